// bwd_generic.cu: exact attention backward on CUDA cores (SIMT), any sm_70+.
//
// Two passes instead of atomics (deterministic by construction; DESIGN.md "Kernel ABI"):
//   bwd_preprocess  delta = rowsum(dO * O), and the lse the main kernels use (lse_eff)
//   bwd_dkdv        one block per key tile:   dV = P^T dO,  dK = scale * dS^T Q
//   bwd_dq          one block per query tile: dQ = scale * dS K
// with P = exp(s - lse) where visible and lse > -inf (else 0; a NaN lse gives NaN),
// dS = P * (dP - delta), dP = dO V^T. With dropout (philox.cuh; Z the keep bits, r = 1 / (1 - p)):
// dV = (Z P r)^T dO and dS = P * (Z dP r - delta), delta from the dropped out. Lost rows (finite |lse| >= lost, cuflash/_config.py
// LOST_LSE) get lse_eff = +inf and delta = 0 here, so they contribute nothing; bwd_lost.cu adds
// their exact gradients afterwards.
// Every output element is written (zeros where nothing contributes): the host allocates with empty().
// Thread layout as in fwd_generic.cu: a row (key row in dkdv, query row in dq) belongs to 8 lanes.
#include "common.cuh"
#include "mask.cuh"
#include "generic_tiles.cuh"
#include "philox.cuh"

// delta[row] = sum_c dout[row, c] * out[row, c]; one warp per row, out contiguous (rows, Dv), dout
// too; or, where dout_src is another array (the caller's dO in any layout of unit column stride:
// dout_rows[bh] the element offset of head bh's matrix, dout_rows[rows / Nq] its row stride),
// read there and copied into dout, which the main kernels then read: no separate copy pass.
// (Always two addresses, so that a layout's launch takes either: dout_src = dout_rows = dout for
// none.)
template <typename T, typename Acc>
__global__ void __launch_bounds__(NUM_THREADS, MIN_BLOCKS_PER_SM)
bwd_preprocess(T* __restrict__ dout, const T* __restrict__ out, const Acc* __restrict__ lse,
               Acc* __restrict__ lse_eff, Acc* __restrict__ delta, long long rows, int Dv,
               Acc lost, const T* dout_src, const long long* dout_rows, int Nq) {
  constexpr int WARPS = NUM_THREADS / 32;
  const bool copy = dout_src != dout;
  const int lane = threadIdx.x % 32;
  const long long first = static_cast<long long>(blockIdx.x) * WARPS + threadIdx.x / 32;
  const long long stride = static_cast<long long>(gridDim.x) * WARPS;
  for (long long row = first; row < rows; row += stride) {
    T* dc = dout + row * Dv;
    const T* d = copy ? dout_src + dout_rows[row / Nq] + (row % Nq) * dout_rows[rows / Nq] : dc;
    const T* o = out + row * Dv;
    Acc sum = Acc(0);
    for (int c = lane; c < Dv; c += 32) {
      const T x = d[c];
      if (copy) dc[c] = x;
      sum += to_acc(x) * to_acc(o[c]);
    }
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(FULL_WARP, sum, offset);
    if (lane == 0) {
      const Acc l = lse[row];
      const bool is_lost = l - l == Acc(0) && (l >= lost || l <= -lost);  // finite, |l| >= lost
      lse_eff[row] = is_lost ? -NEG_INF : l;
      delta[row] = is_lost ? Acc(0) : sum;
    }
  }
}

// P for one (query i, key j) pair from its unscaled score; 0 where invisible or the row is empty
// (lse = -inf), NaN where the lse is NaN.
// g: the score transform's derivative there (f: modifiers.cuh; 1 without one).
template <typename Acc, typename F>
__device__ __forceinline__ Acc recompute_p(Acc s, Acc scale, long long i, long long j,
                                           const Window& w, Acc lse_i, const MaskBias<Acc>& mb,
                                           const F& f, Acc& g) {
  g = Acc(1);
  if (lse_i == NEG_INF) return Acc(0);
  Acc x = s * scale;
  return visible_logit(x, i, j, key_range(w, i), mb, f, g) ? acc_exp(x - lse_i) : Acc(0);
}

