"""Split-KV decode path (kernels_cu/decode.cu): when it applies, how work is split, and launches.

The kernels read each kv head's keys once for all the query rows that share it (GQA packing) and
split the key axis across blocks; see the header of kernels_cu/decode.cu for the block layouts
(decode_tc: tensor cores, 16-bit, Dk = Dv in {64, 128}, no mask / bias; decode_split: the rest) and
the workspace format (normalized partial out, each partial's max and sum). Both kernels take the
score transforms (cuflash/_modifiers.py), a last template argument and two trailing scalars.

Host side, per call (all NumPy, then ONE int64 table on the device, cached by content through
cuflash._runtime.on_device):

1. Grouping (`group_heads`): the output (batch, head) matrices bh that read the same k matrix, the
   same v matrix and have the same valid length form a group (k_map, v_map, kv_lens equal). For
   the standard (B, H) GQA layout these are the runs of H // Hkv consecutive heads. Groups longer
   than MAX_GROUP are cut; shorter ones are padded with -1 to the common size G.
2. Row tiles: a group's G * Nq query rows (query-major) in tiles of ROWS (`rows_per_block`).
3. Key extent of each row tile (`tile_extents`): the keys any of its rows can see by position, the
   same closed form as kernels_cu/mask.cuh (DESIGN.md). It only decides which blocks exist: the
   kernel clips each block to its rows' ranges with mask.cuh itself.
4. Split size: one uniform split size S (keys) for the call (`split_size`). Candidates: for each
   w in SPLIT_WAVES the smallest multiple of the block's key pass, at least SPLIT_MIN_KEYS, such
   that the number of blocks sum(ceil(extent / S)) fits in w waves of resident blocks (SM count x
   blocks per SM from the occupancy API), the block pass times powers of two, and, for uneven
   extents, every multiple of 8 block passes. The S whose list schedule, longest item first, ends
   first wins, so that uneven kv_lens share the SMs instead of the longest sequence setting the
   time (each schedule's end is computed from the distinct extents, not by listing its blocks:
   `_best_split`). kv_lens only changes the extents, so the invalid tail of a sequence gets no
   blocks at all. A tile with an empty extent still gets one (empty) block, which writes out = 0
   and lse = -inf.

Every item's keys are fixed by the table and the partials are merged in slot order, so a call's
result is bitwise reproducible (issue 12 removed decode_tc's key pools, whose stages were claimed
at run time).

Host kv_lens are planned with room to grow (`planned_span`): a new plan spans, for each length L,
every length from L - q to L + q or more, q a power of two at most 1/2**BUCKET_SHIFT of L, so
that a token loop whose lengths grow by one per step re-plans at most once per q steps, however
many sequences it has (a plan per sequence's bucket re-planned whenever any one sequence left
its bucket: B times as often). The plan then spans every length of the span (a bottom-right
window's first key moves with the length) and the kernels read the true lengths from the
device, as they do for a CuPy kv_lens (planned for every length in [0, Nk]); below the plan's
length each item takes its share of the shorter extent (decode.cu item_keys). A new span re-plans
only steps 1-4 and the table: `forward` keeps the rest (kernels, occupancy, offsets: `_Layout`)
per layout.

Path interface (cuflash/_gpu.py): NAME, takes (the SUPPORT RULE below; under
cuflash._gpu.override(path="split") every Problem the kernels can run, `fits`), forward (out
(BH, Nq, Dv) of T, lse (BH, Nq) of the accumulator dtype, launched on the current stream without
synchronizing), instantiations.
"""
import operator

import numpy as np

from . import _config, _memo, _modifiers, _runtime
from ._validate import (LENS_VALUES_MAX, clamped_lens, element_strides, key_range,
                        reads_in_place)

NAME = "split"
TRANSFORMS = _modifiers.SINGLE  # the chains of score transforms its kernels take (cuflash/_gpu.py)
DROPOUT = False  # its kernels take no dropout: cuflash/_gpu.py skips it for a Problem with dropout
SINKS = False  # whether its kernels join the sinks themselves (else cuflash/_gpu.py does)
SOURCE = "decode.cu"
FORCED_SPLIT_KEYS = 64    # the split of a forced run: many splits, some empty for some rows
WARPS = 4                 # kernels_cu/decode.cu DECODE_WARPS
THREADS = 32 * WARPS

# ---- the config table of this path -------------------------------------------------------------
# SUPPORT RULE: the split path applies to CuPy inputs with Nq <= MAX_NQ query rows per head whose
# largest key extent by position, with every length at Nk, is >= MIN_KEYS (below that one block
# per (batch, head) is as good and the generic path is already tuned for it; kv_lens' values do
# not change the path). Everything else (masks, bias, score transforms, kv_lens,
# windows, causal with either alignment, GQA/MQA/broadcast, any strides, every dtype, Dk, Dv <= 256)
# is supported.
MAX_NQ = 16
MIN_KEYS = 512
MAX_ROWS = 8              # rows per block (template ROWS in {1, 2, 4, 8})
MAX_GROUP = 64            # query heads packed on one kv head at most
SPLIT_MIN_KEYS = 256      # a split never has fewer keys than this (tiny caches do not split)
# Instantiations: 4 dtypes x 4 buckets x up to 4 ROWS x (mask/bias or not) x the transform chains
# (_modifiers.CHAINS), aligned rows only (`fits`), compiled on first use (`instantiations` lists
# them for tests/test_build.py).
# decode_tc's tile: TC_KW keys per warp per stage of its two-slot cp.async ring (64-key stages),
# TC_MIN_BLOCKS blocks per SM; the fastest tile on the H200 (benchmarks/RESULTS.md has the ones
# that lost).
TC_KW = 16
TC_MIN_BLOCKS = 2
TC_HEAD_DIMS = (64, 128)   # Dk == Dv == HEAD_DIM (the bucket); others stay on decode_split
TC_MAX_KEYS = 1 << 30      # 32-bit key arithmetic in decode_tc
_LOG2E = 1.4426950408889634  # tc_fits: decode_tc's transform scalars in log2 units, as floats
_FLOAT_MAX = float(np.finfo(np.float32).max)
# split_size: its candidates' waves, and the fixed cost of one block in keys in its list schedule.
SPLIT_WAVES = (1, 2, 3, 4, 6, 8)
SPLIT_OVERHEAD_KEYS = 256
# planned_span: host lengths L planned for [L - q, L + q or more], q = max(BUCKET_MIN_KEYS,
# 2**(floor(log2 L) - BUCKET_SHIFT)) keys
BUCKET_SHIFT = 3
BUCKET_MIN_KEYS = 64


