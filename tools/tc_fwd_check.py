"""Standalone check of the tensor-core forward (kernels_cu/fwd_sm80.cu via cuflash._launch).

Problems are built by cuflash's own validation and argument code (_validate.make_problem,
_gpu._Args) and launched with _launch.launch_fwd_sm80, optionally with an explicit tile
(a _config.Sm80Tile) instead of the table's choice.

Default mode:
1. Correctness on awkward shapes against a dense float64 CuPy reference built from the definition
   in DESIGN.md (outputs poisoned with NaN first), both dtypes, causal both alignments, window,
   kv_lens, mask + bias, strided and GQA inputs. Where torch SDPA flash can run the same case, its
   error against the same reference is printed beside ours.
2. Timing on the FlashAttention grid (16k tokens, heads x head dim = 2048, bf16) against
   torch SDPA with the flash backend on the same data. FLOPs = 4 * B * H * N^2 * D, halved for
   causal.

--variants (~2-3 min on an H200): the candidates' kernels are first compiled in parallel child
processes (CuPy's disk cache then serves this one); every tile of CANDIDATES is checked on odd
shapes (causal both alignments, kv_lens, window, strided GQA, a ramp that keeps raising the row
max; NaN-poisoned outputs vs float64) and timed against torch SDPA flash at D = 128 and 64,
N = 1k, 4k, 16k, causal and not, bf16 (rows after --budget-s seconds are skipped). One failing
candidate prints FAIL lines and the others go on; a compact table comes last.

Timing: CUDA events around a batch of back-to-back launches (host overhead overlaps the GPU;
all host preparation happens before the first event), median of the batches.

    PYTHONPATH=. python3 tools/tc_fwd_check.py [--variants] [--skip-correctness] [--skip-timing]
    PYTHONPATH=. python3 tools/tc_fwd_check.py --build     # no device: candidates' ptxas report
"""
import argparse
import itertools
import math
import sys
import time
import traceback

import cupy as cp
import numpy as np

from cuflash import _config, _gpu, _kernels, _launch
from cuflash._validate import make_problem

try:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
except ImportError:  # timing and the torch error column are skipped
    torch = None

DTYPES = ("float16", "bfloat16")
Tile = _config.Sm80Tile

# Candidate tiles for --variants, per head dim: (label, tile); None = the table's current choice.
# Fields: block_m block_n warps stages q_in_regs min_blocks ksplit rescale opt (see _config.py);
# opt bits: A = 1 incremental copy addresses, L = 2 next tile's copies after S = Q K^T,
# S = 4 K and V in separate cp.async groups (wait for K before Q K^T, for V after it).
# ptxas (NVRTC 13.0): all spill-free on sm_90a; "A" and "A+S" at D=128 spill 8 / 4 bytes on sm_80
# (`--build` prints the table; the 128x64 4-warp tile sits at 255 registers). A+L and A+L+S at
# D=128 spill on sm_90a (16 / 68 bytes) and are left out there.
_A, _L, _S = _config.SM80_OPT_CHEAP_ADDR, _config.SM80_OPT_LATE_ISSUE, _config.SM80_OPT_KV_SPLIT
CANDIDATES = {
    128: [
        ("table", None),                                                  # 128x64 4w Q smem
        ("S", Tile(128, 64, 4, 2, False, 2, 1, 0, _S)),
        ("A", Tile(128, 64, 4, 2, False, 2, 1, 0, _A)),
        ("A+S", Tile(128, 64, 4, 2, False, 2, 1, 0, _A | _S)),
        ("A 128x32 3stg", Tile(128, 32, 4, 3, False, 2, 1, 0, _A)),
        ("A+S 128x32 3stg", Tile(128, 32, 4, 3, False, 2, 1, 0, _A | _S)),
        ("A 8w 128x64 Qreg", Tile(128, 64, 8, 2, True, 1, 1, 0, _A)),      # 1 block/SM
        ("A 8w 128x128 Qreg", Tile(128, 128, 8, 2, True, 1, 1, 0, _A)),    # 1 block/SM
        ("A+S 8w 128x128 Qreg", Tile(128, 128, 8, 2, True, 1, 1, 0, _A | _S)),
    ],
    64: [
        ("table", None),                                                  # 128x64 4w Q smem
        ("S", Tile(128, 64, 4, 2, False, 2, 1, 0, _S)),
        ("A", Tile(128, 64, 4, 2, False, 2, 1, 0, _A)),
        ("A+L", Tile(128, 64, 4, 2, False, 2, 1, 0, _A | _L)),
        ("A+S", Tile(128, 64, 4, 2, False, 2, 1, 0, _A | _S)),
        ("A+L+S", Tile(128, 64, 4, 2, False, 2, 1, 0, _A | _L | _S)),
        ("A Qreg", Tile(128, 64, 4, 2, True, 2, 1, 0, _A)),
        ("A 3stg", Tile(128, 64, 4, 3, False, 2, 1, 0, _A)),
    ],
}


