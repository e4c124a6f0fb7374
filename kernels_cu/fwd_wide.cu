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
//
// Requirements (the host falls back to the generic path otherwise): unit innermost stride, row
// strides, offsets and Dk, Dv multiples of 16 / sizeof(T) elements, 16-byte aligned bases,
// scale > 0.
#include "common.cuh"
#include "mask.cuh"

#include "attn_core.cuh"
#include "mma.cuh"

template <int M, int N, typename T>
__device__ __forceinline__ void zero_frags(T (&c)[M][N][4]) {
#pragma unroll
  for (int m = 0; m < M; ++m)
#pragma unroll
    for (int n = 0; n < N; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) c[m][n][e] = T(0);
}

template <typename T, int PASSES, int DK, int DV, int BLOCK_N, int NWARPS, int MF, int STAGES,
          typename Mod, int MIN_BLOCKS>
__global__ void __launch_bounds__(NWARPS * 32, MIN_BLOCKS)
fwd_wide(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
         T* __restrict__ out, T* __restrict__ lse, ATTN_INPUTS(T), const AttnArgs a,
         int* __restrict__ fix) {
  using namespace tc;
  using Tc = WideMma<T, PASSES>;
  ATTN_ARGS_LOCALS(a, T);
  constexpr bool HAS_MB = !Mod::IDENTITY;
  constexpr bool FRESH = Tc::ROUNDS_TOWARD_ZERO;  // P V summed per tile (see the loop)
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
  // Q K^T is chained through at most G k-steps, then added in T (WideMma::run's rounding)
  constexpr int G = !FRESH ? KD : KD % 8 == 0 ? 8 : KD % 6 == 0 ? 6 : KD % 4 == 0 ? 4 : 1;
  // fragment loads ahead of their product: K's (in key fragments), V's (in output fragments)
  constexpr int PK = NF / 2, PV = DF / 2;

  const int n_mtiles = (Nq + BLOCK_M - 1) / BLOCK_M;
  const long long bh = blockIdx.x / n_mtiles;
  const int i0 = (n_mtiles - 1 - static_cast<int>(blockIdx.x % n_mtiles)) * BLOCK_M;
  const int i_last = min(i0 + BLOCK_M, Nq) - 1;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int g = lane / 4, t = lane % 4;
  const int warp_row0 = warp * MF * 16;

  const Window w = head_window(kv_lens, bh, Nq, Nk, left, right, bottom_right);
  const KeyRange range = tile_key_range(w, i0, i_last);
  const int full_lo = static_cast<int>(min(key_range(w, i_last).lo, w.L));
  const int full_hi = static_cast<int>(max(key_range(w, i0).hi, -1LL));
  const Bounds32 b32 = make_bounds32(w);
  const int n_tiles = range.hi >= range.lo
                          ? static_cast<int>((range.hi - range.lo) / BLOCK_N) + 1 : 0;
  const int j_first = static_cast<int>(range.lo);
  const int j_limit = static_cast<int>(range.hi) + 1;  // keys >= j_limit load as zeros

  const T* qh = q + offsets[0 * BH + bh];
  const T* kh = k + offsets[1 * BH + bh];
  const T* vh = v + offsets[2 * BH + bh];

  extern __shared__ __align__(16) unsigned char smem_raw[];
  const u32 sQ = smem_u32(smem_raw);
  const u32 sK = sQ + BLOCK_M * PITCH_QK * E;
  const u32 sV = sK + STAGES * K_BYTES;

  if (tid == 0) fix[blockIdx.x] = 0;  // set at the end by a thread with a row to settle

  auto issue_tile = [&](int n) {
    const int buf = n % STAGES, jt = j_first + n * BLOCK_N;
    if (n < n_tiles) {
      cp_rows<BLOCK_N, DK, PITCH_QK, THREADS>(sK + buf * K_BYTES, kh, k_rs, jt, j_limit, Dk);
      cp_rows<BLOCK_N, DV, PITCH_V, THREADS>(sV + buf * V_BYTES, vh, v_rs, jt, j_limit, Dv);
    }
    cp_async_commit();
  };
  cp_rows<BLOCK_M, DK, PITCH_QK, THREADS>(sQ, qh, q_rs, i0, Nq, Dk);
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) issue_tile(s);

  MmaSoftmax<MF, T, NATURAL> sm;
  T acc[MF][DF][4];
