"""The Hopper forward (kernels_cu/fwd_wgmma.cu): TMA + wgmma, a producer warpgroup and consumer
warpgroups; float16 / bfloat16, head dims up to 256 (padded to the next multiple of 64 inside the
kernel, TILES), any mask and bias, compute capability 9.0; one launch, which settles at its end
the rows its float arithmetic cannot (lost_rows.cuh fwd_fix_rows, as fwd_mma).

float32, head dims up to 128, a mask and bias read from global memory (MB_GLOBAL: the float32
tiles leave no shared memory for staged ones), no transform, sinks or dropout (F32_TILES): one TF32
product per GEMM with precision="high", three (hi and lo parts: as exact as float32) with
"highest"; three launches of tf32_operand first, which copy q, k and v^T rounded to TF32 (split
in two parts for "highest": the kernel's operands, fwd_wgmma.cu), then the kernel on the copies.

Path interface (cuflash/_gpu.py): NAME, takes / forward, instantiations, cc90_only.
"""
from collections import namedtuple

import numpy as np

from . import _broadcast, _config, _generic, _mask_tiles, _memo, _modifiers, _runtime, _tma
from ._validate import element_strides, key_range

NAME = "wgmma"
TRANSFORMS = _modifiers.SINGLE  # the chains of score transforms its kernels take (cuflash/_gpu.py)
DROPOUT = True  # its kernels take dropout (fwd_wgmma.cu's Drop), without transforms or sinks (takes)
SINKS = True  # whether its forward kernels join the sinks themselves (fwd_wgmma.cu SINKS)
SOURCE = "fwd_wgmma.cu"
ARCH = "sm_90a"

# Tile: block_n keys per tile, `consumers` warpgroups of 64 query rows each (block_m = 64 *
# consumers), a `stages`-deep K and V ring, the registers each consumer thread gets (setmaxnreg;
# the producer warpgroup keeps 24), and whether the two consumers take turns (ping-pong).
Tile = namedtuple("Tile", "block_n consumers stages consumer_regs pingpong")
_T = Tile
TILES = {
    # ((Dk, Dv) padded to multiples of 64, has mask or bias) -> tile. With a mask or bias: fewer
    # keys per tile (the modifier's registers: zero spills; the staged mask and bias rings: shared
    # memory) and two consumers at D=64.
    ((64, 64), False): _T(128, 3, 2, 160, False),
    ((128, 128), False): _T(128, 2, 2, 240, True),
    ((192, 128), False): _T(128, 2, 2, 240, True),
    ((192, 192), False): _T(64, 2, 2, 240, True),
    ((256, 256), False): _T(64, 2, 2, 240, True),
    ((64, 64), True): _T(64, 2, 2, 240, True),
    ((128, 128), True): _T(64, 2, 2, 240, True),
    ((192, 128), True): _T(64, 2, 2, 240, True),
    ((192, 192), True): _T(64, 2, 2, 240, True),
    ((256, 256), True): _T(32, 2, 2, 240, True),
}
# With a score transform and no mask / bias, where the table's tile spills (sm_90a ptxas): at D=64
# 64 keys per tile (128 spilled: ALiBi 484 bytes, float16's softcap 220) but for the (dtype,
# transforms) of TRANSFORM_TILES_SPARED, whose 128-key tile compiles spill-free: bfloat16's softcap
# (tanh.approx), 0.74-0.77 of the call without it against 0.68-0.71 with 64 keys (H100,
# benchmarks/RESULTS.md twenty-ninth section).
TRANSFORM_TILES = {
    ((64, 64), False): _T(64, 3, 2, 160, False),
}
TRANSFORM_TILES_SPARED = {("bfloat16", ("softcap",))}
# float32: ((Dk, Dv) padded, TF32 passes) -> tile. S and P take 4 bytes a key per row (16-bit: P
# 2), so fewer keys per tile at D=128; shared memory: float32 Q, K and V^T tiles, two parts each
# with three passes (hi, lo), which also keep a fresh P V accumulator per tile (DV / 2 registers)
# and P's lo part: at D=128 one consumer of 32-key tiles.
F32_TILES = {
    ((64, 64), 1): _T(128, 2, 2, 240, True),
    ((128, 128), 1): _T(64, 2, 2, 240, True),
    ((64, 64), 3): _T(64, 2, 2, 240, True),
    ((128, 128), 3): _T(32, 1, 2, 240, False),
}
# With a mask or bias, where F32_TILES' tile spills (the modifier's registers; sm_90a ptxas)
F32_MB_TILES = {((64, 64), 1): _T(64, 2, 2, 240, True)}
# float32 precision -> TF32 passes per GEMM (mma.cuh WideMma)
F32_PASSES = {"high": 1, "highest": 3}
del _T
DIMS = sorted({dims for dims, _ in TILES})

