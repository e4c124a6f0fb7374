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
//   bwd_lost_keys  one warp per 128 keys of one (batch, head), after bwd_lost_rows: for each key
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
#include "common.cuh"
#include "mask.cuh"
#include "sinks.cuh"
#include "philox.cuh"

constexpr int LOST_CHUNK = 32;   // rows of the flattened (BH, Nq) per flag (one per lane)
constexpr int LOST_SEG = 128;    // rows a warp checks at once (4 chunks); keys of a key item
constexpr int LOST_COLS = 256 / 32;  // head-dim columns per lane (Dk, Dv <= 256)
constexpr int LOST_WARPS = NUM_THREADS / 32;

__device__ __forceinline__ bool is_lost(double lse, double lost) {
  return lse - lse == 0.0 && (lse >= lost || lse <= -lost);  // finite and |lse| >= lost
}

// One more logit x (> -inf) into a row's running max m and sum l of exp(x - m).
__device__ __forceinline__ void add_logit(double& m, double& l, double x) {
  if (x > m) {
    l = l * exp(m - x) + 1.0;
    m = x;
  } else {
    l += exp(x - m);
  }
}

__device__ __forceinline__ double warp_sum(double x) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) x += __shfl_xor_sync(FULL_WARP, x, offset);
  return x;
}

// Row `r` of a row-major matrix, this lane's columns, as double (0 past ncols).
template <typename T>
__device__ __forceinline__ void load_row(double (&x)[LOST_COLS], const T* row, int ncols) {
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int c = 0; c < LOST_COLS; ++c) {
    const int col = lane + 32 * c;
    x[c] = col < ncols ? static_cast<double>(to_acc(row[col])) : 0.0;
  }
}

// a . row over the first ncols columns (a is 0 past them), reading row as it goes.
template <typename T>
__device__ __forceinline__ double dot(const double (&a)[LOST_COLS], const T* row, int ncols) {
  const int lane = threadIdx.x % 32;
  double s = 0.0;
#pragma unroll
  for (int c = 0; c < LOST_COLS; ++c) {
    const int col = lane + 32 * c;
    if (col < ncols) s = fma(a[c], static_cast<double>(to_acc(row[col])), s);
  }
  return warp_sum(s);
}

// acc += w * row (this lane's columns).
template <typename T>
__device__ __forceinline__ void axpy(double (&acc)[LOST_COLS], double w, const T* row, int ncols) {
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int c = 0; c < LOST_COLS; ++c) {
    const int col = lane + 32 * c;
    if (col < ncols) acc[c] = fma(w, static_cast<double>(to_acc(row[col])), acc[c]);
  }
}

// add_to: dst += x in dst's own type (the main kernels wrote dst before).
__device__ __forceinline__ void add_to(half_t* p, double x) { *p = half_from_float(to_float(*p) + static_cast<float>(x)); }
__device__ __forceinline__ void add_to(bf16_t* p, double x) { *p = bf16_from_float(to_float(*p) + static_cast<float>(x)); }
__device__ __forceinline__ void add_to(float* p, double x) { *p = static_cast<float>(*p + x); }
__device__ __forceinline__ void add_to(double* p, double x) { *p += x; }

// mask.cuh's inputs of one (batch, head), plus the row strides, scale and score transform F
// (modifiers.cuh, natural units), in double.
template <typename T, typename Acc, typename F = NoTransform>
struct LostHead : HeadInputs<T, Acc> {
  long long q_rs, k_rs, v_rs;
  double scale;
  F f;

  // Whether j is visible to i, and then its bias (0 without one).
  __device__ __forceinline__ bool visible(double& b, long long i, long long j) const {
    const MaskBias<Acc>& mb = this->mb;
    const KeyRange r = key_range(this->w, i);
    if (j < r.lo || j > r.hi) return false;
    if (mb.mask != nullptr && !mb.mask[i * mb.mask_rs + j * mb.mask_cs]) return false;
    b = mb.bias != nullptr ? static_cast<double>(mb.bias[i * mb.bias_rs + j * mb.bias_cs]) : 0.0;
    return b != -__longlong_as_double(0x7ff0000000000000LL);
  }

  // The logit of (i, j) in double, or false where j is not visible to i; g *= F's derivative.
  __device__ __forceinline__ bool logit(double& x, double qk, long long i, long long j,
                                        double& g) const {
    double b;
    if (!visible(b, i, j)) return false;
    x = F(f).apply(qk * scale, i, j, g) + b;  // on a copy, as attn_core.cuh ScoreModT
    return true;
  }
};

// The parameters of both backward lost-row kernels before their own outputs.
#define LOST_PARAMS                                                                            \
  const T *__restrict__ q, const T *__restrict__ k, const T *__restrict__ v,                   \
      const T *__restrict__ dout, const T *__restrict__ out, const Acc *__restrict__ lse,      \
      ATTN_INPUTS(Acc), const AttnArgs a, double lost, double *__restrict__ stats,              \
      int *__restrict__ flags
