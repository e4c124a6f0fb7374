"""The one config table: dtypes, head-dim buckets, tile sizes, kernel instantiations.

Everything the host needs to name, size and launch a kernel lives here, and nowhere else:

* dtype -> (C storage type, C accumulator type); the accumulator is float, double for float64;
* head-dim buckets: a kernel is compiled for HEAD_DIM = the smallest bucket >= max(Dk, Dv);
* tile sizes per (path, kernel, accumulator, bucket), passed to the kernels as template arguments
  (so this table is their single source), and the shared-memory size each layout needs.

The number of instantiations is bounded on purpose: 4 dtypes x 4 buckets x 3 main kernels, plus
one preprocess kernel per dtype (52 generic), plus 24 tensor-core forwards (below). Runtime options (causal,
window, kv_lens, mask, bias, alignment) are kernel arguments, not template parameters: in the
generic path they only decide which tiles are visited and a per-element test, never the inner loop.
"""
from collections import namedtuple

import numpy as np

MAX_HEAD_DIM = 256
HEAD_DIM_BUCKETS = (32, 64, 128, 256)

# Threads per block of every generic kernel: 16 row groups of 8 lanes (kernels_cu/common.cuh
# NUM_THREADS; the kernels are written for exactly this layout).
GENERIC_THREADS = 128

# The largest dynamic shared memory a block may ask for on sm_80 (the smallest opt-in of the
# supported architectures that matter; sm_90 allows 227 KiB). Every generic layout fits in it.
SMEM_LIMIT_SM80 = 163 * 1024
SMEM_DEFAULT_LIMIT = 48 * 1024

# Source file of each kernel family, in kernels_cu/.
SOURCES = {
    "fwd": "fwd_generic.cu",
    "bwd_preprocess": "bwd_generic.cu",
    "bwd_dkdv": "bwd_generic.cu",
    "bwd_dq": "bwd_generic.cu",
    "bwd_lost_rows": "lost_rows.cu",
    "bwd_lost_keys": "lost_rows.cu",
    "fwd_lost_rows": "lost_rows.cu",
}
_KERNEL_NAMES = {
    "fwd": "fwd_generic",
    "bwd_preprocess": "bwd_preprocess",
    "bwd_dkdv": "bwd_dkdv",
    "bwd_dq": "bwd_dq",
    "bwd_lost_rows": "bwd_lost_rows",
    "bwd_lost_keys": "bwd_lost_keys",
    "fwd_lost_rows": "fwd_lost_rows",
}
# Kernels that have a head-dim bucket and tiles (the preprocess kernel has neither).
TILED_KERNELS = ("fwd", "bwd_dkdv", "bwd_dq")

# (path, kernel, acc C type, bucket) -> (BLOCK_M, BLOCK_N): BLOCK_M query rows, BLOCK_N key rows.
# Constraints of the generic layout: the kernel's "own" rows (queries in fwd/dq, keys in dkdv) are
# a multiple of 16 and the "lane" rows a multiple of 8. Sizes keep the register accumulators within
# budget (no spills up to HEAD_DIM 128; tests/test_build.py checks it) and the shared memory within
# SMEM_LIMIT_SM80 for double at HEAD_DIM 256.
TILES = {}
for _bucket, _f, _d in (
    (32, (32, 64), (32, 32)),
    (64, (32, 64), (32, 32)),
    (128, (32, 64), (16, 32)),
    (256, (32, 32), (16, 32)),
):
    TILES[("generic", "fwd", "float", _bucket)] = _f
    TILES[("generic", "fwd", "double", _bucket)] = _d
for _bucket, _f, _d in (
    (32, (32, 32), (32, 32)),
    (64, (32, 32), (32, 32)),
    (128, (32, 32), (16, 16)),
    (256, (32, 16), (16, 16)),
):
    TILES[("generic", "bwd_dkdv", "float", _bucket)] = _f
    TILES[("generic", "bwd_dkdv", "double", _bucket)] = _d
for _bucket, _f, _d in (
    (32, (32, 64), (32, 32)),
    (64, (32, 64), (32, 32)),
    (128, (32, 32), (16, 32)),
    (256, (32, 16), (16, 16)),
):
    TILES[("generic", "bwd_dq", "float", _bucket)] = _f
    TILES[("generic", "bwd_dq", "double", _bucket)] = _d
