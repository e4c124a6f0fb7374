"""ALiBi's cost: forward and backward device time with and without alibi_slopes, bf16, B*H = 32
(B = 4, H = 8), N = 4096, D = 128 and D = 64, causal and not; the ratio is time without / time
with (1.0: free; the target is >= 0.9). CUDA events around each call on one stream, after
warm-up (compilation included), median of RUNS, the two variants interleaved run by run so that
clock drift affects both alike (no L2 flush: each of q, k, v, dout is 32 MiB at D = 128, beyond
the H200's 50 MiB L2 together). Prints one line per case and the path each variant ran on.

    PYTHONPATH=. python benchmarks/alibi_speed.py [--runs 15]
"""
import argparse
import statistics

import numpy as np


def _time(cp, fn, runs, warmup=3):
    for _ in range(warmup):
        fn()
    cp.cuda.Stream.null.synchronize()
    times = []
    for _ in range(runs):
        start, end = cp.cuda.Event(), cp.cuda.Event()
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, end))
    return times


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=15)
    args = parser.parse_args()
    import cupy as cp
    import ml_dtypes

    import cuflash
    from cuflash import _gpu, _validate

    B, H, N = 4, 8, 4096
    rng = np.random.default_rng(0)
    slopes = cp.asarray(2.0 ** (-8.0 * np.arange(1, H + 1) / H), dtype=cp.float32)  # ALiBi's
    print(f"bf16, B={B} H={H} N={N}; ms = median of {args.runs} (CUDA events); "
          f"ratio = without / with ALiBi")
    print(f"{'case':<16} {'pass':<4} {'plain ms':>9} {'alibi ms':>9} {'ratio':>6}  paths")
    for D in (128, 64):
        def bf16(shape):
            host = rng.standard_normal(shape).astype(ml_dtypes.bfloat16)
            return cp.asarray(host.view(np.uint16)).view(ml_dtypes.bfloat16)
        q, k, v, dout = (bf16((B, H, N, D)) for _ in range(4))
        for causal in (False, True):
            variants = {"plain": dict(causal=causal),
                        "alibi": dict(causal=causal, alibi_slopes=slopes)}
            outs = {n: cuflash.attention(q, k, v, return_lse=True, **o)
                    for n, o in variants.items()}
            paths = {n: (_gpu.forward_path(_validate.make_problem(q, k, v, **o)),
                         _gpu.backward_path(_validate.make_problem(q, k, v, **o)))
                     for n, o in variants.items()}
            calls = {
                "fwd": {n: (lambda o=o: cuflash.attention(q, k, v, **o))
                        for n, o in variants.items()},
                "bwd": {n: (lambda o=o, n=n: cuflash.attention_backward(
                    dout, q, k, v, outs[n][0], outs[n][1], **o)) for n, o in variants.items()},
            }
            for pas, fns in calls.items():
                times = {n: [] for n in fns}
                for fn in fns.values():
                    _time(cp, fn, 0, warmup=3)
                for _ in range(args.runs):  # interleaved, one run each in turn
                    for n, fn in fns.items():
                        times[n] += _time(cp, fn, 1, warmup=0)
                med = {n: statistics.median(t) for n, t in times.items()}
                name = f"D{D} {'causal' if causal else 'full'}"
                print(f"{name:<16} {pas:<4} {med['plain']:9.3f} {med['alibi']:9.3f} "
                      f"{med['plain'] / med['alibi']:6.3f}  "
                      f"{paths['plain'][pas == 'bwd']} / {paths['alibi'][pas == 'bwd']}")


if __name__ == "__main__":
    main()
