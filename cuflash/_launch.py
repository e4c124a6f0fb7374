"""One launcher per kernel: grid, block, shared memory, and typed arguments in the C order.

CuPy does not check kernel arguments and turns a Python float into a C double, so every scalar is
passed as an explicit NumPy scalar of the C parameter's type, and absent arrays as a null pointer.
Launches go to the current CuPy stream; nothing here synchronizes. Callers (``_gpu.py``) pass
arrays that already satisfy DESIGN.md "Kernel ABI" (dtypes, contiguity, offsets); nothing is
checked again here.
"""
import numpy as np

from . import _config, _kernels

_NULL = np.uint64(0)  # a null device pointer (8 bytes, as CuPy passes array pointers)
_MAX_GRID_Y = 65535
_MAX_GRID_X = 2**31 - 1
_smem_set = {}  # id(kernel) -> largest max_dynamic_shared_size_bytes already set


def _ptr(a):
    return _NULL if a is None else a


def _bh_grid(tiles, BH):
    """(x, y, z): x = tile index, y * z >= BH (the kernels flatten bh = z * gridDim.y + y)."""
    y = min(BH, _MAX_GRID_Y)
    z = -(-BH // y)
    if tiles > _MAX_GRID_X or z > _MAX_GRID_Y:
        raise ValueError(f"problem too large for one launch: {tiles} tiles x {BH} batch*heads")
    return (tiles, y, z)


def _opt_in(kern, smem):
    """Raise the kernel's dynamic shared-memory limit when it needs more than 48 KiB."""
    if smem > _config.SMEM_DEFAULT_LIMIT and _smem_set.get(id(kern), 0) < smem:
        kern.max_dynamic_shared_size_bytes = smem
        _smem_set[id(kern)] = smem


def _prepare(kernel_name, dtype, bucket):
    """The compiled kernel, its (BLOCK_M, BLOCK_N) and its dynamic shared memory, opted in if > 48 KiB."""
    acc = _config.c_types(dtype)[1]
    kern = _kernels.get_kernel(kernel_name, dtype, bucket)
    smem = _config.smem_bytes(kernel_name, acc, bucket)
    _opt_in(kern, smem)
    return kern, _config.tiles(kernel_name, acc, bucket), smem


def _scale(dtype, scale):
    return np.float64(scale) if _config.c_types(dtype)[1] == "double" else np.float32(scale)


def _main_args(offsets, mask, bias, kv_lens, q_rs, k_rs, v_rs, mask_rs, mask_cs, bias_rs,
               bias_cs, BH, Nq, Nk, Dk, Dv, scale, left, right, bottom_right, dtype):
    """The arguments every main kernel takes after its own tensors, in the C order."""
    i64, i32 = np.int64, np.int32
    return (offsets, _ptr(mask), _ptr(bias), _ptr(kv_lens),
            i64(q_rs), i64(k_rs), i64(v_rs), i64(mask_rs), i64(mask_cs), i64(bias_rs),
            i64(bias_cs), i32(BH), i32(Nq), i32(Nk), i32(Dk), i32(Dv), _scale(dtype, scale),
            i32(left), i32(right), i32(bool(bottom_right)))


def launch_fwd(q, k, v, out, lse, offsets, mask, bias, kv_lens, q_rs, k_rs, v_rs, mask_rs,
               mask_cs, bias_rs, bias_cs, BH, Nq, Nk, Dk, Dv, scale, left, right, bottom_right):
    """fwd_generic: out (BH, Nq, Dv) of q.dtype and lse (BH, Nq) of the accumulator dtype."""
    if BH == 0 or Nq == 0:
        return
    bucket = _config.head_dim_bucket(Dk, Dv)
    kern, (bm, _), smem = _prepare("fwd", q.dtype, bucket)
    grid = _bh_grid(-(-Nq // bm), BH)
    args = (q, k, v, out, lse) + _main_args(
        offsets, mask, bias, kv_lens, q_rs, k_rs, v_rs, mask_rs, mask_cs, bias_rs, bias_cs,
        BH, Nq, Nk, Dk, Dv, scale, left, right, bottom_right, q.dtype)
    kern(grid, (_config.GENERIC_THREADS,), args, shared_mem=smem)


def launch_fwd_sm80(q, k, v, out, lse, offsets, mask, bias, kv_lens, q_rs, k_rs, v_rs, mask_rs,
                    mask_cs, bias_rs, bias_cs, BH, Nq, Nk, Dk, Dv, scale, left, right,
                    bottom_right):
    """fwd_sm80 (tensor cores): the generic forward's arguments; lse is float32."""
    if BH == 0 or Nq == 0:
        return
    has_mb = mask is not None or bias is not None
    tile = _config.sm80_tile(Dk, has_mb, _kernels.device_info().cc)
    kern = _kernels.get_function(_config.SOURCES["fwd_sm80"],
                                 _config.sm80_name_expression(q.dtype, Dk, has_mb, tile))
    smem = _config.sm80_smem_bytes(Dk, has_mb)
    _opt_in(kern, smem)
    # 1-D grid, bh-major: the query tiles of one head run together and share its K/V in L2
    blocks = -(-Nq // tile.block_m) * BH
    if blocks > _MAX_GRID_X:
        raise ValueError(f"problem too large for one launch: {blocks} blocks")
    import cupy

    fix = cupy.empty(blocks, dtype=np.int32)  # every entry written by fwd_sm80
    args = (q, k, v, out, lse) + _main_args(
        offsets, mask, bias, kv_lens, q_rs, k_rs, v_rs, mask_rs, mask_cs, bias_rs, bias_cs,
        BH, Nq, Nk, Dk, Dv, scale, left, right, bottom_right, q.dtype) + (fix,)
    kern((blocks,), (tile.warps * 32,), args, shared_mem=smem)
    # Rows the kernel cannot settle, flagged per block (kernels_cu/lost_rows.cu): without mask /
    # bias the ones whose huge logits the folded scale rounds too coarsely (lost lse); with them,
    # rows of l = 0, which may be all-masked (empty) or all -inf (NaN): written NaN.
    launch_fwd_lost(q, k, v, out, lse, offsets, mask, bias, kv_lens, q_rs, k_rs, v_rs, mask_rs,
                    mask_cs, bias_rs, bias_cs, BH, Nq, Nk, Dk, Dv, scale, left, right,
                    bottom_right, fix=fix, block_m=tile.block_m,
                    lost=np.inf if has_mb else None)


def launch_fwd_lost(q, k, v, out, lse, offsets, mask, bias, kv_lens, q_rs, k_rs, v_rs, mask_rs,
                    mask_cs, bias_rs, bias_cs, BH, Nq, Nk, Dk, Dv, scale, left, right,
                    bottom_right, fix, block_m, lost=None):
    """fwd_lost_rows: in the blocks of the tensor-core forward flagged in ``fix`` (its launch
    order), recompute in double out and lse of the rows whose lse came out NaN, +inf or lost
    (|lse| >= ``lost``, default cuflash._config.LOST_LSE); otherwise it only reads the flags."""
    fn = _kernels.get_function(_config.SOURCES["fwd_lost_rows"],
                               _config.fwd_lost_name_expression(q.dtype))
    per_block = _config.GENERIC_THREADS // 32
    blocks = min(-(-fix.size // (32 * per_block)), _kernels.device_info().sm_count)
    i64, i32 = np.int64, np.int32
    fn((blocks,), (_config.GENERIC_THREADS,),
       (q, k, v, out, lse, offsets, _ptr(mask), _ptr(bias), _ptr(kv_lens), i64(q_rs), i64(k_rs),
        i64(v_rs), i64(mask_rs), i64(mask_cs), i64(bias_rs), i64(bias_cs), i32(BH), i32(Nq),
        i32(Nk), i32(Dk), i32(Dv), np.float64(scale), i32(left), i32(right),
        i32(bool(bottom_right)),
        np.float64(_config.lost_lse_limit(lse.dtype) if lost is None else lost), fix,
        i32(block_m)))


def launch_bwd_preprocess(dout, out, lse, lse_eff, delta, rows, Dv):
    """bwd_preprocess: delta (rows,) = rowsum(dout * out) and lse_eff (rows,), the lse the main
    kernels use (+inf, with delta 0, on lost rows); dout, out contiguous (rows, Dv)."""
    if rows == 0:
        return
    kern = _kernels.get_kernel("bwd_preprocess", dout.dtype)
    rows_per_block = _config.GENERIC_THREADS // 32  # one warp per row
    blocks = min(-(-rows // rows_per_block), _MAX_GRID_X)  # the kernel loops beyond that
    lost = _scale(dout.dtype, _config.lost_lse_limit(delta.dtype))
    kern((blocks,), (_config.GENERIC_THREADS,),
         (dout, out, lse, lse_eff, delta, np.int64(rows), np.int32(Dv), lost))


def launch_bwd_dkdv(q, k, v, dout, lse, delta, dk_acc, dv_acc, offsets, mask, bias, kv_lens,
                    q_rs, k_rs, v_rs, mask_rs, mask_cs, bias_rs, bias_cs, BH, Nq, Nk, Dk, Dv,
                    scale, left, right, bottom_right):
    """bwd_dkdv: dk_acc (BH, Nk, Dk) and dv_acc (BH, Nk, Dv) in the accumulator dtype, every element."""
    if BH == 0 or Nk == 0:
        return
    bucket = _config.head_dim_bucket(Dk, Dv)
    kern, (_, bn), smem = _prepare("bwd_dkdv", q.dtype, bucket)
    grid = _bh_grid(-(-Nk // bn), BH)
    args = (q, k, v, dout, lse, delta, dk_acc, dv_acc) + _main_args(
        offsets, mask, bias, kv_lens, q_rs, k_rs, v_rs, mask_rs, mask_cs, bias_rs, bias_cs,
        BH, Nq, Nk, Dk, Dv, scale, left, right, bottom_right, q.dtype)
    kern(grid, (_config.GENERIC_THREADS,), args, shared_mem=smem)


def launch_bwd_dq(q, k, v, dout, lse, delta, dq_acc, offsets, mask, bias, kv_lens, q_rs, k_rs,
                  v_rs, mask_rs, mask_cs, bias_rs, bias_cs, BH, Nq, Nk, Dk, Dv, scale, left,
                  right, bottom_right):
    """bwd_dq: dq_acc (BH, Nq, Dk) in the accumulator dtype, every element."""
    if BH == 0 or Nq == 0:
        return
    bucket = _config.head_dim_bucket(Dk, Dv)
    kern, (bm, _), smem = _prepare("bwd_dq", q.dtype, bucket)
    grid = _bh_grid(-(-Nq // bm), BH)
    args = (q, k, v, dout, lse, delta, dq_acc) + _main_args(
        offsets, mask, bias, kv_lens, q_rs, k_rs, v_rs, mask_rs, mask_cs, bias_rs, bias_cs,
        BH, Nq, Nk, Dk, Dv, scale, left, right, bottom_right, q.dtype)
    kern(grid, (_config.GENERIC_THREADS,), args, shared_mem=smem)


# kernels_cu/lost_rows.cu: rows per flag; rows a warp checks, keys of a warp's item
LOST_CHUNK, LOST_SEG = 32, 128


def launch_lost(q, k, v, dout, out, lse, dq, dk, dv, offsets, mask, bias, kv_lens, q_rs, k_rs,
                v_rs, mask_rs, mask_cs, bias_rs, bias_cs, BH, Nq, Nk, Dk, Dv, scale, left, right,
                bottom_right, flags=None, **_):
    """kernels_cu/lost_rows.cu: add the exact gradients of the lost rows (_config.LOST_LSE) to dq,
    dk, dv, which the main backward kernels wrote without them. dout, out contiguous
    (BH, Nq, Dv); lse contiguous (BH, Nq) in the accumulator dtype; dq (BH, Nq, Dk) in it too;
    dk, dv (BH, Nk, D) in the inputs' or the accumulator dtype. ``flags`` (BH, ceil(Nq / 32)):
    the lost-row flags, if the preprocess wrote them (else made here from lse). Two small
    launches that only read flags (and lse) when no row is lost."""
    import cupy

    if BH == 0 or Nq == 0 or Nk == 0:
        return
    rows_expr, keys_expr = _config.lost_name_expressions(q.dtype, dk.dtype == q.dtype)
    source = _config.SOURCES["bwd_lost_rows"]
    stats = cupy.empty((BH, Nq, 3), dtype=np.float64)
    prewritten = flags is not None  # by the tensor-core preprocess; else written from lse here
    if flags is None:
        flags = cupy.empty((BH, -(-Nq // LOST_CHUNK)), dtype=np.int32)
    i64, i32 = np.int64, np.int32
    lost = _config.lost_lse_limit(lse.dtype)
    args = (q, k, v, dout, out, lse, offsets, _ptr(mask), _ptr(bias), _ptr(kv_lens),
            i64(q_rs), i64(k_rs), i64(v_rs), i64(mask_rs), i64(mask_cs), i64(bias_rs),
            i64(bias_cs), i32(BH), i32(Nq), i32(Nk), i32(Dk), i32(Dv), np.float64(scale),
            i32(left), i32(right), i32(bool(bottom_right)), np.float64(lost), stats, flags)
    threads = (_config.GENERIC_THREADS,)
    warps = _config.GENERIC_THREADS // 32
    cap = 4 * _kernels.device_info().sm_count  # grid-stride beyond: a few flags per warp
    row_blocks = min(-(-BH * -(-Nq // LOST_SEG) // warps), cap)
    key_blocks = min(-(-BH * -(-Nk // LOST_SEG) // warps), cap)
    _kernels.get_function(source, rows_expr)((row_blocks,), threads,
                                             args + (dq, i32(prewritten)))
    _kernels.get_function(source, keys_expr)((key_blocks,), threads, args + (dk, dv))
