"""The tensor-core path of the wide dtypes, sm_80+: float64 on DMMA, float32 on TF32 (three
products per GEMM, as exact as float32; one with precision="high").

* forward (kernels_cu/fwd_wide.cu), then the lost-row fix of its flagged blocks (cuflash._generic),
  as the 16-bit forward;
* backward (kernels_cu/bwd_wide.cu): the generic preprocess (delta, lse with lost rows skipped),
  bwd_wide_dkdv and bwd_wide_dq (no atomics: deterministic), then the lost rows' gradients.

Path interface (cuflash/_gpu.py): NAME, takes / forward, takes_backward / backward,
instantiations.
"""
from collections import namedtuple

import numpy as np

from . import _config, _generic, _mask_tiles, _memo, _modifiers, _runtime

NAME = "wide"
TRANSFORMS = _modifiers.SINGLE  # the chains of score transforms its kernels take (cuflash/_gpu.py)
# the chains whose backward stores the bias's gradient (p.dbias; bwd_wide_dq's DBIAS twins of the
# mask / bias tiles): none with a transform (dbias with softcap or ALiBi: the generic kernels)
DBIAS = ((),)
DROPOUT = False  # its kernels take no dropout: cuflash/_gpu.py skips it for a Problem with dropout
SINKS = True  # whether its forward kernels join the sinks themselves (fwd_wide.cu SINKS)
SOURCE, BWD_SOURCE = "fwd_wide.cu", "bwd_wide.cu"
DTYPES = ("float32", "float64")
# Head-dim buckets: the kernel is compiled for DK = DV = the smallest >= max(Dk, Dv) and zeroes
# the columns past Dk, Dv. float64 stops at 128 (its accumulators: 16 rows x DV per warp).
BUCKETS = {"float32": (32, 64, 96, 128, 192, 256), "float64": (32, 64, 96, 128)}
# float32 precision -> TF32 products per GEMM
PASSES = {"highest": 3, "high": 1}

# WideTile: block_n keys per tile, `warps` warps of 16 * mf query rows each (mf m-fragments), a
# `stages`-deep cp.async ring for K and V, the __launch_bounds__ minimum blocks per SM; parts:
# the backward's dK / dV column slices per key tile (bwd_wide.cu PARTS). TILES hold
# on sm_80 without spills (head dims <= 128); TILES_CC90 (compute capability 9.0+) are the best of
# an H200 sweep (benchmarks/RESULTS.md, "Wide forward tiles") where sm_90a's allocation allows,
# and add float64 at 128 (sm_80 spills there: the generic kernels take it). A mask or bias
# (has_mb) needs registers: some of its tiles are narrower.
WideTile = namedtuple("WideTile", "block_n warps mf stages min_blocks parts", defaults=(1,))
_T = WideTile


def _table(rows):
    """{(dtype, bucket, has_mb): tile} from (dtype, bucket, tile[, tile with a mask or bias]):
    a row without the second tile uses its one tile for both."""
    return {(dt, b, mb): t for dt, b, plain, *masked in rows
            for mb, t in ((False, plain), (True, (masked or [plain])[0]))}


