// bwd_wide.cu: the backward on tensor cores for the wide dtypes (fwd_wide.cu's arithmetic: float32
// on TF32 with PASSES = 3 or 1, float64 on DMMA in natural units), sm_80+. Two kernels and no
// atomics, so the gradients are bitwise the same run to run:
//   bwd_wide_dkdv  one block per key tile (16 MF keys per warp), over the query tiles that can see
//                  it (mask.cuh tile_query_range), Q and dO streaming through a cp.async ring:
//                    S^T = K Q^T, P^T = exp(S^T - lse), dP^T = V dO^T, dS^T = P^T (dP^T - delta)
//                    dV += P^T dO,  dK += dS^T Q        (dK scaled once at the end)
//   bwd_wide_dq    one block per query tile, over the key tiles it sees (fwd_wide's loop):
//                    S = Q K^T, P, dP = dO V^T, dS,  dQ += dS K
//                  (and with DBIAS, P (dP - delta) stored per pair: attn_core.cuh
//                  store_dbias)
// Seven products where a kernel with dQ atomics has five; in exchange no dS round trip through
// shared memory and no atomics. Products: wide.cuh (rows_times_rows for S and dP in both
// orientations, acc_times_rows for the three accumulating ones).
//
// Logits, lse and the modifier (MaskBiasModT<T, true>) in natural units (prob). lse and delta
// come from bwd_generic.cu's bwd_preprocess (the accumulator dtype):
// lost rows have lse = +inf and delta = 0 (lost_rows.cu adds their gradients afterwards); an
// empty row's lse (-inf) is read as +inf, and so are query rows past Nq or past the block's
// range: P = exp(x - inf) = 0 for every x but NaN. A NaN lse gives NaN, as the dense formula.
// Keys past kv_lens are never read (zero-filled); rows of keys past the last visible one get
// dK = dV = 0 from P = 0.
//
// A mask's tile classes (mask_tiles.cuh; one table per kernel, for its own tiles) skip the steps
// it hides, copies included, and give the ones it shows entirely (without bias) only the scale
// and the position mask; a dK/dV block then starts its query steps at a multiple of BLOCK_M, the
// classes' query tiles.
//
// Requirements: fwd_wide's (16-byte rows of q, k, v; dout contiguous (BH, Nq, Dv) and 16-byte
// aligned), scale > 0.
#include "common.cuh"
#include "mask.cuh"

#include "attn_core.cuh"
#include "mask_tiles.cuh"
#include "mma.cuh"
#include "wide.cuh"

// lse of query row i, +inf where the row contributes nothing here.
template <typename T>
__device__ __forceinline__ T row_lse(const T* __restrict__ lse, long long row, bool real) {
  const T l = real ? lse[row] : pos_inf<T>();
  return l == neg_inf<T>() ? pos_inf<T>() : l;
}

// P = exp(logit - lse) from a raw score s (HAS_MB: the modifier's logit, natural units). The
// difference is formed in natural units, as the forward's lse is: float32 then takes exp2 of it
// times log2(e), so P's error is that of the difference, not of |lse| log2(e) rounded.
template <bool HAS_MB, typename T>
__device__ __forceinline__ T prob(T s, T scale, T lse) {
  const T d = HAS_MB ? s - lse : acc_fma(s, scale, -lse);
  return sizeof(T) == 8 ? acc_exp(d) : exp2_acc(d * log2e<T>());
}

