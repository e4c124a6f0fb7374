// decode.cu: split-KV attention for a few query rows per kv head (decode), sm_80+. Two kernels share
// the work decomposition, the tables and the merge below: decode_split (CUDA cores, every dtype,
// head dims <= 256, masks and bias; its block layout is described here) and decode_tc (tensor
// cores, float16 / bfloat16, Dk = Dv in {64, 128}, no mask / bias; described at its definition).
// Both take the score transforms F (modifiers.cuh: logit = F(scale q.k) + bias), a last template
// argument, their scalars and per-head table the trailing kernel parameters mod0, mod1, mod_table
// (decode_tc: no POSITIONAL transform, its rows span several heads).
//
// Work decomposition (the host, cuflash/_decode.py, builds every table):
//   group    the output (batch, head) matrices that read ONE k matrix and ONE v matrix and share
//            one valid length: G query heads (GQA: H / Hkv), table `groups` (n_groups, G) of bh,
//            -1 where a group is shorter than G;
//   row tile ROWS of the group's G * Nq query rows, query-major (row rho -> i = rho / G, head
//            gi = rho % G), so a tile's rows have neighbouring positions and key ranges;
//   item     one block: a contiguous key range [k0, k1) of one row tile (its "split").
// Each block reads its keys of one kv head ONCE for all of its rows, with 16-byte loads, and keeps
// the online softmax per row in Acc (float; double for double). Scores are in the base-2 domain
// (q is pre-multiplied by scale * log2(e), so p = exp2(t - m)), except in decode_split with a
// mask, a bias or a transform: there the logits and the maxima (the workspace's too) stay in
// natural units (q times scale, F applied and the bias added as it is, p = exp2((x - m) *
// log2(e))), because a finite bias need not be finite in base 2 (finfo(float32).min * log2(e)
// overflows; a padding row made of such a bias is a uniform softmax, not an empty row), nor a
// transform's scalars (a cap near finfo(float32).max).
//
// decode_split's block layout: DECODE_WARPS warps stream disjoint warp chunks of keys (warp w takes chunks
// w, w + DECODE_WARPS, ...). In a warp, LK consecutive lanes span one key row (16 bytes each, NV
// vectors per lane when a row is wider than 32 vectors), so one load instruction covers KPL =
// 32 / LK keys ("key slots"); each lane loads U keys of K and of V per chunk, and the next chunk
// is loaded (register double buffer) before the current one is computed. The U x ROWS partial dot
// products of a lane are summed over its LK lanes with a reduce-scatter plus gather (NS - 1 + NS
// shuffles instead of NS * log2(LK)); every lane of a slot then runs the same online softmax and
// accumulates P.V for its own columns. At the end slots merge by shuffles, warps through shared
// memory.
//
// Results per item (the non-finite contract: a row is empty only when it has no visible key;
// otherwise it is the dense formula in IEEE arithmetic, NaN where that gives NaN):
//   * a row tile with one item writes out (T) and lse (natural log, Acc) directly: a row with no
//     visible key out 0, lse -inf; a row with visible keys but l == 0 (every visible logit -inf)
//     out NaN, lse NaN; otherwise acc / l and m + log l (NaN logits make l NaN, and so both);
//   * otherwise the item writes its partial to the workspace: ws_out (n_items, ROWS, Dv) holds the
//     NORMALIZED partial output acc / l, ws_ml (n_items, ROWS, 2) the partial's max and sum
//     (m, l), m in BASE 2 or, for decode_split with a modifier, in natural units. (m, l) and not
//     the partial lse m + log l: where |m| is huge (a padding row of finfo(float32).min biases)
//     the lse rounds to m, and partials of different sizes would get equal weights. The m slot
//     also carries the row's visibility, so that the merge knows whether an all-identity row is
//     empty or NaN:
//       (-inf, 0)  the row has no visible key in this item (identity in the merge);
//       (+inf, 0)  the row has visible keys here but l == 0, every visible logit -inf (identity
//                  in the merge too, but the row is not empty); a written m is always finite;
//       (m, NaN)   a NaN reached l (propagates through the merge; m = 0 if the max was not
//                  finite);
//     ws_out is written for the finite and NaN partials only. The partials are merged with the
//     rule of cuflash.merge on (m, l) (weights l_i exp2(m_i - max), in a fixed order: slot by
//     slot, whichever block merges, so the result is bitwise reproducible) either by the last
//     block of the row tile to finish (an atomic counter per row tile, reset to 0 by that block
//     so the buffer can be reused without a memset; the host always passes fused = 1, 0 would
//     leave the partials in the workspace).
//     Merged row: every partial (-inf, 0) -> out 0, lse -inf; every partial an identity but one
//     of them (+inf, 0) -> NaN, NaN; a NaN partial -> NaN, NaN; else the weighted mean and
//     M + log L.
#include "common.cuh"
#include "mask.cuh"
#include "attn_core.cuh"

#include "mma.cuh"

constexpr int DECODE_WARPS = 4;
constexpr int DECODE_THREADS = DECODE_WARPS * 32;

// Per-block timeline of decode_tc for tools/decode_check.py `trace`, compiled only with
// -DDECODE_TRACE (the product's kernels do not contain it). Launch row b < DECODE_TRACE_ROWS
// writes decode_trace[b][slot] = %globaltimer (ns) at: 0 entry, 1 its first K/V copies issued
// (after the table loads they depend on), 2 its first stage landed, 3 its key loop done, 7 its
// warps' states in shared memory, 4 exit; slot 5 = its SM, slot 6 = 1 if it merged its row
// tile's partials.
#ifdef DECODE_TRACE
#define DECODE_TRACE_ROWS 8192
__device__ unsigned long long decode_trace[DECODE_TRACE_ROWS][8];
__device__ __forceinline__ void decode_mark(int slot, unsigned long long value = ~0ull) {
  if (threadIdx.x == 0 && blockIdx.x < DECODE_TRACE_ROWS) {
    if (value == ~0ull) asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(value));
    decode_trace[blockIdx.x][slot] = value;
  }
}
#define DECODE_MARK(...) decode_mark(__VA_ARGS__)
#else
#define DECODE_MARK(...)
#endif

// Per-instantiation shape constants; cuflash/_decode.py `shape_constants` mirrors them.
template <typename T, int HEAD_DIM, int ROWS>
struct DecodeShape {
  static constexpr int VEC = 16 / static_cast<int>(sizeof(T));  // elements per 16-byte load
  static constexpr int ROW_VECS = HEAD_DIM / VEC;                // 16-byte vectors per key row
  static constexpr int LK = ROW_VECS < 32 ? ROW_VECS : 32;        // lanes per key row
  static constexpr int NV = ROW_VECS / LK;                        // vectors per lane per key row
  static constexpr int COLS = NV * VEC;                           // columns per lane
  static constexpr int KPL = 32 / LK;                             // keys per warp load (slots)
  // Keys per lane per chunk: U * ROWS = 16 scores fill the reduce-scatter, U * NV <= 4 bounds the
  // registers of one K (or V) buffer to 16.
  static constexpr int U_ROWS = 16 / ROWS > 0 ? 16 / ROWS : 1;
  static constexpr int U_REGS = 4 / NV > 0 ? 4 / NV : 1;
  static constexpr int U = U_ROWS < U_REGS ? U_ROWS : U_REGS;
  static constexpr int NS = U * ROWS;   // scores per lane per chunk
  static constexpr int WC = KPL * U;    // keys per warp chunk
  static_assert(ROW_VECS >= 1 && ROW_VECS % LK == 0, "head-dim bucket");
  static_assert((LK & (LK - 1)) == 0 && (NS & (NS - 1)) == 0, "powers of two");
};

// ---- small helpers -----------------------------------------------------------------------------
#define POS_INF (-neg_inf<Acc>())

// Workspace reads of partials written by other blocks of this launch: L2 only (.cg), never a
// stale L1 line.
__device__ __forceinline__ float ld_cg(const float* p) { return __ldcg(p); }
__device__ __forceinline__ double ld_cg(const double* p) { return __ldcg(p); }

// K/V stream: read once, so no L1 allocation; ask L2 to fetch whole 256-byte lines.
__device__ __forceinline__ uint4 ld_stream(const void* p) {
  uint4 r;
  asm("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
      : "l"(p));
  return r;
}

// 16 bytes of a row starting at column col (a multiple of VEC); columns >= ncols read as 0.
// ALIGNED: the host proved 16-byte alignment and ncols % VEC == 0, so a vector is all in or out.
template <typename T, bool ALIGNED>
__device__ __forceinline__ uint4 load_vec(const T* row, int col, int ncols, bool key_ok) {
  constexpr int VEC = 16 / static_cast<int>(sizeof(T));
  if (ALIGNED) {
    if (key_ok && col < ncols) return ld_stream(row + col);
    return make_uint4(0u, 0u, 0u, 0u);
  } else {
    union {
      uint4 v;
      T e[VEC];
    } u;
    u.v = make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
    for (int e = 0; e < VEC; ++e)
      if (key_ok && col + e < ncols) u.e[e] = row[col + e];
    return u.v;
  }
}

