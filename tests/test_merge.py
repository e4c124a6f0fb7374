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


def test_empty_side_is_exactly_the_other_side_whatever_its_out_holds(rng):
    """An empty part (lse = -inf) is the identity bit for bit, even if its out holds NaN."""
    out, lse = rand_inputs(rng, [(5, 4), (5,)], np.float32)
    garbage = np.full_like(out, np.nan)
    empty = np.full_like(lse, -np.inf)
    for merged in (cuflash.merge(out, lse, garbage, empty),
                   cuflash.merge(garbage, empty, out, lse)):
        assert np.array_equal(merged[0], out) and np.array_equal(merged[1], lse)


@pytest.mark.parametrize("bad", [np.nan, np.inf])
@pytest.mark.parametrize("other", ["valid", "empty"])
def test_nan_or_inf_lse_propagates(rng, bad, other):
    """Bug: a NaN lse on one side returned out 0 and lse -inf, dropping the valid other side.

    A NaN (or +inf) lse on either side gives NaN out and NaN lse on that row, whatever the other
    side is; the other rows are merged as usual.
    """
    out_a, lse_a, out_b, lse_b = rand_inputs(rng, [(2, 5, 4), (2, 5), (2, 5, 4), (2, 5)],
                                             np.float32)
    if other == "empty":
        out_b[:, 1], lse_b[:, 1] = 0, -np.inf
    lse_a[:, 1] = bad
    expect_out, expect_lse = cuflash.merge(out_a[:, ::2], lse_a[:, ::2], out_b[:, ::2],
                                           lse_b[:, ::2])
    for merged in (cuflash.merge(out_a, lse_a, out_b, lse_b),
                   cuflash.merge(out_b, lse_b, out_a, lse_a)):
        out, lse = merged
        assert np.isnan(out[:, 1]).all() and np.isnan(lse[:, 1]).all()
        assert np.array_equal(out[:, ::2], expect_out) and np.array_equal(lse[:, ::2], expect_lse)
        assert np.isfinite(out[:, ::2]).all() and np.isfinite(lse[:, ::2]).all()


def test_nan_in_out_of_a_part_with_weight_propagates():
    """NaN in a non-empty part's out (NaN in v) reaches the merge even if its weight underflows."""
    out, lse = cuflash.merge(np.array([[np.nan]]), np.array([-1e4]), np.array([[2.0]]),
                             np.array([0.0]))
    assert np.isnan(out).all() and lse[0] == 0.0


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
