"""The NumPy path (cuflash.attention on NumPy arrays) against the dense reference, over a broad sweep.

Most tests shrink the key tile (``cuflash._numpy.BLOCK_N``) and the query block
(``cuflash._numpy.BLOCK_M``) so that small problems still cross many tiles, including empty ones in
the middle of a row, and blocks whose rows see different key ranges.
"""
import tracemalloc

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import cuflash
from cuflash import _numpy as cpu_path
from cuflash import reference
from helpers import (BFLOAT16, FLOORS, SEED_COUNTEREXAMPLES, assert_close_to_reference,
                     check_seed_counterexample, naive_attention, naive_attention_backward,
                     rand_inputs)

DTYPES = [np.float64, np.float32, np.float16] + ([BFLOAT16] if BFLOAT16 is not None else [])


@pytest.fixture
def block(monkeypatch, request):
    """Set the CPU path's key tile for one test (default: a small 16) and its query block (7
    rows: blocks and tiles do not line up, and a block straddles the causal diagonal)."""
    size = getattr(request, "param", 16)
    monkeypatch.setattr(cpu_path, "BLOCK_N", size)
    monkeypatch.setattr(cpu_path, "BLOCK_M", 7)
    return size


def check(q, k, v, rng, backward=True, **options):
    """cuflash.attention (and its backward) on NumPy inputs vs the reference; returns (out, lse)."""
    dtype = np.dtype(q.dtype)
    acc = np.float64 if dtype == np.float64 else np.float32
    floor = FLOORS[dtype.name]
    low = dtype != np.float64  # float64 has no coarser baseline: the floor is the tolerance
    out, lse = cuflash.attention(q, k, v, return_lse=True, **options)
    ref_out, ref_lse = reference.attention(q, k, v, return_lse=True, **options)
    naive_out, naive_lse = naive_attention(q, k, v, **options) if low else (None, None)
    assert isinstance(out, np.ndarray) and out.dtype == dtype and lse.dtype == acc
    assert out.shape == ref_out.shape and lse.shape == ref_lse.shape
    assert_close_to_reference(out, ref_out, naive_out, floor, "out")
    assert_close_to_reference(lse, ref_lse, naive_lse, floor, "lse")
    empty = ref_lse == -np.inf
    assert np.all(out.astype(np.float64)[empty] == 0) and np.all(lse[empty] == -np.inf)
    if backward:
        dout = rand_inputs(rng, [out.shape], dtype)[0]
        grads = cuflash.attention_backward(dout, q, k, v, out, lse, **options)
        ref = reference.attention_backward(dout, q, k, v, out, lse, **options)
        naive = (naive_attention_backward(dout, q, k, v, out, lse, **options) if low
                 else (None,) * 3)
        for name, x, g, r, n in zip(("dq", "dk", "dv"), (q, k, v), grads, ref, naive):
            assert g.shape == x.shape and g.dtype == dtype, name
            assert_close_to_reference(g, r, n, floor * 4, name)
    return out, lse


def qkv(rng, lead_q, lead_kv, Nq, Nk, Dk=16, Dv=None, dtype=np.float64):
    Dv = Dk if Dv is None else Dv
    return rand_inputs(rng, [lead_q + (Nq, Dk), lead_kv + (Nk, Dk), lead_kv + (Nk, Dv)], dtype)


LENGTHS = [(1, 1), (7, 7), (97, 113), (113, 97), (300, 300), (1, 300), (300, 1), (7, 0),
           (0, 7), (1, 0)]
CAUSAL = [dict(), dict(causal=True), dict(causal=True, align="top-left")]


@pytest.mark.parametrize("block", [128, 32], indirect=True)
@pytest.mark.parametrize("options", CAUSAL, ids=str)
@pytest.mark.parametrize("Nq, Nk", LENGTHS)
def test_lengths(rng, block, options, Nq, Nk):
    q, k, v = qkv(rng, (2, 3), (2, 3), Nq, Nk)
    check(q, k, v, rng, **options)


