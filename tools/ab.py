#!/usr/bin/env python3
"""Same-run A/B of two cuflash trees on one GPU: device time per call, interleaved.

    python tools/ab.py BASE_DIR [--cases dense,options,decode] [--out FILE]

BASE_DIR holds the other tree's `cuflash/` and `kernels_cu/` (e.g. `git archive <rev> cuflash
kernels_cu | tar -x -C BASE_DIR`); it is imported as the package `cuflash_base`. Both trees run
in this process on the same inputs and stream. Each timing is R calls queued behind a spin kernel
(so host time is hidden, as in benchmarks/bench.py), between CUDA events; trees alternate, ROUNDS
times, and the median per tree is reported with the ratio new / base.
"""
import argparse
import importlib.util
import json
import os
import statistics
import sys

import cupy
import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROUNDS, REPS = 5, 8
_spin = cupy.RawKernel(r'''
extern "C" __global__ void spin(long long cycles) {
  const long long t0 = clock64();
  while (clock64() - t0 < cycles) {}
}''', "spin")


def load(name, root):
    spec = importlib.util.spec_from_file_location(name, os.path.join(root, "cuflash", "__init__.py"),
                                                  submodule_search_locations=[
                                                      os.path.join(root, "cuflash")])
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def time_call(fn):
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    fn()
    cupy.cuda.Device().synchronize()
    _spin((1,), (1,), (np.int64(2_000_000 * REPS),))  # ~1 ms per call at 2 GHz: hides the host
    start.record()
    for _ in range(REPS):
        fn()
    end.record()
    end.synchronize()
    return cupy.cuda.get_elapsed_time(start, end) * 1e3 / REPS  # us per call


def dense_cases():
    for d in (64, 128):
        for n in (512, 1024, 2048, 4096, 8192, 16384):
            for causal in (False, True):
                yield f"bf16 d{d} n{n} {'causal' if causal else 'full'}", dict(
                    B=16384 // n, H=2048 // d, Nq=n, Nk=n, D=d, dtype="bfloat16",
                    opts=dict(causal=causal))


def option_cases():
    yield "fp16 d64 n4096 full", dict(B=4, H=32, Nq=4096, Nk=4096, D=64, dtype="float16", opts={})
    yield "bf16 d128 n4096 mask", dict(B=4, H=16, Nq=4096, Nk=4096, D=128, dtype="bfloat16",
                                       opts=dict(mask="pad"))
    yield "bf16 d128 n4096 block-sparse", dict(B=4, H=16, Nq=4096, Nk=4096, D=128,
                                               dtype="bfloat16", opts=dict(mask="blocks"))
    yield "bf16 d128 n4096 bias", dict(B=4, H=16, Nq=4096, Nk=4096, D=128, dtype="bfloat16",
                                       opts=dict(bias="full"))
    yield "bf16 d64 n4096 gqa window", dict(B=4, H=32, Hkv=8, Nq=4096, Nk=4096, D=64,
                                            dtype="bfloat16", opts=dict(window=(256, 0)))
    yield "bf16 d256 n4096 full", dict(B=4, H=8, Nq=4096, Nk=4096, D=256, dtype="bfloat16",
                                       opts={})
    yield "bf16 d192x128 n4096 full", dict(B=4, H=8, Nq=4096, Nk=4096, D=192, Dv=128,
                                           dtype="bfloat16", opts={})
    yield "fp32 d64 n4096 full", dict(B=1, H=16, Nq=4096, Nk=4096, D=64, dtype="float32", opts={})
    yield "fp32 d128 n4096 causal", dict(B=1, H=16, Nq=4096, Nk=4096, D=128, dtype="float32",
                                         opts=dict(causal=True))
    yield "fp32 d64 n4096 bias", dict(B=1, H=16, Nq=4096, Nk=4096, D=64, dtype="float32",
                                      opts=dict(bias="full"))
    yield "fp64 d64 n2048 full", dict(B=1, H=16, Nq=2048, Nk=2048, D=64, dtype="float64", opts={})


def decode_cases():
    for b, L in ((1, 131072), (8, 32768), (32, 8192), (64, 4096)):
        yield f"decode b{b} L{L}", dict(B=b, H=32, Hkv=8, Nq=1, Nk=L, D=128, dtype="bfloat16",
                                        opts={}, fwd_only=True)


