"""Extreme and non-finite values on every path (issue 12's holes 1, 2 and 4).

Each case runs on the NumPy path and, marked ``gpu``, on the CUDA paths that take it: the
generic kernels, the automatic choice (tensor cores for 16-bit inputs), and the split-KV decode
kernels for few queries. The contract (README "Empty rows and non-finite values"):

* only a row with no visible key returns out 0 / lse -inf;
* a visible NaN or +inf logit, or a row whose every visible logit is -inf, gives NaN (out, lse);
* a finite bias as low as finfo.min is a logit like any other (a padding row built with it is a
  uniform softmax);
* the backward recomputes "lost" rows (|lse| too large to carry log l) from their own max and sum,
  and a NaN lse gives NaN gradients, never zeros.
"""
import numpy as np
import pytest

import cuflash
from cuflash import reference
from helpers import BFLOAT16, check_backward, check_forward, to_array, to_f64, to_host

F32MIN = float(np.finfo(np.float32).min)

# (name, forced path: cuflash._gpu.override) of the runs: NumPy, then the CUDA paths
RUNS = [("numpy", None),
        pytest.param(("generic", "generic"), marks=pytest.mark.gpu),
        pytest.param(("mma", "mma"), marks=pytest.mark.gpu),
        pytest.param(("auto", None), marks=pytest.mark.gpu),
        pytest.param(("split", "split"), marks=pytest.mark.gpu),
        pytest.param(("split-simt", "split-simt"), marks=pytest.mark.gpu)]
RUN_IDS = ["numpy", "generic", "mma", "auto", "split", "split-simt"]


@pytest.fixture(params=[r if isinstance(r, tuple) else r for r in RUNS], ids=RUN_IDS)
def run(request, override):
    """(array module, name of the run); sets the CUDA path and NaN-poisons outputs on the GPU."""
    name, force = request.param
    if name == "numpy":
        return np, name
    import cupy
    override(path=force, poison=True)
    return cupy, name


def _dt(name):
    return BFLOAT16 if name == "bfloat16" else np.dtype(name)


def _put(xp, x, dtype):
    return to_array(xp, x, dtype)


def _split_only(name, Nq, Nk):
    if name.startswith("split") and not (Nq <= 16 and Nk >= 512):
        pytest.skip("the split-KV path takes few queries against many keys")


def _check(xp, q, k, v, dout=None, **options):
    """Forward and backward against the float64 reference, tolerance from a same-dtype naive
    implementation; returns the results."""
    out, lse = cuflash.attention(q, k, v, return_lse=True, **options)
    check_forward(out, lse, q, k, v, **options)
    if dout is None:
        dout = np.random.default_rng(1).standard_normal(out.shape)
    dout = _put(xp, dout, np.dtype(q.dtype))
    g = cuflash.attention_backward(dout, q, k, v, out, lse, **options)
    check_backward(g, dout, q, k, v, out, lse, **options)
    return out, lse, g


# ---- hole 1: rows hidden by a large finite bias --------------------------------------------

