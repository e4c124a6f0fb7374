"""The tensor-core forward on mma.sync (kernels_cu/fwd_mma.cu): float16 / bfloat16, sm_80+,
Dk == Dv in HEAD_DIMS, one launch (the kernel settles its lost rows itself: lost_rows.cuh).

Path interface (cuflash/_gpu.py): NAME, takes / forward, instantiations, and `pick_tile`, the tile
for a device. `tensor_core_layout` is what every tensor-core kernel needs of a Problem (the
backward's `takes_backward` reads it too).
"""
from collections import namedtuple

import numpy as np

from . import _config, _generic, _memo, _modifiers, _runtime

NAME = "mma"
TRANSFORMS = _modifiers.SINGLE  # the chains of score transforms its kernels take (cuflash/_gpu.py)
DROPOUT = True  # its kernels take dropout (fwd_mma.cu's Drop), without transforms or sinks (takes)
SINKS = True  # whether its forward kernels join the sinks themselves (fwd_mma.cu SINKS)
SOURCE = "fwd_mma.cu"

# FwdTile: block_m = 16 * MF * warps query rows per block (MF m-fragments of 16 rows per warp: 2
# when Q is re-read from shared memory by ldmatrix, 1 when Q sits in registers), block_n keys per
# tile, a `stages`-deep cp.async ring for K and V, the __launch_bounds__ minimum blocks per SM, and
# two copy choices (fwd_mma.cu): cheap_addr (incremental K/V addresses), kv_split (K and V in
# separate cp.async groups). Chosen from ptxas reports and H200 timings (benchmarks/RESULTS.md
# "Forward tile choices"); a mask or bias (HAS_MB) adds ~25 registers, hence 64-row tiles there.
FwdTile = namedtuple("FwdTile", "block_m block_n warps stages q_in_regs min_blocks cheap_addr "
                     "kv_split", defaults=(False, False))
