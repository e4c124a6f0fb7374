"""The leaf of the host modules: dtypes, C types, head-dim buckets, device limits, constants and the
generic kernels' tiles. It imports nothing of cuflash; every other module may import it.

* dtype -> (C storage type, C accumulator type); the accumulator is float, double for float64;
* head-dim buckets: a generic or decode kernel is compiled for HEAD_DIM = the smallest bucket
  >= max(Dk, Dv);
* the generic kernels' tiles per (kernel, accumulator, bucket), passed to the kernels as template
  arguments (so this table is their single source). The tensor-core paths keep their tiles next to
  the rules that choose them (cuflash/_mma_fwd.py, _mma_bwd.py, _decode.py).

The number of generic instantiations is bounded on purpose: 4 dtypes x 4 buckets x 3 main kernels,
plus one preprocess kernel per dtype. Runtime options (causal, window, kv_lens, mask, bias,
alignment) are kernel arguments, not template parameters: in the generic path they only decide
which tiles are visited and a per-element test, never the inner loop.
"""
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

# The inputs of the tensor-core (mma.sync / wgmma) kernels.
MMA_DTYPES = ("float16", "bfloat16")
# The longest Nq or Nk of the tensor-core kernels: their 32-bit visibility arithmetic is exact below.
MMA_MAX_LEN = 1 << 29

# (kernel, accumulator C type) -> (BLOCK_M, BLOCK_N) per bucket 32, 64, 128, 256: BLOCK_M query
# rows, BLOCK_N key rows. Constraints of the generic layout: the kernel's "own" rows (queries in
# fwd/dq, keys in dkdv) are a multiple of 16 and the "lane" rows a multiple of 8. Sizes keep the
# register accumulators within budget (no spills up to HEAD_DIM 128; tests/test_build.py checks
# it) and the shared memory within SMEM_LIMIT_SM80 for double at HEAD_DIM 256.
_GENERIC_TILES = {
    ("fwd", "float"): ((32, 64), (32, 64), (32, 64), (32, 32)),
    ("fwd", "double"): ((32, 32), (32, 32), (16, 32), (16, 32)),
    ("bwd_dkdv", "float"): ((32, 32), (32, 32), (32, 32), (32, 16)),
    ("bwd_dkdv", "double"): ((32, 32), (32, 32), (16, 16), (16, 16)),
    ("bwd_dq", "float"): ((32, 64), (32, 64), (32, 32), (32, 16)),
    ("bwd_dq", "double"): ((32, 32), (32, 32), (16, 32), (16, 16)),
}
GENERIC_TILES = {(kernel, acc, bucket): tile for (kernel, acc), row in _GENERIC_TILES.items()
                 for bucket, tile in zip(HEAD_DIM_BUCKETS, row)}


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
C_SIZES = {"half_t": 2, "bf16_t": 2, "float": 4, "double": 8}  # bytes of each C type


def dtype_name(dtype):
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
    return _C_TYPES[dtype_name(dtype)]


def head_dim_bucket(Dk, Dv):
    """The smallest bucket >= max(Dk, Dv)."""
    d = max(int(Dk), int(Dv), 1)
    for b in HEAD_DIM_BUCKETS:
        if d <= b:
            return b
    raise ValueError(f"head dims must be at most {MAX_HEAD_DIM}, got Dk={Dk}, Dv={Dv}")