WINDOWS = [(3, 0), (0, 3), (None, 2), (5, None), (0, 0), (2, 2), (40, 7), (None, None)]


@pytest.mark.parametrize("window", WINDOWS, ids=str)
@pytest.mark.parametrize("options", CAUSAL, ids=str)
@pytest.mark.parametrize("Nq, Nk", [(97, 113), (113, 97)])
def test_windows(rng, block, window, options, Nq, Nk):
    q, k, v = qkv(rng, (2,), (2,), Nq, Nk, Dk=8)
    check(q, k, v, rng, window=window, **options)


MASK_SHAPES = ["QK", "1QK", "H1K", "B11K", "BHQK", "Q1", "1K"]


def _shape(code, B, H, Nq, Nk):
    sizes = {"B": B, "H": H, "Q": Nq, "K": Nk, "1": 1}
    return tuple(sizes[c] for c in code)


@pytest.mark.parametrize("options", [dict(), dict(causal=True, window=(20, None))], ids=str)
@pytest.mark.parametrize("shape", MASK_SHAPES)
def test_mask_broadcast(rng, block, shape, options):
    B, H, Nq, Nk = 2, 3, 37, 97
    q, k, v = qkv(rng, (B, H), (B, H), Nq, Nk, Dk=8)
    mask = rng.random(_shape(shape, B, H, Nq, Nk)) < 0.5
    if mask.shape[-2] > 1:
        mask[..., ::5, :] = False  # whole rows masked out
    if mask.shape[-1] > 1:
        mask[..., 32:80] = False   # whole key tiles masked out
    check(q, k, v, rng, mask=mask, **options)


@pytest.mark.parametrize("bias_dtype", [np.float64, np.float32, np.float16])
@pytest.mark.parametrize("shape", ["QK", "H1K", "B1Q1", "BHQK"])
def test_bias(rng, block, shape, bias_dtype):
    B, H, Nq, Nk = 2, 3, 29, 71
    q, k, v = qkv(rng, (B, H), (B, H), Nq, Nk, Dk=8)
    bias = 3 * rng.standard_normal(_shape(shape, B, H, Nq, Nk))
    bias[rng.random(bias.shape) < 0.3] = -np.inf  # -inf hides a key, possibly a whole row
    check(q, k, v, rng, bias=bias.astype(bias_dtype), causal=True)


KV_LENS = [5, 0, [[0], [13]], [[3, 97, 0], [50, 7, 1]], [[96], [2]]]


@pytest.mark.parametrize("kv_lens", KV_LENS, ids=str)
@pytest.mark.parametrize("options", CAUSAL + [dict(window=(4, 1), align="top-left")], ids=str)
@pytest.mark.parametrize("Nq", [7, 113])
def test_kv_lens(rng, block, kv_lens, options, Nq):
    q, k, v = qkv(rng, (2, 3), (2, 3), Nq, 97, Dk=8)
    check(q, k, v, rng, kv_lens=np.array(kv_lens), **options)


# (q leading shape, k/v leading shape): GQA, MQA, broadcast batch, missing axes
HEADS = [((2, 4), (2, 2)), ((2, 4), (2, 1)), ((2, 4), (1, 1)), ((2, 4), (4,)), ((2, 4), ()),
         ((), (3,)), ((5, 1, 2), (3, 1)), ((1, 6), (2, 3)), ((2, 1), (2, 3))]


@pytest.mark.parametrize("options", [dict(), dict(causal=True, kv_lens=[[20], [9]])], ids=str)
@pytest.mark.parametrize("lead_q, lead_kv", HEADS, ids=str)
def test_heads_and_broadcasting(rng, block, lead_q, lead_kv, options):
    q, k, v = qkv(rng, lead_q, lead_kv, 19, 23, Dk=8, Dv=5)
    lead = reference.attention(q, k, v).shape[:-2]
    if "kv_lens" in options and lead[-2:-1] != (2,):
        options = dict(options, kv_lens=9)  # the per-batch lengths need a batch axis of 2
    check(q, k, v, rng, **options)


