// philox.cuh: dropout, the one home of its random bits and of what a kernel does with them
// (DESIGN.md "Dropout"). Mirrored bit for bit by cuflash/_dropout.py (the NumPy path and the
// reference draw the same mask).
//
// The keep bit of element (bh, i, j) of a call (bh: the output's flat (batch, head) index, i the
// query row, j the key, both in the head's own indices) is a pure function of the call's
// (seed, offset) and of that position, so it does not depend on tiles, path or device:
//   (r0, r1, r2, r3) = Philox4x32-7(counter = (j >> 4, i, bh, offset),
//                                    key = (seed & 0xffffffff, seed >> 32))
//   keep(bh, i, j)   = byte j & 15 of the call's 16 (byte j & 3 of word r[(j >> 2) & 3], the low
//                      byte first) >= threshold,   threshold = round(dropout_p * 256)
// One call gives 16 consecutive keys of a row. The rows = queries kernels (drop_rows) draw one
// call per row and 16 keys, lane t of a quad the t-th block of 16, and hand each lane its keys
// (8 n + 2 t + {0, 1} in the mma / wgmma accumulator layout) through quad shuffles; the rows = keys
// kernel (dropped_keys), whose warps hold 16 keys by 8 queries per fragment, draws one call per
// query and shares it over the warp the same way. A kept weight is scaled by
// rscale = 256 / (256 - threshold) (the estimate stays unbiased at dropout_p's granularity 1/256);
// the softmax's l and lse stay the undropped ones.
//
// Kernels take dropout as a trailing parameter pack `const Drop... drop` (empty: no dropout, and
// then no parameter and no code: the default instantiations are unchanged), made into the per-head
// object by dropout_at<Acc>(bh, drop...): NoDropout, or Dropout<Acc>, whose
//   ON                      says whether there is any work;
//   keep(i, j)              the element's keep bit (one call; the generic and lost-row kernels);
//   kept16(i, blk)          the keep bits of keys 16 blk + b of row i (bit b);
//   (p, i, j)               p where kept, 0 where dropped (the P of P V and of dV = P^T dO);
//   scaled(x)               x * rscale in Acc (x without dropout), which a kernel applies once per
//                           output (out, dV) and to the kept dP (the backward's dS =
//                           P (Z dP rscale - D)).
// The tensor-core kernels apply it on their mma.sync fragments: drop_rows (rows = queries:
// fwd_mma, fwd_wgmma, and bwd_mma_dq's dP with SCALED) and dropped_keys (rows = keys:
// bwd_mma_dkdv's bit mask).
#pragma once
#include "common.cuh"

constexpr unsigned PHILOX_M0 = 0xD2511F53u, PHILOX_M1 = 0xCD9E8D57u;  // Random123's multipliers
constexpr unsigned PHILOX_W0 = 0x9E3779B9u, PHILOX_W1 = 0xBB67AE85u;  // its key increments
// 7 rounds, as FlashAttention 2's dropout draws (Salmon et al. report Philox4x32 Crush-resistant
// from 7 rounds; Random123's default of 10 is a safety margin): 30 % fewer of Philox's
// instructions, a 2-4 % faster forward with dropout (benchmarks/RESULTS.md).
constexpr int PHILOX_ROUNDS = 7;

struct Philox4 {
  unsigned x, y, z, w;
};

// Philox4x32-R (Salmon et al., SC'11; Random123's philox4x32_R), R = PHILOX_ROUNDS: counter c,
// key (k0, k1).
__device__ __forceinline__ Philox4 philox4x32(Philox4 c, unsigned k0, unsigned k1) {
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
  unsigned threshold;  // round(dropout_p * 256), 0..255: a byte below it drops its key
  double rscale;       // 256 / (256 - threshold), rounded to Acc by the kernel
};

struct NoDropout {
  static constexpr bool ON = false;
  template <typename Acc>
  __device__ __forceinline__ Acc operator()(Acc p, long long, long long) const { return p; }
  __device__ __forceinline__ bool keep(long long, long long) const { return true; }
  template <typename Acc>
  __device__ __forceinline__ Acc scaled(Acc x) const { return x; }
};

