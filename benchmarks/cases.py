"""The benchmark's case matrix: which shapes, dtypes, layouts, options and implementations run, and
how FLOPs and KV bytes are counted (no GPU, no CuPy, no torch needed)."""
import math
from dataclasses import dataclass, replace
from functools import reduce
from typing import Optional

import numpy as np

# Prefill (issue 3's grid): 16k tokens in all, heads x head dim = 2048
TOTAL_TOKENS = 16384                 # batch = TOTAL_TOKENS // N
HIDDEN = 2048                        # heads x head dim
SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)
HEAD_DIMS = (64, 128)
DTYPES = ("bf16", "fp16")
PREFILL_KINDS = ("fwd", "bwd")
LAYOUTS = ("bhnd", "bnhd")           # how q, k, v and dout are stored: (B, H, N, D) or (B, N, H, D)
CASE_SETS = ("fwd", "bwd", "det", "decode", "options", "wide", "wide-options", "small")

# Options: one shape (N = 4096, 16k tokens, bf16, D = 128 and hidden 2048 unless the case says),
# forward and backward, one case per feature
OPTION_N, OPTION_D, OPTION_DTYPE = 4096, 128, "bf16"
WINDOW = (1023, 0)                   # (left, right): the aligned key and the 1023 before it
PADDING_VALID = 0.62                 # padding: each sequence's first 62 % of keys are valid
BLOCK, BLOCK_VISIBLE, BLOCK_SEED = 128, 0.5, 0   # block-sparse: half the key blocks of each row

# Wider dtypes: D = 64 and 128, heads = 2048 // D, 16k tokens
WIDE_DTYPES = ("fp32", "fp64")
WIDE_SEQLENS = (1024, 4096)
WIDE_HEAD_DIMS = (64, 128)
# Options on the wide dtypes (issue 16: within 15 % of the plain case): N = 4096, D = 64, 16k
# tokens, fp32 and fp64, forward and backward; "plain" is the baseline of the ratio
WIDE_OPTION_D = 64

# Decode (issue 4's grid): Nq = 1 against KV caches of (B, L), and one uneven batch
DECODE_HQ, DECODE_HKV, DECODE_D, DECODE_DTYPE = 32, 8, 128, "bf16"
DECODE_SHAPES = ((1, 131072), (8, 32768), (32, 8192), (64, 4096))   # (B, L)
DECODE_UNEVEN = (32, 8192)           # (B, max L); kv_lens uniform in [1, L], seeded

# Small calls (issue 17): where the host's cost per call is the time; bf16, causal, fwd and bwd
# (B, H, N, D), plus decode B = 1 against a short cache; loop_us / host_us are the numbers to read
SMALL_SHAPES = ((1, 8, 128, 64), (4, 16, 512, 128))
SMALL_DECODE = ((1, 4096),)

QUICK_SEQLENS = (1024, 4096)
QUICK_DECODE_SHAPES = ((8, 32768),)
QUICK_DTYPES = ("bf16",)
QUICK_HEAD_DIMS = (128,)
QUICK_WIDE_DTYPES = ("fp32",)
QUICK_WIDE_SEQLENS = (1024,)

# Which implementations run on which cases (--impls selects among them)
DENSE_IMPLS = ("cuflash", "fa4", "torch-flash", "torch-cudnn", "torch-efficient", "naive")
OPTION_IMPLS = ("cuflash", "fa4", "torch-flash", "torch-cudnn", "torch-efficient", "flex")
# cuflash-tf32: cuflash with precision="high" (float32 only)
WIDE_IMPLS = ("cuflash", "cuflash-tf32", "torch-efficient", "torch-math", "naive")
# cuflash-det: cuflash's backward with deterministic=True, timed against cuflash only (issue 15:
# at most 15 % over the default backward; the peers are timed in the bwd set)
DET_IMPLS = ("cuflash", "cuflash-det")
DECODE_IMPLS = ("cuflash", "fa4", "torch-flash", "torch-cudnn")
TORCH_IMPLS = ("torch-flash", "torch-cudnn", "torch-efficient", "torch-math")  # SDPA's backends
ALL_IMPLS = ("cuflash", "cuflash-tf32", "cuflash-det", "fa4") + TORCH_IMPLS + ("flex", "naive")