del _bucket, _f, _d


# ---- tensor-core forward (kernels_cu/fwd_sm80.cu): float16 / bfloat16, sm_80+, Dk == Dv --------
#
# Sm80Tile: BLOCK_M = 16 * MF * warps query rows per block (MF m-fragments of 16 rows per warp:
# 2 when Q is re-read from shared memory by ldmatrix, 1 when Q sits in registers), BLOCK_N keys per
# tile, a STAGES-deep cp.async ring for K and V, and the __launch_bounds__ minimum blocks per SM.
# Chosen by ptxas reports and H200 measurements (bf16, tools/tc_fwd_check.py --variants; TFLOP/s
# at N=16k non-causal / causal; torch SDPA flash 352 / 320 at D=128, 301 / 292 at D=64):
#   D=128 128x32  4 warps Q smem 2 stages  255 regs / 0 spill  325 / 300   (first choice)
#   D=128 128x32  4 warps Q smem 3 stages  255 / 0             318 / 297
#   D=128 128x64  4 warps Q smem           255 / 48 spill (FA2's tile)     rejected at first;
#     spill-free (NVRTC 13.0, 255 regs) once the masking branch recomputes its row bounds:
#     tools/tc_fwd_check.py --variants, H200 2026-11-29, TFLOP/s (ratio to SDPA flash, same run):
#     N=1k 312 (0.95) / 242 (0.99), 4k 336 (0.97) / 293 (0.98), 16k 345 (0.99) / 317 (1.01)
#     vs 128x32: 286 (0.87) / 224 (0.91), 303 (0.88) / 272 (0.90), 316 (0.91) / 290 (0.93)
#                                                                          <- chosen
#   D=128 128x64 as 2x32-key steps, skip-rescale / lagged max: 0.83-0.94 (slower than 128x64)
#   D=128 128x64  8 warps Q regs 2-3 stg.  209 / 0             251-273 / 257-277 (1 block/SM)
#   D=128  64x64  4 warps Q regs           209 / 0             267 / 278
#   D=64  128x64  4 warps Q smem 2 stages  233 / 0             311 / 296   <- chosen
#     (re-measured 2026-11-29: 0.99-1.04 of flash at N=1k-16k; skip-rescale and 128x128 as
#     2x64-key steps were 0.88-0.97)
#   D=64  128x64  4 warps Q smem 3 stages  230 / 0             309 / 297
#   D=64  128x32  4 warps Q smem           182 / 0             264 / 257
#   D=64   64x128 4 warps Q regs           212 / 0             246 / 247
#   D=64  128x128 4 warps Q smem           255 / 56 spill                  rejected
# A boolean mask or a bias (HAS_MB) adds ~25 registers: those use 64-row tiles (D=256: 64x32,
# 64x64 spills). D=32/96/192/256 were chosen from register and shared-memory counts, not timed yet.
# Instantiations: 2 dtypes x 6 head dims x (with, without mask/bias) = 24.
# ksplit: the key tile runs as ksplit softmax steps of block_n / ksplit keys (registers at the
# step's level, one barrier per tile); rescale: 0 always rescales acc, 1 skips it when no row of
# the warp raised its max (same results), 2 lets a row's max lag by up to 2^8 (fwd_sm80.cu).
# opt: candidate variant bits (kernels_cu/fwd_sm80.cu OPT_*; 0 in the table): 1 incremental K/V
# copy addresses, 2 the next tile's copies issued after S = Q K^T, 4 K and V in separate cp.async
# groups (wait for K before Q K^T, for V after it). Passed as the kernel's last template argument
# RESCALE_OPT = rescale | opt << 2, so the table's kernels keep their names and code.
Sm80Tile = namedtuple("Sm80Tile",
                      "block_m block_n warps stages q_in_regs min_blocks ksplit rescale opt",
                      defaults=(1, 0, 0))
