// attn_core.cuh: what every tensor-core kernel (forward, backward, decode) shares about attention
// itself: the visibility rule of mask.cuh in the 32-bit form MMA fragments use, the score-modifier
// hook, and the online softmax of mma.sync rows; and the online softmax of scalar rows (CUDA-core
// kernels: decode_split). A kernel's loop then reads as the seed's:
//   S = Q K^T;  mask_rows(S) (visibility + modifier);  softmax.step(S -> P);  O = O * alpha + P V
#pragma once
#include "common.cuh"
#include "mask.cuh"
#include "mma.cuh"
#include "modifiers.cuh"

// ---- visibility in 32 bits -------------------------------------------------------------------
// Query i sees key j (by position) iff lo(i) <= j <= hi(i), lo(i) = max(i + dlo, 0) and
// hi(i) = min(i + dhi, L - 1): mask.cuh's key_range with its shift folded in. Exact while
// Nq, Nk <= 2^29, which the host keeps on the tensor-core paths.
struct Bounds32 {
  int dlo, dhi, L_last;
};
__device__ __forceinline__ Bounds32 make_bounds32(const Window& w) {
  constexpr long long CLAMP = 1LL << 30;
  Bounds32 b;
  b.dlo = static_cast<int>(max(-CLAMP, min(CLAMP, w.shift - w.left)));
  b.dhi = static_cast<int>(max(-CLAMP, min(CLAMP, w.shift + w.right)));
  b.L_last = static_cast<int>(w.L) - 1;
  return b;
}
// Keys [j0, j0 + BN) visible to every query of [i0, i_last] (lo, hi are non-decreasing in i).
__device__ __forceinline__ bool tile_all_visible(const Bounds32& b, int i0, int i_last, int j0,
                                                 int BN) {
  return max(i_last + b.dlo, 0) <= j0 && j0 + BN - 1 <= min(i0 + b.dhi, b.L_last);
}

// ---- a query tile and the key tiles it visits ----------------------------------------------------
// The kernels whose block owns query rows (fwd_mma, fwd_wide, the dQ kernels). Grid: 1-D,
// blockIdx.x = bh * n_mtiles + (reversed query tile): no 65535 limit on BH, the blocks of one
// (batch, head) run together (its K / V stay in L2), and the last query tiles, which see the most
// keys when causal, start first. Rows [i0, i_last] of head bh.
struct QueryTile {
  long long bh;
  int i0, i_last;
};
template <int BLOCK_M>
__device__ __forceinline__ QueryTile query_tile(int Nq) {
  const int n_mtiles = (Nq + BLOCK_M - 1) / BLOCK_M;
  QueryTile qt;
  qt.bh = blockIdx.x / n_mtiles;
  qt.i0 = (n_mtiles - 1 - static_cast<int>(blockIdx.x % n_mtiles)) * BLOCK_M;
  qt.i_last = min(qt.i0 + BLOCK_M, Nq) - 1;
  return qt;
}

// The key tiles of BLOCK_N keys that rows [i0, i_last] can see by position: n_tiles of them from
// key j_first, keys from j_limit on loading as zeros (tile_key_range; the tiles nobody sees are
// never visited). A tile [j0, j0 + BLOCK_N) with full_lo <= j0 and j0 + BLOCK_N - 1 <= full_hi,
// i.e. lo(i_last) <= j0 and the tile's last key <= hi(i0), is visible to every row (lo, hi are
// non-decreasing): the kernels skip the per-element predicate (b32) there. (That test is written
// out in each loop: as a member function it moved bwd_wide_dq's hoisted mask bounds in its PTX.)
struct KeyTiles {
  Window w;
  int full_lo, full_hi;
  Bounds32 b32;
  int n_tiles, j_first, j_limit;
};
template <int BLOCK_N>
__device__ __forceinline__ KeyTiles key_tiles(const long long* kv_lens, long long bh,
                                                       int i0, int i_last, int Nq, int Nk,
                                                       int left, int right, int bottom_right) {
  KeyTiles kt;
  kt.w = head_window(kv_lens, bh, Nq, Nk, left, right, bottom_right);
  const KeyRange range = tile_key_range(kt.w, i0, i_last);
  kt.full_lo = static_cast<int>(min(key_range(kt.w, i_last).lo, kt.w.L));
  kt.full_hi = static_cast<int>(max(key_range(kt.w, i0).hi, -1LL));
  kt.b32 = make_bounds32(kt.w);
  kt.n_tiles = range.hi >= range.lo ? static_cast<int>((range.hi - range.lo) / BLOCK_N) + 1 : 0;
  kt.j_first = static_cast<int>(range.lo);
  kt.j_limit = static_cast<int>(range.hi) + 1;
  return kt;
}

