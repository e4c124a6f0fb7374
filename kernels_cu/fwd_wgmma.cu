// fwd_wgmma.cu: the Hopper forward (sm_90a): TMA loads into an mbarrier ring, a producer warpgroup
// and CONSUMERS consumer warpgroups, wgmma for both products. float16 / bfloat16; head dims
// Dk <= DK and Dv <= DV, DK and DV multiples of 64: the tensor maps fill the columns past Dk (Dv)
// with zeros, which add nothing to Q K^T and give output columns that are not stored.
//
// float32 (PASSES = 1, precision="high": one TF32 product per GEMM; PASSES = 3, "highest":
// three, as exact as float32): the operands come from tf32_operand (below), rounded to TF32 to
// nearest (the tensor cores would truncate them); with three passes each as two parts, hi and
// lo = the remainder (mma.cuh WideMma), stored as heads 2 h and 2 h + 1 of the copies, which the
// producer brings side by side (the lo tile after the hi one). S = Qlo Khi + Qhi Klo + Qhi Khi
// (small terms first, one accumulator), and each tile's P V = Plo Vhi + Phi Vlo + Phi Vhi in a
// fresh accumulator added to O in float32: the tensor cores round their sums toward zero, which
// a chain through every key tile of a row collects (tools/tf32_probe.py: 35x the error of one
// per tile). V as V^T: .tf32
// reads only K-major operands, so P V's B operand is V^T with the keys contiguous, in column
// blocks of 32 keys. Within each group of 8 keys, slot s of V^T holds key 2 s (s < 4) or
// 2 (s - 4) + 1, so that S's accumulators, which hold keys 2 t and 2 t + 1 of a lane's rows, are
// P's A fragment as they stand ({s0, s2, s1, s3}, rounded). Key tiles then start at multiples of
// 8: the block's range [j_first, j_limit) widens to multiples of 8, and the keys it adds are
// masked by position; V^T is 0 past the keys and past kv_lens, so nothing they hold reaches O.
// A column block holds 32 floats (128 bytes), and a k-step is 8 of them: the byte offsets of
// wgmma.cuh's swizzled tiles are the 16-bit ones.
//
// One block owns BLOCK_M = 64 * CONSUMERS query rows of one (batch, head); consumer warpgroup c
// owns rows 64 c .. 64 c + 63 (warp w of it rows 16 w .. 16 w + 15, mma.sync's fragment layout,
// wgmma.cuh). One thread of the producer warpgroup issues every copy: the Q tile once, then per key
// tile its K and its V into slot it % STAGES of two rings (K and V apart, so S = Q K^T can start
// before V lands). Each consumer warpgroup runs the seed's loop, with the softmax of tile `it`
// overlapping the product of tile it - 1:
//   S(it) = Q K(it)^T            wgmma, both operands in shared memory        (issued)
//   O += P(it - 1) V(it - 1)     wgmma, P from registers                      (issued)
//   wait for S(it); mask; online softmax -> P(it), alpha   (while P V runs on the tensor cores)
//   wait for P V; O *= alpha
// Key tiles are visited last first (the partially visible ones of a causal block come first).
// Every tile is [j0, j0 + BLOCK_N) with j0 = j_first + t BLOCK_N, except the last one, which ends
// at the block's last visible key + 1 (j0 = j_limit - BLOCK_N): no key at or past j_limit is
// read (kv_lens: "the rest may hold anything, NaN included"; rows before 0 arrive as zeros). Its
// keys below the previous tile's end are masked (key_floor). Tiles entirely visible to the
// warpgroup's rows skip the per-element predicate.
//
// A boolean mask or a bias (MB != MB_NONE) sends every tile through a score modifier
// (logits in log2 units). MB_STAGED (StagedMaskBias below): the producer
// brings their tiles with K (tensor maps tm, tb; one that is the same for every query row comes
// as one row per tile). MB_CLASSES: staged, and the mask's tile classes (mask_tiles.cuh) let
// producer and consumers skip the tiles it hides; a tile it shows entirely takes no per-element
// mask when there is no bias. MB_GLOBAL (MaskBiasMod): read from global memory, where no tensor
// map describes them.
//
// PINGPONG (two consumers): the warpgroups take turns issuing their products (named barriers
// 3 and 4), so that one's softmax runs while the other's products use the tensor cores.
//
// The end of a row is fwd_mma's: out = O / l staged through the warpgroup's own rows of the Q
// tile and written with 16-byte stores; lse. Then the rows the float arithmetic could not settle
// (|m| beyond the folded FFMA's accuracy; with a modifier, l = 0: all masked or all -inf), if the
// warpgroups have any: each consumer warp rechecks its own 16 rows and recomputes those in double
// (lost_rows.cuh fwd_fix_rows_apart, the transform in double: LostF), reading q, k and v as q_mem,
// k_mem, v_mem: the memory and strides that the tensor maps describe.
//
// SINKS: each row's softmax takes its head's sink logit sinks[bh] (sinks.cuh), joined at its end;
// sinks is not read without. Drop: empty, or DropoutArgs (philox.cuh), as in fwd_mma.cu: P's
// dropped entries zeroed after the softmax step, 1 / (1 - p) in the end's factor.
//
// Requirements (cuflash/_wgmma_fwd.py): compute capability 9.0, the tensor maps of q, k, v
// (16-byte aligned bases and strides, unit innermost stride), Dv a multiple of 8, scale > 0.
#include "common.cuh"
#include "mask.cuh"
#include "mask_tiles.cuh"

