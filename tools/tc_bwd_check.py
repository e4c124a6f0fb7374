"""Standalone check of the tensor-core backward (kernels_cu/bwd_sm80.cu via cuflash/_tc_bwd.py).

Stages (each in its own try/except: a failing stage prints FAIL and its traceback, the rest runs):
  1. build      compile the instantiations used below; registers and local (spill) bytes
  2. correct    gradients vs cuflash.reference.attention_backward (dense float64, from the same
                out / lse, which come from cuflash.attention) on odd shapes: Nq, Nk in
                {1, 63, 127, 1000}, causal both alignments, window, kv_lens (incl. 0), GQA with
                strided / broadcast k and v, mask + bias; outputs poisoned with NaN first; torch SDPA
                flash's backward error on the same data (plain and top-left causal) printed beside.
                Error = max |grad - ref| / max |ref| per gradient, on the gradients cast to the
                input dtype (what the API returns).
  3. determ     deterministic=True twice: dq, dk, dv bitwise equal
  4. timing     FlashAttention grid (16k tokens, heads x dim = 2048, D = 64, 128, N = 512..16k,
                causal and not, bf16): cuflash backward (prep + kernels + casts of dq/dk/dv to bf16)
                atomic and deterministic, vs torch SDPA flash backward (autograd.grad with
                retain_graph on the SDPA output), CUDA events, median after warm-up, host prep
                outside. FLOPs = 2.5 * 4 * B * H * N^2 * D, halved for causal.

    PYTHONPATH=. python3 tools/tc_bwd_check.py [--skip-build] [--skip-correctness] [--skip-timing]
        [--variants [--old-variants | --wg]] [--dims 64,128] [--seqs 1024,4096,16384]
  --variants: stages 1-2 also build and check every VARIANTS tile of head dims 64 / 128 (each
  correctness case run again with each tile, printed as v<i>), and stage 4 times them beside the
  table's choice (after comparing their gradients with the default tile's on the timing data).
  --wg: the variants are WG_VARIANTS instead (on compute capability 9.0, where the defaults at D=64
  and 128 are the wgmma tiles: the tiles they replaced, and D=128's 32-query wgmma tile).
  --dims: the head dims of the timing stage.
"""
import argparse
import itertools
import math
import sys
import time
import traceback

import cupy as cp
import numpy as np

import cuflash
from cuflash import _broadcast, _gpu, _tc_bwd, reference
from cuflash._validate import make_problem

try:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
except Exception:  # timing and the torch error column are skipped
    torch = None

SUMMARY = []  # (stage, ok, message) for the final lines


def stage(name):
    def wrap(fn):
        def run(*a, **kw):
            t0 = time.perf_counter()
            try:
                res = fn(*a, **kw)
                ok = res is None or res is True or (isinstance(res, tuple) and res[0])
            except Exception:
                print(f"FAIL stage {name}: exception\n{traceback.format_exc()}", flush=True)
                res, ok = None, False
            dt = time.perf_counter() - t0
            SUMMARY.append((name, ok, f"{dt:.1f} s"))
            print(f"[{name}: {'ok' if ok else 'FAIL'}, {dt:.1f} s]", flush=True)
            return res
        return run
    return wrap


def randn(shape, dtype, rng):
    return cp.asarray(rng.standard_normal(shape, dtype=np.float32)).astype(dtype)


def to_torch(x):
    if x.dtype.name == "bfloat16":
        return torch.from_dlpack(x.view(cp.int16)).view(torch.bfloat16)
    return torch.from_dlpack(x)