@pytest.mark.parametrize("Dk, Dv", [(1, 1), (5, 11), (64, 32), (3, 256), (256, 7)])
def test_head_dims(rng, block, Dk, Dv):
    q, k, v = qkv(rng, (2,), (2,), 33, 41, Dk=Dk, Dv=Dv)
    check(q, k, v, rng, causal=True)


def _strided(rng, kind, dtype=np.float64):
    """(q, k, v) with awkward memory layouts, all with leading shape (2, 3)."""
    B, H, Nq, Nk, D = 2, 3, 21, 45, 8
    if kind == "swapaxes":  # (B, N, H, D) storage read as (B, H, N, D)
        q, k, v = rand_inputs(rng, [(B, Nq, H, D), (B, Nk, H, D), (B, Nk, H, D)], dtype)
        return q.swapaxes(1, 2), k.swapaxes(1, 2), v.swapaxes(1, 2)
    q, k, v = qkv(rng, (B, H), (B, H), Nq, Nk, Dk=D, dtype=dtype)
    if kind == "negative":
        return q[::-1, :, ::-1], k[:, ::-1, ::-1], v[::-1, ::-1, ::-1]
    if kind == "inner-strided":  # innermost axis not contiguous: the one case that copies
        q2, k2, v2 = qkv(rng, (B, H), (B, H), Nq, Nk, Dk=2 * D, dtype=dtype)
        return q2[..., ::2], k2[..., 1::2], v2[..., ::2]
    if kind == "broadcast-view":  # stride 0 on the batch axis
        return q, np.broadcast_to(k[:1], k.shape), np.broadcast_to(v[:1], v.shape)
    if kind == "fortran":
        return np.asfortranarray(q), np.asfortranarray(k), v
    if kind == "sliced":
        return q[:, :, 1::2], k[:, :, ::3], v[:, :, ::3]
    raise ValueError(kind)


@pytest.mark.parametrize("kind", ["swapaxes", "negative", "inner-strided", "broadcast-view",
                                  "fortran", "sliced"])
def test_strided_inputs(rng, block, kind):
    q, k, v = _strided(rng, kind)
    mask = rng.random((q.shape[-2], k.shape[-2])) < 0.8
    check(q, k, v, rng, causal=True, mask=mask)


def test_no_copy_of_strided_qkv(rng):
    """Only an innermost axis that is not contiguous is copied: the maps read the user's memory."""
    q, k, v = _strided(rng, "swapaxes")
    problem = cuflash._validate.make_problem(q, k, v)
    assert problem.q is q and problem.k is k and problem.v is v


def test_empty_rows_and_tiles(rng, block):
    """Rows with no visible key give exactly 0 / -inf and zero gradients; keys nobody sees get
    zero dk and dv; tiles nobody sees in the middle of a row leave the state untouched."""
    B, H, Nq, Nk = 2, 2, 40, 100
    q, k, v = qkv(rng, (B, H), (B, H), Nq, Nk, Dk=8)
    mask = np.ones((Nq, Nk), dtype=bool)
    mask[:, 20:70] = False          # three whole tiles of 16 keys in the middle
    mask[5] = False                 # an empty row
    mask[7, 20:] = False            # a row whose keys all sit in the first tiles
    kv_lens = np.array([[Nk, 0], [15, 60]])  # a sequence with no keys at all
    options = dict(mask=mask, kv_lens=kv_lens, causal=True, align="top-left")
    out, lse = check(q, k, v, rng, **options)
    _, ref_lse = reference.attention(q, k, v, return_lse=True, **options)
    assert np.all(out[:, :, 5] == 0) and np.all(lse[:, :, 5] == -np.inf)
    assert np.all(out[0, 1] == 0) and np.all(lse[0, 1] == -np.inf)
    assert np.array_equal(lse == -np.inf, ref_lse == -np.inf)
    dout = rng.standard_normal(out.shape)
    dq, dk, dv = cuflash.attention_backward(dout, q, k, v, out, lse, **options)
    assert np.all(dq[:, :, 5] == 0) and np.all(dq[0, 1] == 0)
    assert np.all(dk[..., 20:70, :] == 0) and np.all(dv[..., 20:70, :] == 0)
    assert np.all(dk[0, 1] == 0) and np.all(dv[1, 0, 15:] == 0)
    for x in (out, lse, dq, dk, dv):
        assert not np.isnan(x).any()