#include "attn_core.cuh"
#include "mma.cuh"
#include "sinks.cuh"
#include "philox.cuh"
#include "tma.cuh"
#include "wgmma.cuh"
#include "lost_rows.cuh"

// O (64 x DV) += P V, in products of at most 128 columns (column blocks 2 c, 2 c + 1 of V), one
// commit group.
template <typename T, int DV, int KN, tc::u32 KV_BLK>
__device__ __forceinline__ void pv_product(float (&o)[DV / 8][4], const tc::u32 (&p)[KN][4],
                                           tc::u32 sv) {
  if constexpr (sizeof(T) == 4) {  // V^T: DV rows of 32 keys per column block
    static_assert(DV <= 128, "float32: one product");
    wg::regs_times_rows<T, DV, KN, DV * 128>(o, p, sv);
  } else if constexpr (DV <= 128) {
    wg::regs_times_tile<T, DV, KN, KV_BLK>(o, p, sv);
  } else {
    constexpr int HI = DV - 128;
    wg::regs_times_tile<T, 128, KN, KV_BLK, false>(*reinterpret_cast<float(*)[16][4]>(&o[0]), p,
                                                   sv);
    wg::regs_times_tile<T, HI, KN, KV_BLK>(*reinterpret_cast<float(*)[HI / 8][4]>(&o[16]), p,
                                           sv + 2 * KV_BLK);
  }
}

// MB_CLASSES: staged, with the mask's tile classes (mask_tiles.cuh): hidden tiles are skipped,
// tiles the mask shows entirely (with no bias) only scaled.
constexpr int MB_NONE = 0, MB_GLOBAL = 1, MB_STAGED = 2, MB_CLASSES = 3;

// How each input's matrix of output (batch b, head h) is found in its tensor map: head h / hdiv,
// batch b * bmul (0 where the input is broadcast); inputs q, k, v, mask, bias.
struct InputHeads {
  int hdiv[5], bmul[5];
};

// The staged mask and bias of one key tile, applied as attn_core.cuh's score modifier: the mask
// as BLOCK_M rows of BLOCK_N bytes, the bias as BLOCK_N / 32 boxes of BLOCK_M rows x 32 floats with
// the 128-byte swizzle; one that is the same for every query row was staged as its row 0 (step
// 0). A lane's pair of columns is one 2-byte and one 8-byte shared load.
template <int BLOCK_M, int BLOCK_N, typename F>
struct StagedMaskBias {
  tc::u32 mask_s, bias_s;  // this tile's stages
  bool has_mask, has_bias;
  int mask_step, bias_step;
  float scale_log2;
  F f;  // the score transform (modifiers.cuh)
  // This lane's scores s (query rows i, i + 8, block rows r, r + 8) of the key tile at j0:
  // invisible by position or masked -> -inf, else f(s * scale_log2) + bias * log2e.
  template <int NF>
  __device__ __forceinline__ void apply(float (&s)[NF][4], int i, int r, int j0, int t, int Nq,
                                        const Bounds32& b, int key_floor) const {
    for_pair([&](int h) {
      const ColRange cr = visible_columns(i + 8 * h, j0, Nq, b, key_floor);
      const int rm = (r + 8 * h) * mask_step, rb = (r + 8 * h) * bias_step;
#pragma unroll
      for (int nf = 0; nf < NF; ++nf) {
        const int c0 = nf * 8 + 2 * t;
        unsigned m = 0x0101u;
        if (has_mask)
          asm volatile("ld.shared.u16 %0, [%1];" : "=r"(m) : "r"(mask_s + rm * BLOCK_N + c0));
        float bv[2] = {0.f, 0.f};
        if (has_bias)
          asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];"
                       : "=f"(bv[0]), "=f"(bv[1])
                       : "r"(bias_s + (c0 / 32) * (BLOCK_M * 128) + rb * 128 +
                             tc::stored_chunk<true>(rb, (c0 % 32) / 4) * 16 + (c0 % 4) * 4));
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int c = c0 + e;
          const bool keep = c >= cr.lo && c <= cr.hi && ((m >> (8 * e)) & 0xffu) != 0;
          float& x = s[nf][2 * h + e];
          x = keep ? fmaf(bv[e], LOG2E, F(f)(x * scale_log2, i + 8 * h, static_cast<long long>(j0) + c))
                   : neg_inf<float>();
        }
      }
    });
  }
};

