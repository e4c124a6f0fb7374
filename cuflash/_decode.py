"""Split-KV decode path (kernels_cu/decode.cu): when it applies, how work is split, and launches.

The kernels read each kv head's keys once for all the query rows that share it (GQA packing) and
split the key axis across blocks; see the header of kernels_cu/decode.cu for the block layouts
(decode_tc: tensor cores, 16-bit, Dk = Dv in {64, 128}, no mask / bias; decode_split: the rest) and
the workspace format (normalized partial out, base-2 partial lse).

Host side, per call (all NumPy, then ONE int64 table on the device, cached by content through
cuflash._gpu._on_device):

1. Grouping (`group_heads`): the output (batch, head) matrices bh that read the same k matrix, the
   same v matrix and have the same valid length form a group (k_map, v_map, kv_lens equal). For
   the standard (B, H) GQA layout these are the runs of H // Hkv consecutive heads. Groups longer
   than MAX_GROUP are cut; shorter ones are padded with -1 to the common size G.
2. Row tiles: a group's G * Nq query rows (query-major) in tiles of ROWS (`rows_per_block`).
3. Key extent of each row tile (`tile_extents`): the keys any of its rows can see by position, the
   same closed form as kernels_cu/mask.cuh (DESIGN.md). It only decides which blocks exist: the
   kernel clips each block to its rows' ranges with mask.cuh itself.
4. Split size: one uniform split size S (keys) for the call. `split_size` ("waves"): the smallest
   multiple of the block's key pass, at least SPLIT_MIN_KEYS, such that the number of blocks
   sum(ceil(extent / S)) fits in WAVES waves of resident blocks (SM count x blocks per SM from the
   occupancy API); equal-size blocks that are all resident at once finish together. The automatic
   choice uses DEFAULT_RULE ("balanced-fine", `split_size_balanced`): among such candidates (and,
   for uneven extents, every multiple of 8 block passes) the S whose list schedule, longest item
   first, ends first, so that uneven kv_lens share the SMs instead of the longest sequence setting
   the time. kv_lens only changes the extents, so the invalid tail of
   a sequence gets no blocks at all. A tile with an empty extent still gets one (empty) block,
   which writes out = 0 and lse = -inf.

`supports(problem)` says when this path applies (see SUPPORT RULE below); `forward(problem)`
returns (out (BH, Nq, Dv) of T, lse (BH, Nq) of the accumulator dtype) like cuflash._gpu.forward,
launched on the current stream without synchronizing.
"""
import os
import sys
import threading

import numpy as np

from . import _broadcast, _config, _kernels
from ._validate import element_strides

SOURCE = "decode.cu"
WARPS = 4                 # kernels_cu/decode.cu DECODE_WARPS
THREADS = 32 * WARPS

