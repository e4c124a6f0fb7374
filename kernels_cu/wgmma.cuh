// wgmma.cuh: Hopper warpgroup products (wgmma.mma_async, sm_90a) for the tensor-core kernels.
// No kernels.
//
// A warpgroup (4 consecutive warps, the first one's index a multiple of 4) computes D (64 x N,
// N = 32, 64, 80, 128, 176 or 192, float32) += A (64 x 16k) B (16k x N), 16-bit inputs. B is
// always in shared memory, A in shared memory (ss) or in registers (rs). The register layouts are
// mma.sync's (mma.cuh), stacked: warp w of the group holds rows 16 w .. 16 w + 15; its accumulator
// d[j][0..3] is the m16n8 C fragment of columns 8 j .. 8 j + 7, and a register A operand is the
// m16n8k16 A fragment of its 16 rows (tc::acc_to_a). So code written for mma.sync fragments reads wgmma results unchanged.
//
// Shared operands are described by a 64-bit matrix descriptor. The only layout used here is the
// 128-byte swizzle of tc::cp_tile's swizzled tiles: blocks of 64 columns, each rows of 128 bytes,
// 16-byte chunk c of row r stored at chunk c ^ (r % 8). The hardware applies the XOR to absolute
// shared addresses, so every tile base must be 1024-byte aligned (8 rows). Two readings of a tile:
//   K-major (the reduction index runs along the row): rows are M (or N) indices; 8-row groups are
//     SBO = 1024 bytes apart; k-step kk (16 elements) starts 32 (kk % 4) bytes into the row of
//     column block kk / 4.
//   MN-major (imm-trans = 1; the reduction index runs down the rows): the 64 elements of a row are
//     M (or N) indices; k-step kk (16 rows) starts 2048 kk bytes into the block, its two 8-row
//     groups SBO = 1024 bytes apart; LBO is the stride between 64-wide column blocks (N = 128).
// Ordering: shared memory written by the generic proxy (st.shared, cp.async) needs
// fence.proxy.async.shared::cta in each writing thread before the barrier that precedes a wgmma
// reading it (fence_shared). A product is fence() (registers written since the last wgmma), the
// wgmmas, commit(), wait<0>(); the accumulators and register A operands are touched only after it.
//
// Compiled only for sm_90a (__CUDA_ARCH_FEAT_SM90_ALL); any other target gets a trap, and the host
// never launches such a kernel there (_mma_bwd.wgmma_available).
#pragma once
#include "mma.cuh"

