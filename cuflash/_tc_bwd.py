"""Tensor-core backward (kernels_cu/bwd_sm80.cu): tile tables, support test, launchers, backward().

float16 / bfloat16 on sm_80 and newer, Dk == Dv in HEAD_DIMS (32, 64, 96, 128). Three kernels per call:
  bwd_sm80_prep   delta = rowsum(dout * out) and lse2 = lse * log2(e) (+inf on empty rows), float32,
                  padded to Nq_pad = round_up(Nq, LSE_PAD) rows per (batch, head);
  bwd_sm80_dkdv   one block per key tile: dK, dV in registers (float32 out), and by default dQ added
                  to a zeroed float32 buffer with red.global.add (order of additions varies run to run);
  bwd_sm80_dq     only with deterministic=True: dQ recomputed per query tile with plain stores, and
                  the dkdv kernel instantiated without its dQ part: bitwise reproducible, at the cost
                  of recomputing S and dP (7 instead of 5 GEMMs per tile pair).
`backward(problem, dout, out, lse)` returns dq, dk, dv per output (batch, head) in float32, like
cuflash/_gpu.py's backward; the caller sums GQA / broadcast groups and casts.

Which dK/dV tile a call gets (table_tile): on compute capability 9.0 at head dims 64 and 128, the
wgmma form (DKDV_TILES_WG / _MB, OPT_WG: bwd_sm80_dkdv_x compiled for sm_90a, tcb::DKDV_WGMMA):
warpgroup h owns keys [64 h, 64 h + 64) of the 128-key tile, S^T, dP^T, dV and dK are warpgroup
products (wgmma_sm90.cuh) on 128-byte-swizzled tiles, dQ stays on mma.sync (at D=128 with dQ
atomics and no mask / bias, dQ runs on wgmma too: DKDV_TILES_WG_DQ); measured on the H200 (fifth
session, bench.py): 1.02-1.11x FA2 at D=64, 1.12-1.17x at D=128, where the mma.sync tiles below
were at 0.92-1.04x and 0.93-0.99x. Elsewhere: the warp-grid tile at D=128 where shared memory
allows (DKDV_TILES_LARGE_SMEM), else DKDV_TILES / DKDV_TILES_MB.

Tile table (ptxas of NVRTC 13.0 and 13.5, sm_90a and sm_80: registers / spill bytes; no H200
measurement yet: tools/tc_bwd_check.py --variants times the alternatives beside the choice).
  dkdv: BLOCK_N = 16 * WARPS keys (warp w owns 16 keys), BLOCK_M queries per step, K and V
  A-fragments re-read from shared memory by ldmatrix or held in registers (KV_IN_REGS).
    D=128 64q x 128k 8 warps K/V smem        255 / 0   (FA2's 64 x 128 tile)  <- chosen
    D=128 64q x 128k 8 warps K/V regs        255 / 24  -> rejected
    D=128 mask/bias 64q x 128k 8 warps       255 / 88  -> rejected
    D=128 mask/bias 32q x 128k 8 warps       255 / 12 with NVRTC 13.0 (0 with 13.5) -> rejected
    D=128 mask/bias 64q x 64k 4 warps        255 / 20 on sm_80 -> rejected
    D=128 mask/bias 16q x 128k 8 warps       246 / 0   <- mask/bias
    D=64  64q x 128k 8 warps K/V regs        247 / 0   (mask/bias 248 / 0)  <- chosen
    D=64  128q x 128k 8 warps (FA2's tile)   255 / 8   -> rejected
    D=96  64q x 128k 8 warps K/V smem        249 / 0;  D=32 64q x 128k K/V regs: no spills
  Register counts sit near 255 because ptxas hoists the B-fragment ldmatrix loads of the dV / dK
  products (a data dependency, as fwd_sm80.cu does for V, is the next thing to try); the live
  values are dK + dV (HEAD_DIM floats per thread) + S^T and dP^T (BLOCK_M / 2 each). One 8-warp
  block per SM (255 registers x 256 threads fill the register file).
  dq (deterministic mode): 64 query rows (4 warps) x 64 keys, 2-stage K/V ring, 2 blocks per SM,
  188-254 registers, no spills.

Candidates not yet timed (DkdvTile.opt != 0 selects bwd_sm80_dkdv_x<..., MIN_BLOCKS, OPT>, the same
body as bwd_sm80_dkdv, whose PTX is unchanged; bits OPT_*, described at tcb::DkdvOpt in
bwd_sm80.cu). All in tools/tc_bwd_check.py VARIANTS; registers / spill bytes with NVRTC 13.0,
sm_90a / sm_80, bf16 and fp16 alike, dq_atomic:
    BDEP   fake data dependency of the dV / dK B-fragment addresses on P / dS (fwd_sm80.cu's trick)
      D=128 64q x 128k 8w smem   255/0 | 253/0   D=64 64q x 128k 8w regs  248/0 | 247/0
      Result: no register relief. ptxas fills the 255 cap whatever the B loads do: the live state
      itself is ~200 registers at D=128 (dK + dV 128, S^T + dP^T 64); under a lower cap BDEP did
      not help either (D=64 64q x 64k 4w at MIN_BLOCKS 3: 12 B spill without, 8 B with;
      + BCHAIN, one k-step of B loads in flight: 20 B; + LANE_OPQ, opaque lane offsets: 28 B
      at D=128 64q x 128k, 16 B at D=64 32q x 128k MIN_BLOCKS 2).
      Prediction: within +-3 % of the plain tile (the loads now wait on exp2 / dS: slightly less
      latency hiding, slightly fewer registers live across S^T). Not expected to win.
    DQ_V4  lanes t, t^1 swap half fragments: one red.global.add.v4.f32 per 4 dQ columns instead
      of two .v2 (halves the L2 reduction requests; 2 shuffles per 8 columns)
      D=128 64q x 128k 8w smem   255/0 | 255/0   D=64 64q x 128k 8w regs  255/0 | 243/0
      D=128 64q x 128k 8w BDEP+V4 255/0 | 255/0  D=128 64q x 64k 4w MIN_BLOCKS 2  255/0 | 255/0
      Prediction: +2-6 % where the dQ reductions queue in L2 (long N, non-causal); the best bet
      among the D=128 candidates (on sm_80 it is 4 scalar reductions: no gain expected there).
    2 blocks of 8 warps at D=64 (16 warps per SM; 2 x 66 KB shared memory):
      D=64 32q x 128k 8w K/V smem MIN_BLOCKS 2        128/0 | 128/0   (plain kernel, opt 0)
      D=64 32q x 128k 8w K/V smem MIN_BLOCKS 2 V4     128/0 | 128/0
      D=64 32q x 128k 8w K/V smem MIN_BLOCKS 2 BDEP   128/0 | 128/0
      (BDEP + V4 spills 4 B on sm_80; + LANE_OPQ spills 16 B: not listed.)
      Prediction: the most promising: twice the resident warps hides the ldmatrix / mma latency
      that one 8-warp block cannot, against half as many queries per K/V reuse step (twice the
      barriers and dQ reductions per FLOP). +5-15 % at D=64 if shared-memory bandwidth is not the
      limit; V4 should matter more here (32-row tiles double the dQ reduction count).
    SWZ    K, V, Q, dO tiles in unpadded rows (HEAD_DIM * 2 bytes) with FA2's XOR swizzle of the
      16-byte chunks (chunk c of row r stored at chunk c ^ (r % 8)); every ldmatrix address of
      them XORs its column offset into a per-lane base (one LOP3 per distinct column offset:
      12 per query tile in the bf16 sm_80 SASS, kernel 1504 instructions instead of 1472). ncu
      on the H200 flagged the padded tiles' cp.async copies (144-byte rows straddle 128-byte
      lines): 2.6x the ideal shared store wavefronts, 1.5x the ideal L2 sectors. Shared memory
      83 KiB instead of 91 (D=64). MEASURED AND ADOPTED (fourth session): +2-5 % at D=64, now
      DKDV_TILES[64]; the padded tile stays in DKDV_X_TILES for A/B timing.
      D=64 64q x 128k 8w regs  dq_atomic | deterministic: sm_90a 245/0 | 249/0, sm_80 251/0 |
      250/0; mask/bias sm_90a 248/0 | 245/0, sm_80 249/0 | 244/0 (plain tile: sm_90a 246 | 241,
      sm_80 246 | 239). D=128 (K/V in shared memory) spills 8 B: not a candidate.
      Predicted: +0-5 % at D=64 if the copies' shared / L2 traffic is on the critical path.
  No D=128 tile reaches 2 blocks of 8 warps or 3 of 4 (168 cap: 32q x 64k 4w spills 224 B):
  dK + dV alone are 128 registers per thread. A D=128 gain has to come from fewer ldmatrix per mma
  (today ~0.6 x4 loads per mma per warp: each warp re-reads all of Q and dO, twice), e.g. 2 x 4
  warp grids for S^T / dP^T as FA2, which is a layout change, not a tile-table entry.

FA2-style warp grids, bwd_sm80_dkdv_g (OPT_GRID; candidates in GRID_TILES; the layout emulated by
tools/tc_bwd_emulate.py). Measured on the H200: the default at D=128 where shared memory allows
(DKDV_TILES_LARGE_SMEM, +5-7 %), slower than the table's kernel at D=64. 8 warps, 128 keys, BLOCK_M queries per step; S^T / dP^T
on a 4 (keys) x 2 (queries) warp grid, P^T and dS^T (16-bit) through shared memory, dV / dK on
4 (keys) x 2 (head-dim halves), dQ on 2 (queries) x 4 (head-dim quarters) (4 x 2 at BLOCK_M 128).
Head dims 64 and 128 without mask / bias (launch_dkdv takes the table's tile otherwise).
x4 ldmatrix per warp per 64 x 128 tile at D=128: 144 for 320 mma (today's kernel 184); at D=64 the
same 88 as today's kernel for 160 mma, hence also FA2's D=64 tile (BLOCK_M 128: 0.45 per mma).
Registers / spill bytes (NVRTC 13.0, dq_atomic | deterministic, bf16 = fp16), shared memory:
    D=128 BLOCK_M 64   sm_90a 249/0 | 251/0   sm_80 250/0 | 250/0   173 KiB (sm_90 only)
    D=128 BLOCK_M 32   sm_90a 242/0 | 239/0   sm_80 238/0 | 236/0   123 KiB
    D=64  BLOCK_M 64   sm_90a 219/0 | 215/0   sm_80 230/0 | 223/0   109 KiB
    D=64  BLOCK_M 128  sm_90a 255/0 | 255/0   sm_80 253/0 | 254/0   178 KiB (sm_90 only)
    D=64  BLOCK_M 32   sm_90a 186/0 | 177/0   sm_80 178/0 | 168/0    75 KiB
  A warp sub-tile with no visible pair (causal / window diagonals) skips its S^T / dP^T products.
  dQ ordering (2026-11-29, third session; ncu source counters on the H200, D=64 and 128 at N = 4096,
  beside FA2): the end-of-tile burst of dQ red.global.add filled the load/store queue, so the next
  query tile's cp.async (issued right after the top barrier) and every register reuse behind the
  reductions waited: 11 % of our warp samples were long-scoreboard stalls (FA2 7 %), and the
  top-of-tile barrier another 7 % in the grid kernel (FA2 4 %). Both kernels now compute dQ right
  after dS^T is shared and issue its reductions a few per k-step of the dK (grid kernel: dV and dK)
  product (tcb::dq_reduction_at). tools/tc_bwd_check.py, bf16 TFLOP/s at N = 1k / 4k / 16k,
  two runs: D=64 -1..+5 %, D=128 +1..+7 %; all reductions before dK lost 1-7 %, v4 reductions
  (DKDV_DQ_V4) with the spread lost 1-6 %. bench.py after it: 0.90-1.01x FA2 (was 0.89-1.01).
  Tried and removed: the dQ block staged in shared memory (BLOCK_M rows of HEAD_DIM + 8 floats)
  and added with one cp.reduce.async.bulk (TMA) per row at the next tile's top barrier, sm_90
  (commit e17339e, reverted): no red.global.add left, but D=64 lost 9-14 % and D=128 went
  +5 / +1 % at N = 1k and -2..-4 % at 4k / 16k (tc_bwd_check, bf16).
  Rejected: D=64 BLOCK_M 32 at 2 blocks / SM (MIN_BLOCKS 2: 16 B spill with dQ atomics, 40 B with
  opaque lane offsets), D=64 BLOCK_M 64 at 2 blocks (328 B), D=128 BLOCK_M 128 (264 B, 274 KiB).
"""
import itertools
from collections import namedtuple

