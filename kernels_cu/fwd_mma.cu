// fwd_mma.cu: FlashAttention-2-class forward on tensor cores (mma.sync), float16 / bfloat16, sm_80+.
//
// One block of NWARPS warps owns BLOCK_M = 16 * MF * NWARPS query rows of one (batch, head); warp w
// owns the MF m-fragments (16 rows each) starting at row 16 * MF * w. Per key tile of BLOCK_N keys:
//   S = Q K^T      mma.sync m16n8k16, A = Q (ldmatrix from shared, or registers), B = K (ldmatrix)
//   online softmax on the S accumulators in registers (exp2, log2(e) folded into the scale)
//   O += P V       A = P packed from the S accumulators (no shared round trip), B = V (ldmatrix.trans)
// K and V tiles stream through a STAGES-deep cp.async ring (16-byte copies, zero-filled past the
// last needed key); shared rows are padded by 16 bytes so every ldmatrix phase is conflict-free.
// Key tiles outside the block's visible range are never visited; tiles entirely visible to every
// row of the block skip the per-element predicate; the others apply it (mask.cuh's key_range).
// With a boolean mask or a bias (HAS_MB) every tile takes the per-element path.
//
// Requirements (the host falls back to the generic path otherwise): Dk == Dv == HEAD_DIM, unit
// innermost stride, row strides and offsets multiples of 8 elements, 16-byte aligned bases, scale > 0.
#include "common.cuh"
#include "mask.cuh"

#include "attn_core.cuh"
#include "mma.cuh"
#include "sinks.cuh"
#include "philox.cuh"
#include "lost_rows.cuh"

// One K or V tile copy: cp_tile, or cp_tile_inc with CHEAP_ADDR.
template <bool CHEAP, int ROWS, int HEAD_DIM, int THREADS, typename T>
__device__ __forceinline__ void fwd_copy(tc::u32 dst, const T* __restrict__ src, long long rs,
                                         int row0, int limit) {
  if constexpr (CHEAP && THREADS % (HEAD_DIM / 8) == 0)
    tc::cp_tile_inc<ROWS, HEAD_DIM, THREADS>(dst, src, rs, row0, limit);
  else
    tc::cp_tile<ROWS, HEAD_DIM, THREADS>(dst, src, rs, row0, limit);
}

// Grid: attn_core.cuh's query_tile (1-D, blockIdx.x = bh * n_mtiles + reversed query tile).
//
// SINKS: each row's softmax takes its head's sink logit sinks[bh] (sinks.cuh), joined at its end;
// sinks is not read without. Drop: empty, or DropoutArgs (philox.cuh): P's dropped entries are
// zeroed after the softmax step (l stays the undropped sum), 1 / (1 - p) joins the end's factor.
//
// Two measured choices per tile (cuflash/_config.py FwdTile):
//   CHEAP_ADDR  K/V copies with incremental addresses (cp_tile_inc: one 64-bit add per copy
//               instead of a 64-bit row * stride product and parameter reloads);
//   KV_SPLIT    K and V of a tile in separate cp.async groups (issued together): the loop waits
//               only for K before S = Q K^T, and for V (plus a second barrier) right after it,
//               so V's copy overlaps Q K^T.
template <typename T, int HEAD_DIM, int BLOCK_M, int BLOCK_N, int NWARPS, int STAGES,
          bool Q_IN_REGS, typename Mod, int MIN_BLOCKS, bool CHEAP_ADDR, bool KV_SPLIT,
          typename LostF = NoTransform, bool SINKS = false, typename... Drop>
