"""Packed variable-length batches (``cu_seqlens_q`` / ``cu_seqlens_k``, issue 18): the packed
reference against the dense formula written over the packed token axes, the NumPy path and every
CUDA path against the reference (within 2x a same-dtype naive implementation run per sequence),
gradients by finite differences, the named errors, and on the GPU: device offsets, no hidden
synchronization, CUDA graphs.

Sequence b holds queries q[cu_q[b]:cu_q[b + 1]] and keys k[cu_k[b]:cu_k[b + 1]]; every mask
option is aligned per sequence with its own lengths Lq, Lk (bottom-right: query i sees key j iff
j <= i + Lk - Lq when causal)."""
import inspect

import numpy as np
import pytest

import cuflash
from cuflash import reference
from helpers import (BFLOAT16, FLOORS, assert_close_to_reference, naive_attention,
                     naive_attention_backward, numeric_gradient, to_array, to_host)

DTYPES = ["float64", "float32", "float16"] + (["bfloat16"] if BFLOAT16 is not None else [])


def _dtype(name):
    return BFLOAT16 if name == "bfloat16" else np.dtype(name)


def offsets(lengths):
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


def packed_inputs(rng, Lq, Lk, H, Hkv, Dk, Dv, dtype, xp=np, gain=1.0):
    """Packed q (total_q, H, Dk), k (total_k, Hkv, Dk), v (total_k, Hkv, Dv) and the offsets."""
    cq, ck = offsets(Lq), offsets(Lk)
    shapes = ((cq[-1], H, Dk), (ck[-1], Hkv, Dk), (ck[-1], Hkv, Dv))
    arrays = [to_array(xp, rng.standard_normal(s) * (gain if i == 0 else 1.0), _dtype(dtype))
              for i, s in enumerate(shapes)]
    return arrays + [cq, ck]


def _sequences(cq, ck):
    for b in range(len(cq) - 1):
        if cq[b + 1] > cq[b]:
            yield b, slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])


def _row_options(options, b, B, H):
    """Sequence b's options: the (H,) rows of sinks and alibi_slopes broadcast to (B, H)."""
    out = dict(options)
    for name in ("sinks", "alibi_slopes"):
        if out.get(name) is not None:
            out[name] = np.broadcast_to(to_host(out[name]).astype(np.float64), (B, H))[b]
    return out


def _t(x):
    return np.swapaxes(x, 0, 1)


def naive_packed(q, k, v, cq, ck, **options):
    """(out, lse) of a same-dtype naive implementation run on each sequence alone."""
    q, k, v = (to_host(x) for x in (q, k, v))
    B, H = len(cq) - 1, q.shape[1]
    out = np.zeros((q.shape[0], H, v.shape[-1]))
    lse = np.full((q.shape[0], H), -np.inf)
    for b, rows, keys in _sequences(cq, ck):
        o, l = naive_attention(_t(q[rows]), _t(k[keys]), _t(v[keys]),
                               **_row_options(options, b, B, H))
        out[rows], lse[rows] = _t(o), _t(l)
    return out, lse


def naive_packed_backward(dout, q, k, v, out, lse, cq, ck, **options):
    """(dq, dk, dv) of a same-dtype naive implementation run on each sequence alone."""
    dout, q, k, v, out, lse = (to_host(x) for x in (dout, q, k, v, out, lse))
    B, H = len(cq) - 1, q.shape[1]
    grads = [np.zeros(x.shape) for x in (q, k, v)]
    for b, rows, keys in _sequences(cq, ck):
        g = naive_attention_backward(_t(dout[rows]), _t(q[rows]), _t(k[keys]), _t(v[keys]),
                                     _t(out[rows]), _t(lse[rows]),
                                     **_row_options(options, b, B, H))
        for grad, part, span in zip(grads, g, (rows, keys, keys)):
            grad[span] = _t(part)
    return grads


def _host_options(options):
    return {n: to_host(x) if hasattr(x, "shape") else x for n, x in options.items()}


def check_packed_forward(out, lse, q, k, v, cq, ck, **options):
    dtype = np.dtype(q.dtype)
    host = _host_options(options)
    qh, kh, vh = (to_host(x) for x in (q, k, v))
    ref = reference.attention(qh, kh, vh, cu_seqlens_q=cq, cu_seqlens_k=ck, return_lse=True,
                              **host)
    naive = naive_packed(qh, kh, vh, cq, ck, **host) if dtype != np.float64 else (None, None)
    assert_close_to_reference(out, ref[0], naive[0], FLOORS[dtype.name], "out")
    assert_close_to_reference(lse, ref[1], naive[1], FLOORS[dtype.name], "lse")