// ---- score modifiers ---------------------------------------------------------------------------
// Applied to each logit visible by position, in the kernel's units (log2 units in the tensor-core
// kernels): mod(x, i, j) returns the modified logit, -inf for a key the modifier hides; the
// backward's mod.apply(x, i, j, g) also multiplies g by the derivative beyond the scale (1 without
// a transform). The identity costs nothing.
// READS_INPUTS: whether it reads per-(query, key) inputs (then it must not be asked about padding
// query rows, i >= Nq). IDENTITY: no per-element work, so that a kernel templated on the modifier
// leaves the tiles visible by position alone and folds the scale into exp2. HAS_GRAD: the
// backward multiplies dS by g (a transform whose derivative is not 1). POSITIONAL: its transform
// reads (i, j) (modifiers.cuh). make(...): the modifier of head bh from the kernel's inputs (m:
// at_head's, for the transform).
struct NoMod {
  static constexpr bool READS_INPUTS = false, IDENTITY = true, HAS_GRAD = false;
  static constexpr bool POSITIONAL = false;
  using Transform = NoTransform;
  template <typename X>
  __device__ __forceinline__ X operator()(X x, int, long long) const { return x; }
  template <typename X>
  __device__ __forceinline__ X apply(X x, int, long long, X&) const { return x; }
  __device__ __forceinline__ NoMod shown() const { return NoMod(); }
  template <typename Bias, typename Scale>
  __device__ __forceinline__ static NoMod make(const unsigned char*, const Bias*,
                                               const long long*, int, long long, long long,
                                               long long, long long, long long, Scale,
                                               const ModArgs& = ModArgs()) {
    return NoMod();
  }
};
// A boolean mask and / or an additive bias (MB; of the kernel's accumulator type Acc, offset to
// this (batch, head)) and the transform F (modifiers.cuh): the raw score x is scaled to the
// kernel's units, log2 units (x * scale * log2e, then + bias * log2e), or natural ones with NATURAL
// (x * scale, then + bias), F in between; the kernels fold the scale into the exponent only without
// a modifier. A -inf bias gives x = -inf (no mass), a NaN bias NaN; one below -max / log2e
// overflows to -inf (the kernels' lost-row fix-ups settle rows of only such keys).
template <typename Acc, bool NATURAL = false, bool MB = true, typename F = NoTransform>
struct ScoreModT {
  static constexpr bool READS_INPUTS = MB, IDENTITY = false;
  static constexpr bool HAS_GRAD = !F::IDENTITY && !F::ADDITIVE;  // (an additive F: dF/dx = 1)
  static constexpr bool POSITIONAL = F::POSITIONAL;
  using Transform = F;
  const unsigned char* mask;  // may be null
  const Acc* bias;            // may be null
  long long mask_rs, mask_cs, bias_rs, bias_cs;
  Acc scale_units;  // scale, times log2e unless NATURAL
  F f;
  // (F is called on a copy: a member function called on the member itself kept the struct in
  // memory and changed the code of the kernels without a transform.)
  __device__ __forceinline__ Acc operator()(Acc x, int i, long long j) const {
    return logit(x, i, j, [&] { return bias[i * bias_rs + j * bias_cs]; });
  }
  __device__ __forceinline__ Acc apply(Acc x, int i, long long j, Acc& g) const {
    return logit(x, i, j, [&] { return bias[i * bias_rs + j * bias_cs]; }, &g);
  }
  // The logit of (i, j), its bias read by bias_at() (from memory; bwd_mma.cu's DKDV_SBIAS: from
  // a staged copy); with g, F's derivative multiplies *g.
  template <typename BiasAt>
  __device__ __forceinline__ Acc logit(Acc x, int i, long long j, BiasAt bias_at,
                                       Acc* g = nullptr) const {
    if (MB && mask != nullptr && !mask[i * mask_rs + j * mask_cs]) return neg_inf<Acc>();
    x *= scale_units;
    x = g != nullptr ? F(f).apply(x, i, j, *g) : F(f)(x, i, j);
    if (MB && bias != nullptr) {
      const Acc b = bias_at();
      x = NATURAL ? x + b : acc_fma(b, log2e<Acc>(), x);
    }
    return x;
  }
  // The modifier of a tile the mask shows entirely without a bias: the scale and F.
  __device__ __forceinline__ ScoreModT<Acc, NATURAL, false, F> shown() const {
    ScoreModT<Acc, NATURAL, false, F> s;
    s.scale_units = scale_units;
    s.f = f;
    return s;
  }
  __device__ __forceinline__ static ScoreModT make(const unsigned char* mask, const Acc* bias,
                                                   const long long* offsets, int BH,
                                                   long long bh, long long mask_rs,
                                                   long long mask_cs, long long bias_rs,
                                                   long long bias_cs, Acc scale_units,
                                                   const ModArgs& m = ModArgs()) {
    ScoreModT mb;
    if constexpr (MB) {
      mb.mask = mask ? mask + offsets[3 * BH + bh] : nullptr;
      mb.bias = bias ? bias + offsets[4 * BH + bh] : nullptr;
    } else {
      mb.mask = nullptr;
      mb.bias = nullptr;
    }
    mb.mask_rs = mask_rs;
    mb.mask_cs = mask_cs;
    mb.bias_rs = bias_rs;
    mb.bias_cs = bias_cs;
    mb.scale_units = scale_units;
    mb.f = F::make(m, 0, NATURAL ? Acc(1) : log2e<Acc>());
    return mb;
  }
};
// An ADDITIVE transform alone (modifiers.cuh: F(x) = x + g(i, j)) on raw scores, made with
// units / scale so that scale * units * F(x) is the logit: a kernel keeps the scale folded into
// its exponent's FFMA (one multiply fewer per score than ScoreModT's) and its folded-max rules.
template <typename F>
struct RawTransform {
  static_assert(F::ADDITIVE && !F::IDENTITY, "an additive transform");
  static constexpr bool READS_INPUTS = false, IDENTITY = false, HAS_GRAD = false;
  static constexpr bool POSITIONAL = F::POSITIONAL;
  using Transform = F;
  F f;
  template <typename Acc>
  __device__ __forceinline__ Acc operator()(Acc x, int i, long long j) const {
    return F(f)(x, i, j);
  }
  template <typename Acc>
  __device__ __forceinline__ Acc apply(Acc x, int i, long long j, Acc& g) const {
    return F(f).apply(x, i, j, g);
  }
};
// Whether a kernel keeps the scale folded into exp2's FFMA for a modifier that reads a mask or
// bias (READS) with transform F: without any modifier, or with an additive transform alone (then
// applied on the raw scores: raw_transform). The one rule of the fold's kernels.
template <bool READS, typename F>
__device__ __forceinline__ constexpr bool folds_scale() {
  return !READS && F::ADDITIVE;
}
// The RawTransform of F made with `units` (its raw units) where folds_scale holds and there is
// a transform, else NoMod (unused then).
template <bool READS, typename F, typename Acc>
__device__ __forceinline__ auto raw_transform(const ModArgs& m, Acc units) {
  if constexpr (folds_scale<READS, F>() && !F::IDENTITY) {
    return RawTransform<F>{F::make(m, 0, units)};
  } else {
    return NoMod();
  }
}
template <typename Acc, bool NATURAL = false>
using MaskBiasModT = ScoreModT<Acc, NATURAL>;
using MaskBiasMod = MaskBiasModT<float>;  // the 16-bit kernels' (float accumulators, log2 units)

