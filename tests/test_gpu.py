"""The CUDA path against the float64 reference: same contract as the CPU path, every dtype.

Marked ``gpu``: skipped on machines without a CUDA device. Every buffer the kernels write is
filled with NaN before the launch (``cuflash._gpu.override(poison=True)``), so an element left
unwritten fails.
"""
import numpy as np
import pytest

import cuflash
from cuflash import reference
from helpers import (BFLOAT16, DTYPE_NAMES, FLOORS, assert_close_to_reference, check_backward,
                     check_forward, dtype_of, naive_attention, to_array, to_host)

pytestmark = pytest.mark.gpu

DTYPES = DTYPE_NAMES


@pytest.fixture(autouse=True)
def poisoned(override):
    override(poison=True)


@pytest.fixture(params=["generic", "mma", "auto"])
def path(request, override):
    """Run the test on the generic kernels, on the sm_80 tensor-core forward (where it takes the
    case; on an H200 "auto" takes the Hopper forward there) and on the fastest path that takes it."""
    override(path=None if request.param == "auto" else request.param)
    return request.param


def to_device(host, dtype):
    """A CuPy array of ``dtype`` holding ``host`` (bfloat16 goes through its bits)."""
    import cupy
    return to_array(cupy, host, dtype)


def randn(rng, shape, dtype):
    return to_device(rng.standard_normal(shape), dtype_of(dtype))


def check(q, k, v, rng, backward=True, deterministic=False, **options):
    """cuflash on CuPy inputs vs the reference, error within 2x a same-dtype naive baseline."""
    import cupy
    dtype = np.dtype(q.dtype)
    out, lse = cuflash.attention(q, k, v, return_lse=True, **options)
    assert isinstance(out, cupy.ndarray) and out.dtype == dtype
    assert lse.dtype == (np.float64 if dtype == np.float64 else np.float32)
    ref_lse = check_forward(out, lse, q, k, v, **options)
    empty = ref_lse == -np.inf
    assert np.all(to_host(out).astype(np.float64)[empty] == 0)
    if not backward:
        return out, lse
    dout = randn(rng, out.shape, dtype.name)
    grads = cuflash.attention_backward(dout, q, k, v, out, lse, deterministic=deterministic,
                                       **options)
    for name, x, g in zip(("dq", "dk", "dv"), (q, k, v), grads):
        assert isinstance(g, cupy.ndarray) and g.shape == x.shape and g.dtype == dtype, name
    check_backward(grads, dout, q, k, v, out, lse, **options)
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
    # positions: the aligned position moves by q_start - k_start, so the bounds the kernels get
    # may be negative (rows that see nothing) or past the keys (rows that see everything)
    ("positions-ahead-causal", (2,), (2,), 100, 150, 64, 64,
     dict(causal=True, align="top-left", positions=(300, 200))),
    ("positions-behind-causal", (1, 2), (1, 2), 130, 150, 64, 64,
     dict(causal=True, positions=(0, 60))),
    ("positions-window-kv_lens", (2, 2), (2, 1), 120, 130, 128, 128,
     dict(window=(20, 5), positions=(1000, 990), kv_lens=[[130], [77]], align="top-left")),
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
# warp-grid kernel where shared memory allows). This runs both, both dQ modes, and Dk >= 192 (every
# device: the mma.sync kernel with dK / dV / dQ columns in two halves, _mma_bwd.OPT_HALVES; Dk != Dv
# in (192, 128)).
# (name, q lead, kv lead, Nq, Nk, options)
TC_BWD_CASES = [
    ("odd-causal-tl-gqa", (2, 4), (2, 2), 97, 200, dict(causal=True, align="top-left")),
    ("causal-br-long", (1, 2), (1, 2), 300, 700, dict(causal=True)),
    ("window-kv_lens", (2, 2), (2, 2), 130, 260, dict(window=(40, 3), kv_lens=[[250], [0]])),
    ("mask-bias", (2, 2), (2, 2), 150, 190, "mask-bias"),
    ("positions-behind", (1, 2), (1, 2), 130, 200, dict(causal=True, align="top-left",
                                                        positions=(0, 40))),
]


@pytest.mark.parametrize("dtype", ["float16"] + (["bfloat16"] if BFLOAT16 is not None else []))
@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("dims, kernel", [((64, 64), "wgmma"), ((64, 64), "mma"),
                                         ((128, 128), "wgmma"), ((128, 128), "mma"),
                                         ((192, 128), "mma"), ((192, 192), "mma"),
                                         ((256, 256), "mma")],
                         ids=lambda x: f"{x[0]}x{x[1]}" if isinstance(x, tuple) else x)
@pytest.mark.parametrize("case", TC_BWD_CASES, ids=[c[0] for c in TC_BWD_CASES])
def test_tensor_core_backward_kernels(case, dims, kernel, deterministic, dtype, rng, override):
    import cupy
    from cuflash import _gpu, _mma_bwd, _runtime, _validate
    if kernel == "wgmma" and not _runtime.wgmma_available():
        pytest.skip("the wgmma kernel: compute capability 9.0 and NVRTC 12.9+ only")
    override(wgmma=kernel == "wgmma")
    _, lq, lkv, Nq, Nk, options = case
    q = randn(rng, lq + (Nq, dims[0]), dtype)
    k, v = randn(rng, lkv + (Nk, dims[0]), dtype), randn(rng, lkv + (Nk, dims[1]), dtype)
    if options == "mask-bias":
        mask = rng.random(lq + (Nq, Nk)) < 0.7
        mask[0, 1, 5] = False  # an empty row
        options = dict(causal=True, mask=cupy.asarray(mask),
                       bias=cupy.asarray(rng.standard_normal((Nq, Nk)), np.float32))
    p = _validate.make_problem(q, k, v, **options)
    assert _gpu.backward_path(p) == "mma"
    has_mb = p.mask is not None or p.bias is not None
    tile = _mma_bwd.dkdv_tile(dims, has_mb)
    assert bool(tile.opt & _mma_bwd.OPT_WG) == (kernel == "wgmma")
    assert bool(tile.opt & _mma_bwd.OPT_HALVES) == (dims[0] >= 192)
    check(q, k, v, rng, deterministic=deterministic, **options)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("Nq, Nk", [(79, 200), (80, 80), (81, 333), (161, 130), (641, 700)])
def test_eighty_query_steps_at_d128(Nq, Nk, causal, rng, override):
    """D=128's plain wgmma backward steps 80 queries at a time with dQ made transposed
    (_mma_bwd.OPT_DQ_T; lse2 / delta padded to 640 rows): query counts around multiples of 80,
    one tile, several, a partial last one, against the float64 reference."""
    from cuflash import _mma_bwd, _runtime
    if not _runtime.wgmma_available():
        pytest.skip("the wgmma kernel: compute capability 9.0 and NVRTC 12.9+ only")
    override(wgmma=True)
    tile = _mma_bwd.dkdv_tile((128, 128), False, dq_atomic=True)
    assert tile.block_m == 80 and tile.opt & _mma_bwd.OPT_DQ_T
    dtype = "bfloat16" if BFLOAT16 is not None else "float16"
    q = randn(rng, (2, 3, Nq, 128), dtype)
    k, v = (randn(rng, (2, 3, Nk, 128), dtype) for _ in range(2))
    check(q, k, v, rng, causal=causal)


@pytest.mark.parametrize("dims", [(64, 64), (128, 128)], ids=lambda d: f"{d[0]}x{d[1]}")
@pytest.mark.parametrize("layout", ["rows", "misaligned", "keys-strided"])
def test_staged_bias_layouts(layout, dims, rng, override):
    """The wgmma backward stages each query tile's bias block in shared memory: 16-byte copies
    where the rows are whole and aligned ("rows": Nk = 260, a multiple of 4; its last key tile is
    partial and takes 4-byte copies, as do the rows past Nq = 100), 4-byte copies for a head base
    off 16 bytes ("misaligned": a view one float in) and for a key stride of 2 ("keys-strided")."""
    import cupy
    from cuflash import _mma_bwd, _runtime
    if not _runtime.wgmma_available():
        pytest.skip("the wgmma kernel: compute capability 9.0 and NVRTC 12.9+ only")
    override(wgmma=True)
    Nq, Nk, dtype = 100, 260, "bfloat16" if BFLOAT16 is not None else "float16"
    q = randn(rng, (2, 2, Nq, dims[0]), dtype)
    k, v = (randn(rng, (2, 2, Nk, d), dtype) for d in dims)
    full = cupy.asarray(rng.standard_normal((2, Nq, 2 * Nk + 4)), np.float32)  # rows of 4k floats
    bias = {"rows": cupy.ascontiguousarray(full[:, :, :Nk]), "misaligned": full[:, :, 1:Nk + 1],
            "keys-strided": full[:, :, :2 * Nk:2]}[layout]
    tile = _mma_bwd.dkdv_tile(dims, True, True, bias=True)
    assert tile.opt & _mma_bwd.OPT_SBIAS
    check(q, k, v, rng, bias=bias, causal=True)


@pytest.mark.parametrize("dims", [(64, 64), (128, 128)], ids=lambda d: f"{d[0]}x{d[1]}")
@pytest.mark.parametrize("group", [2, 4, 8])
@pytest.mark.parametrize("options", [{}, dict(causal=True), dict(window=(40, 7))],
                         ids=["full", "causal", "window"])