HEAD_DIMS = (32, 64, 96, 128, 192, 256)
_T = FwdTile
TILES = {
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
del _T
# Compute capability 9.0+ only: where the table's 4-warp tile spills on sm_90a with the kernel's own
# lost-row fix (D=32: 16 bytes, 92 with softcap; D=128: 52-72; sm_80: none), 8 warps, Q in
# registers (the same block shape and shared memory). On sm_90a the Hopper forward
# (cuflash._wgmma_fwd) takes most of these calls.
TILES_CC90 = {
    (32, False): FwdTile(128, 128, warps=8, stages=2, q_in_regs=True, min_blocks=1),
    (128, False): FwdTile(128, 64, warps=8, stages=2, q_in_regs=True, min_blocks=1),
}


# With a score transform (cuflash/_modifiers.py) and no mask / bias, where the table's tile spills:
# at D=128 128 x 64 with 8 warps and Q in registers (as D=96), 210 registers (sm_90a).
TRANSFORM_TILES = {
    (128, False): FwdTile(128, 64, warps=8, stages=2, q_in_regs=True, min_blocks=1),
}


# With a transform that reads positions (ALiBi: an int-to-float conversion per score), where the
# tile above spills: D=32 128 x 128 with 8 warps (sm_80: 68 bytes with 4 warps), D=192 with a
# mask / bias 64 x 32 keys (sm_90a: 20 bytes with 64); their shared memory fits smem_bytes'.
POSITIONAL_TILES = {
    (32, False): FwdTile(128, 128, warps=8, stages=2, q_in_regs=True, min_blocks=1),
    (192, True): FwdTile(64, 32, warps=4, stages=2, q_in_regs=False, min_blocks=1),
}


# With dropout (no transform, no mask / bias), where the table's tile spills with the Philox
# draws (sm_80 and sm_90a: D=32 540 bytes, D=128 280 bytes at 255 registers): 8 warps of one
# m-fragment each, Q in registers (the same block shape, so the same shared memory); D=256 the
# mask / bias tile's 32 keys per step (64 spilled 104 bytes on sm_80 with 16-key draws).
DROPOUT_TILES = {
    (32, False): FwdTile(128, 128, warps=8, stages=2, q_in_regs=True, min_blocks=1),
    (128, False): FwdTile(128, 64, warps=8, stages=2, q_in_regs=True, min_blocks=1),
    (256, False): FwdTile(64, 32, warps=4, stages=2, q_in_regs=False, min_blocks=1),
}


def pick_tile(head_dim, has_mb, cc=80, transforms=(), dropout=False):
    """The forward tile for a device of compute capability `cc` (an int, e.g. 90)."""
    if dropout and (head_dim, has_mb) in DROPOUT_TILES:
        return DROPOUT_TILES[(head_dim, has_mb)]
    if _modifiers.positional(transforms) and (head_dim, has_mb) in POSITIONAL_TILES:
        return POSITIONAL_TILES[(head_dim, has_mb)]
    if transforms and (head_dim, has_mb) in TRANSFORM_TILES:
        return TRANSFORM_TILES[(head_dim, has_mb)]
    if cc >= 90 and (head_dim, has_mb) in TILES_CC90:
        return TILES_CC90[(head_dim, has_mb)]
    return TILES[(head_dim, has_mb)]


def smem_bytes(head_dim, has_mb):
    """Q tile plus STAGES K and V tiles of 16-bit elements, rows padded by 8 elements."""
    t = TILES[(head_dim, has_mb)]  # (TILES_CC90 keep the block shape and stages)
    return (t.block_m + 2 * t.stages * t.block_n) * (head_dim + 8) * 2


def name_expression(dtype, head_dim, has_mb, tile=None, transforms=(), sinks=False,
                    dropout=False):
    """has_mb: a mask or bias; transforms: the score transforms' names (cuflash/_modifiers.py;
    they keep the tiles of the call without them); sinks: whether the kernel joins attention
    sinks (a template argument, true, only then: the tiles are the call's without them);
    dropout: the DropoutArgs instantiation (kernels_cu/philox.cuh; SINKS spelled out before
    it)."""
    t = TILES[(head_dim, has_mb)] if tile is None else tile
    b = lambda x: "true" if x else "false"  # noqa: E731
    # LostF: the transforms as its own end settles rows (lost_rows.cuh), then SINKS and Drop
    lost = _generic.lost_transform(transforms)
    last = (f", {lost}, {b(sinks)}, DropoutArgs" if dropout else
            f", {lost}, true" if sinks else f", {lost}" if transforms else "")
    return (f"fwd_mma<{_config.c_types(dtype)[0]}, {head_dim}, {t.block_m}, {t.block_n}, "
            f"{t.warps}, {t.stages}, {b(t.q_in_regs)}, "
            f"{_modifiers.score_mod(has_mb, transforms, dtype_name=_config.dtype_name(dtype))}, "
            f"{t.min_blocks}, {b(t.cheap_addr)}, {b(t.kv_split)}{last}>")


def _variants():
    """The (transforms, sinks, dropout) variants the catalog holds: every transform with and
    without sinks, and dropout alone (no transform, no sinks: `takes` leaves those to the
    generic kernels, so the catalog gains one set of tiles, not one per option)."""
    return [(tf, sk, False) for tf in TRANSFORMS for sk in (False, True)] + [((), False, True)]


def instantiations():
    """Every (kernel, dtype name, head dim or None, source file, name expression) of this path."""
    out = []
    for dt in _config.MMA_DTYPES:
        exprs = {name_expression(dt, d, mb, pick_tile(d, mb, cc, tf, dr), tf, sk, dr)
                 for d, mb in TILES for cc in (80, 90) for tf, sk, dr in _variants()}
        out += [("fwd_mma", dt, int(e.split(",")[1]), SOURCE, e) for e in sorted(exprs)]
    return out


def _requested(cc):
    """The name expressions a device of compute capability `cc` can request."""
    return {name_expression(dt, d, mb, pick_tile(d, mb, cc, v[0], v[2]), *v)
            for dt in _config.MMA_DTYPES for d, mb in TILES for v in _variants()}


def cc90_only():
    """Name expressions requested only on compute capability 9.0+ (held to zero spills there)."""
    return _requested(90) - _requested(80)


def cc80_only():
    """Name expressions requested only below compute capability 9.0 (held to zero spills on sm_80
    only: the tiles TILES_CC90 replaces)."""
    return _requested(80) - _requested(90)


def tensor_core_layout(p, same_dims=True):
    """What every tensor-core kernel needs (fwd_mma.cu and bwd_mma.cu, "Requirements"): 16-bit
    inputs, Dk == Dv (unless not same_dims: the backward's tiles may differ), scale > 0, lengths
    within their 32-bit arithmetic, sm_80+, and 16-byte rows: unit innermost stride, rows and
    matrices 8 elements apart, aligned bases."""
    if p.dtype.name not in _config.MMA_DTYPES or (same_dims and p.Dk != p.Dv):
        return False
    if not p.scale > 0 or max(p.Nq, p.Nk) > _config.MMA_MAX_LEN:
        return False  # the kernels fold the scale into exp2 and take maxima of unscaled scores
    return _runtime.device_info().cc >= 80 and _runtime.rows_of_16_bytes(p)


def takes(p):
    """Whether the tensor-core forward takes this Problem."""
    if p.Dk not in HEAD_DIMS or not tensor_core_layout(p):
        return False
    if p.dropout_p and (p.transforms or p.sinks is not None):
        return False  # dropout with a transform or sinks: the generic kernels (_variants)
    has_mb = p.mask is not None or p.bias is not None
    return smem_bytes(p.Dk, has_mb) <= _runtime.device_info().smem_optin


_prepared = _memo.Memo(256)


class _Forward:
    """The forward of one layout, prepared (built once per Problem.key): called with a Problem of
    its key, out (BH, Nq, Dv) of p.dtype and lse (BH, Nq) float32, with its sinks, in one launch.
    The kernel settles at its own end the rows its float arithmetic cannot (lost_rows.cuh
    fwd_fix_rows, with `lost` as fwd_lost_rows takes it): without mask, bias or transform the rows
    of lost lse; with them every row of l = 0, all masked (empty) or all -inf (NaN)."""

    def __init__(self, p):
        has_mb = p.mask is not None or p.bias is not None
        names = _modifiers.names(p)
        tile = pick_tile(p.Dk, has_mb, _runtime.device_info().cc, names, bool(p.dropout_p))
        kern = _runtime.get_function(SOURCE, name_expression(
            p.dtype, p.Dk, has_mb, tile, names, p.sinks is not None, bool(p.dropout_p)))
        smem = smem_bytes(p.Dk, has_mb)
        _runtime.opt_in(kern, smem)
        # 1-D grid, bh-major: the query tiles of one head run together and share its K/V in L2
        blocks = -(-p.Nq // tile.block_m) * p.BH
        if blocks > _runtime.MAX_GRID_X:
            raise ValueError(f"problem too large for one launch: {blocks} blocks")
        self.launch = _runtime.Launch(kern, (blocks,), (tile.warps * 32,), smem)
        self.lost = np.float64(np.inf if _modifiers.modified(p)
                               else _config.lost_lse_limit(p.acc_dtype))
        self.carving = _runtime.output_carving(p)
        self.args = _runtime.KeptArgs(p)

    def __call__(self, p):
        _, _, tail = self.args(p)
        out, lse = _runtime.carved_outputs(self.carving, p)
        self.launch((p.q, p.k, p.v, out, lse) + tail + (self.lost, _runtime.ptr(p.sinks))
                    + _runtime.dropout_args(p))
        return out, lse


def prepare(p):
    """The forward of p's layout, prepared (_Forward)."""
    return _prepared.build(p.key, lambda: _Forward(p))


def forward(p):
    return prepare(p)(p)
