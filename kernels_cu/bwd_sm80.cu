// bwd_sm80.cu: FlashAttention-2-class backward on tensor cores (mma.sync), float16 / bfloat16, sm_80+.
//
//   bwd_sm80_prep   per query row: delta = rowsum(dO * O) and lse2 = lse * log2(e) (+inf for an
//                   empty row), both float32 in (BH, Nq_pad) buffers padded with (+inf, 0) rows, so
//                   that the main kernels load them in 16-byte copies with no bounds test, and
//                   P = exp2(s * scale * log2(e) - lse2) is exactly 0 on empty and padding rows.
//   bwd_sm80_dkdv   one block per key tile of BLOCK_N = 16 * NWARPS keys of one (batch, head);
//                   warp w owns keys [16 w, 16 w + 16) of the tile, K and V stay in shared memory
//                   (or registers), dK and dV accumulate in float32 registers. The block walks the
//                   query tiles (BLOCK_M rows, aligned to BLOCK_M) that can see its key tile
//                   (mask.cuh tile_query_range); Q, dO, lse2, delta stream through a two-stage
//                   cp.async ring. Per query tile, in the transposed orientation (rows = keys):
//                     S^T  = K Q^T            A = K (ldmatrix / regs), B = Q (ldmatrix)
//                     P^T  = exp2(S^T * scale * log2e - lse2[col])   (0 where invisible)
//                     dV  += P^T dO           A = P^T packed from the S^T accumulators, B = dO (.trans)
//                     dP^T = V dO^T           A = V, B = dO (ldmatrix)
//                     dS^T = scale * P^T (dP^T - delta[col])
//                     dK  += dS^T Q           A = dS^T packed from registers, B = Q (.trans)
//                   and, with DQ_ATOMIC, dS^T goes through shared memory for dQ = dS K (A = dS by
//                   ldmatrix.trans of dS^T, B = K (.trans)), warps split over (query rows, head dim),
//                   added to the float32 dq_acc (BH, Nq, Dk) with red.global.add (zeroed by the host).
//   bwd_sm80_dq     deterministic dQ (no atomics): one block per query tile of 16 * NWARPS rows,
//                   key tiles through a cp.async ring (as fwd_sm80.cu), S, P, dP, dS recomputed
//                   in registers, dQ += dS K, one plain store per element. With bwd_sm80_dkdv
//                   <DQ_ATOMIC = false> the whole backward is bitwise reproducible.
// The scale is folded into dS before it is rounded to 16 bits, so dK and dQ need no final scaling.
// Tiles entirely visible to every row of the query tile skip the per-element predicate (the same
// full-tile rule as fwd_sm80.cu); with a mask or a bias (HAS_MB) every tile takes it.
//
// Requirements (the host falls back to the generic path otherwise): Dk == Dv == HEAD_DIM, unit
// innermost stride, row strides and offsets multiples of 8 elements, 16-byte aligned bases, scale > 0,
// Nq, Nk <= 2^29 (32-bit predicate, as fwd_sm80.cu).
#include "common.cuh"
#include "mask.cuh"
#include "mma_sm80.cuh"

// Every lse2 / delta buffer has Nq_pad = round_up(Nq, LSE_PAD) rows per (batch, head); LSE_PAD is a
// multiple of every BLOCK_M (the host mirrors it in _tc_bwd.LSE_PAD).
constexpr int LSE_PAD = 128;

namespace tcb {
using tc::u32;

// Two 16-bit values packed in one 32-bit word, as floats (lo = the lower address).
template <typename T> __device__ __forceinline__ void unpack2(u32 x, float& lo, float& hi);
template <> __device__ __forceinline__ void unpack2<bf16_t>(u32 x, float& lo, float& hi) {
  lo = __uint_as_float(x << 16);
  hi = __uint_as_float(x & 0xffff0000u);
}
template <> __device__ __forceinline__ void unpack2<half_t>(u32 x, float& lo, float& hi) {
  half_t a, b;
  a.bits = static_cast<unsigned short>(x & 0xffffu);
  b.bits = static_cast<unsigned short>(x >> 16);
  lo = to_float(a);
  hi = to_float(b);
}

// The 32-bit form of the position predicate (fwd_sm80.cu): query i sees key j iff
// i + dlo <= j <= i + dhi and j <= L - 1. Exact while Nq, Nk <= 2^29.
struct Pred32 {
  int dlo, dhi, L_last;
};
__device__ __forceinline__ Pred32 make_pred32(const Window& w) {
  constexpr long long CLAMP = 1LL << 30;
  Pred32 p;
  p.dlo = static_cast<int>(max(-CLAMP, min(CLAMP, w.shift - w.left)));
  p.dhi = static_cast<int>(max(-CLAMP, min(CLAMP, w.shift + w.right)));
  p.L_last = static_cast<int>(w.L) - 1;
  return p;
}
// Keys [j0, j0 + BN) visible to every query of [i0, i_last] (lo, hi are non-decreasing in i).
__device__ __forceinline__ bool tile_all_visible(const Pred32& p, int i0, int i_last, int j0,
                                                 int BN) {
  return max(i_last + p.dlo, 0) <= j0 && j0 + BN - 1 <= min(i0 + p.dhi, p.L_last);
}

// bwd_sm80_dkdv_x OPT bits (candidate variants; bwd_sm80_dkdv is OPT = 0). The B-fragment
// ldmatrix loads of dV += P^T dO and dK += dS^T Q have addresses that do not depend on anything
// computed in the query-tile iteration, so ptxas hoists them to the top of the iteration and holds
// them through S^T and dP^T (the registers that push the kernel to 255). fwd_sm80.cu fixed the same
// thing for V with a fake data dependency; these bits do it here:
//   DKDV_BDEP    k-step kk's B addresses + ((sign bit of the packed P^T of kk) << 4) for dV (P >= 0,
//                so 0; a NaN moves the read one 16-byte chunk inside the padded row), and
//                + ((sign bit of dS * dS) << 4) for dK: the loads cannot rise above exp2 / dS.
//   DKDV_BCHAIN  k-step kk > 0 also adds (accumulator of k-step kk - 1's first product is NaN) << 4:
//                at most one k-step of B fragments in flight (DF / 2 x4 loads).
//   DKDV_DQ_V4   dQ: lanes t, t ^ 1 swap half-fragments (2 shuffles per 8 columns) so that each
//                lane owns 4 consecutive columns of one row: one red.global.add.v4.f32 instead of
//                two .v2 (sm_90+; 4 scalar reductions on sm_80).
//   DKDV_LANE_OPQ the ldmatrix lane offsets are recomputed per query tile from opaque(lane)
//                (as fwd_sm80.cu) instead of staying live through the loop.
// (An enum, not constexpr ints: NVRTC emits namespace-scope constants as globals.)
enum DkdvOpt : int { DKDV_BDEP = 1, DKDV_BCHAIN = 2, DKDV_DQ_V4 = 4, DKDV_LANE_OPQ = 8 };

// p[0..3] += a, b, c, d in global memory (16-byte aligned), no return value.
__device__ __forceinline__ void red_add_f32x4(float* p, float a, float b, float c, float d) {
#if __CUDA_ARCH__ >= 900
  asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(p), "f"(a), "f"(b), "f"(c),
               "f"(d) : "memory");
#else
  asm volatile("red.global.add.f32 [%0], %1;" ::"l"(p), "f"(a) : "memory");
  asm volatile("red.global.add.f32 [%0], %1;" ::"l"(p + 1), "f"(b) : "memory");
  asm volatile("red.global.add.f32 [%0], %1;" ::"l"(p + 2), "f"(c) : "memory");
  asm volatile("red.global.add.f32 [%0], %1;" ::"l"(p + 3), "f"(d) : "memory");
#endif
}
// 16 when x is NaN, else 0: a data dependency ptxas cannot fold.
__device__ __forceinline__ u32 nan_dep(float x) { return x != x ? 16u : 0u; }


