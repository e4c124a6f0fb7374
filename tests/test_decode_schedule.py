"""The split-KV decode schedule (cuflash/_decode.py), without a GPU: decode_oracle's float64
emulation runs the kernels' algorithm from the Schedule tables alone (every item in launch order
writes its partial to its workspace slot, then the merge rule per row tile) and must reproduce the
dense reference: every visible key in exactly one item, empty items and empty rows handled, for
both kernels' layouts (decode_split's rows per block; decode_tc's 16 rows and 64-key stages),
with split_size's choice and with forced splits. split_size's closed form must pick exactly the S
of its first, GPU-tuned definition (kept here as a reference: every block listed, one heap
schedule per candidate)."""
import zlib

import numpy as np
import pytest

from cuflash import _decode, reference
from cuflash._validate import make_problem
from decode_oracle import CASES, case_inputs, emulate

LAYOUTS = {"simt": dict(rows=None, block_keys=None), "tc": dict(rows=16, block_keys=64)}
# None: split_size's choice (the product's); ints: forced splits (the tests' `split=`)
SPLITS = [None, 64, 40, 512]


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("split", SPLITS, ids=[str(s) for s in SPLITS])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_schedule_reproduces_reference(case, split, layout):
    name, c = case
    rng = np.random.default_rng(zlib.crc32(f"{name} {split} {layout}".encode()))
    q, k, v, opts = case_inputs(rng, c)
    p = make_problem(q, k, v, **opts)
    out, lse, s = emulate(p, split=split, **LAYOUTS[layout])
    ref_out, ref_lse = reference.attention(q, k, v, return_lse=True, **opts)
    np.testing.assert_allclose(out, ref_out, rtol=0, atol=1e-10)
    assert np.array_equal(np.isinf(lse), np.isinf(ref_lse))
    finite = np.isfinite(ref_lse)
    np.testing.assert_allclose(lse[finite], ref_lse[finite], rtol=0, atol=1e-10)
    # the launch order is a permutation of the workspace slots
    assert sorted(s.launch.tolist()) == list(range(s.items.shape[0]))


