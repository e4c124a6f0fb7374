"""Tensor-core forward (kernels_cu/fwd_sm80.cu): tile table, support test, and launcher.

float16 / bfloat16 on sm_80 and newer, Dk == Dv in HEAD_DIMS. The kernel takes the generic
forward's arguments (DESIGN.md "Kernel ABI") in the same order, so the lead can fold this into
_config / _launch; until then `launch_fwd` and `forward(problem)` are self-contained.

Tile table (chosen by ptxas reports and H200 measurements, bf16, see tools/tc_fwd_check.py):
  BLOCK_M = 16 * MF * WARPS query rows per block, MF m-fragments (16 rows) per warp; BLOCK_N keys
  per tile; STAGES-deep cp.async ring for K and V; Q either re-read from shared memory by ldmatrix
  at every k-step (MF = 2 amortizes each K/V fragment over two row fragments) or held in registers
  (MF = 1: every warp reads every K/V fragment once per 16 rows).
What was tried (NVRTC 13.5 ptxas sm_90a registers / spill bytes; H200 bf16 TFLOP/s at N=16k
non-causal / causal from tools/tc_fwd_check.py --variants, torch SDPA flash 352 / 320 at D=128,
301 / 292 at D=64):
  D=128 128x32  4 warps MF=2 Q smem 2 stages  255 / 0   325 / 300   <- chosen (2 blocks per SM)
  D=128 128x32  4 warps MF=2 Q smem 3 stages  255 / 0   318 / 297
  D=128 128x64  4 warps MF=2 Q smem           255 / 48 spill (FA2's tile) -> rejected
  D=128 128x64  8 warps MF=1 Q regs 2-3 stg.  209 / 0   251-273 / 257-277 (1 block per SM)
  D=128  64x64  4 warps MF=1 Q regs           209 / 0   267 / 278
  D=64  128x64  4 warps MF=2 Q smem 2 stages  233 / 0   311 / 296   <- chosen
  D=64  128x64  4 warps MF=2 Q smem 3 stages  230 / 0   309 / 297
  D=64  128x32  4 warps MF=2 Q smem           182 / 0   264 / 257
  D=64   64x128 4 warps MF=1 Q regs           212 / 0   246 / 247
  D=64  128x128 4 warps MF=2 Q smem           255 / 56 spill -> rejected
  mask/bias (HAS_MB) adds ~25 registers, so those use 64-row (MF=1) tiles; D=256 64x64 spills
  there, hence 64x32.
MF = 1 tiles read every K/V fragment from shared memory once per 16 rows (256 B per mma) and lose
~15 % to MF = 2. The MF = 2 spills came from ptxas hoisting all V ldmatrix loads above the
softmax; fwd_sm80.cu gives the V addresses a data dependency on l, which removes them at BLOCK_N=32
(BLOCK_N=64 at D=128 still spills 48 bytes).
"""
import math
import os
import re
from collections import namedtuple

import numpy as np

_KERNEL_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "kernels_cu")

Tile = namedtuple("Tile", "block_m block_n warps stages q_in_regs min_blocks")

HEAD_DIMS = (32, 64, 96, 128, 192, 256)

# head dim -> tile, without mask/bias. Instantiations: 2 dtypes x 6 head dims x 2 (HAS_MB).
TILES = {
    32: Tile(128, 128, 4, 2, True, 2),
    64: Tile(128, 64, 4, 2, False, 2),
    96: Tile(128, 64, 8, 2, True, 1),
    128: Tile(128, 32, 4, 2, False, 2),
    192: Tile(64, 64, 4, 2, False, 1),
    256: Tile(64, 64, 4, 2, False, 1),
}
# With a boolean mask or a bias every tile runs the per-element path (more registers).
TILES_MB = {
    32: Tile(64, 64, 4, 2, True, 2),
    64: Tile(64, 64, 4, 2, True, 2),
    96: Tile(64, 64, 4, 2, True, 2),
    128: Tile(64, 64, 4, 2, True, 2),
    192: Tile(64, 64, 4, 2, False, 1),
    256: Tile(64, 32, 4, 2, False, 1),  # 64x64 spills 92 bytes with the mask code
}

_CTYPE = {"float16": "half_t", "bfloat16": "bf16_t"}
_MAX_LEN = 1 << 29  # the kernel's 32-bit predicate is exact below this (fwd_sm80.cu)


def _inline(path, seen):
    """The file with its local #include "x" replaced by the file (once each), for CuPy's cache key."""
    out = []
    with open(path) as f:
        for line in f:
            m = re.match(r'\s*#include\s+"([^"]+)"', line)
            if m:
                inc = os.path.join(os.path.dirname(path), m.group(1))
                if inc not in seen:
                    seen.add(inc)
                    out.append(_inline(inc, seen))
                continue
            if line.strip() == "#pragma once":
                continue
            out.append(line)
    return "".join(out)