template <typename T, int DK, int DV, int BLOCK_N, int CONSUMERS, int STAGES, int CONSUMER_REGS,
          bool PINGPONG, int MB, int PASSES = 1, typename F = NoTransform,
          typename LostF = NoTransform,
          bool SINKS = false, typename... Drop>
__global__ void __launch_bounds__((CONSUMERS + 1) * 128, 1)
fwd_wgmma(const __grid_constant__ TmaMap tq, const __grid_constant__ TmaMap tk,
          const __grid_constant__ TmaMap tv, const __grid_constant__ TmaMap tm,
          const __grid_constant__ TmaMap tb, const InputHeads heads, T* __restrict__ out,
          float* __restrict__ lse, const long long* __restrict__ kv_lens,
          int H, int Nq, int Nk, int Dv, float scale, int left, int right, int bottom_right,
          int mask_box_rows, int bias_box_rows, const long long* __restrict__ offsets,
          const unsigned char* __restrict__ mask, const float* __restrict__ bias, int BH,
          long long mask_rs, long long mask_cs, long long bias_rs, long long bias_cs,
          const TileClasses classes, double mod0, double mod1,
          const double* __restrict__ mod_table, const double* __restrict__ sinks,
          const T* __restrict__ q_mem, const T* __restrict__ k_mem, const T* __restrict__ v_mem,
          long long q_rs, long long k_rs, long long v_rs, int Dk, double scale_d, double lost,
          const Drop... drop) {
  using namespace tc;
  constexpr int BLOCK_M = 64 * CONSUMERS;
  constexpr bool F32 = sizeof(T) == 4;          // TF32 products of float32 operands
  constexpr int COLS = 128 / sizeof(T);         // elements of a column block's 128-byte row
  constexpr int KSTEP = wg::kstep_elems<T>();   // elements of one k-step: 16, float32 8
  constexpr int NF = BLOCK_N / 8;   // score n-fragments per warp
  constexpr int DF = DV / 8;        // output n-fragments per warp
  constexpr int KD = DK / KSTEP;    // k-steps of Q K^T
  constexpr int KN = BLOCK_N / KSTEP;  // k-steps of P V
  // column blocks of a row (one TMA box each); V's: 64 of its columns, float32 32 keys of V^T
  constexpr int NCK = DK / COLS, NCV = F32 ? BLOCK_N / 32 : DV / 64;
  constexpr u32 Q_BLK = BLOCK_M * 128, KV_BLK = BLOCK_N * 128;  // bytes per column block
  constexpr u32 V_BLK = F32 ? DV * 128 : KV_BLK;
  // PARTS: hi and lo tiles of each operand with three passes; the lo tile PART bytes after the hi
  constexpr int PARTS = PASSES == 3 ? 2 : 1;
  constexpr u32 Q_PART = Q_BLK * NCK, K_PART = KV_BLK * NCK, V_PART = V_BLK * NCV;
  constexpr u32 Q_BYTES = Q_PART * PARTS, K_BYTES = K_PART * PARTS, V_BYTES = V_PART * PARTS;
  constexpr u32 CONSUMER_THREADS = CONSUMERS * 128;
  static_assert(DK % 64 == 0 && DV % 64 == 0 && DV <= 256 && BLOCK_N % 16 == 0, "tile shape");
  static_assert(!F32 || (DV <= 128 && BLOCK_N % 32 == 0 && MB <= MB_GLOBAL && F::IDENTITY &&
                         !SINKS && sizeof...(Drop) == 0),
                "float32: a mask or bias from global memory, no transform, sinks or dropout");
  static_assert(PASSES == 1 || (F32 && PASSES == 3), "three TF32 passes: float32 only");
  static_assert(DV <= DK, "the output is staged in the Q tile");
  static_assert(!PINGPONG || CONSUMERS == 2, "ping-pong between two consumer warpgroups");
  static_assert(128 * (24 + CONSUMERS * CONSUMER_REGS) <= 65536, "register budget");
  // HAS_MB: a score modifier on every tile; READS: it reads a mask or bias (a score transform
  // alone spares the tiles visible by position the position test)
  constexpr bool HAS_MB = MB != MB_NONE || !F::IDENTITY, READS = MB != MB_NONE;
  // FOLD: the scale folds into the exponent's FFMA (attn_core.cuh folds_scale)
  constexpr bool FOLD = folds_scale<READS, F>();
  constexpr bool STAGED = MB >= MB_STAGED, CLASSES = MB == MB_CLASSES;
  // staged mask / bias slots (MB_STAGED); mask_box_rows, bias_box_rows: rows per staged tile
  // (0: absent, 1: the same for every query row, BLOCK_M)
  constexpr u32 M_BYTES = STAGED ? BLOCK_M * BLOCK_N : 0;
  constexpr u32 B_BYTES = STAGED ? BLOCK_M * BLOCK_N * 4 : 0;
  static_assert(!STAGED || (BLOCK_N % 32 == 0 && M_BYTES % 1024 == 0), "staged tiles");

  const int n_mtiles = (Nq + BLOCK_M - 1) / BLOCK_M;
  const long long bh = blockIdx.x / n_mtiles;
  const int i0 = (n_mtiles - 1 - static_cast<int>(blockIdx.x % n_mtiles)) * BLOCK_M;
  const int b = static_cast<int>(bh / H), h = static_cast<int>(bh % H);

  const Window w = head_window(kv_lens, bh, Nq, Nk, left, right, bottom_right);
  const KeyRange range = tile_key_range(w, i0, min(i0 + BLOCK_M, Nq) - 1);
  const Bounds32 b32 = make_bounds32(w);
  // float32: widened to multiples of 8 keys (V^T's groups of 8)
  const int j_first = static_cast<int>(range.lo) & (F32 ? ~7 : ~0);
  const int j_limit = F32 ? (static_cast<int>(range.hi) + 8) & ~7 : static_cast<int>(range.hi) + 1;
  const int n_tiles = range.hi >= range.lo ? (j_limit - 1 - j_first) / BLOCK_N + 1 : 0;
  const int key_floor = j_first + (n_tiles - 1) * BLOCK_N;  // of the last tile (visited first)
  // First key of the it-th tile visited (tile n_tiles - 1 - it).
  auto tile_start = [&](int it) {
    return it == 0 ? j_limit - BLOCK_N : j_first + (n_tiles - 1 - it) * BLOCK_N;
  };
  // CLASSES: what the mask shows of the it-th tile (it spans at most two chunks); producer and
  // consumers skip the hidden ones alike. A tile's place in the rings is then its count among the
  // tiles computed (`seq`), not `it`.
  const unsigned char* cls_row = CLASSES ? class_row(classes, bh, i0 / BLOCK_M) : nullptr;
  auto visit_class = [&](int it) {
    return CLASSES ? tile_class<BLOCK_N>(cls_row, tile_start(it)) : TILE_MIXED;
  };
  auto next_tile = [&](int it) {  // the first tile at or after `it` that is not skipped
    if (CLASSES)
      while (it < n_tiles && visit_class(it) == TILE_HIDDEN) ++it;
    return it;
  };

  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const u32 sQ = (smem_u32(smem_raw) + 1023u) & ~1023u;  // swizzled tiles: 1024-aligned
  const u32 sK = sQ + Q_BYTES;
  const u32 sV = sK + STAGES * K_BYTES;
  const u32 sM = sV + STAGES * V_BYTES;
  const u32 sB = sM + STAGES * M_BYTES;
  const u32 bars = sB + STAGES * B_BYTES;
  const u32 q_full = bars;
  auto k_full = [&](int s) { return bars + 8 * (1 + s); };
  auto v_full = [&](int s) { return bars + 8 * (1 + STAGES + s); };
  auto k_empty = [&](int s) { return bars + 8 * (1 + 2 * STAGES + s); };
  auto v_empty = [&](int s) { return bars + 8 * (1 + 3 * STAGES + s); };

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  if (tid == 0) {
    tma::mbar_init(q_full, 1);
    for (int s = 0; s < STAGES; ++s) {
      tma::mbar_init(k_full(s), 1);
      tma::mbar_init(v_full(s), 1);
      tma::mbar_init(k_empty(s), CONSUMER_THREADS);
      tma::mbar_init(v_empty(s), CONSUMER_THREADS);
    }
    tma::mbar_init_fence();
    tma::prefetch_map(tq);
    tma::prefetch_map(tk);
    tma::prefetch_map(tv);
    if (mask_box_rows) tma::prefetch_map(tm);
    if (bias_box_rows) tma::prefetch_map(tb);
  }
  __syncthreads();

  if (warp < 4) {  // ---- producer warpgroup: one thread issues every copy
    tma::regs_dec<24>();
    if (tid == 0) {
      auto head = [&](int x) { return h / heads.hdiv[x]; };
      auto batch = [&](int x) { return b * heads.bmul[x]; };
      const int kh = head(1), kb = batch(1), vh = head(2), vb = batch(2);
      // the staged mask / bias rows of this block (one row when the same for all) come with K
      const u32 mb_bytes = STAGED ? (mask_box_rows + 4 * bias_box_rows) * BLOCK_N : 0;
      tma::arrive_expect_tx(q_full, Q_BYTES);
#pragma unroll
      for (int part = 0; part < PARTS; ++part)
#pragma unroll
        for (int cb = 0; cb < NCK; ++cb)
          tma::load_4d(sQ + part * Q_PART + cb * Q_BLK, tq, cb * COLS, i0, head(0) * PARTS + part,
                       batch(0), q_full);
      for (int it = next_tile(0), k = 0; it < n_tiles; it = next_tile(it + 1), ++k) {
        const int seq = CLASSES ? k : it;
        const int slot = seq % STAGES;
        const u32 parity = ((seq / STAGES) & 1) ^ 1;  // the slot's previous use
        const int j0 = tile_start(it);
        tma::wait(k_empty(slot), parity);
        tma::arrive_expect_tx(k_full(slot), K_BYTES + mb_bytes);
#pragma unroll
        for (int part = 0; part < PARTS; ++part)
#pragma unroll
          for (int cb = 0; cb < NCK; ++cb)
            tma::load_4d(sK + slot * K_BYTES + part * K_PART + cb * KV_BLK, tk, cb * COLS, j0,
                         kh * PARTS + part, kb, k_full(slot));
        if (STAGED && mask_box_rows)
          tma::load_4d(sM + slot * M_BYTES, tm, j0, mask_box_rows == 1 ? 0 : i0, head(3),
                       batch(3), k_full(slot));
        if (STAGED && bias_box_rows) {
#pragma unroll
          for (int cb = 0; cb < BLOCK_N / 32; ++cb)
            tma::load_4d(sB + slot * B_BYTES + cb * BLOCK_M * 128, tb, j0 + 32 * cb,
                         bias_box_rows == 1 ? 0 : i0, head(4), batch(4), k_full(slot));
        }
        tma::wait(v_empty(slot), parity);
        tma::arrive_expect_tx(v_full(slot), V_BYTES);
#pragma unroll
        for (int part = 0; part < PARTS; ++part)
#pragma unroll
          for (int cb = 0; cb < NCV; ++cb) {  // (float32: V^T's 32 keys of every row)
            const u32 dst = sV + slot * V_BYTES + part * V_PART + cb * V_BLK;
            if constexpr (F32)
              tma::load_4d(dst, tv, j0 + 32 * cb, 0, vh * PARTS + part, vb, v_full(slot));
            else
              tma::load_4d(dst, tv, cb * 64, j0, vh, vb, v_full(slot));
          }
      }
    }
    return;
  }

  // ---- consumer warpgroups
  tma::regs_inc<CONSUMER_REGS>();
  const int cw = warp / 4 - 1;                     // consumer warpgroup
  const int g = lane / 4, t = lane % 4;            // fragment coordinates
  const int row_w = cw * 64 + (warp % 4) * 16;     // the warp's first row in the block
  const int i0w = i0 + cw * 64, i_lastw = min(i0w + 63, Nq - 1);
  const u32 sQw = sQ + cw * 64 * 128;              // the warpgroup's rows of each Q column block

  MmaSoftmax<1> sm;
  sm.init(0);
  float o[DF][4];
  zero(o);
  // With a mask, bias or a transform that is not additive the modifier forms the logits in log2
  // units; otherwise (FOLD) the scale folds into the exponent's FFMA.
  const float sl2 = FOLD ? scale * LOG2E : 1.f;
  const bool global_mb = MB == MB_GLOBAL;
  using Mod = ScoreModT<float, false, true, F>;  // MB_GLOBAL's; its shown() the scale and F
  const Mod mb = Mod::make(global_mb ? mask : nullptr, global_mb ? bias : nullptr, offsets, BH, bh,
                           mask_rs, mask_cs, bias_rs, bias_cs, scale * LOG2E,
                           at_head(FLAT_MOD_ARGS, bh, w.shift));
  // FOLD's transform on raw scores (units LOG2E / (scale * LOG2E)); NoMod where there is none
  const auto raw = raw_transform<READS, F>(at_head(FLAT_MOD_ARGS, bh, w.shift),
                                           static_cast<float>(1.0 / scale_d));
  float s[1][NF][4];
  u32 p[KN][4];
  // three passes: P's lo part, and each tile's P V before it joins O (otherwise unused)
  u32 p_lo[KN][4];
  float pv[PARTS == 2 ? DF : 1][4];
  // S = Q K^T of the K tile at sk, one commit group
  auto s_product = [&](u32 sk) {
    if constexpr (PARTS == 2) {
      wg::rows_times_rows<T, BLOCK_N, KD, Q_BLK, KV_BLK, false, false>(s[0], sQw + Q_PART, sk);
      wg::rows_times_rows<T, BLOCK_N, KD, Q_BLK, KV_BLK, true, false>(s[0], sQw, sk + K_PART);
      wg::rows_times_rows<T, BLOCK_N, KD, Q_BLK, KV_BLK, true>(s[0], sQw, sk);
    } else {
      wg::rows_times_rows<T, BLOCK_N, KD, Q_BLK, KV_BLK>(s[0], sQw, sk);
    }
  };
  // O += P V (three passes: pv = P V, added to O by pv_join once done), one commit group
  auto pv_issue = [&](u32 sv) {
    if constexpr (PARTS == 2) {
      constexpr u32 B_BLK = DV * 128;
      wg::regs_times_rows<T, DV, KN, B_BLK, false, false>(pv, p_lo, sv);
      wg::regs_times_rows<T, DV, KN, B_BLK, false>(pv, p, sv + V_PART);
      wg::regs_times_rows<T, DV, KN, B_BLK>(pv, p, sv);
    } else {
      pv_product<T, DV, KN, KV_BLK>(o, p, sv);
    }
  };
  auto pv_join = [&]() {  // after the wait for P V
    if constexpr (PARTS == 2) {
      wg::fence_acc(pv);
#pragma unroll
      for (int df = 0; df < DF; ++df)
#pragma unroll
        for (int e = 0; e < 4; ++e) o[df][e] += pv[df][e];
    } else {
      wg::fence_acc(o);
    }
  };

  // Mask by global position where the tile is not entirely visible to the warpgroup's rows (seq:
  // the tile's place in the rings).
  auto mask_tile = [&](int it, int seq) {
    const int j0 = tile_start(it), floor = it == 0 ? key_floor : 0;
    if (READS || j0 < floor || !tile_all_visible(b32, i0w, i_lastw, j0, BLOCK_N)) {
      const int i = i0 + row_w + g;
      if constexpr (STAGED) {
        if (CLASSES && bias_box_rows == 0 && visit_class(it) == TILE_VISIBLE) {
          const auto to_log2 = mb.shown();  // the mask shows every key: scale (and F) only
          if (j0 < floor || !tile_all_visible(b32, i0w, i_lastw, j0, BLOCK_N)) {
            mask_rows(s[0], i, j0, t, Nq, b32, to_log2, floor);
          } else {
            modify_all(s[0], to_log2, i, j0, t);
          }
          return;
        }
        const int slot = seq % STAGES;
        const StagedMaskBias<BLOCK_M, BLOCK_N, F> st{
            sM + slot * M_BYTES, sB + slot * B_BYTES, mask_box_rows != 0, bias_box_rows != 0,
            mask_box_rows == 1 ? 0 : 1, bias_box_rows == 1 ? 0 : 1, scale * LOG2E, mb.f};
        st.apply(s[0], i, row_w + g, j0, t, Nq, b32, floor);
      } else if constexpr (MB == MB_GLOBAL) {
        mask_rows(s[0], i, j0, t, Nq, b32, mb, floor);
      } else if constexpr (F::IDENTITY) {
        mask_rows(s[0], i, j0, t, Nq, b32, NoMod(), floor);
      } else if constexpr (FOLD) {
        mask_rows(s[0], i, j0, t, Nq, b32, raw, floor);
      } else {
        mask_rows(s[0], i, j0, t, Nq, b32, mb.shown(), floor);
      }
    } else if constexpr (HAS_MB && !READS) {  // a transform alone, in a tile visible by position
      if constexpr (FOLD) modify_all(s[0], raw, i0 + row_w + g, j0, t);
      else modify_all(s[0], mb.shown(), i0 + row_w + g, j0, t);
    }
  };
  // K's slot is free once S = Q K^T is done, or with staged tiles once they are read too.
  auto release_k = [&](int seq, bool after_mask) {
    if (after_mask == STAGED) tma::arrive(k_empty(seq % STAGES));
  };
  const auto dz = dropout_at<float>(bh, drop...);  // philox.cuh: none without a DropoutArgs
  // P of tile `it` as P V's A operand (dropout: its dropped entries 0; l is the undropped sum)
  auto to_p = [&](int it) {
    drop_rows(s[0], dz, i0 + row_w + g, tile_start(it), t);
    if constexpr (F32) {  // keys 2 t, 2 t + 1 of 8 are V^T's slots t, t + 4 (tf32_operand)
#pragma unroll
      for (int kk = 0; kk < KN; ++kk) {
        const float x[4] = {s[0][kk][0], s[0][kk][2], s[0][kk][1], s[0][kk][3]};
#pragma unroll
        for (int e = 0; e < 4; ++e) WideMma<float, PASSES>::split(x[e], p[kk][e], p_lo[kk][e]);
      }
    } else {
#pragma unroll
      for (int kk = 0; kk < KN; ++kk) acc_to_a<T>(s[0][2 * kk], s[0][2 * kk + 1], p[kk]);
    }
  };
  // PINGPONG: a warpgroup issues its products between its turn's barrier and the other's. There
  // are (tiles computed) + 1 issue points per warpgroup; warpgroup 0 goes first, and warpgroup 1
  // passes the turn back after every issue point but its last.
  auto turn_take = [&]() {
    if (PINGPONG) tma::named_sync(3 + cw, 256);
  };
  auto turn_pass = [&](bool last) {
    if (PINGPONG && !(last && cw == 1)) tma::named_arrive(3 + (cw ^ 1), 256);
  };
  const int first = next_tile(0);
  if (PINGPONG && cw == 1 && first < n_tiles) tma::named_arrive(3, 256);

  tma::wait(q_full, 0);
  if (first < n_tiles) {
    tma::wait(k_full(0), 0);
    turn_take();
    s_product(sK);
    turn_pass(false);
    wg::wait<0>();
    wg::fence_acc(s[0]);
    release_k(0, false);
    mask_tile(first, 0);
    release_k(0, true);
    sm.step(s, sl2);
    to_p(first);
  }
  int k = 0;  // CLASSES: the tiles computed before this one
  for (int it = next_tile(first + 1); it < n_tiles; it = next_tile(it + 1)) {
    const int seq = CLASSES ? ++k : it;
    const int slot = seq % STAGES, prev = (seq - 1) % STAGES;
    tma::wait(k_full(slot), (seq / STAGES) & 1);
    tma::wait(v_full(prev), ((seq - 1) / STAGES) & 1);
    turn_take();
    s_product(sK + slot * K_BYTES);
    pv_issue(sV + prev * V_BYTES);
    turn_pass(false);
    wg::wait<1>();  // this tile's S is done; the previous tile's P V may still run
    wg::fence_acc(s[0]);
    release_k(seq, false);
    mask_tile(it, seq);
    release_k(seq, true);
    sm.step(s, sl2);
    wg::wait<0>();
    pv_join();
    tma::arrive(v_empty(prev));
#pragma unroll
    for (int pf = 0; pf < DF / 2; ++pf) sm.rescale(o[2 * pf], o[2 * pf + 1], 0);  // O *= alpha
    to_p(it);
  }
  if (first < n_tiles) {
    const int seq = CLASSES ? k : n_tiles - 1;
    const int last = seq % STAGES;
    tma::wait(v_full(last), (seq / STAGES) & 1);
    turn_take();
    pv_issue(sV + last * V_BYTES);
    turn_pass(true);
    wg::wait<0>();
    pv_join();
    tma::arrive(v_empty(last));
  }

  // Normalize once (fwd_mma.cu's end of block, one m-fragment per warp) and stage the output in
  // the warpgroup's own rows of the Q tile (swizzled like it: conflict-free), once every product
  // of the warpgroup has finished reading Q.
  tma::named_sync(1 + cw, 128);
  bool refix = false;  // a row only double settles (fwd_fix_rows, at the end)
  const float sink = SINKS ? static_cast<float>(sinks[bh]) : 0.f;
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    const float l_row = sm.row_sum(0, hh);
    const int r = row_w + g + 8 * hh;
    const int i = i0 + r;
    const bool empty = row_empty(i, Nq, b32);
    float inv_l = dz.scaled(sm.out_scale(l_row, empty));  // (dropout: times 1 / (1 - p))
    refix |= !FOLD ? !empty & !(l_row > 0.f && l_row < pos_inf<float>())  // fwd_mma.cu's rules
                   : !empty & (fabsf(sm.m[0][hh]) > FOLD_LIMIT);
    if constexpr (SINKS) {  // the sink joins the row's softmax (refix read the keys' l, m)
      float lse_row = sm.lse(0, hh, empty, l_row);
      join_sink(sink, inv_l, lse_row);
      if (t == 0 && i < Nq) lse[bh * Nq + i] = lse_row;
    } else if (t == 0 && i < Nq) {
      lse[bh * Nq + i] = sm.lse(0, hh, empty, l_row);
    }
#pragma unroll
    for (int df = 0; df < DF; ++df) {
      const float x = o[df][2 * hh] * inv_l, y = o[df][2 * hh + 1] * inv_l;
      if constexpr (F32) {  // columns 8 df + 2 t, + 1: 8 bytes of a 32-float column block
        const int c = (df % 4) * 8 + 2 * t;
        asm volatile("st.shared.v2.f32 [%0], {%1, %2};"
                     ::"r"(sQ + (df / 4) * Q_BLK + r * 128 + stored_chunk<true>(r, c / 4) * 16 +
                           (c % 4) * 4), "f"(x), "f"(y) : "memory");
      } else {
        st_shared_b32(sQ + (df / 8) * Q_BLK + r * 128 + stored_chunk<true>(r, df % 8) * 16 + 4 * t,
                      Mma<T>::pack(x, y));
      }
    }
  }
  tma::named_sync(1 + cw, 128);
  constexpr int EPC = 16 / sizeof(T);  // elements per 16-byte chunk
  constexpr int CPR = DV / EPC;  // chunks of a staged row; the first Dv / EPC are stored
  const int ltid = tid % 128;
