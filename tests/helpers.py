"""Shared test helpers: random inputs, same-dtype naive baselines, and the baseline-relative check.

Everything here accepts NumPy or CuPy arrays (CuPy arrays are copied to the host), so that CPU and
GPU tests use the same comparison.
"""
import math

import numpy as np
import pytest

import cuflash
from cuflash import reference

try:
    import ml_dtypes
    BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # bfloat16 tests skip themselves
    BFLOAT16 = None

#: The dtypes the parametrized tests run, by name (bfloat16 where ml_dtypes is installed).
DTYPE_NAMES = ["float64", "float32", "float16"] + (["bfloat16"] if BFLOAT16 is not None else [])


def dtype_of(name):
    """The NumPy dtype of a name of DTYPE_NAMES."""
    return BFLOAT16 if name == "bfloat16" else np.dtype(name)


#: Absolute error allowed on top of 2x the naive baseline's error, per dtype name. The baseline's
#: own error is what scales with the dtype; the floor only absorbs the cases where the baseline
#: happens to be (nearly) exact, e.g. float64 or a single visible key.
FLOORS = {"float64": 1e-12, "float32": 1e-6, "float16": 1e-3, "bfloat16": 8e-3}


def to_host(x):
    """NumPy view/copy of a NumPy or CuPy array (None stays None)."""
    if x is None:
        return None
    if not isinstance(x, np.ndarray) and hasattr(x, "get"):
        return x.get()
    return np.asarray(x)


def to_f64(x):
    return to_host(x).astype(np.float64)


def rand_inputs(rng, shapes, dtype, xp=np):
    """Standard-normal arrays of the given shapes, rounded to ``dtype``, as ``xp`` arrays."""
    dtype = np.dtype(dtype)
    arrays = [rng.standard_normal(shape).astype(dtype) for shape in shapes]
    return [a if xp is np else xp.asarray(a) for a in arrays]


def _arithmetic(dtype):
    """(work dtype, storage dtype) of a naive implementation in ``dtype``.

    16-bit types compute each operation in float32 and round its result to the dtype (what a
    naive GPU implementation with float32-accumulating matmuls does); float32 and float64 compute
    natively in their own precision.
    """
    dtype = np.dtype(dtype)
    if dtype.itemsize == 2:
        return np.float32, dtype
    return dtype.type, None


def naive_attention(q, k, v, **options):
    """Dense attention computed in q's dtype (every intermediate rounded to it).

    Returns ``(out, lse)`` as float64 NumPy arrays holding the same-dtype results: the baseline
    whose error against the float64 reference sets the tolerance.
    """
    work, storage = _arithmetic(to_host(q).dtype)
    dense = reference._Dense(q, k, v, work=work, storage=storage, **_dense_options(options))
    out, lse = dense.forward()
    return out.astype(np.float64), lse.astype(np.float64)


def naive_attention_backward(dout, q, k, v, out, lse, **options):
    """Dense gradients computed in q's dtype; ``(dq, dk, dv)`` (and dsinks with sinks) as float64
    NumPy arrays."""
    work, storage = _arithmetic(to_host(q).dtype)
    dense = reference._Dense(q, k, v, work=work, storage=storage, **_dense_options(options))
    return tuple(g.astype(np.float64) for g in dense.backward(dout, out, lse))


def _dense_options(options):
    names = ("scale", "causal", "align", "window", "mask", "bias", "kv_lens", "positions",
             "softcap", "sinks", "alibi_slopes", "dropout_p", "dropout_seed")
    defaults = dict(scale=None, causal=False, align="bottom-right", window=None, mask=None,
                    bias=None, kv_lens=None, positions=None, softcap=None, sinks=None,
                    alibi_slopes=None, dropout_p=0.0, dropout_seed=None)
    return {name: options.get(name, defaults[name]) for name in names}