def source():
    return _inline(os.path.join(_KERNEL_DIR, "fwd_sm80.cu"), set())


def smem_bytes(head_dim, tile):
    """Shared memory of one block: Q tile plus STAGES K and V tiles, rows padded by 8 elements."""
    return (tile.block_m + 2 * tile.stages * tile.block_n) * (head_dim + 8) * 2


def name_expression(dtype_name, head_dim, tile, has_mb):
    b = lambda x: "true" if x else "false"
    return (f"fwd_sm80<{_CTYPE[dtype_name]}, {head_dim}, {tile.block_m}, {tile.block_n}, "
            f"{tile.warps}, {tile.stages}, {b(tile.q_in_regs)}, {b(has_mb)}, {tile.min_blocks}>")


_cache = {}


def kernel(dtype_name, head_dim, has_mb, tile=None):
    """(RawKernel, tile, shared bytes) for this instantiation, compiled once per device."""
    import cupy

    tile = tile or (TILES_MB if has_mb else TILES)[head_dim]
    dev = cupy.cuda.Device().id
    key = (dev, dtype_name, head_dim, has_mb, tile)
    if key not in _cache:
        name = name_expression(dtype_name, head_dim, tile, has_mb)
        mod = cupy.RawModule(code=source(), options=("-std=c++17",), name_expressions=[name])
        fn = mod.get_function(name)
        smem = smem_bytes(head_dim, tile)
        if smem > 48 * 1024:
            fn.max_dynamic_shared_size_bytes = smem
        if os.environ.get("CUFLASH_DEBUG") == "1":
            print(f"[cuflash] {name}: {fn.num_regs} registers, {fn.local_size_bytes} local bytes, "
                  f"{smem} shared bytes")
        _cache[key] = (fn, tile, smem)
    return _cache[key]


def supports(p, device=None):
    """True when the Problem fits this path; otherwise the host takes the generic path."""
    import cupy

    if p.xp is not cupy or p.dtype.name not in _CTYPE:
        return False
    if p.Dk != p.Dv or p.Dk not in TILES:
        return False
    if not (p.scale > 0 and math.isfinite(p.scale)):
        return False  # the kernel folds the scale into exp2's FFMA and takes maxima of raw scores
    if max(p.Nq, p.Nk) > _MAX_LEN or p.Nq == 0 or p.Nk == 0:
        return False
    major = cupy.cuda.Device(device).compute_capability
    if int(major) < 80:
        return False
    from ._validate import element_strides
    for x, m in ((p.q, p.q_map), (p.k, p.k_map), (p.v, p.v_map)):
        st = element_strides(x)
        if st[-1] != 1 or st[-2] % 8 != 0 or x.data.ptr % 16 != 0:
            return False
        if np.any(np.asarray(m) % 8 != 0):
            return False
    return True


def launch_fwd(q, k, v, out, lse, *, offsets, mask, bias, kv_lens, q_rs, k_rs, v_rs, mask_rs,
               mask_cs, bias_rs, bias_cs, BH, Nq, Nk, Dk, Dv, scale, left, right, bottom_right,
               tile=None):
    """Launch on the current stream. Argument names and order mirror the generic launcher."""
    has_mb = mask is not None or bias is not None
    fn, tile, smem = kernel(np.dtype(q.dtype).name, Dk, has_mb, tile)
    n_mtiles = -(-Nq // tile.block_m)
    null = np.uint64(0)
    fn((n_mtiles * BH,), (tile.warps * 32,),
       (q, k, v, out, lse, offsets,
        mask if mask is not None else null, bias if bias is not None else null,
        kv_lens if kv_lens is not None else null,
        np.int64(q_rs), np.int64(k_rs), np.int64(v_rs), np.int64(mask_rs), np.int64(mask_cs),
        np.int64(bias_rs), np.int64(bias_cs), np.int32(BH), np.int32(Nq), np.int32(Nk),
        np.int32(Dk), np.int32(Dv), np.float32(scale), np.int32(left), np.int32(right),
        np.int32(bottom_right)),
       shared_mem=smem)


def forward(p, tile=None):
    """Forward of a validated Problem on this path: (out (BH, Nq, Dv), lse (BH, Nq) float32)."""
    from . import _gpu

    with p.q.device:
        args = _gpu._Args(p)
        out = _gpu._empty((p.BH, p.Nq, p.Dv), dtype=p.dtype)
        lse = _gpu._empty((p.BH, p.Nq), dtype=np.float32)
        launch_fwd(p.q, p.k, p.v, out, lse, tile=tile, **args.common(p))
        return out, lse