// 16 bytes of storage -> VEC values in Acc (element e sits at byte e * sizeof(T)).
__device__ __forceinline__ void unpack(const uint4& w, float (&x)[8], bf16_t) {
  const unsigned u[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    x[2 * k] = __uint_as_float(u[k] << 16);            // bf16 is the top half of a float
    x[2 * k + 1] = __uint_as_float(u[k] & 0xffff0000u);
  }
}
__device__ __forceinline__ void unpack(const uint4& w, float (&x)[8], half_t) {
  const unsigned u[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
  for (int k = 0; k < 4; ++k)
    asm("{.reg .f16 lo, hi;\n\tmov.b32 {lo, hi}, %2;\n\tcvt.f32.f16 %0, lo;\n\tcvt.f32.f16 %1, hi;}"
        : "=f"(x[2 * k]), "=f"(x[2 * k + 1])
        : "r"(u[k]));
}
__device__ __forceinline__ void unpack(const uint4& w, float (&x)[4], float) {
  x[0] = __uint_as_float(w.x);
  x[1] = __uint_as_float(w.y);
  x[2] = __uint_as_float(w.z);
  x[3] = __uint_as_float(w.w);
}
__device__ __forceinline__ void unpack(const uint4& w, double (&x)[2], double) {
  x[0] = __hiloint2double(static_cast<int>(w.y), static_cast<int>(w.x));
  x[1] = __hiloint2double(static_cast<int>(w.w), static_cast<int>(w.z));
}
// One key row's NV 16-byte words (this lane's columns) as Acc values.
template <typename T, typename Acc, int NV, int VEC>
__device__ __forceinline__ void unpack_row(const uint4 (&w)[NV], Acc (&x)[NV * VEC]) {
#pragma unroll
  for (int n = 0; n < NV; ++n) {
    Acc part[VEC];
    unpack(w[n], part, T{});
#pragma unroll
    for (int e = 0; e < VEC; ++e) x[n * VEC + e] = part[e];
  }
}

// Sum v[0..NS) over the LK lanes of one key slot; afterwards every lane of the slot holds all NS
// totals. Reduce-scatter: at step s the lanes with bit s set keep the upper half of their values
// and add their partner's copy of it, so after S = log2(min(NS, LK)) steps a lane holds NH = NS >> S
// values starting at original index NH * bitrev_S(lane). Remaining lane bits (LK > NS) are summed
// by xor shuffles; a gather then reads each total from its owner.
__host__ __device__ constexpr int bitrev(int x, int bits) {
  return bits == 0 ? 0 : ((x & 1) << (bits - 1)) | bitrev(x >> 1, bits - 1);
}
__host__ __device__ constexpr int clog2(int x) { return x <= 1 ? 0 : 1 + clog2(x / 2); }

// Value select by predicate, kept as a select (selp): with a plain ?: on two array elements the
// compiler may select the ADDRESS instead and move the whole array to local memory.
__device__ __forceinline__ float select(bool p, float a, float b) {
  float r;
  asm("{.reg .pred q;\n\tsetp.ne.b32 q, %1, 0;\n\tselp.f32 %0, %2, %3, q;}"
      : "=f"(r) : "r"(static_cast<int>(p)), "f"(a), "f"(b));
  return r;
}
__device__ __forceinline__ double select(bool p, double a, double b) {
  double r;
  asm("{.reg .pred q;\n\tsetp.ne.b32 q, %1, 0;\n\tselp.f64 %0, %2, %3, q;}"
      : "=d"(r) : "r"(static_cast<int>(p)), "d"(a), "d"(b));
  return r;
}

template <typename Acc, int NS, int LK>
__device__ __forceinline__ void slot_allreduce(Acc (&v)[NS], int lane_in_slot) {
  constexpr int STEPS = clog2(NS < LK ? NS : LK);
  constexpr int NH = NS >> STEPS;
#pragma unroll
  for (int s = 0; s < STEPS; ++s) {
    const int half = NS >> (s + 1);
    const bool upper = (lane_in_slot >> s) & 1;
#pragma unroll
    for (int t = 0; t < NS / 2; ++t) {  // constant trip counts: every index folds to a constant
      if (t < half) {
        const Acc keep = select(upper, v[t + half], v[t]);
        const Acc send = select(upper, v[t], v[t + half]);
        v[t] = keep + __shfl_xor_sync(FULL_WARP, send, 1 << s, LK);
      }
    }
  }
#pragma unroll
  for (int b = STEPS; (1 << b) < LK; ++b) v[0] += __shfl_xor_sync(FULL_WARP, v[0], 1 << b, LK);
  Acc total[NS];
#pragma unroll
  for (int idx = 0; idx < NS; ++idx)
    total[idx] = __shfl_sync(FULL_WARP, v[idx % NH], bitrev(idx / NH, STEPS), LK);
#pragma unroll
  for (int idx = 0; idx < NS; ++idx) v[idx] = total[idx];
}

// One query row of a block: its (batch, head) (-1: padding row), position i, and visible keys
// already clipped to the block's item [k0, k1).
struct DecodeRow {
  long long bh, i, lo, hi;
};

// Fill rows[0..ROWS) for row tile `tile` of group g (threads < ROWS), then __syncthreads().
template <int ROWS>
__device__ __forceinline__ void setup_rows(DecodeRow* rows, const long long* __restrict__ groups,
                                           long long g, long long tile, int G, int Nq,
                                           const Window& w, long long k0, long long k1) {
  if (threadIdx.x < ROWS) {
    const long long rho = tile * ROWS + threadIdx.x;
    DecodeRow row;
    row.bh = -1;
    row.i = 0;
    row.lo = 0;
    row.hi = -1;
    if (rho < static_cast<long long>(G) * Nq) {
      row.i = rho / G;
      row.bh = groups[g * G + rho % G];
    }
    if (row.bh >= 0) {
      const KeyRange kr = key_range(w, row.i);
      row.lo = kr.lo > k0 ? kr.lo : k0;
      row.hi = kr.hi < k1 - 1 ? kr.hi : k1 - 1;
    }
    rows[threadIdx.x] = row;
  }
  __syncthreads();
}

// Merge the row tile's partials (the merge rule of cuflash.merge on the (m, l) pairs, in the
// workspace's units: NATURAL as the kernel that wrote them) and write out / lse. rows[] is set
// up; sM, sInv are ROWS-entry shared scratch (double only). CHUNK: partials loaded at once (float
// only; see below). The partials are read in slot order first .. first + n_items - 1 by a thread
// mapping that does not depend on the block, so the merge is bitwise the same whichever block
// runs it. A partial (+inf, 0) (visible keys, l == 0) is an identity like (-inf, 0) but makes the
// row visible: a row all of whose partials are identities is empty (0, -inf) only if none of
// them is (+inf, 0), else NaN.
template <typename T, typename Acc, int ROWS, bool NATURAL, int CHUNK = 16>
__device__ void combine_partials(T* __restrict__ out, Acc* __restrict__ lse,
                                 const Acc* __restrict__ ws_out, const Acc* __restrict__ ws_ml,
                                 long long first, int n_items, const DecodeRow* rows, Acc* sM,
                                 Acc* sInv, int Nq, int Dv) {
  if constexpr (sizeof(Acc) == 4) {
    // One pass, four columns of one row per thread (Dv % 4 == 0: the host takes this path only
    // for rows of whole 16-byte vectors, _decode.fits), the partials CHUNK at a time with all of
    // a chunk's loads in flight, merged with a running max as in the online softmax. This runs
    // after the last block of the row tile has finished its keys, so its L2 round trips are the
    // end of the kernel: ceil(n_items / CHUNK) of them, where a max pass and then a weighted-sum
    // pass would take 1 + ceil(n_items / 8). An identity partial (m = -inf or +inf) has an
    // unwritten ws_out row that may hold anything: its terms are dropped by a select, never
    // multiplied by 0. A NaN partial is kept: its weight (l = NaN) makes the row NaN; while every
    // partial so far is an identity the reference is 0, so -inf - (-inf) is never formed.
    // CHUNK: 16 for decode_split (24 and 32 made it spill on sm_80), 24 for decode_tc (B = 1:
    // 33 partials in 2 round trips instead of 3).
    const int C4 = Dv / 4;
    for (int idx = threadIdx.x; idx < ROWS * C4; idx += DECODE_THREADS) {
      const int r = idx / C4;
      const int col = (idx % C4) * 4;
      if (rows[r].bh < 0) continue;
      float M = NEG_INF, sum = 0.f, o[4] = {0.f, 0.f, 0.f, 0.f};
      bool visible = false;  // some partial's m is not -inf: the row has a visible key
      for (int it0 = 0; it0 < n_items; it0 += CHUNK) {
        float2 x[CHUNK];  // (m, l)
        float4 y[CHUNK];
#pragma unroll
        for (int c = 0; c < CHUNK; ++c) {
          const long long slot = (first + it0 + c) * ROWS + r;
          const bool in = it0 + c < n_items;
          x[c] = in ? __ldcg(reinterpret_cast<const float2*>(ws_ml) + slot)
                    : make_float2(NEG_INF, 0.f);
          y[c] = in ? __ldcg(reinterpret_cast<const float4*>(ws_out + slot * Dv + col))
                    : make_float4(0.f, 0.f, 0.f, 0.f);
        }
        float M_new = M;
#pragma unroll
        for (int c = 0; c < CHUNK; ++c) {
          visible |= x[c].x != NEG_INF;
          x[c].x = select(x[c].x == POS_INF, NEG_INF, x[c].x);  // +inf: an identity from here on
          M_new = fmaxf(M_new, x[c].x);
        }
        const float M_ref = M_new == NEG_INF ? 0.f : M_new;
        const float a = exp2_diff<NATURAL>(M - M_ref);  // 0 while M = -inf
        sum *= a;
#pragma unroll
        for (int e = 0; e < 4; ++e) o[e] *= a;
#pragma unroll
        for (int c = 0; c < CHUNK; ++c) {
          const bool ok = x[c].x != NEG_INF;
          const float w = select(ok, x[c].y * exp2_diff<NATURAL>(x[c].x - M_ref), 0.f);
          sum += w;
          o[0] += select(ok, w * y[c].x, 0.f);
          o[1] += select(ok, w * y[c].y, 0.f);
          o[2] += select(ok, w * y[c].z, 0.f);
          o[3] += select(ok, w * y[c].w, 0.f);
        }
        M = M_new;
      }
      // sum == 0 with a visible key: every partial an identity, one of them (+inf, 0) (0 / 0)
      const bool zero = sum == 0.f;
      const float inv = !visible ? 0.f : (zero ? quiet_nan<float>() : 1.f / sum);
      const long long row_out = rows[r].bh * Nq + rows[r].i;
      T* dst = out + row_out * Dv + col;
#pragma unroll
      for (int e = 0; e < 4; ++e) store_acc(dst + e, o[e] * inv);
      if (col == 0)
        lse[row_out] = !visible ? NEG_INF
                                : (zero ? quiet_nan<float>() : natural_lse<NATURAL>(M, sum));
    }
  } else {
    // double: exp2 is a call, and values kept live across unrolled calls spill. Two passes: per
    // row (one warp) the max M and sum of l_i exp2(m_i - M) over the non-identity partials (a
    // running pair per lane, merged over the warp; identities never form -inf - (-inf)) and
    // whether any partial is not (-inf, 0), then one column per thread, one item at a time; an
    // identity partial's unwritten ws_out row is never read.
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    for (int r = warp; r < ROWS; r += DECODE_WARPS) {
      if (rows[r].bh < 0) continue;  // padding rows have no partials (warp-uniform)
      Acc M = NEG_INF, sum = Acc(0);
      bool visible = false;
      for (int it = lane; it < n_items; it += 32) {
        const long long slot = (first + it) * ROWS + r;
        const Acc x = ld_cg(ws_ml + 2 * slot);
        visible |= x != NEG_INF;
        if (!(x > NEG_INF && x < POS_INF)) continue;  // an identity
        const Acc l = ld_cg(ws_ml + 2 * slot + 1);  // NaN: propagates
        if (x > M) {
          sum = (M > NEG_INF ? sum * exp2_diff<NATURAL>(M - x) : Acc(0)) + l;
          M = x;
        } else {
          sum += l * exp2_diff<NATURAL>(x - M);
        }
      }
#pragma unroll
      for (int o = 16; o > 0; o /= 2) {
        const Acc M_o = __shfl_xor_sync(FULL_WARP, M, o);
        const Acc s_o = __shfl_xor_sync(FULL_WARP, sum, o);
        const Acc M_n = acc_max(M, M_o);
        sum = (M > NEG_INF ? sum * exp2_diff<NATURAL>(M - M_n) : Acc(0)) +
              (M_o > NEG_INF ? s_o * exp2_diff<NATURAL>(M_o - M_n) : Acc(0));
        M = M_n;
      }
      visible = __any_sync(FULL_WARP, visible);
      if (lane == 0) {
        const bool zero = !(M > NEG_INF);  // no partial but identities (with a visible key: NaN)
        sM[r] = M;
        sInv[r] = !visible ? Acc(0) : (zero ? quiet_nan<Acc>() : Acc(1) / sum);
        lse[rows[r].bh * Nq + rows[r].i] =
            !visible ? NEG_INF : (zero ? quiet_nan<Acc>() : natural_lse<NATURAL>(M, sum));
      }
    }
    __syncthreads();
    for (int idx = threadIdx.x; idx < ROWS * Dv; idx += DECODE_THREADS) {
      const int r = idx / Dv;
      const int col = idx % Dv;
      if (rows[r].bh < 0) continue;
      const Acc M = sM[r];
      Acc o = Acc(0);
      if (M > NEG_INF) {
#pragma unroll 1
        for (int it = 0; it < n_items; ++it) {
          const long long slot = (first + it) * ROWS + r;
          const Acc x = ld_cg(ws_ml + 2 * slot);
          if (x > NEG_INF && x < POS_INF)
            o += ld_cg(ws_ml + 2 * slot + 1) * exp2_diff<NATURAL>(x - M) *
                 ld_cg(ws_out + slot * Dv + col);
        }
      }
      store_acc(out + (rows[r].bh * Nq + rows[r].i) * Dv + col, o * sInv[r]);
    }
  }
}

// Keys any row of the block sees (union [blo, bhi]) and keys every valid row sees (intersection
// [flo, fhi]: chunks inside it need no per-element test). Padding rows count in neither.
struct BlockKeys {
  long long blo, bhi, flo, fhi;
};
template <int ROWS>
__device__ __forceinline__ BlockKeys block_keys(const DecodeRow* rows, long long k0, long long k1) {
  BlockKeys b{k1, k0 - 1, k0, k1 - 1};
  bool any_row = false;
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    if (rows[r].bh < 0) continue;
    any_row = true;
    if (rows[r].lo <= rows[r].hi) {
      b.blo = rows[r].lo < b.blo ? rows[r].lo : b.blo;
      b.bhi = rows[r].hi > b.bhi ? rows[r].hi : b.bhi;
    }
    b.flo = rows[r].lo > b.flo ? rows[r].lo : b.flo;
    b.fhi = rows[r].hi < b.fhi ? rows[r].hi : b.fhi;
  }
  if (!any_row) b.fhi = b.flo - 1;
  return b;
}