// Grid: x = key tile (BLOCK_N keys), (y, z) = batch*head. Each block walks only the query tiles
// that can see its key tile (tile_query_range) and writes dk_acc (BH, Nk, Dk), dv_acc (BH, Nk, Dv).
template <typename T, typename Acc, int HEAD_DIM, int BLOCK_M, int BLOCK_N,
          typename F = NoTransform, typename... Drop>
__global__ void __launch_bounds__(NUM_THREADS, MIN_BLOCKS_PER_SM)
bwd_dkdv(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
         const T* __restrict__ dout, const Acc* __restrict__ lse, const Acc* __restrict__ delta,
         Acc* __restrict__ dk_acc, Acc* __restrict__ dv_acc, ATTN_INPUTS(Acc),
         ATTN_ARGS_PARAMS(Acc), const Drop... drop) {
  using Tile = GenericTile<HEAD_DIM, BLOCK_N, BLOCK_M>;
  constexpr int ROWS = Tile::ROWS, QUERIES = Tile::OTHER, COLS = Tile::COLS;
  constexpr int LD = Tile::LD, LDP = Tile::LDP;

  const long long bh = block_bh();
  if (bh >= BH) return;
  const long long j0 = static_cast<long long>(blockIdx.x) * BLOCK_N;
  const long long j_end = tile_end(j0, BLOCK_N, Nk);

  // K, V stay for the whole walk; Q, dO, P^T and dS^T (key-major), lse, delta per query tile.
  Acc *Ks, *Vs, *Qs, *dOs, *Ps, *dSs, *lse_s, *delta_s;
  shared_arrays<Acc>(Ks, BLOCK_N * LD, Vs, BLOCK_N * LD, Qs, BLOCK_M * LD, dOs, BLOCK_M * LD,
                     Ps, BLOCK_N * LDP, dSs, BLOCK_N * LDP, lse_s, BLOCK_M, delta_s, BLOCK_M);

  const int group = threadIdx.x / LANES_PER_ROW;
  const int lane = threadIdx.x % LANES_PER_ROW;
  const HeadInputs<T, Acc> h =
      head_inputs(bh, q, k, v, dout, lse, delta, offsets, mask, bias, kv_lens, mask_rs, mask_cs,
                  bias_rs, bias_cs, BH, Nq, Nk, Dv, left, right, bottom_right);
  const F f = F::make(at_head(FLAT_MOD_ARGS, bh, h.w.shift), 0, Acc(1));  // the score transform, natural units
  const auto dz = dropout_at<Acc>(bh, drop...);  // philox.cuh: none without a DropoutArgs

  Acc dk[ROWS][COLS], dv[ROWS][COLS];
  tile_zero(dk);
  tile_zero(dv);

  // Keys >= L are invisible: tile_query_range returns an empty range for them.
  const KeyRange qr = tile_query_range(h.w, j0, j_end - 1, Nq);
  if (qr.lo <= qr.hi) {
    load_tile<T, Acc, HEAD_DIM, BLOCK_N>(Ks, h.k, k_rs, j0, j_end, Dk);
    load_tile<T, Acc, HEAD_DIM, BLOCK_N>(Vs, h.v, v_rs, j0, j_end, Dv);
  }
  for (long long i0 = qr.lo; i0 <= qr.hi; i0 += BLOCK_M) {
    const long long i_end = tile_end(i0, BLOCK_M, qr);
    __syncthreads();  // previous tile's accumulation finished with Q, dO, P, dS
    load_tile<T, Acc, HEAD_DIM, BLOCK_M>(Qs, h.q, q_rs, i0, i_end, Dk);
    load_tile<T, Acc, HEAD_DIM, BLOCK_M>(dOs, h.dout, Dv, i0, i_end, Dv);
    for (int t = threadIdx.x; t < BLOCK_M; t += NUM_THREADS) {
      const bool in = i0 + t < i_end;
      lse_s[t] = in ? h.lse[i0 + t] : NEG_INF;  // -inf: padding rows contribute nothing
      delta_s[t] = in ? h.delta[i0 + t] : Acc(0);
    }
    __syncthreads();

    // S^T = K Q^T and dP^T = V dO^T for this thread's keys and queries.
    Acc s[ROWS][QUERIES], dp[ROWS][QUERIES];
    tile_abt<4, LD>(s, Ks, Qs, Dk);
    tile_abt<4, LD>(dp, Vs, dOs, Dv);

    // P and dS = P * (dP - delta), staged transposed (key-major) for the two products below.
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      const int jr = group + ROW_GROUPS * r;
      const long long j = j0 + jr;
#pragma unroll
      for (int ii = 0; ii < QUERIES; ++ii) {
        const int ir = lane + LANES_PER_ROW * ii;
        const long long i = i0 + ir;
        Acc p = Acc(0), g = Acc(1);
        if (j < j_end) p = recompute_p(s[r][ii], scale, i, j, h.w, lse_s[ir], h.mb, f, g);
        const bool kept = p == Acc(0) || dz.keep(i, j);  // (no bits drawn where P is 0)
        Ps[jr * LDP + ir] = kept ? p : Acc(0);
        dSs[jr * LDP + ir] = p * ((kept ? dz.scaled(dp[r][ii]) : Acc(0)) - delta_s[ir]) * g;
      }
    }
    __syncthreads();

    // dV += P^T dO,  dK += dS^T Q (scale applied at the end).
    const int n_queries = static_cast<int>(i_end - i0);
#pragma unroll 2
    for (int ii = 0; ii < n_queries; ++ii) {
      Acc od[COLS], qd[COLS];
#pragma unroll
      for (int c = 0; c < COLS; ++c) {
        od[c] = dOs[ii * LD + lane + LANES_PER_ROW * c];
        qd[c] = Qs[ii * LD + lane + LANES_PER_ROW * c];
      }
#pragma unroll
      for (int r = 0; r < ROWS; ++r) {
        const int jr = group + ROW_GROUPS * r;
        const Acc p = Ps[jr * LDP + ii];
        const Acc ds = dSs[jr * LDP + ii];
#pragma unroll
        for (int c = 0; c < COLS; ++c) {
          dv[r][c] += p * od[c];
          dk[r][c] += ds * qd[c];
        }
      }
    }
  }