// The LostHead of (batch, head) bh from those arguments (no lost-row kernel reads a delta).
#define LOST_HEAD(dout)                                                                        \
  LostHead<T, Acc, F>{head_inputs<T, Acc>(bh, q, k, v, dout, lse, nullptr, offsets, mask, bias, \
                                          kv_lens, mask_rs, mask_cs, bias_rs, bias_cs, BH, Nq, \
                                          Nk, Dv, left, right, bottom_right),                  \
                      q_rs, k_rs, v_rs, scale,                                              \
                      F::make(at_head(mod_args, bh,                                            \
                                      head_window(kv_lens, bh, Nq, Nk, left, right,            \
                                                  bottom_right).shift),                        \
                              0, 1.0)}

// A warp's 128 rows of the flattened (BH, Nq), as four chunks of 32: lane e < 4 gets the ballot
// of chunk e (bit l: row row0 + 32 e + l satisfies pred), the other lanes 0.
template <typename Acc, typename Pred>
__device__ __forceinline__ unsigned scan_rows(const Acc* lse, long long row0, long long rows,
                                              Pred pred) {
  const int lane = threadIdx.x % 32;
  unsigned mine = 0u;
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    const long long r = row0 + 32 * e + lane;
    const unsigned bits = __ballot_sync(FULL_WARP, r < rows && pred(static_cast<double>(lse[r])));
    if (lane == e) mine = bits;
  }
  return mine;
}

// f(row) for each row of such a scan (lane e < 4: the bits of chunk e), in row order; the loop is
// warp-uniform.
template <typename F>
__device__ __forceinline__ void for_each_row(unsigned bits, long long row0, F&& f) {
#pragma unroll 1
  for (int e = 0; e < 4; ++e) {
#pragma unroll 1
    for (unsigned b = __shfl_sync(FULL_WARP, bits, e); b != 0u; b &= b - 1u)
      f(row0 + 32 * e + (__ffs(b) - 1));
  }
}

// Grid: a stride of warps over items of 128 rows of one (batch, head). flags: (BH, ceil(Nq / 32)),
// one per 32 rows of a (batch, head): read when `prewritten` (the tensor-core preprocess wrote
// them), else written here from lse. stats: (BH, Nq, 3) = m, l, delta of lost rows only. sinks:
// (BH,) each (batch, head)'s sink logit (-inf: none), or nullptr without sinks; sink_probs:
// (BH, Nq), the lost rows' sink probabilities written (nullptr without sinks). dbias (nullptr:
// none): (BH, Nq, Nk), the lost rows' logit gradients P (dP - delta) written over the visible keys.
template <typename T, typename Acc, typename F = NoTransform, typename... Drop>
__global__ void __launch_bounds__(NUM_THREADS, 1)
bwd_lost_rows(LOST_PARAMS, Acc* __restrict__ dq, int prewritten, const double* __restrict__ sinks,
              double* __restrict__ sink_probs, Acc* __restrict__ dbias,
              const Drop... drop) {
  ATTN_ARGS_LOCALS(a, double);
  const int n_chunks = (Nq + LOST_CHUNK - 1) / LOST_CHUNK;
  const long long n_items = static_cast<long long>(BH) * ((Nq + LOST_SEG - 1) / LOST_SEG);
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
  const double neg_inf = -__longlong_as_double(0x7ff0000000000000LL);
  for_each_row(bits, row0, [&](long long row) {
    const long long bh = row / Nq, i = row % Nq;
    const LostHead<T, Acc, F> h = LOST_HEAD(dout);
    const auto dz = dropout_at<double>(bh, drop...);
    double qi[LOST_COLS], doi[LOST_COLS], dqi[LOST_COLS];
    load_row(qi, h.q + i * h.q_rs, Dk);
    load_row(doi, h.dout + i * Dv, Dv);
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
    for (int c = 0; c < LOST_COLS; ++c) dqi[c] = 0.0;
    for (long long j = kr.lo; j <= kr.hi; ++j) {
      double x, g = 1.0;
      const double qk = dot(qi, h.k + j * h.k_rs, Dk);
      if (!h.logit(x, qk, i, j, g)) continue;
      const double p = exp(x - m) / l;
      const bool kept = dz.keep(i, j);  // warp-uniform
      const double dlogit =
          p * ((kept ? dz.scaled(dot(doi, h.v + j * h.v_rs, Dv)) : 0.0) - delta);
      if (dbias != nullptr && lane == 0)  // the bias's gradient (before F')
        dbias[row * Nk + j] = static_cast<Acc>(p == 0.0 ? 0.0 : dlogit);
      const double ds = dlogit * g;
      axpy(dqi, ds, h.k + j * h.k_rs, Dk);
    }
    Acc* dq_row = dq + row * Dk;
#pragma unroll
    for (int c = 0; c < LOST_COLS; ++c) {
      const int col = lane + 32 * c;
      if (col < Dk) add_to(dq_row + col, h.scale * dqi[c]);
    }
  });
  }  // items
}

