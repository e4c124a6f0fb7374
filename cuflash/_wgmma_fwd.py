"""The Hopper forward (kernels_cu/fwd_wgmma.cu): TMA + wgmma, a producer warpgroup and consumer
warpgroups; float16 / bfloat16, head dims up to 256 (padded to the next multiple of 64 inside the
kernel, TILES), no mask or bias, compute capability 9.0; then the lost-row fix of its flagged
blocks (cuflash._generic), as after fwd_mma.

Path interface (cuflash/_gpu.py): NAME, takes / forward, instantiations, cc90_only.
"""
from collections import namedtuple

import numpy as np

from . import _config, _generic, _mma_fwd, _runtime, _tma
from ._validate import element_strides

NAME = "wgmma"
SOURCE = "fwd_wgmma.cu"
ARCH = "sm_90a"

# Tile: block_n keys per tile, `consumers` warpgroups of 64 query rows each (block_m = 64 *
# consumers), a `stages`-deep K and V ring, the registers each consumer thread gets (setmaxnreg;
# the producer warpgroup keeps 24), and whether the two consumers take turns (ping-pong).
Tile = namedtuple("Tile", "block_n consumers stages consumer_regs pingpong")
TILES = {
    # (Dk, Dv) padded to multiples of 64 -> tile
    (64, 64): Tile(128, 3, 2, 160, False),
    (128, 128): Tile(128, 2, 2, 240, True),
    (192, 128): Tile(128, 2, 2, 240, True),
    (192, 192): Tile(64, 2, 2, 240, True),
    (256, 256): Tile(64, 2, 2, 240, True),
}


def padded(p):
    """The kernel's (DK, DV) for a Problem: its head dims rounded up to multiples of 64."""
    return (-(-p.Dk // 64) * 64, -(-p.Dv // 64) * 64)


def block_m(tile):
    return 64 * tile.consumers


def smem_bytes(dims, tile):
    """Q tile, `stages` K and V tiles (16-bit), the mbarriers and the slack that aligns the tiles
    to 1024 bytes."""
    dk, dv = dims
    return (block_m(tile) * dk + tile.stages * tile.block_n * (dk + dv)) * 2 \
        + 8 * (1 + 4 * tile.stages) + 1024


def name_expression(dtype, dims, tile):
    b = "true" if tile.pingpong else "false"
    return (f"fwd_wgmma<{_config.c_types(dtype)[0]}, {dims[0]}, {dims[1]}, {tile.block_n}, "
            f"{tile.consumers}, {tile.stages}, {tile.consumer_regs}, {b}>")


def instantiations():
    """Every (kernel, dtype name, head dim, source file, name expression) of this path."""
    return [("fwd_wgmma", dt, dims[0], SOURCE, name_expression(dt, dims, t))
            for dt in _config.MMA_DTYPES for dims, t in TILES.items()]


def cc90_only():
    """Every expression of this path runs on compute capability 9.0 only."""
    return {inst[-1] for inst in instantiations()}


def _grid_shape(p):
    H = p.lead[-1] if p.lead else 1
    return p.BH // H, H


_MAP_CACHE_SIZE = 256
_map_cache = {}


def _maps(p, tile):
    """(q, k, v tensor maps, (hdiv, bmul) per input) or None where a map cannot describe them;
    memoized by the inputs' addresses and layouts (the host work of a call repeats with them)."""
    key = (tile, p.lead, p.Nq, p.Nk) + tuple((x.data.ptr, x.shape, x.strides, x.dtype.str)
                                             for x in (p.q, p.k, p.v))
    if key not in _map_cache:
        if len(_map_cache) >= _MAP_CACHE_SIZE:
            _map_cache.pop(next(iter(_map_cache)))  # oldest first
        _map_cache[key] = _encode_maps(p, tile)
    return _map_cache[key]


def _encode_maps(p, tile):
    B, H = _grid_shape(p)
    maps, coords = [], []
    for x, x_map, n, rows in ((p.q, p.q_map, p.Nq, block_m(tile)),
                              (p.k, p.k_map, p.Nk, tile.block_n),
                              (p.v, p.v_map, p.Nk, tile.block_n)):
        lay = _tma.head_layout(x, x_map, B, H)
        if lay is None:
            return None
        hdiv, bmul, Hx, Bx, sh, sb = lay
        es = element_strides(x)
        item = x.dtype.itemsize
        rs = es[-2] * item
        sh = sh * item if Hx > 1 else rs * n
        sb = sb * item if Bx > 1 else sh * Hx
        if es[-1] != 1 or min(rs, sh, sb) <= 0 or (rs | sh | sb) % 16 or x.data.ptr % 16:
            return None
        m = _tma.tiled_map(x.dtype.name, x.data.ptr, (x.shape[-1], n, Hx, Bx), (rs, sh, sb),
                           (64, rows, 1, 1))
        if m is None:
            return None
        maps.append(m)
        coords.append((hdiv, bmul))
    return maps, coords


def takes(p):
    """Whether the Hopper forward takes this Problem."""
    dims = padded(p)
    if dims not in TILES or p.Dv % 8 or p.mask is not None or p.bias is not None:
        return False
    if p.dtype.name not in _config.MMA_DTYPES or not p.scale > 0:
        return False  # the kernel folds the scale into exp2 and takes maxima of unscaled scores
    if max(p.Nq, p.Nk) > _mma_fwd.MAX_LEN or not _runtime.wgmma_available():
        return False
    tile = TILES[dims]
    if smem_bytes(dims, tile) > _runtime.device_info().smem_optin:
        return False
    return _maps(p, tile) is not None


def forward(p):
    """out (BH, Nq, Dv) of p.dtype and lse (BH, Nq) float32; every row settled, the ones the kernel
    flags by the lost-row fix."""
    import cupy

    dims = padded(p)
    tile = TILES[dims]
    maps, coords = _maps(p, tile)
    args = _runtime.Args(p)
    out = _runtime.empty((p.BH, p.Nq, p.Dv), dtype=p.dtype)
    lse = _runtime.empty((p.BH, p.Nq), dtype=p.acc_dtype)
    kern = _runtime.get_function(SOURCE, name_expression(p.dtype, dims, tile), arch=ARCH)
    smem = smem_bytes(dims, tile)
    _runtime.opt_in(kern, smem)
    blocks = -(-p.Nq // block_m(tile)) * p.BH
    if blocks > _runtime.MAX_GRID_X:
        raise ValueError(f"problem too large for one launch: {blocks} blocks")
    fix = cupy.empty(blocks, dtype=np.int32)  # every entry written by fwd_wgmma
    _, H = _grid_shape(p)
    i32 = np.int32
    (qd, qm), (kd, km), (vd, vm) = coords
    kern((blocks,), ((tile.consumers + 1) * 128,),
         tuple(maps) + (out, lse, _runtime.ptr(args.kv_lens), fix, i32(H), i32(p.Nq), i32(p.Nk),
                        i32(p.Dv), np.float32(p.scale), i32(p.left), i32(p.right), i32(bool(p.bottom_right)),
                        i32(qd), i32(kd), i32(vd), i32(qm), i32(km), i32(vm)),
         shared_mem=smem)
    _generic.launch_fwd_lost(args, out, lse, fix, block_m(tile))
    return out, lse
