"""Every misuse raises ValueError or TypeError naming the function and argument, before any work."""
import re

import numpy as np
import pytest

import cuflash
from cuflash import reference


def _qkv(Nq=5, Nk=7, Dk=8, Dv=8, lead=(2, 4), dtype=np.float32):
    rng = np.random.default_rng(0)
    q = rng.standard_normal(lead + (Nq, Dk)).astype(dtype)
    k = rng.standard_normal(lead + (Nk, Dk)).astype(dtype)
    v = rng.standard_normal(lead + (Nk, Dv)).astype(dtype)
    return q, k, v


BAD_OPTIONS = [
    (dict(align="bottom_right"), ValueError, "align"),
    (dict(align=None), ValueError, "align"),
    (dict(window=(-1, 2)), ValueError, "window left"),
    (dict(window=(2, -3)), ValueError, "window right"),
    (dict(window=(1, 2, 3)), ValueError, "window"),
    (dict(window=5), ValueError, "window"),
    (dict(window=(1.5, 2)), ValueError, "window left"),
    (dict(scale=float("nan")), ValueError, "scale"),
    (dict(scale=float("inf")), ValueError, "scale"),
    (dict(scale="0.1"), TypeError, "scale"),
    (dict(scale=1e39), ValueError, "scale"),   # finite in Python, inf in float32
    (dict(scale=-1e39), ValueError, "scale"),
    (dict(causal="yes"), TypeError, "causal"),
    (dict(mask=np.ones((5, 7), dtype=np.float32)), TypeError, "mask"),
    (dict(mask=np.ones((5, 6), dtype=bool)), ValueError, "mask"),
    (dict(mask=np.ones((3, 4, 5, 7), dtype=bool)), ValueError, "mask"),
    (dict(mask=np.ones((7,), dtype=bool)), ValueError, "mask"),
    (dict(bias=np.ones((5, 7), dtype=np.int32)), TypeError, "bias"),
    (dict(bias=np.ones((4, 5, 8), dtype=np.float32)), ValueError, "bias"),
    (dict(kv_lens=-1), ValueError, "kv_lens"),
    (dict(kv_lens=8), ValueError, "kv_lens"),
    (dict(kv_lens=[1, 2, 3]), ValueError, "kv_lens"),
    (dict(kv_lens=np.array([1.5, 2.0])), TypeError, "kv_lens"),
    (dict(kv_lens=np.array([True, False])), TypeError, "kv_lens"),
    (dict(positions=3), ValueError, "positions"),
    (dict(positions=(1, 2, 3)), ValueError, "positions"),
    (dict(positions=(-1, 0)), ValueError, "positions q_start"),
    (dict(positions=(0, -2)), ValueError, "positions k_start"),
    (dict(positions=(1.0, 0)), ValueError, "positions q_start"),
    (dict(positions=(0, True)), ValueError, "positions k_start"),
    (dict(precision="fast"), ValueError, "precision"),
    (dict(precision="HIGHEST"), ValueError, "precision"),
    (dict(precision=3), TypeError, "precision"),
    (dict(precision=True), TypeError, "precision"),
]


@pytest.mark.parametrize("options,error,word", BAD_OPTIONS, ids=[str(o[0])[:40] for o in BAD_OPTIONS])
@pytest.mark.parametrize("fn", ["attention", "attention_backward", "attention_vjp"])
def test_bad_option(options, error, word, fn):
    q, k, v = _qkv()
    with pytest.raises(error, match=rf"^{fn}: .*{word}"):
        if fn == "attention":
            cuflash.attention(q, k, v, **options)
        elif fn == "attention_vjp":
            cuflash.attention_vjp(q, k, v, **options)
        else:
            out = np.zeros(q.shape[:-1] + (v.shape[-1],), np.float32)
            lse = np.zeros(q.shape[:-1], np.float32)
            cuflash.attention_backward(out, q, k, v, out, lse, **options)