import numpy as np

from . import _config, _kernels, _launch
from ._broadcast import _padded

SOURCE = "bwd_sm80.cu"
_CTYPE = {name: _config.c_types(name)[0] for name in _config.SM80_DTYPES}

# Mirrors kernels_cu/bwd_sm80.cu LSE_PAD: lse2/delta rows per (batch, head) are padded to a multiple.
LSE_PAD = 128

# opt: bwd_sm80_dkdv_x OPT bits (kernels_cu/bwd_sm80.cu tcb::DkdvOpt), 0 = the plain kernel.
DkdvTile = namedtuple("DkdvTile", "block_m warps kv_in_regs min_blocks opt", defaults=(0,))
OPT_BDEP, OPT_BCHAIN, OPT_DQ_V4, OPT_LANE_OPQ = 1, 2, 4, 8
# OPT_SWZ: K, V, Q, dO tiles in unpadded rows with FA2's XOR swizzle of the 16-byte chunks
# (tcb::DKDV_SWZ; head dims that are multiples of 64). Not combinable with OPT_GRID.
OPT_SWZ = 32
# OPT_GRID (host-side bit, not an OPT of bwd_sm80_dkdv_x): the FA2-style warp-grid kernel
# bwd_sm80_dkdv_g<T, HEAD_DIM, BLOCK_M, DQ_ATOMIC, MIN_BLOCKS> (8 warps, 128 keys, head dims 64 and
# 128, no mask / bias: with a mask or bias launch_dkdv takes the DKDV_TILES_MB tile instead).
OPT_GRID = 16
# OPT_WG: sm_90a only. The four products whose rows are keys on wgmma, 64 keys per warpgroup
# (tcb::DKDV_WGMMA, with OPT_SWZ; D=64 or 128, BLOCK_M 32 or 64, 8 warps, K / V in shared
# memory). Compiled with -arch=sm_90a (dkdv_arch).
OPT_WG = 64
# OPT_WG_DQ: with OPT_WG at D=128, BLOCK_M 64, dQ atomics, no mask / bias: dQ on wgmma too
# (tcb::DKDV_WG_DQ; DKDV_TILES_WG_DQ).
OPT_WG_DQ = 128
DqTile = namedtuple("DqTile", "block_n warps stages min_blocks")

