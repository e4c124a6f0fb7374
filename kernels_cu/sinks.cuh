// sinks.cuh: attention sinks' rule (README "Attention sinks"), the one home of the join of a row's
// sink-free softmax with its sink t, a logit of value 0: L = log(exp(a) + exp(t)) and the weight
// f = exp(a - L) left to the keys, a the sink-free lse. The forward kernels apply it in their
// finalize (join_sink: out = acc / l * f, lse = L, in Acc), fwd_lost_rows to the rows it
// recomputes and sinks.cu's join after the paths whose kernels do not take sinks (in double).
#pragma once
#include "common.cuh"

// f and L of a row whose sink-free lse is a: t = -inf is no sink (f = 1, L = a exactly); t = +inf
// a +inf logit (NaN, as the dense formula's max shift gives); a NaN a or t gives NaN; an empty
// row (a = -inf) gives f = 0, L = t. exp and log1p of -|a - t| only: nothing overflows.
template <typename Acc>
__device__ __forceinline__ void sink_join(Acc a, Acc t, Acc& f, Acc& L) {
  if (t == neg_inf<Acc>()) {
    f = Acc(1);
    L = a;
    return;
  }
  if (t == pos_inf<Acc>()) {
    f = L = quiet_nan<Acc>();
    return;
  }
  const Acc d = a - t, e = acc_exp(-fabs(d));
  if (d >= Acc(0)) {
    f = Acc(1) / (Acc(1) + e);
    L = a + acc_log1p(e);
  } else {  // and a NaN d
    f = e / (Acc(1) + e);
    L = t + acc_log1p(e);
  }
}

// The end of a row with its sink t (Acc): the factor of its accumulator (out_scale: 0 when empty,
// 1 / l otherwise) and its lse (-inf when empty, NaN when l = 0, m + log l) become the softmax's
// with the sink. An empty row is out 0 and lse t; a row whose visible logits are all -inf stays
// NaN (its lse is); t = -inf leaves both bitwise as they were.
template <typename Acc>
__device__ __forceinline__ void join_sink(Acc t, Acc& out_scale, Acc& lse) {
  Acc f;
  sink_join(lse, t, f, lse);
  out_scale *= f;
}
