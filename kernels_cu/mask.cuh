// mask.cuh: THE visibility predicate (DESIGN.md "The visibility predicate"), used by every kernel.
// Mirrors: cuflash/_numpy.py (CPU path) and cuflash/reference.py (dense rebuild from the API).
//
// For one (batch, head) with L valid keys, query i sees key j iff
//   p  = bottom_right ? i + (L - Nq) : i
//   lo = max(p - left, 0),  hi = min(p + right, L - 1)
//   lo <= j <= hi  and  mask[i, j]  and  bias[i, j] != -inf  (a NaN bias is visible).
// `left`/`right` arrive from the host with None replaced by Nq + Nk and causal already applied
// (right <= 0). Positions are int64: p + right can exceed int32 for long sequences.
#pragma once
#include "common.cuh"
#include "args.cuh"

struct KeyRange {
  long long lo, hi;  // inclusive; empty when lo > hi
};

// Per-problem constants of the predicate.
struct Window {
  long long shift;  // L - Nq when bottom-right aligned, else 0
  long long L;      // valid keys
  long long left, right;
};

__device__ __forceinline__ Window make_window(int Nq, long long L, int left, int right,
                                              int bottom_right) {
  Window w;
  w.shift = bottom_right ? L - Nq : 0;
  w.L = L;
  w.left = left;
  w.right = right;
  return w;
}

// The window of head bh: its valid keys L = kv_lens[bh] (all Nk without kv_lens), clamped to
// [0, Nk].
__device__ __forceinline__ Window head_window(const long long* kv_lens, long long bh, int Nq,
                                              int Nk, int left, int right, int bottom_right) {
  long long L = kv_lens ? kv_lens[bh] : Nk;
  L = L < 0 ? 0 : (L > Nk ? Nk : L);
  return make_window(Nq, L, left, right, bottom_right);
}

// Keys visible to query i by position alone (before mask and bias). lo and hi are
// non-decreasing in i.
__device__ __forceinline__ KeyRange key_range(const Window& w, long long i) {
  const long long p = i + w.shift;
  KeyRange r;
  r.lo = p - w.left;
  if (r.lo < 0) r.lo = 0;
  r.hi = p + w.right;
  if (r.hi > w.L - 1) r.hi = w.L - 1;
  return r;
}

// Keys any query of the tile [i0, i1] can see: [lo(i0), hi(i1)] by monotonicity.
__device__ __forceinline__ KeyRange tile_key_range(const Window& w, long long i0, long long i1) {
  KeyRange r;
  r.lo = key_range(w, i0).lo;
  r.hi = key_range(w, i1).hi;
  return r;
}

// Queries (within [0, Nq)) that can see at least one key of [j0, j1], by position.
// Inverts the closed forms: hi(i) >= j0  <=>  i >= j0 - right - shift   (needs j0 <= L - 1)
//                           lo(i) <= j1  <=>  i <= j1 + left  - shift   (needs j1 >= 0)
// Keys >= L are never visible, so a key tile starting at or after L has no queries.
__device__ __forceinline__ KeyRange tile_query_range(const Window& w, long long j0, long long j1,
                                                     int Nq) {
  KeyRange r;
  if (j1 > w.L - 1) j1 = w.L - 1;
  if (j0 > j1) {
    r.lo = 0;
    r.hi = -1;
    return r;
  }
  r.lo = j0 - w.right - w.shift;
  if (r.lo < 0) r.lo = 0;
  r.hi = j1 + w.left - w.shift;
  if (r.hi > Nq - 1) r.hi = Nq - 1;
  return r;
}

// Optional dense inputs of the predicate, already offset to this (batch, head).
template <typename Acc>
struct MaskBias {
  const unsigned char* mask;  // may be null
  long long mask_rs, mask_cs;
  const Acc* bias;            // may be null
  long long bias_rs, bias_cs;
};

// The mask and bias of head bh (offsets: the host's (5, BH) table, rows 3 and 4); a null input
// stays null. Two spellings of one body: fwd_generic fills its own local in place, because taking
// head_mask_bias's return value there gives that kernel different PTX.
template <typename Acc>
__device__ __forceinline__ void set_head_mask_bias(MaskBias<Acc>& mb, const unsigned char* mask,
                                                   const Acc* bias, const long long* offsets,
                                                   int BH, long long bh, long long mask_rs,
                                                   long long mask_cs, long long bias_rs,
                                                   long long bias_cs) {
  mb.mask = mask ? mask + offsets[3 * BH + bh] : nullptr;
  mb.mask_rs = mask_rs;
  mb.mask_cs = mask_cs;
  mb.bias = bias ? bias + offsets[4 * BH + bh] : nullptr;
  mb.bias_rs = bias_rs;
  mb.bias_cs = bias_cs;
}