# head dim -> tile. Instantiations: 2 dtypes x 4 head dims x 2 (HAS_MB) x 2 (deterministic) dkdv,
# plus 2 x 4 x 2 dq and 2 x 4 prep.
# D=64: swizzled K, V, Q, dO (OPT_SWZ), H200 2026-11-29 (fourth session), tools/tc_bwd_check.py
# --variants, bf16 TFLOP/s incl. prep and casts at N = 1k / 4k / 16k, non-causal | causal: the
# padded tile 170.7 / 226.4 / 254.7 | 116.7 / 199.7 / 249.6, swizzled 173.6 / 238.8 / 263.1 |
# 119.0 / 206.2 / 256.7 (+2-5 %). The mask / bias tile took it too (correctness-tested, not timed).
DKDV_TILES = {
    32: DkdvTile(64, 8, True, 1),
    64: DkdvTile(64, 8, True, 1, OPT_SWZ),
    96: DkdvTile(64, 8, False, 1),
    128: DkdvTile(64, 8, False, 1),
}
DKDV_TILES_MB = {
    32: DkdvTile(64, 8, True, 1),
    64: DkdvTile(64, 8, True, 1, OPT_SWZ),
    96: DkdvTile(64, 8, False, 1),
    128: DkdvTile(16, 8, False, 1),
}
DQ_TILES = {d: DqTile(64, 4, 2, 2) for d in (32, 64, 96, 128)}
DQ_TILES_MB = dict(DQ_TILES)
HEAD_DIMS = tuple(sorted(DKDV_TILES))
GRID_HEAD_DIMS = (64, 128)  # bwd_sm80_dkdv_g (OPT_GRID)
# Devices whose opt-in shared memory per block holds it (the H200: 227 KiB) take this tile instead
# of DKDV_TILES's at D=128 without mask / bias (H200 2026-11-29, tools/tc_bwd_check.py --variants,
# bf16 TFLOP/s incl. prep and casts at N = 1k / 4k / 16k, non-causal | causal: table 173 / 238 /
# 263 | 117 / 201 / 258; this tile 182 / 253 / 281 | 123 / 213 / 275 = +5-7 %; BLOCK_M 32: 161 /
# 216 / 235). At D=64 the grid kernel was slower (BLOCK_M 128: 159 / 214 / 237 vs 164 / 222 / 249
# non-causal; BLOCK_M 64: 151 / 203 / 221; 32: 135 / 175 / 189): the table stays.
DKDV_TILES_LARGE_SMEM = {128: DkdvTile(64, 8, False, 1, OPT_GRID)}
# Compute capability 9.0 (sm_90a code): the wgmma form of the swizzled tile (OPT_WG), with and
# without mask / bias. H200 2026-11-29 (fifth session), tools/tc_bwd_check.py --variants --wg, bf16
# TFLOP/s at N = 1k / 4k / 16k against the mma.sync table tile in the same run: non-causal
# 177.7 / 254.7 / 286.3 vs 164.8 / 232.0 / 258.9 (+8-11 %), causal 121.6 / 217.2 / 278.5 vs
# 111.9 / 199.6 / 250.0 (+9-11 %); 204-226 registers, no spills; every correctness case of the tool
# (484, D=64 fp16 and bf16 among them, all mask modes) within the same error as the table tile.
# D=128: the same kernel on blocked swizzled tiles (two 64-column blocks per tile), 64 queries per
# step (tc_bwd_check --wg, same run, bf16 at N = 1k / 4k / 16k against the warp-grid default:
# non-causal 206.3 / 305.9 / 349.7 vs 170.9 / 252.0 / 283.3, causal 129.5 / 239.0 / 337.5 vs
# 114.7 / 213.7 / 274.6: +13-23 %; 32 queries per step: 182.2 / 266.7 / 305.8 and 128.1 / 215.6 /
# 298.9). 248-255 registers, no spills, except with a mask / bias and deterministic=True (12 B): the
# mask / bias tile is the 32-query one (231-244 registers).
DKDV_TILES_WG = {64: DkdvTile(64, 8, False, 1, OPT_SWZ | OPT_WG),
                 128: DkdvTile(64, 8, False, 1, OPT_SWZ | OPT_WG)}
