"""The CUDA host path on a machine without a GPU, through tests/fake_cupy.py (a recording stand-in
for CuPy, in a subprocess so that it never meets the real CuPy of this process).

Each case (the dense grid's small and mid calls, decode, masks, bias, dropout, softcap, float32,
float64, D = 96) is called three times on fresh arrays:

* no call reads a device value on the host (the stand-in raises on int(), bool(), .get());
* every kernel parameter that is an address names an allocation of its own call (an input, an
  output, a workspace), a cached device copy of a host table or a kept zeroed buffer, never an
  earlier call's buffer or a foreign address;
* the second and third calls launch the same kernels with the same parameters, up to the new
  arrays' addresses: where a per-layout cache kept an earlier call's address, the third call would
  name an "old" allocation where the second names a "new" one (the first call may build cached
  tables, which later calls name as "old").
"""
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

FAKE = Path(__file__).resolve().parent / "fake_cupy.py"

# bwd_mma_prep's parameters (lost_rows.cu): q, k, v, dout, out, lse, the four ATTN_INPUTS,
# AttnArgs, lost, stats, flags, lse2, delta, Nq_pad, then these
PREP_DQ, PREP_SRC, PREP_SETTLE = 17, 19, 21  # dq_zero (dq_turns next); dout_src, dout_rows; settle


