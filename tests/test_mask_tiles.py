"""Which masks get tile classes (cuflash/_mask_tiles.py layout), without a device: the mask of a
NumPy Problem stands in for a device array at a chosen address."""
import dataclasses
import types

import numpy as np
import pytest

from cuflash import _mask_tiles, _validate


class _OnDevice:
    """A NumPy array seen as a device array at address `ptr` (what layout reads of one)."""

    def __init__(self, a, ptr):
        self.shape, self.strides, self.dtype, self.ndim = a.shape, a.strides, a.dtype, a.ndim
        self.data = types.SimpleNamespace(ptr=ptr)


def _problem(mask, B=2, H=4, Nq=100, ptr=1 << 20, **options):
    Nk = mask.shape[-1]
    q = np.zeros((B, H, Nq, 16), np.float32)
    k = np.zeros((B, H, Nk, 16), np.float32)
    p = _validate.make_problem(q, k, k, mask=mask, **options)
    return dataclasses.replace(p, mask=_OnDevice(p.mask, ptr))


def test_padding_mask_is_one_row_per_batch():
    lay = _mask_tiles.layout(_problem(np.ones((2, 1, 1, 272), bool)))
    assert lay == _mask_tiles.Layout(hdiv=4, bmul=1, heads=1, batches=2, rows=1, rs=0, sh=0,
                                     sb=272)


def test_full_mask_has_a_matrix_per_output_head():
    lay = _mask_tiles.layout(_problem(np.ones((2, 4, 100, 256), bool)))
    assert (lay.hdiv, lay.bmul, lay.heads, lay.batches, lay.rows) == (1, 1, 4, 2, 100)
    assert (lay.rs, lay.sh, lay.sb) == (256, 100 * 256, 4 * 100 * 256)


def test_one_mask_for_every_batch_and_head():
    lay = _mask_tiles.layout(_problem(np.ones((1, 1, 100, 64), bool)))
    assert (lay.bmul, lay.heads, lay.batches, lay.rows, lay.rs) == (0, 1, 1, 100, 64)


@pytest.mark.parametrize("mask, ptr", [
    (np.ones((2, 4, 100, 270), bool), 1 << 20),   # rows 270 bytes apart: no 16-byte loads
    (np.ones((2, 1, 1, 272), bool), (1 << 20) + 8),  # base off 16 bytes
])
def test_unaligned_masks_get_no_classes(mask, ptr):
    assert _mask_tiles.layout(_problem(mask, ptr=ptr)) is None


def test_no_mask_no_classes():
    q = np.zeros((2, 4, 10, 16), np.float32)
    assert _mask_tiles.layout(_validate.make_problem(q, q, q)) is None