# ---- inputs ------------------------------------------------------------------------------------

def randn(shape, dtype, rng):
    return cp.asarray(rng.standard_normal(shape, dtype=np.float32)).astype(dtype)


def prepare_tc(q, k, v, scale, causal, bottom_right, window, kv_lens, mask, bias, tile=None):
    """Everything but the launch (problem, tables, poisoned outputs, compile): (launch, out, lse).

    q (B, H, Nq, D), k/v (Bk, Hk, Nk, D) (any strides, GQA on axis -3); out (B, H, Nq, D)."""
    p = make_problem(q, k, v, scale=scale, causal=causal,
                     align="bottom-right" if bottom_right else "top-left", window=window,
                     mask=mask, bias=bias, kv_lens=kv_lens)
    if _gpu.forward_path(p) != "sm80":
        raise RuntimeError("problem does not take the tensor-core path")
    has_mb = mask is not None or bias is not None
    smem = _config.sm80_smem_bytes(p.Dk, has_mb, tile)
    optin = cp.cuda.Device().attributes["MaxSharedMemoryPerBlockOptin"]
    if smem > optin:
        raise RuntimeError(f"tile needs {smem} B shared memory, device allows {optin}")
    args = _gpu._Args(p).common(p)
    out = cp.empty((p.BH, p.Nq, p.Dv), dtype=q.dtype)
    out.view(cp.uint16).fill(0x7FC0 if q.dtype.name == "bfloat16" else 0x7E00)  # NaN poison
    lse = cp.full((p.BH, p.Nq), np.nan, dtype=np.float32)

    def launch():
        _launch.launch_fwd_sm80(p.q, p.k, p.v, out, lse, tile=tile, **args)

    launch()  # compiles outside any timing; the outputs are poisoned again below
    cp.cuda.get_current_stream().synchronize()
    out.view(cp.uint16).fill(0x7FC0 if q.dtype.name == "bfloat16" else 0x7E00)
    lse.fill(np.nan)
    shape = tuple(p.lead)
    return launch, out.reshape(shape + (p.Nq, p.Dv)), lse.reshape(shape + (p.Nq,))


def run_tc(q, k, v, scale, causal, bottom_right, window, kv_lens, mask, bias, tile=None):
    launch, out, lse = prepare_tc(q, k, v, scale, causal, bottom_right, window, kv_lens, mask,
                                  bias, tile)
    launch()
    return out, lse


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
    "kvlens": (False, True, None, True, False, False),
    "window-tl-kvlens": (True, False, (20, None), True, False, False),
    "strided-gqa": (True, True, (300, None), False, False, True),
    "mask-bias": (True, True, None, True, True, False),
    "ramp": (False, True, None, False, False, False),  # scores grow along the keys
}