@pytest.mark.parametrize("deterministic", [False, True])
def test_gqa_summed_in_the_kernel(options, group, dims, deterministic, rng, override):
    """GQA on the wgmma backward: each dK/dV block runs its kv head's `group` query heads one
    after the other and stores dK, dV once per kv head (OPT_GROUP; no float32 buffers, no sum
    pass). Lengths off the tiles, 2 batches (bh // group is the kv head)."""
    from cuflash import _mma_bwd, _runtime, _validate
    if not _runtime.wgmma_available():
        pytest.skip("the wgmma kernel: compute capability 9.0 and NVRTC 12.9+ only")
    override(wgmma=True)
    Nq, Nk, hkv = 150, 200, 2
    dtype = "bfloat16" if BFLOAT16 is not None else "float16"
    q = randn(rng, (2, hkv * group, Nq, dims[0]), dtype)
    k, v = (randn(rng, (2, hkv, Nk, d), dtype) for d in dims)
    p = _validate.make_problem(q, k, v, **options)
    assert _mma_bwd.group_size(p) == group
    check(q, k, v, rng, deterministic=deterministic, **options)


@pytest.mark.parametrize("dims", [(64, 64), (128, 128)], ids=lambda d: f"{d[0]}x{d[1]}")
def test_gqa_in_the_kernel_with_lost_rows(dims, rng, override):
    """Rows whose |lse| is beyond the lost-row limit (logits near 5000) in some query heads of a
    GQA group: bwd_lost_keys adds their exact gradients to the group's kv rows, heads in order."""
    from cuflash import _runtime
    if not _runtime.wgmma_available():
        pytest.skip("the wgmma kernel: compute capability 9.0 and NVRTC 12.9+ only")
    override(wgmma=True)
    Nq, Nk, dtype = 70, 150, "bfloat16" if BFLOAT16 is not None else "float16"
    q = rng.standard_normal((1, 4, Nq, dims[0]))
    q[0, 1, ::5] = 600.0 / np.sqrt(dims[0] / 64)  # logits ~ 4800: lost rows in head 1
    q[0, 3, 3] = -600.0 / np.sqrt(dims[0] / 64)   # and one in head 3 (the other kv head's)
    k = rng.uniform(0.5, 1.5, (1, 2, Nk, dims[0]))
    q, k = (to_device(x, dtype_of(dtype)) for x in (q, k))
    v = randn(rng, (1, 2, Nk, dims[1]), dtype)
    out, lse = cuflash.attention(q, k, v, causal=True, return_lse=True)
    assert (np.abs(to_host(lse)) >= 4096).any()
    check(q, k, v, rng, causal=True)


@pytest.mark.parametrize("dims", [(64, 64), (256, 256)], ids=lambda d: f"{d[0]}x{d[1]}")
@pytest.mark.parametrize("deterministic", [False, True])
def test_lost_rows_settled_by_the_prep_in_any_layout(dims, deterministic, rng):
    """Lost rows (logits near 4800) with q, k, v and dout as (B, H, N, D) views of (B, N, H, D)
    buffers: with dQ atomics the tensor-core prep settles them (bwd_mma_prep reads the caller's
    dO row, whose contiguous copy it writes, and adds each lost row's exact dQ into the sums it
    zeroed; no bwd_lost_rows), its lost-row columns 4 (D = 64) and 8 (D = 256) per lane;
    deterministic (a dQ kernel with plain stores at these dims): bwd_lost_rows after it."""
    B, H, Nq, Nk, dtype = 1, 4, 70, 150, "bfloat16" if BFLOAT16 is not None else "float16"
    q = rng.standard_normal((B, Nq, H, dims[0]))
    q[0, ::5, 1] = 600.0 / np.sqrt(dims[0] / 64)  # logits ~ 4800: lost rows in head 1
    q[0, 3, 3] = -600.0 / np.sqrt(dims[0] / 64)   # and one in head 3
    k = rng.uniform(0.5, 1.5, (B, Nk, H, dims[0]))
    v = rng.standard_normal((B, Nk, H, dims[1]))
    q, k, v = (to_device(x, dtype_of(dtype)).swapaxes(1, 2) for x in (q, k, v))
    out, lse = cuflash.attention(q, k, v, causal=True, return_lse=True)
    assert (np.abs(to_host(lse)) >= 4096).sum() >= 14
    dout = to_device(rng.standard_normal((B, Nq, H, dims[1])), dtype_of(dtype)).swapaxes(1, 2)
    grads = cuflash.attention_backward(dout, q, k, v, out, lse, causal=True,
                                       deterministic=deterministic)
    check_backward(grads, dout, q, k, v, out, lse, causal=True)


# The wide tensor-core path (fwd_wide, bwd_wide: float32 on TF32, three products per GEMM;
# float64 on DMMA): the sweep's cases plus mask / bias, Dk != Dv within a bucket, the largest buckets and
# logits beyond the folded exp2's range (float32 rows then go to fwd_lost_rows). Cases whose head
# dims the path cannot take (not whole 16-byte rows, float64 above 128) check the fallback.
# (name, q lead, kv lead, Nq, Nk, Dk, Dv, options)
WIDE_CASES = CASES + [
    ("mask-bias-causal", (2, 2), (2, 2), 150, 190, 64, 64, "mask-bias"),
    ("mask-bias-d128", (1, 2), (1, 2), 97, 140, 128, 128, "mask-bias"),
    ("dk>dv", (1, 2), (1, 2), 77, 140, 128, 64, dict(causal=True)),
    ("dk<dv-gqa", (2, 4), (2, 1), 70, 90, 32, 96, dict(window=(30, 10))),
    ("d192", (1, 1), (1, 1), 65, 100, 192, 192, dict(causal=True, align="top-left")),
    ("huge-logits", (2, 2), (2, 2), 64, 200, 64, 64, dict(scale=500.0)),
    ("long-causal", (1, 2), (1, 2), 600, 700, 64, 64, dict(causal=True)),
]


def _options(options, rng, lq, Nq, Nk, dtype):
    """A case's options; "mask-bias": causal with a random mask (one row all masked: empty by
    mask, not by position) and a bias of the accumulator dtype."""
    import cupy
    if options != "mask-bias":
        return options
    mask = rng.random(lq + (Nq, Nk)) < 0.7
    mask[(0,) * len(lq) + (5,)] = False
    return dict(causal=True, mask=cupy.asarray(mask),
                bias=cupy.asarray(rng.standard_normal((Nq, Nk)), dtype))


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("case", WIDE_CASES, ids=[c[0] for c in WIDE_CASES])
def test_wide(case, dtype, rng, override):
    """Forward and backward on the wide path wherever it takes the case."""
    from cuflash import _gpu, _runtime, _validate, _wide
    override(path="wide")
    _, lq, lkv, Nq, Nk, Dk, Dv, options = case
    options = _options(options, rng, lq, Nq, Nk, dtype)
    q = randn(rng, lq + (Nq, Dk), dtype)
    k, v = randn(rng, lkv + (Nk, Dk), dtype), randn(rng, lkv + (Nk, Dv), dtype)
    per_chunk = 16 // np.dtype(dtype).itemsize
    top = 256 if dtype == "float32" else 128 if _runtime.device_info().cc >= 90 else 96
    wide = Dk % per_chunk == 0 and Dv % per_chunk == 0 and max(Dk, Dv) <= top
    assert _gpu.forward_path(_validate.make_problem(q, k, v, **options)) == (
        "wide" if wide else "generic")
    assert wide == (_wide.bucket(_validate.make_problem(q, k, v)) is not None
                    and _wide.takes(_validate.make_problem(q, k, v)))
    p = _validate.make_problem(q, k, v, **options)
    assert _gpu.backward_path(p) == ("wide" if wide and _wide.bwd_bucket(p) else "generic")
    if case[0] == "huge-logits" and dtype == "float64":
        _check_huge_float64(q, k, v, **options)
    else:
        check(q, k, v, rng, **options)


def _check_huge_float64(q, k, v, scale):
    """Logits near 4e3: a float64 naive implementation is the reference itself, so the relative
    tolerance has no room for a different summation order of q . k. The bound is that rounding:
    each logit is off by at most D eps scale sum_d |q_d k_d|, which moves lse and (times the
    spread of v) out by as much."""
    out, lse = cuflash.attention(q, k, v, scale=scale, return_lse=True)
    qh, kh, vh = to_host(q), to_host(k), to_host(v)
    ref_out, ref_lse = reference.attention(qh, kh, vh, scale=scale, return_lse=True)
    D, eps = qh.shape[-1], np.finfo(np.float64).eps
    bound = D * eps * scale * (np.abs(qh) @ np.abs(kh).swapaxes(-1, -2)).max()
    assert 0 < bound < 1e-9
    assert np.abs(to_host(lse) - ref_lse).max() <= bound
    assert np.abs(to_host(out) - ref_out).max() <= bound * np.abs(vh).max() * 2


def test_wide_precision_high_is_tf32(rng, override):
    """precision="high" runs one TF32 product per GEMM: its error against the float64 reference is
    larger than "highest"'s (so the option reaches the kernel) but within TF32's rounding. (The
    Hopper forward's float32 has its own tests: test_hopper_forward_float32.)"""
    from cuflash import _gpu, _validate
    override(path="wide")
    q, k, v = (randn(rng, (2, 2, 300, 64), "float32") for _ in range(3))
    ref = reference.attention(to_host(q), to_host(k), to_host(v), causal=True)
    errs = {}
    for precision in ("highest", "high"):
        p = _validate.make_problem(q, k, v, causal=True, precision=precision)
        assert p.precision == precision and _gpu.forward_path(p) == "wide"
        out = cuflash.attention(q, k, v, causal=True, precision=precision)
        errs[precision] = np.abs(to_host(out) - ref).max()
    naive_out = naive_attention(to_host(q), to_host(k), to_host(v), causal=True)[0]
    naive = np.abs(naive_out - ref).max()
    assert errs["highest"] <= 2 * naive + FLOORS["float32"]
    assert 4 * errs["highest"] < errs["high"] < 2e-2, errs


