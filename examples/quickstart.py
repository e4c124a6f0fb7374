"""Forward and backward with cuflash, checked against the dense float64 reference, and the memory
it takes next to the naive way (scores = q·kᵀ, softmax, times v), which holds the N×N matrix.

Run: python examples/quickstart.py   (on CuPy if a GPU is usable, else NumPy)
"""
import tracemalloc

import numpy as np

import cuflash

try:
    import cupy
    on_gpu = cupy.is_available()  # a CUDA GPU CuPy can use
except ImportError:
    on_gpu = False
xp, to_host = (cupy, cupy.asnumpy) if on_gpu else (np, np.asarray)


def peak_bytes(fn):
    """The peak memory allocated while fn() runs (its result included): CuPy's pool on a GPU,
    tracemalloc (which sees NumPy's allocations) on the CPU."""
    if not on_gpu:
        tracemalloc.start()
        _ = fn()
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        return peak
    pool = xp.get_default_memory_pool()
    xp.cuda.Device().synchronize()
    pool.free_all_blocks()  # the pool never shrinks while fn runs, so its growth is fn's peak
    before = pool.total_bytes()
    _ = fn()
    xp.cuda.Device().synchronize()
    return pool.total_bytes() - before


def naive_attention(q, k, v):
    s = (q @ k.swapaxes(-1, -2)) * q.shape[-1] ** -0.5  # a Python float keeps float32
    p = xp.exp(s - s.max(axis=-1, keepdims=True))
    return (p / p.sum(axis=-1, keepdims=True)) @ v


B, H, N, D = (2, 16, 8192, 64) if on_gpu else (2, 4, 2048, 64)
rng = np.random.default_rng(0)
q, k, v, dout = (xp.asarray(rng.standard_normal((B, H, N, D), dtype=np.float32)) for _ in range(4))
print(f"backend: {xp.__name__}; q, k, v: (B, H, N, D) = {(B, H, N, D)}, float32, causal")

# Forward (out and the per-row log-sum-exp) and backward, which recomputes scores from q, k, lse.
out, lse = cuflash.attention(q, k, v, causal=True, return_lse=True)
dq, dk, dv = cuflash.attention_backward(dout, q, k, v, out, lse, causal=True)

# The reference is dense float64, so check one head of every batch element against it.
head = (slice(None), slice(0, 1))
ref_out = cuflash.reference.attention(q[head], k[head], v[head], causal=True)
ref_grads = cuflash.reference.attention_backward(dout[head], q[head], k[head], v[head],
                                                 out[head], lse[head], causal=True)
for name, got, ref in zip(("out", "dq", "dk", "dv"), (out, dq, dk, dv), (ref_out,) + ref_grads):
    err = np.abs(to_host(got[head]).astype(np.float64) - ref).max()
    print(f"  max |{name} - reference| = {err:.1e}   (max |reference| = {np.abs(ref).max():.1f})")

# Memory: cuflash's working set grows like N (a tile of keys at a time); the naive way holds the
# B·H·N·N scores and temporaries of that size (it even skips the causal mask, which costs more).
flash_peak = peak_bytes(lambda: cuflash.attention(q, k, v, causal=True, return_lse=True))
naive_peak = peak_bytes(lambda: naive_attention(q, k, v))
mib = 2.0 ** -20
print("memory for one forward pass (peak allocated):")
print(f"  cuflash: {flash_peak * mib:9.1f} MiB   (out + lse alone: "
      f"{(out.nbytes + lse.nbytes) * mib:.1f} MiB)")
print(f"  naive:   {naive_peak * mib:9.1f} MiB   (the B·H·N·N scores alone: "
      f"{B * H * N * N * 4 * mib:.1f} MiB)")
