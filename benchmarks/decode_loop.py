#!/usr/bin/env python3
"""Issue 17's token-by-token loop, µs per step, on the GPU: B = 8, 32 / 8 heads, D = 128, a
bfloat16 cache of 8192 keys of which about 4000 are valid, every length growing by one per step.

    python benchmarks/decode_loop.py [--steps 200] [--out FILE.json]

Per step: write the new token's k and v at each sequence's length, then attention over the cache.
Timed (wall clock over the whole loop, ended by a synchronize), in one process on the same data:
  host-lens    kv_lens a NumPy array, advanced on the host
  host-alone   host-lens without the cache writes (lengths from another start, so that none
               repeats): the attention calls' own loop, without subtracting `writes`
  device-lens  kv_lens a CuPy array, advanced in place on the device
  graph        device-lens with the attention call captured once in a CUDA graph and replayed
  kernel       the attention call's device time alone (calls queued behind a GPU spin), device
               kv_lens: the target's denominator (the loop <= 1.2x of it)
  kernel-host  the same with the host kv_lens (their plan, by length bucket)
  host-enqueue host-alone's host time alone: rounds of HOST_ROUNDS_STEPS calls with new lengths
               queued behind a GPU spin, timed without waiting for the device (the best of
               HOST_ROUNDS rounds). Where the kernel is slower than the host (the H100) the
               loops above are device-bound and only this row shows the host's cost; a round
               stays under the 64 pinned staging buffers of _runtime.upload, which a longer
               spin-blocked round would exhaust (its later copies then take cupy.asarray).
The cache writes are the same in every loop; `writes` times them alone.
"""
import argparse
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

B, H, HKV, D, L_MAX, VALID = 8, 32, 8, 128, 8192, 4000
HOST_ROUNDS, HOST_ROUNDS_STEPS = 7, 48


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import cupy
    import cuflash

    import ml_dtypes

    rng = np.random.default_rng(0)
    bf16 = np.dtype(ml_dtypes.bfloat16)

    def randn(*shape):  # bfloat16 on the device, through its bits
        host = rng.standard_normal(shape, np.float32).astype(bf16)
        return cupy.asarray(host.view(np.uint16)).view(bf16)

    k_cache, v_cache = randn(B, HKV, L_MAX, D), randn(B, HKV, L_MAX, D)
    q, new_kv = randn(B, H, 1, D), randn(B, HKV, D)
    start = (VALID + rng.integers(-200, 200, size=(B, 1))).astype(np.int64)
    rows = cupy.arange(B)
    stream = cupy.cuda.Stream(non_blocking=True)

    def loop(step_fn, lens_host=None, lens_dev=None):
        lens_host[...] = start
        lens_dev[...] = cupy.asarray(start)
        stream.synchronize()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            k_cache[rows, :, lens_dev[:, 0]] = new_kv
            v_cache[rows, :, lens_dev[:, 0]] = new_kv
            lens_dev += 1
            lens_host += 1
            step_fn()
        stream.synchronize()
        return (time.perf_counter() - t0) / args.steps * 1e6

    results = {}
    with stream:
        lens_host, lens_dev = start.copy(), cupy.asarray(start)
        for _ in range(3):  # compile and build every table first
            cuflash.attention(q, k_cache, v_cache, kv_lens=lens_host)
            cuflash.attention(q, k_cache, v_cache, kv_lens=lens_dev)
        loop(lambda: None, lens_host, lens_dev)  # the writes' own kernels compile here
        results["writes"] = loop(lambda: None, lens_host, lens_dev)
        results["host-lens"] = loop(lambda: cuflash.attention(q, k_cache, v_cache,
                                                              kv_lens=lens_host),
                                    lens_host, lens_dev)
        lens_host[...] = start + 2 * args.steps  # (lengths no earlier call had)
        stream.synchronize()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            lens_host += 1
            cuflash.attention(q, k_cache, v_cache, kv_lens=lens_host)
        stream.synchronize()
        results["host-alone"] = (time.perf_counter() - t0) / args.steps * 1e6
        results["device-lens"] = loop(lambda: cuflash.attention(q, k_cache, v_cache,
                                                                kv_lens=lens_dev),
                                      lens_host, lens_dev)
        stream.begin_capture()
        cuflash.attention(q, k_cache, v_cache, kv_lens=lens_dev)
        graph = stream.end_capture()
        results["graph"] = loop(lambda: graph.launch(stream), lens_host, lens_dev)
        # device time of one attention call, the host hidden behind a spin
        spin = cupy.RawKernel(r'''extern "C" __global__ void spin(long long c) {
            const long long t0 = clock64(); while (clock64() - t0 < c) {} }''', "spin")
        t0, t1 = cupy.cuda.Event(), cupy.cuda.Event()
        reps = 20
        for name, lens in (("kernel", lens_dev), ("kernel-host", lens_host)):
            cuflash.attention(q, k_cache, v_cache, kv_lens=lens)
            spin((1,), (1,), (np.int64(4_000_000 * reps),))
            t0.record()
            for _ in range(reps):
                cuflash.attention(q, k_cache, v_cache, kv_lens=lens)
            t1.record()
            t1.synchronize()
            results[name] = cupy.cuda.get_elapsed_time(t0, t1) * 1e3 / reps
        # the host's time alone: calls queued behind a spin, never waiting for the device
        lens_host[...] = start + 4 * args.steps  # (lengths no earlier call had)
        best = float("inf")
        for _ in range(HOST_ROUNDS):
            stream.synchronize()
            spin((1,), (1,), (np.int64(40_000_000),))  # ~20 ms: longer than a round's calls
            t_0 = time.perf_counter()
            for _ in range(HOST_ROUNDS_STEPS):
                lens_host += 1
                cuflash.attention(q, k_cache, v_cache, kv_lens=lens_host)
            best = min(best, (time.perf_counter() - t_0) / HOST_ROUNDS_STEPS * 1e6)
        stream.synchronize()
        results["host-enqueue"] = best
        graph = None  # the graph goes before its memory
    cuflash.release_graph_memory()
    for name, us in results.items():
        extra = "" if name in ("kernel", "kernel-host", "writes") else \
            f"  ({us / results['kernel-host']:.2f}x the kernel)" if name in (
                "host-alone", "host-enqueue") else \
            f"  ({(us - results['writes']) / results['kernel']:.2f}x the kernel, writes excluded)"
        print(f"{name:12s} {us:9.1f} us per step{extra}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