DKDV_TILES_WG_MB = {64: DkdvTile(64, 8, False, 1, OPT_SWZ | OPT_WG),
                    128: DkdvTile(32, 8, False, 1, OPT_SWZ | OPT_WG)}
# With dQ atomics and no mask / bias, D=128 takes dQ on wgmma too (OPT_WG_DQ: dS^T stored
# 128-byte swizzled, read as an MN-major A operand). H200 2026-11-30 (sixth session),
# tools/tc_bwd_check.py --variants --wg --dims 128, bf16 TFLOP/s incl. prep and casts at N = 1k /
# 4k / 16k against DKDV_TILES_WG[128] in the same run: non-causal 217.9 / 320.8 / 379.8 vs
# 208.0 / 300.3 / 347.3 (+5-9 %), causal 143.3 / 259.6 / 369.7 vs 138.3 / 242.3 / 343.6 (+4-8 %);
# every correctness case of the tool (928, fp16 and bf16) within the same error as the default.
# deterministic=True keeps DKDV_TILES_WG[128] (its dkdv kernel has no dQ part).
DKDV_TILES_WG_DQ = {128: DkdvTile(64, 8, False, 1, OPT_SWZ | OPT_WG | OPT_WG_DQ)}
# Tests set this to False to run the mma.sync tiles on sm_90 devices too (tests/test_gpu.py).
USE_WG = True
# Candidate tiles of bwd_sm80_dkdv_g (not used by default; tools/tc_bwd_check.py --variants checks
# and times them; tests/test_build.py compiles them): BLOCK_M 64 (FA2's hdim128 tile), 128 (FA2's
# hdim64 tile), 32.
GRID_TILES = {
    64: (DkdvTile(64, 8, False, 1, OPT_GRID), DkdvTile(128, 8, False, 1, OPT_GRID),
         DkdvTile(32, 8, False, 1, OPT_GRID)),
    128: (DkdvTile(64, 8, False, 1, OPT_GRID), DkdvTile(32, 8, False, 1, OPT_GRID)),
}
# Candidate tiles of bwd_sm80_dkdv_x (not used by default; timed by tools/tc_bwd_check.py
# --variants, which also runs them with a mask / bias, so both HAS_MB forms are build-checked):
# D=64's previous table tile, padded rows (the swizzled one replaced it), kept for A/B timing.
DKDV_X_TILES = {
    64: (DkdvTile(64, 8, True, 1),),
}