NAIVE_MAX_N = 8192                   # naive is skipped for N >= this (time; 28-56 GiB there)
NAIVE_MAX_BYTES = 40 * 2**30         # ... and whenever its N x N buffers would pass this

ITEMSIZE = {"bf16": 2, "fp16": 2, "fp32": 4, "fp64": 8}

FLOP_CONVENTION = ("FlashAttention convention: forward FLOPs = 4 * B * H * D * visible pairs, "
                   "D = (Dk + Dv) / 2, visible pairs = exact count of visible (query, key) pairs "
                   "(causal and windows bottom-right aligned, which equals top-left when Nq = Nk; "
                   "boolean masks and kv_lens by their True entries), backward = 2.5 x forward; "
                   "TFLOP/s = FLOPs / median time. Decode TB/s = bytes of K and V that must be read "
                   "(valid keys only) / median time.")


@dataclass(frozen=True)
class Case:
    kind: str                        # "fwd", "bwd" or "decode"
    dtype: str                       # "bf16", "fp16", "fp32" or "fp64"
    b: int
    hq: int
    hkv: int
    nq: int
    nk: int
    d: int                           # head dim of q and k
    causal: bool
    kv_lens: Optional[tuple] = None  # per batch entry, decode's uneven row only
    layout: str = "bhnd"             # storage of q, k, v and dout: "bhnd" or "bnhd"
    dv: Optional[int] = None         # head dim of v where it differs from d
    window: Optional[tuple] = None   # (left, right) as cuflash's window= takes it
    mask: Optional[str] = None       # "padding" or "block-sparse": a boolean mask input
    bias: bool = False               # an additive float32 bias (1, Hq, Nq, Nk)
    softcap: Optional[float] = None  # logit softcapping, cap * tanh(x / cap)
    dropout: float = 0.0             # attention dropout's p (cuflash: a fixed seed)
    option: Optional[str] = None     # the name of an options case
    det: bool = False                # the det set's copy of a bwd grid case (DET_IMPLS time it)

    @property
    def d_v(self):
        return self.dv or self.d

    @property
    def group(self):
        """The plot (and table block) a case belongs to: everything but the sequence length."""
        if self.kind == "decode":
            return "decode"
        shape = self.option or f"d{self.d}_{'causal' if self.causal else 'full'}"
        # det cases get their own group and label: the bwd set may time the same shape in the
        # same run, and the ratios pair rows by label
        return f"{'det' if self.det else self.kind}_{self.dtype}_{shape}_{self.layout}"

    @property
    def label(self):
        if self.kind == "decode":
            lens = "uneven" if self.kv_lens else f"L={self.nk}"
            return f"decode {self.dtype} B={self.b} {lens}"
        return f"{self.group} N={self.nq}"


def prefill_cases(kinds, dtypes, head_dims, seqlens, layouts):
    return [Case(kind, dtype, TOTAL_TOKENS // n, HIDDEN // d, HIDDEN // d, n, n, d, causal,
                 layout=layout)
            for kind in kinds for dtype in dtypes for d in head_dims for causal in (False, True)
            for layout in layouts for n in seqlens]


def det_cases(dtypes, head_dims, seqlens, layouts):
    """The dense backward grid again, for cuflash against cuflash-det (the det set)."""
    return [replace(c, det=True) for c in prefill_cases(("bwd",), dtypes, head_dims, seqlens,
                                                        layouts)]