// acc (this warp's 16 key rows x NQF*8 query columns) = A B^T over the head dim, A the key-side
// fragments (K or V: from registers, or from shared memory at a_row), B the query-side rows (Q or
// dO) in shared memory at b_row. S^T = K Q^T and dP^T = V dO^T are both this product.
template <typename T, int NQF, int KD, bool KV_IN_REGS, int ROW_BYTES, int NA>
__device__ __forceinline__ void rows_times_queries(float (&acc)[NQF][4], const u32 (&areg)[NA][4],
                                                   u32 a_row, u32 b_row) {
  using namespace tc;
#pragma unroll
  for (int nf = 0; nf < NQF; ++nf)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[nf][e] = 0.f;
#pragma unroll
  for (int kk = 0; kk < KD; ++kk) {
    u32 a[4];
    if (KV_IN_REGS) {
#pragma unroll
      for (int e = 0; e < 4; ++e) a[e] = areg[KV_IN_REGS ? kk : 0][e];
    } else {
      ldsm_x4(a_row + kk * 32, a);
    }
#pragma unroll
    for (int p = 0; p < NQF / 2; ++p) {
      u32 b[4];
      ldsm_x4(b_row + p * 16 * ROW_BYTES + kk * 32, b);
      Mma<T>::run(acc[2 * p], a, b[0], b[1]);
      Mma<T>::run(acc[2 * p + 1], a, b[2], b[3]);
    }
  }
}
}  // namespace tcb

// Grid: 1-D over BH * Nq_pad * 8 threads; 8 lanes per row, 16-byte loads.
template <typename T, int HEAD_DIM>
__global__ void __launch_bounds__(256)
bwd_sm80_prep(const T* __restrict__ dout, const T* __restrict__ out, const float* __restrict__ lse,
              float* __restrict__ lse2, float* __restrict__ delta, int BH, int Nq, int Nq_pad) {
  constexpr int LPR = 8;              // lanes per row
  constexpr int CPR = HEAD_DIM / 8;   // 16-byte chunks per row
  const long long row = (static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x) / LPR;
  const int sub = threadIdx.x % LPR;
  const bool valid = row < static_cast<long long>(BH) * Nq_pad;
  const long long bh = row / Nq_pad;
  const int i = static_cast<int>(row % Nq_pad);
  const bool real = valid && i < Nq;
  float sum = 0.f;
  if (real) {
    const uint4* d = reinterpret_cast<const uint4*>(dout + (bh * Nq + i) * HEAD_DIM);
    const uint4* o = reinterpret_cast<const uint4*>(out + (bh * Nq + i) * HEAD_DIM);
#pragma unroll
    for (int c = sub; c < CPR; c += LPR) {
      const uint4 a = d[c], b = o[c];
      const tc::u32 av[4] = {a.x, a.y, a.z, a.w}, bv[4] = {b.x, b.y, b.z, b.w};
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float a0, a1, b0, b1;
        tcb::unpack2<T>(av[e], a0, a1);
        tcb::unpack2<T>(bv[e], b0, b1);
        sum = fmaf(a0, b0, sum);
        sum = fmaf(a1, b1, sum);
      }
    }
  }
#pragma unroll
  for (int off = LPR / 2; off > 0; off /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, off, LPR);
  if (valid && sub == 0) {
    const float l = real ? lse[bh * Nq + i] : -__int_as_float(0x7f800000);
    // -inf (empty row) -> +inf: exp2(x - lse2) = 0 for every finite or -inf x, no test needed.
    lse2[row] = (l == -__int_as_float(0x7f800000)) ? __int_as_float(0x7f800000) : l * LOG2E;
    delta[row] = real ? sum : 0.f;
  }
}

