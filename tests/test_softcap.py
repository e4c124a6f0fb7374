"""Logit softcapping (``softcap=``): the reference against its definition and finite differences,
the NumPy path and every CUDA path that takes it against the reference, and its validation.

The logits are ``softcap * tanh(scale q.k / softcap) + bias``; the gradients carry
``1 - tanh^2``. Inputs are scaled up so that the cap bends most logits (|x| ~ cap).
"""
import numpy as np
import pytest

import cuflash
from cuflash import _gpu, _validate, reference
from helpers import (BFLOAT16, call_public, check_call, check_forward, decode_options, DTYPE_NAMES,
                     dtype_of, numeric_gradient, on_decode_paths, to_array, to_host)

DTYPES = DTYPE_NAMES


def _inputs(rng, lq, lkv, Nq, Nk, Dk, Dv, dtype, xp=np, gain=3.0):
    shapes = (lq + (Nq, Dk), lkv + (Nk, Dk), lkv + (Nk, Dv))
    host = [rng.standard_normal(s) * (gain if i == 0 else 1.0) for i, s in enumerate(shapes)]
    return [to_array(xp, h, dtype_of(dtype)) for h in host]


def _options(name, rng, lead, Nq, Nk, xp=np):
    """The options of a case by name (mask / bias drawn here)."""
    if name == "plain":
        return {}
    if name == "causal":
        return dict(causal=True)
    if name == "window-kv_lens":
        lens = np.array([Nk, Nk // 3])[: lead[0]]
        return dict(window=(20, 3), kv_lens=lens.reshape(lead[:1] + (1,) * (len(lead) - 1)))
    if name == "mask-bias":
        mask = rng.random(lead + (Nq, Nk)) < 0.8
        mask[..., 3, :] = False  # an empty row
        bias = rng.standard_normal((Nq, Nk))
        bias[5, ::2] = -np.inf   # -inf hides
        return dict(mask=xp.asarray(mask), bias=xp.asarray(bias.astype(np.float32)), causal=True)
    raise KeyError(name)


# ---- the reference ----------------------------------------------------------------------------

def test_reference_is_the_definition(rng):
    """softmax(cap tanh(scale q k^T / cap) + bias) v, written out densely."""
    q, k, v = (rng.standard_normal(s) for s in ((2, 9, 4), (2, 11, 4), (2, 11, 3)))
    q *= 4
    bias = rng.standard_normal((9, 11))
    cap, scale = 1.7, 0.6
    out, lse = reference.attention(q, k, v, scale=scale, bias=bias, softcap=cap, return_lse=True)
    x = cap * np.tanh(scale * q @ np.swapaxes(k, -1, -2) / cap) + bias
    w = np.exp(x - x.max(-1, keepdims=True))
    np.testing.assert_allclose(out, (w / w.sum(-1, keepdims=True)) @ v, rtol=1e-13, atol=1e-14)
    np.testing.assert_allclose(lse, np.log(np.exp(x).sum(-1)), rtol=1e-13)
    # every logit within +-cap of its bias; a huge cap changes nothing measurable
    assert np.all(np.abs(x - bias) <= cap)
    plain = reference.attention(q, k, v, scale=scale, bias=bias)
    np.testing.assert_allclose(reference.attention(q, k, v, scale=scale, bias=bias, softcap=1e9),
                               plain, rtol=1e-9, atol=1e-12)


def test_reference_gradients_match_finite_differences(rng):
    """The reference's dq, dk, dv with a softcap (and mask, bias, causal) against central
    differences of sum(out * dout) in float64."""
    q, k, v = (rng.standard_normal(s) for s in ((1, 5, 3), (1, 7, 3), (1, 7, 2)))
    q *= 3
    mask = rng.random((5, 7)) < 0.8
    bias = rng.standard_normal((5, 7))
    opts = dict(softcap=1.3, mask=mask, bias=bias, causal=True, align="top-left", scale=0.8)
    out, lse = reference.attention(q, k, v, return_lse=True, **opts)
    dout = rng.standard_normal(out.shape)
    grads = reference.attention_backward(dout, q, k, v, out, lse, **opts)
    for x, g in zip((q, k, v), grads):
        num = numeric_gradient(lambda: (reference.attention(q, k, v, **opts) * dout).sum(), x)
        np.testing.assert_allclose(g, num, rtol=1e-6, atol=1e-8)


def test_small_cap_is_nearly_uniform(rng):
    """A cap far below the logits' spread flattens every row: out -> the mean of the visible v
    (a property independent of the reference)."""
    q, k, v = (rng.standard_normal(s) for s in ((6, 8), (10, 8), (10, 4)))
    out = cuflash.attention(q * 5, k, v, softcap=1e-6, causal=True)
    want = np.cumsum(v, axis=0)[np.arange(6) + 4] / (np.arange(6) + 5)[:, None]
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)


# ---- the NumPy path ---------------------------------------------------------------------------

CASES = [("plain", (2,), (2,), 37, 53, 16, 16), ("causal", (2, 2), (2, 1), 40, 40, 8, 12),
         ("window-kv_lens", (2,), (2,), 33, 70, 16, 16), ("mask-bias", (2,), (2,), 24, 31, 8, 8)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_numpy_path(case, dtype, rng):
    name, lq, lkv, Nq, Nk, Dk, Dv = case
    q, k, v = _inputs(rng, lq, lkv, Nq, Nk, Dk, Dv, dtype)
    opts = dict(_options(name, rng, lq, Nq, Nk), softcap=2.5)
    _, _, dout, grads = check_call(np, rng, q, k, v, **opts)
    _, vjp = cuflash.attention_vjp(q, k, v, **opts)
    for a, b in zip(vjp(dout), grads):
        np.testing.assert_array_equal(a, b)


def test_zero_is_off_and_signature_keeps_values_apart(rng):
    q, k, v = _inputs(rng, (), (), 9, 12, 8, 8, "float64")
    np.testing.assert_array_equal(cuflash.attention(q, k, v, softcap=0),
                                  cuflash.attention(q, k, v))
    # two caps in a row (one signature each): each call gets its own
    a = cuflash.attention(q, k, v, softcap=0.5)
    b = cuflash.attention(q, k, v, softcap=5.0)
    np.testing.assert_allclose(a, reference.attention(q, k, v, softcap=0.5), rtol=1e-12)
    np.testing.assert_allclose(b, reference.attention(q, k, v, softcap=5.0), rtol=1e-12)
    assert _validate.make_problem(q, k, v, softcap=2).transforms == (("softcap", (2.0,)),)


@pytest.mark.parametrize("fn", ["attention", "attention_backward", "attention_vjp"])
@pytest.mark.parametrize("value, error", [(True, TypeError), ("1", TypeError), ([1.0], TypeError),
                                          (-1.0, ValueError), (float("nan"), ValueError),
                                          (float("inf"), ValueError)])
def test_bad_softcap_is_refused(fn, value, error, rng):
    q, k, v = _inputs(rng, (), (), 4, 5, 8, 8, "float32")
    with pytest.raises(error, match=f"^{fn}: softcap"):
        call_public(fn, q, k, v, softcap=value)


# ---- the CUDA paths ---------------------------------------------------------------------------

GPU_CASES = [("plain", (2, 2), (2, 2), 97, 130, 64, 64), ("causal", (1, 4), (1, 2), 150, 150, 128, 128),
             ("window-kv_lens", (2,), (2,), 70, 200, 64, 64), ("mask-bias", (2,), (2,), 80, 96, 32, 32),
             ("plain", (1,), (1,), 40, 70, 256, 256), ("causal", (2,), (2,), 65, 90, 96, 48)]


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["generic", "mma", "wide", "auto"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", GPU_CASES, ids=[f"{c[0]}-d{c[5]}x{c[6]}" for c in GPU_CASES])
def test_cuda_paths(case, dtype, path, rng, override):
    import cupy
    name, lq, lkv, Nq, Nk, Dk, Dv = case
    override(poison=True, path=None if path == "auto" else path)
    q, k, v = _inputs(rng, lq, lkv, Nq, Nk, Dk, Dv, dtype, cupy)
    check_call(cupy, rng, q, k, v, orders=(False, True),
               **dict(_options(name, rng, lq, Nq, Nk, cupy), softcap=2.5))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
@pytest.mark.parametrize("Nq", [1, 256])
def test_a_softcap_keeps_the_path(Nq, dtype, rng):
    """Every path takes the score transforms: a softcap call runs where the same call without it
    runs (decode, Hopper, tensor cores, wide), but for the float64 wide backward (its tiles spill
    with the derivative: the generic kernels take it) and float32's Hopper forward (no transform:
    the wide path); and it is the reference's."""
    import cupy
    if dtype == "bfloat16" and BFLOAT16 is None:
        pytest.skip("ml_dtypes missing")
    q, k, v = _inputs(rng, (2,), (2,), Nq, 256, 128 if dtype != "float64" else 64,
                      128 if dtype != "float64" else 64, dtype, cupy)
    plain = _validate.make_problem(q, k, v)
    capped = _validate.make_problem(q, k, v, softcap=4.0)
    # (float32 on the Hopper forward: no score transform there, the wide path takes it)
    hopper32 = dtype == "float32" and _gpu.forward_path(plain) == "wgmma"
    assert _gpu.forward_path(capped) == ("wide" if hopper32 else _gpu.forward_path(plain))
    backward = _gpu.backward_path(plain)
    assert _gpu.backward_path(capped) == ("generic" if (dtype, backward) == ("float64", "wide")
                                          else backward)
    out, lse = cuflash.attention(q, k, v, softcap=4.0, return_lse=True)
    check_forward(out, lse, q, k, v, softcap=4.0)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_a_nan_row_stays_nan(dtype, rng, override):
    """A NaN in q makes its row NaN (tanh(NaN) is NaN: the cap does not hide it); the other rows
    are the reference's."""
    import cupy
    override(poison=True)
    q, k, v = _inputs(rng, (1,), (1,), 70, 90, 64, 64, dtype, cupy)
    q[0, 3, 0] = np.nan
    out, lse = cuflash.attention(q, k, v, softcap=3.0, return_lse=True)
    assert np.isnan(to_host(out)[0, 3].astype(np.float64)).all() and np.isnan(to_host(lse)[0, 3])
    rows = np.arange(70) != 3
    check_forward(out[:, rows], lse[:, rows], q[:, rows], k, v, softcap=3.0)


# ---- decode ----------------------------------------------------------------------------------
# The split-KV decode kernels (cuflash/_decode.py): decode_tc (16-bit, Dk = Dv in {64, 128}, no
# mask / bias) and decode_split (the rest, and everything under "split-simt"), forced with small
# splits so that the merge of partials runs too.

DECODE_CASES = [("plain", (2, 8), (2, 2), 1, 1500, 128, 128),       # GQA 4: decode_tc
                ("kv_lens", (2, 4), (2, 1), 3, 3000, 64, 64),       # MQA, lengths on the host
                ("kv_lens-device", (2, 6), (2, 3), 2, 2048, 128, 128),
                ("causal-window", (1, 6), (1, 2), 4, 5000, 96, 96),  # decode_split (D 96)
                ("mask-bias", (1, 4), (1, 2), 2, 1000, 64, 64),
                ("mask-bias", (2, 2), (2, 1), 4, 1200, 128, 64)]


@on_decode_paths(DECODE_CASES, DTYPES)
def test_decode_paths(case, dtype, path, rng, override):
    """A softcap through the decode kernels (forced, many splits) is the reference's."""
    import cupy
    name, lq, lkv, Nq, Nk, Dk, Dv = case
    override(poison=True, path=path)
    q, k, v = _inputs(rng, lq, lkv, Nq, Nk, Dk, Dv, dtype, cupy)
    opts = dict(decode_options(name, rng, lq, Nq, Nk, cupy), softcap=2.5)
    assert _gpu.forward_path(_validate.make_problem(q, k, v, **opts)) == "split"
    out, lse = cuflash.attention(q, k, v, return_lse=True, **opts)
    check_forward(out, lse, q, k, v, **opts)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("Nq", [1, 4])
def test_decode_takes_softcap(Nq, dtype, rng):
    """A decode shape with a softcap goes to the decode path unforced (decode_tc for 16-bit
    inputs of head dim 128, decode_split for float32), and it is the reference's."""
    import cupy
    from cuflash import _decode
    if dtype == "bfloat16" and BFLOAT16 is None:
        pytest.skip("ml_dtypes missing")
    q, k, v = _inputs(rng, (2, 8), (2, 2), Nq, 4096, 128, 128, dtype, cupy)
    p = _validate.make_problem(q, k, v, softcap=4.0)
    assert _gpu.forward_path(p) == "split"
    assert _decode.tc_fits(p) == (dtype != "float32")
    out, lse = cuflash.attention(q, k, v, softcap=4.0, return_lse=True)
    check_forward(out, lse, q, k, v, softcap=4.0)
    # the cap changes the answer (the test would not see a kernel that ignored it)
    plain = to_host(cuflash.attention(q, k, v)).astype(np.float64)
    assert np.abs(to_host(out).astype(np.float64) - plain).max() > 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["split", "split-simt"])
def test_decode_caps_in_turn(path, rng, override):
    """Two caps in a row through one decode layout (its cached plan): each call gets its own
    scalars."""
    import cupy
    override(poison=True, path=path)
    q, k, v = _inputs(rng, (1, 4), (1, 2), 1, 2000, 64, 64, "float16", cupy)
    for cap in (0.5, 8.0, 0.5):
        out, lse = cuflash.attention(q, k, v, softcap=cap, return_lse=True)
        check_forward(out, lse, q, k, v, softcap=cap)