// ---- visibility on mma.sync fragments -----------------------------------------------------------
// f(h) for the two rows of this lane's pair (h = 0: row g, h = 1: row g + 8).
template <typename F>
__device__ __forceinline__ void for_pair(F f) {
#pragma unroll
  for (int h = 0; h < 2; ++h) f(h);
}

// f(x, nf, e) for each score of row h (h = 0, 1) of this lane's pair in an m-fragment's
// s[nf][2 h + e]: the one element loop of the masks below.
template <int NF, typename Acc, typename F>
__device__ __forceinline__ void for_row(Acc (&s)[NF][4], int h, F f) {
#pragma unroll
  for (int nf = 0; nf < NF; ++nf)
#pragma unroll
    for (int e = 0; e < 2; ++e) s[nf][2 * h + e] = f(s[nf][2 * h + e], nf, e);
}

// Query i's visible key columns [lo, hi] of the tile starting at key j0 (none when hi < lo):
// the visibility rule with keys below key_floor hidden too; padding rows (i >= Nq) see nothing.
struct ColRange {
  int lo, hi;
};
__device__ __forceinline__ ColRange visible_columns(int i, int j0, int Nq, const Bounds32& b,
                                                    int key_floor) {
  ColRange r;
  r.lo = max(i + b.dlo, key_floor) - j0;
  r.hi = i < Nq ? min(i + b.dhi, b.L_last) - j0 : -1;
  return r;
}

