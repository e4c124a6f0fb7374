"""Attention sinks (``sinks=``): the reference against its definition and finite differences, the
NumPy path and the CUDA paths against the reference (forward and backward, dsinks included), the
edge values (-inf is no sink, NaN and +inf, empty rows), lost rows with huge logits, and the
validation.

With t the sink of a row's head: L = log(sum_j exp(s_j) + exp(t)), out = sum_j exp(s_j - L) v_j,
and dsinks = -sum_i exp(t - L_i) rowsum(dout * out)_i.
"""
import numpy as np
import pytest

import cuflash
from cuflash import _config, reference
from helpers import (BFLOAT16, call_public, check_backward, check_forward, decode_options,
                     dtype_of, naive_attention, numeric_gradient, to_array, to_f64, to_host)
from test_softcap import CASES, DECODE_CASES, DTYPES, GPU_CASES, _options


def _inputs(rng, lq, lkv, Nq, Nk, Dk, Dv, dtype, xp=np):
    shapes = (lq + (Nq, Dk), lkv + (Nk, Dk), lkv + (Nk, Dv))
    return [to_array(xp, rng.standard_normal(s), dtype_of(dtype)) for s in shapes]


def _sinks(rng, lead, dtype, per_batch=False, xp=np):
    """Sink logits near the rows' lse (so that they take a fair share), in the accumulator dtype
    of inputs of ``dtype`` (dsinks has sinks' dtype): one per head, or one per (batch, head)."""
    shape = lead if per_batch else lead[-1:]
    acc = _config.accumulator_dtype(dtype_of(dtype))
    return xp.asarray((rng.standard_normal(shape) + 2.0).astype(acc))


def _dense(q, k, v, t, scale, bias=None):
    """The definition, written out: softmax over the keys and one more column of logit t, value
    0 (t per head, broadcast over the batch and the rows)."""
    s = scale * q @ np.swapaxes(k, -1, -2) + (0 if bias is None else bias)
    col = np.broadcast_to(np.asarray(t)[..., None, None], s.shape[:-1] + (1,))
    x = np.concatenate([s, col], axis=-1)
    w = np.exp(x - x.max(-1, keepdims=True))
    vals = np.concatenate([np.broadcast_to(v, s.shape[:-2] + v.shape[-2:]),
                           np.zeros(s.shape[:-2] + (1, v.shape[-1]))], axis=-2)
    out = (w / w.sum(-1, keepdims=True)) @ vals
    return out, np.log(np.exp(x).sum(-1))


def _backward(dout, q, k, v, out, lse, fn, **opts):
    """cuflash's or the reference's (dq, dk, dv, dsinks)."""
    if fn == "cuflash":
        return cuflash.attention_backward(dout, q, k, v, out, lse, **opts)
    return reference.attention_backward(dout, q, k, v, out, lse, **opts)


# ---- the reference ----------------------------------------------------------------------------

def test_reference_is_the_definition(rng):
    q, k, v = (rng.standard_normal(s) for s in ((2, 3, 9, 4), (2, 3, 11, 4), (2, 3, 11, 3)))
    bias = rng.standard_normal((9, 11))
    t = np.array([0.5, 3.0, -2.0])
    out, lse = reference.attention(q, k, v, scale=0.7, bias=bias, sinks=t, return_lse=True)
    want_out, want_lse = _dense(q, k, v, t, 0.7, bias)
    np.testing.assert_allclose(out, want_out, rtol=1e-13, atol=1e-14)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-13)
    # the sink only lowers the keys' weights: out = out0 * exp(lse0 - L)
    out0, lse0 = reference.attention(q, k, v, scale=0.7, bias=bias, return_lse=True)
    np.testing.assert_allclose(out, out0 * np.exp(lse0 - lse)[..., None], rtol=1e-12)
    assert (lse > lse0).all()


def test_reference_empty_rows_are_the_sink(rng):
    """A row that sees no key is out 0, lse = its sink (Nk = 0, masked rows)."""
    q, k, v = (rng.standard_normal(s) for s in ((3, 5, 4), (3, 6, 4), (3, 6, 2)))
    t = np.array([1.5, -0.5, 4.0])
    mask = np.ones((5, 6), bool)
    mask[2] = False
    for kk, vv, m, rows in ((k, v, mask, [2]), (k[:, :0], v[:, :0], None, range(5))):
        out, lse = reference.attention(q, kk, vv, mask=m, sinks=t, return_lse=True)
        for i in rows:
            np.testing.assert_array_equal(out[:, i], 0)
            np.testing.assert_array_equal(lse[:, i], t)


