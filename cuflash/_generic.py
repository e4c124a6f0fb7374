"""The generic path (kernels_cu/fwd_generic.cu, bwd_generic.cu): every Problem, every dtype, on CUDA
cores; and the launches of the lost-row kernels (kernels_cu/lost_rows.cu), which the tensor-core
paths call too.

Path interface (cuflash/_gpu.py): NAME, takes / forward, takes_backward / backward, instantiations.
Callers pass Problems with BH, Nq, Nk > 0 (cuflash/api.py answers the empty ones) whose arrays
satisfy DESIGN.md "Kernel ABI"; nothing is checked again here. Scalars go to the kernels as NumPy
scalars of the C parameter's type (cuflash._runtime.Args: `flat_tail` for the generic kernels,
`tail`, with the AttnArgs struct, for the lost-row kernels).
"""
import numpy as np

from . import _broadcast, _config, _memo, _modifiers, _runtime, _validate

NAME = "generic"
TRANSFORMS = _modifiers.CHAINS  # the chains of score transforms its kernels take (cuflash/_gpu.py)
DROPOUT = True  # whether its kernels take dropout (cuflash/_gpu.py skips the paths that do not)
SINKS = False  # whether its forward kernels join the sinks themselves (else cuflash/_gpu.py does)
DBIAS = _modifiers.CHAINS  # the chains whose backward stores the bias's gradient (p.dbias)
FWD_SOURCE, BWD_SOURCE, LOST_SOURCE = "fwd_generic.cu", "bwd_generic.cu", "lost_rows.cu"
# kernel -> (source file, kernel name)
KERNELS = {"fwd": (FWD_SOURCE, "fwd_generic"), "bwd_preprocess": (BWD_SOURCE, "bwd_preprocess"),
           "bwd_dkdv": (BWD_SOURCE, "bwd_dkdv"), "bwd_dq": (BWD_SOURCE, "bwd_dq")}
# Kernels that have a head-dim bucket and tiles (the preprocess kernel has neither).
TILED_KERNELS = ("fwd", "bwd_dkdv", "bwd_dq")
# kernels_cu/lost_rows.cu: rows per flag; rows a warp checks, keys of a warp's item
LOST_CHUNK, LOST_SEG = 32, 128


def smem_bytes(kernel, acc_ctype, bucket):
    """Dynamic shared memory of one block; mirrors the layout comment at the top of each kernel."""
    if kernel == "bwd_preprocess":
        return 0
    bm, bn = _config.GENERIC_TILES[(kernel, acc_ctype, bucket)]
    ld = bucket + 1
    if kernel == "fwd":  # Q [BM][LD], K|V [BN][LD], P [BM][BN+1]
        n = bm * ld + bn * ld + bm * (bn + 1)
    elif kernel == "bwd_dkdv":  # K, V [BN][LD], Q, dO [BM][LD], P^T, dS^T [BN][BM+1], lse, delta [BM]
        n = 2 * bn * ld + 2 * bm * ld + 2 * bn * (bm + 1) + 2 * bm
    elif kernel == "bwd_dq":  # Q, dO [BM][LD], K, V [BN][LD], dS [BM][BN+1]
        n = 2 * bm * ld + 2 * bn * ld + bm * (bn + 1)
    else:
        raise KeyError(kernel)
    return n * _config.C_SIZES[acc_ctype]


def name_expression(kernel, dtype, bucket=None, transforms=(), dbias=False, dropout=False):
    """The C++ name expression of one instantiation, e.g. 'fwd_generic<half_t, float, 128, 32, 64>'
    (the score transforms in natural units: a template argument when there are any; bwd_dq
    with dbias: the DBIAS twin, `true` after the transforms or NoTransform (`false` there with
    dropout alone); with dropout, then `DropoutArgs`: kernels_cu/philox.cuh)."""
    t, acc = _config.c_types(dtype)
    name = KERNELS[kernel][1]
    if kernel == "bwd_preprocess":
        return f"{name}<{t}, {acc}>"
    bm, bn = _config.GENERIC_TILES[(kernel, acc, bucket)]
    f = _transform_arg(transforms, acc, _config.dtype_name(dtype))
    if kernel == "bwd_dq" and (dbias or dropout):
        f = f"{f or ', NoTransform'}, {'true' if dbias else 'false'}"
    if dropout:
        f = f"{f or ', NoTransform'}, DropoutArgs"
    return f"{name}<{t}, {acc}, {bucket}, {bm}, {bn}{f}>"