def make_case(dtype, D, Nq, Nk, mode, rng):
    """(inputs dict for run_tc / reference, uses-torch?)"""
    causal, br, window, use_kv, use_mb, strided = MODES[mode]
    B, H = 2, 3
    scale = 1.0 / math.sqrt(D)
    if strided:  # (B, N, H, D).swapaxes(1, 2) queries; one shared kv head (GQA 3:1)
        q = randn((B, Nq, H, D), dtype, rng).swapaxes(1, 2)
        k = randn((B, Nk, 1, D), dtype, rng).swapaxes(1, 2)
        v = randn((B, Nk, 1, D), dtype, rng).swapaxes(1, 2)
    else:
        q, k, v = (randn((B, H, N, D), dtype, rng) for N in (Nq, Nk, Nk))
    if mode == "ramp":  # the row max keeps rising, by large steps: every rescale path runs
        q = (q.astype(cp.float32) * 2).astype(dtype)
        ramp = cp.linspace(0.1, 3.0, Nk, dtype=cp.float32).reshape(1, 1, Nk, 1)
        k = (k.astype(cp.float32) * ramp).astype(dtype)
    kv_lens = rng.integers(0, Nk + 1, size=(B, H)).astype(np.int64) if use_kv else None
    if use_kv:
        kv_lens[0, 0] = 0
        kv_lens[-1, -1] = Nk
    mask = bias = None
    if use_mb:
        mask = cp.asarray(rng.random((B, H, Nq, Nk)) < 0.8)
        bias = cp.asarray(rng.standard_normal((B, H, Nq, Nk)).astype(np.float32))
        bias[cp.asarray(rng.random((B, H, Nq, Nk)) < 0.05)] = -np.inf
    return dict(q=q, k=k, v=v, scale=scale, causal=causal, bottom_right=br, window=window,
                kv_lens=kv_lens, mask=mask, bias=bias)


def check_case(case, dtype, tile=None, with_torch=False, ref=None):
    """(ok, worst out error, message) for one case; our output vs the float64 reference."""
    tol = 4e-3 if dtype == "float16" else 2.5e-2
    out, lse = run_tc(tile=tile, **case)
    ref_out, ref_lse = reference(**case) if ref is None else ref
    out64 = out.astype(cp.float64)
    err = float(cp.abs(out64 - ref_out).max()) if out.size else 0.0
    nan = bool(cp.isnan(out64).any() or cp.isnan(lse).any())
    inf_ok = bool((cp.isneginf(lse) == cp.isneginf(ref_lse)).all())
    fin = cp.isfinite(ref_lse)
    lse_err = float(cp.abs(cp.where(fin, lse - ref_lse, 0)).max()) if lse.size else 0.0
    ok = (not nan) and inf_ok and err <= tol and lse_err <= 1e-3
    msg = f"out_err={err:.2e} lse_err={lse_err:.2e} nan={nan} -inf_match={inf_ok}"
    if with_torch and torch is not None:
        t = torch_flash(case["q"], case["k"], case["v"], case["scale"], case["causal"])
        terr = float(cp.abs(cp.from_dlpack(t.float().contiguous()).astype(cp.float64)
                            - ref_out).max())
        msg += f" torch_flash_err={terr:.2e}"
    return ok, err, msg


def correctness(head_dims, full_dims):
    rng = np.random.default_rng(0)
    lens = (1, 63, 127, 1000)
    worst = {}
    failures = 0
    n = 0
    for dtype, D in itertools.product(DTYPES, head_dims):
        pairs = list(itertools.product(lens, lens)) if D in full_dims else \
            [(63, 1000), (1000, 127), (1, 63), (127, 127)]
        modes = MODES if D in full_dims else ("plain", "causal-br", "window-tl-kvlens", "mask-bias")
        for (Nq, Nk), mode in itertools.product(pairs, modes):
            case = make_case(dtype, D, Nq, Nk, mode, rng)
            with_torch = mode in ("plain", "causal-br") and (not case["causal"] or Nq == Nk)
            try:
                ok, err, msg = check_case(case, dtype, with_torch=with_torch)
            except Exception as exc:  # noqa: BLE001 - report and go on
                ok, err, msg = False, float("nan"), f"error {type(exc).__name__}: {exc}"
            n += 1
            worst[(dtype, D)] = max(worst.get((dtype, D), 0.0), err)
            if not ok or with_torch:
                print(f"{'ok  ' if ok else 'FAIL'} {dtype:8s} D={D:3d} Nq={Nq:4d} Nk={Nk:4d} "
                      f"{mode:17s} {msg}")
            failures += not ok
    for (dtype, D), e in sorted(worst.items()):
        print(f"worst out error {dtype:8s} D={D:3d}: {e:.2e}")
    print(f"correctness: {n - failures}/{n} cases passed")
    return failures


# ---- timing ------------------------------------------------------------------------------------

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