def _b(x):
    return "true" if x else "false"


def prep_expr(dtype_name, head_dim):
    return f"bwd_sm80_prep<{_CTYPE[dtype_name]}, {head_dim}>"


def dkdv_expr(dtype_name, head_dim, tile, dq_atomic, has_mb):
    """bwd_sm80_dkdv<...> for opt == 0, else the candidate kernel bwd_sm80_dkdv_x<..., opt>."""
    if tile.opt & OPT_GRID:
        if (has_mb or tile.warps != 8 or tile.kv_in_regs or head_dim not in GRID_HEAD_DIMS
                or tile.opt & OPT_SWZ):
            raise ValueError(f"bwd_sm80_dkdv_g cannot take {tile} at head dim {head_dim}"
                             f"{' with mask/bias' if has_mb else ''}")
        return (f"bwd_sm80_dkdv_g<{_CTYPE[dtype_name]}, {head_dim}, {tile.block_m}, "
                f"{_b(dq_atomic)}, {tile.min_blocks}>")
    if tile.opt & OPT_SWZ and head_dim % 64:
        raise ValueError(f"OPT_SWZ needs a head dim that is a multiple of 64, got {head_dim}")
    args = (f"{_CTYPE[dtype_name]}, {head_dim}, {tile.block_m}, {tile.warps}, "
            f"{_b(tile.kv_in_regs)}, {_b(dq_atomic)}, {_b(has_mb)}, {tile.min_blocks}")
    if tile.opt:
        return f"bwd_sm80_dkdv_x<{args}, {tile.opt}>"
    return f"bwd_sm80_dkdv<{args}>"


def dq_expr(dtype_name, head_dim, tile, has_mb):
    return (f"bwd_sm80_dq<{_CTYPE[dtype_name]}, {head_dim}, {tile.block_n}, {tile.warps}, "
            f"{tile.stages}, {_b(has_mb)}, {tile.min_blocks}>")