// Grid: 1-D, blockIdx.x = bh * n_ntiles + key tile: the blocks of one (batch, head) run together
// (its Q and dO stay in L2), the first key tiles (the longest causal ones) first.
template <typename T, int HEAD_DIM, int BLOCK_M, int NWARPS, bool KV_IN_REGS, bool DQ_ATOMIC,
          bool HAS_MB, int OPT>
__device__ __forceinline__ void
bwd_sm80_dkdv_body(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
              const T* __restrict__ dout, const float* __restrict__ lse2,
              const float* __restrict__ delta, float* __restrict__ dq_acc,
              float* __restrict__ dk_acc, float* __restrict__ dv_acc,
              const long long* __restrict__ offsets, const unsigned char* __restrict__ mask,
              const float* __restrict__ bias, const long long* __restrict__ kv_lens,
              long long q_rs, long long k_rs, long long v_rs, long long mask_rs,
              long long mask_cs, long long bias_rs, long long bias_cs, int BH, int Nq, int Nk,
              int Dk, int Dv, float scale, int left, int right, int bottom_right, int Nq_pad) {
  using namespace tc;
  constexpr int THREADS = NWARPS * 32;
  constexpr int BLOCK_N = 16 * NWARPS;  // keys per block, 16 per warp
  constexpr int NQF = BLOCK_M / 8;      // n-fragments of S^T / dP^T (queries)
  constexpr int DF = HEAD_DIM / 8;      // n-fragments of dK / dV (head dim)
  constexpr int KD = HEAD_DIM / 16;     // k-steps of K Q^T and V dO^T
  constexpr int KM = BLOCK_M / 16;      // k-steps of P^T dO and dS^T Q
  constexpr int ROW_BYTES = (HEAD_DIM + 8) * 2;
  constexpr int DS_ROW = (BLOCK_M + 8) * 2;  // dS^T rows (keys) in shared memory, padded
  constexpr int QT_BYTES = BLOCK_M * ROW_BYTES;
  // dQ = dS K: WM warps along the query rows (16 each), WD along the head dim.
  constexpr int WM = BLOCK_M / 16;
  constexpr int WD = NWARPS / WM;
  constexpr int DQ_COLS = HEAD_DIM / (WD > 0 ? WD : 1);
  constexpr int DQ_CHUNK = DQ_COLS <= 64 ? DQ_COLS : DQ_COLS / 2;  // <= 32 accumulators
  static_assert(BLOCK_M % 16 == 0 && HEAD_DIM % 16 == 0, "tile shape");
  static_assert(BLOCK_M <= LSE_PAD && LSE_PAD % BLOCK_M == 0, "lse2/delta padding");
  static_assert(THREADS >= BLOCK_M / 2, "lse2/delta copies: one 16-byte chunk per thread");
  static_assert(!DQ_ATOMIC || (WD >= 1 && NWARPS % WM == 0 && DQ_COLS % 16 == 0 &&
                               DQ_COLS % DQ_CHUNK == 0 && DQ_CHUNK % 16 == 0),
                "dQ warp layout");

  const int n_ntiles = (Nk + BLOCK_N - 1) / BLOCK_N;
  const long long bh = blockIdx.x / n_ntiles;
  const int j0 = static_cast<int>(blockIdx.x % n_ntiles) * BLOCK_N;

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int g = lane / 4, t = lane % 4;  // fragment coordinates: row g (+8), columns 2t, 2t+1

  long long L = kv_lens ? kv_lens[bh] : Nk;
  L = L < 0 ? 0 : (L > Nk ? Nk : L);
  const Window w = make_window(Nq, L, left, right, bottom_right);
  const tcb::Pred32 pr = tcb::make_pred32(w);
  const KeyRange qr = tile_query_range(w, j0, j0 + BLOCK_N - 1, Nq);
  const int m_first = qr.lo <= qr.hi ? static_cast<int>(qr.lo) / BLOCK_M : 0;
  const int n_mt = qr.lo <= qr.hi ? static_cast<int>(qr.hi) / BLOCK_M - m_first + 1 : 0;

  const T* qh = q + offsets[0 * BH + bh];
  const T* kh = k + offsets[1 * BH + bh];
  const T* vh = v + offsets[2 * BH + bh];
  const T* doh = dout + bh * Nq * HEAD_DIM;
  const float* l2h = lse2 + bh * Nq_pad;
  const float* dh = delta + bh * Nq_pad;
  const unsigned char* mh = (HAS_MB && mask) ? mask + offsets[3 * BH + bh] : nullptr;
  const float* bhp = (HAS_MB && bias) ? bias + offsets[4 * BH + bh] : nullptr;

  // Shared layout (mirrored by _tc_bwd.dkdv_smem_bytes): K, V [BLOCK_N], Q, dO [2][BLOCK_M] rows
  // of ROW_BYTES; dS^T [BLOCK_N] rows of DS_ROW; lse2, delta [2][BLOCK_M] floats.
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const u32 sK = smem_u32(smem_raw);
  const u32 sV = sK + BLOCK_N * ROW_BYTES;
  const u32 sQ = sV + BLOCK_N * ROW_BYTES;
  const u32 sdO = sQ + 2 * QT_BYTES;
  const u32 sdS = sdO + 2 * QT_BYTES;
  const u32 sL = sdS + BLOCK_N * DS_ROW;
  const u32 sD = sL + 2 * BLOCK_M * 4;

  // Per-lane ldmatrix offsets (mma_sm80.cuh layouts):
  //  K, V as A (rows = this warp's keys, x4): row lane % 16, column 8 * (lane / 16)
  //  Q, dO as B of K Q^T / V dO^T (x4 over two query fragments): row (lane % 8) + 8 * (lane / 16),
  //    column 8 * ((lane / 8) % 2)
  //  Q, dO, K as B of P^T dO, dS^T Q, dS K (x4.trans over two head-dim fragments):
  //    row (lane % 8) + 8 * ((lane / 8) % 2), column 8 * (lane / 16)
  //  dS as A of dS K, read transposed from dS^T (x4.trans): key row (lane % 8) + 8 * (lane / 16),
  //    query column 8 * ((lane / 8) % 2)
  constexpr bool LANE_OPQ = (OPT & tcb::DKDV_LANE_OPQ) != 0;
  const u32 a_lane0 = (warp * 16 + lane % 16) * ROW_BYTES + (lane / 16) * 16;
  const u32 bn_lane0 = (lane % 8 + 8 * (lane / 16)) * ROW_BYTES + ((lane / 8) % 2) * 16;
  const u32 bt_lane0 = (lane % 8 + 8 * ((lane / 8) % 2)) * ROW_BYTES + (lane / 16) * 16;
  const u32 ds_lane0 = (lane % 8 + 8 * (lane / 16)) * DS_ROW + ((lane / 8) % 2) * 16;

  // One query tile into ring slot `slot`: Q and dO rows (zeros past Nq), lse2 and delta (padded).
  auto load_query_tile = [&](int slot, int i0) {
    cp_tile<BLOCK_M, HEAD_DIM, THREADS>(sQ + slot * QT_BYTES, qh, q_rs, i0, Nq);
    cp_tile<BLOCK_M, HEAD_DIM, THREADS>(sdO + slot * QT_BYTES, doh, HEAD_DIM, i0, Nq);
    if (tid < BLOCK_M / 4) {
      cp_async16(sL + slot * BLOCK_M * 4 + tid * 16, l2h + i0 + tid * 4, 16);
    } else if (tid < BLOCK_M / 2) {
      const int c = tid - BLOCK_M / 4;
      cp_async16(sD + slot * BLOCK_M * 4 + c * 16, dh + i0 + c * 4, 16);
    }
  };

  // Prologue: K, V (zeros from key L on) with the first query tile, one commit group.
  if (n_mt > 0) {
    cp_tile<BLOCK_N, HEAD_DIM, THREADS>(sK, kh, k_rs, j0, static_cast<int>(L));
    cp_tile<BLOCK_N, HEAD_DIM, THREADS>(sV, vh, v_rs, j0, static_cast<int>(L));
    load_query_tile(0, m_first * BLOCK_M);
  }
  cp_async_commit();

  float dk[DF][4], dv[DF][4];
#pragma unroll
  for (int df = 0; df < DF; ++df)
#pragma unroll
    for (int e = 0; e < 4; ++e) dk[df][e] = dv[df][e] = 0.f;

  const float NEG = -__int_as_float(0x7f800000);
  const float scale_log2 = scale * LOG2E;
  const float sl2 = HAS_MB ? 1.f : scale_log2;
  const int jw = j0 + warp * 16 + g;  // this thread's keys: jw and jw + 8

  u32 ka[KV_IN_REGS ? KD : 1][4], va[KV_IN_REGS ? KD : 1][4];

  for (int it = 0; it < n_mt; ++it) {
    const int i0 = (m_first + it) * BLOCK_M;
    const int slot = it & 1;
    cp_async_wait<0>();
    __syncthreads();  // tile `it` landed; every warp finished tile it - 1 (its slot and dS^T)
    if (it + 1 < n_mt) load_query_tile(slot ^ 1, i0 + BLOCK_M);
    cp_async_commit();

    // Lane offsets (LANE_OPQ: recomputed here from an opaque lane index, a few integer ops).
    const int ln = LANE_OPQ ? opaque(lane) : lane;
    const u32 a_lane =
        LANE_OPQ ? (warp * 16 + ln % 16) * ROW_BYTES + (ln / 16) * 16 : a_lane0;
    const u32 bn_lane =
        LANE_OPQ ? (ln % 8 + 8 * (ln / 16)) * ROW_BYTES + ((ln / 8) % 2) * 16 : bn_lane0;
    const u32 bt_lane =
        LANE_OPQ ? (ln % 8 + 8 * ((ln / 8) % 2)) * ROW_BYTES + (ln / 16) * 16 : bt_lane0;
    const u32 ds_lane =
        LANE_OPQ ? (ln % 8 + 8 * (ln / 16)) * DS_ROW + ((ln / 8) % 2) * 16 : ds_lane0;

    if (KV_IN_REGS && it == 0) {
#pragma unroll
      for (int kk = 0; kk < KD; ++kk) {
        ldsm_x4(sK + a_lane + kk * 32, ka[KV_IN_REGS ? kk : 0]);
        ldsm_x4(sV + a_lane + kk * 32, va[KV_IN_REGS ? kk : 0]);
      }
    }
    const u32 qs = sQ + slot * QT_BYTES, dos = sdO + slot * QT_BYTES;
    const u32 ls = sL + slot * BLOCK_M * 4, des = sD + slot * BLOCK_M * 4;

    // S^T = K Q^T (raw dot products).
    float s[NQF][4];
    tcb::rows_times_queries<T, NQF, KD, KV_IN_REGS, ROW_BYTES>(s, ka, sK + a_lane,
                                                             qs + bn_lane);

    // Mask by global position (key = row, query = column), only where the tile is not entirely
    // visible. Padding query rows (>= Nq) need no test: their lse2 is +inf, so P = 0.
    const int i_last = min(i0 + BLOCK_M, Nq) - 1;
    if (HAS_MB || !tcb::tile_all_visible(pr, i0, i_last, j0, BLOCK_N)) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int j = jw + 8 * h;
#pragma unroll
        for (int nf = 0; nf < NQF; ++nf)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int i = i0 + nf * 8 + 2 * t + e;
            float x = s[nf][2 * h + e];
            if (j > pr.L_last || j < i + pr.dlo || j > i + pr.dhi) {
              x = NEG;
            } else if (HAS_MB) {
              if (i >= Nq) {
                x = NEG;
              } else if (mh != nullptr && !mh[i * mask_rs + j * mask_cs]) {
                x = NEG;
              } else {
                x *= scale_log2;
                if (bhp != nullptr) x = fmaf(bhp[i * bias_rs + j * bias_cs], LOG2E, x);
              }
            }
            s[nf][2 * h + e] = x;
          }
      }
    }

    // P^T = exp2(S^T * scale * log2e - lse2[query]); -inf (invisible) and +inf lse2 (empty or
    // padding row) both give exactly 0.
