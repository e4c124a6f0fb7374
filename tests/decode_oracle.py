"""A float64 NumPy emulation of the split-KV decode path (cuflash/_decode.py, kernels_cu/decode.cu)
for tests/test_decode_schedule.py: the kernels' algorithm run from the Schedule tables alone, and
the decode cases it is checked on.

`emulate` runs every item in launch order (its partial to its workspace slot, with the kernels'
encoding of visibility and non-finite partials), then the merge rule per row tile; it uses only
the Schedule's tables and the Problem, not the kernels or the package's reference.
"""
import numpy as np


def emulate(p, capacity=64, split=None, rows=None, block_keys=None, device_lens=None, span=None):
    """The decode path's algorithm in float64 NumPy, from the Schedule tables alone (rows and
    block_keys: decode_tc's layout, 16 rows and its stage keys; default decode_split's), with the
    kernels' workspace encoding (kernels_cu/decode.cu "Results per item"): each partial's (max,
    sum) = (-inf, 0) for a row with no visible key in the item, (+inf, 0) for visible keys whose
    logits are all -inf (l == 0), (m, NaN) when a NaN reached l; the merge treats the first two
    as identities, and a row all of whose partials are identities is empty (0, -inf) unless one
    of them is (+inf, 0) (NaN, NaN). device_lens: (BH,) the lengths the kernels read from the
    device when p has lengths on the device (its Schedule plans without them). Returns (out, lse,
    the Schedule). span: the Schedule's (the lengths a plan serves)."""
    from cuflash import _decode
    from cuflash._validate import element_strides

    s = _decode.Schedule(p, capacity, split=split, rows=rows, block_keys=block_keys, span=span)
    BH, Nq, Dv = p.BH, p.Nq, p.Dv
    flat = {}
    for name, x, mp in (("q", p.q, p.q_map), ("k", p.k, s.k_map), ("v", p.v, s.v_map)):
        st = element_strides(x)
        extent = 1 + sum((n - 1) * abs(t) for n, t in zip(x.shape, st))
        base = np.lib.stride_tricks.as_strided(x, shape=(extent,), strides=(x.itemsize,))
        flat[name] = (base.astype(np.float64), np.asarray(mp).reshape(BH), st[-2])

    def mat(name, off, n, d):  # rows of the matrix at element offset `off`
        base, _, rs = flat[name]
        idx = off + np.arange(n)[:, None] * rs + np.arange(d)[None, :]
        return base[idx]

    mask = None if p.mask is None else np.asarray(p.mask).reshape(BH, Nq, p.Nk)
    bias = None if p.bias is None else np.asarray(p.bias, dtype=np.float64).reshape(BH, Nq, p.Nk)
    n_items = s.items.shape[0]
    part_o = np.full((n_items, s.rows, Dv), np.nan)
    part_m = np.full((n_items, s.rows), np.nan)
    part_l = np.full((n_items, s.rows), np.nan)
    written = np.zeros((n_items, s.rows), dtype=bool)
    # in launch order, with the workspace slot of the kernels' items table
    assert sorted(s.launch.tolist()) == list(range(n_items))
    for tid, k0, k1, it, koff, voff in s.items_table():  # K / V as decode_tc reads
        g, tile, first, count = s.tiles[tid]
        keys = np.arange(k0, k1)  # this block's keys
        L = int((s.lens if device_lens is None else device_lens)[s.groups[g, 0]])
        K = mat("k", koff, p.Nk, p.Dk)
        V = mat("v", voff, p.Nk, p.Dv)
        shift = L - Nq if p.bottom_right else 0
        for r in range(s.rows):
            rho = tile * s.rows + r
            if rho >= s.G * Nq or s.groups[g, rho % s.G] < 0:
                continue
            i, bh = rho // s.G, s.groups[g, rho % s.G]
            written[it, r] = True
            lo = max(i + shift - p.left, 0)
            hi = min(i + shift + p.right, L - 1)
            j = keys[(keys >= lo) & (keys <= hi)]
            qrow = mat("q", flat["q"][1][bh], Nq, p.Dk)[i]
            with np.errstate(invalid="ignore", over="ignore"):
                sc = (K[j] @ qrow) * p.scale
            vis = np.ones(j.size, dtype=bool)
            if mask is not None:
                vis &= mask[bh, i, j]
            if bias is not None:
                sc = sc + bias[bh, i, j]
                vis &= bias[bh, i, j] != -np.inf  # a NaN bias is visible
            if not vis.any():
                part_m[it, r], part_l[it, r] = -np.inf, 0.0  # identity; the row sees nothing here
                continue
            sc = np.where(vis, sc, -np.inf)
            fin = sc[~np.isnan(sc)]  # fmaxf leaves NaN out of the max; it reaches l below
            m = fin.max(initial=-np.inf)
            m_ref = 0.0 if m == -np.inf else m
            with np.errstate(invalid="ignore"):
                e = np.exp(sc - m_ref)
                l = e.sum()
                if l == 0:
                    part_m[it, r], part_l[it, r] = np.inf, 0.0  # identity, but the row sees keys
                    continue
                part_o[it, r] = e @ V[j] / l
            part_m[it, r] = m_ref if np.isfinite(m_ref) else 0.0
            part_l[it, r] = l
    out = np.full((BH, Nq, Dv), np.nan)
    lse = np.full((BH, Nq), np.nan)
    for tid, (g, tile, first, count) in enumerate(s.tiles):
        for r in range(s.rows):
            rho = tile * s.rows + r
            if rho >= s.G * Nq or s.groups[g, rho % s.G] < 0:
                continue
            i, bh = rho // s.G, s.groups[g, rho % s.G]
            ms, ls = part_m[first:first + count, r], part_l[first:first + count, r]
            assert written[first:first + count, r].all(), "a partial was never written"
            if np.all(ms == -np.inf):
                out[bh, i], lse[bh, i] = 0.0, -np.inf
                continue
            kept = np.isfinite(ms)  # not an identity
            if np.isnan(ls[kept]).any() or not kept.any():  # NaN, or visible keys but l == 0
                out[bh, i], lse[bh, i] = np.nan, np.nan
                continue
            M = ms[kept].max()
            w = np.where(kept, ls * np.exp(np.where(kept, ms, M) - M), 0.0)
            o = sum(w[k] * part_o[first + k, r] for k in range(count) if kept[k] and w[k] > 0)
            out[bh, i] = o / w.sum()
            lse[bh, i] = M + np.log(w.sum())
    return out.reshape(p.out_shape), lse.reshape(p.lse_shape), s