// Bits 0..3: which of the four bytes of w are >= the threshold t (t2: 256 - t in both halves):
// byte + 256 - t carries into bit 8 of its 16-bit lane exactly where byte >= t (bytes 0, 2 in
// the even lanes, 1, 3 in the odd), and the carries fold into bits 0..3.
__device__ __forceinline__ unsigned kept4(unsigned w, unsigned t2) {
  const unsigned even = (w & 0x00ff00ffu) + t2, odd = ((w >> 8) & 0x00ff00ffu) + t2;
  const unsigned x = ((even >> 8) & 0x00010001u) | ((odd >> 7) & 0x00020002u);  // bits 0,1,16,17
  return (x | (x >> 14)) & 0xfu;
}

template <typename Acc>
struct Dropout {
  static constexpr bool ON = true;
  unsigned key0, key1, bh, offset, threshold, t2;  // t2: 256 - threshold in each 16-bit half
  Acc rscale;

  // The call of keys 16 blk .. 16 blk + 15 of row i.
  __device__ __forceinline__ Philox4 call(long long i, unsigned blk) const {
    return philox4x32(Philox4{blk, static_cast<unsigned>(i), bh, offset}, key0, key1);
  }
  __device__ __forceinline__ bool keep(long long i, long long j) const {
    const Philox4 r = call(i, static_cast<unsigned>(j >> 4));
    const unsigned w = static_cast<unsigned>(j >> 2) & 3u;
    const unsigned word = w & 2u ? (w & 1u ? r.w : r.z) : (w & 1u ? r.y : r.x);
    return ((word >> (8u * (static_cast<unsigned>(j) & 3u))) & 0xffu) >= threshold;
  }
  // The keep bits of keys 16 blk + b of row i: bit b.
  __device__ __forceinline__ unsigned kept16(long long i, unsigned blk) const {
    const Philox4 r = call(i, blk);
    return kept4(r.x, t2) | kept4(r.y, t2) << 4 | kept4(r.z, t2) << 8 | kept4(r.w, t2) << 12;
  }
  __device__ __forceinline__ Acc operator()(Acc p, long long i, long long j) const {
    return p != Acc(0) && !keep(i, j) ? Acc(0) : p;  // (no bits drawn where p is 0)
  }
  __device__ __forceinline__ Acc scaled(Acc x) const { return x * rscale; }
};

// Dropout on this lane's part of an mma.sync m16n8 accumulator tile in the rows = queries
// orientation (attn_core.cuh mask_rows'): s[nf][2 h + e] is query i + 8 h, key j0 + 8 nf + 2 t + e
// (t = lane % 4); a dropped entry becomes 0, a kept one stays (SCALED: times rscale, the
// backward's dP). No code without dropout. With j0 a multiple of 16 (all but a window's tiles and
// a forward's unaligned first one), lane t of a quad draws 16-key block 4 c + t of the tile for
// both rows (past the tile where it has fewer than 4 c + 4 blocks: unused) and the quad shares
// them by shuffles (bits 2 t + e and 8 + 2 t + e of a block are the lane's keys of fragments 2 b
// and 2 b + 1); else one call per element (a loop). The whole warp calls it.
template <bool SCALED = false, int NF, typename Acc, typename D>
__device__ __forceinline__ void drop_rows(Acc (&s)[NF][4], const D& dz, int i, int j0, int t) {
  if constexpr (D::ON) {
    static_assert(NF % 2 == 0, "whole 16-key blocks");
    constexpr int NB = NF / 2, CALLS = (NB + 3) / 4;  // blocks of the tile; per lane
    auto apply = [&](int nf, int k, bool kept) {
      const Acc x = SCALED ? dz.scaled(s[nf][k]) : s[nf][k];
      s[nf][k] = kept ? x : Acc(0);
    };
    if ((j0 & 15) == 0) {  // warp-uniform
      const int quad = static_cast<int>(threadIdx.x & 28u);  // the quad's first lane
#pragma unroll
      for (int c = 0; c < CALLS; ++c) {
        const unsigned blk = static_cast<unsigned>(j0 >> 4) + 4u * c + static_cast<unsigned>(t);
        const unsigned both = dz.kept16(i, blk) | dz.kept16(i + 8, blk) << 16;  // row h: << 16 h
#pragma unroll
        for (int q = 0; q < 4 && 4 * c + q < NB; ++q) {
          const unsigned v = __shfl_sync(0xffffffffu, both, quad + q) >> (2 * t);
          const int nf = 2 * (4 * c + q);
#pragma unroll
          for (int k = 0; k < 4; ++k) {  // row 8 (k / 2), key 2 t + k % 2 (+ 8)
            apply(nf, k, (v >> (16 * (k / 2) + k % 2)) & 1u);
            apply(nf + 1, k, (v >> (16 * (k / 2) + 8 + k % 2)) & 1u);
          }
        }
      }
    } else {
      unsigned long long bits = 0ull;  // bit 4 nf + k: entry k of fragment nf kept
      static_assert(4 * NF <= 64, "one bit per entry");
#pragma unroll 1
      for (int x = 0; x < 4 * NF; ++x)
        bits |= static_cast<unsigned long long>(
                    dz.keep(i + 8 * ((x & 3) >> 1), j0 + 8 * (x >> 2) + 2 * t + (x & 1))) << x;
#pragma unroll
      for (int nf = 0; nf < NF; ++nf)
#pragma unroll
        for (int k = 0; k < 4; ++k) apply(nf, k, (bits >> (4 * nf + k)) & 1ull);
    }
  }
}

