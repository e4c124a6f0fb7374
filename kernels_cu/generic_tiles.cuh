// generic_tiles.cuh: the block geometry, shared-memory carve and register-tile products of the
// CUDA-core (SIMT) kernels, fwd_generic.cu and bwd_generic.cu. A thread owns rows
// group + ROW_GROUPS * r (r < ROWS) and columns lane + LANES_PER_ROW * c (c < COLS) of an
// accumulator tile, group = threadIdx.x / LANES_PER_ROW and lane = threadIdx.x % LANES_PER_ROW;
// rows are queries or keys, whichever the block owns. Operands are Acc in padded shared memory;
// every sum runs over d in order.
#pragma once
#include "common.cuh"
#include "mask.cuh"

// A generic kernel's block tile: BLOCK_ROWS rows (queries; keys in bwd_dkdv) of HEAD_DIM columns,
// against tiles of BLOCK_OTHER rows of the other side.
template <int HEAD_DIM, int BLOCK_ROWS, int BLOCK_OTHER>
struct GenericTile {
  static_assert(BLOCK_ROWS % ROW_GROUPS == 0 && BLOCK_OTHER % LANES_PER_ROW == 0, "tile shape");
  static_assert(HEAD_DIM % LANES_PER_ROW == 0, "head-dim bucket");
  static constexpr int ROWS = BLOCK_ROWS / ROW_GROUPS;        // block rows per thread
  static constexpr int OTHER = BLOCK_OTHER / LANES_PER_ROW;   // other-side rows per thread per tile
  static constexpr int COLS = HEAD_DIM / LANES_PER_ROW;       // head-dim columns per thread
  static constexpr int LD = HEAD_DIM + 1;                     // padded shared row (Q, K, V, dO)
  static constexpr int LDP = BLOCK_OTHER + 1;                 // padded shared row (P, dS)
};

// The exclusive end of the tile of `size` rows from r0: cut at n, or after the last row of the
// visible range r that the loop walks.
__device__ __forceinline__ long long tile_end(long long r0, int size, long long n) {
  return (r0 + size < n) ? r0 + size : n;
}
__device__ __forceinline__ long long tile_end(long long r0, int size, const KeyRange& r) {
  return (r0 + size <= r.hi) ? r0 + size : r.hi + 1;
}

// Points each `Acc*& array` at consecutive Acc arrays of dynamic shared memory of the element
// counts given after them, in order: the layout cuflash/_generic.py smem_bytes adds up.
template <typename Acc, typename... Arrays>
__device__ __forceinline__ void shared_arrays(Arrays&&... arrays) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  carve_shared(reinterpret_cast<Acc*>(smem_raw), arrays...);
}

// acc = 0.
template <typename Acc, int ROWS, int COLS>
__device__ __forceinline__ void tile_zero(Acc (&acc)[ROWS][COLS]) {
#pragma unroll
  for (int r = 0; r < ROWS; ++r)
#pragma unroll
    for (int c = 0; c < COLS; ++c) acc[r][c] = Acc(0);
}

// acc[r][c] += sum_{d < n} A[row r][d] * B(d, column c), in d order. A is row-major with row
// stride LDA; B(d, c) = B[c * B_COL + d * B_K]. UNROLL is the d loop's unroll factor.
template <int UNROLL, int LDA, int B_COL, int B_K, typename Acc, int ROWS, int COLS>
__device__ __forceinline__ void tile_mac(Acc (&acc)[ROWS][COLS], const Acc* A, const Acc* B,
                                         int n) {
  const int group = threadIdx.x / LANES_PER_ROW;
  const int lane = threadIdx.x % LANES_PER_ROW;
#pragma unroll UNROLL
  for (int d = 0; d < n; ++d) {
    Acc b[COLS];
#pragma unroll
    for (int c = 0; c < COLS; ++c) b[c] = B[(lane + LANES_PER_ROW * c) * B_COL + d * B_K];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      const Acc a = A[(group + ROW_GROUPS * r) * LDA + d];
#pragma unroll
      for (int c = 0; c < COLS; ++c) acc[r][c] += a * b[c];
    }
  }
}

// acc = A B^T over n columns (S = Q K^T, dP = dO V^T, and their transposes in bwd_dkdv): both
// operands row-major with row stride LD; the thread's rows come from A, its columns from B's rows.
template <int UNROLL, int LD, typename Acc, int ROWS, int COLS>
__device__ __forceinline__ void tile_abt(Acc (&acc)[ROWS][COLS], const Acc* A, const Acc* B,
                                         int n) {
  tile_zero(acc);
  tile_mac<UNROLL, LD, LD, 1>(acc, A, B, n);
}

// acc += A B over n rows of B (O += P V, dQ += dS K): A row-major with stride LDA, B with LDB.
template <int UNROLL, int LDA, int LDB, typename Acc, int ROWS, int COLS>
__device__ __forceinline__ void tile_mac_ab(Acc (&acc)[ROWS][COLS], const Acc* A, const Acc* B,
                                            int n) {
  tile_mac<UNROLL, LDA, 1, LDB>(acc, A, B, n);
}
