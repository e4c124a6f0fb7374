"""ALiBi (``alibi_slopes=``): the reference against an independent dense formula and finite
differences, the NumPy path and every CUDA path against the reference, and its validation.

The logit of query i and key j is ``F(scale q_i.k_j) - slope * |p_i - j| + bias[i, j]``: F the
softcap if any, slope the (batch, head)'s, p_i the query's aligned position exactly as the causal
mask has it (i + L - Nq bottom-right with L the sequence's kv_lens, else Nk; i top-left; plus
q_start - k_start with positions). The slopes are scaled up (0.1 to 0.5 per key) so that the
bias moves the softmax well beyond the inputs' rounding.
"""
import numpy as np
import pytest

import cuflash
from cuflash import _gpu, _validate, reference
from helpers import (BFLOAT16, call_public, check_backward, check_call, check_forward,
                     decode_options, DTYPE_NAMES, dtype_of, numeric_gradient, on_decode_paths,
                     to_array, to_host)

DTYPES = DTYPE_NAMES


def _inputs(rng, lq, lkv, Nq, Nk, Dk, Dv, dtype, xp=np):
    shapes = (lq + (Nq, Dk), lkv + (Nk, Dk), lkv + (Nk, Dv))
    return [to_array(xp, rng.standard_normal(s), dtype_of(dtype)) for s in shapes]


def _slopes(rng, shape, xp=np):
    """Positive slopes in [0.1, 0.5) of `shape` (float32, as models store them)."""
    return xp.asarray((0.1 + 0.4 * rng.random(shape)).astype(np.float32))