# How the kernel reads a mask / bias (fwd_wgmma.cu MB_*): none; from global memory; staged tiles.
# MB_CLASSES: staged, with the mask's tile classes (cuflash._mask_tiles): hidden tiles skipped.
MB_NONE, MB_GLOBAL, MB_STAGED, MB_CLASSES = 0, 1, 2, 3
# InputHeads (fwd_wgmma.cu): per input q, k, v, mask, bias, head h / hdiv, batch b * bmul
HEADS_DTYPE = np.dtype([("hdiv", "<i4", (5,)), ("bmul", "<i4", (5,))])


# At D = 64 the 192-row tiles lose to fwd_mma's on rows that see few keys under a causal or window
# bound (mostly diagonal tiles, one block per SM): fwd_mma runs those whose rows see fewer than
# SHORT_ROW_KEYS keys on average (benchmarks/RESULTS.md, tenth session).
SHORT_ROW_KEYS = 768


def pick_tile(dims, mb, transforms=(), dtype=None):
    """The tile of a mask / bias reading mb (score transforms, by name, keep the tile of the call
    without them, but where TRANSFORM_TILES says otherwise for their dtype)."""
    spared = (_config.dtype_name(dtype), tuple(transforms)) in TRANSFORM_TILES_SPARED
    if transforms and not spared and (dims, mb != MB_NONE) in TRANSFORM_TILES:
        return TRANSFORM_TILES[(dims, mb != MB_NONE)]
    return TILES[(dims, mb != MB_NONE)]


