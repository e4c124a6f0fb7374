#!/usr/bin/env python3
"""cuflash benchmark: cuflash side by side with torch SDPA and naive CuPy attention, on one GPU.

Run on a GPU machine from the repository root::

    python benchmarks/bench.py                       # the full grid (issues 3 and 4)
    python benchmarks/bench.py --quick               # a small subset, for smoke runs
    python benchmarks/bench.py --cases decode        # only the decode rows
    python benchmarks/bench.py --dry-run             # print the plan and FLOP counts (no GPU)
    python benchmarks/bench.py --self-test           # check the FLOP counting against NumPy (no GPU)

What it measures
----------------
* Prefill (issue 3): 16k tokens in total (batch = 16384 // N), heads x head dim = 2048, head dim 64
  and 128, N = 512 ... 16k, causal and not, fp16 and bf16, forward and backward. Layout (B, H, N, D).
* Decode (issue 4): Hq = 32, Hkv = 8, D = 128, bf16, Nq = 1 against KV caches of (B, L) = (1, 128k),
  (8, 32k), (32, 8k), (64, 4k), plus one uneven batch (B = 32, L = 8k, kv_lens uniform in [1, L]).
  Reported as time and KV bytes read per second, next to the device-to-device copy bandwidth
  measured in the same run.

Implementations (same process, same inputs, same CUDA stream): cuflash; torch SDPA with the flash,
cuDNN and efficient backends (when torch is importable; tensors shared with CuPy through DLPack,
no copy); naive CuPy attention (matmul, float32 softmax, matmul; prefill only, skipped when its N x N
buffers would pass 40 GiB or N >= 8k). An implementation that fails (unsupported shape, out of
memory) is recorded with its error and the run goes on.

FLOPs (the FlashAttention convention): forward = 4 * B * H * D * (visible query-key pairs per head),
with D = (Dk + Dv) / 2; causal counts the exact visible pairs (N (N + 1) / 2 for Nq = Nk, bottom-right
alignment in general); backward = 2.5 x forward. The same count is used for every implementation,
whatever work it actually does.

Timing: CUDA events on one stream shared by CuPy and torch; before each timed call a short spin
kernel (so the host can enqueue the call before the GPU reaches the start event) and a write of
2 x L2 bytes (so no input is served from L2); the first call (compilation, planning) is untimed;
median of as many runs as fit in --target-seconds (3 to 1000).

Outputs under --out: bench_<stamp>.json (every number, written after every measurement, plus GPU,
date, git commit and versions), table_<stamp>.txt (the printed table), one PNG per case of TFLOP/s vs
N (one line per implementation) and decode.png (KV bytes per second per shape).
"""
import argparse
import contextlib
import datetime
import json
import math
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from typing import Optional

import numpy as np

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_OUT = os.path.join(REPO_ROOT, "benchmarks", "results")

# ---------------------------------------------------------------------------------------------
# The one table of cases
# ---------------------------------------------------------------------------------------------

TOTAL_TOKENS = 16384                 # batch = TOTAL_TOKENS // N
HIDDEN = 2048                        # heads x head dim
SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)
HEAD_DIMS = (64, 128)
DTYPES = ("bf16", "fp16")
PREFILL_KINDS = ("fwd", "bwd")

DECODE_HQ, DECODE_HKV, DECODE_D, DECODE_DTYPE = 32, 8, 128, "bf16"
DECODE_SHAPES = ((1, 131072), (8, 32768), (32, 8192), (64, 4096))   # (B, L)
DECODE_UNEVEN = (32, 8192)           # (B, max L); kv_lens uniform in [1, L], seeded

QUICK_SEQLENS = (1024, 4096)
QUICK_DECODE_SHAPES = ((8, 32768),)
QUICK_DTYPES = ("bf16",)
QUICK_HEAD_DIMS = (128,)

PREFILL_IMPLS = ("cuflash", "torch-flash", "torch-cudnn", "torch-efficient", "naive")
DECODE_IMPLS = ("cuflash", "torch-flash", "torch-cudnn")
ALL_IMPLS = PREFILL_IMPLS
TORCH_BACKENDS = {"torch-flash": "FLASH_ATTENTION", "torch-cudnn": "CUDNN_ATTENTION",
                  "torch-efficient": "EFFICIENT_ATTENTION"}

NAIVE_MAX_N = 8192                   # naive is skipped for N >= this (time; 28-56 GiB there)
NAIVE_MAX_BYTES = 40 * 2**30         # ... and whenever its N x N buffers would pass this
NAIVE_BYTES_PER_SCORE = {"fwd": 6, "bwd": 12}   # live bytes per score element at its peak

ITEMSIZE = {"bf16": 2, "fp16": 2}
DEFAULT_L2_BYTES = 60 * 2**20
COPY_BYTES = 2**30                   # each of source and destination of the copy measurement

FLOP_CONVENTION = ("FlashAttention convention: forward FLOPs = 4 * B * H * D * visible pairs, "
                   "D = (Dk + Dv) / 2, causal = exact count of visible (query, key) pairs "
                   "(bottom-right alignment; equals top-left when Nq = Nk), backward = 2.5 x "
                   "forward; TFLOP/s = FLOPs / median time. Decode TB/s = bytes of K and V that "
                   "must be read (valid keys only) / median time.")

# The issues' targets: (kind, minimum cuflash / torch-flash ratio) per sequence-length range.
TARGETS = {"fwd": ((1024, 1.0), (0, 0.9)), "bwd": ((1024, 1.0),)}
DECODE_COPY_FRACTION = 0.95          # of the measured copy bandwidth
UNEVEN_TOLERANCE = 1.10              # uneven time / full time <= 1.1 x valid-key fraction