def _rand(rng, shape):
    """float32 normal draws, widened to float64 (the values the GPU checks drew)."""
    return rng.standard_normal(shape).astype(np.float32).astype(np.float64)


def case_inputs(rng, c):
    """float64 NumPy (q, k, v, options) for one case dict of CASES."""
    B, H, Hkv, Nq, Nk, Dk, Dv = (c[x] for x in ("B", "H", "Hkv", "Nq", "Nk", "Dk", "Dv"))
    q = _rand(rng, (B, H, Nq, Dk))
    if c.get("strided"):  # (B, Nk, Hkv, D) storage viewed as (B, Hkv, Nk, D)
        k = _rand(rng, (B, Nk, Hkv, Dk)).transpose(0, 2, 1, 3)
        v = _rand(rng, (B, Nk, Hkv, Dv)).transpose(0, 2, 1, 3)
    else:
        k = _rand(rng, (B, Hkv, Nk, Dk))
        v = _rand(rng, (B, Hkv, Nk, Dv))
    opts = dict(causal=c.get("causal", False), align=c.get("align", "bottom-right"),
                window=c.get("window"))
    if c.get("kv_lens") is not None:
        opts["kv_lens"] = np.asarray(c["kv_lens"]).reshape(B, 1)
    if c.get("mask"):
        m = rng.random((B, H, Nq, Nk)) < 0.7
        m[0, 0, 0, :] = False  # one fully masked row
        opts["mask"] = m
    if c.get("bias"):
        b = rng.standard_normal((1, H, Nq, Nk)).astype(np.float32) * 0.5
        b[..., ::7] = -np.inf
        opts["bias"] = b
    return q, k, v, opts


CASES = [
    # name, case dict
    ("gqa-nq1", dict(B=2, H=8, Hkv=2, Nq=1, Nk=1500, Dk=128, Dv=128)),
    ("gqa-nq1-causal-kvlens", dict(B=3, H=8, Hkv=2, Nq=1, Nk=2000, Dk=128, Dv=128, causal=True,
                                   kv_lens=[0, 1999, 700])),
    ("gqa-nq3-causal-br", dict(B=2, H=8, Hkv=2, Nq=3, Nk=1100, Dk=64, Dv=64, causal=True)),
    ("gqa-nq3-causal-tl", dict(B=2, H=8, Hkv=2, Nq=3, Nk=1100, Dk=64, Dv=64, causal=True,
                               align="top-left")),
    ("gqa-nq16-causal-br", dict(B=1, H=8, Hkv=2, Nq=16, Nk=900, Dk=128, Dv=128, causal=True)),
    ("gqa-nq16-window", dict(B=2, H=8, Hkv=2, Nq=16, Nk=1200, Dk=128, Dv=128, window=(300, 5),
                             kv_lens=[1200, 611])),
    ("mqa-nq3-window-tl", dict(B=1, H=6, Hkv=1, Nq=3, Nk=1000, Dk=256, Dv=256, causal=True,
                               align="top-left", window=(200, None))),
    ("mha-d80-uneven", dict(B=4, H=2, Hkv=2, Nq=1, Nk=1300, Dk=80, Dv=80,
                            kv_lens=[1, 1300, 513, 0])),
    ("gqa-dk96-dv64-strided", dict(B=2, H=4, Hkv=2, Nq=2, Nk=700, Dk=96, Dv=64, strided=True,
                                   causal=True)),
    ("gqa-d33-unaligned", dict(B=1, H=4, Hkv=2, Nq=1, Nk=800, Dk=33, Dv=33)),
    ("gqa-mask-bias", dict(B=2, H=4, Hkv=2, Nq=3, Nk=900, Dk=64, Dv=64, mask=True, bias=True,
                           causal=True)),
]
