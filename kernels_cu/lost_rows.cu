// lost_rows.cu: exact recomputation of "lost" rows, any dtype, any sm_70+.
//
// A row whose finite |lse| is at least `lost` (cuflash/_config.py LOST_LSE: 2^12 for a float32
// lse, 2^24 for float64) cannot carry log(l) in its lse: lse = m + log(l) rounds to m once
// ulp(m) / 2 exceeds log(l) (a row padded with an additive finfo.min bias; float16 logits near
// 1e10), and P = exp(s - lse) would be off by up to the factor l.
//
// Forward (fwd_lost_rows, after the tensor-core forward without mask / bias): that kernel folds
// the scale into one FFMA, p = exp2(fma(s, scale * log2e, -m)), whose rounding residual reaches
// ulp(m) / 2 and overflows exp2 once |m| is huge (p = inf, then NaN). The rows it may have
// computed wrongly are exactly those whose lse came out lost, NaN or +inf; this kernel recomputes
// their out and lse in double (a NaN row stays NaN). With attention sinks the forward kernels
// joined each row's sink at its end (sinks.cuh), and so does this kernel to the rows it
// recomputes. (The rows are chosen by the joined lse: one whose keys' lse alone is lost but whose
// sink lifts it below the limit keeps the kernel's value, the keys' part weighted by their share
// exp(lse0 - lse), which is about 0 but where the keys' maximum is within the rounding residual
// that the limit allows anyway.)
//
// Backward: the main kernels skip lost rows (their preprocess gives them lse = +inf and
// delta = 0); these two kernels then ADD their exact gradients, recomputing each lost row's max
// and sum from its own logits, in double:
//   bwd_lost_rows  one warp per 128 rows of the flattened (BH, Nq): flags[c] = "rows
//                  [32 c, 32 c + 32) hold a lost row", always written; per lost row: m, l, delta
//                  in `stats` (with attention sinks, the row's sink logit is one more term of m
//                  and l, and its probability exp(t - m) / l goes to sink_probs), then
//                  dq += scale * dS K
//   bwd_lost_keys  one warp per 128 keys of one (batch, head) (with `group` > 1: of one kv head,
//                  for its group's heads in order), after bwd_lost_rows: for each key
//                  and each lost row that sees it, in row order: dv += P^T dO, dk += scale dS^T Q;
//                  then, for the tensor-core backward (dq_out not null), dq_out = dq rounded to
//                  the inputs' dtype, over the whole grid (every dq row is final by then)
// With dropout (a trailing DropoutArgs, philox.cuh) both kernels draw the main kernels' keep bits:
// dS = P (Z dP / (1 - p) - delta), dV += (Z P / (1 - p))^T dO.
// Without lost rows a warp reads its rows' lse (or the flags of its keys' query range) and
// returns. No atomics: each dq row and each dk / dv row has one owner: deterministic.
//
// A warp computes one (query, key) dot product at a time, lane c owning head-dim columns
// c, c + 32, ... (summed in that order, then by a fixed shuffle tree), so every kernel computes
// bitwise the same logits. out, dout are contiguous (BH, Nq, Dv); lse contiguous (BH, Nq).
#include "lost_rows.cuh"

// The parameters of both backward lost-row kernels before their own outputs.
#define LOST_PARAMS                                                                            \
  const T *__restrict__ q, const T *__restrict__ k, const T *__restrict__ v,                   \
      const T *__restrict__ dout, const T *__restrict__ out, const Acc *__restrict__ lse,      \
      ATTN_INPUTS(Acc), const AttnArgs a, double lost, double *__restrict__ stats,              \
      int *__restrict__ flags