# ---- 1. build ----------------------------------------------------------------------------------
@stage("build")
def build(combos, variants=None):
    variants = variants or {}
    bad = 0
    for dt, d in combos:
        for has_mb in (False, True):
            t = (_tc_bwd.DKDV_TILES_MB if has_mb else _tc_bwd.DKDV_TILES)[d]
            tq = (_tc_bwd.DQ_TILES_MB if has_mb else _tc_bwd.DQ_TILES)[d]
            items = [(_tc_bwd.dkdv_expr(dt, d, t, True, has_mb), _tc_bwd.dkdv_smem_bytes(d, t),
                      _tc_bwd.dkdv_arch(t)),
                     (_tc_bwd.dkdv_expr(dt, d, t, False, has_mb), _tc_bwd.dkdv_smem_bytes(d, t),
                      _tc_bwd.dkdv_arch(t)),
                     (_tc_bwd.dq_expr(dt, d, tq, has_mb), _tc_bwd.dq_smem_bytes(d, tq), None)]
            if not has_mb:
                items.append((_tc_bwd.prep_expr(dt, d), 0, None))
            if not has_mb:
                for t2 in variants.get(d, []):
                    for atomic in (True, False):
                        items.append((_tc_bwd.dkdv_expr(dt, d, t2, atomic, has_mb),
                                      _tc_bwd.dkdv_smem_bytes(d, t2), _tc_bwd.dkdv_arch(t2)))
            for expr, smem, arch in items:
                t0 = time.perf_counter()
                fn = _tc_bwd._function(expr, smem, arch)
                local = fn.local_size_bytes
                bad += local > 0
                print(f"{'FAIL' if local else 'ok  '} {expr}: {fn.num_regs} regs, {local} local B, "
                      f"{smem} smem B, compile+load {time.perf_counter() - t0:.1f} s", flush=True)
    return bad == 0


# ---- 2. correctness ----------------------------------------------------------------------------
MODES = {
    # name: (causal, align, window, kv_lens?, mask+bias?, strided/GQA?)
    "plain": (False, "bottom-right", None, False, False, False),
    "causal-br": (True, "bottom-right", None, False, False, False),
    "causal-tl": (True, "top-left", None, False, False, False),
    "window-br": (False, "bottom-right", (50, 7), False, False, False),
    "causal-kvlens": (True, "bottom-right", None, True, False, False),
    "window-tl-kvlens": (True, "top-left", (20, None), True, False, False),
    "strided-gqa": (True, "bottom-right", (300, None), False, False, True),
    "mask-bias": (True, "bottom-right", None, True, True, False),
}


def make_case(rng, dtype, D, Nq, Nk, mode):
    causal, align, window, use_kv, use_mb, strided = MODES[mode]
    B, H = 2, 2
    if strided:  # (B, N, H, D).swapaxes(1, 2) queries; k, v one kv head (GQA 2:1), batch-broadcast
        q = randn((B, Nq, H, D), dtype, rng).swapaxes(1, 2)
        k = randn((1, Nk, 1, D), dtype, rng).swapaxes(1, 2)
        v = randn((1, Nk, 1, D), dtype, rng).swapaxes(1, 2)
    else:
        q, k, v = (randn((B, H, N, D), dtype, rng) for N in (Nq, Nk, Nk))
    opts = dict(scale=1.0 / math.sqrt(D), causal=causal, align=align, window=window)
    if use_kv:
        kv = rng.integers(0, Nk + 1, size=(B, H)).astype(np.int64)
        kv[0, 0] = 0
        kv[-1, -1] = Nk
        opts["kv_lens"] = kv
    if use_mb:
        opts["mask"] = cp.asarray(rng.random((B, H, Nq, Nk)) < 0.8)
        bias = cp.asarray(rng.standard_normal((Nq, Nk)).astype(np.float32))  # broadcast (0 strides)
        bias[cp.asarray(rng.random((Nq, Nk)) < 0.05)] = -np.inf
        opts["bias"] = bias
    return q, k, v, opts


def ours_grads(q, k, v, opts, dout, out, lse, deterministic=False, tile=None):
    """cuflash's API steps around _tc_bwd.backward: per-(b, h) float32 -> input shapes and dtype.
    tile: a dkdv tile (VARIANTS) instead of the table's."""
    p = make_problem(q, k, v, **opts)
    if not _tc_bwd.supports(p):
        raise RuntimeError("supports() returned False for a case it should take")
    if tile is None:
        dq, dk, dv = _tc_bwd.backward(p, dout, out, lse, deterministic=deterministic)
    else:
        with p.q.device:
            dq, dk, dv = _tc_bwd.make_backward(p, deterministic, dkdv_tile=tile)(dout, out, lse)
    res = []
    for g, x in ((dq, p.q), (dk, p.k), (dv, p.v)):
        g = g.reshape(p.lead + g.shape[-2:])
        res.append(_broadcast.reduce_to_lead(cp, g, x.shape).astype(p.dtype, copy=False))
    return res, (dq, dk, dv)