// Grid: ceil(BH * ceil(Nk / LOST_SEG) / LOST_WARPS) blocks, after bwd_lost_rows (stats, flags):
// warp item = LOST_SEG keys of one (batch, head). dk: (BH, Nk, Dk), dv: (BH, Nk, Dv) of DK (the
// main kernels' output type), added to.
// dq_out = dq rounded to T, 4 elements per thread and step of the grid: the tensor-core
// backward's float32 dq (Acc) into its 16-bit inputs' dtype (n a multiple of 4, both buffers
// 16-byte aligned); a no-op for other types, which never pass a dq_out.
template <typename T, typename Acc>
__device__ __forceinline__ void cast_dq(const Acc* __restrict__ dq, T* __restrict__ dq_out,
                                        long long n) {
  if constexpr (sizeof(Acc) == 4 && sizeof(T) == 2) {
    auto bits = [](float x) {
      T t;
      store_acc(&t, x);
      return static_cast<unsigned>(t.bits);
    };
    const long long step = 4LL * gridDim.x * blockDim.x;
    for (long long e = 4LL * (static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x);
         e < n; e += step) {
      const float4 x = *reinterpret_cast<const float4*>(dq + e);
      *reinterpret_cast<uint2*>(dq_out + e) =
          make_uint2(bits(x.x) | bits(x.y) << 16, bits(x.z) | bits(x.w) << 16);
    }
  }
}

template <typename T, typename Acc, typename DK, typename F = NoTransform, typename... Drop>
__global__ void __launch_bounds__(NUM_THREADS, 1)
bwd_lost_keys(LOST_PARAMS, DK* __restrict__ dk, DK* __restrict__ dv, const Acc* __restrict__ dq,
              T* __restrict__ dq_out, const Drop... drop) {
  ATTN_ARGS_LOCALS(a, double);
  const long long n_items = (Nk + LOST_SEG - 1) / LOST_SEG;
  const int n_chunks = (Nq + LOST_CHUNK - 1) / LOST_CHUNK;
  const int lane = threadIdx.x % 32;
  for (long long item = static_cast<long long>(blockIdx.x) * LOST_WARPS + threadIdx.x / 32;
       item < BH * n_items; item += static_cast<long long>(gridDim.x) * LOST_WARPS) {
  const long long bh = item / n_items;
  const LostHead<T, Acc, F> h = LOST_HEAD(dout);
  const auto dz = dropout_at<double>(bh, drop...);
  const long long j0 = (item % n_items) * LOST_SEG;
  const long long j_last = j0 + LOST_SEG - 1 < Nk - 1 ? j0 + LOST_SEG - 1 : Nk - 1;
  const KeyRange qr = tile_query_range(h.w, j0, j_last, Nq);
  if (qr.lo > qr.hi) continue;
  // the flags of the chunks that hold this item's query rows
  const int* fl = flags + bh * n_chunks;
  bool any = false;
  for (long long c = qr.lo / LOST_CHUNK + lane; c <= qr.hi / LOST_CHUNK; c += 32) any |= fl[c] != 0;
  if (!__any_sync(FULL_WARP, any)) continue;

  for (long long j = j0; j <= j_last; ++j) {
    const KeyRange rows = tile_query_range(h.w, j, j, Nq);
    if (rows.lo > rows.hi) continue;
    double kj[LOST_COLS], vj[LOST_COLS], dkj[LOST_COLS], dvj[LOST_COLS];
    load_row(kj, h.k + j * h.k_rs, Dk);
    load_row(vj, h.v + j * h.v_rs, Dv);
#pragma unroll
    for (int c = 0; c < LOST_COLS; ++c) dkj[c] = dvj[c] = 0.0;
    bool touched = false;
    for (long long c = rows.lo / LOST_CHUNK; c <= rows.hi / LOST_CHUNK; ++c) {
      if (!fl[c]) continue;  // warp-uniform
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
        const double ds = p * ((kept ? dz.scaled(dot(vj, h.dout + i * Dv, Dv)) : 0.0) - st[2]) * g;
        axpy(dkj, ds, h.q + i * h.q_rs, Dk);
        if (kept) axpy(dvj, dz.scaled(p), h.dout + i * Dv, Dv);
        touched = true;
      }
    }
    if (!touched) continue;
    DK* dk_row = dk + (bh * Nk + j) * Dk;
    DK* dv_row = dv + (bh * Nk + j) * Dv;
#pragma unroll
    for (int c = 0; c < LOST_COLS; ++c) {
      const int col = lane + 32 * c;
      if (col < Dk) add_to(dk_row + col, h.scale * dkj[c]);
      if (col < Dv) add_to(dv_row + col, dvj[c]);
    }
  }
  }  // items
  if (dq_out != nullptr) cast_dq(dq, dq_out, static_cast<long long>(BH) * Nq * Dk);
}

