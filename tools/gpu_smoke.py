"""GPU smoke test of the generic kernels, launched directly through cuflash._launch.

    PYTHONPATH=. python3 tools/gpu_smoke.py [NAME_SUBSTRING ...]

With arguments, only the cases whose name contains one of them run (e.g. under compute-sanitizer).
`--rate` instead prints a rough throughput of the generic kernels (CUDA events, 3 runs after one
warm-up; FLOPs counted as FlashAttention does): a sanity check, not a benchmark (see benchmarks/).
Builds random inputs (with row padding, GQA-style shared K/V matrices, broadcast masks), runs the
forward and the three backward kernels on outputs poisoned with NaN, and compares out / lse / dq /
dk / dv with a dense float64 NumPy computation written here from DESIGN.md's definition. Prints one
PASS/FAIL line per case with the max errors (relative to the largest reference magnitude) and a
summary; exits 1 on any failure.
"""
import importlib
import sys
import time
import types
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
try:
    import cuflash  # noqa: F401
except Exception:  # the package __init__ is someone else's work in progress: load ours directly
    pkg = types.ModuleType("cuflash")
    pkg.__path__ = [str(ROOT / "cuflash")]
    sys.modules["cuflash"] = pkg
_config = importlib.import_module("cuflash._config")
_launch = importlib.import_module("cuflash._launch")

import cupy as cp  # noqa: E402
import ml_dtypes  # noqa: E402

DTYPES = {
    "float16": np.dtype(np.float16),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "float32": np.dtype(np.float32),
    "float64": np.dtype(np.float64),
}
# Max error relative to max |reference|, per dtype (inputs are rounded to the dtype first, so the
# error comes from accumulation and output rounding only).
TOL = {"float16": 1e-2, "bfloat16": 4e-2, "float32": 2e-4, "float64": 1e-10}


def reference(q, k, v, dout, scale, left, right, bottom_right, L, mask, bias):
    """Dense float64 forward and backward; arrays batched over BH. Returns out, lse, dq, dk, dv."""
    BH, Nq, _ = q.shape
    Nk = k.shape[1]
    i = np.arange(Nq)[None, :, None]
    j = np.arange(Nk)[None, None, :]
    Lb = L[:, None, None]
    p = i + (Lb - Nq) if bottom_right else i + 0 * Lb
    vis = (j >= p - left) & (j <= p + right) & (j < Lb)
    s = scale * np.einsum("bid,bjd->bij", q, k)
    if mask is not None:
        vis &= mask
    if bias is not None:
        s = s + bias
    vis &= s > -np.inf
    s = np.where(vis, s, -np.inf)
    m = s.max(axis=-1, keepdims=True) if Nk else np.full((BH, Nq, 1), -np.inf)
    m_safe = np.where(np.isfinite(m), m, 0.0)
    P = np.where(vis, np.exp(s - m_safe), 0.0)
    l = P.sum(axis=-1, keepdims=True)
    empty = l == 0
    P = np.where(empty, 0.0, P / np.where(empty, 1.0, l))
    out = np.einsum("bij,bjd->bid", P, v)
    lse = np.where(empty[..., 0], -np.inf, m_safe[..., 0] + np.log(np.where(empty, 1.0, l))[..., 0])
    dv = np.einsum("bij,bid->bjd", P, dout)
    dp = np.einsum("bid,bjd->bij", dout, v)
    delta = (dout * out).sum(-1, keepdims=True)
    ds = P * (dp - delta)
    dq = scale * np.einsum("bij,bjd->bid", ds, k)
    dk = scale * np.einsum("bij,bid->bjd", ds, q)
    return out, lse, dq, dk, dv