TILES = _table([
    ("float32", 32, _T(32, 8, 2, 2, 1)),
    ("float32", 64, _T(32, 8, 1, 2, 1)),
    ("float32", 96, _T(32, 8, 1, 2, 1)),
    ("float32", 128, _T(16, 4, 1, 2, 2)),
    ("float32", 192, _T(8, 4, 1, 2, 1)),
    ("float32", 256, _T(8, 4, 1, 2, 1)),
    ("float64", 32, _T(32, 8, 1, 2, 1)),
    ("float64", 64, _T(16, 8, 1, 2, 1)),
    ("float64", 96, _T(8, 4, 1, 2, 1)),
])
TILES_CC90 = _table([
    ("float32", 64, _T(32, 8, 2, 2, 1), _T(32, 8, 1, 2, 1)),
    ("float32", 128, _T(32, 8, 1, 2, 1)),
    ("float64", 64, _T(32, 8, 1, 2, 1)),
    ("float64", 96, _T(16, 4, 1, 2, 1)),
    ("float64", 128, _T(16, 8, 1, 2, 1)),
])
# The backward: (dkdv tile, dq tile) per (dtype, bucket, has_mb). A dkdv tile's block_n is the
# query rows per step (its block owns 16 * mf * warps keys); a dq tile's, the keys per step.
# BWD_TILES fit sm_80 (163 KiB, no spills); BWD_TILES_CC90 add the buckets whose tiles need
# sm_90's shared memory. Where a warp's dK and dV accumulators would not fit in registers with
# the products' operands, each key tile is computed in parts = 2 column slices. float32 above
# 128 takes the generic kernels.
_P = lambda dkdv, dq: (dkdv, dq)  # noqa: E731
BWD_TILES = _table([
    ("float32", 32, _P(_T(32, 8, 1, 2, 1), _T(32, 8, 1, 2, 1))),
    ("float32", 64, _P(_T(16, 8, 1, 2, 1), _T(32, 8, 1, 2, 1))),
    ("float32", 96, _P(_T(16, 8, 1, 2, 1, 2), _T(16, 8, 1, 2, 1))),
    ("float64", 32, _P(_T(32, 8, 1, 2, 1), _T(32, 8, 1, 2, 1))),
    ("float64", 64, _P(_T(16, 4, 1, 2, 1), _T(16, 4, 1, 2, 1)),
     _P(_T(8, 4, 1, 2, 1), _T(16, 4, 1, 2, 1))),
])
BWD_TILES_CC90 = _table([
    ("float32", 128, _P(_T(16, 8, 1, 2, 1, 2), _T(16, 8, 1, 2, 1))),
    ("float64", 96, _P(_T(16, 4, 1, 2, 1, 2), _T(16, 4, 1, 2, 1))),
    ("float64", 128, _P(_T(16, 4, 1, 2, 1, 2), _T(16, 4, 1, 2, 1)),
     _P(_T(8, 4, 1, 2, 1, 2), _T(8, 4, 1, 2, 1))),
])
del _T, _P


# (dtype, bucket, has_mb) whose tiles spill with a transform that reads positions (ALiBi;
# float32 D=256 with a mask / bias, sm_90a: 4 bytes): the generic kernels take those calls.
POSITIONAL_DECLINED = (("float32", 256, True),)


def pick_tile(dtype_name, bucket, has_mb, cc=80):
    """The tile for a device of compute capability `cc`, or None where this path has none."""
    key = (dtype_name, bucket, has_mb)
    if cc >= 90 and key in TILES_CC90:
        return TILES_CC90[key]
    return TILES.get(key)