def test_reference_padding_row_gradient_is_uniform():
    """The issue's example, on the dense spec itself: a row whose every logit carries
    finfo.min is a uniform softmax, so with dout = 1 on it alone, dv = 1 / Nk exactly."""
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, 1, 3, 4)).astype(np.float32)
    k, v = (rng.standard_normal((1, 1, 4, 4)).astype(np.float32) for _ in range(2))
    bias = np.zeros((3, 4), np.float32)
    bias[0] = F32MIN
    for attention, backward in ((cuflash.attention, cuflash.attention_backward),
                                (reference.attention, reference.attention_backward)):
        out, lse = attention(q, k, v, bias=bias, return_lse=True)
        np.testing.assert_allclose(out[0, 0, 0], v[0, 0].mean(axis=0), rtol=1e-6)
        dout = np.zeros((1, 1, 3, 4), np.float32)
        dout[..., 0, :] = 1
        out, lse = np.asarray(out, np.float32), np.asarray(lse, np.float32)
        dq, dk, dv = backward(dout, q, k, v, out, lse, bias=bias)
        np.testing.assert_allclose(dv, 0.25, rtol=1e-6)  # was 1.0: P = exp(s - lse) = 1


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "float64"])
@pytest.mark.parametrize("pad", ["finfo.min", "-1e9"])
def test_padding_bias_rows(run, dtype, pad):
    """Rows padded with an additive large negative bias (every key of the row), next to
    ordinary rows and rows where only some keys carry it, forward and backward."""
    xp, name = run
    if dtype == "bfloat16" and BFLOAT16 is None:
        pytest.skip("ml_dtypes missing")
    if pad == "-1e9" and dtype in ("float16", "bfloat16"):
        # float32 loses q.k under -1e9 (uniform row) where float64 keeps it, and the 16-bit
        # naive baseline overflows there: no baseline to bound the difference (float32 and
        # float64 inputs cover -1e9; finfo.min agrees in every precision)
        pytest.skip("no same-dtype baseline for -1e9 with 16-bit inputs")
    rng = np.random.default_rng(1)
    Nq, Nk, D = (4, 700, 64) if name.startswith("split") else (70, 150, 64)
    low = float(np.finfo(np.float64 if dtype == "float64" else np.float32).min) \
        if pad == "finfo.min" else -1e9
    bias = rng.standard_normal((Nq, Nk))
    bias[: Nq // 3] = low            # padded rows
    bias[Nq // 3:, ::7] = low        # some padded keys in ordinary rows
    dt = _dt(dtype)
    q = _put(xp, rng.standard_normal((2, 2, Nq, D)), dt)
    k, v = (_put(xp, rng.standard_normal((2, 2, Nk, D)), dt) for _ in range(2))
    acc = np.float64 if dtype == "float64" else np.float32
    out, lse, _ = _check(xp, q, k, v, bias=_put(xp, bias, acc))
    assert np.isfinite(to_f64(lse)).all()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_lost_rows_with_causal_gqa_and_deterministic(run, dtype):
    """Lost rows (finfo.min padding) with causal masking, GQA sums and a padded first row, on
    both dq modes of the tensor-core backward."""
    xp, name = run
    if dtype == "bfloat16" and BFLOAT16 is None:
        pytest.skip("ml_dtypes missing")
    _split_only(name, 3, 600)
    rng = np.random.default_rng(2)
    Nq, Nk = (3, 600) if name.startswith("split") else (130, 200)
    dt = _dt(dtype)
    q = _put(xp, rng.standard_normal((1, 4, Nq, 64)), dt)
    k, v = (_put(xp, rng.standard_normal((1, 2, Nk, 64)), dt) for _ in range(2))
    bias = np.zeros((Nq, Nk), np.float32)
    bias[::2] = F32MIN
    bias = _put(xp, bias, np.float32)
    _check(xp, q, k, v, bias=bias, causal=True)
    if xp is not np:
        out, lse = cuflash.attention(q, k, v, bias=bias, causal=True, return_lse=True)
        dout = _put(xp, rng.standard_normal(out.shape), dt)
        a = cuflash.attention_backward(dout, q, k, v, out, lse, bias=bias, causal=True,
                                       deterministic=True)
        b = cuflash.attention_backward(dout, q, k, v, out, lse, bias=bias, causal=True,
                                       deterministic=True)
        for x, y in zip(a, b):
            assert np.array_equal(to_host(x).view(np.uint16), to_host(y).view(np.uint16))


# ---- hole 4: float16 near the top of its range ---------------------------------------------

@pytest.mark.parametrize("Nq,Nk", [(96, 96), (3, 700)])
def test_float16_near_its_range_limit(run, Nq, Nk):
    """q, k, v and dout uniform in +-6e4 (D = 64): logits ~1e10. The tensor-core forward's folded
    scale overflowed exp2 there (NaN in ~40 % of the outputs), and so did P in the backward."""
    xp, name = run
    _split_only(name, Nq, Nk)
    rng = np.random.default_rng(3)
    big = lambda shape: _put(xp, (rng.random(shape) * 2 - 1) * 6e4, np.float16)  # noqa: E731
    q, k, v = big((1, 1, Nq, 64)), big((1, 1, Nk, 64)), big((1, 1, Nk, 64))
    dout = big((1, 1, Nq, 64))
    out, lse = cuflash.attention(q, k, v, return_lse=True)
    hq, hk, hv = (to_f64(x) for x in (q, k, v))
    ref_out, ref_lse = reference.attention(hq, hk, hv, return_lse=True)
    o = to_f64(out)
    assert not np.isnan(o).any() and not np.isnan(to_f64(lse)).any()
    # the logits are resolved in float32 to ~1e3 out of 1e10: the softmax is one-hot, as in
    # float64, so out is v of the row's arg-max key up to float16 rounding
    np.testing.assert_allclose(o, ref_out, rtol=2 ** -10, atol=1.0)
    np.testing.assert_allclose(to_f64(lse), ref_lse, rtol=1e-6)
    grads = cuflash.attention_backward(dout, q, k, v, out, lse)
    ref = reference.attention_backward(to_f64(dout), hq, hk, hv, o, to_f64(lse))
    for g, r in zip(grads, ref):
        g = to_f64(g)
        finite = np.isfinite(r)
        assert not np.isnan(g[finite]).any()
        fits = np.abs(r) < 6e4  # float16 can hold these: they must be right
        np.testing.assert_allclose(g[fits], r[fits], rtol=2 ** -8, atol=4.0)
        over = finite & (np.abs(r) > 7e4)  # beyond float16: inf of the right sign
        assert np.all(np.sign(g[over]) == np.sign(r[over]))


# ---- hole 2: non-finite inputs ---------------------------------------------------------------

def _nan_rows(x):
    return np.isnan(to_f64(x)).any(axis=-1)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float64"])
def test_nan_in_one_key(run, dtype):
    """NaN in one key (causal): exactly the rows that see it are NaN (out and lse); the others
    are finite and right. Was: every row of the head 0 / -inf, or the key silently dropped."""
    xp, name = run
    if dtype == "bfloat16" and BFLOAT16 is None:
        pytest.skip("ml_dtypes missing")
    rng = np.random.default_rng(4)
    Nq, Nk = (4, 600) if name.startswith("split") else (80, 80)
    j = Nk - 3 if name.startswith("split") else 7
    k = rng.standard_normal((1, 2, Nk, 64))
    k[0, 1, j, 5] = np.nan
    dt = _dt(dtype)
    q = _put(xp, rng.standard_normal((1, 2, Nq, 64)), dt)
    v = _put(xp, rng.standard_normal((1, 2, Nk, 64)), dt)
    k = _put(xp, k, dt)
    out, lse = cuflash.attention(q, k, v, causal=True, return_lse=True)
    ref_out, ref_lse = reference.attention(to_f64(q), to_f64(k), to_f64(v), causal=True,
                                           return_lse=True)
    sees = np.isnan(ref_lse)
    assert sees[0, 1].any() and not sees[0, 0].any()
    assert np.array_equal(_nan_rows(out), sees) and np.array_equal(np.isnan(to_f64(lse)), sees)
    ok = ~sees
    np.testing.assert_allclose(to_f64(out)[ok], ref_out[ok], atol=3e-2, rtol=0)
    np.testing.assert_allclose(to_f64(lse)[ok], ref_lse[ok], atol=3e-2, rtol=0)


@pytest.mark.parametrize("what", ["nan-q", "inf-q", "nan-bias", "all-minus-inf", "all-plus-inf"])
def test_non_finite_rows(run, what):
    """A NaN or +inf in q, a NaN bias entry, and float32 logits that overflow (q, k ~ 1e20) to
    -inf or +inf for every key: the dense formula gives NaN for those rows, never 0 / -inf.
    Rows that are not touched stay right."""
    xp, name = run
    rng = np.random.default_rng(5)
    Nq, Nk = (4, 600) if name.startswith("split") else (50, 90)
    q = rng.standard_normal((2, 1, Nq, 32))
    k = rng.standard_normal((2, 1, Nk, 32))
    v = rng.standard_normal((2, 1, Nk, 32))
    bias = None
    if what == "nan-q":
        q[1, 0, 2, 3] = np.nan
    elif what == "inf-q":
        q[1, 0, 2, 3] = np.inf
    elif what == "nan-bias":
        bias = np.zeros((2, 1, Nq, Nk), np.float32)
        bias[1, 0, 1, Nk - 5] = np.nan
    else:
        sign = -1 if what == "all-minus-inf" else 1
        q[1] = np.abs(q[1]) * 1e20
        k[1] = sign * np.abs(k[1]) * 1e20
    options = {} if bias is None else {"bias": _put(xp, bias, np.float32)}
    q, k, v = (_put(xp, x, np.float32) for x in (q, k, v))
    out, lse = cuflash.attention(q, k, v, return_lse=True, **options)
    hopt = {"bias": bias} if bias is not None else {}
    ref_out, ref_lse = reference.attention(to_f64(q), to_f64(k), to_f64(v), return_lse=True,
                                           **hopt)
    if what.startswith("all"):  # float32 overflows where float64 does not: the rows must be NaN
        want = np.zeros(ref_lse.shape, bool)
        want[1] = True
    else:
        want = np.isnan(ref_lse)
    assert want.any()
    assert np.array_equal(_nan_rows(out), want), f"NaN rows {np.argwhere(_nan_rows(out))}"
    assert np.array_equal(np.isnan(to_f64(lse)), want)
    ok = ~want
    np.testing.assert_allclose(to_f64(out)[ok], ref_out[ok], atol=1e-5, rtol=0)
    assert not (to_f64(lse) == -np.inf).any()  # no row was taken for empty


OVERFLOW_RUNS = RUNS[:3] + [pytest.param(("wgmma", "wgmma"), marks=pytest.mark.gpu),
                             pytest.param(("wide", "wide"), marks=pytest.mark.gpu)] + RUNS[3:]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("sign", [1, -1], ids=["plus", "minus"])
@pytest.mark.parametrize("hide", [None, "bias", "mask"])
@pytest.mark.parametrize("path", OVERFLOW_RUNS, ids=RUN_IDS[:3] + ["wgmma", "wide"] + RUN_IDS[3:])
def test_overflowing_logits(override, path, dtype, sign, hide):
    """q . k beyond float32's range (|q|, |k| ~ 1e20, representable in bfloat16 too) is +-inf in
    the float32 accumulator, and the dense formula gives NaN rows, on every path, with a mask or
    bias too. Was (bfloat16, and every dtype with a mask or bias): the tensor-core forwards' lost-
    row fix-up recomputed such rows in double, where nothing overflows, and returned finite rows."""
    name, force = path
    if name == "numpy":
        xp = np
    else:
        import cupy as xp
        override(path=force, poison=True)
    rng = np.random.default_rng(7)
    Nq, Nk = (4, 600) if name.startswith("split") else (50, 90)
    q = rng.standard_normal((2, 1, Nq, 64))
    k = rng.standard_normal((2, 1, Nk, 64))
    v = rng.standard_normal((2, 1, Nk, 64))
    q[1] = np.abs(q[1]) * 1e20
    k[1] = sign * np.abs(k[1]) * 1e20
    options, hopt = {}, {}
    if hide == "bias":
        hopt["bias"] = rng.standard_normal((2, 1, Nq, Nk)).astype(np.float32)
        options["bias"] = _put(xp, hopt["bias"], np.float32)
    elif hide == "mask":
        hopt["mask"] = np.ones((Nq, Nk), bool)
        hopt["mask"][:, ::3] = False
        options["mask"] = xp.asarray(hopt["mask"])
    q, k, v = (_put(xp, x, _dt(dtype)) for x in (q, k, v))
    out, lse = cuflash.attention(q, k, v, return_lse=True, **options)
    ref_out, _ = reference.attention(to_f64(q), to_f64(k), to_f64(v), return_lse=True, **hopt)
    want = np.zeros(ref_out.shape[:-1], bool)
    want[1] = True
    assert np.array_equal(_nan_rows(out), want), f"NaN rows {np.argwhere(_nan_rows(out) != want)}"
    assert np.array_equal(np.isnan(to_f64(lse)), want)
    ok = ~want
    atol = 1e-5 if dtype == "float32" else 3e-2
    np.testing.assert_allclose(to_f64(out)[ok], ref_out[ok], atol=atol, rtol=0)


def test_minus_inf_bias_still_hides(run):
    """-inf in the bias is a mask (a fully masked row is empty: 0 / -inf), unlike NaN."""
    xp, name = run
    rng = np.random.default_rng(6)
    Nq, Nk = (2, 600) if name.startswith("split") else (20, 40)
    q, k, v = (_put(xp, rng.standard_normal(s), np.float32)
               for s in ((1, 1, Nq, 16), (1, 1, Nk, 16), (1, 1, Nk, 16)))
    bias = np.zeros((Nq, Nk), np.float32)
    bias[0] = -np.inf
    bias[1, : Nk // 2] = -np.inf
    out, lse, _ = _check(xp, q, k, v, bias=_put(xp, bias, np.float32))
    assert to_f64(lse)[0, 0, 0] == -np.inf and (to_f64(out)[0, 0, 0] == 0).all()


def test_nan_lse_gives_nan_gradients(run):
    """A NaN lse (e.g. from a NaN input) must not give silent zero gradients: dq of the row,
    and dk, dv of the keys it sees, are NaN; rows and keys it does not touch stay right."""
    xp, name = run
    rng = np.random.default_rng(7)
    Nq, Nk = (3, 600) if name.startswith("split") else (40, 60)
    dt = np.float16 if name == "auto" else np.float32  # auto: the tensor-core backward
    q, k, v = (_put(xp, rng.standard_normal(s), dt)
               for s in ((1, 1, Nq, 64), (1, 1, Nk, 64), (1, 1, Nk, 64)))
    out, lse = cuflash.attention(q, k, v, causal=True, return_lse=True)
    lse = lse.copy()
    lse[0, 0, 1] = np.nan
    dout = _put(xp, rng.standard_normal(out.shape), dt)
    dq, dk, dv = (to_f64(g) for g in cuflash.attention_backward(dout, q, k, v, out, lse,
                                                                causal=True))
    assert np.isnan(dq[0, 0, 1]).all()
    visible = np.arange(Nk) <= 1 + Nk - Nq  # the keys row 1 sees (bottom-right causal)
    assert np.isnan(dv[0, 0][visible]).all() and np.isnan(dk[0, 0][visible]).all()
    others = [i for i in range(Nq) if i != 1]
    assert np.isfinite(dq[0, 0, others]).all()
