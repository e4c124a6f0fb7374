"""Drivers for the device's checkers and profiler: a few calls of the kernels that matter, nothing else.

    small    small shapes through every tensor-core and decode kernel the package picks on an H200
             (forward, backward with both dq modes, decode_tc and decode_split), edge cases
             included (odd lengths, kv_lens with 0, causal both alignments, windows, GQA,
             mask + bias): for compute-sanitizer, whose memcheck / racecheck / synccheck slow
             every launch down by 10-100x.
    profile  one bench-sized call of each hot kernel (bf16: backward D=64 and D=128 at N = 4096,
             decode (32, 8192) and (1, 131072), and torch SDPA flash's backward on the same
             inputs), after one warm-up call each: for ncu, filtered by kernel name.
             `profile bwd` / `profile decode`: only those.
    launches each launch of one backward replayed alone under CUDA events (median µs per kernel,
             then the whole call), bf16, over a few shapes of both layouts: the prep, dK/dV and
             cast kernels' times without ncu. `launches B,H,N,D[,causal][,bnhd] ...`: those
             shapes. Run it once per tree, PYTHONPATH=<tree>, for an A/B.

On the device machine (Firecracker kinds; see the device README for ncu's --clock-control none):

    PYTHONPATH=. compute-sanitizer --tool memcheck  python3 tools/kernel_calls.py small
    PYTHONPATH=. compute-sanitizer --tool racecheck python3 tools/kernel_calls.py small
    PYTHONPATH=. ncu --clock-control none -k regex:'bwd|decode' \\
        --set full -o $OUT/prof python3 tools/kernel_calls.py profile

Every call of `small` is also checked against cuflash.reference (float64): a wrong answer prints
FAIL and the exit status is 1, so a run under the sanitizer is a correctness run too.
"""
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _arr(cp, rng, shape, dtype):
    return cp.asarray(rng.standard_normal(shape).astype(np.float32)).astype(dtype)


def small():
    import cupy as cp
    import ml_dtypes

    import cuflash
    from cuflash import reference

    rng = np.random.default_rng(0)
    bf16 = ml_dtypes.bfloat16
    fails = 0
    # (q lead, kv lead, Nq, Nk, D, options)
    cases = [
        ((1, 2), (1, 2), 130, 257, 64, {}),
        ((1, 2), (1, 2), 130, 257, 128, dict(causal=True)),
        ((1, 4), (1, 2), 77, 300, 128, dict(causal=True, align="top-left")),
        ((2, 2), (2, 2), 64, 190, 128, dict(window=(40, 3), kv_lens=[[0], [150]])),
        ((1, 2), (1, 2), 70, 129, 64, dict(mask=True, bias=True)),
        ((2, 8), (2, 2), 1, 1500, 128, {}),                       # decode_tc
        ((2, 8), (2, 2), 3, 900, 64, dict(causal=True)),          # decode_tc, 12 rows
        ((1, 4), (1, 1), 2, 700, 96, {}),                         # decode_split (D 96)
    ]
    for dtype in (bf16, np.float16):
        for lq, lkv, Nq, Nk, D, opts in cases:
            opts = dict(opts)
            q = _arr(cp, rng, lq + (Nq, D), dtype)
            k = _arr(cp, rng, lkv + (Nk, D), dtype)
            v = _arr(cp, rng, lkv + (Nk, D), dtype)
            if opts.pop("mask", False):
                opts["mask"] = cp.asarray(rng.random((Nq, Nk)) < 0.7)
            if opts.pop("bias", False):
                opts["bias"] = cp.asarray(rng.standard_normal((Nq, Nk)).astype(np.float32))
            out, lse = cuflash.attention(q, k, v, return_lse=True, **opts)
            ref = reference.attention(q, k, v, **opts)
            err = float(np.max(np.abs(cp.asnumpy(out.astype(cp.float32)) - ref)))
            ok = err < (3e-2 if dtype is bf16 else 5e-3)
            if Nq > 16:  # the backward, both dq modes
                do = _arr(cp, rng, out.shape, dtype)
                ref_grads = reference.attention_backward(do, q, k, v, out, lse, **opts)
                for det in (False, True):
                    g = cuflash.attention_backward(do, q, k, v, out, lse, deterministic=det,
                                                   **opts)
                    for a, r in zip(g, ref_grads):
                        scale = max(float(np.abs(x).max()) for x in ref_grads)
                        e = float(np.max(np.abs(cp.asnumpy(a.astype(cp.float32)) - r))) / scale
                        ok &= e < (3e-2 if dtype is bf16 else 6e-3)
            cp.cuda.Device().synchronize()
            print(f"{'ok  ' if ok else 'FAIL'} {np.dtype(dtype).name:8s} q{lq} kv{lkv} Nq={Nq} "
                  f"Nk={Nk} D={D} {sorted(opts)} out err {err:.1e}", flush=True)
            fails += not ok
    return 1 if fails else 0


