// mask_tiles.cu: the classes of mask_tiles.cuh, one per block: the mask bytes of query rows
// [qt BLOCK_M, +BLOCK_M) (of `rows`) and keys [c BLOCK_N, +BLOCK_N) (of Nk) of mask matrix z
// (batch z / heads, head z % heads), 16 bytes at a time (the host passes only masks whose base and
// strides are 16-byte aligned), the keys of a last group short of 16 one by one.
#include "mask_tiles.cuh"

template <int BLOCK_M, int BLOCK_N>
__global__ void __launch_bounds__(128, 1)
mask_tile_classes(const unsigned char* __restrict__ mask, long long rs, long long sh,
                  long long sb, int rows, int Nk, int heads, unsigned char* __restrict__ cls) {
  constexpr int GROUPS = BLOCK_N / 16;  // 16-byte groups of a chunk row
  static_assert(BLOCK_N % 16 == 0, "whole 16-byte groups");
  const int c0 = blockIdx.x * BLOCK_N, r0 = blockIdx.y * BLOCK_M;
  const int n_rows = min(BLOCK_M, rows - r0), n_keys = min(BLOCK_N, Nk - c0);
  const unsigned char* m = mask + (blockIdx.z / heads) * sb + (blockIdx.z % heads) * sh +
                           r0 * rs + c0;
  bool any = false, all = true;
  for (int idx = threadIdx.x; idx < n_rows * GROUPS; idx += 128) {
    const int r = idx / GROUPS, c = 16 * (idx % GROUPS);
    if (c + 16 <= n_keys) {
      const uint4 w = *reinterpret_cast<const uint4*>(m + r * rs + c);
      any |= (w.x | w.y | w.z | w.w) != 0u;
      // no zero byte among the 16 keys
      all &= (__vcmpeq4(w.x, 0u) | __vcmpeq4(w.y, 0u) | __vcmpeq4(w.z, 0u) |
              __vcmpeq4(w.w, 0u)) == 0u;
    } else {
      for (int j = c; j < n_keys; ++j) {
        const bool shown = m[r * rs + j] != 0;
        any |= shown;
        all &= shown;
      }
    }
  }
  any = __syncthreads_or(any);
  all = __syncthreads_and(all);
  if (threadIdx.x == 0)
    cls[(static_cast<long long>(blockIdx.z) * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x] =
        !any ? TILE_HIDDEN : all ? TILE_VISIBLE : TILE_MIXED;
}