// Rows of an accumulator tile of this lane (MF m-fragments from row r0; columns from c0) to a
// (rows, cols) matrix in global memory, times `scale`: rows < rows_limit, columns < cols.
template <int MF, int DF, typename T>
__device__ __forceinline__ void store_rows(T* __restrict__ out, const T (&acc)[MF][DF][4],
                                           int r0, int rows_limit, int cols, T scale,
                                           int c0 = 0) {
  const int g = threadIdx.x % 32 / 4, t = threadIdx.x % 4;
  tc::for_frag_rows<MF>(r0, g, [&](int mf, int h, int r) {
    if (r >= rows_limit) return;
#pragma unroll
    for (int df = 0; df < DF; ++df) {
      const int c = c0 + df * 8 + 2 * t;
      if (c < cols) {  // cols is even: both columns or neither
        out[static_cast<long long>(r) * cols + c] = acc[mf][df][2 * h] * scale;
        out[static_cast<long long>(r) * cols + c + 1] = acc[mf][df][2 * h + 1] * scale;
      }
    }
  });
}

template <typename T>
struct AddTo {  // acc_times_rows' combine for a plain sum
  template <typename Any>
  __device__ __forceinline__ void operator()(T (&a)[4], const T (&o)[4], Any) const {
#pragma unroll
    for (int e = 0; e < 4; ++e) a[e] += o[e];
  }
};

// Grid: 1-D, blockIdx.x = (bh * n_ntiles + key tile) * PARTS + part (the first key tiles, which
// the most queries see when causal, first). BLOCK_M query rows per step. PARTS > 1: each block
// accumulates the part-th of PARTS column slices of dK and dV only (their accumulators would not
// fit in registers whole: float64 at 128), recomputing S^T and dP^T whole.
template <typename T, int PASSES, int DK, int DV, int BLOCK_M, int NWARPS, int MF, int STAGES,
          typename Mod, int MIN_BLOCKS, int PARTS>