// The end of every split block: merge the DECODE_WARPS warps' states (red_m, red_l: max and sum
// per row in the block's units, NATURAL as the kernel; red_acc [warp][row][red_stride]:
// unnormalized output) and normalize once; write the result (a row tile with one item) or this
// item's partial (the header's "Results per item"), and with `fused` let the last block of the
// row tile merge the partials. Called after a __syncthreads. Row r has a visible key in this item
// iff its position range (rows[r].lo <= rows[r].hi) is not empty and bit r of vis_mb is set:
// decode_split with mask / bias passes the OR of visible_logit over the row's elements, the
// kernels without pass ~0u. Emptiness is decided by that, never by l: l == 0 with a visible key
// means every visible logit was -inf (NaN, or (+inf, 0) in the workspace), and a NaN l gives NaN.
// First the per-row factors, once per row (red_m[w][r] becomes warp w's weight exp2(m_w - M)),
// then V columns per thread (V = 4: red_acc rows, red_stride and Dv multiples of 4 floats, 16-byte
// aligned; the host's whole-vector rule, _decode.fits): no element recomputes its row's max and
// weights (a chain of shared loads, exp2 and a division per element).
// sKeep, sInv: ROWS-entry shared scratch (sKeep[r] = 1 where the row's output is o * sInv[r]; 0
// where it is 0 (a result) or not written (an identity partial)).
template <typename T, typename Acc, int ROWS, bool NATURAL, int V = 1, int CHUNK = 16>
__device__ __forceinline__ void finish_item(
    T* __restrict__ out, Acc* __restrict__ lse, Acc* __restrict__ ws_out,
    Acc* __restrict__ ws_ml, unsigned* __restrict__ counters, const DecodeRow* rows,
    const Acc* red_acc, int red_stride, Acc (&red_m)[DECODE_WARPS][ROWS],
    const Acc (&red_l)[DECODE_WARPS][ROWS], Acc (&sKeep)[ROWS], Acc (&sInv)[ROWS], int& s_last,
    unsigned vis_mb, long long item, long long tile_id, long long first, int n_items, int Nq,
    int Dv, int fused) {
  static_assert(V == 1 || (V == 4 && sizeof(Acc) == 4), "V: 1, or 4 floats");
  if (threadIdx.x < ROWS) {
    const int r = threadIdx.x;
    Acc M = NEG_INF;
#pragma unroll
    for (int w = 0; w < DECODE_WARPS; ++w) M = acc_max(M, red_m[w][r]);
    const Acc M_ref = M == NEG_INF ? Acc(0) : M;  // no warp saw a finite logit: no -inf - (-inf)
    Acc l_sum = Acc(0);
#pragma unroll
    for (int w = 0; w < DECODE_WARPS; ++w) {
      const Acc a = exp2_diff<NATURAL>(red_m[w][r] - M_ref);  // 0 for a warp with m = -inf
      red_m[w][r] = a;
      l_sum += a * red_l[w][r];
    }
    const bool visible = rows[r].lo <= rows[r].hi && ((vis_mb >> r) & 1u);
    const bool zero = l_sum == Acc(0);  // (with a visible key) every visible logit was -inf
    sKeep[r] = (visible && (n_items == 1 || !zero)) ? Acc(1) : Acc(0);
    sInv[r] = !visible ? Acc(0) : (zero ? quiet_nan<Acc>() : Acc(1) / l_sum);
    const long long bh = rows[r].bh;
    if (bh >= 0) {
      if (n_items == 1) {
        lse[bh * Nq + rows[r].i] =
            !visible ? NEG_INF : (zero ? quiet_nan<Acc>() : natural_lse<NATURAL>(M, l_sum));
      } else {
        // m of a kept partial is finite: M, or 0 where l is NaN and M is not finite (+inf gives
        // l = NaN; -inf with a visible key gives l = 0 or NaN)
        const bool finite_m = M > NEG_INF && M < POS_INF;
        Acc* ml = ws_ml + 2 * (item * ROWS + r);
        ml[0] = !visible ? NEG_INF : (zero ? POS_INF : (finite_m ? M : Acc(0)));
        ml[1] = visible && !zero ? l_sum : Acc(0);
      }
    }
  }
  __syncthreads();
  const int CV = Dv / V;
  for (int idx = threadIdx.x; idx < ROWS * CV; idx += DECODE_THREADS) {
    const int r = idx / CV;
    const int col = (idx % CV) * V;
    const long long bh = rows[r].bh;
    if (bh < 0) continue;
    Acc o[V];
#pragma unroll
    for (int e = 0; e < V; ++e) o[e] = Acc(0);
#pragma unroll
    for (int w = 0; w < DECODE_WARPS; ++w) {
      const Acc a = red_m[w][r];
      const Acc* x = red_acc + (w * ROWS + r) * red_stride + col;
      if constexpr (V == 4) {
        const float4 y = *reinterpret_cast<const float4*>(x);
        o[0] += a * y.x;
        o[1] += a * y.y;
        o[2] += a * y.z;
        o[3] += a * y.w;
      } else {
        o[0] += a * x[0];
      }
    }
    const Acc inv = sInv[r];
    const bool keep = sKeep[r] != Acc(0);
    if (n_items == 1) {
      // a row with no visible key writes exactly 0 (o may hold 0 * NaN from a v it does not see)
#pragma unroll
      for (int e = 0; e < V; ++e) {
        store_acc(out + (bh * Nq + rows[r].i) * Dv + col + e, keep ? o[e] * inv : Acc(0));
      }
    } else if (keep) {
      Acc* dst = ws_out + (item * ROWS + r) * Dv + col;
      if constexpr (V == 4)
        *reinterpret_cast<float4*>(dst) =
            make_float4(o[0] * inv, o[1] * inv, o[2] * inv, o[3] * inv);
      else
        dst[0] = o[0] * inv;
    }
  }
  if (n_items == 1 || !fused) return;

  // Fused combine: the last block of the row tile to finish merges all of its partials. The
  // count is one acquire-release atomic of thread 0 after a barrier (the pattern of CUTLASS's
  // semaphores): the barrier orders the block's partial stores before the release, the acquire
  // orders the other blocks' partials before the barrier that lets this block read them. Which
  // block merges does not change the result (combine_partials reads the slots in order).
  __syncthreads();
  if (threadIdx.x == 0) {
    unsigned done;
    asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], 1;"
                 : "=r"(done) : "l"(counters + tile_id) : "memory");
    s_last = (done == static_cast<unsigned>(n_items - 1));
  }
  __syncthreads();
  if (!s_last) return;
  combine_partials<T, Acc, ROWS, NATURAL, CHUNK>(out, lse, ws_out, ws_ml, first, n_items, rows,
                                                 sKeep, sInv, Nq, Dv);
  if (threadIdx.x == 0) counters[tile_id] = 0u;  // ready for the next launch on this stream
}