def run_case(name, dtype, BH, Nq, Nk, Dk, Dv, causal=False, bottom_right=False, left=None,
             right=None, kv_lens=False, mask=False, bias=False, gqa=1, pad=0, seed=0):
    rng = np.random.default_rng(seed)
    dt = DTYPES[dtype]
    acc = np.dtype(np.float64) if dtype == "float64" else np.dtype(np.float32)
    left = Nq + Nk if left is None else left
    right = Nq + Nk if right is None else right
    if causal:
        right = min(right, 0)
    scale = 1.0 / np.sqrt(Dk)

    # Storage: q per bh with padded rows; k and v shared by `gqa` consecutive bh (offset table).
    BKV = -(-BH // gqa)
    q_st = rng.standard_normal((BH, Nq, Dk + pad)).astype(dt)
    k_st = rng.standard_normal((BKV, Nk, Dk + pad)).astype(dt)
    v_st = rng.standard_normal((BKV, Nk, Dv + pad)).astype(dt)
    kv_of = np.arange(BH) // gqa
    q64 = q_st[:, :, :Dk].astype(np.float64)
    k64 = k_st[kv_of, :, :Dk].astype(np.float64)
    v64 = v_st[kv_of, :, :Dv].astype(np.float64)
    dout_h = rng.standard_normal((BH, Nq, Dv)).astype(dt)

    L = rng.integers(0, Nk + 1, BH) if kv_lens else np.full(BH, Nk)
    if kv_lens and BH > 1:
        L[0], L[-1] = 0, Nk  # always one empty and one full head
    offsets = np.zeros((5, BH), np.int64)
    offsets[0] = np.arange(BH) * Nq * (Dk + pad)
    offsets[1] = kv_of * Nk * (Dk + pad)
    offsets[2] = kv_of * Nk * (Dv + pad)
    mask_h = bias_h = None
    mask_rs = mask_cs = bias_rs = bias_cs = 0
    if mask:  # one (Nq, Nk) mask broadcast over bh: offset 0 everywhere
        mask_h = rng.random((Nq, Nk)) < 0.8
        mask_rs, mask_cs = Nk, 1
    if bias:  # per-bh bias with some -inf entries (invisible by definition)
        bias_h = rng.standard_normal((BH, Nq, Nk)).astype(acc)
        bias_h[rng.random((BH, Nq, Nk)) < 0.1] = -np.inf
        offsets[4] = np.arange(BH) * Nq * Nk
        bias_rs, bias_cs = Nk, 1

    ref = reference(q64, k64, v64, dout_h.astype(np.float64), scale, left, right, bottom_right,
                    L, mask_h, None if bias_h is None else bias_h.astype(np.float64))

    def poisoned(shape, dtype):  # NaN everywhere: proves every element is written
        return cp.asarray(np.full(shape, np.nan, dtype=dtype))

    q_d, k_d, v_d = cp.asarray(q_st), cp.asarray(k_st), cp.asarray(v_st)
    out_d = poisoned((BH, Nq, Dv), dt)
    lse_d = poisoned((BH, Nq), acc)
    common = dict(offsets=cp.asarray(offsets), mask=None if mask_h is None else cp.asarray(mask_h),
                  bias=None if bias_h is None else cp.asarray(bias_h),
                  kv_lens=cp.asarray(L.astype(np.int64)) if kv_lens else None,
                  q_rs=Dk + pad, k_rs=Dk + pad, v_rs=Dv + pad, mask_rs=mask_rs, mask_cs=mask_cs,
                  bias_rs=bias_rs, bias_cs=bias_cs, BH=BH, Nq=Nq, Nk=Nk, Dk=Dk, Dv=Dv,
                  scale=scale, left=left, right=right, bottom_right=int(bottom_right))
    _launch.launch_fwd(q_d, k_d, v_d, out_d, lse_d, **common)
    dout_d = cp.asarray(dout_h)
    delta_d = poisoned((BH, Nq), acc)
    dq_d = poisoned((BH, Nq, Dk), acc)
    dk_d = poisoned((BH, Nk, Dk), acc)
    dv_d = poisoned((BH, Nk, Dv), acc)
    _launch.launch_bwd_preprocess(dout_d, out_d, delta_d, BH * Nq, Dv)
    _launch.launch_bwd_dkdv(q_d, k_d, v_d, dout_d, lse_d, delta_d, dk_d, dv_d, **common)
    _launch.launch_bwd_dq(q_d, k_d, v_d, dout_d, lse_d, delta_d, dq_d, **common)
    cp.cuda.Stream.null.synchronize()

    got = [cp.asnumpy(x).astype(np.float64) for x in (out_d, lse_d, dq_d, dk_d, dv_d)]
    errs, ok = {}, True
    for label, g, r in zip(("out", "lse", "dq", "dk", "dv"), got, ref):
        if g.size == 0:
            errs[label] = 0.0
            continue
        if np.isnan(g).any():
            errs[label] = float("nan")  # an element was never written (or a NaN was produced)
            ok = False
            continue
        if label == "lse":
            same_inf = np.array_equal(np.isneginf(g), np.isneginf(r))
            fin = np.isfinite(r)
            e = np.abs(g[fin] - r[fin]).max() if fin.any() else 0.0
            errs[label] = e if same_inf else float("inf")
            ok &= same_inf and e <= TOL[dtype] * 10
            continue
        e = np.abs(g - r).max() / max(np.abs(r).max(), 1e-30 if np.abs(r).max() else 1.0)
        errs[label] = e
        ok &= e <= TOL[dtype]
    line = " ".join(f"{k}={v:.2e}" for k, v in errs.items())
    print(f"{'PASS' if ok else 'FAIL'} {name:48s} {dtype:8s} {line}", flush=True)
    return ok


CASES = [
    # name, dtype, BH, Nq, Nk, Dk, Dv, options
    ("plain 97x113 D64", "float32", 3, 97, 113, 64, 64, {}),
    ("decode Nq=1 causal br", "float32", 4, 1, 113, 64, 64, dict(causal=True, bottom_right=True)),
    ("Nk=0", "float32", 2, 7, 0, 64, 64, {}),
    ("Nk=0 causal br", "float64", 2, 7, 0, 32, 32, dict(causal=True, bottom_right=True)),
    ("Dk=5 Dv=97 causal top-left", "float64", 3, 113, 97, 5, 97, dict(causal=True)),
    ("causal br kv_lens D128", "float16", 5, 97, 113, 128, 128,
     dict(causal=True, bottom_right=True, kv_lens=True)),
    ("window+mask+bias D32", "bfloat16", 3, 113, 97, 32, 32,
     dict(left=8, right=4, mask=True, bias=True)),
    ("causal br Nq>Nk (empty rows)", "float32", 2, 113, 7, 32, 32,
     dict(causal=True, bottom_right=True)),
    ("causal right=-3 left=10 br", "float32", 2, 97, 97, 64, 64,
     dict(causal=True, right=-3, left=10, bottom_right=True)),
    ("D256 causal br kv_lens", "float32", 3, 65, 70, 256, 256,
     dict(causal=True, bottom_right=True, kv_lens=True)),
    ("D256 window", "float64", 2, 40, 33, 256, 256, dict(left=5, right=3)),
    ("D256 plain", "bfloat16", 2, 33, 97, 256, 256, {}),
    ("D256 causal mask", "float16", 2, 97, 113, 250, 256, dict(causal=True, mask=True)),
    ("Dk=97 Dv=5 GQA pad mask kv_lens", "float16", 6, 33, 200, 97, 5,
     dict(gqa=3, pad=3, mask=True, kv_lens=True)),
    ("GQA pad causal br bias", "float32", 4, 7, 113, 64, 32,
     dict(gqa=2, pad=1, causal=True, bottom_right=True, bias=True)),
    ("decode Nq=1 kv_lens Nk=1025", "float16", 8, 1, 1025, 128, 128, dict(kv_lens=True)),
    ("long 1025 causal", "bfloat16", 2, 1025, 1025, 64, 64, dict(causal=True)),
    ("f64 D128 window kv_lens mask bias", "float64", 3, 97, 113, 128, 128,
     dict(left=20, right=7, kv_lens=True, mask=True, bias=True)),
    ("BH=70000 (grid y/z split)", "float32", 70000, 1, 7, 32, 32, dict(causal=True,
                                                                        bottom_right=True)),
]


def rate(dtype, BH, N, D, causal):
    """Rough TFLOP/s of forward and backward (preprocess + dkdv + dq) on one square problem."""
    dt = DTYPES[dtype]
    acc = np.dtype(np.float64) if dtype == "float64" else np.dtype(np.float32)

    def rnd(*shape):
        return cp.random.standard_normal(shape, dtype=cp.float32).astype(dt)

    q, k, v, dout = rnd(BH, N, D), rnd(BH, N, D), rnd(BH, N, D), rnd(BH, N, D)
    out = cp.empty_like(q)
    lse, delta = cp.empty((BH, N), acc), cp.empty((BH, N), acc)
    dq, dk, dv = (cp.empty((BH, N, D), acc) for _ in range(3))
    off = np.arange(BH, dtype=np.int64) * N * D
    common = dict(offsets=cp.asarray(np.stack([off, off, off, 0 * off, 0 * off])), mask=None,
                  bias=None, kv_lens=None, q_rs=D, k_rs=D, v_rs=D, mask_rs=0, mask_cs=0,
                  bias_rs=0, bias_cs=0, BH=BH, Nq=N, Nk=N, Dk=D, Dv=D, scale=D ** -0.5,
                  left=2 * N, right=0 if causal else 2 * N, bottom_right=1)

    def fwd():
        _launch.launch_fwd(q, k, v, out, lse, **common)

    def bwd():
        _launch.launch_bwd_preprocess(dout, out, delta, BH * N, D)
        _launch.launch_bwd_dkdv(q, k, v, dout, lse, delta, dk, dv, **common)
        _launch.launch_bwd_dq(q, k, v, dout, lse, delta, dq, **common)

    for fn, mult, label in ((fwd, 1.0, "fwd"), (bwd, 2.5, "bwd")):
        fn()
        cp.cuda.Device().synchronize()
        start, stop = cp.cuda.Event(), cp.cuda.Event()
        start.record()
        for _ in range(3):
            fn()
        stop.record()
        stop.synchronize()
        t = cp.cuda.get_elapsed_time(start, stop) / 3e3
        flops = 4.0 * BH * N * N * D * mult * (0.5 if causal else 1.0)
        print(f"{label} {dtype:8s} BH={BH} N={N} D={D} {'causal' if causal else 'full  '} "
              f"{t * 1e3:8.2f} ms {flops / t / 1e12:6.2f} TFLOP/s", flush=True)


RATE_CASES = [("float16", 16, 4096, 128, False), ("float16", 16, 4096, 128, True),
              ("bfloat16", 32, 4096, 64, False), ("float32", 16, 4096, 128, False),
              ("float32", 8, 4096, 256, False), ("float64", 8, 2048, 64, False)]


def main(selected=()):
    def wanted(name):
        return not selected or any(sel in name for sel in selected)

    print(f"cupy {cp.__version__}, device {cp.cuda.runtime.getDeviceProperties(0)['name'].decode()}")
    t0 = time.time()
    n_fail = 0
    for name, dtype, BH, Nq, Nk, Dk, Dv, opts in CASES:
        if not wanted(name):
            continue
        try:
            n_fail += not run_case(name, dtype, BH, Nq, Nk, Dk, Dv, **opts)
        except Exception as exc:  # report and keep going: one broken case must not hide the rest
            n_fail += 1
            print(f"FAIL {name:48s} {dtype:8s} raised {type(exc).__name__}: {exc}", flush=True)
    # all four dtypes x all four buckets on one shape
    for dtype in DTYPES:
        for D in _config.HEAD_DIM_BUCKETS:
            if not wanted(f"sweep D{D} {dtype}"):
                continue
            try:
                n_fail += not run_case(f"sweep D{D} causal br kv_lens", dtype, 3, 97, 113, D, D,
                                       causal=True, bottom_right=True, kv_lens=True, seed=D)
            except Exception as exc:
                n_fail += 1
                print(f"FAIL sweep {dtype} D{D} raised {type(exc).__name__}: {exc}", flush=True)
    print(f"{'ALL PASS' if n_fail == 0 else f'{n_fail} FAILED'} in {time.time() - t0:.1f}s")
    return 1 if n_fail else 0


if __name__ == "__main__":
    if sys.argv[1:] == ["--rate"]:
        for case in RATE_CASES:
            rate(*case)
        sys.exit(0)
    sys.exit(main(sys.argv[1:]))
