"""The Hopper forward (kernels_cu/fwd_wgmma.cu): TMA + wgmma, a producer warpgroup and consumer
warpgroups; float16 / bfloat16, Dk == Dv in TILES, no mask or bias, compute capability 9.0; then
the lost-row fix of its flagged blocks (cuflash._generic), as after fwd_mma.

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
# consumers), a `stages`-deep K and V ring, and the registers each consumer thread gets
# (setmaxnreg; the producer warpgroup keeps 24).
Tile = namedtuple("Tile", "block_n consumers stages consumer_regs")
TILES = {
    64: Tile(128, 2, 2, 240),
    128: Tile(128, 2, 2, 240),
}


def block_m(tile):
    return 64 * tile.consumers


def smem_bytes(head_dim, tile):
    """Q tile, `stages` K and V tiles (16-bit), the mbarriers and the slack that aligns the tiles
    to 1024 bytes."""
    return (block_m(tile) + 2 * tile.stages * tile.block_n) * head_dim * 2 \
        + 8 * (1 + 4 * tile.stages) + 1024


def name_expression(dtype, head_dim, tile):
    return (f"fwd_wgmma<{_config.c_types(dtype)[0]}, {head_dim}, {tile.block_n}, "
            f"{tile.consumers}, {tile.stages}, {tile.consumer_regs}>")


def instantiations():
    """Every (kernel, dtype name, head dim, source file, name expression) of this path."""
    return [("fwd_wgmma", dt, d, SOURCE, name_expression(dt, d, t))
            for dt in _config.MMA_DTYPES for d, t in TILES.items()]


def cc90_only():
    """Every expression of this path runs on compute capability 9.0 only."""
    return {inst[-1] for inst in instantiations()}


def _grid_shape(p):
    H = p.lead[-1] if p.lead else 1
    return p.BH // H, H


def _maps(p, tile):
    """(q, k, v tensor maps, (hdiv, bmul) per input) or None where a map cannot describe them."""
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
    if p.Dk not in TILES or p.mask is not None or p.bias is not None:
        return False
    if not _runtime.wgmma_available() or not _mma_fwd.tensor_core_layout(p):
        return False
    tile = TILES[p.Dk]
    if smem_bytes(p.Dk, tile) > _runtime.device_info().smem_optin:
        return False
    return _maps(p, tile) is not None


def forward(p):
    """out (BH, Nq, Dv) of p.dtype and lse (BH, Nq) float32; every row settled, the ones the kernel
    flags by the lost-row fix."""
    import cupy

    tile = TILES[p.Dk]
    maps, coords = _maps(p, tile)
    args = _runtime.Args(p)
    out = _runtime.empty((p.BH, p.Nq, p.Dv), dtype=p.dtype)
    lse = _runtime.empty((p.BH, p.Nq), dtype=p.acc_dtype)
    kern = _runtime.get_function(SOURCE, name_expression(p.dtype, p.Dk, tile), arch=ARCH)
    smem = smem_bytes(p.Dk, tile)
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
                        np.float32(p.scale), i32(p.left), i32(p.right), i32(bool(p.bottom_right)),
                        i32(qd), i32(kd), i32(vd), i32(qm), i32(km), i32(vm)),
         shared_mem=smem)
    _generic.launch_fwd_lost(args, out, lse, fix, block_m(tile))
    return out, lse
