"""The tensor-core backward (kernels_cu/bwd_mma.cu): mma.sync, and wgmma on sm_90a; tile tables,
the tile rule, takes_backward, backward().

float16 / bfloat16 on sm_80 and newer, (Dk, Dv) in HEAD_DIMS: Dk == Dv in (32, 64, 96, 128, 192,
256), and (192, 128). Three kernels per call:
  bwd_mma_prep   (lost_rows.cu) delta = rowsum(dout * out) and lse2 = lse * log2(e) (+inf on empty
                 and lost rows), float32, padded to Nq_pad = round_up(Nq, LSE_PAD) rows per (batch,
                 head); with dQ atomics it zeroes dQ's sums and adds the lost rows' exact dQ;
  bwd_mma_dkdv   one block per key tile: dK, dV in registers (float32 out), and by default dQ added
                 to a zeroed float32 buffer with red.global.add (order of additions varies run to run);
  bwd_mma_dq     only with deterministic=True: dQ recomputed per query tile with plain stores, and
                 the dkdv kernel instantiated without its dQ part: bitwise reproducible, at the cost
                 of recomputing S and dP (7 instead of 5 GEMMs per tile pair).
`backward(problem, dout, out, lse)` returns dq, dk, dv per output (batch, head), like
cuflash/_generic.py's backward; the caller sums GQA / broadcast groups and casts. Path interface
(cuflash/_gpu.py): NAME, takes_backward / backward, instantiations, and `dkdv_tile`, the tile for
a device.

Which dK/dV tile a call gets (dkdv_tile): on compute capability 9.0 at head dims 64 and 128 the
wgmma form (DKDV_TILES_WG / _MB / _DQ / _PLAIN, OPT_WG: compiled for sm_90a), where warpgroup h
owns keys [64 h, 64 h + 64) of the 128-key tile and S^T, dP^T, dV and dK are warpgroup products
(D=64 calls without a modifier or dropout: 128 queries per step); elsewhere
the DKDV_TILES_LARGE_SMEM tiles (D=128: the warp-grid kernel; (192, 128), 256) where shared memory
allows, else DKDV_TILES / DKDV_TILES_MB. Dk >= 192 splits dK, dV and dQ's columns over two blocks
per key tile (OPT_HALVES); Dk != Dv tiles are rows of max(Dk, Dv). Tiles are chosen by ptxas spill
reports and, at D=64, 128 and 192 / 256, by H200 timings (benchmarks/RESULTS.md, with the
alternatives that lost).

dkdv: BLOCK_N = 16 * WARPS keys (warp w owns 16 keys), BLOCK_M queries per step, K and V
A-fragments re-read from shared memory by ldmatrix or held in registers (KV_IN_REGS). Registers
sit near 255: the live state is dK + dV (HEAD_DIM floats per thread) plus S^T and dP^T (BLOCK_M / 2
each), so one 8-warp block runs per SM. With a mask or bias (HAS_MB) D=128 takes 16 queries per
step: larger steps spill. dq (deterministic mode): 64 query rows (4 warps) x 64 keys, 2-stage K/V
ring, 2 blocks per SM.
"""
import itertools
import math
from collections import namedtuple

import numpy as np

from . import _config, _generic, _mask_tiles, _memo, _mma_fwd, _modifiers, _runtime
from ._broadcast import _padded

NAME = "mma"
TRANSFORMS = _modifiers.SINGLE  # the chains of score transforms its kernels take (cuflash/_gpu.py)
# the chains whose backward stores the bias's gradient (p.dbias; the dK/dV kernel's OPT_DBIAS
# twins, dbias_tile): none with a transform (dbias with softcap or ALiBi: the generic kernels)
DBIAS = ((),)
DROPOUT = True  # its kernels take dropout (bwd_mma.cu's Drop), without transforms (takes_backward)
SOURCE = "bwd_mma.cu"
_CTYPE = {name: _config.c_types(name)[0] for name in _config.MMA_DTYPES}

# Mirrors kernels_cu/bwd_mma.cu LSE_PAD: lse2/delta rows per (batch, head) are padded to a multiple.
LSE_PAD = 128