__global__ void __launch_bounds__(NWARPS * 32, MIN_BLOCKS)
bwd_wide_dkdv(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
              const T* __restrict__ dout, const T* __restrict__ lse, const T* __restrict__ delta,
              T* __restrict__ dk, T* __restrict__ dv, ATTN_INPUTS(T), const AttnArgs a,
              const TileClasses classes) {
  using namespace tc;
  ATTN_ARGS_LOCALS(a, T);
  constexpr bool HAS_MB = !Mod::IDENTITY, GR = Mod::HAS_GRAD;
  constexpr int THREADS = NWARPS * 32;
  constexpr int BLOCK_N = 16 * MF * NWARPS;  // keys of this block
  constexpr int NQ = BLOCK_M / 8;            // query fragments = k-steps of dV, dK
  constexpr int KDK = DK / 8, KDV = DV / 8;
  constexpr int DFK = DK / 8 / PARTS, DFV = DV / 8 / PARTS;  // this block's column slices
  constexpr int PK = DK + 8, PV = DV + 8;  // every tile: rows read by pairs (wide.cuh)
  constexpr u32 E = sizeof(T);
  constexpr u32 Q_BYTES = BLOCK_M * PK * E, DO_BYTES = BLOCK_M * PV * E;
  // output fragments per acc_times_rows pass (rounding toward zero): its o temporaries
  constexpr int DG = DK >= 96 ? 2 : 4;
  static_assert(BLOCK_M % 8 == 0 && STAGES >= 2 && DFK % DG == 0 && DFV % DG == 0 &&
                DK % (8 * PARTS) == 0 && DV % (8 * PARTS) == 0, "tile shape");

  const int n_ntiles = (Nk + BLOCK_N - 1) / BLOCK_N;
  const int part = static_cast<int>(blockIdx.x % PARTS);
  const long long bh = blockIdx.x / PARTS / n_ntiles;
  const int j0 = static_cast<int>(blockIdx.x / PARTS % n_ntiles) * BLOCK_N;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int g = lane / 4, t = lane % 4;
  const int warp_row0 = warp * MF * 16;

  const Window w = head_window(kv_lens, bh, Nq, Nk, left, right, bottom_right);
  const KeyRange qr = tile_query_range(w, j0, j0 + BLOCK_N - 1, Nq);
  const Bounds32 b32 = make_bounds32(w);
  const int i_first = HAS_MB ? static_cast<int>(qr.lo) / BLOCK_M * BLOCK_M  // classes' tiles
                             : static_cast<int>(qr.lo);
  const int n_steps = qr.hi >= qr.lo ? static_cast<int>((qr.hi - i_first) / BLOCK_M) + 1 : 0;
  const int i_limit = static_cast<int>(qr.hi) + 1;
  const int key_limit = static_cast<int>(w.L);  // keys past kv_lens are never read

  const HeadQKV<T> in = head_qkv(q, k, v, offsets, BH, bh);
  const T* doh = dout + bh * Nq * Dv;

  u32 sK, sV, sQ, sdO;
  shared_regions(sK, BLOCK_N * PK * E, sV, BLOCK_N * PV * E, sQ, STAGES * Q_BYTES, sdO);

  // The class of step `st` (rows [i_first + st BLOCK_M, + BLOCK_M) against this block's keys),
  // and the first step at or after `st` the mask does not hide; a step's ring slot is its count
  // among the steps visited (`seq`).
  const ClassColumn cc = HAS_MB ? class_column(classes, bh, j0 / BLOCK_N) : ClassColumn{nullptr, 0};
  auto step_cls = [&](int st) {
    return cc.column != nullptr ? int(cc.column[(i_first / BLOCK_M + st) * cc.step])
                                : int(TILE_MIXED);
  };
  auto next_step = [&](int st) {
    if (HAS_MB)
      while (st < n_steps && step_cls(st) == TILE_HIDDEN) ++st;
    return st;
  };
  int load_st = next_step(0);  // the next step to request (with a mask)
  auto issue_step = [&](int seq) {
    const int ls = HAS_MB ? load_st : seq;
    const int buf = seq % STAGES, it = i_first + ls * BLOCK_M;
    if (ls < n_steps) {
      cp_rows<BLOCK_M, DK, PK, THREADS>(sQ + buf * Q_BYTES, in.q, q_rs, it, i_limit, Dk);
      cp_rows<BLOCK_M, DV, PV, THREADS>(sdO + buf * DO_BYTES, doh, Dv, it, i_limit, Dv);
      if (HAS_MB) load_st = next_step(load_st + 1);
    }
    cp_async_commit();
  };
  cp_rows<BLOCK_N, DK, PK, THREADS>(sK, in.k, k_rs, j0, key_limit, Dk);
  cp_rows<BLOCK_N, DV, PV, THREADS>(sV, in.v, v_rs, j0, key_limit, Dv);
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) issue_step(s);

  T dk_acc[MF][DFK][4], dv_acc[MF][DFV][4];
  zero(dk_acc);
  zero(dv_acc);
  const Mod mod = Mod::make(MOD_INPUTS(bh), scale, at_head(mod_args, bh, w.shift));
  const u32 k_lane = sK + ((warp_row0 + g) * PK + 2 * t) * E;  // A of S^T: this warp's keys
  const u32 v_lane = sV + ((warp_row0 + g) * PV + 2 * t) * E;  // A of dP^T
  const int j_thr = j0 + warp_row0 + g;                         // this lane's key row

  for (int n = 0, st = next_step(0); st < n_steps; ++n, st = HAS_MB ? next_step(st + 1) : n) {
    const int i0 = i_first + st * BLOCK_M;
    cp_async_wait<STAGES - 2>();
    __syncthreads();  // step n landed; everyone finished step n - 1's buffers
    issue_step(n + STAGES - 1);
    const u32 qs = sQ + (n % STAGES) * Q_BYTES, dos = sdO + (n % STAGES) * DO_BYTES;

    // S^T = K Q^T; masked where the step is not entirely visible (rows = keys)
    T s[MF][NQ][4];
    wide::rows_times_rows<T, PASSES, MF, NQ, KDK, PK, PK>(s, k_lane, qs + (g * PK + 2 * t) * E);
    const int i_last = min(i0 + BLOCK_M, i_limit) - 1;
    bool shown = false;  // the mask shows the whole step and there is no bias
    if constexpr (HAS_MB && !GR) shown = mod.bias == nullptr && step_cls(st) == TILE_VISIBLE;
    T gr[MF][GR ? NQ : 1][4];  // the modifier's derivative (GR)
    if (shown) {
      const auto scaled = mod.shown();  // the scale only
#pragma unroll
      for (int mf = 0; mf < MF; ++mf)
        mask_key_rows(s[mf], j_thr + mf * 16, i0, t, Nq, b32, scaled);
    } else if (Mod::READS_INPUTS || !tile_all_visible(b32, i0, i_last, j0, BLOCK_N)) {
#pragma unroll
      for (int mf = 0; mf < MF; ++mf) {
        const int j = j_thr + mf * 16;
        if constexpr (GR) mask_key_rows(s[mf], j, i0, t, Nq, b32, with_grad(mod, gr[mf]));
        else mask_key_rows(s[mf], j, i0, t, Nq, b32, mod);
      }
    } else if constexpr (HAS_MB && !Mod::READS_INPUTS) {  // a transform alone, tile visible
#pragma unroll
      for (int mf = 0; mf < MF; ++mf)
        if constexpr (GR) modify_all_keys(s[mf], with_grad(mod, gr[mf]), j_thr + mf * 16, i0, t);
        else modify_all_keys(s[mf], mod, j_thr + mf * 16, i0, t);
    }
    // P^T = exp(S^T - lse[query]); this lane's query columns are i0 + 8 nf + 2t + e
    T dl[NQ][2];
#pragma unroll
    for (int nf = 0; nf < NQ; ++nf)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int i = i0 + nf * 8 + 2 * t + e;
        const bool real = i < i_limit;
        const T l = row_lse(lse, bh * Nq + i, real);
        dl[nf][e] = real ? delta[bh * Nq + i] : T(0);
#pragma unroll
        for (int mf = 0; mf < MF; ++mf)
#pragma unroll
          for (int h = 0; h < 2; ++h)
            s[mf][nf][2 * h + e] = prob<HAS_MB>(s[mf][nf][2 * h + e], scale, l);
      }
    // dV += P^T dO
    wide::acc_times_rows<T, PASSES, MF, NQ, DFV, DG, PV>(
        dv_acc, s, dos + (2 * t * PV + g + part * DFV * 8) * E, 0, AddTo<T>());
    // dP^T = V dO^T, then dS^T = P^T (dP^T - delta[query])
    T dp[MF][NQ][4];
    wide::rows_times_rows<T, PASSES, MF, NQ, KDV, PV, PV>(dp, v_lane, dos + (g * PV + 2 * t) * E);
    for_each_entry(dp, [&](T& x, int mf, int nf, int e) {
      x = s[mf][nf][e] * (x - dl[nf][e % 2]) * grad_of<GR>(gr[mf], nf, e);
    });
    // dK += dS^T Q
    wide::acc_times_rows<T, PASSES, MF, NQ, DFK, DG, PK>(
        dk_acc, dp, qs + (2 * t * PK + g + part * DFK * 8) * E, 0, AddTo<T>());
  }
  cp_async_wait<0>();

  store_rows(dk + bh * Nk * Dk, dk_acc, j0 + warp_row0, Nk, Dk, scale, part * DFK * 8);
  store_rows(dv + bh * Nk * Dv, dv_acc, j0 + warp_row0, Nk, Dv, T(1), part * DFV * 8);
}

