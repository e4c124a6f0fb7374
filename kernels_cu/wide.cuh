// wide.cuh: the two products every wide-dtype tensor-core kernel (fwd_wide.cu, bwd_wide.cu) is
// made of, on mma.cuh's WideMma (m16n8k8; float32 on TF32, float64 on DMMA). No kernels.
//
//   rows_times_rows   C  = A B^T: A and B both row-major tiles in shared memory (Q K^T, dO V^T,
//                     K Q^T, V dO^T): the lane reads pairs (row g, columns 2t, 2t + 1) of both
//   acc_times_rows    C += P B:   P this lane's accumulators of an earlier product (P, dS, their
//                     transposes: WideMma's k order makes them A fragments as they are), B a
//                     row-major tile read by column (rows 2t, 2t + 1, column g): P V, dS K, P^T dO,
//                     dS^T Q
//
// Both load each B fragment a few steps ahead of its product, the load waiting (`after`) for an
// earlier product on the accumulator it feeds: ptxas would otherwise hoist every load of the loop
// to its top, and the operands (split into TF32 hi / lo parts) would not fit in registers.
//
// Rounding (float32, three passes): the tensor cores round each sum toward zero, so a chain of
// many products on one accumulator collects a bias (WideMma::ROUNDS_TOWARD_ZERO). rows_times_rows
// chains at most G k-steps and adds the groups in float32; acc_times_rows sums each call's product
// apart and hands it to the caller's `combine` (which adds it to the running accumulator, or
// rescales and adds in the forward).
#pragma once
#include "common.cuh"
#include "mma.cuh"