// Whether query i sees no key by position (padding rows i >= Nq included); | rather than ||: no
// branch.
__device__ __forceinline__ bool row_empty(int i, int Nq, const Bounds32& b) {
  return (i >= Nq) | (max(i + b.dlo, 0) > min(i + b.dhi, b.L_last));
}

// The backward's modifier: mod, recording at each fragment entry s[nf][k] it modifies the
// derivative g[nf][k] (Mod::apply; 1 at the entries it does not reach, whose P is 0).
template <typename Mod, int NF, typename Acc>
struct WithGrad {
  static constexpr bool READS_INPUTS = Mod::READS_INPUTS;
  const Mod& mod;
  Acc (&g)[NF][4];
};
template <typename Mod, int NF, typename Acc>
__device__ __forceinline__ WithGrad<Mod, NF, Acc> with_grad(const Mod& mod, Acc (&g)[NF][4]) {
#pragma unroll
  for (int nf = 0; nf < NF; ++nf)
#pragma unroll
    for (int k = 0; k < 4; ++k) g[nf][k] = Acc(1);
  return WithGrad<Mod, NF, Acc>{mod, g};
}
// The modifier at fragment entry s[nf][k]: mod(x, i, j), and with WithGrad its derivative too.
template <typename M, typename Acc>
__device__ __forceinline__ Acc mod_at(const M& mod, Acc x, int i, long long j, int, int) {
  return mod(x, i, j);
}
template <typename Mod, int NF, typename Acc>
__device__ __forceinline__ Acc mod_at(const WithGrad<Mod, NF, Acc>& w, Acc x, int i, long long j,
                                      int nf, int k) {
  return w.mod.apply(x, i, j, w.g[nf][k]);
}

// g[nf][k] as WithGrad recorded it, or 1 without a derivative (the array unused).
template <bool HAS_GRAD, int NF, typename Acc>
__device__ __forceinline__ Acc grad_of(const Acc (&g)[NF][4], int nf, int k) {
  if constexpr (HAS_GRAD) return g[nf][k];
  return Acc(1);
}

