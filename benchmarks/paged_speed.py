"""Paged decode against the contiguous cache (issue 17's target: paged >= 0.95x contiguous).

    python benchmarks/paged_speed.py [--reps 50]

One decode step (Nq = 1), B = 8, 32 query heads on 8 kv heads, D = 128, bfloat16, every
sequence L keys, L = 4096 and 16384: the contiguous cache (B, 8, L, 128) against page pools
(num_pages, 8, page_size, 128) with the pages of each sequence shuffled over the pool, page sizes
16, 64 and 256, kv_lens a CuPy array (the decode loop's form). Device time of one attention call
from CUDA events around it (the call's host work overlaps the GPU's), median of --reps timed
calls after 10 warm-ups; the inputs are far larger than the L2 (134 MB of K/V at L = 4096), and
the calls read them in turn, so no call finds the cache warm from the last. Prints the time,
the K/V bandwidth and the ratio contiguous / paged (>= 0.95: paged within 5 %).
"""
import argparse

import numpy as np

import cuflash

B, H, HKV, D = 8, 32, 8, 128


def bf16(cupy, x):
    import ml_dtypes
    host = np.asarray(x, np.float32).astype(ml_dtypes.bfloat16)
    return cupy.asarray(host.view(np.uint16)).view(ml_dtypes.bfloat16)


def device_ms(cupy, fn, reps):
    for _ in range(10):
        fn()
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    times = []
    for _ in range(reps):
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, stop))
    return float(np.median(times))


def main():
    import cupy

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=50)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    dev = cupy.cuda.Device()
    print(f"{cupy.cuda.runtime.getDeviceProperties(dev.id)['name'].decode()}, B={B}, "
          f"H={H}/{HKV}, D={D}, bfloat16, Nq=1, kv_lens on the device")
    print(f"{'L':>6} {'cache':>12} {'us':>8} {'GB/s':>7} {'contig/paged':>13}")
    for L in (4096, 16384):
        q = bf16(cupy, rng.standard_normal((B, H, 1, D)))
        k = bf16(cupy, rng.standard_normal((B, HKV, L, D)))
        v = bf16(cupy, rng.standard_normal((B, HKV, L, D)))
        lens = cupy.full((B,), L, dtype=np.int32)
        nbytes = 2 * k.nbytes
        base = device_ms(cupy, lambda: cuflash.attention(q, k, v, kv_lens=lens[:, None]),
                         args.reps)
        print(f"{L:>6} {'contiguous':>12} {base * 1e3:8.1f} {nbytes / base / 1e6:7.0f} "
              f"{'':>13}")
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
            t = device_ms(cupy, lambda: cuflash.attention(q, kp, vp, block_table=table,
                                                          kv_lens=lens), args.reps)
            print(f"{L:>6} {'paged ' + str(ps):>12} {t * 1e3:8.1f} {nbytes / t / 1e6:7.0f} "
                  f"{base / t:13.3f}   (max |paged - contiguous| {err:.1e})")
            del kp, vp


if __name__ == "__main__":
    main()
