#!/usr/bin/env python3
"""Attention dropout: cuflash with dropout against the same call without it (issue 18's target:
ms(without) / ms(with) at least 0.8) and against torch SDPA's flash backend with the same
dropout_p (target: at least 1.0x), forward and backward, on one GPU.

    python benchmarks/dropout_speed.py [--p 0.1] [--bh 64]

Cases: bf16, B x H = --bh (H = 16), D = 128 N = 4096 causal and not, D = 64 N = 4096.
Timing: benchmarks/timer.py (one stream, a spin first so host time stays out, L2 flushed, median).
The backward is timed alone (cuflash.attention_backward; torch: out.backward(dout) on a kept
graph). Each line: the paths cuflash took, ms without / with dropout and their ratio, torch's ms
and torch / cuflash.
"""
import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # timer.py
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # cuflash

CASES = [("bf16 D128 N4096", 128, 4096, False), ("bf16 D128 N4096 causal", 128, 4096, True),
         ("bf16 D64 N4096", 64, 4096, False)]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--p", type=float, default=0.1)
    ap.add_argument("--bh", type=int, default=64)
    ap.add_argument("--target-seconds", type=float, default=0.5)
    args = ap.parse_args()

    import cupy as cp
    import ml_dtypes
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import cuflash
    from cuflash import _gpu, _validate
    from timer import DEFAULT_L2_BYTES, Timer

    stream = cp.cuda.Stream(non_blocking=True)
    rng = np.random.default_rng(18)
    H = 16
    B = max(1, args.bh // H)
    p = args.p
    print(f"{cp.cuda.runtime.getDeviceProperties(0)['name'].decode()}, B x H = {B} x {H}, "
          f"dropout_p = {p}")
    print(f"{'case':24s} {'dir':3s} {'paths':12s} {'no drop ms':>10s} {'drop ms':>8s} "
          f"{'ratio':>6s} {'torch ms':>9s} {'torch/ours':>10s}")
    with stream, torch.cuda.stream(torch.cuda.ExternalStream(stream.ptr)):
        timer = Timer(cp, stream, args.target_seconds, spin_us=200, l2_bytes=DEFAULT_L2_BYTES)
        for name, D, N, causal in CASES:
            q, k, v, dout = (cp.asarray(rng.standard_normal((B, H, N, D)).astype(np.float32))
                             .astype(ml_dtypes.bfloat16) for _ in range(4))
            drop = dict(dropout_p=p, dropout_seed=(7, 0))
            prob = _validate.make_problem(q, k, v, causal=causal, **drop)
            paths = f"{_gpu.forward_path(prob)}/{_gpu.backward_path(prob)}"
            out0, lse0 = cuflash.attention(q, k, v, causal=causal, return_lse=True)
            out1, lse1 = cuflash.attention(q, k, v, causal=causal, return_lse=True, **drop)
            tq, tk, tv, tdo = (torch.from_dlpack(x.view(np.uint16)).view(torch.bfloat16)
                               .requires_grad_(x is not dout) for x in (q, k, v, dout))
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                def torch_fwd():
                    return torch.nn.functional.scaled_dot_product_attention(
                        tq, tk, tv, is_causal=causal, dropout_p=p)
                tout = torch_fwd()
                rows = {
                    "fwd": (lambda: cuflash.attention(q, k, v, causal=causal),
                            lambda: cuflash.attention(q, k, v, causal=causal, **drop),
                            torch_fwd),
                    "bwd": (lambda: cuflash.attention_backward(dout, q, k, v, out0, lse0,
                                                               causal=causal),
                            lambda: cuflash.attention_backward(dout, q, k, v, out1, lse1,
                                                               causal=causal, **drop),
                            lambda: tout.backward(tdo, retain_graph=True)),
                }
                for kind, (plain, dropped, peer) in rows.items():
                    a = timer.measure(plain)["ms"]
                    b = timer.measure(dropped)["ms"]
                    c = timer.measure(peer)["ms"]
                    print(f"{name:24s} {kind:3s} {paths:12s} {a:10.3f} {b:8.3f} {a / b:6.3f} "
                          f"{c:9.3f} {c / b:10.3f}", flush=True)


if __name__ == "__main__":
    main()
