// fwd_generic.cu: exact attention forward on CUDA cores (SIMT), any sm_70+.
//
// One block of NUM_THREADS = 128 threads owns BLOCK_M query rows of one (batch, head). Thread t
// owns rows (t / 8) + 16 * r (r < BLOCK_M / 16) and, in each key tile, the keys (t % 8) + 8 * jj;
// the 8 lanes of a row combine their max / sum by shuffles. Q stays in shared memory; K and then V
// of each key tile go through one shared buffer; P goes through shared memory to the P.V product.
// Tile sizes come from cuflash/_config.py (the one table) as template arguments.
#include "common.cuh"
#include "mask.cuh"
#include "generic_tiles.cuh"
#include "philox.cuh"

template <typename T, typename Acc, int HEAD_DIM, int BLOCK_M, int BLOCK_N,
          typename F = NoTransform, typename... Drop>
__global__ void __launch_bounds__(NUM_THREADS, MIN_BLOCKS_PER_SM)
fwd_generic(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
            T* __restrict__ out, Acc* __restrict__ lse, ATTN_INPUTS(Acc),
            ATTN_ARGS_PARAMS(Acc), const Drop... drop) {
  using Tile = GenericTile<HEAD_DIM, BLOCK_M, BLOCK_N>;
  constexpr int ROWS = Tile::ROWS, KEYS = Tile::OTHER, COLS = Tile::COLS;
  constexpr int LD = Tile::LD, LDP = Tile::LDP;

  const long long bh = block_bh();
  if (bh >= BH) return;
  const long long i0 = static_cast<long long>(blockIdx.x) * BLOCK_M;
  const long long i_end = tile_end(i0, BLOCK_M, Nq);

  // Q stays; K, then V, of each key tile share one buffer; P feeds the P.V product.
  Acc *Qs, *KVs, *Ps;
  shared_arrays<Acc>(Qs, BLOCK_M * LD, KVs, BLOCK_N * LD, Ps, BLOCK_M * LDP);

  const int group = threadIdx.x / LANES_PER_ROW;
  const int lane = threadIdx.x % LANES_PER_ROW;

  const Window w = head_window(kv_lens, bh, Nq, Nk, left, right, bottom_right);
  const T* qh = q + offsets[0 * BH + bh];
  const T* kh = k + offsets[1 * BH + bh];
  const T* vh = v + offsets[2 * BH + bh];
  MaskBias<Acc> mb;
  set_head_mask_bias(mb, mask, bias, offsets, BH, bh, mask_rs, mask_cs, bias_rs, bias_cs);
  const F f = F::make(at_head(FLAT_MOD_ARGS, bh, w.shift), 0, Acc(1));  // the score transform, natural units
  const auto dz = dropout_at<Acc>(bh, drop...);  // philox.cuh: none without a DropoutArgs

  load_tile<T, Acc, HEAD_DIM, BLOCK_M>(Qs, qh, q_rs, i0, i_end, Dk);

  // Per-row state (DESIGN.md "Empty state"): m = -inf, l = 0, acc = 0. l is a per-lane partial
  // sum, reduced once at the end.
  KeyRange rows[ROWS];
  Acc m[ROWS], l[ROWS], acc[ROWS][COLS];
  // With a mask or bias, bit r: this lane saw a visible key of row r (without them, visibility
  // is the position range alone); a row that saw none is empty (0 and -inf).
  const bool has_mb = mb.mask != nullptr || mb.bias != nullptr;
  unsigned seen = 0u;
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    const long long i = i0 + group + ROW_GROUPS * r;
    if (i < i_end) {
      rows[r] = key_range(w, i);
    } else {
      rows[r].lo = 0;
      rows[r].hi = -1;  // padding row: sees nothing
    }
    m[r] = NEG_INF;
    l[r] = Acc(0);
#pragma unroll
    for (int c = 0; c < COLS; ++c) acc[r][c] = Acc(0);
  }

  // Only key tiles inside the tile's visible range are visited; no element test outside it.
  const KeyRange tile = tile_key_range(w, i0, i_end - 1);
  for (long long j0 = tile.lo; j0 <= tile.hi; j0 += BLOCK_N) {
    const long long j_end = tile_end(j0, BLOCK_N, tile);
    __syncthreads();  // previous P.V finished with KVs and Ps (first trip: nothing to wait for)
    load_tile<T, Acc, HEAD_DIM, BLOCK_N>(KVs, kh, k_rs, j0, j_end, Dk);
    __syncthreads();

    // Scores S = Q K^T for this thread's rows and keys.
    Acc s[ROWS][KEYS];
    tile_abt<8, LD>(s, Qs, KVs, Dk);

    // Online softmax: mask by global position, new max, rescale BOTH l and acc, add this mass.
    // The max propagates NaN (a NaN logit makes the row NaN); a row with nothing visible in
    // this tile is left untouched (never exp(-inf - (-inf))).
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      const long long i = i0 + group + ROW_GROUPS * r;
      Acc tile_max = NEG_INF;
#pragma unroll
      for (int jj = 0; jj < KEYS; ++jj) {
        const long long j = j0 + lane + LANES_PER_ROW * jj;
        Acc x = s[r][jj] * scale, g;
        if (has_mb) {
          const bool vis = visible_logit(x, i, j, rows[r], mb, f, g);
          seen |= static_cast<unsigned>(vis) << r;
          x = vis ? x : NEG_INF;
        } else if (j < rows[r].lo || j > rows[r].hi) {
          x = NEG_INF;
        } else {
          x = f(x, i, j);
        }
        s[r][jj] = x;
        tile_max = max_nan(tile_max, x);
      }
      tile_max = row_max_nan(tile_max);
      if (!(tile_max == NEG_INF)) {
        const Acc m_new = max_nan(m[r], tile_max);
        const Acc alpha = (m[r] > NEG_INF) ? acc_exp(m[r] - m_new) : Acc(0);
        Acc mass = Acc(0);
#pragma unroll
        for (int jj = 0; jj < KEYS; ++jj) {
          s[r][jj] = (s[r][jj] > NEG_INF) ? acc_exp(s[r][jj] - m_new) : Acc(0);
          mass += s[r][jj];
        }
        l[r] = l[r] * alpha + mass;
#pragma unroll
        for (int c = 0; c < COLS; ++c) acc[r][c] *= alpha;
        m[r] = m_new;
      } else {
#pragma unroll
        for (int jj = 0; jj < KEYS; ++jj) s[r][jj] = Acc(0);
      }
      // dropout acts on P V only: l above is the undropped sum (the kept weights' 1 / (1 - p)
      // joins the normalization at the end)
#pragma unroll
      for (int jj = 0; jj < KEYS; ++jj)
        Ps[(group + ROW_GROUPS * r) * LDP + lane + LANES_PER_ROW * jj] =
            dz(s[r][jj], i, j0 + lane + LANES_PER_ROW * jj);
    }

    __syncthreads();  // everyone is done reading K and writing P
    load_tile<T, Acc, HEAD_DIM, BLOCK_N>(KVs, vh, v_rs, j0, j_end, Dv);
    __syncthreads();

    // acc += P V over the tile's keys.
    tile_mac_ab<2, LDP, LD>(acc, Ps, KVs, static_cast<int>(j_end - j0));
  }

  // Normalize once. A row with no visible key is empty: out = 0, lse = -inf. One that sees keys
  // but has l = 0 (every visible logit -inf) is 0 / 0 = NaN, like a NaN l.
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    const Acc l_row = row_sum(l[r]);
    const bool empty = has_mb ? !row_any((seen >> r) & 1u) : rows[r].lo > rows[r].hi;
    const long long i = i0 + group + ROW_GROUPS * r;
    if (i >= i_end) continue;
    const Acc inv_l =
        dz.scaled(empty ? Acc(0) : (l_row == Acc(0) ? quiet_nan<Acc>() : Acc(1) / l_row));
    T* out_row = out + (bh * Nq + i) * Dv;
#pragma unroll
    for (int c = 0; c < COLS; ++c) {
      const int col = lane + LANES_PER_ROW * c;
      if (col < Dv) store_acc(out_row + col, acc[r][c] * inv_l);
    }
    if (lane == 0)
      lse[bh * Nq + i] = empty ? NEG_INF : (l_row == Acc(0) ? quiet_nan<Acc>() : m[r] + acc_log(l_row));
  }
}
