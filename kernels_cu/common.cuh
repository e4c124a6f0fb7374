// common.cuh: storage types, conversions, constants and small warp helpers. No kernels.
//
// half_t and bf16_t are our own 16-bit storage structs so that NVRTC compiles every kernel with no
// include path (no cuda_fp16.h / cuda_bf16.h). Arithmetic is always done in Acc (float or double).
#pragma once

struct __align__(2) half_t { unsigned short bits; };
struct __align__(2) bf16_t { unsigned short bits; };

// Threads per block of every generic kernel; the host mirrors it in _config.GENERIC_THREADS.
constexpr int NUM_THREADS = 128;
// A query (or key) row is owned by LANES_PER_ROW consecutive lanes of one warp.
constexpr int LANES_PER_ROW = 8;
constexpr int ROW_GROUPS = NUM_THREADS / LANES_PER_ROW;
constexpr unsigned FULL_WARP = 0xffffffffu;
// __launch_bounds__ minimum of resident blocks. Without it ptxas trades small spills for
// occupancy tiers on its own, differently per NVRTC version (13.0 spilled where 13.5 did not);
// with 1 the accumulators stay in registers, and shared memory limits residency to ~3 blocks
// per SM anyway. tests/test_build.py holds every HEAD_DIM <= 128 kernel to zero spills.
constexpr int MIN_BLOCKS_PER_SM = 1;

constexpr float LOG2E = 1.4426950408889634f;

// -inf and friends as functions: NVRTC has no constexpr way to spell an infinity without headers.
template <typename Acc> __device__ __forceinline__ Acc neg_inf();
template <> __device__ __forceinline__ float neg_inf<float>() { return __int_as_float(0xff800000); }
template <> __device__ __forceinline__ double neg_inf<double>() {
  return __longlong_as_double(0xfff0000000000000LL);
}
#define NEG_INF (neg_inf<Acc>())
template <typename Acc> __device__ __forceinline__ Acc pos_inf();
template <> __device__ __forceinline__ float pos_inf<float>() { return __int_as_float(0x7f800000); }
template <> __device__ __forceinline__ double pos_inf<double>() {
  return __longlong_as_double(0x7ff0000000000000LL);
}
// The quiet NaN a row gets when it sees keys but its sum is 0 (every visible logit -inf: 0 / 0).
template <typename Acc> __device__ __forceinline__ Acc quiet_nan();
template <> __device__ __forceinline__ float quiet_nan<float>() { return __int_as_float(0x7fc00000); }
template <> __device__ __forceinline__ double quiet_nan<double>() {
  return __longlong_as_double(0x7ff8000000000000LL);
}

// ---- conversions: storage -> Acc ---------------------------------------------------------------
__device__ __forceinline__ float to_float(half_t h) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h.bits));
  return f;
}
__device__ __forceinline__ float to_float(bf16_t b) {
  return __uint_as_float(static_cast<unsigned>(b.bits) << 16);  // bf16 is the top half of a float
}
__device__ __forceinline__ float to_float(float x) { return x; }

// to_acc: the widening every load goes through (double stays double).
__device__ __forceinline__ float to_acc(half_t x) { return to_float(x); }
__device__ __forceinline__ float to_acc(bf16_t x) { return to_float(x); }
__device__ __forceinline__ float to_acc(float x) { return x; }
__device__ __forceinline__ double to_acc(double x) { return x; }

// ---- conversions: Acc -> storage ---------------------------------------------------------------
__device__ __forceinline__ half_t half_from_float(float f) {
  half_t h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h.bits) : "f"(f));
  return h;
}
__device__ __forceinline__ bf16_t bf16_from_float(float f) {
  const unsigned u = __float_as_uint(f);
  bf16_t b;
  if ((u & 0x7fffffffu) > 0x7f800000u) {
    b.bits = static_cast<unsigned short>((u >> 16) | 0x0040u);  // NaN stays a (quiet) NaN
  } else {
    // Round to nearest, ties to even; a carry into the exponent rounds up to inf correctly.
    const unsigned rounding = 0x7fffu + ((u >> 16) & 1u);
    b.bits = static_cast<unsigned short>((u + rounding) >> 16);
  }
  return b;
}

__device__ __forceinline__ void store_acc(half_t* p, float x) { *p = half_from_float(x); }
__device__ __forceinline__ void store_acc(bf16_t* p, float x) { *p = bf16_from_float(x); }
__device__ __forceinline__ void store_acc(float* p, float x) { *p = x; }
__device__ __forceinline__ void store_acc(double* p, double x) { *p = x; }

