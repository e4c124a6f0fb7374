"""The tile classes of a boolean mask (kernels_cu/mask_tiles.cu, mask_tiles.cuh): per mask matrix,
query tile and key chunk of a kernel's tiles, whether the mask hides every key, shows every key, or
some. The Hopper forward and the tensor-core dK/dV kernel skip the hidden tiles and give the shown
ones no per-element mask. Classified on the current stream before every call that uses them: a
mask may change in place between calls.
"""
from collections import namedtuple

import numpy as np

from . import _broadcast, _memo, _runtime, _tma
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
_layouts = _memo.Memo(256)


def expression(block_m, block_n):
    return f"mask_tile_classes<{block_m}, {block_n}>"


def grid_shape(p):
    """(B, H) of the output's (batch, head) matrices, bh = b * H + h."""
    H = p.lead[-1] if p.lead else 1
    return p.BH // H, H


def layout(p):
    """The Layout of p's mask, or None: no mask, or one whose matrices are not at b * sb + h * sh
    (_tma.head_layout) or whose base and strides are not 16-byte multiples. Memoized by the mask's
    layout and its address modulo 16 (all that _layout reads of the address: a new mask of a
    known layout, every training step's, finds it)."""
    x = p.mask
    if x is None:
        return None
    return _layouts.build((x.data.ptr % 16, x.shape, x.strides, p.lead, p.Nq), lambda: _layout(p))


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
    lay = layout(p)
    if lay is None:
        return NO_CLASSES, None
    run = _classifiers.build((lay, p.Nk, grid_shape(p)[1], block_m, block_n),
                             lambda: _Classifier(p, lay, block_m, block_n))
    return run(p.mask) if run.launch is not None else (NO_CLASSES, None)


class _Classifier:
    """mask_tile_classes prepared for one mask Layout and tile shape: its launch, the table's
    shape and the TileClasses but for the table's address (a call makes the table and launches)."""

    def __init__(self, p, lay, block_m, block_n):
        qtiles, chunks = -(-lay.rows // block_m), -(-p.Nk // block_n)
        matrices = lay.heads * lay.batches
        self.launch = None
        if max(qtiles, matrices) > _runtime.MAX_GRID_Y:
            return
        self.shape = (matrices, qtiles, chunks)
        self.launch = _runtime.Launch(
            _runtime.get_function(SOURCE, expression(block_m, block_n)), (chunks, qtiles, matrices),
            (128,))
        self.numbers = (np.int64(lay.rs), np.int64(lay.sh), np.int64(lay.sb), np.int32(lay.rows),
                        np.int32(p.Nk), np.int32(lay.heads))
        c = np.zeros((), dtype=CLASSES_DTYPE)
        c["qtiles"], c["heads"], c["chunks"] = qtiles, lay.heads, chunks
        c["hdiv"], c["bmul"], c["H"] = lay.hdiv, lay.bmul, grid_shape(p)[1]
        self.rest = c.tobytes()[8:]  # the TileClasses after `cls` (its first field)

    def __call__(self, mask):
        table = _runtime._cupy().empty(self.shape, np.uint8)  # (all written by the kernel)
        self.launch((mask,) + self.numbers + (table,))
        classes = np.frombuffer(table.data.ptr.to_bytes(8, "little") + self.rest, CLASSES_DTYPE)
        return classes[0], table


_classifiers = _memo.Memo(256)  # (Layout, Nk, H, block_m, block_n) -> _Classifier
