"""The CUDA path against the float64 reference: same contract as the CPU path, every dtype.

Marked ``gpu``: skipped on machines without a CUDA device. Every buffer the kernels write is
filled with NaN before the launch (``cuflash._gpu.POISON``), so an element left unwritten fails.
"""
import numpy as np
import pytest

import cuflash
from cuflash import reference
from helpers import (BFLOAT16, FLOORS, assert_close_to_reference, naive_attention,
                     naive_attention_backward, to_host)

pytestmark = pytest.mark.gpu

DTYPES = ["float64", "float32", "float16"] + (["bfloat16"] if BFLOAT16 is not None else [])


@pytest.fixture(autouse=True)
def poisoned(monkeypatch):
    from cuflash import _gpu
    monkeypatch.setattr(_gpu, "POISON", True)


@pytest.fixture(params=["generic", "auto"])
def path(request, monkeypatch):
    """Run the test once on the generic kernels and once on the fastest path that takes it."""
    from cuflash import _gpu
    monkeypatch.setattr(_gpu, "FORCE_PATH", None if request.param == "auto" else request.param)
    return request.param


def _dtype(name):
    return BFLOAT16 if name == "bfloat16" else np.dtype(name)


def to_device(host, dtype):
    """A CuPy array of ``dtype`` holding ``host`` (bfloat16 goes through its bits)."""
    import cupy
    host = np.asarray(host).astype(dtype)
    if dtype == BFLOAT16:
        return cupy.asarray(host.view(np.uint16)).view(dtype)
    return cupy.asarray(host)


def randn(rng, shape, dtype):
    return to_device(rng.standard_normal(shape), _dtype(dtype))


def check(q, k, v, rng, backward=True, deterministic=False, **options):
    """cuflash on CuPy inputs vs the reference, error within 2x a same-dtype naive baseline."""
    import cupy
    dtype = np.dtype(q.dtype)
    low = dtype != np.float64
    floor = FLOORS[dtype.name]
    out, lse = cuflash.attention(q, k, v, return_lse=True, **options)
    assert isinstance(out, cupy.ndarray) and out.dtype == dtype
    assert lse.dtype == (np.float64 if dtype == np.float64 else np.float32)
    qh, kh, vh = (to_host(x) for x in (q, k, v))
    host_options = {name: to_host(x) if hasattr(x, "device") else x for name, x in options.items()}
    ref_out, ref_lse = reference.attention(qh, kh, vh, return_lse=True, **host_options)
    naive = naive_attention(qh, kh, vh, **host_options) if low else (None, None)
    assert_close_to_reference(out, ref_out, naive[0], floor, "out")
    assert_close_to_reference(lse, ref_lse, naive[1], floor, "lse")
    empty = ref_lse == -np.inf
    assert np.all(to_host(out).astype(np.float64)[empty] == 0)
    if not backward:
        return out, lse
    dout = randn(rng, out.shape, dtype.name)
    grads = cuflash.attention_backward(dout, q, k, v, out, lse, deterministic=deterministic,
                                       **options)
    douth, outh, lseh = to_host(dout), to_host(out), to_host(lse)
    ref = reference.attention_backward(douth, qh, kh, vh, outh, lseh, **host_options)
    base = (naive_attention_backward(douth, qh, kh, vh, outh, lseh, **host_options) if low
            else (None,) * 3)
    for name, x, g, r, n in zip(("dq", "dk", "dv"), (q, k, v), grads, ref, base):
        assert isinstance(g, cupy.ndarray) and g.shape == x.shape and g.dtype == dtype, name
        assert_close_to_reference(g, r, n, floor * 4, name)
    return out, lse