// One warp's exact backward of lost row `row` of the flattened (BH, Nq): its max m, sum l and
// delta into stats (BH, Nq, 3); with a sink (sinks: (BH,) each (batch, head)'s sink logit, -inf:
// none; nullptr without sinks) the sink is one more term of m and l, and its probability goes to
// sink_probs (BH, Nq); then dq's row += scale * dS K. dout_row: the row of dO (the caller's or
// the contiguous copy). COLS: head-dim columns per lane (COLS * 32 >= Dk, Dv).
template <typename T, typename Acc, typename F, int COLS, typename... Drop>
__device__ __forceinline__ void lost_row_backward(LOST_PARAMS, Acc* __restrict__ dq,
                                                  const double* __restrict__ sinks,
                                                  double* __restrict__ sink_probs,
                                                  const T* dout_row, long long row,
                                                  const Drop... drop) {
  ATTN_ARGS_LOCALS(a, double);
  const int lane = threadIdx.x % 32;
  const double neg_inf = -__longlong_as_double(0x7ff0000000000000LL);
  const long long bh = row / Nq, i = row % Nq;
  const LostHead<T, Acc, F> h = LOST_HEAD(dout);
  const auto dz = dropout_at<double>(bh, drop...);
  double qi[COLS], doi[COLS], dqi[COLS];
  load_row(qi, h.q + i * h.q_rs, Dk);
  load_row(doi, dout_row, Dv);
  const double delta = dot(doi, out + (bh * Nq + i) * Dv, Dv);
  const KeyRange kr = key_range(h.w, i);
  // The row's max and sum, online (a -inf logit adds nothing).
  double m = neg_inf, l = 0.0;
  for (long long j = kr.lo; j <= kr.hi; ++j) {
    double x, g = 1.0;
    const double qk = dot(qi, h.k + j * h.k_rs, Dk);
    if (!h.logit(x, qk, i, j, g) || x == neg_inf) continue;
    add_logit(m, l, x);
  }
  if (sinks != nullptr && sinks[bh] != neg_inf) {  // the sink column: a logit of value 0
    add_logit(m, l, sinks[bh]);
    if (lane == 0) sink_probs[row] = exp(sinks[bh] - m) / l;
  }
  if (lane == 0) {
    stats[3 * row + 0] = m;
    stats[3 * row + 1] = l;
    stats[3 * row + 2] = delta;
  }
  // dq = scale * sum_j dS_ij k_j with P = exp(x - m) / l, dS = P (dO . v_j - delta) F'.
#pragma unroll
  for (int c = 0; c < COLS; ++c) dqi[c] = 0.0;
  for (long long j = kr.lo; j <= kr.hi; ++j) {
    double x, g = 1.0;
    const double qk = dot(qi, h.k + j * h.k_rs, Dk);
    if (!h.logit(x, qk, i, j, g)) continue;
    const double p = exp(x - m) / l;
    const bool kept = dz.keep(i, j);  // warp-uniform
    const double ds =
        p * ((kept ? dz.scaled(dot(doi, h.v + j * h.v_rs, Dv)) : 0.0) - delta) * g;
    axpy(dqi, ds, h.k + j * h.k_rs, Dk);
  }
  Acc* dq_row = dq + row * Dk;
#pragma unroll
  for (int c = 0; c < COLS; ++c) {
    const int col = lane + 32 * c;
    if (col < Dk) add_to(dq_row + col, h.scale * dqi[c]);
  }
}

// Grid: a stride of warps over items of 128 rows of one (batch, head). flags: (BH, ceil(Nq / 32)),
// one per 32 rows of a (batch, head): read when `prewritten` (the tensor-core preprocess wrote
// them), else written here from lse. stats: (BH, Nq, 3) = m, l, delta of lost rows only; sinks,
// sink_probs as lost_row_backward takes them. (The lost rows' logit gradients, dbias, are
// bwd_lost_keys', which runs after every kernel that stores dbias.)
template <typename T, typename Acc, typename F = NoTransform, typename... Drop>
__global__ void __launch_bounds__(NUM_THREADS, 1)
bwd_lost_rows(LOST_PARAMS, Acc* __restrict__ dq, int prewritten, const double* __restrict__ sinks,
              double* __restrict__ sink_probs, const Drop... drop) {
  const int Nq = a.Nq, Dv = a.Dv;
  const int n_chunks = (Nq + LOST_CHUNK - 1) / LOST_CHUNK;
  const long long n_items = static_cast<long long>(a.BH) * ((Nq + LOST_SEG - 1) / LOST_SEG);
  const int lane = threadIdx.x % 32;
  for (long long item = static_cast<long long>(blockIdx.x) * LOST_WARPS + threadIdx.x / 32;
       item < n_items; item += static_cast<long long>(gridDim.x) * LOST_WARPS) {
  const long long bh = item / ((Nq + LOST_SEG - 1) / LOST_SEG);
  const int c_first = static_cast<int>(item % ((Nq + LOST_SEG - 1) / LOST_SEG)) * (LOST_SEG / LOST_CHUNK);
  unsigned bits = 0u;  // lane e < 4: the lost rows of chunk c_first + e
#pragma unroll
  for (int e = 0; e < LOST_SEG / LOST_CHUNK; ++e) {
    const int c = c_first + e;
    if (c >= n_chunks || (prewritten && !flags[bh * n_chunks + c])) continue;  // warp-uniform
    const int i = c * LOST_CHUNK + lane;
    const unsigned b = __ballot_sync(
        FULL_WARP, i < Nq && is_lost(static_cast<double>(lse[bh * Nq + i]), lost));
    if (!prewritten && lane == 0) flags[bh * n_chunks + c] = b != 0u;
    if (lane == e) bits = b;
  }
  const long long row0 = bh * Nq + static_cast<long long>(c_first) * LOST_CHUNK;
  for_each_row(bits, row0, [&](long long row) {
    lost_row_backward<T, Acc, F, LOST_COLS>(q, k, v, dout, out, lse, offsets, mask, bias,
                                            kv_lens, a, lost, stats, flags, dq, sinks,
                                            sink_probs, dout + row * Dv, row, drop...);
  });
  }  // items
}

