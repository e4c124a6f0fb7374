// philox.cuh: dropout, the one home of its random bits and of what a kernel does with them
// (DESIGN.md "Dropout"). Mirrored bit for bit by cuflash/_dropout.py (the NumPy path and the
// reference draw the same mask).
//
// The keep bit of element (bh, i, j) of a call (bh: the output's flat (batch, head) index, i the
// query row, j the key, both in the head's own indices) is a pure function of the call's
// (seed, offset) and of that position, so it does not depend on tiles, path or device:
//   (r0, r1, r2, r3) = Philox4x32-10(counter = (j >> 2, i, bh, offset),
//                                    key = (seed & 0xffffffff, seed >> 32))
//   keep(bh, i, j)   = r[j & 3] >= threshold,   threshold = floor(dropout_p * 2^32)
// (one Philox call per 4 consecutive keys of a row, word j & 3 for key j). A kept weight is
// scaled by rscale = 1 / (1 - dropout_p); the softmax's l and lse stay the undropped ones.
//
// Kernels take dropout as a trailing parameter pack `const Drop... drop` (empty: no dropout, and
// then no parameter and no code: the default instantiations are unchanged), made into the per-head
// object by dropout_at<Acc>(bh, drop...): NoDropout, or Dropout<Acc>, whose
//   ON                      says whether there is any work;
//   keep(i, j)              the element's keep bit;
//   (p, i, j)               p where kept, 0 where dropped (the P of P V and of dV = P^T dO);
//   scaled(x)               x * rscale, rscale = 1 / (1 - dropout_p) in Acc (x without dropout),
//                           which a kernel applies once per output (out, dV) and to the kept dP
//                           (the backward's dS = P (Z dP rscale - D));
//   keep2(i, j, k0, k1)     the bits of keys j and j + 1 (one Philox call when j is even).
// The tensor-core kernels apply it on their mma.sync fragments: drop_rows (rows = queries:
// fwd_mma, fwd_wgmma, and bwd_mma_dq's dP with SCALED) and dropped_keys (rows = keys:
// bwd_mma_dkdv's bit mask).
#pragma once
#include "common.cuh"

constexpr unsigned PHILOX_M0 = 0xD2511F53u, PHILOX_M1 = 0xCD9E8D57u;  // Random123's multipliers
constexpr unsigned PHILOX_W0 = 0x9E3779B9u, PHILOX_W1 = 0xBB67AE85u;  // its key increments
constexpr int PHILOX_ROUNDS = 10;

struct Philox4 {
  unsigned x, y, z, w;
};

// Philox4x32-10 (Salmon et al., SC'11; Random123's philox4x32_R with R = 10): counter c, key (k0, k1).
__device__ __forceinline__ Philox4 philox4x32_10(Philox4 c, unsigned k0, unsigned k1) {
#pragma unroll
  for (int r = 0; r < PHILOX_ROUNDS; ++r) {
    if (r > 0) {  // the key bumps between rounds
      k0 += PHILOX_W0;
      k1 += PHILOX_W1;
    }
    const unsigned hi0 = __umulhi(PHILOX_M0, c.x), lo0 = PHILOX_M0 * c.x;
    const unsigned hi1 = __umulhi(PHILOX_M1, c.z), lo1 = PHILOX_M1 * c.z;
    c = Philox4{hi1 ^ c.y ^ k0, lo1, hi0 ^ c.w ^ k1, lo0};
  }
  return c;
}

// The host's DropoutArgs (cuflash/_runtime.py DROPOUT_FIELDS), passed by value.
struct DropoutArgs {
  unsigned long long seed;
  unsigned offset;     // the counter's last word
  unsigned threshold;  // floor(dropout_p * 2^32): a word below it drops its key
  double rscale;       // 1 / (1 - dropout_p), rounded to Acc by the kernel
};

struct NoDropout {
  static constexpr bool ON = false;
  template <typename Acc>
  __device__ __forceinline__ Acc operator()(Acc p, long long, long long) const { return p; }
  __device__ __forceinline__ bool keep(long long, long long) const { return true; }
  __device__ __forceinline__ void keep2(long long, long long, bool& k0, bool& k1) const {
    k0 = k1 = true;
  }
  template <typename Acc>
  __device__ __forceinline__ Acc scaled(Acc x) const { return x; }
};

template <typename Acc>
struct Dropout {
  static constexpr bool ON = true;
  unsigned key0, key1, bh, offset, threshold;
  Acc rscale;

