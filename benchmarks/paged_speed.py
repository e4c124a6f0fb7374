"""Paged decode against the contiguous cache (issue 17's target: paged >= 0.95x contiguous).

    python benchmarks/paged_speed.py [--reps 50]

One decode step (Nq = 1), B = 8, 32 query heads on 8 kv heads, D = 128, bfloat16, every
sequence L keys, L = 4096 and 16384: the contiguous cache (B, 8, L, 128) against page pools
(num_pages, 8, page_size, 128) with the pages of each sequence shuffled over the pool, page sizes
16, 64 and 256, kv_lens a CuPy array (the decode loop's form). Device time of one attention call:
the call captured in a CUDA graph, CUDA events around each replay, median of --reps after
warm-ups (so the host's work, which an eager call of this size is bound by, is left out; it is
printed apart, per eager call). K/V are far larger than the L2 (134 MB at L = 4096). Prints the
time, the K/V bandwidth, the ratio contiguous / paged (>= 0.95: paged within 5 %) and the host
time per call.
"""
import argparse
import time

import numpy as np

import cuflash

B, H, HKV, D = 8, 32, 8, 128


def bf16(cupy, x):
    import ml_dtypes
    host = np.asarray(x, np.float32).astype(ml_dtypes.bfloat16)
    return cupy.asarray(host.view(np.uint16)).view(ml_dtypes.bfloat16)


def device_ms(cupy, fn, reps):
    """(device ms, host ms) of one call: the device time from CUDA events around each replay of
    the call captured in a CUDA graph (median of `reps`; the host's work is not in it), the host
    time per call of `reps` eager calls in a row."""
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        for _ in range(10):
            fn()
        stream.synchronize()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        host = (time.perf_counter() - t0) / reps * 1e3
        stream.synchronize()
        stream.begin_capture()
        fn()
        graph = stream.end_capture()
        start, stop = cupy.cuda.Event(), cupy.cuda.Event()
        for _ in range(5):
            graph.launch(stream)
        times = []
        for _ in range(reps):
            start.record(stream)
            graph.launch(stream)
            stop.record(stream)
            stop.synchronize()
            times.append(cupy.cuda.get_elapsed_time(start, stop))
    del graph
    cuflash.release_graph_memory()
    return float(np.median(times)), host


def main():
    import cupy

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=50)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    dev = cupy.cuda.Device()
    print(f"{cupy.cuda.runtime.getDeviceProperties(dev.id)['name'].decode()}, B={B}, "
          f"H={H}/{HKV}, D={D}, bfloat16, Nq=1, kv_lens on the device")
    print(f"{'L':>6} {'cache':>12} {'us':>8} {'GB/s':>7} {'contig/paged':>13} {'host us':>8}")
    for L in (4096, 16384):
        q = bf16(cupy, rng.standard_normal((B, H, 1, D)))
        k = bf16(cupy, rng.standard_normal((B, HKV, L, D)))
        v = bf16(cupy, rng.standard_normal((B, HKV, L, D)))
        lens = cupy.full((B,), L, dtype=np.int32)
        nbytes = 2 * k.nbytes
        lens2 = lens[:, None]
        base, host = device_ms(cupy, lambda: cuflash.attention(q, k, v, kv_lens=lens2),
                               args.reps)
        print(f"{L:>6} {'contiguous':>12} {base * 1e3:8.1f} {nbytes / base / 1e6:7.0f} "
              f"{'':>13} {host * 1e3:8.0f}")
        for ps in (16, 64, 256):
            per_seq = L // ps
            num_pages = B * per_seq
            order = rng.permutation(num_pages).astype(np.int32)
            table = cupy.asarray(order.reshape(B, per_seq))
            # the same keys as k, v, page by page at the table's pages
            kp = cupy.empty((num_pages, HKV, ps, D), dtype=k.dtype)
            vp = cupy.empty_like(kp)
            idx = cupy.asarray(order)
            kp[idx] = k.reshape(B, HKV, per_seq, ps, D).transpose(0, 2, 1, 3, 4).reshape(
                num_pages, HKV, ps, D)
            vp[idx] = v.reshape(B, HKV, per_seq, ps, D).transpose(0, 2, 1, 3, 4).reshape(
                num_pages, HKV, ps, D)
            want = cuflash.attention(q, k, v, kv_lens=lens[:, None])
            got = cuflash.attention(q, kp, vp, block_table=table, kv_lens=lens)
            err = float(cupy.abs(got.astype(np.float32) - want.astype(np.float32)).max())
            t, host = device_ms(cupy, lambda: cuflash.attention(q, kp, vp, block_table=table,
                                                                kv_lens=lens), args.reps)
            print(f"{L:>6} {'paged ' + str(ps):>12} {t * 1e3:8.1f} {nbytes / t / 1e6:7.0f} "
                  f"{base / t:13.3f} {host * 1e3:8.0f}   (max |paged - contiguous| {err:.1e})")


if __name__ == "__main__":
    main()