// Half h (0: the low 16 bits) of a 32-bit word of two 16-bit T, as float.
template <typename T>
__device__ __forceinline__ float half_word(unsigned w, int h) {
  T t;
  t.bits = static_cast<unsigned short>(h ? w >> 16 : w & 0xffffu);
  return to_float(t);
}

// The tensor-core backward's preprocess (cuflash/_mma_bwd.py), with its lost rows' backward.
// Grid: 1-D over BH * Nq_pad / 32 blocks of 128 threads (32 rows of one (batch, head): Nq_pad is a
// multiple of 32; one lost-row flag); 4 lanes per row, 16-byte loads. Per row: delta =
// rowsum(dO * O) and lse2 = lse * log2(e), float32, padded to Nq_pad rows per (batch, head); an
// empty or lost row gets lse2 = +inf and delta = 0, so that the main kernels skip it. dout: (BH,
// Nq, Dv) rows read; or, where dout_src is another array (the caller's dO in any layout of
// 16-byte rows: dout_rows[bh] the element offset of head bh's matrix, dout_rows[BH] its row
// stride), read there and written to dout, which the other kernels then read: no separate copy
// pass. (Always two addresses, so that a layout's launch takes either: dout_src = dout_rows =
// dout for none.) dq_zero (dQ added by the dK/dV kernel's atomics, else null): dQ's float32
// rows zeroed, and dq_turns (DKDV_DQ_ORDER, else null) with them. Then, with `settle` (dQ
// zeroed here), the block's lost rows' exact backward (lost_row_backward, a warp a row, into the
// zeroed dq, before any dK/dV block adds to it); without, bwd_lost_rows runs it after the dQ
// kernel. COLS: head-dim columns per lane of the lost rows (COLS * 32 >= Dk, Dv); a row's rowsum
// takes 4 lanes, each with COLS 16-byte chunks of dO and of O in flight (8 lanes of fewer chunks
// each, or 2 of more, were no faster: H100, RESULTS thirty-seventh section).
constexpr int PREP_LANES = 4;  // lanes per row; a block is 32 rows
template <typename T, int COLS, typename F = NoTransform, typename... Drop>
__global__ void __launch_bounds__(32 * PREP_LANES, 1)
bwd_mma_prep(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
             T* dout, const T* __restrict__ out, const float* __restrict__ lse,
             ATTN_INPUTS(float), const AttnArgs a, double lost, double* __restrict__ stats,
             int* __restrict__ flags, float* __restrict__ lse2, float* __restrict__ delta,
             int Nq_pad, float* __restrict__ dq_zero, int* __restrict__ dq_turns,
             const T* dout_src, const long long* dout_rows, int settle,
             const double* __restrict__ sinks, double* __restrict__ sink_probs,
             const Drop... drop) {
  const int BH = a.BH, Nq = a.Nq, Dk = a.Dk, Dv = a.Dv;
  const bool copy = dout_src != dout;
  // row i of head bh of the caller's dO (a block's lost rows read it there too: this block's
  // copy of it may not be visible to the loads of another warp)
  auto caller_row = [&](long long bh, long long i) {
    return copy ? dout_src + dout_rows[bh] + i * dout_rows[BH] : dout + (bh * Nq + i) * Dv;
  };
  constexpr int LPR = PREP_LANES, THREADS = 32 * LPR, CHUNKS = COLS;  // (chunks: a lane's)
  static_assert(CHUNKS * LPR * 8 == 32 * COLS, "COLS * 32 columns in 16-byte chunks");
  const long long row = (static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x) / LPR;
  const int sub = threadIdx.x % LPR;
  const bool valid = row < static_cast<long long>(BH) * Nq_pad;
  const long long bh = row / Nq_pad;
  const int i = static_cast<int>(row % Nq_pad);
  const bool real = valid && i < Nq;
  float sum = 0.f;
  if (real) {
    uint4* dc = reinterpret_cast<uint4*>(dout + (bh * Nq + i) * Dv);
    const uint4* d = reinterpret_cast<const uint4*>(caller_row(bh, i));
    const uint4* o = reinterpret_cast<const uint4*>(out + (bh * Nq + i) * Dv);
    // the row's 16-byte chunks c = sub, sub + LPR, ... < Dv / 8 (at most CHUNKS per lane)
    uint4 av[CHUNKS], bv[CHUNKS];
#pragma unroll
    for (int u = 0; u < CHUNKS; ++u) {
      if (sub + LPR * u < Dv / 8) {
        av[u] = d[sub + LPR * u];
        bv[u] = o[sub + LPR * u];
      }
    }
#pragma unroll
    for (int u = 0; u < CHUNKS; ++u) {
      if (sub + LPR * u < Dv / 8) {
        if (copy) dc[sub + LPR * u] = av[u];
        const unsigned aw[4] = {av[u].x, av[u].y, av[u].z, av[u].w};
        const unsigned bw[4] = {bv[u].x, bv[u].y, bv[u].z, bv[u].w};
#pragma unroll
        for (int e = 0; e < 4; ++e) {  // elements 2 e (the word's low half) and 2 e + 1
          sum = fmaf(half_word<T>(aw[e], 0), half_word<T>(bw[e], 0), sum);
          sum = fmaf(half_word<T>(aw[e], 1), half_word<T>(bw[e], 1), sum);
        }
      }
    }
  }
#pragma unroll
  for (int off = LPR / 2; off > 0; off /= 2) sum += __shfl_xor_sync(FULL_WARP, sum, off, LPR);
  if (dq_zero != nullptr && real) {  // dQ's float32 rows, which bwd_mma_dkdv's atomics add to
    float4* z = reinterpret_cast<float4*>(dq_zero + (bh * Nq + i) * static_cast<long long>(Dk));
    for (int c = sub; c < Dk / 4; c += LPR) z[c] = make_float4(0.f, 0.f, 0.f, 0.f);
    if (dq_turns != nullptr && sub == 0) dq_turns[bh * Nq + i] = 0;  // (DKDV_DQ_ORDER)
  }
  const float l = real ? lse[bh * Nq + i] : neg_inf<float>();
  // -inf (empty row) -> +inf: exp2(x - lse2) = 0 for every finite or -inf x, no test needed.
  // Lost rows (finite |lse| >= lost: lse cannot carry log(l)) likewise, with delta 0: they
  // contribute nothing in the main kernels. A NaN lse stays NaN.
  const bool row_lost = real && is_lost(static_cast<double>(l), lost);
  const bool skip = l == neg_inf<float>() || row_lost;
  if (valid && sub == 0) {
    lse2[row] = skip ? pos_inf<float>() : l * LOG2E;
    delta[row] = real && !skip ? sum : 0.f;
  }
  __shared__ unsigned char lost_rows[32];  // the block's rows that are lost
  if (sub == 0) lost_rows[threadIdx.x / LPR] = row_lost;
  const int any = __syncthreads_or(row_lost);  // (also: dq's zeroed rows seen by the block)
  const long long row0 = static_cast<long long>(blockIdx.x) * 32;  // (padded index)
  const int i0 = static_cast<int>(row0 % Nq_pad);
  if (threadIdx.x == 0 && i0 < Nq) flags[(row0 / Nq_pad) * ((Nq + 31) / 32) + i0 / 32] = any;
  if (!any || !settle) return;
  const int warp = threadIdx.x / 32;
#pragma unroll 1
  for (int r = warp; r < 32; r += THREADS / 32) {
    if (!lost_rows[r]) continue;  // warp-uniform
    lost_row_backward<T, float, F, COLS>(q, k, v, dout, out, lse, offsets, mask, bias, kv_lens,
                                         a, lost, stats, flags, dq_zero, sinks, sink_probs,
                                         caller_row(row0 / Nq_pad, i0 + r),
                                         (row0 / Nq_pad) * Nq + i0 + r, drop...);
  }
}

