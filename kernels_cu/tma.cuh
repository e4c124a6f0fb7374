// tma.cuh: Hopper's asynchronous data movement for the warp-specialized kernels (sm_90a): tensor
// maps, bulk tensor copies (TMA) completing on shared-memory mbarriers, named barriers and the
// register reallocation between producer and consumer warpgroups. No kernels.
//
// A tensor map (CUtensorMap, 128 bytes) is made on the host (cuflash/_tma.py) and passed BY VALUE
// as a `const __grid_constant__ TmaMap` parameter; the copy instructions take its generic address.
// The maps here are 4-D, innermost first: (column, row, head, batch), box (64 columns, ROWS rows,
// 1, 1), 128-byte swizzle: a box lands as ROWS rows of 128 bytes, 16-byte chunk c of row r at chunk
// c ^ (r % 8), which is wgmma.cuh's K-major / MN-major swizzled layout (destination 1024-aligned).
// Elements outside the tensor (rows past its end, negative rows) arrive as zeros.
//
// mbarrier protocol (one phase per use of a ring slot, parity = use count & 1):
//   full  barrier: count 1, the producer's arrive.expect_tx(bytes) + the copies' complete_tx;
//   empty barrier: count = consumer threads, each arrives once it no longer reads the slot.
// The producer waits on an empty barrier with the parity of the phase before (a fresh barrier's
// "previous phase" counts as complete, so the first pass over the ring does not wait).
#pragma once
#include "mma.cuh"

struct __align__(64) TmaMap {
  unsigned long long v[16];
};

namespace tma {
using tc::u32;

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define CUFLASH_TMA 1
#else
#define CUFLASH_TMA 0
#endif

__device__ __forceinline__ void mbar_init(u32 bar, u32 count) {
#if CUFLASH_TMA
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
#endif
}
// Makes the initialized barriers visible to the copy engine; a block barrier follows.
__device__ __forceinline__ void mbar_init_fence() {
#if CUFLASH_TMA
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
#endif
}
__device__ __forceinline__ void arrive_expect_tx(u32 bar, u32 bytes) {
#if CUFLASH_TMA
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes)
               : "memory");
#endif
}
__device__ __forceinline__ void arrive(u32 bar) {
#if CUFLASH_TMA
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
#endif
}
// Returns once the phase of parity `parity` of the barrier has completed.
__device__ __forceinline__ void wait(u32 bar, u32 parity) {
#if CUFLASH_TMA
  u32 done;
  do {
    asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
                 "selp.u32 %0, 1, 0, p;\n}\n"
                 : "=r"(done) : "r"(bar), "r"(parity) : "memory");
  } while (!done);
#endif
}

// One box of a 4-D tensor map into shared memory at dst, completing on barrier bar.
__device__ __forceinline__ void load_4d(u32 dst, const TmaMap& map, int c0, int c1, int c2, int c3,
                                        u32 bar) {
#if CUFLASH_TMA
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3, %4, %5}], [%6];"
      ::"r"(dst), "l"(reinterpret_cast<unsigned long long>(&map)), "r"(c0), "r"(c1), "r"(c2),
        "r"(c3), "r"(bar)
      : "memory");
#endif
}
__device__ __forceinline__ void prefetch_map(const TmaMap& map) {
#if CUFLASH_TMA
  asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<unsigned long long>(&map))
               : "memory");
#endif
}

// A barrier among `threads` threads (a multiple of 32) of the block, id 1..15 (0 is
// __syncthreads).
__device__ __forceinline__ void named_sync(u32 id, u32 threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_arrive(u32 id, u32 threads) {
  asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(threads) : "memory");
}
// named_sync that also returns whether any of the `threads` threads passed x = true.
__device__ __forceinline__ bool named_sync_or(u32 id, u32 threads, bool x) {
  u32 any;
  asm volatile(
      "{\n .reg .pred in, out;\n setp.ne.u32 in, %1, 0;\n"
      " bar.red.or.pred out, %2, %3, in;\n selp.u32 %0, 1, 0, out;\n}"
      : "=r"(any) : "r"(static_cast<u32>(x)), "r"(id), "r"(threads) : "memory");
  return any != 0;
}

// Register reallocation of the executing warpgroup (needs a register cap at entry:
// __launch_bounds__(threads, 1)).
template <u32 N> __device__ __forceinline__ void regs_dec() {
#if CUFLASH_TMA
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(N));
#endif
}
template <u32 N> __device__ __forceinline__ void regs_inc() {
#if CUFLASH_TMA
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(N));
#endif
}
}  // namespace tma
