"""What is timed: cuflash and each peer (FlashAttention-4; torch SDPA's flash, cuDNN, efficient and
math backends; FlexAttention; naive CuPy attention), each prepared as a Prepared whose fn is exactly
the timed work, and the inputs they share. CuPy, cuflash, torch and FA4 are imported only when a GPU
run asks for them (load_*), so that this module imports on a machine without them."""
import contextlib
import math
import os
import sys
from dataclasses import dataclass
from functools import partial

import numpy as np

from cases import BLOCK, block_pattern, mask_array, padding_lens, visible_mask

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TORCH_BACKENDS = {"torch-flash": "FLASH_ATTENTION", "torch-cudnn": "CUDNN_ATTENTION",
                  "torch-efficient": "EFFICIENT_ATTENTION",
                  "torch-math": "MATH"}                      # cases.TORCH_IMPLS -> SDPBackend
FLEX_RECOMPILE_LIMIT = 64            # torch.compile variants of flex_attention one run may need


class Refused(Exception):
    """A peer does not take this case (its untimed trial call failed): recorded as skipped."""


def load_cupy():
    try:
        import cupy
    except ImportError as e:
        raise SystemExit(f"bench.py needs CuPy and a CUDA GPU; `import cupy` failed: {e}. "
                         "Use --dry-run or --self-test on a machine without a GPU.")
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # CUDARuntimeError: no driver, no device
        raise SystemExit(f"bench.py needs a CUDA GPU; CuPy found none: {e}")
    if count == 0:
        raise SystemExit("bench.py needs a CUDA GPU; CuPy found none (device count 0)")
    return cupy


def load_cuflash():
    try:
        import cuflash
    except ImportError:
        sys.path.insert(0, REPO_ROOT)
        import cuflash
    return cuflash


def load_torch(device_id):
    """(torch, None), or (None, why not)."""
    try:
        import torch
    except ImportError as e:
        return None, f"torch not importable ({type(e).__name__})"
    if not torch.cuda.is_available():
        return None, "torch.cuda.is_available() is False"
    torch.cuda.set_device(device_id)
    return torch, None


def load_fa4():
    """(FlashAttention-4's flash_attn_func, None), or (None, why not)."""
    try:
        from flash_attn.cute import flash_attn_func
    except Exception as e:  # ImportError, or the CuTe DSL failing as it loads
        return None, f"fa4 not importable: {type(e).__name__}: {str(e).strip()[:200]}"
    return flash_attn_func, None


def load_flex(torch):
    """((compiled flex_attention, create_block_mask), None), or (None, why not). Compiled once here,
    with static shapes; each case's shapes are traced by prepare_flex's untimed trial call."""
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        config = torch._dynamo.config
        for name in ("cache_size_limit", "recompile_limit"):  # the older and the newer name
            if hasattr(config, name):
                setattr(config, name, max(getattr(config, name), FLEX_RECOMPILE_LIMIT))
        return (torch.compile(flex_attention, dynamic=False), create_block_mask), None
    except Exception as e:
        return None, f"FlexAttention not importable: {type(e).__name__}: {str(e).strip()[:200]}"


# ---- inputs, layouts, and CuPy <-> torch sharing -------------------------------------------

NP_DTYPES = {"fp16": np.float16, "fp32": np.float32, "fp64": np.float64}


def np_dtype(name):
    if name == "bf16":
        import ml_dtypes
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(NP_DTYPES[name])


def to_dtype(cp, x32, dtype):
    """float32 CuPy array -> dtype; bfloat16 by round-to-nearest-even on the bits if astype fails."""
    try:
        return x32.astype(dtype)
    except Exception:
        if dtype.name != "bfloat16":
            raise
        bits = x32.view(cp.uint32)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        return rounded.astype(cp.uint16).view(dtype)


def make_inputs(cp, case, seed):
    """q (Hq heads, Nq, Dk), k (Hkv, Nk, Dk), v (Hkv, Nk, Dv) and, for the backward, dout like the
    output, all N(0, 1) and stored in the case's layout: (B, H, N, D) for "bhnd", (B, N, H, D) for
    "bnhd"; for a bias case also bias (1, Hq, Nq, Nk) N(0, 1) in the accumulator dtype (float32,
    float64 for fp64 cases: a float32 bias would be cast per call)."""
    rng = cp.random.RandomState(seed)
    dtype = np_dtype(case.dtype)

    def draw(h, n, d):
        shape = (case.b, h, n, d) if case.layout == "bhnd" else (case.b, n, h, d)
        return to_dtype(cp, rng.standard_normal(shape, dtype=cp.float32), dtype)

    inputs = {"q": draw(case.hq, case.nq, case.d), "k": draw(case.hkv, case.nk, case.d),
              "v": draw(case.hkv, case.nk, case.d_v)}
    if case.kind == "bwd":
        inputs["dout"] = draw(case.hq, case.nq, case.d_v)
    if case.bias:
        acc = cp.float64 if case.dtype == "fp64" else cp.float32
        inputs["bias"] = rng.standard_normal((1, case.hq, case.nq, case.nk), dtype=acc)
    return inputs