// Grid: ceil(BH * ceil(Nk / LOST_SEG) / LOST_WARPS) blocks, after bwd_lost_rows (stats, flags):
// warp item = LOST_SEG keys of one (batch, head). dk: (BH, Nk, Dk), dv: (BH, Nk, Dv) of DK (the
// main kernels' output type), added to.
// dq_out = dq rounded to T, 4 elements per thread and step of the grid: the tensor-core
// backward's float32 dq (Acc) into its 16-bit inputs' dtype (n a multiple of 4, both buffers
// 16-byte aligned); a no-op for other types, which never pass a dq_out.
template <typename T>
__device__ __forceinline__ uint2 pack4(const float4& x) {  // four floats as 16-bit T, in order
  auto bits = [](float f) {
    T t;
    store_acc(&t, f);
    return static_cast<unsigned>(t.bits);
  };
  return make_uint2(bits(x.x) | bits(x.y) << 16, bits(x.z) | bits(x.w) << 16);
}
template <typename T, typename Acc>
__device__ __forceinline__ void cast_dq(const Acc* __restrict__ dq, T* __restrict__ dq_out,
                                        long long n) {
  if constexpr (sizeof(Acc) == 4 && sizeof(T) == 2) {
    auto cast4 = [&](long long e, const float4& x) {
      *reinterpret_cast<uint2*>(dq_out + e) = pack4<T>(x);
    };
    // U loads in flight per thread, predicated (one block of 256 threads per multiprocessor: one
    // load at a time read 1.9 TB/s; 4, then the rest one by one, took 5-12 % longer, 8 up to 4 %)
    constexpr int U = 16;
    const long long step = 4LL * gridDim.x * blockDim.x;
    for (long long e = 4LL * (static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x);
         e < n; e += U * step) {
      float4 x[U];
#pragma unroll
      for (int u = 0; u < U; ++u)
        if (e + u * step < n) x[u] = *reinterpret_cast<const float4*>(dq + e + u * step);
#pragma unroll
      for (int u = 0; u < U; ++u)
        if (e + u * step < n) cast4(e + u * step, x[u]);
    }
  }
}

