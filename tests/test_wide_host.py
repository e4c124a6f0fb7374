"""The wide tensor-core path's host tables (cuflash/_wide.py), without a device: what a device of
compute capability 8.0 or 9.0 would launch is in the catalog CI compiles, sm_90-only tiles are
never picked on sm_80, and the backward is only offered where the forward runs too."""
import itertools

import pytest

from cuflash import _modifiers, _wide

CCS = (80, 90)
KEYS = sorted(set(_wide.TILES) | set(_wide.TILES_CC90) | set(_wide.BWD_TILES)
              | set(_wide.BWD_TILES_CC90))


def _picked(cc):
    """Every name expression a device of compute capability cc can request, with its key."""
    for (dt, bucket, has_mb), passes in itertools.product(KEYS, _wide.PASSES.values()):
        if dt != "float32" and passes != 1:
            continue
        tile = _wide.pick_tile(dt, bucket, has_mb, cc)
        if tile is not None:
            yield (dt, bucket, has_mb), _wide.name_expression(dt, bucket, has_mb, passes, tile)
        tiles = _wide.pick_bwd_tiles(dt, bucket, has_mb, cc)
        if tiles is not None:
            for expr in _wide.bwd_name_expressions(dt, bucket, has_mb, passes, tiles):
                yield (dt, bucket, has_mb), expr


@pytest.mark.parametrize("cc", CCS)
def test_every_pick_is_in_the_catalog(cc):
    catalog = {e for *_, e in _wide.instantiations()}
    missing = {expr for _, expr in _picked(cc)} - catalog
    assert not missing, sorted(missing)


def test_sm80_never_picks_an_sm90_only_tile():
    cc90_only = _wide.cc90_only()
    assert cc90_only  # the sm_90 tables add something
    picked = {expr for _, expr in _picked(80)}
    assert not picked & cc90_only, sorted(picked & cc90_only)


@pytest.mark.parametrize("cc", CCS)
def test_the_backward_only_where_the_forward_runs(cc):
    """takes_backward requires takes: a backward bucket without a forward tile could never run."""
    for dt, bucket, has_mb in KEYS:
        if _wide.pick_bwd_tiles(dt, bucket, has_mb, cc) is not None:
            assert _wide.pick_tile(dt, bucket, has_mb, cc) is not None, (dt, bucket, has_mb, cc)


@pytest.mark.parametrize("cc", CCS)
def test_buckets_are_whole_for_each_mask_setting(cc):
    """A bucket has a tile with and without a mask or bias, or neither: has_mb never decides
    whether the path takes a Problem."""
    for dt, bucket, _ in KEYS:
        fwd = [_wide.pick_tile(dt, bucket, mb, cc) is None for mb in (False, True)]
        bwd = [_wide.pick_bwd_tiles(dt, bucket, mb, cc) is None for mb in (False, True)]
        assert len(set(fwd)) == 1 and len(set(bwd)) == 1, (dt, bucket, cc)


def test_buckets_and_modifiers():
    assert all(b in _wide.BUCKETS[dt] for dt, b, _ in KEYS)
    # float64 kernels run in natural units; the backward always does (bwd_wide.cu)
    assert _modifiers.score_mod(True, (), "double") == "MaskBiasModT<double, true>"
    assert _modifiers.score_mod(True, (), "float") == "MaskBiasMod"
    assert _modifiers.score_mod(True, (), "float", natural=True) == "MaskBiasModT<float, true>"
    assert _modifiers.score_mod(False, (), "double") == "NoMod"
    assert _modifiers.score_mod(False, ("softcap",), "double", dtype_name="float64") == \
        "ScoreModT<double, true, false, Softcap<double, true, 0>>"
    for dt, b, mb in KEYS:
        tiles = _wide.pick_bwd_tiles(dt, b, mb, 90)
        if tiles is not None and mb:
            for expr in _wide.bwd_name_expressions(dt, b, mb, 3, tiles):
                assert "true>" in expr, expr


def test_backward_column_parts_divide_the_bucket():
    """bwd_wide_dkdv's static_assert: each of `parts` column slices holds whole groups of output
    fragments (2 per pass at head dims >= 96, else 4)."""
    for table in (_wide.BWD_TILES, _wide.BWD_TILES_CC90):
        for (dt, bucket, _), (dkdv, dq) in table.items():
            per_pass = 2 if bucket >= 96 else 4
            assert (bucket // 8 // dkdv.parts) % per_pass == 0, (dt, bucket, dkdv)
            assert (bucket // 8) % per_pass == 0 and dq.parts == 1, (dt, bucket, dq)
