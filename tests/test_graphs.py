"""Lengths on the device and CUDA graphs (issue 17): a CuPy kv_lens is read by the kernels, with
no synchronization and no plan made from its values, out-of-range values clamped on the device;
forward, backward and decode calls captured in a cupy.cuda.Graph replay with the new contents of
their input arrays."""
import numpy as np
import pytest

import cuflash
from cuflash import _gpu, _validate
from helpers import check_backward, check_forward, dtype_of, to_array, to_host

pytestmark = pytest.mark.gpu

# (name, forced path or None, q lead, kv lead, Nq, Nk, D, dtype, options)
CASES = [
    ("decode-gqa", None, (2, 8), (2, 2), 1, 1500, 128, "bfloat16", {}),
    ("decode-split", "split", (2, 4), (2, 4), 3, 900, 64, "float16", dict(causal=True)),
    ("decode-simt-mask", "split-simt", (2, 4), (2, 1), 2, 800, 64, "float32", dict(mask=True)),
    ("mma", "mma", (2, 4), (2, 4), 200, 300, 64, "float16", dict(causal=True)),
    ("wgmma", "wgmma", (2, 4), (2, 2), 256, 384, 128, "bfloat16", {}),
    ("wide", "wide", (2, 2), (2, 2), 150, 260, 64, "float32", dict(window=(40, 10))),
    ("generic", "generic", (2, 2), (2, 2), 70, 90, 40, "float64", {}),
]


def _inputs(case, rng):
    import cupy
    _, _, lq, lkv, Nq, Nk, D, dtype, options = case
    q, k, v, dout = (to_array(cupy, rng.standard_normal(s), dtype_of(dtype))
                     for s in (lq + (Nq, D), lkv + (Nk, D), lkv + (Nk, D), lq + (Nq, D)))
    options = dict(options)
    if options.get("mask"):
        options["mask"] = cupy.asarray(rng.random((Nq, Nk)) < 0.7)
    return q, k, v, dout, options


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_device_kv_lens(case, rng, override):
    """A CuPy kv_lens gives the host kv_lens' result on every path, forward and backward, with
    values outside [0, Nk] clamped (-3 -> 0: empty rows; Nk + 5 -> Nk)."""
    import cupy
    name, force, lq, lkv, Nq, Nk, D, dtype, _ = case
    override(path=force, poison=True)
    q, k, v, dout, options = _inputs(case, rng)
    given = np.array([[-3], [Nk + 5]])  # per batch, one length for its heads
    host = np.clip(given, 0, Nk)
    out, lse = cuflash.attention(q, k, v, kv_lens=cupy.asarray(given), return_lse=True, **options)
    check_forward(out, lse, q, k, v, kv_lens=host, **options)
    ref = cuflash.attention(q, k, v, kv_lens=host, **options)
    if not name.startswith("decode"):  # the same kernels on the same lengths: the same bits
        assert np.array_equal(to_host(out), to_host(ref), equal_nan=True)
    grads = cuflash.attention_backward(dout, q, k, v, out, lse, kv_lens=cupy.asarray(given),
                                       deterministic=True, **options)
    check_backward(grads, dout, q, k, v, out, lse, kv_lens=host, **options)


# the forms a CuPy kv_lens takes on the decode kernels: read in place (C-contiguous int32 or int64,
# any broadcast) or through its clamped int64 copy (any other integer dtype, strided views)
LENS_FORMS = ["int64-per-batch", "int32-per-batch", "int32-per-head", "int16", "strided-view",
              "uint32"]