// dq_out in q's layout (`like`: the host made it with q's strides): rows of the flattened
// (BH, Nq), each lane 4 columns (Dk a multiple of 4; q's row stride and matrix offsets multiples
// of 4 elements, as the tensor-core backward's 16-byte rows are). A warp takes 32 / (Dk / 4) rows
// at once where a row has fewer than 32 groups of 4 (Dk = 64: two rows, no idle half-warp), and U
// of its rows' loads are in flight as in cast_dq (one at a time, the D = 64 cast took longer
// than the contiguous one by ~0.2 ms on 16k tokens x 32 heads).
template <typename T, typename Acc>
__device__ __forceinline__ void cast_dq_rows(const Acc* __restrict__ dq, T* __restrict__ dq_out,
                                             long long rows, int Nq, int Dk,
                                             const long long* __restrict__ q_offsets,
                                             long long q_rs) {
  if constexpr (sizeof(Acc) == 4 && sizeof(T) == 2) {
    auto out_row = [&](long long r) {
      const long long bh = rows < (1LL << 31) ? static_cast<int>(r) / Nq : r / Nq;
      return dq_out + q_offsets[bh] + (r - bh * Nq) * q_rs;
    };
    const int lane = threadIdx.x % 32, groups = Dk / 4;
    const int per_warp = groups < 32 ? 32 / groups : 1;  // rows a warp takes at once
    const int sub = lane / groups;                       // this lane's row of those (0 if >= 32)
    if (sub >= per_warp) return;                         // (groups not dividing 32: idle lanes)
    constexpr int U = 4;
    const long long step = static_cast<long long>(gridDim.x) * (blockDim.x / 32) * per_warp;
    long long r = (static_cast<long long>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32) *
                      per_warp + sub;
    for (int c0 = 4 * (lane % groups); c0 < Dk; c0 += 128) {  // (Dk > 128: more than one)
      long long row = r;
      for (; row + (U - 1) * step < rows; row += U * step) {
        float4 x[U];
#pragma unroll
        for (int u = 0; u < U; ++u)
          x[u] = *reinterpret_cast<const float4*>(dq + (row + u * step) * Dk + c0);
#pragma unroll
        for (int u = 0; u < U; ++u)
          *reinterpret_cast<uint2*>(out_row(row + u * step) + c0) = pack4<T>(x[u]);
      }
      for (; row < rows; row += step) {
        const float4 x = *reinterpret_cast<const float4*>(dq + row * Dk + c0);
        *reinterpret_cast<uint2*>(out_row(row) + c0) = pack4<T>(x);
      }
    }
  }
}

