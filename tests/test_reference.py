"""The dense float64 reference against first principles: loops, finite differences, the seed."""
import math

import numpy as np
import pytest

from cuflash import reference
from helpers import SEED_COUNTEREXAMPLES, check_seed_counterexample


def _loop_attention(q, k, v, scale, causal=False, align="bottom-right", window=None, mask=None,
                    bias=None, kv_lens=None):
    """One (batch, head) at a time, one row at a time, one key at a time: no broadcasting tricks.

    q (B, H, Nq, Dk); k, v (B, Hkv, Nk, D); mask/bias (B, H, Nq, Nk) or None; kv_lens (B, H) or None.
    """
    B, H, Nq, _ = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    out = np.zeros((B, H, Nq, v.shape[-1]))
    lse = np.full((B, H, Nq), -math.inf)
    for b in range(B):
        for h in range(H):
            g = h // (H // Hkv)
            L = Nk if kv_lens is None else int(kv_lens[b, h])
            for i in range(Nq):
                pos = i + L - Nq if align == "bottom-right" else i
                logits = {}
                for j in range(L):
                    if causal and j > pos:
                        continue
                    if window is not None:
                        if window[0] is not None and j < pos - window[0]:
                            continue
                        if window[1] is not None and j > pos + window[1]:
                            continue
                    if mask is not None and not mask[b, h, i, j]:
                        continue
                    logit = scale * float(np.dot(q[b, h, i], k[b, g, j]))
                    if bias is not None:
                        logit += bias[b, h, i, j]
                    if logit > -math.inf:  # exp(-inf) = 0: no mass, as if masked
                        logits[j] = logit
                if not logits:
                    continue
                top = max(logits.values())
                weights = {j: math.exp(x - top) for j, x in logits.items()}
                total = sum(weights.values())
                out[b, h, i] = sum(w * v[b, g, j] for j, w in weights.items()) / total
                lse[b, h, i] = top + math.log(total)
    return out, lse


LOOP_CASES = [
    dict(),
    dict(causal=True),
    dict(causal=True, align="top-left"),
    dict(window=(1, 2)),
    dict(window=(None, 0), align="top-left"),
    dict(window=(2, None), causal=True),
    dict(mask=True),
    dict(bias=True),
    dict(kv_lens=True, causal=True),
    dict(kv_lens=True, window=(1, 1), mask=True, bias=True),
]


