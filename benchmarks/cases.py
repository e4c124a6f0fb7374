"""The benchmark's case matrix: which shapes, dtypes and implementations run, and how FLOPs and
KV bytes are counted (no GPU, no CuPy, no torch needed)."""
from dataclasses import dataclass
from typing import Optional

import numpy as np

# Prefill (issue 3's grid): 16k tokens in all, heads x head dim = 2048, layout (B, H, N, D)
TOTAL_TOKENS = 16384                 # batch = TOTAL_TOKENS // N
HIDDEN = 2048                        # heads x head dim
SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)
HEAD_DIMS = (64, 128)
DTYPES = ("bf16", "fp16")
PREFILL_KINDS = ("fwd", "bwd")

# Decode (issue 4's grid): Nq = 1 against KV caches of (B, L), and one uneven batch
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
TORCH_IMPLS = ("torch-flash", "torch-cudnn", "torch-efficient")   # torch SDPA's backends

NAIVE_MAX_N = 8192                   # naive is skipped for N >= this (time; 28-56 GiB there)
NAIVE_MAX_BYTES = 40 * 2**30         # ... and whenever its N x N buffers would pass this
NAIVE_BYTES_PER_SCORE = {"fwd": 6, "bwd": 12}   # live bytes per score element at its peak

ITEMSIZE = {"bf16": 2, "fp16": 2}

FLOP_CONVENTION = ("FlashAttention convention: forward FLOPs = 4 * B * H * D * visible pairs, "
                   "D = (Dk + Dv) / 2, causal = exact count of visible (query, key) pairs "
                   "(bottom-right alignment; equals top-left when Nq = Nk), backward = 2.5 x "
                   "forward; TFLOP/s = FLOPs / median time. Decode TB/s = bytes of K and V that "
                   "must be read (valid keys only) / median time.")


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
    if impl in TORCH_IMPLS and torch_reason:
        return f"skipped: {torch_reason}"
    return None


# ---- FLOPs and bytes ------------------------------------------------------------------------

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