@dataclass(frozen=True)
class Case:
    kind: str                        # "fwd", "bwd" or "decode"
    dtype: str                       # "bf16" or "fp16"
    b: int
    hq: int
    hkv: int
    nq: int
    nk: int
    d: int
    causal: bool
    kv_lens: Optional[tuple] = None  # per batch entry, decode's uneven row only

    @property
    def group(self):
        """The plot (and table) a case belongs to: everything but the sequence length."""
        if self.kind == "decode":
            return "decode"
        return f"{self.kind}_{self.dtype}_d{self.d}_{'causal' if self.causal else 'full'}"

    @property
    def label(self):
        if self.kind == "decode":
            lens = "uneven" if self.kv_lens else f"L={self.nk}"
            return f"decode {self.dtype} B={self.b} {lens}"
        return f"{self.group} N={self.nq}"


def prefill_cases(kinds, dtypes, head_dims, seqlens):
    return [Case(kind, dtype, TOTAL_TOKENS // n, HIDDEN // d, HIDDEN // d, n, n, d, causal)
            for kind in kinds for dtype in dtypes for d in head_dims for causal in (False, True)
            for n in seqlens]


def decode_cases(shapes, uneven=True, seed=0):
    cases = [Case("decode", DECODE_DTYPE, b, DECODE_HQ, DECODE_HKV, 1, length, DECODE_D, False)
             for b, length in shapes]
    if uneven:
        b, length = DECODE_UNEVEN
        lens = np.random.default_rng(seed).integers(1, length + 1, size=b)
        cases.append(Case("decode", DECODE_DTYPE, b, DECODE_HQ, DECODE_HKV, 1, length, DECODE_D,
                          False, tuple(int(x) for x in lens)))
    return cases


def build_cases(args):
    kinds = [c for c in args.cases if c in PREFILL_KINDS]
    cases = prefill_cases(kinds, args.dtypes, args.heads_dims, args.seqlens) if kinds else []
    if "decode" in args.cases:
        cases += decode_cases(QUICK_DECODE_SHAPES if args.quick else DECODE_SHAPES, seed=args.seed)
    return cases


def impls_for(case, selected):
    table = DECODE_IMPLS if case.kind == "decode" else PREFILL_IMPLS
    return [name for name in table if name in selected]


def naive_bytes(case):
    return case.b * case.hq * case.nq * case.nk * NAIVE_BYTES_PER_SCORE[case.kind]


def skip_reason(case, impl, torch_reason=None):
    """Why (case, impl) is not measured, or None. torch_reason: why torch is unavailable."""
    if impl == "naive":
        if case.nq >= NAIVE_MAX_N:
            return f"skipped: N >= {NAIVE_MAX_N} (~{naive_bytes(case) / 2**30:.0f} GiB, slow)"
        if naive_bytes(case) > NAIVE_MAX_BYTES:
            return f"skipped: N x N buffers ~{naive_bytes(case) / 2**30:.0f} GiB > 40 GiB"
    if impl in TORCH_BACKENDS and torch_reason:
        return f"skipped: {torch_reason}"
    return None


# ---------------------------------------------------------------------------------------------
# FLOPs and bytes
# ---------------------------------------------------------------------------------------------

def _capped_triangle(a, cap):
    """sum_{t=1..a} min(t, cap), and 0 for a <= 0."""
    if a <= 0:
        return 0
    if a <= cap:
        return a * (a + 1) // 2
    return cap * (cap + 1) // 2 + (a - cap) * cap


def visible_pairs(nq, nk, causal, align="bottom-right"):
    """Visible (query, key) pairs of one head: row i sees min(max(i + off + 1, 0), nk) keys,
    off = nk - nq (bottom-right) or 0 (top-left); every key when not causal."""
    if not causal:
        return nq * nk
    off = nk - nq if align == "bottom-right" else 0
    return _capped_triangle(off + nq, nk) - _capped_triangle(off, nk)


def case_pairs(case):
    """Visible pairs summed over the batch (per head)."""
    lens = case.kv_lens or (case.nk,) * case.b
    return sum(visible_pairs(case.nq, n, case.causal) for n in lens)


def case_flops(case):
    fwd = 4 * case.hq * case.d * case_pairs(case)       # D = (Dk + Dv) / 2 = d here
    return fwd * 5 // 2 if case.kind == "bwd" else fwd


def kv_bytes(case):
    """Bytes of K and V that must be read: valid keys only."""
    lens = case.kv_lens or (case.nk,) * case.b
    return 2 * case.hkv * case.d * ITEMSIZE[case.dtype] * sum(lens)


# ---------------------------------------------------------------------------------------------
# Environment: CuPy, cuflash, torch, metadata
# ---------------------------------------------------------------------------------------------

def load_cupy():
    try:
        import cupy
    except ImportError as e:
        raise SystemExit(f"bench.py needs CuPy and a CUDA GPU; `import cupy` failed: {e}. "
                         "Use --dry-run or --self-test on a machine without a GPU.")
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # CUDARuntimeError: no driver, no device
        raise SystemExit(f"bench.py needs a CUDA GPU; CuPy found none: {e}")
    if count == 0:
        raise SystemExit("bench.py needs a CUDA GPU; CuPy found none (device count 0)")
    return cupy


def load_cuflash():
    try:
        import cuflash
    except ImportError:
        sys.path.insert(0, REPO_ROOT)
        import cuflash
    return cuflash


def load_torch(device_id):
    """(torch, None), or (None, why not)."""
    try:
        import torch
    except ImportError as e:
        return None, f"torch not importable ({type(e).__name__})"
    if not torch.cuda.is_available():
        return None, "torch.cuda.is_available() is False"
    torch.cuda.set_device(device_id)
    return torch, None


def git_commit():
    """(commit, dirty) of the checkout; CUFLASH_COMMIT overrides it where the tree was copied
    without its own .git (the device machine), as (that commit, None)."""
    if os.environ.get("CUFLASH_COMMIT"):
        return os.environ["CUFLASH_COMMIT"], None
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                                text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=REPO_ROOT, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None, None
    if commit.returncode != 0:
        return None, None
    return commit.stdout.strip(), bool(dirty.stdout.strip())


def collect_meta(cp, cf, torch, args, bf16_dlpack):
    dev = cp.cuda.Device()
    props = cp.cuda.runtime.getDeviceProperties(dev.id)
    commit, dirty = git_commit()
    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "git_commit": commit, "git_dirty": dirty,
        "gpu": props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"]),
        "compute_capability": dev.compute_capability,
        "sm_count": props.get("multiProcessorCount"),
        "l2_bytes": props.get("l2CacheSize"),
        "memory_bytes": props.get("totalGlobalMem"),
        "python": platform.python_version(), "numpy": np.__version__,
        "cupy": cp.__version__, "cuda_runtime": cp.cuda.runtime.runtimeGetVersion(),
        "cuda_driver": cp.cuda.runtime.driverGetVersion(),
        "cuflash": getattr(cf, "__version__", None),
        "torch": torch.__version__ if torch else None,
        "torch_cuda": torch.version.cuda if torch else None,
        "cudnn": torch.backends.cudnn.version() if torch else None,
        "bf16_dlpack": bf16_dlpack,
        "flop_convention": FLOP_CONVENTION,
        "args": {k: v for k, v in vars(args).items()},
    }
    return meta