  __device__ __forceinline__ bool keep(long long i, long long j) const {
    const Philox4 r = philox4x32_10(
        Philox4{static_cast<unsigned>(j >> 2), static_cast<unsigned>(i), bh, offset}, key0, key1);
    const unsigned lane = static_cast<unsigned>(j) & 3u;
    const unsigned word = lane & 2u ? (lane & 1u ? r.w : r.z) : (lane & 1u ? r.y : r.x);
    return word >= threshold;
  }
  // The keep bits of keys j and j + 1 of query i: one Philox call when j is even (both in one
  // group of 4; the tensor-core kernels' fragment pairs, whose parity is warp-uniform), else two.
  __device__ __forceinline__ void keep2(long long i, long long j, bool& k0, bool& k1) const {
    if ((j & 1) == 0) {
      const Philox4 r = philox4x32_10(
          Philox4{static_cast<unsigned>(j >> 2), static_cast<unsigned>(i), bh, offset}, key0,
          key1);
      const bool upper = (j & 2) != 0;
      k0 = (upper ? r.z : r.x) >= threshold;
      k1 = (upper ? r.w : r.y) >= threshold;
    } else {
      k0 = keep(i, j);
      k1 = keep(i, j + 1);
    }
  }
  __device__ __forceinline__ Acc operator()(Acc p, long long i, long long j) const {
    return p != Acc(0) && !keep(i, j) ? Acc(0) : p;  // (no bits drawn where p is 0)
  }
  __device__ __forceinline__ Acc scaled(Acc x) const { return x * rscale; }
};

// Dropout on this lane's part of an mma.sync m16n8 accumulator tile in the rows = queries
// orientation (attn_core.cuh mask_rows'): s[nf][2 h + e] is query i + 8 h, key j0 + 8 nf + 2 t + e
// (t = lane % 4); a dropped entry becomes 0, a kept one stays (SCALED: times rscale, the
// backward's dP). No code without dropout.
template <bool SCALED = false, int NF, typename Acc, typename D>
__device__ __forceinline__ void drop_rows(Acc (&s)[NF][4], const D& dz, int i, int j0, int t) {
  if constexpr (D::ON) {
#pragma unroll
    for (int nf = 0; nf < NF; ++nf)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        bool k0, k1;
        dz.keep2(i + 8 * h, static_cast<long long>(j0) + nf * 8 + 2 * t, k0, k1);
        const Acc x0 = SCALED ? dz.scaled(s[nf][2 * h]) : s[nf][2 * h];
        const Acc x1 = SCALED ? dz.scaled(s[nf][2 * h + 1]) : s[nf][2 * h + 1];
        s[nf][2 * h] = k0 ? x0 : Acc(0);
        s[nf][2 * h + 1] = k1 ? x1 : Acc(0);
      }
  }
}

// The dK / dV orientation (attn_core.cuh mask_key_rows'): entry k of a thread's fragment nf is
// key j + 8 (k / 2), query i0 + 8 nf + 2 t + k % 2. Bit 4 nf + k of the result: that entry is
// dropped; 0 without dropout. (Drawn before the tile's products, where fewer registers are live:
// after them the D=128 mask / bias tile spilled.)
template <int NF, typename D>
__device__ __forceinline__ unsigned long long dropped_keys(const D& dz, int j, int i0, int t) {
  static_assert(NF * 4 <= 64, "one bit per entry");
  unsigned long long bits = 0ull;
  if constexpr (D::ON) {
#pragma unroll
    for (int nf = 0; nf < NF; ++nf)
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const bool drop = !dz.keep(i0 + nf * 8 + 2 * t + k % 2, j + 8 * (k / 2));
        bits |= static_cast<unsigned long long>(drop) << (4 * nf + k);
      }
  }
  return bits;
}

// Head bh's dropout from a kernel's trailing pack: none, or one DropoutArgs.
template <typename Acc>
__device__ __forceinline__ NoDropout dropout_at(long long) {
  return NoDropout();
}
template <typename Acc>
__device__ __forceinline__ Dropout<Acc> dropout_at(long long bh, const DropoutArgs& a) {
  Dropout<Acc> d;
  d.key0 = static_cast<unsigned>(a.seed);
  d.key1 = static_cast<unsigned>(a.seed >> 32);
  d.bh = static_cast<unsigned>(bh);
  d.offset = a.offset;
  d.threshold = a.threshold;
  d.rscale = static_cast<Acc>(a.rscale);
  return d;
}