def test_no_warnings_on_empty_rows(rng, block, recwarn):
    q, k, v = qkv(rng, (2,), (2,), 50, 30, Dk=4)
    out, lse = cuflash.attention(q, k, v, causal=True, kv_lens=np.array([0, 30]), return_lse=True)
    cuflash.attention_backward(np.ones_like(out), q, k, v, out, lse, causal=True,
                               kv_lens=np.array([0, 30]))
    assert not [w for w in recwarn if issubclass(w.category, RuntimeWarning)]


DTYPE_OPTIONS = [
    dict(),
    dict(causal=True, window=(30, None)),
    dict(mask="rand", bias="rand", kv_lens=[[90], [31]], causal=True, align="top-left"),
]


@pytest.mark.parametrize("options", DTYPE_OPTIONS, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("block", [16, 128], indirect=True)
def test_dtypes(rng, block, dtype, options):
    Nq, Nk = 97, 113
    q, k, v = qkv(rng, (2, 4), (2, 2), Nq, Nk, Dk=32, Dv=24, dtype=dtype)
    options = dict(options)
    if options.get("mask") == "rand":
        options["mask"] = rng.random((4, Nq, Nk)) < 0.7
    if options.get("bias") == "rand":
        options["bias"] = rng.standard_normal((Nq, Nk)).astype(np.float32)
    check(q, k, v, rng, **options)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_dtypes_strided(rng, block, dtype):
    q, k, v = _strided(rng, "negative", dtype)
    check(q, k, v, rng, causal=True)


@pytest.mark.parametrize("lead_q, lead_kv, Nq, Nk", [
    ((0, 3), (0, 3), 5, 7), ((2, 0), (2, 1), 5, 7), ((2, 3), (2, 3), 0, 7),
    ((2, 3), (2, 3), 0, 0), ((4,), (1,), 3, 0), ((2, 3), (1, 3), 0, 4)])
def test_zero_sized(rng, lead_q, lead_kv, Nq, Nk):
    q, k, v = qkv(rng, lead_q, lead_kv, Nq, Nk, Dk=4, Dv=3, dtype=np.float32)
    out, lse = cuflash.attention(q, k, v, return_lse=True, causal=True)
    lead = np.broadcast_shapes(lead_q, lead_kv)
    assert out.shape == lead + (Nq, 3) and out.dtype == np.float32 and np.all(out == 0)
    assert lse.shape == lead + (Nq,) and lse.dtype == np.float32 and np.all(lse == -np.inf)
    dq, dk, dv = cuflash.attention_backward(np.ones_like(out), q, k, v, out, lse, causal=True)
    for g, x in ((dq, q), (dk, k), (dv, v)):
        assert g.shape == x.shape and g.dtype == x.dtype and np.all(g == 0)
    # The tiled functions themselves cope with empty problems too (the API short-cuts them).
    problem = cuflash._validate.make_problem(q, k, v, causal=True)
    out, lse = cpu_path.forward(problem)
    assert out.size == problem.BH * Nq * 3 and np.all(out == 0) and np.all(lse == -np.inf)


@pytest.mark.parametrize("block", [2], indirect=True)
def test_worked_example_of_the_seed(block):
    """Step 6 of the seed, tile size 2: row 0 is [2.479, 3.493] / 2.986 = [0.830, 1.170]."""
    q = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [0.0, 0.0]])
    k = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0], [0.0, 1.0]])
    v = np.array([[1.0, 1.0], [2.0, 0.0], [0.0, 2.0], [1.0, 1.0]])
    out = cuflash.attention(q, k, v)
    np.testing.assert_allclose(out[0], [0.830, 1.170], atol=5e-4)
    np.testing.assert_allclose(out, reference.attention(q, k, v), rtol=1e-14, atol=1e-15)