#pragma unroll
    for (int nf = 0; nf < NQF; ++nf) {
      float l0, l1;
      ld_shared_v2f(ls + (nf * 8 + 2 * t) * 4, l0, l1);
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        s[nf][2 * h] = ex2(fmaf(s[nf][2 * h], sl2, -l0));
        s[nf][2 * h + 1] = ex2(fmaf(s[nf][2 * h + 1], sl2, -l1));
      }
    }

    // dV += P^T dO: P^T packed straight from the accumulators (k = queries).
#pragma unroll
    for (int kk = 0; kk < KM; ++kk) {
      u32 pa[4];
      pa[0] = Mma<T>::pack(s[2 * kk][0], s[2 * kk][1]);
      pa[1] = Mma<T>::pack(s[2 * kk][2], s[2 * kk][3]);
      pa[2] = Mma<T>::pack(s[2 * kk + 1][0], s[2 * kk + 1][1]);
      pa[3] = Mma<T>::pack(s[2 * kk + 1][2], s[2 * kk + 1][3]);
      u32 vdep = 0;
      if (OPT & tcb::DKDV_BDEP) vdep = (pa[3] >> 31) << 4;
      if ((OPT & tcb::DKDV_BCHAIN) && kk > 0) vdep += tcb::nan_dep(dv[0][0]);
#pragma unroll
      for (int p = 0; p < DF / 2; ++p) {
        u32 b[4];
        ldsm_x4_t(dos + vdep + bt_lane + kk * 16 * ROW_BYTES + p * 32, b);
        Mma<T>::run(dv[2 * p], pa, b[0], b[1]);
        Mma<T>::run(dv[2 * p + 1], pa, b[2], b[3]);
      }
    }

    // dP^T = V dO^T.
    float dp[NQF][4];
    tcb::rows_times_queries<T, NQF, KD, KV_IN_REGS, ROW_BYTES>(dp, va, sV + a_lane,
                                                             dos + bn_lane);

    // dS^T = scale * P^T (dP^T - delta[query]), in dp.