def lost_transform(transforms):
    """The lost-row code's transform type (double, natural units): NoTransform for none. The
    tensor-core forward that settles its own rows (fwd_mma's LostF) takes it too."""
    return _modifiers.transform(transforms, "double", True, "float64")


def _transform_arg(transforms, acc, dtype_name="float64", dropout=False):
    """The transforms as a template argument (natural units), none without any; with dropout,
    the transforms (or NoTransform) and then DropoutArgs, the kernels' trailing parameter pack."""
    f = _modifiers.transform(transforms, acc, True, dtype_name) if transforms else None
    if dropout:
        return f", {f or 'NoTransform'}, DropoutArgs"
    return f", {f}" if f else ""


def lost_name_expressions(dtype, dk_is_input_dtype, transforms=(), dropout=False):
    """The two backward kernels of lost_rows.cu for inputs of ``dtype`` whose dk / dv buffers hold
    the inputs' dtype (else the accumulator's); with dropout, their DropoutArgs instantiations."""
    t, acc = _config.c_types(dtype)
    f = _transform_arg(transforms, "double", dropout=dropout)
    return (f"bwd_lost_rows<{t}, {acc}{f}>",
            f"bwd_lost_keys<{t}, {acc}, {t if dk_is_input_dtype else acc}{f}>")


def fwd_lost_name_expression(dtype, transforms=(), dropout=False):
    t, acc = _config.c_types(dtype)
    return f"fwd_lost_rows<{t}, {acc}{_transform_arg(transforms, 'double', dropout=dropout)}>"


def instantiations():
    """Every (kernel, dtype name, bucket or None, source file, name expression) of this path:
    each chain of transforms without and with dropout (the one path that takes dropout takes it
    with every chain; its lost-row kernels then with the accumulator's dk / dv only)."""
    out = []
    for dt in _config.supported_dtype_names():
        for tf in _modifiers.CHAINS:
            for dropout in (False, True):
                rows, keys = lost_name_expressions(dt, False, tf, dropout)
                out += [("bwd_lost_rows", dt, None, LOST_SOURCE, rows),
                        ("bwd_lost_keys", dt, None, LOST_SOURCE, keys)]
                out += [(kernel, dt, b, KERNELS[kernel][0],
                         name_expression(kernel, dt, b, tf, dropout=dropout))
                        for kernel in TILED_KERNELS for b in _config.HEAD_DIM_BUCKETS]
            # the bias's gradient: bwd_dq's DBIAS twins (every chain: DBIAS; not with dropout)
            out += [("bwd_dq", dt, b, BWD_SOURCE, name_expression("bwd_dq", dt, b, tf, dbias=True))
                    for b in _config.HEAD_DIM_BUCKETS]
        out.append(("bwd_preprocess", dt, None, BWD_SOURCE, name_expression("bwd_preprocess", dt)))
    return out


def _prepare(kernel, p):
    """The compiled kernel, its (BLOCK_M, BLOCK_N) and its dynamic shared memory, opted in (bwd_dq:
    its DBIAS twin with p.dbias)."""
    acc = _config.c_types(p.dtype)[1]
    bucket = _config.head_dim_bucket(p.Dk, p.Dv)
    kern = _runtime.get_function(KERNELS[kernel][0],
                                 name_expression(kernel, p.dtype, bucket, _modifiers.names(p),
                                                 dbias=p.dbias and kernel == "bwd_dq",
                                                 dropout=bool(p.dropout_p)))
    smem = smem_bytes(kernel, acc, bucket)
    _runtime.opt_in(kern, smem)
    return kern, _config.GENERIC_TILES[(kernel, acc, bucket)], smem


def takes(p):
    """The generic kernels take every Problem (the last path of both registries)."""
    return True


takes_backward = takes


