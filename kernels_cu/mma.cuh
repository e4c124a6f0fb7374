// mma.cuh: tensor-core building blocks for the sm_80+ kernels (mma.sync m16n8k16, ldmatrix,
// cp.async), float16 / bfloat16 in, float32 accumulate; and the m16n8k8 products of the wide
// types (float32 on TF32, float64 on DMMA: WideMma, at the end). No kernels.
//
// Shared by fwd_mma.cu and bwd_mma.cu: PTX wrappers, the mma/pack of each 16-bit type, cp_tile;
// then shared loads and stores and global reductions (used by the backward).
//
// Fragment layouts of mma.sync.m16n8k16.row.col (g = lane / 4, t = lane % 4):
//   C (16x8 f32):   c0, c1 = (row g,     cols 2t, 2t+1);  c2, c3 = (row g + 8, cols 2t, 2t+1)
//   A (16x16 b16):  a0 = (row g, k 2t..2t+1)   a1 = (row g + 8, k 2t..)
//                   a2 = (row g, k 2t+8..)     a3 = (row g + 8, k 2t+8..)      (low half = lower k)
//   B (16x8 b16):   b0 = (k 2t..2t+1, col g)   b1 = (k 2t+8.., col g)
// ldmatrix.x4: lanes 8i..8i+7 give the row addresses of matrix i, register i receives it; without
// .trans the thread holds (row g, cols 2t, 2t+1) of each 8x8 matrix, with .trans (rows 2t, 2t+1,
// col g), i.e. the transposed matrix's (row g, cols 2t, 2t+1).
#pragma once
#include "common.cuh"