def assert_close_to_reference(got, ref64, naive_same_dtype, floor, name="out"):
    """Assert ``|got - ref64| <= 2 * |naive_same_dtype - ref64| + floor`` (max over elements).

    Where the reference is not finite (lse = -inf on empty rows) ``got`` must equal it exactly.
    ``got`` must hold no NaN anywhere. ``naive_same_dtype`` may be None (baseline error 0).
    On failure the message gives max and mean errors of ``got`` and of the baseline.
    """
    got, ref = to_f64(got), to_f64(ref64)
    assert got.shape == ref.shape, f"{name}: shape {got.shape}, expected {ref.shape}"
    assert not np.isnan(got).any(), f"{name}: {int(np.isnan(got).sum())} NaN entries"
    finite = np.isfinite(ref)
    bad = ~finite & (got != ref)
    assert not bad.any(), (
        f"{name}: {int(bad.sum())} entries differ where the reference is {ref[bad][:3]}: "
        f"got {got[bad][:3]}")
    if not finite.any():
        return
    err = np.abs(got[finite] - ref[finite])
    if naive_same_dtype is None:
        base = np.zeros(1)
    else:
        naive = to_f64(naive_same_dtype)
        both = finite & np.isfinite(naive)  # a naive 16-bit row may overflow: no baseline there
        base = np.abs(naive[both] - ref[both]) if both.any() else np.zeros(1)
    limit = 2 * base.max() + floor
    assert err.max() <= limit, (
        f"{name}: max error {err.max():.3e} (mean {err.mean():.3e}) exceeds "
        f"2 x naive max error {base.max():.3e} (mean {base.mean():.3e}) + floor {floor:.1e}")


def to_array(xp, host, dtype):
    """A NumPy or CuPy (``xp``) array of ``dtype`` holding ``host`` (bfloat16 goes to CuPy
    through its bits)."""
    host = np.asarray(host).astype(dtype)
    if xp is np:
        return host
    if dtype == BFLOAT16:
        return xp.asarray(host.view(np.uint16)).view(dtype)
    return xp.asarray(host)


def _host_options(options):
    return {name: to_host(x) if hasattr(x, "shape") else x for name, x in options.items()}


def check_forward(out, lse, q, k, v, **options):
    """cuflash's ``out``, ``lse`` against the float64 reference, within 2x a same-dtype naive
    baseline; returns the reference lse."""
    dtype = np.dtype(q.dtype)
    low = dtype != np.float64
    qh, kh, vh = (to_host(x) for x in (q, k, v))
    host_options = _host_options(options)
    ref_out, ref_lse = reference.attention(qh, kh, vh, return_lse=True, **host_options)
    naive = naive_attention(qh, kh, vh, **host_options) if low else (None, None)
    assert_close_to_reference(out, ref_out, naive[0], FLOORS[dtype.name], "out")
    assert_close_to_reference(lse, ref_lse, naive[1], FLOORS[dtype.name], "lse")
    return ref_lse


def check_backward(grads, dout, q, k, v, out, lse, **options):
    """cuflash's (dq, dk, dv), and dsinks with sinks, against the float64 reference's for the same
    dout, out and lse, within 2x a same-dtype naive baseline (floor 4x the forward's)."""
    dtype = np.dtype(q.dtype)
    low = dtype != np.float64
    qh, kh, vh, douth, outh, lseh = (to_host(x) for x in (q, k, v, dout, out, lse))
    host_options = _host_options(options)
    ref = reference.attention_backward(douth, qh, kh, vh, outh, lseh, **host_options)
    base = (naive_attention_backward(douth, qh, kh, vh, outh, lseh, **host_options) if low
            else (None,) * len(ref))
    assert len(grads) == len(ref), f"{len(grads)} gradients, expected {len(ref)}"
    for name, g, r, n in zip(("dq", "dk", "dv", "dsinks"), grads, ref, base):
        assert_close_to_reference(g, r, n, FLOORS[dtype.name] * 4, name)


#: The seed's counterexamples: (v of the two keys, the right out). One query, keys with logits
#: (0, log 3) at scale 1, so weights (1/4, 3/4) and lse = log 4.
SEED_COUNTEREXAMPLES = [((0.0, 1.0), 0.75), ((1.0, 0.0), 0.25)]