# (name, q leading dims, k/v leading dims, Nq, Nk, Dk, Dv, options)
CASES = [
    ("plain-odd", (2, 3), (2, 3), 97, 113, 64, 64, {}),
    ("gqa-causal-br", (1, 4), (1, 2), 7, 300, 32, 48, dict(causal=True)),
    ("nq>nk-causal-br", (2,), (2,), 300, 7, 16, 16, dict(causal=True)),
    ("nq>nk-causal-tl", (2,), (2,), 300, 7, 16, 16, dict(causal=True, align="top-left")),
    ("mqa-decode", (3,), (1,), 1, 1025, 128, 128, {}),
    ("window", (1,), (1,), 200, 200, 96, 96, dict(window=(5, 2))),
    ("window-left-only-causal", (2,), (2,), 130, 260, 64, 64, dict(window=(17, None), causal=True)),
    ("kv_lens", (3, 2), (3, 2), 40, 90, 64, 32, dict(kv_lens=np.array([[0], [17], [90]]), causal=True)),
    ("kv_lens-window", (2, 2), (2, 1), 64, 130, 64, 64, dict(kv_lens=[[100], [3]], window=(9, 4))),
    ("head-dim-256", (1,), (1,), 130, 70, 256, 256, dict(causal=True, align="top-left")),
    ("odd-head-dims", (2,), (2,), 33, 65, 5, 97, {}),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_sweep(case, dtype, rng, path):
    _, lq, lkv, Nq, Nk, Dk, Dv, options = case
    q = randn(rng, lq + (Nq, Dk), dtype)
    k = randn(rng, lkv + (Nk, Dk), dtype)
    v = randn(rng, lkv + (Nk, Dv), dtype)
    check(q, k, v, rng, **options)


# The tensor-core backward has two dK/dV kernels at D=64 and 128 on compute capability 9.0: the
# wgmma one (what "auto" runs there) and the mma.sync one every other device runs (at D=128 the
# warp-grid kernel where shared memory allows). This runs both, both dQ modes.
# (name, q lead, kv lead, Nq, Nk, options)
TC_BWD_CASES = [
    ("odd-causal-tl-gqa", (2, 4), (2, 2), 97, 200, dict(causal=True, align="top-left")),
    ("causal-br-long", (1, 2), (1, 2), 300, 700, dict(causal=True)),
    ("window-kv_lens", (2, 2), (2, 2), 130, 260, dict(window=(40, 3), kv_lens=[[250], [0]])),
    ("mask-bias", (2, 2), (2, 2), 150, 190, "mask-bias"),
]


@pytest.mark.parametrize("dtype", ["float16"] + (["bfloat16"] if BFLOAT16 is not None else []))
@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("kernel", ["wgmma", "mma"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("case", TC_BWD_CASES, ids=[c[0] for c in TC_BWD_CASES])
def test_tensor_core_backward_kernels(case, head_dim, kernel, deterministic, dtype, rng,
                                      monkeypatch):
    import cupy
    from cuflash import _gpu, _tc_bwd, _validate
    if kernel == "wgmma" and not _tc_bwd.wgmma_available():
        pytest.skip("the wgmma kernel: compute capability 9.0 and NVRTC 12.9+ only")
    monkeypatch.setattr(_tc_bwd, "USE_WG", kernel == "wgmma")
    _, lq, lkv, Nq, Nk, options = case
    q = randn(rng, lq + (Nq, head_dim), dtype)
    k, v = (randn(rng, lkv + (Nk, head_dim), dtype) for _ in range(2))
    if options == "mask-bias":
        mask = rng.random(lq + (Nq, Nk)) < 0.7
        mask[0, 1, 5] = False  # an empty row
        options = dict(causal=True, mask=cupy.asarray(mask),
                       bias=cupy.asarray(rng.standard_normal((Nq, Nk)), np.float32))
    p = _validate.make_problem(q, k, v, **options)
    assert _gpu.backward_path(p) == "sm80"
    has_mb = p.mask is not None or p.bias is not None
    assert bool(_tc_bwd.table_tile(head_dim, has_mb).opt & _tc_bwd.OPT_WG) == (kernel == "wgmma")
    check(q, k, v, rng, deterministic=deterministic, **options)


# Few queries against many keys: the split-KV path's territory. (name, q lead, kv lead, Nq, Nk,
# Dk, Dv, options); run with forced small splits (64 keys: many splits, some empty for some rows)
# and with the automatic choice.
DECODE_CASES = [
    ("gqa-1", (2, 8), (2, 2), 1, 1500, 128, 128, {}),
    ("gqa-3-causal-br", (2, 8), (2, 2), 3, 700, 64, 64, dict(causal=True)),
    ("gqa-16-causal-tl", (1, 4), (1, 1), 16, 600, 64, 64, dict(causal=True, align="top-left")),
    ("mqa-window", (3,), (1,), 2, 900, 80, 80, dict(window=(100, 0))),
    ("kv_lens-uneven", (4, 4), (4, 2), 1, 1100, 128, 96,
     dict(kv_lens=[[0], [1], [513], [1100]], causal=True)),
    ("head-dim-256", (2,), (2,), 1, 530, 256, 256, {}),
    # 772 items at the forced split (three waves of blocks on an H200): decode_tc's
    # persistent blocks run several items each, streaming the next item's first keys during the
    # current one's last stage; kv_lens 0 makes empty items in the middle of a block's sequence
    ("many-items-per-block", (4, 16), (4, 4), 1, 8192, 128, 128,
     dict(kv_lens=[[0], [1], [4000], [8192]])),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("force", ["split", "split-simt", "auto"])
@pytest.mark.parametrize("case", DECODE_CASES, ids=[c[0] for c in DECODE_CASES])
def test_decode_sweep(case, force, dtype, rng, monkeypatch):
    """'split': small splits on the automatic kernel (decode_tc for 16-bit, Dk = Dv = 64 / 128,
    decode_split otherwise); 'split-simt': small splits on decode_split everywhere."""
    from cuflash import _gpu, _validate
    monkeypatch.setattr(_gpu, "FORCE_PATH", None if force == "auto" else force)
    _, lq, lkv, Nq, Nk, Dk, Dv, options = case
    q = randn(rng, lq + (Nq, Dk), dtype)
    k = randn(rng, lkv + (Nk, Dk), dtype)
    v = randn(rng, lkv + (Nk, Dv), dtype)
    if force != "auto":
        assert _gpu.forward_path(_validate.make_problem(q, k, v, **options)) == "split"
    check(q, k, v, rng, **options)


# decode_tc's key pools, forced (FORCE_PATH 'split-pool': 512-key splits, half of each split tile's
# keys in its pool, also where the items take more than one wave): the DECODE_CASES decode_tc takes,
# one of 512 items (two waves on an H200: blocks of the second find their tile's pool drained, or
# partly), and a window with kv_lens (rows that see different keys of the pool, an empty tile).
# (Not gqa-16-causal-tl: with top-left causal its 16 rows see at most 16 keys, no split, no pool.)
POOL_CASES = [c for c in DECODE_CASES
              if c[5] == c[6] and c[5] in (64, 128) and c[0] != "gqa-16-causal-tl"] + [
    ("pool-two-waves", (8, 32), (8, 8), 1, 4096, 128, 128, {}),
    ("pool-window-kv_lens", (3, 8), (3, 2), 2, 3000, 128, 128,
     dict(window=(700, 0), kv_lens=[[0], [1500], [3000]])),
]


@pytest.mark.parametrize("dtype", [d for d in DTYPES if d in ("float16", "bfloat16")])
@pytest.mark.parametrize("case", POOL_CASES, ids=[c[0] for c in POOL_CASES])
def test_decode_key_pools(case, dtype, rng, monkeypatch):
    """Blocks claim their tile's pool stages at run time: any dealing must give the reference
    answer, and a second call (the same plan) finds the pool counters reset."""
    from cuflash import _decode, _gpu, _validate
    monkeypatch.setattr(_gpu, "FORCE_PATH", "split-pool")
    _, lq, lkv, Nq, Nk, Dk, Dv, options = case
    q = randn(rng, lq + (Nq, Dk), dtype)
    k = randn(rng, lkv + (Nk, Dk), dtype)
    v = randn(rng, lkv + (Nk, Dv), dtype)
    p = _validate.make_problem(q, k, v, **options)
    assert _gpu.forward_path(p) == "split" and _decode.tc_fits(p)
    split, divisor = _gpu._FORCED_POOL
    sched = _decode.Plan(p, split=split, pool=divisor, force_pool=True).sched
    assert np.any(sched.pools[:, 1] > sched.pools[:, 0])
    for _ in range(2):  # the dealing may differ between the calls; each must meet the reference
        check(q, k, v, rng, backward=False, **options)


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_split_path_takes_whole_vector_rows_only(dtype, rng, monkeypatch):
    """decode.cu's merge reads 4 float columns at a time: the split path must refuse rows that are
    not whole 16-byte vectors (Dv = 33 here), and the generic path answers instead."""
    from cuflash import _gpu, _validate
    monkeypatch.setattr(_gpu, "FORCE_PATH", "split")
    q, k = randn(rng, (2, 4, 2, 40), dtype), randn(rng, (2, 2, 700, 40), dtype)
    v = randn(rng, (2, 2, 700, 33), dtype)
    assert _gpu.forward_path(_validate.make_problem(q, k, v)) == "generic"
    check(q, k, v, rng, backward=False)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"] if BFLOAT16 is not None else ["float32"])
def test_decode_with_mask_and_bias(dtype, rng, monkeypatch):
    import cupy
    from cuflash import _gpu
    monkeypatch.setattr(_gpu, "FORCE_PATH", "split")
    q, k, v = (randn(rng, (2, 4, n, 64), dtype) for n in (2, 800, 800))
    mask = rng.random((4, 2, 800)) < 0.5
    mask[1, 0] = False  # an empty row
    bias = rng.standard_normal((2, 800))
    check(q, k, v, rng, mask=cupy.asarray(mask), bias=cupy.asarray(bias, np.float32))


@pytest.mark.parametrize("dtype", DTYPES)
def test_mask_and_bias_with_empty_rows(dtype, rng, path):
    """A broadcast mask with fully masked rows and columns, plus a broadcast bias."""
    import cupy
    Nq, Nk = 70, 150
    q, k, v = (randn(rng, (2, 3, n, 32), dtype) for n in (Nq, Nk, Nk))
    mask = rng.random((3, Nq, Nk)) < 0.3
    mask[:, 5] = False          # empty rows
    mask[:, :, 64:128] = False  # an empty key tile in the middle of every row
    bias = rng.standard_normal((Nq, 1)) * 3 + rng.standard_normal((1, Nk))
    out, lse = check(q, k, v, rng, mask=cupy.asarray(mask), bias=cupy.asarray(bias, np.float32))
    assert bool((lse[:, :, 5] == -np.inf).all())


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"] if BFLOAT16 is not None else ["float32"])
def test_strided_and_reversed_inputs(dtype, rng, path):
    """(B, N, H, D) arrays passed as swapaxes(1, 2), and keys read backwards: no copy needed."""
    B, N, H, D = 2, 77, 4, 64
    qkv = randn(rng, (B, N, 3, H, D), dtype)
    q, k, v = (qkv[:, :, i].swapaxes(1, 2) for i in range(3))
    k = k[:, :, ::-1]
    check(q, k, v, rng, causal=True)


@pytest.mark.parametrize("dtype", DTYPES)
def test_empty_sizes(dtype, rng):
    q = randn(rng, (2, 5, 16), dtype)
    k = randn(rng, (2, 0, 16), dtype)
    out, lse = cuflash.attention(q, k, k, return_lse=True)
    assert out.shape == (2, 5, 16) and bool((out == 0).all()) and bool((lse == -np.inf).all())
    dq, dk, dv = cuflash.attention_backward(out, q, k, k, out, lse)
    assert dq.shape == q.shape and bool((dq == 0).all()) and dk.shape == k.shape
    out = cuflash.attention(q[:0], k[:0], k[:0])
    assert out.shape == (0, 5, 16)
    out = cuflash.attention(q[:, :0], q, q)
    assert out.shape == (2, 0, 16)


def test_mixed_libraries_are_a_type_error(rng):
    q = randn(rng, (4, 16), "float32")
    with pytest.raises(TypeError, match="k is a numpy.ndarray"):
        cuflash.attention(q, to_host(q), q)
    with pytest.raises(TypeError, match="mask is a numpy.ndarray"):
        cuflash.attention(q, q, q, mask=np.ones((4, 4), bool))


def test_merge_and_vjp_on_device(rng):
    """merge of two key halves equals attention over all keys; vjp matches attention_backward."""
    q, k, v = (randn(rng, (2, 33, 32), "float32") for _ in range(3))
    out_a, lse_a = cuflash.attention(q, k[:, :20], v[:, :20], return_lse=True)
    out_b, lse_b = cuflash.attention(q, k[:, 20:], v[:, 20:], return_lse=True)
    out, lse = cuflash.merge(out_a, lse_a, out_b, lse_b)
    ref_out, ref_lse = reference.attention(*(to_host(x) for x in (q, k, v)), return_lse=True)
    assert np.abs(to_host(out) - ref_out).max() < 1e-5
    assert np.abs(to_host(lse) - ref_lse).max() < 1e-5
    out, vjp = cuflash.attention_vjp(q, k, v, causal=True)
    dout = randn(rng, out.shape, "float32")
    for g, h in zip(vjp(dout), cuflash.attention_backward(dout, q, k, v, *cuflash.attention(
            q, k, v, causal=True, return_lse=True), causal=True)):
        assert np.array_equal(to_host(g), to_host(h))


@pytest.mark.parametrize("causal", [False, True])
def test_long_sequence_in_bounded_memory(causal, rng, path):
    """N = 32k, one head: the N x N float32 scores (4 GiB) would not fit the 1 GiB this test allows."""
    import cupy
    N, D = 32768, 64
    pool = cupy.get_default_memory_pool()
    pool.free_all_blocks()
    pool.set_limit(size=1 << 30)
    try:
        q, k, v = (randn(rng, (1, N, D), "float16") for _ in range(3))
        out, lse = cuflash.attention(q, k, v, causal=causal, return_lse=True)
        cupy.cuda.get_current_stream().synchronize()
    finally:
        pool.set_limit(size=0)
    qh, kh, vh = (to_host(x) for x in (q, k, v))
    for start in (0, N // 2 - 64, N - 256):  # three blocks of rows against the reference
        stop = start + 256
        keys = stop if causal else N  # causal rows [start, stop) see keys < stop, bottom-right
        ref_out, ref_lse = reference.attention(qh[:, start:stop], kh[:, :keys], vh[:, :keys],
                                               causal=causal, return_lse=True)
        naive_out, naive_lse = naive_attention(qh[:, start:stop], kh[:, :keys], vh[:, :keys],
                                               causal=causal)
        assert_close_to_reference(out[:, start:stop], ref_out, naive_out, FLOORS["float16"])
        assert_close_to_reference(lse[:, start:stop], ref_lse, naive_lse, FLOORS["float16"])


def test_fast_path_is_chosen_where_it_applies(rng):
    """The 'auto' runs above test the tensor-core path only if dispatch really picks it."""
    from cuflash import _gpu, _validate
    q, k, v = (randn(rng, (2, 4, 256, 128), "bfloat16") for _ in range(3))
    assert _gpu.forward_path(_validate.make_problem(q, k, v, causal=True)) == "sm80"
    q32 = randn(rng, (2, 4, 256, 128), "float32")
    assert _gpu.forward_path(_validate.make_problem(q32, q32, q32)) == "generic"
    assert _gpu.forward_path(_validate.make_problem(q[..., :80], k[..., :80], v[..., :80])) == "generic"


def test_kv_lens_as_device_array(rng):
    """kv_lens may live on the device too (validation copies it to the host to check it)."""
    import cupy
    q, k, v = (randn(rng, (3, 20, 32), "float32") for _ in range(3))
    lens = [0, 5, 20]
    a = cuflash.attention(q, k, v, kv_lens=cupy.asarray(lens), causal=True)
    b = cuflash.attention(q, k, v, kv_lens=lens, causal=True)
    assert np.array_equal(to_host(a), to_host(b))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"] if BFLOAT16 is not None else ["float16"])
def test_deterministic_backward_is_bitwise_reproducible(dtype, rng):
    """deterministic=True: two runs give identical bits (the tensor-core dq otherwise uses atomics)."""
    from cuflash import _gpu, _validate
    q = randn(rng, (2, 8, 300, 128), dtype)
    k, v = (randn(rng, (2, 2, 300, 128), dtype) for _ in range(2))
    assert _gpu.backward_path(_validate.make_problem(q, k, v, causal=True)) == "sm80"
    out, lse = cuflash.attention(q, k, v, causal=True, return_lse=True)
    dout = randn(rng, out.shape, dtype)
    first = cuflash.attention_backward(dout, q, k, v, out, lse, causal=True, deterministic=True)
    second = cuflash.attention_backward(dout, q, k, v, out, lse, causal=True, deterministic=True)
    for a, b in zip(first, second):
        assert np.array_equal(to_host(a).view(np.uint16), to_host(b).view(np.uint16))
    check(q, k, v, rng, causal=True)