def rel_err(g, ref, scale=0.0):
    """max |g - ref| / max(max |ref|, scale). `scale`: the largest gradient of the call: where
    one query sees a single key, dq and dk are exactly 0 (softmax of one key is 1) and their
    rounding noise would otherwise be measured against ~1e-17."""
    g = cp.asnumpy(g.astype(cp.float64)) if not isinstance(g, np.ndarray) else g.astype(np.float64)
    if g.size == 0:
        return 0.0
    den = max(float(np.abs(ref).max()), scale, 1e-6)
    return float(np.abs(g - ref).max()) / den


def torch_flash_grads(q, k, v, dout, scale, causal):
    tq, tk, tv = (to_torch(x.copy()).requires_grad_() for x in (q, k, v))
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        o = F.scaled_dot_product_attention(tq, tk, tv, is_causal=causal, scale=scale)
    return torch.autograd.grad(o, (tq, tk, tv), to_torch(dout))


@stage("correctness")
def correctness(full, partial, deterministic_too=True, variants=None):
    """variants: {head dim: [dkdv tiles]}: each case also runs with each tile of its head dim
    (same data, same reference, same bound; printed as v<i>)."""
    variants = variants or {}
    rng = np.random.default_rng(0)
    lens = (1, 63, 127, 1000)
    worst = {}
    fails = n = case_no = 0
    _gpu.POISON = True
    try:
        plan = [(dt, D, list(itertools.product(lens, lens)), list(MODES)) for dt, D in full] + \
               [(dt, D, [(63, 1000), (1000, 127), (1, 63), (127, 127)],
                 ["plain", "causal-br", "window-tl-kvlens", "strided-gqa", "mask-bias"])
                for dt, D in partial]
        for dtype, D, pairs, modes in plan:
            tol = 6e-3 if dtype == "float16" else 3e-2
            for (Nq, Nk), mode in itertools.product(pairs, modes):
                n += 1
                try:
                    q, k, v, opts = make_case(rng, dtype, D, Nq, Nk, mode)
                    out, lse = cuflash.attention(q, k, v, return_lse=True, **opts)
                    dout = randn(out.shape, dtype, rng)
                    case_no += 1
                    det = deterministic_too and (case_no % 2 == 0)  # alternate the dQ modes
                    ref = reference.attention_backward(dout, q, k, v, out, lse, **opts)
                    terr = None
                    # torch's flash takes top-left causal only with Nq == Nk
                    if torch is not None and Nq > 1 and (
                            mode == "plain" or (mode == "causal-tl" and Nq == Nk)):
                        tg = torch_flash_grads(q, k, v, dout, opts["scale"], opts["causal"])
                        terr = [rel_err(cp.from_dlpack(t.float().contiguous()), r)
                                for t, r in zip(tg, ref)]
                    bound = tol if terr is None else max(tol, 2.5 * max(terr))
                    for vi, tile in [(None, None)] + list(enumerate(variants.get(D, []))):
                        grads, raw = ours_grads(q, k, v, opts, dout, out, lse, deterministic=det,
                                                tile=tile)
                        scale = max(float(np.abs(r).max()) if r.size else 0.0 for r in ref)
                        errs = [rel_err(g, r, scale) for g, r in zip(grads, ref)]
                        nan = any(bool(cp.isnan(x).any()) for x in raw)
                        ok = not nan and max(errs) <= bound
                        key = (dtype, D, vi)
                        worst[key] = max(worst.get(key, 0.0), max(errs))
                        if not ok or (terr is not None and Nq == Nk == 1000):
                            print(f"{'ok  ' if ok else 'FAIL'} {dtype:8s} D={D:3d} Nq={Nq:4d} "
                                  f"Nk={Nk:4d} {mode:16s} det={det!s:5} "
                                  f"{'default' if vi is None else f'v{vi}':7s} err dq/dk/dv = "
                                  + "/".join(f"{e:.1e}" for e in errs) + f" nan={nan}"
                                  + ("" if terr is None else
                                     "  torch_flash " + "/".join(f"{e:.1e}" for e in terr)),
                                  flush=True)
                        fails += not ok
                        n += vi is not None
                        del grads, raw
                except Exception:
                    fails += 1
                    print(f"FAIL {dtype} D={D} Nq={Nq} Nk={Nk} {mode}: exception\n"
                          f"{traceback.format_exc()}", flush=True)
    finally:
        _gpu.POISON = False
    for (dtype, D, vi), e in sorted(worst.items(), key=lambda kv: (kv[0][0], kv[0][1],
                                                                   -1 if kv[0][2] is None
                                                                   else kv[0][2])):
        name = "default" if vi is None else f"v{vi} {variants[D][vi]}"
        print(f"worst relative error {dtype:8s} D={D:3d} {name}: {e:.2e}")
    print(f"correctness: {n - fails}/{n} cases passed")
    return fails == 0