# opt: bwd_mma_dkdv OPT bits (kernels_cu/bwd_mma.cu tcb::DkdvOpt), 0 = mma.sync on padded tiles.
DkdvTile = namedtuple("DkdvTile", "block_m warps kv_in_regs min_blocks opt", defaults=(0,))
# OPT_SWZ: K, V, Q, dO tiles in unpadded rows with FA2's XOR swizzle of the 16-byte chunks
# (tcb::DKDV_SWZ; head dims that are multiples of 64).
OPT_SWZ = 1
# OPT_WG: sm_90a only. The four products whose rows are keys on wgmma, 64 keys per warpgroup
# (tcb::DKDV_WGMMA, with OPT_SWZ; D=64 or 128, BLOCK_M 32 or 64 (D=64: or 128), 8 warps, K / V
# in shared memory). Compiled with -arch=sm_90a (dkdv_arch).
OPT_WG = 2
# OPT_WG_DQ: with OPT_WG at D=128, BLOCK_M 64 (or D=64, BLOCK_M 128), dQ atomics: dQ on wgmma
# too (at 128 queries dK's A operand dS^T read from shared memory as well) (tcb::DKDV_WG_DQ;
# DKDV_TILES_WG_DQ, DKDV_TILES_WG_PLAIN).
OPT_WG_DQ = 4
# OPT_GRID (host-side bit, not an OPT of bwd_mma_dkdv): the FA2-style warp-grid kernel
# bwd_mma_dkdv_grid<T, HEAD_DIM, BLOCK_M, DQ_ATOMIC, MIN_BLOCKS> (8 warps, 128 keys, no mask /
# bias).
OPT_GRID = 8
# OPT_HALVES: head dims whose dK + dV do not fit a warp's registers (192, 256): two blocks per key
# tile, each with half of dK's, dV's and dQ's columns (tcb::DKDV_HALVES; padded tiles).
OPT_HALVES = 16
# OPT_DBIAS: the bias's gradient, P^T (dP^T - delta) stored per pair (tcb::DKDV_DBIAS; with a
# mask / bias modifier, on the tiles of dbias_tile).
OPT_DBIAS = 64
# OPT_SBIAS: a bias comes with each query tile into shared memory (tcb::copy_bias_block: 16-byte
# copies where its rows allow, else 4-byte, any strides) and the modifier reads it there
# (tcb::DKDV_SBIAS; the wgmma mask / bias tiles). No copy without a bias.
OPT_SBIAS = 128
# OPT_GROUP: GQA in the kernel (tcb::DKDV_GROUP): a block's keys serve the `group` query heads of
# their kv head, dK and dV summed in registers and stored once per kv head in the inputs' dtype
# (group_size says when; no float32 buffers, no sum pass after).
OPT_GROUP = 256
# OPT_DQ_BULK: with OPT_WG, 64 queries per step and dQ atomics, each query tile's dQ block goes
# through shared memory to the bulk copy engine's reduce-add (tcb::DKDV_DQ_BULK; + its block in
# dkdv_smem_bytes). wg_tile sets it: not with a transform or dropout (ALiBi's and dropout's WG_DQ
# tiles spilled 24 / 16 bytes with it), not on the 32-query tiles (the bias backward was 2-3 %
# slower with it than with DQ_UNDER, H100).
OPT_DQ_BULK = 512
# OPT_DQ_ORDER: deterministic=True on an OPT_DQ_BULK tile: the key blocks of a head add each query
# row's dQ in one order fixed by the shapes (tcb::dq_turn; the rows' turns in an int32 (BH, Nq)
# buffer that prep zeroes): the atomics' single pass, no dq kernel recomputing S and dP.
# ordered_tile says when.
OPT_DQ_ORDER = 1024
# where OPT_DQ_ORDER pays (H100, bf16, deterministic vs default backward, N = 1k / 4k / 4k causal:
# D=128 +26 / +35 / +38 % against the dq kernel's +36 / +49 / +43 %; D=64 +48 / +58 / +60 %
# against +24 / +30 / +27 %: its tiles are short beside a turn's hand-over)
ORDER_DIMS = ((128, 128),)
# OPT_LIKE: with OPT_WG, no mask / bias, transform, dropout or dbias: dK and dV stored in k's and
# v's layouts (tcb::DKDV_LIKE; _recipe's `like`: q, k, v dense transposes such as (B, N, H, D)
# views). Its own instantiations: a runtime switch in the stores changed every wgmma kernel's
# main-loop schedule (D=64 3 % slower on the H100 where the switch was off).
OPT_LIKE = 2048
# OPT_DQ_T: with OPT_WG_DQ and OPT_DQ_BULK at D=128, 80 queries per step: dQ made transposed
# (dQ^T = K^T dS^T; 80 is no multiple of wgmma's M), dS stored as rows of queries
# (tcb::DKDV_DQ_T); lse2 / delta padded to a multiple of 640 (nq_padded).
OPT_DQ_T = 8192
DqTile = namedtuple("DqTile", "block_n warps stages min_blocks")

# (Dk, Dv) -> tile. Instantiations: 2 dtypes x 7 head dim pairs x 2 (HAS_MB) x 2 (deterministic)
# dkdv, plus 2 x 7 x 2 dq, plus the LARGE_SMEM and wgmma tiles below, and the prep kernels
# (lost_rows.cu: by lost-row columns, transforms and dropout; prep_expr).
DKDV_TILES = {
    (32, 32): DkdvTile(block_m=64, warps=8, kv_in_regs=True, min_blocks=1),
    (64, 64): DkdvTile(block_m=64, warps=8, kv_in_regs=True, min_blocks=1, opt=OPT_SWZ),
    (96, 96): DkdvTile(block_m=64, warps=8, kv_in_regs=False, min_blocks=1),
    (128, 128): DkdvTile(block_m=64, warps=8, kv_in_regs=False, min_blocks=1),
    (192, 128): DkdvTile(block_m=32, warps=4, kv_in_regs=False, min_blocks=1, opt=OPT_HALVES),
    (192, 192): DkdvTile(block_m=32, warps=4, kv_in_regs=False, min_blocks=1, opt=OPT_HALVES),
    (256, 256): DkdvTile(block_m=32, warps=4, kv_in_regs=False, min_blocks=1, opt=OPT_HALVES),
}
# with a mask / bias (the modifier keeps more addresses live): smaller query steps where the
# table's tile spills
DKDV_TILES_MB = {
    **DKDV_TILES,
    (128, 128): DkdvTile(block_m=16, warps=8, kv_in_regs=False, min_blocks=1),
    (256, 256): DkdvTile(block_m=16, warps=4, kv_in_regs=False, min_blocks=1, opt=OPT_HALVES),
}
# with a score transform (its dF/dx registers; with or without a mask / bias): smaller query steps
# where the mask / bias tile spilled on sm_80
DKDV_TILES_TF = {
    **DKDV_TILES_MB,
    (64, 64): DkdvTile(block_m=32, warps=8, kv_in_regs=True, min_blocks=1, opt=OPT_SWZ),
}
# Head dims whose every tile spilled with a transform and a mask / bias on sm_80 (D=96: no smaller
# query step fits its dQ layout): the generic backward takes a transform there.
NO_TRANSFORM_DIMS = ((96, 96),)
# dq: one tile per head dim pair, with and without mask / bias (Dk >= 192: 32 keys per step, one
# block per SM; 64 spilled at 256)
DQ_TILES = {d: DqTile(block_n=64, warps=4, stages=2, min_blocks=2) for d in DKDV_TILES}
DQ_TILES.update({d: DqTile(block_n=32, warps=4, stages=2, min_blocks=1)
                 for d in DKDV_TILES if d[0] >= 192})
