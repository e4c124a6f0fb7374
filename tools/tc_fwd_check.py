"""Standalone check of the tensor-core forward (kernels_cu/fwd_sm80.cu via cuflash/_tc.py).

1. Correctness on awkward shapes against a dense float64 CuPy reference built from the definition
   in DESIGN.md (outputs poisoned with NaN first), both dtypes, causal both alignments, window,
   kv_lens, mask + bias, strided and GQA inputs. Where torch SDPA flash can run the same case, its
   error against the same reference is printed beside ours.
2. Timing on the FlashAttention grid (16k tokens, heads x head dim = 2048, bf16) against
   torch SDPA with the flash backend on the same data, CUDA events, median after warm-up.
   FLOPs = 4 * B * H * N^2 * D, halved for causal.

    PYTHONPATH=. python3 tools/tc_fwd_check.py [--skip-correctness] [--skip-timing] [--variants]
"""
import argparse
import itertools
import math
import sys
import time

import cupy as cp
import numpy as np

from cuflash import _tc

try:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
except ImportError:  # timing and the torch error column are skipped
    torch = None

DTYPES = ("float16", "bfloat16")


# ---- inputs ------------------------------------------------------------------------------------

def randn(shape, dtype, rng):
    return cp.asarray(rng.standard_normal(shape, dtype=np.float32)).astype(dtype)


def head_table(x, B, H):
    """Element offsets of each (b, h) matrix of x (shape (Bx, Hx, N, D), any strides), GQA h//g."""
    Bx, Hx = x.shape[:2]
    sb = 0 if Bx == 1 else x.strides[0] // x.itemsize
    sh = x.strides[1] // x.itemsize
    b = np.arange(B)[:, None]
    h = np.arange(H)[None, :] // (H // Hx)
    return (b * sb + h * sh).reshape(-1).astype(np.int64)


def run_tc(q, k, v, scale, causal, bottom_right, window, kv_lens, mask, bias, tile=None):
    """q (B, H, Nq, D), k/v (Bk, Hk, Nk, D) views; returns out (B, H, Nq, D), lse (B, H, Nq)."""
    launch, out, lse = prepare_tc(q, k, v, scale, causal, bottom_right, window, kv_lens, mask,
                                  bias, tile)
    launch()
    return out, lse


def prepare_tc(q, k, v, scale, causal, bottom_right, window, kv_lens, mask, bias, tile=None):
    """Everything but the launch (tables, poisoned outputs): (launch, out, lse)."""
    B, H, Nq, D = q.shape
    Nk = k.shape[2]
    BH = B * H
    big = Nq + Nk
    left, right = window if window is not None else (None, None)
    left = big if left is None else left
    right = big if right is None else right
    if causal:
        right = min(right, 0)
    offsets = np.zeros((5, BH), dtype=np.int64)
    offsets[0], offsets[1], offsets[2] = (head_table(x, B, H) for x in (q, k, v))
    mask_rs = mask_cs = bias_rs = bias_cs = 0
    if mask is not None:  # (B, H, Nq, Nk) dense
        offsets[3] = np.arange(BH) * Nq * Nk
        mask_rs, mask_cs = Nk, 1
    if bias is not None:
        offsets[4] = np.arange(BH) * Nq * Nk
        bias_rs, bias_cs = Nk, 1
    out = cp.empty((BH, Nq, D), dtype=q.dtype)
    out.view(cp.uint16).fill(0x7FC0 if q.dtype.name == "bfloat16" else 0x7E00)  # NaN poison
    lse = cp.full((BH, Nq), np.nan, dtype=np.float32)
    args = dict(offsets=cp.asarray(offsets), mask=mask, bias=bias,
                kv_lens=None if kv_lens is None else cp.asarray(kv_lens.reshape(BH)),
                q_rs=q.strides[2] // q.itemsize, k_rs=k.strides[2] // k.itemsize,
                v_rs=v.strides[2] // v.itemsize, mask_rs=mask_rs, mask_cs=mask_cs,
                bias_rs=bias_rs, bias_cs=bias_cs, BH=BH, Nq=Nq, Nk=Nk, Dk=D, Dv=D,
                scale=scale, left=left, right=right, bottom_right=int(bottom_right), tile=tile)
    _tc.kernel(q.dtype.name, D, mask is not None or bias is not None, tile)  # compile outside timing
    launch = lambda: _tc.launch_fwd(q, k, v, out, lse, **args)
    return launch, out.reshape(B, H, Nq, D), lse.reshape(B, H, Nq)