// like (the tensor-core backward's OPT_LIKE): dk, dv and dq_out have k's, v's
// and q's strides (rows at their inputs' offsets), else rows of (BH / group, Nk, D) and a
// contiguous dq_out.
template <typename T, typename Acc, typename DK, typename F = NoTransform, typename... Drop>
__global__ void __launch_bounds__(NUM_THREADS, 1)
bwd_lost_keys(LOST_PARAMS, DK* __restrict__ dk, DK* __restrict__ dv, const Acc* __restrict__ dq,
              T* __restrict__ dq_out, int group, int like, Acc* __restrict__ dbias,
              const Drop... drop) {
  ATTN_ARGS_LOCALS(a, double);
  const long long n_items = (Nk + LOST_SEG - 1) / LOST_SEG;
  const int n_chunks = (Nq + LOST_CHUNK - 1) / LOST_CHUNK;
  const int lane = threadIdx.x % 32;
  // group > 1 (the tensor-core backward's GQA, _mma_bwd.group_size): dk, dv per (batch, kv head)
  // bkv, whose keys serve the heads bh = bkv * group + gi (one window, k and v, for all); an item
  // adds their lost rows in head order, then stores once (each dk / dv row has one owner).
  const long long BKV = BH / group;
  for (long long item = static_cast<long long>(blockIdx.x) * LOST_WARPS + threadIdx.x / 32;
       item < BKV * n_items; item += static_cast<long long>(gridDim.x) * LOST_WARPS) {
  const long long bkv = item / n_items;
  const long long j0 = (item % n_items) * LOST_SEG;
  const long long j_last = j0 + LOST_SEG - 1 < Nk - 1 ? j0 + LOST_SEG - 1 : Nk - 1;
  // the flags of the chunks that hold this item's query rows, in any head of the group
  bool any = false;
  for (int gi = 0; gi < group; ++gi) {
    const long long bh = bkv * group + gi;
    const LostHead<T, Acc, F> h = LOST_HEAD(dout);
    const KeyRange qr = tile_query_range(h.w, j0, j_last, Nq);
    const int* fl = flags + bh * n_chunks;
    for (long long c = qr.lo / LOST_CHUNK + lane; qr.lo <= qr.hi && c <= qr.hi / LOST_CHUNK;
         c += 32)
      any |= fl[c] != 0;
  }
  if (!__any_sync(FULL_WARP, any)) continue;

  for (long long j = j0; j <= j_last; ++j) {
    double kj[LOST_COLS], vj[LOST_COLS], dkj[LOST_COLS], dvj[LOST_COLS];
    bool touched = false, loaded = false;
    double scale_h = 0.0;
#pragma unroll
    for (int c = 0; c < LOST_COLS; ++c) dkj[c] = dvj[c] = 0.0;
    for (int gi = 0; gi < group; ++gi) {
    const long long bh = bkv * group + gi;
    const LostHead<T, Acc, F> h = LOST_HEAD(dout);
    const auto dz = dropout_at<double>(bh, drop...);
    const int* fl = flags + bh * n_chunks;
    const KeyRange rows = tile_query_range(h.w, j, j, Nq);
    if (rows.lo > rows.hi) continue;
    scale_h = h.scale;
    for (long long c = rows.lo / LOST_CHUNK; c <= rows.hi / LOST_CHUNK; ++c) {
      if (!fl[c]) continue;  // warp-uniform
      if (!loaded) {  // (the group's k and v rows: one for all its heads)
        load_row(kj, h.k + j * h.k_rs, Dk);
        load_row(vj, h.v + j * h.v_rs, Dv);
        loaded = true;
      }
      const long long i_end = (c + 1) * LOST_CHUNK - 1 < rows.hi ? (c + 1) * LOST_CHUNK - 1 : rows.hi;
      for (long long i = c * LOST_CHUNK > rows.lo ? c * LOST_CHUNK : rows.lo; i <= i_end; ++i) {
        const long long r = bh * Nq + i;
        if (!is_lost(static_cast<double>(lse[r]), lost)) continue;
        double x, g = 1.0;
        const double qk = dot(kj, h.q + i * h.q_rs, Dk);
        if (!h.logit(x, qk, i, j, g)) continue;
        const double* st = stats + 3 * r;
        const double p = exp(x - st[0]) / st[1];
        const bool kept = dz.keep(i, j);  // warp-uniform
        const double dlogit =
            p * ((kept ? dz.scaled(dot(vj, h.dout + i * Dv, Dv)) : 0.0) - st[2]);
        if (dbias != nullptr && lane == 0)  // the bias's gradient (before F')
          dbias[r * Nk + j] = static_cast<Acc>(p == 0.0 ? 0.0 : dlogit);
        const double ds = dlogit * g;
        axpy(dkj, ds, h.q + i * h.q_rs, Dk);
        if (kept) axpy(dvj, dz.scaled(p), h.dout + i * Dv, Dv);
        touched = true;
      }
    }
    }  // heads
    if (!touched) continue;
    DK* dk_row = dk + (like ? offsets[BH + bkv * group] + j * k_rs : (bkv * Nk + j) * Dk);
    DK* dv_row = dv + (like ? offsets[2 * BH + bkv * group] + j * v_rs : (bkv * Nk + j) * Dv);
#pragma unroll
    for (int c = 0; c < LOST_COLS; ++c) {
      const int col = lane + 32 * c;
      if (col < Dk) add_to(dk_row + col, scale_h * dkj[c]);
      if (col < Dv) add_to(dv_row + col, dvj[c]);
    }
  }
  }  // items
  if (dq_out != nullptr) {
    if (like)
      cast_dq_rows(dq, dq_out, static_cast<long long>(BH) * Nq, Nq, Dk, offsets, q_rs);
    else
      cast_dq(dq, dq_out, static_cast<long long>(BH) * Nq * Dk);
  }
}

