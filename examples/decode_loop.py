"""A token-by-token decode loop: a preallocated KV cache, the lengths in a device array that the
loop updates in place, and the attention step captured once in a CUDA graph and replayed.

    python examples/decode_loop.py

On a GPU (CuPy) every step is: append the new token's k and v at each sequence's length, add 1 to
the lengths, replay the graph (cuflash reads the lengths on the device: no synchronization, no
new plan). Without a GPU the same loop runs on NumPy, with eager calls.
"""
import numpy as np

import cuflash

B, H, HKV, D = 4, 32, 8, 128   # batch, query heads, kv heads (grouped-query attention), head dim
L_MAX, STEPS = 2048, 24        # cache capacity, tokens to decode

try:
    import cupy
    gpu = cupy.cuda.runtime.getDeviceCount() > 0
except Exception:  # no CuPy, or no driver
    gpu = False
xp = cupy if gpu else np
dtype = np.float16 if gpu else np.float32
rng = np.random.default_rng(0)


def randn(*shape):
    return xp.asarray(rng.standard_normal(shape).astype(dtype))


prompt = rng.integers(100, 1000, size=B)            # each sequence's prompt length
k_cache, v_cache = xp.zeros((B, HKV, L_MAX, D), dtype), xp.zeros((B, HKV, L_MAX, D), dtype)
for b, n in enumerate(prompt):
    k_cache[b, :, :n], v_cache[b, :, :n] = randn(HKV, n, D), randn(HKV, n, D)
lens = xp.array(prompt.reshape(B, 1))               # (B, 1): one length for all heads of a row
q = randn(B, H, 1, D)                               # the step's query, rewritten each token
rows = xp.arange(B)


def step():
    return cuflash.attention(q, k_cache, v_cache, kv_lens=lens)


if gpu:
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        step()                                      # builds the layout's tables (once)
        stream.synchronize()
        stream.begin_capture()
        out = step()                                # the graph writes this array on each replay
        graph = stream.end_capture()

worst = 0.0
with (stream if gpu else np.errstate()):
    for t in range(STEPS):
        new_k, new_v = randn(B, HKV, D), randn(B, HKV, D)
        k_cache[rows, :, lens[:, 0]] = new_k        # append at each sequence's length
        v_cache[rows, :, lens[:, 0]] = new_v
        lens += 1
        q[...] = randn(B, H, 1, D)
        if gpu:
            graph.launch(stream)
            got = out
        else:
            got = step()
        if t % 8 == 7:                              # against attention over the valid keys only
            for b in range(B):
                n = int(lens[b, 0])
                ref = cuflash.reference.attention(
                    *(np.asarray(x.get() if gpu else x, np.float64)
                      for x in (q[b], k_cache[b, :, :n], v_cache[b, :, :n])))
                g = np.asarray(got[b].get() if gpu else got[b], np.float64)
                worst = max(worst, float(np.abs(g - ref).max()))
    if gpu:
        stream.synchronize()

print(f"{'CuPy, one CUDA graph replayed' if gpu else 'NumPy, eager calls'}: {STEPS} tokens, "
      f"lengths {prompt.tolist()} -> {[int(x) for x in (lens.get() if gpu else lens)[:, 0]]}, "
      f"max |out - reference| {worst:.1e}")
if gpu:
    del graph
    cuflash.release_graph_memory()