def as_layout(x, stored, wanted):
    """A CuPy array or torch tensor stored as `stored` ("bhnd" or "bnhd"), seen as `wanted`: itself,
    or a view with axes 1 and 2 swapped (no copy)."""
    return x if stored == wanted else x.swapaxes(1, 2)


def make_to_torch(cp, torch):
    """A CuPy -> torch zero-copy converter, and how it shares bfloat16 ("direct" or "int16 view")."""
    bf16 = np_dtype("bf16")
    probe = to_dtype(cp, cp.arange(8, dtype=cp.float32), bf16)
    try:
        t = torch.from_dlpack(probe)
        direct = t.dtype == torch.bfloat16 and t.float().cpu().tolist() == list(range(8))
    except Exception:
        direct = False

    def to_torch(x):
        if x.dtype == bf16 and not direct:
            return torch.from_dlpack(x.view(cp.int16)).view(torch.bfloat16)
        return torch.from_dlpack(x)

    return to_torch, "direct" if direct else "int16 view"


def torch_views(env, case, x, names, layout):
    """torch tensors sharing the CuPy buffers x[name] (no copy), seen in `layout`."""
    return [as_layout(env.to_torch(x[name]), case.layout, layout) for name in names]


def trial(torch, fn, who):
    """fn() once, untimed; a failure other than running out of memory is `who` refusing the case."""
    try:
        return fn()
    except torch.cuda.OutOfMemoryError:
        raise
    except Exception as e:
        raise Refused(f"{who} refused: {type(e).__name__}: {str(e).strip()[:300]}") from e


# ---- the implementations: each returns Prepared(fn = exactly the timed work, context, notes) --

@dataclass
class Prepared:
    fn: object
    context: object                   # a factory of the context manager to time fn inside
    notes: dict
    memory: str                       # "cupy" or "torch": whose allocator to watch


def prepare_cuflash(env, case, x, precision=None, deterministic=False):
    cf = env.cf
    opts = {"causal": case.causal}
    if precision is not None:
        opts["precision"] = precision
    if case.kv_lens:
        opts["kv_lens"] = [[n] for n in case.kv_lens]        # host ints, shape (B, 1)
    if case.window:
        opts["window"] = case.window
    if case.mask:
        opts["mask"] = env.cp.asarray(mask_array(case))
    if case.bias:
        opts["bias"] = x["bias"]
    if case.softcap:
        opts["softcap"] = case.softcap
    if case.dropout:
        opts["dropout_p"], opts["dropout_seed"] = case.dropout, (1234, 0)
    # (B, H, N, D) views: of the buffers themselves for bhnd, swapaxes(1, 2) of them for bnhd
    q, k, v = (as_layout(x[name], case.layout, "bhnd") for name in ("q", "k", "v"))
    if case.kind != "bwd":
        return Prepared(lambda: cf.attention(q, k, v, **opts), contextlib.nullcontext, {}, "cupy")
    out, lse = cf.attention(q, k, v, return_lse=True, **opts)
    dout = as_layout(x["dout"], case.layout, "bhnd")
    return Prepared(lambda: cf.attention_backward(dout, q, k, v, out, lse,
                                                  deterministic=deterministic, **opts),
                    contextlib.nullcontext, {}, "cupy")


def torch_backward(torch, forward, inputs, dout, **kw):
    """The timed callable of a torch backward: autograd.grad of one retained forward graph,
    out = forward(*inputs, **kw)."""
    inputs = tuple(t.detach().requires_grad_() for t in inputs)
    out = forward(*inputs, **kw)

    def fn():
        return torch.autograd.grad(out, inputs, dout, retain_graph=True)
    return fn


def sdpa_visible(env, case, x, q):
    """SDPA's keywords for which pairs are visible (is_causal, or an attn_mask made here, outside
    the timed region), and the note that says which."""
    torch = env.torch
    if case.bias:
        # cast once: SDPA's fused backends take an attn_mask of the query dtype
        return ({"attn_mask": env.to_torch(x["bias"]).to(q.dtype)},
                {"bias": f"{x['bias'].dtype} bias cast to {case.dtype} attn_mask, untimed"})
    visible = visible_mask(case)
    if visible is None:
        # SDPA's is_causal is top-left; the prefill grid has Nq = Nk, where it equals bottom-right
        return {"is_causal": case.causal}, {}
    return ({"attn_mask": torch.from_numpy(visible).to(q.device)},
            {"mask": f"boolean attn_mask {tuple(visible.shape)}"})