#pragma unroll
    for (int nf = 0; nf < NQF; ++nf) {
      float d0, d1;
      ld_shared_v2f(des + (nf * 8 + 2 * t) * 4, d0, d1);
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        dp[nf][2 * h] = scale * s[nf][2 * h] * (dp[nf][2 * h] - d0);
        dp[nf][2 * h + 1] = scale * s[nf][2 * h + 1] * (dp[nf][2 * h + 1] - d1);
      }
    }

    // dK += dS^T Q; the packed dS^T also goes to shared memory for dQ.
#pragma unroll
    for (int kk = 0; kk < KM; ++kk) {
      u32 da[4];
      da[0] = Mma<T>::pack(dp[2 * kk][0], dp[2 * kk][1]);
      da[1] = Mma<T>::pack(dp[2 * kk][2], dp[2 * kk][3]);
      da[2] = Mma<T>::pack(dp[2 * kk + 1][0], dp[2 * kk + 1][1]);
      da[3] = Mma<T>::pack(dp[2 * kk + 1][2], dp[2 * kk + 1][3]);
      u32 kdep = 0;
      if (OPT & tcb::DKDV_BDEP)
        kdep = (__float_as_uint(dp[2 * kk + 1][3] * dp[2 * kk + 1][3]) >> 31) << 4;
      if ((OPT & tcb::DKDV_BCHAIN) && kk > 0) kdep += tcb::nan_dep(dk[0][0]);
      if (DQ_ATOMIC) {
        // a0 = (key g, queries 16kk + 2t..), a1 = key g + 8, a2/a3 = queries + 8.
        const u32 row = sdS + (warp * 16 + g) * DS_ROW + (kk * 16 + 2 * t) * 2;
        st_shared_b32(row, da[0]);
        st_shared_b32(row + 8 * DS_ROW, da[1]);
        st_shared_b32(row + 16, da[2]);
        st_shared_b32(row + 8 * DS_ROW + 16, da[3]);
      }
#pragma unroll
      for (int p = 0; p < DF / 2; ++p) {
        u32 b[4];
        ldsm_x4_t(qs + kdep + bt_lane + kk * 16 * ROW_BYTES + p * 32, b);
        Mma<T>::run(dk[2 * p], da, b[0], b[1]);
        Mma<T>::run(dk[2 * p + 1], da, b[2], b[3]);
      }
    }

    if (DQ_ATOMIC) {
      __syncthreads();  // dS^T of every warp in shared memory
      // dQ[i0 + 16 wm .., cols] += dS K over this block's BLOCK_N keys.
      constexpr int WD_ = WD > 0 ? WD : 1;
      const int wm = warp % WM, wd = warp / WM;
      const int col0 = wd * (HEAD_DIM / WD_);
#pragma unroll
      for (int c0 = 0; c0 < DQ_COLS; c0 += DQ_CHUNK) {
        float acc[DQ_CHUNK / 8][4];
#pragma unroll
        for (int nf = 0; nf < DQ_CHUNK / 8; ++nf)
#pragma unroll
          for (int e = 0; e < 4; ++e) acc[nf][e] = 0.f;
#pragma unroll
        for (int kk = 0; kk < BLOCK_N / 16; ++kk) {
          u32 a[4];
          ldsm_x4_t(sdS + ds_lane + kk * 16 * DS_ROW + wm * 32, a);
#pragma unroll
          for (int p = 0; p < DQ_CHUNK / 16; ++p) {
            u32 b[4];
            ldsm_x4_t(sK + bt_lane + kk * 16 * ROW_BYTES + (col0 + c0) * 2 + p * 32, b);
            Mma<T>::run(acc[2 * p], a, b[0], b[1]);
            Mma<T>::run(acc[2 * p + 1], a, b[2], b[3]);
          }
        }
        if (OPT & tcb::DKDV_DQ_V4) {
          // Even t: row g, columns 2t..2t+3 (its own pair, then its partner's h = 0 pair); odd t:
          // row g + 8, columns 2t-2..2t+1 (the partner's h = 1 pair, then its own).
          const bool odd = (t & 1) != 0;
          const int i = i0 + wm * 16 + g + (odd ? 8 : 0);
          float* row = dq_acc + (bh * Nq + i) * HEAD_DIM + col0 + c0 + 4 * (t / 2);
#pragma unroll
          for (int nf = 0; nf < DQ_CHUNK / 8; ++nf) {
            const float s0 = odd ? acc[nf][0] : acc[nf][2];
            const float s1 = odd ? acc[nf][1] : acc[nf][3];
            const float r0 = __shfl_xor_sync(0xffffffffu, s0, 1);
            const float r1 = __shfl_xor_sync(0xffffffffu, s1, 1);
            if (i < Nq) {
              if (odd)
                tcb::red_add_f32x4(row + nf * 8, r0, r1, acc[nf][2], acc[nf][3]);
              else
                tcb::red_add_f32x4(row + nf * 8, acc[nf][0], acc[nf][1], r0, r1);
            }
          }
        } else {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int i = i0 + wm * 16 + g + 8 * h;
          if (i < Nq) {
            float* row = dq_acc + (bh * Nq + i) * HEAD_DIM + col0 + c0 + 2 * t;
#pragma unroll
            for (int nf = 0; nf < DQ_CHUNK / 8; ++nf)
              red_add_f32x2(row + nf * 8, acc[nf][2 * h], acc[nf][2 * h + 1]);
          }
        }
        }
      }
    }
  }

  // Every key row of the tile below Nk is written, zeros where no query sees it.
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int j = jw + 8 * h;
    if (j < Nk) {
      float* dkr = dk_acc + (bh * Nk + j) * HEAD_DIM + 2 * t;
      float* dvr = dv_acc + (bh * Nk + j) * HEAD_DIM + 2 * t;
#pragma unroll
      for (int df = 0; df < DF; ++df) {
        *reinterpret_cast<float2*>(dkr + df * 8) = make_float2(dk[df][2 * h], dk[df][2 * h + 1]);
        *reinterpret_cast<float2*>(dvr + df * 8) = make_float2(dv[df][2 * h], dv[df][2 * h + 1]);
      }
    }
  }
}