def padded(p):
    """The kernel's (DK, DV) for a Problem: its head dims rounded up to multiples of 64."""
    return (-(-p.Dk // 64) * 64, -(-p.Dv // 64) * 64)


def block_m(tile):
    return 64 * tile.consumers


def smem_bytes(dims, tile, mb, itemsize=2):
    """Q tile, `stages` K and V tiles (of itemsize bytes), the staged mask (bytes) and bias
    (float32) rings, the mbarriers and the slack that aligns the tiles to 1024 bytes."""
    dk, dv = dims
    staged = block_m(tile) * tile.block_n * (1 + 4) if mb >= MB_STAGED else 0
    return (block_m(tile) * dk + tile.stages * tile.block_n * (dk + dv)) * itemsize \
        + tile.stages * staged + 8 * (1 + 4 * tile.stages) + 1024


def name_expression(dtype, dims, tile, mb, transforms=(), sinks=False, dropout=False,
                    passes=None):
    """transforms: the score transforms' names (cuflash/_modifiers.py), a template argument when
    there are any or sinks or dropout; sinks: whether the kernel joins attention sinks (then a
    template argument, true); dropout: the DropoutArgs instantiation (kernels_cu/philox.cuh);
    passes: float32's TF32 passes (PASSES; 1, its default, is spelled before any transform)."""
    b = "true" if tile.pingpong else "false"
    # F, then LostF (the transforms as its end settles rows: lost_rows.cuh), SINKS and Drop
    f = (f", {_modifiers.transform(transforms, 'float', False, _config.dtype_name(dtype))}"
         f", {_generic.lost_transform(transforms)}"
         if transforms or sinks or dropout else "") + (", true" if sinks else "")
    if dropout:
        f += f"{'' if sinks else ', false'}, DropoutArgs"
    if passes is not None or f:
        f = f", {passes or 1}{f}"
    return (f"fwd_wgmma<{_config.c_types(dtype)[0]}, {dims[0]}, {dims[1]}, {tile.block_n}, "
            f"{tile.consumers}, {tile.stages}, {tile.consumer_regs}, {b}, {mb}{f}>")


def instantiations():
    """Every (kernel, dtype name, head dim, source file, name expression) of this path."""
    main = [("fwd_wgmma", dt, dims[0], SOURCE,
             name_expression(dt, dims, pick_tile(dims, mb, tf, dt), mb, tf, sk))
            for dt in _config.MMA_DTYPES for dims in DIMS for tf in TRANSFORMS
            for mb in (MB_NONE, MB_GLOBAL, MB_STAGED, MB_CLASSES) for sk in (False, True)]
    # with dropout: no transform, no sinks (takes leaves those to fwd_mma or the generic kernels)
    main += [("fwd_wgmma", dt, dims[0], SOURCE,
              name_expression(dt, dims, pick_tile(dims, mb), mb, (), False, True))
             for dt in _config.MMA_DTYPES for dims in DIMS
             for mb in (MB_NONE, MB_GLOBAL, MB_STAGED, MB_CLASSES)]
    main += [("fwd_wgmma", "float32", dims[0], SOURCE,
              name_expression("float32", dims, f32_tile(dims, passes, mb), mb, passes=passes))
             for dims, passes in F32_TILES for mb in (MB_NONE, MB_GLOBAL)]
    main += [("tf32_operand", "float32", None, SOURCE, _operand_expression(b, passes))
             for b in (False, True) for passes in sorted(set(F32_PASSES.values()))]
    tiles = {pick_tile(dims, MB_STAGED) for dims in DIMS}
    masks = {_mask_tiles.expression(block_m(t), t.block_n) for t in tiles}
    return main + [("mask_tile_classes", None, None, _mask_tiles.SOURCE, e) for e in sorted(masks)]


def cc90_only():
    """Every fwd_wgmma expression runs on compute capability 9.0 only."""
    return {inst[-1] for inst in instantiations() if inst[0] in ("fwd_wgmma", "tf32_operand")}


# Launch: the kernel's choice of mask / bias reading, the 5 tensor maps (q, k, v, mask, bias),
# InputHeads, and the rows per staged mask / bias tile (0: absent, 1: one row for every query).
Launch = namedtuple("Launch", "mb maps heads mask_rows bias_rows")
_launches = _memo.Memo(256)
# A Launch without its addresses: the TiledMap of each input (q, k, v, mask, bias; None where
# absent or read from global memory) and the rest of the Launch.
MapsLayout = namedtuple("MapsLayout", "mb tiled heads mask_rows bias_rows")
_maps_layouts = _memo.Memo(256)


def _launch(p, dims):
    """The Launch of a Problem, or None where no tensor map describes q, k or v; memoized by the
    inputs' addresses and the Problem's signature (the maps hold the addresses; the signature
    fixes the layouts and the bounds, which decide whether the mask / bias may be staged:
    _key_tiles_aligned; a causal call on the arrays of an unbounded one staged them and
    faulted, when the key held the layouts only)."""
    ptrs = tuple(None if x is None else x.data.ptr for x in (p.q, p.k, p.v, p.mask, p.bias))
    key = None if p.key is None else (dims, p.key) + ptrs
    return _launches.build(key, lambda: _encode(p, dims, ptrs))


def _encode(p, dims, ptrs):
    """The Launch of p's inputs at addresses `ptrs`: its MapsLayout (memoized by the signature and
    the addresses' 16-byte residues, all that the driver's checks and the staging rule read of
    the addresses) with each map encoded at its address (new arrays of a known layout, as a
    training loop makes, cost the driver's encoding alone)."""
    key = None if p.key is None else (dims, p.key) + tuple(None if a is None else a % 16
                                                           for a in ptrs)
    lay = _maps_layouts.build(key, lambda: _maps_layout(p, dims))
    if lay is None:
        return None
    maps = []
    for tiled, ptr in zip(lay.tiled, ptrs):
        m = _tma.NO_MAP if tiled is None else tiled.at(ptr)
        if m is None:
            return None
        maps.append(m)
    return Launch(lay.mb, tuple(maps), lay.heads, lay.mask_rows, lay.bias_rows)


def _tensor_map(x, x_map, B, H, rows, cols, box, swizzle, one_row_ok=False):
    """(TiledMap, hdiv, bmul, rows per box) of input x read as (cols, rows, heads, batches) in
    boxes of box = (columns, rows) elements, or None (also where the driver refuses x's map).
    With one_row_ok an input that is the same for every row (row stride 0) is read as one row
    (rows per box 1)."""
    lay = _tma.head_layout(x, x_map, B, H)
    if lay is None or x.data.ptr % 16:
        return None
    hdiv, bmul, Hx, Bx, sh, sb = lay
    es = element_strides(x)
    item = x.dtype.itemsize
    rs = es[-2] * item
    one_row = rs == 0
    if one_row and not one_row_ok:
        return None
    if one_row:  # any valid stride: the row coordinate is always 0
        rows, rs = 1, -(-cols * item // 16) * 16
    sh = sh * item if Hx > 1 else rs * rows
    sb = sb * item if Bx > 1 else sh * Hx
    if es[-1] != 1 or min(rs, sh, sb) <= 0 or (rs | sh | sb) % 16:
        return None
    box_rows = 1 if one_row else box[1]
    tiled = _tma.TiledMap(x.dtype.name, (cols, rows, Hx, Bx), (rs, sh, sb),
                          (box[0], box_rows, 1, 1), swizzle)
    return None if tiled.at(x.data.ptr) is None else (tiled, hdiv, bmul, box_rows)


def mean_row_keys(p, samples=17):
    """The mean number of keys a query row sees by position alone (L = Nk), over `samples` rows
    spread evenly (_validate.key_range)."""
    rows = (p.Nq - 1) * np.arange(samples) // (samples - 1)
    lo, hi = key_range(rows, p.Nk, p.Nq, p.left, p.right, p.bottom_right)
    return float(np.maximum(hi - lo + 1, 0).sum()) / samples


def short_bounded_rows(p, dims):
    """Whether fwd_mma is the faster forward (SHORT_ROW_KEYS)."""
    bounded = min(p.left, p.right) < p.Nq + p.Nk
    return dims == (64, 64) and bounded and mean_row_keys(p) < SHORT_ROW_KEYS


def _key_tiles_aligned(p):
    """Whether every key tile of every block starts at a non-negative multiple of 16 keys, which
    the staged mask and bias copies need (their key coordinate is innermost: off 16 bytes the copy
    faulted with an illegal instruction on the H200; negative ones were never tried there): every
    query sees keys 0 .. L - 1 (no causal or window bound) and every L is 0 or a multiple of 16 of
    at least 64 keys (the widest staged tile, which ends at L)."""
    unbounded = p.Nq + p.Nk
    if p.left < unbounded or p.right < unbounded:
        return False
    widest = max(t.block_n for (_, has_mb), t in TILES.items() if has_mb)
    if p.lens_device is not None:
        return False  # lengths on the device: any value
    lens = [p.Nk] if p.kv_lens is None else np.unique(p.kv_lens)
    return all(x == 0 or (x % 16 == 0 and x >= widest) for x in map(int, lens))


def _maps_layout(p, dims):
    """p's MapsLayout (its arrays' addresses only tried: _encode encodes the call's)."""
    B, H = _mask_tiles.grid_shape(p)
    tile = pick_tile(dims, MB_NONE if p.mask is None and p.bias is None else MB_STAGED,
                     _modifiers.names(p), p.dtype)
    bm, bn = block_m(tile), tile.block_n
    found = [_tensor_map(x, x_map, B, H, n, x.shape[-1], (64, rows), _tma.SWIZZLE_128B)
             for x, x_map, n, rows in ((p.q, p.q_map, p.Nq, bm), (p.k, p.k_map, p.Nk, bn),
                                       (p.v, p.v_map, p.Nk, bn))]
    if None in found:
        return None
    mb = MB_NONE if p.mask is None and p.bias is None else \
        (MB_STAGED if _key_tiles_aligned(p) else MB_GLOBAL)
    staged = []  # mask, bias: (map, hdiv, bmul, rows per box) or None where absent
    for x, box, swizzle in ((p.mask, (bn, bm), _tma.SWIZZLE_NONE),
                            (p.bias, (32, bm), _tma.SWIZZLE_128B)):
        if x is None:
            staged.append(None)
            continue
        x_map = _broadcast.lead_offsets(p.lead, p.lead, element_strides(x)[:-2])
        m = _tensor_map(x, x_map, B, H, p.Nq, p.Nk, box, swizzle, one_row_ok=True)
        mb = MB_STAGED if m is not None and mb != MB_GLOBAL else MB_GLOBAL
        staged.append(m)
    if mb == MB_GLOBAL:
        staged = [None, None]
    elif _mask_tiles.layout(p) is not None:  # a staged mask that can be classified
        mb = MB_CLASSES
    heads = np.zeros((), dtype=HEADS_DTYPE)
    tiled = []
    for x, found_x in enumerate(found + staged):
        m, hdiv, bmul = found_x[:3] if found_x is not None else (None, 1, 0)
        tiled.append(m)
        heads["hdiv"][x], heads["bmul"][x] = hdiv, bmul
    rows = [0 if x is None else x[3] for x in staged]
    return MapsLayout(mb, tuple(tiled), heads[()], rows[0], rows[1])


def takes(p):
    """Whether the Hopper forward takes this Problem."""
    if p.dtype.name == "float32":
        return _takes_f32(p)
    dims = padded(p)
    if dims not in DIMS or p.Dv % 8:
        return False
    if p.dtype.name not in _config.MMA_DTYPES or not p.scale > 0:
        return False  # the kernel folds the scale into exp2 and takes maxima of unscaled scores
    if p.dropout_p and (p.transforms or p.sinks is not None):
        return False  # dropout with a transform or sinks: fwd_mma or the generic kernels
    if max(p.Nq, p.Nk) > _config.MMA_MAX_LEN or not _runtime.wgmma_available():
        return False
    if short_bounded_rows(p, dims) and _runtime.overrides().path != NAME:
        return False
    launch = _launch(p, dims)
    if launch is None:
        return False
    return smem_bytes(dims, pick_tile(dims, launch.mb, _modifiers.names(p), p.dtype),
                      launch.mb) <= \
        _runtime.device_info().smem_optin


_prepared = _memo.Memo(256)


def _recipe(p, dims, launch):
    """(the kernel's Launch, blocks, block_m, tile, its four runs of numbers) of a layout (and
    of its staging, `launch`: the numbers of the maps' rows)."""
    mb = launch.mb
    names = _modifiers.names(p)
    tile = pick_tile(dims, mb, names, p.dtype)
    kern = _runtime.get_function(SOURCE, name_expression(p.dtype, dims, tile, mb, names,
                                                         p.sinks is not None,
                                                         bool(p.dropout_p)), arch=ARCH)
    smem = smem_bytes(dims, tile, mb)
    _runtime.opt_in(kern, smem)
    blocks = -(-p.Nq // block_m(tile)) * p.BH
    if blocks > _runtime.MAX_GRID_X:
        raise ValueError(f"problem too large for one launch: {blocks} blocks")
    _, H = _mask_tiles.grid_shape(p)
    return (_runtime.Launch(kern, (blocks,), ((tile.consumers + 1) * 128,), smem), blocks,
            block_m(tile), tile, _numbers(p, H, mb, launch.mask_rows, launch.bias_rows))


def _numbers(p, H, mb, mask_rows, bias_rows):
    """fwd_wgmma's four runs of numbers for a layout (H: the output's heads; mb and the rows per
    staged mask / bias tile: the Launch's)."""
    i32 = np.int32
    strides = _runtime.Args(p).strides
    # the kernel's own parameter list (not AttnArgs: the struct's fields cost the generic
    # kernels registers, and this one is kept as it was measured); its numbers, per layout:
    return ((i32(H), i32(p.Nq), i32(p.Nk), i32(p.Dv), np.float32(p.scale), i32(p.left),
             i32(p.right), i32(bool(p.bottom_right)), i32(mask_rows), i32(bias_rows)),
            (i32(p.BH),) + tuple(np.int64(x) for x in strides[3:]),
            tuple(np.float64(x) for x in _modifiers.scalars(p)),
            # the end's lost-row fix (fwd_fix_rows): q, k, v's row strides, Dk, the scale in
            # double and the |lse| limit (with a modifier only rows of l = 0, which the
            # kernel flags, as fwd_mma's: all masked, empty, or all -inf, NaN)
            tuple(np.int64(x) for x in strides[:3])
            + (i32(p.Dk), np.float64(p.scale),
               np.float64(np.inf if mb != MB_NONE or p.transforms
                          else _config.lost_lse_limit(p.acc_dtype))))


class _Forward:
    """The forward of one layout and staging (_launch's mb and rows), prepared: called with a
    Problem of its key, out (p.out_shape, p.dtype) and lse (p.lse_shape, float32), with p's
    sinks; every row settled, in one launch. The tensor maps are the call's arrays' (_launch,
    memoized by their addresses)."""

    def __init__(self, p, dims, launch):
        self.dims = dims
        (self.run, _, self.block_m, self.tile,
         (self.sizes, self.strides, self.scalars, self.fixing)) = _recipe(p, dims, launch)
        self.carving = _runtime.output_carving(p)
        self.args = _runtime.KeptArgs(p)

    def __call__(self, p):
        launch = _launch(p, self.dims)
        kv_lens, offsets, _ = self.args(p)
        out, lse = _runtime.carved_outputs(self.carving, p)
        # the classes table must live until the launch is enqueued
        classes, _table = (_mask_tiles.classify(p, self.block_m, self.tile.block_n)
                           if launch.mb == MB_CLASSES else (_mask_tiles.NO_CLASSES, None))
        sinks, drop = _runtime.ptr(p.sinks), _runtime.dropout_args(p)
        self.run(launch.maps + (launch.heads, out, lse, _runtime.ptr(kv_lens))
                 + self.sizes + (offsets, _runtime.ptr(p.mask), _runtime.ptr(p.bias))
                 + self.strides + (classes,) + self.scalars
                 + (_runtime.ptr(_modifiers.table(p)), sinks, p.q, p.k, p.v) + self.fixing
                 + drop)
        return out, lse


def prepare(p):
    """The prepared forward of p's layout and staging (_Forward, float32 _Forward32)."""
    dims = padded(p)
    if p.dtype.name == "float32":
        return _prepared.build(None if p.key is None else (p.key, "f32"),
                               lambda: _Forward32(p, dims))
    launch = _launch(p, dims)
    key = None if p.key is None else (p.key, launch.mb, launch.mask_rows, launch.bias_rows)
    return _prepared.build(key, lambda: _Forward(p, dims, launch))


def forward(p):
    return prepare(p)(p)


# ---- float32 (one TF32 pass, precision="high"; three, "highest") ---------------------------------

# How tf32_operand reads one of q, k, v: its matrices' (hdiv, bmul, Hx, Bx) as _tma.head_layout
# gives them and its element strides (row, column, head, batch).
Operand = namedtuple("Operand", "hdiv bmul heads batches rs cs hs bs")
_f32_layouts = _memo.Memo(256)


def _f32_layout(p):
    """(Operand of q, k, v) or None where a float32 call's matrices are not at b * sb + h * sh
    (_tma.head_layout); memoized by the signature."""
    def build():
        B, H = _mask_tiles.grid_shape(p)
        ops = []
        for x, x_map in ((p.q, p.q_map), (p.k, p.k_map), (p.v, p.v_map)):
            lay = _tma.head_layout(x, x_map, B, H)
            if lay is None:
                return None
            hdiv, bmul, Hx, Bx, sh, sb = lay
            es = element_strides(x)
            ops.append(Operand(hdiv, bmul, Hx, Bx, es[-2], es[-1], sh, sb))
        return tuple(ops)

    return _f32_layouts.build(p.key, build)


def _takes_f32(p):
    dims = padded(p)
    passes = F32_PASSES[p.precision]
    if (dims, passes) not in F32_TILES or p.Dv % 4 or not p.scale > 0:
        return False
    if (p.transforms or p.sinks is not None
            or p.dropout_p or p.pages is not None):
        return False
    # (tf32_operand's grid: row tiles of 32 along y)
    if max(p.Nq, p.Nk) > min(_config.MMA_MAX_LEN, 32 * 65535) or not _runtime.wgmma_available():
        return False
    if _f32_layout(p) is None:
        return False
    return smem_bytes(dims, F32_TILES[(dims, passes)], MB_NONE, 4 * (1 + (passes == 3))) <= \
        _runtime.device_info().smem_optin


def f32_tile(dims, passes, mb):
    """The float32 tile of (Dk, Dv) padded, TF32 passes and mask / bias reading."""
    if mb != MB_NONE and (dims, passes) in F32_MB_TILES:
        return F32_MB_TILES[(dims, passes)]
    return F32_TILES[(dims, passes)]


def _operand_expression(transpose, passes):
    return f"tf32_operand<{'true' if transpose else 'false'}, {2 if passes == 3 else 1}>"


def _ceil(a, b):
    return -(-a // b)


class _Forward32:
    """The float32 forward of one layout, prepared: tf32_operand's three copies (q and k rounded
    to TF32, rows padded to 4 floats; v^T rounded and key-permuted, rows of the keys padded to
    8; each as hi and lo matrices with three passes), then fwd_wgmma on their tensor maps (one
    allocation per call, its maps encoded per call)."""

    def __init__(self, p, dims):
        self.dims = dims
        passes = F32_PASSES[p.precision]
        parts = 2 if passes == 3 else 1
        mb = MB_NONE if p.mask is None and p.bias is None else MB_GLOBAL
        tile = f32_tile(dims, passes, mb)
        ops = _f32_layout(p)
        B, H = _mask_tiles.grid_shape(p)
        kern = _runtime.get_function(SOURCE, name_expression(p.dtype, dims, tile, mb,
                                                             passes=passes), arch=ARCH)
        smem = smem_bytes(dims, tile, MB_NONE, 4 * parts)
        _runtime.opt_in(kern, smem)
        blocks = _ceil(p.Nq, block_m(tile)) * p.BH
        if blocks > _runtime.MAX_GRID_X:
            raise ValueError(f"problem too large for one launch: {blocks} blocks")
        self.run = _runtime.Launch(kern, (blocks,), ((tile.consumers + 1) * 128,), smem)
        i32, i64 = np.int32, np.int64
        self.sizes, self.strides, self.scalars, self.fixing = _numbers(p, H, mb, 0, 0)
        # the copies: (rows, cols, ld) per operand, v transposed
        ldk = _ceil(p.Dk, 4) * 4
        shapes = ((p.Nq, p.Dk, ldk), (p.Nk, p.Dk, ldk), (p.Nk, p.Dv, _ceil(p.Nk, 8) * 8))
        nbytes = [parts * op.heads * op.batches * (cols if n == 2 else rows) * ld * 4
                  for n, (op, (rows, cols, ld)) in enumerate(zip(ops, shapes))]
        self.workspace = _runtime.carving(*nbytes)
        self.prep = []
        for n, (op, (rows, cols, ld)) in enumerate(zip(ops, shapes)):
            transpose = n == 2
            k = _runtime.get_function(SOURCE, _operand_expression(transpose, passes), arch=ARCH)
            grid = (op.heads * op.batches * _ceil(cols if transpose else ld, 32),
                    _ceil(ld if transpose else rows, 32))
            numbers = (i32(rows), i32(cols), i32(op.heads), i64(op.rs), i64(op.cs), i64(op.hs),
                       i64(op.bs), i32(ld))
            self.prep.append((_runtime.Launch(k, grid, (32, 8)), numbers,
                              (i32(B), i32(H), i32(op.hdiv), i32(op.bmul))))
        # tensor maps of the copies: (columns, rows, heads x parts, batches), boxes of 32 floats
        self.tiled = []
        for n, (op, (rows, cols, ld)) in enumerate(zip(ops, shapes)):
            heads = op.heads * parts
            dims4 = (ld, cols, heads, op.batches) if n == 2 else (cols, rows, heads, op.batches)
            row_bytes = ld * 4
            mat = row_bytes * (cols if n == 2 else rows)
            box_rows = dims[1] if n == 2 else (block_m(tile) if n == 0 else tile.block_n)
            self.tiled.append(_tma.TiledMap("float32", dims4, (row_bytes, mat, mat * heads),
                                            (32, box_rows, 1, 1), _tma.SWIZZLE_128B))
        heads = np.zeros((), dtype=HEADS_DTYPE)
        for x, op in enumerate(ops):
            heads["hdiv"][x], heads["bmul"][x] = op.hdiv, op.bmul
        heads["hdiv"][3:], heads["bmul"][3:] = 1, 0
        self.heads = heads[()]
        self.carving = _runtime.output_carving(p)
        self.args = _runtime.KeptArgs(p)

    def __call__(self, p):
        kv_lens, offsets, _ = self.args(p)
        out, lse = _runtime.carved_outputs(self.carving, p)
        copies = _runtime.carved(self.workspace)
        lens = _runtime.ptr(kv_lens)
        maps = []
        for x, y, tiled, (run, numbers, grid) in zip((p.q, p.k, p.v), copies, self.tiled,
                                                      self.prep):
            run((x, y) + numbers + (lens if x is p.v else _runtime.NULL,) + grid)
            m = tiled.at(y.ptr)
            if m is None:
                raise RuntimeError("fwd_wgmma: the driver refused a float32 tensor map")
            maps.append(m)
        self.run(tuple(maps) + (_tma.NO_MAP, _tma.NO_MAP, self.heads, out, lse, lens)
                 + self.sizes + (offsets, _runtime.ptr(p.mask), _runtime.ptr(p.bias))
                 + self.strides
                 + (_mask_tiles.NO_CLASSES,) + self.scalars
                 + (_runtime.ptr(_modifiers.table(p)), _runtime.NULL, p.q, p.k, p.v)
                 + self.fixing)
        return out, lse