// ---- the split kernel --------------------------------------------------------------------------
// Tables (int64): offsets (5, BH) rows q, k, v, mask, bias as in DESIGN.md "Kernel ABI";
// lens (BH) valid keys per (batch, head) (valid_keys); groups (n_groups, G); tiles (n_tiles, 4) =
// (group, tile index, first item, item count); items (n_items, ITEM_COLS) = (row tile, k0, k1,
// item, k offset, v offset) in launch order: a block runs a row of the table (decode_split: row
// b; decode_tc: the rows of its snake_row sequence) and writes workspace slot `item` (a tile's
// items keep consecutive slots), so the host may launch long items first. The k and v offsets
// (elements, of the group's kv head) let decode_tc request its first keys after one table load.
// The kernel parameter list shared by decode_split (Acc: its accumulator type) and decode_tc
// (float; it appends n_launch and device_lens), and the matching argument list.
#define DECODE_PARAMS(Acc)                                                                   \
  const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,                 \
      T* __restrict__ out, Acc* __restrict__ lse, Acc* __restrict__ ws_out,                  \
      Acc* __restrict__ ws_ml, unsigned* __restrict__ counters,                              \
      const long long* __restrict__ offsets, const long long* __restrict__ lens,             \
      const void* __restrict__ kv_lens, const long long* __restrict__ lens_map, int lens_bytes,  \
      const long long* __restrict__ groups, const long long* __restrict__ tiles,             \
      const long long* __restrict__ items, const unsigned char* __restrict__ mask,           \
      const Acc* __restrict__ bias, long long q_rs, long long k_rs, long long v_rs,          \
      long long mask_rs, long long mask_cs, long long bias_rs, long long bias_cs, int BH,    \
      int Nq, int Dk, int Dv, int G, Acc scale, int left, int right, int bottom_right, int fused
#define DECODE_ARGS_KV(KV)                                                                   \
  q, k, v, out, lse, ws_out, ws_ml, counters, offsets, lens, KV, lens_map, lens_bytes,        \
      groups, tiles, items, mask, bias,                                                      \
      q_rs, k_rs, v_rs, mask_rs, mask_cs, bias_rs, bias_cs, BH, Nq, Dk, Dv, G, scale, left,    \
      right, bottom_right, fused
#define DECODE_ARGS DECODE_ARGS_KV(kv_lens)

// Host kv_lens by value: up to HOST_LENS_MAX of the caller's lengths in the launch's parameters
// (every kernel's last, `host_lens`), read like a CuPy kv_lens of int64 (lens_map[bh] its
// element) when lens_bytes < 0: a token loop's new lengths need no copy to the device, and a
// captured graph keeps its call's values (cuflash/_decode.py HostLens, _validate.LENS_VALUES_MAX).
constexpr int HOST_LENS_MAX = 64;
struct alignas(16) HostLens {
  long long v[HOST_LENS_MAX];
};
#define DECODE_HOST_LENS const __grid_constant__ HostLens host_lens
// The lengths the kernel reads: the caller's CuPy kv_lens, or the values in its parameters.
#define DECODE_LENS_SOURCE                                                                   \
  (lens_bytes < 0 ? static_cast<const void*>(host_lens.v) : kv_lens)

// The valid keys of (batch, head) bh: lens[bh], the host's lengths (the plan's, or this call's
// copy), or with the caller's CuPy kv_lens (lens_bytes: its element size, 4 or 8; or -1: the
// host's values in the launch's parameters, int64, HostLens) its element lens_map[bh] clamped to
// [0, lens[bh]] (the plan then holds the largest length it serves there: Nk for a CuPy kv_lens).
// Read on the device, never checked on the host: out-of-range lengths clamp (DESIGN.md "Lengths
// on the device").
__device__ __forceinline__ long long valid_keys(const long long* __restrict__ lens,
                                                const void* __restrict__ kv_lens,
                                                const long long* __restrict__ lens_map,
                                                int lens_bytes, long long bh) {
  const long long n = lens[bh];
  if (lens_bytes == 0) return n;
  const long long x = lens_bytes == 4 ? static_cast<const int*>(kv_lens)[lens_map[bh]]
                                      : static_cast<const long long*>(kv_lens)[lens_map[bh]];
  return x < 0 ? 0 : (x > n ? n : x);
}

// One block's work: row `launch_row` of the items table and its row tile.
constexpr int ITEM_COLS = 6;  // cuflash/_decode.py Schedule.items_table
struct DecodeItem {
  long long tile_id, item, k0, k1, g, tile, first;
  int n_items;
};
template <int COLS = ITEM_COLS>
__device__ __forceinline__ DecodeItem read_item(const long long* __restrict__ items,
                                                const long long* __restrict__ tiles,
                                                long long launch_row) {
  DecodeItem it;
  it.tile_id = items[COLS * launch_row];
  it.k0 = items[COLS * launch_row + 1];
  it.k1 = items[COLS * launch_row + 2];
  it.item = items[COLS * launch_row + 3];
  it.g = tiles[4 * it.tile_id];
  it.tile = tiles[4 * it.tile_id + 1];
  it.first = tiles[4 * it.tile_id + 2];
  it.n_items = static_cast<int>(tiles[4 * it.tile_id + 3]);
  return it;
}

// An item's keys at the length the kernel reads. The host plans a row tile's items as pieces of
// the tile's key extent at the plan's length lens[bh] (a CuPy kv_lens: Nk). With a shorter length
// read at run time (valid_keys: a CuPy kv_lens, or host lengths inside a plan's span) the extent
// shrinks, and each item keeps its share of it: a bound k maps from the plan's extent [E0, E1) to
// the valid one [e0, e1) in proportion, rounded down to a multiple of A keys (the kernel's key
// pass), with E0 -> e0 and E1 -> e1 exactly. The items then still partition the extent, each with
// its share of the work (held at the plan's bounds, the later items of a short sequence were
// empty and its first ones did it all), and the result depends only on the lengths. At the plan's
// length, or where the plan's extent is empty, the host's bounds stand.
struct ItemKeys {
  long long k0, k1;
};
template <int ROWS, int A>
__device__ __forceinline__ ItemKeys item_keys(long long k0, long long k1, long long tile, int G,
                                              int Nq, long long plan_len, long long len,
                                              int left, int right, int bottom_right) {
  if (len == plan_len) return ItemKeys{k0, k1};
  const long long i0 = tile * ROWS / G;  // the tile's first and last query (rows query-major)
  const long long last = (tile + 1) * ROWS < static_cast<long long>(G) * Nq
                             ? (tile + 1) * ROWS - 1 : static_cast<long long>(G) * Nq - 1;
  const KeyRange P =
      tile_key_range(make_window(Nq, plan_len, left, right, bottom_right), i0, last / G);
  const KeyRange V = tile_key_range(make_window(Nq, len, left, right, bottom_right), i0, last / G);
  const long long E0 = P.lo, E1 = P.hi + 1, e0 = V.lo, e1 = V.hi + 1 > e0 ? V.hi + 1 : e0;
  if (E1 <= E0) return ItemKeys{k0, k1};
  auto at = [&](long long k) -> long long {
    if (k <= E0) return e0;
    if (k >= E1) return e1;
    const long long x = (e0 + (k - E0) * (e1 - e0) / (E1 - E0)) / A * A;
    return x > e0 ? x : e0;
  };
  return ItemKeys{at(k0), at(k1)};
}

