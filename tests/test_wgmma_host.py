"""The Hopper forward's host decisions that need no device (cuflash/_wgmma_fwd.py, _tma.py): how
an input's (batch, head) matrices map onto a 4-D tensor map, and which problems may stage their
mask and bias tiles."""
import numpy as np
import pytest

from cuflash import _tma, _validate, _wgmma_fwd


def _problem(rng, Nq, Nk, lead=(2, 4), kv_lead=None, **options):
    q = rng.standard_normal(lead + (Nq, 64)).astype(np.float32)
    k = rng.standard_normal((kv_lead or lead) + (Nk, 64)).astype(np.float32)
    return _validate.make_problem(q, k, k, **options)


@pytest.mark.parametrize("options, Nk, aligned", [
    ({}, 256, True),
    ({}, 250, False),                      # the last tile ends at 250
    (dict(causal=True), 256, False),       # diagonal tiles start anywhere
    (dict(window=(100, None)), 256, False),
    (dict(window=(10**6, None)), 256, True),  # a bound beyond every key is no bound
    (dict(kv_lens=[[64], [128]]), 256, True),
    (dict(kv_lens=[[64], [100]]), 256, False),
    (dict(kv_lens=[[0], [256]]), 256, True),
    ({}, 32, False),                       # a tile ending at 32 would start at -32
], ids=str)
def test_staged_tiles_need_key_tiles_at_multiples_of_16(rng, options, Nk, aligned):
    """Staging a mask / bias tile whose first key is not 16-byte aligned faulted on the H200
    (illegal instruction, causal bias): such problems read them from global memory instead."""
    p = _problem(rng, 100, Nk, **options)
    assert _wgmma_fwd._key_tiles_aligned(p) == aligned


def test_head_layout_of_gqa_and_broadcast_inputs(rng):
    p = _problem(rng, 8, 16, lead=(3, 4), kv_lead=(1, 2))
    B, H = 3, 4
    hdiv, bmul, Hx, Bx, sh, sb = _tma.head_layout(p.k, p.k_map, B, H)
    assert (hdiv, bmul, Hx, Bx) == (2, 0, 2, 1)  # 2 query heads per kv head, one batch for all
    assert sh == 16 * 64
    hdiv, bmul, Hx, Bx, sh, sb = _tma.head_layout(p.q, p.q_map, B, H)
    assert (hdiv, bmul, Hx, Bx, sh, sb) == (1, 1, 4, 3, 8 * 64, 4 * 8 * 64)


def test_head_layout_refuses_offsets_no_map_describes(rng):
    """Two broadcast leading axes folded into one batch axis are not of the form b * sb."""
    q = rng.standard_normal((2, 3, 4, 8, 64)).astype(np.float32)
    k = rng.standard_normal((2, 1, 4, 16, 64)).astype(np.float32)
    p = _validate.make_problem(q, k, k)
    assert _tma.head_layout(p.k, p.k_map, 6, 4) is None