# ---- 3. determinism ----------------------------------------------------------------------------
@stage("determinism")
def determinism(dims):
    rng = np.random.default_rng(2)
    ok = True
    for dtype, D, mode in itertools.product(("bfloat16",), dims, ("strided-gqa", "plain")):
        q, k, v, opts = make_case(rng, dtype, D, 1000, 1000, mode)
        out, lse = cuflash.attention(q, k, v, return_lse=True, **opts)
        dout = randn(out.shape, dtype, rng)
        p = make_problem(q, k, v, **opts)
        a = [x.copy() for x in _tc_bwd.backward(p, dout, out, lse, deterministic=True)]
        b = _tc_bwd.backward(p, dout, out, lse, deterministic=True)
        c = _tc_bwd.backward(p, dout, out, lse, deterministic=False)
        same = all(bool(cp.array_equal(x.view(cp.uint32), y.view(cp.uint32))) for x, y in zip(a, b))
        diff = max(float(cp.abs(x - y).max()) / max(float(cp.abs(x).max()), 1e-30)
                   for x, y in zip(a, c))
        print(f"{'ok  ' if same else 'FAIL'} {dtype} D={D} {mode}: deterministic runs bitwise "
              f"equal={same}; atomic vs deterministic max rel diff {diff:.1e}")
        ok &= same and diff < 1e-3
    return ok


# ---- 4. timing ---------------------------------------------------------------------------------
def median_ms(fn, make_ev, elapsed, min_reps=5, max_reps=20, budget_s=0.3):
    for _ in range(2):
        fn()
    times = []
    t_end = time.perf_counter() + budget_s
    while len(times) < min_reps or (len(times) < max_reps and time.perf_counter() < t_end):
        a, b = make_ev(), make_ev()
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(elapsed(a, b))
    return float(np.median(times))


def cp_time(fn):
    return median_ms(fn, cp.cuda.Event, cp.cuda.get_elapsed_time)


def torch_time(fn):
    return median_ms(fn, lambda: torch.cuda.Event(enable_timing=True), lambda a, b: a.elapsed_time(b))


_T = _tc_bwd.DkdvTile
_BDEP, _CHAIN, _V4 = _tc_bwd.OPT_BDEP, _tc_bwd.OPT_BCHAIN, _tc_bwd.OPT_DQ_V4
VARIANTS = {  # dkdv tiles timed beside the table's choice with --variants (non-causal and causal),
    # and checked against the reference in the correctness stage (every case of their head dim).
    # OPT_GRID: bwd_sm80_dkdv_g, the FA2-style warp grids (S^T / dP^T on 4 keys x 2 queries, dK / dV
    # on 4 keys x 2 head-dim halves, dQ on 2 query halves x 4 head-dim quarters (4 x 2 at
    # BLOCK_M 128), P^T and dS^T through shared memory). Shared memory: D=64 BLOCK_M 64 / 128 / 32: 109 / 178 / 75 KiB,
    # D=128 BLOCK_M 64 / 32: 173 / 123 KiB (over 163 KiB: sm_90 only).
    # _tc_bwd.GRID_TILES: D=64 BLOCK_M 64, 128, 32; D=128 BLOCK_M 64 (the default where shared
    # memory allows), 32.
    d: list(tiles) for d, tiles in _tc_bwd.GRID_TILES.items()
}
# D=64's previous table tile: padded rows instead of the swizzled ones of OPT_SWZ, which replaced it
# (+2-5 %, see _tc_bwd.DKDV_TILES); timed beside it for A/B. _tc_bwd.DKDV_X_TILES[64].
VARIANTS[64].extend(_tc_bwd.DKDV_X_TILES[64])
# --wg: on compute capability 9.0 the defaults at D=64 and 128 are the wgmma tiles
# (_tc_bwd.DKDV_TILES_WG, and at D=128 with dQ atomics _tc_bwd.DKDV_TILES_WG_DQ); this times beside
# them the tiles they replaced (D=64's mma.sync table tile, D=128's warp-grid tile and the wgmma
# tile with dQ on mma.sync) and, at D=128, the wgmma tile with 32 queries per step.
WG_VARIANTS = {64: [_tc_bwd.DKDV_TILES[64]],
               128: [_tc_bwd.DKDV_TILES_LARGE_SMEM[128],
                     _T(32, 8, False, 1, _tc_bwd.OPT_SWZ | _tc_bwd.OPT_WG),
                     _tc_bwd.DKDV_TILES_WG[128]]}