@pytest.mark.parametrize("block", [1], indirect=True)
@pytest.mark.parametrize("values, want", SEED_COUNTEREXAMPLES)
def test_counterexamples_of_the_seed(block, values, want):
    """One key per tile: the online softmax must rescale both l and acc (answers 3/4 and 1/4)."""
    check_seed_counterexample(cuflash.attention, values, want)


def test_memory_is_linear_in_keys(rng):
    """The score matrix (Nq, Nk) is never materialized: peak extra memory stays far below it."""
    Nq = Nk = 2048
    q, k, v = qkv(rng, (), (), Nq, Nk, Dk=16, dtype=np.float32)
    scores_bytes = Nq * Nk * 4
    tracemalloc.start()
    try:
        cuflash.attention(q, k, v, causal=True)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < scores_bytes / 2, f"peak {peak} bytes vs a {scores_bytes}-byte score matrix"


POSITIONS = [
    dict(causal=True, positions=(30, 0), align="top-left"),
    # a window side wider than Nq + Nk that positions move past the keys still bounds (bug: the
    # side was clamped to "unbounded" before the shift, and every key became visible)
    dict(window=(95, None), positions=(200, 0), align="top-left"),
    dict(window=(None, 95), positions=(0, 200), align="top-left"),
    dict(causal=True, positions=(0, 30)),                      # rows before every key: empty
    dict(window=(6, 3), positions=(100, 90), kv_lens=[[50], [9]]),
    dict(causal=True, window=(None, 4), positions=(5, 5), align="top-left"),
]


@pytest.mark.parametrize("options", POSITIONS, ids=str)
def test_positions(rng, block, options):
    q, k, v = qkv(rng, (2, 2), (2, 1), 40, 50, Dk=8)
    check(q, k, v, rng, **options)


@pytest.mark.parametrize("options", [dict(causal=True), dict(window=(9, 2)),
                                     dict(causal=True, window=(12, None))], ids=str)
def test_blocks_of_one_sequence_merge_to_the_whole(rng, block, options):
    """Attention of a block of queries over blocks of keys, each placed by ``positions`` and
    merged, is attention over the whole sequence (what a ring of devices computes)."""
    N, cut_q, cuts_k = 60, (23, 41), (0, 17, 30, 52, 60)
    q, k, v = qkv(rng, (2,), (2,), N, N, Dk=8)
    whole, whole_lse = cuflash.attention(q, k, v, return_lse=True, align="top-left", **options)
    a, b = cut_q
    out = lse = None
    for j0, j1 in zip(cuts_k[:-1], cuts_k[1:]):
        part = cuflash.attention(q[:, a:b], k[:, j0:j1], v[:, j0:j1], return_lse=True,
                                 align="top-left", positions=(a, j0), **options)
        out, lse = part if out is None else cuflash.merge(out, lse, *part)
    np.testing.assert_allclose(out, whole[:, a:b], rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse, whole_lse[:, a:b], rtol=1e-12, atol=1e-12)


def test_reference_positions_are_a_mask(rng):
    """The reference's positions against the same visibility written as a boolean mask."""
    q, k, v = qkv(rng, (2,), (2,), 20, 30, Dk=4)
    i, j = np.arange(20)[:, None] + 40, np.arange(30)[None, :] + 35
    mask = (j <= i) & (j >= i - 7)
    got = reference.attention(q, k, v, causal=True, window=(7, None), positions=(40, 35),
                              align="top-left")
    np.testing.assert_allclose(got, reference.attention(q, k, v, mask=mask), rtol=1e-14)