namespace wg {
using tc::u32;
typedef unsigned long long u64;

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define CUFLASH_WGMMA 1
#else
#define CUFLASH_WGMMA 0
#endif

// 128-byte-swizzle descriptor of the operand starting at shared address addr (bits 0-13: addr / 16,
// 16-29: LBO / 16, 32-45: SBO / 16, 62-63: swizzle mode 1 = 128 bytes).
__device__ __forceinline__ u64 desc_sw128(u32 addr, u32 lbo_bytes, u32 sbo_bytes) {
  return static_cast<u64>((addr & 0x3FFFF) >> 4) | (static_cast<u64>(lbo_bytes >> 4) << 16) |
         (static_cast<u64>(sbo_bytes >> 4) << 32) | (1ull << 62);
}
constexpr u32 SW128_SBO = 1024;  // 8 rows of 128 bytes
constexpr u32 SW128_KSTEP_K = 32;     // K-major: bytes per k-step of 16 elements along the row
constexpr u32 SW128_KSTEP_MN = 2048;  // MN-major: bytes per k-step of 16 rows

// One instruction of sm_90a's (elsewhere none: kernels that use these trap before reaching them).
#if CUFLASH_WGMMA
#define CUFLASH_SM90A_ASM(...) asm volatile(__VA_ARGS__)
#else
#define CUFLASH_SM90A_ASM(...) ((void)0)
#endif

__device__ __forceinline__ void fence() {
  CUFLASH_SM90A_ASM("wgmma.fence.sync.aligned;" ::: "memory");
}
__device__ __forceinline__ void commit() {
  CUFLASH_SM90A_ASM("wgmma.commit_group.sync.aligned;" ::: "memory");
}
template <int N> __device__ __forceinline__ void wait() {
  CUFLASH_SM90A_ASM("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}
__device__ __forceinline__ void fence_shared() {
  CUFLASH_SM90A_ASM("fence.proxy.async.shared::cta;" ::: "memory");
}
// dst[0 .. bytes / 4) += the floats at shared address src, by the bulk copy engine (atomic per
// element, like red.global.add); src and dst 16-byte aligned, bytes a multiple of 16. The
// issuing thread's bulk group: commit with bulk_commit, and bulk_wait_read<0> before src is
// written again (or the block exits). src was written by the generic proxy: fence_shared in each
// writing thread, then the barrier, then this.
__device__ __forceinline__ void bulk_add_f32(float* dst, u32 src, u32 bytes) {
  CUFLASH_SM90A_ASM("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;"
                    ::"l"(dst), "r"(src), "r"(bytes) : "memory");
}
__device__ __forceinline__ void bulk_commit() {
  CUFLASH_SM90A_ASM("cp.async.bulk.commit_group;" ::: "memory");
}
template <int N> __device__ __forceinline__ void bulk_wait_read() {
  CUFLASH_SM90A_ASM("cp.async.bulk.wait_group.read %0;" ::"n"(N) : "memory");
}
// ... and until their writes are done (visible to this thread: a release after it publishes
// them), not only their reads of shared memory.
template <int N> __device__ __forceinline__ void bulk_wait() {
  CUFLASH_SM90A_ASM("cp.async.bulk.wait_group %0;" ::"n"(N) : "memory");
}
// Orders this thread's generic-proxy global accesses before (an acquire) with its later bulk
// copies' (async proxy).
__device__ __forceinline__ void fence_global() {
  CUFLASH_SM90A_ASM("fence.proxy.async.global;" ::: "memory");
}
// Keeps the compiler from moving accumulator reads or writes across a wait (registers the
// tensor cores write asynchronously).
template <int NF> __device__ __forceinline__ void fence_acc(float (&d)[NF][4]) {
#pragma unroll
  for (int j = 0; j < NF; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) asm volatile("" : "+f"(d[j][e])::"memory");
}

#define CUFLASH_WG_D4(d, j) "+f"(d[j][0]), "+f"(d[j][1]), "+f"(d[j][2]), "+f"(d[j][3])
#define CUFLASH_WG_DOPS16(d) \
  CUFLASH_WG_D4(d, 0), CUFLASH_WG_D4(d, 1), CUFLASH_WG_D4(d, 2), CUFLASH_WG_D4(d, 3)
#define CUFLASH_WG_DOPS32(d) CUFLASH_WG_DOPS16(d), \
  CUFLASH_WG_D4(d, 4), CUFLASH_WG_D4(d, 5), CUFLASH_WG_D4(d, 6), CUFLASH_WG_D4(d, 7)
#define CUFLASH_WG_DOPS64(d) CUFLASH_WG_DOPS32(d), \
  CUFLASH_WG_D4(d, 8), CUFLASH_WG_D4(d, 9), CUFLASH_WG_D4(d, 10), CUFLASH_WG_D4(d, 11), \
  CUFLASH_WG_D4(d, 12), CUFLASH_WG_D4(d, 13), CUFLASH_WG_D4(d, 14), CUFLASH_WG_D4(d, 15)
#define CUFLASH_WG_DSTR16 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15"
#define CUFLASH_WG_DSTR32 CUFLASH_WG_DSTR16 ", " \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define CUFLASH_WG_DSTR64 CUFLASH_WG_DSTR32 ", " \
  "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
  "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
// The operands after R accumulators: A and B descriptors, the accumulate flag, B's and A's
// transposes (ss);
// four A registers, B's descriptor, the flag, B's transpose (rs).
#define CUFLASH_WG_SS_TAIL16 ", %16, %17, p, 1, 1, %20, %19;\n}\n"
#define CUFLASH_WG_SS_TAIL32 ", %32, %33, p, 1, 1, %36, %35;\n}\n"
#define CUFLASH_WG_SS_TAIL64 ", %64, %65, p, 1, 1, %68, %67;\n}\n"
#define CUFLASH_WG_SS_FLAG16 "setp.ne.b32 p, %18, 0;\n"
#define CUFLASH_WG_SS_FLAG32 "setp.ne.b32 p, %34, 0;\n"
#define CUFLASH_WG_SS_FLAG64 "setp.ne.b32 p, %66, 0;\n"
#define CUFLASH_WG_RS_TAIL16 ", {%16, %17, %18, %19}, %20, p, 1, 1, %22;\n}\n"
#define CUFLASH_WG_RS_TAIL32 ", {%32, %33, %34, %35}, %36, p, 1, 1, %38;\n}\n"
#define CUFLASH_WG_RS_TAIL64 ", {%64, %65, %66, %67}, %68, p, 1, 1, %70;\n}\n"
#define CUFLASH_WG_RS_FLAG16 "setp.ne.b32 p, %21, 0;\n"
#define CUFLASH_WG_RS_FLAG32 "setp.ne.b32 p, %37, 0;\n"
#define CUFLASH_WG_RS_FLAG64 "setp.ne.b32 p, %69, 0;\n"

// N = 80 (the backward's 80-query steps at D=128)
#define CUFLASH_WG_DOPS40(d) CUFLASH_WG_DOPS32(d), CUFLASH_WG_D4(d, 8), CUFLASH_WG_D4(d, 9)
#define CUFLASH_WG_DSTR40 CUFLASH_WG_DSTR32 ", %32, %33, %34, %35, %36, %37, %38, %39"
#define CUFLASH_WG_SS_TAIL40 ", %40, %41, p, 1, 1, %44, %43;\n}\n"
#define CUFLASH_WG_SS_FLAG40 "setp.ne.b32 p, %42, 0;\n"
#define CUFLASH_WG_RS_TAIL40 ", {%40, %41, %42, %43}, %44, p, 1, 1, %46;\n}\n"
#define CUFLASH_WG_RS_FLAG40 "setp.ne.b32 p, %45, 0;\n"

// N = 176 and 192 (score tiles of 176 and 192 keys)
#define CUFLASH_WG_DOPS88(d) CUFLASH_WG_DOPS64(d), \
  CUFLASH_WG_D4(d, 16), CUFLASH_WG_D4(d, 17), CUFLASH_WG_D4(d, 18), CUFLASH_WG_D4(d, 19), CUFLASH_WG_D4(d, 20), CUFLASH_WG_D4(d, 21)
#define CUFLASH_WG_DSTR88 CUFLASH_WG_DSTR64 ", " \
  "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87"
#define CUFLASH_WG_SS_TAIL88 ", %88, %89, p, 1, 1, %92, %91;\n}\n"
#define CUFLASH_WG_SS_FLAG88 "setp.ne.b32 p, %90, 0;\n"
#define CUFLASH_WG_RS_TAIL88 ", {%88, %89, %90, %91}, %92, p, 1, 1, %94;\n}\n"
#define CUFLASH_WG_RS_FLAG88 "setp.ne.b32 p, %93, 0;\n"
#define CUFLASH_WG_DOPS96(d) CUFLASH_WG_DOPS64(d), \
  CUFLASH_WG_D4(d, 16), CUFLASH_WG_D4(d, 17), CUFLASH_WG_D4(d, 18), CUFLASH_WG_D4(d, 19), CUFLASH_WG_D4(d, 20), CUFLASH_WG_D4(d, 21), CUFLASH_WG_D4(d, 22), CUFLASH_WG_D4(d, 23)
#define CUFLASH_WG_DSTR96 CUFLASH_WG_DSTR64 ", " \
  "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95"
#define CUFLASH_WG_SS_TAIL96 ", %96, %97, p, 1, 1, %100, %99;\n}\n"
#define CUFLASH_WG_SS_FLAG96 "setp.ne.b32 p, %98, 0;\n"
#define CUFLASH_WG_RS_TAIL96 ", {%96, %97, %98, %99}, %100, p, 1, 1, %102;\n}\n"
#define CUFLASH_WG_RS_FLAG96 "setp.ne.b32 p, %101, 0;\n"

// Mma<T, N>::ss / rs: d (64 x N; = A B, or += with ACC) for one k-step of 16; TB: B MN-major,
// TA: A MN-major (ss only).
template <typename T, int N> struct Mma;
#if CUFLASH_WGMMA
#define CUFLASH_WG_MMA(TYPE, TY, N, R)                                                         \
  template <> struct Mma<TYPE, N> {                                                            \
    template <int ACC, int TB, int TA = 0>                                                     \
    static __device__ __forceinline__ void ss(float (&d)[N / 8][4], u64 a, u64 b) {           \
      asm volatile("{\n.reg .pred p;\n" CUFLASH_WG_SS_FLAG##R                                 \
                   "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TY "." TY " {"            \
                   CUFLASH_WG_DSTR##R "}" CUFLASH_WG_SS_TAIL##R                               \
                   : CUFLASH_WG_DOPS##R(d)                                                     \
                   : "l"(a), "l"(b), "r"(ACC), "n"(TB), "n"(TA));                              \
    }                                                                                          \
    template <int ACC, int TB>                                                                 \
    static __device__ __forceinline__ void rs(float (&d)[N / 8][4], const u32 (&a)[4], u64 b) { \
      asm volatile("{\n.reg .pred p;\n" CUFLASH_WG_RS_FLAG##R                                 \
                   "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TY "." TY " {"            \
                   CUFLASH_WG_DSTR##R "}" CUFLASH_WG_RS_TAIL##R                               \
                   : CUFLASH_WG_DOPS##R(d)                                                     \
                   : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(ACC), "n"(TB));   \
    }                                                                                          \
  };
#else
#define CUFLASH_WG_MMA(TYPE, TY, N, R)                                                         \
  template <> struct Mma<TYPE, N> {                                                            \
    template <int ACC, int TB, int TA = 0>                                                     \
    static __device__ __forceinline__ void ss(float (&)[N / 8][4], u64, u64) { __trap(); }    \
    template <int ACC, int TB>                                                                 \
    static __device__ __forceinline__ void rs(float (&)[N / 8][4], const u32 (&)[4], u64) {   \
      __trap();                                                                                \
    }                                                                                          \
  };
#endif
CUFLASH_WG_MMA(bf16_t, "bf16", 32, 16)
CUFLASH_WG_MMA(bf16_t, "bf16", 64, 32)
CUFLASH_WG_MMA(bf16_t, "bf16", 80, 40)
CUFLASH_WG_MMA(bf16_t, "bf16", 128, 64)
CUFLASH_WG_MMA(half_t, "f16", 32, 16)
CUFLASH_WG_MMA(half_t, "f16", 64, 32)
CUFLASH_WG_MMA(half_t, "f16", 80, 40)
CUFLASH_WG_MMA(half_t, "f16", 128, 64)
CUFLASH_WG_MMA(bf16_t, "bf16", 176, 88)
CUFLASH_WG_MMA(bf16_t, "bf16", 192, 96)
CUFLASH_WG_MMA(half_t, "f16", 176, 88)
CUFLASH_WG_MMA(half_t, "f16", 192, 96)

// Mma<float, N>: float32 operands on TF32 (k-steps of 8; the hardware reads each operand's top 19
// bits, a truncation: operands are rounded to TF32 before they reach it). .tf32 takes no
// transpose: both shared operands are K-major (TB = TA = 0), as a register A is.
#define CUFLASH_WG_SS_TAILF16 ", %16, %17, p, 1, 1;\n}\n"
#define CUFLASH_WG_SS_TAILF32 ", %32, %33, p, 1, 1;\n}\n"
#define CUFLASH_WG_SS_TAILF64 ", %64, %65, p, 1, 1;\n}\n"
#define CUFLASH_WG_RS_TAILF16 ", {%16, %17, %18, %19}, %20, p, 1, 1;\n}\n"
#define CUFLASH_WG_RS_TAILF32 ", {%32, %33, %34, %35}, %36, p, 1, 1;\n}\n"
#define CUFLASH_WG_RS_TAILF64 ", {%64, %65, %66, %67}, %68, p, 1, 1;\n}\n"
#if CUFLASH_WGMMA
#define CUFLASH_WG_MMA_TF32(N, R)                                                               \
  template <> struct Mma<float, N> {                                                           \
    template <int ACC, int TB, int TA = 0>                                                     \
    static __device__ __forceinline__ void ss(float (&d)[N / 8][4], u64 a, u64 b) {           \
      static_assert(TB == 0 && TA == 0, ".tf32 operands are K-major");                         \
      asm volatile("{\n.reg .pred p;\n" CUFLASH_WG_SS_FLAG##R                                 \
                   "wgmma.mma_async.sync.aligned.m64n" #N "k8.f32.tf32.tf32 {"                 \
                   CUFLASH_WG_DSTR##R "}" CUFLASH_WG_SS_TAILF##R                              \
                   : CUFLASH_WG_DOPS##R(d)                                                     \
                   : "l"(a), "l"(b), "r"(ACC));                                                \
    }                                                                                          \
    template <int ACC, int TB>                                                                 \
    static __device__ __forceinline__ void rs(float (&d)[N / 8][4], const u32 (&a)[4], u64 b) { \
      static_assert(TB == 0, ".tf32 operands are K-major");                                    \
      asm volatile("{\n.reg .pred p;\n" CUFLASH_WG_RS_FLAG##R                                 \
                   "wgmma.mma_async.sync.aligned.m64n" #N "k8.f32.tf32.tf32 {"                 \
                   CUFLASH_WG_DSTR##R "}" CUFLASH_WG_RS_TAILF##R                              \
                   : CUFLASH_WG_DOPS##R(d)                                                     \
                   : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(ACC));            \
    }                                                                                          \
  };
#else
#define CUFLASH_WG_MMA_TF32(N, R) CUFLASH_WG_MMA(float, "tf32", N, R)  // (the 16-bit stubs' trap)
#endif
CUFLASH_WG_MMA_TF32(32, 16)
CUFLASH_WG_MMA_TF32(64, 32)
CUFLASH_WG_MMA_TF32(128, 64)
#undef CUFLASH_WG_MMA_TF32
#undef CUFLASH_WG_MMA

// Bytes of one k-step along a K-major row: 16 elements of 16 bits or 8 of float32 (TF32), so a
// 128-byte row of a swizzled column block holds 4 k-steps whatever T is.
template <typename T> __host__ __device__ constexpr int kstep_elems() {
  return 32 / static_cast<int>(sizeof(T));
}

// d (64 x N) = A B^T over K = 16 KSTEPS, both operands K-major 128-byte-swizzled tiles (blocks of
// 64 columns, tc::chunk_offset_swz): A's 64 rows from shared address a (1024-aligned), whose tile
// has A_BLK bytes per column block; B's N rows from b, B_BLK bytes per block. (S^T = K Q^T and
// dP^T = V dO^T.)
// ADD: d += A B^T; COMMIT = false leaves the products in the open group (float32's three TF32
// products of one S).
template <typename T, int N, int KSTEPS, u32 A_BLK, u32 B_BLK, bool ADD = false,
          bool COMMIT = true>
__device__ __forceinline__ void rows_times_rows(float (&d)[N / 8][4], u32 a, u32 b) {
  fence();
#pragma unroll
  for (int kk = 0; kk < KSTEPS; ++kk) {
    const u32 col = (kk % 4) * SW128_KSTEP_K;  // 4 k-steps per 64-column block
    const u64 da = desc_sw128(a + (kk / 4) * A_BLK + col, 0, SW128_SBO);
    const u64 db = desc_sw128(b + (kk / 4) * B_BLK + col, 0, SW128_SBO);
    if (kk == 0 && !ADD)
      Mma<T, N>::template ss<0, 0>(d, da, db);
    else
      Mma<T, N>::template ss<1, 0>(d, da, db);
  }
  if (COMMIT) commit();
}
// d (64 x N) += A B over K = 16 KSTEPS: A from registers (a[kk], mma.sync A fragments), B a
// 128-byte-swizzled tile of 16 KSTEPS rows and N columns at shared address b, read MN-major, with
// B_BLK bytes per 64-column block (the descriptor's LBO). (dV += P^T dO and dK += dS^T Q.)
// COMMIT = false leaves the products in the open group (a wider product issued in parts).
template <typename T, int N, int KSTEPS, u32 B_BLK, bool COMMIT = true>
__device__ __forceinline__ void regs_times_tile(float (&d)[N / 8][4], const u32 (&a)[KSTEPS][4],
                                                u32 b) {
  fence();
#pragma unroll
  for (int kk = 0; kk < KSTEPS; ++kk)
    Mma<T, N>::template rs<1, 1>(d, a[kk], desc_sw128(b + kk * SW128_KSTEP_MN, B_BLK, SW128_SBO));
  if (COMMIT) commit();
}
// d (64 x N) += A B over K = 16 KSTEPS: A K-major from shared memory (64 rows at a, A_BLK bytes
// per 64-column block, as rows_times_rows's), B MN-major (as regs_times_tile's, B_BLK bytes per
// 64-column block). (dK += dS^T Q with dS^T stored for dQ.)
template <typename T, int N, int KSTEPS, u32 A_BLK, u32 B_BLK>
__device__ __forceinline__ void tile_times_tile(float (&d)[N / 8][4], u32 a, u32 b) {
  fence();
#pragma unroll
  for (int kk = 0; kk < KSTEPS; ++kk) {
    const u64 da = desc_sw128(a + (kk / 4) * A_BLK + (kk % 4) * SW128_KSTEP_K, 0, SW128_SBO);
    const u64 db = desc_sw128(b + kk * SW128_KSTEP_MN, B_BLK, SW128_SBO);
    Mma<T, N>::template ss<1, 1>(d, da, db);
  }
  commit();
}
// d (64 x N) = A B (ADD: d +=) over K = 16 KSTEPS, both operands 128-byte-swizzled tiles read
// MN-major: A (64 wide) from shared address a, B (N wide, B_BLK bytes per 64-column block) from b;
// k-step kk is rows 16 kk .. 16 kk + 15 of both. (dQ = dS K with dS^T stored: rows = keys; dK +=
// dS^T Q with dS stored: rows = queries.)
template <typename T, int N, int KSTEPS, u32 B_BLK, bool ADD = false>
__device__ __forceinline__ void tile_t_times_tile(float (&d)[N / 8][4], u32 a, u32 b) {
  fence();
#pragma unroll
  for (int kk = 0; kk < KSTEPS; ++kk) {
    const u64 da = desc_sw128(a + kk * SW128_KSTEP_MN, 0, SW128_SBO);
    const u64 db = desc_sw128(b + kk * SW128_KSTEP_MN, B_BLK, SW128_SBO);
    if (kk == 0 && !ADD)
      Mma<T, N>::template ss<0, 1, 1>(d, da, db);
    else
      Mma<T, N>::template ss<1, 1, 1>(d, da, db);
  }
  commit();
}
// d (64 x N) = A B over K = 16 KSTEPS: A read MN-major (64 wide, as tile_t_times_tile's), B
// K-major (N rows at b, B_BLK bytes per 64-column block, as rows_times_rows's B). (dQ^T = K^T
// dS^T with dS stored: rows = queries.)
template <typename T, int N, int KSTEPS, u32 B_BLK>
__device__ __forceinline__ void tile_t_times_rows(float (&d)[N / 8][4], u32 a, u32 b) {
  fence();
#pragma unroll
  for (int kk = 0; kk < KSTEPS; ++kk) {
    const u64 da = desc_sw128(a + kk * SW128_KSTEP_MN, 0, SW128_SBO);
    const u64 db = desc_sw128(b + (kk / 4) * B_BLK + (kk % 4) * SW128_KSTEP_K, 0, SW128_SBO);
    if (kk == 0)
      Mma<T, N>::template ss<0, 0, 1>(d, da, db);
    else
      Mma<T, N>::template ss<1, 0, 1>(d, da, db);
  }
  commit();
}
// d (64 x N) += A B over KSTEPS k-steps: A from registers (a[kk], as regs_times_tile's), B K-major
// (N rows at b, B_BLK bytes per column block, as rows_times_rows's B). (float32's O += P V with B
// = V^T: .tf32 reads no MN-major operand.) ADD = false: d = A B.
template <typename T, int N, int KSTEPS, u32 B_BLK, bool COMMIT = true, bool ADD = true>
__device__ __forceinline__ void regs_times_rows(float (&d)[N / 8][4], const u32 (&a)[KSTEPS][4],
                                                u32 b) {
  fence();
#pragma unroll
  for (int kk = 0; kk < KSTEPS; ++kk) {
    const u64 db = desc_sw128(b + (kk / 4) * B_BLK + (kk % 4) * SW128_KSTEP_K, 0, SW128_SBO);
    if (kk == 0 && !ADD)
      Mma<T, N>::template rs<0, 0>(d, a[kk], db);
    else
      Mma<T, N>::template rs<1, 0>(d, a[kk], db);
  }
  if (COMMIT) commit();
}
// The four 8 x 8 16-bit blocks of an m16n8k16 A fragment as tc::acc_to_a packs them (x[0]: rows
// 0-7, columns 0-7; x[1]: rows 8-15, columns 0-7; x[2], x[3]: the same rows, columns 8-15) stored
// transposed: lane l gives the shared address of row l % 8 of block l / 8's transpose (16 bytes:
// the block's column l % 8).
__device__ __forceinline__ void stsm_x4_t(u32 addr, const u32 (&x)[4]) {
  CUFLASH_SM90A_ASM("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};"
                    ::"r"(addr), "r"(x[0]), "r"(x[1]), "r"(x[2]), "r"(x[3]) : "memory");
}
}  // namespace wg