#pragma unroll
  for (int idx = ltid; idx < 64 * CPR; idx += 128) {
    const int r = cw * 64 + idx / CPR, c = idx % CPR;
    const int i = i0 + r;
    if (i < Nq && c * EPC < Dv) {
      uint4 val;
      asm volatile("ld.shared.v4.b32 {%0,%1,%2,%3}, [%4];"
                   : "=r"(val.x), "=r"(val.y), "=r"(val.z), "=r"(val.w)
                   : "r"(sQ + (c / 8) * Q_BLK + r * 128 + stored_chunk<true>(r, c % 8) * 16)
                   : "memory");
      *reinterpret_cast<uint4*>(out + (bh * Nq + i) * Dv + c * EPC) = val;
    }
  }
  // The warpgroups' rows are all written: the ones to settle again, each warp its own 16 rows.
  if (tma::named_sync_or(5, CONSUMER_THREADS, refix)) {
    const AttnArgs a{q_rs, k_rs, v_rs, mask_rs, mask_cs, bias_rs, bias_cs, BH, Nq, Nk, Dk, Dv,
                     scale_d, left, right, bottom_right, mod0, mod1, mod_table};
    const long long r0 = bh * Nq + i0 + row_w;
    const long long r1 = bh * Nq + min(i0 + row_w + 16, Nq);  // (r1 <= r0: none)
    fwd_fix_rows_apart<T, float, LostF, DK / 32>(q_mem, k_mem, v_mem, out, lse, offsets, mask,
                                                 bias, kv_lens, a, lost, r0, r1,
                                                 SINKS ? sinks : nullptr, drop...);
  }
}

