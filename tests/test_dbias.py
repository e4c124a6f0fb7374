"""The bias's gradient (``return_dbias=True``): the reference against its definition and finite
differences, the NumPy path and every CUDA backward path against the reference, broadcast
shapes, dtypes, empty and lost rows, and the validation.

dbias[b, h, i, j] = dS[b, h, i, j] = P (dP - D) at the logit s = F(scale q.k) + bias (F: softcap,
ALiBi), 0 where P is 0, summed over the axes on which the bias broadcasts.
"""
import numpy as np
import pytest

import cuflash
from cuflash import _gpu, _validate, reference
from helpers import (BFLOAT16, FLOORS, _arithmetic, _dense_options, assert_close_to_reference,
                     check_backward, to_array, to_f64, to_host)

DTYPES = ["float64", "float32", "float16"] + (["bfloat16"] if BFLOAT16 is not None else [])


def _dtype(name):
    return BFLOAT16 if name == "bfloat16" else np.dtype(name)


def _inputs(rng, lq, lkv, Nq, Nk, Dk, Dv, dtype, xp=np):
    shapes = (lq + (Nq, Dk), lkv + (Nk, Dk), lkv + (Nk, Dv))
    return [to_array(xp, rng.standard_normal(s), _dtype(dtype)) for s in shapes]


def _numeric_dbias(q, k, v, bias, dout, attention=reference.attention, h=1e-6, **opts):
    """Central differences of sum(attention(...) * dout) with respect to every bias entry."""
    num = np.zeros(bias.shape)
    for idx in np.ndindex(bias.shape):
        old = bias[idx]
        bias[idx] = old + h
        up = (attention(q, k, v, bias=bias, **opts) * dout).sum()
        bias[idx] = old - h
        down = (attention(q, k, v, bias=bias, **opts) * dout).sum()
        bias[idx] = old
        num[idx] = (up - down) / (2 * h)
    return num


def check_dbias(got, dout, q, k, v, out, lse, **opts):
    """dbias against the float64 reference's for the same dout, out and lse, within 2x a
    same-dtype naive baseline (floor 4x the forward's), of bias's shape and dtype. The baseline
    returns its dbias in bias's dtype too (float64 inputs: the reference's, rounded to it)."""
    dtype = np.dtype(q.dtype)
    bias = opts["bias"]
    assert got.shape == bias.shape and got.dtype == bias.dtype, (got.shape, got.dtype)
    assert type(got) is type(bias)  # the inputs' library
    host = [to_host(x) for x in (dout, q, k, v, out, lse)]
    hopts = {n: to_host(x) if hasattr(x, "shape") else x for n, x in opts.items()}
    ref = reference.attention_backward(*host, return_dbias=True, **hopts)[-1]
    naive = None
    if dtype != np.float64:
        work, storage = _arithmetic(dtype)
        dense = reference._Dense(*host[1:4], work=work, storage=storage, **_dense_options(hopts))
        naive = dense.backward(host[0], host[4], host[5], dbias=True)[-1]
    naive = (ref if naive is None else naive).astype(bias.dtype).astype(np.float64)
    assert_close_to_reference(got, ref, naive, FLOORS[dtype.name] * 4, "dbias")


# ---- the reference ----------------------------------------------------------------------------

