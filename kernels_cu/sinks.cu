// sinks.cu: attention sinks (cuflash/_sinks.py) on contiguous rows of Dv elements, one warp a row:
// the join of a sink-free (out, lse) with each row's sink (sinks.cuh's rule, after the paths whose
// kernels do not take sinks: generic, decode), and rowsum(dout * out) for the sink's gradient.
// Both are one pass over out; their double arithmetic runs once a row.
#include "common.cuh"
#include "sinks.cuh"

// out (rows, dv) *= f of its row, lse1[row] = L; sinks: one per nq rows (per (batch, head)).
template <typename T, typename X>
__global__ void sink_join_rows(T* __restrict__ out, const X* __restrict__ lse0,
                               X* __restrict__ lse1, const double* __restrict__ sinks,
                               long long rows, int nq, int dv) {
  const long long row = static_cast<long long>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  if (row >= rows) return;
  const int lane = threadIdx.x % 32;
  double f, L;
  sink_join(static_cast<double>(lse0[row]), sinks[row / nq], f, L);
  T* o = out + row * dv;
  for (int c = lane; c < dv; c += 32) store_acc(o + c, to_acc(o[c]) * f);
  if (lane == 0) lse1[row] = static_cast<X>(L);
}

// delta[row] = sum over the row's dv columns of dout * out, in double.
template <typename T>
__global__ void sink_row_dot(const T* __restrict__ dout, const T* __restrict__ out,
                             double* __restrict__ delta, long long rows, int dv) {
  const long long row = static_cast<long long>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  if (row >= rows) return;
  const int lane = threadIdx.x % 32;
  double sum = 0.0;
  for (int c = lane; c < dv; c += 32)
    sum += static_cast<double>(to_acc(dout[row * dv + c])) * to_acc(out[row * dv + c]);
#pragma unroll
  for (int off = 16; off > 0; off /= 2) sum += __shfl_xor_sync(FULL_WARP, sum, off);
  if (lane == 0) delta[row] = sum;
}