# The Hopper forward (fwd_wgmma, compute capability 9.0): 64 and 128-row query tiles against
# 128-key tiles, visited last first; the last tile ends at the block's last visible key and masks
# what the one before it took. (name, q lead, kv lead, Nq, Nk, options)
WG_FWD_CASES = [
    ("plain", (2, 3), (2, 3), 256, 256, {}),
    ("odd", (1, 2), (1, 2), 97, 300, {}),
    ("one-short-tile", (1, 1), (1, 1), 5, 9, {}),
    ("causal-br", (2, 2), (2, 2), 300, 700, dict(causal=True)),
    ("causal-tl", (1, 2), (1, 2), 700, 300, dict(causal=True, align="top-left")),
    ("nq>nk-causal-br", (2,), (2,), 300, 70, dict(causal=True)),  # rows with no visible key
    ("gqa-causal", (2, 8), (2, 2), 200, 333, dict(causal=True)),
    ("mqa-broadcast-batch", (3, 4), (1, 1), 130, 260, {}),
    ("window", (1, 2), (1, 2), 500, 500, dict(window=(37, 5))),
    ("window-left-causal", (1, 2), (1, 2), 260, 520, dict(window=(129, None), causal=True)),
    ("kv_lens", (3, 2), (3, 2), 150, 400, dict(kv_lens=np.array([[0], [17], [400]]), causal=True)),
    ("kv_lens-window", (2, 2), (2, 1), 64, 300, dict(kv_lens=[[260], [3]], window=(9, 4))),
    ("positions-behind", (1, 2), (1, 2), 300, 400, dict(causal=True, align="top-left",
                                                        positions=(0, 150))),
]


def _wgmma_forward_or_skip(override, q, k, v, options):
    """Run the rest of the test's forwards on the Hopper kernel (also where dispatch would leave
    the problem to fwd_mma: _wgmma_fwd.SHORT_ROW_KEYS), and check that it takes this one."""
    from cuflash import _gpu, _runtime, _validate
    if not _runtime.wgmma_available():
        pytest.skip("the Hopper forward: compute capability 9.0 and NVRTC 12.9+ only")
    override(path="wgmma")
    assert _gpu.forward_path(_validate.make_problem(q, k, v, **options)) == "wgmma"


# (Dk, Dv): the kernel's own sizes on every case, and on a few cases the other tiles and sizes it
# pads (96 -> 128, 80 -> 128, 40 -> 64)
WG_RUNS = [(c, d) for c in WG_FWD_CASES for d in [(64, 64), (128, 128)]] + [
    (c, d) for c in WG_FWD_CASES if c[0] in ("odd", "causal-br", "gqa-causal", "kv_lens-window")
    for d in [(96, 96), (192, 128), (192, 192), (256, 256), (80, 80), (40, 40)]]


@pytest.mark.parametrize("dtype", ["float16"] + (["bfloat16"] if BFLOAT16 is not None else []))
@pytest.mark.parametrize("case, dims", WG_RUNS, ids=[f"{c[0]}-{d[0]}x{d[1]}" for c, d in WG_RUNS])
def test_hopper_forward(case, dims, dtype, rng, override):
    _, lq, lkv, Nq, Nk, options = case
    dk, dv = dims
    q = randn(rng, lq + (Nq, dk), dtype)
    k = randn(rng, lkv + (Nk, dk), dtype)
    v = randn(rng, lkv + (Nk, dv), dtype)
    _wgmma_forward_or_skip(override, q, k, v, options)
    check(q, k, v, rng, **options)


def tf32_rounded(x):
    """float32 x rounded to TensorFloat-32 (10-bit mantissa) to nearest, ties away from zero, as
    cvt.rna.tf32.f32 does; non-finite values kept."""
    x = np.asarray(x, dtype=np.float32)
    bits = x.view(np.uint32)
    rounded = ((bits + np.uint32(0x1000)) & np.uint32(0xFFFFE000)).view(np.float32)
    return np.where(np.isfinite(x), rounded, x)


def check_tf32_forward(q, k, v, precision, **options):
    """A float32 forward against the float64 reference: "highest" within 2x the error of a naive
    float32 implementation, "high" within 2x that of one on inputs rounded to TF32 (the kernel
    also rounds P, whose error is of the same order as v's and sits in the slack)."""
    out, lse = cuflash.attention(q, k, v, return_lse=True, precision=precision, **options)
    host = {n: to_host(x) if hasattr(x, "shape") else x for n, x in options.items()}
    qh, kh, vh = (to_host(x) for x in (q, k, v))
    ref_out, ref_lse = reference.attention(qh, kh, vh, return_lse=True, **host)
    if precision == "high":
        qh, kh, vh = tf32_rounded(qh), tf32_rounded(kh), tf32_rounded(vh)
    naive = naive_attention(qh, kh, vh, **host)
    assert_close_to_reference(out, ref_out, naive[0], FLOORS["float32"], "out")
    assert_close_to_reference(lse, ref_lse, naive[1], FLOORS["float32"], "lse")
    return out, ref_out


# float32 on the Hopper forward (one TF32 pass, "high", and three, "highest"): its tiles (64, 64)
# and (128, 128), and the sizes they pad (40 -> 64, 96 -> 128, Dk 5 with Dv 36 -> 64)
F32_RUNS = [(c, d) for c in WG_FWD_CASES for d in [(64, 64), (128, 128)]] + [
    (c, d) for c in WG_FWD_CASES if c[0] in ("odd", "gqa-causal", "kv_lens-window", "window")
    for d in [(40, 40), (96, 96), (5, 36)]]


@pytest.mark.parametrize("precision", ["high", "highest"])
@pytest.mark.parametrize("case, dims", F32_RUNS, ids=[f"{c[0]}-{d[0]}x{d[1]}" for c, d in F32_RUNS])
def test_hopper_forward_float32(case, dims, precision, rng, override):
    _, lq, lkv, Nq, Nk, options = case
    dk, dv = dims
    q = randn(rng, lq + (Nq, dk), "float32")
    k = randn(rng, lkv + (Nk, dk), "float32")
    v = randn(rng, lkv + (Nk, dv), "float32")
    _wgmma_forward_or_skip(override, q, k, v, dict(options, precision=precision))
    check_tf32_forward(q, k, v, precision, **options)


def test_hopper_forward_float32_choice(rng, override):
    """float32 reaches the Hopper forward with either precision, also with kv_lens that differ
    between the output heads reading one v matrix (its v^T copy is zeroed past the longest)."""
    from cuflash import _gpu, _runtime, _validate
    if not _runtime.wgmma_available():
        pytest.skip("the Hopper forward: compute capability 9.0 and NVRTC 12.9+ only")
    q = randn(rng, (1, 4, 300, 64), "float32")
    k, v = randn(rng, (1, 2, 300, 64), "float32"), randn(rng, (1, 2, 300, 64), "float32")
    path = lambda **o: _gpu.forward_path(_validate.make_problem(q, k, v, **o))  # noqa: E731
    assert path(precision="high") == "wgmma"
    assert path() == "wgmma" and path(precision="highest") == "wgmma"
    for precision in ("high", "highest"):
        assert path(precision=precision, kv_lens=np.array([[30, 31, 77, 7]])) == "wgmma"


@pytest.mark.parametrize("precision", ["high", "highest"])
@pytest.mark.parametrize("dims", [(64, 64), (128, 128)], ids=str)
def test_hopper_forward_float32_nan_past_kv_lens(dims, precision, rng, override):
    """The float32 kernel's key tiles start at multiples of 8 keys, so the last one reads up to 7
    keys past a row's last visible one: past kv_lens (here different for the two heads that
    share a kv head) the keys may hold anything, NaN and inf included, which must not reach the
    output (v^T is zeroed past the longest length, the scores masked): the call gives what it
    gives with zeros there."""
    import cupy
    dk, dv = dims
    lens = np.array([[13, 21], [70, 64], [0, 0]])
    q = randn(rng, (3, 2, 90, dk), "float32")
    k = rng.standard_normal((3, 1, 100, dk)).astype(np.float32)
    v = rng.standard_normal((3, 1, 100, dv)).astype(np.float32)
    k_clean, v_clean = k.copy(), v.copy()
    for b, n in enumerate(lens.max(axis=1)):
        k[b, :, n:], k_clean[b, :, n:] = np.nan, 0
        v[b, :, n:], v_clean[b, :, n:] = np.inf, 0
    for causal in (False, True):
        options = dict(kv_lens=lens, causal=causal)
        _wgmma_forward_or_skip(override, q, cupy.asarray(k), cupy.asarray(v),
                               dict(options, precision=precision))
        got = cuflash.attention(q, cupy.asarray(k), cupy.asarray(v), precision=precision,
                                **options)
        check_tf32_forward(q, cupy.asarray(k_clean), cupy.asarray(v_clean), precision, **options)
        clean = cuflash.attention(q, cupy.asarray(k_clean), cupy.asarray(v_clean),
                                  precision=precision, **options)
        assert np.array_equal(to_host(got), to_host(clean))


@pytest.mark.parametrize("Nk, staged", [(272, True), (270, False)], ids=["staged", "global"])
@pytest.mark.parametrize("dims", [(64, 64), (128, 128), (192, 128), (256, 256)], ids=str)
@pytest.mark.parametrize("kind", ["padding-mask", "mask", "bias", "mask-bias-causal"])
def test_hopper_forward_mask_bias(kind, dims, Nk, staged, rng, override):
    """Masks and biases through the score modifier, with rows that see no key (0 / -inf) and a
    padding bias of finfo.min (uniform rows, settled by the lost-row fix); staged by the producer
    where their strides are 16-byte multiples (272 keys), else read from global memory (270). A
    padding mask, the same for every query, is staged as one row."""
    from cuflash import _validate, _wgmma_fwd
    B, Hq, Hk, Nq = 2, 4, 2, 150
    dk, dv = dims
    q = randn(rng, (B, Hq, Nq, dk), "float16")
    k, v = randn(rng, (B, Hk, Nk, dk), "float16"), randn(rng, (B, Hk, Nk, dv), "float16")
    options = _mask_bias_options(kind, B, Hq, Nq, Nk, rng)
    _wgmma_forward_or_skip(override, q, k, v, options)
    p = _validate.make_problem(q, k, v, **options)
    # staged tiles need key tiles at multiples of 16 keys: no causal bound (its diagonal tiles
    # start anywhere; staging them faulted with an illegal instruction)
    # (a staged mask is classified: MB_CLASSES)
    want = _wgmma_fwd.MB_GLOBAL if not staged or "causal" in options else \
        _wgmma_fwd.MB_CLASSES if "mask" in options else _wgmma_fwd.MB_STAGED
    assert _wgmma_fwd._launch(p, _wgmma_fwd.padded(p)).mb == want
    check(q, k, v, rng, **options)