#pragma unroll
  for (int mf = 0; mf < MF; ++mf) {
    sm.init(mf);
#pragma unroll
    for (int df = 0; df < DF; ++df)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[mf][df][e] = T(0);
  }
  const T scale_units = NATURAL ? scale : scale * log2e<T>();
  const T fold = HAS_MB ? T(1) : scale_units;
  const Mod mod = Mod::make(mask, bias, offsets, BH, bh, mask_rs, mask_cs, bias_rs, bias_cs,
                            scale_units);
  // This lane's Q rows g, g + 8 of the warp's first m-fragment, at column 2t (a k-step adds 8
  // columns, an m-fragment 16 rows).
  const u32 q_lane = sQ + ((warp_row0 + g) * PITCH_QK + 2 * t) * E;
  const int i_thr = i0 + warp_row0 + g;

  for (int n = 0; n < n_tiles; ++n) {
    const int j0 = j_first + n * BLOCK_N;
    cp_async_wait<STAGES - 2>();
    __syncthreads();  // tile n landed; everyone finished tile n - 1's buffers
    issue_tile(n + STAGES - 1);
    const u32 k_lane = sK + (n % STAGES) * K_BYTES + (g * PITCH_QK + 2 * t) * E;
    const u32 v_lane = sV + (n % STAGES) * V_BYTES + (2 * t * PITCH_V + g) * E;

    // S = Q K^T (raw dot products), step i = (k-step i / NF, key fragment i % NF). The K
    // fragment of step i + PK is loaded at step i, waiting (mma.cuh `after`) for the product on
    // its accumulator that came NF - PK steps earlier: loads PK steps ahead, never all of them at
    // the top (ptxas would hoist them all and run out of registers). Q's fragments of the next
    // k-step are loaded halfway through this one.
    T s[MF][NF][4], c[MF][NF][4];
    zero_frags(c);
    T qr[MF][4], kr[PK > 0 ? PK : 1][2];
    auto load_q = [&](int kk, u32 dep) {
#pragma unroll
      for (int mf = 0; mf < MF; ++mf) {  // (row g, 2t), (g, 2t + 1), (g + 8, 2t), (g + 8, 2t + 1)
        const u32 addr = q_lane + (mf * 16 * PITCH_QK + kk * 8) * E + dep;
        ld_shared_pair(addr, qr[mf][0], qr[mf][2]);
        ld_shared_pair(addr + 8 * PITCH_QK * E, qr[mf][1], qr[mf][3]);
      }
    };
    auto load_k = [&](int i, T(&r)[2], u32 dep) {
      ld_shared_pair(k_lane + ((i % NF) * 8 * PITCH_QK + (i / NF) * 8) * E + dep, r[0], r[1]);
    };
    load_q(0, 0);
#pragma unroll
    for (int i = 0; i < PK; ++i) load_k(i, kr[i], 0);
    typename Tc::A qa[MF];
#pragma unroll
    for (int i = 0; i < KD * NF; ++i) {
      const int kk = i / NF, nf = i % NF;
      if (nf == 0) {
#pragma unroll
        for (int mf = 0; mf < MF; ++mf) qa[mf] = Tc::make_a(qr[mf][0], qr[mf][1], qr[mf][2], qr[mf][3]);
      }
      if (nf == NF / 2 && kk + 1 < KD) load_q(kk + 1, after(c[MF - 1][NF - 1][0]));
      T kc[2];
      if (PK > 0) {
        kc[0] = kr[i % (PK > 0 ? PK : 1)][0];
        kc[1] = kr[i % (PK > 0 ? PK : 1)][1];
        if (i + PK < KD * NF) load_k(i + PK, kr[i % (PK > 0 ? PK : 1)], after(c[0][(i + PK) % NF][0]));
      } else {
        load_k(i, kc, after(c[0][nf][0]));
      }
      const typename Tc::B kb = Tc::make_b(kc[0], kc[1]);
#pragma unroll
      for (int mf = 0; mf < MF; ++mf) Tc::run(c[mf][nf], qa[mf], kb);
      if (nf == NF - 1 && (kk + 1) % G == 0) {  // the end of a rounding group: into s
#pragma unroll
        for (int mf = 0; mf < MF; ++mf)
#pragma unroll
          for (int f = 0; f < NF; ++f)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              s[mf][f][e] = kk + 1 == G ? c[mf][f][e] : s[mf][f][e] + c[mf][f][e];
              if (kk + 1 < KD) c[mf][f][e] = T(0);
            }
      }
    }

    if (HAS_MB || j0 < full_lo || j0 + BLOCK_N - 1 > full_hi) {
#pragma unroll
      for (int mf = 0; mf < MF; ++mf) mask_rows(s[mf], i_thr + mf * 16, j0, t, Nq, b32, mod);
    }

    sm.step(s, fold);  // S -> P; m, l advanced; alpha for acc

    // O = alpha O + P V, step i = (key k-step i / DF, output fragment i % DF), V's fragments PV
    // steps ahead as K's above (the first ones wait for the softmax). With three TF32 passes the
    // tile's P V is summed apart (o) and added to O in float32 (WideMma::run: a chain rounds
    // toward zero); else straight into O.
    T o[FRESH ? MF : 1][FRESH ? DF : 1][4];