def check_packed_backward(grads, dout, q, k, v, out, lse, cq, ck, **options):
    dtype = np.dtype(q.dtype)
    host = _host_options(options)
    args = [to_host(x) for x in (dout, q, k, v, out, lse)]
    ref = reference.attention_backward(*args, cu_seqlens_q=cq, cu_seqlens_k=ck, **host)
    naive = (tuple(naive_packed_backward(*args, cq, ck, **host)) if dtype != np.float64
             else (None,) * 3)
    assert len(grads) == len(ref)
    for name, g, r, n in zip(("dq", "dk", "dv"), grads, ref, naive):
        assert_close_to_reference(g, r, n, FLOORS[dtype.name] * 4, name)
    if len(ref) == 4:  # dsinks: -sum_i P_sink_i D_i in float64 from the same out, lse and dout
        np.testing.assert_allclose(to_host(grads[3]).astype(np.float64), ref[3], rtol=1e-6,
                                   atol=1e-9)


# (name, Lq, Lk, H, Hkv, Dk, Dv, options): lengths not tile multiples, Lq > Lk and Lq < Lk in one
# batch, empty sequences on either side
CASES = [
    ("plain", [5, 17, 1, 33], [9, 4, 30, 33], 2, 2, 16, 16, {}),
    ("causal-bottom-right", [7, 20, 3, 1], [12, 5, 3, 9], 2, 1, 8, 12, dict(causal=True)),
    ("causal-top-left", [7, 20, 3], [12, 5, 9], 3, 3, 8, 8, dict(causal=True, align="top-left")),
    ("window", [9, 30, 4], [14, 30, 2], 2, 2, 16, 8, dict(window=(3, 2))),
    ("causal-window", [9, 30, 4], [14, 26, 8], 4, 2, 8, 8, dict(window=(4, 1), causal=True)),
    ("gqa-softcap", [11, 6], [5, 19], 6, 2, 16, 16, dict(softcap=2.0, scale=0.7)),
    ("alibi", [13, 2, 25], [20, 9, 25], 4, 2, 8, 8, dict(causal=True)),
    ("sinks", [6, 0, 15], [10, 3, 0], 4, 4, 8, 8, dict(window=(5, 0))),
    ("empty", [0, 4, 3, 0, 2], [5, 0, 2, 0, 0], 2, 1, 8, 4, dict(causal=True)),
]


def case_options(name, options, B, H, rng, xp=np):
    options = dict(options)
    if name == "alibi":
        options["alibi_slopes"] = xp.asarray(2.0 ** -np.arange(1, H + 1))  # (H,)
    if name == "sinks":
        options["sinks"] = xp.asarray(rng.standard_normal((B, H)).astype(np.float32))  # (B, H)
    return options


# ---- the reference ----------------------------------------------------------------------------

