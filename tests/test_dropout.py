"""Dropout (``dropout_p=``, ``dropout_seed=``): the Philox4x32-7 generator against a scalar
implementation (and, at 10 rounds, Random123's known answers), the counter layout, the keep rate,
the reference against its definition and finite differences, the NumPy path against the
reference, p = 0 as no dropout, the seed as data, the validation; on the GPU the mask bitwise
NumPy's and every path's outputs and gradients against the reference.

out = (Z ∘ P / (1 − p')) V with P the undropped softmax; dV = (Z ∘ P / (1 − p'))ᵀ dO,
dS = P ∘ (Z ∘ dP / (1 − p') − D), D = rowsum(dO ∘ O); p' = round(256 p) / 256.
"""
import numpy as np
import pytest

import cuflash
from cuflash import (_dropout, _generic, _gpu, _mma_bwd, _mma_fwd, _numpy, _runtime, _validate,
                     _wgmma_fwd, reference)
from helpers import (BFLOAT16, DTYPE_NAMES, call_public, check_backward, check_forward, dtype_of,
                     to_array, to_host)
from test_softcap import _options as _shared_options

DTYPES = DTYPE_NAMES
SEED = (0x0123456789ABCDEF, 17)


# ---- a scalar Philox4x32-R, written from its definition (Salmon et al., SC'11) ----------------

def _scalar_philox(counter, key, rounds=7):
    c, (k0, k1) = list(counter), key
    for r in range(rounds):
        if r:
            k0, k1 = (k0 + 0x9E3779B9) % 2**32, (k1 + 0xBB67AE85) % 2**32
        p0, p1 = 0xD2511F53 * c[0], 0xCD9E8D57 * c[2]
        c = [(p1 >> 32) ^ c[1] ^ k0, p1 % 2**32, (p0 >> 32) ^ c[3] ^ k1, p0 % 2**32]
    return c