// Paged K/V (cuflash/_paged.py): the kernels' `Pages` argument. NoPages: k and v hold each kv
// head's keys as rows of stride k_rs / v_rs (the offsets table gives the head's first row).
// PagedKV: key j of the block's sequence is row j % page_size of page table[j / page_size] (a
// shift where page_size is a power of two), the page clamped to [0, last_page] (a CuPy table is
// never checked on the host); the offsets table then gives the kv head's offset within a page,
// and the items table carries a 7th column, the sequence's row offset in the block table.
struct NoPages {
  static constexpr bool PAGED = false;
  static constexpr int ITEM_COLS = ::ITEM_COLS;
};
struct KeyAt {
  long long k, v;  // the key row's offsets in the k and v pools (elements)
};
struct PagedKV {
  static constexpr bool PAGED = true;
  static constexpr int ITEM_COLS = ::ITEM_COLS + 1;
  const int* __restrict__ table;
  long long k_ps, v_ps;  // page strides (elements)
  int page_size, page_shift, last_page;  // page_shift: log2(page_size), or -1
  // The page of key j (< 2^31) of the sequence whose block-table row is `row`.
  __device__ __forceinline__ int page(const int* row, int j) const {
    const int p = __ldg(row + (page_shift >= 0 ? j >> page_shift : j / page_size));
    return p < 0 ? 0 : (p > last_page ? last_page : p);
  }
  // The pools' offsets of key j on its page.
  __device__ __forceinline__ KeyAt offsets(int page, int j, long long k_rs,
                                           long long v_rs) const {
    const int r = page_shift >= 0 ? j & (page_size - 1) : j % page_size;
    return KeyAt{page * k_ps + r * k_rs, page * v_ps + r * v_rs};
  }
  __device__ __forceinline__ KeyAt at(const int* row, int j, long long k_rs,
                                      long long v_rs) const {
    return offsets(page(row, j), j, k_rs, v_rs);
  }
};
// The paged kernels' trailing parameters, and PagedKV from them.
#define DECODE_PAGED_PARAMS                                                                  \
  const int* __restrict__ page_table, long long k_page_stride, long long v_page_stride,      \
      int page_size, int page_shift, int num_pages
#define DECODE_PAGED_ARG                                                                     \
  PagedKV { page_table, k_page_stride, v_page_stride, page_size, page_shift, num_pages - 1 }

// SIMT split kernel (every dtype, head dims <= 256, masks and bias, the score transform F in
// natural units): DECODE_WARPS warps stream disjoint warp chunks of keys from global memory into a
// register double buffer (see the header). The body of decode_split and decode_split_paged.
template <typename T, typename Acc, int HEAD_DIM, int ROWS, bool HAS_MB, bool ALIGNED,
          typename F, typename Pages>
__device__ __forceinline__ void decode_split_body(DECODE_PARAMS(Acc), double mod0, double mod1,
                                                  const double* __restrict__ mod_table,
                                                  const Pages pg) {
  __shared__ DecodeRow rows[ROWS];
  __shared__ Acc red_acc[DECODE_WARPS][ROWS][HEAD_DIM];
  __shared__ Acc red_m[DECODE_WARPS][ROWS], red_l[DECODE_WARPS][ROWS];
  __shared__ Acc sM[ROWS], sInv[ROWS];
  __shared__ int s_last;
  __shared__ unsigned red_vis[DECODE_WARPS];  // HAS_MB: per warp, bit r = row r saw a visible key
  using Shape = DecodeShape<T, HEAD_DIM, ROWS>;
  constexpr int VEC = Shape::VEC, LK = Shape::LK, NV = Shape::NV, COLS = Shape::COLS;
  constexpr int KPL = Shape::KPL, U = Shape::U, NS = Shape::NS, WC = Shape::WC;
  constexpr long long STRIDE = static_cast<long long>(WC) * DECODE_WARPS;  // keys per block pass
  // A score modifier (mask, bias or transform): the logits, maxima and partials in natural units.
  constexpr bool NATURAL = HAS_MB || !F::IDENTITY;
  const F xf = F::make(FLAT_MOD_ARGS, 0, Acc(1));  // the score transform, natural units

  const DecodeItem it = read_item<Pages::ITEM_COLS>(items, tiles, blockIdx.x);
  const long long bh0 = groups[it.g * G];  // every group's first member exists
  const long long len = valid_keys(lens, kv_lens, lens_map, lens_bytes, bh0);
  const Window win = make_window(Nq, len, left, right, bottom_right);
  const ItemKeys ik = item_keys<ROWS, static_cast<int>(STRIDE)>(
      it.k0, it.k1, it.tile, G, Nq, lens[bh0], len, left, right, bottom_right);
  setup_rows<ROWS>(rows, groups, it.g, it.tile, G, Nq, win, ik.k0, ik.k1);
  const BlockKeys bk = block_keys<ROWS>(rows, ik.k0, ik.k1);
  const long long blo = bk.blo, bhi = bk.bhi, flo = bk.flo, fhi = bk.fhi;
  // A POSITIONAL transform (ALiBi) per row: a block's rows are the heads of a GQA group, each with
  // its own slope (a padding row, bh < 0, reads none); the others one for all rows (xf).
  F xh[F::POSITIONAL ? ROWS : 1];
  if constexpr (F::POSITIONAL) {
#pragma unroll
    for (int r = 0; r < ROWS; ++r)
      xh[r] = F::make(at_head(FLAT_MOD_ARGS, rows[r].bh, win.shift), 0, Acc(1));
  }

  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int slot = lane / LK;  // which key of a warp load
  const int t = lane % LK;     // which 16-byte column vector(s) of it

  // q rows, pre-scaled into the base-2 domain (natural units with a modifier, the header says
  // why); padding rows and columns >= Dk are 0.
  Acc qr[ROWS][COLS];
  const Acc qscale = NATURAL ? scale : scale * log2e<Acc>();
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    const long long bh = rows[r].bh;
    const T* qrow = q + (bh >= 0 ? offsets[bh] + rows[r].i * q_rs : 0);
#pragma unroll
    for (int n = 0; n < NV; ++n)
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        const int col = (n * LK + t) * VEC + e;
        qr[r][n * VEC + e] = (bh >= 0 && col < Dk) ? to_acc(qrow[col]) * qscale : Acc(0);
      }
  }
  const T* kh = k + offsets[1 * BH + bh0];
  const T* vh = v + offsets[2 * BH + bh0];
  const int* trow = nullptr;  // paged: the sequence's block-table row
  if constexpr (Pages::PAGED) trow = pg.table + items[Pages::ITEM_COLS * blockIdx.x + 6];

  // Per-row state (DESIGN.md "Empty state"), per key slot: the online softmax (m = -inf, l = 0)
  // and acc = 0; with mask / bias also vis (bit r: row r has seen a visible key; m and l cannot
  // tell, a visible logit may be -inf).
  RowSoftmax<Acc, NATURAL, ROWS> sm;
  Acc acc[ROWS][COLS];
  unsigned vis = 0u;
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    sm.init(r);
#pragma unroll
    for (int c = 0; c < COLS; ++c) acc[r][c] = Acc(0);
  }

  struct Frag {
    uint4 k[U][NV], v[U][NV];
  };
  // Load the warp chunk starting at key `base`; keys past bhi and columns past Dk / Dv read 0.
  auto load = [&](Frag& f, long long base) {
    const long long j = base + slot;
    if constexpr (Pages::PAGED) {
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const bool ok = j + u * KPL <= bhi;
        // the key's page and row (no table read past bhi)
        const KeyAt a = ok ? pg.at(trow, static_cast<int>(j + u * KPL), k_rs, v_rs) : KeyAt{0, 0};
#pragma unroll
        for (int n = 0; n < NV; ++n) {
          const int col = (n * LK + t) * VEC;
          f.k[u][n] = load_vec<T, ALIGNED>(kh + a.k, col, Dk, ok);
          f.v[u][n] = load_vec<T, ALIGNED>(vh + a.v, col, Dv, ok);
        }
      }
      return;
    }
    const T* krow = kh + j * k_rs;
    const T* vrow = vh + j * v_rs;
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const bool ok = j + u * KPL <= bhi;
#pragma unroll
      for (int n = 0; n < NV; ++n) {
        const int col = (n * LK + t) * VEC;
        f.k[u][n] = load_vec<T, ALIGNED>(krow + u * KPL * k_rs, col, Dk, ok);
        f.v[u][n] = load_vec<T, ALIGNED>(vrow + u * KPL * v_rs, col, Dv, ok);
      }
    }
  };

  auto step = [&](const Frag& f, long long base) {
    // Scores: partial dot products over this lane's columns, then summed over the slot's lanes.
    Acc s[NS];  // s[u * ROWS + r]
#pragma unroll
    for (int u = 0; u < U; ++u) {
      Acc kx[COLS];
      unpack_row<T, Acc, NV, VEC>(f.k[u], kx);
#pragma unroll
      for (int r = 0; r < ROWS; ++r) {
        Acc d = Acc(0);
#pragma unroll
        for (int c = 0; c < COLS; ++c) d += qr[r][c] * kx[c];
        s[u * ROWS + r] = d;
      }
    }
    slot_allreduce<Acc, NS, LK>(s, t);

    // Mask by global position only where some key of the chunk may be invisible to some row; a
    // transform applies to every visible logit, the interior chunks' too.
    const bool interior = !HAS_MB && base >= flo && base + WC - 1 <= fhi;
    if (!interior) {
#pragma unroll
      for (int r = 0; r < ROWS; ++r) {
        KeyRange kr;
        kr.lo = rows[r].lo;
        kr.hi = rows[r].hi;
        // Padding rows (bh < 0: no head) and kernels without mask / bias read neither.
        MaskBias<Acc> mb{nullptr, mask_rs, mask_cs, nullptr, bias_rs, bias_cs};
        if (HAS_MB && rows[r].bh >= 0)
          mb = head_mask_bias(mask, bias, offsets, BH, rows[r].bh, mask_rs, mask_cs, bias_rs,
                              bias_cs);
#pragma unroll
        for (int u = 0; u < U; ++u) {
          const long long j = base + u * KPL + slot;
          Acc& x = s[u * ROWS + r];
          if (NATURAL) {  // natural units: F applied, the bias added as it is
            Acc g = Acc(1);  // F's derivative: unused (the forward)
            if (visible_logit(x, rows[r].i, j, kr, mb, F::POSITIONAL ? xh[F::POSITIONAL ? r : 0] : xf, g))
              vis |= 1u << r;
            else
              x = NEG_INF;
          } else {
            x = masked_logit(x, rows[r].i, j, kr, mb);  // range test only; x unchanged if visible
          }
        }
      }
    } else if constexpr (!F::IDENTITY) {
#pragma unroll
      for (int r = 0; r < ROWS; ++r)
#pragma unroll
        for (int u = 0; u < U; ++u)
          s[u * ROWS + r] = (F::POSITIONAL ? xh[F::POSITIONAL ? r : 0] : xf)(s[u * ROWS + r], rows[r].i,
                                                                         base + u * KPL + slot);
    }

    // Online softmax per row (RowSoftmax): new max, rescale BOTH l and acc, add this chunk's
    // mass. No test on the logits: an invisible key's -inf gives p = 0.
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      Acc tile_max = s[r];
#pragma unroll
      for (int u = 1; u < U; ++u) tile_max = acc_max(tile_max, s[u * ROWS + r]);
      const Acc m_ref = sm.advance(r, tile_max);
#pragma unroll
      for (int c = 0; c < COLS; ++c) acc[r][c] *= sm.alpha[r];
#pragma unroll
      for (int u = 0; u < U; ++u) s[u * ROWS + r] = sm.accumulate(r, s[u * ROWS + r], m_ref);
    }

    // acc += P V over the chunk's keys (this lane's columns).