SM80_OPT_CHEAP_ADDR, SM80_OPT_LATE_ISSUE, SM80_OPT_KV_SPLIT = 1, 2, 4
SM80_DTYPES = ("float16", "bfloat16")
SM80_HEAD_DIMS = (32, 64, 96, 128, 192, 256)
# Variant bits, H200 2026-11-29 (tools/tc_fwd_check.py --variants, bf16, ratio to SDPA flash in
# the same run at N = 1k / 4k / 16k, non-causal | causal; the plain tile first):
#   D=128 128x64 plain 0.95 0.99 0.96 | 0.98 0.98 1.01;  S (4) 1.01 1.04 1.00 | 1.02 1.04 1.05;
#         A (1) 1.04 1.03 1.01 | 1.05 1.08 1.06;  A+S (5) 1.05 1.04 1.03 | 1.05 1.09 1.07 (A spills
#         4-8 bytes on sm_80: A+S is the sm_90+ tile, SM90_TILES; S on sm_80);  128x32 3 stages with
#         A: 0.93-0.99; 8 warps with Q in registers: 0.75-0.94.
#   D=64  128x64 plain 0.99 1.02 1.02 | 1.03 0.99 1.02;  A (1) 1.04 1.06 1.04 | 1.04 1.04 1.05;
#         A+L (3) 1.02 1.06 1.05 | 1.07 1.05 1.06;  S alone 0.95-1.00.
SM80_TILES = {
    # (head dim, has mask or bias) -> tile
    (32, False): Sm80Tile(128, 128, 4, 2, True, 2),
    (64, False): Sm80Tile(128, 64, 4, 2, False, 2, 1, 0, SM80_OPT_CHEAP_ADDR),
    (96, False): Sm80Tile(128, 64, 8, 2, True, 1),
    (128, False): Sm80Tile(128, 64, 4, 2, False, 2, 1, 0, SM80_OPT_KV_SPLIT),
    (192, False): Sm80Tile(64, 64, 4, 2, False, 1),
    (256, False): Sm80Tile(64, 64, 4, 2, False, 1),
    (32, True): Sm80Tile(64, 64, 4, 2, True, 2),
    (64, True): Sm80Tile(64, 64, 4, 2, True, 2),
    (96, True): Sm80Tile(64, 64, 4, 2, True, 2),
    (128, True): Sm80Tile(64, 64, 4, 2, True, 2),
    (192, True): Sm80Tile(64, 64, 4, 2, False, 1),
    (256, True): Sm80Tile(64, 32, 4, 2, False, 1),
}
SOURCES["fwd_sm80"] = "fwd_sm80.cu"
_KERNEL_NAMES["fwd_sm80"] = "fwd_sm80"
# The tensor-core backward kernels; their tiles are in cuflash/_tc_bwd.py.
for _k in ("bwd_sm80_prep", "bwd_sm80_dkdv", "bwd_sm80_dkdv_x", "bwd_sm80_dkdv_g",
           "bwd_sm80_dq"):
    SOURCES[_k] = "bwd_sm80.cu"
    _KERNEL_NAMES[_k] = _k
del _k
# The split-KV decode kernels; their tables (rows per block, split rule) are in cuflash/_decode.py.
SOURCES["decode_split"] = SOURCES["decode_combine"] = SOURCES["decode_tc"] = "decode.cu"
_KERNEL_NAMES["decode_split"] = "decode_split"
_KERNEL_NAMES["decode_combine"] = "decode_combine"
_KERNEL_NAMES["decode_tc"] = "decode_tc"


# sm_90+ (compiled for the device's architecture) where ptxas fits a faster variant spill-free only
# there; every other key uses SM80_TILES.
SM90_TILES = {
    (128, False): Sm80Tile(128, 64, 4, 2, False, 2, 1, 0,
                           SM80_OPT_CHEAP_ADDR | SM80_OPT_KV_SPLIT),
}


def sm80_tile(head_dim, has_mb, cc=80):
    """The forward tile for a device of compute capability `cc` (an int, e.g. 90)."""
    if cc >= 90 and (head_dim, has_mb) in SM90_TILES:
        return SM90_TILES[(head_dim, has_mb)]
    return SM80_TILES[(head_dim, has_mb)]


def sm80_smem_bytes(head_dim, has_mb, tile=None):
    """Q tile plus STAGES K and V tiles of 16-bit elements, rows padded by 8 elements.
    `tile` (an Sm80Tile) overrides the table's choice (tools/tc_fwd_check.py times candidates)."""
    t = SM80_TILES[(head_dim, has_mb)] if tile is None else tile
    return (t.block_m + 2 * t.stages * t.block_n) * (head_dim + 8) * 2