// tf32_operand: one float32 operand of the float32 forward, rounded to TF32 (to nearest), as a
// contiguous copy y of (batch, head) matrices, PARTS of them per matrix (2: hi, then lo = the
// remainder rounded: WideMma's split). x's matrix m = bx * heads + hx (element strides rs, cs
// within, hs, bs between) of rows x cols becomes matrices m PARTS + part of y:
//   TRANSPOSE = false (q, k): rows of ld >= cols floats (the columns past cols 0);
//   TRANSPOSE = true (v): its transpose, cols rows of ld >= rows keys (fwd_wgmma's V^T), key
//     8 a + j at slot 8 a + j / 2 (j even) or 8 a + 4 + j / 2 (j odd), 0 past the rows and, with
//     kv_lens, past the longest key length of the output (batch, head)s that read the matrix
//     (heads hx hdiv .. hx hdiv + hdiv - 1 of batch bx, or of every batch of B where the matrix
//     is broadcast, bmul = 0): no key at or past every reader's length reaches O, whatever it
//     holds.
// Block (32, 8): a tile of 32 rows x 32 columns of the matrix (TRANSPOSE: 32 keys x 32 columns
// through shared memory); grid x = matrices x column tiles, y = row tiles.
template <bool TRANSPOSE, int PARTS>
__global__ void __launch_bounds__(256)
tf32_operand(const float* __restrict__ x, float* __restrict__ y, int rows, int cols, int heads,
             long long rs, long long cs, long long hs, long long bs, int ld,
             const long long* __restrict__ kv_lens, int B, int H, int hdiv, int bmul) {
  const int n_ct = ((TRANSPOSE ? cols : ld) + 31) / 32;
  const long long m = blockIdx.x / n_ct;
  const int c0 = static_cast<int>(blockIdx.x % n_ct) * 32, r0 = blockIdx.y * 32;
  const int bx = static_cast<int>(m / heads), hx = static_cast<int>(m % heads);
  const float* xm = x + bx * bs + hx * hs;
  const int tx = threadIdx.x, ty = threadIdx.y;
  const long long mat = static_cast<long long>(TRANSPOSE ? cols : rows) * ld;  // y's matrix
  auto store = [&](float* at, float v) {  // hi, and lo one matrix later
    tc::u32 hi, lo;
    tc::WideMma<float, PARTS == 2 ? 3 : 1>::split(v, hi, lo);
    at[0] = __uint_as_float(hi);
    if (PARTS == 2) at[mat] = __uint_as_float(lo);
  };
  float* ym = y + m * PARTS * mat;
  if constexpr (!TRANSPOSE) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int r = r0 + ty + 8 * i, c = c0 + tx;
      if (r < rows && c < ld)
        store(ym + static_cast<long long>(r) * ld + c, c < cols ? xm[r * rs + c * cs] : 0.f);
    }
  } else {
    __shared__ float tile[32][33];
    long long len = kv_lens ? 0 : rows;
    if (kv_lens)
      for (int b = bmul ? bx : 0; b < (bmul ? bx + 1 : B); ++b)
        for (int h = hx * hdiv; h < (hx + 1) * hdiv; ++h)
          len = max(len, kv_lens[static_cast<long long>(b) * H + h]);
    const int keys = static_cast<int>(min(static_cast<long long>(rows), len));
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int r = r0 + ty + 8 * i, c = c0 + tx;
      tile[ty + 8 * i][tx] = r < keys && c < cols ? xm[r * rs + c * cs] : 0.f;
    }
    __syncthreads();
    const int j = tx % 8, key = (tx & ~7) + (j < 4 ? 2 * j : 2 * (j - 4) + 1);  // slot tx's key
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int d = c0 + ty + 8 * i, s = r0 + tx;
      if (d < cols && s < ld) store(ym + static_cast<long long>(d) * ld + s, tile[key][ty + 8 * i]);
    }
  }
}