def _scalar_keep(seed, offset, p, bh, i, j):
    """The README's keep rule for one element, from the scalar Philox: call j // 16, byte j % 16
    of its 16 (byte j % 4, low first, of word (j // 4) % 4)."""
    words = _scalar_philox((j // 16, i, bh, offset), (seed % 2**32, seed // 2**32))
    return (words[(j // 4) % 4] >> (8 * (j % 4))) % 256 >= round(p * 256)


# Random123's kat_vectors for philox4x32 with 10 rounds: (counter, key, output).
KAT = [((0, 0, 0, 0), (0, 0), (0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8)),
       ((0xffffffff,) * 4, (0xffffffff,) * 2, (0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd)),
       ((0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344), (0xa4093822, 0x299f31d0),
        (0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1))]


@pytest.mark.parametrize("counter,key,want", KAT)
def test_philox_known_answers(counter, key, want):
    """The round function and key schedule, at Random123's default of 10 rounds (dropout draws
    7: _dropout.ROUNDS, the same rounds fewer)."""
    assert _dropout.ROUNDS == 7
    assert tuple(_scalar_philox(counter, key, 10)) == want
    got = _dropout.philox4x32(counter, key, 10)
    assert tuple(int(x) for x in got) == want


@pytest.mark.parametrize("rounds", [7, 10])
def test_numpy_generator_is_the_scalar_one(rounds, rng):
    """Vectorized uint32 arithmetic (uint64 products, wrapping key bumps) gives the scalar
    definition's bits on random counters and keys, extreme words included."""
    counters = rng.integers(0, 2**32, size=(4, 300), dtype=np.uint64)
    counters[:, :4] = [[0], [1], [2**32 - 1], [2**31]]
    key = (int(rng.integers(0, 2**32)), 2**32 - 1)
    got = np.stack(_dropout.philox4x32(tuple(counters), key, rounds))
    for n in range(counters.shape[1]):
        want = _scalar_philox([int(c) for c in counters[:, n]], key, rounds)
        assert [int(x) for x in got[:, n]] == want, n


@pytest.mark.parametrize("j0, j1", [(5, 23), (0, 16), (3, 9), (60, 200), (123, 124), (7, 7)])
def test_counter_layout(j0, j1):
    """keep() over odd key ranges (inside a 16-key block and across blocks) of several heads and
    rows is the per-element rule: call j // 16, byte j % 16, key (seed low, seed high)."""
    seed, offset, p = 2**64 - 5, 2**32 - 3, 0.37
    t = _dropout.threshold(p)
    bh, rows = np.array([0, 3, 2**31 + 7]), np.array([0, 5, 1000])
    z = _dropout.keep(seed, offset, t, bh[:, None], rows[None, :], j0, j1)
    assert z.shape == (3, 3, j1 - j0)
    for a, b in enumerate(bh):
        for c, i in enumerate(rows):
            want = [_scalar_keep(seed, offset, p, int(b), int(i), j) for j in range(j0, j1)]
            assert list(z[a, c]) == want


def test_one_call_is_sixteen_keys():
    """The 16 bytes of call b of a row are its keys 16 b .. 16 b + 15, in byte order (each drawn
    alone: the generator does not depend on the range asked)."""
    seed, offset, i, bh, b = 99, 5, 17, 3, 2
    words = _scalar_philox((b, i, bh, offset), (seed, 0))
    for t in (0, 100, 200, 255):
        want = [(words[k // 4] >> (8 * (k % 4))) % 256 >= t for k in range(16)]
        got = [_dropout.keep(seed, offset, t, bh, i, j, j + 1)[0]
               for j in range(16 * b, 16 * b + 16)]
        assert got == want


def test_threshold():
    """round(p 256), halves up; the kept weights' factor 1 / (1 - threshold / 256); None where p
    rounds to 1 (refused by the public functions)."""
    assert _dropout.threshold(0.0) == 0
    assert _dropout.threshold(0.5) == 128
    assert _dropout.threshold(0.1) == 26  # 25.6
    assert _dropout.threshold(1 / 512) == 1 and _dropout.threshold(np.nextafter(1 / 512, 0)) == 0
    assert _dropout.threshold(np.nextafter(255.5 / 256, 0)) == 255
    assert _dropout.threshold(255.5 / 256) is None
    assert _dropout.rscale(0.25) == 1 / 0.75 and _dropout.rscale(0.1) == 256 / 230


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_keep_rate(p):
    """The kept fraction is 1 - p' (p' = round(256 p) / 256) within 5 standard deviations, per
    head and overall; two offsets (and two heads) agree as often as independent masks would
    (p'² + (1 - p')²)."""
    n = 4 * 128 * 512
    z = _dropout.dense_keep((4,), 128, 512, p, (12345, 0))
    p = _dropout.threshold(p) / 256
    sd = np.sqrt(p * (1 - p) / n)
    assert abs(z.mean() - (1 - p)) < 5 * sd
    for h in range(4):
        assert abs(z[h].mean() - (1 - p)) < 5 * 2 * sd
    other = _dropout.dense_keep((4,), 128, 512, p, (12345, 1))
    same = p * p + (1 - p) * (1 - p)
    assert abs((z == other).mean() - same) < 5 * np.sqrt(same * (1 - same) / n)
    assert abs((z[0] == z[1]).mean() - same) < 5 * np.sqrt(same * (1 - same) / (n / 4))
    # neighbouring keys (one Philox call, or not) and rows are not correlated
    for a, b in ((z[..., :-1], z[..., 1:]), (z[..., :-16], z[..., 16:]), (z[:, :-1], z[:, 1:])):
        assert abs((a == b).mean() - same) < 5 * np.sqrt(same * (1 - same) / a.size)


# ---- the reference ----------------------------------------------------------------------------

def test_reference_is_the_definition(rng):
    """(Z P / (1 - p)) v with P the undropped softmax; lse the undropped one; the mask is the
    per-element rule of the README (scalar Philox)."""
    q, k, v = (rng.standard_normal(s) for s in ((2, 9, 4), (2, 11, 4), (2, 11, 3)))
    p = 0.4
    out, lse = reference.attention(q, k, v, dropout_p=p, dropout_seed=SEED, return_lse=True)
    z = reference.dropout_mask(q, k, v, p, SEED)
    for bh in range(2):
        for i in range(9):
            assert list(z[bh, i]) == [_scalar_keep(*SEED, p, bh, i, j) for j in range(11)]
    s = q @ np.swapaxes(k, -1, -2) / 2.0
    w = np.exp(s - s.max(-1, keepdims=True))
    w /= w.sum(-1, keepdims=True)
    np.testing.assert_allclose(out, (z * w * (256 / (256 - round(256 * p)))) @ v, rtol=1e-13,
                               atol=1e-14)
    np.testing.assert_array_equal(lse, reference.attention(q, k, v, return_lse=True)[1])
    assert not z.all() and z.any()


def _fd_check(fn, q, k, v, dout, grads, h=1e-6, rtol=1e-6, atol=1e-8):
    for x, g in zip((q, k, v), grads):
        num = np.zeros_like(x)
        for idx in np.ndindex(x.shape):
            old = x[idx]
            x[idx] = old + h
            up = (fn(q, k, v) * dout).sum()
            x[idx] = old - h
            down = (fn(q, k, v) * dout).sum()
            x[idx] = old
            num[idx] = (up - down) / (2 * h)
        np.testing.assert_allclose(g, num, rtol=rtol, atol=atol)


@pytest.mark.parametrize("attention,backward", [
    (reference.attention, reference.attention_backward),
    (cuflash.attention, cuflash.attention_backward)], ids=["reference", "numpy"])
def test_gradients_match_finite_differences(attention, backward, rng):
    """dq, dk, dv with dropout (and mask, bias, causal, GQA) against central differences of
    sum(out * dout) in float64; the mask is a function of the seed alone, so it stays fixed."""
    q, k, v = (rng.standard_normal(s) for s in ((2, 5, 3), (1, 7, 3), (1, 7, 2)))
    mask = rng.random((5, 7)) < 0.8
    opts = dict(dropout_p=0.3, dropout_seed=SEED, mask=mask, bias=rng.standard_normal((5, 7)),
                causal=True, align="top-left", scale=0.8)
    out, lse = attention(q, k, v, return_lse=True, **opts)
    dout = rng.standard_normal(out.shape)
    grads = backward(dout, q, k, v, out, lse, **opts)
    _fd_check(lambda a, b, c: attention(a, b, c, **opts), q, k, v, dout, grads)


# ---- the NumPy path ---------------------------------------------------------------------------

def _inputs(rng, lq, lkv, Nq, Nk, Dk, Dv, dtype, xp=np):
    shapes = (lq + (Nq, Dk), lkv + (Nk, Dk), lkv + (Nk, Dv))
    return [to_array(xp, rng.standard_normal(s), dtype_of(dtype)) for s in shapes]


def _options(name, rng, lead, Nq, Nk, xp=np):
    """test_softcap's cases by name, and two of dropout's own."""
    if name == "mask":  # no bound: the Hopper forward stages (and classifies) the mask's tiles
        mask = rng.random(lead + (Nq, Nk)) < 0.7
        mask[..., :, 64:128] = False  # a hidden key block
        return dict(mask=xp.asarray(mask))
    if name == "softcap-alibi-sinks":
        return dict(softcap=3.0, alibi_slopes=xp.asarray(np.linspace(0.1, 0.5, lead[-1])),
                    sinks=xp.asarray(np.linspace(-1.0, 1.0, lead[-1])))
    return _shared_options(name, rng, lead, Nq, Nk, xp)


CASES = [("plain", (2,), (2,), 37, 53, 16, 16), ("causal", (2, 2), (2, 1), 40, 40, 8, 12),
         ("window-kv_lens", (2,), (2,), 33, 300, 16, 16), ("mask-bias", (2,), (2,), 24, 31, 8, 8),
         ("softcap-alibi-sinks", (1, 3), (1, 3), 20, 45, 8, 8)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_numpy_path(case, dtype, rng):
    name, lq, lkv, Nq, Nk, Dk, Dv = case
    q, k, v = _inputs(rng, lq, lkv, Nq, Nk, Dk, Dv, dtype)
    opts = dict(_options(name, rng, lq, Nq, Nk), dropout_p=0.25, dropout_seed=SEED)
    out, lse = cuflash.attention(q, k, v, return_lse=True, **opts)
    check_forward(out, lse, q, k, v, **opts)
    dout = to_array(np, rng.standard_normal(out.shape), dtype_of(dtype))
    grads = cuflash.attention_backward(dout, q, k, v, out, lse, **opts)
    check_backward(grads, dout, q, k, v, out, lse, **opts)
    out2, vjp = cuflash.attention_vjp(q, k, v, **opts)  # keeps the seed: the same mask
    np.testing.assert_array_equal(out2, out)
    for a, b in zip(vjp(dout), grads):
        np.testing.assert_array_equal(a, b)


def test_dropout_changes_the_answer(rng):
    """The test above could not see a path that ignored dropout: the dropped out differs from
    the undropped one far beyond rounding, and so do the gradients."""
    q, k, v = _inputs(rng, (2,), (2,), 30, 40, 8, 8, "float32")
    out = cuflash.attention(q, k, v, dropout_p=0.3, dropout_seed=1)
    assert np.abs(out - cuflash.attention(q, k, v)).max() > 0.1
    g = cuflash.attention_backward(out, q, k, v, out, cuflash.attention(
        q, k, v, dropout_p=0.3, dropout_seed=1, return_lse=True)[1], dropout_p=0.3,
        dropout_seed=1)
    g0 = cuflash.attention_backward(out, q, k, v, out, cuflash.attention(
        q, k, v, return_lse=True)[1])
    assert all(np.abs(a - b).max() > 1e-2 for a, b in zip(g, g0))


def test_lost_rows_with_dropout(rng):
    """Rows padded with an additive finfo(float32).min bias are "lost" (|lse| >= 2**12): the
    backward recomputes them exactly, with the same keep bits."""
    q, k, v = _inputs(rng, (2,), (2,), 12, 20, 8, 8, "float32")
    bias = np.zeros((12, 20), np.float32)
    bias[4] = np.finfo(np.float32).min
    bias[7, 3:] = np.finfo(np.float32).min
    opts = dict(bias=bias, dropout_p=0.3, dropout_seed=SEED)
    out, lse = cuflash.attention(q, k, v, return_lse=True, **opts)
    assert np.abs(lse[:, 4]).min() >= 2**12
    check_forward(out, lse, q, k, v, **opts)
    dout = rng.standard_normal(out.shape).astype(np.float32)
    grads = cuflash.attention_backward(dout, q, k, v, out, lse, **opts)
    check_backward(grads, dout, q, k, v, out, lse, **opts)


def test_a_nan_row_with_dropout(rng):
    """A NaN in q makes its row NaN (out, lse, dq); in the backward dv is NaN exactly on the keys
    that row keeps (a dropped weight is exactly 0 even where P is NaN), dk on every key (dS =
    P (Z dP r - D) is NaN wherever P is), on the NumPy path as in the reference."""
    q, k, v = _inputs(rng, (1,), (1,), 10, 14, 8, 8, "float64")
    q[0, 3, 0] = np.nan
    opts = dict(dropout_p=0.5, dropout_seed=SEED)
    out, lse = cuflash.attention(q, k, v, return_lse=True, **opts)
    assert np.isnan(out[0, 3]).all() and np.isnan(lse[0, 3]) and not np.isnan(out[0, 4:]).any()
    dout = rng.standard_normal(out.shape)
    got = cuflash.attention_backward(dout, q, k, v, out, lse, **opts)
    want = reference.attention_backward(dout, q, k, v, out, lse, **opts)
    kept = reference.dropout_mask(q, k, v, 0.5, SEED)[0, 3]
    assert 0 < kept.sum() < 14
    assert np.isnan(got[0][0, 3]).all() and not np.isnan(np.delete(got[0][0], 3, axis=0)).any()
    assert np.isnan(got[1]).any(axis=-1).all() and np.isnan(want[1]).any(axis=-1).all()
    for g in (got[2], want[2]):
        np.testing.assert_array_equal(np.isnan(g[0]).any(axis=-1), kept)
    np.testing.assert_allclose(got[2][0, ~kept], want[2][0, ~kept], rtol=1e-12, atol=1e-13)


def test_zero_is_off_bitwise(rng):
    """dropout_p = 0 (with or without a seed) is the call without dropout, bitwise: the same
    Problem (no dropout fields) and the same results; and on the GPU the same kernels."""
    q, k, v = _inputs(rng, (2,), (2,), 21, 33, 8, 8, "float32")
    base, base_lse = cuflash.attention(q, k, v, causal=True, return_lse=True)
    for extra in (dict(dropout_p=0.0), dict(dropout_p=0, dropout_seed=5),
                  dict(dropout_p=0.0, dropout_seed=(5, 6))):
        out, lse = cuflash.attention(q, k, v, causal=True, return_lse=True, **extra)
        np.testing.assert_array_equal(out, base)
        np.testing.assert_array_equal(lse, base_lse)
        g = cuflash.attention_backward(out, q, k, v, out, lse, causal=True, **extra)
        for a, b in zip(g, cuflash.attention_backward(out, q, k, v, out, lse, causal=True)):
            np.testing.assert_array_equal(a, b)
        p = _validate.make_problem(q, k, v, **extra)
        assert p.dropout_p == 0.0 and p.dropout_seed is None
    assert _generic.name_expression("fwd", "float16", 64) == \
        _generic.name_expression("fwd", "float16", 64, (), False)
    assert "DropoutArgs" not in _generic.name_expression("fwd", "float16", 64)


def test_mask_does_not_depend_on_tiles(rng, monkeypatch):
    """The NumPy path's applied mask is the reference's whatever its tiles: with q = k = 0 every
    visible key weighs 1 / L, so with v = the identity out[i, j] > 0 exactly where key j is kept;
    blocks of 1, 3 and 8 rows against tiles of 4, 7 and 256 keys all show the dense mask."""
    Nq, Nk, p = 13, 29, 0.4
    q, k, v = np.zeros((3, Nq, 2)), np.zeros((3, Nk, 2)), np.broadcast_to(np.eye(Nk), (3, Nk, Nk))
    want = reference.dropout_mask(q, k, v, p, SEED)
    for bm, bn in ((1, 4), (3, 7), (8, 256), (None, 256)):
        monkeypatch.setattr(_numpy, "BLOCK_M", bm)
        monkeypatch.setattr(_numpy, "BLOCK_N", bn)
        out = cuflash.attention(q, k, v, dropout_p=p, dropout_seed=SEED)
        np.testing.assert_array_equal(out > 0, want)
        np.testing.assert_allclose(out[want], _dropout.rscale(p) / Nk, rtol=1e-14)


def test_seed_is_data(rng):
    """Two seeds share one signature (nothing re-planned) but draw their own masks; the offset
    and the seed's high word both change the mask."""
    q, k, v = _inputs(rng, (2,), (2,), 16, 24, 8, 8, "float64")
    seeds = [(1, 0), (1, 1), (1 + 2**32, 0), (1, 0)]
    keys = {_validate.make_problem(q, k, v, dropout_p=0.5, dropout_seed=s).key for s in seeds}
    assert len(keys) == 1
    outs = []
    for s in seeds:
        out = cuflash.attention(q, k, v, dropout_p=0.5, dropout_seed=s)
        np.testing.assert_allclose(out, reference.attention(q, k, v, dropout_p=0.5,
                                                            dropout_seed=s),
                                   rtol=1e-12, atol=1e-14)
        outs.append(out)
    assert all(np.abs(outs[0] - o).max() > 1e-3 for o in outs[1:3])
    np.testing.assert_array_equal(outs[0], outs[3])
    # an int seed is (seed, 0)
    np.testing.assert_array_equal(cuflash.attention(q, k, v, dropout_p=0.5, dropout_seed=1),
                                  outs[0])
    # a new probability is a new signature
    assert _validate.make_problem(q, k, v, dropout_p=0.25, dropout_seed=1).key not in keys


def test_which_paths_take_dropout():
    """Every CUDA path says whether its kernels take dropout; the generic kernels (the fallback)
    do, so the dispatcher can always place a dropout Problem. The catalog's DropoutArgs kernels:
    the generic ones with each chain of transforms (every dtype, bucket; their lost-row kernels),
    the mma.sync and Hopper forwards' tiles without transforms or sinks (each settles its own
    lost rows: no fwd_lost_rows) and
    the tensor-core backward's without transforms (dK/dV with and without dQ atomics on the
    mma.sync tiles and, at D = 64 and 128, the wgmma ones; dQ; no grid, not D=96; its prep,
    which settles lost rows, by lost-row columns)."""
    for path in _gpu.PATHS:
        assert path.DROPOUT is (path in (_generic, _mma_fwd, _mma_bwd, _wgmma_fwd)), path.__name__
    exprs = [e for *_, e in _gpu.instantiations() if "DropoutArgs" in e]
    kinds = {}
    for e in exprs:
        kinds[e.split("<")[0]] = kinds.get(e.split("<")[0], 0) + 1
    assert kinds == {"fwd_generic": 64, "bwd_dkdv": 64, "bwd_dq": 64, "bwd_lost_rows": 16,
                     "bwd_lost_keys": 18, "fwd_mma": 24, "bwd_mma_prep": 6,
                     "bwd_mma_dkdv": 64, "bwd_mma_dq": 24, "fwd_wgmma": 40}
    assert all("NoMod" in e or "MaskBiasMod" in e for e in exprs
               if e.startswith(("fwd_mma", "bwd_mma_dkdv", "bwd_mma_dq")))
    assert all("NoTransform, false, DropoutArgs" in e for e in exprs if e.startswith("fwd_wgmma"))
    assert not any(e.startswith("bwd_mma_dkdv_grid") for e in exprs)
    wg = {e for e in exprs if e.startswith("bwd_mma_dkdv") and int(e.rsplit(",", 2)[-2]) &
          _mma_bwd.OPT_WG}
    assert len(wg) == 16 and all(", 64, 64, " in e or ", 128, 128, " in e for e in wg)


def test_dropout_args_struct_matches_its_host_mirror():
    """kernels_cu/philox.cuh DropoutArgs and cuflash._runtime.DROPOUT_FIELDS: the same fields in
    the same order and C types (NumPy's aligned layout is then C's: 24 bytes), and the values the
    host packs (threshold round(256 p), rscale 256 / (256 - threshold), the checked seed and
    offset)."""
    import re
    src = (_runtime.kernels_dir() / "philox.cuh").read_text()
    body = re.search(r"struct DropoutArgs \{(.*?)\};", src, re.S).group(1)
    c_types = {"unsigned long long": "<u8", "unsigned": "<u4", "double": "<f8"}
    fields = []
    for decl in re.sub(r"//[^\n]*", "", body).split(";"):
        decl = " ".join(decl.split())
        if decl:
            ctype = next(t for t in sorted(c_types, key=len, reverse=True)
                         if decl.startswith(t + " "))
            fields.append((decl[len(ctype):].strip(), c_types[ctype]))
    assert fields == list(_runtime.DROPOUT_FIELDS)
    assert _runtime.DROPOUT_DTYPE.itemsize == 24
    q, k, v = _inputs(np.random.default_rng(0), (), (), 4, 5, 8, 8, "float32")
    (a,) = _runtime.dropout_args(_validate.make_problem(q, k, v, dropout_p=0.25,
                                                        dropout_seed=(2**64 - 1, 7)))
    assert (int(a["seed"]), int(a["offset"]), int(a["threshold"])) == (2**64 - 1, 7, 64)
    assert float(a["rscale"]) == 1 / 0.75
    assert _runtime.dropout_args(_validate.make_problem(q, k, v, dropout_p=0.0)) == ()


# ---- validation -------------------------------------------------------------------------------

@pytest.mark.parametrize("fn", ["attention", "attention_backward", "attention_vjp"])
@pytest.mark.parametrize("options, error, match", [
    (dict(dropout_p=True, dropout_seed=1), TypeError, "dropout_p must be a real number"),
    (dict(dropout_p="0.1", dropout_seed=1), TypeError, "dropout_p must be a real number"),
    (dict(dropout_p=1.0, dropout_seed=1), ValueError, r"dropout_p must lie in \[0, 1\)"),
    (dict(dropout_p=0.999, dropout_seed=1), ValueError,
     r"dropout_p rounds to 1 at dropout's granularity 1/256 .*got 0.999$"),
    (dict(dropout_p=-0.1, dropout_seed=1), ValueError, r"dropout_p must lie in \[0, 1\)"),
    (dict(dropout_p=float("nan"), dropout_seed=1), ValueError, r"dropout_p must lie"),
    (dict(dropout_p=0.1), TypeError, r"dropout_p=0.1 needs dropout_seed"),
    (dict(dropout_p=0.1, dropout_seed=1.5), TypeError, "dropout_seed's seed must be an int"),
    (dict(dropout_p=0.1, dropout_seed=True), TypeError, "dropout_seed's seed must be an int"),
    (dict(dropout_p=0.1, dropout_seed=-1), ValueError,
     r"dropout_seed's seed must lie in \[0, 18446744073709551615\]"),
    (dict(dropout_p=0.1, dropout_seed=2**64), ValueError, "dropout_seed's seed must lie in"),
    (dict(dropout_p=0.1, dropout_seed=(1, 2**32)), ValueError,
     r"dropout_seed's offset must lie in \[0, 4294967295\]"),
    (dict(dropout_p=0.1, dropout_seed=(1, "2")), TypeError, "dropout_seed's offset must be an int"),
    (dict(dropout_p=0.1, dropout_seed=(1, 2, 3)), ValueError,
     "dropout_seed must be an int or a pair"),
    (dict(dropout_p=0.0, dropout_seed=-3), ValueError, "dropout_seed's seed must lie in"),
])
def test_bad_dropout_is_refused(fn, options, error, match, rng):
    q, k, v = _inputs(rng, (), (), 4, 5, 8, 8, "float32")
    with pytest.raises(error, match=f"^{fn}: {match}"):
        call_public(fn, q, k, v, **options)


def test_a_bad_seed_is_refused_on_a_known_signature(rng):
    """The seed's values are not in the signature, so they are checked on every call: a bad
    seed after a good one of the same types is refused too."""
    q, k, v = _inputs(rng, (), (), 4, 5, 8, 8, "float32")
    cuflash.attention(q, k, v, dropout_p=0.2, dropout_seed=(3, 4))
    with pytest.raises(ValueError, match="^attention: dropout_seed's offset must lie"):
        cuflash.attention(q, k, v, dropout_p=0.2, dropout_seed=(3, 2**40))
    with pytest.raises(ValueError, match="^attention: dropout_seed's seed must lie"):
        cuflash.attention(q, k, v, dropout_p=0.2, dropout_seed=(-3, 4))
    # without dropout too: a seed given with dropout_p = 0 is checked, then ignored (a plain
    # signature's shortcut must not skip it)
    for _ in range(2):
        cuflash.attention(q, k, v, dropout_seed=(3, 4))
    with pytest.raises(ValueError, match="^attention: dropout_seed's offset must lie"):
        cuflash.attention(q, k, v, dropout_seed=(3, 2**40))


# ---- the CUDA paths ---------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("path", ["generic", "mma", "wgmma", "wide", "split", "auto"])
@pytest.mark.parametrize("mask", [False, True], ids=["positions", "mask"])
def test_cuda_mask_is_numpy_bitwise(mask, path, dtype, override):
    """The GPU's applied mask is the NumPy generator's bit for bit (q = k = 0, v = the identity:
    out[i, j] > 0 exactly where key j is kept), on a forced path (or its fallback) and the
    automatic choice, with a window and kv_lens so that key tiles start at odd keys (the
    tensor-core kernels' pairs of keys straddle Philox groups there); the 16-bit inputs take
    the tensor-core forwards (mma.sync; Hopper's where it runs)."""
    import cupy
    override(poison=True, path=None if path == "auto" else path)
    Nq, Nk, D, p = 70, 128, 128, 0.35
    lens = np.array([[Nk], [101]])
    visible = None if not mask else np.random.default_rng(5).random((2, 3, Nq, Nk)) < 0.9
    opts = dict(dropout_p=p, dropout_seed=SEED, window=(45, 3), kv_lens=lens,
                mask=None if visible is None else cupy.asarray(visible))
    q = to_array(cupy, np.zeros((2, 3, Nq, D)), dtype_of(dtype))
    k = to_array(cupy, np.zeros((2, 3, Nk, D)), dtype_of(dtype))
    v = to_array(cupy, np.broadcast_to(np.eye(Nk), (2, 3, Nk, D)), dtype_of(dtype))
    tc = dtype in ("float16", "bfloat16")
    hopper = _runtime.wgmma_available()
    want = {"mma": {"mma"}, "wgmma": {"wgmma" if hopper else "generic"},
            "auto": {"wgmma", "mma"}}.get(path, {"generic"}) if tc else {"generic"}
    assert _gpu.forward_path(_validate.make_problem(q, k, v, **opts)) in want
    out = to_host(cuflash.attention(q, k, v, **opts)).astype(np.float64)
    z = reference.dropout_mask(to_host(q), to_host(k), to_host(v), p, SEED)
    seen = reference.attention(np.zeros((2, 3, Nq, 1)), np.zeros((2, 3, Nk, 1)),
                               np.broadcast_to(np.eye(Nk), (2, 3, Nk, Nk)), window=(45, 3),
                               kv_lens=lens, mask=visible) > 0
    opts["mask"] = visible
    np.testing.assert_array_equal(out > 0, z & seen)
    host = cuflash.attention(to_host(q), to_host(k), to_host(v), **opts)
    np.testing.assert_array_equal(host.astype(np.float64) > 0, z & seen)


GPU_CASES = [("plain", (2, 2), (2, 2), 97, 130, 64, 64),
             ("causal", (1, 4), (1, 2), 150, 150, 128, 128),
             ("window-kv_lens", (2,), (2,), 70, 200, 64, 64),
             ("mask-bias", (2,), (2,), 80, 96, 32, 32),
             ("mask", (2, 2), (2, 2), 200, 256, 64, 64),
             ("softcap-alibi-sinks", (1, 3), (1, 3), 40, 70, 256, 256),
             ("causal", (2,), (2,), 65, 90, 96, 48),
             ("plain", (1, 2), (1, 2), 77, 140, 256, 256),  # fwd_mma's DROPOUT_TILES 64 x 32
             ("plain", (1, 8), (1, 2), 2, 1024, 128, 128)]  # a decode shape


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["generic", "auto"])  # (the forced paths: the mask test above)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", GPU_CASES, ids=[f"{c[0]}-nq{c[3]}-d{c[5]}x{c[6]}"
                                                 for c in GPU_CASES])
def test_cuda_paths(case, dtype, path, rng, override):
    """Outputs and gradients with dropout against the float64 reference (same mask), within 2x a
    same-dtype naive baseline; the chooser puts dropout on a path that takes it (generic)."""
    import cupy
    name, lq, lkv, Nq, Nk, Dk, Dv = case
    override(poison=True, path=None if path == "auto" else path)
    q, k, v = _inputs(rng, lq, lkv, Nq, Nk, Dk, Dv, dtype, cupy)
    opts = dict(_options(name, rng, lq, Nq, Nk, cupy), dropout_p=0.2, dropout_seed=SEED)
    p = _validate.make_problem(q, k, v, **opts)
    # the tensor-core forwards take 16-bit dropout without transforms or sinks (Hopper's where
    # it takes the layout), the mma.sync backward without transforms; the rest: generic
    tc = dtype in ("float16", "bfloat16") and name != "softcap-alibi-sinks" and path == "auto"
    forward = "wgmma" if tc and _wgmma_fwd.takes(p) else (
        "mma" if tc and Dk == Dv and Dk in _mma_fwd.HEAD_DIMS else "generic")
    assert _gpu.forward_path(p) == forward
    assert _gpu.backward_path(p) == ("mma" if tc and (Dk, Dv) in _mma_bwd.DKDV_TILES_DROPOUT
                                     else "generic")
    out, lse = cuflash.attention(q, k, v, return_lse=True, **opts)
    check_forward(out, lse, q, k, v, **opts)
    dout = to_array(cupy, rng.standard_normal(out.shape), dtype_of(dtype))
    for deterministic in (False, True):  # (the mma.sync dQ kernel with True)
        grads = cuflash.attention_backward(dout, q, k, v, out, lse, deterministic=deterministic,
                                           **opts)
        check_backward(grads, dout, q, k, v, out, lse, **opts)
    # (grads are the deterministic call's: the default adds dQ in an unfixed order)
    _, vjp = cuflash.attention_vjp(q, k, v, deterministic=True, **opts)
    for a, b in zip(vjp(dout), grads):
        np.testing.assert_array_equal(to_host(a), to_host(b))


@pytest.mark.gpu
def test_cuda_agrees_with_numpy(rng):
    """float64 on the GPU and on the CPU: the same mask, the same result to rounding."""
    import cupy
    q, k, v = _inputs(rng, (2, 2), (2, 1), 50, 77, 32, 32, "float64")
    opts = dict(causal=True, dropout_p=0.5, dropout_seed=SEED)
    out, lse = cuflash.attention(q, k, v, return_lse=True, **opts)
    gq, gk, gv = (cupy.asarray(x) for x in (q, k, v))
    dout = rng.standard_normal(out.shape)
    gout, glse = cuflash.attention(gq, gk, gv, return_lse=True, **opts)
    np.testing.assert_allclose(to_host(gout), out, rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(to_host(glse), lse, rtol=1e-13)
    cpu = cuflash.attention_backward(dout, q, k, v, out, lse, **opts)
    gpu = cuflash.attention_backward(cupy.asarray(dout), gq, gk, gv, gout, glse, **opts)
    for a, b in zip(gpu, cpu):
        np.testing.assert_allclose(to_host(a), b, rtol=1e-11, atol=1e-12)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("dims", sorted(_mma_bwd.DKDV_TILES))  # (96, 96): declined
@pytest.mark.parametrize("masked", [False, True], ids=["plain", "mask"])
@pytest.mark.parametrize("wgmma", [True, False], ids=["wgmma", "mma"])
def test_cuda_tensor_core_backward(wgmma, masked, dims, dtype, rng, override):
    """The tensor-core backward with dropout at every head-dim pair it takes (dK/dV with dQ
    atomics, and deterministic with the dQ kernel; halves at 192 / 256), causal with odd lengths,
    against the reference with the same mask: the mma.sync tiles, and on sm_90 (wgmma=True) the
    wgmma ones at D = 64 and 128."""
    import cupy
    if dtype == "bfloat16" and BFLOAT16 is None:
        pytest.skip("ml_dtypes missing")
    if wgmma and not _runtime.wgmma_available():
        pytest.skip("wgmma tiles: compute capability 9.0")
    override(poison=True, wgmma=wgmma)
    Dk, Dv = dims
    q, k, v = _inputs(rng, (2, 2), (2, 1), 97, 113, Dk, Dk, dtype, cupy)
    v = to_array(cupy, rng.standard_normal((2, 1, 113, Dv)), dtype_of(dtype))
    opts = dict(causal=True, dropout_p=0.3, dropout_seed=SEED)
    if masked:
        opts["mask"] = cupy.asarray(rng.random((97, 113)) < 0.85)
    p = _validate.make_problem(q, k, v, **opts)
    assert _gpu.backward_path(p) == ("generic" if dims in _mma_bwd.NO_DROPOUT_DIMS else "mma")
    for atomic in (True, False):
        if dims in _mma_bwd.NO_DROPOUT_DIMS:
            break
        tile = _mma_bwd.dkdv_tile(dims, masked, atomic, (), True)
        assert bool(tile.opt & _mma_bwd.OPT_WG) == (wgmma and dims in _mma_bwd.DKDV_TILES_WG)
    out, lse = cuflash.attention(q, k, v, return_lse=True, **opts)
    dout = to_array(cupy, rng.standard_normal(out.shape), dtype_of(dtype))
    for deterministic in (False, True):
        grads = cuflash.attention_backward(dout, q, k, v, out, lse, deterministic=deterministic,
                                           **opts)
        check_backward(grads, dout, q, k, v, out, lse, **opts)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_cuda_lost_rows_with_dropout(dtype, rng, override):
    """Lost rows (an additive finfo(float32).min padding bias) get their exact gradients from
    the lost-row kernels, with the main kernels' keep bits."""
    import cupy
    override(poison=True)
    q, k, v = _inputs(rng, (2,), (2,), 40, 64, 32, 32, dtype, cupy)
    bias = np.zeros((40, 64), np.float32)
    bias[4] = np.finfo(np.float32).min
    bias[9, 5:] = np.finfo(np.float32).min
    opts = dict(bias=cupy.asarray(bias), dropout_p=0.3, dropout_seed=SEED)
    out, lse = cuflash.attention(q, k, v, return_lse=True, **opts)
    assert np.abs(to_host(lse)[:, 4]).min() >= 2**12
    check_forward(out, lse, q, k, v, **opts)
    dout = to_array(cupy, rng.standard_normal(out.shape), dtype_of(dtype))
    grads = cuflash.attention_backward(dout, q, k, v, out, lse, **opts)
    check_backward(grads, dout, q, k, v, out, lse, **opts)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
def test_cuda_zero_keeps_the_path(dtype, rng):
    """dropout_p = 0 chooses the paths (and so the kernels) of the call without it, and gives
    bitwise its results."""
    import cupy
    q, k, v = _inputs(rng, (2, 4), (2, 4), 256, 256, 64, 64, dtype, cupy)
    plain = _validate.make_problem(q, k, v, causal=True)
    zero = _validate.make_problem(q, k, v, causal=True, dropout_p=0.0, dropout_seed=3)
    assert _gpu.forward_path(zero) == _gpu.forward_path(plain)
    assert _gpu.backward_path(zero) == _gpu.backward_path(plain)
    a, la = cuflash.attention(q, k, v, causal=True, return_lse=True)
    b, lb = cuflash.attention(q, k, v, causal=True, return_lse=True, dropout_p=0.0, dropout_seed=3)
    np.testing.assert_array_equal(to_host(a), to_host(b))
    np.testing.assert_array_equal(to_host(la), to_host(lb))


@pytest.mark.gpu
def test_cuda_paged_with_dropout(rng):
    """A paged decode call with dropout is gathered and runs on the generic kernels (decode
    declines dropout); it is the contiguous call's result."""
    import cupy
    B, H, Hkv, D, ps = 2, 4, 2, 64, 16
    k_pages = cupy.asarray(rng.standard_normal((10, Hkv, ps, D)).astype(np.float32))
    v_pages = cupy.asarray(rng.standard_normal((10, Hkv, ps, D)).astype(np.float32))
    table = np.array([[7, 2, 5], [0, 9, 4]], np.int32)
    lens = np.array([40, 33])
    q = cupy.asarray(rng.standard_normal((B, H, 1, D)).astype(np.float32))
    opts = dict(kv_lens=lens, dropout_p=0.4, dropout_seed=SEED)
    out = cuflash.attention(q, k_pages, v_pages, block_table=table, **opts)
    k = k_pages[cupy.asarray(table)].transpose(0, 2, 1, 3, 4).reshape(B, Hkv, 3 * ps, D)
    v = v_pages[cupy.asarray(table)].transpose(0, 2, 1, 3, 4).reshape(B, Hkv, 3 * ps, D)
    # (with a block table kv_lens is per sequence; the contiguous call's broadcasts over heads)
    flat = dict(opts, kv_lens=lens[:, None])
    np.testing.assert_allclose(to_host(out), to_host(cuflash.attention(q, k, v, **flat)),
                               rtol=1e-6, atol=1e-6)
    check_forward(out, cuflash.attention(q, k, v, return_lse=True, **flat)[1], q, k, v, **flat)


def test_dropout_with_dbias_or_packed_is_refused(rng):
    """Not supported yet, and said so before any work: dropout with return_dbias (no kernel stores
    dS with the keep bits), and dropout on packed sequences (its mask's positions are not
    defined per sequence); the reference refuses them alike."""
    q, k, v = (rng.standard_normal((2, 6, 8)) for _ in range(3))
    bias = rng.standard_normal((6, 6))
    out, lse = cuflash.attention(q, k, v, bias=bias, return_lse=True)
    for backward in (cuflash.attention_backward, reference.attention_backward):
        with pytest.raises(ValueError, match="return_dbias=True with dropout_p > 0"):
            backward(out, q, k, v, out, lse, bias=bias, return_dbias=True, dropout_p=0.1,
                     dropout_seed=3)
    with pytest.raises(ValueError, match="return_dbias=True with dropout_p > 0"):
        cuflash.attention_vjp(q, k, v, bias=bias, return_dbias=True, dropout_p=0.1,
                              dropout_seed=3)
    packed = rng.standard_normal((6, 2, 8))
    cu = np.array([0, 2, 6], np.int32)
    for attention in (cuflash.attention, reference.attention):
        with pytest.raises(ValueError, match="dropout_p is not defined for packed sequences"):
            attention(packed, packed, packed, cu_seqlens_q=cu, cu_seqlens_k=cu, dropout_p=0.1,
                      dropout_seed=3)