def test_shape_mismatches_name_the_arrays():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"^attention: q and k must have the same head dim"
                                         r".*q.shape=\(2, 4, 5, 8\)"):
        cuflash.attention(q, k[..., :6], v)
    with pytest.raises(ValueError, match=r"^attention: k and v must have the same number of keys"
                                         r".*v.shape=\(2, 4, 6, 8\)"):
        cuflash.attention(q, k, v[..., :6, :])
    with pytest.raises(ValueError, match="leading dims"):
        cuflash.attention(q, k[:, :3], v[:, :3])   # 4 query heads, 3 kv heads
    with pytest.raises(ValueError, match="leading dims"):
        cuflash.attention(q, k[:1].repeat(3, axis=0), v[:1].repeat(3, axis=0))
    with pytest.raises(ValueError, match="at least 2 dims"):
        cuflash.attention(q[0, 0, 0], k, v)


def test_head_dim_limits():
    q, k, v = _qkv(Dk=257, Dv=8)
    with pytest.raises(ValueError, match=r"Dk.*\[1, 256\].*257"):
        cuflash.attention(q, k, v)
    q, k, v = _qkv(Dk=8, Dv=300)
    with pytest.raises(ValueError, match=r"Dv.*300"):
        cuflash.attention(q, k, v)


def test_dtypes():
    q, k, v = _qkv()
    with pytest.raises(TypeError, match="one dtype"):
        cuflash.attention(q, k.astype(np.float64), v)
    with pytest.raises(TypeError, match="q must have dtype"):
        cuflash.attention(q.astype(np.int32), k, v)
    with pytest.raises(TypeError, match="k must have dtype"):
        cuflash.attention(q, k.astype(np.complex64), v)
    with pytest.raises(TypeError, match="^attention: q must be a numpy.ndarray or cupy.ndarray, "
                                        "got list"):
        cuflash.attention(q.tolist(), k, v)
    with pytest.raises(TypeError, match="v must be a numpy.ndarray or cupy.ndarray"):
        cuflash.attention(q, k, None)


def test_backward_arguments():
    q, k, v = _qkv()
    out, lse = cuflash.attention(q, k, v, return_lse=True)
    with pytest.raises(ValueError, match="^attention_backward: dout must have the output's shape"):
        cuflash.attention_backward(out[..., :3], q, k, v, out, lse)
    with pytest.raises(TypeError, match="^attention_backward: dout must have q's dtype"):
        cuflash.attention_backward(out.astype(np.float64), q, k, v, out, lse)
    with pytest.raises(ValueError, match="^attention_backward: lse must have shape"):
        cuflash.attention_backward(out, q, k, v, out, lse[..., :2])
    with pytest.raises(TypeError, match="^attention_backward: lse must be an array"):
        cuflash.attention_backward(out, q, k, v, out, None)
    _, vjp = cuflash.attention_vjp(q, k, v)
    with pytest.raises(ValueError, match="^attention_vjp: dout"):
        vjp(out[:1])
    with pytest.raises(TypeError, match="^attention_vjp: .*return_lse"):
        cuflash.attention_vjp(q, k, v, return_lse=True)
    with pytest.raises(TypeError, match="^attention_backward: deterministic must be a bool"):
        cuflash.attention_backward(out, q, k, v, out, lse, deterministic=1)
    with pytest.raises(TypeError, match="^attention_vjp: deterministic must be a bool"):
        cuflash.attention_vjp(q, k, v, deterministic="yes")


def test_merge_arguments():
    rng = np.random.default_rng(1)
    out = rng.standard_normal((3, 4)).astype(np.float32)
    lse = rng.standard_normal(3).astype(np.float32)
    with pytest.raises(ValueError, match="^merge: out_a and out_b must have one shape"):
        cuflash.merge(out, lse, out[:2], lse[:2])
    with pytest.raises(ValueError, match="^merge: lse_b must have shape"):
        cuflash.merge(out, lse, out, lse[:2])
    with pytest.raises(TypeError, match="^merge: out_a and out_b must have one dtype"):
        cuflash.merge(out, lse, out.astype(np.float64), lse)
    with pytest.raises(TypeError, match="^merge: lse_a must have a floating dtype"):
        cuflash.merge(out, lse.astype(np.int64), out, lse)
    with pytest.raises(TypeError, match="^merge: out_b must be an array, got None"):
        cuflash.merge(out, lse, None, lse)
    with pytest.raises(TypeError, match="^merge: lse_a must be a numpy.ndarray or cupy.ndarray"):
        cuflash.merge(out, lse.tolist(), out, lse)