template <typename Acc>
__device__ __forceinline__ MaskBias<Acc> head_mask_bias(const unsigned char* mask, const Acc* bias,
                                                        const long long* offsets, int BH,
                                                        long long bh, long long mask_rs,
                                                        long long mask_cs, long long bias_rs,
                                                        long long bias_cs) {
  MaskBias<Acc> mb;
  set_head_mask_bias(mb, mask, bias, offsets, BH, bh, mask_rs, mask_cs, bias_rs, bias_cs);
  return mb;
}

// The per-element test: whether key j is visible to query i (position range, mask, and a bias
// entry other than -inf; a NaN bias is visible and makes the logit NaN). When it is, `s` (the
// scaled logit, natural units) becomes the transformed (f: modifiers.cuh), biased logit and g is
// multiplied by f's derivative; otherwise `s` is left unchanged.
template <typename Acc, typename F>
__device__ __forceinline__ bool visible_logit(Acc& s, long long i, long long j, const KeyRange& r,
                                              const MaskBias<Acc>& mb, const F& f, Acc& g) {
  if (j < r.lo || j > r.hi) return false;
  if (mb.mask != nullptr && !mb.mask[i * mb.mask_rs + j * mb.mask_cs]) return false;
  if (mb.bias != nullptr) {
    const Acc b = mb.bias[i * mb.bias_rs + j * mb.bias_cs];
    if (b == NEG_INF) return false;
    s = f.apply(s, i, j, g) + b;
  } else {
    s = f.apply(s, i, j, g);
  }
  return true;
}
template <typename Acc>
__device__ __forceinline__ bool visible_logit(Acc& s, long long i, long long j, const KeyRange& r,
                                              const MaskBias<Acc>& mb) {
  Acc g = Acc(1);
  return visible_logit(s, i, j, r, mb, NoTransform(), g);
}

// The biased logit where visible, -inf elsewhere (for code that needs no visibility bit: a
// visible logit may itself be -inf, e.g. by overflow, which is not the same as invisible).
template <typename Acc>
__device__ __forceinline__ Acc masked_logit(Acc s, long long i, long long j, const KeyRange& r,
                                            const MaskBias<Acc>& mb) {
  return visible_logit(s, i, j, r, mb) ? s : NEG_INF;
}

// One (batch, head)'s inputs, as the generic and lost-row kernels set them up: q, k, v, mask and
// bias offset by the host's per-head table (offsets: five rows of BH, in that order); dout, lse,
// delta contiguous (BH, Nq, Dv), (BH, Nq), (BH, Nq), and null (unused) in kernels that have none;
// the window over L = clamp(kv_lens[bh], 0, Nk) valid keys.
template <typename T, typename Acc>
struct HeadInputs : HeadQKV<T> {
  const T* dout;
  const Acc *lse, *delta;
  MaskBias<Acc> mb;
  Window w;
};

template <typename T, typename Acc>
__device__ __forceinline__ HeadInputs<T, Acc> head_inputs(
    long long bh, const T* q, const T* k, const T* v, const T* dout, const Acc* lse,
    const Acc* delta, const long long* offsets, const unsigned char* mask, const Acc* bias,
    const long long* kv_lens, long long mask_rs, long long mask_cs, long long bias_rs,
    long long bias_cs, int BH, int Nq, int Nk, int Dv, int left, int right, int bottom_right) {
  HeadInputs<T, Acc> h;
  h.w = head_window(kv_lens, bh, Nq, Nk, left, right, bottom_right);
  static_cast<HeadQKV<T>&>(h) = head_qkv(q, k, v, offsets, BH, bh);
  h.dout = dout + bh * Nq * Dv;
  h.lse = lse + bh * Nq;
  h.delta = delta + bh * Nq;
  h.mb = head_mask_bias(mask, bias, offsets, BH, bh, mask_rs, mask_cs, bias_rs, bias_cs);
  return h;
}