// The bias's gradient of pair (query i, key j) of head bh into dbias (BH, Nq, Nk) (the kernels'
// DBIAS instantiations): the logit's gradient P (dP - delta), exactly 0 where P is 0 (hidden
// pairs, empty and padding rows); pairs past Nq or Nk are not stored.
template <typename Acc>
__device__ __forceinline__ void store_dbias(Acc* __restrict__ dbias, long long bh, int Nq, int Nk,
                                            int i, int j, Acc p, Acc dlogit) {
  if (i < Nq && j < Nk)
    dbias[(bh * Nq + i) * Nk + j] = p == Acc(0) ? Acc(0) : dlogit;
}

// Row h of an m-fragment's scores, key column c = 8 nf + 2 t + e of the tile starting at key j0
// (t = lane % 4): entries outside [c_lo, c_hi] become -inf, the others go through the modifier
// (query i).
template <int NF, typename Acc, typename Mod>
__device__ __forceinline__ void mask_columns(Acc (&s)[NF][4], int h, int c_lo, int c_hi, int t,
                                             int i, int j0, const Mod& mod) {
  for_row(s, h, [&](Acc x, int nf, int e) {
    const int c = nf * 8 + 2 * t + e;
    return (c < c_lo || c > c_hi)
               ? neg_inf<Acc>()
               : mod_at(mod, x, i, static_cast<long long>(j0) + c, nf, 2 * h + e);
  });
}

// Rows = queries: one m-fragment's scores s[nf][2 h + e] of this lane, query i + 8 h (h = 0, 1)
// and key j0 + 8 nf + 2 t + e. Invisible entries become -inf, visible ones go through the
// modifier. Padding rows (i >= Nq) see nothing. Keys below key_floor (>= 0) count as invisible
// too: a tile that overlaps keys an earlier tile already took (fwd_wgmma's last tile).
template <int NF, typename Acc, typename Mod>
__device__ __forceinline__ void mask_rows(Acc (&s)[NF][4], int i, int j0, int t, int Nq,
                                          const Bounds32& b, const Mod& mod, int key_floor = 0) {
  for_pair([&](int h) {
    const int ih = i + 8 * h;
    const ColRange cr = visible_columns(ih, j0, Nq, b, key_floor);
    mask_columns(s, h, cr.lo, cr.hi, t, ih, j0, mod);
  });
}

// Every entry of an m-fragment through a modifier that reads no inputs (a score transform alone),
// in a tile visible by position to every row of it: no position test. The entries' positions are
// mask_rows' (query i + 8 h, key j0 + 8 nf + 2 t + e), for a POSITIONAL transform (ALiBi); the
// others ignore them (no code).
template <int NF, typename Acc, typename Mod>
__device__ __forceinline__ void modify_all(Acc (&s)[NF][4], const Mod& mod, int i, int j0, int t) {
  static_assert(!Mod::READS_INPUTS, "a mask or bias needs the per-element test");
#pragma unroll
  for (int nf = 0; nf < NF; ++nf)
#pragma unroll
    for (int k = 0; k < 4; ++k)
      s[nf][k] = mod_at(mod, s[nf][k], i + 8 * (k / 2),
                        static_cast<long long>(j0) + nf * 8 + 2 * t + k % 2, nf, k);
}
// The same in the dK / dV orientation (mask_key_rows'): key j + 8 h, query i0 + 8 nf + 2 t + e.
template <int NF, typename Acc, typename Mod>
__device__ __forceinline__ void modify_all_keys(Acc (&s)[NF][4], const Mod& mod, int j, int i0,
                                                int t) {
  static_assert(!Mod::READS_INPUTS, "a mask or bias needs the per-element test");
#pragma unroll
  for (int nf = 0; nf < NF; ++nf)
#pragma unroll
    for (int k = 0; k < 4; ++k)
      s[nf][k] = mod_at(mod, s[nf][k], i0 + nf * 8 + 2 * t + k % 2,
                        static_cast<long long>(j) + 8 * (k / 2), nf, k);
}