@pytest.mark.parametrize("precision", ["high", "highest"])
@pytest.mark.parametrize("dims", [(64, 64), (128, 128)], ids=str)
@pytest.mark.parametrize("kind", ["padding-mask", "mask-bias-causal"])
def test_hopper_forward_float32_mask_bias(kind, dims, precision, rng, override):
    """float32 on the Hopper forward reads a mask and bias from global memory (MB_GLOBAL)."""
    B, Hq, Hk, Nq, Nk = 2, 4, 2, 150, 270
    dk, dv = dims
    q = randn(rng, (B, Hq, Nq, dk), "float32")
    k, v = randn(rng, (B, Hk, Nk, dk), "float32"), randn(rng, (B, Hk, Nk, dv), "float32")
    options = _mask_bias_options(kind, B, Hq, Nq, Nk, rng)
    _wgmma_forward_or_skip(override, q, k, v, dict(options, precision=precision))
    check_tf32_forward(q, k, v, precision, **options)


def _mask_bias_options(kind, B, Hq, Nq, Nk, rng):
    """The options of a mask / bias kind: a padding mask (B, 1, 1, Nk), a random mask with a row
    that sees no key, a float32 bias (Hq, Nq, Nk) with a padding row of finfo.min, both with
    causal."""
    import cupy
    options = {}
    if kind == "padding-mask":
        valid = np.arange(Nk)[None, :] < np.array([[200], [1]])
        options["mask"] = cupy.asarray(valid[:, None, None, :])
    if kind in ("mask", "mask-bias-causal"):
        mask = rng.random((B, Hq, Nq, Nk)) < 0.6
        mask[0, 1, 7] = False  # a row with no visible key
        options["mask"] = cupy.asarray(mask)
    if kind in ("bias", "mask-bias-causal"):
        bias = rng.standard_normal((Hq, Nq, Nk)).astype(np.float32)
        bias[2, 3, :] = np.finfo(np.float32).min  # a padding row: uniform weights
        options["bias"] = cupy.asarray(bias)
    if kind == "mask-bias-causal":
        options["causal"] = True
    return options


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("kind", ["blocks", "blocks-bias", "blocks-causal", "padding"])
def test_wide_forward_skips_hidden_tiles(kind, dtype, rng, override):
    """The wide forward reads a mask's tile classes for its own tiles (mask_tiles.cuh): it skips
    the key tiles the mask hides (copies included), gives tiles it shows entirely only the scale
    and the position mask (no bias), masks the rest element by element; after an in-place change
    of the mask, the next call sees the change. Blocks of 256 x 32 (the float32 D = 64 tile) give
    all three kinds, and rows that see no key."""
    import cupy
    from cuflash import _gpu, _mask_tiles, _validate
    override(path="wide")
    B, H, Nq, Nk, D = 2, 2, 520, 400, 64
    q = randn(rng, (B, H, Nq, D), dtype)
    k, v = randn(rng, (B, H, Nk, D), dtype), randn(rng, (B, H, Nk, D), dtype)
    options = {}
    if kind == "padding":  # one row for every query; batch 1 sees no key at all
        mask = (np.arange(Nk)[None, :] < np.array([[230], [0]]))[:, None, None, :]
    else:
        blocks = rng.random((B, 1, -(-Nq // 128), -(-Nk // 32))) < 0.5
        mask = blocks.repeat(128, axis=2).repeat(32, axis=3)[:, :, :Nq, :Nk].copy()
        mask[0, 0, 5, :] = False                      # a row with no visible key
        mask[1, 0, 130:140, 70:75] = ~mask[1, 0, 130:140, 70:75]  # a mixed tile
    options["mask"] = cupy.asarray(mask)
    if kind == "blocks-bias":
        options["bias"] = cupy.asarray(rng.standard_normal((H, Nq, Nk)), dtype)
    if kind == "blocks-causal":
        options["causal"] = True
    p = _validate.make_problem(q, k, v, **options)
    assert _gpu.forward_path(p) == "wide" and _mask_tiles.layout(p) is not None
    check(q, k, v, rng, **options)
    m = options["mask"]
    m[..., 64:128] = ~m[..., 64:128]  # in place: hidden tiles become visible and back
    check(q, k, v, rng, **options)


@pytest.mark.parametrize("dims", [(64, 64), (128, 128), (256, 256)], ids=str)
@pytest.mark.parametrize("kind", ["blocks", "blocks-bias", "blocks-kv-lens", "blocks-causal",
                                  "padding"])
def test_hopper_forward_skips_hidden_tiles(kind, dims, rng, override):
    """A staged mask's tiles are classified before the kernel (fwd_wgmma.cu mask_tile_classes):
    tiles it hides entirely are skipped, tiles it shows entirely take no per-element mask (the
    bias still applies), the rest are masked element by element. Masks made of 128 x 64 blocks
    give all three kinds (and rows that see no key); the mask then changes in place, and the next
    call must see the change. The backward (check) classifies for its own tiles: at D=64 and 128
    on compute capability 9.0 its wgmma dK/dV kernel skips hidden tiles and gives tiles a mask
    without bias shows entirely the position mask only (kv_lens, causal)."""
    import cupy
    from cuflash import _mask_tiles, _validate, _wgmma_fwd
    B, H, Nq, Nk = 2, 2, 300, 320
    dk, dv = dims
    q = randn(rng, (B, H, Nq, dk), "bfloat16")
    k, v = randn(rng, (B, H, Nk, dk), "bfloat16"), randn(rng, (B, H, Nk, dv), "bfloat16")
    options = {}
    if kind == "padding":  # one row for every query; batch 1 sees no key at all
        valid = np.arange(Nk)[None, :] < np.array([[200], [0]])
        mask = valid[:, None, None, :]
    else:
        blocks = rng.random((B, 1, -(-Nq // 128), Nk // 64)) < 0.5
        mask = blocks.repeat(128, axis=2).repeat(64, axis=3)[:, :, :Nq].copy()
        mask[0, 0, 5, :] = False                      # a row with no visible key
        mask[1, 0, 130:140, 70:75] = ~mask[1, 0, 130:140, 70:75]  # a mixed tile
    options["mask"] = cupy.asarray(mask)
    if kind == "blocks-bias":
        options["bias"] = cupy.asarray(rng.standard_normal((H, Nq, Nk)).astype(np.float32))
    if kind == "blocks-kv-lens":
        options["kv_lens"] = [[320, 256], [64, 192]]
    if kind == "blocks-causal":
        options["causal"] = True
    _wgmma_forward_or_skip(override, q, k, v, options)
    p = _validate.make_problem(q, k, v, **options)
    # (a causal call's diagonal tiles start anywhere: its mask is read from global memory,
    # _wgmma_fwd._key_tiles_aligned)
    want = _wgmma_fwd.MB_GLOBAL if "causal" in options else _wgmma_fwd.MB_CLASSES
    assert _wgmma_fwd._launch(p, _wgmma_fwd.padded(p)).mb == want
    assert _mask_tiles.layout(p) is not None
    check(q, k, v, rng, **options)
    m = options["mask"]
    m[..., 64:128] = ~m[..., 64:128]  # in place: hidden tiles become visible and back
    check(q, k, v, rng, **options)


def test_hopper_forward_launch_follows_the_bounds(rng, override):
    """Regression: the Hopper forward memoized its launch (tensor maps, mask / bias variant) by the
    inputs' addresses only, so a causal or kv_lens call on the arrays of an earlier unbounded call
    staged tiles that start off 16 keys and faulted (illegal instruction). Same arrays, four
    calls (unbounded, causal, kv_lens, unbounded), each checked against the reference."""
    import cupy
    from cuflash import _validate, _wgmma_fwd
    B, H, Nq, Nk, D = 2, 2, 300, 320, 128
    q = randn(rng, (B, H, Nq, D), "bfloat16")
    k, v = randn(rng, (B, H, Nk, D), "bfloat16"), randn(rng, (B, H, Nk, D), "bfloat16")
    blocks = rng.random((B, 1, -(-Nq // 128), Nk // 64)) < 0.5
    mask = cupy.asarray(blocks.repeat(128, axis=2).repeat(64, axis=3)[:, :, :Nq].copy())
    _wgmma_forward_or_skip(override, q, k, v, dict(mask=mask))
    for options, want in ((dict(mask=mask), _wgmma_fwd.MB_CLASSES),
                          (dict(mask=mask, causal=True), _wgmma_fwd.MB_GLOBAL),
                          (dict(mask=mask, kv_lens=[[300], [100]]), _wgmma_fwd.MB_GLOBAL),
                          (dict(mask=mask), _wgmma_fwd.MB_CLASSES)):
        p = _validate.make_problem(q, k, v, **options)
        assert _wgmma_fwd._launch(p, _wgmma_fwd.padded(p)).mb == want, options
        check(q, k, v, rng, backward=False, **options)


@pytest.mark.parametrize("layout", ["bnhd", "bhnd-strided-rows"])
def test_hopper_forward_layouts(layout, rng, override):
    """(B, N, H, D) storage read through the tensor maps' strides, and rows padded apart."""
    B, N, H, D = 2, 333, 4, 128
    if layout == "bnhd":
        qkv = randn(rng, (B, N, 3, H, D), "float16")
        q, k, v = (qkv[:, :, i].swapaxes(1, 2) for i in range(3))
    else:
        q, k, v = (randn(rng, (B, H, N, D + 64), "float16")[..., :D] for _ in range(3))
    _wgmma_forward_or_skip(override, q, k, v, dict(causal=True))
    check(q, k, v, rng, causal=True)


@pytest.mark.parametrize("causal", [False, True])
def test_hopper_forward_reads_no_key_past_kv_lens(causal, rng, override):
    """Keys at and past kv_lens hold NaN: no row may see them (the last tile ends at the last
    visible key instead of running into them)."""
    import cupy
    B, H, Nq, Nk, D = 3, 2, 200, 520, 64
    lens = np.array([[1], [130], [517]])
    q = randn(rng, (B, H, Nq, D), "bfloat16" if BFLOAT16 is not None else "float16")
    k, v = (randn(rng, (B, H, Nk, D), q.dtype.name) for _ in range(2))
    _wgmma_forward_or_skip(override, q, k, v, dict(kv_lens=lens, causal=causal))
    out_clean, lse_clean = cuflash.attention(q, k, v, kv_lens=lens, causal=causal, return_lse=True)
    check_forward(out_clean, lse_clean, q, k, v, kv_lens=lens, causal=causal)
    for b, n in enumerate(lens[:, 0]):
        k[b, :, n:] = cupy.nan
        v[b, :, n:] = cupy.nan
    out, lse = cuflash.attention(q, k, v, kv_lens=lens, causal=causal, return_lse=True)
    assert bool(cupy.isfinite(out.astype(np.float32)).all())
    assert bool((out == out_clean).all()) and bool((lse == lse_clean).all())


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
    ("positions-causal", (2, 8), (2, 2), 4, 900, 128, 128,
     dict(causal=True, align="top-left", positions=(700, 100))),
    # 772 items at the forced split (three waves of blocks on an H200): decode_tc's
    # persistent blocks run several items each, streaming the next item's first keys during the
    # current one's last stage; kv_lens 0 makes empty items in the middle of a block's sequence
    ("many-items-per-block", (4, 16), (4, 4), 1, 8192, 128, 128,
     dict(kv_lens=[[0], [1], [4000], [8192]])),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("force", ["split", "split-simt", "auto"])
@pytest.mark.parametrize("case", DECODE_CASES, ids=[c[0] for c in DECODE_CASES])
def test_decode_sweep(case, force, dtype, rng, override):
    """'split': small splits on the automatic kernel (decode_tc for 16-bit, Dk = Dv = 64 / 128,
    decode_split otherwise); 'split-simt': small splits on decode_split everywhere."""
    from cuflash import _gpu, _validate
    override(path=None if force == "auto" else force)
    _, lq, lkv, Nq, Nk, Dk, Dv, options = case
    q = randn(rng, lq + (Nq, Dk), dtype)
    k = randn(rng, lkv + (Nk, Dk), dtype)
    v = randn(rng, lkv + (Nk, Dv), dtype)
    if force != "auto":
        assert _gpu.forward_path(_validate.make_problem(q, k, v, **options)) == "split"
    check(q, k, v, rng, **options)


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_split_path_takes_whole_vector_rows_only(dtype, rng, override):
    """decode.cu's merge reads 4 float columns at a time: the split path must refuse rows that are
    not whole 16-byte vectors (Dv = 33 here), and the generic path answers instead."""
    from cuflash import _gpu, _validate
    override(path="split")
    q, k = randn(rng, (2, 4, 2, 40), dtype), randn(rng, (2, 2, 700, 40), dtype)
    v = randn(rng, (2, 2, 700, 33), dtype)
    assert _gpu.forward_path(_validate.make_problem(q, k, v)) == "generic"
    check(q, k, v, rng, backward=False)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"] if BFLOAT16 is not None else ["float32"])
def test_decode_with_mask_and_bias(dtype, rng, override):
    import cupy
    override(path="split")
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


DOUT_LAYOUTS = ["bnhd", "wide-rows", "odd-head-stride", "unaligned-base"]


@pytest.mark.parametrize("deterministic", [True, False])
@pytest.mark.parametrize("layout", DOUT_LAYOUTS)
@pytest.mark.parametrize("dtype,path", [("float16", "auto"), ("bfloat16", "auto"),
                                        ("float32", "auto"), ("float64", "auto"),
                                        ("float16", "generic")])
def test_backward_takes_dout_in_any_layout(dtype, path, layout, deterministic, rng, override):
    """dout as a (B, N, H, D) view and as rows of a wider buffer (read in place by the
    backward's preprocess kernel, which copies it on the way: _generic.dout_rows), with head
    offsets or a base that the preprocess cannot read in place (copied first; the tensor-core
    prep reads 16-byte vectors): on the tensor-core, wide and generic backwards the gradients
    equal those of a contiguous dout of the same values (bitwise with deterministic=True) and
    the float64 reference's."""
    import cupy
    if dtype == "bfloat16" and BFLOAT16 is None:
        pytest.skip("no bfloat16 dtype")
    override(path=None if path == "auto" else path)
    B, H, N, D = 2, 4, 200, 64
    q, k, v = (randn(rng, (B, N, H, D), dtype).swapaxes(1, 2) for _ in range(3))
    out, lse = cuflash.attention(q, k, v, causal=True, return_lse=True)
    dout = randn(rng, (B, H, N, D), dtype)
    size = dout.dtype.itemsize
    if layout == "bnhd":
        view = cupy.ascontiguousarray(dout.swapaxes(1, 2)).swapaxes(1, 2)
    elif layout == "wide-rows":  # row stride D + 8 elements
        view = cupy.zeros((B, H, N, D + 8), dout.dtype)[..., :D]
    elif layout == "odd-head-stride":  # heads N D + 4 elements apart
        buf = cupy.zeros(B * H * (N * D + 4), dout.dtype)
        view = cupy.lib.stride_tricks.as_strided(
            buf, (B, H, N, D), (H * (N * D + 4) * size, (N * D + 4) * size, D * size, size))
    else:  # the base 2 elements past a 16-byte boundary
        view = cupy.zeros(dout.size + 2, dout.dtype)[2:].reshape(dout.shape)
    view[...] = dout
    assert bool((view == dout).all())
    assert view.flags.c_contiguous == (layout == "unaligned-base")
    want = cuflash.attention_backward(dout, q, k, v, out, lse, causal=True,
                                      deterministic=deterministic)
    got = cuflash.attention_backward(view, q, k, v, out, lse, causal=True,
                                     deterministic=deterministic)
    if deterministic:
        for name, g, w in zip(("dq", "dk", "dv"), got, want):
            assert bool((g == w).all()), name
    check_backward(got, dout, q, k, v, out, lse, causal=True)


@pytest.mark.parametrize("deterministic", [True, False])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("heads", [(3, 3), (6, 2)], ids=["mha", "gqa"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"] if BFLOAT16 is not None else
                         ["float16"])
def test_gradients_come_back_in_the_inputs_layout(dtype, heads, D, deterministic, rng):
    """q, k, v as (B, H, N, D) views of (B, N, H, D) buffers: the tensor-core backward writes dq,
    dk and dv with q's, k's and v's strides (no transpose left for the caller; GQA's dk, dv
    summed per kv head in the kernel), equal to the gradients of contiguous copies of the same
    inputs (bitwise with deterministic=True) and to the float64 reference's. Views that do not
    fill their buffer (slices of a packed qkv) get C-contiguous gradients. (B * H * N odd: the
    dq cast's warps take two rows at once at D = 64, the last one alone.)"""
    import cupy
    B, N = 3, 301
    H, Hkv = heads
    q = randn(rng, (B, N, H, D), dtype).swapaxes(1, 2)
    k, v = (randn(rng, (B, N, Hkv, D), dtype).swapaxes(1, 2) for _ in range(2))
    dout = randn(rng, (B, H, N, D), dtype)
    out, lse = cuflash.attention(q, k, v, causal=True, return_lse=True)
    got = cuflash.attention_backward(dout, q, k, v, out, lse, causal=True,
                                     deterministic=deterministic)
    # (on the wgmma tiles, Hopper: elsewhere C-contiguous)
    from cuflash import _runtime
    like = _runtime.wgmma_available()
    for name, g, x in zip(("dq", "dk", "dv"), got, (q, k, v)):
        assert g.shape == x.shape, name
        assert g.strides == x.strides if like else g.flags.c_contiguous, (name, g.strides)
    contiguous = [cupy.ascontiguousarray(x) for x in (q, k, v)]
    want = cuflash.attention_backward(dout, *contiguous, out, lse, causal=True,
                                      deterministic=deterministic)
    if deterministic:
        for name, g, w in zip(("dq", "dk", "dv"), got, want):
            assert bool((g == w).all()), name
    check_backward(got, dout, q, k, v, out, lse, causal=True)
    # slices of a packed (B, N, 3, H, D) buffer: not dense, so C-contiguous gradients
    qkv = randn(rng, (B, N, 3, H, D), dtype)
    q3, k3, v3 = (qkv[:, :, i].swapaxes(1, 2) for i in range(3))
    out3, lse3 = cuflash.attention(q3, k3, v3, causal=True, return_lse=True)
    grads3 = cuflash.attention_backward(dout, q3, k3, v3, out3, lse3, causal=True,
                                        deterministic=deterministic)
    assert all(g.flags.c_contiguous for g in grads3)
    check_backward(grads3, dout, q3, k3, v3, out3, lse3, causal=True)


def test_gradients_of_a_broadcast_q_beside_transposed_kv(rng):
    """q broadcast over the batch, k and v (B, H, N, D) views: dq is summed over the batch (its
    own shape, C-contiguous: no layout-kept gradients when q is broadcast), every gradient as the
    float64 reference's."""
    B, H, N, D = 2, 4, 130, 64
    q = randn(rng, (H, N, D), "float16")
    k, v = (randn(rng, (B, N, H, D), "float16").swapaxes(1, 2) for _ in range(2))
    dout = randn(rng, (B, H, N, D), "float16")
    out, lse = cuflash.attention(q, k, v, return_lse=True)
    grads = cuflash.attention_backward(dout, q, k, v, out, lse)
    assert grads[0].shape == q.shape and grads[0].flags.c_contiguous
    check_backward(grads, dout, q, k, v, out, lse)


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


# (name, q lead, kv lead, Nq, Nk, D, dtype, options): one case per forward path, with backward
NO_SYNC_CASES = [
    ("mma-causal", (1, 8), (1, 8), 128, 128, 64, "float16", dict(causal=True)),
    ("wgmma-mask", (2, 4), (2, 4), 512, 512, 128, "float16", "mask"),
    ("generic-fp32-kv_lens", (2, 2), (2, 2), 100, 300, 32, "float32", dict(kv_lens=[[300], [7]])),
    ("decode-gqa", (1, 32), (1, 8), 1, 4096, 128, "float16", {}),
    ("decode-kv_lens", (2, 8), (2, 2), 1, 2048, 128, "float16", dict(kv_lens=[[2000], [5]])),
]


@pytest.mark.parametrize("case", NO_SYNC_CASES, ids=[c[0] for c in NO_SYNC_CASES])
def test_calls_never_synchronize(case, rng):
    """A forward and a backward with host kv_lens enqueue work and nothing else: under CUDA
    stream capture, where any synchronizing call or device-to-host copy raises, they run through
    (after a first call on the same stream has built the per-layout caches). The captured graph
    is not launched: temporaries freed after the calls are not kept for a replay."""
    import cupy
    _, lq, lkv, Nq, Nk, D, dtype, options = case
    q = randn(rng, lq + (Nq, D), dtype)
    k, v = randn(rng, lkv + (Nk, D), dtype), randn(rng, lkv + (Nk, D), dtype)
    if options == "mask":
        options = dict(mask=cupy.asarray(rng.random((Nq, Nk)) < 0.5))
    dout = randn(rng, lq + (Nq, D), dtype)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        out, lse = cuflash.attention(q, k, v, return_lse=True, **options)
        cuflash.attention_backward(dout, q, k, v, out, lse, **options)
        stream.synchronize()
        stream.begin_capture()
        try:
            cuflash.attention(q, k, v, return_lse=True, **options)
            cuflash.attention_backward(dout, q, k, v, out, lse, **options)
        finally:
            stream.end_capture()


# a kernel that keeps one thread busy for `cycles` clock cycles (tests of what waits for it)
_SPIN = r"""extern "C" __global__ void spin(long long cycles) {
  const long long t0 = clock64();
  while (clock64() - t0 < cycles) {}
}"""


@pytest.mark.parametrize("case", ["decode", "generic"])
def test_new_host_kv_lens_do_not_wait_for_the_stream(case, rng):
    """Host kv_lens with new values at every call (issue 17's token loop) are copied to the
    device without waiting for the stream (cuflash/_runtime.py upload; a pageable copy does not
    wait either: this passed before it too). Behind a spin of about 0.1 s, calls with new lengths
    must return while the spin still runs; their results (after it) must match the
    reference."""
    import cupy
    if case == "decode":  # the split path's bucket plans (B = 2, 8 / 2 heads, one query)
        q, k, v = (randn(rng, s, "float16") for s in ((2, 8, 1, 64), (2, 2, 2048, 64),
                                                       (2, 2, 2048, 64)))
        start = np.array([[1500], [700]])
    else:  # the generic kernels' argument tables
        q, k, v = (randn(rng, (2, 2, n, 32), "float32") for n in (100, 300, 300))
        start = np.array([[200], [7]])
    spin = cupy.RawKernel(_SPIN, "spin")
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        cuflash.attention(q, k, v, kv_lens=start)  # (compiles, plans the layout)
        spin((1,), (1,), (np.int64(2_000_000_000 // 10),))  # ~0.1 s at 2 GHz
        behind = stream.record()
        outs = [cuflash.attention(q, k, v, kv_lens=start + step) for step in range(1, 6)]
        assert not behind.done, "a call with new host kv_lens waited for the stream"
        stream.synchronize()
    for step, out in zip(range(1, 6), outs):
        host = [to_host(x) for x in (q, k, v)]
        ref = reference.attention(*host, kv_lens=start + step)
        naive = naive_attention(q, k, v, kv_lens=start + step)[0]
        assert_close_to_reference(out, ref, naive, FLOORS[to_host(q).dtype.name])


@pytest.mark.parametrize("case", ["fwd_mma", "fwd_wgmma", "decode", "decode-host-lens",
                                  "decode-device-lens"])
def test_a_dropped_lse_changes_nothing(case, rng, poisoned, override):
    """attention without return_lse on the short way gives its prepared forward lse as a bare
    pointer (Problem.lse_unused, issue 17's host cost): the same out as with return_lse, and the
    launches alike whichever call of the layout came first (an array's or a pointer's address).
    Bitwise, but for host kv_lens seen again: those get a plan of their own (_decode._exact)."""
    import cupy
    override(path="mma" if case == "fwd_mma" else None)
    for first, n in ((True, 256), (False, 192)):  # a new layout whose first call keeps lse or not
        if case.startswith("fwd"):  # B = 2, 4 heads: the tensor-core forwards
            q, k, v = (randn(rng, (2, 4, n, 64), "bfloat16" if BFLOAT16 else "float16")
                       for _ in range(3))
            options = [dict(causal=True)] * 3
        else:  # the split path, one query per head
            q, k, v = (randn(rng, s, "float16") for s in ((2, 8, 1, 64), (2, 2, 4 * n, 64),
                                                           (2, 2, 4 * n, 64)))
            lens = [np.array([[4 * n - 30 + i], [300 + i]]) for i in range(3)]
            options = ([{}] * 3 if case == "decode" else [dict(kv_lens=x) for x in lens]
                       if case == "decode-host-lens" else [dict(kv_lens=cupy.asarray(x))
                                                           for x in lens])
        for i, opt in enumerate(options):
            with_lse = (i != 1) == first
            got = cuflash.attention(q, k, v, return_lse=with_lse, **opt)
            out = to_host(got[0] if with_lse else got)
            again = to_host(cuflash.attention(q, k, v, return_lse=True, **opt)[0])
            if case == "decode-host-lens":
                np.testing.assert_allclose(out.astype(np.float32), again.astype(np.float32),
                                           rtol=0, atol=2e-3)
            else:
                assert np.array_equal(out, again)


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


def test_fast_path_is_chosen_where_it_applies(rng, override):
    """The 'auto' runs above test the tensor-core paths only if dispatch really picks them: the
    Hopper forward on compute capability 9.0 (any head dim up to 256, padded), fwd_mma elsewhere
    and where it is forced."""
    from cuflash import _gpu, _runtime, _validate
    hopper = _runtime.wgmma_available()
    q, k, v = (randn(rng, (2, 4, 256, 128), "bfloat16") for _ in range(3))
    p = _validate.make_problem(q, k, v, causal=True)
    assert _gpu.forward_path(p) == ("wgmma" if hopper else "mma")
    q32 = randn(rng, (2, 4, 256, 128), "float32")
    assert _gpu.forward_path(_validate.make_problem(q32, q32, q32)) == (
        "wgmma" if hopper else "wide")
    p80 = _validate.make_problem(q[..., :80], k[..., :80], v[..., :80])
    assert _gpu.forward_path(p80) == ("wgmma" if hopper else "generic")
    q64 = q[..., :64]
    short = _validate.make_problem(q64, q64, q64, causal=True)  # rows see 128 keys on average
    assert _gpu.forward_path(short) == "mma"
    assert _gpu.forward_path(_validate.make_problem(q64, q64, q64)) == ("wgmma" if hopper else "mma")
    override(path="mma")
    assert _gpu.forward_path(p) == "mma" and _gpu.forward_path(p80) == "generic"


@pytest.mark.parametrize("shape, dtype, causal", [
    ((1, 8, 128, 64), "bfloat16", True),     # fwd_mma (rows see few keys)
    ((2, 4, 512, 128), "bfloat16", False),   # the Hopper forward (fwd_mma on sm_80)
    ((2, 4, 256, 64), "float32", True),      # the Hopper forward's float32 (wide on sm_80)
    ((1, 32, 1, 128), "float16", False),     # decode (its Nk below)
])
def test_repeated_plain_calls_on_new_data(shape, dtype, causal, rng):
    """A plain signature's repeated calls run the path its first call chose (cuflash._gpu.Repeat,
    its prepared run kept): each call on fresh arrays and values against the reference."""
    from cuflash import _gpu, _validate
    B, H, N, D = shape
    Nk = 4096 if N == 1 else N
    for step in range(3):
        q = randn(rng, (B, H, N, D), dtype)
        k, v = (randn(rng, (B, H // 4 if N == 1 else H, Nk, D), dtype) for _ in range(2))
        out, lse = cuflash.attention(q, k, v, causal=causal, return_lse=True)
        check_forward(out, lse, q, k, v, causal=causal)
        if N > 1:  # and the backward's kept run (the tensor-core backward's, where it takes it)
            dout = randn(rng, out.shape, dtype)
            grads = cuflash.attention_backward(dout, q, k, v, out, lse, causal=causal)
            check_backward(grads, dout, q, k, v, out, lse, causal=causal)
    p = _validate.make_problem(q, k, v, causal=causal)
    assert p.plain and p.key in _gpu._repeats


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
    assert _gpu.backward_path(_validate.make_problem(q, k, v, causal=True)) == "mma"
    out, lse = cuflash.attention(q, k, v, causal=True, return_lse=True)
    dout = randn(rng, out.shape, dtype)
    first = cuflash.attention_backward(dout, q, k, v, out, lse, causal=True, deterministic=True)
    second = cuflash.attention_backward(dout, q, k, v, out, lse, causal=True, deterministic=True)
    for a, b in zip(first, second):
        assert np.array_equal(to_host(a).view(np.uint16), to_host(b).view(np.uint16))
    check(q, k, v, rng, causal=True)


# (name, q leading dims, k/v leading dims, Nq, Nk, options): deterministic dQ in order
ORDER_CASES = [
    ("full", (2, 3), (2, 3), 700, 700, {}),
    ("causal", (2, 3), (2, 3), 700, 700, dict(causal=True)),
    ("causal-tl-long-k", (1, 2), (1, 2), 200, 900, dict(causal=True, align="top-left")),
    ("causal-br-long-k", (1, 2), (1, 2), 200, 900, dict(causal=True)),
    ("causal-br-long-q", (1, 2), (1, 2), 900, 300, dict(causal=True)),
    ("window", (2, 2), (2, 2), 800, 800, dict(window=(100, 50))),
    ("window-left-causal", (2, 2), (2, 2), 500, 800, dict(window=(200, None), causal=True)),
    ("kv_lens-causal", (3, 2), (3, 2), 500, 500, dict(kv_lens=np.array([[0], [137], [500]]),
                                                      causal=True)),
    ("positions-window", (2, 2), (2, 1), 300, 330, dict(window=(40, 5), positions=(1000, 990),
                                                        kv_lens=[[330], [77]])),
    ("gqa-causal", (2, 6), (2, 2), 600, 600, dict(causal=True)),
    # key block 0 sees no query, blocks 1 and 2 see every tile (a hang before: block 0's empty
    # range was taken for one that reaches the last tile)
    ("left-window-empty-block0", (1, 1), (1, 1), 26, 1301, dict(window=(127, None),
                                                                 kv_lens=[[309]])),
    # several waves of key blocks (256-640 blocks of 8 per head on ~132 multiprocessors): a wave
    # boundary splits a head, whose first blocks then wait for blocks launched a wave later
    ("waves-full", (5, 16), (5, 16), 1000, 1000, {}),
    ("waves-causal", (5, 16), (5, 16), 1000, 1000, dict(causal=True)),
    ("waves-window", (3, 16), (3, 16), 1000, 1000, dict(window=(300, 100))),
    ("waves-kv_lens-causal", (4, 16), (4, 16), 1000, 1000,
     dict(kv_lens=np.array([[1000], [3], [0], [777]]), causal=True)),
    ("waves-gqa-causal", (4, 24), (4, 8), 1000, 1000, dict(causal=True)),
]


@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("case", ORDER_CASES, ids=[c[0] for c in ORDER_CASES])
def test_deterministic_dq_in_key_block_order(case, D, rng):
    """deterministic=True on Hopper's bulk-dQ tiles (_mma_bwd.ordered_tile): the key blocks of a
    head add each query row's dQ in one order, each waiting for its turn (bwd_mma.cu dq_turn):
    causal and windowed heads latest-starting block first, the others in block order. Every
    order must match the blocks that really visit a tile (else a block waits forever, or two
    add at once): odd lengths, both alignments, windows, kv_lens (an empty head), positions and
    GQA in the kernel. Three runs give the same bits, and the gradients are the reference's."""
    from cuflash import _mma_bwd, _runtime, _validate
    name, qlead, kvlead, Nq, Nk, options = case
    dtype = "bfloat16" if BFLOAT16 is not None else "float16"
    q = randn(rng, qlead + (Nq, D), dtype)
    k, v = (randn(rng, kvlead + (Nk, D), dtype) for _ in range(2))
    if _runtime.wgmma_available():  # (elsewhere, and at D=64, the dq kernel: the same checks)
        p = _validate.make_problem(q, k, v, **options)
        assert _mma_bwd.prepare_backward(p, True).r.ordered == ((D, D) in _mma_bwd.ORDER_DIMS)
    out, lse = cuflash.attention(q, k, v, return_lse=True, **options)
    dout = randn(rng, out.shape, dtype)
    runs = [cuflash.attention_backward(dout, q, k, v, out, lse, deterministic=True, **options)
            for _ in range(3)]
    for name_g, *gs in zip(("dq", "dk", "dv"), *runs):
        assert all(np.array_equal(_bits(gs[0]), _bits(g)) for g in gs[1:]), (name, name_g)
    check_backward(runs[0], dout, q, k, v, out, lse, **options)


def test_deterministic_dq_beyond_one_block_per_multiprocessor(rng):
    """More key blocks per head than multiprocessors: the ordered dQ could wait on a block that
    is not resident, so the dq kernel takes it (ordered_tile), reproducible and right."""
    from cuflash import _mma_bwd, _runtime, _validate
    Nk = _runtime.device_info().sm_count * 128 + 5
    q = randn(rng, (1, 64, 128), "float16")
    k, v = (randn(rng, (1, Nk, 128), "float16") for _ in range(2))
    if _runtime.wgmma_available():
        assert not _mma_bwd.prepare_backward(_validate.make_problem(q, k, v), True).r.ordered
        shorter = _validate.make_problem(q, k[:, :Nk - 133], v[:, :Nk - 133])
        assert _mma_bwd.prepare_backward(shorter, True).r.ordered
    out, lse = cuflash.attention(q, k, v, return_lse=True)
    dout = randn(rng, out.shape, "float16")
    first, second = (cuflash.attention_backward(dout, q, k, v, out, lse, deterministic=True)
                     for _ in range(2))
    for a, b in zip(first, second):
        assert np.array_equal(_bits(a), _bits(b))
    check_backward(first, dout, q, k, v, out, lse)


# ---- the split-KV decode path and issue 12 ------------------------------------------------------

def _bits(x):
    """The raw bits of a device array, on the host (a bitwise comparison, NaN included)."""
    h = to_host(x)
    return h.view({2: np.uint16, 4: np.uint32, 8: np.uint64}[h.dtype.itemsize])


# (name, q lead, kv lead, Nq, Nk, D, options): both split into many partials on the automatic
# choice (decode_tc for 16-bit, decode_split for float32) and with override(path="split")
REPRO_CASES = [
    ("gqa-4-long", (1, 32), (1, 8), 1, 16384, 128, {}),
    ("gqa-4-nq3-causal", (2, 8), (2, 2), 3, 3000, 64, dict(causal=True)),
]


@pytest.mark.parametrize("dtype", ["float32"] + (["bfloat16"] if BFLOAT16 is not None else []))
@pytest.mark.parametrize("force", ["auto", "split"])
@pytest.mark.parametrize("case", REPRO_CASES, ids=[c[0] for c in REPRO_CASES])
def test_decode_forward_is_bitwise_reproducible(case, force, dtype, rng, override):
    """Issue 12, hole 6: decode_tc's key pools handed out stages by atomic tickets, so the
    partials (and the merge) changed from call to call: 19 of 19 repeated calls differed bitwise
    from the first. The pools are gone; ten calls of one problem must give identical bits."""
    from cuflash import _decode, _gpu, _validate
    override(path=None if force == "auto" else force)
    _, lq, lkv, Nq, Nk, D, options = case
    q = randn(rng, lq + (Nq, D), dtype)
    k, v = (randn(rng, lkv + (Nk, D), dtype) for _ in range(2))
    p = _validate.make_problem(q, k, v, **options)
    assert _gpu.forward_path(p) == "split"
    split = None if force == "auto" else _decode.FORCED_SPLIT_KEYS
    assert _decode.Plan(p, split=split).split_any  # the merge runs
    first = [_bits(x) for x in cuflash.attention(q, k, v, return_lse=True, **options)]
    for _ in range(9):
        again = cuflash.attention(q, k, v, return_lse=True, **options)
        for a, b in zip(first, again):
            assert np.array_equal(a, _bits(b))
    check(q, k, v, rng, backward=False, **options)


@pytest.mark.parametrize("scale", [0.0, -0.3])
@pytest.mark.parametrize("force", ["auto", "split"])
def test_decode_zero_and_negative_scale(scale, force, rng, override):
    """Issue 12, hole 5: decode_tc folds the scale into one FFMA on maxima of the unscaled
    scores, which needs scale > 0 (scale 0: a masked -inf score times 0 is NaN; a negative scale
    makes the max the min). bf16, Nq = 5, Nk = 604, GQA 6/2, causal gave output errors of 0.08
    (automatic) and 0.029 (forced small splits), 10x the tolerance. _decode.tc_fits now refuses
    scale <= 0, and decode_split (q pre-multiplied by the scale) answers."""
    from cuflash import _decode, _gpu, _validate
    override(path=None if force == "auto" else force)
    dtype = "bfloat16" if BFLOAT16 is not None else "float16"
    q = randn(rng, (2, 6, 5, 128), dtype)
    k, v = (randn(rng, (2, 2, 604, 128), dtype) for _ in range(2))
    p = _validate.make_problem(q, k, v, scale=scale, causal=True)
    assert _gpu.forward_path(p) == "split" and not _decode.tc_fits(p)
    check(q, k, v, rng, backward=False, scale=scale, causal=True)


def _compare_rows(out, lse, ref, naive, rows, dtype):
    """out / lse of the selected (batch, head, query) rows against the float64 reference, within
    2x the same-dtype naive baseline (assert_close_to_reference)."""
    floor = FLOORS[np.dtype(dtype).name]
    for name, got, r, n in (("out", out, ref[0], naive[0]), ("lse", lse, ref[1], naive[1])):
        assert_close_to_reference(to_host(got).astype(np.float64)[rows], r[rows], n[rows], floor,
                                  name)


@pytest.mark.parametrize("dtype", ["float32"] + (["bfloat16"] if BFLOAT16 is not None else []))
@pytest.mark.parametrize("force", ["auto", "split", "split-simt"])
def test_decode_non_finite_rows(force, dtype, rng, override):
    """Issue 12, hole 2 on the decode path: non-finite values came out as empty rows (out 0, lse
    -inf): a block decided "empty" by !(l > 0) (NaN l included) or dropped a row's chunk whose
    max was not > -inf, and the merge dropped NaN partials. Now only a row with no visible key is
    empty. Rows: a NaN in one key (its kv head's rows: NaN out and lse); float32 logits that
    overflow to -inf on the first 300 keys, finite after (those partials are identities: the
    finite answer); every visible logit -inf (NaN, NaN, not empty); q = 0 (uniform); kv_lens 0
    (empty); keys past kv_lens all NaN (never read)."""
    from cuflash import _gpu, _validate
    override(path=None if force == "auto" else force)
    B, H, Hkv, Nk, D = 3, 8, 2, 1500, 128   # query heads 0-3 read kv head 0, heads 4-7 kv head 1
    qh = rng.standard_normal((B, H, 1, D))
    kh, vh = rng.standard_normal((B, Hkv, Nk, D)), rng.standard_normal((B, Hkv, Nk, D))
    kv_lens = np.array([[Nk], [1200], [0]])
    kh[1, :, 1200:] = vh[1, :, 1200:] = np.nan
    kh[2] = vh[2] = np.nan
    kh[0, 0, 700, 5] = np.nan                 # batch 0, heads 0-3: NaN
    kh[0, 1, :300] = -3e38                    # batch 0, heads 4-5: q.k = -inf, then finite
    qh[0, 4:6] = 1.0
    qh[0, 6:8] = 0.0                          # batch 0, heads 6-7: uniform
    kh[1, 0, :1200] = -3e38                   # batch 1, heads 0-1: every logit -inf
    qh[1, 0:2] = 1.0
    qh[1, 2:4] = 0.0                          # batch 1, heads 2-3: uniform
    q, k, v = (to_device(x, dtype_of(dtype)) for x in (qh, kh, vh))
    assert _gpu.forward_path(_validate.make_problem(q, k, v, kv_lens=kv_lens)) == "split"
    out, lse = cuflash.attention(q, k, v, kv_lens=kv_lens, return_lse=True)
    nan = np.zeros((B, H, 1), dtype=bool)
    nan[0, 0:4] = nan[1, 0:2] = True
    o64, l64 = to_host(out).astype(np.float64), to_host(lse).astype(np.float64)
    assert np.isnan(o64[nan]).all() and np.isnan(l64[nan]).all()
    # the other rows against the reference on inputs with the NaNs (never seen by them) zeroed
    kc, vc = (np.nan_to_num(to_host(x).astype(np.float64), nan=0.0).astype(to_host(x).dtype)
              for x in (k, v))
    ref = reference.attention(to_host(q), kc, vc, kv_lens=kv_lens, return_lse=True)
    naive = naive_attention(to_host(q), kc, vc, kv_lens=kv_lens)
    _compare_rows(out, lse, ref, naive, ~nan, dtype)
    assert np.all(o64[2] == 0) and np.all(l64[2] == -np.inf)


@pytest.mark.parametrize("dtype", ["float32"] + (["bfloat16"] if BFLOAT16 is not None else []))
@pytest.mark.parametrize("force", ["auto", "split"])
def test_decode_padding_bias_is_uniform_not_empty(force, dtype, rng, override):
    """Issue 12 on decode_split with a bias: logits went to base 2 as bias * log2(e), which is
    -inf for a finite bias of finfo(float32).min, so a padding row made of such a bias (every
    logit finfo.min) came out empty (0, -inf) instead of a uniform softmax over its visible keys
    (out = their mean, lse finite). The bias path now works in natural units and merges the
    partials' (max, sum) pairs, which keeps the keys' counts where lse = m + log l rounds to m.
    Also: a NaN bias entry on a visible key makes its row NaN; a row whose every bias is -inf
    is empty."""
    import cupy
    from cuflash import _gpu, _validate
    override(path=None if force == "auto" else force)
    q = randn(rng, (2, 4, 2, 64), dtype)
    k, v = (randn(rng, (2, 2, 900, 64), dtype) for _ in range(2))
    bias = rng.standard_normal((2, 4, 2, 900)).astype(np.float32)
    bias[0, 1, 0] = np.finfo(np.float32).min  # the padding row
    bias[0, 1, 0, ::7] = -np.inf              # ... over a subset of the keys
    bias[1, 2, 1, 450] = np.nan               # a NaN row
    bias[1, 3, 0] = -np.inf                   # an empty row
    p = _validate.make_problem(q, k, v, bias=cupy.asarray(bias))
    assert _gpu.forward_path(p) == "split"
    out, lse = cuflash.attention(q, k, v, bias=cupy.asarray(bias), return_lse=True)
    o64, l64 = to_host(out).astype(np.float64), to_host(lse).astype(np.float64)
    assert np.isnan(o64[1, 2, 1]).all() and np.isnan(l64[1, 2, 1])
    assert np.all(o64[1, 3, 0] == 0) and l64[1, 3, 0] == -np.inf
    qh, kh, vh = (to_host(x) for x in (q, k, v))
    seen = bias[0, 1, 0] > -np.inf
    assert np.isfinite(l64[0, 1, 0])
    np.testing.assert_allclose(o64[0, 1, 0], vh[0, 0][seen].astype(np.float64).mean(0),
                               rtol=0, atol=2 * FLOORS[np.dtype(dtype).name])
    rows = np.ones((2, 4, 2), dtype=bool)
    rows[1, 2, 1] = False
    clean = np.where(np.isnan(bias), 0.0, bias).astype(np.float32)
    ref = reference.attention(qh, kh, vh, bias=clean, return_lse=True)
    naive = naive_attention(qh, kh, vh, bias=clean)
    _compare_rows(out, lse, ref, naive, rows, dtype)


@pytest.mark.parametrize("force", ["auto", "split"])
def test_decode_huge_float16_logits(force, rng, override):
    """Issue 12, hole 4 on decode_tc: its exp2(fma(s, scale * log2(e), -m)) has a residual up to
    ulp(m) / 2 where m is the rounded max: with float16 entries of magnitude 2^15 the logits
    reach ~1e9 in base 2, the residual exceeds 128 and exp2 overflows (inf, then NaN). A step
    where some row's |m| > 2^16 now takes explicitly rounded logits (p <= 1). Entries are
    +-2^15, so every product (2^30) and every dot product on the tensor cores is exact, and the
    keys that tie at the max share the softmax (the rest are ~1e8 below it). (decode_split has no
    fold; its pre-scaled q would round these dot products and break the ties at random.)"""
    from cuflash import _decode, _gpu, _validate
    override(path=None if force == "auto" else force)
    sign = lambda shape: np.where(rng.random(shape) < 0.5, -1.0, 1.0)  # noqa: E731
    q = to_device(sign((2, 8, 2, 128)) * 2.0 ** 15, np.float16)
    k = to_device(sign((2, 2, 1500, 128)) * 2.0 ** 15, np.float16)
    v = randn(rng, (2, 2, 1500, 128), "float16")
    p = _validate.make_problem(q, k, v)
    assert _gpu.forward_path(p) == "split" and _decode.tc_fits(p)
    out, lse = cuflash.attention(q, k, v, return_lse=True)
    qh, kh, vh = (to_host(x) for x in (q, k, v))
    ref_out, ref_lse = reference.attention(qh, kh, vh, return_lse=True)
    # the baseline: the exact result rounded to float16 (a naive float16 computation overflows)
    rounded = ref_out.astype(np.float16).astype(np.float64)
    assert_close_to_reference(out, ref_out, rounded, FLOORS["float16"], "out")
    # lse ~ 1e9: float32 holds it to a relative 2^-24 per rounding
    lse64 = to_host(lse).astype(np.float64)
    assert np.all(np.abs(lse64 - ref_lse) <= 2.0 ** -20 * np.abs(ref_lse))


def test_threads_on_one_stream_share_no_scratch(rng):
    """Two threads calling the backward (four launches per call) and the split decode on one
    stream at once: their calls' launches interleave on the stream, so the scratch a thread's
    calls reuse (_runtime.stream_scratch, the decode counters) is that thread's own. Every call
    gives the bits of a call made alone (the backward deterministic)."""
    import threading

    import cupy
    q, k, v, dout = (to_array(cupy, rng.standard_normal((2, 4, 256, 64)), np.float16)
                     for _ in range(4))
    qd, kd, vd = (to_array(cupy, rng.standard_normal(s), np.float16)
                  for s in ((1, 32, 1, 128), (1, 8, 16384, 128), (1, 8, 16384, 128)))
    out, lse = cuflash.attention(q, k, v, causal=True, return_lse=True)

    def calls():
        return (cuflash.attention_backward(dout, q, k, v, out, lse, causal=True,
                                           deterministic=True)
                + (cuflash.attention(qd, kd, vd),))

    want = [to_host(x) for x in calls()]
    got, start = [], threading.Barrier(2)

    def worker():
        start.wait()
        mine = [calls() for _ in range(20)]
        cupy.cuda.get_current_stream().synchronize()
        got.extend(mine)

    threads = [threading.Thread(target=worker) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) == 40
    for result in got:
        for x, w in zip(result, want):
            assert np.array_equal(to_host(x), w)