// A logit computed in double as the forward's Acc would hold it: beyond Acc's range it is +-inf
// (a float32 q . k of 16-bit or float32 inputs overflows, and the dense formula then gives NaN,
// not the finite row double would), inside it stays exact.
template <typename Acc> __device__ __forceinline__ double in_range(double x);
template <> __device__ __forceinline__ double in_range<double>(double x) { return x; }
template <> __device__ __forceinline__ double in_range<float>(double x) {
  constexpr double OVER = 3.4028235677973366e38;  // FLT_MAX + ulp / 2: rounds to inf
  return fabs(x) >= OVER ? copysign(__longlong_as_double(0x7ff0000000000000LL), x) : x;
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
  const long long row0 = bh * Nq + i0;
  const long long rows = bh * Nq + (i0 + block_m < Nq ? i0 + block_m : Nq);
  const double inf = __longlong_as_double(0x7ff0000000000000LL);
  const unsigned bits = scan_rows(static_cast<const Acc*>(lse), row0, rows, [lost, inf](double l) {
    return l != l || l == inf || is_lost(l, lost);
  });
  for_each_row(bits, row0, [&](long long row) {
    const long long bh = row / Nq, i = row % Nq;
    const LostHead<T, Acc, F> h = LOST_HEAD(static_cast<const T*>(nullptr));
    const auto dz = dropout_at<double>(bh, drop...);
    double qi[LOST_COLS], acc[LOST_COLS];
    load_row(qi, h.q + i * h.q_rs, Dk);
#pragma unroll
    for (int c = 0; c < LOST_COLS; ++c) acc[c] = 0.0;
    const KeyRange kr = key_range(h.w, i);
    double m = -inf, l = 0.0;
    bool seen = false;
    // 32 keys at a time: each lane tests one (mask, bias), then the visible ones, in order
    for (long long j0 = kr.lo; j0 <= kr.hi; j0 += 32) {
      double b_lane = 0.0;
      const bool vis = j0 + lane <= kr.hi && h.visible(b_lane, i, j0 + lane);
      for (unsigned vb = __ballot_sync(FULL_WARP, vis); vb != 0u; vb &= vb - 1u) {
      const int sl = __ffs(vb) - 1;
      const long long j = j0 + sl;
      const double x = in_range<Acc>(
          F(h.f)(in_range<Acc>(dot(qi, h.k + j * h.k_rs, Dk)) * h.scale, i, j) +
          __shfl_sync(FULL_WARP, b_lane, sl));
      seen = true;
      if (x == -inf) continue;  // no mass (the row is NaN if nothing else comes)
      const double m_new = x > m ? x : m;  // a NaN x reaches l through p below
      const double alpha = exp(m - m_new), p = exp(x - m_new);
      l = l * alpha + p;
#pragma unroll
      for (int c = 0; c < LOST_COLS; ++c) acc[c] *= alpha;
      if constexpr (decltype(dz)::ON) {  // dropout: P V only (keep is warp-uniform)
        if (dz.keep(i, j)) axpy(acc, p, h.v + j * h.v_rs, Dv);
      } else {
        axpy(acc, p, h.v + j * h.v_rs, Dv);
      }
      m = m_new;
      }
    }
    // As every forward: empty -> 0 / -inf; l == 0 (all -inf) or an infinite logit -> NaN.
    // With a sink, joined as the forward kernels join it (an empty row: 0 and the sink).
    const double nan = __longlong_as_double(0x7ff8000000000000LL);
    double inv_l = !seen ? 0.0 : (l == 0.0 || m == inf) ? nan : 1.0 / l;
    if constexpr (decltype(dz)::ON) inv_l = dz.scaled(inv_l);  // the kept weights' 1 / (1 - p)
    double lse_row = !seen ? -inf : (l == 0.0 || m == inf) ? nan : m + log(l);
    if (sinks != nullptr) join_sink(in_range<Acc>(sinks[bh]), inv_l, lse_row);  // Acc's range
    T* orow = out + row * Dv;
#pragma unroll
    for (int c = 0; c < LOST_COLS; ++c) {
      const int col = lane + 32 * c;
      if (col < Dv) store_acc(orow + col, static_cast<Acc>(acc[c] * inv_l));
    }
    if (lane == 0) lse[row] = static_cast<Acc>(lse_row);
  });
  }  // flagged blocks
  }  // flag words
}