def dkdv_smem_bytes(head_dim, tile):
    """K, V (BLOCK_N rows) + two slots of Q, dO (BLOCK_M rows), rows padded by 8 elements; dS^T
    (BLOCK_N rows of BLOCK_M + 8); two slots of lse2 and delta (float32); OPT_GRID: + P^T (as dS^T).
    OPT_SWZ: K, V, Q, dO rows unpadded (head_dim * 2 bytes), plus one such row of slack: the kernel
    rounds its shared base up to a row (its XOR addressing needs row-aligned tile bases).
    (OPT_GRID, D=128, BLOCK_M=64: 177152 B: over sm_80's 163 KiB, so sm_90 only.)"""
    block_n = 16 * tile.warps
    swz = bool(tile.opt & OPT_SWZ)  # (never with OPT_GRID: dkdv_expr refuses it)
    row = head_dim * 2 if swz else (head_dim + 8) * 2
    ps = block_n * (tile.block_m + 8) * 2
    slack = (1024 if tile.opt & OPT_WG else row) if swz else 0  # wgmma: 1024-byte aligned tiles
    return (2 * block_n + 4 * tile.block_m) * row + ps * (2 if tile.opt & OPT_GRID else 1) \
        + 4 * tile.block_m * 4 + slack


def dkdv_arch(tile):
    """The NVRTC target a dK/dV tile needs beyond CuPy's default (OPT_WG: sm_90a), or None."""
    return "sm_90a" if tile.opt & OPT_WG else None


# NVRTC before 12.9 rejects a second -arch ("defined more than once"), and CuPy always appends
# its own after ours (_kernels.get_function); from 12.9 on, sm_90a wins in either order (checked
# with the libraries of nvidia-cuda-nvrtc-cu12 12.0-12.6, 12.8 and 12.9, and NVRTC 13.0).
WG_MIN_NVRTC = (12, 9)


def wgmma_available():
    """Whether the current device can run the OPT_WG tiles: sm_90a code runs on compute capability
    9.0 only, and CuPy's NVRTC must build it (WG_MIN_NVRTC)."""
    return _kernels.device_info().cc == 90 and _kernels.nvrtc_version() >= WG_MIN_NVRTC


def wg_tile(head_dim, has_mb, dq_atomic):
    """The wgmma dK/dV tile of a call kind, or None: with dQ atomics and no mask / bias the one
    with dQ on wgmma too where there is one (DKDV_TILES_WG_DQ), else DKDV_TILES_WG / _MB."""
    if dq_atomic and not has_mb and head_dim in DKDV_TILES_WG_DQ:
        return DKDV_TILES_WG_DQ[head_dim]
    return (DKDV_TILES_WG_MB if has_mb else DKDV_TILES_WG).get(head_dim)


def table_tile(head_dim, has_mb, dq_atomic=False):
    """The dK/dV tile for a call on the current device: the wgmma tile (wg_tile) on compute
    capability 9.0 (sm_90a code runs there only; NVRTC 12.9+ builds it), else the warp-grid tile
    where shared memory allows it, else the table's."""
    info = _kernels.device_info()
    wg = wg_tile(head_dim, has_mb, dq_atomic)
    if USE_WG and wg is not None and wgmma_available() and \
            dkdv_smem_bytes(head_dim, wg) <= info.smem_optin:
        return wg
    if not has_mb and head_dim in DKDV_TILES_LARGE_SMEM:
        big = DKDV_TILES_LARGE_SMEM[head_dim]
        if dkdv_smem_bytes(head_dim, big) <= info.smem_optin:
            return big
    return (DKDV_TILES_MB if has_mb else DKDV_TILES)[head_dim]


def grid_tile_usable(tile, head_dim, has_mb):
    """Whether the OPT_GRID kernel can run this call (else launch_dkdv takes the table's tile)."""
    return not has_mb and head_dim in GRID_HEAD_DIMS and tile.warps == 8 and not tile.kv_in_regs


def dq_smem_bytes(head_dim, tile):
    """Q, dO (16 * WARPS rows) + STAGES K and V tiles, rows padded by 8 elements."""
    return (2 * 16 * tile.warps + 2 * tile.stages * tile.block_n) * (head_dim + 8) * 2


def all_instantiations(dtypes=("float16", "bfloat16")):
    """Every name expression the host can request (for build checks without a GPU)."""
    out = []
    for dt in dtypes:
        for d in HEAD_DIMS:
            out.append(prep_expr(dt, d))
            for mb in (False, True):
                tile = (DKDV_TILES_MB if mb else DKDV_TILES)[d]
                out.append(dkdv_expr(dt, d, tile, True, mb))
                out.append(dkdv_expr(dt, d, tile, False, mb))
                out.append(dq_expr(dt, d, (DQ_TILES_MB if mb else DQ_TILES)[d], mb))
            if d in DKDV_TILES_LARGE_SMEM:
                for atomic in (True, False):
                    out.append(dkdv_expr(dt, d, DKDV_TILES_LARGE_SMEM[d], atomic, False))
            if d in DKDV_TILES_WG:  # (compiled for sm_90a at run time; elsewhere a trap)
                for atomic, mb in itertools.product((True, False), (False, True)):
                    out.append(dkdv_expr(dt, d, wg_tile(d, mb, atomic), atomic, mb))
    return out


