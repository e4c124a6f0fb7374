"""The Hopper kernels' host decisions that need no device (cuflash/_wgmma_fwd.py, _tma.py): how
an input's (batch, head) matrices map onto a 4-D tensor map, which problems may stage their mask
and bias tiles, and which it leaves to fwd_mma; and which backwards add dQ in key-block order
(cuflash/_mma_bwd.py)."""
import numpy as np
import pytest

from cuflash import _memo, _tma, _validate, _wgmma_fwd


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


@pytest.mark.parametrize("options, Nq, Nk", [
    ({}, 100, 300), (dict(causal=True), 100, 300), (dict(causal=True, align="top-left"), 300, 100),
    (dict(window=(17, 5)), 257, 257), (dict(window=(3, None), align="top-left"), 50, 400),
], ids=str)
def test_mean_row_keys_counts_the_visible_keys(rng, options, Nq, Nk):
    """The sampled mean against the dense visibility of the reference (every row sampled)."""
    from cuflash import reference
    p = _problem(rng, Nq, Nk, **options)
    visible = reference._visible((), Nq, Nk, options.get("causal", False),
                                 options.get("align", "bottom-right"), options.get("window"),
                                 None, None, None)
    assert _wgmma_fwd.mean_row_keys(p, samples=Nq) == pytest.approx(visible.sum() / Nq)


@pytest.mark.parametrize("D, N, options, short", [
    (64, 1024, dict(causal=True), True),     # rows see 512 keys on average
    (64, 2048, dict(causal=True), False),
    (64, 4096, dict(window=(256, 0)), True),
    (64, 4096, dict(window=(1024, 0)), False),
    (64, 512, {}, False),                    # unbounded rows stay on the Hopper kernel
    (128, 512, dict(causal=True), False),    # so does every other head dim
], ids=str)
def test_short_bounded_rows_go_to_fwd_mma(rng, D, N, options, short):
    q = rng.standard_normal((1, 1, N, D)).astype(np.float32)
    p = _validate.make_problem(q, q, q, **options)
    assert _wgmma_fwd.short_bounded_rows(p, _wgmma_fwd.padded(p)) == short


class _DeviceLike:
    """What _wgmma_fwd._launch reads of an input to memoize it (address and layout)."""

    def __init__(self, x, ptr):
        self.shape, self.strides, self.dtype = x.shape, x.strides, x.dtype
        self.data = type("Memory", (), {"ptr": ptr})()


def test_launch_cache_follows_the_bounds(rng, monkeypatch):
    """Regression: _launch memoized by the inputs' addresses only, so a causal or kv_lens call on
    the arrays of an earlier unbounded call reused its staged-mask launch (tiles off 16 keys: an
    illegal instruction on the H200). Here the maps' layout reports what it was asked to decide
    (as its staging rule, `mb`), through both memos: the Launch's by addresses and the layout's
    by the addresses' residues."""
    import dataclasses
    monkeypatch.setattr(_wgmma_fwd, "_maps_layout", lambda p, dims: _wgmma_fwd.MapsLayout(
        _wgmma_fwd._key_tiles_aligned(p), (None,) * 5, None, 0, 0))
    monkeypatch.setattr(_wgmma_fwd, "_launches", _memo.Memo())
    monkeypatch.setattr(_wgmma_fwd, "_maps_layouts", _memo.Memo())
    for options, aligned in (({}, True), (dict(causal=True), False),
                             (dict(kv_lens=[[64], [100]]), False), (dict(window=(8, 8)), False),
                             ({}, True)):
        p = _problem(rng, 100, 256, **options)
        p = dataclasses.replace(p, **{n: _DeviceLike(getattr(p, n), 1 << (20 + i))
                                      for i, n in enumerate(("q", "k", "v"))})
        assert _wgmma_fwd._launch(p, (64, 64)).mb is aligned, options


def test_ordered_dq_takes_problems_its_turns_count_in_32_bits(monkeypatch):
    """deterministic=True in key-block order (_mma_bwd.ordered_tile): tcb::spread_turn counts
    query tiles x (key blocks + 1) in 32-bit arithmetic, so a problem beyond 2^32 of them goes to
    the dq kernel (a wrapped count would rank blocks wrongly and hang their waits)."""
    from types import SimpleNamespace

    from cuflash import _mma_bwd, _runtime
    monkeypatch.setattr(_runtime, "device_info", lambda *a: _runtime.DeviceInfo(90, 232448, 132))
    monkeypatch.setattr(_runtime, "wgmma_available", lambda: True)

    def ordered(Nq, Nk):
        p = SimpleNamespace(mask=None, bias=None, Nq=Nq, Nk=Nk)
        return _mma_bwd.ordered_tile(p, (128, 128), (), False)

    tile = ordered(1024, 1024)
    assert tile is not None and tile.opt & _mma_bwd.OPT_DQ_ORDER
    blocks = 132  # one key block per multiprocessor, the most ordered_tile takes
    Nk = blocks * 16 * tile.warps
    assert ordered(1024, Nk) is not None and ordered(1024, Nk + 1) is None
    most = 2**32 // (blocks + 1) * tile.block_m  # the longest Nq whose tiles' count fits
    assert most < 2**31
    assert ordered(most, Nk) is not None and ordered(most + 1, Nk) is None