def make(case, rng):
    dt = np.dtype(case["dtype"]) if case["dtype"] != "bfloat16" else cupy.dtype("bfloat16")
    B, H, Hkv = case["B"], case["H"], case.get("Hkv", case["H"])

    def randn(*shape):
        return cupy.asarray(rng.standard_normal(shape, dtype=np.float32)).astype(dt)

    q = randn(B, H, case["Nq"], case["D"])
    k = randn(B, Hkv, case["Nk"], case["D"])
    v = randn(B, Hkv, case["Nk"], case.get("Dv", case["D"]))
    opts = dict(case["opts"])
    if opts.get("mask") == "pad":
        m = np.ones((B, 1, 1, case["Nk"]), bool)
        m[..., int(case["Nk"] * 0.62):] = False
        opts["mask"] = cupy.asarray(m)
    elif opts.get("mask") == "blocks":  # half of the 128 x 128 blocks, the same for every head
        blocks = rng.random((case["Nq"] // 128, case["Nk"] // 128)) < 0.5
        opts["mask"] = cupy.asarray(blocks.repeat(128, axis=0).repeat(128, axis=1)[None, None])
    if opts.get("bias") == "full":
        opts["bias"] = cupy.asarray(rng.standard_normal((1, H, case["Nq"], case["Nk"]),
                                                        dtype=np.float32))
    return q, k, v, opts


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("base")
    ap.add_argument("--cases", default="dense,options,decode")
    ap.add_argument("--out", default=None)
    ap.add_argument("--only", default=None, help="comma-separated substrings of case names")
    ap.add_argument("--also", default=None,
                    help="comma list of more trees (like BASE_DIR), timed too; new / each printed")
    ap.add_argument("--no-fixup", action="store_true",
                    help="also time the new tree with its lost-row launches stubbed out")
    args = ap.parse_args()
    trees = {"base": load("cuflash_base", args.base), "new": load("cuflash", REPO)}
    for i, root in enumerate(args.also.split(",") if args.also else []):
        trees[f"also{i}"] = load(f"cuflash_also{i}", root)
    if args.no_fixup:
        nofix = load("cuflash_nofix", REPO)
        launch = importlib.import_module("cuflash_nofix._generic")
        launch.launch_fwd_lost = lambda *a, **k: None
        launch.launch_lost = lambda *a, **k: None
        trees["new-nofix"] = nofix
    kinds = args.cases.split(",")
    cases = [c for kind, gen in (("dense", dense_cases), ("options", option_cases),
                                 ("decode", decode_cases)) if kind in kinds for c in gen()
             if not args.only or any(o in c[0] for o in args.only.split(","))]
    rng = np.random.default_rng(0)
    results = []
    for name, case in cases:
        q, k, v, opts = make(case, rng)
        for kind in (("fwd",) if case.get("fwd_only") else ("fwd", "bwd")):
            fns = {}
            for t, lib in trees.items():
                if kind == "fwd":
                    fns[t] = lambda lib=lib: lib.attention(q, k, v, **opts)
                else:
                    out, lse = lib.attention(q, k, v, return_lse=True, **opts)
                    dout = cupy.ones_like(out)
                    fns[t] = lambda lib=lib, out=out, lse=lse, dout=dout: \
                        lib.attention_backward(dout, q, k, v, out, lse, **opts)
            times = {t: [] for t in trees}
            for _ in range(ROUNDS):
                for t in trees:
                    times[t].append(time_call(fns[t]))
            med = {t: statistics.median(x) for t, x in times.items()}
            ratio = med["new"] / med["base"]
            results.append(dict(case=name, kind=kind, ratio=ratio,
                                **{f"{t}_us": med[t] for t in trees}))
            extra = "".join(f"  new/{t} {med['new'] / med[t]:.3f}" for t in trees
                            if t not in ("base", "new"))
            print(f"{name:32s} {kind}  base {med['base']:9.1f} us  new {med['new']:9.1f} us  "
                  f"new/base {ratio:.3f}{extra}", flush=True)
        del q, k, v, opts
        cupy.get_default_memory_pool().free_all_blocks()
    worst = max(results, key=lambda r: r["ratio"])
    print(f"worst new/base {worst['ratio']:.3f} ({worst['case']} {worst['kind']}); "
          f"median {statistics.median(r['ratio'] for r in results):.3f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