namespace wide {
using tc::u32;
using tc::for_each_entry;
using tc::zero;

// k-steps per rounding group of rows_times_rows (all of them where rounding is to nearest): at
// least two groups, of at most 8. One group of 8 k-steps measured about 3x a naive float32
// product's largest error (dbias at D = 64); two, in tools/tf32_rounding.py's emulation, within
// 2x it at D = 32 ... 128; groups of 4 spilled the D = 128 dK/dV kernel (a group's sum lives
// beside the result).
template <typename Tc, int KD>
__host__ __device__ constexpr int group_steps() {
  return !Tc::ROUNDS_TOWARD_ZERO     ? KD
         : KD % 2 == 0 && KD / 2 <= 8 ? KD / 2
         : KD % 8 == 0                ? 8
         : KD % 6 == 0                ? 6
         : KD % 4 == 0                ? 4
         : KD % 2 == 0                ? 2
                                      : 1;
}

// s = A B^T over KD k-steps of 8 columns. A: this lane's MF m-fragments, a_lane the address of row
// g, column 2t of the first (fragments 16 rows apart, rows PITCH_A elements); B: NF fragments of 8
// rows, b_lane the address of row g, column 2t of the first. Step i = (k-step i / NF, fragment
// i % NF); B's fragment of step i + PK is loaded at step i, A's of the next k-step halfway
// through this one.
template <typename T, int PASSES, int MF, int NF, int KD, int PITCH_A, int PITCH_B>
__device__ __forceinline__ void rows_times_rows(T (&s)[MF][NF][4], u32 a_lane, u32 b_lane) {
  using Tc = tc::WideMma<T, PASSES>;
  using tc::after;
  constexpr u32 E = sizeof(T);
  constexpr int G = group_steps<Tc, KD>();
  static_assert(KD % G == 0, "rows_times_rows: every group ends in s");
  constexpr int PK = NF / 2;
  T c[MF][NF][4];
  zero(c);
  T ar[MF][4], br[PK > 0 ? PK : 1][2];
  auto load_a = [&](int kk, u32 dep) {
#pragma unroll
    for (int mf = 0; mf < MF; ++mf) {  // (row g, 2t), (g, 2t + 1), (g + 8, 2t), (g + 8, 2t + 1)
      const u32 addr = a_lane + (mf * 16 * PITCH_A + kk * 8) * E + dep;
      tc::ld_shared_pair(addr, ar[mf][0], ar[mf][2]);
      tc::ld_shared_pair(addr + 8 * PITCH_A * E, ar[mf][1], ar[mf][3]);
    }
  };
  auto load_b = [&](int i, T(&r)[2], u32 dep) {
    tc::ld_shared_pair(b_lane + ((i % NF) * 8 * PITCH_B + (i / NF) * 8) * E + dep, r[0], r[1]);
  };
  load_a(0, 0);
#pragma unroll
  for (int i = 0; i < PK; ++i) load_b(i, br[i], 0);
  typename Tc::A a[MF];
#pragma unroll
  for (int i = 0; i < KD * NF; ++i) {
    const int kk = i / NF, nf = i % NF;
    if (nf == 0) {
#pragma unroll
      for (int mf = 0; mf < MF; ++mf) a[mf] = Tc::make_a(ar[mf][0], ar[mf][1], ar[mf][2], ar[mf][3]);
    }
    if (nf == NF / 2 && kk + 1 < KD) load_a(kk + 1, after(c[MF - 1][NF - 1][0]));
    T bc[2];
    if (PK > 0) {
      constexpr int SLOTS = PK > 0 ? PK : 1;
      bc[0] = br[i % SLOTS][0];
      bc[1] = br[i % SLOTS][1];
      if (i + PK < KD * NF) load_b(i + PK, br[i % SLOTS], after(c[0][(i + PK) % NF][0]));
    } else {
      load_b(i, bc, after(c[0][nf][0]));
    }
    const typename Tc::B b = Tc::make_b(bc[0], bc[1]);
#pragma unroll
    for (int mf = 0; mf < MF; ++mf) Tc::run(c[mf][nf], a[mf], b);
    if (nf == NF - 1 && (kk + 1) % G == 0) {  // the end of a rounding group: into s
      for_each_entry(s, [&](T& x, int mf, int f, int e) {
        x = kk + 1 == G ? c[mf][f][e] : x + c[mf][f][e];
        if (kk + 1 < KD) c[mf][f][e] = T(0);
      });
    }
  }
}

// acc (MF x DF fragments) += P B. P: MF x NK accumulator fragments (k = 8 NK columns), B: 8 NK
// rows of 8 DF columns, b_lane the address of row 2t, column g. Rounding to nearest: straight into
// acc. Toward zero: the product of DG output fragments at a time in a fresh o, then
// combine(acc[mf][df], o[mf][d], mf) (DF % DG == 0). The loads of step i = (k-step, fragment) of
// a group run PB steps ahead; the group's first ones wait on `dep` (the softmax, in the forward).
template <typename T, int PASSES, int MF, int NK, int DF, int DG, int PITCH_B, typename Combine>
__device__ __forceinline__ void acc_times_rows(T (&acc)[MF][DF][4], const T (&p)[MF][NK][4],
                                               u32 b_lane, u32 dep, Combine combine) {
  using Tc = tc::WideMma<T, PASSES>;
  using tc::after;
  constexpr u32 E = sizeof(T);
  constexpr bool FRESH = Tc::ROUNDS_TOWARD_ZERO;
  constexpr int W = FRESH ? DG : DF;  // output fragments per pass over P
  constexpr int PB = W / 2 > 0 ? W / 2 : 1;
  static_assert(DF % W == 0, "acc_times_rows: DF % DG");
#pragma unroll
  for (int d0 = 0; d0 < DF; d0 += W) {
    T o[FRESH ? MF : 1][FRESH ? W : 1][4];
    if (FRESH) zero(o);
    auto dst = [&](int mf, int d) -> T(&)[4] {
      return FRESH ? o[FRESH ? mf : 0][FRESH ? d : 0] : acc[mf][d0 + d];
    };
    auto load_b = [&](int i, T(&r)[2], u32 dp) {
      const u32 addr = b_lane + ((i / W) * 8 * PITCH_B + (d0 + i % W) * 8) * E + dp;
      tc::ld_shared_one(addr, r[0]);
      tc::ld_shared_one(addr + PITCH_B * E, r[1]);
    };
    T br[PB][2];
#pragma unroll
    for (int i = 0; i < PB; ++i) load_b(i, br[i], dep);
    typename Tc::A a[MF];
#pragma unroll
    for (int i = 0; i < NK * W; ++i) {
      const int kk = i / W, d = i % W;
      if (d == 0) {
#pragma unroll
        for (int mf = 0; mf < MF; ++mf)
          a[mf] = Tc::make_a(p[mf][kk][0], p[mf][kk][2], p[mf][kk][1], p[mf][kk][3]);
      }
      T bc[2] = {br[i % PB][0], br[i % PB][1]};
      if (i + PB < NK * W) {
        const int j = i + PB;
        load_b(j, br[i % PB], j < W ? dep : after(dst(0, j % W)[0]));
      }
      const typename Tc::B b = Tc::make_b(bc[0], bc[1]);
#pragma unroll
      for (int mf = 0; mf < MF; ++mf) Tc::run(dst(mf, d), a[mf], b);
    }
    if (FRESH) {
#pragma unroll
      for (int mf = 0; mf < MF; ++mf)
#pragma unroll
        for (int d = 0; d < W; ++d) combine(acc[mf][d0 + d], o[FRESH ? mf : 0][FRESH ? d : 0], mf);
    }
  }
}

}  // namespace wide