def prepare_torch(env, case, x, impl):
    torch = env.torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    sdpa = torch.nn.functional.scaled_dot_product_attention
    backend = getattr(SDPBackend, TORCH_BACKENDS[impl])

    def context():                    # sdpa_kernel's context manager is single-use
        return sdpa_kernel(backend)

    # (B, H, N, D): the buffers themselves for bhnd, .transpose(1, 2) views of them for bnhd
    q, k, v = torch_views(env, case, x, ("q", "k", "v"), "bhnd")
    kw, notes = sdpa_visible(env, case, x, q)
    if case.dropout:
        kw["dropout_p"] = case.dropout
    if case.hq != case.hkv:
        k, v, notes["gqa"] = torch_gqa(sdpa, context, q, k, v, kw, case.hq // case.hkv)
        if "enable_gqa" in notes["gqa"]:
            kw["enable_gqa"] = True
    if case.kind != "bwd":
        return Prepared(lambda: sdpa(q, k, v, **kw), context, notes, "torch")
    (dout,) = torch_views(env, case, x, ("dout",), "bhnd")
    with context():
        fn = torch_backward(torch, sdpa, (q, k, v), dout, **kw)
    return Prepared(fn, context, notes, "torch")


def torch_gqa(sdpa, context, q, k, v, kw, groups):
    """GQA for SDPA: enable_gqa=True if this backend takes it, else repeat_interleave (untimed)."""
    try:
        with context():
            sdpa(q, k, v, enable_gqa=True, **kw)
        return k, v, "enable_gqa=True"
    except Exception as e:
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
        return k, v, (f"repeat_interleave of k, v outside the timed region (enable_gqa failed: "
                      f"{type(e).__name__}); the kernel reads {groups}x the KV bytes counted")


def prepare_fa4(env, case, x):
    """FlashAttention-4 on (B, N, H, D) tensors: the buffers themselves for bnhd; for bhnd a
    .transpose(1, 2) view of them, no copy (FA4 takes any strides with a unit-stride last dim, as
    a caller holding (B, H, N, D) tensors would hand them over). GQA: k, v with fewer heads."""
    torch = env.torch
    q, k, v = torch_views(env, case, x, ("q", "k", "v"), "bnhd")
    kw = {"causal": case.causal}
    if case.window:
        kw["window_size"] = case.window
    if case.softcap:
        kw["softcap"] = case.softcap

    def forward(q, k, v):
        result = env.fa4(q, k, v, **kw)
        return result[0] if isinstance(result, (tuple, list)) else result   # out, or (out, lse)

    if case.kind != "bwd":
        fn = partial(forward, q, k, v)
    else:
        (dout,) = torch_views(env, case, x, ("dout",), "bnhd")
        fn = trial(torch, lambda: torch_backward(torch, forward, (q, k, v), dout), "fa4")
    trial(torch, fn, "fa4")
    return Prepared(fn, contextlib.nullcontext, {}, "torch")


def prepare_flex(env, case, x):
    """FlexAttention with a block mask of the case's boolean mask (padding: kv < valid length of
    the batch entry; block-sparse: the 128 x 128 block pattern), made and compiled untimed; a
    softcap as its score_mod (cap * tanh(score / cap)), with the causal block mask if causal."""
    torch = env.torch
    flex, create_block_mask = env.flex
    q, k, v = torch_views(env, case, x, ("q", "k", "v"), "bhnd")
    kw = {}
    if case.softcap:
        cap = case.softcap

        def score_mod(score, b, h, q_idx, kv_idx):
            return cap * torch.tanh(score / cap)
        kw["score_mod"] = score_mod
    if case.softcap and not case.mask:
        def mask_mod(b, h, q_idx, kv_idx):
            return q_idx >= kv_idx
        batch = None
    elif case.mask == "padding":
        lens = torch.tensor(padding_lens(case), device=q.device)

        def mask_mod(b, h, q_idx, kv_idx):
            return kv_idx < lens[b]
        batch = case.b
    else:
        blocks = torch.from_numpy(block_pattern(case)).to(q.device)

        def mask_mod(b, h, q_idx, kv_idx):
            return blocks[q_idx // BLOCK, kv_idx // BLOCK]
        batch = None                  # one pattern for every batch entry
    if not case.mask and not case.causal:
        block_mask = None
    else:
        block_mask = trial(torch, lambda: create_block_mask(mask_mod, batch, None, case.nq,
                                                            case.nk, device=q.device,
                                                            BLOCK_SIZE=BLOCK),
                           "FlexAttention")
    kw["block_mask"] = block_mask
    if case.kind != "bwd":
        fn = partial(flex, q, k, v, **kw)
    else:
        (dout,) = torch_views(env, case, x, ("dout",), "bhnd")
        fn = trial(torch, lambda: torch_backward(torch, flex, (q, k, v), dout, **kw),
                   "FlexAttention")
    trial(torch, fn, "FlexAttention")
    return Prepared(fn, contextlib.nullcontext, {}, "torch")


def naive_matmul(cp, dtype):
    """cp.matmul in the input dtype, or through float32 when CuPy cannot multiply this dtype."""
    a = to_dtype(cp, cp.ones((2, 16, 16), dtype=cp.float32), dtype)
    try:
        cp.matmul(a, a)
        return cp.matmul, None
    except Exception as e:
        def matmul(x, y):
            return cp.matmul(x.astype(cp.float32), y.astype(cp.float32)).astype(dtype)
        return matmul, f"{dtype} matmul failed ({type(e).__name__}): GEMMs in float32"


def naive_probabilities(cp, mm, q, k, scale, causal_bias, acc):
    """softmax(q kᵀ scale + bias) in the accumulator dtype, in place on one N x N buffer."""
    s = mm(q, k.swapaxes(-1, -2)).astype(acc)
    s *= scale
    if causal_bias is not None:
        s += causal_bias
    s -= s.max(axis=-1, keepdims=True)
    cp.exp(s, out=s)
    s /= s.sum(axis=-1, keepdims=True)
    return s


def naive_forward(cp, mm, q, k, v, scale, causal_bias, acc):
    p = naive_probabilities(cp, mm, q, k, scale, causal_bias, acc)
    return mm(p.astype(q.dtype), v)


def naive_backward(cp, mm, dout, q, k, v, out, scale, causal_bias, acc):
    p = naive_probabilities(cp, mm, q, k, scale, causal_bias, acc)
    dv = mm(p.astype(q.dtype).swapaxes(-1, -2), dout)
    dp = mm(dout, v.swapaxes(-1, -2)).astype(acc)
    dp -= (dout.astype(acc) * out.astype(acc)).sum(axis=-1, keepdims=True)
    dp *= p
    dp *= scale
    del p
    ds = dp.astype(q.dtype)
    del dp
    return mm(ds, k), mm(ds.swapaxes(-1, -2), q), dv


def causal_bias(cp, nq, nk, acc):
    """(Nq, Nk) in the accumulator dtype: 0 where visible (bottom-right), -inf elsewhere."""
    i = cp.arange(nq)[:, None]
    j = cp.arange(nk)[None, :]
    return cp.where(j <= i + (nk - nq), 0.0, -np.inf).astype(acc)


def prepare_naive(env, case, x):
    cp = env.cp
    q, k, v = (as_layout(x[name], case.layout, "bhnd") for name in ("q", "k", "v"))
    mm, note = naive_matmul(cp, q.dtype)
    notes = {"matmul": note} if note else {}
    acc = cp.float64 if q.dtype == cp.float64 else cp.float32
    scale = 1.0 / math.sqrt(case.d)
    bias = causal_bias(cp, case.nq, case.nk, acc) if case.causal else None
    if case.kind != "bwd":
        return Prepared(lambda: naive_forward(cp, mm, q, k, v, scale, bias, acc),
                        contextlib.nullcontext, notes, "cupy")
    out = naive_forward(cp, mm, q, k, v, scale, bias, acc)
    dout = as_layout(x["dout"], case.layout, "bhnd")
    return Prepared(lambda: naive_backward(cp, mm, dout, q, k, v, out, scale, bias, acc),
                    contextlib.nullcontext, notes, "cupy")


PREPARE = {"cuflash": prepare_cuflash, "fa4": prepare_fa4, "flex": prepare_flex,
           "naive": prepare_naive,
           "cuflash-tf32": lambda env, case, x: prepare_cuflash(env, case, x, precision="high"),
           "cuflash-det": lambda env, case, x: prepare_cuflash(env, case, x, deterministic=True)}


def prepare(env, case, x, impl):
    """The Prepared of implementation `impl` (a name of cases.ALL_IMPLS) on inputs x."""
    if impl in TORCH_BACKENDS:
        return prepare_torch(env, case, x, impl)
    return PREPARE[impl](env, case, x)