def smem_bytes(dtype_name, t, bucket):
    """Tile t's Q (16 mf rows per warp) and `stages` K and V tiles; Q and K rows padded by 8
    elements, V rows by 16 bytes (fwd_wide.cu)."""
    e = np.dtype(dtype_name).itemsize
    return (16 * t.mf * t.warps * (bucket + 8)
            + t.stages * t.block_n * (2 * bucket + 8 + 16 // e)) * e


def name_expression(dtype_name, bucket, has_mb, passes, t, transforms=(), sinks=False):
    """has_mb: a mask or bias; transforms: the score transforms' names (cuflash/_modifiers.py);
    sinks: whether the kernel joins attention sinks (a last template argument, true, only then)."""
    c = _config.c_types(dtype_name)[0]
    mod = _modifiers.score_mod(has_mb, transforms, c)
    return (f"fwd_wide<{c}, {passes if dtype_name == 'float32' else 1}, {bucket}, {bucket}, "
            f"{t.block_n}, {t.warps}, {t.mf}, {t.stages}, {mod}, {t.min_blocks}"
            f"{', true' if sinks else ''}>")


def pick_bwd_tiles(dtype_name, bucket, has_mb, cc=80):
    """(dkdv tile, dq tile) for a device of compute capability `cc`, or None."""
    key = (dtype_name, bucket, has_mb)
    if cc >= 90 and key in BWD_TILES_CC90:
        return BWD_TILES_CC90[key]
    return BWD_TILES.get(key)


def bwd_name_expressions(dtype_name, bucket, has_mb, passes, tiles, transforms=(), dbias=False):
    """(dkdv, dq) name expressions (the modifier in natural units: bwd_wide.cu); dbias: dq's
    DBIAS twin (a last template argument, true)."""
    c = _config.c_types(dtype_name)[0]
    mod = _modifiers.score_mod(has_mb, transforms, c, natural=True)
    p = passes if dtype_name == "float32" else 1
    dkdv, dq = tiles
    head = f"{c}, {p}, {bucket}, {bucket}"
    return (f"bwd_wide_dkdv<{head}, {dkdv.block_n}, {dkdv.warps}, {dkdv.mf}, {dkdv.stages}, "
            f"{mod}, {dkdv.min_blocks}, {dkdv.parts}>",
            f"bwd_wide_dq<{head}, {dq.block_n}, {dq.warps}, {dq.mf}, {dq.stages}, {mod}, "
            f"{dq.min_blocks}{', true' if dbias else ''}>")


def bwd_smem_bytes(dtype_name, tiles, bucket):
    """dkdv: K and V of its keys, `stages` Q and dO tiles; dq: Q and dO of its rows, `stages` K and
    V tiles; every row padded by 8 elements (bwd_wide.cu)."""
    e = np.dtype(dtype_name).itemsize
    row = 2 * (bucket + 8) * e  # a K + V (or Q + dO) row pair
    return tuple((16 * t.mf * t.warps + t.stages * t.block_n) * row for t in tiles)


# The float64 backward with a score transform spills on every tile (its dF/dx doubles): the
# generic kernels take it.
NO_BWD_TRANSFORMS = ("float64",)


def _variants(tiles, transforms_with_mb=False):
    """(dtype name, bucket, has_mb, passes, tile, transforms) of every instantiation of a tile
    table: the forward's score transforms keep the tiles of the calls without them; with
    transforms_with_mb (the backward) they take the mask / bias tiles, with or without one."""
    for (dt, b, mb), t in tiles.items():
        for passes in (PASSES.values() if dt == "float32" else (1,)):
            for tf in TRANSFORMS:
                if tf and transforms_with_mb and dt in NO_BWD_TRANSFORMS:
                    continue
                if _modifiers.positional(tf) and (dt, b, True) in POSITIONAL_DECLINED:
                    continue
                for has_mb in ((mb,) if not tf or not transforms_with_mb else
                               (False, True) if mb else ()):
                    yield dt, b, has_mb, passes, t, tf


def instantiations():
    """Every (kernel, dtype name, head dim, source file, name expression) of this path."""
    exprs = {name_expression(*v, sinks=sk): v[:2] for tiles in (TILES, TILES_CC90)
             for v in _variants(tiles) for sk in (False, True)}
    out = [("fwd_wide", dt, b, SOURCE, e) for e, (dt, b) in exprs.items()]
    for table in (BWD_TILES, BWD_TILES_CC90):
        for v in _variants(table, transforms_with_mb=True):
            dkdv, dq = bwd_name_expressions(*v)
            dt, b = v[:2]
            out += [("bwd_wide_dkdv", dt, b, BWD_SOURCE, dkdv),
                    ("bwd_wide_dq", dt, b, BWD_SOURCE, dq)]
            if _takes_dbias(*v):  # the bias's gradient: dq's DBIAS twin
                out.append(("bwd_wide_dq", dt, b, BWD_SOURCE, bwd_name_expressions(*v, True)[1]))
    for dt in DTYPES:
        out.append(("bwd_preprocess", dt, None, _generic.BWD_SOURCE,
                    _generic.name_expression("bwd_preprocess", dt)))
        for tf in TRANSFORMS:
            rows, keys = _generic.lost_name_expressions(dt, False, tf)
            out += [("bwd_lost_rows", dt, None, _generic.LOST_SOURCE, rows),
                    ("bwd_lost_keys", dt, None, _generic.LOST_SOURCE, keys),
                    ("fwd_lost_rows", dt, None, _generic.LOST_SOURCE,
                     _generic.fwd_lost_name_expression(dt, tf))]
    return out


# (dtype, bucket) whose dq DBIAS twin spills (the stores' registers): the generic kernels take
# dbias there. float32 128 (PASSES = 3): 16 bytes on sm_80 and sm_90a; float64 96 / 128: 28 / 20
# bytes on sm_80.
DBIAS_DECLINED = (("float32", 128), ("float64", 96), ("float64", 128))


def _takes_dbias(dt, b, has_mb, passes, t, tf):
    """Whether a backward variant (_variants) has a DBIAS twin: a mask / bias, a chain of DBIAS,
    not DBIAS_DECLINED."""
    return has_mb and tf in DBIAS and (dt, b) not in DBIAS_DECLINED


def cc90_only():
    """Name expressions requested only on compute capability 9.0+ (held to zero spills there)."""
    fwd = {name_expression(*v, sinks=sk) for v in _variants(TILES_CC90) for sk in (False, True)} - {
        name_expression(*v, sinks=sk) for v in _variants(TILES) for sk in (False, True)}
    return fwd | {e for v in _variants(BWD_TILES_CC90, True) for e in bwd_name_expressions(*v)} | {
        bwd_name_expressions(*v, True)[1] for v in _variants(BWD_TILES_CC90, True)
        if _takes_dbias(*v)}


def bucket(p):
    """The head-dim bucket of p, or None when its head dims exceed the dtype's largest."""
    d = max(p.Dk, p.Dv)
    return next((b for b in BUCKETS.get(p.dtype.name, ()) if d <= b), None)


def takes(p):
    """Whether the wide tensor-core forward takes this Problem: float32 / float64, head dims
    within the buckets, scale > 0, lengths within the 32-bit arithmetic, sm_80+, and 16-byte
    rows (unit innermost stride; row strides, matrix offsets and Dk, Dv multiples of 16 bytes;
    aligned bases)."""
    b = bucket(p)
    if b is None or not p.scale > 0 or max(p.Nq, p.Nk) > _config.MMA_MAX_LEN:
        return False
    if (p.Dk * p.dtype.itemsize) % 16 or (p.Dv * p.dtype.itemsize) % 16:
        return False
    info = _runtime.device_info()
    has_mb = p.mask is not None or p.bias is not None
    if _modifiers.positional(_modifiers.names(p)) and (p.dtype.name, b, has_mb) in \
            POSITIONAL_DECLINED:
        return False
    tile = pick_tile(p.dtype.name, b, has_mb, info.cc) if info.cc >= 80 else None
    if tile is None or smem_bytes(p.dtype.name, tile, b) > info.smem_optin:
        return False
    return _runtime.rows_of_16_bytes(p)


_prepared = _memo.Memo(256)


class _Forward:
    """The forward of one layout, prepared (built once per Problem.key): called with a Problem of
    its key, out (BH, Nq, Dv) of p.dtype and lse (BH, Nq) of p.acc_dtype, with p's sinks. A mask's
    tile classes are computed first (on every call: the mask may change in place; the table lives
    until the launch is enqueued). The kernel flags per block the rows it cannot settle
    (kernels_cu/lost_rows.cu), which the lost-row fix then recomputes: without mask / bias the
    ones whose huge logits the folded scale rounds too coarsely (lost lse); with them, rows of
    l = 0, which may be all-masked (empty) or all -inf (NaN): written NaN."""

    def __init__(self, p):
        has_mb = p.mask is not None or p.bias is not None
        b = bucket(p)
        tile = pick_tile(p.dtype.name, b, has_mb, _runtime.device_info().cc)
        passes = PASSES[p.precision] if p.dtype.name == "float32" else 1
        kern = _runtime.get_function(SOURCE, name_expression(
            p.dtype.name, b, has_mb, passes, tile, _modifiers.names(p), p.sinks is not None))
        smem = smem_bytes(p.dtype.name, tile, b)
        _runtime.opt_in(kern, smem)
        self.block_m, self.block_n = 16 * tile.mf * tile.warps, tile.block_n
        blocks = -(-p.Nq // self.block_m) * p.BH  # 1-D, bh-major (fwd_lost_rows reads this order)
        if blocks > _runtime.MAX_GRID_X:
            raise ValueError(f"problem too large for one launch: {blocks} blocks")
        self.launch = _runtime.Launch(kern, (blocks,), (tile.warps * 32,), smem)
        self.carving = _runtime.output_carving(p, 4 * blocks)  # fix: int32 per block, all written
        self.lost = _generic.FwdLostRows(p, blocks, self.block_m,
                                         np.inf if _modifiers.modified(p) else None)
        self.args = _runtime.KeptArgs(p)

    def __call__(self, p):
        _, _, tail = self.args(p)
        # (NO_CLASSES without a mask)
        classes, _table = _mask_tiles.classify(p, self.block_m, self.block_n)
        out, lse, fix = _runtime.carved(self.carving)
        head = (p.q, p.k, p.v, out, lse) + tail
        sinks = _runtime.ptr(p.sinks)
        self.launch(head + (fix, classes, sinks))
        self.lost(head, fix, sinks, ())
        return out, lse


def prepare(p):
    return _prepared.build(p.key, lambda: _Forward(p))


def forward(p):
    return prepare(p)(p)


def _bwd_tiles(p):
    """(bucket, (dkdv tile, dq tile)) of p on the current device, or (bucket, None)."""
    b = bucket(p)  # (a score transform takes the tiles of a mask / bias: its dF/dx registers)
    return b, pick_bwd_tiles(p.dtype.name, b, _modifiers.modified(p), _runtime.device_info().cc)


def bwd_bucket(p):
    """The backward's head-dim bucket of p on the current device, or None."""
    b, tiles = _bwd_tiles(p)
    return None if tiles is None else b


def takes_backward(p):
    """The forward's conditions, within the backward's buckets and shared memory."""
    b, tiles = _bwd_tiles(p)
    if tiles is None or not takes(p) or (p.transforms and p.dtype.name in NO_BWD_TRANSFORMS):
        return False
    if p.dbias and (p.dtype.name, b) in DBIAS_DECLINED:
        return False
    return max(bwd_smem_bytes(p.dtype.name, tiles, b)) <= _runtime.device_info().smem_optin


_bwd_recipes = _memo.Memo(256)


def _bwd_recipe(p):
    """((the Launch of dkdv, of dq), (dkdv tile, dq tile)): the launches of a layout."""
    has_mb = p.mask is not None or p.bias is not None
    b, tiles = _bwd_tiles(p)
    passes = PASSES[p.precision] if p.dtype.name == "float32" else 1
    launches = []
    exprs = bwd_name_expressions(p.dtype.name, b, has_mb, passes, tiles, _modifiers.names(p),
                                 p.dbias)
    for expr, smem, t, n in zip(exprs,
                                bwd_smem_bytes(p.dtype.name, tiles, b), tiles, (p.Nk, p.Nq)):
        kern = _runtime.get_function(BWD_SOURCE, expr)
        _runtime.opt_in(kern, smem)
        blocks = -(-n // (16 * t.mf * t.warps)) * p.BH * t.parts
        if blocks > _runtime.MAX_GRID_X:
            raise ValueError(f"problem too large for one launch: {blocks} blocks")
        launches.append(_runtime.Launch(kern, (blocks,), (t.warps * 32,), smem))
    return tuple(launches), tiles


def backward(p, dout, out, lse, deterministic=False, sink_probs=None):
    """dq (BH, Nq, Dk), dk (BH, Nk, Dk), dv (BH, Nk, Dv) per output (batch, head), in the
    accumulator dtype (with p.dbias also the logits' gradient (BH, Nq, Nk), stored by the dQ
    kernel); deterministic whatever ``deterministic`` says (no atomics). sink_probs
    (with sinks): the rows' sink probabilities, which the lost-row fix overwrites on its rows."""
    import cupy

    launches, (kv_tile, dq_tile) = _bwd_recipes.build(p.key, lambda: _bwd_recipe(p))
    dkdv, dq_k = launches
    args = _runtime.Args(p)
    BH, acc = p.BH, p.acc_dtype
    out = cupy.ascontiguousarray(out).reshape(BH, p.Nq, p.Dv)
    lse = cupy.ascontiguousarray(lse.astype(acc, copy=False)).reshape(BH, p.Nq)
    dout, lse_eff, delta = _generic.preprocess(p, dout, out, lse)  # (16-byte aligned rows)
    dq, dk, dv = _runtime.carve(((BH, p.Nq, p.Dk), acc), ((BH, p.Nk, p.Dk), acc),
                                ((BH, p.Nk, p.Dv), acc))
    ins = (p.q, p.k, p.v, dout, lse_eff, delta)
    # a mask's tile classes for each kernel's tiles, NO_CLASSES without one (the tables live
    # until the launches)
    dkdv_cls, _t1 = _mask_tiles.classify(p, kv_tile.block_n, 16 * kv_tile.mf * kv_tile.warps)
    dq_cls, _t2 = _mask_tiles.classify(p, 16 * dq_tile.mf * dq_tile.warps, dq_tile.block_n)
    dbias = _generic.dbias_buffer(p, acc)  # with p.dbias: the dQ kernel stores it
    dkdv(ins + (dk, dv) + args.tail + (dkdv_cls,))
    dq_k(ins + (dq,) + args.tail + (dq_cls, _runtime.ptr(dbias)))
    _generic.launch_lost(args, dout, out, lse, dq, dk, dv, sink_probs=sink_probs, dbias=dbias)
    return (dq, dk, dv) if dbias is None else (dq, dk, dv, dbias)
