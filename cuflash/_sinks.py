"""Attention sinks (``sinks=``, README "Attention sinks"): a per-head logit t that joins every row's
softmax denominator with value 0.

With L = log(sum_j exp(s_j) + exp(t)) and out = sum_j exp(s_j - L) v_j, the forward is the
sink-free forward (out0, lse0) joined with the sink (``join``): L = logaddexp(lse0, t) and
out = out0 * exp(lse0 - L). The backward's kernels need nothing else: given L and that out, their
P = exp(s - L) is the softmax with the sink, and D = rowsum(dout * out) equals sum_j P_j dP_j
because the sink's value is 0. The sink's own gradient is dt = -sum_i P_sink_i D_i with
P_sink_i = exp(t - L_i) (``probabilities``, then ``gradient``); the lost-row fix of the backward
(kernels_cu/lost_rows.cu, cuflash/_numpy.py) takes the sink into the max and sum it recomputes
and overwrites its rows' P_sink with the exact value. Everything here runs in float64, on the
Problem's library, without a synchronization.
"""

import numpy as np

from . import _broadcast, _config, _runtime

_kernels = {}
_ROWS_PER_BLOCK = 8  # kernels_cu/sinks.cu: one warp a row


def _expr(kernel, dtype, lse_dtype=None):
    """The name expression of a sinks.cu kernel for out's dtype (and the lse's)."""
    types = [_config.c_types(dtype)[0]] + ([_config.c_types(lse_dtype)[0]] if lse_dtype else [])
    return f"{kernel}<{', '.join(types)}>"


def instantiations():
    """The sinks.cu kernels the package can request (the catalog's, for the CI build)."""
    rows = []
    for dt in ("float16", "bfloat16", "float32", "float64"):
        acc = "float64" if dt == "float64" else "float32"
        rows.append(("sink_join_rows", dt, None, "sinks.cu", _expr("sink_join_rows", dt, acc)))
        rows.append(("sink_row_dot", dt, None, "sinks.cu", _expr("sink_row_dot", dt)))
    return rows


