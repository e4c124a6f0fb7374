"""Every misuse raises ValueError or TypeError naming the argument, before any work starts."""
import numpy as np
import pytest

import cuflash


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
]


@pytest.mark.parametrize("options,error,word", BAD_OPTIONS, ids=[str(o[0])[:40] for o in BAD_OPTIONS])
@pytest.mark.parametrize("fn", ["attention", "attention_backward", "attention_vjp"])
def test_bad_option(options, error, word, fn):
    q, k, v = _qkv()
    with pytest.raises(error, match=word):
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
    with pytest.raises(ValueError, match=r"q and k must have the same head dim.*q.shape=\(2, 4, 5, 8\)"):
        cuflash.attention(q, k[..., :6], v)
    with pytest.raises(ValueError, match=r"k and v must have the same number of keys.*v.shape=\(2, 4, 6, 8\)"):
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
    with pytest.raises(TypeError, match="q must be a numpy.ndarray or cupy.ndarray, got list"):
        cuflash.attention(q.tolist(), k, v)
    with pytest.raises(TypeError, match="v must be a numpy.ndarray or cupy.ndarray"):
        cuflash.attention(q, k, None)


def test_backward_arguments():
    q, k, v = _qkv()
    out, lse = cuflash.attention(q, k, v, return_lse=True)
    with pytest.raises(ValueError, match="dout must have the output's shape"):
        cuflash.attention_backward(out[..., :3], q, k, v, out, lse)
    with pytest.raises(TypeError, match="dout must have q's dtype"):
        cuflash.attention_backward(out.astype(np.float64), q, k, v, out, lse)
    with pytest.raises(ValueError, match="lse must have shape"):
        cuflash.attention_backward(out, q, k, v, out, lse[..., :2])
    _, vjp = cuflash.attention_vjp(q, k, v)
    with pytest.raises(ValueError, match="dout"):
        vjp(out[:1])
    with pytest.raises(TypeError, match="return_lse"):
        cuflash.attention_vjp(q, k, v, return_lse=True)
    with pytest.raises(TypeError, match="deterministic must be a bool"):
        cuflash.attention_backward(out, q, k, v, out, lse, deterministic=1)
    with pytest.raises(TypeError, match="deterministic must be a bool"):
        cuflash.attention_vjp(q, k, v, deterministic="yes")


def test_merge_arguments():
    rng = np.random.default_rng(1)
    out = rng.standard_normal((3, 4)).astype(np.float32)
    lse = rng.standard_normal(3).astype(np.float32)
    with pytest.raises(ValueError, match="out_a and out_b must have one shape"):
        cuflash.merge(out, lse, out[:2], lse[:2])
    with pytest.raises(ValueError, match="lse_b must have shape"):
        cuflash.merge(out, lse, out, lse[:2])
    with pytest.raises(TypeError, match="out_a and out_b must have one dtype"):
        cuflash.merge(out, lse, out.astype(np.float64), lse)
    with pytest.raises(TypeError, match="lse_a must have a floating dtype"):
        cuflash.merge(out, lse.astype(np.int64), out, lse)


def test_cpu_errors_happen_before_work(monkeypatch):
    """Validation runs before dispatch: a bad call never reaches a compute path."""
    import cuflash.api as api

    def boom(problem):
        raise AssertionError("dispatch reached")
    monkeypatch.setattr(api, "_dispatch", boom)
    q, k, v = _qkv()
    with pytest.raises(ValueError):
        cuflash.attention(q, k, v, window=(-1, 0))