// Rows = keys (the dK / dV orientation): s[nf][2 h + e] of key j + 8 h (h = 0, 1) and query
// i0 + 8 nf + 2 t + e. Padding query columns (i >= Nq) are left to the caller's P = 0 (their lse
// is +inf) unless the modifier reads inputs there.
template <int NF, typename Acc, typename Mod>
__device__ __forceinline__ void mask_key_rows(Acc (&s)[NF][4], int j, int i0, int t, int Nq,
                                              const Bounds32& b, const Mod& mod) {
  for_pair([&](int h) {
    const int jh = j + 8 * h;
    for_row(s, h, [&](Acc x, int nf, int e) {
      const int i = i0 + nf * 8 + 2 * t + e;
      if (jh > b.L_last || jh < i + b.dlo || jh > i + b.dhi) return neg_inf<Acc>();
      if (Mod::READS_INPUTS && i >= Nq) return neg_inf<Acc>();
      return mod_at(mod, x, i, jh, nf, 2 * h + e);
    });
  });
}

// Beyond this |max| (log2 units) the folded exp2(fma(s, scale * log2e, -m)) of the forward
// kernels is off by more than its rounding residual ulp(m) / 2 = 2^-12 allows: such rows are
// recomputed (fwd_lost_rows).
constexpr float FOLD_LIMIT = 4096.f;
// Per accumulator type: float64 logits go to fwd_lost_rows only where a float64 lse may be lost
// (cuflash/_config.py LOST_LSE); the folded residual there is ulp(m) / 2 <= 2^-29.
template <typename Acc> __device__ __forceinline__ Acc fold_limit();
template <> __device__ __forceinline__ float fold_limit<float>() { return FOLD_LIMIT; }
template <> __device__ __forceinline__ double fold_limit<double>() { return 16777216.0; }

// ---- online softmax of mma.sync rows ------------------------------------------------------------
// This lane's rows g and g + 8 (h = 0, 1) of MF m-fragments, in Acc (float; double for the
// float64 kernels, whose exp is then the exact one) and log2 units (natural ones with NATURAL): a running max m, this
// lane's part of the denominator l (the quad is summed at the end) and the factor alpha by which
// the last step rescaled l, and by which the caller rescales its accumulator (next to the first
// product that consumes it). A row with no finite logit so far keeps m = -inf and uses 0 as its
// reference, so no exp(-inf - (-inf)); NaN logits (dropped by fmaxf) reach l through exp2.
template <int MF, typename Acc = float, bool NATURAL = false>
struct MmaSoftmax {
  static __device__ __forceinline__ Acc exp_units(Acc x) { return ::exp_units<NATURAL>(x); }
  Acc m[MF][2], l[MF][2], alpha[MF][2];

