// args.cuh: the parameters every attention kernel takes after its own tensors: the per-head input
// tables as __restrict__ pointers (ATTN_INPUTS), then one struct of scalars passed by value
// (AttnArgs). The pointers stay separate parameters because ptxas gives loads through a pointer
// read from a struct parameter no read-only (ld.global.nc) path, __restrict__ or not. The host
// mirror of AttnArgs is cuflash/_runtime.py ARGS_FIELDS (a NumPy structured scalar with the same
// fields, order and C types; tests/test_build.py holds the two in step).
#pragma once
#include "modifiers.cuh"

// offsets (5, BH): element offsets of each (batch, head) in q, k, v, mask, bias; mask, bias (of
// type Bias) and kv_lens (BH) are null where absent.
#define ATTN_INPUTS(Bias)                                                                      \
  const long long *__restrict__ offsets, const unsigned char *__restrict__ mask,               \
      const Bias *__restrict__ bias, const long long *__restrict__ kv_lens

// q, k and v of head bh: rows 0 to 2 of the offsets table (rows 3 and 4, mask and bias:
// mask.cuh head_mask_bias).
template <typename T>
struct HeadQKV {
  const T *q, *k, *v;
};
template <typename T>
__device__ __forceinline__ HeadQKV<T> head_qkv(const T* q, const T* k, const T* v,
                                               const long long* offsets, int BH, long long bh) {
  HeadQKV<T> h;
  h.q = q + offsets[0 * BH + bh];
  h.k = k + offsets[1 * BH + bh];
  h.v = v + offsets[2 * BH + bh];
  return h;
}

struct AttnArgs {
  long long q_rs, k_rs, v_rs, mask_rs, mask_cs, bias_rs, bias_cs;  // strides, in elements
  int BH, Nq, Nk, Dk, Dv;
  double scale;  // rounded to the kernel's arithmetic type by ATTN_ARGS_LOCALS
  int left, right, bottom_right;  // the window (cuflash/_validate.py) and the alignment
  double mod0, mod1;  // the score transforms' scalars (ModArgs, MOD_ARGS of them; cuflash/_modifiers.py)
  const double* mod_table;  // (BH,) the transforms' per-(batch, head) values (ALiBi's slopes) or null
};

// The same fields as separate parameters, for the generic CUDA-core kernels: there ptxas kept the
// struct's fields in registers (vector loads from the parameter space), which raised their register
// counts (fwd float64 167 -> 173: 3 -> 2 blocks per SM) and cost them 6-20 % at float32 / float64
// (tenth session). Scale: the kernel's scale type (the host passes that type).
#define ATTN_ARGS_PARAMS(Scale)                                                                \
  long long q_rs, long long k_rs, long long v_rs, long long mask_rs, long long mask_cs,        \
      long long bias_rs, long long bias_cs, int BH, int Nq, int Nk, int Dk, int Dv, Scale scale, \
      int left, int right, int bottom_right, double mod0, double mod1, const double* mod_table

// The fields as the const locals a kernel body reads (the names the positional parameters had),
// the scale rounded to `Scale` as the host rounded it when it passed a scalar of that type.
#define ATTN_ARGS_LOCALS(a, Scale)                                                             \
  const long long q_rs = (a).q_rs, k_rs = (a).k_rs, v_rs = (a).v_rs;                         \
  const long long mask_rs = (a).mask_rs, mask_cs = (a).mask_cs;                              \
  const long long bias_rs = (a).bias_rs, bias_cs = (a).bias_cs;                              \
  const int BH = (a).BH, Nq = (a).Nq, Nk = (a).Nk, Dk = (a).Dk, Dv = (a).Dv;                 \
  const Scale scale = static_cast<Scale>((a).scale);                                         \
  const int left = (a).left, right = (a).right, bottom_right = (a).bottom_right;               \
  const ModArgs mod_args = {{(a).mod0, (a).mod1}, (a).mod_table, 0, 0}

// The ModArgs of kernels that take the modifier fields as parameters (ATTN_ARGS_PARAMS, decode's
// mod0, mod1, mod_table), before at_head (modifiers.cuh) places them.
#define FLAT_MOD_ARGS ModArgs{{mod0, mod1}, mod_table, 0, 0}

// Head bh's mask / bias inputs as ScoreModT::make (attn_core.cuh) takes them, by the names
// ATTN_INPUTS and ATTN_ARGS_LOCALS give: Mod::make(MOD_INPUTS(bh), scale_units,
// at_head(mod_args, bh, shift)).
#define MOD_INPUTS(bh) mask, bias, offsets, BH, bh, mask_rs, mask_cs, bias_rs, bias_cs