__global__ void __launch_bounds__(NWARPS * 32, MIN_BLOCKS)
fwd_mma(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
        T* __restrict__ out, float* __restrict__ lse, ATTN_INPUTS(float), const AttnArgs a,
        double lost, const double* __restrict__ sinks, const Drop... drop) {
  using namespace tc;
  ATTN_ARGS_LOCALS(a, float);
  // HAS_MB: the score modifier works on every element; READS: it reads a mask or bias there (a
  // score transform alone spares the tiles visible by position the position test)
  constexpr bool HAS_MB = !Mod::IDENTITY, READS = Mod::READS_INPUTS;
  constexpr int THREADS = NWARPS * 32;
  constexpr int MF = BLOCK_M / (16 * NWARPS);  // m-fragments per warp
  constexpr int NF = BLOCK_N / 8;              // score n-fragments (keys)
  constexpr int DF = HEAD_DIM / 8;             // output n-fragments (head dim)
  constexpr int KD = HEAD_DIM / 16;            // k-steps of Q K^T
  constexpr int KN = BLOCK_N / 16;             // k-steps of P V
  constexpr int ROW_BYTES = (HEAD_DIM + 8) * 2;
  constexpr int TILE_BYTES = BLOCK_N * ROW_BYTES;
  static_assert(MF >= 1 && MF * 16 * NWARPS == BLOCK_M, "BLOCK_M must be 16 * MF * NWARPS");
  static_assert(BLOCK_N % 16 == 0 && HEAD_DIM % 16 == 0, "tile shape");
  static_assert(STAGES >= 2, "cp.async ring depth");

  const QueryTile qt = query_tile<BLOCK_M>(Nq);
  const long long bh = qt.bh;
  const int i0 = qt.i0;

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int g = lane / 4, t = lane % 4;  // mma fragment coordinates: row g (+8), columns 2t, 2t+1
  const int warp_row0 = warp * MF * 16;

  // The key tiles the block visits; those not entirely visible to it take the per-element test.
  const KeyTiles kt = key_tiles<BLOCK_N>(kv_lens, bh, i0, qt.i_last, Nq, Nk, left, right,
                                          bottom_right);

  const HeadQKV<T> in = head_qkv(q, k, v, offsets, BH, bh);

  u32 sQ, sK, sV;
  shared_regions(sQ, BLOCK_M * ROW_BYTES, sK, STAGES * TILE_BYTES, sV);

  // Per-lane ldmatrix offsets (see the m16n8k16 fragment layouts):
  //  Q (A, x4): lane -> row lane % 16, column 8 * (lane / 16)
  //  K (B, x4 over two key fragments): row (lane % 8) + 8 * (lane / 16), column 8 * ((lane / 8) % 2)
  //  V (B, x4.trans over two dim fragments): row (lane % 8) + 8 * ((lane / 8) % 2), col 8 * (lane / 16)
  // (K and V offsets are formed inside the key loop, see there.)
  const u32 q_lane = sQ + (warp_row0 + lane % 16) * ROW_BYTES + (lane / 16) * 16;

  // Key tile t's K and V into ring slot t % STAGES (nothing past the last tile), as one commit
  // group, or as two (K, then V) with KV_SPLIT.
  auto issue_tile = [&](int t) {
    const int buf = t % STAGES;
    const int jt = kt.j_first + t * BLOCK_N;
    if (t < kt.n_tiles)
      fwd_copy<CHEAP_ADDR, BLOCK_N, HEAD_DIM, THREADS>(sK + buf * TILE_BYTES, in.k, k_rs, jt,
                                                       kt.j_limit);
    if (KV_SPLIT) cp_async_commit();
    if (t < kt.n_tiles)
      fwd_copy<CHEAP_ADDR, BLOCK_N, HEAD_DIM, THREADS>(sV + buf * TILE_BYTES, in.v, v_rs, jt,
                                                       kt.j_limit);
    cp_async_commit();
  };
  // Prologue: Q with the first key tile, then STAGES - 2 more tiles. Commit groups:
  // [Q K0 V0] [K1 V1] ..., or with KV_SPLIT [Q K0] [V0] [K1] [V1] ...
  cp_tile<BLOCK_M, HEAD_DIM, THREADS>(sQ, in.q, q_rs, i0, Nq);
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) issue_tile(s);

  // Row state (DESIGN.md "Empty state"): the online softmax of this thread's rows g and g + 8 of
  // each m-fragment (h = 0, 1), and acc = 0.
  MmaSoftmax<MF> sm;
  float acc[MF][DF][4];
  sm.init(acc);
  // With a mask or bias the logits are formed explicitly in log2 units by the score modifier
  // (s * scale * log2e + bias * log2e); otherwise the scale is folded into the exponent's FFMA.
  const float scale_log2 = scale * LOG2E;
  const float sl2 = HAS_MB ? 1.f : scale_log2;
  const Mod mod = Mod::make(MOD_INPUTS(bh), scale_log2, at_head(mod_args, bh, kt.w.shift));
  const auto dz = dropout_at<float>(bh, drop...);  // philox.cuh: none without a DropoutArgs

  u32 qreg[Q_IN_REGS ? MF : 1][Q_IN_REGS ? KD : 1][4];

  for (int n = 0; n < kt.n_tiles; ++n) {
    const int j0 = kt.j_first + n * BLOCK_N;  // first key of this tile
    // KV_SPLIT: committed so far [.. K(n) V(n) .. K(n+S-2) V(n+S-2)]: K(n) is complete when at
    // most 2S - 3 groups are pending. Otherwise tile n is complete when S - 2 are.
    if (KV_SPLIT) cp_async_wait<2 * STAGES - 3>();
    else cp_async_wait<STAGES - 2>();
    __syncthreads();  // K (and V) of tile n landed; everyone finished tile n - 1's buffers
    issue_tile(n + STAGES - 1);
    if (Q_IN_REGS && n == 0) {
#pragma unroll
      for (int mf = 0; mf < MF; ++mf)
#pragma unroll
        for (int kk = 0; kk < KD; ++kk)
          ldsm_x4(q_lane + mf * 16 * ROW_BYTES + kk * 32, qreg[Q_IN_REGS ? mf : 0][Q_IN_REGS ? kk : 0]);
    }

    // The lane offsets are recomputed per step from an opaque lane index (a few integer ops):
    // kept live through the loop they cost the 128 x 64 tile a spilled register.
    const int ln = opaque(lane);
    const u32 kbuf = sK + (n % STAGES) * TILE_BYTES +
                     (ln % 8 + 8 * (ln / 16)) * ROW_BYTES + ((ln / 8) % 2) * 16;
    const u32 vbuf = sV + (n % STAGES) * TILE_BYTES +
                     (ln % 8 + 8 * ((ln / 8) % 2)) * ROW_BYTES + (ln / 16) * 16;

    // S = Q K^T (raw dot products, fp32).
    float s[MF][NF][4];
    zero(s);
#pragma unroll
    for (int kk = 0; kk < KD; ++kk) {
      u32 qa[MF][4];
#pragma unroll
      for (int mf = 0; mf < MF; ++mf) {
        if (Q_IN_REGS) {
#pragma unroll
          for (int e = 0; e < 4; ++e) qa[mf][e] = qreg[Q_IN_REGS ? mf : 0][Q_IN_REGS ? kk : 0][e];
        } else {
          ldsm_x4(q_lane + mf * 16 * ROW_BYTES + kk * 32, qa[mf]);
        }
      }
      mma_kstep<T, false, 16 * ROW_BYTES>(s, qa, kbuf + kk * 32);
    }

    // KV_SPLIT: V of this tile, waited for only after S = Q K^T (as FlashAttention-2 does;
    // waiting after the softmax instead holds the scores across the barrier and spills).
    if (KV_SPLIT) {
      // Committed: up to V(n + S - 1); V(n) is complete when at most 2S - 2 groups are pending.
      cp_async_wait<2 * STAGES - 2>();
      __syncthreads();  // V of tile n landed for everyone
    }

    // Mask by global position, only in steps not entirely visible to the block.
    if (READS || j0 < kt.full_lo || j0 + BLOCK_N - 1 > kt.full_hi) {
      // The row bounds are recomputed here from an opaque row index: hoisted out of the key loop,
      // 2 * MF * 2 loop invariants would stay live through every tile and spill at 128 x 64.
      const int i_thr = opaque(i0 + warp_row0 + g);
#pragma unroll
      for (int mf = 0; mf < MF; ++mf) {
        mask_rows(s[mf], i_thr + mf * 16, j0, t, Nq, kt.b32, mod);
      }
    } else if constexpr (HAS_MB && !READS) {
      // the rows for a POSITIONAL transform, opaque as above (none without one)
      const int i_thr = Mod::POSITIONAL ? opaque(i0 + warp_row0 + g) : 0;
#pragma unroll
      for (int mf = 0; mf < MF; ++mf) modify_all(s[mf], mod, i_thr + mf * 16, j0, t);
    }

    sm.step(s, sl2);  // S -> P; m, l rescaled and advanced
    if constexpr (decltype(dz)::ON) {  // dropout on P V only (l above is the undropped sum)
      const int i_thr = opaque(i0 + warp_row0 + g);
#pragma unroll
      for (int mf = 0; mf < MF; ++mf) drop_rows(s[mf], dz, i_thr + mf * 16, j0, t);
    }

    // O += P V with P packed straight from the score accumulators into A fragments; acc's rescale
    // sits next to the first product that consumes it. The V addresses take a data
    // dependency on the softmax (l >= 0, so the sign bit is 0; a NaN input shifts by one aligned
    // 16-byte chunk): without it ptxas hoists every V ldmatrix above the softmax and the MF = 2
    // tiles spill.
    const u32 vdep = (__float_as_uint(sm.l[MF - 1][1]) >> 31) << 4;
    const u32 vbuf_dep = vbuf + vdep;
#pragma unroll
    for (int kk = 0; kk < KN; ++kk) {
      u32 pa[MF][4];
#pragma unroll
      for (int mf = 0; mf < MF; ++mf) {
        acc_to_a<T>(s[mf][2 * kk], s[mf][2 * kk + 1], pa[mf]);
      }
#pragma unroll
      for (int p = 0; p < DF / 2; ++p) {
        u32 vb[4];
        ldsm_x4_t(vbuf_dep + kk * 16 * ROW_BYTES + p * 32, vb);
#pragma unroll
        for (int mf = 0; mf < MF; ++mf) {
          if (kk == 0) sm.rescale(acc[mf][2 * p], acc[mf][2 * p + 1], mf);  // O *= alpha
          Mma<T>::run2(acc[mf][2 * p], acc[mf][2 * p + 1], pa[mf], vb);
        }
      }
    }
  }

  // Every copy (Q included, when no tile was visited) has landed before Q's rows are reused.
  cp_async_wait<0>();
  __syncthreads();

  // Normalize once. A row with no visible key is empty: out = 0, lse = -inf. One that sees keys
  // but has l = 0 (every visible logit -inf) is 0 / 0 = NaN, like a NaN l. With a mask or bias
  // "sees keys" is known by position only: a row with l = 0 there may also be one whose keys are
  // all masked (empty), so it is written NaN and fwd_fix_rows (kernels_cu/lost_rows.cuh, at the
  // end), which rechecks every NaN row, tells the two apart. With SINKS the row's sink then joins its factor
  // and lse (sinks.cuh join_sink: an empty row becomes 0 / t, a NaN one stays NaN). The warp
  // stages its own rows of the output in its own rows of the Q tile, then writes them with
  // 16-byte stores.
  bool refix = false;  // a row only double settles (fwd_fix_rows, at the end)
  const float sink = SINKS ? static_cast<float>(sinks[bh]) : 0.f;
