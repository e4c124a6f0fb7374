// fwd_wide.cu: the forward on tensor cores for the wide dtypes, sm_80+: float64 on DMMA (with
// the online softmax in float64), float32 on TF32 (PASSES = 3: each operand split hi + lo, a
// float32 product; PASSES = 1: one TF32 product, precision="high").
//
// fwd_mma.cu's loop in the m16n8k8 geometry of mma.cuh's WideMma. One block of NWARPS warps owns
// BLOCK_M = 16 * MF * NWARPS query rows of one (batch, head), warp w the MF m-fragments of 16 rows
// from 16 MF w (each K / V fragment it loads serves all MF). Per key tile of BLOCK_N keys:
//   S = Q K^T     A = Q, B = K, both from shared memory (Q is re-read per tile: registers would
//                 not hold it in the wide types)
//   mask_rows (visibility + modifier), MmaSoftmax<1, T>::step (S -> P; the scale folded into exp2)
//   O += P V      A = P from the S accumulators (WideMma's k order: slot t is key 2t, slot t + 4
//                 key 2t + 1), B = V rows 2t, 2t + 1 of the k-step
// K and V of a tile stream through a STAGES-deep cp.async ring. Shared rows: Q and K PITCH_QK =
// DK + 8 elements (a lane's pair loads of rows g, columns 2t at 8-byte / 16-byte granularity hit
// distinct banks), V PITCH_V = DV + 16 / sizeof(T) (rows 2t, column g: distinct banks).
// Head dims Dk <= DK, Dv <= DV (runtime; the copies zero the columns past them, so DK, DV are a
// bucket). Visibility, tile skipping and the lost-row flags are fwd_mma's: a block whose rows the
// lost-row fix (lost_rows.cu fwd_lost_rows) must settle sets fix[block]; the grid is its order.
// With a mask, its tile classes (mask_tiles.cuh, for BLOCK_M x BLOCK_N tiles; none: every tile
// mixed) let the block skip the key tiles it hides, loads included, and take no per-element mask
// on the ones it shows entirely when there is no bias.
//
// SINKS: each row's softmax takes its head's sink logit sinks[bh] (sinks.cuh), joined at its end.
//
// Requirements (the host falls back to the generic path otherwise): unit innermost stride, row
// strides, offsets and Dk, Dv multiples of 16 / sizeof(T) elements, 16-byte aligned bases,
// scale > 0.
#include "common.cuh"
#include "mask.cuh"

#include "attn_core.cuh"
#include "mask_tiles.cuh"
#include "mma.cuh"
#include "sinks.cuh"
#include "wide.cuh"

template <typename T, int PASSES, int DK, int DV, int BLOCK_N, int NWARPS, int MF, int STAGES,
          typename Mod, int MIN_BLOCKS, bool SINKS = false>
