"""Tile variants of the Hopper forward side by side (device time behind a GPU spin, TFLOP/s), next
to fwd_mma, torch SDPA (cuDNN, flash) and FlashAttention-4 where importable. On the device machine:
    PYTHONPATH=. python3 tools/wg_probe.py grid     # D 64/128, N 1k/4k/16k: VARIANTS below
    PYTHONPATH=. python3 tools/wg_probe.py dims     # D 96, (192, 128), 256
    PYTHONPATH=. python3 tools/wg_probe.py opts     # padding / block-sparse masks, bias
"""
import sys
import cupy as cp
import cuflash
from cuflash import _gpu, _validate, _wgmma_fwd as W

def tflops(B, H, N, D, causal, ms):
    pairs = N * N if not causal else N * (N + 1) / 2
    return 4 * B * H * D * pairs / (ms * 1e-3) / 1e12

_spin = cp.RawKernel(r"""extern "C" __global__ void spin(long long n) {
  long long t0 = clock64(); while (clock64() - t0 < n) {} }""", "spin")

def bench(fn, iters=10):
    fn(); cp.cuda.Device().synchronize()
    s, e = cp.cuda.Event(), cp.cuda.Event()
    ts = []
    for _ in range(3):
        _spin((1,), (1,), (cp.int64(20_000_000),))  # ~10 ms: the host enqueues ahead of the GPU
        s.record()
        for _ in range(iters): fn()
        e.record(); e.synchronize()
        ts.append(cp.cuda.get_elapsed_time(s, e) / iters)
    return min(ts)

import torch
from torch.nn.attention import sdpa_kernel, SDPBackend


def sdpa_rows(row, backends, q, k, v, rate, **kw):
    """Appends 'name TFLOP/s' per torch SDPA backend (rate: ms -> TFLOP/s); '-' where refused."""
    for name, be in backends:
        try:
            with sdpa_kernel(be):
                ms = bench(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, **kw))
            row.append(f"{name} {rate(ms):6.1f}")
        except Exception:
            row.append(f"{name} -")

try:
    from flash_attn.cute import flash_attn_func
except Exception as ex:
    print("no fa4:", ex)
    flash_attn_func = None

T = W.Tile
VARIANTS = {  # (Dk, Dv) padded -> {name: tile}
    (64, 64): {"c3": T(128, 3, 2, 160, False), "pp192": T(192, 2, 2, 240, True), "nopp192": T(192, 2, 2, 240, False)},
    (128, 128): {"pp": T(128, 2, 2, 240, True), "nopp": T(128, 2, 2, 240, False), "pp176": T(176, 2, 2, 240, True), "nopp176": T(176, 2, 2, 240, False)},
}
default = dict(W.TILES)
mode = sys.argv[1] if len(sys.argv) > 1 else "grid"
if mode == "opts":
    B, H, N, D = 4, 16, 4096, 128
    q, k, v = (cp.random.standard_normal((B, H, N, D), dtype=cp.float32).astype("bfloat16") for _ in range(3))
    valid = cp.arange(N)[None, :] < cp.array([[2540]] * B)
    pad = valid[:, None, None, :]
    bias = cp.random.standard_normal((1, H, N, N), dtype=cp.float32)
    tq, tk, tv = (torch.from_dlpack(x) for x in (q, k, v))
    blocks = cp.random.random((N // 128, N // 128)) < 0.5
    sparse = cp.repeat(cp.repeat(blocks, 128, 0), 128, 1)[None, None]
    sparse = cp.ascontiguousarray(cp.broadcast_to(sparse, (B, 1, N, N)))
    nsp = int(sparse[0, 0].sum())
    for name, opts, pairs, tmask in (("padding", dict(mask=pad), 2540 * N, torch.from_dlpack(pad)),
                                     ("blocksparse", dict(mask=sparse), nsp, torch.from_dlpack(sparse)),
                                     ("bias", dict(bias=bias), N * N, torch.from_dlpack(bias).to(torch.bfloat16))):
        row = [f"{name}"]
        fl = 4 * B * H * D * pairs
        ms = bench(lambda: cuflash.attention(q, k, v, **opts))
        row.append(f"cuflash {fl / ms / 1e9:6.1f}")
        with _gpu.override(path="mma"):
            ms = bench(lambda: cuflash.attention(q, k, v, **opts))
        row.append(f"mma {fl / ms / 1e9:6.1f}")
        backends = (("cudnn", SDPBackend.CUDNN_ATTENTION), ("eff", SDPBackend.EFFICIENT_ATTENTION))
        sdpa_rows(row, backends, tq, tk, tv, lambda ms: fl / ms / 1e9, attn_mask=tmask)
        print("  ".join(row), flush=True)
    raise SystemExit
if mode == "grid":
    cases = [(D, D, N, c) for D in (64, 128) for c in (False, True) for N in (1024, 4096, 16384)]
else:
    cases = [(dk, dv, 4096, c) for dk, dv in ((96, 96), (192, 128), (256, 256)) for c in (False, True)]
for dk, dv, N, causal in cases:
    H = 2048 // dk if dk != 256 else 8
    B = 16384 // N if dk != 256 else 4
    q, k = (cp.random.standard_normal((B, H, N, dk), dtype=cp.float32).astype("bfloat16") for _ in range(2))
    v = cp.random.standard_normal((B, H, N, dv), dtype=cp.float32).astype("bfloat16")
    p = _validate.make_problem(q, k, v, causal=causal)
    row = [f"D={dk}/{dv} N={N:5d} {'causal' if causal else 'full  '} {_gpu.forward_path(p)}"]
    dims = W.padded(p)
    for name, tile in (VARIANTS.get(dims) or {"def": default[(dims, False)]}).items():
        W.TILES[(dims, False)] = tile
        ms = bench(lambda: cuflash.attention(q, k, v, causal=causal))
        row.append(f"{name} {tflops(B,H,N,dk,causal,ms):6.1f}")
    W.TILES.update(default)
    with _gpu.override(path="mma"):
        ms = bench(lambda: cuflash.attention(q, k, v, causal=causal))
    row.append(f"mma {tflops(B,H,N,dk,causal,ms):6.1f}")
    tq, tk, tv = (torch.from_dlpack(x) for x in (q, k, v))
    sdpa_rows(row, (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)),
              tq, tk, tv, lambda ms: tflops(B, H, N, dk, causal, ms), is_causal=causal)
    if flash_attn_func is not None:
        bq, bk, bv = (x.transpose(1, 2).contiguous() for x in (tq, tk, tv))
        try:
            ms = bench(lambda: flash_attn_func(bq, bk, bv, causal=causal))
            row.append(f"fa4 {tflops(B,H,N,dk,causal,ms):6.1f}")
        except Exception as ex:
            row.append(f"fa4 err {str(ex)[:60]}")
    print("  ".join(row), flush=True)