def reference(q, k, v, scale, causal, bottom_right, window, kv_lens, mask, bias):
    """Dense float64 attention straight from the definition (DESIGN.md)."""
    B, H, Nq, D = q.shape
    Nk = k.shape[2]
    q64 = q.astype(cp.float64)
    k64 = cp.broadcast_to(cp.repeat(k.astype(cp.float64), H // k.shape[1], axis=1), (B, H, Nk, D))
    v64 = cp.broadcast_to(cp.repeat(v.astype(cp.float64), H // v.shape[1], axis=1), (B, H, Nk, D))
    s = cp.einsum("bhid,bhjd->bhij", q64, k64) * scale
    L = cp.full((B, H, 1, 1), Nk, dtype=cp.int64) if kv_lens is None else \
        cp.asarray(kv_lens).reshape(B, H, 1, 1)
    i = cp.arange(Nq).reshape(1, 1, Nq, 1)
    j = cp.arange(Nk).reshape(1, 1, 1, Nk)
    p = i + (L - Nq) if bottom_right else i + 0 * L
    vis = cp.broadcast_to(j < L, (B, H, Nq, Nk))
    if causal:
        vis = vis & (j <= p)
    if window is not None:
        if window[0] is not None:
            vis = vis & (p - window[0] <= j)
        if window[1] is not None:
            vis = vis & (j <= p + window[1])
    if mask is not None:
        vis = vis & mask
    if bias is not None:
        s = s + bias.astype(cp.float64)
        vis = vis & (bias > -cp.inf)
    s = cp.where(vis, s, -cp.inf)
    empty = ~vis.any(-1, keepdims=True)
    m = cp.where(empty, 0.0, s.max(-1, keepdims=True))
    pm = cp.exp(s - m)
    l = pm.sum(-1, keepdims=True)
    out = cp.where(empty, 0.0, cp.einsum("bhij,bhjd->bhid", pm, v64) / cp.where(empty, 1.0, l))
    lse = cp.where(empty[..., 0], -cp.inf, (m + cp.log(cp.where(empty, 1.0, l)))[..., 0])
    return out, lse


def to_torch(x):
    if x.dtype.name == "bfloat16":
        return torch.from_dlpack(x.view(cp.int16)).view(torch.bfloat16)
    return torch.from_dlpack(x)


def torch_flash(q, k, v, scale, causal):
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        return F.scaled_dot_product_attention(to_torch(q), to_torch(k), to_torch(v),
                                              is_causal=causal, scale=scale)


# ---- correctness -------------------------------------------------------------------------------

MODES = {
    # name: (causal, bottom_right, window, kv_lens?, mask+bias?, strided/GQA?)
    "plain": (False, True, None, False, False, False),
    "causal-br": (True, True, None, False, False, False),
    "causal-tl": (True, False, None, False, False, False),
    "window-br": (False, True, (50, 7), False, False, False),
    "causal-kvlens": (True, True, None, True, False, False),
    "window-tl-kvlens": (True, False, (20, None), True, False, False),
    "strided-gqa": (True, True, (300, None), False, False, True),
    "mask-bias": (True, True, None, True, True, False),
}


def correctness(head_dims, full_dims):
    rng = np.random.default_rng(0)
    lens = (1, 63, 127, 1000)
    worst = {}
    failures = 0
    n = 0
    for dtype, D in itertools.product(DTYPES, head_dims):
        tol = 4e-3 if dtype == "float16" else 2.5e-2
        pairs = list(itertools.product(lens, lens)) if D in full_dims else \
            [(63, 1000), (1000, 127), (1, 63), (127, 127)]
        modes = MODES if D in full_dims else ("plain", "causal-br", "window-tl-kvlens", "mask-bias")
        for (Nq, Nk), mode in itertools.product(pairs, modes):
            causal, br, window, use_kv, use_mb, strided = MODES[mode]
            B, H = 2, 3
            scale = 1.0 / math.sqrt(D)
            if strided:  # (B, N, H, D).swapaxes(1, 2) queries; one shared kv head (GQA 3:1)
                q = randn((B, Nq, H, D), dtype, rng).swapaxes(1, 2)
                k = randn((B, Nk, 1, D), dtype, rng).swapaxes(1, 2)
                v = randn((B, Nk, 1, D), dtype, rng).swapaxes(1, 2)
            else:
                q, k, v = (randn((B, H, N, D), dtype, rng) for N in (Nq, Nk, Nk))
            kv_lens = rng.integers(0, Nk + 1, size=(B, H)).astype(np.int64) if use_kv else None
            if use_kv:
                kv_lens[0, 0] = 0
                kv_lens[-1, -1] = Nk
            mask = bias = None
            if use_mb:
                mask = cp.asarray(rng.random((B, H, Nq, Nk)) < 0.8)
                bias = cp.asarray(rng.standard_normal((B, H, Nq, Nk)).astype(np.float32))
                bias[cp.asarray(rng.random((B, H, Nq, Nk)) < 0.05)] = -np.inf
            out, lse = run_tc(q, k, v, scale, causal, br, window, kv_lens, mask, bias)
            ref_out, ref_lse = reference(q, k, v, scale, causal, br, window, kv_lens, mask, bias)
            out64 = out.astype(cp.float64)
            err = float(cp.abs(out64 - ref_out).max()) if out.size else 0.0
            nan = bool(cp.isnan(out64).any() or cp.isnan(lse).any())
            inf_ok = bool((cp.isneginf(lse) == cp.isneginf(ref_lse)).all())
            fin = cp.isfinite(ref_lse)
            lse_err = float(cp.abs(cp.where(fin, lse - ref_lse, 0)).max()) if lse.size else 0.0
            terr = ""
            if torch is not None and mode in ("plain", "causal-br") and (not causal or Nq == Nk):
                t = torch_flash(q, k, v, scale, causal)
                terr = "%.2e" % float(cp.abs(cp.from_dlpack(t.float().contiguous())
                                             .astype(cp.float64) - ref_out).max())
            ok = (not nan) and inf_ok and err <= tol and lse_err <= 1e-3
            n += 1
            key = (dtype, D)
            worst[key] = max(worst.get(key, 0.0), err)
            if not ok or terr:
                print(f"{'ok  ' if ok else 'FAIL'} {dtype:8s} D={D:3d} Nq={Nq:4d} Nk={Nk:4d} "
                      f"{mode:17s} out_err={err:.2e} lse_err={lse_err:.2e} nan={nan} "
                      f"-inf_match={inf_ok}" + (f" torch_flash_err={terr}" if terr else ""))
            failures += not ok
    for (dtype, D), e in sorted(worst.items()):
        print(f"worst out error {dtype:8s} D={D:3d}: {e:.2e}")
    print(f"correctness: {n - failures}/{n} cases passed")
    return failures


# ---- timing ------------------------------------------------------------------------------------

def median_ms(fn, ev, min_reps=5, max_reps=20, budget_s=0.25):
    for _ in range(3):
        fn()
    times = []
    t_end = time.perf_counter() + budget_s
    while len(times) < min_reps or (len(times) < max_reps and time.perf_counter() < t_end):
        a, b = ev(), ev()
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(ev.elapsed(a, b))
    return float(np.median(times))


class CpEv:
    def __call__(self):
        return cp.cuda.Event()

    @staticmethod
    def elapsed(a, b):
        return cp.cuda.get_elapsed_time(a, b)


class TorchEv:
    def __call__(self):
        return torch.cuda.Event(enable_timing=True)

    @staticmethod
    def elapsed(a, b):
        return a.elapsed_time(b)


def timing(head_dims, seqs, variants):
    rng = np.random.default_rng(1)
    dtype = "bfloat16"
    rows = []
    print(f"\ntiming (bf16, TFLOP/s; FLOPs = 4*B*H*N^2*D, /2 causal)")
    hdr = f"{'D':>4} {'N':>6} {'causal':>6} {'cuflash':>8} {'flash':>8} {'ratio':>6}"
    extra = {D: variants.get(D, []) for D in head_dims}
    for D in head_dims:
        names = [f"v{i}" for i in range(len(extra[D]))]
        print(hdr + "".join(f" {n:>8}" for n in names))
        for t_i, t in enumerate(extra[D]):
            print(f"     v{t_i} = {t}")
        for N, causal in itertools.product(seqs, (False, True)):
            B, H = 16384 // N, 2048 // D
            q, k, v = (randn((B, H, N, D), dtype, rng) for _ in range(3))
            scale = 1.0 / math.sqrt(D)
            flops = 4.0 * B * H * N * N * D / (2 if causal else 1)
            tf = lambda ms: flops / ms / 1e9
            ours = tf(median_ms(prepare_tc(q, k, v, scale, causal, True, None, None, None,
                                           None)[0], CpEv()))
            peer = float("nan")
            if torch is not None:
                tq, tk, tv = to_torch(q), to_torch(k), to_torch(v)

                def flash():
                    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                        F.scaled_dot_product_attention(tq, tk, tv, is_causal=causal)
                peer = tf(median_ms(flash, TorchEv()))
            alt = [tf(median_ms(prepare_tc(q, k, v, scale, causal, True, None, None, None,
                                           None, tile=t)[0], CpEv())) for t in extra[D]]
            line = f"{D:4d} {N:6d} {str(causal):>6} {ours:8.1f} {peer:8.1f} {ours / peer:6.2f}"
            print(line + "".join(f" {a:8.1f}" for a in alt), flush=True)
            rows.append((D, N, causal, ours, peer, alt))
            del q, k, v
    return rows


VARIANTS = {  # alternatives timed beside the table's choice with --variants
    64: [_tc.Tile(128, 64, 4, 3, False, 2), _tc.Tile(128, 32, 4, 2, False, 2),
         _tc.Tile(64, 128, 4, 2, True, 2)],
    128: [_tc.Tile(128, 32, 4, 3, False, 2), _tc.Tile(128, 64, 8, 3, True, 1),
          _tc.Tile(64, 64, 4, 2, True, 2)],
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--skip-correctness", action="store_true")
    ap.add_argument("--skip-timing", action="store_true")
    ap.add_argument("--variants", action="store_true", help="also time VARIANTS tiles")
    ap.add_argument("--dims", default="32,64,96,128,192,256")
    ap.add_argument("--seqs", default="512,1024,2048,4096,8192,16384")
    a = ap.parse_args()
    dims = [int(x) for x in a.dims.split(",")]
    print("device:", cp.cuda.runtime.getDeviceProperties(0)["name"].decode(),
          "torch", torch.__version__ if torch else None)
    t0 = time.perf_counter()
    fails = 0
    if not a.skip_correctness:
        fails = correctness(dims, full_dims=(64, 128))
        print(f"[correctness took {time.perf_counter() - t0:.1f} s]")
    if not a.skip_timing:
        timing([d for d in dims if d in (64, 128)], [int(x) for x in a.seqs.split(",")],
               VARIANTS if a.variants else {})
    print(f"[total {time.perf_counter() - t0:.1f} s]")
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