def forward(p):
    """fwd_generic: out (p.out_shape, p.dtype) and lse (p.lse_shape, p.acc_dtype)."""
    args = _runtime.Args(p)
    out, lse = _runtime.outputs(p)
    kern, (bm, _), smem = _prepare("fwd", p)
    _runtime.launch(kern, _runtime.bh_grid(-(-p.Nq // bm), p.BH), (_config.GENERIC_THREADS,),
                    (p.q, p.k, p.v, out, lse) + args.flat_tail(p.acc_dtype.type)
                    + _runtime.dropout_args(p), shared_mem=smem)
    return out, lse


def dout_rows(p, dout, base_align, vector):
    """(dout, src, rows) for a backward's preprocess kernel (bwd_preprocess here, bwd_mma_prep),
    which reads the caller's dout in loads of `vector` bytes and hands the main kernels C-contiguous
    (lead, Nq, Dv) rows at a `base_align`-byte aligned base. dout itself (src = rows = dout:
    nothing to copy) where it is such; else, where the preprocess can read it in place (unit
    innermost stride; row stride, matrix offsets and base multiples of `vector` bytes: a
    (B, N, H, D) view among them), a new buffer that the preprocess fills as it reads src = dout
    through `rows` (its matrix offsets per (batch, head), then its row stride: a device table kept
    per layout); else a contiguous copy."""
    if dout.flags.c_contiguous and not dout.data.ptr % base_align:
        return dout, dout, dout
    key = (p.lead, dout.shape, dout.strides, dout.dtype.str, vector)
    host = _dout_tables.get(key, False)
    if host is False:
        host = _dout_table(p.lead, dout, vector // dout.dtype.itemsize)
        _dout_tables.put(key, host)
    import cupy

    if host is None or dout.data.ptr % vector:
        dout = cupy.ascontiguousarray(dout)
        dout = dout if not dout.data.ptr % base_align else dout.copy()
        return dout, dout, dout
    return cupy.empty(dout.shape, dout.dtype), dout, _runtime.on_device(host)


def _dout_table(lead, x, align):
    """dout_rows' table for x (lead + (N, D)): its BH matrix offsets and its row stride (int64,
    elements); None unless the innermost stride is 1 and the rest are multiples of `align`."""
    strides = _validate.element_strides(x)
    offsets = _broadcast.lead_offsets(tuple(lead), x.shape[:-2], strides[:-2]).reshape(-1)
    if strides[-1] != 1 or strides[-2] % align or np.any(offsets % align):
        return None
    return np.append(offsets, np.int64(strides[-2]))


_dout_tables = _memo.Memo(64)


def preprocess(p, dout, out, lse):
    """bwd_preprocess: (dout, lse_eff, delta): dout as the main kernels read it, C-contiguous
    (BH, Nq, Dv) (the caller's, or its copy made on the way: dout_rows); (BH, Nq) each in the
    accumulator dtype, delta = rowsum(dout * out), lse_eff = lse, +inf (and delta 0) on lost rows.
    dout in any layout; out contiguous (BH, Nq, Dv); lse contiguous (BH, Nq) in the accumulator
    dtype. The main kernels read dout's rows at a 16-byte aligned base."""
    BH, acc = p.BH, p.acc_dtype
    dout, src, rows = dout_rows(p, dout, 16, dout.dtype.itemsize)
    lse_eff, delta = _runtime.carve(((BH, p.Nq), acc), ((BH, p.Nq), acc))  # lse_eff lost: +inf
    kern = _runtime.get_function(BWD_SOURCE, name_expression("bwd_preprocess", p.dtype))
    n = BH * p.Nq  # one warp a row; the kernel loops beyond the grid
    blocks = min(-(-n // (_config.GENERIC_THREADS // 32)), _runtime.MAX_GRID_X)
    _runtime.launch(kern, (blocks,), (_config.GENERIC_THREADS,),
                    (dout, out, lse, lse_eff, delta, np.int64(n), np.int32(p.Dv),
                     acc.type(_config.lost_lse_limit(acc)), src, rows, np.int32(p.Nq)))
    return dout.reshape(BH, p.Nq, p.Dv), lse_eff, delta


def backward(p, dout, out, lse, deterministic=False, sink_probs=None):
    """dq (BH, Nq, Dk), dk (BH, Nk, Dk), dv (BH, Nk, Dv) per output (batch, head), every element,
    in the accumulator dtype, and with p.dbias the logits' gradient (BH, Nq, Nk) (`dbias_buffer`;
    bwd_dq stores it). Deterministic by construction (no atomics): bwd_preprocess (delta =
    rowsum(dout * out), and lse_eff: +inf, with delta 0, on lost rows), bwd_dkdv over key tiles,
    bwd_dq over query tiles, then the lost rows' exact gradients (launch_lost)."""
    import cupy

    args = _runtime.Args(p)
    BH, acc, threads = p.BH, p.acc_dtype, (_config.GENERIC_THREADS,)
    out = cupy.ascontiguousarray(out).reshape(BH, p.Nq, p.Dv)
    lse = cupy.ascontiguousarray(lse.astype(acc, copy=False)).reshape(BH, p.Nq)
    dout, lse_eff, delta = preprocess(p, dout, out, lse)
    dq, dk, dv = _runtime.carve(((BH, p.Nq, p.Dk), acc), ((BH, p.Nk, p.Dk), acc),
                                ((BH, p.Nk, p.Dv), acc))
    drop = _runtime.dropout_args(p)  # (DropoutArgs,) or ()
    kern, (_, bn), smem = _prepare("bwd_dkdv", p)
    _runtime.launch(kern, _runtime.bh_grid(-(-p.Nk // bn), BH), threads,
                    (p.q, p.k, p.v, dout, lse_eff, delta, dk, dv) + args.flat_tail(acc.type)
                    + drop, shared_mem=smem)
    dbias = dbias_buffer(p, acc)
    kern, (bm, _), smem = _prepare("bwd_dq", p)
    _runtime.launch(kern, _runtime.bh_grid(-(-p.Nq // bm), BH), threads,
                    (p.q, p.k, p.v, dout, lse_eff, delta, dq) + args.flat_tail(acc.type)
                    + (_runtime.ptr(dbias),) + drop, shared_mem=smem)
    launch_lost(args, dout, out, lse, dq, dk, dv, sink_probs=sink_probs, dbias=dbias)
    return (dq, dk, dv) if dbias is None else (dq, dk, dv, dbias)


def dbias_buffer(p, dtype):
    """With p.dbias, the (BH, Nq, Nk) buffer of ``dtype`` (the kernels' accumulator) into which a
    backward kernel stores the logits' gradient of every pair it walks; else None. Zeroed where
    a kernel may skip pairs (the mask's tiles, the key ranges of causal, a window, kv_lens: the
    skipped pairs keep 0); where every query sees every key by position and there is no mask,
    every pair is walked, so it is not (empty: NaN-poisoned under the tests' override)."""
    if not p.dbias:
        return None
    import cupy
    shape = (p.BH, p.Nq, p.Nk)
    every = _walks.build(p.key, lambda: walks_every_pair(p))  # (the layout's: per signature)
    return _runtime.empty(shape, dtype) if every else cupy.zeros(shape, dtype)


_walks = _memo.Memo(256)


def walks_every_pair(p):
    """No mask, no kv_lens, and every query row sees keys [0, Nk - 1] by position (causal and the
    window, positions' shift included, hide nothing): every backward kernel walks every pair."""
    if p.mask is not None or p.kv_lens is not None or p.lens_device is not None:
        return False
    lo, hi = _validate.key_range(np.array([0, p.Nq - 1]), p.Nk, p.Nq, p.left, p.right,
                                 p.bottom_right)
    return int(lo[1]) <= 0 and int(hi[0]) >= p.Nk - 1


_lost_plans = _memo.Memo(256)


class FwdLostRows:
    """fwd_lost_rows prepared for one layout: in the ``blocks`` blocks of the tensor-core forward
    flagged in ``fix`` (int32, its launch order), recompute in double out and lse of the rows
    whose lse came out NaN, +inf or lost (|lse| >= ``lost``, default cuflash._config.LOST_LSE);
    otherwise it only reads the flags. With sinks (p.sinks) it joins them to those rows, as the
    forward kernels (SINKS) did."""

    def __init__(self, p, blocks, block_m, lost=None):
        fn = _runtime.get_function(LOST_SOURCE,
                                   fwd_lost_name_expression(p.dtype, _modifiers.names(p),
                                                            bool(p.dropout_p)))
        per_block = _config.GENERIC_THREADS // 32
        grid = min(-(-blocks // (32 * per_block)), _runtime.device_info().sm_count)
        self.launch = _runtime.Launch(fn, (grid,), (_config.GENERIC_THREADS,))
        self.limit = np.float64(_config.lost_lse_limit(p.acc_dtype) if lost is None else lost)
        self.block_m = np.int32(block_m)

    def __call__(self, head, fix, sinks, drop):
        """head: (q, k, v, out, lse) + Args.tail; sinks: the pointer; drop: dropout_args."""
        self.launch(head + (self.limit, fix, self.block_m, sinks) + drop)


class BwdLostRows:
    """kernels_cu/lost_rows.cu's backward pair prepared for one layout: add the exact gradients of
    the lost rows (_config.LOST_LSE) to dq, dk, dv, which the main backward kernels wrote without
    them. dout, out contiguous (BH, Nq, Dv); lse contiguous (BH, Nq) in the accumulator dtype;
    dq (BH, Nq, Dk) in it too; dk, dv (BH, Nk, D) of `kv_dtype`, the inputs' or the accumulator
    dtype. `prewritten`: the lost-row flags (BH, ceil(Nq / 32)) were written by the preprocess
    (the tensor-core path's), else made here from lse. With sinks (p.sinks) the sink joins each
    lost row's max and sum, and the row's exact sink probability is written into ``sink_probs``
    (BH, Nq) float64. ``dbias`` (BH, Nq, Nk) in the accumulator dtype (dbias_buffer; None: none):
    the lost rows' logit gradients are written there (by the second kernel, after every kernel
    that stores dbias). Two small launches that only read flags (and lse) when no row is lost;
    one where the rows' part is `settled` already (the tensor-core prep did it). `cast_dq` (the
    tensor-core backward): the second also rounds the float32 dq to the inputs' dtype into
    `dq_out` (its grid then also sized for that).
    `group` > 1 (the tensor-core backward's OPT_GROUP): dk, dv are (BH / group, Nk, D), each
    kv head's, summed over its group of consecutive heads. `like` (the tensor-core backward's
    gradients in their inputs' layouts): dk, dv and dq_out have k's, v's and q's strides."""

    def __init__(self, p, kv_dtype, prewritten, cast_dq=False, group=1, like=False,
                 settled=False):
        BH, Nq, Nk = p.BH, p.Nq, p.Nk
        rows_expr, keys_expr = lost_name_expressions(p.dtype, kv_dtype == p.dtype,
                                                     _modifiers.names(p), bool(p.dropout_p))
        warps = _config.GENERIC_THREADS // 32
        cap = 4 * _runtime.device_info().sm_count  # grid-stride beyond: a few flags per warp
        row_blocks = min(-(-BH * -(-Nq // LOST_SEG) // warps), cap)
        key_blocks = min(-(-(BH // group) * -(-Nk // LOST_SEG) // warps), cap)
        if cast_dq:  # 4 elements per thread and step
            key_blocks = max(key_blocks,
                             min(-(-BH * Nq * p.Dk // (4 * _config.GENERIC_THREADS)), cap))
        threads = (_config.GENERIC_THREADS,)
        self.rows = None if settled else _runtime.Launch(
            _runtime.get_function(LOST_SOURCE, rows_expr), (row_blocks,), threads)
        self.keys = _runtime.Launch(_runtime.get_function(LOST_SOURCE, keys_expr),
                                    (key_blocks,), threads)
        self.limit = np.float64(_config.lost_lse_limit(p.acc_dtype))
        self.prewritten = np.int32(prewritten)
        self.group = np.int32(group)
        self.like = np.int32(like)
        # scratch: each row's (max, sum, ...) in double, then the flags where none are prewritten
        flags = () if prewritten else (BH * -(-Nq // LOST_CHUNK) * 4,)
        self.scratch = (BH * Nq * 3 * 8,) + flags

    def __call__(self, p, tail, dout, out, lse, dq, dk, dv, stats, flags, sink_probs=None,
                 dbias=None, dq_out=None):
        """tail: p's Args.tail; stats, flags: `scratch`'s buffers (flags: the prewritten);
        dq_out: with cast_dq, dq's rounded copy."""
        common = (p.q, p.k, p.v, dout, out, lse) + tail + (self.limit, stats, flags)
        sinks = (_runtime.NULL, _runtime.NULL) if p.sinks is None else (p.sinks, sink_probs)
        drop = _runtime.dropout_args(p)  # (DropoutArgs,) or (): this call's seed and offset
        if self.rows is not None:
            self.rows(common + (dq, self.prewritten) + sinks + drop)
        self.keys(common + (dk, dv, dq, _runtime.ptr(dq_out), self.group, self.like,
                            _runtime.ptr(dbias)) + drop)


def launch_lost(args, dout, out, lse, dq, dk, dv, sink_probs=None, dbias=None):
    """BwdLostRows of args' Problem (the generic and wide backwards), the flags made from lse."""
    p = args.p
    key = None if p.key is None else (p.key, dk.dtype)
    lost = _lost_plans.build(key, lambda: BwdLostRows(p, dk.dtype, False))
    stats, flags = _runtime.carve(*lost.scratch)
    lost(p, args.tail, dout, out, lse, dq, dk, dv, stats, flags, sink_probs, dbias)
