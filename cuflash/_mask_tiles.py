"""The tile classes of a boolean mask (kernels_cu/mask_tiles.cu, mask_tiles.cuh): per mask matrix,
query tile and key chunk of a kernel's tiles, whether the mask hides every key, shows every key, or
some. The Hopper forward and the tensor-core dK/dV kernel skip the hidden tiles and give the shown
ones no per-element mask. Classified on the current stream before every call that uses them: a
mask may change in place between calls.
"""
from collections import namedtuple

import numpy as np

from . import _broadcast, _runtime, _tma
from ._validate import element_strides

SOURCE = "mask_tiles.cu"
# TileClasses (mask_tiles.cuh), a NumPy structured scalar passed by value; NO_CLASSES: none
CLASSES_DTYPE = np.dtype([("cls", "<u8"), ("qtiles", "<i4"), ("heads", "<i4"), ("chunks", "<i4"),
                          ("hdiv", "<i4"), ("bmul", "<i4"), ("H", "<i4")], align=True)
NO_CLASSES = np.zeros((), dtype=CLASSES_DTYPE)[()]

# How mask_tile_classes reads a mask: output (b, h) reads matrix (b * bmul, h // hdiv) of
# `batches` x `heads` (rows, Nk) matrices, row stride rs (0: one row for every query), head and
# batch strides sh, sb (elements = bytes).
Layout = namedtuple("Layout", "hdiv bmul heads batches rows rs sh sb")
_CACHE_SIZE = 256
_layouts = {}


def expression(block_m, block_n):
    return f"mask_tile_classes<{block_m}, {block_n}>"


def grid_shape(p):
    """(B, H) of the output's (batch, head) matrices, bh = b * H + h."""
    H = p.lead[-1] if p.lead else 1
    return p.BH // H, H


def layout(p):
    """The Layout of p's mask, or None: no mask, or one whose matrices are not at b * sb + h * sh
    (_tma.head_layout) or whose base and strides are not 16-byte multiples. Memoized by the mask's
    address and layout."""
    x = p.mask
    if x is None:
        return None
    key = (x.data.ptr, x.shape, x.strides, p.lead, p.Nq)
    if key not in _layouts:
        if len(_layouts) >= _CACHE_SIZE:
            _layouts.pop(next(iter(_layouts)))  # oldest first
        _layouts[key] = _layout(p)
    return _layouts[key]


def _layout(p):
    B, H = grid_shape(p)
    es = element_strides(p.mask)
    lay = _tma.head_layout(p.mask, _broadcast.lead_offsets(p.lead, p.lead, es[:-2]), B, H)
    if lay is None or p.mask.data.ptr % 16 or es[-1] != 1:
        return None
    hdiv, bmul, Hx, Bx, sh, sb = lay
    rs = es[-2]
    if min(rs, sh, sb) < 0 or (rs | sh | sb) % 16:
        return None
    return Layout(hdiv, bmul, Hx, Bx, 1 if rs == 0 else p.Nq, rs, sh, sb)


def classify(p, block_m, block_n):
    """(TileClasses, its table) of p's mask for tiles of block_m query rows and block_n keys,
    computed on the current stream; (NO_CLASSES, None) where layout() refuses the mask or the grid
    cannot hold the table. The table must live until the kernel that reads it is enqueued."""
    import cupy

    lay = layout(p)
    if lay is None:
        return NO_CLASSES, None
    qtiles, chunks = -(-lay.rows // block_m), -(-p.Nk // block_n)
    matrices = lay.heads * lay.batches
    if max(qtiles, matrices) > _runtime.MAX_GRID_Y:
        return NO_CLASSES, None
    table = cupy.empty((matrices, qtiles, chunks), dtype=np.uint8)
    kern = _runtime.get_function(SOURCE, expression(block_m, block_n))
    kern((chunks, qtiles, matrices), (128,),
         (p.mask, np.int64(lay.rs), np.int64(lay.sh), np.int64(lay.sb), np.int32(lay.rows),
          np.int32(p.Nk), np.int32(lay.heads), table))
    c = np.zeros((), dtype=CLASSES_DTYPE)
    c["cls"], c["qtiles"], c["heads"], c["chunks"] = table.data.ptr, qtiles, lay.heads, chunks
    c["hdiv"], c["bmul"], c["H"] = lay.hdiv, lay.bmul, grid_shape(p)[1]
    return c[()], table