def sm90_only_instantiations():
    """Expressions requested only on sm_90-class devices that spill on sm_80 (none: the large
    shared-memory tile is spill-free on both; it is only requested where it fits)."""
    return []


def candidate_instantiations(dtypes=("float16", "bfloat16")):
    """Name expressions of the GRID_TILES candidates (both dQ modes), of the DKDV_X_TILES
    candidates (both dQ modes, with and without mask / bias) and of the wgmma tile that
    DKDV_TILES_WG_DQ replaced with dQ atomics (tools/tc_bwd_check.py --wg times it), for
    device-free build checks."""
    grid = [dkdv_expr(dt, d, t, atomic, False) for dt in dtypes
            for d, tiles in GRID_TILES.items() for t in tiles for atomic in (True, False)]
    x = [dkdv_expr(dt, d, t, atomic, mb) for dt in dtypes for d, tiles in DKDV_X_TILES.items()
         for t in tiles for mb in (False, True) for atomic in (True, False)]
    wg = [dkdv_expr(dt, d, DKDV_TILES_WG[d], True, False) for dt in dtypes
          for d in DKDV_TILES_WG_DQ]
    return grid + x + wg


_smem_set = {}


def _function(expr, smem, arch=None):
    """The RawKernel of one name expression on the current device (compiled once, by _kernels)."""
    fn = _kernels.get_function(SOURCE, expr, arch)
    if smem > 48 * 1024 and _smem_set.get(id(fn), 0) < smem:
        fn.max_dynamic_shared_size_bytes = smem
        _smem_set[id(fn)] = smem
    return fn


