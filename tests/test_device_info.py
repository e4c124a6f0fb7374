"""cuflash._runtime.device_info: the one place the kernel choices read device properties from
(compute capability for the forward tiles, opt-in shared memory for the tensor-core paths, SM count
for the decode split). Checked without a GPU against a stand-in for CuPy's device queries."""
import itertools

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")

from cuflash import _runtime  # noqa: E402


class _FakeDevice:
    current = 0
    props = {0: ("80", 166912, 108), 1: ("90", 232448, 132)}

    def __init__(self, i=None):
        self.id = _FakeDevice.current if i is None else i
        cc, smem, _ = self.props[self.id]
        self.compute_capability = cc
        self.attributes = {"MaxSharedMemoryPerBlockOptin": smem}


def test_device_info_reads_and_caches_per_device(monkeypatch):
    calls = []

    def props(i):
        calls.append(i)
        return {"multiProcessorCount": _FakeDevice.props[i][2]}

    monkeypatch.setattr(cupy.cuda, "Device", _FakeDevice)
    monkeypatch.setattr(cupy.cuda.runtime, "getDeviceProperties", props)
    monkeypatch.setattr(_runtime, "_device_infos", {})
    _FakeDevice.current = 1
    assert _runtime.device_info() == (90, 232448, 132)
    assert _runtime.device_info(0) == (80, 166912, 108)
    assert _runtime.device_info(1) is _runtime.device_info()   # cached, not queried again
    assert calls == [1, 0]
    assert isinstance(_runtime.device_info().cc, int)


@pytest.mark.parametrize("cc,nvrtc,smem,eligible", [
    (90, (13, 0), 232448, True),
    (90, (12, 9), 232448, True),
    (90, (12, 8), 232448, False),   # rejects CuPy's second -arch: the mma.sync tiles instead
    (80, (13, 0), 166912, False),   # sm_90a code runs on compute capability 9.0 only
    (100, (13, 0), 232448, False),
    (90, (13, 0), 100 * 1024, True),  # D=64's wgmma tile fits, D=128's does not
])
def test_backward_tile_choice_follows_device_and_nvrtc(monkeypatch, override, cc, nvrtc, smem,
                                                       eligible):
    """_mma_bwd.dkdv_tile: the wgmma tiles only where the device runs sm_90a code, CuPy's NVRTC
    builds it and shared memory holds them; otherwise the tile every other device gets."""
    from cuflash import _mma_bwd

    monkeypatch.setattr(_runtime, "device_info",
                        lambda device_id=None: _runtime.DeviceInfo(cc, smem, 132))
    monkeypatch.setattr(_runtime, "nvrtc_version", lambda: nvrtc)
    for d, has_mb in ((64, False), (64, True), (128, False), (128, True)):
        dims = (d, d)
        # (plain calls: DKDV_TILES_WG_PLAIN, D=64's 128 queries per step; D=128's 80, dQ^T,
        # with dQ atomics only)
        plain_tile = None if has_mb else _mma_bwd.DKDV_TILES_WG_PLAIN.get(dims)
        no_dq_plain = plain_tile is not None and not plain_tile.opt & _mma_bwd.OPT_DQ_T
        wg = _mma_bwd.DKDV_TILES_WG_MB[dims] if has_mb else \
            plain_tile if no_dq_plain else _mma_bwd.DKDV_TILES_WG[dims]
        want = eligible and _mma_bwd.dkdv_smem_bytes(dims, wg) <= smem
        tile = _mma_bwd.dkdv_tile(dims, has_mb)
        assert (tile == wg) == want, (dims, has_mb, tile)
        assert bool(tile.opt & _mma_bwd.OPT_WG) == want
        if not want and not tile.opt & _mma_bwd.OPT_GRID:  # the table's tile, as elsewhere
            assert tile == (_mma_bwd.DKDV_TILES_MB if has_mb else _mma_bwd.DKDV_TILES)[dims]
        # with dQ atomics, D=128's wgmma tile with dQ on wgmma too (a mask alone included), and
        # the plain ones; a bias keeps the mask / bias tile, which stages it in shared memory;
        # the 64-, 80- and 128-query tiles add dQ through shared memory (OPT_DQ_BULK, its block
        # allocated: taken where it fits)
        def bulk(t):
            return t._replace(opt=t.opt | (_mma_bwd.OPT_DQ_BULK if t.block_m >= 64 else 0))
        assert not tile.opt & _mma_bwd.OPT_DQ_BULK  # (no dQ atomics: nothing to add)
        plain = plain_tile is not None
        wg_dq = bulk(plain_tile._replace(opt=plain_tile.opt | _mma_bwd.OPT_WG_DQ) if plain
                     else _mma_bwd.DKDV_TILES_WG_DQ.get(dims, wg))
        atomic = _mma_bwd.dkdv_tile(dims, has_mb, dq_atomic=True)
        if eligible and _mma_bwd.dkdv_smem_bytes(dims, wg_dq) <= smem:
            assert atomic == wg_dq
            assert bool(atomic.opt & _mma_bwd.OPT_WG_DQ) == (d == 128 or plain)
        else:
            assert not atomic.opt & _mma_bwd.OPT_WG
        if has_mb:
            biased = _mma_bwd.dkdv_tile(dims, True, dq_atomic=True, bias=True)
            if eligible and _mma_bwd.dkdv_smem_bytes(dims, bulk(wg)) <= smem:
                assert biased == bulk(wg) and biased.opt & _mma_bwd.OPT_SBIAS
            else:
                assert not biased.opt & (_mma_bwd.OPT_WG | _mma_bwd.OPT_SBIAS)
    # Dk >= 192: column halves on every device, 128 keys where they fit
    for dims, has_mb in itertools.product(((192, 128), (192, 192), (256, 256)), (False, True)):
        tile = _mma_bwd.dkdv_tile(dims, has_mb)
        big = _mma_bwd.DKDV_TILES_LARGE_SMEM.get(dims)
        if not has_mb and big is not None and _mma_bwd.dkdv_smem_bytes(dims, big) <= smem:
            assert tile == big
        else:
            assert tile == (_mma_bwd.DKDV_TILES_MB if has_mb else _mma_bwd.DKDV_TILES)[dims]
        assert tile.opt & _mma_bwd.OPT_HALVES and not tile.opt & _mma_bwd.OPT_WG
    override(wgmma=False)
    assert not _mma_bwd.dkdv_tile((64, 64), False).opt & _mma_bwd.OPT_WG


