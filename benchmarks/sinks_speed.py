#!/usr/bin/env python3
"""The forward with attention sinks against the same call without them (issue 18's target: the
ratio ms(without) / ms(with) at least 0.9), on one GPU.

Run from the repository root on a GPU machine::

    python benchmarks/sinks_speed.py                 # the five cases of issue 18
    python benchmarks/sinks_speed.py --bh 64         # other batch x heads (default 32)

Cases (B x H = --bh, split as B = bh // 16, H = 16; (H,) float32 sinks near the rows' lse):
bf16 D = 128 N = 4096 causal and not, bf16 D = 64 N = 8192, fp16 D = 128 N = 4096, bf16 D = 128
N = 1024 causal. Timing: benchmarks/timer.py (CUDA events on one stream, a spin before each run so
the host's enqueue stays out, 2 x L2 flushed before each run, first call untimed, median of the
runs that fit in --target-seconds). Each line: the forward path that ran, ms without and with
sinks, the ratio, and with --join the time the same call took when the sinks were joined by the
separate pass (cuflash/_sinks.py join after the sink-free kernels: the state before issue 18).
"""
import argparse
import contextlib
import copy
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # timer.py
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # cuflash

CASES = [  # (name, dtype, D, N, causal)
    ("bf16 D128 N4096", "bfloat16", 128, 4096, False),
    ("bf16 D128 N4096 causal", "bfloat16", 128, 4096, True),
    ("bf16 D64 N8192", "bfloat16", 64, 8192, False),
    ("fp16 D128 N4096", "float16", 128, 4096, False),
    ("bf16 D128 N1024 causal", "bfloat16", 128, 1024, True),
]


@contextlib.contextmanager
def joined_after(module):
    """A path's sink-free kernels, then the separate join pass (cuflash/_gpu.py forward joins after
    a path whose SINKS is False), for --join. The Problem it sees has no sinks and no signature
    (so none of its memoized launches, which are the ones with SINKS, is found)."""
    forward, sinks = module.forward, module.SINKS

    def sink_free(p):
        bare = copy.copy(p)
        bare.sinks, bare.key = None, None
        return forward(bare)

    module.forward, module.SINKS = sink_free, False
    try:
        yield
    finally:
        module.forward, module.SINKS = forward, sinks


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bh", type=int, default=32, help="batch x heads (a multiple of 16)")
    ap.add_argument("--target-seconds", type=float, default=1.0, help="timed runs per measurement")
    ap.add_argument("--join", action="store_true",
                    help="also time the sink-free kernels followed by the separate join pass")
    args = ap.parse_args()

    import cupy as cp
    import cuflash
    from cuflash import _gpu, _validate
    from timer import DEFAULT_L2_BYTES, Timer

    stream = cp.cuda.Stream(non_blocking=True)
    rng = np.random.default_rng(18)
    H = 16
    B = max(1, args.bh // H)
    print(f"{cp.cuda.runtime.getDeviceProperties(0)['name'].decode()}, B x H = {B} x {H}")
    print(f"{'case':26s} {'path':8s} {'no sinks ms':>12s} {'sinks ms':>9s} {'ratio':>6s}"
          + (f" {'join ms':>8s} {'ratio':>6s}" if args.join else ""))
    with stream:
        timer = Timer(cp, stream, args.target_seconds, spin_us=200, l2_bytes=DEFAULT_L2_BYTES)
        for name, dtype, D, N, causal in CASES:
            dt = cp.dtype(dtype) if dtype != "bfloat16" else None
            if dt is None:
                import ml_dtypes
                dt = np.dtype(ml_dtypes.bfloat16)
            q, k, v = (cp.asarray(rng.standard_normal((B, H, N, D)).astype(np.float32)).astype(dt)
                       for _ in range(3))
            t = cp.asarray((rng.standard_normal(H) + 2.0).astype(np.float32))
            path = _gpu.forward_path(_validate.make_problem(q, k, v, causal=causal, sinks=t))
            plain = timer.measure(lambda: cuflash.attention(q, k, v, causal=causal))["ms"]
            fused = timer.measure(lambda: cuflash.attention(q, k, v, causal=causal, sinks=t))["ms"]
            line = f"{name:26s} {path:8s} {plain:12.4f} {fused:9.4f} {plain / fused:6.3f}"
            if args.join:
                module = next(m for m in _gpu.FORWARD if m.NAME == path)
                with joined_after(module):
                    joined = timer.measure(
                        lambda: cuflash.attention(q, k, v, causal=causal, sinks=t))["ms"]
                line += f" {joined:8.4f} {plain / joined:6.3f}"
            print(line, flush=True)


if __name__ == "__main__":
    main()
