"""cuflash.merge: attention over a union of disjoint key sets from the parts' (out, lse)."""
import itertools

import numpy as np
import pytest

import cuflash
from cuflash import reference
from helpers import BFLOAT16, rand_inputs

PARTS = [(0, 5), (5, 6), (6, 19)]  # three disjoint key ranges, one of a single key


def _parts(q, k, v, mask, ranges=PARTS):
    """(out, lse) of attention over each key range (empty rows inside a part included)."""
    return [cuflash.attention(q, k[..., a:b, :], v[..., a:b, :], mask=mask[..., a:b],
                              return_lse=True) for a, b in ranges]


@pytest.mark.parametrize("order", list(itertools.permutations(range(3))))
@pytest.mark.parametrize("tree", ["left", "right"])
def test_every_order_of_three_parts(rng, order, tree):
    q, k, v = rand_inputs(rng, [(2, 3, 7, 8), (2, 3, 19, 8), (2, 3, 19, 5)], np.float64)
    mask = rng.random((7, 19)) < 0.6
    mask[2] = False          # an empty row in every part
    mask[4, 5:] = False      # a row whose mass lives in one part only
    parts = _parts(q, k, v, mask)
    a, b, c = (parts[i] for i in order)
    if tree == "left":
        out, lse = cuflash.merge(*cuflash.merge(*a, *b), *c)
    else:
        out, lse = cuflash.merge(*a, *cuflash.merge(*b, *c))
    ref_out, ref_lse = reference.attention(q, k, v, mask=mask, return_lse=True)
    np.testing.assert_allclose(out, ref_out, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-12, atol=1e-12)
    assert np.all(out[..., 2, :] == 0) and np.all(lse[..., 2] == -np.inf)


def test_empty_state_is_the_identity(rng):
    out, lse = rand_inputs(rng, [(4, 3, 6), (4, 3)], np.float32)
    empty_out, empty_lse = np.zeros_like(out), np.full_like(lse, -np.inf)
    for merged in (cuflash.merge(out, lse, empty_out, empty_lse),
                   cuflash.merge(empty_out, empty_lse, out, lse)):
        assert np.array_equal(merged[0], out) and np.array_equal(merged[1], lse)
    both = cuflash.merge(empty_out, empty_lse, empty_out, empty_lse)
    assert np.all(both[0] == 0) and np.all(both[1] == -np.inf)
    assert not np.isnan(both[0]).any()


def test_rescales_numerator_and_denominator_alike():
    """The seed's counterexample: logits (0, log 3), values (1, 0) in two one-key parts -> 1/4."""
    out, lse = cuflash.merge(np.array([[1.0]]), np.array([0.0]), np.array([[0.0]]),
                             np.array([np.log(3.0)]))
    assert out[0, 0] == pytest.approx(0.25, abs=1e-15)
    assert lse[0] == pytest.approx(np.log(4.0), abs=1e-15)


@pytest.mark.parametrize("dtype", [np.float16, np.float32] + ([BFLOAT16] if BFLOAT16 else []))
def test_keeps_dtypes(rng, dtype):
    out = rand_inputs(rng, [(3, 4)], dtype)[0]
    lse = rand_inputs(rng, [(3,)], np.float32)[0]
    merged_out, merged_lse = cuflash.merge(out, lse, out, lse)
    assert merged_out.dtype == dtype and merged_lse.dtype == np.float32
    # two equal halves: same output, lse + log 2
    np.testing.assert_allclose(merged_lse, lse + np.log(2), rtol=1e-6)
    np.testing.assert_allclose(merged_out.astype(np.float32), out.astype(np.float32), rtol=1e-2)


def test_vjp_matches_attention_backward(rng):
    q, k, v = rand_inputs(rng, [(2, 9, 8), (2, 13, 8), (2, 13, 8)], np.float64)
    out, vjp = cuflash.attention_vjp(q, k, v, causal=True, window=(4, None))
    dout = rand_inputs(rng, [out.shape], np.float64)[0]
    ref = reference.attention_backward(dout, q, k, v, *reference.attention(
        q, k, v, causal=True, window=(4, None), return_lse=True), causal=True, window=(4, None))
    for g, r in zip(vjp(dout), ref):
        np.testing.assert_allclose(g, r, rtol=1e-10, atol=1e-12)