@pytest.mark.parametrize("align", ["bottom-right", "top-left"])
def test_reference_is_the_packed_formula(align, rng):
    """The packed reference is softmax over the packed (total_q, total_k) logits with the
    per-sequence rule written out densely here: token t of sequence b (its i-th) sees key u of
    sequence b (its j-th) iff j <= i + Lk - Lq (bottom-right) or j <= i (top-left), within the
    window; with GQA and ALiBi's -slope * |p - j| at the aligned position p."""
    Lq, Lk, H, Hkv = [4, 0, 7, 3], [6, 3, 2, 0], 4, 2
    q, k, v, cq, ck = packed_inputs(rng, Lq, Lk, H, Hkv, 8, 5, "float64")
    slopes = np.array([0.5, 0.25, 0.125, 1.0])
    opts = dict(causal=True, window=(3, None), align=align, alibi_slopes=slopes, scale=0.6)
    out, lse = reference.attention(q, k, v, cu_seqlens_q=cq, cu_seqlens_k=ck, return_lse=True,
                                   **opts)
    seq_q = np.repeat(np.arange(4), Lq)
    seq_k = np.repeat(np.arange(4), Lk)
    i = np.arange(cq[-1]) - cq[seq_q]
    j = np.arange(ck[-1]) - ck[seq_k]
    p = i + (np.array(Lk)[seq_q] - np.array(Lq)[seq_q] if align == "bottom-right" else 0)
    p, j2 = p[:, None], j[None, :]
    visible = (seq_q[:, None] == seq_k[None, :]) & (j2 <= p) & (j2 >= p - 3)
    for h in range(H):
        s = 0.6 * q[:, h] @ k[:, h // 2].T - slopes[h] * np.abs(p - j2)
        s = np.where(visible, s, -np.inf)
        seen = visible.any(axis=1)
        m = np.where(seen, s.max(axis=1), 0)
        w = np.exp(s - m[:, None])
        want = np.where(seen[:, None], (w @ v[:, h // 2]) / np.where(seen, w.sum(1), 1)[:, None],
                        0)
        np.testing.assert_allclose(out[:, h], want, rtol=1e-12, atol=1e-13)
        want_lse = np.where(seen, m + np.log(np.where(seen, w.sum(1), 1)), -np.inf)
        np.testing.assert_allclose(lse[:, h], want_lse, rtol=1e-12)
    assert (lse[cq[3]:] == -np.inf).all() and (out[cq[3]:] == 0).all()  # Lk = 0: empty rows


def test_reference_gradients_match_finite_differences(rng):
    """The packed reference's dq, dk, dv, dsinks against central differences of sum(out * dout)."""
    q, k, v, cq, ck = packed_inputs(rng, [3, 2, 0], [2, 4, 1], 2, 1, 3, 2, "float64", gain=2.0)
    sinks = np.array([0.3, -0.5])
    opts = dict(causal=True, softcap=1.5, sinks=sinks, cu_seqlens_q=cq, cu_seqlens_k=ck)
    out, lse = reference.attention(q, k, v, return_lse=True, **opts)
    dout = rng.standard_normal(out.shape)
    grads = reference.attention_backward(dout, q, k, v, out, lse, **opts)
    _finite_differences(reference.attention, (q, k, v, sinks), grads, dout, opts)


def _finite_differences(fn, inputs, grads, dout, opts):
    """grads against central differences; opts holds inputs[3] (the sinks) itself."""
    q, k, v, _ = inputs
    for x, g in zip(inputs, grads):
        num = numeric_gradient(lambda: (fn(q, k, v, **opts) * dout).sum(), x)
        np.testing.assert_allclose(g, num, rtol=1e-6, atol=1e-8)


# ---- the NumPy path ---------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_numpy_path(case, dtype, rng):
    name, Lq, Lk, H, Hkv, Dk, Dv, options = case
    q, k, v, cq, ck = packed_inputs(rng, Lq, Lk, H, Hkv, Dk, Dv, dtype)
    opts = case_options(name, options, len(Lq), H, rng)
    packed = dict(cu_seqlens_q=cq, cu_seqlens_k=ck)
    out, lse = cuflash.attention(q, k, v, return_lse=True, **packed, **opts)
    assert out.shape == (cq[-1], H, Dv) and out.dtype == q.dtype and lse.shape == (cq[-1], H)
    check_packed_forward(out, lse, q, k, v, cq, ck, **opts)
    dout = to_array(np, rng.standard_normal(out.shape), _dtype(dtype))
    grads = cuflash.attention_backward(dout, q, k, v, out, lse, **packed, **opts)
    assert [g.shape for g in grads[:3]] == [q.shape, k.shape, v.shape]
    assert all(g.dtype == q.dtype for g in grads[:3])
    check_packed_backward(grads, dout, q, k, v, out, lse, cq, ck, **opts)
    out2, vjp = cuflash.attention_vjp(q, k, v, **packed, **opts)
    np.testing.assert_array_equal(out2, out)
    for a, b in zip(vjp(dout), grads):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("seed", range(12))
def test_numpy_random_batches(seed):
    """Random batches (1-6 sequences, lengths 0-40 on either side, GQA, any alignment, causal or
    not, a random window, softcap, ALiBi, sinks) in float64 against the reference, forward and
    backward."""
    rng = np.random.default_rng(seed)
    B = int(rng.integers(1, 7))
    Lq, Lk = rng.integers(0, 41, B), rng.integers(0, 41, B)
    Hkv = int(rng.integers(1, 3))
    H = Hkv * int(rng.integers(1, 4))
    q, k, v, cq, ck = packed_inputs(rng, Lq, Lk, H, Hkv, 8, int(rng.integers(1, 9)), "float64",
                                    gain=2.0)
    sides = [None if rng.random() < 0.3 else int(rng.integers(0, 12)) for _ in range(2)]
    opts = dict(causal=bool(rng.random() < 0.5),
                align="bottom-right" if rng.random() < 0.5 else "top-left",
                window=None if rng.random() < 0.4 else tuple(sides))
    if rng.random() < 0.5:
        opts["softcap"] = float(rng.uniform(0.5, 4))
    if rng.random() < 0.5:
        opts["alibi_slopes"] = rng.uniform(0, 0.5, (B, H) if rng.random() < 0.5 else (H,))
    if rng.random() < 0.5:
        opts["sinks"] = rng.standard_normal(H)
    packed = dict(cu_seqlens_q=cq, cu_seqlens_k=ck)
    out, lse = cuflash.attention(q, k, v, return_lse=True, **packed, **opts)
    check_packed_forward(out, lse, q, k, v, cq, ck, **opts)
    dout = rng.standard_normal(out.shape)
    grads = cuflash.attention_backward(dout, q, k, v, out, lse, **packed, **opts)
    check_packed_backward(grads, dout, q, k, v, out, lse, cq, ck, **opts)


def test_numpy_gradients_match_finite_differences(rng):
    """cuflash's packed gradients (the NumPy path, float64) against central differences of its
    own forward: causal bottom-right with Lq > Lk and Lq < Lk, GQA, ALiBi, sinks per (B, H)."""
    q, k, v, cq, ck = packed_inputs(rng, [4, 1, 3], [2, 5, 3], 4, 2, 3, 2, "float64")
    sinks = rng.standard_normal((3, 4))
    opts = dict(causal=True, alibi_slopes=np.array([0.5, 0.1, 0.3, 0.2]), sinks=sinks,
                cu_seqlens_q=cq, cu_seqlens_k=ck)
    out, lse = cuflash.attention(q, k, v, return_lse=True, **opts)
    dout = rng.standard_normal(out.shape)
    grads = cuflash.attention_backward(dout, q, k, v, out, lse, **opts)
    assert grads[3].shape == (3, 4)
    _finite_differences(cuflash.attention, (q, k, v, sinks), grads, dout, opts)


def test_offsets_forms_and_max_seqlen(rng):
    """Offsets as a list, int32 or int64 arrays give one result, bit for bit; a max_seqlen above
    the longest sequence changes nothing (the work is padded to the longest)."""
    q, k, v, cq, ck = packed_inputs(rng, [5, 9, 2], [7, 3, 11], 2, 2, 8, 8, "float32")
    base = cuflash.attention(q, k, v, cu_seqlens_q=cq, cu_seqlens_k=ck, causal=True)
    for fq, fk, extra in ((list(cq), list(ck), {}), (cq.astype(np.int64), ck, {}),
                          (cq, ck, dict(max_seqlen_q=9, max_seqlen_k=40))):
        got = cuflash.attention(q, k, v, cu_seqlens_q=fq, cu_seqlens_k=fk, causal=True, **extra)
        np.testing.assert_array_equal(got, base)


def test_strided_packed_inputs(rng):
    """q, k, v read out of one packed (total, 3, H, D) qkv array (FlashAttention's packed-qkv
    layout), and a reversed token axis: the same result as contiguous copies, forward and
    backward."""
    lengths = [6, 11, 1]
    cq = offsets(lengths)
    qkv = rng.standard_normal((cq[-1], 3, 2, 8))
    q, k, v = qkv[:, 0], qkv[:, 1][::-1], qkv[:, 2]
    opts = dict(cu_seqlens_q=cq, cu_seqlens_k=cq, causal=True, window=(4, 0))
    out, lse = cuflash.attention(q, k, v, return_lse=True, **opts)
    copies = [np.ascontiguousarray(x) for x in (q, k, v)]
    np.testing.assert_array_equal(out, cuflash.attention(*copies, **opts))
    dout = rng.standard_normal(out.shape)[::-1]
    grads = cuflash.attention_backward(dout, q, k, v, out, lse, **opts)
    for a, b in zip(grads, cuflash.attention_backward(np.ascontiguousarray(dout), *copies, out,
                                                      lse, **opts)):
        np.testing.assert_array_equal(a, b)
    check_packed_backward(grads, dout, q, k, v, out, lse, cq, cq, causal=True, window=(4, 0))


def test_new_offsets_of_one_layout(rng):
    """Two calls whose padded Problems share a signature (same totals, longest sequences and key
    lengths) but whose query offsets differ: each gathers its own tokens (the row maps are keyed
    by the offsets' values, not by the Problem)."""
    q, k, v, _, ck = packed_inputs(rng, [3, 5], [6, 6], 2, 2, 8, 8, "float64")
    for lengths in ([3, 5], [5, 3]):
        cq = offsets(lengths)
        out = cuflash.attention(q, k, v, cu_seqlens_q=cq, cu_seqlens_k=ck, causal=True)
        ref = reference.attention(q, k, v, cu_seqlens_q=cq, cu_seqlens_k=ck, causal=True)
        np.testing.assert_allclose(out, ref, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("lengths", [([], []), ([0, 0], [0, 0]), ([0, 3], [2, 0]), ([2], [0])],
                         ids=str)
def test_empty_batches(lengths, rng):
    """No sequence, no tokens, or no keys: empty or zero rows (lse -inf), zero gradients."""
    q, k, v, cq, ck = packed_inputs(rng, *lengths, 2, 1, 4, 3, "float32")
    opts = dict(cu_seqlens_q=cq, cu_seqlens_k=ck, causal=True)
    out, lse = cuflash.attention(q, k, v, return_lse=True, **opts)
    assert out.shape == (cq[-1], 2, 3) and (out == 0).all() and (lse == -np.inf).all()
    grads = cuflash.attention_backward(np.ones_like(out), q, k, v, out, lse, **opts)
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]
    assert all((g == 0).all() for g in grads)


# ---- errors -----------------------------------------------------------------------------------

def _misuse(rng):
    q, k, v, cq, ck = packed_inputs(rng, [3, 4], [5, 2], 4, 2, 8, 8, "float32")
    P = dict(cu_seqlens_q=cq, cu_seqlens_k=ck)
    return q, k, v, cq, ck, P


MISUSES = [
    ("q only", lambda q, k, v, cq, ck, P: dict(cu_seqlens_q=cq), ValueError,
     "cu_seqlens_q and cu_seqlens_k must be given together, got cu_seqlens_k=None"),
    ("max without offsets", lambda q, k, v, cq, ck, P: dict(max_seqlen_q=4), ValueError,
     "max_seqlen_q is only taken with cu_seqlens_q and cu_seqlens_k"),
    ("float offsets", lambda q, k, v, cq, ck, P: {**P, "cu_seqlens_q": cq.astype(float)},
     TypeError, "cu_seqlens_q must hold int32"),
    ("2-D offsets", lambda q, k, v, cq, ck, P: {**P, "cu_seqlens_k": ck[None]}, ValueError,
     r"cu_seqlens_k must have shape \(B \+ 1,\)"),
    ("lengths differ", lambda q, k, v, cq, ck, P: {**P, "cu_seqlens_k": [0, 5, 7, 7]},
     ValueError, "cu_seqlens_q and cu_seqlens_k must have one length B"),
    ("not from 0", lambda q, k, v, cq, ck, P: {**P, "cu_seqlens_q": [1, 3, 7]}, ValueError,
     r"cu_seqlens_q must start at 0, got cu_seqlens_q\[0\] = 1"),
    ("decreasing", lambda q, k, v, cq, ck, P: {**P, "cu_seqlens_k": [0, 6, 5]}, ValueError,
     r"cu_seqlens_k must be non-decreasing, got cu_seqlens_k\[1\] = 6 > cu_seqlens_k\[2\] = 5"),
    ("total", lambda q, k, v, cq, ck, P: {**P, "cu_seqlens_q": [0, 3, 6]}, ValueError,
     r"cu_seqlens_q\[-1\] must be the number of packed tokens q.shape\[0\] = 7, got 6"),
    ("max too small", lambda q, k, v, cq, ck, P: {**P, "max_seqlen_k": 4}, ValueError,
     "max_seqlen_k must be at least the longest sequence's length 5"),
    ("max bool", lambda q, k, v, cq, ck, P: {**P, "max_seqlen_q": True}, TypeError,
     "max_seqlen_q must be a non-negative int or None"),
    ("max negative", lambda q, k, v, cq, ck, P: {**P, "max_seqlen_q": -1}, ValueError,
     "max_seqlen_q must be non-negative"),
    ("mask", lambda q, k, v, cq, ck, P: {**P, "mask": np.ones((7, 7), bool)}, ValueError,
     "mask is not defined for packed sequences"),
    ("bias", lambda q, k, v, cq, ck, P: {**P, "bias": np.zeros((7, 7))}, ValueError,
     "bias is not defined for packed sequences"),
    ("kv_lens", lambda q, k, v, cq, ck, P: {**P, "kv_lens": 3}, ValueError,
     "kv_lens is not defined for packed sequences"),
    ("positions", lambda q, k, v, cq, ck, P: {**P, "positions": (0, 2)}, ValueError,
     "positions is not defined for packed sequences"),
]


@pytest.mark.parametrize("fn", ["attention", "attention_backward", "attention_vjp"])
@pytest.mark.parametrize("misuse", MISUSES, ids=[m[0] for m in MISUSES])
def test_errors(fn, misuse, rng, monkeypatch):
    """Each misuse raises its named error before any work (the dispatch is never reached)."""
    from cuflash import api
    _, make, error, message = misuse
    q, k, v, cq, ck, P = _misuse(rng)
    out, lse = cuflash.attention(q, k, v, return_lse=True, **P)
    monkeypatch.setattr(api, "_dispatch", lambda problem: pytest.fail("dispatch reached"))
    kwargs = make(q, k, v, cq, ck, P)
    with pytest.raises(error, match=f"^{fn}: {message}"):
        if fn == "attention_backward":
            cuflash.attention_backward(out, q, k, v, out, lse, **kwargs)
        else:
            getattr(cuflash, fn)(q, k, v, **kwargs)


@pytest.mark.parametrize("change, error, message", [
    (lambda q, k, v: (q[None], k, v), ValueError,
     r"with cu_seqlens, q must have shape \(total_q, H, Dk\), got q.shape=\(1, 7, 4, 8\)"),
    (lambda q, k, v: (q, k, v[:, :1]), ValueError,
     "k and v must hold the same tokens and kv heads"),
    (lambda q, k, v: (q[:, :3], k, v), ValueError, "q's heads .axis 1. must be a multiple"),
    (lambda q, k, v: (q[..., :4], k, v), ValueError, "q and k must have the same head dim"),
    (lambda q, k, v: (q.astype(np.int32), k, v), TypeError, "q must have dtype"),
    (lambda q, k, v: (q, k.astype(np.float64), v), TypeError, "q, k and v must have one dtype"),
])
def test_shape_errors(change, error, message, rng):
    q, k, v, cq, ck, P = _misuse(rng)
    with pytest.raises(error, match=f"^attention: {message}"):
        cuflash.attention(*change(q, k, v), **P)


def test_block_table_and_backward_inputs_are_checked(rng):
    q, k, v, cq, ck, P = _misuse(rng)
    with pytest.raises(ValueError, match="^attention: block_table is not defined for packed"):
        cuflash.attention(q, k, v, block_table=np.zeros((2, 1), np.int32), **P)
    out, lse = cuflash.attention(q, k, v, return_lse=True, **P)
    with pytest.raises(ValueError, match=r"^attention_backward: lse must have shape .* = \(7, 4\)"):
        cuflash.attention_backward(out, q, k, v, out, lse.T, **P)  # FlashAttention's (H, total)
    with pytest.raises(ValueError, match=r"^attention_backward: dout must have the output's shape"):
        cuflash.attention_backward(out[:-1], q, k, v, out, lse, **P)
    _, vjp = cuflash.attention_vjp(q, k, v, **P)
    with pytest.raises(TypeError, match="^attention_vjp: dout must have q's dtype"):
        vjp(out.astype(np.float64))


def test_reference_checks_like_the_api(rng):
    q, k, v, cq, ck, P = _misuse(rng)
    with pytest.raises(ValueError, match="^attention: cu_seqlens_q must start at 0"):
        reference.attention(q, k, v, **{**P, "cu_seqlens_q": [1, 3, 7]})
    with pytest.raises(ValueError, match="^attention_backward: mask is not defined"):
        reference.attention_backward(q, q, k, v, q, q[..., 0], mask=np.ones((7, 7), bool), **P)


# ---- the CUDA paths ---------------------------------------------------------------------------

GPU_CASES = [
    ("plain", [100, 37, 1, 250], [130, 64, 300, 250], 4, 2, 64, 64, {}),
    ("causal-bottom-right", [77, 300, 5, 0], [128, 200, 33, 10], 2, 2, 128, 128,
     dict(causal=True)),
    ("causal-top-left", [77, 300, 5], [128, 200, 33], 2, 1, 64, 64,
     dict(causal=True, align="top-left")),
    ("causal-window", [150, 40, 260], [150, 90, 200], 4, 4, 64, 64, dict(causal=True,
                                                                          window=(50, 0))),
    ("alibi", [90, 1, 200], [120, 70, 200], 4, 2, 64, 64, dict(causal=True)),
    ("sinks", [64, 0, 129], [200, 17, 0], 4, 4, 96, 96, dict(softcap=3.0)),
    ("empty", [0, 40, 33, 0, 7], [50, 0, 60, 0, 0], 2, 2, 32, 32, dict(causal=True)),
    ("dk-dv", [65, 130], [90, 40], 2, 2, 96, 48, dict(window=(20, 20))),
]
GPU_DTYPES = ["float16", "float32", "float64"] + (["bfloat16"] if BFLOAT16 is not None else [])


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["generic", "mma", "wgmma", "wide", "auto"])
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("case", GPU_CASES, ids=[c[0] for c in GPU_CASES])
def test_cuda_paths(case, dtype, path, rng, override):
    """Host offsets on CuPy inputs, every path forced (the generic kernels where it declines),
    outputs and padded buffers NaN-poisoned: forward, backward (both dq modes) and vjp."""
    import cupy
    name, Lq, Lk, H, Hkv, Dk, Dv, options = case
    override(poison=True, path=None if path == "auto" else path)
    q, k, v, cq, ck = packed_inputs(rng, Lq, Lk, H, Hkv, Dk, Dv, dtype, cupy)
    opts = case_options(name, options, len(Lq), H, rng, cupy)
    packed = dict(cu_seqlens_q=cq, cu_seqlens_k=ck)
    out, lse = cuflash.attention(q, k, v, return_lse=True, **packed, **opts)
    check_packed_forward(out, lse, q, k, v, cq, ck, **opts)
    dout = to_array(cupy, rng.standard_normal(out.shape), _dtype(dtype))
    for deterministic in (False, True):
        grads = cuflash.attention_backward(dout, q, k, v, out, lse, deterministic=deterministic,
                                           **packed, **opts)
        check_packed_backward(grads, dout, q, k, v, out, lse, cq, ck, **opts)
    _, vjp = cuflash.attention_vjp(q, k, v, deterministic=True, **packed, **opts)
    for a, b in zip(vjp(dout), grads):
        assert np.array_equal(to_host(a), to_host(b), equal_nan=True)


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["split", "split-simt", "auto"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_cuda_decode(path, dtype, rng, override):
    """A packed decode step (one or a few queries per sequence against long keys): the padded
    Problem (Nq = max_q <= 16) takes the split-KV decode kernels."""
    import cupy
    from cuflash import _gpu, api
    if dtype == "bfloat16" and BFLOAT16 is None:
        pytest.skip("ml_dtypes missing")
    override(poison=True, path=None if path == "auto" else path)
    Lq, Lk = [1, 3, 1, 2], [1500, 700, 0, 2048]
    q, k, v, cq, ck = packed_inputs(rng, Lq, Lk, 8, 2, 128, 128, dtype, cupy)
    opts = dict(causal=True)
    defaults = {n: a.default for n, a in inspect.signature(cuflash.attention).parameters.items()}
    names = {**defaults, **opts, "cu_seqlens_q": cq, "cu_seqlens_k": ck}
    assert _gpu.forward_path(api._packed("attention", q, k, v, names)[2]) == "split"
    out, lse = cuflash.attention(q, k, v, cu_seqlens_q=cq, cu_seqlens_k=ck, return_lse=True,
                                 **opts)
    check_packed_forward(out, lse, q, k, v, cq, ck, **opts)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("slack", [0, 37])
def test_cuda_device_offsets(slack, dtype, rng, override):
    """CuPy offsets (with max_seqlen, exact or above the longest sequence) stay on the device:
    the same answers as the reference, forward and backward."""
    import cupy
    if dtype == "bfloat16" and BFLOAT16 is None:
        pytest.skip("ml_dtypes missing")
    override(poison=True)
    Lq, Lk = [40, 0, 129, 7], [64, 33, 100, 0]
    q, k, v, cq, ck = packed_inputs(rng, Lq, Lk, 4, 2, 64, 64, dtype, cupy)
    packed = dict(cu_seqlens_q=cupy.asarray(cq), cu_seqlens_k=cupy.asarray(ck),
                  max_seqlen_q=max(Lq) + slack, max_seqlen_k=max(Lk) + slack)
    for opts in (dict(causal=True), dict(causal=True, align="top-left", window=(16, 0))):
        out, lse = cuflash.attention(q, k, v, return_lse=True, **packed, **opts)
        check_packed_forward(out, lse, q, k, v, cq, ck, **opts)
        dout = to_array(cupy, rng.standard_normal(out.shape), _dtype(dtype))
        grads = cuflash.attention_backward(dout, q, k, v, out, lse, **packed, **opts)
        check_packed_backward(grads, dout, q, k, v, out, lse, cq, ck, **opts)


@pytest.mark.gpu
def test_cuda_device_offsets_need_max_seqlen(rng):
    import cupy
    q, k, v, cq, ck = packed_inputs(rng, [3, 4], [5, 2], 2, 2, 16, 16, "float32", cupy)
    with pytest.raises(TypeError, match="^attention: max_seqlen_q must be an int with a "
                                        "cupy.ndarray cu_seqlens_q"):
        cuflash.attention(q, k, v, cu_seqlens_q=cupy.asarray(cq), cu_seqlens_k=ck)
    with pytest.raises(TypeError, match="^attention: cu_seqlens_k must be a sequence of ints or"):
        cuflash.attention(to_host(q), to_host(k), to_host(v), cu_seqlens_q=cq,
                          cu_seqlens_k=cupy.asarray(ck))


@pytest.mark.gpu
@pytest.mark.parametrize("offsets_on", ["host", "device"])
def test_calls_never_synchronize(offsets_on, rng):
    """A packed forward and backward enqueue work and nothing else: under CUDA stream capture,
    where a synchronizing call or a device-to-host copy raises, they run through (after a first
    call has built the per-layout caches: the host offsets' device copy and row maps)."""
    import cupy
    Lq, Lk = [100, 3, 260], [128, 300, 60]
    q, k, v, cq, ck = packed_inputs(rng, Lq, Lk, 8, 2, 64, 64, "float16", cupy)
    packed = (dict(cu_seqlens_q=cq, cu_seqlens_k=ck) if offsets_on == "host" else
              dict(cu_seqlens_q=cupy.asarray(cq), cu_seqlens_k=cupy.asarray(ck),
                   max_seqlen_q=max(Lq), max_seqlen_k=max(Lk)))
    dout = to_array(cupy, rng.standard_normal((cq[-1], 8, 64)), np.float16)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        out, lse = cuflash.attention(q, k, v, causal=True, return_lse=True, **packed)
        cuflash.attention_backward(dout, q, k, v, out, lse, causal=True, **packed)
        stream.synchronize()
        stream.begin_capture()
        try:
            cuflash.attention(q, k, v, causal=True, return_lse=True, **packed)
            cuflash.attention_backward(dout, q, k, v, out, lse, causal=True, **packed)
        finally:
            stream.end_capture()


@pytest.mark.gpu
def test_graph_replays_new_device_offsets(rng):
    """A captured packed call with device offsets reads them at every replay: offsets changed in
    place (same B, totals and max_seqlen) give the new sequences' attention."""
    import cupy
    H, D = 4, 64
    q, k, v, cq, ck = packed_inputs(rng, [30, 50], [64, 16], H, H, D, D, "float16", cupy)
    dq, dk = cupy.asarray(cq), cupy.asarray(ck)
    packed = dict(cu_seqlens_q=dq, cu_seqlens_k=dk, max_seqlen_q=50, max_seqlen_k=64)
    cuflash.attention(q, k, v, causal=True, **packed)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        out = cuflash.attention(q, k, v, causal=True, **packed)
        graph = stream.end_capture()
        for lq, lk in (([30, 50], [64, 16]), ([50, 30], [16, 64]), ([40, 40], [60, 20])):
            dq[...] = cupy.asarray(offsets(lq))
            dk[...] = cupy.asarray(offsets(lk))
            graph.launch(stream)
            stream.synchronize()
            ref = reference.attention(*(to_host(x) for x in (q, k, v)), causal=True,
                                      cu_seqlens_q=offsets(lq), cu_seqlens_k=offsets(lk))
            naive = naive_packed(q, k, v, offsets(lq), offsets(lk), causal=True)[0]
            assert_close_to_reference(out, ref, naive, FLOORS["float16"], "out")
    cuflash.release_graph_memory()