def check_seed_counterexample(attention, values, want):
    """``attention`` (cuflash's or the reference's) must give out = ``want`` and lse = log 4 on the
    seed's counterexample. Summing tile-local softmax outputs gives 1 (1/2 as an average); rescaling
    l but not acc gives 3/4 for values (1, 0)."""
    q = np.array([[1.0]])
    k = np.array([[0.0], [math.log(3)]])
    v = np.array(values).reshape(2, 1)
    out, lse = attention(q, k, v, scale=1.0, return_lse=True)
    assert abs(out[0, 0] - want) <= 1e-15, f"out {out[0, 0]!r}, expected {want}"
    assert abs(lse[0] - math.log(4)) <= 1e-15, f"lse {lse[0]!r}, expected log 4"


def call_public(fn, q, k, v, **options):
    """Call the public function named ``fn`` with ``options`` (attention_backward on an out and lse
    of the forward without them): what the validation tests run."""
    if fn == "attention_backward":
        out, lse = cuflash.attention(q, k, v, return_lse=True)
        return cuflash.attention_backward(out, q, k, v, out, lse, **options)
    return getattr(cuflash, fn)(q, k, v, **options)


def check_call(xp, rng, q, k, v, orders=(False,), **options):
    """attention(q, k, v, **options) against the reference (check_forward), then its backward
    for a random dout in each dQ order of ``orders`` (deterministic False / True: the atomic
    and the fixed-order dQ) (check_backward); returns (out, lse, dout, the last order's
    gradients)."""
    out, lse = cuflash.attention(q, k, v, return_lse=True, **options)
    check_forward(out, lse, q, k, v, **options)
    dout = to_array(xp, rng.standard_normal(out.shape), np.dtype(q.dtype))
    for deterministic in orders:
        grads = cuflash.attention_backward(dout, q, k, v, out, lse, deterministic=deterministic,
                                           **options)
        check_backward(grads, dout, q, k, v, out, lse, **options)
    return out, lse, dout, grads


def numeric_gradient(loss, x, h=1e-6):
    """The central-difference gradient of the scalar ``loss()`` with respect to the float64
    NumPy array x, which it perturbs in place (and restores) entry by entry."""
    num = np.zeros_like(x)
    for idx in np.ndindex(x.shape):
        old = x[idx]
        x[idx] = old + h
        up = loss()
        x[idx] = old - h
        down = loss()
        x[idx] = old
        num[idx] = (up - down) / (2 * h)
    return num


def decode_options(name, rng, lead, Nq, Nk, xp):
    """The options of a split-KV decode case by name (plain, kv_lens, kv_lens-device,
    causal-window, mask-bias; kv_lens, mask and bias drawn here) for leading axes `lead`."""
    lens = np.array([Nk, Nk // 3 + 5])[: lead[0]].reshape(lead[:1] + (1,) * (len(lead) - 1))
    if name == "plain":
        return {}
    if name == "kv_lens":
        return dict(kv_lens=lens)
    if name == "kv_lens-device":
        return dict(kv_lens=xp.asarray(lens), causal=True)
    if name == "causal-window":
        return dict(causal=True, window=(700, 0))
    if name == "mask-bias":
        mask = rng.random(lead + (Nq, Nk)) < 0.7
        mask[(0,) * len(lead) + (1,)] = False  # an empty row
        bias = rng.standard_normal((Nq, Nk)) * 2
        bias[0, ::3] = -np.inf                   # -inf hides
        return dict(mask=xp.asarray(mask), bias=xp.asarray(bias.astype(np.float32)),
                    kv_lens=lens)
    raise KeyError(name)


def on_decode_paths(cases, dtypes):
    """A GPU test's parameters: the forced split-KV paths ("split", "split-simt"), dtypes and
    decode cases (name, lead_q, lead_kv, Nq, Nk, Dk, Dv), as `path`, `dtype` and `case`."""
    marks = (pytest.mark.gpu,
             pytest.mark.parametrize("path", ["split", "split-simt"]),
             pytest.mark.parametrize("dtype", dtypes),
             pytest.mark.parametrize("case", cases, ids=[f"{c[0]}-nq{c[3]}-d{c[5]}x{c[6]}"
                                                         for c in cases]))

    def mark(test):
        for m in reversed(marks):  # as decorators listed top to bottom
            test = m(test)
        return test
    return mark