# Host kv_lens by value (kernels_cu/decode.cu HostLens, every decode kernel's last parameter): a
# span's plan of a caller's few lengths (Problem.lens_values) passes them in the launch itself,
# read through the plan's lens_map like a CuPy kv_lens: no copy to the device per token (issue
# 17). Other calls pass NO_HOST_LENS.
HOST_LENS = np.dtype({"names": ["v"], "formats": [(np.int64, (LENS_VALUES_MAX,))]})
NO_HOST_LENS = np.zeros((), HOST_LENS)[()]
BY_VALUE = np.int32(-1)  # decode.cu valid_keys' lens_bytes for them


def host_lens_arg(values):
    """The HostLens parameter holding `values` (at most LENS_VALUES_MAX Python ints)."""
    a = np.zeros(LENS_VALUES_MAX, dtype=np.int64)
    a[:len(values)] = values
    return a.view(HOST_LENS)[0]


def _storage_size(dtype):
    return _config.C_SIZES[_config.c_types(dtype)[0]]


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


def max_rows(dtype, bucket, has_mb=False, transforms=False):
    """Largest ROWS whose q (and acc) registers, ROWS x COLS 32-bit words each, fit the budget:
    64 words for 16-bit storage (COLS = 8: ROWS = 8, 244-250 registers), 32 otherwise (float32
    D = 256 at ROWS = 8 and double D = 128 at ROWS = 8 reach 255 registers and spill on sm_80).
    transforms: whether the kernel applies score transforms."""
    c = shape_constants(dtype, bucket, 1)
    words = 2 if _config.c_types(dtype)[1] == "double" else 1
    budget = 64 if _storage_size(dtype) == 2 else 32
    r = MAX_ROWS
    while r > 1 and r * c["COLS"] * words > budget:
        r //= 2
    # the mask/bias reads keep more addresses live: half the rows, a quarter for double (NVRTC
    # 13.0 spilled otherwise); so does a transform's double tanh (float's fits)
    return max(1, r // (2 * words)) if has_mb or (transforms and words == 2) else r


def rows_per_block(dtype, bucket, group_rows, has_mb=False, transforms=False):
    """ROWS template value: the smallest power of two >= the group's rows, capped."""
    cap = max_rows(dtype, bucket, has_mb, transforms)
    r = 1
    while r < group_rows and r < cap:
        r *= 2
    return r


def name_expression(dtype, bucket, rows, has_mb, aligned, transforms=(), paged=False):
    """Name expression of the decode_split kernel; transforms: the score transforms' names
    (cuflash/_modifiers.py), a last template argument in natural units when there are any;
    paged: its form on a paged KV cache (decode_split_paged, cuflash/_paged.py)."""
    t, acc = _config.c_types(dtype)
    b = lambda x: "true" if x else "false"  # noqa: E731
    f = (f", {_modifiers.transform(transforms, acc, True, _config.dtype_name(dtype))}"
         if transforms else "")
    name = "decode_split_paged" if paged else "decode_split"
    return f"{name}<{t}, {acc}, {bucket}, {rows}, {b(has_mb)}, {b(aligned)}{f}>"


def tc_expression(dtype, bucket, transforms=(), paged=False):
    """Name expression of the decode_tc kernel; transforms as name_expression's (in log2 units),
    paged too (decode_tc_paged)."""
    f = (f", {_modifiers.transform(transforms, 'float', False, _config.dtype_name(dtype))}"
         if transforms else "")
    name = "decode_tc_paged" if paged else "decode_tc"
    return f"{name}<{_config.c_types(dtype)[0]}, {bucket}, {TC_KW}, {TC_MIN_BLOCKS}{f}>"


def tc_smem_bytes(bucket):
    """decode_tc's dynamic shared memory: 16 Q rows and the two-slot K/V ring, padded rows of
    16-bit values (the warps' merge buffer, 4 x 16 rows of bucket + 8 floats, fits in one slot)."""
    row = (bucket + 8) * 2
    return 16 * row + 2 * (2 * WARPS * TC_KW) * row  # two slots of K and V rows


def tc_fits(p):
    """True when decode_tc can run this Problem (16-bit, Dk == Dv == 64 or 128, no mask / bias,
    scale > 0: it folds the scale into one FFMA on maxima of the unscaled scores, which a zero
    scale (-inf * 0 = NaN on masked scores) or a negative one (the max becomes the min) breaks;
    decode_split pre-multiplies q by the scale and takes any). It applies the score transforms in
    log2 units, so their scalars times log2(e) must be finite floats (decode has no fix-up kernel
    for a cap that overflows there; decode_split keeps them in natural units). A block's rows span
    the heads of a GQA group: no transform that reads positions and per-head slopes (ALiBi),
    which decode_split takes per row."""
    return (p.dtype.name in ("float16", "bfloat16") and p.Dk == p.Dv and p.Dk in TC_HEAD_DIMS
            and not _modifiers.positional(_modifiers.names(p))
            and p.mask is None and p.bias is None and p.scale > 0 and p.Nk < TC_MAX_KEYS
            and all(abs(x) * _LOG2E < _FLOAT_MAX for x in _modifiers.scalars(p)) and fits(p))


# ---- kernels (compiled by cuflash._runtime) and their occupancy --------------------------------
_per_sm = {}      # id(kernel) -> resident blocks per SM
_counters = _memo.Memo(16)  # _runtime.stream_key() -> uint32 array, zeros between launches


def _kernel(expr, dyn_smem=0):
    """(kernel, resident blocks per SM) of one name expression on the current device; decode_tc's
    dynamic shared memory (dyn_smem) is set on the kernel before the occupancy query."""
    func = _runtime.get_function(SOURCE, expr)
    per_sm = _per_sm.get(id(func))
    if per_sm is None:
        _runtime.opt_in(func, int(dyn_smem), limit=0)
        per_sm = _per_sm.setdefault(id(func), _blocks_per_sm(func, dyn_smem))
    return func, per_sm


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
    """Zeroed merge counters (one per split row tile) for a launch. The kernels reset every counter
    they use to 0 (a tile's last block), so launches that follow each other on one stream share a
    buffer (_runtime.stream_key). Under CUDA graph capture a buffer of the graph's own: a graph may
    replay on another stream beside this stream's calls, or beside another graph captured here,
    and launches that run at once must not count in one buffer."""
    if _runtime.capture_keeping():
        return _runtime.zeros((max(n, 1),), np.uint32)  # (kept for the graph)
    return _runtime.per_stream(_counters, lambda buf: buf.size >= n,
                               lambda: _runtime.zeros((max(n, 1024),), np.uint32))


# ---- host scheduling (pure NumPy; tested without a GPU) ----------------------------------------

def group_heads(k_map, v_map, lens, max_group=MAX_GROUP, seq=None):
    """(groups (n_groups, G) int64 of bh, -1 padded; G). Members of a group share k, v and length
    (and `seq`, where given: a paged cache's sequence, whose block-table row picks the pages).

    Fast path: consecutive runs of equal keys of one common length (the standard GQA layout).
    """
    cols = (k_map, v_map, lens) + (() if seq is None else (seq,))
    cols = [np.asarray(x, dtype=np.int64).reshape(-1) for x in cols]
    BH = cols[0].size
    keys = np.stack(cols, axis=1)
    change = np.ones(BH, dtype=bool)
    change[1:] = np.any(keys[1:] != keys[:-1], axis=1)
    starts = np.flatnonzero(change)
    runs = np.diff(np.append(starts, BH))
    if runs.size and np.all(runs == runs[0]) and runs[0] <= max_group:
        # every run is a whole group iff no two runs have equal keys (sorted: no two neighbours)
        run_keys = keys[starts][np.lexsort(keys[starts].T)]
        if np.all(np.any(run_keys[1:] != run_keys[:-1], axis=1)):
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

    Row rho = i * G + gi of a group; tile t holds rho in [t * rows, (t + 1) * rows). The rule is
    _validate.key_range's; lo, hi are non-decreasing in i, so a tile's range is its first row's lo
    and its last row's hi.
    """
    group_lens = np.asarray(group_lens, dtype=np.int64)
    n_tiles = -(-(G * Nq) // rows)
    t = np.arange(n_tiles, dtype=np.int64)
    i_first = (t * rows) // G
    i_last = (np.minimum((t + 1) * rows, G * Nq) - 1) // G
    L = group_lens[:, None]
    lo = key_range(i_first[None, :], L, Nq, left, right, bottom_right)[0]
    hi = key_range(i_last[None, :], L, Nq, left, right, bottom_right)[1]
    g = np.repeat(np.arange(group_lens.size, dtype=np.int64), n_tiles)
    tt = np.tile(t, group_lens.size)
    return g, tt, lo.reshape(-1), hi.reshape(-1)


def _distinct(extents):
    """The positive extents as (distinct values ascending, multiplicities): all split_size
    depends on (tiles of equal extents cost the same), and far fewer than the tiles."""
    ext = np.asarray(extents, dtype=np.int64).reshape(-1)
    return np.unique(ext[ext > 0], return_counts=True)


def _waves_splits(u, w, capacities, block_keys, probes=1 << 14):
    """For each of `capacities` at once, the smallest S (a multiple of block_keys, at least
    SPLIT_MIN_KEYS) with sum(ceil(extent / S)) <= capacity, from _distinct's (u, w); the largest
    extent if even one block per tile exceeds it. The block count n(S) = sum(w * ceil(u / S)) lies
    in [N / S, N / S + T) (N keys, T tiles), which brackets the answer; a search vectorized over
    the capacities, probing up to `probes` (capacity, S, extent) triples a step, closes the
    bracket in a step or two."""
    cap = np.asarray(capacities, dtype=np.int64)
    if u.size == 0:
        return np.full(cap.shape, max(SPLIT_MIN_KEYS, block_keys), dtype=np.int64)
    unit = block_keys
    lo0 = -(-SPLIT_MIN_KEYS // unit)
    hi0 = max(lo0, -(-int(u[-1]) // unit))  # the answer when even that does not fit
    N, T = int((u * w).sum()), int(w.sum())
    lo = np.minimum(np.maximum(-(-N // (np.maximum(cap, 1) * unit)), lo0), hi0)
    hi = np.where(cap > T, np.minimum(np.maximum(-(-N // (np.maximum(cap - T, 1) * unit)), lo),
                                      hi0), hi0)
    uf = u.astype(np.float64)  # exact: ceil of a correctly rounded quotient below 2^53
    rows = np.arange(cap.size)
    while np.any(lo < hi):  # the answer is in [lo, hi]
        span = hi - lo
        K = int(min(span.max(), max(probes // (cap.size * u.size), 2)))
        s = lo[:, None] + span[:, None] * np.arange(K) // K  # K probes in [lo, hi)
        ok = np.ceil(uf / (s[:, :, None] * unit)) @ w <= cap[:, None]  # monotone in s
        j = ok.argmax(axis=1)  # the first probe that fits (if any does)
        fit = ok[rows, j] & (span > 0)
        lo = np.where(fit, np.where(j > 0, s[rows, j - 1] + 1, lo),
                      np.where(span > 0, s[:, -1] + 1, lo))
        hi = np.where(fit, s[rows, j], hi)
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
    """Tile numbering of split_size's schedules: longest extent first (stable), so that the
    blocks of the short tiles fill the end of the schedule (longest-processing-time first)."""
    return np.argsort(-np.asarray(extents, dtype=np.int64), kind="stable")


def split_size(extents, capacity, block_keys):
    """The split size S of a call (the module docstring's step 4): among the one-wave-per-w splits
    (_waves_splits, w in SPLIT_WAVES), the block pass times powers of two and, for uneven extents,
    every multiple of 8 block passes below the longest extent (of a coarser step past 32 of them),
    the one whose list schedule (blocks of ceil-split keys + SPLIT_OVERHEAD_KEYS each, longest
    first as launch_order launches them, on `capacity` slots) ends first; ties go to the larger S
    (fewer partials). Equal extents that fit one wave keep the one-wave S; uneven extents get
    smaller splits, so that short and long sequences share the SMs instead of the longest block
    setting the time.

    The end of each candidate's schedule is list_schedule_end of the block costs, longest first,
    computed without listing the blocks, whose number grows with the keys (_best_split)."""
    ext = np.asarray(extents, dtype=np.int64).reshape(-1)
    u, w = _distinct(ext)
    cands = set(_waves_splits(u, w, [int(x * capacity) for x in SPLIT_WAVES],
                              block_keys).tolist())
    top = int(ext.max(initial=0))
    S = max(SPLIT_MIN_KEYS, block_keys)
    while S < top:  # and powers of two times the block pass
        cands.add(S)
        S *= 2
    if ext.size and ext.min() < top:  # uneven extents: also every 8 block passes
        step = max(8 * block_keys, -(-top // (32 * block_keys)) * block_keys)
        cands.update(range(max(SPLIT_MIN_KEYS, step), top, step))
    return _best_split(u, w, np.array(sorted(cands), dtype=np.int64), capacity,
                       SPLIT_OVERHEAD_KEYS)


def _best_split(u, w, S, capacity, overhead_keys):
    """The candidate S (ascending) whose schedule ends first, the larger on ties: exactly the
    minimum over S of (list_schedule_end(costs), -S), costs = the blocks of the distinct extents u
    (w tiles each) cut at S, plus overhead_keys, longest first; computed from the extents, not by
    listing the blocks.

    The schedule of S: its M blocks of S keys (cost c = S + overhead) come first and fill the slots
    round by round: r = M % capacity slots end at a + c, the other m = capacity - r at
    a = M // capacity * c. Then its k short last blocks (at most one per tile, each < c), longest
    first: the first m take one slot each at a, ending at a + max(c if r else 0, the longest)
    ("first"), the end when k <= m. Otherwise the other k - m (the tail) only ever go onto the
    k - m least loaded slots (a slot taking the j-th would need every less loaded one to have taken
    one before it). Each tail block goes onto a slot loaded at most these slots' mean, and at most
    as much as the least loaded one still untouched: when that keeps every slot within `first`,
    `first` is the end. The others, most promising lower bound first, get list_schedule_end's heap
    on their tail (_schedule_tail) until no bound can beat the best end."""
    if u.size == 0:
        return int(S[-1])  # no blocks: every schedule ends at 0
    C, T, rows = S.size, int(w.sum()), np.arange(S.size)
    Sc = S[:, None]
    n = -(-u // Sc)                              # blocks per extent (candidate x extent)
    rem = u - (n - 1) * Sc                       # keys of the last one, in (0, S]
    short = rem < Sc
    blocks, k = n @ w, short @ w
    c = S + overhead_keys
    a, r = (blocks - k) // capacity * c, (blocks - k) % capacity
    m = capacity - r
    # Y[i]: candidate i's short blocks' costs, longest first, 0-padded to the T tiles
    cost = np.where(short, rem + overhead_keys, 0)
    order = np.argsort(-cost, axis=1)
    cost = cost[rows[:, None], order]
    Y = np.repeat(np.concatenate([cost, np.zeros((C, 1), dtype=np.int64)], axis=1).reshape(-1),
                  np.concatenate([np.where(cost > 0, w[order], 0), (T - k)[:, None]],
                                 axis=1).reshape(-1)).reshape(C, T)
    P = np.zeros((C, T + 1), dtype=np.int64)   # P[i, j] = Y[i, :j].sum()
    np.cumsum(Y, axis=1, out=P[:, 1:])
    first = a + np.maximum((r > 0) * c, Y[:, 0])
    # the tail (where rest > 0): blocks Y[m:k] onto `slots` slots that hold `load` before it; its
    # j-th block (column J = m + j) finds a slot loaded at most their mean and, for j < m, at most
    # Y[m - 1 - j] (one of the j + 1 least loaded is still untouched)
    rest = k - m
    slots = np.minimum(np.maximum(rest, 1), capacity)
    lim = lambda i, top=T: np.minimum(np.maximum(i, 0), top)  # noqa: E731 (rows without a tail)
    Pm = P[rows, lim(m)]
    load = Pm - P[rows, lim(m - rest)] + c * np.minimum(np.maximum(rest - m, 0), r)
    J, m2 = np.arange(T), m[:, None]
    room = (first - a)[:, None] - Y              # the most a slot may hold before item J
    by_pair = (J < 2 * m2) & (Y[rows[:, None], lim(2 * m2 - 1 - J, T - 1)] <= room)
    by_mean = (load - Pm)[:, None] + P[:, :T] < (room + 1) * slots[:, None]
    decided = (rest <= 0) | np.all(by_pair | by_mean | (J < m2) | (J >= k[:, None]), axis=1)
    lower = np.maximum(-(-(load + P[rows, k] - Pm) // slots),
                       Y[rows, lim(m - 1, T - 1)] + Y[rows, lim(m, T - 1)])
    total = int(u @ w) + blocks * overhead_keys
    bound = np.where(decided, first, np.maximum(np.maximum(first, a + lower),
                                                -(-total // capacity)))
    best = (np.inf, 0)
    for i in np.lexsort((-S, bound)).tolist():   # most promising first
        if bound[i] > best[0]:
            break
        if bound[i] == best[0] and S[i] < best[1]:
            continue
        end = int(first[i]) if decided[i] else max(
            int(first[i]), int(a[i]) + _schedule_tail(Y[i, :k[i]], int(m[i]), int(r[i]),
                                                      int(c[i])))
        if end < best[0] or (end == best[0] and S[i] > best[1]):
            best = (end, int(S[i]))
    return best[1]


def _schedule_tail(y, m, r, c):
    """_best_split's tail: the short blocks y (longest first, more than m of them) after y[:m]
    went one per slot onto m slots at 0, with r more slots at c > y[0]; each goes onto the least
    loaded slot (list_schedule_end). Returns the largest end of the slots that take the rest
    (the len(y) - m least loaded ones)."""
    import heapq

    rest = y.size - m
    h = y[max(m - rest, 0):m].tolist() + [c] * min(r, max(rest - m, 0))
    heapq.heapify(h)
    for x in y[m:].tolist():
        heapq.heapreplace(h, h[0] + x)
    return max(h)


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
    """The lengths the schedule plans for: the host kv_lens, else Nk (also for lengths on the
    device, whose values the host never sees: the kernels then stop each item at its length)."""
    return (np.full(p.BH, p.Nk, dtype=np.int64) if p.kv_lens is None
            else np.asarray(p.kv_lens, dtype=np.int64).reshape(p.BH))


def _length_key(p):
    """What members of a group must share besides k and v: the length, or with lengths on the
    device the element of kv_lens they read."""
    return _lens(p) if p.lens_map is None else p.lens_map


def _sequence(p):
    """A paged Problem's sequence of each (batch, head) (its block-table row; the lead is (B, H)),
    which a group's members must share too; None unpaged."""
    return None if p.pages is None else np.arange(p.BH, dtype=np.int64) // p.lead[-1]


def _grouping(p):
    """group_heads' answer for p."""
    return group_heads(np.asarray(p.k_map, dtype=np.int64).reshape(p.BH),
                       np.asarray(p.v_map, dtype=np.int64).reshape(p.BH), _length_key(p),
                       seq=_sequence(p))


def _max_extent(p):
    """The widest key range of a query row by position, every length at Nk: the path does not
    depend on kv_lens' values (a token loop keeps its kernels as its lengths grow, and the choice
    holds for the layout: cuflash._gpu's prepare_lens)."""
    L = p.Nk
    shift = L - p.Nq if p.bottom_right else 0
    lo = max(shift - p.left, 0)
    hi = min(p.Nq - 1 + shift + p.right, L - 1)
    return hi - lo + 1


def fits(p):
    """True when the split-KV kernels can run this Problem at all (tests force them this way);
    by layout and the k / v bases' alignment (memoized: a token loop asks at every step)."""
    if p.xp is np or p.BH == 0 or p.Nq == 0 or p.Nk == 0:
        return False
    key = None if p.layout_key is None else (p.layout_key, p.k.data.ptr % 16,
                                             p.v.data.ptr % 16)
    return _fits.build(key, lambda: _fits_layout(p))


_fits = _memo.Memo(256)


def _fits_layout(p):
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
    if p.pages is not None and (p.pages.k_ps * p.k.dtype.itemsize % 16
                                or p.pages.v_ps * p.v.dtype.itemsize % 16):
        return False
    return True


class Schedule:
    """The host-side decomposition of one Problem (pure NumPy; no device needed).

    groups (n_groups, G), rows (ROWS), tiles (n_tiles, 4) = (group, tile index, first item,
    item count), items (n_items, 3) = (tile id, k0, k1 exclusive), split (keys per item), lens
    (BH). `split` forces the keys per item (tests; tiles then keep their order and the items
    launch in table order); else split_size chooses, the tiles are numbered longest first
    (lpt_order) and the items launch longest first (launch_order). `grouping`: group_heads'
    answer for p, when the caller has it.
    """

    def __init__(self, p, capacity, split=None, rows=None, block_keys=None, grouping=None,
                 span=None):
        BH = p.BH
        # span: (shortest, longest) length of each bh the plan must serve (the kernels read the
        # true one from the device); by default the host kv_lens exactly, or every length in
        # [0, Nk] with lengths on the device
        if span is None:
            span = (np.zeros(BH, np.int64), _lens(p)) if p.lens_device is not None else (
                _lens(p),) * 2
        self.lens = span[1]
        self.k_map = np.asarray(p.k_map, dtype=np.int64).reshape(BH)
        self.v_map = np.asarray(p.v_map, dtype=np.int64).reshape(BH)
        self.groups, self.G = grouping or _grouping(p)
        self.table_rows = (None if p.pages is None else
                           np.arange(BH, dtype=np.int64) // p.lead[-1] * p.pages.table_rs)
        self.bucket = _config.head_dim_bucket(p.Dk, p.Dv)
        has_mb = p.mask is not None or p.bias is not None
        self.rows = rows or rows_per_block(p.dtype, self.bucket, self.G * p.Nq, has_mb,
                                           bool(p.transforms))
        block_keys = block_keys or shape_constants(p.dtype, self.bucket, self.rows)["BLOCK_KEYS"]
        first = self.groups[:, 0]
        g, t, lo, hi = tile_extents(self.lens[first], self.G, p.Nq, self.rows, p.left, p.right,
                                    p.bottom_right)
        if p.bottom_right and not np.array_equal(span[0], span[1]):
            # A bottom-right row's first key moves down with L (aligned to the keys' end): each
            # tile spans its keys for every L of the span, lo at the shortest and hi at the
            # longest (both grow with L).
            lo = tile_extents(span[0][first], self.G, p.Nq, self.rows, p.left, p.right, True)[2]
        if split:
            self.split = int(split)
        else:
            self.split = split_size(np.maximum(hi - lo + 1, 0), capacity, block_keys)
            order = lpt_order(np.maximum(hi - lo + 1, 0))  # tile ids follow the launch order
            g, t, lo, hi = g[order], t[order], lo[order], hi[order]
        first, count, self.items = make_items(lo, hi, self.split)
        self.tiles = np.stack([g, t, first, count], axis=1)
        self.split_any = bool(np.any(count > 1))
        # launch order of the items (row r of the kernels' table = item launch[r])
        self.launch = (np.arange(self.items.shape[0], dtype=np.int64) if split
                       else launch_order(self.items))

    def items_table(self):
        """The kernels' items table (n_items, 6): (tile, k0, k1, workspace slot, k offset,
        v offset), in launch order; the offsets (elements) are those of the tile's kv head, so
        that decode_tc requests its first keys after one table load (kernels_cu/decode.cu
        ITEM_COLS). Paged: a 7th column, the sequence's row offset in the block table
        (decode.cu PagedKV)."""
        items = self.items[self.launch]
        bh0 = self.groups[self.tiles[items[:, 0], 0], 0]  # every group's first member exists
        cols = [items, self.launch[:, None], self.k_map[bh0][:, None], self.v_map[bh0][:, None]]
        if self.table_rows is not None:
            cols.append(self.table_rows[bh0][:, None])
        return np.concatenate(cols, axis=1)


def _use_tc(p, variant):
    """Whether a Plan runs decode_tc: where it fits (tc_fits), unless `variant` is "simt"
    (decode_split everywhere: tests). None is the automatic choice."""
    if variant not in (None, "simt"):
        raise ValueError(f"decode variant must be None or 'simt', got {variant!r}")
    return variant is None and tc_fits(p)


class _Layout:
    """What a Plan takes from the layout alone, not from kv_lens: the kernel, the table's offsets
    rows and the strides; and per ROWS (set by the grouping, which kv_lens changes in broadcast
    layouts) the kernels, their occupancy and the split rule's capacity. forward keeps one per
    layout, so that a new kv_lens (each decoded token) only re-plans the split and the table.
    Arguments as Plan's."""

    def __init__(self, p, variant=None):
        self.dtype = p.dtype
        self.has_mb = p.mask is not None or p.bias is not None
        self.transforms = _modifiers.names(p)  # the score transforms (a template argument)
        self.aligned = _aligned(p)
        self.paged = p.pages is not None  # the kernels' paged forms
        self.bucket = _config.head_dim_bucket(p.Dk, p.Dv)
        # decode_tc: 16 rows a block, its stage's keys a pass; decode_split: Schedule's defaults
        self.tc = tc = _use_tc(p, variant)
        self.dyn_smem = tc_smem_bytes(self.bucket) if tc else 0
        self.sched_rows = 16 if tc else None
        self.block_keys = TC_KW * WARPS if tc else None
        # the table's offsets rows; the 7 strides (q, k, v rows; mask, bias rows and columns)
        self.offsets, self.strides = _runtime.offset_table(p)
        self._by_rows = {}

    def rows(self, G, Nq):
        """ROWS: decode_tc's 16, or decode_split's for a group of G heads (the grouping can change
        with kv_lens) and Nq query rows."""
        if self.sched_rows:
            return self.sched_rows
        return rows_per_block(self.dtype, self.bucket, G * Nq, self.has_mb,
                              bool(self.transforms))

    def kernels(self, rows):
        """(expr, kernel, blocks per SM, capacity) on the current device
        (forward's cache keys name it), compiled on first use."""
        hit = self._by_rows.get(rows)
        if hit is None:
            expr = (tc_expression(self.dtype, self.bucket, self.transforms, self.paged)
                    if self.tc else
                    name_expression(self.dtype, self.bucket, rows, self.has_mb, self.aligned,
                                    self.transforms, self.paged))
            kernel, per_sm = _kernel(expr, self.dyn_smem)
            capacity = max(1, per_sm * _runtime.device_info().sm_count)  # one wave
            hit = self._by_rows[rows] = (expr, kernel, per_sm, capacity)
        return hit


class Plan:
    """Everything of one call but the launches: compiled kernels, the device table, buffers.

    `run()` launches on the current stream and returns (out, lse); tools/decode_check.py times
    `run()` alone, with the host preparation outside the timed region. `split` forces the split
    size (tests). `variant`: None runs decode_tc where it fits (tc_fits), else decode_split;
    "simt" runs decode_split everywhere (tests). `layout`: a _Layout of this layout to reuse
    (forward's cache); it then stands for `variant`.
    """

    def __init__(self, p, split=None, variant=None, layout=None, span=None):
        self.p = p
        self.span = span  # None: planned for p's own lengths (Schedule's default)
        self.leader = None  # (serves)
        self.last_lens = None  # (_host_lens)
        self.width = None  # (covers)
        self.elems = p.lens_elems  # (covers: the caller's element of each (batch, head))
        self.by_element = None
        with p.q.device:
            self.layout = lay = layout or _Layout(p, variant)
            # capacity needs the kernel (its occupancy), the kernel needs ROWS from the grouping
            grouping = _grouping(p)
            rows = lay.rows(grouping[1], p.Nq)
            self.expr, self.kernel, self.per_sm, self.capacity = lay.kernels(rows)
        self.tc, self.dyn_smem = lay.tc, lay.dyn_smem
        sched = Schedule(p, self.capacity, split, lay.sched_rows, lay.block_keys, grouping,
                         span)
        assert sched.rows == rows
        self.sched = sched
        self.G, self.rows, self.split = sched.G, sched.rows, sched.split
        self.n_items, self.n_tiles = sched.items.shape[0], sched.tiles.shape[0]
        self.strides = tuple(np.int64(s) for s in lay.strides)
        self.scalars = self.grid = None  # run's constant arguments, made by its first call

        parts = [lay.offsets.reshape(-1), sched.lens, sched.groups.reshape(-1),
                 sched.tiles.reshape(-1), sched.items_table().reshape(-1)]
        # a CuPy kv_lens: the kernels read it in place (lens_map: the element of each (batch,
        # head)), else its clamped (BH,) int64 copy (clamped_lens; each its own); a span's plan of
        # a caller's few host lengths: by value (HostLens), through lens_map likewise
        self.in_place = p.lens_device is not None and reads_in_place(p.lens_device)
        self.by_value = (p.lens_device is None and span is not None
                         and p.lens_elems is not None)
        if p.lens_device is not None:
            parts.append(p.lens_map if self.in_place else np.arange(p.BH, dtype=np.int64))
            self.lens_bytes = np.int32(p.lens_device.itemsize if self.in_place else 8)
        elif self.by_value:
            parts.append(p.lens_elems)
            self.lens_bytes = BY_VALUE
        bounds = np.cumsum([0] + [x.size for x in parts])
        with p.q.device:  # the one host-to-device copy, cached by content: a pageable copy
            table = _runtime.on_device(np.concatenate(parts))  # would wait for the stream
            (self.offsets, self.lens, self.groups, self.tiles, self.items,
             *self.lens_map) = (table[a:b] for a, b in zip(bounds[:-1], bounds[1:]))
            self.table = table
            self.split_any = sched.split_any

    def _leader(self):
        """Each (batch, head)'s group's first member (BH,), made once."""
        if self.leader is None:
            g = self.sched.groups
            leader = np.arange(self.sched.lens.shape[0], dtype=np.int64)
            members = g >= 0
            leader[g[members]] = np.broadcast_to(g[:, :1], g.shape)[members]
            self.leader = leader
        return self.leader

    def serves(self, lens):
        """Whether this plan runs host lengths `lens` (BH,) of its span: each of its groups'
        members still shares one length (the kernels read the group's first)."""
        return bool((lens == lens[self._leader()]).all())

    def covers(self, lens, values=None, elems=None):
        """Whether this plan runs host lengths `lens` (BH,): each within the span it was planned
        for, and `serves`. `values`, `elems`: the same lengths as the caller's few values and
        their map (Problem.lens_values, lens_elems), checked on Python ints when the map is the
        one of the plan's Problem (a signature's calls share it)."""
        if values is not None and elems is not None and elems is self.elems:
            lo, hi, pairs = self.by_element or self._by_element()
            return (all(map(operator.le, lo, values)) and all(map(operator.le, values, hi))
                    and all(values[a] == values[b] for a, b in pairs))
        if self.width is None:  # the span as (lo, hi - lo): lo <= L <= hi in one comparison
            lo, hi = self.span or (self.sched.lens,) * 2
            self.width = (lo, (hi - lo).astype(np.uint64))
        lo, width = self.width
        return bool(((lens - lo).view(np.uint64) <= width).all()) and self.serves(lens)

    def _by_element(self):
        """covers' rule on the caller's elements: each element's span (every (batch, head) that
        reads it was planned for its one length: the same span) and the pairs of elements that
        `serves` needs equal (a group's members that read different ones)."""
        lo, hi = self.span or (self.sched.lens,) * 2
        elems = self.elems
        first = np.zeros(int(elems.max(initial=0)) + 1, dtype=np.int64)
        first[elems] = np.arange(elems.size, dtype=np.int64)  # (any (batch, head) that reads it)
        pairs = tuple(sorted({(a, b) for a, b in zip(elems.tolist(),
                                                     elems[self._leader()].tolist()) if a != b}))
        self.by_element = (lo[first].tolist(), hi[first].tolist(), pairs)
        return self.by_element

    def __call__(self, p):
        """run(p); the plan keeps the layout, not the caller's arrays."""
        self.p = None
        return self.run(p)

    def run(self, p=None):
        """Launch the split kernel (its last block per row tile merges the partials); returns
        (out, lse).

        ``p`` is a Problem with the same layout as the one planned (see ``forward``'s cache);
        by default the planned one. Under the arrays' device (cuflash._gpu.forward's)."""
        p = self.p if p is None else p  # (not kept: threads may share the plan)
        if self.scalars is None:  # the layout's: the same for every call of the Plan
            self._first_run(p)
        # the workspace (ws_ml: each partial's (max, sum)): with splits the stream's scratch
        # (calls on other streams never share it), not carved with out and lse, which the caller
        # may keep (a token loop's outputs); without, a row's worth carved with them
        if self.split_any:
            out, lse = _runtime.carved_outputs(self.carving, p)
            ws_out, ws_ml = _runtime.stream_scratch(self.ws_carving)
        else:
            out, lse, ws_out, ws_ml = _runtime.carved_outputs(self.carving, p)
        counters = _counter_buffer(self.n_tiles)  # one merge counter per row tile
        head = (p.q, p.k, p.v, out, lse, ws_out, ws_ml, counters)
        if self.plain_tail is not None and p.plain:
            self.launch(head + self.plain_tail)
            return out, lse
        # the true lengths: a CuPy kv_lens' (read in place, or its clamped copy), the host's (the
        # plan serves their span: by value, or a copy of them), or Nk
        host = NO_HOST_LENS
        if p.lens_device is not None:
            caller = p.lens_device if self.in_place else clamped_lens(p)
            lens = (self.lens, caller, self.lens_map[0], self.lens_bytes)
        elif self.by_value and p.lens_elems is self.elems and p.lens_values is not None:
            lens = (self.lens, _runtime.NULL, self.lens_map[0], BY_VALUE)
            host = host_lens_arg(p.lens_values)
        else:
            lens = (self.lens if p.kv_lens is None or self.span is None else
                    self._host_lens(p.kv_lens), _runtime.NULL, _runtime.NULL, np.int32(0))
        # after the scalars: this call's per-head table of the transforms (mod_table; ALiBi)
        args = head + self._tail(self.scalars, lens, _runtime.ptr(p.mask), _runtime.ptr(p.bias),
                                 _runtime.ptr(_modifiers.table(p)))
        if p.pages is not None:  # this call's block table (a host one: its device copy)
            table = (_runtime.on_device(p.pages.table) if p.pages.host else p.pages.table)
            args += (table,) + self.page_scalars
        self.launch(args + (host,))
        return out, lse

    def _host_lens(self, kv_lens):
        """A span's plan reads each call's host lengths from a copy of them: a new one (an
        upload that does not wait for the stream), or the last call's if they are the same (a
        repeated call; under graph capture, which copies nothing, they must be)."""
        values = kv_lens.tobytes()
        last = self.last_lens
        if last is None or last[0] != values:
            last = self.last_lens = (values, _runtime.upload(kv_lens.reshape(-1), pointer=True))
        return last[1]

    def _tail(self, scalars, lens, mask, bias, table):
        """lens: (lens, kv_lens, lens_map, lens_bytes) as decode.cu's valid_keys reads them."""
        return ((self.offsets,) + lens + (self.groups, self.tiles, self.items, mask, bias)
                + scalars + (table,))

    def _first_run(self, p):
        """The layout's launch, numbers and carvings (and a plain Problem's whole tail)."""
        i32 = np.int32
        partials = self.n_items * self.rows if self.split_any else 1
        size = p.acc_dtype.itemsize * partials
        ws = (size * p.Dv, size * 2)
        if self.split_any:
            self.carving, self.ws_carving = _runtime.output_carving(p), _runtime.carving(*ws)
        else:
            self.carving = _runtime.output_carving(p, *ws)
        scalars = self.strides + (
            i32(p.BH), i32(p.Nq), i32(p.Dk), i32(p.Dv), i32(self.G),
            p.acc_dtype.type(p.scale), i32(p.left), i32(p.right),
            i32(bool(p.bottom_right)), i32(1))  # 1: fused, the merge in-kernel
        if self.tc:  # persistent blocks, at most one wave (decode_tc); lengths on the
            # device: its copies stop at each item's length (decode_split's do anyway)
            scalars += (i32(self.n_items), i32(p.kv_lens is not None
                                               or p.lens_device is not None))
            self.grid = min(self.n_items, self.per_sm * _runtime.device_info().sm_count)
        else:
            self.grid = self.n_items
        # the transforms' scalars, both kernels' last parameters but one (mod0, mod1)
        scalars += tuple(np.float64(x) for x in _modifiers.scalars(p))
        self.launch = _runtime.Launch(self.kernel, (self.grid,), (THREADS,),
                                      self.dyn_smem)
        if p.pages is not None:  # the paged kernels' trailing parameters
            pg = p.pages
            shift = pg.page_size.bit_length() - 1
            self.page_scalars = (np.int64(pg.k_ps), np.int64(pg.v_ps),
                                 i32(pg.page_size),
                                 i32(shift if 1 << shift == pg.page_size else -1),
                                 i32(pg.num_pages))
        null = _runtime.NULL
        self.plain_tail = (self._tail(scalars, (self.lens, null, null, i32(0)), null, null, null)
                           + (NO_HOST_LENS,) if p.plain else None)
        self.scalars = scalars  # (last: run's sign that the rest is here)


def takes(p):
    """Whether this path runs the Problem: the SUPPORT RULE, or wherever the kernels can run
    (`fits`) when the tests force this path or the keys are paged (cuflash/_paged.py: reading
    the pages in place beats gathering them at any key count)."""
    return fits(p) if _runtime.overrides().path == NAME or p.pages is not None else supports(p)


def forward(p):
    """(out (p.out_shape, p.dtype), lse (p.lse_shape, p.acc_dtype)) on the current stream. When the
    tests force this path, with FORCED_SPLIT_KEYS keys per split (to exercise the merge) and their
    decode variant ("simt": decode_split where decode_tc would run; see Plan)."""
    return prepare(p)(p)


def prepare_lens(p):
    """The run of every Problem of p's layout whatever its host kv_lens, under the device and test
    switches of p's call (cuflash._gpu.Repeat keeps it for them): each call finds its plan by its
    lengths (`prepare`)."""
    settings = _settings(p)
    return lambda p: _prepare(p, *settings)(p)


def prepare(p):
    """The Plan that runs p (called with p, or with another Problem of p's layout and lengths)."""
    return _prepare(p, *_settings(p))


def _settings(p):
    """(split, variant, layout key) of p's plans under the current test switches and device."""
    ov = _runtime.overrides()
    forced = ov.path == NAME
    split, variant = (FORCED_SPLIT_KEYS, ov.variant) if forced else (None, None)
    return split, variant, _layout_key(p, split) + (variant,)


def _prepare(p, split, variant, layout_key):
    if p.kv_lens is None:
        plan = _plans.get(layout_key)
        if plan is None:
            plan = _plan(p, split, variant, layout_key, layout_key)
    else:  # host lengths: a plan per span (planned_span), found by the lengths' key too
        exact = None if p.key is None else layout_key[:2] + (variant, p.key)
        plan = _exact.get(exact)
        if plan is not None and plan.span is not None and not _runtime.capturing():
            # these lengths came back (a repeated call, not a token loop): plan them exactly
            # (not under graph capture, where the new plan's table could not be uploaded: the
            # span's plan, whose table exists, serves them)
            plan = Plan(p, split=split, variant=variant, layout=_layouts.get(layout_key))
            _keep(_exact, exact, plan)
        if plan is None:
            lens = p.kv_lens.reshape(-1)
            plan = _last.get(layout_key)  # a token loop's lengths: its last plan's span, mostly
            if plan is None or not plan.covers(lens, p.lens_values, p.lens_elems):
                span = planned_span(lens, p.Nk)
                key = layout_key + (span[0].tobytes(), span[1].tobytes())
                plan = _plans.get(key)
                if plan is None or not plan.serves(lens):
                    plan = _plan(p, split, variant, layout_key, key, span)
                _keep(_last, layout_key, plan)
            if exact is not None:
                _keep(_exact, exact, plan)
    return plan


def _plan(p, split, variant, layout_key, key, span=None):
    """A new Plan of p, kept under `key`, its _Layout under `layout_key`."""
    plan = Plan(p, split=split, variant=variant, layout=_layouts.get(layout_key), span=span)
    _keep(_plans, key, plan)
    _keep(_layouts, layout_key, plan.layout)
    return plan


def planned_span(lens, Nk):
    """The span (lo, hi) of a new plan of host lengths `lens` (int64, at most Nk each): for each
    length L, lo = max(L - q, 0) and hi = min(L + q < a multiple of q <= L + 2 q, Nk), with
    q = max(BUCKET_MIN_KEYS, 2**(floor(log2 L) - BUCKET_SHIFT)): each length may grow q steps or
    more (or shrink q) before the plan stops serving it (the Schedule's `span`)."""
    e = np.frexp(np.maximum(lens, 1))[1] - 1  # floor(log2 L): L = m 2**(e + 1), m in [0.5, 1)
    q = np.maximum(np.left_shift(1, np.maximum(e - BUCKET_SHIFT, 0)), BUCKET_MIN_KEYS)
    return np.maximum(lens - q, 0), np.minimum((lens // q + 2) * q, Nk)


# Plans by layout and length span: the schedule and its device table depend only on shapes,
# strides, options and the lengths' span, so repeated calls skip the host work, also when the
# lengths grow by one per call (a token loop) inside their span. A new span reuses its layout's
# _Layout and re-plans only the split and the table. Lengths seen a second time get a plan of
# their own (_exact): a span's plan costs up to 3 % of device time (RESULTS.md).
_PLAN_CACHE_SIZE = 64
_plans = {}
_layouts = {}
_exact = {}  # (device, split, variant, Problem.key) -> the plan that serves its host kv_lens
_last = {}  # layout key -> the plan its last call of new host lengths took


def _keep(cache, key, value):
    if key not in cache and len(cache) >= _PLAN_CACHE_SIZE:
        cache.pop(next(iter(cache)))  # oldest first
    cache[key] = value


def _layout_key(p, split):
    """Everything a Plan is derived from, except the arrays' contents and kv_lens: the number of
    the Problem's signature (host kv_lens by their layout: Problem.layout_key) or the layout
    itself. (Not `_aligned(p)`: forward only receives problems that `fits`, which requires
    it; it was NumPy work on every call.)"""
    import cupy

    def strides(x):
        return None if x is None else element_strides(x)

    if p.layout_key is not None:
        return (cupy.cuda.Device().id, split, p.layout_key)
    return (cupy.cuda.Device().id, split, p.dtype.str, p.lead, p.Nq, p.Nk, p.Dk, p.Dv,
            p.scale, p.left, p.right, p.bottom_right, p.transforms,
            None if p.pages is None else p.pages.layout,
            None if p.lens_map is None else (p.lens_map.tobytes(), p.lens_device.dtype.str,
                                             reads_in_place(p.lens_device)),
            strides(p.q), strides(p.k), strides(p.v), strides(p.mask), strides(p.bias),
            p.q_map.tobytes(), p.k_map.tobytes(), p.v_map.tobytes())


def instantiations():
    """Every (kernel, dtype name, bucket, source file, name expression) this path can request:
    each kernel also in its paged form (decode_split_paged, decode_tc_paged)."""
    out = []
    for paged in (False, True):
        split, tc = ("decode_split_paged", "decode_tc_paged") if paged else ("decode_split",
                                                                             "decode_tc")
        for dt in _config.supported_dtype_names():
            for tf in TRANSFORMS:
                for b in _config.HEAD_DIM_BUCKETS:
                    for has_mb in (False, True):
                        r = 1
                        while r <= max_rows(dt, b, has_mb, bool(tf)):
                            out.append((split, dt, b, SOURCE,
                                        name_expression(dt, b, r, has_mb, True, tf, paged)))
                            r *= 2
                if dt in ("float16", "bfloat16") and not _modifiers.positional(tf):
                    for b in TC_HEAD_DIMS:
                        out.append((tc, dt, b, SOURCE, tc_expression(dt, b, tf, paged)))
    return out