@pytest.mark.parametrize("options, most", [
    (dict(causal=True), 0.56),                     # half the square, plus the diagonal blocks
    (dict(window=(100, 100)), 0.4),                # a band of 201 keys: 5 or 6 tiles of 64
    (dict(causal=True, kv_lens=[300, 1024]), 0.56),
])
def test_hidden_tiles_are_skipped(rng, monkeypatch, options, most):
    """Blocks of rows compute scores only for the key tiles their rows see by position: causal
    does about half the work of the full square (the point of tiling on the CPU too)."""
    monkeypatch.setattr(cpu_path, "BLOCK_N", 64)
    monkeypatch.setattr(cpu_path, "BLOCK_M", 64)
    computed = []
    scores = cpu_path._Tiles.scores

    def counting(self, hs, rs, j0, j1, whole):
        s, hidden = scores(self, hs, rs, j0, j1, whole)
        computed.append(s.size)
        return s, hidden

    monkeypatch.setattr(cpu_path._Tiles, "scores", counting)
    Nq = Nk = 1024
    q, k, v = qkv(rng, (2,), (2,), Nq, Nk, Dk=8, dtype=np.float32)
    check(q, k, v, rng, backward=False, **options)
    assert 0 < sum(computed) <= most * 2 * Nq * Nk


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_fuzz_against_reference(data):
    draw = data.draw
    seed = draw(st.integers(0, 2**32 - 1), label="seed")
    rng = np.random.default_rng(seed)
    Nq, Nk = draw(st.integers(0, 40), label="Nq"), draw(st.integers(0, 40), label="Nk")
    H, g = draw(st.sampled_from([1, 2, 4]), label="H"), draw(st.sampled_from([1, 2]), label="g")
    Hkv = max(H // g, 1)
    B = draw(st.integers(1, 2), label="B")
    dtype = draw(st.sampled_from([np.float64, np.float32]), label="dtype")
    q, k, v = qkv(rng, (B, H), (B, Hkv), Nq, Nk, Dk=draw(st.integers(1, 9)),
                  Dv=draw(st.integers(1, 9)), dtype=dtype)
    side = st.one_of(st.none(), st.integers(0, 45))
    options = dict(causal=draw(st.booleans(), label="causal"),
                   align=draw(st.sampled_from(["bottom-right", "top-left"]), label="align"),
                   window=draw(st.one_of(st.none(), st.tuples(side, side)), label="window"),
                   positions=draw(st.one_of(st.none(), st.tuples(st.integers(0, 50),
                                                                 st.integers(0, 50))),
                                  label="positions"))
    if draw(st.booleans(), label="mask"):
        options["mask"] = rng.random((B, H, Nq, Nk)) < 0.7
    if draw(st.booleans(), label="bias"):
        options["bias"] = rng.standard_normal((Nq, Nk))
    if draw(st.booleans(), label="kv_lens"):
        options["kv_lens"] = rng.integers(0, Nk + 1, size=(B, 1))
    saved = cpu_path.BLOCK_N, cpu_path.BLOCK_M, cpu_path.TILE
    cpu_path.BLOCK_N = draw(st.sampled_from([1, 3, 8, 128]), label="BLOCK_N")
    cpu_path.BLOCK_M = draw(st.sampled_from([None, 1, 5, 16]), label="BLOCK_M")
    cpu_path.TILE = draw(st.sampled_from([1, 64, 1 << 18]), label="TILE")  # heads per step
    try:
        check(q, k, v, rng, **options)
    finally:
        cpu_path.BLOCK_N, cpu_path.BLOCK_M, cpu_path.TILE = saved
