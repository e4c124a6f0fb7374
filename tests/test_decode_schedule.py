"""The split-KV decode schedule (cuflash/_decode.py), without a GPU: tools/decode_check.py's float64
emulation runs the kernels' algorithm from the Schedule tables alone (every item in launch order
writes its partial to its workspace slot, then the merge rule per row tile) and must reproduce the
dense reference: every visible key in exactly one item, empty items and empty rows handled, for
both kernels' layouts (decode_split's rows per block; decode_tc's 16 rows and 64-key stages) and
every split rule. The split rules' closed forms must pick exactly the S of their first, GPU-tuned
definitions (kept here as references: every block listed, one heap schedule per candidate)."""
import importlib.util
import pathlib
import zlib

import numpy as np
import pytest

from cuflash import _decode, reference
from cuflash._validate import make_problem

_spec = importlib.util.spec_from_file_location(
    "decode_check", pathlib.Path(__file__).resolve().parent.parent / "tools" / "decode_check.py")
decode_check = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(decode_check)

# "tc-pool": decode_tc's layout with half of every split tile's keys in its key pool, the pool
# stages dealt to random items of the tile (as run-time claims may deal them)
LAYOUTS = {"simt": dict(rows=None, block_keys=None), "tc": dict(rows=16, block_keys=64),
           "tc-pool": dict(rows=16, block_keys=64, pool=2, force_pool=True)}
SPLITS = [None, 64, 40, 512, "balanced", "balanced-fine"]


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("split", SPLITS, ids=[str(s) for s in SPLITS])
@pytest.mark.parametrize("case", decode_check.CASES, ids=[c[0] for c in decode_check.CASES])
def test_schedule_reproduces_reference(case, split, layout):
    name, c = case
    rng = np.random.default_rng(zlib.crc32(f"{name} {split} {layout}".encode()))
    q, k, v, opts = decode_check.case_inputs(np, rng, dict(c, dtype="float64"))
    p = make_problem(q, k, v, **opts)
    rule = split if isinstance(split, str) else None
    out, lse, s = decode_check.emulate(p, split=None if rule else split, rule=rule,
                                       seed=zlib.crc32(name.encode()), **LAYOUTS[layout])
    ref_out, ref_lse = reference.attention(q, k, v, return_lse=True, **opts)
    np.testing.assert_allclose(out, ref_out, rtol=0, atol=1e-10)
    assert np.array_equal(np.isinf(lse), np.isinf(ref_lse))
    finite = np.isfinite(ref_lse)
    np.testing.assert_allclose(lse[finite], ref_lse[finite], rtol=0, atol=1e-10)
    # the launch order is a permutation of the workspace slots
    assert sorted(s.launch.tolist()) == list(range(s.items.shape[0]))


def _pooled(s):
    return s.pools[:, 1] > s.pools[:, 0]


@pytest.mark.parametrize("case", decode_check.CASES, ids=[c[0] for c in decode_check.CASES])
def test_key_pools_partition_each_tile(case):
    """Per split tile: the items' own ranges are equal runs of whole stages (at least
    POOL_MIN_STAGES), back to back from the extent's start, and the pool is the rest of the
    extent; tiles of one item, or too short, keep their items and get no pool."""
    name, c = case
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    q, k, v, opts = decode_check.case_inputs(np, rng, dict(c, dtype="float64"))
    p = make_problem(q, k, v, **opts)
    bk = 64
    plain = _decode.Schedule(p, 64, 512, None, 16, bk)
    s = _decode.Schedule(p, 64, 512, None, 16, bk, pool=2, force_pool=True)
    assert not _pooled(plain).any()
    assert np.array_equal(s.tiles, plain.tiles)
    n_pooled = 0
    for tid, (g, t, first, count) in enumerate(s.tiles):
        its, pools = s.items[first:first + count], s.pools[first:first + count]
        lo0, hi1 = plain.items[first, 1], plain.items[first + count - 1, 2]  # the extent
        assert np.all(its[:, 0] == tid)
        if not _pooled(s)[first]:
            assert np.array_equal(its, plain.items[first:first + count])
            assert count == 1 or (hi1 - lo0) // 2 // count < 2 * bk
            continue
        n_pooled += 1
        own = its[:, 2] - its[:, 1]
        assert count >= 2 and np.all(own == own[0]) and own[0] % bk == 0 and own[0] >= 2 * bk
        assert np.array_equal(its[:, 1], lo0 + own[0] * np.arange(count))
        assert np.all(pools[:, 0] == its[-1, 2]) and np.all(pools[:, 1] == hi1)
        assert hi1 - pools[0, 0] >= (hi1 - lo0) // 2  # at least 1 / divisor of the extent
    assert n_pooled > 0 or not (plain.tiles[:, 3] > 1).any()