// ---- math in Acc -------------------------------------------------------------------------------
__device__ __forceinline__ float acc_exp(float x) { return expf(x); }
__device__ __forceinline__ double acc_exp(double x) { return exp(x); }
__device__ __forceinline__ float acc_log(float x) { return logf(x); }
__device__ __forceinline__ double acc_log(double x) { return log(x); }
__device__ __forceinline__ float acc_log1p(float x) { return log1pf(x); }
__device__ __forceinline__ double acc_log1p(double x) { return log1p(x); }
__device__ __forceinline__ float acc_max(float a, float b) { return fmaxf(a, b); }
__device__ __forceinline__ double acc_max(double a, double b) { return fmax(a, b); }
__device__ __forceinline__ float acc_fma(float a, float b, float c) { return fmaf(a, b, c); }
__device__ __forceinline__ double acc_fma(double a, double b, double c) { return fma(a, b, c); }
template <typename Acc> __device__ __forceinline__ Acc log2e() { return Acc(1.4426950408889634); }
template <typename Acc> __device__ __forceinline__ Acc ln2() { return Acc(0.6931471805599453); }
// exp2 of a base-2 logit; exp2(-inf) = 0. float: the MUFU instruction (rel. error ~2^-22).
__device__ __forceinline__ float exp2_acc(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ double exp2_acc(double x) { return exp2(x); }
__device__ __forceinline__ float log2_acc(float x) { return log2f(x); }
__device__ __forceinline__ double log2_acc(double x) { return log2(x); }

// ---- reductions over the LANES_PER_ROW lanes that own one row ----------------------------------
template <typename Acc> __device__ __forceinline__ Acc row_max(Acc x) {
#pragma unroll
  for (int offset = LANES_PER_ROW / 2; offset > 0; offset /= 2)
    x = acc_max(x, __shfl_xor_sync(FULL_WARP, x, offset, LANES_PER_ROW));
  return x;
}
__device__ __forceinline__ bool row_any(bool x) {
  int v = x;
#pragma unroll
  for (int offset = LANES_PER_ROW / 2; offset > 0; offset /= 2)
    v |= __shfl_xor_sync(FULL_WARP, v, offset, LANES_PER_ROW);
  return v != 0;
}
// max that propagates NaN (fmax drops it); sm_80+ has it as one instruction for float.
__device__ __forceinline__ float max_nan(float a, float b) {
#if __CUDA_ARCH__ >= 800
  float r;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
#else
  return (a != a || b != b) ? a + b : fmaxf(a, b);
#endif
}
__device__ __forceinline__ double max_nan(double a, double b) {
  return (a != a || b != b) ? a + b : fmax(a, b);
}
template <typename Acc> __device__ __forceinline__ Acc row_max_nan(Acc x) {
#pragma unroll
  for (int offset = LANES_PER_ROW / 2; offset > 0; offset /= 2)
    x = max_nan(x, __shfl_xor_sync(FULL_WARP, x, offset, LANES_PER_ROW));
  return x;
}
template <typename Acc> __device__ __forceinline__ Acc row_sum(Acc x) {
#pragma unroll
  for (int offset = LANES_PER_ROW / 2; offset > 0; offset /= 2)
    x += __shfl_xor_sync(FULL_WARP, x, offset, LANES_PER_ROW);
  return x;
}

// ---- tiles -------------------------------------------------------------------------------------
// Copy rows [r0, r0 + ROWS) x columns [0, HEAD_DIM) of a row-major matrix (row stride rs, unit
// column stride) into shared memory as Acc, with rows padded to HEAD_DIM + 1 elements against bank
// conflicts. Rows >= row_end and columns >= ncols are written as zeros: later products multiply
// them by a zero probability, and 0 * (stale NaN) would not be zero.
template <typename T, typename Acc, int HEAD_DIM, int ROWS>
__device__ __forceinline__ void load_tile(Acc* __restrict__ dst, const T* __restrict__ src,
                                          long long rs, long long r0, long long row_end,
                                          int ncols) {
  constexpr int LD = HEAD_DIM + 1;
#pragma unroll 4
  for (int idx = threadIdx.x; idx < ROWS * HEAD_DIM; idx += NUM_THREADS) {
    const int r = idx / HEAD_DIM;
    const int c = idx % HEAD_DIM;
    const long long row = r0 + r;
    Acc x = Acc(0);
    if (row < row_end && c < ncols) x = to_acc(src[row * rs + c]);
    dst[r * LD + c] = x;
  }
}

// Grid: x = tile index, (y, z) = the flattened batch*head index (gridDim.y <= 65535).
__device__ __forceinline__ long long block_bh() {
  return static_cast<long long>(blockIdx.z) * gridDim.y + blockIdx.y;
}

// Sets each `P& region` to consecutive places from `at`, each `size` after the one before (P: an
// element pointer and element counts, or a shared-window u32 address and bytes): one statement
// for a kernel's shared-memory layout, in the order its host smem_bytes adds the sizes up.
template <typename P>
__device__ __forceinline__ void carve_shared(P) {}
template <typename P>
__device__ __forceinline__ void carve_shared(P at, P& last) {  // the last region's size unsaid
  last = at;
}
template <typename P, typename... More>
__device__ __forceinline__ void carve_shared(P at, P& region, int size, More&&... more) {
  region = at;
  carve_shared(static_cast<P>(at + size), more...);
}