template <typename T, int HEAD_DIM, int BLOCK_M, int NWARPS, bool KV_IN_REGS, bool DQ_ATOMIC,
          bool HAS_MB, int MIN_BLOCKS>
__global__ void __launch_bounds__(NWARPS * 32, MIN_BLOCKS)
bwd_sm80_dkdv(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
              const T* __restrict__ dout, const float* __restrict__ lse2,
              const float* __restrict__ delta, float* __restrict__ dq_acc,
              float* __restrict__ dk_acc, float* __restrict__ dv_acc,
              const long long* __restrict__ offsets, const unsigned char* __restrict__ mask,
              const float* __restrict__ bias, const long long* __restrict__ kv_lens,
              long long q_rs, long long k_rs, long long v_rs, long long mask_rs,
              long long mask_cs, long long bias_rs, long long bias_cs, int BH, int Nq, int Nk,
              int Dk, int Dv, float scale, int left, int right, int bottom_right, int Nq_pad) {
  bwd_sm80_dkdv_body<T, HEAD_DIM, BLOCK_M, NWARPS, KV_IN_REGS, DQ_ATOMIC, HAS_MB, 0>(
      q, k, v, dout, lse2, delta, dq_acc, dk_acc, dv_acc, offsets, mask, bias, kv_lens, q_rs, k_rs, v_rs, mask_rs, mask_cs, bias_rs, bias_cs, BH, Nq, Nk, Dk, Dv, scale, left, right, bottom_right, Nq_pad);
}

// Candidate variants (not used by default): the same body with OPT != 0 (bits: see tcb::DKDV_*).
template <typename T, int HEAD_DIM, int BLOCK_M, int NWARPS, bool KV_IN_REGS, bool DQ_ATOMIC,
          bool HAS_MB, int MIN_BLOCKS, int OPT>
__global__ void __launch_bounds__(NWARPS * 32, MIN_BLOCKS)
bwd_sm80_dkdv_x(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
              const T* __restrict__ dout, const float* __restrict__ lse2,
              const float* __restrict__ delta, float* __restrict__ dq_acc,
              float* __restrict__ dk_acc, float* __restrict__ dv_acc,
              const long long* __restrict__ offsets, const unsigned char* __restrict__ mask,
              const float* __restrict__ bias, const long long* __restrict__ kv_lens,
              long long q_rs, long long k_rs, long long v_rs, long long mask_rs,
              long long mask_cs, long long bias_rs, long long bias_cs, int BH, int Nq, int Nk,
              int Dk, int Dv, float scale, int left, int right, int bottom_right, int Nq_pad) {
  bwd_sm80_dkdv_body<T, HEAD_DIM, BLOCK_M, NWARPS, KV_IN_REGS, DQ_ATOMIC, HAS_MB, OPT>(
      q, k, v, dout, lse2, delta, dq_acc, dk_acc, dv_acc, offsets, mask, bias, kv_lens, q_rs, k_rs, v_rs, mask_rs, mask_cs, bias_rs, bias_cs, BH, Nq, Nk, Dk, Dv, scale, left, right, bottom_right, Nq_pad);
}