// The dK / dV orientation (attn_core.cuh mask_key_rows'): entry k of a thread's fragment nf is
// key j + 8 (k / 2), query i0 + 8 nf + 2 t + k % 2, the warp's 16 keys j - lane / 4 + 0..15
// starting at a multiple of 16 (the dK / dV tiles' key rows): one 16-key block, one call per
// query. Lane L draws query i0 + 8 (4 c + L / 8) + L % 8 (fragment 4 c + L / 8), and each lane
// reads bits g and g + 8 (g = lane / 4) of its two queries' calls by shuffles. Bit 4 nf + k of the
// result (32 bits where they are enough): that entry is dropped; 0 without dropout. The whole warp
// calls it. (Drawn before the tile's products, where fewer registers are live: after them the
// D=128 mask / bias tile spilled.)
template <int NF>
__device__ __forceinline__ auto dropped_bits() {  // the type of dropped_keys' bits
  if constexpr (NF * 4 <= 32) return 0u;
  else return 0ull;
}
template <int NF, typename D>
__device__ __forceinline__ auto dropped_keys(const D& dz, int j, int i0, int t) {
  static_assert(NF * 4 <= 64, "one bit per entry");
  using Bits = decltype(dropped_bits<NF>());
  Bits bits = 0;
  if constexpr (D::ON) {
    const int lane = static_cast<int>(threadIdx.x & 31u), g = lane >> 2;
    const unsigned blk = static_cast<unsigned>((j - g) >> 4);  // the warp's 16 keys
#pragma unroll 1
    for (int c = 0; c < (NF + 3) / 4; ++c) {  // (rolled: unrolled, ptxas spilled D=128's tiles)
      const unsigned mine = dz.kept16(i0 + 8 * (4 * c + (lane >> 3)) + (lane & 7), blk);
#pragma unroll
      for (int q = 0; q < 4; ++q) {  // fragment 4 c + q
#pragma unroll
        for (int e = 0; e < 2; ++e) {  // query 2 t + e
          const unsigned v = __shfl_sync(0xffffffffu, mine, 8 * q + 2 * t + e) >> g;
#pragma unroll
          for (int kh = 0; kh < 2; ++kh) {  // key j + 8 kh
            const Bits drop = ((v >> (8 * kh)) & 1u) ^ 1u;
            if (4 * c + q < NF) bits |= drop << (4 * (4 * c + q) + 2 * kh + e);
          }
        }
      }
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
  d.t2 = (256u - a.threshold) * 0x00010001u;
  d.rscale = static_cast<Acc>(a.rscale);
  return d;
}