#pragma unroll
  for (int mf = 0; mf < MF; ++mf)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float l_row = sm.row_sum(mf, h);
      const int r = warp_row0 + mf * 16 + g + 8 * h;
      const int i = i0 + r;
      const bool empty = row_empty(i, Nq, kt.b32);  // by position
      float inv_l = dz.scaled(sm.out_scale(l_row, empty));  // (dropout: times 1 / (1 - p))
      // HAS_MB: l = 0 may be an all-masked row, and l = 0, NaN or inf a bias that overflowed in
      // log2 units (|bias| > FLT_MAX / log2e); else a max beyond the folded FFMA's accuracy
      refix |= HAS_MB ? !empty & !(l_row > 0.f && l_row < pos_inf<float>())
                      : !empty & (fabsf(sm.m[mf][h]) > FOLD_LIMIT);  // (an infinite m: NaN anyway)
      if constexpr (SINKS) {  // the sink joins the row's softmax (refix read the keys' l, m)
        float lse_row = sm.lse(mf, h, empty, l_row);
        join_sink(sink, inv_l, lse_row);
        if (t == 0 && i < Nq) lse[bh * Nq + i] = lse_row;
      } else if (t == 0 && i < Nq) {
        lse[bh * Nq + i] = sm.lse(mf, h, empty, l_row);
      }
      const u32 row_addr = sQ + r * ROW_BYTES + 4 * t;