// Deterministic dQ. Grid: 1-D, blockIdx.x = bh * n_mtiles + (reversed query tile), as fwd_sm80.
// BLOCK_M = 16 * NWARPS query rows, warp w owns rows [16 w, 16 w + 16); key tiles of BLOCK_N start
// at the first visible key (tile_key_range) and stream through a STAGES-deep ring of K and V.
template <typename T, int HEAD_DIM, int BLOCK_N, int NWARPS, int STAGES, bool HAS_MB,
          int MIN_BLOCKS>
__global__ void __launch_bounds__(NWARPS * 32, MIN_BLOCKS)
bwd_sm80_dq(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
            const T* __restrict__ dout, const float* __restrict__ lse2,
            const float* __restrict__ delta, float* __restrict__ dq_acc,
            const long long* __restrict__ offsets, const unsigned char* __restrict__ mask,
            const float* __restrict__ bias, const long long* __restrict__ kv_lens,
            long long q_rs, long long k_rs, long long v_rs, long long mask_rs,
            long long mask_cs, long long bias_rs, long long bias_cs, int BH, int Nq, int Nk,
            int Dk, int Dv, float scale, int left, int right, int bottom_right, int Nq_pad) {
  using namespace tc;
  constexpr int THREADS = NWARPS * 32;
  constexpr int BLOCK_M = 16 * NWARPS;
  constexpr int NF = BLOCK_N / 8;   // n-fragments of S / dP (keys)
  constexpr int DF = HEAD_DIM / 8;  // n-fragments of dQ
  constexpr int KD = HEAD_DIM / 16;
  constexpr int KN = BLOCK_N / 16;  // k-steps of dS K
  constexpr int ROW_BYTES = (HEAD_DIM + 8) * 2;
  constexpr int TILE_BYTES = BLOCK_N * ROW_BYTES;
  static_assert(BLOCK_N % 16 == 0 && HEAD_DIM % 16 == 0, "tile shape");
  static_assert(LSE_PAD % BLOCK_M == 0, "lse2/delta padding");
  static_assert(STAGES >= 2, "cp.async ring depth");

  const int n_mtiles = (Nq + BLOCK_M - 1) / BLOCK_M;
  const long long bh = blockIdx.x / n_mtiles;
  const int i0 = (n_mtiles - 1 - static_cast<int>(blockIdx.x % n_mtiles)) * BLOCK_M;
  const int i_last = min(i0 + BLOCK_M, Nq) - 1;

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int g = lane / 4, t = lane % 4;

  long long L = kv_lens ? kv_lens[bh] : Nk;
  L = L < 0 ? 0 : (L > Nk ? Nk : L);
  const Window w = make_window(Nq, L, left, right, bottom_right);
  const tcb::Pred32 pr = tcb::make_pred32(w);
  const KeyRange range = tile_key_range(w, i0, i_last);
  const int n_tiles = range.hi >= range.lo
                          ? static_cast<int>((range.hi - range.lo) / BLOCK_N) + 1 : 0;
  const int j_first = static_cast<int>(range.lo);
  const int j_limit = static_cast<int>(range.hi) + 1;  // keys >= j_limit load as zeros

  const T* qh = q + offsets[0 * BH + bh];
  const T* kh = k + offsets[1 * BH + bh];
  const T* vh = v + offsets[2 * BH + bh];
  const T* doh = dout + bh * Nq * HEAD_DIM;
  const unsigned char* mh = (HAS_MB && mask) ? mask + offsets[3 * BH + bh] : nullptr;
  const float* bhp = (HAS_MB && bias) ? bias + offsets[4 * BH + bh] : nullptr;

  // Shared layout (mirrored by _tc_bwd.dq_smem_bytes): Q, dO [BLOCK_M], K, V [STAGES][BLOCK_N].
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const u32 sQ = smem_u32(smem_raw);
  const u32 sdO = sQ + BLOCK_M * ROW_BYTES;
  const u32 sK = sdO + BLOCK_M * ROW_BYTES;
  const u32 sV = sK + STAGES * TILE_BYTES;

  // ldmatrix lane offsets as fwd_sm80.cu: Q, dO as A; K, V as B (non-trans); K as B of dS K (trans).
  const u32 a_lane = (warp * 16 + lane % 16) * ROW_BYTES + (lane / 16) * 16;
  const u32 bn_lane = (lane % 8 + 8 * (lane / 16)) * ROW_BYTES + ((lane / 8) % 2) * 16;
  const u32 bt_lane = (lane % 8 + 8 * ((lane / 8) % 2)) * ROW_BYTES + (lane / 16) * 16;

  cp_tile<BLOCK_M, HEAD_DIM, THREADS>(sQ, qh, q_rs, i0, Nq);
  cp_tile<BLOCK_M, HEAD_DIM, THREADS>(sdO, doh, HEAD_DIM, i0, Nq);
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < n_tiles) {
      const int j0 = j_first + s * BLOCK_N;
      cp_tile<BLOCK_N, HEAD_DIM, THREADS>(sK + s * TILE_BYTES, kh, k_rs, j0, j_limit);
      cp_tile<BLOCK_N, HEAD_DIM, THREADS>(sV + s * TILE_BYTES, vh, v_rs, j0, j_limit);
    }
    cp_async_commit();
  }

  // This thread's rows i0 + 16 warp + g (+ 8): lse2 (+inf past Nq) and delta (padded buffers).
  float l2r[2], der[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const long long i = static_cast<long long>(i0) + warp * 16 + g + 8 * h;
    l2r[h] = lse2[bh * Nq_pad + i];
    der[h] = delta[bh * Nq_pad + i];
  }

  float dq[DF][4];