  // The empty state of m-fragment mf's rows: m = -inf, l = 0.
  __device__ __forceinline__ void init(int mf) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      m[mf][h] = neg_inf<Acc>();
      l[mf][h] = Acc(0);
    }
  }
  // The empty state of every row and of the accumulator that the rows scale: acc = 0.
  template <typename T, int DF>
  __device__ __forceinline__ void init(T (&acc)[MF][DF][4]) {
#pragma unroll
    for (int mf = 0; mf < MF; ++mf) init(mf);
    tc::zero(acc);
  }

  // Row (mf, h) meets a tile: m grows to include the tile's max (of s * fold, the quad's lanes
  // together), alpha = exp2(m_old - m_ref) rescales what came before; returns the reference m_ref
  // (0 while m is -inf).
  template <int NF>
  __device__ __forceinline__ Acc advance(const Acc (&s)[NF][4], int mf, int h, Acc fold) {
    Acc mx = neg_inf<Acc>();
#pragma unroll
    for (int nf = 0; nf < NF; ++nf) mx = acc_max(mx, acc_max(s[nf][2 * h], s[nf][2 * h + 1]));
    mx = acc_max(mx, __shfl_xor_sync(FULL_WARP, mx, 1));
    mx = acc_max(mx, __shfl_xor_sync(FULL_WARP, mx, 2));
    const Acc m_old = m[mf][h];
    const Acc m_new = acc_max(m_old, mx * fold);
    const Acc m_ref = (m_new == neg_inf<Acc>()) ? Acc(0) : m_new;
    alpha[mf][h] = exp_units(m_old - m_ref);
    m[mf][h] = m_new;
    return m_ref;
  }

  // One key tile: s (scores; `fold` times s is the logit in log2 units) becomes P = exp2(logit - m)
  // in place; m, l and alpha advance.
  template <int NF>
  __device__ __forceinline__ void step(Acc (&s)[MF][NF][4], Acc fold) {
#pragma unroll
    for (int mf = 0; mf < MF; ++mf)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const Acc neg_ref = -advance(s[mf], mf, h, fold);
        Acc mass = Acc(0);
#pragma unroll
        for (int nf = 0; nf < NF; ++nf)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const Acc p = exp_units(acc_fma(s[mf][nf][2 * h + e], fold, neg_ref));
            s[mf][nf][2 * h + e] = p;
            mass += p;
          }
        l[mf][h] = l[mf][h] * alpha[mf][h] + mass;
      }
  }

  // As step, for a kernel with no later fix-up of rows with huge logits (decode_tc): m is the
  // rounded max of s * fold, and the folded FFMA's residual reaches ulp(m) / 2, which overflows
  // exp2 for huge finite logits (float16 near 6e4). A tile where some row of the warp has
  // |m| > HUGE_M (warp-uniform) takes the rounded logits x = s * fold instead: p = exp2(x - m) <= 1.
  template <int NF>
  __device__ __forceinline__ void step_guarded(float (&s)[MF][NF][4], float fold) {
    constexpr float HUGE_M = 65536.f;  // 2^16, log2 units
    float m_ref[MF][2];
#pragma unroll
    for (int mf = 0; mf < MF; ++mf)
      for_pair([&](int h) { m_ref[mf][h] = advance(s[mf], mf, h, fold); });
    bool huge = false;
#pragma unroll
    for (int mf = 0; mf < MF; ++mf) huge |= fabsf(m_ref[mf][0]) > HUGE_M || fabsf(m_ref[mf][1]) > HUGE_M;
    float sl = fold;
    if (__any_sync(FULL_WARP, huge)) {
      tc::for_each_entry(s, [&](float& x, int, int, int) { x = __fmul_rn(x, fold); });  // no fma
      sl = 1.f;  // fma(x, 1, -m) = x - m, rounded
    }
#pragma unroll
    for (int mf = 0; mf < MF; ++mf)
      for_pair([&](int h) {
        float mass = 0.f;
        for_row(s[mf], h, [&](float x, int, int) {
          const float p = tc::ex2(fmaf(x, sl, -m_ref[mf][h]));
          mass += p;
          return p;
        });
        l[mf][h] = l[mf][h] * alpha[mf][h] + mass;
      });
  }

  // acc (two n-fragments of m-fragment mf) *= alpha of its rows.
  __device__ __forceinline__ void rescale(Acc (&acc0)[4], Acc (&acc1)[4], int mf) const {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      acc0[e] *= alpha[mf][e / 2];
      acc1[e] *= alpha[mf][e / 2];
    }
  }

  // The end of row (mf, h): its denominator, the sum over the quad of lanes that share the row.
  __device__ __forceinline__ Acc row_sum(int mf, int h) const {
    Acc l_row = l[mf][h];
    l_row += __shfl_xor_sync(FULL_WARP, l_row, 1);
    l_row += __shfl_xor_sync(FULL_WARP, l_row, 2);
    return l_row;
  }
  // The factor for its accumulator: 0 for an empty row (no visible key by position). A row that
  // sees keys but whose l is 0 (every visible logit -inf) has acc = 0 and gets 1 / 0 = inf, so
  // 0 * inf = NaN, like a NaN l.
  __device__ __forceinline__ static Acc out_scale(Acc l_row, bool empty) {
    return empty ? Acc(0) : Acc(1) / l_row;
  }
  // Its lse (natural units), by the same rules: -inf when empty, NaN when l is 0.
  __device__ __forceinline__ Acc lse(int mf, int h, bool empty, Acc l_row) const {
    return empty ? neg_inf<Acc>()
                 : l_row == Acc(0) ? quiet_nan<Acc>()
                 : (NATURAL ? m[mf][h] : m[mf][h] * ln2<Acc>()) + acc_log(l_row);
  }
};