# ---------------------------------------------------------------------------------------------
# Inputs and CuPy <-> torch sharing
# ---------------------------------------------------------------------------------------------

def np_dtype(name):
    if name == "bf16":
        import ml_dtypes
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(np.float16)


def to_dtype(cp, x32, dtype):
    """float32 CuPy array -> dtype; bfloat16 by round-to-nearest-even on the bits if astype fails."""
    try:
        return x32.astype(dtype)
    except Exception:
        if dtype.name != "bfloat16":
            raise
        bits = x32.view(cp.uint32)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        return rounded.astype(cp.uint16).view(dtype)


def make_inputs(cp, case, seed):
    """q (B, Hq, Nq, D), k and v (B, Hkv, Nk, D), and dout like q for the backward; N(0, 1)."""
    rng = cp.random.RandomState(seed)
    dtype = np_dtype(case.dtype)

    def draw(*shape):
        return to_dtype(cp, rng.standard_normal(shape, dtype=cp.float32), dtype)

    inputs = {"q": draw(case.b, case.hq, case.nq, case.d),
              "k": draw(case.b, case.hkv, case.nk, case.d),
              "v": draw(case.b, case.hkv, case.nk, case.d)}
    if case.kind == "bwd":
        inputs["dout"] = draw(case.b, case.hq, case.nq, case.d)
    return inputs


def make_to_torch(cp, torch):
    """A CuPy -> torch zero-copy converter, and how it shares bfloat16 ("direct" or "int16 view")."""
    bf16 = np_dtype("bf16")
    probe = to_dtype(cp, cp.arange(8, dtype=cp.float32), bf16)
    try:
        t = torch.from_dlpack(probe)
        direct = t.dtype == torch.bfloat16 and t.float().cpu().tolist() == list(range(8))
    except Exception:
        direct = False

    def to_torch(x):
        if x.dtype == bf16 and not direct:
            return torch.from_dlpack(x.view(cp.int16)).view(torch.bfloat16)
        return torch.from_dlpack(x)

    return to_torch, "direct" if direct else "int16 view"


# ---------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------

SPIN_SOURCE = r"""
extern "C" __global__ void bench_spin(unsigned long long ns) {
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); } while (t - t0 < ns);
}
"""