def profile(which="all"):
    import cupy as cp
    import ml_dtypes

    import cuflash

    rng = np.random.default_rng(0)
    bf16 = ml_dtypes.bfloat16
    calls = []
    for D in (64, 128) if which in ("all", "bwd") else ():
        H, N, B = 2048 // D, 4096, 4
        q, k, v, do = (_arr(cp, rng, (B, H, N, D), bf16) for _ in range(4))
        out, lse = cuflash.attention(q, k, v, return_lse=True)
        calls.append(lambda q=q, k=k, v=v, do=do, out=out, lse=lse:
                     cuflash.attention_backward(do, q, k, v, out, lse))
        try:
            import torch

            def t(x):
                return torch.from_dlpack(x.view(cp.int16)).view(torch.bfloat16)
            tq, tk, tv = (t(x).clone().requires_grad_() for x in (q, k, v))
            tdo = t(do)

            def torch_bwd(tq=tq, tk=tk, tv=tv, tdo=tdo):
                from torch.nn.attention import SDPBackend, sdpa_kernel
                with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                    o = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv)
                torch.autograd.grad(o, (tq, tk, tv), tdo)
            calls.append(torch_bwd)
        except ImportError:
            pass
    for B, L in ((32, 8192), (1, 131072)) if which in ("all", "decode") else ():
        qd = _arr(cp, rng, (B, 32, 1, 128), bf16)
        kd, vd = (_arr(cp, rng, (B, 8, L, 128), bf16) for _ in range(2))
        calls.append(lambda qd=qd, kd=kd, vd=vd: cuflash.attention(qd, kd, vd))
    for fn in calls:  # warm-up (compilation, plans), then the profiled call
        fn()
    cp.cuda.Device().synchronize()
    for fn in calls:
        fn()
    cp.cuda.Device().synchronize()
    return 0


def launches(*shapes):
    import cupy as cp
    import ml_dtypes

    import cuflash
    from cuflash import _runtime

    def median_us(fn, reps=50):
        times = []
        for _ in range(reps):
            start, end = cp.cuda.Event(), cp.cuda.Event()
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(cp.cuda.get_elapsed_time(start, end) * 1e3)
        return float(np.median(times))

    rng = np.random.default_rng(0)
    shapes = shapes or ("1,32,4096,64", "2,32,4096,64,causal", "8,32,1024,64,bnhd",
                        "1,16,8192,128,causal", "4,16,1024,128", "4,16,1024,128,bnhd",
                        "4,8,1024,256")
    for shape in shapes:
        B, H, N, D, *flags = shape.split(",")
        B, H, N, D = int(B), int(H), int(N), int(D)
        causal = "causal" in flags
        bnhd = "bnhd" in flags
        q, k, v, do = (_arr(cp, rng, (B, N, H, D) if bnhd else (B, H, N, D),
                            ml_dtypes.bfloat16) for _ in range(4))
        if bnhd:
            q, k, v, do = (x.transpose(0, 2, 1, 3) for x in (q, k, v, do))
        out, lse = cuflash.attention(q, k, v, causal=causal, return_lse=True)

        def backward():
            cuflash.attention_backward(do, q, k, v, out, lse, causal=causal)
        backward()  # (compilation, plans)
        seen, launch = [], _runtime.Launch.__call__
        _runtime.Launch.__call__ = lambda self, args: (seen.append((self, args)),
                                                       launch(self, args))
        try:
            backward()
        finally:
            _runtime.Launch.__call__ = launch
        names = {id(f): key[2] for key, (_, f) in _runtime._functions.items()}
        parts = [f"{names.get(id(lau.kern), '?').split('<')[0]} "
                 f"{median_us(lambda lau=lau, args=args: launch(lau, args)):.1f}"
                 for lau, args in seen]
        print(f"{shape:24s} " + " | ".join(parts) + f" | whole {median_us(backward):.1f}",
              flush=True)
    return 0


if __name__ == "__main__":
    mode = sys.argv[1] if len(sys.argv) > 1 else "small"
    sys.exit({"small": small, "profile": profile, "launches": launches}[mode](*sys.argv[2:]))