def _trace(tmp_path, *cases):
    out = tmp_path / "trace.json"
    run = subprocess.run([sys.executable, str(FAKE), "trace", str(out), *cases],
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout + run.stderr
    return json.loads(out.read_text())


def _addresses(x):
    if isinstance(x, list) and len(x) == 2 and x[0] == "ptr":
        yield x[1]
    elif isinstance(x, list):
        for y in x:
            yield from _addresses(y)


@pytest.fixture(scope="module")
def trace(tmp_path_factory):
    return _trace(tmp_path_factory.mktemp("trace"))


def test_every_case_traced(trace):
    names = {key.rsplit("/", 1)[0] for key in trace}
    assert {"small/fwd", "small/bwd", "mid/fwd", "mid/bwd", "decode/fwd", "dropout/bwd",
            "mask/bwd", "fp64/bwd", "bnhd/bwd"} <= names
    for name in names:
        launches = [e for e in trace[name + "/0"] if e[0] in ("launch", "rawkernel")]
        assert launches, name


def test_addresses_name_allocations(trace):
    """Every address names an allocation: the call's own, or a cached table or zeroed buffer
    (decode's self-resetting counters), never an earlier call's buffer."""
    for key, events in trace.items():
        for where in _addresses(events):
            assert where is not None and where[0] in ("new", "table"), (key, where, events)


def test_repeated_calls_launch_alike(trace):
    def alike(name, events):  # a token loop ("grow") passes its new lengths every step: in
        # the decode kernels' last parameter (by value), or uploaded
        if "grow" not in name:
            return events
        return [e[:3] if e[0] == "upload" else
                e[:5] + [e[5][:-1]] if e[0] == "launch" and "decode" in e[1] else e
                for e in events]
    for key in trace:
        name, n = key.rsplit("/", 1)
        if n == "2":
            assert alike(name, trace[key]) == alike(name, trace[name + "/1"]), key
            # the first call runs the same kernels in the same order (it may also upload the
            # tables that later calls find cached)
            def kernels(events):
                return [e[:2] for e in events if e[0] != "upload"]
            assert kernels(trace[name + "/0"]) == kernels(trace[key]), key


def test_a_token_loop_passes_its_lengths_by_value(trace):
    """A token loop's new host lengths (a few values: Problem.lens_values) go to the decode kernel
    in its last parameter (HostLens): no upload per step, and the parameter holds the step's
    lengths (4 sequences in the trace's shrunk case, each call's on from the last's)."""
    steps = [trace[f"decode-grow/fwd/{n}"] for n in (1, 2)]
    for events in steps:
        assert not [e for e in events if e[0] == "upload"], events
    lengths = [[e for e in events if e[0] == "launch" and "decode" in e[1]][-1][5][-1]
               for events in steps]
    first, second = (np.array(x[:4]) for x in lengths)
    step = second - first
    assert np.all(first > 0) and step[0] > 0 and np.all(step == step[0]), lengths
    assert not any(lengths[0][4:]) and not any(lengths[1][4:]), lengths  # (unused: 0)


def test_the_forward_is_one_launch(trace):
    """A known shape of the trace: the dense bf16 forward on the tensor cores, mma.sync or Hopper,
    is its kernel alone, which settles its lost rows itself (fwd_mma.cu, fwd_wgmma.cu; lost_rows.cuh
    fwd_fix_rows), writing the out and lse the call returns."""
    for call, kernel in (("small/fwd/1", "fwd_mma<bf16_t, 64,"),
                         ("mid/fwd/1", "fwd_wgmma<bf16_t, 128,"),
                         ("window-gqa/fwd/1", "fwd_wgmma<bf16_t, 128,")):
        events = trace[call]
        assert [e[0] for e in events] == ["launch"], call
        assert events[0][1].startswith(kernel), (call, events[0][1])


def test_the_backward_rounds_dq_in_its_last_kernel(trace):
    """A known shape of the trace: the dense bf16 backward on the tensor cores is three launches
    and nothing else (no memset, no CuPy cast): prep zeroes dq's float32 sums (and settles the
    lost rows into them: no bwd_lost_rows), bwd_mma_dkdv adds into them, and bwd_lost_keys, last,
    rounds them into the dq it returns."""
    events = trace["small/bwd/1"]
    assert [e[0] for e in events] == ["launch"] * 3
    prep, dkdv, keys = events
    assert [e[1].split("<")[0] for e in events] == ["bwd_mma_prep", "bwd_mma_dkdv",
                                                    "bwd_lost_keys"]
    dq32 = prep[5][PREP_DQ]
    assert prep[5][PREP_SETTLE] == [1]
    assert dkdv[5][6] == dq32 and keys[5][16] == dq32  # dkdv's dq; lost_keys' (..., dq, dq_out)
    assert keys[5][17] not in (dq32, ["ptr", None])


def test_the_prep_takes_every_padded_row(trace):
    """A known shape of the trace: bwd_mma_prep is a block of 128 threads (4 lanes a row) per 32
    padded query rows of each (batch, head), Nq padded to a multiple of 128 (_mma_bwd.LSE_PAD) and
    of the dK/dV tile's query step (D = 128's 80 on the H200: 640, _mma_bwd.nq_padded), its
    lost-row columns per lane by the head dim (2 at D = 64: fewer registers, more blocks per SM)."""
    for call, bh, nq_pad, cols in (("small/bwd/1", 8, 128, 2), ("mid/bwd/1", 64, 640, 4)):
        prep = trace[call][0]
        assert prep[1].startswith(f"bwd_mma_prep<bf16_t, {cols}"), (call, prep[1])
        assert prep[2:4] == [[bh * nq_pad // 32, 1, 1], [128, 1, 1]], (call, prep[2:4])


def test_the_deterministic_backward_adds_dq_in_order(trace):
    """A known shape of the trace: the deterministic bf16 backward on Hopper's bulk-dQ tiles
    (GQA causal, 132 multiprocessors) is the default's three launches, not five: bwd_mma_dkdv
    with OPT_DQ_ORDER (and OPT_GROUP) adds dQ in its fixed order, no dq kernel recomputes it;
    prep zeroes dq's sums and the rows' turns (two parts of the stream's scratch), which dkdv
    takes."""
    from cuflash import _mma_bwd
    events = trace["deterministic/bwd/1"]
    assert [e[1].split("<")[0] for e in events] == ["bwd_mma_prep", "bwd_mma_dkdv",
                                                    "bwd_lost_keys"]
    prep, dkdv = events[:2]
    opt = int(dkdv[1].rsplit(",", 1)[1].strip(" >"))
    assert opt & _mma_bwd.OPT_DQ_ORDER and opt & _mma_bwd.OPT_GROUP, dkdv[1]
    dq32, turns = prep[5][PREP_DQ], prep[5][PREP_DQ + 1]  # (..., dq_zero, dq_turns, ...)
    assert turns[1][0] == "table" and turns != dq32, (turns, dq32)
    assert dkdv[5][6] == dq32 and dkdv[5][-2] == turns  # (..., dbias, turns, group)


def test_a_bnhd_backward_copies_nothing(trace):
    """A known shape of the trace: with q, k, v and dout as (B, H, N, D) views of (B, N, H, D)
    buffers, the backward is the same three launches and nothing else: prep reads dout in place
    through its offset table and writes the (BH, Nq, Dv) rows the other kernels read (no CuPy
    copy before it), and the gradients are written in q's, k's and v's layouts (no transpose
    after)."""
    from cuflash import _mma_bwd

    def opt(launch):  # a bwd_mma_dkdv launch's OPT
        return int(launch[1].rsplit(",", 1)[1].strip(" >"))

    for call in ("bnhd/bwd/1", "bnhd/bwd/2"):
        events = trace[call]
        assert [e[0] for e in events] == ["launch"] * 3, call
        prep, dkdv = events[:2]
        assert prep[1].startswith("bwd_mma_prep<")
        # (q, k, v, dout, ..., dout_src, dout_rows): dout a new buffer, dout_src the caller's
        # (also new: an input of this call), dout_rows a cached table; dkdv reads prep's dout
        dout, src, rows = prep[5][3], prep[5][PREP_SRC], prep[5][PREP_SRC + 1]
        assert dout[1][0] == "new" and src[1][0] == "new" and dout != src, call
        assert rows[1][0] == "table" and dkdv[5][3] == dout, call
        # the gradients in the inputs' layouts: dkdv with OPT_LIKE (its last template
        # argument), bwd_lost_keys' `like` (its parameter 19: ..., group, like, dbias)
        keys = events[2]
        assert opt(dkdv) & _mma_bwd.OPT_LIKE, dkdv[1]
        assert keys[1].startswith("bwd_lost_keys<") and keys[5][19] == [1]
    mid = trace["mid/bwd/1"]  # the same shape stored (B, H, N, D): no copy, no table
    assert mid[0][5][3] == mid[0][5][PREP_SRC] == mid[0][5][PREP_SRC + 1], mid[0]
    assert not opt(mid[1]) & _mma_bwd.OPT_LIKE and mid[2][5][19] == [0]


def test_device_lengths_are_read_in_place(trace):
    """A known shape of the trace: decode with a CuPy kv_lens (int64, C-contiguous) is the decode
    kernel alone, which reads the caller's array in place through the plan's map (no clamped
    copy, no elementwise kernel)."""
    for call in ("decode-device/fwd/1", "decode-device/fwd/2"):
        events = trace[call]
        assert [e[0] for e in events] == ["launch"], call
        params = events[0][5]
        assert events[0][1].startswith("decode_tc<")
        # (q, k, v, out, lse, ws_out, ws_ml, counters, offsets, lens, kv_lens, lens_map,
        # lens_bytes, ...): the plan's tables, then this call's kv_lens, then the map
        assert params[9][1][0] == "table" and params[11][1][0] == "table", call
        assert params[10][1][0] == "new" and params[12] == [8], call


_REPEAT = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
import numpy as np
import fake_cupy
cupy = fake_cupy.install()
import cuflash
from cuflash import _decode
q, k, v = fake_cupy._inputs(cupy, 4, 8, 2, 1, 4096, 128)
lens = np.array([[1000], [3000], [17], [4000]])
seen = []
for step in range(3):
    cuflash.attention(q, k, v, kv_lens=lens)
    plan = next(iter(_decode._exact.values()))
    seen.append([plan.span is None, plan.sched.lens.tolist()])
cuflash.attention(q, k, v, kv_lens=lens + 1)
seen.append(len(_decode._exact))
print(json.dumps(seen))
"""


def test_decode_plans_repeated_lengths_exactly():
    """Host kv_lens: the first call of new lengths runs its bucket's plan (a token loop never
    re-plans per token); the same lengths again get a plan of their own, kept for the next calls
    (a repeated call loses nothing to the bucket), and new lengths go back to a bucket's plan."""
    run = subprocess.run([sys.executable, "-c", _REPEAT, str(FAKE.parent)], capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    first, second, third, n_exact = json.loads(run.stdout)
    heads = [1000] * 8 + [3000] * 8 + [17] * 8 + [4000] * 8
    assert not first[0] and first[1] != heads  # the bucket's tops
    assert second == [True, heads] and third == second
    assert n_exact == 2


_KEPT = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
import fake_cupy
cupy = fake_cupy.install()
fake_cupy._fake_tma()
import cuflash
from cuflash import _gpu

chosen = []
choose = _gpu._choose
def counted(paths, takes, p):
    chosen.append(takes)
    return choose(paths, takes, p)
_gpu._choose = counted
from cuflash import _validate
validated = []  # the calls that took the whole way (validation), not the kept run at once
problem = _validate.problem
def counted_problem(*args):
    validated.append(args[0])
    return problem(*args)
_validate.problem = counted_problem
seen = {}
for name, (B, H, Hkv, Nq, Nk, D) in {"mma": (1, 8, 8, 128, 128, 64),
                                     "wgmma": (2, 8, 8, 512, 512, 128),
                                     "decode": (1, 32, 8, 1, 4096, 128)}.items():
    q, k, v = fake_cupy._inputs(cupy, B, H, Hkv, Nq, Nk, D)
    counts, full = [], []
    for _ in range(3):  # fresh arrays each call: the kept path serves the layout, not the arrays
        q, k, v = (cupy.empty(x.shape, x.dtype) for x in (q, k, v))
        cuflash.attention(q, k, v, causal=Nq > 1)
        counts.append(len(chosen))
        full.append(len(validated))
    big = cupy.empty((q.size + 8,), q.dtype)  # q 16 bytes off its usual alignment: chosen anew
    cuflash.attention(big[8:].reshape(q.shape), k, v, causal=Nq > 1)
    counts.append(len(chosen))
    full.append(len(validated))
    with _gpu.override(path="generic"):  # the tests' switch: chosen anew
        cuflash.attention(q, k, v, causal=Nq > 1)
    counts.append(len(chosen))
    full.append(len(validated))
    cuflash.attention(q, k, v, causal=Nq > 1, softcap=30.0)  # another signature
    counts.append(len(chosen))
    full.append(len(validated))
    cuflash.attention(q, k, v, causal=Nq > 1, softcap=30.0)  # the same again: the short way
    counts.append(len(chosen))
    full.append(len(validated))
    seen[name] = [counts[i] - counts[i - 1] for i in range(1, len(counts))]
    seen[name + "/validated"] = [full[i] - full[i - 1] for i in range(1, len(full))]
    chosen.clear()
import numpy as np
for name, (B, H, Hkv, Nq, Nk, D) in {"decode-lens": (4, 32, 8, 1, 4096, 128),
                                     "mma-lens": (2, 8, 8, 128, 128, 64)}.items():
    q, k, v = fake_cupy._inputs(cupy, B, H, Hkv, Nq, Nk, D)
    counts = []
    validated.clear()
    full = []
    for _ in range(3):  # a new CuPy kv_lens each call
        cuflash.attention(q, k, v, causal=Nq > 1, kv_lens=cupy.empty((B, 1), np.int64))
        counts.append(len(chosen))
        full.append(len(validated))
    seen[name] = [counts[0]] + [counts[i] - counts[i - 1] for i in range(1, len(counts))]
    seen[name + "/validated"] = [full[0]] + [full[i] - full[i - 1] for i in range(1, 3)]
    chosen.clear()
q, k, v = fake_cupy._inputs(cupy, 4, 32, 8, 1, 4096, 128)  # host kv_lens growing per call
counts, full = [], []
validated.clear()
for step in range(4):
    cuflash.attention(q, k, v, kv_lens=np.array([[400], [3000], [17], [4000]]) + step)
    counts.append(len(chosen))
    full.append(len(validated))
seen["host-lens"] = [counts[0]] + [counts[i] - counts[i - 1] for i in range(1, 4)]
seen["host-lens/validated"] = [full[0]] + [full[i] - full[i - 1] for i in range(1, 4)]
chosen.clear()
q = cupy.empty((4, 32, 1, 128), k.dtype)  # a paged cache: CuPy table and kv_lens, new per call
pools = [cupy.empty((64, 8, 64, 128), k.dtype) for _ in range(2)]
counts, full = [], []
validated.clear()
for _ in range(3):
    cuflash.attention(q, *pools, kv_lens=cupy.empty((4,), np.int64),
                      block_table=cupy.empty((4, 16), np.int32))
    counts.append(len(chosen))
    full.append(len(validated))
seen["paged"] = [counts[0]] + [counts[i] - counts[i - 1] for i in range(1, 3)]
seen["paged/validated"] = [full[0]] + [full[i] - full[i - 1] for i in range(1, 3)]
chosen.clear()
q, k, v = fake_cupy._inputs(cupy, 1, 8, 8, 128, 128, 64)
out, lse = cuflash.attention(q, k, v, causal=True, return_lse=True)
chosen.clear()
validated.clear()
steps = []
for deterministic in (False, True, False, True):
    cuflash.attention_backward(out, q, k, v, out, lse, causal=True, deterministic=deterministic)
    steps.append(len(validated))
seen["backward"] = [x == "takes_backward" for x in chosen]
seen["backward/validated"] = [steps[0]] + [steps[i] - steps[i - 1] for i in range(1, 4)]
print(json.dumps(seen))
"""


def test_a_plain_signature_keeps_its_path():
    """A repeated call of a plain signature (no mask, bias, lengths, sinks, dropout: only q, k,
    v change), or of one plain but for a CuPy kv_lens and block_table, runs the path its first
    call chose
    (cuflash._gpu.Repeat) without choosing again, on fresh arrays too, as does a decode call with
    new host kv_lens (a token loop: its layout's run); new alignments, the tests' switches and
    new signatures choose anew.
    (That the kept runs launch what the full path launches: test_repeated_calls_launch_alike.)"""
    run = subprocess.run([sys.executable, "-c", _KEPT, str(FAKE.parent)], capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    seen = json.loads(run.stdout)
    assert seen.pop("backward") == [True, True]  # chosen once per `deterministic`
    assert seen.pop("backward/validated") == [1, 0, 0, 0]  # once per signature
    for name in ("decode-lens", "mma-lens", "paged"):  # lengths (and table) on the device:
        # repeatable too
        assert seen.pop(name) == [1, 0, 0], name
        assert seen.pop(name + "/validated") == [1, 0, 0], name
    # host kv_lens new at every call (a token loop): their values checked, the path kept for
    # the layout (the first length, 17, would not choose the split path by its own extent)
    assert seen.pop("host-lens") == [1, 0, 0, 0]
    assert seen.pop("host-lens/validated") == [1, 0, 0, 0]
    for name in ("mma", "wgmma", "decode"):
        # a plain repeated call is the signature's Problem with its arrays at once
        # (_validate.repeated_problem), no validation, new alignments and switches too (they
        # choose the path anew, above); a new signature takes the whole way
        assert seen.pop(name + "/validated") == [0, 0, 0, 0, 1, 0], name
    for name, steps in seen.items():
        assert steps == [0, 0, 1, 1, 1, 0], name


def test_the_plain_call_checks_every_option():
    """attention() and attention_backward() take a call the short way (the signature's Problem
    with the call's arrays, _validate.repeated_problem) only when every option but the ones in
    its key is off: each of the others is tested (a new option must join the test, or a call
    with it would run as the plain one)."""
    import inspect

    from cuflash import api

    keyed = {"scale", "causal", "align", "precision", "dropout_p", "kv_lens", "block_table",
             "softcap"}
    for fn, arrays, flags in ((api.attention, {"q", "k", "v"}, {"return_lse"}),
                              (api.attention_backward, {"dout", "q", "k", "v", "out", "lse"},
                               {"deterministic"})):
        source = inspect.getsource(fn)
        params = set(inspect.signature(fn).parameters) - arrays - flags
        assert keyed - {"block_table"} <= params and set(api.OPTIONS) <= params
        for name in sorted(params - keyed):
            off = "return_dbias is False" if name == "return_dbias" else f"{name} is None"
            assert off in source, (fn.__name__, name)



_FRESH = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
import fake_cupy
cupy = fake_cupy.install()
fake_cupy._fake_tma()
import cuflash
from cuflash import _tma, _wgmma_fwd
layouts, encoded = [], []
make = _wgmma_fwd._maps_layout
_wgmma_fwd._maps_layout = lambda p, dims: layouts.append(1) or make(p, dims)
at = _tma.TiledMap.at
_tma.TiledMap.at = lambda self, ptr: encoded.append(ptr) or at(self, ptr)
q, k, v = fake_cupy._inputs(cupy, 2, 8, 8, 512, 512, 128)
steps = []
for _ in range(4):  # new arrays of one layout each call, as a training loop makes
    q, k, v = (cupy.empty(x.shape, x.dtype) for x in (q, k, v))
    cuflash.attention(q, k, v, causal=True)
    steps.append([len(layouts), len(encoded)])
print(json.dumps(steps))
"""


def test_new_arrays_of_a_known_layout_only_encode_their_maps():
    """The Hopper forward's tensor maps for new arrays of a known layout: the layout (which maps,
    their dims, strides, boxes, the staging rule) is made once; each call encodes its three maps
    at its arrays' addresses (the first call also tries each map once while making the layout)."""
    run = subprocess.run([sys.executable, "-c", _FRESH, str(FAKE.parent)], capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    steps = json.loads(run.stdout)
    assert [s[0] for s in steps] == [1, 1, 1, 1]
    assert [b[1] - a[1] for a, b in zip(steps, steps[1:])] == [3, 3, 3]


_CAPTURED = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
import numpy as np
import fake_cupy
cupy = fake_cupy.install()
import cuflash
from cuflash import _decode, _runtime
few = sys.argv[2] == "few"  # a caller's few lengths go by value; more than LENS_VALUES_MAX: a copy
B = 2 if few else 9
q, k, v = fake_cupy._inputs(cupy, B, 8, 2, 1, 2048, 128)
lens = (np.array([[1000], [1500]]) if few else
        1000 + np.arange(B * 8).reshape(B, 8) // 4 * 50)  # (groups of 4 heads: one length)
cuflash.attention(q, k, v, kv_lens=lens)  # the layout's tables (and the lengths' upload)
fake_cupy._State.capturing = True  # (a host-to-device copy now raises, as CuPy's)
cuflash.attention(q, k, v, kv_lens=lens)
if few:  # by value: new lengths need no copy either
    cuflash.attention(q, k, v, kv_lens=lens + 1)
fake_cupy._State.capturing = False
plan = next(iter(_decode._last.values()))
table = [m for m in _runtime._graph_memory if m is plan.items]  # (the plan's, kept)
if few:
    ok = plan.by_value and plan.last_lens is None and table
else:
    copy = plan.last_lens[1]  # what the captured call read
    cuflash.attention(q, k, v, kv_lens=lens + 1)  # new lengths: the plan's copy replaced
    kept = [m for m in _runtime._graph_memory if m is copy]  # (kept for the graph)
    ok = not plan.by_value and plan.last_lens[1] is not copy and kept and table
print(json.dumps("ok" if ok else "the captured call's lengths or plan not kept"))
"""


@pytest.mark.parametrize("lengths", ["few", "many"])
def test_a_repeated_call_under_capture_uploads_nothing(lengths):
    """Regression (found on the GPU, tests/test_gpu.py test_calls_never_synchronize): host
    kv_lens seen a second time get an exact decode plan, whose new table was uploaded during
    CUDA graph capture (CuPy refuses a host-to-device copy there). Under capture the span's
    plan, whose table exists, serves them ("few" lengths: by value in the launch, which new
    lengths under capture may take too; "many": reading the copy of these lengths its eager call
    made, which like the plan's tables is kept for the graph's replays (release_graph_memory),
    also once new lengths replace it in the plan)."""
    run = subprocess.run([sys.executable, "-c", _CAPTURED, str(FAKE.parent), lengths],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert json.loads(run.stdout) == "ok"

_COUNTERS = r"""
import json, sys, threading
sys.path.insert(0, sys.argv[1])
import numpy as np
import fake_cupy
cupy = fake_cupy.install()
import cuflash
from cuflash import _decode, _runtime
q, k, v = fake_cupy._inputs(cupy, 2, 8, 2, 1, 8192, 128)  # split: merge counters
made, got = _decode._counter_buffer, []
def spy(n):  # the counters buffer each decode launch gets
    got.append(made(n))
    return got[-1]
_decode._counter_buffer = spy
def counters():
    return got[-1]
cuflash.attention(q, k, v)
first = counters()
cuflash.attention(q, k, v)
shared = counters() is first  # one stream: one buffer
fake_cupy._State.capturing = True
cuflash.attention(q, k, v)
captured = counters()
cuflash.attention(q, k, v)
own = captured is not first and counters() is not captured  # a buffer per captured call
kept = any(m is captured for m in _runtime._graph_memory)
fake_cupy._State.capturing = False
# two threads on one stream: a buffer each (their calls' launches interleave)
seen, lock = [], threading.Lock()
both = threading.Barrier(2)  # (both threads alive: their idents differ)
def call():
    with lock:
        cuflash.attention(q, k, v)
        seen.append(counters())
    both.wait()
threads = [threading.Thread(target=call) for _ in range(2)]
for t in threads:
    t.start()
for t in threads:
    t.join()
scratches = {key[2] for key in _runtime._stream_scratch}  # (the split workspace's, by thread)
per_thread = seen[0] is not seen[1] and seen[0] is not first and len(scratches) == 3
# a stream per call: the buffers kept per stream stay few
for ptr in range(0x9000, 0x9000 + 40):
    fake_cupy._STREAM.ptr = ptr
    cuflash.attention(q, k, v)
bounded = len(_runtime._stream_scratch) <= 16 and len(_decode._counters) <= 16
print(json.dumps([shared, own, kept, per_thread, bounded]))
"""


def test_launches_that_may_run_at_once_share_no_buffers():
    """The split decode kernels count finished blocks per row tile in a zeroed buffer that
    launches in order on one stream share: a CUDA graph captured with it could replay beside
    that stream's calls (or beside another graph) and count in the same counters. A captured
    call takes its own buffer, kept for the graph. Two threads' calls on one stream interleave
    their launches: each thread has its own buffers (counters and stream scratch). A caller that
    makes a stream per call does not make the kept buffers grow without bound."""
    run = subprocess.run([sys.executable, "-c", _COUNTERS, str(FAKE.parent)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert json.loads(run.stdout) == [True, True, True, True, True]


_TOKEN_LOOP = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
import numpy as np
import fake_cupy
cupy = fake_cupy.install()
import cuflash
from cuflash import _decode
q, k, v = fake_cupy._inputs(cupy, 4, 8, 2, 1, 4096, 128)
start = np.array([[1000], [3000], [17], [3900]])
plans, inside = [], []
for step in range(100):
    lens = start + step
    cuflash.attention(q, k, v, kv_lens=lens)
    plan = next(iter(_decode._last.values()))
    if not plans or plans[-1][1] is not plan:
        plans.append((step, plan))
    lo, hi = plan.span
    bh = np.repeat(lens[:, 0], 8)
    inside.append(bool(np.all((lo <= bh) & (bh <= hi))))
print(json.dumps([[s for s, _ in plans], inside, len(_decode._plans)]))
"""


def test_a_token_loop_keeps_its_plan_while_it_covers_the_lengths():
    """Host kv_lens growing by one per step: a step takes its layout's last plan while that plan's
    span holds every length (no span arithmetic per token), a new span's plan when one leaves
    it (_decode.planned_span: 1000 + 89 passes 1088, its span's top; each length has room for
    64 steps or more), and every step's plan spans its lengths."""
    run = subprocess.run([sys.executable, "-c", _TOKEN_LOOP, str(FAKE.parent)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    changes, inside, n_plans = json.loads(run.stdout)
    assert changes == [0, 89] and all(inside) and n_plans == 2

_COVERS = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
import numpy as np
import fake_cupy
cupy = fake_cupy.install()
import cuflash
from cuflash import _decode, _validate
rng = np.random.default_rng(3)
# k and v shared by the 4 sequences: sequences of one length share a group (group_heads), so a
# plan's groups span several of the caller's elements
q, k, v = fake_cupy._inputs(cupy, 4, 8, 2, 1, 4096, 128)
k, v = k[:1], v[:1]
results, pairs = [], []
for start in ([[1000], [1000], [3000], [3000]], [[500], [2500], [2500], [40]]):
    lens = np.array(start)
    p0 = _validate.make_problem(q, k, v, kv_lens=lens)
    span = _decode.planned_span(p0.kv_lens.reshape(-1), 4096)  # (a token loop's plan)
    plan = _decode.Plan(p0, span=span)
    for _ in range(300):
        new = lens + rng.integers(-150, 150, size=lens.shape)
        if rng.random() < 0.5:  # equal neighbours, as the plan's groups need
            new[1] = new[0]
        new = np.clip(new, 0, 4096)
        p = _validate.make_problem(q, k, v, kv_lens=new)
        assert p.lens_elems is p0.lens_elems and p.lens_values == tuple(new.ravel().tolist())
        flat = p.kv_lens.reshape(-1)
        fast = plan.covers(flat, p.lens_values, p.lens_elems)
        results.append([fast, plan.covers(flat)])
    pairs.append(len(plan.by_element[2]))
print(json.dumps([results, pairs]))
"""


def test_a_plan_covers_the_callers_few_lengths_as_its_own():
    """Plan.covers on the caller's few kv_lens values (Python ints, Problem.lens_values) answers
    as on the (batch, head) lengths: each length within its span, and the members of each group
    (here groups of two sequences that share k, v and a length) still of one length."""
    run = subprocess.run([sys.executable, "-c", _COVERS, str(FAKE.parent)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    results, pairs = json.loads(run.stdout)
    assert all(fast == slow for fast, slow in results)
    assert any(fast for fast, _ in results) and not all(fast for fast, _ in results)
    assert min(pairs) > 0  # (groups span elements: the equality rule is exercised)