HEAD_DIMS = tuple(sorted(DKDV_TILES))
# Devices whose opt-in shared memory per block holds it (the H200: 227 KiB) take these tiles
# instead of DKDV_TILES's without mask / bias: D=128 the warp-grid kernel (177 KiB: over sm_80's
# 163 KiB); 128 keys per block pair at (192, 128) (219 KiB) and D=256 (209 KiB): 1.15-1.3x the
# 64-key tiles on the H200 (benchmarks/RESULTS.md).
DKDV_TILES_LARGE_SMEM = {
    (128, 128): DkdvTile(block_m=64, warps=8, kv_in_regs=False, min_blocks=1, opt=OPT_GRID),
    (192, 128): DkdvTile(block_m=64, warps=8, kv_in_regs=False, min_blocks=1, opt=OPT_HALVES),
    (256, 256): DkdvTile(block_m=32, warps=8, kv_in_regs=False, min_blocks=1, opt=OPT_HALVES)}
# Compute capability 9.0 (sm_90a code): the wgmma form of the swizzled tile (OPT_WG), with and
# without mask / bias; with a mask / bias D=128 takes 32 queries per step (64 spill 12 B with
# deterministic=True).
DKDV_TILES_WG = {
    (64, 64): DkdvTile(block_m=64, warps=8, kv_in_regs=False, min_blocks=1, opt=OPT_SWZ | OPT_WG),
    (128, 128): DkdvTile(block_m=64, warps=8, kv_in_regs=False, min_blocks=1,
                         opt=OPT_SWZ | OPT_WG),
}
DKDV_TILES_WG_MB = {
    (64, 64): DkdvTile(block_m=64, warps=8, kv_in_regs=False, min_blocks=1,
                       opt=OPT_SWZ | OPT_WG | OPT_SBIAS),
    (128, 128): DkdvTile(block_m=32, warps=8, kv_in_regs=False, min_blocks=1,
                         opt=OPT_SWZ | OPT_WG | OPT_SBIAS),
}
# With dQ atomics and no mask / bias, D=128 takes dQ on wgmma too (OPT_WG_DQ: dS^T stored
# 128-byte swizzled, read as an MN-major A operand). deterministic=True keeps DKDV_TILES_WG's
# (its dkdv kernel has no dQ part).
DKDV_TILES_WG_DQ = {(128, 128): DkdvTile(block_m=64, warps=8, kv_in_regs=False, min_blocks=1,
                                         opt=OPT_SWZ | OPT_WG | OPT_WG_DQ)}
# Plain calls (no mask / bias, transform or dropout) at D=64: 128 queries per step (S^T and dP^T
# as 64 x 128 products), dQ on wgmma with dQ atomics, warpgroup h taking query rows [64 h,
# 64 h + 64). Their modifier, transform and dropout twins spilled (sm_90a ptxas). At D=128, with
# dQ atomics only (OPT_DQ_T: no form without dQ), 80 queries per step.
DKDV_TILES_WG_PLAIN = {(64, 64): DkdvTile(block_m=128, warps=8, kv_in_regs=False, min_blocks=1,
                                          opt=OPT_SWZ | OPT_WG),
                       (128, 128): DkdvTile(block_m=80, warps=8, kv_in_regs=False, min_blocks=1,
                                            opt=OPT_SWZ | OPT_WG | OPT_DQ_T)}


def _b(x):
    return "true" if x else "false"


def prep_expr(dtype_name, dims, transforms=(), dropout=False):
    """The prep kernel (lost_rows.cu, which settles the lost rows too): COLS = 2, 4 or 8 lost-row
    columns per lane (COLS * 32 >= the head dims; fewer registers, more blocks per
    multiprocessor); the transforms and dropout of the lost-row kernels."""
    cols = 2 if max(dims) <= 64 else 4 if max(dims) <= 128 else 8
    return (f"bwd_mma_prep<{_CTYPE[dtype_name]}, {cols}"
            f"{_generic._transform_arg(transforms, 'double', dropout=dropout)}>")


# With a mask / bias and a transform that reads positions (ALiBi), the dims whose dQ tile spills
# (D=256: 8 bytes on sm_80 and sm_90a): the generic kernels take those backward calls.
POSITIONAL_MB_DECLINED = ((256, 256),)


def _positional_mb_declined(names):
    return POSITIONAL_MB_DECLINED if _modifiers.positional(names) else ()


def dkdv_expr(dtype_name, dims, tile, dq_atomic, has_mb, transforms=(), dropout=False):
    """bwd_mma_dkdv<..., opt>, or the warp-grid kernel bwd_mma_dkdv_grid for an OPT_GRID tile.
    has_mb: a mask or bias; transforms: the score transforms' names (cuflash/_modifiers.py);
    dropout: the DropoutArgs instantiation (kernels_cu/philox.cuh; never a grid tile)."""
    dk, dv = dims
    if tile.opt & OPT_GRID:
        assert not dropout, "the warp-grid kernel takes no dropout (DKDV_TILES_DROPOUT)"
        return (f"bwd_mma_dkdv_grid<{_CTYPE[dtype_name]}, {dk}, {tile.block_m}, "
                f"{_b(dq_atomic)}, {tile.min_blocks}>")
    return (f"bwd_mma_dkdv<{_CTYPE[dtype_name]}, {dk}, {dv}, {tile.block_m}, {tile.warps}, "
            f"{_b(tile.kv_in_regs)}, {_b(dq_atomic)}, "
            f"{_modifiers.score_mod(has_mb, transforms, dtype_name=dtype_name)}, {tile.min_blocks}, "
            f"{tile.opt}{', DropoutArgs' if dropout else ''}>")