namespace tc {

typedef unsigned int u32;
constexpr float LN2 = 0.6931471805599453f;

// ---- PTX wrappers ------------------------------------------------------------------------------
__device__ __forceinline__ u32 smem_u32(const void* p) {
  u32 r;
  asm("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(r) : "l"(p));
  return r;
}
// carve_shared (common.cuh) over dynamic shared memory as shared-window addresses, from its first
// ALIGN-aligned byte: shared_regions(sA, bytes_a, sB, bytes_b, sC) puts sA at the start, sB after.
template <u32 ALIGN = 16, typename... Regions>
__device__ __forceinline__ void shared_regions(Regions&&... regions) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  u32 base = smem_u32(smem_raw);
  if constexpr (ALIGN > 16) base = (base + ALIGN - 1) & ~(ALIGN - 1);
  carve_shared(base, regions...);
}
// 16-byte global -> shared copy; src_bytes = 0 writes zeros without reading.
__device__ __forceinline__ void cp_async16(u32 dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(src_bytes)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N> __device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}
__device__ __forceinline__ void ldsm_x4(u32 addr, u32 (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
__device__ __forceinline__ void ldsm_x4_t(u32 addr, u32 (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
__device__ __forceinline__ float ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
// An opaque copy: the compiler cannot hoist what is computed from it out of the loop it sits in.
__device__ __forceinline__ int opaque(int x) {
  int r;
  asm volatile("mov.b32 %0, %1;" : "=r"(r) : "r"(x));
  return r;
}

// The 16-bit type's tensor-core product and its pair packing (lo goes to the low half); PTX
// names the type f16 or bf16.
template <typename T> struct Mma;
#define TC_MMA(T, TY)                                                                          \
  template <> struct Mma<T> {                                                                 \
    static __device__ __forceinline__ void run(float (&c)[4], const u32 (&a)[4], u32 b0,      \
                                               u32 b1) {                                      \
      asm("mma.sync.aligned.m16n8k16.row.col.f32." TY "." TY ".f32 {%0,%1,%2,%3}, "           \
          "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"                                            \
          : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])                                    \
          : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));                    \
    }                                                                                         \
    /* two products sharing A: c0 += A (b[0], b[1]), c1 += A (b[2], b[3]) (an x4 B load) */  \
    static __device__ __forceinline__ void run2(float (&c0)[4], float (&c1)[4],               \
                                                const u32 (&a)[4], const u32 (&b)[4]) {       \
      run(c0, a, b[0], b[1]);                                                                 \
      run(c1, a, b[2], b[3]);                                                                 \
    }                                                                                         \
    static __device__ __forceinline__ u32 pack(float lo, float hi) {                          \
      u32 r;                                                                                  \
      asm("cvt.rn." TY "x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));                    \
      return r;                                                                               \
    }                                                                                         \
  };
TC_MMA(half_t, "f16")
TC_MMA(bf16_t, "bf16")
#undef TC_MMA

// Every entry of an array of accumulator fragments set to 0 (before its first product): one row
// of n-fragments, or M of them (m-fragments; any accumulator type, the wide kernels' too).
template <int N>
__device__ __forceinline__ void zero(float (&a)[N][4]) {
#pragma unroll
  for (int j = 0; j < N; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) a[j][e] = 0.f;
}
// f(c[m][n][e], m, n, e) for every entry of M rows of N accumulator fragments (e / 2: the row
// of the lane's pair, as in for_pair), fully unrolled: the one element loop over fragments.
template <int M, int N, typename T, typename F>
__device__ __forceinline__ void for_each_entry(T (&c)[M][N][4], F f) {
#pragma unroll
  for (int m = 0; m < M; ++m)
#pragma unroll
    for (int n = 0; n < N; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) f(c[m][n][e], m, n, e);
}
// f(mf, h, r) for the two rows of this lane's pair in each of MF m-fragments from row r0:
// r = r0 + 16 mf + g + 8 h (g = lane / 4; h: entries 2 h, 2 h + 1), the one row loop.
template <int MF, typename F>
__device__ __forceinline__ void for_frag_rows(int r0, int g, F f) {
#pragma unroll
  for (int mf = 0; mf < MF; ++mf)
#pragma unroll
    for (int h = 0; h < 2; ++h) f(mf, h, r0 + mf * 16 + g + 8 * h);
}
template <int M, int N, typename T>
__device__ __forceinline__ void zero(T (&c)[M][N][4]) {
  for_each_entry(c, [](T& x, int, int, int) { x = T(0); });
}

// One k-step of 16 of acc += A B: MF m-fragments of A in registers, B's NF n-fragments loaded by
// pairs, one ldmatrix.x4 (TRANS: .trans) at b + p * PAIR bytes for pair p serving every m-fragment.
template <typename T, bool TRANS, int PAIR, int MF, int NF>
__device__ __forceinline__ void mma_kstep(float (&acc)[MF][NF][4], const u32 (&a)[MF][4], u32 b) {
#pragma unroll
  for (int p = 0; p < NF / 2; ++p) {
    u32 bf[4];
    if (TRANS)
      ldsm_x4_t(b + p * PAIR, bf);
    else
      ldsm_x4(b + p * PAIR, bf);
#pragma unroll
    for (int mf = 0; mf < MF; ++mf) Mma<T>::run2(acc[mf][2 * p], acc[mf][2 * p + 1], a[mf], bf);
  }
}
// The same for one m-fragment.
template <typename T, bool TRANS, int PAIR, int NF>
__device__ __forceinline__ void mma_kstep(float (&acc)[NF][4], const u32 (&a)[4], u32 b) {
  mma_kstep<T, TRANS, PAIR>(reinterpret_cast<float (&)[1][NF][4]>(acc),
                            reinterpret_cast<const u32 (&)[1][4]>(a), b);
}

// Two 16x8 float accumulator fragments (n-fragments 2 kk and 2 kk + 1 of one product) as the
// 16x16 16-bit A fragment of k-step kk of the next product: P (or dS) stays in registers.
template <typename T>
__device__ __forceinline__ void acc_to_a(const float (&c0)[4], const float (&c1)[4],
                                         u32 (&a)[4]) {
  a[0] = Mma<T>::pack(c0[0], c0[1]);
  a[1] = Mma<T>::pack(c0[2], c0[3]);
  a[2] = Mma<T>::pack(c1[0], c1[1]);
  a[3] = Mma<T>::pack(c1[2], c1[3]);
}

// ---- shared tile layouts ----------------------------------------------------------------------
// A tile of 16-bit rows in shared memory, addressed in 16-byte chunks (8 elements), two layouts:
//   padded (SWZ = false): rows of ROW = (cols + 8) * 2 bytes, chunk c of row r at r * ROW + 16 c.
//     The pad shifts each row by 4 banks, so the 8 rows of an ldmatrix phase hit distinct banks,
//     but rows straddle 128-byte lines, so their cp.async stores cost extra shared wavefronts and
//     L2 sectors (profiler counts: benchmarks/RESULTS.md, "Tensor-core backward", SWZ).
//   swizzled (SWZ = true; cols a multiple of 64): blocks of 64 columns stored one after another,
//     each a ROWS x 128-byte array; chunk c of row r sits in block c / 8, row r, at chunk
//     (c % 8) ^ (r % 8) of that 128-byte row. For 64 columns (one block) this is FA2's layout; it is
//     also wgmma's 128-byte swizzle (wgmma.cuh) at any width. A row's stores fill whole
//     128-byte lines, and 8 consecutive rows at one logical chunk sit in 8 distinct 16-byte bank
//     groups: the 8 addresses of an ldmatrix phase stay conflict-free.
// stored_chunk: where chunk c (< 8) of row r sits in its 128-byte row; chunk_offset: its byte offset
// in the tile (block 0; ROW = 128 when swizzled).
template <bool SWZ>
__host__ __device__ __forceinline__ constexpr int stored_chunk(int r, int c) {
  return SWZ ? c ^ (r & 7) : c;
}
template <bool SWZ, int ROW>
__host__ __device__ __forceinline__ constexpr int chunk_offset(int r, int c) {
  return r * ROW + stored_chunk<SWZ>(r, c) * 16;
}
// ldmatrix address of the 8x8 block row_off bytes (a multiple of 8 rows) and col_off bytes (an even
// number of chunks) past the lane's own address lane_addr = tile base + chunk_offset(lane's row,
// lane's chunk), the lane's chunk being 0 or 1. Padded: a sum (col_off folds into ldmatrix's
// immediate). Swizzled: the row offset keeps r % 8 and (lane chunk + even chunk) is their XOR, so
// col_off XORs into the lane's swizzled chunk; that needs the tile base aligned to ROW (the XOR
// stays in the row's offset bits) and costs one LOP3 per distinct col_off (it cannot fold).
// BLK (swizzled tiles wider than 64 columns): bytes per 64-column block; col_off may then reach
// past the first block.
template <bool SWZ, u32 BLK = 0>
__device__ __forceinline__ u32 tile_addr(u32 lane_addr, u32 row_off, u32 col_off) {
  if (SWZ && BLK != 0) return (lane_addr ^ (col_off % 128)) + (col_off / 128) * BLK + row_off;
  return SWZ ? (lane_addr ^ col_off) + row_off : lane_addr + row_off + col_off;
}

// Copy rows [row0, row0 + ROWS) of a (row stride rs, unit column stride) matrix into a shared tile
// (padded, or swizzled with SWZ: chunk_offset); rows >= limit become zeros (P = 0 times a stale NaN
// would not be 0). Thread t copies chunk t % CPR of rows t / CPR + RPI * it: one base pointer per
// call, constant shared offsets (with SWZ, RPI % 8 == 0 keeps each thread's swizzle fixed).
// HEAD_DIM columns per row; padded rows are PITCH_DIM + 8 elements apart (a tile narrower than the
// others of its kernel: bwd_mma.cu's V / dO when Dv < Dk).
template <int ROWS, int HEAD_DIM, int THREADS, typename T, bool SWZ = false,
          int PITCH_DIM = HEAD_DIM>
__device__ __forceinline__ void cp_tile(u32 dst, const T* __restrict__ src, long long rs, int row0,
                                        int limit) {
  constexpr int CPR = HEAD_DIM / 8;  // 16-byte chunks per row
  constexpr int ROW_BYTES = SWZ ? 128 : (PITCH_DIM + 8) * 2;  // row pitch (of a block, swizzled)
  static_assert(!SWZ || PITCH_DIM == HEAD_DIM, "cp_tile: swizzled tiles are HEAD_DIM wide");
  constexpr int BLK = ROWS * 128;                           // swizzled: bytes per 64-column block
  static_assert(!SWZ || CPR % 8 == 0, "cp_tile: the swizzle needs a multiple of 8 chunks per row");
  // rs through an opaque move: otherwise the compiler hoists every row's 64-bit address out of the
  // key loop and keeps them all live (~24 registers).
  long long rs_o;
  asm volatile("mov.b64 %0, %1;" : "=l"(rs_o) : "l"(rs));
  if constexpr (THREADS % CPR == 0) {
    constexpr int RPI = THREADS / CPR;  // rows per iteration
    static_assert(!SWZ || RPI % 8 == 0, "cp_tile: a thread's rows must share r % 8");
    const int r_thr = threadIdx.x / CPR, c_thr = threadIdx.x % CPR;
    const T* base = src + static_cast<long long>(row0 + r_thr) * rs_o + c_thr * 8;
    // chunk_offset's terms, added to dst one by one (the padded form's PTX stays as it was)
    const u32 d = dst + (SWZ ? (c_thr / 8) * BLK : 0) + r_thr * ROW_BYTES +
                  stored_chunk<SWZ>(r_thr, SWZ ? c_thr % 8 : c_thr) * 16;
#pragma unroll
    for (int it = 0; it < (ROWS + RPI - 1) / RPI; ++it) {
      const int r = it * RPI + r_thr;
      if (ROWS % RPI == 0 || r < ROWS) {
        const bool ok = row0 + r < limit;
        cp_async16(d + it * RPI * ROW_BYTES, ok ? base + it * RPI * rs_o : src, ok ? 16 : 0);
      }
    }
  } else {  // head dims 96, 192: rows do not divide the block evenly
    constexpr int TOTAL = ROWS * CPR;
#pragma unroll
    for (int it = 0; it < (TOTAL + THREADS - 1) / THREADS; ++it) {
      const int idx = it * THREADS + threadIdx.x;
      if (TOTAL % THREADS == 0 || idx < TOTAL) {
        const int r = idx / CPR, c = idx % CPR;
        const bool ok = row0 + r < limit;
        const T* gp = src + (ok ? static_cast<long long>(row0 + r) * rs_o : 0LL) + c * 8;
        cp_async16(dst + (SWZ ? (c / 8) * BLK : 0) + r * ROW_BYTES +
                       stored_chunk<SWZ>(r, SWZ ? c % 8 : c) * 16, gp, ok ? 16 : 0);
      }
    }
  }
}

// cp_tile with incremental source addresses (THREADS a multiple of HEAD_DIM / 8): the thread's
// first row pointer is formed once (one 64-bit multiply), then advanced by RPI rows per copy (one
// 64-bit add), and the row predicate compares against one precomputed remainder. cp_tile forms a
// full 64-bit row * stride product and reloads its parameters per row (~10 instructions per copy).
template <int ROWS, int HEAD_DIM, int THREADS, typename T>
__device__ __forceinline__ void cp_tile_inc(u32 dst, const T* __restrict__ src, long long rs,
                                            int row0, int limit) {
  constexpr int CPR = HEAD_DIM / 8;
  constexpr int ROW_BYTES = (HEAD_DIM + 8) * 2;
  static_assert(THREADS % CPR == 0, "cp_tile_inc: rows must divide the block");
  constexpr int RPI = THREADS / CPR;
  long long rs_o;  // opaque, as in cp_tile: nothing of this is hoisted out of the key loop
  asm volatile("mov.b64 %0, %1;" : "=l"(rs_o) : "l"(rs));
  const int r_thr = threadIdx.x / CPR, c_thr = threadIdx.x % CPR;
  const T* p = src + static_cast<long long>(row0 + r_thr) * rs_o + c_thr * 8;
  // in BYTES: the opaque add below adds to the address, not to a T*
  const long long step = RPI * rs_o * static_cast<long long>(sizeof(T));
  const int rem = limit - row0 - r_thr;  // copy `it` reads a real row iff it * RPI < rem
  const u32 d = dst + r_thr * ROW_BYTES + c_thr * 16;
#pragma unroll
  for (int it = 0; it < (ROWS + RPI - 1) / RPI; ++it) {
    if (ROWS % RPI == 0 || it * RPI + r_thr < ROWS) {
      const bool ok = it * RPI < rem;
      cp_async16(d + it * RPI * ROW_BYTES, ok ? p : src, ok ? 16 : 0);
    }
    // An opaque add, ordered with the copies: one row pointer live at a time (a plain += lets the
    // compiler form every row's pointer up front and hold them all).
    asm volatile("add.s64 %0, %0, %1;" : "+l"(p) : "l"(step));
  }
}

// ---- new for the backward ----------------------------------------------------------------------
__device__ __forceinline__ void st_shared_b32(u32 addr, u32 x) {
  asm volatile("st.shared.b32 [%0], %1;" ::"r"(addr), "r"(x) : "memory");
}
__device__ __forceinline__ void st_shared_f32(u32 addr, float a) {
  asm volatile("st.shared.f32 [%0], %1;" ::"r"(addr), "f"(a) : "memory");
}
__device__ __forceinline__ void st_shared_v2f(u32 addr, float a, float b) {
  asm volatile("st.shared.v2.f32 [%0], {%1,%2};" ::"r"(addr), "f"(a), "f"(b) : "memory");
}
__device__ __forceinline__ void ld_shared_v2f(u32 addr, float& a, float& b) {
  asm volatile("ld.shared.v2.f32 {%0,%1}, [%2];" : "=f"(a), "=f"(b) : "r"(addr) : "memory");
}
// *p += a, p[1] += b in global memory, no return value (red). One vector reduction on sm_90+.
__device__ __forceinline__ void red_add_f32x2(float* p, float a, float b) {
#if __CUDA_ARCH__ >= 900
  asm volatile("red.global.add.v2.f32 [%0], {%1, %2};" ::"l"(p), "f"(a), "f"(b) : "memory");
#else
  asm volatile("red.global.add.f32 [%0], %1;" ::"l"(p), "f"(a) : "memory");
  asm volatile("red.global.add.f32 [%0], %1;" ::"l"(p + 1), "f"(b) : "memory");
#endif
}


// ---- the wide types: float32 on TF32, float64 on DMMA (fwd_wide.cu) ---------------------------
// One geometry for both, m16n8k8 (g = lane / 4, t = lane % 4), one element per register:
//   A (16x8):  a0 = (row g, k t)   a1 = (row g + 8, k t)   a2 = (row g, k t + 4)   a3 = (row g + 8, k t + 4)
//   B (8x8):   b0 = (k t, col g)   b1 = (k t + 4, col g)
//   C (16x8):  as m16n8k16's.
// Any order of the 8 k of one step is the same product when A and B use it: the kernels put
// element 2t in slot t and 2t + 1 in slot t + 4, so a lane's (a0, a2), (a1, a3) and (b0, b1) are
// neighbours in a row (one vector load each), and an accumulator's (c0, c1), (c2, c3) are (a0, a2),
// (a1, a3) of the next product (P stays in registers).
//
// float32: PASSES = 3 splits each operand x = hi + lo into TF32 parts (hi = x rounded to TF32,
// lo = the remainder rounded to TF32: |x - hi - lo| <= 2^-24 |x|) and accumulates lo_a hi_b,
// hi_a lo_b, hi_a hi_b (small terms first; lo_a lo_b <= 2^-24 |a b| is dropped): a float32
// product. PASSES = 1: hi_a hi_b only (TF32, 10-bit mantissas). float64: the f64 product, m16n8k8
// on sm_90+, four m8n8k4 on sm_80 (a0 b0 + a2 b1 for rows g, a1 b0 + a3 b1 for rows g + 8).
__device__ __forceinline__ u32 to_tf32(float x) {
  u32 r;
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
  return r;
}

template <typename T, int PASSES>
struct WideMma;

template <int PASSES>
struct WideMma<float, PASSES> {
  static_assert(PASSES == 1 || PASSES == 3, "TF32 passes: 1 or 3");
  static constexpr int LO = PASSES == 3 ? 1 : 0;
  // whether a long chain of run's on one c costs more than the product's own error
  static constexpr bool ROUNDS_TOWARD_ZERO = PASSES == 3;
  struct A {
    u32 hi[4], lo[4];  // lo unused (and not formed) with one pass
  };
  struct B {
    u32 hi[2], lo[2];
  };
  static __device__ __forceinline__ void split(float x, u32& hi, u32& lo) {
    hi = to_tf32(x);
    if (LO) lo = to_tf32(x - __uint_as_float(hi));
  }
  static __device__ __forceinline__ A make_a(float a0, float a1, float a2, float a3) {
    A a;
    split(a0, a.hi[0], a.lo[0]);
    split(a1, a.hi[1], a.lo[1]);
    split(a2, a.hi[2], a.lo[2]);
    split(a3, a.hi[3], a.lo[3]);
    return a;
  }
  static __device__ __forceinline__ B make_b(float b0, float b1) {
    B b;
    split(b0, b.hi[0], b.lo[0]);
    split(b1, b.hi[1], b.lo[1]);
    return b;
  }
  static __device__ __forceinline__ void mma(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
  // c += A B. The tensor cores round each sum toward zero: a c chained through many k-steps
  // collects that bias (a row's P V over a few hundred keys: 5-10x float32's error), so the
  // kernels chain c over one tile only and add tiles in float32 (fwd_wide.cu).
  static __device__ __forceinline__ void run(float (&c)[4], const A& a, const B& b) {
    if (LO) {
      mma(c, a.lo, b.hi[0], b.hi[1]);
      mma(c, a.hi, b.lo[0], b.lo[1]);
    }
    mma(c, a.hi, b.hi[0], b.hi[1]);
  }
};

template <int PASSES>
struct WideMma<double, PASSES> {
  static constexpr bool ROUNDS_TOWARD_ZERO = false;  // DMMA rounds to nearest
  struct A {
    double x[4];
  };
  struct B {
    double x[2];
  };
  static __device__ __forceinline__ A make_a(double a0, double a1, double a2, double a3) {
    A a = {{a0, a1, a2, a3}};
    return a;
  }
  static __device__ __forceinline__ B make_b(double b0, double b1) {
    B b = {{b0, b1}};
    return b;
  }
  static __device__ __forceinline__ void run(double (&c)[4], const A& a, const B& b) {
#if __CUDA_ARCH__ >= 900
    asm("mma.sync.aligned.m16n8k8.row.col.f64.f64.f64.f64 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+d"(c[0]), "+d"(c[1]), "+d"(c[2]), "+d"(c[3])
        : "d"(a.x[0]), "d"(a.x[1]), "d"(a.x[2]), "d"(a.x[3]), "d"(b.x[0]), "d"(b.x[1]));
#else
    asm("mma.sync.aligned.m8n8k4.row.col.f64.f64.f64.f64 {%0,%1}, {%2}, {%3}, {%0,%1};"
        : "+d"(c[0]), "+d"(c[1]) : "d"(a.x[0]), "d"(b.x[0]));
    asm("mma.sync.aligned.m8n8k4.row.col.f64.f64.f64.f64 {%0,%1}, {%2}, {%3}, {%0,%1};"
        : "+d"(c[2]), "+d"(c[3]) : "d"(a.x[1]), "d"(b.x[0]));
    asm("mma.sync.aligned.m8n8k4.row.col.f64.f64.f64.f64 {%0,%1}, {%2}, {%3}, {%0,%1};"
        : "+d"(c[0]), "+d"(c[1]) : "d"(a.x[2]), "d"(b.x[1]));
    asm("mma.sync.aligned.m8n8k4.row.col.f64.f64.f64.f64 {%0,%1}, {%2}, {%3}, {%0,%1};"
        : "+d"(c[2]), "+d"(c[3]) : "d"(a.x[3]), "d"(b.x[1]));
#endif
  }
};

// An address offset of 0 that depends on x: a shared load at addr + after(x) waits for x. Without
// it ptxas hoists every B load of a product loop to its top (the wide types' operands then take
// ~4x the registers of the accumulators they feed, and spill). x is never the non-canonical NaN
// compared with (GPU arithmetic only produces the canonical one), so the offset is 0.
__device__ __forceinline__ u32 after(float x) {
  return __float_as_uint(x) == 0xffc00001u ? 16u : 0u;
}
__device__ __forceinline__ u32 after(double x) {
  return __double_as_longlong(x) == static_cast<long long>(0xfff8000000000001ULL) ? 16u : 0u;
}

// Two neighbouring elements of a shared row (8-byte aligned float pair, 16-byte double pair).
__device__ __forceinline__ void ld_shared_pair(u32 addr, float& a, float& b) {
  asm volatile("ld.shared.v2.f32 {%0,%1}, [%2];" : "=f"(a), "=f"(b) : "r"(addr) : "memory");
}
__device__ __forceinline__ void ld_shared_pair(u32 addr, double& a, double& b) {
  asm volatile("ld.shared.v2.f64 {%0,%1}, [%2];" : "=d"(a), "=d"(b) : "r"(addr) : "memory");
}
__device__ __forceinline__ void ld_shared_one(u32 addr, float& a) {
  asm volatile("ld.shared.f32 %0, [%1];" : "=f"(a) : "r"(addr) : "memory");
}
__device__ __forceinline__ void ld_shared_one(u32 addr, double& a) {
  asm volatile("ld.shared.f64 %0, [%1];" : "=d"(a) : "r"(addr) : "memory");
}

// Rows [row0, row0 + ROWS) of a (row stride rs, unit column stride) matrix of T, its first `cols`
// columns (a multiple of 16 / sizeof(T)) into shared rows PITCH elements apart, COLS wide: 16-byte
// cp.async copies; rows >= limit and columns >= cols become zeros (so a narrower head dim is a
// zero-padded one, and P = 0 never meets a stale NaN).
template <int ROWS, int COLS, int PITCH, int THREADS, typename T>
__device__ __forceinline__ void cp_rows(u32 dst, const T* __restrict__ src, long long rs, int row0,
                                        int limit, int cols) {
  constexpr int EPC = 16 / static_cast<int>(sizeof(T));  // elements per 16-byte chunk
  constexpr int CPR = COLS / EPC;
  constexpr int TOTAL = ROWS * CPR;
  static_assert(COLS % EPC == 0 && (PITCH * sizeof(T)) % 16 == 0, "cp_rows: 16-byte rows");
  long long rs_o;  // opaque, as in cp_tile
  asm volatile("mov.b64 %0, %1;" : "=l"(rs_o) : "l"(rs));
#pragma unroll
  for (int it = 0; it < (TOTAL + THREADS - 1) / THREADS; ++it) {
    const int idx = it * THREADS + threadIdx.x;
    if (TOTAL % THREADS == 0 || idx < TOTAL) {
      const int r = idx / CPR, c = idx % CPR;
      const bool ok = row0 + r < limit && c * EPC < cols;
      const T* gp = src + (ok ? static_cast<long long>(row0 + r) * rs_o + c * EPC : 0LL);
      cp_async16(dst + (r * PITCH + c * EPC) * static_cast<u32>(sizeof(T)), gp, ok ? 16 : 0);
    }
  }
}

}  // namespace tc
