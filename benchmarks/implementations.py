"""What is timed: cuflash and each peer (torch SDPA's flash, cuDNN and efficient backends; naive
CuPy attention), each prepared as a Prepared whose fn is exactly the timed work, and the inputs
they share. CuPy, cuflash and torch are imported only when a GPU run asks for them (load_*), so
that this module imports on a machine without them."""
import contextlib
import math
import os
import sys
from dataclasses import dataclass

import numpy as np

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TORCH_BACKENDS = {"torch-flash": "FLASH_ATTENTION", "torch-cudnn": "CUDNN_ATTENTION",
                  "torch-efficient": "EFFICIENT_ATTENTION"}   # cases.TORCH_IMPLS -> SDPBackend


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


# ---- inputs, and CuPy <-> torch sharing -----------------------------------------------------

def np_dtype(name):
    if name == "bf16":
        import ml_dtypes
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(np.float16)


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
    """q (B, Hq, Nq, D), k and v (B, Hkv, Nk, D), and dout like q for the backward; N(0, 1)."""
    rng = cp.random.RandomState(seed)
    dtype = np_dtype(case.dtype)

    def draw(*shape):
        return to_dtype(cp, rng.standard_normal(shape, dtype=cp.float32), dtype)

    inputs = {"q": draw(case.b, case.hq, case.nq, case.d),
              "k": draw(case.b, case.hkv, case.nk, case.d),
              "v": draw(case.b, case.hkv, case.nk, case.d)}
    if case.kind == "bwd":
        inputs["dout"] = draw(case.b, case.hq, case.nq, case.d)
    return inputs


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


# ---- the implementations: each returns Prepared(fn = exactly the timed work, context, notes) --

@dataclass
class Prepared:
    fn: object
    context: object                   # a factory of the context manager to time fn inside
    notes: dict
    memory: str                       # "cupy" or "torch": whose allocator to watch


def prepare_cuflash(env, case, x):
    cf = env.cf
    opts = {"causal": case.causal}
    if case.kv_lens:
        opts["kv_lens"] = [[n] for n in case.kv_lens]        # host ints, shape (B, 1)
    q, k, v = x["q"], x["k"], x["v"]
    if case.kind != "bwd":
        return Prepared(lambda: cf.attention(q, k, v, **opts), contextlib.nullcontext, {}, "cupy")
    out, lse = cf.attention(q, k, v, return_lse=True, **opts)
    dout = x["dout"]
    return Prepared(lambda: cf.attention_backward(dout, q, k, v, out, lse, **opts),
                    contextlib.nullcontext, {}, "cupy")


def prepare_torch(env, case, x, impl):
    torch = env.torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    sdpa = torch.nn.functional.scaled_dot_product_attention
    backend = getattr(SDPBackend, TORCH_BACKENDS[impl])

    def context():                    # sdpa_kernel's context manager is single-use
        return sdpa_kernel(backend)

    q, k, v = (env.to_torch(x[name]) for name in ("q", "k", "v"))
    # SDPA's is_causal is top-left; the prefill grid has Nq = Nk, where it equals bottom-right
    kw = {"is_causal": case.causal}
    notes = {}
    if case.kv_lens:
        valid = torch.arange(case.nk, device=q.device)[None, :] < torch.tensor(
            case.kv_lens, device=q.device)[:, None]
        kw["attn_mask"] = valid.view(case.b, 1, 1, case.nk)
        notes["kv_lens"] = "boolean attn_mask (B, 1, 1, L): work in proportion to B x L"
    if case.hq != case.hkv:
        k, v, notes["gqa"] = torch_gqa(sdpa, context, q, k, v, kw, case.hq // case.hkv)
        if "enable_gqa" in notes["gqa"]:
            kw["enable_gqa"] = True
    if case.kind != "bwd":
        def fn():
            return sdpa(q, k, v, **kw)
        return Prepared(fn, context, notes, "torch")
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    with context():
        out = sdpa(q, k, v, **kw)
    dout = env.to_torch(x["dout"])

    def fn():
        return torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
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


def naive_probabilities(cp, mm, q, k, scale, causal_bias):
    """softmax(q kᵀ scale + bias) in float32, in place on one N x N buffer."""
    s = mm(q, k.swapaxes(-1, -2)).astype(cp.float32)
    s *= scale
    if causal_bias is not None:
        s += causal_bias
    s -= s.max(axis=-1, keepdims=True)
    cp.exp(s, out=s)
    s /= s.sum(axis=-1, keepdims=True)
    return s


def naive_forward(cp, mm, q, k, v, scale, causal_bias):
    p = naive_probabilities(cp, mm, q, k, scale, causal_bias)
    return mm(p.astype(q.dtype), v)


def naive_backward(cp, mm, dout, q, k, v, out, scale, causal_bias):
    p = naive_probabilities(cp, mm, q, k, scale, causal_bias)
    dv = mm(p.astype(q.dtype).swapaxes(-1, -2), dout)
    dp = mm(dout, v.swapaxes(-1, -2)).astype(cp.float32)
    dp -= (dout.astype(cp.float32) * out.astype(cp.float32)).sum(axis=-1, keepdims=True)
    dp *= p
    dp *= scale
    del p
    ds = dp.astype(q.dtype)
    del dp
    return mm(ds, k), mm(ds.swapaxes(-1, -2), q), dv


def causal_bias(cp, nq, nk):
    """(Nq, Nk) float32: 0 where visible (bottom-right), -inf elsewhere."""
    i = cp.arange(nq)[:, None]
    j = cp.arange(nk)[None, :]
    return cp.where(j <= i + (nk - nq), 0.0, -np.inf).astype(cp.float32)


def prepare_naive(env, case, x):
    cp = env.cp
    q, k, v = x["q"], x["k"], x["v"]
    mm, note = naive_matmul(cp, q.dtype)
    notes = {"matmul": note} if note else {}
    scale = 1.0 / math.sqrt(case.d)
    bias = causal_bias(cp, case.nq, case.nk) if case.causal else None
    if case.kind != "bwd":
        return Prepared(lambda: naive_forward(cp, mm, q, k, v, scale, bias),
                        contextlib.nullcontext, notes, "cupy")
    out = naive_forward(cp, mm, q, k, v, scale, bias)
    dout = x["dout"]
    return Prepared(lambda: naive_backward(cp, mm, dout, q, k, v, out, scale, bias),
                    contextlib.nullcontext, notes, "cupy")


def prepare(env, case, x, impl):
    """The Prepared of implementation `impl` (a name of cases.ALL_IMPLS) on inputs x."""
    if impl == "cuflash":
        return prepare_cuflash(env, case, x)
    if impl == "naive":
        return prepare_naive(env, case, x)
    return prepare_torch(env, case, x, impl)