def sm80_name_expression(dtype, head_dim, has_mb, tile=None):
    t = SM80_TILES[(head_dim, has_mb)] if tile is None else tile
    b = lambda x: "true" if x else "false"  # noqa: E731
    return (f"fwd_sm80<{c_types(dtype)[0]}, {head_dim}, {t.block_m}, {t.block_n}, {t.warps}, "
            f"{t.stages}, {b(t.q_in_regs)}, {b(has_mb)}, {t.min_blocks}, {t.ksplit}, "
            f"{t.rescale | (t.opt << 2)}>")


def _bfloat16():
    try:
        import ml_dtypes
    except ImportError:  # bfloat16 is then simply unavailable
        return None
    return np.dtype(ml_dtypes.bfloat16)


def supported_dtype_names():
    return ("float16", "bfloat16", "float32", "float64")


def accumulator_dtype(dtype):
    """float64 inputs accumulate in float64, every other dtype in float32."""
    return np.dtype(np.float64) if np.dtype(dtype) == np.float64 else np.dtype(np.float32)


# A row whose |lse| is at least this (in the accumulator dtype) cannot carry log(l) in its lse:
# lse = m + log(l) rounds to within ulp(lse) / 2 of m, so P = exp(s - lse) would be off by up to
# that much in the exponent (by the factor l itself once log(l) is lost entirely, e.g. a row
# padded with an additive finfo.min bias). The backward recomputes such "lost" rows exactly
# (their max and sum in float64) instead of trusting their lse. Below the limit the error of
# exp(s - lse) is at most ulp(lse) / 2, no larger than the rounding of the logits themselves.
LOST_LSE = {"float32": 2.0 ** 12, "float64": 2.0 ** 24}


def lost_lse_limit(acc_dtype):
    return LOST_LSE[np.dtype(acc_dtype).name]


# dtype name -> (storage C type, accumulator C type); the C types are defined in common.cuh.
_C_TYPES = {
    "float16": ("half_t", "float"),
    "bfloat16": ("bf16_t", "float"),
    "float32": ("float", "float"),
    "float64": ("double", "double"),
}
_C_SIZES = {"float": 4, "double": 8}


def _dtype_name(dtype):
    if isinstance(dtype, str) and dtype in _C_TYPES:
        return dtype
    dt = np.dtype(dtype)
    bf16 = _bfloat16()
    if bf16 is not None and dt == bf16:
        return "bfloat16"
    if dt.name in _C_TYPES and dt.name != "bfloat16":
        return dt.name
    raise TypeError(f"no kernel for dtype {dt}; supported: {', '.join(supported_dtype_names())}")


def c_types(dtype):
    """(storage C type, accumulator C type) of a supported dtype (or dtype name)."""
    return _C_TYPES[_dtype_name(dtype)]


def head_dim_bucket(Dk, Dv):
    """The smallest bucket >= max(Dk, Dv)."""
    d = max(int(Dk), int(Dv), 1)
    for b in HEAD_DIM_BUCKETS:
        if d <= b:
            return b
    raise ValueError(f"head dims must be at most {MAX_HEAD_DIM}, got Dk={Dk}, Dv={Dv}")


def tiles(kernel, acc_ctype, bucket, path="generic"):
    """(BLOCK_M, BLOCK_N) of a tiled kernel."""
    return TILES[(path, kernel, acc_ctype, bucket)]


def smem_bytes(kernel, acc_ctype, bucket, path="generic"):
    """Dynamic shared memory of one block; mirrors the layout comment at the top of each kernel."""
    if kernel == "bwd_preprocess":
        return 0
    bm, bn = tiles(kernel, acc_ctype, bucket, path)
    ld = bucket + 1
    if kernel == "fwd":  # Q [BM][LD], K|V [BN][LD], P [BM][BN+1]
        n = bm * ld + bn * ld + bm * (bn + 1)
    elif kernel == "bwd_dkdv":  # K, V [BN][LD], Q, dO [BM][LD], P^T, dS^T [BN][BM+1], lse, delta [BM]
        n = 2 * bn * ld + 2 * bm * ld + 2 * bn * (bm + 1) + 2 * bm
    elif kernel == "bwd_dq":  # Q, dO [BM][LD], K, V [BN][LD], dS [BM][BN+1]
        n = 2 * bm * ld + 2 * bn * ld + bm * (bn + 1)
    else:
        raise KeyError(kernel)
    return n * _C_SIZES[acc_ctype]