OLD_VARIANTS = {  # timed on the H200 and lost (-8..+1 %): only with --old-variants
    # opt != 0: the bwd_sm80_dkdv_x candidates (see the _tc_bwd docstring for registers / spills)
    64: [_T(64, 8, False, 1), _T(64, 4, True, 2), _T(32, 4, True, 3),
         _T(64, 8, True, 1, _BDEP), _T(64, 8, True, 1, _V4),
         _T(32, 8, False, 2), _T(32, 8, False, 2, _V4), _T(32, 8, False, 2, _BDEP)],
    # (D=128 BLOCK_M 64 with 4 warps, plain and V4, lost too; they no longer build: dQ needs at
    # most 64 columns per warp since its reductions are spread over dK, tcb::dq_reduction_at)
    128: [_T(32, 8, False, 1), _T(32, 4, False, 2),
          _T(64, 8, False, 1, _BDEP), _T(64, 8, False, 1, _V4), _T(64, 8, False, 1, _BDEP | _V4)],
}


@stage("timing")
def timing(dims, seqs, variants, rows):
    dtype = "bfloat16"
    bf16 = cp.dtype(dtype)
    for D in dims:
        for N, causal in itertools.product(seqs, (False, True)):
            try:
                B, H = 16384 // N, 2048 // D
                q, k, v, dout = (cp.random.standard_normal((B, H, N, D), dtype=cp.float32)
                                 .astype(bf16) for _ in range(4))
                scale = 1.0 / math.sqrt(D)
                p = make_problem(q, k, v, scale=scale, causal=causal)
                out, lse = cuflash.attention(q, k, v, causal=causal, return_lse=True)
                out = out.reshape(B, H, N, D)
                flops = 2.5 * 4.0 * B * H * N * N * D / (2 if causal else 1)
                tf = lambda ms: flops / ms / 1e9

                def ours_fn(det, tile=None):
                    run = _tc_bwd.make_backward(p, deterministic=det, dkdv_tile=tile)
                    return lambda: [g.astype(bf16) for g in run(dout, out, lse)]

                ours = tf(cp_time(ours_fn(False)))
                det = tf(cp_time(ours_fn(True)))
                alt = []
                base = ours_fn(False)() if variants.get(D) else None
                for i, t in enumerate(variants.get(D, [])):
                    # each variant's gradients against the default tile's (same data), then time
                    got = ours_fn(False, t)()
                    diff = max(float(cp.abs(x.astype(cp.float32) - y.astype(cp.float32)).max())
                               / max(float(cp.abs(y.astype(cp.float32)).max()), 1e-30)
                               for x, y in zip(got, base))
                    if not diff <= 1e-2:
                        print(f"FAIL variant v{i} {t} D={D} N={N} causal={causal}: max rel diff "
                              f"{diff:.1e} vs the default tile", flush=True)
                    del got
                    alt.append(tf(cp_time(ours_fn(False, t))))
                del base
                peer = float("nan")
                if torch is not None:
                    tq, tk, tv = (to_torch(x).detach().requires_grad_() for x in (q, k, v))
                    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                        o = F.scaled_dot_product_attention(tq, tk, tv, is_causal=causal)
                    tdo = to_torch(dout)
                    peer = tf(torch_time(
                        lambda: torch.autograd.grad(o, (tq, tk, tv), tdo, retain_graph=True)))
                    del o, tq, tk, tv, tdo
                rows.append((D, N, causal, ours, det, peer, alt))
                print(f"D={D:3d} N={N:5d} causal={causal!s:5}: cuflash {ours:6.1f}  det {det:6.1f}  "
                      f"flash {peer:6.1f}  ratio {ours / peer:5.2f}"
                      + "".join(f"  v{i} {a:6.1f}" for i, a in enumerate(alt)), flush=True)
                del q, k, v, dout, out, lse, p
            except Exception:
                print(f"FAIL timing D={D} N={N} causal={causal}\n{traceback.format_exc()}",
                      flush=True)
                rows.append((D, N, causal, float("nan"), float("nan"), float("nan"), []))
            cp.get_default_memory_pool().free_all_blocks()
    return True


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--skip-build", action="store_true")
    ap.add_argument("--skip-correctness", action="store_true")
    ap.add_argument("--skip-timing", action="store_true")
    ap.add_argument("--variants", action="store_true",
                    help="also build, check and time the VARIANTS dkdv tiles")
    ap.add_argument("--old-variants", action="store_true",
                    help="with --variants: also time OLD_VARIANTS (timed before, lost)")
    ap.add_argument("--wg", action="store_true",
                    help="the variants are WG_VARIANTS (wgmma, sm_90a) instead of VARIANTS")
    ap.add_argument("--dims", default="64,128", help="head dims of the timing stage")
    ap.add_argument("--seqs", default="512,1024,2048,4096,8192,16384")
    a = ap.parse_args()
    t0 = time.perf_counter()
    try:
        dev = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
        print("device:", dev["name"].decode(), "sm", cp.cuda.Device().compute_capability,
              "| nvrtc", cp.cuda.nvrtc.getVersion(), "| torch", torch.__version__ if torch else None)
    except Exception:
        print(f"FAIL device query\n{traceback.format_exc()}")
    variants = {}
    if a.variants:
        variants = {d: list((WG_VARIANTS if a.wg else VARIANTS).get(d, [])) for d in (64, 128)}
    timed = {d: v + (OLD_VARIANTS.get(d, []) if a.old_variants else [])
             for d, v in variants.items()}
    full = [("bfloat16", 128), ("float16", 64)]
    partial = [("float16", 128), ("bfloat16", 64), ("bfloat16", 32), ("float16", 96)]
    if not a.skip_build:  # the instantiations the later stages use (compiles them once)
        build(full + partial, variants)
    if not a.skip_correctness:
        correctness(full=full, partial=partial, variants=variants)
        determinism([64, 128])
    rows = []
    if not a.skip_timing:
        timing([int(x) for x in a.dims.split(",")], [int(x) for x in a.seqs.split(",")], timed,
               rows)
    # ---- compact table, last ----
    if rows:
        print("\nbackward, bf16, TFLOP/s (FLOPs = 2.5 * 4*B*H*N^2*D, /2 causal); cuflash includes "
              "prep, dq zeroing and the bf16 casts; det = deterministic=True")
        if a.variants:
            for D, vs in timed.items():
                for i, t in enumerate(vs):
                    print(f"  D={D} v{i} = {t}")
        print(f"{'D':>4} {'N':>6} {'causal':>6} {'cuflash':>8} {'det':>8} {'flash':>8} {'ratio':>6}"
              + ("   variants" if a.variants else ""))
        for D, N, causal, ours, det, peer, alt in rows:
            print(f"{D:4d} {N:6d} {str(causal):>6} {ours:8.1f} {det:8.1f} {peer:8.1f} "
                  f"{ours / peer:6.2f}" + "".join(f" {x:7.1f}" for x in alt))
    for name, ok, msg in SUMMARY:
        print(f"{'ok  ' if ok else 'FAIL'} stage {name} ({msg})")
    print(f"[total {time.perf_counter() - t0:.1f} s]")
    return 0 if all(ok for _, ok, _ in SUMMARY) else 1


if __name__ == "__main__":
    sys.exit(main())
