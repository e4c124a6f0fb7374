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
# FwdTile: block_m = 16 * MF * warps query rows per block (MF m-fragments of 16 rows per warp: 2
# when Q is re-read from shared memory by ldmatrix, 1 when Q sits in registers), block_n keys per
# tile, a `stages`-deep cp.async ring for K and V, the __launch_bounds__ minimum blocks per SM, and
# two copy choices (fwd_sm80.cu): cheap_addr (incremental K/V addresses), kv_split (K and V in
# separate cp.async groups). Chosen from ptxas reports and H200 timings (benchmarks/RESULTS.md
# "Forward tile choices"); a mask or bias (HAS_MB) adds ~25 registers, hence 64-row tiles there.
FwdTile = namedtuple("FwdTile", "block_m block_n warps stages q_in_regs min_blocks cheap_addr kv_split",
                     defaults=(False, False))
SM80_DTYPES = ("float16", "bfloat16")
SM80_HEAD_DIMS = (32, 64, 96, 128, 192, 256)
_T = FwdTile
SM80_TILES = {
    # (head dim, has mask or bias) -> tile
    (32, False): _T(128, 128, warps=4, stages=2, q_in_regs=True, min_blocks=2),
    (64, False): _T(128, 64, warps=4, stages=2, q_in_regs=False, min_blocks=2, cheap_addr=True),
    (96, False): _T(128, 64, warps=8, stages=2, q_in_regs=True, min_blocks=1),
    (128, False): _T(128, 64, warps=4, stages=2, q_in_regs=False, min_blocks=2, kv_split=True),
    (192, False): _T(64, 64, warps=4, stages=2, q_in_regs=False, min_blocks=1),
    (256, False): _T(64, 64, warps=4, stages=2, q_in_regs=False, min_blocks=1),
    (32, True): _T(64, 64, warps=4, stages=2, q_in_regs=True, min_blocks=2),
    (64, True): _T(64, 64, warps=4, stages=2, q_in_regs=True, min_blocks=2),
    (96, True): _T(64, 64, warps=4, stages=2, q_in_regs=True, min_blocks=2),
    (128, True): _T(64, 64, warps=4, stages=2, q_in_regs=True, min_blocks=2),
    (192, True): _T(64, 64, warps=4, stages=2, q_in_regs=False, min_blocks=1),
    (256, True): _T(64, 32, warps=4, stages=2, q_in_regs=False, min_blocks=1),
}
# sm_90+ only: cheap_addr and kv_split together spill 4-8 bytes on sm_80 but not on sm_90a.
SM90_TILES = {
    (128, False): SM80_TILES[(128, False)]._replace(cheap_addr=True),
}
del _T
SOURCES["fwd_sm80"] = "fwd_sm80.cu"
_KERNEL_NAMES["fwd_sm80"] = "fwd_sm80"
# The tensor-core backward kernels; their tiles are in cuflash/_tc_bwd.py.
for _k in ("bwd_sm80_prep", "bwd_sm80_dkdv", "bwd_sm80_dkdv_g", "bwd_sm80_dq"):
    SOURCES[_k] = "bwd_sm80.cu"
    _KERNEL_NAMES[_k] = _k
del _k
# The split-KV decode kernels; their tables (rows per block, decode_tc's tile) are in
# cuflash/_decode.py.
SOURCES["decode_split"] = SOURCES["decode_tc"] = "decode.cu"
_KERNEL_NAMES["decode_split"] = "decode_split"
_KERNEL_NAMES["decode_tc"] = "decode_tc"


def sm80_tile(head_dim, has_mb, cc=80):
    """The forward tile for a device of compute capability `cc` (an int, e.g. 90)."""
    if cc >= 90 and (head_dim, has_mb) in SM90_TILES:
        return SM90_TILES[(head_dim, has_mb)]
    return SM80_TILES[(head_dim, has_mb)]


def sm80_smem_bytes(head_dim, has_mb):
    """Q tile plus STAGES K and V tiles of 16-bit elements, rows padded by 8 elements."""
    t = SM80_TILES[(head_dim, has_mb)]  # (SM90_TILES keep the block shape and stages)
    return (t.block_m + 2 * t.stages * t.block_n) * (head_dim + 8) * 2


def sm80_name_expression(dtype, head_dim, has_mb, tile=None):
    t = SM80_TILES[(head_dim, has_mb)] if tile is None else tile
    b = lambda x: "true" if x else "false"  # noqa: E731
    return (f"fwd_sm80<{c_types(dtype)[0]}, {head_dim}, {t.block_m}, {t.block_n}, {t.warps}, "
            f"{t.stages}, {b(t.q_in_regs)}, {b(has_mb)}, {t.min_blocks}, {b(t.cheap_addr)}, "
            f"{b(t.kv_split)}>")


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
    return {sm80_name_expression(dt, d, mb, t) for dt in SM80_DTYPES
            for (d, mb), t in SM90_TILES.items()}


def _dtype_of_ctype(expr):
    ctype = expr.split("<", 1)[1].split(",")[0].strip()
    return {c: name for name, (c, _) in _C_TYPES.items()}[ctype]