__global__ void __launch_bounds__(NWARPS * 32, MIN_BLOCKS)
fwd_wide(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
         T* __restrict__ out, T* __restrict__ lse, ATTN_INPUTS(T), const AttnArgs a,
         int* __restrict__ fix, const TileClasses classes, const double* __restrict__ sinks) {
  using namespace tc;
  using Tc = WideMma<T, PASSES>;
  ATTN_ARGS_LOCALS(a, T);
  constexpr bool HAS_MB = !Mod::IDENTITY;
  constexpr bool FRESH = Tc::ROUNDS_TOWARD_ZERO;  // P V summed per tile (wide.cuh)
  constexpr int THREADS = NWARPS * 32;
  constexpr int BLOCK_M = 16 * MF * NWARPS;
  constexpr int NF = BLOCK_N / 8;   // score n-fragments (keys) = k-steps of P V
  constexpr int DF = DV / 8;        // output n-fragments
  constexpr int KD = DK / 8;        // k-steps of Q K^T
  constexpr int PITCH_QK = DK + 8, PITCH_V = DV + 16 / static_cast<int>(sizeof(T));
  constexpr u32 E = sizeof(T);
  constexpr u32 K_BYTES = BLOCK_N * PITCH_QK * E, V_BYTES = BLOCK_N * PITCH_V * E;
  static_assert(BLOCK_N % 8 == 0 && DK % 8 == 0 && DV % 8 == 0 && STAGES >= 2, "tile shape");
  // float64 in natural units (p = exp(x - m)): its lse then needs no log2 conversion and stays
  // within a few ulp of a dense float64 computation even where |lse| is large. Mod must be in
  // the same units (MaskBiasModT<double, true>).
  constexpr bool NATURAL = sizeof(T) == 8;

  const QueryTile qt = query_tile<BLOCK_M>(Nq);
  const long long bh = qt.bh;
  const int i0 = qt.i0;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int g = lane / 4, t = lane % 4;
  const int warp_row0 = warp * MF * 16;

  const KeyTiles kt = key_tiles<BLOCK_N>(kv_lens, bh, i0, qt.i_last, Nq, Nk, left, right,
                                          bottom_right);

  const HeadQKV<T> in = head_qkv(q, k, v, offsets, BH, bh);

  u32 sQ, sK, sV;
  shared_regions(sQ, BLOCK_M * PITCH_QK * E, sK, STAGES * K_BYTES, sV);

  if (tid == 0) fix[blockIdx.x] = 0;  // set at the end by a thread with a row to settle

  // Key tile `it` spans keys [kt.j_first + it BLOCK_N, + BLOCK_N); its class (a mask only), and
  // the first tile at or after `it` that the mask does not hide. A tile's ring slot is its count
  // among the tiles visited (`seq`), not `it`.
  const TileWalk<BLOCK_N, HAS_MB> walk{HAS_MB ? class_row(classes, bh, i0 / BLOCK_M) : nullptr,
                                        kt.j_first, kt.n_tiles};
  int load_it = walk.next(0);  // the next tile to request (with a mask)
  auto issue_tile = [&](int seq) {
    const int lt = HAS_MB ? load_it : seq;  // without a mask the seq-th tile is tile seq
    const int buf = seq % STAGES, jt = kt.j_first + lt * BLOCK_N;
    if (lt < kt.n_tiles) {
      cp_rows<BLOCK_N, DK, PITCH_QK, THREADS>(sK + buf * K_BYTES, in.k, k_rs, jt, kt.j_limit, Dk);
      cp_rows<BLOCK_N, DV, PITCH_V, THREADS>(sV + buf * V_BYTES, in.v, v_rs, jt, kt.j_limit, Dv);
      if (HAS_MB) load_it = walk.next(load_it + 1);
    }
    cp_async_commit();
  };
  cp_rows<BLOCK_M, DK, PITCH_QK, THREADS>(sQ, in.q, q_rs, i0, Nq, Dk);
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) issue_tile(s);

  MmaSoftmax<MF, T, NATURAL> sm;
  T acc[MF][DF][4];
  sm.init(acc);
  const T scale_units = NATURAL ? scale : scale * log2e<T>();
  const T fold = HAS_MB ? T(1) : scale_units;
  const Mod mod = Mod::make(MOD_INPUTS(bh), scale_units, at_head(mod_args, bh, kt.w.shift));
  // This lane's Q rows g, g + 8 of the warp's first m-fragment, at column 2t (a k-step adds 8
  // columns, an m-fragment 16 rows).
  const u32 q_lane = sQ + ((warp_row0 + g) * PITCH_QK + 2 * t) * E;
  const int i_thr = i0 + warp_row0 + g;

  for (int n = 0, it = walk.next(0); it < kt.n_tiles; ++n, it = HAS_MB ? walk.next(it + 1) : n) {
    const int j0 = kt.j_first + it * BLOCK_N;
    cp_async_wait<STAGES - 2>();
    __syncthreads();  // tile n landed; everyone finished tile n - 1's buffers
    issue_tile(n + STAGES - 1);
    const u32 k_lane = sK + (n % STAGES) * K_BYTES + (g * PITCH_QK + 2 * t) * E;
    const u32 v_lane = sV + (n % STAGES) * V_BYTES + (2 * t * PITCH_V + g) * E;

    // S = Q K^T (raw dot products)
    T s[MF][NF][4];
    wide::rows_times_rows<T, PASSES, MF, NF, KD, PITCH_QK, PITCH_QK>(s, q_lane, k_lane);

    bool shown = false;  // the mask shows every key of the tile and there is no bias
    if constexpr (HAS_MB) shown = mod.bias == nullptr && walk.cls(it) == TILE_VISIBLE;
    if (shown) {
      const auto scaled = mod.shown();  // the scale (and transform) only
#pragma unroll
      for (int mf = 0; mf < MF; ++mf)
        mask_rows(s[mf], i_thr + mf * 16, j0, t, Nq, kt.b32, scaled);
    } else if (Mod::READS_INPUTS || j0 < kt.full_lo || j0 + BLOCK_N - 1 > kt.full_hi) {
#pragma unroll
      for (int mf = 0; mf < MF; ++mf) mask_rows(s[mf], i_thr + mf * 16, j0, t, Nq, kt.b32, mod);
    } else if constexpr (HAS_MB && !Mod::READS_INPUTS) {  // a transform alone, tile visible
#pragma unroll
      for (int mf = 0; mf < MF; ++mf) modify_all(s[mf], mod, i_thr + mf * 16, j0, t);
    }

    sm.step(s, fold);  // S -> P; m, l advanced; alpha for acc

    // O = alpha O + P V (rounding toward zero: P V apart, then O = fma(O, alpha, P V)); V's first
    // loads wait for the softmax.
    if (!FRESH) for_each_entry(acc, [&](T& o, int mf, int, int e) { o *= sm.alpha[mf][e / 2]; });
    wide::acc_times_rows<T, PASSES, MF, NF, DF, DF, PITCH_V>(
        acc, s, v_lane, after(sm.l[MF - 1][1]), [&](T(&o)[4], const T(&pv)[4], int mf) {
          for (int e = 0; e < 4; ++e) o[e] = acc_fma(o[e], sm.alpha[mf][e / 2], pv[e]);
        });
  }
  cp_async_wait<0>();

  // Normalize once (fwd_mma's rules: an empty row 0 / -inf; l = 0 with visible keys NaN, which
  // fwd_lost_rows settles with a mask or bias; huge finite maxima flagged for it too).
  bool refix = false;
  const T sink = SINKS ? static_cast<T>(sinks[bh]) : T(0);