// Grid: a stride of warps over the tensor-core forward's blocks (fix: one flag per block, in its
// 1-D launch order bh * n_mtiles + reversed query tile, as fwd_mma.cu writes it; block_m <= 128
// rows each). A flagged block's rows whose lse is NaN, +inf or lost (|lse| >= lost) get out (T)
// and lse (Acc) recomputed in double. sinks: (BH,) each (batch, head)'s sink logit, joined to
// the rows recomputed, or nullptr without sinks.
template <typename T, typename Acc, typename F = NoTransform, typename... Drop>
__global__ void __launch_bounds__(NUM_THREADS, 1)
fwd_lost_rows(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
              T* __restrict__ out, Acc* __restrict__ lse, ATTN_INPUTS(Acc), const AttnArgs a,
              double lost, const int* __restrict__ fix, int block_m,
              const double* __restrict__ sinks, const Drop... drop) {
  ATTN_ARGS_LOCALS(a, double);
  const int n_mtiles = (Nq + block_m - 1) / block_m;
  const long long n_blocks = static_cast<long long>(BH) * n_mtiles;
  const long long warps = static_cast<long long>(gridDim.x) * LOST_WARPS;
  const int lane = threadIdx.x % 32;
  for (long long f0 = (static_cast<long long>(blockIdx.x) * LOST_WARPS + threadIdx.x / 32) * 32;
       f0 < n_blocks; f0 += warps * 32) {
  for (unsigned fb = __ballot_sync(FULL_WARP, f0 + lane < n_blocks && fix[f0 + lane] != 0);
       fb != 0u; fb &= fb - 1u) {
  const long long blk = f0 + __ffs(fb) - 1;
  const long long bh = blk / n_mtiles;
  const long long i0 = (n_mtiles - 1 - blk % n_mtiles) * static_cast<long long>(block_m);
  fwd_fix_rows<T, Acc, F>(q, k, v, out, lse, offsets, mask, bias, kv_lens, a, lost, bh * Nq + i0,
                          bh * Nq + (i0 + block_m < Nq ? i0 + block_m : Nq), sinks, drop...);
  }  // flagged blocks
  }  // flag words
}