def _launch(expr, rows, *args):
    if rows == 0:
        return
    grid = ((rows + _ROWS_PER_BLOCK - 1) // _ROWS_PER_BLOCK,)
    _runtime.launch(_runtime.get_function("sinks.cu", expr), grid, (32 * _ROWS_PER_BLOCK,), args)


def _kernel(name):
    """The CuPy kernels of this module, built once."""
    if name not in _kernels:
        import cupy

        # per row: the weight f and lse L; then per element out *= f (f broadcast over Dv), so
        # that the join's double-precision exp / log1p run once a row, not once an element
        _kernels["join"] = cupy.ElementwiseKernel(
            "X lse0, float64 t", "float64 f, X lse1",
            "double L; sink_join(static_cast<double>(lse0), t, f, L); lse1 = L;",
            "cuflash_sink_join", preamble=_runtime.source("sinks.cu"))
        _kernels["scale"] = cupy.ElementwiseKernel(
            "float64 f", "T o", "o = static_cast<T>(static_cast<double>(o) * f)",
            "cuflash_sink_scale")
        _kernels["probabilities"] = cupy.ElementwiseKernel(
            "X lse, raw float64 sinks, int64 nq", "float64 prob",
            "const double l = lse; prob = isinf(l) && l < 0 ? 0.0 : exp(sinks[i / nq] - l)",
            "cuflash_sink_probabilities")
        _kernels["row_dot"] = cupy.ReductionKernel(
            "T x, T y", "float64 d", "static_cast<double>(x) * static_cast<double>(y)", "a + b",
            "d = a", "0", "cuflash_sink_row_dot", reduce_type="double")
    return _kernels[name]


def _join_numpy(a, t):
    """The NumPy form of kernels_cu/sinks.cu sink_join, elementwise: (f, L) of float64 arrays a, t."""
    with np.errstate(all="ignore"):
        d = a - t
        e = np.exp(-np.abs(d))
        keys = d >= 0
        f = np.where(keys, 1 / (1 + e), e / (1 + e))
        L = np.where(keys, a, t) + np.log1p(e)
        f = np.where(t == -np.inf, 1.0, np.where(t == np.inf, np.nan, f))
        L = np.where(t == -np.inf, a, np.where(t == np.inf, np.nan, L))
    return f, L


def join(p, out, lse):
    """The sink-free forward's out (lead + (Nq, Dv) or (BH, Nq, Dv), p.dtype) and lse (lead +
    (Nq,) or (BH, Nq)) joined with the sinks: the softmax's out and lse with each row's sink
    column (out in place on CuPy). For the paths whose kernels do not take sinks (cuflash/_gpu.py
    SINKS), the NumPy path and the empty Problems (every row empty: out 0, lse the sink)."""
    t = p.sinks.reshape(lse.shape[:-1] + (1,))
    if p.xp is np:
        f, L = _join_numpy(lse.astype(np.float64), t)
        with np.errstate(all="ignore"):
            return ((out.astype(np.float64) * f[..., None]).astype(p.dtype),
                    L.astype(lse.dtype))
    with _runtime.device_of(p.q):
        joined = _runtime.empty(lse.shape, lse.dtype)
        if out.flags.c_contiguous and lse.flags.c_contiguous and out.dtype == p.dtype:
            rows = p.BH * p.Nq
            _launch(_expr("sink_join_rows", p.dtype, lse.dtype), rows, out, lse, joined, p.sinks,
                    np.int64(rows), np.int32(p.Nq), np.int32(p.Dv))
            return out, joined
        f = _runtime.empty(lse.shape, np.float64)
        _kernel("join")(lse, t, f, joined)
        _kernel("scale")(f[..., None], out)
    return out, joined


def probabilities(p, lse):
    """Each row's sink probability P_sink = exp(t - lse), (BH, Nq) float64, from the lse given to
    the backward (0 on an empty row, lse = -inf); the lost-row fix overwrites its rows'."""
    if p.xp is np:
        lse = np.asarray(lse, dtype=np.float64).reshape(p.BH, p.Nq)
        with np.errstate(all="ignore"):
            return np.where(lse == -np.inf, 0.0, np.exp(p.sinks[:, None] - lse))
    with _runtime.device_of(p.q):
        prob = p.xp.empty((p.BH, p.Nq), dtype=np.float64)
        _kernel("probabilities")(lse.reshape(p.BH, p.Nq), p.sinks, np.int64(p.Nq), prob)
    return prob


def gradient(p, dout, out, prob):
    """dsinks = -sum_i P_sink_i D_i, D = rowsum(dout * out) in float64, summed over the rows and
    over the axes on which sinks broadcasts: sinks' shape, p.sinks_dtype."""
    xp = p.xp
    with _runtime.device_of(p.q), np.errstate(all="ignore"):  # NaN and inf propagate as the formula says
        if xp is np:
            delta = np.einsum("...d,...d->...", dout.astype(np.float64), out.astype(np.float64))
        elif (dout.flags.c_contiguous and out.flags.c_contiguous
              and dout.dtype == out.dtype == p.dtype):  # one warp a row
            delta = _runtime.empty(out.shape[:-1], np.float64)
            rows = p.BH * p.Nq
            _launch(_expr("sink_row_dot", p.dtype), rows, dout, out, delta, np.int64(rows),
                    np.int32(p.Dv))
        else:
            delta = _kernel("row_dot")(dout, out, axis=-1)
        per_head = -(prob.reshape(delta.shape) * delta).sum(axis=-1)  # lead
        shape = p.sinks_shape
        g = _broadcast.reduce_to_lead(xp, per_head.reshape(p.lead + (1, 1)), shape + (1, 1))
        return g.reshape(shape).astype(p.sinks_dtype)
