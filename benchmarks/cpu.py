"""The NumPy path next to naive NumPy attention, on the CPU (``bench.py --cpu``; no GPU).

Naive attention materializes the (Nq, Nk) scores per (batch, head): S = q k^T * scale (causal: a
bottom-right -inf outside the band), P = softmax(S) in the input dtype, out = P v; its backward
materializes P again and forms dV = P^T dO, dS = P (dP - rowsum(dP P)), dQ = dS k * scale,
dK = dS^T q * scale. Both run on the same inputs, in the same process, with the same BLAS.
Reported per case: best-of-``repeat`` seconds for each, the ratio naive / cuflash (> 1: cuflash
is faster) and the peak of Python-traced allocations (tracemalloc sees NumPy's buffers).
"""
import time
import tracemalloc

import numpy as np

CASES = [  # (dtype, B*H, N, D, causal): the shapes of the float32 / float64 issue
    (dt, 8, 2048, 64, causal) for dt in ("float32", "float64") for causal in (False, True)
] + [(dt, 4, 4096, 128, True) for dt in ("float32", "float64")]


def _naive_probabilities(q, k, causal):
    s = (q @ np.swapaxes(k, -1, -2)) * q.dtype.type(q.shape[-1] ** -0.5)
    if causal:
        nq, nk = s.shape[-2:]
        s = np.where(np.tri(nq, nk, nk - nq, dtype=bool), s, -np.inf)
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    return p / p.sum(axis=-1, keepdims=True)


def naive_forward(q, k, v, causal):
    return _naive_probabilities(q, k, causal) @ v


def naive_backward(dout, q, k, v, causal):
    p = _naive_probabilities(q, k, causal)
    scale = q.dtype.type(q.shape[-1] ** -0.5)
    dv = np.swapaxes(p, -1, -2) @ dout
    dp = dout @ np.swapaxes(v, -1, -2)
    ds = p * (dp - (dp * p).sum(axis=-1, keepdims=True))
    return (ds @ k) * scale, (np.swapaxes(ds, -1, -2) @ q) * scale, dv


def _measure(fn, repeat):
    fn()  # warm: first-call costs are not the steady state
    tracemalloc.start()
    try:
        fn()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    best = np.inf
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best, peak


def run(cf, repeat=3, seed=0, cases=CASES):
    """Rows of measurements, one per (case, direction)."""
    rows = []
    for dtype, bh, n, d, causal in cases:
        rng = np.random.default_rng(seed)
        q, k, v, dout = (rng.standard_normal((1, bh, n, d)).astype(dtype) for _ in range(4))
        out, lse = cf.attention(q, k, v, causal=causal, return_lse=True)
        pairs = {
            "fwd": (lambda: cf.attention(q, k, v, causal=causal),
                    lambda: naive_forward(q, k, v, causal)),
            "bwd": (lambda: cf.attention_backward(dout, q, k, v, out, lse, causal=causal),
                    lambda: naive_backward(dout, q, k, v, causal)),
        }
        for direction, (ours, naive) in pairs.items():
            (t_ours, m_ours), (t_naive, m_naive) = _measure(ours, repeat), _measure(naive, repeat)
            rows.append(dict(dtype=dtype, BH=bh, N=n, D=d, causal=causal, direction=direction,
                             cuflash_s=t_ours, naive_s=t_naive, speedup=t_naive / t_ours,
                             cuflash_peak_bytes=m_ours, naive_peak_bytes=m_naive))
    return rows


def format_rows(rows):
    lines = [f"{'case':34s} {'dir':4s} {'cuflash ms':>11s} {'naive ms':>9s} {'naive/cuflash':>14s}"
             f" {'cuflash MiB':>12s} {'naive MiB':>10s}"]
    for r in rows:
        case = f"{r['dtype']} BH={r['BH']} N={r['N']} D={r['D']}" + (" causal" if r["causal"] else "")
        lines.append(f"{case:34s} {r['direction']:4s} {r['cuflash_s'] * 1e3:11.1f} "
                     f"{r['naive_s'] * 1e3:9.1f} {r['speedup']:14.2f} "
                     f"{r['cuflash_peak_bytes'] / 2**20:12.1f} {r['naive_peak_bytes'] / 2**20:10.1f}")
    return "\n".join(lines)