@pytest.mark.parametrize("force", [None, "split", "split-simt"])
@pytest.mark.parametrize("form", LENS_FORMS)
def test_device_kv_lens_forms(form, force, rng, override):
    """Every form of a CuPy kv_lens gives the host lengths' result on the decode kernels, values
    outside [0, Nk] clamped, on repeated calls with new values in the same array (the plan's
    in-place read must not keep an old address or value)."""
    import cupy
    override(path=force, poison=True)
    B, H, Hkv, Nk, D = 3, 8, 2, 700, 64
    q, k, v = (to_array(cupy, rng.standard_normal(s), dtype_of("float16"))
               for s in ((B, H, 1, D), (B, Hkv, Nk, D), (B, Hkv, Nk, D)))
    for given in (np.array([[-3], [Nk + 5], [250]]), np.array([[Nk], [0], [1]])):
        host = np.clip(given, 0, Nk)
        if form == "int64-per-batch":
            lens = cupy.asarray(given, dtype=np.int64)
        elif form == "int32-per-batch":
            lens = cupy.asarray(given, dtype=np.int32)
        elif form == "int32-per-head":
            host = np.broadcast_to(host, (B, H))
            lens = cupy.asarray(np.broadcast_to(given, (B, H)), dtype=np.int32)
        elif form == "int16":
            lens = cupy.asarray(given, dtype=np.int16)
        elif form == "strided-view":  # every other element of a longer array
            lens = cupy.asarray(np.repeat(given, 2, axis=0), dtype=np.int64)[::2]
        else:  # uint32: the negative length is no longer there (its 2**32 - 3 clamps to Nk)
            given, host = np.abs(given), np.clip(np.abs(given), 0, Nk)
            lens = cupy.asarray(given, dtype=np.uint32)
        assert _validate.reads_in_place(lens) == form.startswith(("int64", "int32"))
        out, lse = cuflash.attention(q, k, v, kv_lens=lens, return_lse=True)
        check_forward(out, lse, q, k, v, kv_lens=host)


# bottom-right windows on the decode kernels, lengths on the device well inside (0, Nk)
WINDOW_CASES = [
    ("decode-tc-window", None, (3, 8), (3, 2), 1, 1500, 128, "bfloat16", dict(window=(700, 0))),
    ("decode-split-window", "split", (3, 4), (3, 4), 3, 900, 64, "float16",
     dict(window=(100, 20))),
    ("decode-simt-causal-window", "split-simt", (3, 4), (3, 1), 2, 800, 64, "float32",
     dict(causal=True, window=(150, None))),
]