def median_ms(fn, ev, batches=7, budget_s=0.3, target_ms=3.0):
    """Per-call milliseconds: median over batches of back-to-back calls between two events."""
    for _ in range(2):
        fn()
    a, b = ev(), ev()
    a.record()
    fn()
    b.record()
    b.synchronize()
    per = max(ev.elapsed(a, b), 1e-3)
    reps = max(1, min(50, int(target_ms / per)))
    times = []
    t_end = time.perf_counter() + budget_s
    while len(times) < 3 or (len(times) < batches and time.perf_counter() < t_end):
        a, b = ev(), ev()
        a.record()
        for _ in range(reps):
            fn()
        b.record()
        b.synchronize()
        times.append(ev.elapsed(a, b) / reps)
    return float(np.median(times))


def grid_inputs(D, N, rng):
    B, H = 16384 // N, 2048 // D
    return tuple(randn((B, H, N, D), "bfloat16", rng) for _ in range(3)), B, H


def flash_tflops(q, k, v, causal, flops):
    if torch is None:
        return float("nan")
    tq, tk, tv = to_torch(q), to_torch(k), to_torch(v)

    def flash():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            F.scaled_dot_product_attention(tq, tk, tv, is_causal=causal)
    return flops / median_ms(flash, TorchEv()) / 1e9


def timing(head_dims, seqs):
    rng = np.random.default_rng(1)
    print("\ntiming (bf16, TFLOP/s; FLOPs = 4*B*H*N^2*D, /2 causal)")
    print(f"{'D':>4} {'N':>6} {'causal':>6} {'cuflash':>8} {'flash':>8} {'ratio':>6}")
    for D in head_dims:
        for N, causal in itertools.product(seqs, (False, True)):
            (q, k, v), B, H = grid_inputs(D, N, rng)
            flops = 4.0 * B * H * N * N * D / (2 if causal else 1)
            launch = prepare_tc(q, k, v, 1.0 / math.sqrt(D), causal, True, None, None, None,
                                None)[0]
            ours = flops / median_ms(launch, CpEv()) / 1e9
            peer = flash_tflops(q, k, v, causal, flops)
            print(f"{D:4d} {N:6d} {str(causal):>6} {ours:8.1f} {peer:8.1f} {ours / peer:6.2f}",
                  flush=True)
            del q, k, v


# ---- --variants: candidate tiles -------------------------------------------------------------

VARIANT_CASES = (  # (dtype, Nq, Nk, mode): odd lengths, every visibility feature but mask/bias
    ("bfloat16", 127, 1000, "plain"),
    ("bfloat16", 1000, 1000, "causal-br"),
    ("bfloat16", 1000, 127, "causal-tl"),
    ("bfloat16", 1001, 1001, "causal-tl"),
    ("bfloat16", 300, 1001, "causal-br"),
    ("bfloat16", 1001, 300, "causal-br"),   # rows before the aligned start see nothing
    ("bfloat16", 1, 63, "causal-tl"),       # one tile, one row
    ("bfloat16", 999, 777, "kvlens"),
    ("bfloat16", 63, 1000, "causal-kvlens"),
    ("bfloat16", 1000, 1000, "window-tl-kvlens"),
    ("bfloat16", 130, 513, "strided-gqa"),
    ("bfloat16", 200, 1000, "ramp"),
    ("float16", 127, 1000, "ramp"),
    ("float16", 1000, 1000, "causal-br"),
)


_WARM = """
import sys
from cuflash import _config, _kernels
for expr in sys.argv[1:]:
    try:
        _kernels.get_function(_config.SOURCES["fwd_sm80"], expr)
    except Exception as exc:  # reported again by the correctness stage
        print("prewarm failed:", expr, type(exc).__name__, str(exc)[:200], flush=True)
"""


def prewarm(exprs, workers=None):
    """Compile `exprs` in parallel child processes (one CUDA context each): CuPy's on-disk kernel
    cache then serves this process, so the candidates' NVRTC builds (several seconds each) overlap."""
    import os
    import subprocess
    t0 = time.perf_counter()
    exprs = sorted(set(exprs))
    workers = max(1, min(workers or os.cpu_count() or 1, 16, len(exprs)))
    chunks = [exprs[i::workers] for i in range(workers)]
    procs = [subprocess.Popen([sys.executable, "-c", _WARM] + c) for c in chunks if c]
    for pr in procs:
        pr.wait()
    print(f"[prewarm: {len(exprs)} kernels in {len(procs)} processes, "
          f"{time.perf_counter() - t0:.1f} s]", flush=True)