@pytest.mark.parametrize("fn", ["reference", "cuflash"])
def test_gradients_match_finite_differences(fn, rng):
    """dq, dk, dv and dsinks, with a (H,) sink broadcast over the batch (and mask, causal,
    softcap), against central differences of sum(out * dout) in float64."""
    q, k, v = (rng.standard_normal(s) for s in ((2, 2, 5, 3), (2, 2, 7, 3), (2, 2, 7, 2)))
    t = np.array([0.3, 1.2])
    mask = rng.random((5, 7)) < 0.8
    opts = dict(softcap=2.0, mask=mask, causal=True, align="top-left", scale=0.9)
    attention = cuflash.attention if fn == "cuflash" else reference.attention
    out, lse = attention(q, k, v, sinks=t, return_lse=True, **opts)
    dout = rng.standard_normal(out.shape)
    grads = _backward(dout, q, k, v, out, lse, fn, sinks=t, **opts)
    assert len(grads) == 4 and grads[3].shape == t.shape
    for x, g in zip((q, k, v, t), grads):
        num = numeric_gradient(lambda: (attention(q, k, v, sinks=t, **opts) * dout).sum(), x)
        np.testing.assert_allclose(g, num, rtol=1e-6, atol=1e-8)


# ---- the NumPy path ---------------------------------------------------------------------------