def test_return_lse_must_be_a_bool():
    """Bug: return_lse="no" was taken as true, where causal and deterministic refuse it."""
    q, k, v = _qkv()
    for value in ("no", 1, None):
        with pytest.raises(TypeError, match=r"^attention: return_lse must be a bool, got"):
            cuflash.attention(q, k, v, return_lse=value)
    out, lse = cuflash.attention(q, k, v, return_lse=np.bool_(True))
    assert lse.shape == q.shape[:-1]


def test_k_and_v_must_have_one_head_count():
    """Bug: k with 2 heads and v with 4 (q 4) was accepted, grouping k but not v."""
    q, k, v = _qkv(lead=(2, 4))
    with pytest.raises(ValueError, match=re.escape(
            "attention: the leading dims of k and v must broadcast against each other (on axis "
            "-3: the same number of kv heads, or 1), got k.shape=(2, 2, 7, 8) and "
            "v.shape=(2, 4, 7, 8)")):
        cuflash.attention(q, k[:, :2], v)
    with pytest.raises(ValueError, match=r"^attention_backward: the leading dims of k and v"):
        out = np.zeros(q.shape[:-1] + (8,), np.float32)
        cuflash.attention_backward(out, q, k, v[:, :2], out, out[..., 0])
    with pytest.raises(ValueError, match=r"^attention_vjp: the leading dims of k and v"):
        cuflash.attention_vjp(q, k, v[:, :2])
    with pytest.raises(ValueError, match=r"^attention: the leading dims of k and v"):
        cuflash.attention(q[:1], k[:1].repeat(3, axis=0), v[:1].repeat(2, axis=0))  # batch 3 vs 2


# (k leading shape, v leading shape) with q (2, 4): k and v broadcast against each other plainly
KV_LEADS = [((2, 2), (2, 2)), ((1, 4), (2, 4)), ((2, 1), (2, 4)), ((2, 4), (1,)), ((2, 1), (2, 2)),
            ((4,), (2, 1, 4))]