#pragma unroll
  for (int mf = 0; mf < MF; ++mf)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const T l_row = sm.row_sum(mf, h);
      const int i = i_thr + mf * 16 + 8 * h;
      const bool empty = row_empty(i, Nq, kt.b32);
      T inv_l = sm.out_scale(l_row, empty);
      // Without a modifier only a finite max beyond the fold's range needs the fix-up: an
      // infinite one (every logit -inf, or a +inf logit: float32 overflow of q . k) already gives
      // the NaN of the dense float32 formula, which the fix-up's float64 would not reproduce.
      const T am = fabs(sm.m[mf][h]);
      refix |= HAS_MB ? !empty & !(l_row > T(0) && l_row < pos_inf<T>())
                      : !empty & (am > fold_limit<T>()) & (am < pos_inf<T>());
      if (i < Nq) {
        if constexpr (SINKS) {  // the sink joins the row's softmax (refix read the keys' l, m)
          T lse_row = sm.lse(mf, h, empty, l_row);
          join_sink(sink, inv_l, lse_row);
          if (t == 0) lse[bh * Nq + i] = lse_row;
        } else if (t == 0) {
          lse[bh * Nq + i] = sm.lse(mf, h, empty, l_row);
        }
        T* row = out + (bh * Nq + i) * Dv;
#pragma unroll
        for (int df = 0; df < DF; ++df) {
          const int c = df * 8 + 2 * t;
          if (c < Dv) {  // Dv is even: both columns or neither
            row[c] = acc[mf][df][2 * h] * inv_l;
            row[c + 1] = acc[mf][df][2 * h + 1] * inv_l;
          }
        }
      }
    }
  if (refix) fix[blockIdx.x] = 1;
}