#pragma unroll
    for (int u = 0; u < U; ++u) {
      Acc vx[COLS];
      unpack_row<T, Acc, NV, VEC>(f.v[u], vx);
#pragma unroll
      for (int r = 0; r < ROWS; ++r)
#pragma unroll
        for (int c = 0; c < COLS; ++c) acc[r][c] += s[u * ROWS + r] * vx[c];
    }
  };

  // Stream the warp's chunks with the next one in flight while the current one is computed.
  long long b0 = blo + warp * WC;
  if (b0 <= bhi) {
    Frag fa, fb;
    load(fa, b0);
    for (;;) {
      const long long b1 = b0 + STRIDE;
      if (b1 <= bhi) load(fb, b1);
      step(fa, b0);
      if (b1 > bhi) break;
      const long long b2 = b1 + STRIDE;
      if (b2 <= bhi) load(fa, b2);
      step(fb, b1);
      if (b2 > bhi) break;
      b0 = b2;
    }
  }
  // Merge the key slots of the warp (lanes that differ in the bits above LK).
#pragma unroll
  for (int off = LK; off < 32; off *= 2) {
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      const auto w = sm.merge_xor(r, off);
#pragma unroll
      for (int c = 0; c < COLS; ++c)
        acc[r][c] = acc[r][c] * w.self + __shfl_xor_sync(FULL_WARP, acc[r][c], off) * w.other;
    }
  }
  if (slot == 0) {
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
#pragma unroll
      for (int n = 0; n < NV; ++n)
#pragma unroll
        for (int e = 0; e < VEC; ++e) red_acc[warp][r][(n * LK + t) * VEC + e] = acc[r][n * VEC + e];
      if (t == 0) {
        red_m[warp][r] = sm.m[r];
        red_l[warp][r] = sm.l[r];
      }
    }
  }
  if (HAS_MB) {
    vis = __reduce_or_sync(FULL_WARP, vis);
    if (lane == 0) red_vis[warp] = vis;
  }
  __syncthreads();
  unsigned vis_mb = ~0u;  // no mask / bias: the rows' position ranges decide (finish_item)
  if (HAS_MB) {
    vis_mb = 0u;
#pragma unroll
    for (int w = 0; w < DECODE_WARPS; ++w) vis_mb |= red_vis[w];
  }

  finish_item<T, Acc, ROWS, NATURAL>(out, lse, ws_out, ws_ml, counters, rows, &red_acc[0][0][0],
                                     HEAD_DIM, red_m, red_l, sM, sInv, s_last, vis_mb, it.item,
                                     it.tile_id, it.first, it.n_items, Nq, Dv, fused);
}

template <typename T, typename Acc, int HEAD_DIM, int ROWS, bool HAS_MB, bool ALIGNED,
          typename F = NoTransform>
__global__ void __launch_bounds__(DECODE_THREADS, MIN_BLOCKS_PER_SM)
decode_split(DECODE_PARAMS(Acc), double mod0, double mod1, const double* __restrict__ mod_table,
             DECODE_HOST_LENS) {
  decode_split_body<T, Acc, HEAD_DIM, ROWS, HAS_MB, ALIGNED, F>(
      DECODE_ARGS_KV(DECODE_LENS_SOURCE), mod0, mod1, mod_table, NoPages{});
}

// decode_split on a paged KV cache (k, v the page pools).
template <typename T, typename Acc, int HEAD_DIM, int ROWS, bool HAS_MB, bool ALIGNED,
          typename F = NoTransform>
__global__ void __launch_bounds__(DECODE_THREADS, MIN_BLOCKS_PER_SM)
decode_split_paged(DECODE_PARAMS(Acc), double mod0, double mod1,
                   const double* __restrict__ mod_table, DECODE_PAGED_PARAMS, DECODE_HOST_LENS) {
  decode_split_body<T, Acc, HEAD_DIM, ROWS, HAS_MB, ALIGNED, F>(
      DECODE_ARGS_KV(DECODE_LENS_SOURCE), mod0, mod1, mod_table, DECODE_PAGED_ARG);
}

// decode_tc's stage copy: keys [row0, row0 + ROWS) of a (row stride rs) matrix into padded shared
// rows (HEAD_DIM + 8 elements), 16 bytes per cp.async with a 128-byte L2 prefetch hint (faster
// than none or 256 bytes); keys >= limit become zeros.
template <int ROWS, int HEAD_DIM, typename T>
__device__ __forceinline__ void cp_keys(unsigned dst, const T* __restrict__ src, long long rs,
                                        int row0, int limit) {
  constexpr int CPR = HEAD_DIM / 8;  // 16-byte chunks per row
  constexpr int ROW_BYTES = (HEAD_DIM + 8) * 2;
  constexpr int RPI = DECODE_THREADS / CPR;
  static_assert(DECODE_THREADS % CPR == 0 && ROWS % RPI == 0, "cp_keys: rows must divide the block");
  const int r_thr = threadIdx.x / CPR, c_thr = threadIdx.x % CPR;
  const T* p = src + static_cast<long long>(row0 + r_thr) * rs + c_thr * 8;
  const unsigned d = dst + r_thr * ROW_BYTES + c_thr * 16;
  const int rem = limit - row0 - r_thr;  // copy `it` reads a real row iff it * RPI < rem
#pragma unroll
  for (int it = 0; it < ROWS / RPI; ++it) {
    const bool ok = it * RPI < rem;
    const void* g = ok ? static_cast<const void*>(p + it * RPI * rs) : static_cast<const void*>(src);
    const int n = ok ? 16 : 0;
    asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16, %2;"
                 ::"r"(d + it * RPI * ROW_BYTES), "l"(g), "r"(n) : "memory");
  }
}

// cp_keys for K and V of a paged cache at once: key row j's page (one table read per row, shared
// by K and V) from pg; rows >= limit become zeros and read no table entry.
// Split in two, so that decode_tc can read the table for its next stage before it waits for the
// current one (the reads' latency then hides behind that wait): `PageRows::lookup` reads this
// thread's rows' pages, `cp_keys_paged` issues the copies.
template <int ROWS, int HEAD_DIM>
struct PageRows {
  static constexpr int RPI = DECODE_THREADS / (HEAD_DIM / 8);  // rows per copy instruction
  static constexpr int N = ROWS / RPI;                         // this thread's rows
  int page[N];
  __device__ __forceinline__ void lookup(const PagedKV& pg, const int* __restrict__ trow,
                                         int row0, int limit) {
    const int r_thr = threadIdx.x / (HEAD_DIM / 8);
    const int rem = limit - row0 - r_thr;
#pragma unroll
    for (int it = 0; it < N; ++it) {
      const int j = row0 + r_thr + it * RPI;
      page[it] = it * RPI < rem ? pg.page(trow, j) : 0;
    }
  }
};

template <int ROWS, int HEAD_DIM, typename T>
__device__ __forceinline__ void cp_keys_paged(unsigned dst_k, unsigned dst_v,
                                              const T* __restrict__ k, const T* __restrict__ v,
                                              long long k_rs, long long v_rs, int row0,
                                              int limit, const PagedKV& pg,
                                              const PageRows<ROWS, HEAD_DIM>& pr) {
  constexpr int CPR = HEAD_DIM / 8;  // 16-byte chunks per row
  constexpr int ROW_BYTES = (HEAD_DIM + 8) * 2;
  constexpr int RPI = DECODE_THREADS / CPR;
  static_assert(DECODE_THREADS % CPR == 0 && ROWS % RPI == 0, "cp_keys: rows must divide the block");
  const int r_thr = threadIdx.x / CPR, c_thr = threadIdx.x % CPR;
  const unsigned d = r_thr * ROW_BYTES + c_thr * 16;
  const int rem = limit - row0 - r_thr;  // copy `it` reads a real row iff it * RPI < rem
#pragma unroll
  for (int it = 0; it < ROWS / RPI; ++it) {
    const bool ok = it * RPI < rem;
    const KeyAt at = pg.offsets(pr.page[it], row0 + r_thr + it * RPI, k_rs, v_rs);
    const void* gk = ok ? static_cast<const void*>(k + at.k + c_thr * 8)
                        : static_cast<const void*>(k);
    const void* gv = ok ? static_cast<const void*>(v + at.v + c_thr * 8)
                        : static_cast<const void*>(v);
    const int n = ok ? 16 : 0;
    asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16, %2;"
                 ::"r"(dst_k + d + it * RPI * ROW_BYTES), "l"(gk), "r"(n) : "memory");
    asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16, %2;"
                 ::"r"(dst_v + d + it * RPI * ROW_BYTES), "l"(gv), "r"(n) : "memory");
  }
}