#pragma unroll
    for (int mf = 0; mf < MF; ++mf)
#pragma unroll
      for (int df = 0; df < DF; ++df)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          if (FRESH) o[FRESH ? mf : 0][FRESH ? df : 0][e] = T(0);
          else acc[mf][df][e] *= sm.alpha[mf][e / 2];
        }
    auto dst = [&](int mf, int df) -> T(&)[4] {
      return FRESH ? o[FRESH ? mf : 0][FRESH ? df : 0] : acc[mf][df];
    };
    auto load_v = [&](int i, T(&r)[2], u32 dep) {
      const u32 va = v_lane + ((i / DF) * 8 * PITCH_V + (i % DF) * 8) * E + dep;
      ld_shared_one(va, r[0]);
      ld_shared_one(va + PITCH_V * E, r[1]);
    };
    T vr[PV][2];
    const u32 after_softmax = after(sm.l[MF - 1][1]);
#pragma unroll
    for (int i = 0; i < PV; ++i) load_v(i, vr[i], after_softmax);
    typename Tc::A pa[MF];
#pragma unroll
    for (int i = 0; i < NF * DF; ++i) {
      const int kk = i / DF, df = i % DF;
      if (df == 0) {
#pragma unroll
        for (int mf = 0; mf < MF; ++mf)
          pa[mf] = Tc::make_a(s[mf][kk][0], s[mf][kk][2], s[mf][kk][1], s[mf][kk][3]);
      }
      T vc[2] = {vr[i % PV][0], vr[i % PV][1]};
      if (i + PV < NF * DF) {
        const int j = i + PV;
        load_v(j, vr[i % PV], j < DF ? after_softmax : after(dst(0, j % DF)[0]));
      }
      const typename Tc::B vb = Tc::make_b(vc[0], vc[1]);
#pragma unroll
      for (int mf = 0; mf < MF; ++mf) Tc::run(dst(mf, df), pa[mf], vb);
    }
    if (FRESH) {
#pragma unroll
      for (int mf = 0; mf < MF; ++mf)
#pragma unroll
        for (int df = 0; df < DF; ++df)
#pragma unroll
          for (int e = 0; e < 4; ++e)
            acc[mf][df][e] = acc_fma(acc[mf][df][e], sm.alpha[mf][e / 2],
                                     o[FRESH ? mf : 0][FRESH ? df : 0][e]);
    }
  }
  cp_async_wait<0>();

  // Normalize once (fwd_mma's rules: an empty row 0 / -inf; l = 0 with visible keys NaN, which
  // fwd_lost_rows settles with a mask or bias; huge maxima flagged for it too).
  bool refix = false;
#pragma unroll
  for (int mf = 0; mf < MF; ++mf)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const T l_row = sm.row_sum(mf, h);
      const int i = i_thr + mf * 16 + 8 * h;
      const bool empty = row_empty(i, Nq, b32);
      const T inv_l = sm.out_scale(l_row, empty);
      refix |= HAS_MB ? !empty & !(l_row > T(0) && l_row < pos_inf<T>())
                      : !empty & (fabs(sm.m[mf][h]) > fold_limit<T>());
      if (i < Nq) {
        if (t == 0) lse[bh * Nq + i] = sm.lse(mf, h, empty, l_row);
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
