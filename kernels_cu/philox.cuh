// philox.cuh: dropout, the one home of its random bits and of what a kernel does with them
// (DESIGN.md "Dropout"). Mirrored bit for bit by cuflash/_dropout.py (the NumPy path and the
// reference draw the same mask).
//
// The keep bit of element (bh, i, j) of a call (bh: the output's flat (batch, head) index, i the
// query row, j the key, both in the head's own indices) is a pure function of the call's
// (seed, offset) and of that position, so it does not depend on tiles, path or device:
//   (r0, r1, r2, r3) = Philox4x32-10(counter = ((j >> 6) * 4 + ((j >> 1) & 3), i, bh, offset),
//                                    key = (seed & 0xffffffff, seed >> 32))
//   byte b = ((j >> 3) & 7) * 2 + (j & 1) of the call's 16 bytes (byte b & 3 of word r[b >> 2],
//   the low byte first);   keep(bh, i, j) = byte >= threshold,   threshold = round(dropout_p * 256)
// One call gives 16 keys of a row: in a 64-key block the keys 8 n + 2 c + {0, 1} (n = 0..7) of
// the pair class c = (j >> 1) & 3, which are exactly what lane t = c of an mma.sync m16n8 (or
// wgmma) accumulator holds of that row and block, so the rows = queries kernels draw one call per
// row and 64 keys (drop_rows) and the rows = keys kernels share each call over a warp through
// shuffles (dropped_keys). A kept weight is scaled by rscale = 256 / (256 - threshold) (the
// estimate stays unbiased at dropout_p's granularity 1/256); the softmax's l and lse stay the
// undropped ones.
//
// Kernels take dropout as a trailing parameter pack `const Drop... drop` (empty: no dropout, and
// then no parameter and no code: the default instantiations are unchanged), made into the per-head
// object by dropout_at<Acc>(bh, drop...): NoDropout, or Dropout<Acc>, whose
//   ON                      says whether there is any work;
//   keep(i, j)              the element's keep bit (one call; the generic and lost-row kernels);
//   kept16(i, ctr)          the keep bits of call ctr of row i (bit b: byte b kept);
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

// The call of element (i, j): its counter's first word.
__device__ __forceinline__ unsigned dropout_counter(long long j) {
  return static_cast<unsigned>(j >> 6) * 4u + (static_cast<unsigned>(j >> 1) & 3u);
}

// Bits 0..3: which of the four bytes of w are >= the threshold (t4: it in each byte).
__device__ __forceinline__ unsigned kept4(unsigned w, unsigned t4) {
  const unsigned ge = __vcmpgeu4(w, t4) & 0x01010101u;  // byte k: 1 where kept
  return (ge * 0x01020408u) >> 24;  // byte k's bit to bit 24 + k (no carries)
}

template <typename Acc>
struct Dropout {
  static constexpr bool ON = true;
  unsigned key0, key1, bh, offset, threshold, t4;  // t4: threshold in each byte
  Acc rscale;

  __device__ __forceinline__ Philox4 call(long long i, unsigned ctr) const {
    return philox4x32_10(Philox4{ctr, static_cast<unsigned>(i), bh, offset}, key0, key1);
  }
  __device__ __forceinline__ bool keep(long long i, long long j) const {
    const Philox4 r = call(i, dropout_counter(j));
    const unsigned w = static_cast<unsigned>(j >> 4) & 3u;
    const unsigned word = w & 2u ? (w & 1u ? r.w : r.z) : (w & 1u ? r.y : r.x);
    const unsigned byte = (word >> (8u * ((static_cast<unsigned>(j >> 2) & 2u) |
                                          (static_cast<unsigned>(j) & 1u)))) & 0xffu;
    return byte >= threshold;
  }
  // The keep bits of call ctr of row i: bit b set where byte b is kept.
  __device__ __forceinline__ unsigned kept16(long long i, unsigned ctr) const {
    const Philox4 r = call(i, ctr);
    return kept4(r.x, t4) | kept4(r.y, t4) << 4 | kept4(r.z, t4) << 8 | kept4(r.w, t4) << 12;
  }
  __device__ __forceinline__ Acc operator()(Acc p, long long i, long long j) const {
    return p != Acc(0) && !keep(i, j) ? Acc(0) : p;  // (no bits drawn where p is 0)
  }
  __device__ __forceinline__ Acc scaled(Acc x) const { return x * rscale; }
};