// ---- the tensor-core split kernel (float16 / bfloat16, Dk == Dv == HEAD_DIM, no mask or bias) --
// The row tile is one m16n8k16 m-fragment: the group's G * Nq rows (16 per tile, padding rows
// zero). Each stage of a two-slot cp.async ring holds DECODE_WARPS * KW keys of K and of V in
// padded shared rows (conflict-free ldmatrix, as fwd_mma.cu); warp w computes keys
// [w * KW, (w + 1) * KW) of every stage with its own online softmax state:
//   S = Q K^T   A = Q (registers, from shared once), B = K (ldmatrix)
//   softmax     exp2 with scale * log2(e) folded into one FFMA on the unscaled scores (needs
//               scale > 0: _decode.tc_fits); masked by global position only in stages not
//               entirely visible to every row. With a transform F (the 16-bit arithmetic of
//               modifiers.cuh) every stage forms its logits explicitly in log2 units instead,
//               F(s * scale * log2(e)), -inf where hidden by position (a ScoreModT without mask /
//               bias, as fwd_mma's), and exp2 folds nothing
//   O += P V    A = P packed from the S accumulators, B = V (ldmatrix.trans)
// The warps' states are merged through shared memory (finish_item) in the ring slot the last
// stage freed.
// Blocks are persistent: the host launches min(n_launch, resident capacity) blocks and block b runs
// launch rows snake_row(0, b), snake_row(1, b), ... (b, then 2 * grid - 1 - b, ...: the host's
// longest-first order, dealt out so that the blocks with the shorter first items get the longer
// second ones). The ring is one stream of stages across a block's items: the last stage of an item
// requests the next item's first keys, so a second item does not wait for its first load.
// An item's keys and its partial do not depend on which block runs it, and the merge reads the
// partials in slot order, so the result is bitwise reproducible.
// Dynamic shared memory: 16 Q rows + 2 slots of 2 * DECODE_WARPS * KW K/V rows of
// (HEAD_DIM + 8) * 2 bytes (cuflash/_decode.py tc_smem_bytes).
__device__ __forceinline__ long long snake_row(int round, int b, int grid) {
  return static_cast<long long>(round) * grid + ((round & 1) ? grid - 1 - b : b);
}

#define DECODE_TC_PARAMS                                                                     \
  DECODE_PARAMS(float), int n_launch, int device_lens, double mod0, double mod1,             \
      const double* __restrict__ mod_table
#define DECODE_TC_ARGS                                                                       \
  DECODE_ARGS_KV(DECODE_LENS_SOURCE), n_launch, device_lens, mod0, mod1, mod_table