@pytest.mark.parametrize("atomic", [True, False])
def test_additive_transforms_keep_the_plain_backward_tiles(monkeypatch, override, atomic):
    """On the H200: ALiBi alone (an additive transform: the scale stays folded, no derivative
    array) takes the call without it's wgmma dK/dV tile (the 64-query ones: not the plain
    calls' 128 / 80), D=128's with dQ on wgmma included;
    a transform with a mask or bias, or softcap, the modifier's tiles; without wgmma the
    transforms' tiles (never the warp-grid kernel, which takes no modifier)."""
    from cuflash import _mma_bwd

    monkeypatch.setattr(_runtime, "device_info",
                        lambda device_id=None: _runtime.DeviceInfo(90, 232448, 132))
    monkeypatch.setattr(_runtime, "nvrtc_version", lambda: (13, 0))
    for dims in ((64, 64), (128, 128)):
        plain = _mma_bwd.dkdv_tile(dims, False, atomic)
        # (less OPT_DQ_BULK, which a transform leaves off: ALiBi's WG_DQ tile spilled with it;
        # the plain calls' own tiles (DKDV_TILES_WG_PLAIN) are not ALiBi's: the 64-query ones)
        base = plain
        if dims in _mma_bwd.DKDV_TILES_WG_PLAIN:
            base = (_mma_bwd.DKDV_TILES_WG_DQ if atomic and dims in _mma_bwd.DKDV_TILES_WG_DQ
                    else _mma_bwd.DKDV_TILES_WG)[dims]
        no_bulk = base._replace(opt=base.opt & ~_mma_bwd.OPT_DQ_BULK)
        assert _mma_bwd.dkdv_tile(dims, False, atomic, ("alibi",)) == no_bulk
        assert plain.opt & _mma_bwd.OPT_WG and bool(plain.opt & _mma_bwd.OPT_DQ_BULK) == atomic
        for has_mb, names in ((True, ("alibi",)), (False, ("softcap",)), (True, ("softcap",))):
            assert _mma_bwd.dkdv_tile(dims, has_mb, atomic, names) == \
                _mma_bwd.DKDV_TILES_WG_MB[dims], (has_mb, names)  # (dQ on mma.sync: WG_DQ spills)
    override(wgmma=False)
    for dims in ((64, 64), (128, 128), (256, 256)):
        assert _mma_bwd.dkdv_tile(dims, False, atomic, ("alibi",)) == _mma_bwd.DKDV_TILES_TF[dims]


def test_gqa_group_size():
    """_mma_bwd.group_size: the query heads per dK/dV block (OPT_GROUP) where k and v broadcast
    over groups of consecutive heads of the last leading axis alone and the call has no modifier,
    dropout or kv_lens; else 1 (the float32 buffers and the sum pass)."""
    from cuflash import _mma_bwd, _validate

    rng = np.random.default_rng(0)

    def problem(ql, kl, vl=None, **options):
        q = rng.standard_normal(ql + (33, 64)).astype(np.float32)
        k = rng.standard_normal(kl + (40, 64)).astype(np.float32)
        v = rng.standard_normal((vl or kl) + (40, 64)).astype(np.float32)
        return _validate.make_problem(q, k, v, **options)

    assert _mma_bwd.group_size(problem((2, 8), (2, 2))) == 4
    assert _mma_bwd.group_size(problem((2, 8), (2, 1))) == 8  # MQA
    assert _mma_bwd.group_size(problem((2, 8), (2, 2), causal=True, window=(5, 0))) == 4
    assert _mma_bwd.group_size(problem((2, 8), (2, 8))) == 1  # no GQA
    assert _mma_bwd.group_size(problem((2, 8), (1, 2))) == 1  # the batch broadcast too
    assert _mma_bwd.group_size(problem((2, 8), (2,))) == 1    # k (2, N, D): heads broadcast
    assert _mma_bwd.group_size(problem((2, 8), (2, 2), (2, 1))) == 1  # v broadcast otherwise
    assert _mma_bwd.group_size(problem((8,), (2,))) == 4      # no batch axis
    assert _mma_bwd.group_size(problem((2, 8), (2, 2), kv_lens=np.array([[40], [30]]))) == 1
    assert _mma_bwd.group_size(problem((2, 8), (2, 2), softcap=20.0)) == 1
    assert _mma_bwd.group_size(problem((2, 8), (2, 2), bias=np.zeros((33, 40)))) == 1
    assert _mma_bwd.group_size(problem((2, 8), (2, 2), mask=np.ones((33, 40), bool))) == 1