@pytest.mark.parametrize("case", WINDOW_CASES, ids=[c[0] for c in WINDOW_CASES])
def test_device_kv_lens_window(case, rng, override):
    """A bottom-right window with a CuPy kv_lens on the decode kernels: the schedule is planned
    without the lengths, yet each row's window ends at its own sequence's length (regression:
    planned at Nk, the rows of a shorter sequence saw only the keys the window holds at Nk)."""
    import cupy
    _, force, _, _, _, Nk, _, _, _ = case
    override(path=force, poison=True)
    q, k, v, _, options = _inputs(case, rng)
    host = np.array([[Nk // 3], [Nk - 200], [Nk]])
    out, lse = cuflash.attention(q, k, v, kv_lens=cupy.asarray(host), return_lse=True, **options)
    check_forward(out, lse, q, k, v, kv_lens=host, **options)


# lengths far below the plan's (a CuPy kv_lens is planned at Nk): each item of a row tile takes
# its share of the tile's shorter extent (decode.cu item_keys), with tiny lengths (fewer keys
# than items), windows of either alignment and several query rows per tile
SHARE_OPTIONS = [{}, dict(window=(300, 0)), dict(causal=True, window=(100, 40)),
                 dict(causal=True, align="top-left"), dict(window=(None, 5), align="top-left")]


@pytest.mark.parametrize("Nq", [1, 3])
@pytest.mark.parametrize("options", SHARE_OPTIONS, ids=lambda o: "-".join(map(str, o.items())))
@pytest.mark.parametrize("force", [None, "split", "split-simt"])
def test_device_kv_lens_share_the_items(force, options, Nq, rng, override):
    """Short CuPy kv_lens on a plan made for Nk (the split kernels rescale each item's keys to
    the valid extent): the reference's result for every length, and the same bits on a repeat."""
    import cupy
    override(path=force, poison=True)
    B, H, Hkv, Nk, D = 7, 8, 2, 3000, 128
    q, k, v = (to_array(cupy, rng.standard_normal(s), dtype_of("bfloat16"))
               for s in ((B, H, Nq, D), (B, Hkv, Nk, D), (B, Hkv, Nk, D)))
    host = np.array([[0], [1], [17], [333], [1500], [2999], [Nk]])
    lens = cupy.asarray(host)
    out, lse = cuflash.attention(q, k, v, kv_lens=lens, return_lse=True, **options)
    check_forward(out, lse, q, k, v, kv_lens=host, **options)
    again = cuflash.attention(q, k, v, kv_lens=lens, **options)
    assert np.array_equal(to_host(out), to_host(again), equal_nan=True)


@pytest.mark.parametrize("window", [None, (600, 0)], ids=["full", "window"])
def test_host_kv_lens_token_loop(window, rng):
    """Host kv_lens new at every call, as in a token loop: growing by one, then past the first
    plan's span (_decode.planned_span: 1020 is planned up to 1088, 1320 up to 1536), shrinking
    inside a span, then per-head lengths that stop being equal inside a GQA group. The decode
    plans serve a span of lengths and the kernels read the true ones: every call must give the
    reference's result."""
    import cupy
    B, H, Hkv, Nk, D = 2, 8, 2, 1500, 128
    q, k, v = (to_array(cupy, rng.standard_normal(s), dtype_of("bfloat16"))
               for s in ((B, H, 1, D), (B, Hkv, Nk, D), (B, Hkv, Nk, D)))
    options = {} if window is None else dict(window=window)
    steps = [np.array([[L], [L + 300]]) for L in list(range(1020, 1027)) + [1160, 1156]]
    per_head = np.full((B, H), 1100)
    steps += [per_head, np.where(np.arange(H) == 1, 1099, per_head)]
    for lens in steps:
        out, lse = cuflash.attention(q, k, v, kv_lens=lens, return_lse=True, **options)
        assert _gpu.forward_path(_validate.make_problem(q, k, v, kv_lens=lens,
                                                        **options)) == "split"
        check_forward(out, lse, q, k, v, kv_lens=lens, **options)


def test_device_kv_lens_checks(rng):
    """What the host can check of a CuPy kv_lens without its values: dtype and shape."""
    import cupy
    q = cupy.zeros((2, 3, 16, 32), np.float32)
    with pytest.raises(TypeError, match="attention: kv_lens must hold integers"):
        cuflash.attention(q, q, q, kv_lens=cupy.ones(2, np.float32))
    with pytest.raises(TypeError, match="attention: kv_lens must hold integers"):
        cuflash.attention(q, q, q, kv_lens=cupy.ones(2, bool))
    with pytest.raises(ValueError, match="attention: kv_lens must broadcast"):
        cuflash.attention(q, q, q, kv_lens=cupy.ones((3, 2), np.int32))


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_graph_replay(case, rng, override):
    """Forward and backward captured in one CUDA graph (after one call of the same layout), then
    replayed after new values were written into q, k, v, dout and the CuPy kv_lens: the outputs
    the captured calls returned hold what eager calls give on the new values, bit for bit (the
    backward deterministic). The graph's temporaries are kept until release_graph_memory."""
    import cupy
    name, force, lq, lkv, Nq, Nk, D, dtype, _ = case
    override(path=force)
    q, k, v, dout, options = _inputs(case, rng)
    lens = cupy.asarray(np.array([[Nk - 7], [Nk // 3]]))

    def calls():
        out, lse = cuflash.attention(q, k, v, kv_lens=lens, return_lse=True, **options)
        return (out, lse) + cuflash.attention_backward(dout, q, k, v, out, lse, kv_lens=lens,
                                                       deterministic=True, **options)

    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        calls()  # builds the layout's device tables, which a capture cannot copy
        stream.synchronize()
        cuflash.release_graph_memory()
        stream.begin_capture()
        try:
            captured = calls()
        finally:
            graph = stream.end_capture()
        for trial in range(2):
            fresh = _inputs(case, rng)
            for x, y in zip((q, k, v, dout), fresh):
                x[...] = y
            lens[...] = cupy.asarray(np.array([[Nk // (2 + trial)], [Nk - trial]]))
            graph.launch(stream)
            want = calls()
            stream.synchronize()
            for got, ref, what in zip(captured, want, ("out", "lse", "dq", "dk", "dv")):
                assert np.array_equal(to_host(got), to_host(ref), equal_nan=True), (trial, what)
        del graph
    assert cuflash.release_graph_memory() > 0


def test_a_graph_keeps_its_host_kv_lens(rng):
    """Regression: a captured decode call with host kv_lens reads the copy of them that its
    plan made in the eager call before; an eager call with other lengths afterwards replaced that
    copy in the plan, which freed it while the graph still read it (every array a captured launch
    reads is now kept until release_graph_memory: _runtime.keep_captured). Replayed after such
    calls and after new arrays took the freed memory, the graph must give its captured lengths'
    result."""
    import cupy
    B, H, Hkv, Nk, D = 2, 8, 2, 1500, 128
    q, k, v = (to_array(cupy, rng.standard_normal(s), dtype_of("bfloat16"))
               for s in ((B, H, 1, D), (B, Hkv, Nk, D), (B, Hkv, Nk, D)))
    lens = np.array([[1000], [1200]])
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        cuflash.attention(q, k, v, kv_lens=lens)  # the plan and its copy of these lengths
        stream.synchronize()
        stream.begin_capture()
        try:
            out, lse = cuflash.attention(q, k, v, kv_lens=lens, return_lse=True)
        finally:
            graph = stream.end_capture()
        for step in (5, 7):  # other lengths (the plan's span serves them)
            cuflash.attention(q, k, v, kv_lens=lens + step)
        fill = [cupy.full(B * H, 3, np.int64) for _ in range(64)]  # (into freed memory)
        out[...] = 0
        graph.launch(stream)
        stream.synchronize()
    check_forward(out, lse, q, k, v, kv_lens=lens)
    del graph, fill
    cuflash.release_graph_memory()


def test_a_graph_replays_beside_eager_calls(rng):
    """Regression (found by reading): the split decode kernels count each row tile's finished
    blocks in zeroed counters that a stream's launches shared, so a graph captured on one stream
    and replayed on another beside that stream's eager calls counted in the same buffer (a tile
    merged before its partials were written). A captured call now has counters of its own: the
    replays and the eager calls, run at once, all give the first call's bits."""
    import cupy
    B, H, Hkv, Nk, D = 1, 32, 8, 16384, 128  # one sequence: every row tile split many ways
    q, k, v = (to_array(cupy, rng.standard_normal(s), dtype_of("bfloat16"))
               for s in ((B, H, 1, D), (B, Hkv, Nk, D), (B, Hkv, Nk, D)))
    first, second = cupy.cuda.Stream(non_blocking=True), cupy.cuda.Stream(non_blocking=True)
    with first:
        want = to_host(cuflash.attention(q, k, v))
        first.synchronize()
        first.begin_capture()
        try:
            captured = cuflash.attention(q, k, v)
        finally:
            graph = first.end_capture()
        eager, replays = [], []
        for _ in range(30):
            graph.launch(second)
            eager.append(cuflash.attention(q, k, v))  # (on the first stream, beside the replay)
            second.synchronize()
            replays.append(to_host(captured))
        first.synchronize()
    for out in replays + [to_host(x) for x in eager]:
        assert np.array_equal(out, want)
    del graph
    cuflash.release_graph_memory()


def test_device_kv_lens_never_synchronize(rng):
    """A decode step with a CuPy kv_lens enqueues work and nothing else (under stream capture any
    synchronizing call or device-to-host copy raises), also for new lengths."""
    import cupy
    q = to_array(cupy, rng.standard_normal((4, 32, 1, 128)), np.float16)
    k, v = (to_array(cupy, rng.standard_normal((4, 8, 4096, 128)), np.float16) for _ in "kv")
    lens = cupy.asarray(np.array([[4000], [17], [0], [4096]]))
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        cuflash.attention(q, k, v, kv_lens=lens)
        stream.synchronize()
        lens += 1  # new values: no new plan
        stream.begin_capture()
        try:
            cuflash.attention(q, k, v, kv_lens=lens)
        finally:
            stream.end_capture()
    cuflash.release_graph_memory()