def test_key_pools_only_in_one_wave():
    """Automatic pools (POOL_DIVISOR) only when all items are resident at once: a block of a
    later wave would find its tile's pool drained by the first."""
    p = decode_check.timing_problem(1, 131072)
    one = _decode.Schedule(p, 264, None, "balanced-fine", 16, 64, pool=_decode.POOL_DIVISOR)
    assert one.items.shape[0] <= 264 and _pooled(one).all()
    pool = one.pools[0]
    assert pool[1] - pool[0] >= 131072 // _decode.POOL_DIVISOR
    two = _decode.Schedule(p, 264, 1024, None, 16, 64, pool=_decode.POOL_DIVISOR)
    assert two.items.shape[0] > 264 and not _pooled(two).any()
    forced = _decode.Schedule(p, 264, 1024, None, 16, 64, pool=_decode.POOL_DIVISOR,
                              force_pool=True)
    assert _pooled(forced).all()


def test_split_rules_fill_one_wave():
    """The bench shapes: one wave of resident blocks (264 = 132 SMs x 2), no more."""
    for ext in ([131072] * 8, [32768] * 64, [8192] * 256, [4096] * 512):
        for rule in _decode.SPLIT_RULES.values():
            S = rule(np.array(ext), 264, 64)
            assert S % 64 == 0
            assert sum(-(-e // S) for e in ext) <= max(264, len(ext))


# ---- the split rules against their definition ---------------------------------------------------

def _reference_split_size(extents, capacity, block_keys, min_keys=_decode.SPLIT_MIN_KEYS):
    """split_size as first written: a bisection on the block count of the whole extents."""
    ext = np.asarray(extents, dtype=np.int64)
    ext = ext[ext > 0]
    if ext.size == 0:
        return max(min_keys, block_keys)
    unit = block_keys
    lo = -(-max(min_keys, 1) // unit)
    hi = max(lo, -(-int(ext.max()) // unit))
    count = lambda s: int(np.sum(-(-ext // (s * unit))))  # noqa: E731
    if count(hi) > capacity:
        return hi * unit
    while lo < hi:
        mid = (lo + hi) // 2
        if count(mid) <= capacity:
            hi = mid
        else:
            lo = mid + 1
    return lo * unit


def _reference_split_size_balanced(extents, capacity, block_keys, min_keys=_decode.SPLIT_MIN_KEYS,
                                   overhead_keys=_decode.SPLIT_OVERHEAD_KEYS,
                                   waves=(1, 2, 3, 4, 6, 8), fine=False):
    """split_size_balanced as first written (and GPU-tuned): every block listed, one heap list
    schedule per candidate."""
    ext = np.asarray(extents, dtype=np.int64)
    best = None
    cands = {_reference_split_size(ext, int(w * capacity), block_keys, min_keys) for w in waves}
    top = int(ext.max(initial=0))
    S = max(min_keys, block_keys)
    while S < top:
        cands.add(S)
        S *= 2
    if fine and ext.size and ext.min() < top:
        step = max(8 * block_keys, -(-top // (32 * block_keys)) * block_keys)
        cands.update(range(max(min_keys, step), top, step))
    for S in sorted(cands):
        e = ext[ext > 0]
        n = -(-e // S)
        costs = np.repeat(np.full(e.size, S, dtype=np.int64), n)
        last = np.cumsum(n) - 1
        costs[last] = e - (n - 1) * S
        costs = np.sort(costs)[::-1]
        end = _decode.list_schedule_end(costs + overhead_keys, capacity) if costs.size else 0
        if best is None or end < best[0] or (end == best[0] and S > best[1]):
            best = (end, S)
    return best[1]


def _random_extents(rng):
    """Tile extents like Schedule's: a few distinct lengths repeated over kv heads and row tiles,
    some tiles empty, some batches equal; from tiny to ~2M keys."""
    top = int(rng.choice([300, 2000, 9000, 40000, 300000, 2100000]))
    kind = rng.integers(4)
    B = int(rng.integers(1, 65 if top < 100000 else 9))  # the reference lists every block
    if kind == 0:    # equal extents (the full bench shapes)
        lens = np.full(B, int(rng.integers(1, top)))
    elif kind == 1:  # uniform kv_lens (the uneven bench batch)
        lens = rng.integers(1, top + 1, size=B)
    elif kind == 2:  # a few long among many short, and empty tiles
        lens = np.where(rng.random(B) < 0.1, top, rng.integers(0, top // 20 + 2, size=B))
    else:            # a few distinct lengths
        lens = rng.choice(rng.integers(0, top + 1, size=3), size=B)
    return np.repeat(lens, int(rng.choice([1, 2, 8]))).astype(np.int64)


def _block_keys():
    """The layouts' block passes: decode_tc's 64 and decode_split's BLOCK_KEYS."""
    out = {64}
    for dt in ("float16", "float32", "float64"):
        for bucket in (64, 128, 256):
            for rows in (1, 2, 4, 8):
                out.add(_decode.shape_constants(dt, bucket, rows)["BLOCK_KEYS"])
    return sorted(out)


@pytest.mark.parametrize("seed", range(4))
def test_split_rules_match_reference(seed):
    """The closed-form split rules pick exactly the S of the listed-block ones (GPU-tuned) and
    of the bisection: uneven and equal extents, small and large capacities, all block passes."""
    rng = np.random.default_rng(seed)
    block_keys = _block_keys()
    for _ in range(60):
        ext = _random_extents(rng)
        capacity = int(rng.choice([1, 7, 132, 264, 528, 1056, 4224]))
        bk = int(rng.choice(block_keys))
        assert _decode.split_size(ext, capacity, bk) == _reference_split_size(ext, capacity, bk)
        for fine, overhead, waves in ((True, 256, (1, 2, 3, 4, 6, 8)),
                                      (False, 256, (1, 2, 3, 4, 6, 8)),
                                      (False, 64, (1, 2, 3, 4, 6, 8, 12, 16))):
            got = _decode.split_size_balanced(ext, capacity, bk, overhead_keys=overhead,
                                              waves=waves, fine=fine)
            want = _reference_split_size_balanced(ext, capacity, bk, overhead_keys=overhead,
                                                  waves=waves, fine=fine)
            assert got == want, (ext.tolist(), capacity, bk, fine, overhead)


def test_split_rule_bench_shapes():
    """The GPU-tuned choices on bench.py's decode shapes (8 kv heads, decode_tc's layout, 264
    slots): the uneven batch (B = 32, L = 8192, kv_lens uniform in [1, L] with seed 0) gets
    S = 4608, the four full shapes their one-wave S."""
    rule = _decode.SPLIT_RULES["balanced-fine"]
    lens = np.random.default_rng(0).integers(1, 8192 + 1, size=32)
    assert rule(np.repeat(lens, 8), 264, 64) == 4608
    for B, L in ((1, 131072), (8, 32768), (32, 8192), (64, 4096)):
        ext = np.full(8 * B, L)
        assert rule(ext, 264, 64) == _decode.split_size(ext, 264, 64) == \
            _reference_split_size(ext, 264, 64)