@pytest.mark.parametrize("softcap", [None, 2.5])
@pytest.mark.parametrize("per_batch", [False, True], ids=["per-head", "per-batch-head"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_numpy_path(case, dtype, per_batch, softcap, rng):
    """Every option with sinks (causal GQA, window and kv_lens, mask and bias with an empty
    row), each dtype, against the reference within 2x a same-dtype naive implementation."""
    name, lq, lkv, Nq, Nk, Dk, Dv = case
    q, k, v = _inputs(rng, lq, lkv, Nq, Nk, Dk, Dv, dtype)
    opts = dict(_options(name, rng, lq, Nq, Nk), softcap=softcap,
                sinks=_sinks(rng, lq, dtype, per_batch))
    out, lse = cuflash.attention(q, k, v, return_lse=True, **opts)
    check_forward(out, lse, q, k, v, **opts)
    dout = to_array(np, rng.standard_normal(out.shape), dtype_of(dtype))
    grads = cuflash.attention_backward(dout, q, k, v, out, lse, **opts)
    assert grads[3].shape == opts["sinks"].shape and grads[3].dtype == opts["sinks"].dtype
    check_backward(grads, dout, q, k, v, out, lse, **opts)
    out2, vjp = cuflash.attention_vjp(q, k, v, **opts)
    np.testing.assert_array_equal(out2, out)
    for a, b in zip(vjp(dout), grads, strict=True):
        np.testing.assert_array_equal(a, b)


def test_minus_inf_is_no_sink(rng):
    """sinks = -inf (a number, or an array) gives bitwise the call without sinks, and dsinks 0."""
    q, k, v = _inputs(rng, (2,), (2,), 20, 30, 8, 8, "float32")
    mask = rng.random((20, 30)) < 0.5
    mask[4] = False  # an empty row: out 0, lse -inf as without sinks
    out, lse = cuflash.attention(q, k, v, mask=mask, return_lse=True)
    dout = rng.standard_normal(out.shape).astype(np.float32)
    plain = cuflash.attention_backward(dout, q, k, v, out, lse, mask=mask)
    for t in (-np.inf, np.full(2, -np.inf, np.float32)):
        out_t, lse_t = cuflash.attention(q, k, v, mask=mask, sinks=t, return_lse=True)
        np.testing.assert_array_equal(out_t, out)
        np.testing.assert_array_equal(lse_t, lse)
        *grads, dsinks = cuflash.attention_backward(dout, q, k, v, out, lse, mask=mask, sinks=t)
        for a, b in zip(grads, plain):
            np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(dsinks, np.zeros(np.shape(t)))


def test_empty_rows(rng):
    """A row that sees no key gives out 0 and lse = the sink (0 and -inf for a -inf sink), and
    no gradient; Nk = 0 and zero-sized batches too."""
    q, k, v = _inputs(rng, (3,), (3,), 6, 9, 4, 4, "float64")
    t = np.array([1.0, -np.inf, 2.0])
    mask = np.ones((6, 9), bool)
    mask[1] = False
    out, lse = cuflash.attention(q, k, v, mask=mask, sinks=t, return_lse=True)
    np.testing.assert_array_equal(out[:, 1], 0)
    np.testing.assert_array_equal(lse[:, 1], t)
    check_forward(out, lse, q, k, v, mask=mask, sinks=t)
    dout = rng.standard_normal(out.shape)
    grads = cuflash.attention_backward(dout, q, k, v, out, lse, mask=mask, sinks=t)
    check_backward(grads, dout, q, k, v, out, lse, mask=mask, sinks=t)
    np.testing.assert_array_equal(grads[0][:, 1], 0)
    out, lse = cuflash.attention(q, k[:, :0], v[:, :0], sinks=t, return_lse=True)
    np.testing.assert_array_equal(out, 0)
    np.testing.assert_array_equal(lse, np.broadcast_to(t[:, None], lse.shape))
    grads = cuflash.attention_backward(dout, q, k[:, :0], v[:, :0], out, lse, sinks=t)
    np.testing.assert_array_equal(grads[3], 0)
    out, lse = cuflash.attention(q[:0], k[:0], v[:0], sinks=2.0, return_lse=True)
    assert out.shape == (0, 6, 4) and lse.shape == (0, 6)


def test_nan_and_inf_sinks(rng):
    """A NaN sink, and a +inf one (a +inf logit), make every row of their head NaN, empty rows
    included; the other heads are as with finite sinks."""
    q, k, v = _inputs(rng, (3,), (3,), 7, 8, 4, 4, "float32")
    mask = np.ones((7, 8), bool)
    mask[0] = False
    finite = np.array([0.5, 1.0, 1.5], np.float32)
    for bad in (np.nan, np.inf):
        t = finite.copy()
        t[1] = bad
        out, lse = cuflash.attention(q, k, v, mask=mask, sinks=t, return_lse=True)
        ref_out, ref_lse = reference.attention(q, k, v, mask=mask, sinks=t, return_lse=True)
        assert np.isnan(out[1]).all() and np.isnan(lse[1]).all()
        assert np.isnan(ref_out[1]).all() and np.isnan(ref_lse[1]).all()
        good, good_lse = cuflash.attention(q, k, v, mask=mask, sinks=finite, return_lse=True)
        np.testing.assert_array_equal(out[[0, 2]], good[[0, 2]])
        np.testing.assert_array_equal(lse[[0, 2]], good_lse[[0, 2]])
        dout = np.ones_like(out)
        dsinks = cuflash.attention_backward(dout, q, k, v, out, lse, mask=mask, sinks=t)[3]
        assert np.isnan(dsinks[1]) and np.isfinite(dsinks[[0, 2]]).all()


def test_an_overflowed_row_stays_nan(rng):
    """A row whose visible logits are all -inf (a float32 overflow) is NaN without a sink, and
    stays NaN with one (README "Attention sinks"); so is the dense formula computed in float32
    (the reference's own float64 does not overflow there)."""
    q = np.array([[1e20, 1e20], [1.0, 0.0]], np.float32)
    k = np.array([[-1e20, -1e20], [-1e20, -1e20]], np.float32)
    v = np.ones((2, 3), np.float32)
    for fn in (cuflash.attention, naive_attention):
        out, lse = fn(q, k, v, scale=1.0, sinks=0.5, return_lse=True)
        assert np.isnan(out[0]).all() and np.isnan(lse[0])
        assert np.isfinite(out[1]).all() and np.isfinite(lse[1])


def test_each_call_gets_its_own_sinks(rng):
    """Calls of one signature (a number, an array) with other sink values: each its own."""
    q, k, v = _inputs(rng, (2,), (2,), 9, 12, 8, 8, "float64")
    for t in (0.0, 3.0, np.array([1.0, -1.0]), np.array([-2.0, 4.0])):
        out, lse = cuflash.attention(q, k, v, sinks=t, return_lse=True)
        want, want_lse = reference.attention(q, k, v, sinks=t, return_lse=True)
        np.testing.assert_allclose(out, want, rtol=1e-12, atol=1e-14)
        np.testing.assert_allclose(lse, want_lse, rtol=1e-12)
    grads = cuflash.attention_backward(out, q, k, v, out, lse, sinks=np.float16(1.0))
    assert grads[3].shape == () and grads[3].dtype == np.float64  # the accumulator's


def test_vjp_keeps_the_forwards_sinks(rng):
    """vjp returns (dq, dk, dv, dsinks) for the sinks of its forward, even if the caller's array
    changes after it."""
    q, k, v = _inputs(rng, (2, 2), (2, 1), 6, 10, 4, 4, "float64")
    t = np.array([0.5, 1.5])
    out, vjp = cuflash.attention_vjp(q, k, v, sinks=t, causal=True)
    want = cuflash.attention_backward(np.ones_like(out), q, k, v, *cuflash.attention(
        q, k, v, sinks=t, causal=True, return_lse=True), sinks=t, causal=True)
    t[:] = 9.0
    got = vjp(np.ones_like(out))
    assert len(got) == 4 and got[3].shape == (2,)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)


# ---- lost rows ---------------------------------------------------------------------------------

def _huge_logits(rng, dtype, how, xp=np, lq=(2, 2), Nq=40, Nk=60, D=16):
    """Inputs whose logits reach |s| ~ 1e4 (float32 accumulation) or ~ 3e7 (float64), by a
    huge scale (q.k itself) or by one huge bias offset: every row's |lse| is beyond
    cuflash._config.LOST_LSE, so the backward recomputes them all; and sinks as large as the
    rows' lse (one per batch and head), so that they take a fair share of every row."""
    acc = _config.accumulator_dtype(dtype_of(dtype))
    big = 3e3 if acc == np.float32 else 3e7
    q, k, v = _inputs(rng, lq, lq, Nq, Nk, D, D, dtype, xp)
    if how == "scale":
        opts = dict(scale=big)
    else:
        opts = dict(bias=xp.asarray((rng.standard_normal((Nq, Nk)) - 3 * big).astype(acc)))
    lse0 = to_f64(cuflash.attention(q, k, v, return_lse=True, **opts)[1])
    assert (np.abs(lse0) >= _config.lost_lse_limit(acc)).all()
    return q, k, v, dict(opts, sinks=xp.asarray(np.median(lse0, axis=-1)))


def _check_huge_forward(out, lse, q, k, v, **opts):
    """The forward of huge logits against the reference: within 2x a naive implementation of the
    same dtype, where that has an error; for float64 within eps·|lse| (the join reads the
    sink-free lse, whose rounding there is that of the logits themselves)."""
    if np.dtype(q.dtype) != np.float64:
        check_forward(out, lse, q, k, v, **opts)
        return
    ref_out, ref_lse = reference.attention(*(to_host(x) for x in (q, k, v)), return_lse=True,
                                           **{n: to_host(x) for n, x in opts.items()})
    limit = np.finfo(np.float64).eps * np.abs(ref_lse).max()
    np.testing.assert_allclose(to_f64(out), ref_out, rtol=0, atol=limit)
    np.testing.assert_allclose(to_f64(lse), ref_lse, rtol=0, atol=limit)


@pytest.mark.parametrize("how", ["scale", "bias"])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_lost_rows_take_the_sink(dtype, how, rng):
    """The lost-row recomputation of the backward puts the sink into each row's sum: the
    gradients (dsinks included) are the reference's, which would miss by the sink's share
    without it."""
    if (dtype, how) == ("float64", "scale"):
        pytest.skip("gradients of 1e8 against the float64 floor: the bias case covers float64")
    q, k, v, opts = _huge_logits(rng, dtype, how)
    out, lse = cuflash.attention(q, k, v, return_lse=True, **opts)
    _check_huge_forward(out, lse, q, k, v, **opts)
    share = np.exp(opts["sinks"][..., None] - to_f64(lse))
    assert np.median(share) > 0.05  # the sink matters in these rows
    dout = to_array(np, rng.standard_normal(out.shape), dtype_of(dtype))
    grads = cuflash.attention_backward(dout, q, k, v, out, lse, **opts)
    check_backward(grads, dout, q, k, v, out, lse, **opts)


# ---- validation ---------------------------------------------------------------------------------

BAD_SINKS = [(True, TypeError), (1 + 2j, TypeError), ([1.0, 2.0], TypeError), ("1", TypeError),
             (np.array([True, False]), TypeError), (np.array([1 + 1j, 2]), TypeError),
             (np.zeros(3), ValueError), (np.zeros((2, 2, 1)), ValueError),
             (np.zeros((3, 2)), ValueError)]


@pytest.mark.parametrize("fn", ["attention", "attention_backward", "attention_vjp"])
@pytest.mark.parametrize("value, error", BAD_SINKS,
                         ids=[f"{type(v).__name__}-{np.shape(v)}" for v, _ in BAD_SINKS])
def test_bad_sinks_are_refused(fn, value, error, rng):
    q, k, v = _inputs(rng, (2, 2), (2, 2), 4, 5, 8, 8, "float32")
    with pytest.raises(error, match=f"^{fn}: sinks"):
        call_public(fn, q, k, v, sinks=value)
    with pytest.raises(error, match="^attention: sinks"):  # the reference's checks are the same
        reference.attention(q, k, v, sinks=value)


def test_good_sinks_are_taken(rng):
    """Numbers, integer arrays, 16-bit arrays, (H,), (B, H), (1, H), 0-d arrays."""
    q, k, v = _inputs(rng, (2, 3), (2, 3), 4, 5, 8, 8, "float32")
    for t in (1, 2.5, np.float32(1.0), np.arange(3), np.ones(3, np.float16), np.ones((2, 3)),
              np.ones((1, 3)), np.array(0.5)) + ((np.ones(3, BFLOAT16),) if BFLOAT16 else ()):
        out, lse = cuflash.attention(q, k, v, sinks=t, return_lse=True)
        check_forward(out, lse, q, k, v, sinks=t)
        dsinks = cuflash.attention_backward(out, q, k, v, out, lse, sinks=t)[3]
        assert dsinks.shape == np.shape(t)
        float_array = isinstance(t, np.ndarray) and t.dtype.kind != "i"
        assert dsinks.dtype == (t.dtype if float_array else np.float32)


# ---- the CUDA paths ---------------------------------------------------------------------------

# (forced path, case, its options) of the GPU runs: the softcap tests' cases on the main paths
# (wgmma, mma and wide join the sinks in their kernels, generic after them), and their decode
# cases on the split-KV kernels (forced, many splits)
GPU_RUNS = ([(path, case, _options) for path in ("generic", "mma", "wgmma", "wide", "auto")
             for case in GPU_CASES]
            + [(path, case, decode_options) for path in ("split", "split-simt")
               for case in DECODE_CASES])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("path, case, options", GPU_RUNS,
                         ids=[f"{p}-{c[0]}-nq{c[3]}-d{c[5]}x{c[6]}" for p, c, _ in GPU_RUNS])
def test_cuda_paths(path, case, options, dtype, rng, override):
    """Sinks on every CUDA path (forced as the softcap tests force them), per head or per batch
    and head, with a softcap on the cases of head dims that are multiples of 64: the forward,
    and both backward modes."""
    import cupy
    name, lq, lkv, Nq, Nk, Dk, Dv = case
    override(poison=True, path=None if path == "auto" else path)
    q, k, v = _inputs(rng, lq, lkv, Nq, Nk, Dk, Dv, dtype, cupy)
    opts = dict(options(name, rng, lq, Nq, Nk, cupy),
                sinks=_sinks(rng, lq, dtype, Nq % 2 == 0, cupy),
                softcap=2.5 if Dk % 64 == 0 else None)
    out, lse = cuflash.attention(q, k, v, return_lse=True, **opts)
    check_forward(out, lse, q, k, v, **opts)
    dout = to_array(cupy, rng.standard_normal(out.shape), dtype_of(dtype))
    for deterministic in (False, True):
        grads = cuflash.attention_backward(dout, q, k, v, out, lse, deterministic=deterministic,
                                           **opts)
        assert isinstance(grads[3], cupy.ndarray) and grads[3].shape == opts["sinks"].shape
        check_backward(grads, dout, q, k, v, out, lse, **opts)


@pytest.mark.gpu
@pytest.mark.parametrize("how", ["scale", "bias"])
@pytest.mark.parametrize("path", ["generic", "mma", "wgmma", "wide", "auto"])
@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
def test_cuda_lost_rows_take_the_sink(dtype, path, how, rng, override):
    """The lost-row kernels (kernels_cu/lost_rows.cu) put the sink into each lost row's sum and
    give its exact probability to dsinks, on every backward path; in the forward, fwd_lost_rows
    joins the sink to the rows it recomputes (float16 "scale": every row of the tensor-core
    forwards), as their kernels joined it to the others."""
    import cupy
    if (dtype, how) == ("float64", "scale"):
        pytest.skip("gradients of 1e8 against the float64 floor: the bias case covers float64")
    override(poison=True, path=None if path == "auto" else path)
    q, k, v, opts = _huge_logits(rng, dtype, how, cupy, Nq=70, Nk=90, D=64)
    out, lse = cuflash.attention(q, k, v, return_lse=True, **opts)
    dout = to_array(cupy, rng.standard_normal(out.shape), dtype_of(dtype))
    _check_huge_forward(out, lse, q, k, v, **opts)
    for deterministic in (False, True):
        grads = cuflash.attention_backward(dout, q, k, v, out, lse, deterministic=deterministic,
                                           **opts)
        check_backward(grads, dout, q, k, v, out, lse, **opts)


@pytest.mark.gpu
def test_cuda_edge_values(rng, override):
    """On the GPU too: -inf is bitwise no sink, NaN makes its head NaN, an empty row is the
    sink; a number sink and a CuPy one on another stream's call."""
    import cupy
    override(poison=True)
    q, k, v = _inputs(rng, (3,), (3,), 30, 40, 64, 64, "float16", cupy)
    mask = cupy.ones((30, 40), dtype=bool)
    mask[2] = False
    out, lse = cuflash.attention(q, k, v, mask=mask, return_lse=True)
    out_t, lse_t = cuflash.attention(q, k, v, mask=mask, sinks=-np.inf, return_lse=True)
    assert bool((out_t.view(cupy.uint16) == out.view(cupy.uint16)).all())
    assert bool((lse_t == lse).all())
    t = cupy.asarray([0.5, np.nan, 2.0])
    out, lse = cuflash.attention(q, k, v, mask=mask, sinks=t, return_lse=True)
    assert np.isnan(to_f64(out)[1]).all() and np.isnan(to_host(lse)[1]).all()
    np.testing.assert_array_equal(to_host(out)[[0, 2], 2].astype(np.float64), 0)
    np.testing.assert_array_equal(to_host(lse)[[0, 2], 2], [0.5, 2.0])
    rows = np.arange(3) != 1
    check_forward(out[rows], lse[rows], q[rows], k[rows], v[rows], mask=mask, sinks=t[rows])
    out, lse = cuflash.attention(q, k, v, sinks=1.25, return_lse=True)
    check_forward(out, lse, q, k, v, sinks=1.25)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_cuda_bnhd_layout(dtype, rng, override):
    """(B, N, H, D) memory seen as (B, H, N, D) views, and a strided dout: the join and the row
    sums that do not read contiguous rows (cuflash/_sinks.py's elementwise forms) agree with the
    reference as the contiguous ones do."""
    import cupy
    override(poison=True)
    B, H, Nq, Nk, D = 2, 3, 40, 56, 64
    dt = dtype_of(dtype)
    q, k, v = (to_array(cupy, rng.standard_normal((B, n, H, D)), dt).transpose(0, 2, 1, 3)
               for n in (Nq, Nk, Nk))
    opts = dict(sinks=cupy.asarray(rng.standard_normal(H)), causal=True)
    out, lse = cuflash.attention(q, k, v, return_lse=True, **opts)
    check_forward(out, lse, q, k, v, **opts)
    dout = to_array(cupy, rng.standard_normal((B, Nq, H, D)), dt).transpose(0, 2, 1, 3)
    grads = cuflash.attention_backward(dout, q, k, v, out, lse, **opts)
    check_backward(grads, dout, q, k, v, out, lse, **opts)


# ---- the forward kernels that join the sinks themselves (SINKS) --------------------------------

def test_catalog_has_the_sinks_twin_of_every_fused_forward():
    """The paths whose kernels join the sinks (SINKS) list, for each forward instantiation, its
    twin with the last template argument SINKS = true (and only those): what their forwards
    request with sinks, which CI compiles."""
    from cuflash import _gpu

    def arguments(expr):  # the top-level template arguments of a name expression
        args, depth, start = [], 0, expr.index("<") + 1
        for i, c in enumerate(expr[start:-1], start):
            depth += (c == "<") - (c == ">")
            if c == "," and depth == 0:
                args.append(expr[start:i].strip())
                start = i + 1
        return tuple(args + [expr[start:-1].strip()])

    fused = [p for p in _gpu.FORWARD if p.SINKS]
    assert sorted(p.NAME for p in fused) == ["mma", "wgmma", "wide"]
    with_sinks = {"fwd_mma": 13, "fwd_wide": 11, "fwd_wgmma": 13}  # arguments, SINKS last
    for path in fused:
        kernel = f"fwd_{path.NAME}"
        # (dropout: tests/test_dropout.py; the Hopper forward's float32 kernels take no sinks:
        # the wide path runs float32 with sinks)
        exprs = {arguments(e) for k, *_, e in path.instantiations()
                 if k == kernel and "DropoutArgs" not in e and not e.startswith("fwd_wgmma<float,")}
        twins = {a for a in exprs if len(a) == with_sinks[kernel]}
        assert twins and all(a[-1] == "true" for a in twins), path.NAME
        def bare_of(a):  # SINKS dropped, then the defaults it spelled out (F, LostF; PASSES)
            a = a[:-1]
            while a[-1] == "NoTransform":
                a = a[:-1]
            return a[:-1] if kernel == "fwd_wgmma" and a[-1] == "1" else a
        bare = {bare_of(a) for a in twins}
        assert bare == exprs - twins, path.NAME


# (forced path, dtype): the kernels of each path that join the sink in their finalize
FUSED = [("wgmma", "float16"), ("wgmma", "bfloat16"), ("mma", "float16"), ("mma", "bfloat16"),
         ("wide", "float32"), ("wide", "float64")]
FUSED = [(p, d) for p, d in FUSED if d != "bfloat16" or BFLOAT16 is not None]


def _no_join(*args):
    raise AssertionError("cuflash._sinks.join ran after a path whose kernels take the sinks")


@pytest.mark.gpu
@pytest.mark.parametrize("path, dtype", FUSED, ids=[f"{p}-{d}" for p, d in FUSED])
def test_cuda_fused_paths_join_no_pass(path, dtype, rng, override, monkeypatch):
    """The forward with sinks on the paths whose kernels join them runs no join pass (a path that
    fell back to the generic kernels would: cuflash._gpu.forward joins after those), and agrees
    with the reference; plain, causal and with a mask and bias."""
    import cupy
    from cuflash import _sinks as sinks_module
    override(poison=True, path=path)
    monkeypatch.setattr(sinks_module, "join", _no_join)
    for name, (lq, Nq, Nk, D) in (("plain", ((2, 3), 77, 130, 64)),
                                  ("causal", ((1, 4), 150, 150, 128)),
                                  ("mask-bias", ((2,), 80, 96, 64))):
        q, k, v = _inputs(rng, lq, lq, Nq, Nk, D, D, dtype, cupy)
        opts = dict(_options(name, rng, lq, Nq, Nk, cupy), sinks=_sinks(rng, lq, dtype, True, cupy))
        out, lse = cuflash.attention(q, k, v, return_lse=True, **opts)
        check_forward(out, lse, q, k, v, **opts)


@pytest.mark.gpu
@pytest.mark.parametrize("path, dtype", FUSED, ids=[f"{p}-{d}" for p, d in FUSED])
def test_cuda_fused_edge_rows(path, dtype, rng, override):
    """The sink in the kernels' finalize keeps every rule of README "Attention sinks": rows that
    see no key by position (causal with Nq > Nk, kv_lens = 0) and rows whose keys a mask hides
    all (settled by fwd_lost_rows, which must join the sink too) give out 0 and lse = t exactly;
    a -inf sink is no sink (bitwise but for lse's last place on fwd_mma / fwd_wide); NaN and +inf
    sinks make every row of their head NaN, empty rows included, and leave the other heads
    bitwise as they were."""
    import cupy
    override(poison=True, path=path)
    B, H, Nq, Nk, D = 2, 4, 50, 30, 64
    q, k, v = _inputs(rng, (B, H), (B, H), Nq, Nk, D, D, dtype, cupy)
    acc = _config.accumulator_dtype(dtype_of(dtype))
    t = (rng.standard_normal((B, H)) + 2.0).astype(acc)
    t[:, 0] = -np.inf
    mask = rng.random((B, H, Nq, Nk)) < 0.7
    mask[:, :, 7] = False  # rows every key of which the mask hides
    for opts, empty in ((dict(causal=True, kv_lens=np.array([Nk, 0]).reshape(B, 1)),
                         lambda b, i: b == 1 or i < Nq - Nk),
                        (dict(mask=cupy.asarray(mask)), lambda b, i: i == 7)):
        out0, lse0 = (to_host(x) for x in cuflash.attention(q, k, v, return_lse=True, **opts))
        out, lse = cuflash.attention(q, k, v, return_lse=True, sinks=cupy.asarray(t), **opts)
        check_forward(out, lse, q, k, v, sinks=t, **opts)
        out, lse = to_host(out), to_host(lse)
        rows = np.array([[empty(b, i) for i in range(Nq)] for b in range(B)])  # (B, Nq)
        assert rows.any()
        for b, h in np.ndindex(B, H):
            np.testing.assert_array_equal(out[b, h][rows[b]].astype(np.float64), 0)
            np.testing.assert_array_equal(lse[b, h][rows[b]], t[b, h])
        # -inf: out bitwise the call without sinks (16-bit outputs compared as their bits); lse
        # too on fwd_wgmma, within an ulp on fwd_mma / fwd_wide (the SINKS instantiation rounds
        # m + log l once differently: measured on the H200, 24 of 100 rows 1 ulp apart)
        np.testing.assert_array_equal(out[:, 0].view(np.uint8), out0[:, 0].view(np.uint8))
        if path == "wgmma":
            np.testing.assert_array_equal(lse[:, 0], lse0[:, 0])
        else:
            np.testing.assert_array_max_ulp(lse[:, 0], lse0[:, 0], maxulp=1)
        bad = t.copy()
        bad[:, 1], bad[:, 2] = np.nan, np.inf
        out_b, lse_b = (to_host(x) for x in cuflash.attention(
            q, k, v, return_lse=True, sinks=cupy.asarray(bad), **opts))
        assert np.isnan(out_b[:, 1:3].astype(np.float64)).all() and np.isnan(lse_b[:, 1:3]).all()
        for h in (0, 3):
            np.testing.assert_array_equal(out_b[:, h].view(np.uint8), out[:, h].view(np.uint8))
            np.testing.assert_array_equal(lse_b[:, h], lse[:, h])


@pytest.mark.gpu
@pytest.mark.parametrize("path, dtype", [(p, d) for p, d in FUSED if d in ("bfloat16", "float32")],
                         ids=[f"{p}-{d}" for p, d in FUSED if d in ("bfloat16", "float32")])
def test_cuda_fused_overflowed_row_stays_nan(path, dtype, rng, override):
    """A row whose visible logits all overflow to -inf in float32 (q ~ 1e20 against k ~ -1e20) is
    NaN with a sink as without (not an empty row, which the sink would give lse = t); the rows
    with finite logits stay finite (their huge |lse| goes to fwd_lost_rows)."""
    import cupy
    override(poison=True, path=path)
    D = 64
    q = np.ones((2, 16, D))
    q[:, 0] = 1e20
    k = np.full((2, 24, D), -1e20)
    v = rng.standard_normal((2, 24, D))
    q, k, v = (to_array(cupy, x, dtype_of(dtype)) for x in (q, k, v))
    out, lse = cuflash.attention(q, k, v, scale=1.0, sinks=cupy.asarray([0.5, -1.0]),
                                 return_lse=True)
    out, lse = to_f64(out), to_f64(lse)
    assert np.isnan(out[:, 0]).all() and np.isnan(lse[:, 0]).all()
    assert np.isfinite(out[:, 1:]).all() and np.isfinite(lse[:, 1:]).all()
