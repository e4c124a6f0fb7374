// modifiers.cuh: the score transforms, the one place a new score modifier (softcap, ALiBi, ...)
// is written (DESIGN.md "Adding a score modifier"). A transform F maps the scaled logit x of a
// visible (query i, key j) to F(x), in the kernel's units (log2 units: x = s * scale * log2e; or
// natural units: x = s * scale), after the mask and before the additive bias:
//   logit = F(scale * s) + bias      (the forward; -inf where the position, mask or bias hides)
// Every kernel applies it through its score modifier (attn_core.cuh ScoreModT, the generic
// kernels' mask.cuh visible_logit), so that a transform reaches every path at once. Its interface:
//   SLOTS                 how many of AttnArgs' modifier scalars (ModArgs) it reads;
//   IDENTITY              no work (NoTransform), so that kernels keep their unmodified fast paths;
//   POSITIONAL            it reads the positions i, j (ALiBi): kernels pass the real ones on
//                         tiles they spare the position test, and kernels whose rows belong to
//                         several heads (decode_tc) do not take it;
//   ADDITIVE              F(x) = x + g(i, j) with g made in the given units (ALiBi): a kernel may
//                         apply it to raw scores with units / scale (attn_core.cuh RawTransform)
//                         and keep the scale folded into the exponent;
//   make(m, slot, units)  its values from m.v[slot ..] (the host's cuflash/_modifiers.py puts them
//                         there) and the head's m.table[m.bh], units = log2e in log2-unit kernels,
//                         1 in natural-unit ones;
//   (x, i, j)             the forward (i: the query row, j: the key, in the head's own indices);
//   apply(x, i, j, g)     the forward, multiplying g by dF/dx (the backward's dS = P (dP - D) g).
#pragma once
#include "common.cuh"

constexpr int MOD_ARGS = 2;  // cuflash/_modifiers.py MOD_ARGS
// What make() reads: the scalars (AttnArgs mod0, mod1), the per-(batch, head) table (AttnArgs
// mod_table: ALiBi's slopes, null without), and where the transform is applied: the head bh and
// the aligned position of its query 0, p = i + shift (mask.cuh Window::shift: L - Nq bottom-right,
// else 0). Kernels fill bh and shift once per head (at_head); only a POSITIONAL transform reads them.
struct ModArgs {
  double v[MOD_ARGS];
  const double* table;
  long long bh, shift;
};
__device__ __forceinline__ ModArgs at_head(ModArgs m, long long bh, long long shift) {
  m.bh = bh;
  m.shift = shift;
  return m;
}

struct NoTransform {
  static constexpr int SLOTS = 0;
  static constexpr bool IDENTITY = true, POSITIONAL = false, ADDITIVE = true;
  template <typename Acc>
  __device__ __forceinline__ static NoTransform make(const ModArgs&, int, Acc) {
    return NoTransform();
  }
  template <typename Acc>
  __device__ __forceinline__ Acc operator()(Acc x, long long, long long) const { return x; }
  template <typename Acc>
  __device__ __forceinline__ Acc apply(Acc x, long long, long long, Acc&) const { return x; }
};