// The body of decode_tc and decode_tc_paged.
template <typename T, int HEAD_DIM, int KW, int MINB, typename F, typename Pages>
__device__ __forceinline__ void decode_tc_body(DECODE_TC_PARAMS, const Pages pg) {
  using namespace tc;
  constexpr int ROWS = 16;
  constexpr int BK = KW * DECODE_WARPS;           // keys per stage
  constexpr int ROW_BYTES = (HEAD_DIM + 8) * 2;   // padded shared row
  constexpr int TILE_BYTES = BK * ROW_BYTES;
  constexpr int SLOT_BYTES = 2 * TILE_BYTES;      // a ring slot: K rows, then V rows
  constexpr int RED_STRIDE = HEAD_DIM + 8;        // merge buffer row (floats), see below
  constexpr int KD = HEAD_DIM / 16;               // k-steps of Q K^T
  constexpr int NF = KW / 8;                      // score n-fragments (keys)
  constexpr int KN = KW / 16;                     // k-steps of P V
  constexpr int DF = HEAD_DIM / 8;                // output n-fragments (head dim)
  static_assert(KW % 16 == 0 && HEAD_DIM % 16 == 0, "tile shape");
  static_assert(DECODE_WARPS * ROWS * RED_STRIDE * 4 <= SLOT_BYTES, "merge buffer in one slot");
  __shared__ DecodeRow rows[ROWS];
  __shared__ float red_m[DECODE_WARPS][ROWS], red_l[DECODE_WARPS][ROWS];
  __shared__ float sM[ROWS], sInv[ROWS];
  __shared__ int s_last;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const u32 sQ = smem_u32(smem_raw);
  const u32 sRing = sQ + ROWS * ROW_BYTES;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int g = lane / 4, t = lane % 4;
  const float sl2 = scale * LOG2E;
  // The transform's modifier (unused without one): the scale to log2 units, then F.
  // Its rows may belong to several heads: no POSITIONAL transform (the host sends ALiBi to
  // decode_split).
  static_assert(!F::POSITIONAL, "decode_tc takes no positional transform");
  using Mod = ScoreModT<float, false, false, F>;
  const Mod mod = Mod::make(MOD_INPUTS(0), sl2, FLAT_MOD_ARGS);

  // Stage number `gs` of the block's stream sits in slot gs % 2. An item's keys [k0, k1) are a
  // piece of the host's extent of the tile (the union of its rows' visible ranges: no key is read
  // in vain; one that some row does not see is masked below like any other); keys >= limit (k1)
  // are zero-filled by cp_keys.
  // Paged: `toff` is the sequence's row offset in the block table (items' 7th column).
  constexpr int COLS = Pages::ITEM_COLS;
  PageRows<BK, HEAD_DIM> pre;  // paged: the next stage's pages, read ahead (see the loop)
  auto request_paged = [&](int gs, long long koff, long long voff, int key0, int limit) {
    if constexpr (Pages::PAGED) {
      const u32 slot = sRing + (gs & 1) * SLOT_BYTES;
      cp_keys_paged<BK, HEAD_DIM>(slot, slot + TILE_BYTES, k + koff, v + voff, k_rs, v_rs, key0,
                                  limit, pg, pre);
    }
  };
  auto request = [&](int gs, long long koff, long long voff, long long toff, int key0,
                     int limit) {
    const u32 slot = sRing + (gs & 1) * SLOT_BYTES;
    if constexpr (Pages::PAGED) {
      pre.lookup(pg, pg.table + toff, key0, limit);
      request_paged(gs, koff, voff, key0, limit);
    } else {
      cp_keys<BK, HEAD_DIM>(slot, k + koff, k_rs, key0, limit);
      cp_keys<BK, HEAD_DIM>(slot + TILE_BYTES, v + voff, v_rs, key0, limit);
    }
  };
  auto table_row = [&](const long long* ir) -> long long {  // 0 unpaged: never read
    if constexpr (Pages::PAGED) return ir[6];
    return 0;
  };
  auto stages_of = [](long long k0, long long k1) {
    return k1 > k0 ? static_cast<int>((k1 - k0 - 1) / BK + 1) : 0;
  };
  // A launch row's keys at the valid length (item_keys), which with lengths on the device
  // (device_lens: the host planned for Nk keys) stop at the row tile's length too, so that no key
  // past it is read (it may hold NaN).
  auto item_range = [&](long long launch_row) -> ItemKeys {
    const long long* ir = items + COLS * launch_row;
    const long long* tr = tiles + 4 * ir[0];
    const long long bh0 = groups[tr[0] * G];
    const long long len = valid_keys(lens, kv_lens, lens_map, lens_bytes, bh0);
    ItemKeys ik = item_keys<ROWS, BK>(ir[1], ir[2], tr[1], G, Nq, lens[bh0], len, left, right,
                                      bottom_right);
    if (device_lens && ik.k1 > len) ik.k1 = len;
    return ik;
  };

  DECODE_MARK(0);
  long long row = blockIdx.x;  // < n_launch: the host launches at most n_launch blocks
  // The first item's first stage goes out after one table load, before anything else, so that
  // its latency hides the set-up below.
  int base = 0;  // stream number of the current item's first stage
  {
    const long long* ir = items + COLS * row;
    const ItemKeys ik = item_range(row);
    if (ik.k1 > ik.k0)
      request(0, ir[4], ir[5], table_row(ir), static_cast<int>(ik.k0), static_cast<int>(ik.k1));
    cp_async_commit();
  }
  DECODE_MARK(1);

  for (int round = 0;; ++round) {
    const DecodeItem it = read_item<COLS>(items, tiles, row);
    const long long koff = items[COLS * row + 4], voff = items[COLS * row + 5];
    const long long toff = table_row(items + COLS * row);
    const ItemKeys ik = item_range(row);
    const int blo = static_cast<int>(ik.k0);
    const int k1 = static_cast<int>(ik.k1);
    const int n_own = stages_of(ik.k0, ik.k1);
    // The next item: its first stage is requested in this item's last stage.
    const long long next = snake_row(round + 1, blockIdx.x, gridDim.x);
    const bool has_next = next < n_launch;
    long long nk0 = 0, nk1 = 0, nkoff = 0, nvoff = 0, ntoff = 0;
    if (has_next) {
      const long long* nr = items + COLS * next;
      const ItemKeys nik = item_range(next);
      nk0 = nik.k0;
      nk1 = nik.k1;
      nkoff = nr[4];
      nvoff = nr[5];
      ntoff = table_row(nr);
    }

    const long long bh0 = groups[it.g * G];
    const Window win = make_window(Nq, valid_keys(lens, kv_lens, lens_map, lens_bytes, bh0), left,
                                   right, bottom_right);
    setup_rows<ROWS>(rows, groups, it.g, it.tile, G, Nq, win, ik.k0, ik.k1);
    const BlockKeys bk = block_keys<ROWS>(rows, ik.k0, ik.k1);

    // Q rows (any alignment: scalar reads; padding rows 0) into the padded shared tile.
    for (int idx = tid; idx < ROWS * HEAD_DIM; idx += DECODE_THREADS) {
      const int r = idx / HEAD_DIM, col = idx % HEAD_DIM;
      const long long bh = rows[r].bh;
      const unsigned short x = bh >= 0 ? q[offsets[bh] + rows[r].i * q_rs + col].bits : 0;
      reinterpret_cast<unsigned short*>(smem_raw)[r * (ROW_BYTES / 2) + col] = x;
    }
    __syncthreads();  // Q is in shared memory
    u32 qa[KD][4];
    {
      const u32 q_lane = sQ + (lane % 16) * ROW_BYTES + (lane / 16) * 16;
#pragma unroll
      for (int kk = 0; kk < KD; ++kk) ldsm_x4(q_lane + kk * 32, qa[kk]);
    }
    // This thread's rows g and g + 8: visible keys [lo, hi] (clipped to [k0, k1)) and query
    // position; the host keeps keys < 2^30 on this path.
    long long row_lo[2], row_hi[2];
    int row_i[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      row_lo[h] = rows[g + 8 * h].lo;
      row_hi[h] = rows[g + 8 * h].hi;  // padding rows: hi < lo, nothing visible
      row_i[h] = static_cast<int>(rows[g + 8 * h].i);
    }

    MmaSoftmax<1> sm;  // the online softmax of this lane's rows g and g + 8
    sm.init(0);
    float acc[DF][4];
    tc::zero(acc);

    // Stage n of the item: its first key `key` (keys >= k1 are zero-filled).
    int n = 0, key = blo;
    for (bool more = n_own > 0; more; ++n) {
      if constexpr (Pages::PAGED) {  // the next request's pages, read before the wait below
        if (n + 1 < n_own)
          pre.lookup(pg, pg.table + toff, key + BK, k1);
        else if (has_next && nk1 > nk0)
          pre.lookup(pg, pg.table + ntoff, static_cast<int>(nk0), static_cast<int>(nk1));
      }
      cp_async_wait<0>();
      __syncthreads();  // stage n landed for everyone; everyone finished stage n - 1
      if (round == 0 && n == 0) DECODE_MARK(2);
      more = n + 1 < n_own;
      if constexpr (Pages::PAGED) {
        if (more)
          request_paged(base + n + 1, koff, voff, key + BK, k1);
        else if (has_next && nk1 > nk0)
          request_paged(base + n + 1, nkoff, nvoff, static_cast<int>(nk0),
                        static_cast<int>(nk1));
      } else {
        if (more)
          request(base + n + 1, koff, voff, toff, key + BK, k1);
        else if (has_next && nk1 > nk0)  // the last stage: the next item's first
          request(base + n + 1, nkoff, nvoff, ntoff, static_cast<int>(nk0),
                  static_cast<int>(nk1));
      }
      cp_async_commit();
      const int j0 = key + warp * KW;  // this warp's first key
      if (j0 < k1) {                   // warp-uniform: else nothing of this stage for it
        const u32 slot = sRing + ((base + n) & 1) * SLOT_BYTES + warp * KW * ROW_BYTES;
        const u32 kbuf =
            slot + (lane % 8 + 8 * (lane / 16)) * ROW_BYTES + ((lane / 8) % 2) * 16;
        const u32 vbuf = slot + TILE_BYTES + (lane % 8 + 8 * ((lane / 8) % 2)) * ROW_BYTES +
                         (lane / 16) * 16;

        float s[1][NF][4];  // one m-fragment: the tile's 16 rows
#pragma unroll
        for (int nf = 0; nf < NF; ++nf)
#pragma unroll
          for (int e = 0; e < 4; ++e) s[0][nf][e] = 0.f;
#pragma unroll
        for (int kk = 0; kk < KD; ++kk)
#pragma unroll
          for (int p = 0; p < NF / 2; ++p) {
            u32 kb[4];
            ldsm_x4(kbuf + p * 16 * ROW_BYTES + kk * 32, kb);
            Mma<T>::run2(s[0][2 * p], s[0][2 * p + 1], qa[kk], kb);
          }

        // Mask by global position unless every row of the tile sees all KW keys (without a
        // transform: the scale is folded into exp2 below); with one, every stage forms its logits,
        // F applied, -inf where hidden by position.
        if (!F::IDENTITY || j0 < bk.flo || j0 + KW - 1 > bk.fhi) {
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const long long lo = row_lo[h] - j0, hi = row_hi[h] - j0;
            const int c_lo = static_cast<int>(lo < 0 ? 0 : (lo > KW ? KW : lo));
            const int c_hi = static_cast<int>(hi < -1 ? -1 : (hi > KW ? KW : hi));
            if constexpr (F::IDENTITY)
              mask_columns(s[0], h, c_lo, c_hi, t, 0, j0, NoMod());
            else
              mask_columns(s[0], h, c_lo, c_hi, t, row_i[h], j0, mod);
          }
        }

        // Online softmax: new max, rescale BOTH l and acc, add this step's mass (attn_core.cuh's
        // MmaSoftmax, with its huge-logit guard: decode has no fix-up kernel).
        sm.step_guarded(s, F::IDENTITY ? sl2 : 1.f);
#pragma unroll
        for (int df = 0; df < DF; ++df)
#pragma unroll
          for (int e = 0; e < 4; ++e) acc[df][e] *= sm.alpha[0][e / 2];
#pragma unroll
        for (int kk = 0; kk < KN; ++kk) {
          u32 pa[4];
          acc_to_a<T>(s[0][2 * kk], s[0][2 * kk + 1], pa);
#pragma unroll
          for (int p = 0; p < DF / 2; ++p) {
            u32 vb[4];
            ldsm_x4_t(vbuf + kk * 16 * ROW_BYTES + p * 32, vb);
            Mma<T>::run2(acc[2 * p], acc[2 * p + 1], pa, vb);
          }
        }
      }
      key += BK;
    }
    __syncthreads();  // every warp is done with the last stage: its slot is free
    if (!has_next) DECODE_MARK(3);

    // Per warp: m (base 2, scaled), l summed over the quad, acc unnormalized -> the free slot
    // (the one of stream stage base + n - 1; the other may hold the next item's first
    // stage), in rows of HEAD_DIM + 8 floats: the 8 row-groups of a fragment then fall on
    // different banks (with HEAD_DIM floats, the 8 lanes of one column pair shared a bank).
    float* const red_acc = reinterpret_cast<float*>(
        smem_raw + ROWS * ROW_BYTES + ((base + n + 1) & 1) * SLOT_BYTES);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float l_row = sm.row_sum(0, h);
      const int r = g + 8 * h;
      if (t == 0) {
        red_m[warp][r] = sm.m[0][h];
        red_l[warp][r] = l_row;
      }
#pragma unroll
      for (int df = 0; df < DF; ++df)
        *reinterpret_cast<float2*>(red_acc + (warp * ROWS + r) * RED_STRIDE + df * 8 + 2 * t) =
            make_float2(acc[df][2 * h], acc[df][2 * h + 1]);
    }
    __syncthreads();
    if (!has_next) DECODE_MARK(7);
    finish_item<T, float, ROWS, false, 4, 24>(out, lse, ws_out, ws_ml, counters, rows, red_acc,
                                              RED_STRIDE, red_m, red_l, sM, sInv, s_last, ~0u,
                                              it.item, it.tile_id, it.first, it.n_items, Nq, Dv,
                                              fused);
#ifdef DECODE_TRACE
    if (!has_next) DECODE_MARK(6, it.n_items > 1 && fused && s_last ? 1ull : 0ull);
#endif
    if (!has_next) break;
    __syncthreads();  // rows[], the merge buffer and sQ are free for the next item
    base += n;
    row = next;
    if (n == 0) {  // nothing requested the next item's first stage yet
      if (nk1 > nk0)
        request(base, nkoff, nvoff, ntoff, static_cast<int>(nk0), static_cast<int>(nk1));
      cp_async_commit();
    }
  }
  cp_async_wait<0>();
#ifdef DECODE_TRACE
  DECODE_MARK(4);
  unsigned smid;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(smid));
  DECODE_MARK(5, smid);
#endif
}

template <typename T, int HEAD_DIM, int KW, int MINB, typename F = NoTransform>
__global__ void __launch_bounds__(DECODE_THREADS, MINB)
decode_tc(DECODE_TC_PARAMS, DECODE_HOST_LENS) {
  decode_tc_body<T, HEAD_DIM, KW, MINB, F>(DECODE_TC_ARGS, NoPages{});
}

// decode_tc on a paged KV cache (k, v the page pools).
template <typename T, int HEAD_DIM, int KW, int MINB, typename F = NoTransform>
__global__ void __launch_bounds__(DECODE_THREADS, MINB)
decode_tc_paged(DECODE_TC_PARAMS, DECODE_PAGED_PARAMS, DECODE_HOST_LENS) {
  decode_tc_body<T, HEAD_DIM, KW, MINB, F>(DECODE_TC_ARGS, DECODE_PAGED_ARG);
}