// Grid: 1-D, blockIdx.x = bh * n_mtiles + (reversed query tile), as fwd_wide. BLOCK_N keys per
// step.
// DBIAS (a mask / bias modifier only): dbias (BH, Nq, Nk) gets P (dP - delta) per pair
// (attn_core.cuh store_dbias); without it dbias is null and unread.
template <typename T, int PASSES, int DK, int DV, int BLOCK_N, int NWARPS, int MF, int STAGES,
          typename Mod, int MIN_BLOCKS, bool DBIAS = false>
__global__ void __launch_bounds__(NWARPS * 32, MIN_BLOCKS)
bwd_wide_dq(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
            const T* __restrict__ dout, const T* __restrict__ lse, const T* __restrict__ delta,
            T* __restrict__ dq, ATTN_INPUTS(T), const AttnArgs a, const TileClasses classes,
            T* __restrict__ dbias) {
  using namespace tc;
  ATTN_ARGS_LOCALS(a, T);
  constexpr bool HAS_MB = !Mod::IDENTITY, GR = Mod::HAS_GRAD;
  static_assert(!DBIAS || Mod::READS_INPUTS, "DBIAS: a modifier that reads the bias");
  constexpr int THREADS = NWARPS * 32;
  constexpr int BLOCK_M = 16 * MF * NWARPS;
  constexpr int NF = BLOCK_N / 8;  // key fragments = k-steps of dQ
  constexpr int KDK = DK / 8, KDV = DV / 8, DFK = DK / 8;
  constexpr int PK = DK + 8, PV = DV + 8;
  constexpr u32 E = sizeof(T);
  constexpr u32 K_BYTES = BLOCK_N * PK * E, V_BYTES = BLOCK_N * PV * E;
  constexpr int DG = DK >= 96 ? 2 : 4;
  static_assert(BLOCK_N % 8 == 0 && STAGES >= 2 && DFK % DG == 0, "tile shape");

  const QueryTile qt = query_tile<BLOCK_M>(Nq);
  const long long bh = qt.bh;
  const int i0 = qt.i0;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int g = lane / 4, t = lane % 4;
  const int warp_row0 = warp * MF * 16;

  const KeyTiles kt = key_tiles<BLOCK_N>(kv_lens, bh, i0, qt.i_last, Nq, Nk, left, right,
                                          bottom_right);

  const HeadQKV<T> in = head_qkv(q, k, v, offsets, BH, bh);
  const T* doh = dout + bh * Nq * Dv;

  u32 sQ, sdO, sK, sV;
  shared_regions(sQ, BLOCK_M * PK * E, sdO, BLOCK_M * PV * E, sK, STAGES * K_BYTES, sV);

  // fwd_wide's key tiles, classes and ring slots
  const TileWalk<BLOCK_N, HAS_MB> walk{HAS_MB ? class_row(classes, bh, i0 / BLOCK_M) : nullptr,
                                        kt.j_first, kt.n_tiles};
  int load_it = walk.next(0);
  auto issue_tile = [&](int seq) {
    const int lt = HAS_MB ? load_it : seq;
    const int buf = seq % STAGES, jt = kt.j_first + lt * BLOCK_N;
    if (lt < kt.n_tiles) {
      cp_rows<BLOCK_N, DK, PK, THREADS>(sK + buf * K_BYTES, in.k, k_rs, jt, kt.j_limit, Dk);
      cp_rows<BLOCK_N, DV, PV, THREADS>(sV + buf * V_BYTES, in.v, v_rs, jt, kt.j_limit, Dv);
      if (HAS_MB) load_it = walk.next(load_it + 1);
    }
    cp_async_commit();
  };
  cp_rows<BLOCK_M, DK, PK, THREADS>(sQ, in.q, q_rs, i0, Nq, Dk);
  cp_rows<BLOCK_M, DV, PV, THREADS>(sdO, doh, Dv, i0, Nq, Dv);
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) issue_tile(s);

  T dq_acc[MF][DFK][4];
  zero(dq_acc);
  const Mod mod = Mod::make(MOD_INPUTS(bh), scale, at_head(mod_args, bh, kt.w.shift));
  const int i_thr = i0 + warp_row0 + g;
  T lrow[MF][2], drow[MF][2];  // lse and delta of this lane's rows g, g + 8