@pytest.mark.parametrize("options", LOOP_CASES, ids=str)
@pytest.mark.parametrize("Nq, Nk", [(3, 5), (5, 3), (4, 4), (1, 6)])
def test_forward_matches_loops(rng, options, Nq, Nk):
    B, H, Hkv, Dk, Dv = 2, 4, 2, 3, 5
    q = rng.standard_normal((B, H, Nq, Dk))
    k = rng.standard_normal((B, Hkv, Nk, Dk))
    v = rng.standard_normal((B, Hkv, Nk, Dv))
    opts = dict(options)
    if opts.get("mask"):
        opts["mask"] = rng.random((B, H, Nq, Nk)) < 0.6
    if opts.get("bias"):
        bias = rng.standard_normal((B, H, Nq, Nk))
        bias[rng.random(bias.shape) < 0.2] = -np.inf
        opts["bias"] = bias
    if opts.get("kv_lens"):
        opts["kv_lens"] = rng.integers(0, Nk + 1, size=(B, H))
    scale = 0.7
    want_out, want_lse = _loop_attention(q, k, v, scale, **opts)
    out, lse = reference.attention(q, k, v, scale=scale, return_lse=True, **opts)
    assert out.dtype == lse.dtype == np.float64
    np.testing.assert_allclose(out, want_out, rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(np.isinf(lse), np.isinf(want_lse))
    np.testing.assert_allclose(lse, want_lse, rtol=1e-12, atol=1e-12)


# (q shape, k shape, v shape, options): tiny float64 problems for finite differences
FD_CASES = [
    ("plain", (3, 2), (4, 2), (4, 3), dict()),
    ("causal-tall", (2, 5, 3), (2, 3, 3), (2, 3, 2), dict(causal=True)),
    ("causal-top-left", (4, 3), (6, 3), (6, 2), dict(causal=True, align="top-left")),
    ("window", (5, 2), (5, 2), (5, 2), dict(window=(1, 1))),
    ("window-one-sided", (4, 2), (6, 2), (6, 3), dict(window=(None, 1), align="top-left")),
    ("mask", (2, 4, 3), (1, 5, 3), (1, 5, 2), dict(mask="rand")),
    ("bias", (4, 3), (5, 3), (5, 4), dict(bias="rand")),
    ("gqa", (1, 4, 3, 2), (1, 2, 4, 2), (1, 2, 4, 3), dict(causal=True)),
    ("mqa-broadcast-batch", (2, 2, 3, 2), (1, 1, 4, 2), (1, 1, 4, 2), dict()),
    ("kv_lens", (2, 3, 2), (2, 5, 2), (2, 5, 3), dict(kv_lens=[4, 1], causal=True)),
    ("kv_lens-zero", (2, 3, 2), (2, 4, 2), (2, 4, 2), dict(kv_lens=[0, 3])),
    ("everything", (2, 2, 4, 3), (2, 1, 5, 3), (2, 1, 5, 2),
     dict(causal=True, window=(2, None), mask="rand", bias="rand", kv_lens=[[5, 3], [4, 2]])),
]


def _loss_and_grads(q, k, v, g, options):
    out, lse = reference.attention(q, k, v, return_lse=True, **options)
    grads = reference.attention_backward(g, q, k, v, out, lse, **options)
    return float((out * g).sum()), grads


@pytest.mark.parametrize("case", FD_CASES, ids=[c[0] for c in FD_CASES])
def test_backward_matches_finite_differences(rng, case):
    _, qs, ks, vs, options = case
    q, k, v = (rng.standard_normal(s) for s in (qs, ks, vs))
    options = dict(options)
    full = reference.attention(q, k, v).shape[:-1] + (ks[-2],)
    if options.get("mask") == "rand":
        options["mask"] = rng.random(full) < 0.7
    if options.get("bias") == "rand":
        options["bias"] = rng.standard_normal(full)
    out = reference.attention(q, k, v, **options)
    g = rng.standard_normal(out.shape)
    _, grads = _loss_and_grads(q, k, v, g, options)
    eps = 1e-6
    inputs = [q, k, v]
    for which, x in enumerate(inputs):
        numeric = np.zeros_like(x)
        for index in np.ndindex(x.shape):
            saved = x[index]
            x[index] = saved + eps
            plus = float((reference.attention(*inputs, **options) * g).sum())
            x[index] = saved - eps
            minus = float((reference.attention(*inputs, **options) * g).sum())
            x[index] = saved
            numeric[index] = (plus - minus) / (2 * eps)
        assert grads[which].shape == x.shape
        np.testing.assert_allclose(grads[which], numeric, rtol=1e-6, atol=1e-7,
                                   err_msg=f"d{'qkv'[which]}")


def test_backward_zero_on_empty_rows(rng):
    q, k, v = rng.standard_normal((6, 3)), rng.standard_normal((3, 3)), rng.standard_normal((3, 2))
    out, lse = reference.attention(q, k, v, causal=True, return_lse=True)
    assert np.all(lse[:3] == -np.inf) and np.all(out[:3] == 0)  # bottom-right, Nq > Nk
    dq, dk, dv = reference.attention_backward(rng.standard_normal(out.shape), q, k, v, out, lse,
                                              causal=True)
    assert np.all(dq[:3] == 0) and np.isfinite(dq).all()
    assert np.isfinite(dk).all() and np.isfinite(dv).all()


def test_worked_example_of_the_seed():
    """Step 6 of the seed: N = 4, d = 2, row 0 scaled scores [1/sqrt2, 0, 1/sqrt2, 0] -> [0.830, 1.170]."""
    q = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [0.0, 0.0]])
    k = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0], [0.0, 1.0]])
    v = np.array([[1.0, 1.0], [2.0, 0.0], [0.0, 2.0], [1.0, 1.0]])
    scores = (q @ k.T) / math.sqrt(2)
    np.testing.assert_allclose(scores[0], [1 / math.sqrt(2), 0, 1 / math.sqrt(2), 0])
    out, lse = reference.attention(q, k, v, return_lse=True)
    np.testing.assert_allclose(out[0], [0.830, 1.170], atol=5e-4)
    np.testing.assert_allclose(out[0], [2.479, 3.493] / np.float64(2.986), atol=5e-4)
    np.testing.assert_allclose(lse[0], 1 / math.sqrt(2) + math.log(2.986), atol=5e-4)