def variants(head_dims, seqs, budget_s=200.0):
    t0 = time.perf_counter()
    labels = {D: [lab for lab, _ in CANDIDATES[D]] for D in head_dims}
    prewarm([_config.sm80_name_expression(dt, D, False, tile) for D in head_dims
             for _, tile in CANDIDATES[D] for dt in DTYPES])
    broken = {}  # (D, label) -> first failure
    # 1. correctness of every candidate (compiles it too)
    rng = np.random.default_rng(0)
    for D in head_dims:
        cases = []
        for dt, Nq, Nk, mode in VARIANT_CASES:
            case = make_case(dt, D, Nq, Nk, mode, rng)
            cases.append((dt, Nq, Nk, mode, case, reference(**case)))
        for label, tile in CANDIDATES[D]:
            expr = _config.sm80_name_expression("bfloat16", D, False, tile)
            worst, n_ok = 0.0, 0
            for dt, Nq, Nk, mode, case, ref in cases:
                try:
                    ok, err, msg = check_case(case, dt, tile=tile, ref=ref)
                except Exception as exc:  # noqa: BLE001 - report and go on
                    ok, err = False, float("nan")
                    msg = f"error {type(exc).__name__}: {exc}".splitlines()[0][:300]
                    if not isinstance(exc, (RuntimeError, ValueError)):
                        traceback.print_exc(limit=3)
                worst = max(worst, err) if err == err else worst
                n_ok += ok
                if not ok:
                    print(f"FAIL D={D} {label} ({expr}) {dt} Nq={Nq} Nk={Nk} {mode}: {msg}",
                          flush=True)
                    broken.setdefault((D, label), f"{mode}: {msg}")
            try:  # what the device's build of the bf16 kernel uses (local bytes > 0: spills)
                a = _kernels.get_function(_config.SOURCES["fwd_sm80"], expr).attributes
                res = f"{a['num_regs']} regs, {a['local_size_bytes']} B local"
            except Exception as exc:  # noqa: BLE001
                res = f"no attributes ({type(exc).__name__})"
            print(f"{'ok  ' if n_ok == len(cases) else 'FAIL'} D={D:3d} {label:20s} "
                  f"{n_ok}/{len(cases)} cases, worst out error {worst:.2e}, {res}   {expr}",
                  flush=True)
    print(f"[variants correctness took {time.perf_counter() - t0:.1f} s]", flush=True)

    # 2. timing, every candidate beside torch flash on the same data
    trng = np.random.default_rng(1)
    table = []
    for D in head_dims:
        for N, causal in itertools.product(seqs, (False, True)):
            if time.perf_counter() - t0 > budget_s:
                print(f"[budget {budget_s:.0f} s reached: D={D} N={N} causal={causal} and later "
                      "rows not timed]", flush=True)
                break
            (q, k, v), B, H = grid_inputs(D, N, trng)
            flops = 4.0 * B * H * N * N * D / (2 if causal else 1)
            try:
                peer = flash_tflops(q, k, v, causal, flops)
            except Exception as exc:  # noqa: BLE001
                print(f"FAIL torch flash D={D} N={N} causal={causal}: {exc}")
                peer = float("nan")
            row = []
            for label, tile in CANDIDATES[D]:
                if (D, label) in broken:
                    row.append(float("nan"))
                    continue
                try:
                    launch = prepare_tc(q, k, v, 1.0 / math.sqrt(D), causal, True, None, None,
                                        None, None, tile=tile)[0]
                    row.append(flops / median_ms(launch, CpEv()) / 1e9)
                except Exception as exc:  # noqa: BLE001
                    print(f"FAIL timing D={D} {label} N={N} causal={causal}: {exc}")
                    broken.setdefault((D, label), f"timing: {exc}")
                    row.append(float("nan"))
            print(f"D={D} N={N} causal={causal}: flash {peer:.1f} | " +
                  " | ".join(f"{lab} {t:.1f}" for lab, t in zip(labels[D], row)), flush=True)
            table.append((D, N, causal, peer, row))
            del q, k, v
    print(f"[variants total {time.perf_counter() - t0:.1f} s]")

    # 3. the compact table: TFLOP/s (ratio to torch SDPA flash)
    print("\n==== variants: bf16 TFLOP/s (ratio to torch SDPA flash) ====")
    for D in head_dims:
        print(f"D={D}:")
        for i, (label, tile) in enumerate(CANDIDATES[D]):
            desc = tile if tile is not None else _config.SM80_TILES[(D, False)]
            status = "BROKEN " + broken[(D, label)][:80] if (D, label) in broken else ""
            print(f"  c{i} {label:20s} {tuple(desc)} {status}")
        hdr = f"  {'N':>6} {'causal':>6} {'flash':>7}" + "".join(
            f" {'c%d' % i:>13}" for i in range(len(CANDIDATES[D])))
        print(hdr)
        for d, N, causal, peer, row in table:
            if d != D:
                continue
            print(f"  {N:6d} {str(causal):>6} {peer:7.1f}" +
                  "".join(f" {t:6.1f} ({t / peer:4.2f})" for t in row))
    return len(broken)