// ---- online softmax of scalar rows (CUDA cores) -------------------------------------------------
// Units of a kernel's logits and maxima: base 2 (p = exp2(x - m)), or NATURAL (p = exp2((x - m) *
// log2(e))), where a finite logit stays finite (finfo(float32).min * log2(e) overflows: a padding
// row of such a bias is a uniform softmax, not an empty row). exp2_diff: the weight exp2 of a
// difference d = x - m of two of them (d = -inf gives 0; in natural units d * log2(e) may only
// overflow to -inf, giving 0, the right limit). natural_lse: the lse m + log l in natural units.
template <bool NATURAL, typename Acc>
__device__ __forceinline__ Acc exp2_diff(Acc d) {
  return exp2_acc(NATURAL ? d * log2e<Acc>() : d);
}
template <bool NATURAL, typename Acc>
__device__ __forceinline__ Acc natural_lse(Acc m, Acc l) {
  return NATURAL ? m + log2_acc(l) * ln2<Acc>() : (m + log2_acc(l)) * ln2<Acc>();
}

// The ROWS rows of one thread, in Acc (float or double) and the units above: per row a running
// max m, the thread's part of the denominator l, and the factor alpha by which the last step
// rescaled l, and by which the caller rescales its accumulator. A row with no finite logit so far
// keeps m = -inf and uses 0 as its reference, so no exp(-inf - (-inf)); NaN logits (dropped by
// acc_max) reach l through exp2.
// (One object for all rows, l declared before m: the order that keeps decode_split's PTX as it
// was before the object existed.)
template <typename Acc, bool NATURAL, int ROWS>
struct RowSoftmax {
  Acc l[ROWS], m[ROWS], alpha[ROWS];

  // The empty state of row r: m = -inf, l = 0.
  __device__ __forceinline__ void init(int r) {
    m[r] = neg_inf<Acc>();
    l[r] = Acc(0);
  }

  // Row r meets a tile whose logits' max is tile_max: m grows to include it, l is rescaled by
  // alpha = exp2(m_old - m_ref) (0 while m was -inf); returns the reference m_ref (0 while m is
  // -inf).
  __device__ __forceinline__ Acc advance(int r, Acc tile_max) {
    const Acc m_new = acc_max(m[r], tile_max);
    const Acc m_ref = m_new == neg_inf<Acc>() ? Acc(0) : m_new;
    alpha[r] = exp2_diff<NATURAL>(m[r] - m_ref);
    l[r] *= alpha[r];
    m[r] = m_new;
    return m_ref;
  }

  // One logit x of that tile: its weight p = exp2(x - m_ref), added to l.
  __device__ __forceinline__ Acc accumulate(int r, Acc x, Acc m_ref) {
    const Acc p = exp2_diff<NATURAL>(x - m_ref);
    l[r] += p;
    return p;
  }

  // Merge row r of lane (this lane ^ offset), other keys of the same row, into this lane's; returns
  // the weights by which the caller combines the accumulators, acc * self + acc_o * other. A side
  // with m = -inf weighs 0 (no -inf - (-inf) when both are empty).
  struct Weights {
    Acc self, other;
  };
  __device__ __forceinline__ Weights merge_xor(int r, int offset) {
    const Acc m_o = __shfl_xor_sync(FULL_WARP, m[r], offset);
    const Acc l_o = __shfl_xor_sync(FULL_WARP, l[r], offset);
    const Acc m_new = acc_max(m[r], m_o);
    Weights w;
    w.self = (m[r] > neg_inf<Acc>()) ? exp2_diff<NATURAL>(m[r] - m_new) : Acc(0);
    w.other = (m_o > neg_inf<Acc>()) ? exp2_diff<NATURAL>(m_o - m_new) : Acc(0);
    l[r] = l[r] * w.self + l_o * w.other;
    m[r] = m_new;
    return w;
  }
};