def _dense(q, k, v, slopes, scale=None, causal=False, align="bottom-right", kv_lens=None,
           positions=(0, 0), softcap=None):
    """out, lse of ALiBi attention in float64, written out from the definition (no cuflash
    code): q (..., Nq, D), k, v (..., Nk, D) with the same leading dims, slopes broadcast to
    them, kv_lens (leading dims) or None."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    lead, Nq, Nk = q.shape[:-2], q.shape[-2], k.shape[-2]
    scale = 1 / np.sqrt(q.shape[-1]) if scale is None else scale
    L = np.broadcast_to(Nk if kv_lens is None else np.asarray(kv_lens), lead)[..., None, None]
    i, j = np.arange(Nq)[:, None], np.arange(Nk)[None, :]
    p = (i + L - Nq if align == "bottom-right" else i + 0 * L) + positions[0] - positions[1]
    x = scale * q @ np.swapaxes(k, -1, -2)
    if softcap:
        x = softcap * np.tanh(x / softcap)
    x = x - np.broadcast_to(np.asarray(slopes, np.float64), lead)[..., None, None] * np.abs(p - j)
    seen = (j < L) & ((j <= p) if causal else True)
    x = np.where(seen, x, -np.inf)
    m = np.max(np.where(seen, x, -np.inf), axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0)
    w = np.exp(x - m)
    with np.errstate(divide="ignore"):  # log(0) on empty rows, replaced below
        lse = np.where(seen.any(-1), (m + np.log(w.sum(-1, keepdims=True)))[..., 0], -np.inf)
    out = np.where(seen.any(-1, keepdims=True), (w @ v) / np.maximum(w.sum(-1, keepdims=True),
                                                                   1e-300), 0)
    return out, lse


def _options(name, rng, lead, Nq, Nk, xp=np):
    """A case's options by name (slopes per head, or per batch and head; mask / bias drawn here)."""
    H = lead[-1]
    if name == "plain":
        return dict(alibi_slopes=_slopes(rng, (H,), xp))
    if name == "causal":
        return dict(causal=True, alibi_slopes=_slopes(rng, lead, xp))
    if name == "causal-top-left":
        return dict(causal=True, align="top-left", alibi_slopes=_slopes(rng, (H,), xp))
    if name == "window-kv_lens":
        lens = np.array([Nk, Nk // 3])[: lead[0]]
        return dict(window=(20, 3), kv_lens=lens.reshape(lead[:1] + (1,) * (len(lead) - 1)),
                    alibi_slopes=_slopes(rng, (H,), xp))
    if name == "positions":
        return dict(causal=True, positions=(40, 7), alibi_slopes=_slopes(rng, (H,), xp))
    if name == "softcap":
        return dict(causal=True, softcap=2.0, alibi_slopes=_slopes(rng, (H,), xp))
    if name == "mask-bias":
        mask = rng.random(lead + (Nq, Nk)) < 0.8
        mask[..., 3, :] = False  # an empty row
        bias = rng.standard_normal((Nq, Nk))
        bias[5, ::2] = -np.inf   # -inf hides
        return dict(mask=xp.asarray(mask), bias=xp.asarray(bias.astype(np.float32)), causal=True,
                    alibi_slopes=_slopes(rng, (H,), xp))
    raise KeyError(name)


# ---- the reference ----------------------------------------------------------------------------

@pytest.mark.parametrize("opts", [dict(), dict(causal=True), dict(causal=True, align="top-left"),
                                  dict(causal=True, kv_lens=np.array([[9, 4, 13], [0, 13, 6]])),
                                  dict(causal=True, positions=(5, 2)), dict(softcap=1.5),
                                  dict(align="top-left", positions=(0, 3))],
                         ids=["plain", "causal", "top-left", "kv_lens", "positions", "softcap",
                              "top-left-positions"])
def test_reference_is_the_definition(opts, rng):
    """The reference and the NumPy path against the dense formula written out here, slopes per
    batch and head, Nq < Nk."""
    q, k, v = (rng.standard_normal(s) for s in ((2, 3, 9, 4), (2, 3, 13, 4), (2, 3, 13, 3)))
    slopes = rng.random((2, 3)) + 0.2
    want_out, want_lse = _dense(q, k, v, slopes, **opts)
    for fn in (reference.attention, cuflash.attention):
        out, lse = fn(q, k, v, alibi_slopes=slopes, return_lse=True, **opts)
        np.testing.assert_allclose(out, want_out, rtol=1e-12, atol=1e-13)
        np.testing.assert_array_equal(np.isinf(lse), np.isinf(want_lse))
        np.testing.assert_allclose(lse[np.isfinite(want_lse)], want_lse[np.isfinite(want_lse)],
                                   rtol=1e-12)


def test_bias_matches_a_dense_bias(rng):
    """ALiBi is the additive bias -slope |p - j| it stands for (Nq > Nk, bottom-right: negative
    aligned positions); zero slopes are the call without it."""
    q, k, v = (rng.standard_normal(s) for s in ((2, 12, 8), (2, 7, 8), (2, 7, 5)))
    slopes = np.array([0.3, 0.7])
    p = np.arange(12)[:, None] + 7 - 12
    bias = -slopes[:, None, None] * np.abs(p - np.arange(7)[None, :])
    for opts in (dict(), dict(window=(2, 2))):
        np.testing.assert_allclose(cuflash.attention(q, k, v, alibi_slopes=slopes, **opts),
                                   cuflash.attention(q, k, v, bias=bias, **opts), rtol=1e-12,
                                   atol=1e-14)
    np.testing.assert_array_equal(cuflash.attention(q, k, v, alibi_slopes=np.zeros(2)),
                                  cuflash.attention(q, k, v))


def test_gradients_match_finite_differences(rng):
    """dq, dk, dv with ALiBi (and softcap, mask, causal, kv_lens, positions) against central
    differences of sum(out * dout) in float64, for the reference and the NumPy path."""
    q, k, v = (rng.standard_normal(s) for s in ((2, 5, 3), (2, 7, 3), (2, 7, 2)))
    mask = rng.random((5, 7)) < 0.85
    opts = dict(alibi_slopes=np.array([0.4, 1.1]), softcap=1.3, mask=mask, causal=True,
                kv_lens=np.array([7, 6]), positions=(3, 1), scale=0.8)
    out, lse = reference.attention(q, k, v, return_lse=True, **opts)
    dout = rng.standard_normal(out.shape)
    ref_grads = reference.attention_backward(dout, q, k, v, out, lse, **opts)
    got_grads = cuflash.attention_backward(dout, q, k, v, out, lse, **opts)
    for x, g, g2 in zip((q, k, v), ref_grads, got_grads):
        num = numeric_gradient(lambda: (_dense_masked(q, k, v, **opts) * dout).sum(), x)
        np.testing.assert_allclose(g, num, rtol=1e-6, atol=1e-8)
        np.testing.assert_allclose(g2, num, rtol=1e-6, atol=1e-8)


def _dense_masked(q, k, v, *, mask, alibi_slopes, softcap, causal, kv_lens, positions, scale):
    """_dense with a boolean mask (every row here sees a key)."""
    lead, Nq, Nk = q.shape[:-2], q.shape[-2], k.shape[-2]
    L = np.broadcast_to(kv_lens, lead)[..., None, None]
    i, j = np.arange(Nq)[:, None], np.arange(Nk)[None, :]
    p = i + L - Nq + positions[0] - positions[1]
    x = softcap * np.tanh(scale * q @ np.swapaxes(k, -1, -2) / softcap)
    x = x - np.asarray(alibi_slopes)[..., None, None] * np.abs(p - j)
    x = np.where((j < L) & (j <= p) & mask, x, -np.inf)
    w = np.exp(x - x.max(-1, keepdims=True))
    return (w / w.sum(-1, keepdims=True)) @ v


# ---- the NumPy path ---------------------------------------------------------------------------

CASES = [("plain", (2,), (2,), 37, 53, 16, 16), ("causal", (2, 2), (2, 1), 40, 40, 8, 12),
         ("causal-top-left", (2,), (2,), 50, 30, 8, 8),
         ("window-kv_lens", (2,), (2,), 33, 70, 16, 16), ("positions", (3,), (3,), 20, 45, 8, 8),
         ("softcap", (1, 4), (1, 2), 30, 60, 16, 16), ("mask-bias", (2,), (2,), 24, 31, 8, 8)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_numpy_path(case, dtype, rng):
    name, lq, lkv, Nq, Nk, Dk, Dv = case
    q, k, v = _inputs(rng, lq, lkv, Nq, Nk, Dk, Dv, dtype)
    opts = _options(name, rng, lq, Nq, Nk)
    _, _, dout, grads = check_call(np, rng, q, k, v, **opts)
    _, vjp = cuflash.attention_vjp(q, k, v, **opts)
    for a, b in zip(vjp(dout), grads):
        np.testing.assert_array_equal(a, b)


def test_bnhd_layout_and_lost_rows(rng, monkeypatch):
    """(B, N, H, D) storage read through swapaxes, with small NumPy tiles (the online softmax
    across many key tiles), and a padding bias near finfo.min (lost rows: the backward's exact
    recomputation carries ALiBi too)."""
    from cuflash import _numpy
    monkeypatch.setattr(_numpy, "BLOCK_N", 8)
    B, N, H, D = 2, 29, 3, 8
    q, k, v = (rng.standard_normal((B, N, H, D)).astype(np.float32).swapaxes(1, 2)
               for _ in range(3))
    slopes = _slopes(rng, (H,))
    bias = np.zeros((B, 1, N, N), np.float32)
    bias[0, :, 4] = np.finfo(np.float32).min  # row 4 of batch 0: a uniform softmax, |lse| huge
    opts = dict(causal=True, alibi_slopes=slopes, bias=bias)
    out, lse = cuflash.attention(q, k, v, return_lse=True, **opts)
    check_forward(out, lse, q, k, v, **opts)
    dout = rng.standard_normal(out.shape).astype(np.float32)
    check_backward(cuflash.attention_backward(dout, q, k, v, out, lse, **opts), dout, q, k, v,
                   out, lse, **opts)


def test_slopes_in_turn_and_scalar_slope(rng):
    """Two slope arrays of one signature in a row each get their own values; a number is one
    slope for every head; the Problem carries float64 slopes per (batch, head)."""
    q, k, v = _inputs(rng, (2, 2), (2, 2), 9, 12, 8, 8, "float64")
    for s in (np.array([0.1, 0.9]), np.array([2.0, 0.0])):
        np.testing.assert_allclose(cuflash.attention(q, k, v, alibi_slopes=s, causal=True),
                                   _dense(q, k, v, s, causal=True)[0], rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(cuflash.attention(q, k, v, alibi_slopes=0.5),
                               _dense(q, k, v, 0.5)[0], rtol=1e-12, atol=1e-13)
    p = _validate.make_problem(q, k, v, alibi_slopes=np.array([[1, 2], [3, 4]]),
                               positions=(6, 2))
    assert p.alibi.dtype == np.float64 and p.alibi.tolist() == [1.0, 2.0, 3.0, 4.0]
    assert p.transforms == (("alibi", (4.0,)),)


@pytest.mark.parametrize("fn", ["attention", "attention_backward", "attention_vjp"])
@pytest.mark.parametrize("value, error, match", [
    (True, TypeError, "alibi_slopes must be a real number"),
    ("1", TypeError, "alibi_slopes must be a real number"),
    ([0.5, 0.5], TypeError, "alibi_slopes must be a real number"),
    (np.array([True, False]), TypeError, "alibi_slopes must hold real numbers"),
    (np.ones(3), ValueError, "alibi_slopes must broadcast to the leading dims"),
    (np.ones((3, 2)), ValueError, "alibi_slopes must broadcast to the leading dims"),
    (np.array([0.5, np.nan]), ValueError, "alibi_slopes must be finite"),
    (np.array([np.inf, 0.5]), ValueError, "alibi_slopes must be finite"),
    (float("nan"), ValueError, "alibi_slopes must be finite")])
def test_bad_slopes_are_refused(fn, value, error, match, rng):
    q, k, v = _inputs(rng, (2,), (2,), 4, 5, 8, 8, "float32")
    with pytest.raises(error, match=f"^{fn}: {match}"):
        call_public(fn, q, k, v, alibi_slopes=value)


# ---- the CUDA paths ---------------------------------------------------------------------------

GPU_CASES = [("plain", (2, 2), (2, 2), 97, 130, 64, 64), ("causal", (1, 4), (1, 2), 150, 150, 128, 128),
             ("causal-top-left", (2, 2), (2, 2), 200, 90, 64, 64),
             ("window-kv_lens", (2,), (2,), 70, 200, 64, 64), ("mask-bias", (2,), (2,), 80, 96, 32, 32),
             ("positions", (2,), (2,), 65, 140, 96, 96), ("plain", (1,), (1,), 40, 70, 256, 256),
             ("causal", (2,), (2,), 65, 90, 192, 128), ("softcap", (1, 4), (1, 2), 130, 130, 128, 128)]


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["generic", "mma", "wgmma", "wide", "auto"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", GPU_CASES, ids=[f"{c[0]}-d{c[5]}x{c[6]}" for c in GPU_CASES])
def test_cuda_paths(case, dtype, path, rng, override):
    """Every path forced (where it takes the call; the generic kernels elsewhere), forward and
    both backward orders, NaN-poisoned buffers."""
    import cupy
    name, lq, lkv, Nq, Nk, Dk, Dv = case
    override(poison=True, path=None if path == "auto" else path)
    q, k, v = _inputs(rng, lq, lkv, Nq, Nk, Dk, Dv, dtype, cupy)
    check_call(cupy, rng, q, k, v, orders=(False, True), **_options(name, rng, lq, Nq, Nk, cupy))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
@pytest.mark.parametrize("Nq", [1, 256])
def test_alibi_keeps_the_path(Nq, dtype, rng):
    """ALiBi alone runs where the call without it runs (decode, Hopper, tensor cores, wide),
    but for the float64 wide backward (as softcap: the generic kernels) and float32's Hopper
    forward (no transform: the wide path); ALiBi with softcap runs
    on the generic kernels (the chains of two transforms are theirs alone). Both are the
    reference's, and ALiBi changes the answer."""
    import cupy
    if dtype == "bfloat16" and BFLOAT16 is None:
        pytest.skip("ml_dtypes missing")
    D = 128 if dtype != "float64" else 64
    q, k, v = _inputs(rng, (2, 4), (2, 4), Nq, 256, D, D, dtype, cupy)
    slopes = _slopes(rng, (4,), cupy)
    plain = _validate.make_problem(q, k, v, causal=True)
    alibi = _validate.make_problem(q, k, v, causal=True, alibi_slopes=slopes)
    both = _validate.make_problem(q, k, v, causal=True, alibi_slopes=slopes, softcap=3.0)
    # (float32 on the Hopper forward: no score transform there, the wide path takes it)
    hopper32 = dtype == "float32" and _gpu.forward_path(plain) == "wgmma"
    assert _gpu.forward_path(alibi) == ("wide" if hopper32 else _gpu.forward_path(plain))
    backward = _gpu.backward_path(plain)
    assert _gpu.backward_path(alibi) == ("generic" if (dtype, backward) == ("float64", "wide")
                                         else backward)
    assert _gpu.forward_path(both) == _gpu.backward_path(both) == "generic"
    for opts in (dict(alibi_slopes=slopes), dict(alibi_slopes=slopes, softcap=3.0)):
        out, lse = cuflash.attention(q, k, v, causal=True, return_lse=True, **opts)
        check_forward(out, lse, q, k, v, causal=True, **opts)
    without = to_host(cuflash.attention(q, k, v, causal=True)).astype(np.float64)
    assert np.abs(to_host(out).astype(np.float64) - without).max() > 1e-2


@pytest.mark.gpu
def test_device_slopes_are_not_checked(rng, override):
    """A CuPy slope array is not read on the host: a NaN slope makes its head's rows NaN (the
    formula's arithmetic), the other heads are the reference's."""
    import cupy
    override(poison=True)
    q, k, v = _inputs(rng, (1, 2), (1, 2), 70, 90, 64, 64, "float16", cupy)
    slopes = cupy.asarray([np.nan, 0.25], dtype=np.float32)
    out, lse = cuflash.attention(q, k, v, alibi_slopes=slopes, return_lse=True)
    assert np.isnan(to_host(lse)[0, 0]).all()
    check_forward(out[:, 1:], lse[:, 1:], q[:, 1:], k[:, 1:], v[:, 1:],
                  alibi_slopes=cupy.asarray([0.25], dtype=np.float32))


@pytest.mark.gpu
def test_bnhd_layout_on_the_gpu(rng, override):
    """(B, N, H, D) CuPy storage through swapaxes, slopes per head, causal, on the automatic
    path and the generic kernels."""
    import cupy
    B, N, H, D = 2, 300, 4, 64
    q, k, v = (cupy.asarray(rng.standard_normal((B, N, H, D)).astype(np.float16)).swapaxes(1, 2)
               for _ in range(3))
    slopes = _slopes(rng, (H,), cupy)
    for path in (None, "generic"):
        with _gpu.override(path=path, poison=True):
            out, lse = cuflash.attention(q, k, v, causal=True, alibi_slopes=slopes,
                                         return_lse=True)
        check_forward(out, lse, q, k, v, causal=True, alibi_slopes=slopes)


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["generic", "mma", "wgmma", "wide", "auto"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("edge", [-1, 1])
def test_distances_at_the_span_edge(edge, dtype, path, rng, override):
    """Query positions as far from the keys as the float32 kernels take (Nq + Nk + |q_start -
    k_start| = ALIBI_SPAN - 1, either sign): every distance exact (modifiers.cuh Alibi forms it
    from the bits of 1.5 * 2^23 + (i - j)). Slopes small enough that the logits stay small
    (terms up to ~24: the float kernels settle the rows, not the float64 fix-up, and lse is not
    held to ulps of a huge value), large enough that a distance off by the float's 2^22 or 2^23
    range would move them by 16 or more."""
    import cupy
    Nq, Nk, D = 70, 200, 64
    override(poison=True, path=None if path == "auto" else path)
    q, k, v = _inputs(rng, (2,), (2,), Nq, Nk, D, D, dtype, cupy)
    offset = edge * (_validate.ALIBI_SPAN - 1 - Nq - Nk)
    slopes = cupy.asarray([2.0**-18, 3 * 2.0**-19], dtype=np.float32)  # terms up to ~24
    for opts in (dict(), dict(causal=True)):
        options = dict(alibi_slopes=slopes, positions=(max(offset, 0), max(-offset, 0)), **opts)
        if opts and edge < 0:
            continue  # (every key after every query: causal rows empty)
        check_call(cupy, rng, q, k, v, **options)


@pytest.mark.gpu
@pytest.mark.parametrize("fn", ["attention", "attention_backward"])
def test_positions_beyond_the_span_are_refused(fn, rng):
    """Float32 accumulation (16-bit and float32 CuPy inputs) refuses ALiBi at Nq + Nk +
    |q_start - k_start| >= ALIBI_SPAN by name before any launch; float64 CuPy inputs and NumPy
    arrays take it and agree with the reference."""
    import cupy
    Nq, Nk, D = 20, 30, 32
    far = (_validate.ALIBI_SPAN - Nq - Nk, 0)
    slopes = np.float64(1e-4)
    for dtype in ("float16", "float32"):
        q, k, v = _inputs(rng, (2,), (2,), Nq, Nk, D, D, dtype, cupy)
        with pytest.raises(ValueError, match=f"^{fn}: alibi_slopes with float16, bfloat16 or "
                                             "float32 inputs on the GPU needs"):
            call_public(fn, q, k, v, alibi_slopes=slopes, positions=far)
    for xp, dtype in ((cupy, "float64"), (np, "float32")):
        q, k, v = _inputs(rng, (2,), (2,), Nq, Nk, D, D, dtype, xp)
        check_call(xp, rng, q, k, v, alibi_slopes=slopes, positions=far)


# ---- decode ----------------------------------------------------------------------------------
# ALiBi goes to decode_split (decode_tc's rows span several heads of a GQA group): forced with
# small splits, so that the merge of partials runs too.

DECODE_CASES = [("plain", (2, 8), (2, 2), 1, 1500, 128, 128),       # GQA 4: per-row slopes
                ("kv_lens", (2, 4), (2, 1), 3, 3000, 64, 64),       # MQA, lengths on the host
                ("kv_lens-device", (2, 6), (2, 3), 2, 2048, 128, 128),
                ("causal-window", (1, 6), (1, 2), 4, 5000, 96, 96),
                ("mask-bias", (1, 4), (1, 2), 2, 1000, 64, 64)]


def _decode_options(name, rng, lead, Nq, Nk, xp):
    slopes = _slopes(rng, lead, xp) * 0.05  # per batch and head
    return dict(decode_options(name, rng, lead, Nq, Nk, xp), alibi_slopes=slopes)


@on_decode_paths(DECODE_CASES, DTYPES)
def test_decode_paths(case, dtype, path, rng, override):
    import cupy
    from cuflash import _decode
    name, lq, lkv, Nq, Nk, Dk, Dv = case
    override(poison=True, path=path)
    q, k, v = _inputs(rng, lq, lkv, Nq, Nk, Dk, Dv, dtype, cupy)
    opts = _decode_options(name, rng, lq, Nq, Nk, cupy)
    p = _validate.make_problem(q, k, v, **opts)
    assert _gpu.forward_path(p) == "split" and not _decode.tc_fits(p)
    out, lse = cuflash.attention(q, k, v, return_lse=True, **opts)
    check_forward(out, lse, q, k, v, **opts)


@pytest.mark.gpu
def test_decode_slopes_in_turn(rng, override):
    """Two slope arrays through one decode layout (its cached plan): each call reads its own."""
    import cupy
    override(poison=True, path="split")
    q, k, v = _inputs(rng, (1, 4), (1, 2), 1, 2000, 64, 64, "float16", cupy)
    for s in ([0.01, 0.02, 0.04, 0.08], [0.08, 0.0, 0.3, 0.01]):
        slopes = cupy.asarray(s, dtype=np.float32)
        out, lse = cuflash.attention(q, k, v, alibi_slopes=slopes, return_lse=True)
        check_forward(out, lse, q, k, v, alibi_slopes=slopes)