def dq_expr(dtype_name, dims, tile, has_mb, transforms=(), dropout=False):
    return (f"bwd_mma_dq<{_CTYPE[dtype_name]}, {dims[0]}, {dims[1]}, {tile.block_n}, "
            f"{tile.warps}, {tile.stages}, "
            f"{_modifiers.score_mod(has_mb, transforms, dtype_name=dtype_name)}, "
            f"{tile.min_blocks}{', DropoutArgs' if dropout else ''}>")


def dkdv_blocks(p, tile, group=1):
    """The dK/dV launch's 1-D grid: a block per key tile per (batch, head), two with OPT_HALVES;
    with OPT_GROUP per (batch, kv head) of `group` heads."""
    return -(-p.Nk // (16 * tile.warps)) * (p.BH // group) * (2 if tile.opt & OPT_HALVES else 1)


def group_size(p):
    """How many query heads one dK/dV block serves (OPT_GROUP), or 1: GQA's group where k and v
    broadcast over groups of consecutive heads of the last leading axis alone (bh // group is
    then their own (batch, kv head), as _broadcast.reduce_to_lead sums), on the wgmma tiles,
    without a mask, bias, transform, dropout, dbias, kv_lens (one window per group) or pages."""
    lead = tuple(p.lead)
    if not lead or p.mask is not None or p.bias is not None or p.transforms or p.dropout_p \
            or p.dbias or p.kv_lens is not None or p.lens_device is not None \
            or p.pages is not None:
        return 1
    kl, vl = (_padded(x.shape[:-2], len(lead)) for x in (p.k, p.v))
    if kl != vl or kl[:-1] != lead[:-1] or kl[-1] >= lead[-1] or lead[-1] % kl[-1]:
        return 1
    return lead[-1] // kl[-1]


def dkdv_smem_bytes(dims, tile):
    """K, V (BLOCK_N rows) + two slots of Q, dO (BLOCK_M rows), rows of max(Dk, Dv) padded by 8
    elements; dS^T (BLOCK_N rows of BLOCK_M + 8); two slots of lse2 and delta (float32); OPT_GRID:
    + P^T (as dS^T); OPT_SBIAS: + two slots of the bias block (BLOCK_M rows of BLOCK_N + 4
    floats, tcb::sbias_pitch); OPT_DQ_BULK: + the dQ block (BLOCK_M rows of head_dim + 8
    floats). OPT_SWZ (Dk == Dv): K, V, Q, dO rows unpadded (head_dim * 2
    bytes), plus one such row of slack: the kernel rounds its shared base up to a row (its XOR
    addressing needs row-aligned tile bases)."""
    head_dim = max(dims)
    block_n = 16 * tile.warps
    swz = bool(tile.opt & OPT_SWZ)  # (never with OPT_GRID)
    row = head_dim * 2 if swz else (head_dim + 8) * 2
    ps = block_n * (tile.block_m + 8) * 2
    slack = (1024 if tile.opt & OPT_WG else row) if swz else 0  # wgmma: 1024-byte aligned tiles
    sbias = 2 * tile.block_m * (block_n + 4) * 4 if tile.opt & OPT_SBIAS else 0  # 2 slots
    dq_block = tile.block_m * (head_dim + 8) * 4 if tile.opt & OPT_DQ_BULK else 0
    return (2 * block_n + 4 * tile.block_m) * row + ps * (2 if tile.opt & OPT_GRID else 1) \
        + 4 * tile.block_m * 4 + slack + sbias + dq_block


def nq_padded(Nq, tile):
    """lse2 / delta rows per (batch, head): Nq rounded up to LSE_PAD and the tile's query step."""
    pad = math.lcm(LSE_PAD, tile.block_m)
    return -(-Nq // pad) * pad


def dkdv_arch(tile):
    """The NVRTC target a dK/dV tile needs beyond CuPy's default (OPT_WG: sm_90a), or None."""
    return "sm_90a" if tile.opt & OPT_WG else None


def wg_tile(dims, has_mb, dq_atomic, dropout=False, transforms=(), bias=False):
    """The wgmma dK/dV tile of a call kind, or None. has_mb: a modifier (wg_modified); transforms:
    the transforms' names; bias: the modifier has a bias. A call without a modifier, transform or
    dropout takes DKDV_TILES_WG_PLAIN's tile where there is one (with dQ atomics, OPT_WG_DQ on
    it). Otherwise, with dQ atomics the one with dQ on wgmma
    too where there is one (DKDV_TILES_WG_DQ): without a modifier (dropout included), or with a
    mask alone (no bias, transform or dropout: with those it spilled 88-556 bytes on sm_90a, and a
    bias gains more from DKDV_TILES_WG_MB's staging, OPT_SBIAS); else DKDV_TILES_WG / _MB; with
    dropout DKDV_TILES_WG_MB's in place of DKDV_TILES_WG's (D=128's 64 queries per step spilled
    8 bytes with dropout; WG_DQ's did not). OPT_DQ_BULK where its rule holds."""
    alone = not has_mb or not (bias or transforms or dropout)
    plain = DKDV_TILES_WG_PLAIN.get(dims) if not (has_mb or transforms or dropout) else None
    if plain is not None and (dq_atomic or not plain.opt & OPT_DQ_T):
        tile = plain._replace(opt=plain.opt | OPT_WG_DQ) if dq_atomic else plain
    elif dq_atomic and dims in DKDV_TILES_WG_DQ and alone:
        tile = DKDV_TILES_WG_DQ[dims]
    else:
        tile = (DKDV_TILES_WG_MB if has_mb or dropout else DKDV_TILES_WG).get(dims)
    if tile is not None and dq_atomic and tile.block_m >= 64 and not transforms and not dropout:
        tile = tile._replace(opt=tile.opt | OPT_DQ_BULK)
    return tile


# With dropout (the keep bits of a thread's P^T entries, philox.cuh dropped_keys; no warp-grid
# tile): the wgmma tiles where dkdv_tile takes them, else the transforms' smaller query steps, all
# spill-free on sm_80 and sm_90a but D=96's (12-40 bytes; no smaller query step fits its dQ
# layout): the generic kernels take its dropout backward (NO_DROPOUT_DIMS).
NO_DROPOUT_DIMS = ((96, 96),)
DKDV_TILES_DROPOUT = {d: t for d, t in DKDV_TILES_TF.items() if d not in NO_DROPOUT_DIMS}


def wg_modified(has_mb, transforms):
    """Whether a call takes the wgmma tiles of a modifier: a mask / bias (has_mb here: the mask or
    bias alone) or a transform that is not additive. Additive transforms alone (ALiBi) keep the
    plain call's tiles: the kernel folds the scale as without them and keeps no derivative
    (modifiers.cuh ADDITIVE), and those instantiations compile spill-free."""
    return has_mb or (bool(transforms) and not _modifiers.additive(transforms))


def dkdv_tile(dims, has_mb, dq_atomic=False, transforms=(), dropout=False, dbias=False,
              bias=False):
    """The dK/dV tile for a call on the current device: the wgmma tile (wg_tile) on compute
    capability 9.0 (sm_90a code runs there only; NVRTC 12.9+ builds it; tests turn it off with
    cuflash._gpu.override(wgmma=False)), else with dropout DKDV_TILES_DROPOUT's, else the
    DKDV_TILES_LARGE_SMEM tile where shared memory allows it, else the table's. has_mb: a mask or
    bias; bias: a bias among them; transforms: the transforms' names. dbias (with a bias, no
    transform, no dropout): dbias_tile."""
    info = _runtime.device_info()
    wg = wg_tile(dims, wg_modified(has_mb, transforms), dq_atomic, dropout, transforms, bias)
    use_wg = _runtime.overrides().wgmma and wg is not None and _runtime.wgmma_available() and \
        dkdv_smem_bytes(dims, wg) <= info.smem_optin
    if dropout:
        return wg if use_wg else DKDV_TILES_DROPOUT[dims]
    if dbias:
        return dbias_tile(dims, dq_atomic, use_wg)
    if use_wg:
        return wg
    if not has_mb and not transforms and dims in DKDV_TILES_LARGE_SMEM:
        big = DKDV_TILES_LARGE_SMEM[dims]
        if dkdv_smem_bytes(dims, big) <= info.smem_optin:
            return big
    if transforms:
        return DKDV_TILES_TF[dims]
    return (DKDV_TILES_MB if has_mb else DKDV_TILES)[dims]


# Head dims whose dK/dV DBIAS tiles spill (the stores' registers): the generic kernels take
# dbias there. D=96: 36-40 bytes on sm_80 (no smaller query step fits its dQ layout, as with
# NO_TRANSFORM_DIMS; sm_90a compiled it spill-free).
DBIAS_DECLINED = ((96, 96),)


def ordered_tile(p, dims, names, dropout):
    """The OPT_DQ_ORDER tile of a deterministic call, or None (the dq kernel then): an OPT_DQ_BULK
    tile, no mask / bias (the tiles a mask skips would break the order's runs of key blocks), and
    a head's key blocks at most one per multiprocessor (a block may wait for a later block of its
    head, which must then be resident: with at least one block per multiprocessor, it is once
    the blocks before it are). And query tiles x (key blocks + 1) at most 2^32: tcb::spread_turn
    counts in 32 bits."""
    if p.mask is not None or p.bias is not None or dims not in ORDER_DIMS:
        return None
    tile = orderable(dims, dkdv_tile(dims, False, True, names, dropout))
    blocks = -(-p.Nk // (16 * tile.warps))
    if not tile.opt & OPT_DQ_BULK or blocks > _runtime.device_info().sm_count or \
            -(-p.Nq // tile.block_m) * (blocks + 1) > 1 << 32:
        return None
    return tile._replace(opt=tile.opt | OPT_DQ_ORDER)


def orderable(dims, tile):
    """The tile that takes OPT_DQ_ORDER where `tile` would be taken: itself, but for the dQ^T
    tile (OPT_DQ_T), which has no ordered form: the 64-query one with dQ on wgmma."""
    if tile.opt & OPT_DQ_T:
        tile = DKDV_TILES_WG_DQ[dims]
        return tile._replace(opt=tile.opt | OPT_DQ_BULK)
    return tile


def dbias_tile(dims, dq_atomic, wgmma):
    """The dK/dV tile of a call with the bias's gradient: the mask / bias tile with OPT_DBIAS, the
    wgmma one (wg_tile) where ``wgmma`` (dkdv_tile's rule), else the transforms' (DKDV_TILES_TF:
    smaller query steps where the stores' registers would not fit)."""
    tile = wg_tile(dims, True, dq_atomic, bias=True) if wgmma else None
    tile = tile or DKDV_TILES_TF[dims]
    return tile._replace(opt=tile.opt | OPT_DBIAS)


def dq_smem_bytes(dims, tile):
    """Q, dO (16 * WARPS rows) + STAGES K and V tiles, rows of max(Dk, Dv) padded by 8 elements."""
    return (2 * 16 * tile.warps + 2 * tile.stages * tile.block_n) * (max(dims) + 8) * 2


def instantiations():
    """Every (kernel, dtype name, head dim or None, source file, name expression) of this path."""
    out = []
    for dt in _config.MMA_DTYPES:
        exprs = []
        for d in HEAD_DIMS:
            for mb in (False, True):
                tile = (DKDV_TILES_MB if mb else DKDV_TILES)[d]
                exprs.append(dkdv_expr(dt, d, tile, True, mb))
                exprs.append(dkdv_expr(dt, d, tile, False, mb))
                exprs.append(dq_expr(dt, d, DQ_TILES[d], mb))
            if d in DKDV_TILES_LARGE_SMEM:
                for atomic in (True, False):
                    exprs.append(dkdv_expr(dt, d, DKDV_TILES_LARGE_SMEM[d], atomic, False))
            if d in DKDV_TILES_WG:  # (compiled for sm_90a at run time; elsewhere a trap)
                for atomic, mb in itertools.product((True, False), (False, True)):
                    for bias in (False, True) if mb else (False,):  # (a mask, a bias: wg_tile)
                        e = dkdv_expr(dt, d, wg_tile(d, mb, atomic, bias=bias), atomic, mb)
                        if e not in exprs:
                            exprs.append(e)
                # GQA in the kernel (group_size): the plain tiles with OPT_GROUP
                for atomic in (True, False):
                    tile = wg_tile(d, False, atomic)
                    exprs.append(dkdv_expr(dt, d, tile._replace(opt=tile.opt | OPT_GROUP),
                                           atomic, False))
                # deterministic dQ in order (ordered_tile), and the gradients in the inputs'
                # layouts (OPT_LIKE), with and without OPT_GROUP
                for atomic, group in itertools.product((True, False), (0, OPT_GROUP)):
                    tile = wg_tile(d, False, atomic)
                    orders = (0, OPT_DQ_ORDER) if atomic and tile.opt & OPT_DQ_BULK and \
                        d in ORDER_DIMS else (0,)
                    for order, like in itertools.product(orders, (0, OPT_LIKE)):
                        if order or like:
                            t = orderable(d, tile) if order else tile
                            exprs.append(dkdv_expr(dt, d, t._replace(
                                opt=t.opt | group | order | like), atomic, False))
            # the bias's gradient: the OPT_DBIAS twins of the mask / bias tiles (dbias_tile)
            if d not in DBIAS_DECLINED:
                for atomic in (True, False):
                    exprs.append(dkdv_expr(dt, d, dbias_tile(d, atomic, False), atomic, True))
                    if d in DKDV_TILES_WG:
                        exprs.append(dkdv_expr(dt, d, dbias_tile(d, atomic, True), atomic, True))
            # with score transforms: the mask / bias tiles, with or without a mask / bias
            for tf, mb, atomic in itertools.product(TRANSFORMS[1:], (False, True),
                                                    (True, False)):
                if d in NO_TRANSFORM_DIMS or (mb and d in _positional_mb_declined(tf)):
                    continue
                exprs.append(dkdv_expr(dt, d, DKDV_TILES_TF[d], atomic, mb, tf))
                if not atomic:
                    exprs.append(dq_expr(dt, d, DQ_TILES[d], mb, tf))
                if d in DKDV_TILES_WG:
                    exprs.append(dkdv_expr(dt, d, wg_tile(d, wg_modified(mb, tf), atomic,
                                                          False, tf), atomic, mb, tf))
            # with dropout (no transform): its tiles, with and without a mask / bias and dQ atomics
            for mb in ((False, True) if d in DKDV_TILES_DROPOUT else ()):
                for atomic in (True, False):
                    exprs.append(dkdv_expr(dt, d, DKDV_TILES_DROPOUT[d], atomic, mb, (), True))
                    if d in DKDV_TILES_WG:
                        exprs.append(dkdv_expr(dt, d, wg_tile(d, mb, atomic, True), atomic,
                                               mb, (), True))
                exprs.append(dq_expr(dt, d, DQ_TILES[d], mb, (), True))
        out += [(e.split("<", 1)[0], dt, int(e.split(",")[1].strip(" >")), SOURCE, e)
                for e in exprs]
        # the prep kernels (lost_rows.cu), each transform chain and dropout without one
        cols = ((64, 64), (128, 128), (256, 256))  # (COLS 2, 4, 8)
        preps = [prep_expr(dt, d, tf) for tf in TRANSFORMS for d in cols]
        preps += [prep_expr(dt, d, (), True) for d in cols]
        out += [("bwd_mma_prep", dt, None, _generic.LOST_SOURCE, e) for e in preps]
        # the lost-row fix, with dk / dv in the inputs' dtype (no sum follows) or in float32
        for tf in TRANSFORMS:
            rows, keys16 = _generic.lost_name_expressions(dt, True, tf)
            keys32 = _generic.lost_name_expressions(dt, False, tf)[1]
            out += [("bwd_lost_rows", dt, None, _generic.LOST_SOURCE, rows)]
            out += [("bwd_lost_keys", dt, None, _generic.LOST_SOURCE, k)
                    for k in (keys16, keys32)]
        # and with dropout (dk / dv in the inputs' dtype; the float32 ones are the generic path's)
        rows, keys16 = _generic.lost_name_expressions(dt, True, (), True)
        out += [("bwd_lost_rows", dt, None, _generic.LOST_SOURCE, rows),
                ("bwd_lost_keys", dt, None, _generic.LOST_SOURCE, keys16)]
    # the masks' tile classes of the dK/dV tiles with a mask
    masked = {(t.block_m, 16 * t.warps) for t in (*DKDV_TILES_MB.values(), *DKDV_TILES_TF.values(),
                                                  *DKDV_TILES_WG_MB.values(),
                                                  *DKDV_TILES_DROPOUT.values())}
    return out + [("mask_tile_classes", None, None, _mask_tiles.SOURCE,
                   _mask_tiles.expression(*shape)) for shape in sorted(masked)]


def _function(expr, smem, arch=None):
    """The RawKernel of one name expression on the current device, opted in to `smem` bytes."""
    fn = _runtime.get_function(SOURCE, expr, arch)
    _runtime.opt_in(fn, smem)
    return fn


def takes_backward(p):
    """True when the Problem fits this path; otherwise the host takes the generic backward."""
    if (p.Dk, p.Dv) not in DKDV_TILES or p.BH == 0 or p.Nq == 0 or p.Nk == 0:
        return False
    if p.bias is not None and p.bias.dtype != np.float32:
        return False
    if p.transforms and (p.Dk, p.Dv) in NO_TRANSFORM_DIMS:
        return False
    if p.dbias and (p.Dk, p.Dv) in DBIAS_DECLINED:
        return False
    if p.dropout_p and (p.transforms or (p.Dk, p.Dv) in NO_DROPOUT_DIMS):
        return False  # dropout with a score transform, or at D=96: the generic kernels
    if (p.mask is not None or p.bias is not None) and \
            (p.Dk, p.Dv) in _positional_mb_declined(_modifiers.names(p)):
        return False
    if not _mma_fwd.tensor_core_layout(p, same_dims=False):
        return False
    # grid limits of the 1-D launches
    return dkdv_blocks(p, DKDV_TILES[p.Dk, p.Dv]) < 2**31 and p.BH * -(-p.Nq // 16) < 2**31


def _dense(x):
    """Whether x's elements fill x.size consecutive elements with positive strides (a transpose
    of a C-contiguous array; axes of size 1 aside): an array of x's strides then fits one
    allocation of that size."""
    dims = sorted((s, n) for n, s in zip(x.shape, x.strides) if n != 1)
    expect = x.dtype.itemsize
    for s, n in dims:
        if s != expect:
            return False
        expect *= n
    return True


def _contiguous16(x):
    """x, or a copy of it where it is not C-contiguous with a 16-byte aligned base (its shape
    kept: the kernels read (BH, N, D) from the pointer)."""
    if x.flags.c_contiguous and not x.data.ptr % 16:
        return x
    import cupy

    x = cupy.ascontiguousarray(x)
    return x if not x.data.ptr % 16 else x.copy()


_prepared = _memo.Memo(256)
# the launches (_runtime.Launch) prep, dkdv and dq (None unless deterministic without
# OPT_DQ_ORDER); nq_pad_arg: nq_pad as the kernels' int32; out16_arg: out16 as the dkdv
# kernel's int32; group: the heads per dK/dV block (OPT_GROUP, else 1), group_arg: it as an int32;
# atomic: dQ added by the dK/dV kernel; ordered: in OPT_DQ_ORDER's order; like: the gradients in
# q's, k's and v's layouts (OPT_LIKE)
Recipe = namedtuple("Recipe", "out16 kv_dtype nq_pad prep dkdv dkdv_classes dq nq_pad_arg "
                              "out16_arg group group_arg atomic ordered like")


def _recipe(p, deterministic):
    """What a backward call of this layout launches, and how (shapes, kernels, grids)."""
    BH, Nq = p.BH, p.Nq
    dims = (p.Dk, p.Dv)
    has_mb = p.mask is not None or p.bias is not None
    names = _modifiers.names(p)
    dropout = bool(p.dropout_p)
    ordered = ordered_tile(p, dims, names, dropout) if deterministic else None
    atomic = not deterministic or ordered is not None  # dQ added by the dK/dV kernel
    tile = ordered or dkdv_tile(dims, has_mb, atomic, names, dropout, p.dbias,
                                p.bias is not None)
    nq_pad = nq_padded(Nq, tile)
    group = group_size(p) if tile.opt & OPT_WG else 1  # GQA in the kernel (OPT_GROUP)
    if group > 1:
        tile = tile._replace(opt=tile.opt | OPT_GROUP)
    # dK, dV straight in the inputs' dtype when no broadcast / GQA sum follows (each k and v
    # matrix is one output (batch, head)'s, or one kv head's with OPT_GROUP): no float32 buffers,
    # no cast passes
    out16 = group > 1 or all(_padded(x.shape[:-2], len(p.lead)) == tuple(p.lead)
                             for x in (p.k, p.v))
    # and then in q's, k's and v's own layouts where one of them is a transpose of a C-contiguous
    # array (a (B, N, H, D) view) and all are dense: no transpose for the caller to make
    # (and q not broadcast: dq is then one matrix per output (batch, head), as dk and dv are; on
    # the wgmma tiles without a modifier, dropout or dbias (OPT_LIKE): the mma.sync ones, at 255
    # registers, spilled with the stores' offsets)
    like = bool(tile.opt & OPT_WG) and out16 and not (has_mb or names or dropout or p.dbias) \
        and _padded(p.q.shape[:-2], len(p.lead)) == tuple(p.lead) \
        and all(_dense(x) for x in (p.q, p.k, p.v)) \
        and not all(x.flags.c_contiguous for x in (p.q, p.k, p.v))
    if like:
        tile = tile._replace(opt=tile.opt | OPT_LIKE)
    smem = dkdv_smem_bytes(dims, tile)
    dkdv = _runtime.Launch(
        _function(dkdv_expr(p.dtype.name, dims, tile, atomic, has_mb, names, dropout),
                  smem, dkdv_arch(tile)), (dkdv_blocks(p, tile, group),), (tile.warps * 32,),
        smem)
    # the mask's tile classes, for its key blocks of 16 * warps keys
    classes = (tile.block_m, 16 * tile.warps) if has_mb else None
    dq = None
    if not atomic:  # dq every element
        dq_tile = DQ_TILES[dims]
        dq_smem = dq_smem_bytes(dims, dq_tile)
        dq = _runtime.Launch(_function(dq_expr(p.dtype.name, dims, dq_tile, has_mb, names,
                                               dropout), dq_smem),
                             (-(-Nq // (16 * dq_tile.warps)) * BH,), (dq_tile.warps * 32,),
                             dq_smem)
    # a block of 32 rows x lost_rows.cu's PREP_LANES = 4 lanes each
    prep = _runtime.Launch(_runtime.get_function(_generic.LOST_SOURCE, prep_expr(
        p.dtype.name, dims, names, dropout)), (BH * nq_pad // 32,), (128,))
    i32 = np.int32
    return Recipe(out16, p.dtype if out16 else np.dtype(np.float32), nq_pad, prep, dkdv,
                  classes, dq, i32(nq_pad), i32(out16), group, i32(group),
                  atomic, ordered is not None, like)


class _Backward:
    """The backward of one layout, prepared (built once per Problem.key and `deterministic`):
    called with a Problem of its key and (dout, out, lse, sink_probs), the gradients per output
    (batch, head): dq (..., Nq, Dk), dk (..., Nk, Dk), dv (..., Nk, Dv) of the leading shape
    p.lead; the caller reduces and casts. dq is in the inputs' dtype (rounded from its float32
    sums by bwd_lost_keys); dk and dv are float32 where a broadcast / GQA sum follows, else
    already in the inputs' dtype (with OPT_GROUP summed over GQA's groups already: k's leading
    shape). With p.dbias also the logits' gradient (BH, Nq, Nk) float32,
    stored by the dK/dV kernel. sink_probs (with sinks): the rows' sink probabilities, which the
    lost-row fix overwrites on its rows (_gpu.backward)."""

    def __init__(self, p, deterministic):
        self.r = r = _recipe(p, deterministic)  # dkdv_tile reads the switch
        BH, Nq, Nk = p.BH, p.Nq, p.Nk
        # (with dQ atomics prep settles the lost rows: the pair's first kernel is not launched)
        self.lost = _generic.BwdLostRows(p, r.kv_dtype, True, cast_dq=True, group=r.group,
                                         like=r.like, settled=r.atomic)
        self.settle = np.int32(r.atomic)
        # scratch, one allocation: lse2, delta (BH, Nq_pad) float32 and the lost-row flags
        # (BH, ceil(Nq / 32)) int32 for lost_rows.cu, every entry written by prep; dq's float32
        # sums; the lost-row kernels' per-row doubles. The gradients in the caller's leading
        # shape (the kernels read pointers, and the caller's reshapes are then none).
        # (the kernels' own buffers: pointers, not arrays)
        padded, lead = ((BH, r.nq_pad), np.float32, _runtime.POINTER), p.lead
        # (OPT_DQ_ORDER: and the rows' turns, int32 (BH, Nq), zeroed by prep)
        turns = (BH * Nq * 4,) if r.ordered else ()
        self.scratch = _runtime.carving(padded, padded, BH * -(-Nq // 32) * 4,
                                        (lead + (Nq, p.Dk), np.float32, _runtime.POINTER),
                                        *self.lost.scratch, *turns)
        # (OPT_GROUP: dk, dv per kv head, k's leading shape)
        kv_lead = lead if r.group == 1 else _padded(p.k.shape[:-2], len(lead))
        if r.like:  # (q's, k's and v's shapes and strides)
            self.grads = _runtime.carving(*((x.shape, p.dtype, x.strides) for x in (p.q, p.k, p.v)))
        else:
            self.grads = _runtime.carving((lead + (Nq, p.Dk), p.dtype),
                                          (kv_lead + (Nk, p.Dk), r.kv_dtype),
                                          (kv_lead + (Nk, p.Dv), r.kv_dtype))
        self.args = _runtime.KeptArgs(p)

    def __call__(self, p, dout, out, lse, sink_probs=None):
        import cupy

        r = self.r
        _, _, tail = self.args(p)
        # (BH, Nq, Dv) rows to the kernels: dout in another layout copied by prep on the way
        dout, dout_src, dout_rows = _generic.dout_rows(p, dout, 16, 16)
        out = _contiguous16(out)
        if lse.dtype != np.float32 or not lse.flags.c_contiguous:
            lse = cupy.ascontiguousarray(lse, dtype=np.float32)  # (BH, Nq)
        lse2, delta, lost_flags, dq, stats, *turns = _runtime.stream_scratch(self.scratch)
        turns = turns[0] if turns else _runtime.NULL
        # (with dQ atomics prep zeroes dq, which they add into, and OPT_DQ_ORDER's turns)
        dq_zero = dq if r.atomic else _runtime.NULL
        sinks = (_runtime.NULL, _runtime.NULL) if p.sinks is None else (p.sinks, sink_probs)
        drop = _runtime.dropout_args(p)  # (DropoutArgs,) or (): this call's seed and offset
        r.prep((p.q, p.k, p.v, dout, out, lse) + tail
               + (self.lost.limit, stats, lost_flags, lse2, delta, r.nq_pad_arg, dq_zero, turns,
                  dout_src, dout_rows, self.settle) + sinks + drop)
        dq_out, dk, dv = _runtime.carved(self.grads)
        # dkdv: dk, dv every element; with dQ atomics dq += this kernel's dQ (the mask's classes
        # table must live until the launch is enqueued)
        classes, _table = (_mask_tiles.classify(p, *r.dkdv_classes) if r.dkdv_classes
                           else (_mask_tiles.NO_CLASSES, None))
        dbias = _generic.dbias_buffer(p, np.float32)  # with p.dbias: the dkdv kernel stores it
        padded = tail + (r.nq_pad_arg,)
        r.dkdv((p.q, p.k, p.v, dout, lse2, delta, dq_zero, dk, dv, classes) + padded
               + (r.out16_arg, _runtime.ptr(dbias), turns, r.group_arg) + drop)
        if r.dq is not None:
            r.dq((p.q, p.k, p.v, dout, lse2, delta, dq) + padded + drop)
        # the lost rows' gradients, then dq rounded to the inputs' dtype (dq_out)
        self.lost(p, tail, dout, out, lse, dq, dk, dv, stats, lost_flags, sink_probs, dbias,
                  dq_out)
        return (dq_out, dk, dv) if dbias is None else (dq_out, dk, dv, dbias)


def prepare_backward(p, deterministic):
    """The prepared backward of p's layout (_Backward)."""
    key = None if p.key is None else (p.key, deterministic, _runtime.overrides().wgmma)
    return _prepared.build(key, lambda: _Backward(p, deterministic))


def backward(p, dout, out, lse, deterministic=False, sink_probs=None):
    return prepare_backward(p, deterministic)(p, dout, out, lse, sink_probs)