# Lengths on the device (a CuPy kv_lens): the host plans for Nk and never sees the values.
# (name, B, H, Hkv, Nq, Nk, D, options); each batch's length is drawn from LENGTHS
DEVICE_LENS_CASES = [
    ("window-br-nq1", 3, 8, 2, 1, 1500, 64, dict(window=(300, 0))),
    ("causal-window-br-nq4", 3, 8, 2, 4, 1200, 64, dict(causal=True, window=(200, None))),
    ("window-both-sides-br", 3, 4, 2, 3, 900, 64, dict(window=(100, 50))),
    ("window-tl", 3, 4, 2, 3, 900, 64, dict(align="top-left", window=(100, 50))),
    ("causal-br", 3, 8, 2, 2, 1000, 64, dict(causal=True)),
    ("plain", 3, 8, 2, 1, 1000, 64, {}),
]


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("split", [None, 64], ids=["auto", "64"])
@pytest.mark.parametrize("case", DEVICE_LENS_CASES, ids=[c[0] for c in DEVICE_LENS_CASES])
def test_schedule_with_lengths_on_the_device(case, split, layout):
    """With lengths on the device the Schedule plans for Nk keys and the kernels stop at the true
    lengths: every key a row sees for ANY length in [0, Nk] must lie in its tile's items. A
    bottom-right window's first key moves down with the length; planned at Nk, a row of a short
    sequence saw only the keys the window has at Nk (silently wrong: out from one key)."""
    name, B, H, Hkv, Nq, Nk, D, opts = case
    rng = np.random.default_rng(zlib.crc32(f"{name} {split} {layout}".encode()))
    q, k, v = (rng.standard_normal(s) for s in ((B, H, Nq, D), (B, Hkv, Nk, D), (B, Hkv, Nk, D)))
    lens = np.array([Nq // 2, int(rng.integers(Nk // 4, Nk // 2)), Nk])[:B]
    p = make_problem(q, k, v, **opts)
    p.lens_device = lens.repeat(H)  # what the kernels read: (BH,) (a CuPy array on a GPU)
    p.lens_map = np.arange(B).repeat(H)  # each (batch, head)'s element of a (B, 1) kv_lens
    out, lse, _ = emulate(p, split=split, device_lens=p.lens_device, **LAYOUTS[layout])
    ref_out, ref_lse = reference.attention(q, k, v, return_lse=True, kv_lens=lens[:, None],
                                           **opts)
    np.testing.assert_allclose(out, ref_out, rtol=0, atol=1e-10)
    assert np.array_equal(np.isinf(lse), np.isinf(ref_lse))
    finite = np.isfinite(ref_lse)
    np.testing.assert_allclose(lse[finite], ref_lse[finite], rtol=0, atol=1e-10)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("case", DEVICE_LENS_CASES, ids=[c[0] for c in DEVICE_LENS_CASES])
def test_schedule_serves_a_length_span(case, layout):
    """Host lengths are planned with room to grow (_decode.planned_span): one plan, made from one
    call's lengths, must serve every length of their spans (a token loop's next steps; the
    kernels read the true lengths), the shortest and the longest included."""
    name, B, H, Hkv, Nq, Nk, D, opts = case
    rng = np.random.default_rng(zlib.crc32(f"bucket {name} {layout}".encode()))
    q, k, v = (rng.standard_normal(s) for s in ((B, H, Nq, D), (B, Hkv, Nk, D), (B, Hkv, Nk, D)))
    lens = np.array([int(rng.integers(Nk // 4, Nk // 2)), Nk - 3, 700])[:B]
    low, high = _decode.planned_span(lens, Nk)
    # each length may shrink and grow by its unit q (2**(floor(log2 L) - BUCKET_SHIFT), at
    # least BUCKET_MIN_KEYS) inside the span, up to Nk
    unit = np.maximum(2 ** (np.floor(np.log2(lens)).astype(int) - _decode.BUCKET_SHIFT),
                      _decode.BUCKET_MIN_KEYS)
    assert np.array_equal(low, np.maximum(lens - unit, 0))
    assert np.all((high == Nk) | ((high > lens + unit) & (high <= lens + 2 * unit)
                                 & (high % unit == 0)))
    p = make_problem(q, k, v, kv_lens=lens[:, None], **opts)
    span = (low.repeat(H), high.repeat(H))
    for true in (low, high, rng.integers(low, high + 1)):
        out, lse, _ = emulate(p, span=span, device_lens=true.repeat(H), **LAYOUTS[layout])
        ref_out, ref_lse = reference.attention(q, k, v, return_lse=True, kv_lens=true[:, None],
                                               **opts)
        np.testing.assert_allclose(out, ref_out, rtol=0, atol=1e-10)
        assert np.array_equal(np.isinf(lse), np.isinf(ref_lse))


def _dense_contract(q, k, v, bias, visible, scale):
    """The non-finite contract's dense formula per row in float64 IEEE arithmetic: out 0 and lse
    -inf without a visible key, else x = scale q.k + bias over the visible keys, m = max x (NaN
    if one is NaN), out = sum exp(x - m) v / l, lse = m + log l (so NaN, NaN when every visible
    logit is -inf: -inf - -inf)."""
    out = np.zeros(q.shape[:-1] + (v.shape[-1],))
    lse = np.full(q.shape[:-1], -np.inf)
    G = q.shape[1] // k.shape[1]
    with np.errstate(invalid="ignore", over="ignore"):
        for b, h, i in np.ndindex(*q.shape[:-1]):
            vis = visible[b, h, i]
            if not vis.any():
                continue
            x = (k[b, h // G][vis] @ q[b, h, i]) * scale + bias[b, h, i][vis]
            m = x.max()
            e = np.exp(x - m)
            out[b, h, i] = e @ v[b, h // G][vis] / e.sum()
            lse[b, h, i] = m + np.log(e.sum())
    return out, lse


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("split", [None, 64, 40, 512], ids=str)
def test_schedule_non_finite_contract(split, layout):
    """Issue 12 (holes 2, 4): the decode merge must not hide NaN as an empty row. Emulated with
    the kernels' workspace encoding (a partial lse of -inf: no visible key in the item; +inf:
    visible keys whose logits are all -inf; NaN: NaN reached l), in float64 where q ~ 1e200 and
    k ~ -1e200 overflow q.k to -inf. Rows: a NaN key (every row that sees it NaN); keys past
    kv_lens all NaN (never read); visible logits -inf on the first 200 keys and finite after
    (the -inf splits are identities: a finite answer); every visible logit -inf (NaN, NaN, not
    an empty row); a fully masked row (0, -inf); a NaN bias entry on a visible key (NaN). (Finite
    logits stay far from 1e200: there one ulp is ~1e184 and the order of a dot product decides.)"""
    rng = np.random.default_rng(12)
    B, H, Hkv, Nq, Nk, D = 2, 4, 2, 2, 700, 64
    q = rng.standard_normal((B, H, Nq, D))
    k = rng.standard_normal((B, Hkv, Nk, D))
    v = rng.standard_normal((B, Hkv, Nk, D))
    kv_lens = np.array([[650], [700]])
    k[0, :, 650:] = np.nan
    v[0, :, 650:] = np.nan
    k[0, 0, 300] = np.nan                     # batch 0, heads 0 and 1: NaN rows
    q[0, 3] = 1e200
    k[0, 1, :200] = -1e200                    # batch 0, head 3: -inf logits, then finite ones
    q[1, 1] = 1e200
    k[1, 0] = -1e200                          # batch 1, head 1: every logit -inf
    q[0, 2] = q[1, 0] = 0.0                   # their neighbours: logits = bias (exact, not ~1e200)
    mask = np.ones((B, H, Nq, Nk), dtype=bool)
    mask[1, 2, 0] = False                     # batch 1, head 2, row 0: empty
    bias = 0.1 * rng.standard_normal((B, H, Nq, Nk))
    bias[..., ::9] = -np.inf                  # invisible keys
    bias[1, 3, 1, 500] = np.nan               # batch 1, head 3, row 1: a visible NaN bias
    p = make_problem(q, k, v, causal=True, kv_lens=kv_lens, mask=mask, bias=bias)
    out, lse, _ = emulate(p, split=split, **LAYOUTS[layout])

    j, i = np.arange(Nk), np.arange(Nq)[:, None]
    L = kv_lens.reshape(B, 1, 1, 1)
    visible = (j < L) & (j <= i + L - Nq) & mask & (bias != -np.inf)
    ref_out, ref_lse = _dense_contract(q, k, v, bias, visible, 1 / np.sqrt(D))
    nan_rows = {(0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1), (1, 1, 0), (1, 1, 1), (1, 3, 1)}
    assert {tuple(x) for x in np.argwhere(np.isnan(ref_lse)).tolist()} == nan_rows
    assert ref_lse[1, 2, 0] == -np.inf and np.isfinite(ref_lse[0, 3]).all()
    np.testing.assert_array_equal(np.isnan(lse), np.isnan(ref_lse))
    np.testing.assert_array_equal(np.isnan(out), np.isnan(ref_out))
    np.testing.assert_array_equal(lse[np.isinf(ref_lse)], ref_lse[np.isinf(ref_lse)])
    assert np.all(out[np.isinf(ref_lse)] == 0)
    ok = np.isfinite(ref_lse)
    np.testing.assert_allclose(lse[ok], ref_lse[ok], rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(out[ok], ref_out[ok], rtol=1e-9, atol=1e-12)


def test_split_size_fills_one_wave():
    """The bench shapes: one wave of resident blocks (264 = 132 SMs x 2), no more."""
    for ext in ([131072] * 8, [32768] * 64, [8192] * 256, [4096] * 512):
        S = _decode.split_size(np.array(ext), 264, 64)
        assert S % 64 == 0
        assert sum(-(-e // S) for e in ext) <= max(264, len(ext))


def test_group_heads():
    """Heads that read the same k, v and length form a group: GQA runs of consecutive heads,
    and interleaved lengths split a shared kv head into one group per length."""
    g, G = _decode.group_heads(np.repeat(np.arange(4), 8), np.repeat(np.arange(4), 8),
                               np.full(32, 9))
    assert G == 8 and (g == np.arange(32).reshape(4, 8)).all()
    g, G = _decode.group_heads(np.zeros(4, int), np.zeros(4, int), np.array([3, 5, 3, 5]))
    assert G == 2 and sorted(map(tuple, g.tolist())) == [(0, 2), (1, 3)]


# ---- split_size against its definition -----------------------------------------------------

def _reference_waves_split(extents, capacity, block_keys, min_keys=_decode.SPLIT_MIN_KEYS):
    """The smallest split whose blocks fit `capacity` (split_size's candidate per wave count,
    _decode._waves_splits) as first written: a bisection on the block count of the extents."""
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


def _reference_split_size(extents, capacity, block_keys, min_keys=_decode.SPLIT_MIN_KEYS,
                           overhead_keys=_decode.SPLIT_OVERHEAD_KEYS, waves=(1, 2, 3, 4, 6, 8)):
    """split_size as first written (and GPU-tuned, as the rule "balanced-fine"): every block
    listed, one heap list schedule per candidate."""
    ext = np.asarray(extents, dtype=np.int64)
    best = None
    cands = {_reference_waves_split(ext, int(w * capacity), block_keys, min_keys) for w in waves}
    top = int(ext.max(initial=0))
    S = max(min_keys, block_keys)
    while S < top:
        cands.add(S)
        S *= 2
    if ext.size and ext.min() < top:  # uneven extents: also every 8 block passes
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
def test_split_size_matches_reference(seed):
    """The closed forms pick exactly the S of the definitions: split_size that of the listed-block
    one (GPU-tuned), its one-wave candidates that of the bisection; uneven and equal extents,
    small and large capacities, all block passes."""
    rng = np.random.default_rng(seed)
    block_keys = _block_keys()
    for _ in range(60):
        ext = _random_extents(rng)
        capacity = int(rng.choice([1, 7, 132, 264, 528, 1056, 4224]))
        bk = int(rng.choice(block_keys))
        waves = _decode._waves_splits(*_decode._distinct(ext), [capacity], bk)
        assert int(waves[0]) == _reference_waves_split(ext, capacity, bk)
        got, want = _decode.split_size(ext, capacity, bk), _reference_split_size(ext, capacity, bk)
        assert got == want, (ext.tolist(), capacity, bk)


def test_split_size_bench_shapes():
    """The GPU-tuned choices on bench.py's decode shapes (8 kv heads, decode_tc's layout, 264
    slots): the uneven batch (B = 32, L = 8192, kv_lens uniform in [1, L] with seed 0) gets
    S = 4608, the four full shapes their one-wave S."""
    lens = np.random.default_rng(0).integers(1, 8192 + 1, size=32)
    assert _decode.split_size(np.repeat(lens, 8), 264, 64) == 4608
    for B, L in ((1, 131072), (8, 32768), (32, 8192), (64, 4096)):
        ext = np.full(8 * B, L)
        assert _decode.split_size(ext, 264, 64) == _reference_waves_split(ext, 264, 64)