#pragma unroll
      for (int df = 0; df < DF; ++df) {
        const u32 packed =
            Mma<T>::pack(acc[mf][df][2 * h] * inv_l, acc[mf][df][2 * h + 1] * inv_l);
        asm volatile("st.shared.b32 [%0], %1;" ::"r"(row_addr + df * 16), "r"(packed) : "memory");
      }
    }
  __syncwarp();
  constexpr int CPR = HEAD_DIM / 8;
#pragma unroll
  for (int idx = lane; idx < MF * 16 * CPR; idx += 32) {
    const int r = idx / CPR, c = idx % CPR;
    const int i = i0 + warp_row0 + r;
    if (i < Nq) {
      uint4 val;
      asm volatile("ld.shared.v4.b32 {%0,%1,%2,%3}, [%4];"
                   : "=r"(val.x), "=r"(val.y), "=r"(val.z), "=r"(val.w)
                   : "r"(sQ + (warp_row0 + r) * ROW_BYTES + c * 16) : "memory");
      *reinterpret_cast<uint4*>(out + (bh * Nq + i) * HEAD_DIM + c * 8) = val;
    }
  }
  // The rows the float arithmetic could not settle (refix): once every warp's rows are written,
  // each warp rechecks 32 of the block's rows and recomputes those in double (lost_rows.cuh
  // fwd_fix_rows, the transform F in double: LostF), as fwd_lost_rows does after the kernels that
  // flag blocks instead. (Warp 0 alone, for all rows, spilled the 4-warp tiles at 255 registers.)
  if (__syncthreads_or(refix)) {
    // this block's rows only (8-warp or 64-row tiles: some warps have none; r1 <= r0: none)
    const int end = i0 + BLOCK_M < Nq ? i0 + BLOCK_M : Nq;
    const int r0 = i0 + 32 * warp, r1 = r0 + 32 < end ? r0 + 32 : end;
    fwd_fix_rows<T, float, LostF>(q, k, v, out, lse, offsets, mask, bias, kv_lens, a, lost,
                                  bh * Nq + r0, bh * Nq + r1, SINKS ? sinks : nullptr, drop...);
  }
}