def test_reference_is_the_definition(rng):
    """P (dout v^T - D), written out densely from softmax(scale q k^T + bias), and summed over
    the batch for a (1, H, Nq, Nk) bias; the other gradients are the call's without it."""
    q, k, v = (rng.standard_normal(s) for s in ((2, 3, 6, 4), (2, 3, 8, 4), (2, 3, 8, 5)))
    bias = rng.standard_normal((1, 3, 6, 8))
    scale = 0.7
    out, lse = reference.attention(q, k, v, scale=scale, bias=bias, return_lse=True)
    dout = rng.standard_normal(out.shape)
    grads = reference.attention_backward(dout, q, k, v, out, lse, scale=scale, bias=bias,
                                         return_dbias=True)
    x = scale * q @ np.swapaxes(k, -1, -2) + bias
    p = np.exp(x - x.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    d = (dout * out).sum(-1, keepdims=True)
    want = (p * (dout @ np.swapaxes(v, -1, -2) - d)).sum(axis=0, keepdims=True)
    assert len(grads) == 4
    np.testing.assert_allclose(grads[3], want, rtol=1e-12, atol=1e-14)
    plain = reference.attention_backward(dout, q, k, v, out, lse, scale=scale, bias=bias)
    for a, b in zip(grads[:3], plain):
        np.testing.assert_array_equal(a, b)


FD_CASES = [
    ("full", (2, 5, 7), dict(causal=True)),
    ("heads over batch", (1, 2, 5, 7), dict(mask=(np.arange(7) % 3 != 1)[None], softcap=1.3)),
    ("shared", (5, 7), dict(window=(2, 1), kv_lens=[[6], [4]])),
    ("keys", (2, 1, 1, 7), dict(sinks=np.array([0.5, -1.0]), alibi_slopes=np.array([0.3, 0.7]))),
]


@pytest.mark.parametrize("api", [reference, cuflash], ids=["reference", "numpy-path"])
@pytest.mark.parametrize("case", FD_CASES, ids=[c[0] for c in FD_CASES])
def test_matches_finite_differences(case, api, rng):
    """The reference's and the NumPy path's dbias against central differences of their own
    sum(out * dout) in float64, for broadcast biases (and grouped k, v) and with the options that
    change P (causal, mask, window, kv_lens) or the logit (softcap: its derivative must not
    enter; sinks; ALiBi)."""
    _, bshape, opts = case
    q, k, v = (rng.standard_normal(s) for s in ((2, 2, 5, 3), (2, 1, 7, 3), (2, 1, 7, 2)))
    q *= 2
    bias = rng.standard_normal(bshape)
    out, lse = api.attention(q, k, v, bias=bias, return_lse=True, **opts)
    dout = rng.standard_normal(out.shape)
    dbias = api.attention_backward(dout, q, k, v, out, lse, bias=bias, return_dbias=True,
                                   **opts)[-1]
    num = _numeric_dbias(q, k, v, bias, dout, attention=api.attention, **opts)
    np.testing.assert_allclose(dbias, num, rtol=1e-6, atol=1e-8)


def test_a_row_constant_bias_has_no_gradient(rng):
    """A bias of shape (Nq, 1) shifts each row's logits alike, which a softmax ignores: its
    gradient sum_j P (dP - D) is 0 (a property, not the reference's code); with a sink it is not
    (the sink's logit does not move)."""
    q, k, v = (rng.standard_normal(s) for s in ((3, 9, 4), (3, 11, 4), (3, 11, 4)))
    bias = rng.standard_normal((9, 1))
    for api in (cuflash, reference):
        out, lse = api.attention(q, k, v, bias=bias, causal=True, return_lse=True)
        dout = rng.standard_normal(out.shape)
        dbias = api.attention_backward(dout, q, k, v, out, lse, bias=bias, causal=True,
                                       return_dbias=True)[-1]
        assert dbias.shape == (9, 1)
        np.testing.assert_allclose(dbias, 0, atol=1e-13)
    out, lse = cuflash.attention(q, k, v, bias=bias, sinks=1.0, return_lse=True)
    dbias = cuflash.attention_backward(dout, q, k, v, out, lse, bias=bias, sinks=1.0,
                                       return_dbias=True)[-1]
    assert np.abs(dbias).max() > 1e-3


# ---- the NumPy path ---------------------------------------------------------------------------

# (name, lq, lkv, Nq, Nk, Dk, Dv, bias shape, options)
CASES = [
    ("full", (2, 3), (2, 3), 37, 53, 16, 16, (2, 3, 37, 53), {}),
    ("heads-causal-gqa", (2, 4), (2, 2), 40, 40, 8, 12, (1, 4, 40, 40), dict(causal=True)),
    ("shared-window-kv_lens", (2,), (2,), 33, 70, 16, 16, (33, 70),
     dict(window=(20, 3), kv_lens=np.array([70, 23]))),
    ("keys-mask-softcap", (2,), (2,), 24, 31, 8, 8, (2, 1, 31), dict(softcap=2.5)),
    ("queries-sinks-alibi", (2, 2), (2, 2), 20, 29, 8, 8, (2, 1, 20, 1),
     dict(sinks=np.array([0.3, -0.5]), alibi_slopes=np.array([0.25, 0.5]))),
    ("causal-nq-gt-nk", (3,), (3,), 30, 12, 8, 8, (3, 30, 12), dict(causal=True)),
]


def _case_options(case, rng, xp=np, bias_dtype=np.float32):
    name, lq, _, Nq, Nk, _, _, bshape, extra = case
    opts = {n: xp.asarray(x) if isinstance(x, np.ndarray) else x for n, x in extra.items()}
    if "kv_lens" in opts:
        opts["kv_lens"] = extra["kv_lens"]  # host lengths (checked on the host)
    bias = rng.standard_normal(bshape)
    if "mask" in name:
        mask = rng.random(lq + (Nq, Nk)) < 0.8
        mask[..., 3, :] = False  # an empty row
        opts["mask"] = xp.asarray(mask)
        bias[..., ::5] = -np.inf  # -inf hides
    opts["bias"] = to_array(xp, bias, bias_dtype)
    return opts


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_numpy_path(case, dtype, rng):
    """dbias of the NumPy path against the reference, in bias's shape and dtype (here float32,
    and q's dtype for the 16-bit inputs), and the other gradients unchanged by asking for it;
    attention_vjp gives the same."""
    _, lq, lkv, Nq, Nk, Dk, Dv, _, _ = case
    q, k, v = _inputs(rng, lq, lkv, Nq, Nk, Dk, Dv, dtype)
    bias_dtype = _dtype(dtype) if dtype in ("float16", "bfloat16") else np.float32
    opts = _case_options(case, rng, bias_dtype=bias_dtype)
    out, lse = cuflash.attention(q, k, v, return_lse=True, **opts)
    dout = to_array(np, rng.standard_normal(out.shape), _dtype(dtype))
    grads = cuflash.attention_backward(dout, q, k, v, out, lse, return_dbias=True, **opts)
    check_dbias(grads[-1], dout, q, k, v, out, lse, **opts)
    plain = cuflash.attention_backward(dout, q, k, v, out, lse, **opts)
    assert len(grads) == len(plain) + 1
    for a, b in zip(grads, plain):
        np.testing.assert_array_equal(a, b)
    _, vjp = cuflash.attention_vjp(q, k, v, return_dbias=True, **opts)
    for a, b in zip(vjp(dout), grads):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_numpy_path_small_tiles(case, rng, monkeypatch):
    """The NumPy path with small key tiles and query blocks (tiles skipped by position, partial
    tiles, several blocks of heads): dbias is the reference's, float64."""
    from cuflash import _numpy
    monkeypatch.setattr(_numpy, "BLOCK_N", 8)
    monkeypatch.setattr(_numpy, "BLOCK_M", 5)
    monkeypatch.setattr(_numpy, "TILE", 8 * 5 * 2)
    _, lq, lkv, Nq, Nk, Dk, Dv, _, _ = case
    q, k, v = _inputs(rng, lq, lkv, Nq, Nk, Dk, Dv, "float64")
    opts = _case_options(case, rng, bias_dtype=np.float64)
    out, lse = cuflash.attention(q, k, v, return_lse=True, **opts)
    dout = rng.standard_normal(out.shape)
    grads = cuflash.attention_backward(dout, q, k, v, out, lse, return_dbias=True, **opts)
    check_dbias(grads[-1], dout, q, k, v, out, lse, **opts)


def test_hidden_pairs_and_empty_rows_are_zero(rng):
    """Exactly 0 where a key is hidden (causal, mask, a -inf bias, past kv_lens, whose v holds
    a NaN that is never read) and on empty rows (causal Nq > Nk, kv_lens = 0); nonzero on the
    visible pairs."""
    q, k, v = (rng.standard_normal(s) for s in ((2, 9, 4), (2, 6, 4), (2, 6, 3)))
    bias = rng.standard_normal((2, 9, 6))
    bias[:, 5, 1] = -np.inf
    mask = rng.random((9, 6)) < 0.7
    lens = np.array([0, 5])
    v[1, 5] = np.nan  # past kv_lens: never read
    opts = dict(bias=bias, mask=mask, causal=True, kv_lens=lens)
    out, lse = cuflash.attention(q, k, v, return_lse=True, **opts)
    dout = rng.standard_normal(out.shape)
    dbias = cuflash.attention_backward(dout, q, k, v, out, lse, return_dbias=True, **opts)[-1]
    p = np.arange(9)[:, None] + lens[:, None, None] - 9  # the aligned positions (bottom-right)
    visible = (np.arange(6) <= p) & (np.arange(6) < lens[:, None, None]) & mask & (bias > -np.inf)
    assert not np.isnan(dbias).any()
    assert np.all(dbias[~visible] == 0)
    assert np.all(dbias[visible] != 0)
    assert np.all(dbias[0] == 0)  # kv_lens = 0: every row empty


def test_nan_lse_gives_nan_on_visible_keys_only(rng):
    q, k, v = (rng.standard_normal(s) for s in ((6, 4), (8, 4), (8, 4)))
    bias = rng.standard_normal((6, 8))
    out, lse = cuflash.attention(q, k, v, bias=bias, causal=True, return_lse=True)
    lse[4] = np.nan
    dbias = cuflash.attention_backward(np.ones_like(out), q, k, v, out, lse, bias=bias,
                                       causal=True, return_dbias=True)[-1]
    assert np.isnan(dbias[4, :7]).all() and np.all(dbias[4, 7:] == 0)
    assert not np.isnan(np.delete(dbias, 4, axis=0)).any()


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_lost_rows(dtype, rng):
    """Rows padded with an additive finfo(float32).min bias have a lost lse (|lse| >= 2**12 in
    float32): the backward's exact recomputation must give their dbias too."""
    q, k, v = _inputs(rng, (2,), (2,), 12, 20, 8, 8, dtype)
    bias = rng.standard_normal((2, 12, 20)).astype(np.float32)
    bias[0, 3:6] = np.finfo(np.float32).min  # every key of these rows padding: a uniform row
    bias[1, 7, :10] = -1e30
    out, lse = cuflash.attention(q, k, v, bias=bias, return_lse=True)
    assert abs(float(lse[0, 4])) >= 2**12
    dout = rng.standard_normal(out.shape).astype(dtype)
    dbias = cuflash.attention_backward(dout, q, k, v, out, lse, bias=bias, return_dbias=True)[-1]
    check_dbias(dbias, dout, q, k, v, out, lse, bias=bias)
    assert np.abs(dbias[0, 4]).max() > 1e-3  # (P = 1/20 there, not 0)


def test_dtypes_and_empty_problems(rng):
    """dbias has bias's dtype whatever q's (float16 bias with float32 inputs, float64 bias with
    float32 inputs), and bias's shape for problems with nothing to compute (zeros)."""
    q, k, v = _inputs(rng, (2,), (2,), 5, 7, 4, 4, "float32")
    for bias_dtype in (np.float16, np.float64):
        bias = rng.standard_normal((5, 7)).astype(bias_dtype)
        out, lse = cuflash.attention(q, k, v, bias=bias, return_lse=True)
        dbias = cuflash.attention_backward(out, q, k, v, out, lse, bias=bias,
                                           return_dbias=True)[-1]
        assert dbias.dtype == bias_dtype and dbias.shape == (5, 7)
        check_dbias(dbias, out, q, k, v, out, lse, bias=bias)
    for nq, nk, lead in ((0, 7, (2,)), (5, 0, (2,)), (5, 7, (0,))):
        q, k, v = _inputs(rng, lead, lead, nq, nk, 4, 4, "float32")
        bias = np.ones((1, nq, nk), np.float16)
        out, lse = cuflash.attention(q, k, v, bias=bias, return_lse=True)
        grads = cuflash.attention_backward(out, q, k, v, out, lse, bias=bias, return_dbias=True)
        assert len(grads) == 4 and grads[3].shape == (1, nq, nk)
        assert grads[3].dtype == np.float16 and not grads[3].any()


def test_order_with_sinks_and_signatures(rng):
    """With sinks: (dq, dk, dv, dsinks, dbias); the same call with and without return_dbias,
    in turn (two signatures), gives each its own results."""
    q, k, v = _inputs(rng, (2,), (2,), 6, 9, 4, 4, "float64")
    bias = rng.standard_normal((2, 6, 9))
    opts = dict(bias=bias, sinks=np.array([0.5, 1.5]))
    out, lse = cuflash.attention(q, k, v, return_lse=True, **opts)
    dout = rng.standard_normal(out.shape)
    ref = reference.attention_backward(dout, q, k, v, out, lse, return_dbias=True, **opts)
    for _ in range(2):
        assert len(cuflash.attention_backward(dout, q, k, v, out, lse, **opts)) == 4
        grads = cuflash.attention_backward(dout, q, k, v, out, lse, return_dbias=True, **opts)
        assert len(grads) == 5 and grads[3].shape == (2,) and grads[4].shape == (2, 6, 9)
        for g, r in zip(grads, ref):
            np.testing.assert_allclose(g, r, rtol=1e-10, atol=1e-13)
    assert _validate.make_problem(q, k, v, bias=bias, return_dbias=True).dbias


def test_walks_every_pair_is_the_visibility_rule(rng):
    """The CUDA paths leave the dbias buffer unzeroed only when every query sees every key by
    position (_generic.walks_every_pair): that must be exactly when the reference's dense
    visibility is all True (no mask, no kv_lens), over causal, windows, alignments, positions."""
    from cuflash import _generic
    seen = set()
    for _ in range(300):
        Nq, Nk = int(rng.integers(1, 9)), int(rng.integers(1, 9))
        causal = bool(rng.random() < 0.3)
        align = ["bottom-right", "top-left"][int(rng.integers(2))]
        window = None if rng.random() < 0.3 else tuple(
            None if rng.random() < 0.3 else int(rng.integers(0, 10)) for _ in range(2))
        positions = None if rng.random() < 0.5 else tuple(int(x) for x in rng.integers(0, 6, 2))
        q, k, v = (np.zeros((n, 2)) for n in (Nq, Nk, Nk))
        opts = dict(causal=causal, align=align, window=window, positions=positions)
        p = _validate.make_problem(q, k, v, bias=np.zeros((Nq, Nk)), return_dbias=True, **opts)
        dense = reference._visible((), Nq, Nk, causal, align, window, None, None, None, positions)
        assert _generic.walks_every_pair(p) == bool(dense.all()), opts
        seen.add(bool(dense.all()))
    assert seen == {True, False}
    q, k, v = (np.zeros((2, n, 2)) for n in (4, 6, 6))
    for extra in (dict(mask=np.ones((4, 6), bool)), dict(kv_lens=6)):
        assert not _generic.walks_every_pair(_validate.make_problem(q, k, v, **extra))


def test_catalog_holds_the_dbias_kernels():
    """Every DBIAS twin the host can request is in the catalog that CI compiles: the generic dQ
    kernel's for every chain and bucket, the 16-bit dK/dV kernel's (mma.sync and wgmma tiles,
    both dq orders) and the wide dQ kernel's for the calls without a transform."""
    from cuflash import _config, _generic, _mma_bwd, _modifiers, _wide
    catalog = {e for *_, e in _gpu.instantiations()}
    for dt in _config.supported_dtype_names():
        for tf in _modifiers.CHAINS:
            for b in _config.HEAD_DIM_BUCKETS:
                assert _generic.name_expression("bwd_dq", dt, b, tf, True) in catalog
    for dt in _config.MMA_DTYPES:
        for d in set(_mma_bwd.HEAD_DIMS) - set(_mma_bwd.DBIAS_DECLINED):
            for atomic in (True, False):
                for wg in (False, True):
                    if wg and _mma_bwd.wg_tile(d, True, atomic) is None:
                        continue
                    tile = _mma_bwd.dbias_tile(d, atomic, wg)
                    assert tile.opt & _mma_bwd.OPT_DBIAS
                    assert _mma_bwd.dkdv_expr(dt, d, tile, atomic, True) in catalog
    for table in (_wide.BWD_TILES, _wide.BWD_TILES_CC90):
        for (dt, b, mb), tiles in table.items():
            if mb and (dt, b) not in _wide.DBIAS_DECLINED:
                for passes in (_wide.PASSES.values() if dt == "float32" else (1,)):
                    dq = _wide.bwd_name_expressions(dt, b, True, passes, tiles, (), True)[1]
                    assert dq.endswith(", true>") and dq in catalog


# ---- validation -------------------------------------------------------------------------------

@pytest.mark.parametrize("fn", ["attention_backward", "attention_vjp"])
def test_bad_return_dbias_is_refused(fn, rng):
    q, k, v = _inputs(rng, (), (), 4, 5, 8, 8, "float32")
    bias = rng.standard_normal((4, 5)).astype(np.float32)

    def call(**opts):
        if fn == "attention_backward":
            out, lse = cuflash.attention(q, k, v, return_lse=True)
            return cuflash.attention_backward(out, q, k, v, out, lse, **opts)
        return cuflash.attention_vjp(q, k, v, **opts)

    with pytest.raises(ValueError, match=f"^{fn}: return_dbias=True asks for the gradient of "
                                         "bias, but bias is None"):
        call(return_dbias=True)
    for value in (1, None, "yes"):
        with pytest.raises(TypeError, match=f"^{fn}: return_dbias must be a bool"):
            call(return_dbias=value, bias=bias)
    with pytest.raises(ValueError, match="^attention_backward: return_dbias=True"):
        reference.attention_backward(q, q, k, v, q, q[:, 0], return_dbias=True)


def test_forward_takes_no_return_dbias(rng):
    q, k, v = _inputs(rng, (), (), 4, 5, 8, 8, "float32")
    with pytest.raises(TypeError, match="return_dbias"):
        cuflash.attention(q, k, v, return_dbias=True)


# ---- the CUDA paths ---------------------------------------------------------------------------

GPU_CASES = [
    ("full", (2, 3), (2, 3), 97, 130, 64, 64, (2, 3, 97, 130), {}),
    ("heads-causal-gqa", (2, 4), (2, 2), 150, 150, 128, 128, (1, 4, 150, 150),
     dict(causal=True)),
    ("shared-window-kv_lens", (2,), (2,), 70, 200, 64, 64, (70, 200),
     dict(window=(20, 3), kv_lens=np.array([200, 67]))),
    ("keys-mask-softcap", (2,), (2,), 80, 96, 32, 32, (2, 1, 96), dict(softcap=2.5)),
    ("queries-sinks", (1, 2), (1, 2), 40, 70, 256, 256, (1, 2, 40, 1),
     dict(sinks=np.array([0.3, -0.5]))),
    ("shared-alibi", (2,), (2,), 65, 90, 192, 128, (65, 90),
     dict(alibi_slopes=np.array([0.25, 0.5]))),
    ("causal-nq-gt-nk", (2,), (2,), 90, 40, 96, 96, (2, 90, 40), dict(causal=True)),
]


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["generic", "mma", "mma-sync", "wide", "auto"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", GPU_CASES, ids=[f"{c[0]}-d{c[5]}x{c[6]}" for c in GPU_CASES])
def test_cuda_paths(case, dtype, path, rng, override):
    """Every backward path forced (where it takes the call; the generic kernels elsewhere; on
    sm_90 "mma" runs the wgmma dK/dV kernels, "mma-sync" the mma.sync ones), both dq orders,
    NaN-poisoned buffers: dbias against the reference, the path the call without dbias takes
    (the generic kernels with a transform or at a declined head dim), and the other gradients
    against the reference."""
    import cupy
    override(poison=True)  # (an unzeroed dbias buffer too: every pair must be written)
    if path == "mma-sync":
        override(path="mma", wgmma=False)
    else:
        override(path=None if path == "auto" else path)
    _, lq, lkv, Nq, Nk, Dk, Dv, _, _ = case
    q, k, v = _inputs(rng, lq, lkv, Nq, Nk, Dk, Dv, dtype, cupy)
    bias_dtype = _dtype(dtype) if case[0] == "full" and dtype != "float64" else np.float32
    opts = _case_options(case, rng, cupy, bias_dtype)
    out, lse = cuflash.attention(q, k, v, return_lse=True, **opts)
    dout = to_array(cupy, rng.standard_normal(out.shape), _dtype(dtype))
    plain = _validate.make_problem(q, k, v, **opts)
    asked = _validate.make_problem(q, k, v, return_dbias=True, **opts)
    # dbias runs where the call without it runs, but with softcap or ALiBi (the tensor-core
    # backwards store it without a transform only) and at the declined head dims: the generic
    # kernels
    from cuflash import _mma_bwd, _wide
    without = _gpu.backward_path(plain)
    declined = bool(plain.transforms) or (
        without == "mma" and (Dk, Dv) in _mma_bwd.DBIAS_DECLINED) or (
        without == "wide" and (dtype, _wide.bwd_bucket(plain)) in _wide.DBIAS_DECLINED)
    assert _gpu.backward_path(asked) == ("generic" if declined else without)
    for deterministic in (False, True):
        grads = cuflash.attention_backward(dout, q, k, v, out, lse, deterministic=deterministic,
                                           return_dbias=True, **opts)
        check_dbias(grads[-1], dout, q, k, v, out, lse, **opts)
        # the other gradients: the reference's (not bitwise the call's without dbias: on the
        # H200 the storing twins rounded dq differently in causal shapes, by a few ulp)
        check_backward(grads[:-1], dout, q, k, v, out, lse, **opts)


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["generic", "mma", "wide"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_lost_rows(dtype, path, rng, override):
    """Rows padded with finfo(float32).min (lost lse): the lost-row kernel writes their dbias."""
    import cupy
    override(path=path)
    D = 64
    q, k, v = _inputs(rng, (2, 2), (2, 2), 70, 90, D, D, dtype, cupy)
    bias = rng.standard_normal((2, 1, 70, 90)).astype(np.float32)
    bias[0, 0, 3:40] = np.finfo(np.float32).min
    bias[1, 0, 66, :50] = -1e30
    bias = cupy.asarray(bias)
    out, lse = cuflash.attention(q, k, v, bias=bias, return_lse=True)
    assert abs(float(lse[0, 0, 10])) >= 2**12
    dout = to_array(cupy, rng.standard_normal(out.shape), _dtype(dtype))
    dbias = cuflash.attention_backward(dout, q, k, v, out, lse, bias=bias, return_dbias=True)[-1]
    check_dbias(dbias, dout, q, k, v, out, lse, bias=bias)
    assert float(abs(dbias[0, 0, 10]).max()) > 1e-4


@pytest.mark.gpu
def test_cuda_vjp_and_numpy_agree(rng):
    """attention_vjp's dbias on the GPU is attention_backward's, and close to the NumPy path's
    (float64: the same arithmetic up to rounding)."""
    import cupy
    q, k, v = _inputs(rng, (2, 2), (2, 1), 50, 70, 32, 32, "float64", cupy)
    bias = cupy.asarray(rng.standard_normal((2, 50, 70)))
    out, vjp = cuflash.attention_vjp(q, k, v, bias=bias, causal=True, return_dbias=True)
    dout = cupy.asarray(rng.standard_normal(out.shape))
    got = vjp(dout)
    hq, hk, hv, hb, hd = (to_host(x) for x in (q, k, v, bias, dout))
    _, host_vjp = cuflash.attention_vjp(hq, hk, hv, bias=hb, causal=True, return_dbias=True)
    want = host_vjp(hd)
    assert len(got) == len(want) == 4
    np.testing.assert_allclose(to_f64(got[3]), want[3], rtol=1e-9, atol=1e-12)