class Timer:
    """Median time of a callable with CUDA events on one stream, L2 flushed before each run."""

    def __init__(self, cp, stream, target_s, spin_us, l2_bytes):
        self.cp, self.stream, self.target_s = cp, stream, target_s
        self.flush_buffer = cp.empty(2 * l2_bytes // 4, dtype=cp.int32)
        self.spin_kernel = cp.RawKernel(SPIN_SOURCE, "bench_spin")
        self.spin_ns = np.uint64(int(spin_us * 1000))
        self.spin_us = spin_us

    def _prepare_run(self):
        # the spin keeps the GPU busy while the host enqueues the flush and the timed call, so
        # host-side overhead shorter than the spin stays out of the measurement
        self.spin_kernel((1,), (1,), (self.spin_ns,))
        self.flush_buffer.fill(0)

    def _runs(self, fn, n):
        cp = self.cp
        events = [(cp.cuda.Event(), cp.cuda.Event()) for _ in range(n)]
        host = []
        for start, end in events:
            self._prepare_run()
            start.record(self.stream)
            t0 = time.perf_counter()
            fn()
            host.append(time.perf_counter() - t0)
            end.record(self.stream)
        self.stream.synchronize()
        return [cp.cuda.get_elapsed_time(s, e) for s, e in events], host

    def measure(self, fn):
        fn()                                   # untimed: compilation, planning, handles
        self.stream.synchronize()
        probe, _ = self._runs(fn, 1)
        if probe[0] * 1e-3 >= self.target_s:   # slow: three runs in all
            runs = 2
        else:
            warm, _ = self._runs(fn, 3)
            per_run = max(statistics.median(probe + warm), 1e-3) * 1e-3
            runs = int(min(1000, max(10, self.target_s / per_run)))
        times, host = self._runs(fn, runs)
        if runs == 2:
            times = probe + times
        host_us = statistics.median(host) * 1e6
        result = {
            "ms": statistics.median(times), "ms_min": min(times), "ms_mean": statistics.fmean(times),
            "ms_p20": float(np.percentile(times, 20)), "ms_p80": float(np.percentile(times, 80)),
            "runs": len(times), "host_us": host_us,
            "times_ms": [round(t, 5) for t in times],
        }
        if host_us > self.spin_us:
            result["host_bound_warning"] = (f"enqueueing took {host_us:.0f} us > spin "
                                            f"{self.spin_us:.0f} us: host time may be included")
        return result


def measure_copy_bandwidth(cp, timer):
    """Device-to-device copy bandwidth: (bytes read + bytes written) / median time, in TB/s."""
    src = cp.empty(COPY_BYTES // 4, dtype=cp.int32)
    src.fill(1)
    dst = cp.empty_like(src)
    timing = timer.measure(lambda: dst.data.copy_from_device_async(src.data, COPY_BYTES,
                                                                   timer.stream))
    tbps = 2 * COPY_BYTES / (timing["ms"] * 1e-3) / 1e12
    return {"bytes_each_way": COPY_BYTES, "tbps": tbps, **timing}


# ---------------------------------------------------------------------------------------------
# Peak device memory
# ---------------------------------------------------------------------------------------------

def cupy_peak_bytes(cp, stream, fn):
    """High-water mark of CuPy pool memory handed out during one call (its outputs included)."""

    class PeakHook(cp.cuda.MemoryHook):
        name = "cuflash_bench_peak"

        def __init__(self):
            self.current = self.peak = 0

        def malloc_postprocess(self, **kw):
            self.current += kw["mem_size"]
            self.peak = max(self.peak, self.current)

        def free_postprocess(self, **kw):
            self.current -= kw["mem_size"]

    hook = PeakHook()
    with hook:
        result = fn()
        stream.synchronize()
        del result
    return hook.peak


def torch_peak_bytes(torch, fn):
    """Peak torch-allocator memory above what was allocated before the call."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    result = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del result
    return peak


def free_pools(env):
    env.stream.synchronize()
    env.cp.get_default_memory_pool().free_all_blocks()
    if env.torch is not None:
        env.torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------
# Implementations: each returns Prepared(fn = exactly the timed work, context, notes)
# ---------------------------------------------------------------------------------------------

@dataclass
class Prepared:
    fn: object
    context: object                   # a factory of the context manager to time fn inside
    notes: dict
    memory: str                       # "cupy" or "torch": whose allocator to watch


def prepare_cuflash(env, case, x):
    cf = env.cf
    opts = {"causal": case.causal}
    if case.kv_lens:
        opts["kv_lens"] = [[n] for n in case.kv_lens]        # host ints, shape (B, 1)
    q, k, v = x["q"], x["k"], x["v"]
    if case.kind != "bwd":
        return Prepared(lambda: cf.attention(q, k, v, **opts), contextlib.nullcontext, {}, "cupy")
    out, lse = cf.attention(q, k, v, return_lse=True, **opts)
    dout = x["dout"]
    return Prepared(lambda: cf.attention_backward(dout, q, k, v, out, lse, **opts),
                    contextlib.nullcontext, {}, "cupy")


def prepare_torch(env, case, x, impl):
    torch = env.torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    sdpa = torch.nn.functional.scaled_dot_product_attention
    backend = getattr(SDPBackend, TORCH_BACKENDS[impl])

    def context():                    # sdpa_kernel's context manager is single-use
        return sdpa_kernel(backend)

    q, k, v = (env.to_torch(x[name]) for name in ("q", "k", "v"))
    # SDPA's is_causal is top-left; the prefill grid has Nq = Nk, where it equals bottom-right
    kw = {"is_causal": case.causal}
    notes = {}
    if case.kv_lens:
        valid = torch.arange(case.nk, device=q.device)[None, :] < torch.tensor(
            case.kv_lens, device=q.device)[:, None]
        kw["attn_mask"] = valid.view(case.b, 1, 1, case.nk)
        notes["kv_lens"] = "boolean attn_mask (B, 1, 1, L): work in proportion to B x L"
    if case.hq != case.hkv:
        k, v, notes["gqa"] = torch_gqa(sdpa, context, q, k, v, kw, case.hq // case.hkv)
        if "enable_gqa" in notes["gqa"]:
            kw["enable_gqa"] = True
    if case.kind != "bwd":
        def fn():
            return sdpa(q, k, v, **kw)
        return Prepared(fn, context, notes, "torch")
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    with context():
        out = sdpa(q, k, v, **kw)
    dout = env.to_torch(x["dout"])

    def fn():
        return torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
    return Prepared(fn, context, notes, "torch")


def torch_gqa(sdpa, context, q, k, v, kw, groups):
    """GQA for SDPA: enable_gqa=True if this backend takes it, else repeat_interleave (untimed)."""
    try:
        with context():
            sdpa(q, k, v, enable_gqa=True, **kw)
        return k, v, "enable_gqa=True"
    except Exception as e:
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
        return k, v, (f"repeat_interleave of k, v outside the timed region (enable_gqa failed: "
                      f"{type(e).__name__}); the kernel reads {groups}x the KV bytes counted")


def naive_matmul(cp, dtype):
    """cp.matmul in the input dtype, or through float32 when CuPy cannot multiply this dtype."""
    a = to_dtype(cp, cp.ones((2, 16, 16), dtype=cp.float32), dtype)
    try:
        cp.matmul(a, a)
        return cp.matmul, None
    except Exception as e:
        def matmul(x, y):
            return cp.matmul(x.astype(cp.float32), y.astype(cp.float32)).astype(dtype)
        return matmul, f"{dtype} matmul failed ({type(e).__name__}): GEMMs in float32"


def naive_probabilities(cp, mm, q, k, scale, causal_bias):
    """softmax(q kᵀ scale + bias) in float32, in place on one N x N buffer."""
    s = mm(q, k.swapaxes(-1, -2)).astype(cp.float32)
    s *= scale
    if causal_bias is not None:
        s += causal_bias
    s -= s.max(axis=-1, keepdims=True)
    cp.exp(s, out=s)
    s /= s.sum(axis=-1, keepdims=True)
    return s


def naive_forward(cp, mm, q, k, v, scale, causal_bias):
    p = naive_probabilities(cp, mm, q, k, scale, causal_bias)
    return mm(p.astype(q.dtype), v)


def naive_backward(cp, mm, dout, q, k, v, out, scale, causal_bias):
    p = naive_probabilities(cp, mm, q, k, scale, causal_bias)
    dv = mm(p.astype(q.dtype).swapaxes(-1, -2), dout)
    dp = mm(dout, v.swapaxes(-1, -2)).astype(cp.float32)
    dp -= (dout.astype(cp.float32) * out.astype(cp.float32)).sum(axis=-1, keepdims=True)
    dp *= p
    dp *= scale
    del p
    ds = dp.astype(q.dtype)
    del dp
    return mm(ds, k), mm(ds.swapaxes(-1, -2), q), dv


def causal_bias(cp, nq, nk):
    """(Nq, Nk) float32: 0 where visible (bottom-right), -inf elsewhere."""
    i = cp.arange(nq)[:, None]
    j = cp.arange(nk)[None, :]
    return cp.where(j <= i + (nk - nq), 0.0, -np.inf).astype(cp.float32)


def prepare_naive(env, case, x):
    cp = env.cp
    q, k, v = x["q"], x["k"], x["v"]
    mm, note = naive_matmul(cp, q.dtype)
    notes = {"matmul": note} if note else {}
    scale = 1.0 / math.sqrt(case.d)
    bias = causal_bias(cp, case.nq, case.nk) if case.causal else None
    if case.kind != "bwd":
        return Prepared(lambda: naive_forward(cp, mm, q, k, v, scale, bias),
                        contextlib.nullcontext, notes, "cupy")
    out = naive_forward(cp, mm, q, k, v, scale, bias)
    dout = x["dout"]
    return Prepared(lambda: naive_backward(cp, mm, dout, q, k, v, out, scale, bias),
                    contextlib.nullcontext, notes, "cupy")


def prepare(env, case, x, impl):
    if impl == "cuflash":
        return prepare_cuflash(env, case, x)
    if impl == "naive":
        return prepare_naive(env, case, x)
    return prepare_torch(env, case, x, impl)


# ---------------------------------------------------------------------------------------------
# Running
# ---------------------------------------------------------------------------------------------

@dataclass
class Env:
    cp: object
    cf: object
    torch: object
    torch_reason: Optional[str]
    to_torch: object
    stream: object
    timer: object


def base_row(case, impl):
    row = {k: v for k, v in asdict(case).items() if k != "kv_lens"}
    row.update(impl=impl, group=case.group, label=case.label, flops=case_flops(case),
               uneven=bool(case.kv_lens))
    if case.kind == "decode":
        row["kv_bytes"] = kv_bytes(case)
        row["valid_keys"] = sum(case.kv_lens or (case.nk,) * case.b)
    return row


def measure_one(env, case, impl, x):
    """Time one implementation on one case; every failure becomes an error string."""
    try:
        prepared = prepare(env, case, x, impl)
        with prepared.context():
            timing = env.timer.measure(prepared.fn)
            if prepared.memory == "cupy":
                peak = cupy_peak_bytes(env.cp, env.stream, prepared.fn)
            else:
                peak = torch_peak_bytes(env.torch, prepared.fn)
        seconds = timing["ms"] * 1e-3
        result = dict(timing, tflops=case_flops(case) / seconds / 1e12, peak_bytes=peak,
                      notes=prepared.notes)
        if case.kind == "decode":
            result["tbps"] = kv_bytes(case) / seconds / 1e12
        return result
    except Exception as e:
        return {"error": f"{type(e).__name__}: {str(e).strip()[:400]}"}
    finally:
        prepared = None
        free_pools(env)


def progress(total):
    try:
        from tqdm import tqdm
        # off a terminal (the device machine's captured output), redraw rarely
        return tqdm(total=total, unit="run", dynamic_ncols=True,
                    mininterval=0.1 if sys.stderr.isatty() else 10.0)
    except ImportError:
        return _PlainProgress(total)


class _PlainProgress:
    def __init__(self, total):
        self.total, self.n = total, 0

    def set_description(self, text, refresh=True):
        print(f"[{self.n + 1}/{self.total}] {text}", file=sys.stderr, flush=True)

    def update(self, n=1):
        self.n += n

    def close(self):
        pass


def run_cases(env, cases, impls, args, deadline, save):
    rows = []
    bar = progress(sum(len(impls_for(c, impls)) for c in cases))
    try:
        for case in cases:
            x = None
            for impl in impls_for(case, impls):
                bar.set_description(f"{case.label} {impl}", refresh=False)
                row = base_row(case, impl)
                reason = skip_reason(case, impl, env.torch_reason)
                if reason is None and time.monotonic() > deadline:
                    reason = "skipped: --max-seconds budget spent"
                if reason:
                    row["skipped"] = reason
                else:
                    try:
                        x = x if x is not None else make_inputs(env.cp, case, args.seed)
                        row.update(measure_one(env, case, impl, x))
                    except Exception as e:  # the inputs themselves did not fit
                        row["error"] = f"inputs: {type(e).__name__}: {str(e).strip()[:300]}"
                rows.append(row)
                save(rows)
                bar.update(1)
            del x
            free_pools(env)
    finally:
        bar.close()
    return rows


# ---------------------------------------------------------------------------------------------
# Reporting: ratios, targets, table, JSON, plots
# ---------------------------------------------------------------------------------------------

def add_ratios(rows):
    """On every peer row: cuflash / peer = peer time / cuflash time (> 1: cuflash is faster)."""
    cuflash_ms = {r["label"]: r["ms"] for r in rows if r["impl"] == "cuflash" and "ms" in r}
    for r in rows:
        if r["impl"] != "cuflash" and "ms" in r and r["label"] in cuflash_ms:
            r["cuflash_over_peer"] = r["ms"] / cuflash_ms[r["label"]]


def check_targets(rows, copy):
    """The issues' targets as (PASS / MISS / N/A, text) lines."""
    lines = []
    by = {(r["label"], r["impl"]): r for r in rows}
    for r in rows:
        if r["impl"] != "torch-flash" or r["kind"] not in TARGETS:
            continue
        need = next((t for n_min, t in TARGETS[r["kind"]] if r["nq"] >= n_min), None)
        ratio = r.get("cuflash_over_peer")
        if need is None:
            continue
        if ratio is None:
            lines.append(("N/A", f"{r['label']}: cuflash or torch-flash not measured"))
        else:
            lines.append(("PASS" if ratio >= need else "MISS",
                          f"{r['label']}: cuflash/torch-flash {ratio:.2f}x (need >= {need})"))
    for r in rows:
        if r["kind"] != "decode" or r["impl"] != "cuflash" or r["uneven"]:
            continue
        if "tbps" in r and copy:
            frac = r["tbps"] / copy["tbps"]
            lines.append(("PASS" if frac >= DECODE_COPY_FRACTION else "MISS",
                          f"{r['label']}: {r['tbps']:.2f} TB/s = {frac:.0%} of copy "
                          f"{copy['tbps']:.2f} TB/s (need >= {DECODE_COPY_FRACTION:.0%})"))
        cudnn = by.get((r["label"], "torch-cudnn"), {})
        if "cuflash_over_peer" in cudnn:
            ratio = cudnn["cuflash_over_peer"]
            lines.append(("PASS" if ratio >= 1.0 else "MISS",
                          f"{r['label']}: cuflash/torch-cudnn {ratio:.2f}x (need >= 1.0)"))
    uneven = uneven_summary(rows)
    if uneven:
        ok = uneven["time_fraction"] <= UNEVEN_TOLERANCE * uneven["valid_fraction"]
        lines.append(("PASS" if ok else "MISS",
                      f"uneven kv_lens: time {uneven['time_fraction']:.2f} of the full batch for "
                      f"{uneven['valid_fraction']:.2f} of its keys "
                      f"(need <= {UNEVEN_TOLERANCE:.2f} x the key fraction)"))
    return lines


def uneven_summary(rows):
    """cuflash on the uneven batch against the same (B, L) with every key valid."""
    uneven = next((r for r in rows if r["impl"] == "cuflash" and r.get("uneven") and "ms" in r),
                  None)
    if uneven is None:
        return None
    full = next((r for r in rows if r["impl"] == "cuflash" and r["kind"] == "decode"
                 and not r["uneven"] and r["b"] == uneven["b"] and r["nk"] == uneven["nk"]
                 and "ms" in r), None)
    if full is None:
        return None
    return {"valid_fraction": uneven["valid_keys"] / full["valid_keys"],
            "time_fraction": uneven["ms"] / full["ms"]}


def _fmt(value, spec):
    return "" if value is None else format(value, spec)


def format_table(rows, copy):
    header = (f"{'case':<28} {'N/L':>6} {'impl':<16} {'ms':>9} {'TFLOP/s':>8} {'TB/s':>6} "
              f"{'cuflash/':>8} {'peak':>9}  note")
    sub = f"{'':<28} {'':>6} {'':<16} {'':>9} {'':>8} {'':>6} {'peer':>8} {'MiB':>9}"
    lines = [FLOP_CONVENTION, "", header, sub]
    previous = None
    for r in rows:
        case = r["label"].rsplit(" N=", 1)[0] if r["kind"] != "decode" else \
            f"decode B={r['b']}" + (" uneven" if r["uneven"] else "")
        if previous is not None and r["group"] != previous:
            lines.append("")
        previous = r["group"]
        ratio = r.get("cuflash_over_peer")
        note = r.get("error") or r.get("skipped") or "; ".join(
            [str(v) for v in (r.get("notes") or {}).values()]
            + (["host-bound?"] if "host_bound_warning" in r else []))
        peak = r.get("peak_bytes")
        lines.append(
            f"{case:<28} {r['nk'] if r['kind'] == 'decode' else r['nq']:>6} {r['impl']:<16} "
            f"{_fmt(r.get('ms'), '9.4f'):>9} {_fmt(r.get('tflops'), '8.1f'):>8} "
            f"{_fmt(r.get('tbps'), '6.2f'):>6} "
            f"{(_fmt(ratio, '.2f') + 'x') if ratio else '':>8} "
            f"{_fmt(None if peak is None else peak / 2**20, '9.0f'):>9}  {note[:70]}")
    if copy:
        lines += ["", f"device-to-device copy: {copy['tbps']:.2f} TB/s (bytes read + written, "
                      f"{copy['bytes_each_way'] / 2**30:.0f} GiB each way, median of {copy['runs']})"]
    return "\n".join(lines)


def write_json(path, meta, rows, copy, targets=None, uneven=None, status="running"):
    data = {"meta": meta, "status": status, "copy_bandwidth": copy, "rows": rows,
            "targets": [{"result": a, "text": b} for a, b in targets or ()],
            "decode_uneven": uneven}
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, default=str)
    os.replace(tmp, path)


def write_plots(out_dir, rows, copy, meta):
    """One PNG per prefill case (TFLOP/s vs N, a line per implementation) and decode.png."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        print(f"no plots: matplotlib not importable ({e})", file=sys.stderr)
        return []
    paths = []
    for group in dict.fromkeys(r["group"] for r in rows if r["kind"] != "decode"):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for impl in dict.fromkeys(r["impl"] for r in rows):
            pts = [(r["nq"], r["tflops"]) for r in rows
                   if r["group"] == group and r["impl"] == impl and "tflops" in r]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=impl)
        ax.set_xscale("log", base=2)
        ns = sorted({r["nq"] for r in rows if r["group"] == group})
        ax.set_xticks(ns, [f"{n // 1024}k" if n >= 1024 else str(n) for n in ns])
        ax.set_xlabel("sequence length N (batch = 16384 // N)")
        ax.set_ylabel("TFLOP/s (FlashAttention convention)")
        ax.set_title(f"{group} — {meta.get('gpu', '')}", fontsize=10)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
        paths.append(_save(fig, plt, os.path.join(out_dir, f"{group}.png")))
    decode = [r for r in rows if r["kind"] == "decode"]
    if decode:
        labels = list(dict.fromkeys(r["label"] for r in decode))
        impls = list(dict.fromkeys(r["impl"] for r in decode))
        fig, ax = plt.subplots(figsize=(8, 4.5))
        width = 0.8 / len(impls)
        for i, impl in enumerate(impls):
            vals = [next((r.get("tbps", 0) for r in decode
                          if r["label"] == lab and r["impl"] == impl), 0) for lab in labels]
            ax.bar([j + i * width for j in range(len(labels))], vals, width, label=impl)
        if copy:
            ax.axhline(copy["tbps"], color="k", linestyle="--", label="d2d copy")
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(labels))])
        ax.set_xticklabels([lab.split(" ", 2)[2] for lab in labels], fontsize=8)
        ax.set_ylabel("KV bytes read / s (TB/s)")
        ax.set_title(f"decode, Hq={DECODE_HQ} Hkv={DECODE_HKV} D={DECODE_D} {DECODE_DTYPE}, Nq=1 "
                     f"— {meta.get('gpu', '')}", fontsize=10)
        ax.legend(fontsize=8)
        paths.append(_save(fig, plt, os.path.join(out_dir, "decode.png")))
    return paths


def _save(fig, plt, path):
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# ---------------------------------------------------------------------------------------------
# Dry run and self-test (no GPU needed)
# ---------------------------------------------------------------------------------------------

def print_plan(cases, impls):
    print(FLOP_CONVENTION)
    print()
    print(f"{'case':<36} {'B':>3} {'Hq':>3} {'Hkv':>3} {'Nq':>6} {'Nk':>6} {'D':>4} "
          f"{'GFLOP':>10} {'KV MiB':>8}  implementations")
    measurements = 0
    for case in cases:
        parts = []
        for impl in impls_for(case, impls):
            reason = skip_reason(case, impl)
            parts.append(f"{impl} ({reason})" if reason else impl)
            measurements += reason is None
        kv = f"{kv_bytes(case) / 2**20:8.0f}" if case.kind == "decode" else f"{'':>8}"
        print(f"{case.label:<36} {case.b:>3} {case.hq:>3} {case.hkv:>3} {case.nq:>6} {case.nk:>6} "
              f"{case.d:>4} {case_flops(case) / 1e9:>10.1f} {kv}  {', '.join(parts)}")
    print(f"\n{len(cases)} cases, up to {measurements} measurements (torch peers only if torch "
          f"is importable on the GPU machine)")


def self_test():
    """visible_pairs / case_flops against a brute-force NumPy count of the mask."""
    failures, passed = [], 0

    def brute(nq, nk, causal, align):
        if not causal:
            return nq * nk
        off = nk - nq if align == "bottom-right" else 0
        i = np.arange(nq)[:, None]
        j = np.arange(nk)[None, :]
        return int(np.count_nonzero(j <= i + off))

    sizes = list(range(0, 12)) + [31, 64, 97, 128, 513]
    checks = [(nq, nk, causal, align) for nq in sizes for nk in sizes
              for causal in (False, True) for align in ("bottom-right", "top-left")]
    checks += [(1, 131072, True, "bottom-right"), (4096, 4096, True, "bottom-right"),
               (1000, 3000, True, "bottom-right"), (3000, 1000, True, "bottom-right")]
    for nq, nk, causal, align in checks:
        got, want = visible_pairs(nq, nk, causal, align), brute(nq, nk, causal, align)
        if got == want:
            passed += 1
        else:
            failures.append(f"visible_pairs({nq}, {nk}, {causal}, {align}) = {got}, want {want}")

    def expect(name, got, want):
        nonlocal passed
        if got == want:
            passed += 1
        else:
            failures.append(f"{name}: got {got}, want {want}")

    n = 4096
    full = Case("fwd", "bf16", 4, 16, 16, n, n, 128, False)
    expect("fwd non-causal = 4 B H N^2 D", case_flops(full), 4 * 4 * 16 * n * n * 128)
    causal = Case("fwd", "bf16", 4, 16, 16, n, n, 128, True)
    expect("fwd causal = 4 B H D N(N+1)/2", case_flops(causal), 4 * 4 * 16 * 128 * n * (n + 1) // 2)
    expect("bwd = 2.5 x fwd", case_flops(Case("bwd", "bf16", 4, 16, 16, n, n, 128, True)),
           case_flops(causal) * 5 // 2)
    dec = Case("decode", "bf16", 2, 32, 8, 1, 100, 128, False, (10, 30))
    expect("decode FLOPs over valid keys", case_flops(dec), 4 * 32 * 128 * 40)
    expect("decode KV bytes over valid keys", kv_bytes(dec), 2 * 8 * 128 * 2 * 40)
    expect("decode KV bytes", kv_bytes(Case("decode", "bf16", 8, 32, 8, 1, 32768, 128, False)),
           2 * 8 * 8 * 32768 * 128 * 2)
    for f in failures:
        print("FAIL", f)
    print(f"{passed} passed, {len(failures)} failed")
    return not failures


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------

def _csv(kind, allowed=None):
    def parse(text):
        items = [kind(s.strip()) for s in text.split(",") if s.strip()]
        if allowed is not None:
            bad = [s for s in items if s not in allowed]
            if bad:
                raise argparse.ArgumentTypeError(f"unknown {bad}; choose from {','.join(allowed)}")
        return items
    return parse


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=FLOP_CONVENTION)
    p.add_argument("--quick", action="store_true",
                   help="small subset: N = 1k, 4k; bf16; D = 128; decode B=8 L=32k + uneven; "
                        "0.15 s per measurement")
    p.add_argument("--cases", type=_csv(str, ("fwd", "bwd", "decode")),
                   default=["fwd", "bwd", "decode"], help="comma list of fwd,bwd,decode")
    p.add_argument("--dtypes", type=_csv(str, DTYPES), default=None,
                   help="comma list of bf16,fp16 (prefill; decode is bf16)")
    p.add_argument("--heads-dims", type=_csv(int), default=None,
                   help="comma list of prefill head dims (default 64,128; heads = 2048 // D)")
    p.add_argument("--seqlens", type=_csv(int), default=None,
                   help="comma list of prefill N (default 512,...,16384)")
    p.add_argument("--impls", type=_csv(str, ALL_IMPLS), default=list(ALL_IMPLS),
                   help="comma list of " + ",".join(ALL_IMPLS))
    p.add_argument("--out", default=DEFAULT_OUT, help="output folder (default benchmarks/results)")
    p.add_argument("--max-seconds", type=float, default=None,
                   help="start no new measurement after this many seconds (the rest is recorded "
                        "as skipped); outputs are written either way")
    p.add_argument("--target-seconds", type=float, default=None,
                   help="time box of one measurement (default 0.4, 0.15 with --quick)")
    p.add_argument("--spin-us", type=float, default=200.0,
                   help="GPU spin before each timed run that hides host enqueue time (default 200)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dry-run", action="store_true", help="print the plan and FLOPs; no GPU")
    p.add_argument("--self-test", action="store_true",
                   help="check the FLOP counting against NumPy; no GPU")
    args = p.parse_args(argv)
    args.dtypes = args.dtypes or list(QUICK_DTYPES if args.quick else DTYPES)
    args.heads_dims = args.heads_dims or list(QUICK_HEAD_DIMS if args.quick else HEAD_DIMS)
    args.seqlens = args.seqlens or list(QUICK_SEQLENS if args.quick else SEQLENS)
    if args.target_seconds is None:
        args.target_seconds = 0.15 if args.quick else 0.4
    bad = [n for n in args.seqlens if n <= 0 or TOTAL_TOKENS % n]
    if bad:
        p.error(f"--seqlens must divide {TOTAL_TOKENS}, got {bad}")
    bad = [d for d in args.heads_dims if d <= 0 or HIDDEN % d]
    if bad:
        p.error(f"--heads-dims must divide {HIDDEN}, got {bad}")
    return args


def _terminate(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv=None):
    args = parse_args(argv)
    if args.self_test:
        return 0 if self_test() else 1
    cases = build_cases(args)
    if args.dry_run:
        print_plan(cases, args.impls)
        return 0

    start = time.monotonic()
    deadline = start + args.max_seconds if args.max_seconds else math.inf
    cp = load_cupy()
    cf = load_cuflash()
    torch, torch_reason = load_torch(cp.cuda.Device().id)
    os.makedirs(args.out, exist_ok=True)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    json_path = os.path.join(args.out, f"bench_{stamp}.json")
    signal.signal(signal.SIGTERM, _terminate)

    # one stream for CuPy and torch: events, kernels and DLPack hand-offs are all ordered on it
    stream = cp.cuda.Stream(non_blocking=False)
    rows, copy, status = [], None, "complete"
    with contextlib.ExitStack() as stack:
        stack.enter_context(stream)
        to_torch, bf16_dlpack = None, None
        if torch is not None:
            stack.enter_context(torch.cuda.stream(torch.cuda.ExternalStream(stream.ptr)))
            to_torch, bf16_dlpack = make_to_torch(cp, torch)
        meta = collect_meta(cp, cf, torch, args, bf16_dlpack)
        meta["torch_skipped"] = torch_reason
        l2 = meta["l2_bytes"] or DEFAULT_L2_BYTES
        timer = Timer(cp, stream, args.target_seconds, args.spin_us, l2)
        env = Env(cp, cf, torch, torch_reason, to_torch, stream, timer)
        print(f"{meta['gpu']}  cupy {meta['cupy']}  torch {meta['torch']}  "
              f"commit {meta['git_commit']}  -> {json_path}", file=sys.stderr)
        try:
            if any(c.kind == "decode" for c in cases):
                copy = measure_copy_bandwidth(cp, timer)
                free_pools(env)
            rows = run_cases(env, cases, args.impls, args, deadline,
                             lambda r: write_json(json_path, meta, r, copy))
        except KeyboardInterrupt as e:
            status = f"interrupted ({e})"
            print(f"\n{status}: writing what was measured", file=sys.stderr)
            rows = _read_rows(json_path)

    add_ratios(rows)
    targets = check_targets(rows, copy)
    uneven = uneven_summary(rows)
    meta["seconds"] = round(time.monotonic() - start, 1)
    write_json(json_path, meta, rows, copy, targets, uneven, status)
    table = format_table(rows, copy)
    with open(os.path.join(args.out, f"table_{stamp}.txt"), "w") as f:
        f.write(table + "\n")
    plots = write_plots(args.out, rows, copy, meta)
    print(table)
    print(f"\nwrote {json_path}, {len(plots)} plots under {args.out} ({status}, "
          f"{meta['seconds']:.0f} s)")
    if targets:
        count = {k: sum(r == k for r, _ in targets) for k in ("PASS", "MISS", "N/A")}
        print(f"\ntargets (issues 3, 4): {count['PASS']} pass, {count['MISS']} miss, "
              f"{count['N/A']} not checked (a peer or cuflash not measured)")
        for result, text in targets:
            if result == "MISS":
                print("  MISS", text)
    return 0 if status == "complete" else 2


def _read_rows(path):
    try:
        with open(path) as f:
            return json.load(f)["rows"]
    except (OSError, ValueError, KeyError):
        return []


if __name__ == "__main__":
    sys.exit(main())
