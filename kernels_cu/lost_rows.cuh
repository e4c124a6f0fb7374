// lost_rows.cuh: the rows fast arithmetic cannot settle, recomputed in double, one warp a row:
// the helpers of the lost-row kernels (kernels_cu/lost_rows.cu, which says what they do) and the
// forward's per-block fix (fwd_fix_rows), which the tensor-core forward also runs at its end.
#pragma once
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

// Row `r` of a row-major matrix, this lane's columns, as double (0 past ncols). The helpers take
// N columns per lane, N * 32 >= ncols (LOST_COLS covers every head dim; a kernel that knows its
// head dims may hold fewer, with the same sums: the columns past ncols add nothing).
template <typename T, int N>
__device__ __forceinline__ void load_row(double (&x)[N], const T* row, int ncols) {
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int c = 0; c < N; ++c) {
    const int col = lane + 32 * c;
    x[c] = col < ncols ? static_cast<double>(to_acc(row[col])) : 0.0;
  }
}

// a . row over the first ncols columns (a is 0 past them), reading row as it goes.
template <typename T, int N>
__device__ __forceinline__ double dot(const double (&a)[N], const T* row, int ncols) {
  const int lane = threadIdx.x % 32;
  double s = 0.0;
#pragma unroll
  for (int c = 0; c < N; ++c) {
    const int col = lane + 32 * c;
    if (col < ncols) s = fma(a[c], static_cast<double>(to_acc(row[col])), s);
  }
  return warp_sum(s);
}

// acc += w * row (this lane's columns).
template <typename T, int N>
__device__ __forceinline__ void axpy(double (&acc)[N], double w, const T* row, int ncols) {
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int c = 0; c < N; ++c) {
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

// A logit computed in double as the forward's Acc would hold it: beyond Acc's range it is +-inf
// (a float32 q . k of 16-bit or float32 inputs overflows, and the dense formula then gives NaN,
// not the finite row double would), inside it stays exact.
template <typename Acc> __device__ __forceinline__ double in_range(double x);
template <> __device__ __forceinline__ double in_range<double>(double x) { return x; }
template <> __device__ __forceinline__ double in_range<float>(double x) {
  constexpr double OVER = 3.4028235677973366e38;  // FLT_MAX + ulp / 2: rounds to inf
  return fabs(x) >= OVER ? copysign(__longlong_as_double(0x7ff0000000000000LL), x) : x;
}

// One warp settles the rows [row0, rows) of the flattened (BH, Nq) (at most LOST_SEG of them: one
// block of a tensor-core forward) whose lse came out NaN, +inf or lost (|lse| >= lost): their out
// (T) and lse (Acc) recomputed in double, the sink joined where there is one (sinks: (BH,) each
// (batch, head)'s sink logit, or nullptr). fwd_lost_rows runs it for the blocks a forward flagged;
// fwd_mma and fwd_wgmma at their own end, for their rows. COLS: head-dim columns per lane (COLS * 32
// >= Dk, Dv).
template <typename T, typename Acc, typename F = NoTransform, int COLS = LOST_COLS,
          typename... Drop>
__device__ __forceinline__ void fwd_fix_rows(
    const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
    T* __restrict__ out, Acc* __restrict__ lse, ATTN_INPUTS(Acc), const AttnArgs& a, double lost,
    long long row0, long long rows, const double* __restrict__ sinks, const Drop... drop) {
  ATTN_ARGS_LOCALS(a, double);
  const int lane = threadIdx.x % 32;
  const double inf = __longlong_as_double(0x7ff0000000000000LL);
  const unsigned bits = scan_rows(static_cast<const Acc*>(lse), row0, rows, [lost, inf](double l) {
    return l != l || l == inf || is_lost(l, lost);
  });
  for_each_row(bits, row0, [&](long long row) {
    const long long bh = row / Nq, i = row % Nq;
    const LostHead<T, Acc, F> h = LOST_HEAD(static_cast<const T*>(nullptr));
    const auto dz = dropout_at<double>(bh, drop...);
    double qi[COLS], acc[COLS];
    load_row(qi, h.q + i * h.q_rs, Dk);
#pragma unroll
    for (int c = 0; c < COLS; ++c) acc[c] = 0.0;
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
      for (int c = 0; c < COLS; ++c) acc[c] *= alpha;
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
    for (int c = 0; c < COLS; ++c) {
      const int col = lane + 32 * c;
      if (col < Dv) store_acc(orow + col, static_cast<Acc>(acc[c] * inv_l));
    }
    if (lane == 0) lse[row] = static_cast<Acc>(lse_row);
  });
}

// fwd_fix_rows as a call, not inlined: its own register allocation. Inlined at the end of
// fwd_wgmma's 128-register tile (D=64, three consumers) it spilled 128 bytes, where the call has
// no stack frame and no spill (ptxas -v); the rows it settles are rare, the call's cost nothing.
template <typename T, typename Acc, typename F, int COLS, typename... Drop>
__device__ __noinline__ void fwd_fix_rows_apart(
    const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
    T* __restrict__ out, Acc* __restrict__ lse, ATTN_INPUTS(Acc), const AttnArgs a, double lost,
    long long row0, long long rows, const double* __restrict__ sinks, const Drop... drop) {
  fwd_fix_rows<T, Acc, F, COLS>(q, k, v, out, lse, offsets, mask, bias, kv_lens, a, lost, row0,
                                rows, sinks, drop...);
}