def name_expression(kernel, dtype, bucket=None, path="generic"):
    """The C++ name expression of one instantiation, e.g. 'fwd_generic<half_t, float, 128, 32, 64>'."""
    t, acc = c_types(dtype)
    name = _KERNEL_NAMES[kernel]
    if kernel == "bwd_preprocess":
        return f"{name}<{t}, {acc}>"
    bm, bn = tiles(kernel, acc, bucket, path)
    return f"{name}<{t}, {acc}, {bucket}, {bm}, {bn}>"


def lost_name_expressions(dtype, dk_is_input_dtype):
    """The two kernels of bwd_lost.cu for inputs of ``dtype`` whose dk / dv buffers hold the
    inputs' dtype (else the accumulator's)."""
    t, acc = c_types(dtype)
    return f"bwd_lost_rows<{t}, {acc}>", f"bwd_lost_keys<{t}, {acc}, {t if dk_is_input_dtype else acc}>"


def fwd_lost_name_expression(dtype):
    t, acc = c_types(dtype)
    return f"fwd_lost_rows<{t}, {acc}>"


def all_instantiations():
    """Every (kernel, dtype name, bucket or None, source file, name expression) the package can request."""
    out = []
    for dt in supported_dtype_names():
        rows, keys = lost_name_expressions(dt, False)
        out.append(("bwd_lost_rows", dt, None, SOURCES["bwd_lost_rows"], rows))
        out.append(("bwd_lost_keys", dt, None, SOURCES["bwd_lost_keys"], keys))
        if dt in SM80_DTYPES:  # the tensor-core backward writes dk, dv in the inputs' dtype;
            out.append(("bwd_lost_keys", dt, None, SOURCES["bwd_lost_keys"],  # its forward's fix
                        lost_name_expressions(dt, True)[1]))
            out.append(("fwd_lost_rows", dt, None, SOURCES["fwd_lost_rows"],
                        fwd_lost_name_expression(dt)))
    for dt in supported_dtype_names():
        for kernel in TILED_KERNELS:
            for b in HEAD_DIM_BUCKETS:
                out.append((kernel, dt, b, SOURCES[kernel], name_expression(kernel, dt, b)))
        out.append(("bwd_preprocess", dt, None, SOURCES["bwd_preprocess"],
                    name_expression("bwd_preprocess", dt)))
    for dt in SM80_DTYPES:
        for (head_dim, has_mb) in SM80_TILES:
            out.append(("fwd_sm80", dt, head_dim, SOURCES["fwd_sm80"],
                        sm80_name_expression(dt, head_dim, has_mb)))
        for (head_dim, has_mb), tile in SM90_TILES.items():
            out.append(("fwd_sm80", dt, head_dim, SOURCES["fwd_sm80"],
                        sm80_name_expression(dt, head_dim, has_mb, tile)))
    from . import _decode, _tc_bwd  # their tile rules live with their schedulers
    for expr in _tc_bwd.all_instantiations():
        kernel = expr.split("<", 1)[0]
        head_dim = int(expr.split(",")[1].strip(" >"))
        out.append((kernel, _dtype_of_ctype(expr), head_dim, SOURCES[kernel], expr))
    return out + _decode.instantiations()


def sm90_only_instantiations():
    """Name expressions the package requests only on sm_90+ devices (checked for spills there)."""
    from . import _tc_bwd
    out = {sm80_name_expression(dt, d, mb, t) for dt in SM80_DTYPES
           for (d, mb), t in SM90_TILES.items()}
    return out | set(_tc_bwd.sm90_only_instantiations())


def _dtype_of_ctype(expr):
    ctype = expr.split("<", 1)[1].split(",")[0].strip()
    return {c: name for name, (c, _) in _C_TYPES.items()}[ctype]