def supports(p):
    """True when the Problem fits this path; otherwise the host takes the generic backward."""
    from . import _gpu

    if p.Dk not in DKDV_TILES or p.BH == 0 or p.Nq == 0 or p.Nk == 0:
        return False
    if p.bias is not None and p.bias.dtype != np.float32:
        return False
    if not _gpu.tensor_core_layout(p):
        return False
    # grid limits of the 1-D launches
    tile = DKDV_TILES[p.Dk]
    return p.BH * -(-p.Nk // (16 * tile.warps)) < 2**31 and p.BH * -(-p.Nq // 16) < 2**31


# ---- launchers (current stream; scalars typed as the C parameters) -----------------------------
_NULL = np.uint64(0)


def _main_args(offsets, mask, bias, kv_lens, q_rs, k_rs, v_rs, mask_rs, mask_cs, bias_rs,
               bias_cs, BH, Nq, Nk, Dk, Dv, scale, left, right, bottom_right, Nq_pad):
    i64, i32 = np.int64, np.int32
    return (offsets, _NULL if mask is None else mask, _NULL if bias is None else bias,
            _NULL if kv_lens is None else kv_lens,
            i64(q_rs), i64(k_rs), i64(v_rs), i64(mask_rs), i64(mask_cs), i64(bias_rs),
            i64(bias_cs), i32(BH), i32(Nq), i32(Nk), i32(Dk), i32(Dv), np.float32(scale),
            i32(left), i32(right), i32(bool(bottom_right)), i32(Nq_pad))


def launch_prep(dout, out, lse, lse2, delta, lost_flags, BH, Nq, Nq_pad, D):
    """lse2, delta (BH, Nq_pad) float32 from dout, out (BH, Nq, D) and lse (BH, Nq) float32, and
    lost_flags (BH, ceil(Nq / 32)) int32 for kernels_cu/lost_rows.cu."""
    fn = _function(prep_expr(np.dtype(dout.dtype).name, D), 0)
    threads = BH * Nq_pad * 8
    lost = np.float32(_config.lost_lse_limit(np.float32))
    fn((-(-threads // 256),), (256,),
       (dout, out, lse, lse2, delta, np.int32(BH), np.int32(Nq), np.int32(Nq_pad), lost,
        lost_flags))


def launch_dkdv(q, k, v, dout, lse2, delta, dq_acc, dk_acc, dv_acc, *, dq_atomic, tile=None,
                out16=False, **common):
    """dk_acc, dv_acc (BH, Nk, D) float32, every element (with out16: arrays of q's 16-bit dtype,
    written directly); with dq_atomic, dq_acc (BH, Nq, D) float32 (zeroed by the caller) += this
    kernel's dQ."""
    has_mb = common["mask"] is not None or common["bias"] is not None
    D = common["Dk"]
    if tile is not None and tile.opt & OPT_GRID and not grid_tile_usable(tile, D, has_mb):
        tile = None  # the grid kernel has no mask / bias: the table's tile
    if tile is not None and tile.opt & OPT_WG_DQ and (has_mb or not dq_atomic):
        tile = None  # OPT_WG_DQ is built for dQ atomics without mask / bias only
    tile = tile or table_tile(D, has_mb, dq_atomic)
    smem = dkdv_smem_bytes(D, tile)
    fn = _function(dkdv_expr(np.dtype(q.dtype).name, D, tile, dq_atomic, has_mb), smem,
                   dkdv_arch(tile))
    n_ntiles = -(-common["Nk"] // (16 * tile.warps))
    fn((n_ntiles * common["BH"],), (tile.warps * 32,),
       (q, k, v, dout, lse2, delta, dq_acc if dq_atomic else _NULL, dk_acc, dv_acc)
       + _main_args(**common) + (np.int32(bool(out16)),), shared_mem=smem)


def launch_dq(q, k, v, dout, lse2, delta, dq_acc, *, tile=None, **common):
    """dq_acc (BH, Nq, D) float32, every element, without atomics."""
    has_mb = common["mask"] is not None or common["bias"] is not None
    D = common["Dk"]
    tile = tile or (DQ_TILES_MB if has_mb else DQ_TILES)[D]
    smem = dq_smem_bytes(D, tile)
    fn = _function(dq_expr(np.dtype(q.dtype).name, D, tile, has_mb), smem)
    n_mtiles = -(-common["Nq"] // (16 * tile.warps))
    fn((n_mtiles * common["BH"],), (tile.warps * 32,),
       (q, k, v, dout, lse2, delta, dq_acc) + _main_args(**common), shared_mem=smem)


def _contiguous16(x, shape):
    """x as a C-contiguous array of `shape` whose base is 16-byte aligned (copied only if needed)."""
    import cupy

    x = cupy.ascontiguousarray(x).reshape(shape)
    if x.data.ptr % 16:
        x = x.copy()
    return x


def make_backward(p, deterministic=False, dkdv_tile=None, dq_tile=None):
    """All host preparation (offset tables) done once; returns run(dout, out, lse) -> (dq, dk, dv).
    Everything run() does is device work on the current stream (for timing)."""
    import cupy

    from . import _gpu

    args = _gpu._Args(p)
    common = args.common(p)
    BH, Nq, Nk, D = p.BH, p.Nq, p.Nk, p.Dk
    # dK, dV straight in the inputs' dtype when no broadcast / GQA sum follows (each k and v
    # matrix is one output (batch, head)'s): no float32 buffers, no cast passes
    out16 = all(_padded(x.shape[:-2], len(p.lead)) == tuple(p.lead) for x in (p.k, p.v))
    kv_dtype = p.dtype if out16 else np.float32
    Nq_pad = -(-Nq // LSE_PAD) * LSE_PAD
    common["Nq_pad"] = Nq_pad

    def run(dout, out, lse):
        with p.q.device:
            dout = _contiguous16(dout, (BH, Nq, D))
            out = _contiguous16(out, (BH, Nq, D))
            lse = cupy.ascontiguousarray(lse.astype(np.float32, copy=False)).reshape(BH, Nq)
            lse2 = _gpu._empty((BH, Nq_pad), dtype=np.float32)  # every row written by prep
            delta = _gpu._empty((BH, Nq_pad), dtype=np.float32)
            lost_flags = cupy.empty((BH, -(-Nq // 32)), dtype=np.int32)  # all written by prep
            launch_prep(dout, out, lse, lse2, delta, lost_flags, BH, Nq, Nq_pad, D)
            if deterministic:
                dq = _gpu._empty((BH, Nq, D), dtype=np.float32)
            else:
                dq = cupy.zeros((BH, Nq, D), dtype=np.float32)
            dk = _gpu._empty((BH, Nk, D), dtype=kv_dtype)
            dv = _gpu._empty((BH, Nk, D), dtype=kv_dtype)
            launch_dkdv(p.q, p.k, p.v, dout, lse2, delta, dq, dk, dv,
                        dq_atomic=not deterministic, tile=dkdv_tile, out16=out16, **common)
            if deterministic:
                launch_dq(p.q, p.k, p.v, dout, lse2, delta, dq, tile=dq_tile, **common)
            _launch.launch_lost(p.q, p.k, p.v, dout, out, lse, dq, dk, dv, flags=lost_flags,
                                **common)
            return dq, dk, dv

    return run


def backward(p, dout, out, lse, deterministic=False):
    """Gradients of a validated Problem on this path: dq (BH, Nq, Dk), dk (BH, Nk, Dk),
    dv (BH, Nk, Dv), per output (batch, head); the caller reduces and casts. dq is float32; dk and
    dv are float32 where a broadcast / GQA sum follows, else already in the inputs' dtype."""
    with p.q.device:
        return make_backward(p, deterministic)(dout, out, lse)