// The keep bits of row i's keys j0 + 8 nf + 2 t + e (nf < NF, e < 2) in this lane's part of an
// mma.sync m16n8 accumulator tile (t = lane % 4): bit 2 nf + e. With j0 a multiple of 8 (every
// tile but a forward's unaligned first one) those keys are the bytes 2 n + e of the calls
// (j >> 6) * 4 + t, n the key's 8-key group in its 64-key block: one call per 64-key block
// touched; else one call per key (a loop).
template <int NF, typename D>
__device__ __forceinline__ unsigned long long kept_row(const D& dz, int i, int j0, int t) {
  static_assert(2 * NF <= 64, "one bit per key");
  unsigned long long bits = 0ull;
  if ((j0 & 7) == 0) {  // warp-uniform
    constexpr int CALLS = (NF + 14) / 8;  // 64-key blocks a tile of NF groups can touch
    static_assert(CALLS * 16 <= 64, "the bits fit a u64");
    const int o = (j0 >> 3) & 7;  // the tile's first group in its block
    const unsigned ctr0 = static_cast<unsigned>(j0 >> 6) * 4u + static_cast<unsigned>(t);
#pragma unroll
    for (int c = 0; c < CALLS; ++c)
      if (c == 0 || 8 * c < o + NF)  // (warp-uniform)
        bits |= static_cast<unsigned long long>(dz.kept16(i, ctr0 + 4u * c)) << (16 * c);
    return bits >> (2 * o);
  }
#pragma unroll 1
  for (int x = 0; x < 2 * NF; ++x)
    bits |= static_cast<unsigned long long>(dz.keep(i, j0 + 8 * (x >> 1) + 2 * t + (x & 1))) << x;
  return bits;
}

// Dropout on this lane's part of an mma.sync m16n8 accumulator tile in the rows = queries
// orientation (attn_core.cuh mask_rows'): s[nf][2 h + e] is query i + 8 h, key j0 + 8 nf + 2 t + e
// (t = lane % 4); a dropped entry becomes 0, a kept one stays (SCALED: times rscale, the
// backward's dP). No code without dropout.
template <bool SCALED = false, int NF, typename Acc, typename D>
__device__ __forceinline__ void drop_rows(Acc (&s)[NF][4], const D& dz, int i, int j0, int t) {
  if constexpr (D::ON) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const unsigned long long bits = kept_row<NF>(dz, i + 8 * h, j0, t);
#pragma unroll
      for (int nf = 0; nf < NF; ++nf)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const Acc x = SCALED ? dz.scaled(s[nf][2 * h + e]) : s[nf][2 * h + e];
          s[nf][2 * h + e] = (bits >> (2 * nf + e)) & 1ull ? x : Acc(0);
        }
    }
  }
}

// The dK / dV orientation (attn_core.cuh mask_key_rows'): entry k of a thread's fragment nf is
// key j + 8 (k / 2), query i0 + 8 nf + 2 t + k % 2, the warp's 16 keys j - lane / 4 + 0..15
// starting at a multiple of 16 (the dK / dV tiles' key rows). Bit 4 nf + k of the result: that
// entry is dropped (in 32 bits where they are enough); 0 without dropout. A fragment's 8 queries by the warp's 16 keys are one word
// of each of 32 calls (8 queries by the 4 pair classes): lane L draws the call of query
// i0 + 8 nf + L % 8, class L / 8, and each lane reads its bytes from two of them by shuffles.
// (Drawn before the tile's products, where fewer registers are live: after them the D=128 mask /
// bias tile spilled.)
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
    const int jw = j - g;  // the warp's first key (a multiple of 16)
    const unsigned ctr = static_cast<unsigned>(jw >> 6) * 4u + static_cast<unsigned>(lane >> 3);
    const unsigned wsel = static_cast<unsigned>(jw >> 4) & 3u;  // the word of keys jw..jw+15
    const int src = 2 * t + 8 * (g >> 1);  // the lane of this thread's query 2 t, class g / 2
    const unsigned sh = 8u * static_cast<unsigned>(g & 1);  // key j's byte; key j + 8: + 16
#pragma unroll 1
    for (int nf = 0; nf < NF; ++nf) {  // (rolled: unrolled, ptxas spilled D=128's wgmma tiles)
      const Philox4 r = dz.call(i0 + nf * 8 + (lane & 7), ctr);
      const unsigned word = wsel & 2u ? (wsel & 1u ? r.w : r.z) : (wsel & 1u ? r.y : r.x);
#pragma unroll
      for (int e = 0; e < 2; ++e) {  // query 2 t + e
        const unsigned w = __shfl_sync(0xffffffffu, word, src + e);
#pragma unroll
        for (int kh = 0; kh < 2; ++kh) {  // key j + 8 kh
          const bool drop = ((w >> (sh + 16u * kh)) & 0xffu) < dz.threshold;
          bits |= static_cast<Bits>(drop) << (4 * nf + 2 * kh + e);
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
  d.t4 = a.threshold * 0x01010101u;
  d.rscale = static_cast<Acc>(a.rscale);
  return d;
}