# ---- the config table of this path -------------------------------------------------------------
# SUPPORT RULE: the split path applies to CuPy inputs with Nq <= MAX_NQ query rows per head whose
# largest key extent is >= MIN_KEYS (below that one block per (batch, head) is as good and the
# generic path is already tuned for it). Everything else (masks, bias, kv_lens, windows, causal
# with either alignment, GQA/MQA/broadcast, any strides, every dtype, Dk, Dv <= 256) is supported.
MAX_NQ = 16
MIN_KEYS = 512
MAX_ROWS = 8              # rows per block (template ROWS in {1, 2, 4, 8})
MAX_GROUP = 64            # query heads packed on one kv head at most
SPLIT_MIN_KEYS = 256      # a split never has fewer keys than this (tiny caches do not split)
WAVES = 1                 # blocks of one call <= WAVES x resident capacity (see split_size)
# Instantiations: 4 dtypes x 4 buckets x up to 4 ROWS x (mask/bias or not), aligned rows only
# (`fits`), compiled on first use (`instantiations` lists them for tests/test_build.py); the hot ones (aligned, no mask/bias, ROWS <= 8, 16-bit, D <= 128) are held to zero
# spills by `tools/decode_check.py build` (sm_80 and sm_90a, NVRTC ptxas report).
#
# CANDIDATES (not used unless asked for: Plan(variant=..., split_rule=...); timed by
# tools/decode_check.py timing).
# Measured 2026-11-29 (H200, KV TB/s for the four shapes; copy 4.22 TB/s): decode_split
# 2.73-2.75 / 3.22-3.28 / 3.31-3.32 / 3.23-3.26. Tried and removed: cp.async rings per warp
# (3-4 blocks/SM, 96-144 KB in flight per SM) 2.1 / 2.6 / 2.8 / 2.4; 2 keys per lane at 3
# blocks/SM 1.8-1.9; Hopper bulk-copy rings of 64-192 KB per block: 2.7 / 3.2-3.4 / 3.4 / 3.3 at
# 2-3 blocks/SM but 1.8-2.0 at 1 block/SM with 128-192 KB in flight. So bytes in flight are not
# the limit: the SIMT kernel is bound by its instruction issue (about 60 warp instructions per
# key at GQA 4: unpacking, 4 x 128 FMAs each way, the slot reductions, the softmax repeated on
# 16 lanes), and more warps per SM is what moved it. Hence decode_tc (tensor cores, below).
# TC_VARIANTS name -> (KW keys per warp per stage, STAGES of the cp.async ring, MINB blocks/SM,
# HINT the L2 prefetch-size hint of the copies: 0, 128 or 256 bytes).
# Measured 2026-11-29 (H200, bf16, the bench shapes (1, 131072) / (8, 32768) / (32, 8192) /
# (64, 4096), KV TB/s, tools/decode_check.py timing; copy 4.27, a read-only stream 4.45, cuDNN
# 4.14 / 4.37 / 4.43 / 4.39): decode_split 3.26 / 3.50 / 3.57 / 3.52 (fit over B = 32,
# L = 1k..16k: 3.74 TB/s + 13 us a call); tc16s2 3.45 / 3.90 / 4.01 / 3.87 (4.27 TB/s + 17 us);
# tc16s3 3.38 / 3.83 / 3.93 / 3.87; tc16s4 3.55 / 3.87 / 3.83 / 3.59; tc32s3 3.54 / 3.86 / 3.85 /
# 3.65; with the L2 prefetch hint: 256 B 3.34 / 3.79 / 3.88 / 3.75 (slower), 128 B ("tc16s2h1")
# 3.50 / 4.00 / 4.11 / 3.95 <- DEFAULT_TC. More waves only add per-block cost (about +20 us a
# wave at the same slope), so the split rules stay at one wave of resident blocks.
TC_VARIANTS = {
    "tc16s2": (16, 2, 2, 0),     # 64-key stages, 2 blocks/SM, 1 stage in flight each (74 KB)
    "tc16s3": (16, 3, 2, 0),     # 64-key stages, 2 blocks/SM (2 x 109 KB at D = 128)
    "tc16s4": (16, 4, 1, 0),     # 64-key stages, 1 block/SM, 3 stages in flight
    "tc32s3": (32, 3, 1, 0),     # 128-key stages, 1 block/SM
    "tc16s2h": (16, 2, 2, 256),  # tc16s2 with the 256-byte L2 prefetch hint
    "tc16s3h": (16, 3, 2, 256),
    "tc16s2h1": (16, 2, 2, 128),
    # 2026-11-29 (third session), tools/decode_check.py timing, KV TB/s for the four shapes and
    # the uneven batch (tc16s2h1 in the same run): more bytes in flight did not help:
    # tc16s3h1 3.41 / 3.91 / 4.03 / 3.96 / 3.57 (3.52 / 3.99 / 4.11 / 3.95 / 3.50), tc16s2m3h1
    # 3.32 / 3.89 / 3.84 / 3.60 / 3.19, tc16s4h1 3.57 / 3.91 / 3.87 / 3.61 / 3.01. An L2
    # evict-first policy on the copies (K/V are read once; HINT 129) won there on every shape, by
    # 0.7-1.8 %: tc16s2h1e 3.60 / 4.06 / 4.18 / 4.05 / 3.60 (3.55 / 4.03 / 4.15 / 4.00 / 3.54),
    # but lost 7-9 % in benchmarks/bench.py, which fills the L2 with dirty lines (its flush)
    # before each run: 3.26 / 3.63 / 3.67 / 3.59 / 3.27 against tc16s2h1's 3.50 / 3.97 / 4.02 /
    # 3.88 / 3.43 in the same process. decode_check's timing rotates two input sets without a
    # flush: it cannot judge cache policies. tc16s2h1 stays DEFAULT_TC.
    "tc16s3h1": (16, 3, 2, 128),    # 2 stages in flight per block, 2 blocks/SM (2 x 109 KB)
    "tc16s2m3h1": (16, 2, 3, 128),  # 3 blocks/SM (3 x 74 KB)
    "tc16s4h1": (16, 4, 1, 128),    # 1 block/SM, 3 stages in flight
    "tc16s2h1e": (16, 2, 2, 129),   # tc16s2h1 with an L2 evict-first policy
}
DEFAULT_TC = "tc16s2h1"    # decode_tc's tile where it fits (tc_fits), on sm_80+
DEFAULT_RULE = "balanced-fine"  # the split rule of the automatic choice (both kernels)
TC_HEAD_DIMS = (64, 128)   # Dk == Dv == HEAD_DIM (the bucket); others stay on decode_split
TC_MAX_KEYS = 1 << 30      # 32-bit key arithmetic in decode_tc
# Split rules (SPLIT_RULES, Plan(split_rule=...)): "waves" (default, WAVES x capacity, below),
# "balanced" (split_size_balanced: the S, among the 1..8-wave splits and block-pass x 2^i, whose
# greedy list schedule of blocks of S + SPLIT_OVERHEAD_KEYS key-costs on `capacity` slots, longest
# block first, ends first; tiles renumbered longest first and items launched longest first) and
# "balanced-o64" (64 keys per block, up to 16 waves). Measured with decode_split: "balanced" takes
# the uneven batch from 0.91-0.98 to 0.62-0.69 of the full batch's time, the full shapes unchanged.
# "balanced-fine" (<- DEFAULT_RULE, third session): for uneven extents the candidates also include
# every multiple of 8 block passes (at most ~32 of them); the uneven batch gets S = 4608 instead
# of 4096 (384 blocks instead of 424): bench.py 165.0 -> 158.9 us, 0.62 -> 0.59 of the full
# batch's time; equal extents keep their S (the four full shapes unchanged). With a per-block cost
# of 640 keys (the measured ~20 us a wave) it picks the same S. Host cost of the rule: ~4 ms for
# that batch, ~125 ms for 16 sequences of up to 1M keys ("balanced": 146 ms), once per layout.
# UNEVEN BATCH (bench.py's: B = 32, L = 8192, kv_lens uniform in [1, L] with seed 0, 52.7 % of
# the keys valid; 132 SMs x 2 blocks = 264 slots): with "waves" the full batch is 256 tiles -> 256
# blocks of 8192 keys, one wave; the uneven batch gets S = 7680 -> 264 blocks, mean 4187 keys but
# max 7680 = 0.94 of 8192: all blocks run at once and the longest sets the time.
# Target <= 1.1 x 0.527 = 0.58. `tools/decode_check.py host` prints the schedules.
SPLIT_OVERHEAD_KEYS = 256  # the "balanced" rule's fixed cost of one block, in keys