def build_report(head_dims, archs=("sm_80", "sm_90a")):
    """Device-free: ptxas registers / stack / spill bytes of every candidate (both dtypes)."""
    bad = 0
    for arch in archs:
        exprs = sorted({_config.sm80_name_expression(dt, D, False, tile) for D in head_dims
                        for _, tile in CANDIDATES[D] for dt in DTYPES})
        usage = _kernels.resource_usage(exprs, arch)
        for D in head_dims:
            for label, tile in CANDIDATES[D]:
                for dt in DTYPES:
                    u = usage[_config.sm80_name_expression(dt, D, False, tile)]
                    spill = u.get("spill_stores", -1) + u.get("spill_loads", -1) + u.get("stack", -1)
                    bad += spill != 0
                    print(f"{arch:7s} D={D:3d} {label:20s} {dt:8s} {u.get('registers')} regs, "
                          f"stack {u.get('stack')}, spill st/ld {u.get('spill_stores')}/"
                          f"{u.get('spill_loads')}{'' if spill == 0 else '   <- SPILLS'}", flush=True)
    return bad


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--skip-correctness", action="store_true")
    ap.add_argument("--skip-timing", action="store_true")
    ap.add_argument("--variants", action="store_true",
                    help="only the fast candidate-tile check and timing (CANDIDATES)")
    ap.add_argument("--dims", default=None,
                    help="head dims (default 32,...,256; with --variants 128,64)")
    ap.add_argument("--seqs", default=None,
                    help="sequence lengths (default 512,...,16384; with --variants 1024,4096,16384)")
    ap.add_argument("--budget-s", type=float, default=200.0,
                    help="--variants: stop timing new rows after this many seconds (default 200)")
    ap.add_argument("--build", action="store_true",
                    help="no device: ptxas resource report of every candidate (sm_80, sm_90a)")
    a = ap.parse_args()
    if a.build:
        dims = [int(x) for x in (a.dims or "128,64").split(",")]
        return 1 if build_report([d for d in dims if d in CANDIDATES]) else 0
    print("device:", cp.cuda.runtime.getDeviceProperties(0)["name"].decode(),
          "torch", torch.__version__ if torch else None)
    t0 = time.perf_counter()
    if a.variants:
        dims = [int(x) for x in (a.dims or "128,64").split(",")]
        seqs = [int(x) for x in (a.seqs or "1024,4096,16384").split(",")]
        return 1 if variants([d for d in dims if d in CANDIDATES], seqs, a.budget_s) else 0
    dims = [int(x) for x in (a.dims or "32,64,96,128,192,256").split(",")]
    seqs = [int(x) for x in (a.seqs or "512,1024,2048,4096,8192,16384").split(",")]
    fails = 0
    if not a.skip_correctness:
        fails = correctness(dims, full_dims=(64, 128))
        print(f"[correctness took {time.perf_counter() - t0:.1f} s]")
    if not a.skip_timing:
        timing([d for d in dims if d in (64, 128)], seqs)
    print(f"[total {time.perf_counter() - t0:.1f} s]")
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