def option_cases(layouts):
    """One case per feature at N = 4096, forward and backward, in each layout."""
    n, h = OPTION_N, HIDDEN // OPTION_D
    specs = (  # name, and the fields that differ from Hq = Hkv = 16, D = 128, not causal
        ("gqa32-8_causal", dict(hq=32, hkv=8, causal=True)),
        # causal=False as FA4's window_size=(1023, 0) is called: right = 0 is causal already
        ("window1023-0", dict(window=WINDOW)),
        ("d96", dict(hq=HIDDEN // 96, hkv=HIDDEN // 96, d=96)),   # 21 heads: hidden 2016
        ("dk192-dv128_causal", dict(d=192, dv=128, causal=True)),  # MLA-style
        ("d256", dict(hq=8, hkv=8, d=256)),
        ("padding62", dict(mask="padding")),
        ("blocksparse50", dict(mask="block-sparse")),
        ("bias-fp32", dict(bias=True)),
        ("softcap30", dict(softcap=30.0)),
        ("softcap30_causal", dict(softcap=30.0, causal=True)),
        # issue 18: against the dense grid's D=128 N=4096 rows (the same call without dropout)
        ("dropout10", dict(dropout=0.1)),
        ("dropout10_causal", dict(dropout=0.1, causal=True)),
    )
    return [replace(Case(kind, OPTION_DTYPE, TOTAL_TOKENS // n, h, h, n, n, OPTION_D, False,
                         layout=layout, option=name), **spec)
            for kind in PREFILL_KINDS for name, spec in specs for layout in layouts]


def wide_option_cases(layouts):
    """The wide dtypes at N = 4096, D = 64: the plain case and one case per feature."""
    n, h = OPTION_N, HIDDEN // WIDE_OPTION_D
    specs = (("plain", {}), ("window1023-0", dict(window=WINDOW)),
             ("padding62", dict(mask="padding")), ("bias", dict(bias=True)),
             ("dk64-dv32", dict(dv=WIDE_OPTION_D // 2)))
    return [replace(Case(kind, dtype, TOTAL_TOKENS // n, h, h, n, n, WIDE_OPTION_D, False,
                         layout=layout, option=f"wide-{name}"), **spec)
            for kind in PREFILL_KINDS for dtype in WIDE_DTYPES for name, spec in specs
            for layout in layouts]


def small_cases():
    """The small calls of issue 17's host-cost table (option "small": a group of their own)."""
    cases = [Case(kind, "bf16", b, h, h, n, n, d, True, option=f"small_b{b}_h{h}_d{d}")
             for kind in PREFILL_KINDS for b, h, n, d in SMALL_SHAPES]
    return cases + decode_cases(SMALL_DECODE, uneven=False)


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
    cases = prefill_cases(kinds, args.dtypes, args.heads_dims, args.seqlens, args.layouts)
    if "det" in args.cases:
        cases += det_cases(args.dtypes, args.heads_dims, args.seqlens, args.layouts)
    if "options" in args.cases:
        cases += [c for c in option_cases(args.layouts)
                  if getattr(args, "options", None) is None or c.option in args.options]
    if "wide" in args.cases:
        cases += prefill_cases(PREFILL_KINDS, QUICK_WIDE_DTYPES if args.quick else WIDE_DTYPES,
                               WIDE_HEAD_DIMS[-1:] if args.quick else WIDE_HEAD_DIMS,
                               QUICK_WIDE_SEQLENS if args.quick else WIDE_SEQLENS,
                               args.layouts)
    if "wide-options" in args.cases:
        cases += wide_option_cases(args.layouts)
    if "decode" in args.cases:
        cases += decode_cases(QUICK_DECODE_SHAPES if args.quick else DECODE_SHAPES, seed=args.seed)
    if "small" in args.cases:
        cases += small_cases()
    return cases


def impls_for(case, selected):
    if case.kind == "decode":
        table = DECODE_IMPLS
    elif case.det:
        table = DET_IMPLS
    elif case.option and case.dtype in WIDE_DTYPES:
        # naive CuPy attention takes no options; cuflash-tf32 is float32's
        table = tuple(n for n in WIDE_IMPLS
                      if n != "naive" and (n != "cuflash-tf32" or case.dtype == "fp32"))
    elif case.option:
        # FlexAttention only where there is a boolean mask to make a block mask of, or a
        # softcap (its score_mod)
        table = OPTION_IMPLS if case.mask or case.softcap else \
            tuple(n for n in OPTION_IMPLS if n != "flex")
    elif case.dtype in WIDE_DTYPES:
        table = tuple(n for n in WIDE_IMPLS if n != "cuflash-tf32" or case.dtype == "fp32")
    else:
        table = DENSE_IMPLS
    return [name for name in table if name in selected]


def naive_bytes(case):
    """Live bytes of naive attention's N x N buffers at their peak: the scores in the accumulator
    dtype and the probabilities in the input dtype (forward); twice that (backward)."""
    per_score = (8 if case.dtype == "fp64" else 4) + ITEMSIZE[case.dtype]
    return case.b * case.hq * case.nq * case.nk * per_score * (2 if case.kind == "bwd" else 1)


def skip_reason(case, impl, unavailable=None):
    """Why (case, impl) is not measured, or None. unavailable: {impl: why it is not importable}."""
    if impl == "naive":
        if case.nq >= NAIVE_MAX_N:
            return f"skipped: N >= {NAIVE_MAX_N} (~{naive_bytes(case) / 2**30:.0f} GiB, slow)"
        if naive_bytes(case) > NAIVE_MAX_BYTES:
            return f"skipped: N x N buffers ~{naive_bytes(case) / 2**30:.0f} GiB > 40 GiB"
    if impl == "fa4" and (case.mask or case.bias):
        return "skipped: fa4's flash_attn_func takes no mask or bias"
    if impl in ("fa4", "flex") and case.dropout:
        return f"skipped: {impl} takes no dropout"
    if impl == "fa4" and case.kv_lens:
        return "skipped: fa4's flash_attn_func takes no per-sequence kv lengths"
    if impl.startswith("torch-") and case.softcap:
        return "skipped: SDPA takes no softcap"
    if impl == "torch-flash" and needs_attn_mask(case):
        return "skipped: SDPA's flash backend takes no attn_mask"
    if impl == "torch-efficient" and case.dtype == "fp64":
        return "skipped: SDPA's efficient backend takes fp16, bf16 and fp32 only"
    if unavailable and impl in unavailable:
        return f"skipped: {unavailable[impl]}"
    return None


# ---- visible pairs, masks, FLOPs and bytes ----------------------------------------------------

def visible_pairs(nq, nk, causal, align="bottom-right", window=None):
    """Visible (query, key) pairs of one head: row i sits at the aligned position p = i + off
    (off = nk - nq bottom-right, 0 top-left) and sees the keys j in [0, nk) with
    p - left <= j <= p + right, window = (left, right) (None: unbounded), causal capping right
    at 0; every key without causal and window."""
    left, right = window or (None, None)
    if causal:
        right = 0 if right is None else min(right, 0)
    if left is None and right is None:
        return nq * nk
    p = np.arange(nq, dtype=np.int64) + (nk - nq if align == "bottom-right" else 0)
    lo = np.zeros_like(p) if left is None else np.maximum(p - left, 0)
    hi = np.full_like(p, nk - 1) if right is None else np.minimum(p + right, nk - 1)
    return int(np.maximum(hi - lo + 1, 0).sum())


def band(nq, nk, causal, window):
    """(Nq, Nk) bool: the pairs that causal and window leave visible, bottom-right aligned."""
    p = np.arange(nq)[:, None] + (nk - nq)
    j = np.arange(nk)[None, :]
    left, right = window or (None, None)
    if causal:
        right = 0 if right is None else min(right, 0)
    visible = np.ones((nq, nk), dtype=bool)
    if left is not None:
        visible &= j >= p - left
    if right is not None:
        visible &= j <= p + right
    return visible


def padding_lens(case):
    """Valid keys per sequence of a padding case: the first 62 % of each."""
    return (round(PADDING_VALID * case.nk),) * case.b


def block_pattern(case):
    """(Nq / 128, Nk / 128) bool: each query block row sees a seeded random half of the key blocks
    (so no row is empty and every row does the same work)."""
    rows, cols = case.nq // BLOCK, case.nk // BLOCK
    row = np.arange(cols) < round(BLOCK_VISIBLE * cols)
    return np.random.default_rng(BLOCK_SEED).permuted(np.tile(row, (rows, 1)), axis=1)


def mask_array(case):
    """The boolean mask input of a padding or block-sparse case: (B, 1, 1, Nk) with each
    sequence's valid prefix True, or (1, 1, Nq, Nk) expanded from block_pattern; else None."""
    if case.mask == "padding":
        lens = np.array(padding_lens(case))
        return (np.arange(case.nk)[None, :] < lens[:, None]).reshape(case.b, 1, 1, case.nk)
    if case.mask == "block-sparse":
        return block_pattern(case).repeat(BLOCK, axis=0).repeat(BLOCK, axis=1)[None, None]
    return None


def needs_attn_mask(case):
    """Whether the visible pairs need a mask argument (SDPA's attn_mask), not just is_causal."""
    return bool(case.kv_lens or case.window or case.mask or case.bias)


def visible_mask(case):
    """The visible (query, key) pairs as a bool array broadcastable to (B, H, Nq, Nk), for the
    cases with kv_lens, a window or a mask input; None for full and plain causal cases."""
    if not (case.kv_lens or case.window or case.mask):
        return None
    if case.kv_lens and (case.causal or case.window):
        raise ValueError("kv_lens with causal or window would align to kv_lens, not to Nk")
    parts = []
    if case.kv_lens:
        lens = np.array(case.kv_lens)
        parts.append((np.arange(case.nk)[None, :] < lens[:, None]).reshape(case.b, 1, 1, case.nk))
    if case.causal or case.window:
        parts.append(band(case.nq, case.nk, case.causal, case.window)[None, None])
    if case.mask:
        parts.append(mask_array(case))
    return reduce(np.logical_and, parts)


def case_pairs(case):
    """Visible pairs summed over the batch (per head)."""
    if case.kv_lens or case.mask:
        visible = visible_mask(case)     # each axis full or 1: every entry stands for as many
        full = (case.b, 1, case.nq, case.nk)
        return int(np.count_nonzero(visible)) * math.prod(full) // visible.size
    return case.b * visible_pairs(case.nq, case.nk, case.causal, window=case.window)


def case_flops(case):
    fwd = 2 * case.hq * (case.d + case.d_v) * case_pairs(case)   # 4 * H * (Dk + Dv) / 2
    return fwd * 5 // 2 if case.kind == "bwd" else fwd


def kv_bytes(case):
    """Bytes of K and V that must be read: valid keys only."""
    lens = case.kv_lens or (case.nk,) * case.b
    return case.hkv * (case.d + case.d_v) * ITEMSIZE[case.dtype] * sum(lens)


def self_test():
    """visible_pairs / case_flops / the masks against brute-force NumPy counts."""
    failures, passed = [], 0

    def expect(name, got, want):
        nonlocal passed
        if got == want:
            passed += 1
        else:
            failures.append(f"{name}: got {got}, want {want}")

    def brute(nq, nk, causal, align, window):
        off = nk - nq if align == "bottom-right" else 0
        i = np.arange(nq)[:, None] + off
        j = np.arange(nk)[None, :]
        visible = np.ones((nq, nk), dtype=bool)
        if causal:
            visible &= j <= i
        if window and window[0] is not None:
            visible &= j >= i - window[0]
        if window and window[1] is not None:
            visible &= j <= i + window[1]
        return int(np.count_nonzero(visible))

    sizes = list(range(0, 12)) + [31, 64, 97, 128, 513]
    windows = (None, (0, 0), (1, 0), (2, 3), (None, 1), (1, None), (0, None), (1023, 0))
    checks = [(nq, nk, causal, align, None) for nq in sizes for nk in sizes
              for causal in (False, True) for align in ("bottom-right", "top-left")]
    checks += [(nq, nk, causal, align, w) for nq in (0, 1, 5, 31, 97) for nk in (0, 1, 7, 64, 513)
               for causal in (False, True) for align in ("bottom-right", "top-left")
               for w in windows[1:]]
    checks += [(1, 131072, True, "bottom-right", None), (4096, 4096, True, "bottom-right", None),
               (1000, 3000, True, "bottom-right", None), (3000, 1000, True, "bottom-right", None),
               (4096, 4096, False, "bottom-right", WINDOW)]
    for nq, nk, causal, align, w in checks:
        expect(f"visible_pairs({nq}, {nk}, {causal}, {align}, {w})",
               visible_pairs(nq, nk, causal, align, w), brute(nq, nk, causal, align, w))
    for nq, nk, causal, w in ((5, 9, True, None), (9, 5, False, (2, 1)), (64, 64, False, (3, 0))):
        expect(f"band({nq}, {nk}, {causal}, {w})", int(band(nq, nk, causal, w).sum()),
               brute(nq, nk, causal, "bottom-right", w))

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

    options = {c.option: c for c in option_cases(("bhnd",)) if c.kind == "fwd"}
    b = TOTAL_TOKENS // OPTION_N
    mla = options["dk192-dv128_causal"]
    expect("MLA FLOPs use D = (Dk + Dv) / 2", case_flops(mla), 4 * b * 16 * 160 * n * (n + 1) // 2)
    win = options["window1023-0"]
    expect("window pairs = count of its mask", case_pairs(win),
           b * int(np.count_nonzero(visible_mask(win))))
    expect("window pairs = sum of min(i + 1, 1024)", case_pairs(win),
           b * sum(min(i + 1, 1024) for i in range(n)))
    pad = options["padding62"]
    expect("padding mask shape", mask_array(pad).shape, (b, 1, 1, n))
    expect("padding pairs = B Nq round(0.62 Nk)", case_pairs(pad), b * n * round(0.62 * n))
    sparse = options["blocksparse50"]
    pattern = block_pattern(sparse)
    expect("block pattern: half of each block row",
           set(pattern.sum(axis=1).tolist()), {n // BLOCK // 2})
    expect("block pattern seeded", bool((pattern == block_pattern(sparse)).all()), True)
    expect("block-sparse pairs = count of its mask x B", case_pairs(sparse),
           b * int(np.count_nonzero(mask_array(sparse))))
    expect("block-sparse pairs = half of all", case_pairs(sparse), b * n * n // 2)
    expect("bias: every pair visible", case_pairs(options["bias-fp32"]), b * n * n)
    expect("GQA FLOPs count query heads", case_flops(options["gqa32-8_causal"]),
           4 * b * 32 * 128 * n * (n + 1) // 2)
    dec_mask = visible_mask(dec)
    expect("decode uneven mask counts kv_lens", int(dec_mask.sum()), 40)
    det = det_cases(DTYPES, HEAD_DIMS, SEQLENS, LAYOUTS)
    expect("det cases: cuflash and cuflash-det only",
           {tuple(impls_for(c, ALL_IMPLS)) for c in det}, {DET_IMPLS})

    everything = (prefill_cases(PREFILL_KINDS, DTYPES, HEAD_DIMS, SEQLENS, LAYOUTS)
                  + det
                  + option_cases(LAYOUTS)
                  + prefill_cases(PREFILL_KINDS, WIDE_DTYPES, WIDE_HEAD_DIMS, WIDE_SEQLENS, LAYOUTS)
                  + wide_option_cases(LAYOUTS)
                  + decode_cases(DECODE_SHAPES))
    labels = [c.label for c in everything]
    expect("labels unique", len(set(labels)), len(labels))
    expect("every case has implementations", all(impls_for(c, ALL_IMPLS) for c in everything), True)
    for f in failures:
        print("FAIL", f)
    print(f"{passed} passed, {len(failures)} failed")
    return not failures