def _storage_size(dtype):
    return {"half_t": 2, "bf16_t": 2, "float": 4, "double": 8}[_config.c_types(dtype)[0]]


def shape_constants(dtype, bucket, rows):
    """Mirror of DecodeShape<T, HEAD_DIM, ROWS> in kernels_cu/decode.cu."""
    vec = 16 // _storage_size(dtype)
    row_vecs = bucket // vec
    lk = min(row_vecs, 32)
    nv = row_vecs // lk
    kpl = 32 // lk
    u = min(max(16 // rows, 1), max(4 // nv, 1))
    return dict(VEC=vec, LK=lk, NV=nv, COLS=nv * vec, KPL=kpl, U=u, NS=u * rows, WC=kpl * u,
                BLOCK_KEYS=kpl * u * WARPS)


def max_rows(dtype, bucket, has_mb=False):
    """Largest ROWS whose q (and acc) registers, ROWS x COLS 32-bit words each, fit the budget:
    64 words for 16-bit storage (COLS = 8: ROWS = 8, 244-250 registers), 32 otherwise (float32
    D = 256 at ROWS = 8 and double D = 128 at ROWS = 8 reach 255 registers and spill on sm_80)."""
    c = shape_constants(dtype, bucket, 1)
    words = 2 if _config.c_types(dtype)[1] == "double" else 1
    budget = 64 if _storage_size(dtype) == 2 else 32
    r = MAX_ROWS
    while r > 1 and r * c["COLS"] * words > budget:
        r //= 2
    # the mask/bias reads keep more addresses live: half the rows, a quarter for double (NVRTC
    # 13.0 spilled otherwise)
    return max(1, r // (2 * words)) if has_mb else r


def rows_per_block(dtype, bucket, group_rows, has_mb=False):
    """ROWS template value: the smallest power of two >= the group's rows, capped."""
    cap = max_rows(dtype, bucket, has_mb)
    r = 1
    while r < group_rows and r < cap:
        r *= 2
    return r


def name_expression(dtype, bucket, rows, has_mb, aligned):
    t, acc = _config.c_types(dtype)
    b = lambda x: "true" if x else "false"  # noqa: E731
    return f"decode_split<{t}, {acc}, {bucket}, {rows}, {b(has_mb)}, {b(aligned)}>"


def tc_expression(dtype, bucket, variant):
    """Name expression of a decode_tc kernel (TC_VARIANTS)."""
    kw, stages, minb, hint = TC_VARIANTS[variant]
    return f"decode_tc<{_config.c_types(dtype)[0]}, {bucket}, {kw}, {stages}, {minb}, {hint}>"


def tc_smem_bytes(bucket, variant):
    """decode_tc's dynamic shared memory: 16 Q rows and the K/V ring, padded rows of 16-bit
    values (at least the warps' merge buffer, 4 x 16 x bucket floats)."""
    kw, stages = TC_VARIANTS[variant][:2]
    row = (bucket + 8) * 2
    return max(16 * row + 2 * stages * WARPS * kw * row, WARPS * 16 * bucket * 4)


def tc_fits(p):
    """True when decode_tc can run this Problem (16-bit, Dk == Dv == 64 or 128, no mask / bias)."""
    return (p.dtype.name in ("float16", "bfloat16") and p.Dk == p.Dv and p.Dk in TC_HEAD_DIMS
            and p.mask is None and p.bias is None and p.Nk < TC_MAX_KEYS and fits(p))


def combine_expression(dtype, rows):
    t, acc = _config.c_types(dtype)
    return f"decode_combine<{t}, {acc}, {rows}>"


# ---- compilation (memoized per device, like _kernels.get_kernel) -------------------------------
_lock = threading.Lock()
_functions = {}   # (device, expr) -> (module, kernel, blocks per SM)
_counters = {}    # (device, stream ptr) -> cupy uint32 array, all zeros between launches


def _kernel(expr, dyn_smem=0):
    import cupy

    dev = cupy.cuda.Device().id
    key = (dev, expr)
    with _lock:
        hit = _functions.get(key)
    if hit is not None:
        return hit[1], hit[2]
    module = cupy.RawModule(code=_kernels.source(SOURCE), options=_kernels.OPTIONS,
                            name_expressions=[expr])
    func = module.get_function(expr)
    if dyn_smem:  # decode_tc: opt in above 48 KB
        func.max_dynamic_shared_size_bytes = int(dyn_smem)
    per_sm = _blocks_per_sm(func, dyn_smem)
    if os.environ.get("CUFLASH_DEBUG", "") not in ("", "0"):
        a = func.attributes
        print(f"cuflash: {expr} on device {dev}: {a['num_regs']} registers, "
              f"{a['shared_size_bytes']} B static shared, {a['local_size_bytes']} B local, "
              f"{per_sm} blocks/SM", file=sys.stderr)
    with _lock:
        _functions.setdefault(key, (module, func, per_sm))
        return _functions[key][1], _functions[key][2]


def _blocks_per_sm(func, dyn_smem=0):
    """Resident blocks per SM of THREADS-thread blocks (occupancy API; estimate as fallback)."""
    try:
        from cupy_backends.cuda.api import driver
        n = driver.occupancyMaxActiveBlocksPerMultiprocessor(func.kernel.ptr, THREADS, dyn_smem)
        if n > 0:
            return int(n)
    except Exception:
        pass
    a = func.attributes
    regs = max(int(a["num_regs"]), 1)
    by_regs = 65536 // (((regs * 32 + 255) // 256) * 256 * WARPS)
    by_smem = (227 * 1024) // max(int(a["shared_size_bytes"]) + dyn_smem + 1024, 1)
    return max(1, min(by_regs, by_smem, 2048 // THREADS, 32))


def _counter_buffer(n):
    """Per (device, stream) zeroed counters; decode_split resets every counter it uses to 0."""
    import cupy

    key = (cupy.cuda.Device().id, cupy.cuda.get_current_stream().ptr)
    with _lock:
        buf = _counters.get(key)
        if buf is None or buf.size < n:
            buf = cupy.zeros(max(n, 1024), dtype=np.uint32)
            _counters[key] = buf
        return buf


# ---- host scheduling (pure NumPy; tested without a GPU) ----------------------------------------

def group_heads(k_map, v_map, lens, max_group=MAX_GROUP):
    """(groups (n_groups, G) int64 of bh, -1 padded; G). Members of a group share k, v and length.

    Fast path: consecutive runs of equal keys of one common length (the standard GQA layout).
    """
    k_map, v_map, lens = (np.asarray(x, dtype=np.int64).reshape(-1) for x in (k_map, v_map, lens))
    BH = k_map.size
    keys = np.stack([k_map, v_map, lens], axis=1)
    change = np.ones(BH, dtype=bool)
    change[1:] = np.any(keys[1:] != keys[:-1], axis=1)
    starts = np.flatnonzero(change)
    runs = np.diff(np.append(starts, BH))
    if runs.size and np.all(runs == runs[0]) and runs[0] <= max_group:
        # every run is a whole group iff no two runs have equal keys
        if np.unique(keys[starts], axis=0).shape[0] == starts.size:
            G = int(runs[0])
            return np.arange(BH, dtype=np.int64).reshape(-1, G), G
    _, inverse, counts = np.unique(keys, axis=0, return_inverse=True, return_counts=True)
    inverse = inverse.reshape(-1)
    order = np.argsort(inverse, kind="stable")
    G = int(min(counts.max(), max_group))
    rows = []
    pos = 0
    for c in counts:
        members = order[pos:pos + c]
        pos += c
        for s in range(0, c, G):
            chunk = members[s:s + G]
            rows.append(np.concatenate([chunk, np.full(G - chunk.size, -1, dtype=np.int64)]))
    return np.array(rows, dtype=np.int64).reshape(-1, G), G


def tile_extents(group_lens, G, Nq, rows, left, right, bottom_right):
    """Per row tile: (group, tile, lo, hi) with [lo, hi] the keys its rows can see by position.

    Row rho = i * G + gi of a group; tile t holds rho in [t * rows, (t + 1) * rows). Mirrors
    key_range in kernels_cu/mask.cuh: p = i + (L - Nq if bottom_right else 0),
    lo = max(p - left, 0), hi = min(p + right, L - 1); lo, hi non-decreasing in i.
    """
    group_lens = np.asarray(group_lens, dtype=np.int64)
    n_tiles = -(-(G * Nq) // rows)
    t = np.arange(n_tiles, dtype=np.int64)
    i_first = (t * rows) // G
    i_last = (np.minimum((t + 1) * rows, G * Nq) - 1) // G
    L = group_lens[:, None]
    shift = (L - Nq) if bottom_right else np.zeros_like(L)
    lo = np.maximum(i_first[None, :] + shift - left, 0)
    hi = np.minimum(i_last[None, :] + shift + right, L - 1)
    g = np.repeat(np.arange(group_lens.size, dtype=np.int64), n_tiles)
    tt = np.tile(t, group_lens.size)
    return g, tt, lo.reshape(-1), hi.reshape(-1)


def split_size(extents, capacity, block_keys, min_keys=SPLIT_MIN_KEYS):
    """The one split rule: smallest S (multiple of block_keys, >= min_keys) with
    sum(ceil(extent / S)) <= capacity; the largest extent if even one block per tile exceeds it."""
    ext = np.asarray(extents, dtype=np.int64)
    ext = ext[ext > 0]
    if ext.size == 0:
        return max(min_keys, block_keys)
    unit = block_keys
    lo = -(-max(min_keys, 1) // unit)           # S in units of block_keys
    hi = max(lo, -(-int(ext.max()) // unit))
    count = lambda s: int(np.sum(-(-ext // (s * unit))))  # noqa: E731
    if count(hi) > capacity:
        return hi * unit
    while lo < hi:
        mid = (lo + hi) // 2
        if count(mid) <= capacity:
            hi = mid
        else:
            lo = mid + 1
    return lo * unit


def list_schedule_end(costs, capacity):
    """End time of greedy list scheduling of `costs` (in launch order) on `capacity` slots: each
    block starts on the first slot to free up (the hardware's block dispatch, idealized)."""
    import heapq

    costs = np.asarray(costs, dtype=np.int64)
    if costs.size <= capacity:
        return int(costs.max(initial=0))
    slots = [int(c) for c in costs[:capacity]]
    heapq.heapify(slots)
    for c in costs[capacity:].tolist():
        heapq.heapreplace(slots, slots[0] + c)
    return max(slots)


def launch_order(items):
    """Item-level longest-first launch order (rows of `items`, stable); the kernels read each
    item's workspace slot from the table's 4th column."""
    items = np.asarray(items, dtype=np.int64)
    return np.argsort(-(items[:, 2] - items[:, 1]), kind="stable")


def lpt_order(extents):
    """Tile launch order of the "balanced" rules: longest extent first (stable), so that the
    blocks of the short tiles fill the end of the schedule (longest-processing-time first)."""
    return np.argsort(-np.asarray(extents, dtype=np.int64), kind="stable")


def split_size_balanced(extents, capacity, block_keys, min_keys=SPLIT_MIN_KEYS,
                        overhead_keys=SPLIT_OVERHEAD_KEYS, waves=(1, 2, 3, 4, 6, 8), fine=False):
    """Split rules "balanced" and, with `fine`, "balanced-fine" (DEFAULT_RULE): among the waves
    rule's S for each w in `waves`, the one whose list schedule (blocks of ceil-split keys +
    overhead_keys each, longest first as launch_order launches them, on `capacity` slots) ends
    first; ties go to the larger S (fewer partials). Equal extents that fit one wave keep the
    one-wave S; uneven extents get smaller splits, so that short and long sequences share the SMs
    instead of the longest block setting the time. `fine`: uneven extents also try every multiple
    of 8 block passes below the longest extent (of a coarser step past 32 of them: the host cost
    stays ~32 list schedules)."""
    ext = np.asarray(extents, dtype=np.int64)
    best = None
    cands = {split_size(ext, int(w * capacity), block_keys, min_keys) for w in waves}
    top = int(ext.max(initial=0))
    S = max(min_keys, block_keys)
    while S < top:  # and powers of two times the block pass
        cands.add(S)
        S *= 2
    if fine and ext.size and ext.min() < top:  # uneven extents: also every 8 block passes
        step = max(8 * block_keys, -(-top // (32 * block_keys)) * block_keys)
        cands.update(range(max(min_keys, step), top, step))
    for S in sorted(cands):
        e = ext[ext > 0]
        n = -(-e // S)
        # per tile: n - 1 blocks of S keys and one of the remainder
        costs = np.repeat(np.full(e.size, S, dtype=np.int64), n)
        last = np.cumsum(n) - 1
        costs[last] = e - (n - 1) * S
        costs = np.sort(costs)[::-1]  # launch_order
        end = list_schedule_end(costs + overhead_keys, capacity) if costs.size else 0
        if best is None or end < best[0] or (end == best[0] and S > best[1]):
            best = (end, S)
    return best[1]


# name -> split function (extents, capacity, block_keys) -> S; every rule but "waves" also numbers
# the tiles in lpt_order and launches the items in launch_order
SPLIT_RULES = {
    "waves": split_size,               # today's rule
    "balanced": split_size_balanced,   # SPLIT_OVERHEAD_KEYS per block
    "balanced-o64": lambda e, c, b: split_size_balanced(e, c, b, overhead_keys=64,
                                                        waves=(1, 2, 3, 4, 6, 8, 12, 16)),
    "balanced-fine": lambda e, c, b: split_size_balanced(e, c, b, fine=True),  # DEFAULT_RULE
}


def make_items(lo, hi, S):
    """Cut each row tile's extent [lo, hi] into items of S keys.

    Returns (first, count, items): per tile its first item and item count; items (n, 3) =
    (tile id, k0, k1) with k1 exclusive, ordered by tile. Every tile has at least one item (an
    empty extent gets one item with k0 = k1 = 0, which writes out = 0 and lse = -inf)."""
    lo = np.asarray(lo, dtype=np.int64)
    hi = np.asarray(hi, dtype=np.int64)
    ext = np.maximum(hi - lo + 1, 0)
    count = np.maximum(-(-ext // S), 1)
    first = np.concatenate([[0], np.cumsum(count)[:-1]]).astype(np.int64)
    n = int(count.sum())
    tile_of = np.repeat(np.arange(lo.size, dtype=np.int64), count)
    split = np.arange(n, dtype=np.int64) - first[tile_of]
    k0 = lo[tile_of] + split * S
    k1 = np.minimum(k0 + S, hi[tile_of] + 1)
    empty = ext[tile_of] == 0
    k0 = np.where(empty, 0, k0)
    k1 = np.where(empty, 0, k1)
    return first, count, np.stack([tile_of, k0, k1], axis=1)


# ---- the Problem-facing API --------------------------------------------------------------------

def _lens(p):
    return (np.full(p.BH, p.Nk, dtype=np.int64) if p.kv_lens is None
            else np.asarray(p.kv_lens, dtype=np.int64).reshape(p.BH))


def _max_extent(p):
    L = int(_lens(p).max()) if p.BH else 0
    shift = L - p.Nq if p.bottom_right else 0
    lo = max(shift - p.left, 0)
    hi = min(p.Nq - 1 + shift + p.right, L - 1)
    return hi - lo + 1


def fits(p):
    """True when the split-KV kernels can run this Problem at all (tests force them this way)."""
    if p.xp is np or p.BH == 0 or p.Nq == 0 or p.Nk == 0:
        return False
    # unaligned rows (odd head dims, odd strides) stay on the generic path: it keeps the number
    # of instantiations (and CI's build check) down
    return p.Nq <= MAX_NQ and max(p.Dk, p.Dv) <= _config.MAX_HEAD_DIM and _aligned(p)


def supports(p):
    """True when the split-KV path should run this Problem (SUPPORT RULE above)."""
    return fits(p) and _max_extent(p) >= MIN_KEYS


def _aligned(p):
    vec = 16 // _storage_size(p.dtype)
    if p.Dk % vec or p.Dv % vec:
        return False
    for x, mp in ((p.k, p.k_map), (p.v, p.v_map)):
        isz = x.dtype.itemsize
        rs = element_strides(x)[-2] if p.Nk > 1 else 0
        if (rs * isz) % 16 or x.data.ptr % 16:
            return False
        if np.any((np.asarray(mp, dtype=np.int64) * isz) % 16):
            return False
    return True


class Schedule:
    """The host-side decomposition of one Problem (pure NumPy; no device needed).

    groups (n_groups, G), rows (ROWS), tiles (n_tiles, 4) = (group, tile index, first item,
    item count), items (n_items, 3) = (tile id, k0, k1 exclusive), split (keys per item), lens (BH).
    """

    def __init__(self, p, capacity, split=None, rule=None, rows=None, block_keys=None):
        BH = p.BH
        self.lens = _lens(p)
        self.k_map = np.asarray(p.k_map, dtype=np.int64).reshape(BH)
        self.v_map = np.asarray(p.v_map, dtype=np.int64).reshape(BH)
        self.groups, self.G = group_heads(self.k_map, self.v_map, self.lens)
        self.bucket = _config.head_dim_bucket(p.Dk, p.Dv)
        has_mb = p.mask is not None or p.bias is not None
        self.rows = rows or rows_per_block(p.dtype, self.bucket, self.G * p.Nq, has_mb)
        block_keys = block_keys or shape_constants(p.dtype, self.bucket, self.rows)["BLOCK_KEYS"]
        g, t, lo, hi = tile_extents(self.lens[self.groups[:, 0]], self.G, p.Nq, self.rows,
                                    p.left, p.right, p.bottom_right)
        if split:
            self.split = int(split)
        elif rule is None or rule == "waves":
            self.split = split_size(np.maximum(hi - lo + 1, 0), capacity, block_keys)
        else:  # a candidate rule (SPLIT_RULES)
            self.split = SPLIT_RULES[rule](np.maximum(hi - lo + 1, 0), capacity, block_keys)
            order = lpt_order(np.maximum(hi - lo + 1, 0))  # tile ids follow the launch order
            g, t, lo, hi = g[order], t[order], lo[order], hi[order]
        first, count, self.items = make_items(lo, hi, self.split)
        self.tiles = np.stack([g, t, first, count], axis=1)
        self.split_any = bool(np.any(count > 1))
        # launch order of the items (row r of the kernels' table = item launch[r])
        self.launch = (np.arange(self.items.shape[0], dtype=np.int64)
                       if rule is None or rule == "waves" or split else launch_order(self.items))

    def items_x(self):
        """The kernels' items table (n_items, 4): (tile, k0, k1, workspace slot), in launch
        order."""
        return np.concatenate([self.items[self.launch], self.launch[:, None]], axis=1)


class Plan:
    """Everything of one call but the launches: compiled kernels, the device table, buffers.

    `run()` launches on the current stream and returns (out, lse); tools/decode_check.py times
    `run()` alone, with the host preparation outside the timed region. `split` forces the split
    size (tests); `waves` scales the capacity of the split rule. `variant`: None chooses
    (DEFAULT_TC where tc_fits, else "simt", with DEFAULT_RULE), "simt" is decode_split, a name of
    TC_VARIANTS that decode_tc tile; `split_rule` a rule of
    SPLIT_RULES; both default to today's behaviour.
    """

    def __init__(self, p, fused=True, waves=WAVES, poison=False, split=None, variant=None,
                 split_rule=None):
        import cupy

        self.p = p
        self.fused = bool(fused)
        BH = p.BH
        has_mb = p.mask is not None or p.bias is not None
        aligned = _aligned(p)
        bucket = _config.head_dim_bucket(p.Dk, p.Dv)
        with p.q.device:
            # capacity needs the kernel (its occupancy), the kernel needs ROWS from the grouping
            lens = _lens(p)
            _, G = group_heads(p.k_map, p.v_map, lens)
            rows = rows_per_block(p.dtype, bucket, G * p.Nq, has_mb)
            if variant is None:  # the automatic choice
                variant = DEFAULT_TC if tc_fits(p) else "simt"
                split_rule = split_rule or DEFAULT_RULE
            self.variant, self.dyn_smem = variant, 0
            sched_rows = block_keys = None
            if variant == "simt":
                self.expr = name_expression(p.dtype, bucket, rows, has_mb, aligned)
                self.kernel, per_sm = _kernel(self.expr)
            else:
                if not tc_fits(p):
                    raise ValueError(f"decode variant {variant!r} does not apply to this problem")
                self.expr = tc_expression(p.dtype, bucket, variant)
                self.dyn_smem = tc_smem_bytes(bucket, variant)
                self.kernel, per_sm = _kernel(self.expr, self.dyn_smem)
                rows = sched_rows = 16
                block_keys = TC_VARIANTS[variant][0] * WARPS
            self.per_sm = per_sm
            self.combine = None if self.fused else _kernel(combine_expression(p.dtype, rows))[0]
            self.capacity = max(1, int(waves * per_sm * _kernels.device_info().sm_count))
        sched = Schedule(p, self.capacity, split, split_rule, sched_rows, block_keys)
        assert sched.rows == rows
        self.sched = sched
        self.G, self.rows, self.split = sched.G, sched.rows, sched.split
        self.n_items, self.n_tiles = sched.items.shape[0], sched.tiles.shape[0]

        offsets = np.zeros((5, BH), dtype=np.int64)
        offsets[0] = np.asarray(p.q_map, dtype=np.int64).reshape(BH)
        offsets[1], offsets[2] = sched.k_map, sched.v_map
        self.mask_rs = self.mask_cs = self.bias_rs = self.bias_cs = 0
        if p.mask is not None:
            st = element_strides(p.mask)
            offsets[3] = _broadcast.lead_offsets(p.lead, p.lead, st[:-2]).reshape(BH)
            self.mask_rs, self.mask_cs = st[-2:]
        if p.bias is not None:
            st = element_strides(p.bias)
            offsets[4] = _broadcast.lead_offsets(p.lead, p.lead, st[:-2]).reshape(BH)
            self.bias_rs, self.bias_cs = st[-2:]
        items = sched.items_x()
        parts = [offsets.reshape(-1), sched.lens, sched.groups.reshape(-1),
                 sched.tiles.reshape(-1), items.reshape(-1)]
        bounds = np.cumsum([0] + [x.size for x in parts])
        with p.q.device:
            host = np.concatenate(parts)
            try:  # cached by content: a pageable copy would wait for the stream to drain
                from ._gpu import _on_device
                table = _on_device(host)
            except ImportError:
                table = cupy.asarray(host)  # the one host-to-device copy
            (self.offsets, self.lens, self.groups, self.tiles,
             self.items) = (table[a:b] for a, b in zip(bounds[:-1], bounds[1:]))
            self.table = table
            self.split_any = sched.split_any
        self.q_rs, self.k_rs, self.v_rs = (element_strides(x)[-2] for x in (p.q, p.k, p.v))
        self.poison = poison

    def _outputs(self):
        import cupy

        p = self.p
        out = cupy.empty((p.BH, p.Nq, p.Dv), dtype=p.dtype)
        lse = cupy.empty((p.BH, p.Nq), dtype=p.acc_dtype)
        if self.poison:
            if p.dtype.name == "bfloat16":
                out.view(np.uint16).fill(0x7FC0)
            else:
                out.fill(np.nan)
            lse.fill(np.nan)
        return out, lse

    def run(self, out=None, lse=None, p=None):
        """Launch (split kernel, and the combine kernel when not fused); returns (out, lse).

        ``p`` is a Problem with the same layout as the one planned (see ``forward``'s cache);
        by default the planned one."""
        import cupy

        if p is not None:
            self.p = p
        p = self.p
        if out is None:
            out, lse = self._outputs()
        i64, i32 = np.int64, np.int32
        sc = np.float64 if p.acc_dtype == np.float64 else np.float32
        null = np.uint64(0)
        with p.q.device:
            # per-call workspace (from CuPy's pool): concurrent calls on other streams never share
            shape = (self.n_items, self.rows) if self.split_any else (1, 1)
            ws_out = cupy.empty(shape + (p.Dv,), dtype=p.acc_dtype)
            ws_lse = cupy.empty(shape, dtype=p.acc_dtype)
            counters = _counter_buffer(self.n_tiles if self.split_any else 1)
            args = (p.q, p.k, p.v, out, lse, ws_out, ws_lse, counters,
                    self.offsets, self.lens, self.groups, self.tiles, self.items,
                    null if p.mask is None else p.mask, null if p.bias is None else p.bias,
                    i64(self.q_rs), i64(self.k_rs), i64(self.v_rs), i64(self.mask_rs),
                    i64(self.mask_cs), i64(self.bias_rs), i64(self.bias_cs), i32(p.BH),
                    i32(p.Nq), i32(p.Dk), i32(p.Dv), i32(self.G), sc(p.scale), i32(p.left),
                    i32(p.right), i32(bool(p.bottom_right)), i32(self.fused))
            if self.dyn_smem:
                self.kernel((self.n_items,), (THREADS,), args, shared_mem=self.dyn_smem)
            else:
                self.kernel((self.n_items,), (THREADS,), args)
            if self.split_any and not self.fused:
                self.combine((self.n_tiles,), (THREADS,),
                             (out, lse, ws_out, ws_lse, self.lens, self.groups,
                              self.tiles, i32(p.Nq), i32(p.Dv), i32(self.G), i32(p.left),
                              i32(p.right), i32(bool(p.bottom_right))))
        return out, lse


def plan(p, fused=True, waves=WAVES, poison=False, split=None, variant=None, split_rule=None):
    return Plan(p, fused=fused, waves=waves, poison=poison, split=split, variant=variant,
                split_rule=split_rule)


def forward(p, split=None, variant=None):
    """(out (BH, Nq, Dv) of p.dtype, lse (BH, Nq) of p.acc_dtype) on the current stream.

    ``split`` forces the keys per split (tests use a small one to exercise the merge), ``variant``
    the kernel (see Plan; tests force "simt" where decode_tc would run)."""
    from . import _gpu

    key = _layout_key(p, split, _gpu.POISON) + (variant,)
    plan = _plans.get(key)
    if plan is None:
        if len(_plans) >= _PLAN_CACHE_SIZE:
            _plans.pop(next(iter(_plans)))  # oldest first
        plan = _plans[key] = Plan(p, poison=_gpu.POISON, split=split, variant=variant)
    out, lse = plan.run(p=p)
    plan.p = None  # the cache keeps the layout, not the caller's arrays
    return out, lse


# Plans by layout: the schedule and its device table depend only on shapes, strides, options and
# kv_lens, so repeated calls (decoding token after token) skip the host work (about 1 ms).
_PLAN_CACHE_SIZE = 64
_plans = {}


def _layout_key(p, split, poison):
    """Everything a Plan is derived from, except the arrays' contents."""
    import cupy

    def strides(x):
        return None if x is None else element_strides(x)

    return (cupy.cuda.Device().id, split, poison, p.dtype.str, p.lead, p.Nq, p.Nk, p.Dk, p.Dv,
            p.scale, p.left, p.right, p.bottom_right, _aligned(p),
            strides(p.q), strides(p.k), strides(p.v), strides(p.mask), strides(p.bias),
            None if p.kv_lens is None else p.kv_lens.tobytes(),
            p.q_map.tobytes(), p.k_map.tobytes(), p.v_map.tobytes())


def instantiations():
    """Every (kernel, dtype name, bucket, source file, name expression) this path can request."""
    out = []
    for dt in _config.supported_dtype_names():
        rows_options = set()
        for b in _config.HEAD_DIM_BUCKETS:
            for has_mb in (False, True):
                r = 1
                while r <= max_rows(dt, b, has_mb):
                    rows_options.add(r)
                    out.append(("decode_split", dt, b, SOURCE,
                                name_expression(dt, b, r, has_mb, True)))
                    r *= 2
        if dt in ("float16", "bfloat16"):
            rows_options.add(16)
            for b in TC_HEAD_DIMS:
                out.append(("decode_tc", dt, b, SOURCE, tc_expression(dt, b, DEFAULT_TC)))
        for r in sorted(rows_options):
            out.append(("decode_combine", dt, None, SOURCE, combine_expression(dt, r)))
    return out