#pragma unroll
  for (int mf = 0; mf < MF; ++mf)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int i = i_thr + mf * 16 + 8 * h;
      lrow[mf][h] = row_lse(lse, bh * Nq + i, i < Nq);
      drow[mf][h] = i < Nq ? delta[bh * Nq + i] : T(0);
    }
  const u32 q_lane = sQ + ((warp_row0 + g) * PK + 2 * t) * E;
  const u32 do_lane = sdO + ((warp_row0 + g) * PV + 2 * t) * E;

  for (int n = 0, it = walk.next(0); it < kt.n_tiles; ++n, it = HAS_MB ? walk.next(it + 1) : n) {
    const int j0 = kt.j_first + it * BLOCK_N;
    cp_async_wait<STAGES - 2>();
    __syncthreads();
    issue_tile(n + STAGES - 1);
    const u32 ks = sK + (n % STAGES) * K_BYTES, vs = sV + (n % STAGES) * V_BYTES;

    T s[MF][NF][4];
    wide::rows_times_rows<T, PASSES, MF, NF, KDK, PK, PK>(s, q_lane, ks + (g * PK + 2 * t) * E);
    bool shown = false;
    if constexpr (HAS_MB && !GR) shown = mod.bias == nullptr && walk.cls(it) == TILE_VISIBLE;
    T gr[MF][GR ? NF : 1][4];  // the modifier's derivative (GR)
    if (shown) {
      const auto scaled = mod.shown();  // the scale only
#pragma unroll
      for (int mf = 0; mf < MF; ++mf)
        mask_rows(s[mf], i_thr + mf * 16, j0, t, Nq, kt.b32, scaled);
    } else if (Mod::READS_INPUTS || j0 < kt.full_lo || j0 + BLOCK_N - 1 > kt.full_hi) {
#pragma unroll
      for (int mf = 0; mf < MF; ++mf) {
        const int i = i_thr + mf * 16;
        if constexpr (GR) mask_rows(s[mf], i, j0, t, Nq, kt.b32, with_grad(mod, gr[mf]));
        else mask_rows(s[mf], i, j0, t, Nq, kt.b32, mod);
      }
    } else if constexpr (HAS_MB && !Mod::READS_INPUTS) {  // a transform alone, tile visible
#pragma unroll
      for (int mf = 0; mf < MF; ++mf)
        if constexpr (GR) modify_all(s[mf], with_grad(mod, gr[mf]), i_thr + mf * 16, j0, t);
        else modify_all(s[mf], mod, i_thr + mf * 16, j0, t);
    }
    T dp[MF][NF][4];
    wide::rows_times_rows<T, PASSES, MF, NF, KDV, PV, PV>(dp, do_lane, vs + (g * PV + 2 * t) * E);
    // P = exp(S - lse[row]); dS = P (dP - delta[row]), in dp
    for_each_entry(dp, [&](T& x, int mf, int nf, int e) {
      const T p = prob<HAS_MB>(s[mf][nf][e], scale, lrow[mf][e / 2]);
      if constexpr (DBIAS)  // the bias's gradient
        store_dbias(dbias, bh, Nq, Nk, i_thr + mf * 16 + 8 * (e / 2), j0 + nf * 8 + 2 * t + e % 2,
                    p, p * (x - drow[mf][e / 2]));
      x = p * (x - drow[mf][e / 2]) * grad_of<GR>(gr[mf], nf, e);
    });
    // dQ += dS K
    wide::acc_times_rows<T, PASSES, MF, NF, DFK, DG, PK>(dq_acc, dp, ks + (2 * t * PK + g) * E,
                                                         0, AddTo<T>());
  }
  cp_async_wait<0>();

  store_rows(dq + bh * Nq * Dk, dq_acc, i0 + warp_row0, Nq, Dk, scale);
}