// x / y without a full-precision division in float (rel. error ~2 ulp; 0 once y reaches +inf),
// exactly rounded in double.
__device__ __forceinline__ float ratio_fast(float x, float y) { return __fdividef(x, y); }
__device__ __forceinline__ double ratio_fast(double x, double y) { return x / y; }
// e^x in the kernel's units: exp2 in log2 units (x already times log2e), exp in natural ones.
template <bool NATURAL, typename Acc>
__device__ __forceinline__ Acc exp_units(Acc x) {
  return NATURAL ? acc_exp(x) : exp2_acc(x);
}
__device__ __forceinline__ float abs_acc(float x) { return fabsf(x); }
__device__ __forceinline__ double abs_acc(double x) { return fabs(x); }
__device__ __forceinline__ float tanh_acc(float x) { return tanhf(x); }
__device__ __forceinline__ double tanh_acc(double x) { return tanh(x); }
// tanh on the MUFU unit (sm_75+): one instruction, relative error about 2^-11.
__device__ __forceinline__ float tanh_mufu(float x) {
  float y;
  asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// How a transform evaluates its functions, by the inputs' precision (cuflash/_modifiers.py picks):
// accurately (float32, float64 inputs), from one MUFU exponential (float16: its logits carry 11
// bits) or with the MUFU's own approximation where there is one (bfloat16: 8 bits).
constexpr int ARITH_ACCURATE = 0, ARITH_EXP = 1, ARITH_MUFU = 2;

// Logit softcapping: F(x) = c tanh(x / c) with c the cap in the kernel's units (cap * log2e in
// log2 units: the same function of the natural logit, as x / c = x_nat / cap). dF/dx =
// 1 - tanh^2, from the same tanh. ARITH_EXP: tanh(y) = 1 - 2 / (1 + e^{2y}) from one MUFU
// exponential and a fast division, absolute error ~2^-22 (c at +inf, -c at -inf, NaN kept);
// ARITH_MUFU: tanh.approx (relative error ~2^-11, below a bfloat16 logit's 2^-9); otherwise the
// accurate tanhf / tanh.
template <typename Acc, bool NATURAL = false, int ARITH = ARITH_ACCURATE>
struct Softcap {
  static constexpr int SLOTS = 1;
  static constexpr bool IDENTITY = false, POSITIONAL = false, ADDITIVE = false;
  Acc c, inv_c, k;  // the cap in the kernel's units, its inverse, and 2 / cap (either units)
  __device__ __forceinline__ static Softcap make(const ModArgs& m, int slot, Acc units) {
    Softcap f;
    f.c = static_cast<Acc>(m.v[slot]) * units;
    f.inv_c = Acc(1) / f.c;
    f.k = static_cast<Acc>(2.0 / m.v[slot]);
    return f;
  }
  // tanh(x / c); in the exponential's form e^{2 x_nat / cap} = exp_units(x * k) in either units
  __device__ __forceinline__ Acc tanh_of(Acc x) const {
    if constexpr (ARITH == ARITH_EXP)
      return Acc(1) - ratio_fast(Acc(2), Acc(1) + exp_units<NATURAL>(x * k));
    else if constexpr (ARITH == ARITH_MUFU && sizeof(Acc) == 4)
      return tanh_mufu(x * inv_c);
    else
      return tanh_acc(x * inv_c);
  }
  __device__ __forceinline__ Acc operator()(Acc x, long long, long long) const {
    return c * tanh_of(x);
  }
  __device__ __forceinline__ Acc apply(Acc x, long long, long long, Acc& g) const {
    const Acc t = tanh_of(x);
    g *= Acc(1) - t * t;
    return c * t;
  }
};

// ALiBi (Press et al.; FlashAttention's convention): F(x) = x - slope |p_i - j|, the linear bias
// by distance between query i's aligned position p_i = i + shift + d (the causal mask's, with
// d = q_start - k_start of `positions`, the transform's scalar) and key j, with the (batch, head)'s
// slope from m.table, in the kernel's units (slope * units). dF/dx = 1. A head index bh < 0 (a
// decode padding row) reads no slope.
// The distance p_i - j = (i - j) + p0 (p0 = shift + d, query 0's aligned position) is exact:
//   double  the int32 i - j converted, plus p0 (exact below 2^53);
//   float   without a conversion instruction (one I2FP per score of the four that ALiBi added
//           to the Hopper forward; benchmarks/RESULTS.md, twenty-ninth session): the float whose
//           bits are ALIBI_MAGIC + (i - j) is 1.5 * 2^23 + (i - j) exactly (its ulp is 1 while
//           |i - j| < 2^22), so one integer add and one subtraction of (1.5 * 2^23 - p0) give
//           (i - j) + p0 exactly. The host keeps Nq + Nk + |d| below ALIBI_SPAN for float
//           accumulators (cuflash/_validate.py: |i - j| < 2^22, p0 and the result integers
//           below 2^23), so every distance is the exact one, as in double.
// (an enum, not a constexpr int: NVRTC emits namespace-scope constants as globals)
enum : int { ALIBI_MAGIC = 0x4B400000 };  // the bits of 1.5 * 2^23 (12582912.f)
template <typename Acc>
struct Alibi {
  static constexpr int SLOTS = 1;
  static constexpr bool IDENTITY = false, POSITIONAL = true, ADDITIVE = true;
  static constexpr bool MAGIC = sizeof(Acc) == 4;
  Acc slope, p0;  // the slope in the kernel's units; p0 (double), 1.5 * 2^23 - p0 (float)
  __device__ __forceinline__ static Alibi make(const ModArgs& m, int slot, Acc units) {
    Alibi f;
    f.slope = (m.table != nullptr && m.bh >= 0) ? static_cast<Acc>(m.table[m.bh] * units) : Acc(0);
    const double p0 = static_cast<double>(m.shift) + m.v[slot];
    f.p0 = static_cast<Acc>(MAGIC ? 12582912.0 - p0 : p0);
    return f;
  }
  __device__ __forceinline__ Acc operator()(Acc x, long long i, long long j) const {
    const int n = static_cast<int>(i) - static_cast<int>(j);
    Acc d;
    if constexpr (MAGIC)
      d = __int_as_float(ALIBI_MAGIC + n) - p0;
    else
      d = static_cast<Acc>(n) + p0;
    return x - slope * abs_acc(d);
  }
  __device__ __forceinline__ Acc apply(Acc x, long long i, long long j, Acc&) const {
    return (*this)(x, i, j);
  }
};

// Two transforms in turn (G after F); the host nests them for a chain of three or more.
template <typename F, typename G>
struct Then {
  static constexpr int SLOTS = F::SLOTS + G::SLOTS;
  static constexpr bool IDENTITY = F::IDENTITY && G::IDENTITY;
  static constexpr bool POSITIONAL = F::POSITIONAL || G::POSITIONAL;
  static constexpr bool ADDITIVE = false;  // (chains run on the generic kernels, which never fold)
  F f;
  G g2;
  template <typename Acc>
  __device__ __forceinline__ static Then make(const ModArgs& m, int slot, Acc units) {
    Then t;
    t.f = F::make(m, slot, units);
    t.g2 = G::make(m, slot + F::SLOTS, units);
    return t;
  }
  template <typename Acc>
  __device__ __forceinline__ Acc operator()(Acc x, long long i, long long j) const {
    return g2(f(x, i, j), i, j);
  }
  template <typename Acc>
  __device__ __forceinline__ Acc apply(Acc x, long long i, long long j, Acc& g) const {
    return g2.apply(f.apply(x, i, j, g), i, j, g);
  }
};