#pragma unroll
  for (int df = 0; df < DF; ++df)
#pragma unroll
    for (int e = 0; e < 4; ++e) dq[df][e] = 0.f;
  const float NEG = -__int_as_float(0x7f800000);
  const float scale_log2 = scale * LOG2E;
  const float sl2 = HAS_MB ? 1.f : scale_log2;
  const int full_lo = static_cast<int>(min(key_range(w, i_last).lo, L));
  const int full_hi = static_cast<int>(max(key_range(w, i0).hi, -1LL));

  for (int n = 0; n < n_tiles; ++n) {
    const int j0 = j_first + n * BLOCK_N;
    cp_async_wait<STAGES - 2>();
    __syncthreads();  // tile n landed for everyone; everyone finished tile n - 1's buffers
    {
      const int nn = n + STAGES - 1;
      const int buf = nn % STAGES;
      if (nn < n_tiles) {
        const int jn = j_first + nn * BLOCK_N;
        cp_tile<BLOCK_N, HEAD_DIM, THREADS>(sK + buf * TILE_BYTES, kh, k_rs, jn, j_limit);
        cp_tile<BLOCK_N, HEAD_DIM, THREADS>(sV + buf * TILE_BYTES, vh, v_rs, jn, j_limit);
      }
      cp_async_commit();
    }
    const u32 kbuf = sK + (n % STAGES) * TILE_BYTES;
    const u32 vbuf = sV + (n % STAGES) * TILE_BYTES;

    // S = Q K^T and dP = dO V^T.
    float s[NF][4], dp[NF][4];
#pragma unroll
    for (int nf = 0; nf < NF; ++nf)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[nf][e] = dp[nf][e] = 0.f;
#pragma unroll
    for (int kk = 0; kk < KD; ++kk) {
      u32 a[4];
      ldsm_x4(sQ + a_lane + kk * 32, a);
#pragma unroll
      for (int p = 0; p < NF / 2; ++p) {
        u32 b[4];
        ldsm_x4(kbuf + bn_lane + p * 16 * ROW_BYTES + kk * 32, b);
        Mma<T>::run(s[2 * p], a, b[0], b[1]);
        Mma<T>::run(s[2 * p + 1], a, b[2], b[3]);
      }
    }
#pragma unroll
    for (int kk = 0; kk < KD; ++kk) {
      u32 a[4];
      ldsm_x4(sdO + a_lane + kk * 32, a);
#pragma unroll
      for (int p = 0; p < NF / 2; ++p) {
        u32 b[4];
        ldsm_x4(vbuf + bn_lane + p * 16 * ROW_BYTES + kk * 32, b);
        Mma<T>::run(dp[2 * p], a, b[0], b[1]);
        Mma<T>::run(dp[2 * p + 1], a, b[2], b[3]);
      }
    }

    // Mask (rows = queries, columns = keys), only in tiles not entirely visible to the block.
    if (HAS_MB || j0 < full_lo || j0 + BLOCK_N - 1 > full_hi) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int i = i0 + warp * 16 + g + 8 * h;
        const int c_lo = max(i + pr.dlo, 0) - j0;
        const int c_hi = i < Nq ? min(i + pr.dhi, pr.L_last) - j0 : -1;
#pragma unroll
        for (int nf = 0; nf < NF; ++nf)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int c = nf * 8 + 2 * t + e;
            float x = s[nf][2 * h + e];
            if (c < c_lo || c > c_hi) {
              x = NEG;
            } else if (HAS_MB) {
              const long long j = static_cast<long long>(j0) + c;
              if (mh != nullptr && !mh[i * mask_rs + j * mask_cs]) {
                x = NEG;
              } else {
                x *= scale_log2;
                if (bhp != nullptr) x = fmaf(bhp[i * bias_rs + j * bias_cs], LOG2E, x);
              }
            }
            s[nf][2 * h + e] = x;
          }
      }
    }

    // dS = scale * P (dP - delta), P = exp2(S * scale * log2e - lse2[row]).
#pragma unroll
    for (int nf = 0; nf < NF; ++nf)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float p = ex2(fmaf(s[nf][e], sl2, -l2r[e / 2]));
        s[nf][e] = scale * p * (dp[nf][e] - der[e / 2]);
      }

    // dQ += dS K: dS packed from the accumulators (k = keys), K read transposed.
#pragma unroll
    for (int kk = 0; kk < KN; ++kk) {
      u32 da[4];
      da[0] = Mma<T>::pack(s[2 * kk][0], s[2 * kk][1]);
      da[1] = Mma<T>::pack(s[2 * kk][2], s[2 * kk][3]);
      da[2] = Mma<T>::pack(s[2 * kk + 1][0], s[2 * kk + 1][1]);
      da[3] = Mma<T>::pack(s[2 * kk + 1][2], s[2 * kk + 1][3]);
#pragma unroll
      for (int p = 0; p < DF / 2; ++p) {
        u32 b[4];
        ldsm_x4_t(kbuf + bt_lane + kk * 16 * ROW_BYTES + p * 32, b);
        Mma<T>::run(dq[2 * p], da, b[0], b[1]);
        Mma<T>::run(dq[2 * p + 1], da, b[2], b[3]);
      }
    }
  }
  cp_async_wait<0>();  // no copy outlives the block

#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int i = i0 + warp * 16 + g + 8 * h;
    if (i < Nq) {
      float* row = dq_acc + (bh * Nq + i) * HEAD_DIM + 2 * t;
#pragma unroll
      for (int df = 0; df < DF; ++df)
        *reinterpret_cast<float2*>(row + df * 8) = make_float2(dq[df][2 * h], dq[df][2 * h + 1]);
    }
  }
}