@pytest.mark.parametrize("k_lead, v_lead", KV_LEADS, ids=str)
def test_k_and_v_that_broadcast_still_work(rng, k_lead, v_lead):
    """The k/v check refuses only grouping between k and v, not NumPy broadcasting or GQA."""
    q = rng.standard_normal((2, 4, 5, 8))
    k = rng.standard_normal(k_lead + (7, 8))
    v = rng.standard_normal(v_lead + (7, 3))
    out, lse = cuflash.attention(q, k, v, causal=True, return_lse=True)
    ref_out, ref_lse = reference.attention(q, k, v, causal=True, return_lse=True)
    np.testing.assert_allclose(out, ref_out, rtol=1e-12, atol=1e-12)
    dout = rng.standard_normal(out.shape)
    grads = cuflash.attention_backward(dout, q, k, v, out, lse, causal=True)
    ref = reference.attention_backward(dout, q, k, v, ref_out, ref_lse, causal=True)
    for g, r, x in zip(grads, ref, (q, k, v)):
        assert g.shape == x.shape
        np.testing.assert_allclose(g, r, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_scale_that_overflows_the_accumulator(dtype):
    """Bug: scale=1e39 is finite as a Python float but inf in float32; it turned rows "empty"."""
    q, k, v = _qkv(dtype=dtype)
    with pytest.raises(ValueError,
                       match=r"^attention: scale must be at most 2.359e\+38 .*float32.*1e\+39"):
        cuflash.attention(q, k, v, scale=1e39)
    cuflash.attention(q, k, v, scale=2e38)  # representable, scale * log2(e) too: accepted


def test_extreme_scales_that_are_accepted(rng):
    """1e39 is an ordinary scale for float64 inputs; 1e-50 (0 in float32) is uniform attention."""
    q, k, v = (x.astype(np.float64) for x in _qkv())
    np.testing.assert_allclose(cuflash.attention(q, k, v, scale=1e39),
                               reference.attention(q, k, v, scale=1e39), rtol=1e-12, atol=1e-12)
    q, k, v = _qkv()
    out = cuflash.attention(q, k, v, scale=1e-50)
    uniform = np.broadcast_to(v.mean(axis=-2, keepdims=True), out.shape)
    np.testing.assert_allclose(out, uniform, rtol=1e-5, atol=1e-6)


def test_float64_bias_beyond_float32_range():
    """A float64 bias is cast to float32 for float32 inputs (documented, values are not read):
    -1e39 becomes -inf and hides its key; +1e39 becomes +inf and makes its row NaN."""
    q, k, v = _qkv()
    bias = np.zeros((5, 7))
    bias[:, 2] = -1e39
    bias[3, 4] = 1e39
    with np.errstate(over="ignore"):  # NumPy's own warning for the overflowing cast
        out = cuflash.attention(q, k, v, bias=bias)
    hidden = cuflash.attention(q, k, v, bias=np.where(bias < -1e38, -np.inf, 0.0))
    rows = np.arange(5) != 3
    assert np.array_equal(out[..., rows, :], hidden[..., rows, :])
    assert np.isnan(out[..., 3, :]).all()


def test_vjp_names_an_unknown_option():
    """Bug: attention_vjp(casual=True) said "make_problem() got an unexpected keyword argument"."""
    q, k, v = _qkv()
    with pytest.raises(TypeError,
                       match=r"attention_vjp\(\) got an unexpected keyword argument 'casual'"):
        cuflash.attention_vjp(q, k, v, casual=True)
    for value in (True, False):
        with pytest.raises(TypeError, match=r"^attention_vjp: takes no return_lse option"):
            cuflash.attention_vjp(q, k, v, return_lse=value)


def _misuses():
    q, k, v = _qkv()
    return {
        "window": lambda: cuflash.attention(q, k, v, window=(-1, 0)),
        "return_lse": lambda: cuflash.attention(q, k, v, return_lse="no"),
        "kv heads": lambda: cuflash.attention(q, k[:, :2], v),
        "scale": lambda: cuflash.attention(q, k, v, scale=1e39),
        "vjp option": lambda: cuflash.attention_vjp(q, k, v, casual=True),
        "vjp scale": lambda: cuflash.attention_vjp(q, k, v, scale=1e39),
    }


@pytest.mark.parametrize("misuse", list(_misuses()))
def test_cpu_errors_happen_before_work(monkeypatch, misuse):
    """Validation runs before dispatch: a bad call never reaches a compute path."""
    import cuflash.api as api

    def boom(problem):
        raise AssertionError("dispatch reached")
    monkeypatch.setattr(api, "_dispatch", boom)
    with pytest.raises((TypeError, ValueError)):
        _misuses()[misuse]()


@pytest.mark.parametrize("fn", ["attention", "attention_backward", "attention_vjp"])
def test_signatures_carry_every_option(fn):
    """api.OPTIONS, which each public function hands to make_problem from its locals(), is
    exactly its keyword-only parameters but its own flags, the packed keywords (api.PACKED),
    attention's block_table, which only the forward takes and passes itself, and the backward's
    return_dbias, likewise: an option added to a signature and not to OPTIONS (or the reverse)
    would be dropped or raise."""
    import inspect

    from cuflash import api

    params = inspect.signature(getattr(cuflash, fn)).parameters
    keywords = [n for n, p in params.items() if p.kind is p.KEYWORD_ONLY]
    own = {"return_lse", "deterministic"} | ({"block_table"} if fn == "attention" else
                                              {"return_dbias"})
    own |= set(api.PACKED)  # packed sequences' keywords, which api._packed reads
    assert set(api.PACKED) <= set(keywords)
    assert [n for n in keywords if n not in own] == list(api.OPTIONS)