#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    const long long j = j0 + group + ROW_GROUPS * r;
    if (j >= j_end) continue;
    Acc* dk_row = dk_acc + (bh * Nk + j) * Dk;
    Acc* dv_row = dv_acc + (bh * Nk + j) * Dv;
#pragma unroll
    for (int c = 0; c < COLS; ++c) {
      const int col = lane + LANES_PER_ROW * c;
      if (col < Dk) dk_row[col] = dk[r][c] * scale;
      if (col < Dv) dv_row[col] = dz.scaled(dv[r][c]);
    }
  }
}

// Grid: x = query tile (BLOCK_M queries), (y, z) = batch*head. Walks the key tiles the query tile
// can see (tile_key_range) and writes dq_acc (BH, Nq, Dk) = scale * dS K. DBIAS: dbias
// (BH, Nq, Nk) gets the logits' gradient P (dP - delta) of every pair of the key tiles walked
// (0 where P is 0), the bias's gradient before its broadcast sum (the host zeroes the pairs no
// tile reaches); without DBIAS dbias is null and unread.
template <typename T, typename Acc, int HEAD_DIM, int BLOCK_M, int BLOCK_N,
          typename F = NoTransform, bool DBIAS = false, typename... Drop>
__global__ void __launch_bounds__(NUM_THREADS, MIN_BLOCKS_PER_SM)
bwd_dq(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
       const T* __restrict__ dout, const Acc* __restrict__ lse, const Acc* __restrict__ delta,
       Acc* __restrict__ dq_acc, ATTN_INPUTS(Acc), ATTN_ARGS_PARAMS(Acc),
       Acc* __restrict__ dbias, const Drop... drop) {
  using Tile = GenericTile<HEAD_DIM, BLOCK_M, BLOCK_N>;
  constexpr int ROWS = Tile::ROWS, KEYS = Tile::OTHER, COLS = Tile::COLS;
  constexpr int LD = Tile::LD, LDP = Tile::LDP;

  const long long bh = block_bh();
  if (bh >= BH) return;
  const long long i0 = static_cast<long long>(blockIdx.x) * BLOCK_M;
  const long long i_end = tile_end(i0, BLOCK_M, Nq);

  // Q, dO stay for the whole walk; K, V per key tile; dS feeds the dS K product.
  Acc *Qs, *dOs, *Ks, *Vs, *dSs;
  shared_arrays<Acc>(Qs, BLOCK_M * LD, dOs, BLOCK_M * LD, Ks, BLOCK_N * LD, Vs, BLOCK_N * LD,
                     dSs, BLOCK_M * LDP);

  const int group = threadIdx.x / LANES_PER_ROW;
  const int lane = threadIdx.x % LANES_PER_ROW;
  const HeadInputs<T, Acc> h =
      head_inputs(bh, q, k, v, dout, lse, delta, offsets, mask, bias, kv_lens, mask_rs, mask_cs,
                  bias_rs, bias_cs, BH, Nq, Nk, Dv, left, right, bottom_right);
  const F f = F::make(at_head(FLAT_MOD_ARGS, bh, h.w.shift), 0, Acc(1));  // the score transform, natural units
  const auto dz = dropout_at<Acc>(bh, drop...);  // philox.cuh: none without a DropoutArgs

  load_tile<T, Acc, HEAD_DIM, BLOCK_M>(Qs, h.q, q_rs, i0, i_end, Dk);
  load_tile<T, Acc, HEAD_DIM, BLOCK_M>(dOs, h.dout, Dv, i0, i_end, Dv);

  Acc lse_r[ROWS], delta_r[ROWS], dq[ROWS][COLS];
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    const long long i = i0 + group + ROW_GROUPS * r;
    lse_r[r] = (i < i_end) ? h.lse[i] : NEG_INF;  // -inf: padding rows contribute nothing
    delta_r[r] = (i < i_end) ? h.delta[i] : Acc(0);
#pragma unroll
    for (int c = 0; c < COLS; ++c) dq[r][c] = Acc(0);
  }

  const KeyRange tile = tile_key_range(h.w, i0, i_end - 1);
  for (long long j0 = tile.lo; j0 <= tile.hi; j0 += BLOCK_N) {
    const long long j_end = tile_end(j0, BLOCK_N, tile);
    __syncthreads();  // previous tile's accumulation finished with K and dS
    load_tile<T, Acc, HEAD_DIM, BLOCK_N>(Ks, h.k, k_rs, j0, j_end, Dk);
    load_tile<T, Acc, HEAD_DIM, BLOCK_N>(Vs, h.v, v_rs, j0, j_end, Dv);
    __syncthreads();

    // S = Q K^T and dP = dO V^T for this thread's queries and keys.
    Acc s[ROWS][KEYS], dp[ROWS][KEYS];
    tile_abt<4, LD>(s, Qs, Ks, Dk);
    tile_abt<4, LD>(dp, dOs, Vs, Dv);

    // dS = P * (dP - delta), staged through shared memory for the dS K product.
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      const int ir = group + ROW_GROUPS * r;
      const long long i = i0 + ir;
      // the bias's gradient (before F'), row i from key j0 + lane (null: not asked, or padding)
      Acc* const db = DBIAS && i < i_end ? dbias + (bh * Nq + i) * Nk + j0 + lane : nullptr;
#pragma unroll
      for (int jj = 0; jj < KEYS; ++jj) {
        const long long j = j0 + lane + LANES_PER_ROW * jj;
        Acc ds = Acc(0);
        if (j < j_end) {
          Acc g;
          const Acc p = recompute_p(s[r][jj], scale, i, j, h.w, lse_r[r], h.mb, f, g);
          const bool kept = p == Acc(0) || dz.keep(i, j);  // (no bits drawn where P is 0)
          const Acc dlogit = p * ((kept ? dz.scaled(dp[r][jj]) : Acc(0)) - delta_r[r]);
          ds = dlogit * g;
          if (DBIAS && db != nullptr) db[LANES_PER_ROW * jj] = p == Acc(0) ? Acc(0) : dlogit;
        }
        dSs[ir * LDP + lane + LANES_PER_ROW * jj] = ds;
      }
    }
    __syncthreads();

    // dQ += dS K (scale applied at the end).
    tile_mac_ab<2, LDP, LD>(dq, dSs, Ks, static_cast<int>(j_end - j0));
  }

#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    const long long i = i0 + group + ROW_GROUPS * r;
    if (i >= i_end) continue;
    Acc* dq_row = dq_acc + (bh * Nq + i) * Dk;
#pragma unroll
    for (int c = 0; c < COLS; ++c) {
      const int col = lane + LANES_PER_ROW * c;
      if (col < Dk) dq_row[col] = dq[r][c] * scale;
    }
  }
}