@pytest.mark.parametrize("values, want", SEED_COUNTEREXAMPLES)
def test_counterexamples_of_the_seed(values, want):
    """Logits (0, log 3): weights (1/4, 3/4). The reference must give 3/4 and 1/4."""
    check_seed_counterexample(reference.attention, values, want)


# The causal pictures that cuflash.attention's docstring prints from its own calls (x = visible;
# tests/test_examples.py runs them): the reference must draw the same.
PICTURES = [
    (3, 5, "bottom-right", ["xxx..", "xxxx.", "xxxxx"]),
    (3, 5, "top-left", ["x....", "xx...", "xxx.."]),
    (5, 3, "bottom-right", ["...", "...", "x..", "xx.", "xxx"]),
    (5, 3, "top-left", ["x..", "xx.", "xxx", "xxx", "xxx"]),
]


@pytest.mark.parametrize("Nq, Nk, align, picture", PICTURES)
def test_causal_pictures(Nq, Nk, align, picture):
    q, k, v = np.ones((Nq, 1)), np.ones((Nk, 1)), np.eye(Nk)
    out = reference.attention(q, k, v, causal=True, align=align)
    # Equal logits: each visible key gets weight 1 / (visible count); out[i, j] > 0 iff visible.
    got = ["".join("x" if w > 0 else "." for w in row) for row in out]
    assert got == picture


def test_window_and_kv_lens_picture():
    """kv_lens = 4 aligns the last query with key 3, not key 5; window (1, 0) keeps keys p-1, p."""
    q, k, v = np.ones((3, 1)), np.ones((6, 1)), np.eye(6)
    out = reference.attention(q, k, v, window=(1, 0), kv_lens=4)
    got = ["".join("x" if w > 0 else "." for w in row) for row in out]
    assert got == ["xx....", ".xx...", "..xx.."]


def test_empty_key_axis():
    q, k, v = np.ones((2, 3, 4)), np.ones((2, 0, 4)), np.ones((2, 0, 5))
    out, lse = reference.attention(q, k, v, return_lse=True)
    assert out.shape == (2, 3, 5) and np.all(out == 0)
    assert lse.shape == (2, 3) and np.all(lse == -np.inf)


def test_accepts_low_precision_and_returns_float64(rng):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    q, k, v = (rng.standard_normal((3, 4)).astype(ml_dtypes.bfloat16) for _ in range(3))
    out, lse = reference.attention(q, k, v, return_lse=True)
    assert out.dtype == lse.dtype == np.float64
    want = reference.attention(*(x.astype(np.float64) for x in (q, k, v)))
    np.testing.assert_array_equal(out, want)


def test_rejects_bad_input_like_the_api():
    q = np.ones((3, 4))
    with pytest.raises(ValueError, match="align"):
        reference.attention(q, q, q, align="bottom_right")
    with pytest.raises(TypeError, match="mask"):
        reference.attention(q, q, q, mask=np.ones((3, 3)))
