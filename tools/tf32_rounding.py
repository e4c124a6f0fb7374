#!/usr/bin/env python3
"""An emulation of the float32 wide path's products (three TF32 passes on tensor cores whose sums
round toward zero), next to a naive float32 dot product, against float64.

    python tools/tf32_rounding.py [--trials 200]
    python tools/tf32_rounding.py --pv [--trials 300]

--pv: a float32 Hopper forward's O = P V (tools/tf32_probe.py, NOTES' float32-on-wgmma sketch)
over K = 4096 keys, P uniform in [0, 1), V normal: one TF32 product (operands rounded or
truncated) or three, accumulated in place or in a fresh accumulator per 64 keys.

Model of one m16n8k8 TF32 mma (per output element): the exact sum of c and eight exact products,
each term truncated to the float32 grid of the largest term's exponent, then rounded toward zero
to float32. A k-step runs lo*hi, hi*lo, hi*hi on one accumulator; a rounding group of G k-steps
chains on a fresh accumulator and is added to the result in float32 (wide.cuh group_steps).
Prints the mean and largest absolute error of a length-K dot product of standard normals.
"""
import argparse

import numpy as np


def tf32(x):
    """float32 -> TF32 (10-bit mantissa), to nearest, ties away (cvt.rna.tf32.f32)."""
    b = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    return ((b + 0x1000) & 0xFFFFE000).astype(np.uint32).view(np.float32)


def mma(c, a, b):
    terms = [float(c)] + [float(x) * float(y) for x, y in zip(a, b)]
    m = max(abs(t) for t in terms)
    if m == 0:
        return np.float32(0)
    ulp = 2.0 ** (np.floor(np.log2(m)) - 23)
    s = sum(np.trunc(t / ulp) * ulp for t in terms)
    f = np.float32(s)
    return np.nextafter(f, np.float32(0)) if abs(float(f)) > abs(s) else f


def truncated(x):
    """float32 -> TF32 by dropping the low 13 bits (an operand read as raw float32 bits)."""
    return (np.asarray(x, np.float32).view(np.uint32) & np.uint32(0xFFFFE000)).view(np.float32)


def pv_dot(a, b, G, three, rounded):
    """One dot product (the wide path's, or a P V entry): k-steps of 8, one product (operands
    rounded or truncated to TF32) or three (hi + lo), a fresh accumulator per G k-steps (G = 0:
    one accumulator throughout)."""
    ah, bh = (tf32(a), tf32(b)) if three or rounded else (truncated(a), truncated(b))
    al, bl = tf32(a - ah), tf32(b - bh)
    s, c = np.float32(0), np.float32(0)
    for k in range(len(a) // 8):
        i = slice(8 * k, 8 * k + 8)
        c = mma(mma(mma(c, al[i], bh[i]), ah[i], bl[i]), ah[i], bh[i]) if three else \
            mma(c, ah[i], bh[i])
        if G and (k + 1) % G == 0:
            s, c = np.float32(s + c), np.float32(0)
    return np.float32(s + c)


def pv_main(trials, K=4096):
    rng = np.random.default_rng(0)
    rules = {"1 x TF32 rounded, in place": (0, False, True),
             "1 x TF32 truncated, in place": (0, False, False),
             "1 x TF32 truncated, fresh per 64 keys": (8, False, False),
             "3 x TF32, in place": (0, True, True),
             "3 x TF32, fresh per 64 keys": (8, True, True)}
    errs = {name: [] for name in list(rules) + ["naive float32", "NumPy pairwise float32"]}
    scale = []
    for _ in range(trials):
        a = rng.random(K).astype(np.float32)
        b = rng.standard_normal(K).astype(np.float32)
        exact = float(np.dot(a.astype(np.float64), b.astype(np.float64)))
        scale.append(abs(exact))
        for name, rule in rules.items():
            errs[name].append(abs(float(pv_dot(a, b, *rule)) - exact))
        got = np.float32(0)
        for x, y in zip(a, b):  # fma: one rounding per step
            got = np.float32(float(got) + float(x) * float(y))
        errs["naive float32"].append(abs(float(got) - exact))
        errs["NumPy pairwise float32"].append(abs(float(np.sum(a * b, dtype=np.float32)) - exact))
    print(f"K={K}, mean |exact| {np.mean(scale):.1f}")
    for name, e in errs.items():
        print(f"{name:40s} mean {np.mean(e):.2e}  max {max(e):.2e}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--trials", type=int, default=None)
    ap.add_argument("--pv", action="store_true")
    args = ap.parse_args()
    if args.pv:
        return pv_main(args.trials or 300)
    args.trials = args.trials or 200
    rng = np.random.default_rng(0)
    for K in (32, 64, 96, 128):
        KD = K // 8
        old = next(g for g in (8, 6, 4, 1) if KD % g == 0)
        rules = {"naive float32": None, f"groups of {old} (until 2026-12-03)": old,
                 f"groups of {min(KD // 2, 8)} (now)": min(KD // 2, 8), "every k-step": 1}
        errs = {name: [] for name in rules}
        for _ in range(args.trials):
            a, b = (rng.standard_normal(K).astype(np.float32) for _ in range(2))
            exact = float(np.dot(a.astype(np.float64), b.astype(np.float64)))
            for name, G in rules.items():
                if G is None:
                    got = np.float32(0)
                    for x, y in zip(a, b):  # fma: one rounding per step
                        got = np.float32(float(got) + float(x) * float(y))
                else:
                    got = pv_dot(a, b, G, True, True)
                errs[name].append(abs(float(got) - exact))
        naive = max(errs["naive float32"])
        for name, e in errs.items():
            print(f"K={K:4d} {name:32s} mean {np.mean(e):.2e}  max {max(e):.2e}  "
                  f"max / naive max {max(e) / naive:.2f}")


if __name__ == "__main__":
    main()
