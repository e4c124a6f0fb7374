// bwd_mma.cu: FlashAttention-2-class backward on tensor cores (mma.sync), float16 / bfloat16, sm_80+.
// On sm_90a the dK/dV kernel has a wgmma form (tcb::DKDV_WGMMA, wgmma.cuh): the same body,
// with its four key-row products as warpgroup instructions.
//
//   bwd_mma_prep   (lost_rows.cu) per query row: delta = rowsum(dO * O) and lse2 = lse * log2(e)
//                  (+inf for an empty or lost row), both float32 in (BH, Nq_pad) buffers padded
//                  with (+inf, 0) rows, so that the main kernels load them in 16-byte copies with
//                  no bounds test, and P = exp2(s * scale * log2(e) - lse2) is exactly 0 on empty
//                  and padding rows; with dQ atomics it also zeroes the row's float32 dQ (dq_zero)
//                  and adds the lost rows' exact dQ; dO in another layout is copied to
//                  (BH, Nq, Dv) rows on the way.
//   bwd_mma_dkdv   one block per key tile of BLOCK_N = 16 * NWARPS keys of one (batch, head);
//                  warp w owns keys [16 w, 16 w + 16) of the tile, K and V stay in shared memory
//                  (or registers), dK and dV accumulate in float32 registers. The block walks the
//                  query tiles (BLOCK_M rows, aligned to BLOCK_M) that can see its key tile
//                  (mask.cuh tile_query_range); Q, dO, lse2, delta stream through a two-stage
//                  cp.async ring. Per query tile, in the transposed orientation (rows = keys):
//                    S^T  = K Q^T            A = K (ldmatrix / regs), B = Q (ldmatrix)
//                    P^T  = exp2(S^T * scale * log2e - lse2[col])   (0 where invisible)
//                    dV  += P^T dO           A = P^T packed from the S^T accumulators, B = dO (.trans)
//                    dP^T = V dO^T           A = V, B = dO (ldmatrix)
//                    dS^T = scale * P^T (dP^T - delta[col])
//                    dQ   = dS K             (DQ_ATOMIC) dS^T through shared memory, A = dS by
//                                            ldmatrix.trans of dS^T, B = K (.trans), warps split
//                                            over (query rows, head dim), into registers
//                    dK  += dS^T Q           A = dS^T packed from registers, B = Q (.trans); the
//                                            dQ block is added to the float32 dq_acc (BH, Nq, Dk,
//                                            zeroed by bwd_mma_prep) with red.global.add, a few per
//                                            k-step of this product (tcb::dq_reduction_at).
//                                            The wgmma form defers them to the next query tile
//                                            (DEFER_DQ, DQ_UNDER) or hands the block, staged in
//                                            shared memory, to the bulk copy engine (DQ_BULK).
//                  With tcb::DKDV_DBIAS, P^T (dP^T - delta) is stored per pair (the bias's
//                  gradient, attn_core.cuh store_dbias).
//   bwd_mma_dq     deterministic dQ (no atomics): one block per query tile of 16 * NWARPS rows,
//                  key tiles through a cp.async ring (as fwd_mma.cu), S, P, dP, dS recomputed
//                  in registers, dQ += dS K, one plain store per element. With bwd_mma_dkdv
//                  <DQ_ATOMIC = false> the whole backward is bitwise reproducible.
// The scale is folded into dS before it is rounded to 16 bits, so dK and dQ need no final scaling.
// Tiles entirely visible to every row of the query tile skip the per-element predicate (the same
// full-tile rule as fwd_mma.cu); with a mask or a bias (HAS_MB) every tile takes it.
//
// Requirements (the host falls back to the generic path otherwise): (Dk, Dv) a pair of the host's
// tables (Dk = HEAD_DIM, Dv = DV; DV != HEAD_DIM on padded tiles only, in rows of the wider), unit
// innermost stride, row strides and offsets multiples of 8 elements, 16-byte aligned bases,
// scale > 0, Nq, Nk <= 2^29 (32-bit predicate, as fwd_mma.cu).
#include "common.cuh"
#include "mask.cuh"
#include "mask_tiles.cuh"
#include "attn_core.cuh"
#include "mma.cuh"
#include "wgmma.cuh"
#include "philox.cuh"

// Every lse2 / delta buffer has Nq_pad = round_up(Nq, LSE_PAD) rows per (batch, head); LSE_PAD is a
// multiple of every BLOCK_M (the host mirrors it in _mma_bwd.LSE_PAD).
constexpr int LSE_PAD = 128;

namespace tcb {
using tc::u32;

// bwd_mma_dkdv OPT bits (0: the mma.sync kernel on padded tiles):
//   DKDV_SWZ     K, V, Q and dO tiles unpadded (rows of HEAD_DIM * 2 bytes, a multiple of 128)
//                with FA2's XOR swizzle of the 16-byte chunks (tc::chunk_offset): padded rows
//                straddle 128-byte lines and make the cp.async copies cost more shared store
//                wavefronts. Every ldmatrix address of those tiles goes through tc::tile_addr (one
//                XOR per distinct column offset); dS^T stays padded (its 4-byte stores and
//                ldmatrix.trans are conflict-free as they are). The shared base is rounded up to a
//                row (the XOR must not carry into it); the host reserves the extra row.
//                HEAD_DIM % 64 == 0.
//   DKDV_WGMMA   sm_90a (wgmma.cuh): the four products whose rows are keys (S^T, dP^T, dV,
//                dK) on wgmma instead of mma.sync; warpgroup h (warps 4h..4h+3) owns keys
//                [64 h, 64 h + 64), so every register fragment is where the mma.sync form has it
//                and the masking / softmax / dS code is shared. S^T and dP^T read K, V, Q, dO from
//                shared memory (K-major), dV and dK take P^T, dS^T from registers and dO, Q
//                MN-major. S^T and dP^T are issued together, dV runs under dS, dK under dQ (which
//                stays on mma.sync) and the dQ reductions (issued together, while dK runs). Needs
//                DKDV_SWZ, HEAD_DIM 64 or 128 (tiles stored as blocks of 64 columns), BLOCK_M 32 or
//                64, 8 warps, K and V in shared memory; tile bases 1024-aligned.
//   DKDV_WG_DQ   with DKDV_WGMMA, dQ atomics, at HEAD_DIM 128 and BLOCK_M 64 or HEAD_DIM 64 and
//                BLOCK_M 128 (_mma_bwd.DKDV_TILES_WG_DQ, DKDV_TILES_WG_PLAIN): dQ = dS K on wgmma
//                too. dS^T goes to shared memory 128-byte-swizzled (rows = keys, blocks of 64
//                queries of 128 bytes), read as an MN-major A; at D=128 warpgroup h takes dQ's
//                columns [64 h, 64 h + 64) over all 128 keys with K's column block h as an
//                MN-major B, at D=64 its query rows [64 h, 64 h + 64) (dS^T's block h). Its
//                fragments are the mma.sync dQ layout's (WM x WD warps), so the reductions are the
//                same. At 128 queries dK += dS^T Q reads its A from those rows too (K-major,
//                after a barrier of the warpgroup), not from registers: 32 registers fewer.
//   DKDV_DQ_T    with DKDV_WG_DQ and DKDV_DQ_BULK at HEAD_DIM 128, BLOCK_M 80 (_mma_bwd
//                DKDV_TILES_WG_PLAIN): 80 queries are no multiple of wgmma's M = 64, so dQ is made
//                transposed, dQ^T = K^T dS^T: warpgroup h takes dQ's columns [64 h, 64 h + 64) as
//                its M (K's column block h read MN-major), N = the 80 queries, from dS stored as
//                rows of queries (K-major B; stmatrix .trans of the packed dS^T fragments), and
//                puts them in the dQ block transposed (rows of HEAD_DIM + 4 floats: conflict-free).
//                The host pads lse2 / delta to a multiple of 640 (LSE_PAD and 80).
//   DKDV_HALVES  head dims whose dK + dV accumulators do not fit a warp's registers (192,
//                256): two blocks per key tile (blockIdx.x = 2 * tile + half), block `half` owns
//                the second or first half of dK's, dV's and dQ's columns; S^T and dP^T (full head
//                dim contractions) are computed by both (7 products per tile pair instead of 5).
//                Padded tiles, K / V in shared memory.
// (An enum, not constexpr ints: NVRTC emits namespace-scope constants as globals.)
// (Host-side, _mma_bwd.OPT_GRID selects the warp-grid kernel bwd_mma_dkdv_grid; the kernels never
// see it.)
// DKDV_DBIAS: the bias's gradient, P^T (dP^T - delta) per pair into dbias (BH, Nq, Nk)
//                (attn_core.cuh store_dbias; with DKDV_HALVES by the block of half 0). A mask /
//                bias modifier only; without it dbias is null and unread.
// DKDV_SBIAS: a bias comes with each query tile: its [i0, i0 + BLOCK_M) x [j0, j0 + BLOCK_N)
//                block is copied into the ring slot of the tile's Q and dO (copy_bias_block: any
//                strides; zeros past Nq and Nk), rows of sbias_pitch floats,
//                and the modifier reads it there (StagedBias), not from global memory in the
//                key-row orientation, where every load waited on its own round trip. No copy and
//                no read without a bias.
// DKDV_GROUP: a block's keys serve `group` consecutive (batch, head)s bh = bkv * group + h (GQA:
//                the query heads of one kv head): its query tiles run head after head through
//                the one ring, dK and dV accumulate over all of them and are stored once, per
//                bkv (no sum pass after). No modifier, no dropout, no dbias, one window for the
//                group (the host's rule, _mma_bwd.group_size).
// DKDV_DQ_BULK: with DKDV_WGMMA, 64 queries per step and dQ atomics: each tile's dQ block is
//                stored to shared memory and added to dq_acc by the bulk copy engine at the next
//                tile's top (add_dq_block). The host sets it (_mma_bwd.wg_tile says when) and
//                allocates the block (dkdv_smem_bytes).
// DKDV_DQ_ORDER: with DKDV_DQ_BULK, deterministic dQ: the key blocks of a head add each query
//                row's dQ in one order fixed by the shapes (dq_turn), a row's turn counted in
//                dq_turns (zeroed by prep); each issuing thread waits for its row's turn, adds,
//                and passes the turn on once the engine's writes are done (at the next sDQ
//                wait). No modifier (its skipped tiles would break the order's ranges).
// DKDV_LIKE: with DKDV_WGMMA, no modifier, dropout or dbias: dK and dV (16-bit) stored in k's and
//                v's layouts (kv_row_at), the host's rule (_mma_bwd._recipe); a separate
//                instantiation, since a runtime switch in the stores changed the main loop's
//                schedule (D=64 3 % slower, H100).
enum DkdvOpt : int { DKDV_SWZ = 1, DKDV_WGMMA = 2, DKDV_WG_DQ = 4, DKDV_HALVES = 16,
                     DKDV_DBIAS = 64, DKDV_SBIAS = 128, DKDV_GROUP = 256, DKDV_DQ_BULK = 512,
                     DKDV_DQ_ORDER = 1024, DKDV_LIKE = 2048, DKDV_DQ_T = 8192 };

// DKDV_DQ_ORDER: the place of key block jb (of n_blocks, BLOCK_N keys each) among the blocks of
// its head that see query tile m (BLOCK_M rows): the blocks whose queries start later (a causal
// or right-bounded window: they reach tile m first, their first tiles lying further down) go
// first, `late_first`; otherwise (every block from tile 0 on) in block order. The blocks that see
// a tile are consecutive (tile_query_range's bounds rise with the keys), so a binary search over
// the predicate the kernel's own tile range uses finds the first (last) of them.
template <int BLOCK_M, int BLOCK_N>
__device__ __forceinline__ int dq_turn(const Window& w, int jb, int n_blocks, int m, int Nq,
                                       bool late_first) {
  auto sees = [&](int b) {  // key block b sees tile m (b on jb's side of the run)
    const KeyRange r = tile_query_range(w, static_cast<long long>(b) * BLOCK_N,
                                        static_cast<long long>(b) * BLOCK_N + BLOCK_N - 1, Nq);
    return r.lo <= r.hi && (late_first ? r.lo / BLOCK_M <= m : r.hi / BLOCK_M >= m);
  };
  int lo = late_first ? jb : 0, hi = late_first ? n_blocks - 1 : jb;
  while (lo < hi) {  // late_first: the last block that sees m; else the first
    const int mid = late_first ? (lo + hi + 1) / 2 : (lo + hi) / 2;
    if (late_first)
      sees(mid) ? lo = mid : hi = mid - 1;
    else
      sees(mid) ? hi = mid : lo = mid + 1;
  }
  return late_first ? lo - jb : jb - lo;
}
// ... and where every block of the head (nb of them: those up to the last visible key's) sees all
// M query tiles and block b starts at tile s_b = b M / nb (wrapping around): its place by arrival
// at tile m, (m - s_b) mod M, ties in block order. below(x): the blocks that start at or before
// tile x. In 32 bits (M (nb + 1) <= 2^32, _mma_bwd.ordered_tile): 64-bit divisions are a software
// routine, four per tile and thread.
__device__ __forceinline__ int spread_turn(int jb, int nb, int M, int m) {
  const unsigned unb = nb, uM = M;
  auto below = [&](int x) {
    const unsigned n = (static_cast<unsigned>(x + 1) * unb + uM - 1) / uM;
    return static_cast<int>(n < unb ? n : unb);
  };
  const int s = static_cast<int>(static_cast<unsigned>(jb) * uM / unb);
  const int ahead = m >= s ? below(m) - below(s) : nb - below(s) + below(m);
  return ahead + jb - below(s - 1);
}
// A row's turn: read early by a relaxed load (peek_turn, a tile ahead: its latency hides under
// the tile's products), waited for (wait_turn, acquire) only if that read had not seen it yet;
// passed (pass_turn) by a relaxed add once the bulk adds are complete (cp.async.bulk.wait_group
// 0), without a release: a release is a GPU-scope membar that waits for the next tile's copies
// in flight. Why the order holds: the predecessor's bulk adds are performed at L2 before its
// pass is issued, and this block's bulk add is issued only after its load returned the passed
// value (a control dependency: stores are not issued speculatively). Only the run-to-run
// determinism rests on it; the sum is atomic either way.
__device__ __forceinline__ int peek_turn(const int* turn) {
  int now;
  asm volatile("ld.relaxed.gpu.global.b32 %0, [%1];" : "=r"(now) : "l"(turn) : "memory");
  return now;
}
__device__ __forceinline__ void wait_turn(const int* turn, int mine) {
  int now;
  do {
    asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(now) : "l"(turn) : "memory");
  } while (now != mine);
}
__device__ __forceinline__ void pass_turn(int* turn) {
  asm volatile("red.relaxed.gpu.global.add.s32 [%0], 1;" ::"l"(turn) : "memory");
}

// DKDV_SBIAS: the staged bias block's row pitch in floats (BLOCK_N + 4: the rows 2 t apart that a
// quad reads together fall on disjoint banks).
template <int BLOCK_N>
__host__ __device__ constexpr int sbias_pitch() {
  return BLOCK_N + 4;
}

// The bias block of query rows [i0, i0 + BLOCK_M) and keys [j0, j0 + BLOCK_N) of one head
// (bias: its (0, 0); strides in elements) into shared memory at dst, rows of PITCH floats, zeros
// past Nq and Nk: 16-byte cp.async where the block's rows are whole and 16-byte aligned (unit key
// stride, row stride and head base multiples of 4 floats, keys j0 + BLOCK_N <= Nk: one test per
// block), else one 4-byte cp.async per element (any strides).
template <int BLOCK_M, int BLOCK_N, int PITCH, int THREADS>
__device__ __forceinline__ void copy_bias_block(u32 dst, const float* bias, long long rs,
                                                long long cs, int i0, int j0, int Nq, int Nk) {
  static_assert(BLOCK_N % 4 == 0 && PITCH % 4 == 0, "16-byte chunks of the bias rows");
  const bool chunks = cs == 1 && rs % 4 == 0 && j0 + BLOCK_N <= Nk &&
                      reinterpret_cast<unsigned long long>(bias) % 16 == 0;
  if (chunks) {
    constexpr int CPR = BLOCK_N / 4;  // chunks per row
#pragma unroll
    for (int e = threadIdx.x; e < BLOCK_M * CPR; e += THREADS) {
      const int r = e / CPR, c = (e % CPR) * 4;
      const bool ok = i0 + r < Nq;
      const float* src = ok ? bias + (i0 + r) * rs + j0 + c : bias;
      tc::cp_async16(dst + (r * PITCH + c) * 4, src, ok ? 16 : 0);
    }
    return;
  }
#pragma unroll 4
  for (int e = threadIdx.x; e < BLOCK_M * BLOCK_N; e += THREADS) {
    const int r = e / BLOCK_N, c = e % BLOCK_N;
    const bool ok = i0 + r < Nq && j0 + c < Nk;
    const float* src = ok ? bias + (i0 + r) * rs + (j0 + c) * cs : bias;
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(dst + (r * PITCH + c) * 4),
                 "l"(src), "r"(ok ? 4 : 0) : "memory");
  }
}

// DKDV_SBIAS: a modifier (attn_core.cuh ScoreModT) whose bias of (query i, key j) is read from
// the staged block at `block` (query rows from i0, keys from j0, rows of PITCH floats).
template <typename Mod, int PITCH>
struct StagedBias {
  static constexpr bool READS_INPUTS = Mod::READS_INPUTS, IDENTITY = Mod::IDENTITY;
  static constexpr bool HAS_GRAD = Mod::HAS_GRAD, POSITIONAL = Mod::POSITIONAL;
  using Transform = typename Mod::Transform;
  const Mod& mod;
  u32 block;
  int i0, j0;
  __device__ __forceinline__ float at(int i, long long j) const {
    float b;
    asm volatile("ld.shared.f32 %0, [%1];"
                 : "=f"(b)
                 : "r"(block + ((i - i0) * PITCH + (static_cast<int>(j) - j0)) * 4));
    return b;
  }
  __device__ __forceinline__ float operator()(float x, int i, long long j) const {
    return mod.logit(x, i, j, [&] { return at(i, j); });
  }
  __device__ __forceinline__ float apply(float x, int i, long long j, float& g) const {
    return mod.logit(x, i, j, [&] { return at(i, j); }, &g);
  }
};

// s[mi][nf][e] = f(s[mi][nf][e], value, mi, nf, e) over S^T-shaped fragments (rows = keys,
// columns = queries q0 + nf * 8 + 2t + e % 2), value = that query's entry of the shared float
// array col (lse2 or delta; one v2 load per n-fragment serves its two columns).
template <int MF, int NQF, typename F>
__device__ __forceinline__ void with_query_values(float (&s)[MF][NQF][4], u32 col, int q0, int t,
                                                  F f) {
#pragma unroll
  for (int nf = 0; nf < NQF; ++nf) {
    float v[2];
    tc::ld_shared_v2f(col + (q0 + nf * 8 + 2 * t) * 4, v[0], v[1]);
#pragma unroll
    for (int mi = 0; mi < MF; ++mi)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[mi][nf][e] = f(s[mi][nf][e], v[e % 2], mi, nf, e);
  }
}
template <int NQF, typename F>  // one m-fragment
__device__ __forceinline__ void with_query_values(float (&s)[NQF][4], u32 col, int q0, int t,
                                                  F f) {
  with_query_values(reinterpret_cast<float(&)[1][NQF][4]>(s), col, q0, t,
                    [&](float x, float v, int, int nf, int e) { return f(x, v, nf, e); });
}
// The same in two steps: query_values loads the entries ahead of their use (the wgmma kernel
// issues them under the products whose accumulators they meet), with_query_values applies them.
template <int NQF>
__device__ __forceinline__ void query_values(float (&v)[NQF][2], u32 col, int q0, int t) {
#pragma unroll
  for (int nf = 0; nf < NQF; ++nf)
    tc::ld_shared_v2f(col + (q0 + nf * 8 + 2 * t) * 4, v[nf][0], v[nf][1]);
}
template <int NQF, typename F>
__device__ __forceinline__ void with_query_values(float (&s)[NQF][4], const float (&v)[NQF][2],
                                                  F f) {
#pragma unroll
  for (int nf = 0; nf < NQF; ++nf)
#pragma unroll
    for (int e = 0; e < 4; ++e) s[nf][e] = f(s[nf][e], v[nf][e % 2], nf, e);
}

// The dQ reductions of a query tile go out spread over the k-steps of the product that follows
// them (dK += dS^T Q; phase 2 in bwd_mma_dkdv_grid), ceil(NR / STEPS) per k-step: issued as one
// burst at the end of the tile they fill the load/store queue, and the next tile's copies wait.
__host__ __device__ constexpr bool dq_reduction_at(int r, int step, int NR, int STEPS) {
  return r / ((NR + STEPS - 1) / STEPS) == step;
}

// acc (this warp's 16 key rows x NQF*8 query columns) = A B^T over the head dim, A the key-side
// fragments (K or V: from registers, or from shared memory at a_row), B the query-side rows (Q or
// dO) in shared memory at b_row (a_row, b_row: lane addresses, tc::tile_addr; SWZ: swizzled
// tiles). S^T = K Q^T and dP^T = V dO^T are both this product.
template <typename T, int NQF, int KD, bool KV_IN_REGS, int ROW_BYTES, bool SWZ, int NA>
__device__ __forceinline__ void rows_times_queries(float (&acc)[NQF][4], const u32 (&areg)[NA][4],
                                                   u32 a_row, u32 b_row) {
  using namespace tc;
  zero(acc);
#pragma unroll
  for (int kk = 0; kk < KD; ++kk) {
    u32 a[4];
    if (KV_IN_REGS) {
#pragma unroll
      for (int e = 0; e < 4; ++e) a[e] = areg[KV_IN_REGS ? kk : 0][e];
    } else {
      ldsm_x4(tile_addr<SWZ>(a_row, 0, kk * 32), a);
    }
#pragma unroll
    for (int p = 0; p < NQF / 2; ++p) {
      u32 b[4];
      ldsm_x4(tile_addr<SWZ>(b_row, p * 16 * ROW_BYTES, kk * 32), b);
      Mma<T>::run2(acc[2 * p], acc[2 * p + 1], a, b);
    }
  }
}

// DKDV_LIKE: where the dK / dV kernels store key row j of their block, the host's dk / dv having
// k's / v's strides: the offsets table's row `input` (1: k, 2: v) for the block's first head bh,
// then j rows of the input's row stride rs. (Computed at each store: made before the stores, on
// the mma.sync tiles, the offsets spilled kernels at 255 registers on sm_90a by 4-36 bytes.)
__device__ __forceinline__ long long kv_row_at(const long long* offsets, int BH, long long bh,
                                               long long rs, int input, int j) {
  return offsets[input * BH + bh] + j * rs;
}

// One thread's pairs of a dK and a dV row (row half h of each 16x8 fragment, NFK / NFV fragments 8
// columns apart) at element offsets ek, ev: float32, or the inputs' 16-bit type when out16 (the
// host's dk / dv are then T arrays: no GQA / broadcast sum follows, so no float32 round trip).
template <typename T, int NFK, int NFV>
__device__ __forceinline__ void store_kv_rows(float* dk_acc, float* dv_acc, long long ek,
                                              long long ev, const float (&dk)[NFK][4],
                                              const float (&dv)[NFV][4], int h, int out16) {
  using namespace tc;
  constexpr int NF = NFK > NFV ? NFK : NFV;
  if (out16) {
    T* dkr = reinterpret_cast<T*>(dk_acc) + ek;
    T* dvr = reinterpret_cast<T*>(dv_acc) + ev;
#pragma unroll
    for (int f = 0; f < NF; ++f) {
      if (f < NFK)
        *reinterpret_cast<u32*>(dkr + f * 8) =
            Mma<T>::pack(dk[f < NFK ? f : 0][2 * h], dk[f < NFK ? f : 0][2 * h + 1]);
      if (f < NFV)
        *reinterpret_cast<u32*>(dvr + f * 8) =
            Mma<T>::pack(dv[f < NFV ? f : 0][2 * h], dv[f < NFV ? f : 0][2 * h + 1]);
    }
  } else {
    float* dkr = dk_acc + ek;
    float* dvr = dv_acc + ev;
#pragma unroll
    for (int f = 0; f < NF; ++f) {
      if (f < NFK)
        *reinterpret_cast<float2*>(dkr + f * 8) =
            make_float2(dk[f < NFK ? f : 0][2 * h], dk[f < NFK ? f : 0][2 * h + 1]);
      if (f < NFV)
        *reinterpret_cast<float2*>(dvr + f * 8) =
            make_float2(dv[f < NFV ? f : 0][2 * h], dv[f < NFV ? f : 0][2 * h + 1]);
    }
  }
}

// One query tile of the dK/dV kernels into ring slot `slot` (of two): Q (HEAD_DIM = Dk) and dO (DV)
// rows from i0 (zeros past Nq; dO's rows are contiguous) in rows of the wider of the two, lse2 and
// delta of those rows (their buffers are padded). SWZ: Q and dO tiles swizzled (tc::chunk_offset).
template <int BLOCK_M, int HEAD_DIM, int THREADS, typename T, bool SWZ = false, int DV = HEAD_DIM>
__device__ __forceinline__ void copy_query_tile(u32 sQ, u32 sdO, u32 sL, u32 sD, int slot,
                                                const T* qh, long long q_rs, const T* doh,
                                                const float* l2h, const float* dh, int i0,
                                                int Nq) {
  using namespace tc;
  constexpr int PD = HEAD_DIM > DV ? HEAD_DIM : DV;  // row pitch (elements, padded tiles)
  constexpr int QT_BYTES = BLOCK_M * (SWZ ? HEAD_DIM : PD + 8) * 2;
  const int tid = threadIdx.x;
  cp_tile<BLOCK_M, HEAD_DIM, THREADS, T, SWZ, PD>(sQ + slot * QT_BYTES, qh, q_rs, i0, Nq);
  cp_tile<BLOCK_M, DV, THREADS, T, SWZ, PD>(sdO + slot * QT_BYTES, doh, DV, i0, Nq);
  if (tid < BLOCK_M / 4) {
    cp_async16(sL + slot * BLOCK_M * 4 + tid * 16, l2h + i0 + tid * 4, 16);
  } else if (tid < BLOCK_M / 2) {
    const int c = tid - BLOCK_M / 4;
    cp_async16(sD + slot * BLOCK_M * 4 + c * 16, dh + i0 + c * 4, 16);
  }
}
// One dK/dV block's view of its head: the window and its 32-bit bounds, the query tiles that
// can see the keys [j0, j0 + BLOCK_N) by position (m_first and the n_mt after it), and the head's
// inputs (q, k, v; dO (rows of DV), lse2, delta per output row).
template <typename T>
struct KeyBlock : HeadQKV<T> {
  Window w;
  Bounds32 pr;
  int m_first, n_mt;
  const T* dout;
  const float *lse2, *delta;
};
template <int DV, int BLOCK_M, int BLOCK_N, typename T>
__device__ __forceinline__ KeyBlock<T> key_block(long long bh, int j0, const T* q, const T* k,
                                                 const T* v, const T* dout, const float* lse2,
                                                 const float* delta, const long long* offsets,
                                                 const long long* kv_lens, int BH, int Nq, int Nk,
                                                 int left, int right, int bottom_right,
                                                 int Nq_pad) {
  KeyBlock<T> b;
  b.w = head_window(kv_lens, bh, Nq, Nk, left, right, bottom_right);
  b.pr = make_bounds32(b.w);
  const KeyRange qr = tile_query_range(b.w, j0, j0 + BLOCK_N - 1, Nq);
  b.m_first = qr.lo <= qr.hi ? static_cast<int>(qr.lo) / BLOCK_M : 0;
  b.n_mt = qr.lo <= qr.hi ? static_cast<int>(qr.hi) / BLOCK_M - b.m_first + 1 : 0;
  static_cast<HeadQKV<T>&>(b) = head_qkv(q, k, v, offsets, BH, bh);
  b.dout = dout + bh * Nq * DV;
  b.lse2 = lse2 + bh * Nq_pad;
  b.delta = delta + bh * Nq_pad;
  return b;
}
}  // namespace tcb

// P^T's fragments 2 kk, 2 kk + 1 as the A operand of dV += P^T dO; with dropout (philox.cuh
// dropped_keys' bits `zb`) the dropped entries 0 and the kept ones times rscale.
template <typename T, int NQF, typename DZ>
__device__ __forceinline__ void p_operand(const float (&s)[NQF][4], int kk,
                                          decltype(dropped_bits<NQF>()) zb, const DZ& dz,
                                          tc::u32 (&pa)[4]) {
  if constexpr (DZ::ON) {
    float a[4], b[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      a[k] = (zb >> (8 * kk + k)) & 1u ? 0.f : dz.scaled(s[2 * kk][k]);
      b[k] = (zb >> (8 * kk + 4 + k)) & 1u ? 0.f : dz.scaled(s[2 * kk + 1][k]);
    }
    tc::acc_to_a<T>(a, b, pa);
  } else {
    tc::acc_to_a<T>(s[2 * kk], s[2 * kk + 1], pa);
  }
}

// Grid: 1-D, blockIdx.x = bh * n_ntiles + key tile (DKDV_HALVES: times 2, + half): the blocks of
// one (batch, head) run together (its Q and dO stay in L2), the first key tiles (the longest
// causal ones) first. OPT: tcb::DkdvOpt.
// HEAD_DIM: Dk (q, k, dq, dk); DV: Dv (v, dout, dv), DV != HEAD_DIM on padded tiles only.
// Drop: empty, or DropoutArgs (philox.cuh): dV += (Z P^T / (1 - p)) dO and
// dS^T = scale * P^T (Z dP^T / (1 - p) - delta), Z the forward's keep bits.
template <typename T, int HEAD_DIM, int DV, int BLOCK_M, int NWARPS, bool KV_IN_REGS,
          bool DQ_ATOMIC, typename Mod, int MIN_BLOCKS, int OPT, typename... Drop>
__global__ void __launch_bounds__(NWARPS * 32, MIN_BLOCKS)
bwd_mma_dkdv(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
             const T* __restrict__ dout, const float* __restrict__ lse2,
             const float* __restrict__ delta, float* __restrict__ dq_acc,
             float* __restrict__ dk_acc, float* __restrict__ dv_acc, const TileClasses classes,
             ATTN_INPUTS(float), const AttnArgs a, int Nq_pad, int out16,
             float* __restrict__ dbias, int* __restrict__ dq_turns, int group,
             const Drop... drop) {
  using namespace tc;
  ATTN_ARGS_LOCALS(a, float);
  constexpr bool HAS_MB = !Mod::IDENTITY;  // the score modifier works on every element
  constexpr int THREADS = NWARPS * 32;
  constexpr int BLOCK_N = 16 * NWARPS;  // keys per block, 16 per warp
  constexpr int NQF = BLOCK_M / 8;      // n-fragments of S^T / dP^T (queries)
  constexpr bool HALVES = (OPT & tcb::DKDV_HALVES) != 0;  // half of dK, dV, dQ's columns
  constexpr bool DBIAS = (OPT & tcb::DKDV_DBIAS) != 0;    // the bias's gradient
  static_assert(!DBIAS || Mod::READS_INPUTS, "DKDV_DBIAS: a modifier that reads the bias");
  constexpr bool SBIAS = Mod::READS_INPUTS && (OPT & tcb::DKDV_SBIAS) != 0;  // staged bias
  constexpr int SB_PITCH = tcb::sbias_pitch<16 * NWARPS>();
  constexpr int SB_BYTES = SBIAS ? BLOCK_M * SB_PITCH * 4 : 0;  // per ring slot
  constexpr int DCK = HALVES ? HEAD_DIM / 2 : HEAD_DIM;    // this block's dK / dQ columns
  constexpr int DCV = HALVES ? DV / 2 : DV;                // and dV columns
  constexpr int DFK = DCK / 8;          // n-fragments of dK (head dim)
  constexpr int DFV = DCV / 8;          // and of dV
  constexpr int KD = HEAD_DIM / 16;     // k-steps of K Q^T
  constexpr int KDV = DV / 16;          // and of V dO^T
  constexpr int PD = HEAD_DIM > DV ? HEAD_DIM : DV;  // row pitch of the padded tiles (elements)
  constexpr int KM = BLOCK_M / 16;      // k-steps of P^T dO and dS^T Q
  constexpr bool SWZ = (OPT & tcb::DKDV_SWZ) != 0;  // K, V, Q, dO swizzled (tc::chunk_offset)
  constexpr int ROW_BYTES = SWZ ? HEAD_DIM * 2 : (PD + 8) * 2;  // bytes per row of a tile
  // Row pitch inside a tile: swizzled tiles are blocks of 64 columns (tc::cp_tile), rows of 128
  // bytes; KBLK: bytes per block of the K tile when there are several (else 0, tc::tile_addr).
  constexpr int LROW = SWZ ? 128 : ROW_BYTES;
  constexpr u32 KBLK = SWZ && HEAD_DIM > 64 ? BLOCK_N * 128 : 0;
  constexpr bool WG_DQ = (OPT & tcb::DKDV_WG_DQ) != 0;  // dQ on wgmma (swizzled dS^T)
  constexpr bool DQ_TR = (OPT & tcb::DKDV_DQ_T) != 0;   // ... as dQ^T = K^T dS^T (80 queries)
  // dS^T rows (keys) in shared memory: padded, or (WG_DQ) 128-byte-swizzled rows of 64 queries,
  // in blocks of DS_BLK bytes (BLOCK_N rows) per 64 queries
  constexpr int DS_ROW = WG_DQ ? 128 : (BLOCK_M + 8) * 2;
  constexpr u32 DS_BLK = BLOCK_N * 128;
  // DQ_TR: dS as rows of queries, in blocks of DST_BLK bytes per 64 keys
  constexpr u32 DST_BLK = BLOCK_M * 128;
  // DQ_BULK (DKDV_DQ_BULK): a tile's dQ block is stored to shared memory (rows of DQ_PITCH
  // bytes, 8 banks apart: conflict-free) and added to dq_acc by the bulk copy engine at the next
  // tile's top, a row per DQ_T-th thread (add_dq_block): no red.global.add for the fences to wait
  // for.
  constexpr bool DQ_BULK = (OPT & tcb::DKDV_DQ_BULK) != 0;
  constexpr bool ORDER = (OPT & tcb::DKDV_DQ_ORDER) != 0;  // deterministic dQ (dq_turn)
  constexpr bool LIKE = (OPT & tcb::DKDV_LIKE) != 0;      // dK, dV in k's, v's layouts
  static_assert(!ORDER || (DQ_BULK && !HAS_MB), "DKDV_DQ_ORDER: DQ_BULK, no modifier");
  constexpr int DQ_PITCH = (HEAD_DIM + (DQ_TR ? 4 : 8)) * 4;  // (DQ_TR: transposed stores)
  constexpr int QT_BYTES = BLOCK_M * ROW_BYTES;
  // dQ = dS K: WM warps along the query rows (16 each), WD along the head dim.
  constexpr int WM = BLOCK_M / 16;
  constexpr int WD = NWARPS / WM;
  constexpr int DQ_COLS = DCK / (WD > 0 ? WD : 1);  // dQ columns per warp
  static_assert(BLOCK_M % 16 == 0 && HEAD_DIM % 16 == 0 && DV % 16 == 0, "tile shape");
  static_assert(!SWZ || HEAD_DIM % 64 == 0, "DKDV_SWZ: rows of a multiple of 8 chunks");
  static_assert(DV == HEAD_DIM || (!SWZ && !KV_IN_REGS), "Dk != Dv: padded tiles in shared memory");
  constexpr bool WG = (OPT & tcb::DKDV_WGMMA) != 0;  // four products on wgmma (sm_90a)
  static_assert(!LIKE || (WG && !HAS_MB && sizeof...(Drop) == 0 && !DBIAS),
                "DKDV_LIKE: the wgmma kernel, no modifier, dropout or dbias");
  static_assert(!WG || (SWZ && (HEAD_DIM == 64 || HEAD_DIM == 128) &&
                        (BLOCK_M == 32 || BLOCK_M == 64 || (BLOCK_M == 128 && HEAD_DIM == 64) ||
                         (BLOCK_M == 80 && DQ_TR)) &&
                        NWARPS == 8 && !KV_IN_REGS),
                "DKDV_WGMMA: swizzled tiles, head dim 64 / 128, 32 or 64 (D=64: or 128) x 128 "
                "tile, K / V in shared memory");
  static_assert(!SWZ || HEAD_DIM == 64 || WG, "DKDV_SWZ's mma.sync products: one column block");
  static_assert(!HALVES || (!SWZ && !KV_IN_REGS && DCK % 16 == 0 && DCV % 16 == 0),
                "DKDV_HALVES: padded tiles, K / V in shared memory, halves of 16-column steps");
  static_assert(!WG_DQ || (WG && (BLOCK_M * HEAD_DIM == 64 * 128 || DQ_TR) && DQ_ATOMIC),
                "DKDV_WG_DQ: the wgmma kernel, 64 queries per step at D=128 or 128 at D=64, dQ "
                "atomics");
  static_assert(!DQ_TR || (WG_DQ && DQ_BULK && !ORDER && HEAD_DIM == 128 && BLOCK_M == 80),
                "DKDV_DQ_T: dQ on wgmma, through shared memory, unordered, D=128, 80 queries");
  // Shared tile bases: swizzled tiles start on a row (tc::tile_addr's XOR must not carry into the
  // base), wgmma's 128-byte swizzle on 8 rows (it swizzles absolute addresses).
  constexpr u32 BASE_ALIGN = WG ? 8 * LROW : LROW;
  // (DQ_TR's 80 queries: the host pads to a multiple of 640, _mma_bwd.nq_padded)
  static_assert(DQ_TR || (BLOCK_M <= LSE_PAD && LSE_PAD % BLOCK_M == 0), "lse2/delta padding");
  static_assert(THREADS >= BLOCK_M / 2, "lse2/delta copies: one 16-byte chunk per thread");
  static_assert(!DQ_ATOMIC || DQ_TR || (WD >= 1 && NWARPS % WM == 0 && DQ_COLS % 16 == 0 &&
                                        DQ_COLS <= 64),
                "dQ warp layout (at most 32 accumulators per thread, held through dK)");

  const int n_ntiles = (Nk + BLOCK_N - 1) / BLOCK_N;
  const unsigned blk = HALVES ? blockIdx.x / 2 : blockIdx.x;  // the key tile's block
  // GROUP (DKDV_GROUP): the block's query tiles are those of `heads` heads from bh, head after
  // head; bkv numbers the block's dK / dV rows (the kv head; else bkv = bh).
  constexpr bool GROUP = (OPT & tcb::DKDV_GROUP) != 0;
  static_assert(!GROUP || (!HAS_MB && sizeof...(Drop) == 0 && !DBIAS && !HALVES),
                "DKDV_GROUP: no modifier, dropout, dbias or column halves");
  const int heads = GROUP ? group : 1;
  const long long bkv = blk / n_ntiles;
  const long long bh = bkv * heads;  // (the first head of the group)
  const int j0 = static_cast<int>(blk % n_ntiles) * BLOCK_N;
  const int half = HALVES ? static_cast<int>(blockIdx.x % 2) : 0;
  const int c0 = half * DCK, c0v = half * DCV;  // this block's first dK / dQ and dV column

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int g = lane / 4, t = lane % 4;  // fragment coordinates: row g (+8), columns 2t, 2t+1

  const tcb::KeyBlock<T> kb = tcb::key_block<DV, BLOCK_M, BLOCK_N>(
      bh, j0, q, k, v, dout, lse2, delta, offsets, kv_lens, BH, Nq, Nk, left, right,
      bottom_right, Nq_pad);
  const Window& w = kb.w;
  const Bounds32& pr = kb.pr;
  // ORDER: the order of this head's key blocks (kb.w). jl: the block of the last visible key.
  // late_first (tcb::dq_turn): the later blocks start further down (causal, a right-bounded
  // window). spread (tcb::spread_turn): every block sees every query tile (no window); block jb
  // then starts at tile rot = jb * n_mt / (jl + 1) and wraps around, so that the blocks reach a
  // tile one after another (from one tile, in block order, each would wait for all before it).
  // Otherwise (a left window alone) block order from tile 0.
  const int jl = w.L > 0 ? static_cast<int>((w.L - 1) / BLOCK_N) : 0;
  const int n_qt = (Nq - 1) / BLOCK_M + 1;  // the head's query tiles
  const bool late_first =
      ORDER && tile_query_range(w, static_cast<long long>(jl) * BLOCK_N,
                                static_cast<long long>(jl) * BLOCK_N + BLOCK_N - 1, Nq).lo >=
                   BLOCK_M;
  const KeyRange block0 = tile_query_range(w, 0, BLOCK_N - 1, Nq);  // (block 0's queries)
  const bool spread = ORDER && !late_first && w.L > 0 && block0.lo <= block0.hi &&
                      block0.hi / BLOCK_M == n_qt - 1;
  const int rot = spread ? static_cast<int>(static_cast<long long>(j0 / BLOCK_N) * kb.n_mt /
                                            (jl + 1))
                         : 0;
  // What the mask shows of query tile m_first + it against this key block (mask_tiles.cuh, with
  // HAS_MB): the tiles it hides are skipped (next_query_tile); the others keep the per-element
  // mask (a shortcut for the tiles it shows entirely spilled the D=96 tile on sm_80).
  const ClassColumn cls = class_column(classes, bh, j0 / BLOCK_N);
  auto query_class = [&](int it) {
    return HAS_MB && cls.column != nullptr ? cls.column[(kb.m_first + it) * cls.step]
                                           : TILE_MIXED;
  };
  auto next_query_tile = [&](int it) {
    if (HAS_MB)
      while (it < kb.n_mt && query_class(it) == TILE_HIDDEN) ++it;
    return it;
  };
  const int first = next_query_tile(0);

  // Shared layout (mirrored by _mma_bwd.dkdv_smem_bytes): K, V [BLOCK_N], Q, dO [2][BLOCK_M] rows
  // of ROW_BYTES (SWZ: as blocks of 64 columns, tc::cp_tile); dS^T [BLOCK_N] rows of DS_ROW;
  // lse2, delta [2][BLOCK_M] floats. SWZ: from the first BASE_ALIGN-aligned address (every tile
  // base is then aligned: tc::tile_addr's XOR, wgmma's swizzle).
  u32 sK, sV, sQ, sdO, sdS, sL, sD, sDQ, sB;
  shared_regions<SWZ ? BASE_ALIGN : 16>(sK, BLOCK_N * ROW_BYTES, sV, BLOCK_N * ROW_BYTES, sQ,
                                        2 * QT_BYTES, sdO, 2 * QT_BYTES, sdS,
                                        DQ_TR   ? BLOCK_N / 64 * DST_BLK
                                        : WG_DQ ? BLOCK_M / 64 * DS_BLK
                                                : BLOCK_N * DS_ROW,
                                        sL,
                                        2 * BLOCK_M * 4, sD, 2 * BLOCK_M * 4, sDQ,
                                        DQ_BULK ? BLOCK_M * DQ_PITCH : 0, sB);

  // Per-lane ldmatrix offsets (mma.cuh layouts), as (row, 16-byte chunk) in
  // tc::chunk_offset; the blocks a lane reads are then tc::tile_addr(tile base + offset, ...):
  //  K, V as A (rows = this warp's keys, x4): row lane % 16, chunk lane / 16
  //  Q, dO as B of K Q^T / V dO^T (x4 over two query fragments): row (lane % 8) + 8 * (lane / 16),
  //    chunk (lane / 8) % 2
  //  Q, dO, K as B of P^T dO, dS^T Q, dS K (x4.trans over two head-dim fragments):
  //    row (lane % 8) + 8 * ((lane / 8) % 2), chunk lane / 16
  //  dS as A of dS K, read transposed from dS^T (x4.trans, always padded): key row
  //    (lane % 8) + 8 * (lane / 16), query chunk (lane / 8) % 2
  const u32 a_lane = chunk_offset<SWZ, LROW>(warp * 16 + lane % 16, lane / 16);
  const u32 bn_lane = chunk_offset<SWZ, LROW>(lane % 8 + 8 * (lane / 16), (lane / 8) % 2);
  const u32 bt_lane = chunk_offset<SWZ, LROW>(lane % 8 + 8 * ((lane / 8) % 2), lane / 16);
  const u32 ds_lane = (lane % 8 + 8 * (lane / 16)) * DS_ROW + ((lane / 8) % 2) * 16;

  // Tile `it` of the block's sequence: its head (bh + head_of(it); GROUP: n_mt tiles per head)
  // and its first query row.
  auto head_of = [&](int it) { return GROUP ? it / kb.n_mt : 0; };
  auto row_of = [&](int it) {
    const int t = GROUP ? it - head_of(it) * kb.n_mt : it;
    return (kb.m_first + (ORDER ? (t + rot) % kb.n_mt : t)) * BLOCK_M;
  };
  // One query tile (rows from i0, of head bh + hd) into ring slot `slot` (tcb::copy_query_tile).
  auto load_query_tile = [&](int slot, int i0, int hd) {
    if constexpr (GROUP) {  // (the head's rows: as key_block finds them)
      const long long b = bh + hd;
      tcb::copy_query_tile<BLOCK_M, HEAD_DIM, THREADS, T, SWZ, DV>(
          sQ, sdO, sL, sD, slot, q + offsets[b], q_rs, dout + b * Nq * DV, lse2 + b * Nq_pad,
          delta + b * Nq_pad, i0, Nq);
      return;
    }
    tcb::copy_query_tile<BLOCK_M, HEAD_DIM, THREADS, T, SWZ, DV>(sQ, sdO, sL, sD, slot, kb.q, q_rs,
                                                             kb.dout, kb.lse2, kb.delta, i0, Nq);
    if constexpr (SBIAS) {  // (the modifier, made below, is read only once the copies are issued)
      if (bias != nullptr)
        tcb::copy_bias_block<BLOCK_M, BLOCK_N, SB_PITCH, THREADS>(
            sB + slot * SB_BYTES, bias + offsets[4 * BH + bh], bias_rs, bias_cs, i0, j0, Nq, Nk);
    }
  };

  // Prologue: K, V (zeros from key L on) with the first query tile, one commit group.
  if (first < kb.n_mt) {
    cp_tile<BLOCK_N, HEAD_DIM, THREADS, T, SWZ, PD>(sK, kb.k, k_rs, j0, static_cast<int>(w.L));
    cp_tile<BLOCK_N, DV, THREADS, T, SWZ, PD>(sV, kb.v, v_rs, j0, static_cast<int>(w.L));
    load_query_tile(0, row_of(first), head_of(first));
  }
  cp_async_commit();

  float dk[DFK][4], dv[DFV][4];
  zero(dk);
  zero(dv);

  const float NEG = neg_inf<float>();
  const float scale_log2 = scale * LOG2E;
  const Mod mod = Mod::make(MOD_INPUTS(bh), scale_log2, at_head(mod_args, bh, w.shift));
  // FOLD: the scale in exp2's FMA (attn_core.cuh folds_scale; ALiBi alone goes on the raw scores)
  constexpr bool FOLD = folds_scale<Mod::READS_INPUTS, typename Mod::Transform>();
  const auto raw = raw_transform<Mod::READS_INPUTS, typename Mod::Transform>(
      at_head(mod_args, bh, w.shift), 1.f / scale);
  const float sl2 = FOLD ? scale_log2 : 1.f;
  const int jw = j0 + warp * 16 + g;  // this thread's keys: jw and jw + 8
  const auto dz = dropout_at<float>(bh, drop...);  // philox.cuh: none without a DropoutArgs
  // EARLY_QV: a thread's lse2 (then delta) entries loaded under the products whose accumulators
  // they meet (WG), not after them: D=64 full 2-3 % faster (H100). Not on D=128's 64-query
  // tiles: with a modifier or dropout they spilled 12-108 bytes, and without, no gain showed
  // beyond the card's run-to-run drift (3 %).
  constexpr bool EARLY_QV = WG && BLOCK_M <= 64 && (HEAD_DIM == 64 || BLOCK_M == 32);

  u32 ka[KV_IN_REGS ? KD : 1][4], va[KV_IN_REGS ? KD : 1][4];

  // dQ[i0 + 16 wm .., col0 ..] = dS K over this block's BLOCK_N keys, into acc; reduction r adds
  // row half h = r / QF, columns nf = r % QF of it to dq_acc. WG: a tile's reductions go out at
  // the next tile's top, after its barrier (DEFER_DQ; the last tile's after the loop): the
  // fence.proxy.async before that barrier (MEMBAR.ALL.CTA) waits for every global access still in
  // flight, and held each tile's top until all of its reductions had landed (ncu, D=128).
  // DQ_UNDER: on the 32-query tiles (dQ on mma.sync) they go out under the next tile's S^T and
  // dP^T products instead (padding, bias 3 % faster on the H100; D=64's 64-query tile lost 2 %
  // that way, D=128's WG_DQ tile spilled).
  constexpr int QF = DQ_TR ? BLOCK_M / 8 : DQ_ATOMIC ? DQ_COLS / 8 : 1;  // (DQ_TR: dQ^T's N)
  constexpr int NR = 2 * QF;
  constexpr bool DEFER_DQ = WG && DQ_ATOMIC;
  constexpr bool DQ_UNDER = DEFER_DQ && !DQ_BULK && !WG_DQ && BLOCK_M == 32;
  float acc[QF][4];
  // This warp's dQ rows (16 wm ..) and columns (col0 ..): DEFER_DQ holds them through the loop;
  // the other tiles make them where they are used (held, they spilled D=96's mma.sync mask /
  // bias tile on sm_90a).
  const int wm_held = warp % WM, col0_held = c0 + (warp / WM) * DQ_COLS;
  auto dq_red = [&](int r, int i0, int hd) {  // (of the tile of rows i0 in head bh + hd)
    const int wm = DEFER_DQ ? wm_held : warp % WM;
    const int col0 = DEFER_DQ ? col0_held : c0 + (warp / WM) * DQ_COLS;
    const int h = r / QF, nf = r % QF;
    const int i = i0 + wm * 16 + g + 8 * h;
    if (i < Nq)
      red_add_f32x2(dq_acc + ((GROUP ? bh + hd : bh) * Nq + i) * HEAD_DIM + col0 + 2 * t + nf * 8,
                    acc[nf][2 * h], acc[nf][2 * h + 1]);
  };
  int dq_i0 = -1, dq_hd = 0;  // DEFER_DQ: the tile whose dQ block acc holds (rows, head), -1: none
  // DQ_BULK: that block from sDQ into dq_acc, row tid / DQ_T by thread tid % DQ_T == 0 (after the
  // barrier that follows its stores; its bulk group waited for before sDQ is written again).
  // (DQ_T threads per row; where BLOCK_M does not divide THREADS, row tid of the first BLOCK_M)
  constexpr int DQ_T = THREADS % BLOCK_M == 0 ? THREADS / BLOCK_M : 0;
  static_assert(!DQ_BULK || ((OPT & tcb::DKDV_WGMMA) != 0 && DQ_ATOMIC && THREADS >= BLOCK_M),
                "DKDV_DQ_BULK: the wgmma kernel with dQ atomics, a thread per row");
  const int dq_r = DQ_T ? (tid % DQ_T == 0 ? tid / DQ_T : -1) : (tid < BLOCK_M ? tid : -1);
  // ORDER: the row's turn first (dq_rank: the block's place for that tile; seen: the turn as
  // peek_turn read it when the tile's products were issued), then passed on once the engine has
  // written the row (sdq_free).
  int dq_rank = 0, seen = -1;
  int* turn = nullptr;
  auto dq_row = [&](int i0, int hd) {  // the row this thread adds of the tile (rows i0, head hd)
    return (GROUP ? bh + hd : bh) * Nq + i0 + dq_r;
  };
  auto add_dq_block = [&]() {
    const int r = dq_r;
    if (dq_i0 >= 0 && r >= 0 && dq_i0 + r < Nq) {
      const long long row = dq_row(dq_i0, dq_hd);
      if constexpr (ORDER) {
        turn = dq_turns + row;
        if (seen != dq_rank) tcb::wait_turn(turn, dq_rank);
        wg::fence_global();
      }
      wg::bulk_add_f32(dq_acc + row * HEAD_DIM, sDQ + r * DQ_PITCH, HEAD_DIM * 4);
      wg::bulk_commit();
    }
    if constexpr (ORDER) __syncwarp();  // (the lanes that waited rejoin before the wgmma)
  };
  auto sdq_free = [&]() {  // the last block's bulk adds have read sDQ (ORDER: and written dq)
    if constexpr (ORDER) {
      wg::bulk_wait<0>();
      if (turn != nullptr) tcb::pass_turn(turn), turn = nullptr;
    } else {
      wg::bulk_wait_read<0>();
    }
  };

  // n: the query tiles computed before this one (the ring's sequence)
  const int n_tiles = heads * kb.n_mt;  // (GROUP: n_mt per head)
  for (int it = first, n = 0; it < n_tiles; it = next_query_tile(it + 1), ++n) {
    const int i0 = row_of(it);
    const int slot = n & 1;
    cp_async_wait<0>();
    if (WG) wg::fence_shared();  // the copies are read by wgmma (the async proxy)
    __syncthreads();  // this tile landed; every warp finished the previous one (its slot, dS^T)
    const int next = next_query_tile(it + 1);
    if (next < n_tiles) load_query_tile(slot ^ 1, row_of(next), head_of(next));
    cp_async_commit();
    if constexpr (DQ_BULK) {
      add_dq_block();  // the previous tile's dQ block
    } else if constexpr (DEFER_DQ && !DQ_UNDER) {  // the previous tile's dQ reductions
      if (dq_i0 >= 0) {
#pragma unroll
        for (int r = 0; r < NR; ++r) dq_red(r, dq_i0, dq_hd);
      }
    }

    if (KV_IN_REGS && n == 0) {
#pragma unroll
      for (int kk = 0; kk < KD; ++kk) {
        ldsm_x4(tile_addr<SWZ>(sK + a_lane, 0, kk * 32), ka[KV_IN_REGS ? kk : 0]);
        ldsm_x4(tile_addr<SWZ>(sV + a_lane, 0, kk * 32), va[KV_IN_REGS ? kk : 0]);
      }
    }
    const u32 qs = sQ + slot * QT_BYTES, dos = sdO + slot * QT_BYTES;
    const u32 ls = sL + slot * BLOCK_M * 4, des = sD + slot * BLOCK_M * 4;

    // dropout: the entries the forward dropped (bit 4 nf + k; none without dropout)
    const auto zb = dropped_keys<NQF>(dz, jw, i0, t);

    // S^T = K Q^T (raw dot products). WG: dP^T = V dO^T is issued with it.
    float s[NQF][4], dp[NQF][4];
    float qv[EARLY_QV ? NQF : 1][2];  // EARLY_QV: this thread's lse2, then delta entries
    const u32 wg_rows = (warp / 4) * 64 * LROW;  // WG: this warpgroup's K / V rows
    if constexpr (WG) {
      wg::rows_times_rows<T, BLOCK_M, KD, BLOCK_N * 128, BLOCK_M * 128>(s, sK + wg_rows, qs);
      wg::rows_times_rows<T, BLOCK_M, KD, BLOCK_N * 128, BLOCK_M * 128>(dp, sV + wg_rows, dos);
      if constexpr (DQ_UNDER) {  // the previous tile's dQ reductions, under both products
        if (dq_i0 >= 0) {
#pragma unroll
          for (int r = 0; r < NR; ++r) dq_red(r, dq_i0, dq_hd);
        }
      }
      if constexpr (EARLY_QV) tcb::query_values(qv, ls, 0, t);
      wg::wait<1>();
      wg::fence_acc(s);
    } else {
      tcb::rows_times_queries<T, NQF, KD, KV_IN_REGS, LROW, SWZ>(s, ka, sK + a_lane,
                                                                    qs + bn_lane);
    }

    // Mask by global position (key = row, query = column), only where the tile is not entirely
    // visible. Padding query rows (>= Nq) need no test: their lse2 is +inf, so P = 0. WG: a tile
    // that a mask without bias shows entirely takes the position mask only, and the scale in
    // exp2's FMA (sl); on sm_80 that branch spilled the D=96 tile.
    const int i_last = min(i0 + BLOCK_M, Nq) - 1;
    bool shown = false;
    if constexpr (WG && HAS_MB && Mod::Transform::IDENTITY)
      shown = mod.bias == nullptr && query_class(it) == TILE_VISIBLE;
    float gr[Mod::HAS_GRAD ? NQF : 1][4];  // the modifier's derivative (HAS_GRAD)
    if (shown) {
      if (!tile_all_visible(pr, i0, i_last, j0, BLOCK_N))
        mask_key_rows(s, jw, i0, t, Nq, pr, NoMod());
    } else if (Mod::READS_INPUTS || !tile_all_visible(pr, i0, i_last, j0, BLOCK_N)) {
      if constexpr (SBIAS) {  // the bias from the tile's staged block
        const tcb::StagedBias<Mod, SB_PITCH> staged{mod, sB + slot * SB_BYTES, i0, j0};
        if constexpr (Mod::HAS_GRAD) mask_key_rows(s, jw, i0, t, Nq, pr, with_grad(staged, gr));
        else mask_key_rows(s, jw, i0, t, Nq, pr, staged);
      } else if constexpr (Mod::HAS_GRAD) {
        mask_key_rows(s, jw, i0, t, Nq, pr, with_grad(mod, gr));
      } else if constexpr (FOLD && HAS_MB) {
        mask_key_rows(s, jw, i0, t, Nq, pr, raw);
      } else {
        mask_key_rows(s, jw, i0, t, Nq, pr, mod);
      }
    } else if constexpr (HAS_MB && !Mod::READS_INPUTS) {  // a transform alone, tile visible
      if constexpr (FOLD) modify_all_keys(s, raw, jw, i0, t);
      else modify_all_keys(s, with_grad(mod, gr), jw, i0, t);
    }
    const float sl = shown ? scale_log2 : sl2;

    // P^T = exp2(S^T * scale * log2e - lse2[query]); -inf (invisible) and +inf lse2 (empty or
    // padding row) both give exactly 0.
    auto probability = [&](float x, float l2, int, int) { return ex2(fmaf(x, sl, -l2)); };
    if constexpr (EARLY_QV) tcb::with_query_values(s, qv, probability);
    else tcb::with_query_values(s, ls, 0, t, probability);

    // dV += P^T dO: P^T packed straight from the accumulators (k = queries).
    if constexpr (WG) {
      u32 pa[KM][4];
#pragma unroll
      for (int kk = 0; kk < KM; ++kk) p_operand<T>(s, kk, zb, dz, pa[kk]);
      wg::regs_times_tile<T, HEAD_DIM, KM, BLOCK_M * 128>(dv, pa, dos);
      if constexpr (EARLY_QV) tcb::query_values(qv, des, 0, t);  // under dP^T and dV
      wg::wait<1>();  // dP^T landed (dV may still run)
      wg::fence_acc(dp);
    }
#pragma unroll
    for (int kk = 0; kk < (WG ? 0 : KM); ++kk) {
      u32 pa[4];
      p_operand<T>(s, kk, zb, dz, pa);
#pragma unroll
      for (int p = 0; p < DFV / 2; ++p) {
        u32 b[4];
        ldsm_x4_t(tile_addr<SWZ>(dos + bt_lane, kk * 16 * LROW, c0v * 2 + p * 32), b);
        Mma<T>::run2(dv[2 * p], dv[2 * p + 1], pa, b);
      }
    }

    // dP^T = V dO^T (WG: issued with S^T).
    if constexpr (!WG)
      tcb::rows_times_queries<T, NQF, KDV, KV_IN_REGS, LROW, SWZ>(dp, va, sV + a_lane,
                                                                    dos + bn_lane);

    // dS^T = scale * P^T (dP^T - delta[query]) (times the modifier's derivative), in dp.
    constexpr bool GR = Mod::HAS_GRAD;
    auto score_grad = [&](float x, float delta, int nf, int e) {
      if constexpr (decltype(dz)::ON) x = (zb >> (4 * nf + e)) & 1u ? 0.f : dz.scaled(x);
      if constexpr (DBIAS)  // the bias's gradient (HALVES: by the first block of the two)
        if (half == 0)
          store_dbias(dbias, bh, Nq, Nk, i0 + nf * 8 + 2 * t + e % 2, jw + 8 * (e / 2), s[nf][e],
                      s[nf][e] * (x - delta));
      return scale * s[nf][e] * (x - delta) * grad_of<GR>(gr, nf, e);
    };
    if constexpr (EARLY_QV) tcb::with_query_values(dp, qv, score_grad);
    else tcb::with_query_values(dp, des, 0, t, score_grad);

    // dS^T packed to 16 bits (the A operand of dK += dS^T Q), and with DQ_ATOMIC stored to shared
    // memory for dQ.
    u32 da[KM][4];
#pragma unroll
    for (int kk = 0; kk < KM; ++kk) {
      acc_to_a<T>(dp[2 * kk], dp[2 * kk + 1], da[kk]);
      if (DQ_ATOMIC) {
        // a0 = (key g, queries 16kk + 2t..), a1 = key g + 8, a2/a3 = queries + 8. WG_DQ: query
        // chunk 2 kk (+1 for a2/a3) of key row r sits at chunk (2 kk) ^ (r % 8) (keys g and g + 8
        // share r % 8): 8 rows x 4 words per store, conflict-free.
        if constexpr (DQ_TR) {  // dS rows (queries) of this warp's 16 keys, 64 keys per block
          const int m = lane / 8, qrow = 16 * kk + 8 * (m / 2) + lane % 8;
          const int chunk = 2 * (warp % 4) + m % 2;  // (keys 16 (warp % 4) + 8 (m % 2) ..)
          wg::stsm_x4_t(sdS + (warp / 4) * DST_BLK + qrow * 128 + ((chunk ^ (qrow % 8)) * 16),
                        da[kk]);
        } else if constexpr (WG_DQ) {
          const int key = warp * 16 + g;
          const u32 blk = sdS + (kk / 4) * DS_BLK;  // (the block of queries 16 kk ..)
          const u32 row = blk + chunk_offset<true, DS_ROW>(key, (2 * kk) % 8) + 4 * t;
          const u32 row8 = blk + chunk_offset<true, DS_ROW>(key, (2 * kk + 1) % 8) + 4 * t;
          st_shared_b32(row, da[kk][0]);
          st_shared_b32(row + 8 * DS_ROW, da[kk][1]);
          st_shared_b32(row8, da[kk][2]);
          st_shared_b32(row8 + 8 * DS_ROW, da[kk][3]);
        } else {
          const u32 row = sdS + (warp * 16 + g) * DS_ROW + (kk * 16 + 2 * t) * 2;
          st_shared_b32(row, da[kk][0]);
          st_shared_b32(row + 8 * DS_ROW, da[kk][1]);
          st_shared_b32(row + 16, da[kk][2]);
          st_shared_b32(row + 8 * DS_ROW + 16, da[kk][3]);
        }
      }
    }
    // dK += dS^T Q, under dQ. WG_DQ at 128 queries and DQ_TR: A = this warpgroup's part of the
    // dS^T (dS) just stored (a barrier of its 128 threads), not the packed registers, which are
    // then free (from registers they spilled; at D=128's 64 queries the shared A was 4 % slower,
    // H100).
    if constexpr (WG_DQ && BLOCK_M == 128) {
      wg::fence_shared();
      asm volatile("bar.sync %0, 128;" ::"r"(1 + warp / 4) : "memory");
      wg::tile_times_tile<T, HEAD_DIM, KM, DS_BLK, BLOCK_M * 128>(dk, sdS + (warp / 4) * 64 * 128,
                                                                   qs);
    } else if constexpr (DQ_TR) {  // A = dS^T read MN-major from dS's block of this group's keys
      wg::fence_shared();
      asm volatile("bar.sync %0, 128;" ::"r"(1 + warp / 4) : "memory");
      wg::tile_t_times_tile<T, HEAD_DIM, KM, BLOCK_M * 128, true>(dk, sdS + (warp / 4) * DST_BLK,
                                                                  qs);
    } else if constexpr (WG) {
      wg::regs_times_tile<T, HEAD_DIM, KM, BLOCK_M * 128>(dk, da, qs);
    }

    // dQ = dS K into acc; its red.global.add go out at the next tile's top (DEFER_DQ), else a few
    // per k-step of dK below (tcb::dq_reductions_at).
    if constexpr (WG_DQ) {
      if constexpr (DQ_BULK) sdq_free();  // the last block left sDQ (barrier next)
      wg::fence_shared();  // dS^T is read by wgmma
      __syncthreads();     // dS^T of every warp in shared memory
      // warpgroup h: dQ's columns [64 h, 64 h + 64) at D=128, its query rows [64 h, 64 h + 64)
      // (dS^T's block h) at D=64
      if constexpr (DQ_TR) {  // dQ^T: warpgroup h's 64 columns x the 80 queries
        wg::tile_t_times_rows<T, BLOCK_M, BLOCK_N / 16, DST_BLK>(acc, sK + (warp / 4) * KBLK, sdS);
      } else {
        const u32 ds_blk = sdS + (BLOCK_M / 64 - 1) * (warp / 4) * DS_BLK;
        wg::tile_t_times_tile<T, 64, BLOCK_N / 16, 0>(acc, ds_blk, sK + (warp / 4) * KBLK);
      }
      wg::wait<0>();  // (dV and dK land here too)
      wg::fence_acc(acc);
    } else if (DQ_ATOMIC) {
      const int wm = DEFER_DQ ? wm_held : warp % WM;
      const int col0 = DEFER_DQ ? col0_held : c0 + (warp / WM) * DQ_COLS;
      if constexpr (DQ_BULK) sdq_free();  // the last block left sDQ (barrier next)
      __syncthreads();  // dS^T of every warp in shared memory
      zero(acc);
#pragma unroll
      for (int kk = 0; kk < BLOCK_N / 16; ++kk) {
        u32 a[4];
        ldsm_x4_t(sdS + ds_lane + kk * 16 * DS_ROW + wm * 32, a);
#pragma unroll
        for (int p = 0; p < QF / 2; ++p) {
          u32 b[4];
          ldsm_x4_t(tile_addr<SWZ, KBLK>(sK + bt_lane, kk * 16 * LROW, col0 * 2 + p * 32), b);
          Mma<T>::run2(acc[2 * p], acc[2 * p + 1], a, b);
        }
      }
    }
    if constexpr (DQ_TR) {  // dQ^T into sDQ transposed: column d of query row q
      const int d = (warp / 4) * 64 + (warp % 4) * 16 + g;
#pragma unroll
      for (int nf = 0; nf < QF; ++nf)
#pragma unroll
        for (int e = 0; e < 4; ++e)
          st_shared_f32(sDQ + (nf * 8 + 2 * t + e % 2) * DQ_PITCH + (d + 8 * (e / 2)) * 4,
                        acc[nf][e]);
    } else if constexpr (DQ_BULK) {  // acc into sDQ (added at the next tile's top)
#pragma unroll
      for (int nf = 0; nf < QF; ++nf)
#pragma unroll
        for (int h = 0; h < 2; ++h)
          st_shared_v2f(sDQ + (wm_held * 16 + g + 8 * h) * DQ_PITCH +
                            (col0_held + nf * 8 + 2 * t) * 4,
                        acc[nf][2 * h], acc[nf][2 * h + 1]);
    }
    // dK += dS^T Q (WG: issued above; both products land here, the dQ reductions wait for the
    // next tile's top).
    if constexpr (WG) {
      if (DQ_ATOMIC) dq_i0 = i0, dq_hd = head_of(it);
      if constexpr (ORDER) {
        dq_rank = spread ? tcb::spread_turn(j0 / BLOCK_N, jl + 1, n_qt, i0 / BLOCK_M)
                         : tcb::dq_turn<BLOCK_M, BLOCK_N>(w, j0 / BLOCK_N, n_ntiles,
                                                          i0 / BLOCK_M, Nq, late_first);
        if (dq_r >= 0 && i0 + dq_r < Nq)
          seen = tcb::peek_turn(dq_turns + dq_row(i0, dq_hd));
      }
      wg::wait<0>();
      wg::fence_acc(dv);
      wg::fence_acc(dk);
    }
#pragma unroll
    for (int kk = 0; kk < (WG ? 0 : KM); ++kk) {
      if (DQ_ATOMIC) {
#pragma unroll
        for (int r = 0; r < NR; ++r)
          if (tcb::dq_reduction_at(r, kk, NR, KM)) dq_red(r, i0, head_of(it));
      }
#pragma unroll
      for (int p = 0; p < DFK / 2; ++p) {
        u32 b[4];
        ldsm_x4_t(tile_addr<SWZ>(qs + bt_lane, kk * 16 * LROW, c0 * 2 + p * 32), b);
        Mma<T>::run2(dk[2 * p], dk[2 * p + 1], da[kk], b);
      }
    }
  }

  if constexpr (DQ_BULK) {  // the last tile's dQ block
    wg::fence_shared();
    __syncthreads();
    add_dq_block();
    sdq_free();  // (sDQ stays until the engine has read it)
  } else if constexpr (DEFER_DQ) {  // the last tile's dQ reductions
    if (dq_i0 >= 0) {
#pragma unroll
      for (int r = 0; r < NR; ++r) dq_red(r, dq_i0, dq_hd);
    }
  }

  // Every key row of the tile below Nk is written, zeros where no query sees it: rows of
  // (BH / group, Nk, D), or (LIKE) at their inputs' rows (tcb::kv_row_at).
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int j = jw + 8 * h;
    if (j < Nk) {
      const long long ek = LIKE ? tcb::kv_row_at(offsets, BH, bh, k_rs, 1, j)
                                : (bkv * Nk + j) * HEAD_DIM;
      const long long ev = LIKE ? tcb::kv_row_at(offsets, BH, bh, v_rs, 2, j)
                                : (bkv * Nk + j) * DV;
      tcb::store_kv_rows<T>(dk_acc, dv_acc, ek + c0 + 2 * t, ev + c0v + 2 * t, dk, dv, h, out16);
    }
  }
}

// Deterministic dQ. Grid: 1-D, blockIdx.x = bh * n_mtiles + (reversed query tile), as fwd_mma.
// BLOCK_M = 16 * NWARPS query rows, warp w owns rows [16 w, 16 w + 16); key tiles of BLOCK_N start
// at the first visible key (tile_key_range) and stream through a STAGES-deep ring of K and V.
// HEAD_DIM: Dk (q, k, dq); DV: Dv (v, dout).
// Drop: empty, or DropoutArgs (philox.cuh): dS = scale * P (Z dP / (1 - p) - delta).
template <typename T, int HEAD_DIM, int DV, int BLOCK_N, int NWARPS, int STAGES, typename Mod,
          int MIN_BLOCKS, typename... Drop>
__global__ void __launch_bounds__(NWARPS * 32, MIN_BLOCKS)
bwd_mma_dq(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
           const T* __restrict__ dout, const float* __restrict__ lse2,
           const float* __restrict__ delta, float* __restrict__ dq_acc, ATTN_INPUTS(float),
           const AttnArgs a, int Nq_pad, const Drop... drop) {
  using namespace tc;
  ATTN_ARGS_LOCALS(a, float);
  constexpr bool HAS_MB = !Mod::IDENTITY;  // the score modifier works on every element
  constexpr int THREADS = NWARPS * 32;
  constexpr int BLOCK_M = 16 * NWARPS;
  constexpr int NF = BLOCK_N / 8;   // n-fragments of S / dP (keys)
  constexpr int DF = HEAD_DIM / 8;  // n-fragments of dQ
  constexpr int KD = HEAD_DIM / 16;  // k-steps of Q K^T
  constexpr int KDV = DV / 16;       // and of dO V^T
  constexpr int KN = BLOCK_N / 16;  // k-steps of dS K
  constexpr int PD = HEAD_DIM > DV ? HEAD_DIM : DV;  // row pitch of every tile (elements)
  constexpr int ROW_BYTES = (PD + 8) * 2;
  constexpr int TILE_BYTES = BLOCK_N * ROW_BYTES;
  static_assert(BLOCK_N % 16 == 0 && HEAD_DIM % 16 == 0 && DV % 16 == 0, "tile shape");
  static_assert(LSE_PAD % BLOCK_M == 0, "lse2/delta padding");
  static_assert(STAGES >= 2, "cp.async ring depth");

  const QueryTile qt = query_tile<BLOCK_M>(Nq);
  const long long bh = qt.bh;
  const int i0 = qt.i0;

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int g = lane / 4, t = lane % 4;

  // key_tiles' fields, in the order whose PTX this kernel has always had (the full-tile bounds
  // last, next to the loop)
  const Window w = head_window(kv_lens, bh, Nq, Nk, left, right, bottom_right);
  const Bounds32 pr = make_bounds32(w);
  const KeyRange range = tile_key_range(w, i0, qt.i_last);
  const int n_tiles = range.hi >= range.lo
                          ? static_cast<int>((range.hi - range.lo) / BLOCK_N) + 1 : 0;
  const int j_first = static_cast<int>(range.lo);
  const int j_limit = static_cast<int>(range.hi) + 1;  // keys >= j_limit load as zeros

  const HeadQKV<T> in = head_qkv(q, k, v, offsets, BH, bh);
  const T* doh = dout + bh * Nq * DV;

  // Shared layout (mirrored by _mma_bwd.dq_smem_bytes): Q, dO [BLOCK_M], K, V [STAGES][BLOCK_N].
  u32 sQ, sdO, sK, sV;
  shared_regions(sQ, BLOCK_M * ROW_BYTES, sdO, BLOCK_M * ROW_BYTES, sK, STAGES * TILE_BYTES, sV);

  // ldmatrix lane offsets as fwd_mma.cu: Q, dO as A; K, V as B (non-trans); K as B of dS K (trans).
  const u32 a_lane = (warp * 16 + lane % 16) * ROW_BYTES + (lane / 16) * 16;
  const u32 bn_lane = (lane % 8 + 8 * (lane / 16)) * ROW_BYTES + ((lane / 8) % 2) * 16;
  const u32 bt_lane = (lane % 8 + 8 * ((lane / 8) % 2)) * ROW_BYTES + (lane / 16) * 16;

  cp_tile<BLOCK_M, HEAD_DIM, THREADS, T, false, PD>(sQ, in.q, q_rs, i0, Nq);
  cp_tile<BLOCK_M, DV, THREADS, T, false, PD>(sdO, doh, DV, i0, Nq);
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < n_tiles) {
      const int j0 = j_first + s * BLOCK_N;
      cp_tile<BLOCK_N, HEAD_DIM, THREADS, T, false, PD>(sK + s * TILE_BYTES, in.k, k_rs, j0,
                                                        j_limit);
      cp_tile<BLOCK_N, DV, THREADS, T, false, PD>(sV + s * TILE_BYTES, in.v, v_rs, j0, j_limit);
    }
    cp_async_commit();
  }

  // This thread's rows i0 + 16 warp + g (+ 8): lse2 (+inf past Nq) and delta (padded buffers).
  float l2r[2], der[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const long long i = static_cast<long long>(i0) + warp * 16 + g + 8 * h;
    l2r[h] = lse2[bh * Nq_pad + i];
    der[h] = delta[bh * Nq_pad + i];
  }

  float dq[DF][4];
  zero(dq);
  const float NEG = neg_inf<float>();
  const float scale_log2 = scale * LOG2E;
  const Mod mod = Mod::make(MOD_INPUTS(bh), scale_log2, at_head(mod_args, bh, w.shift));
  constexpr bool FOLD = folds_scale<Mod::READS_INPUTS, typename Mod::Transform>();
  const auto raw = raw_transform<Mod::READS_INPUTS, typename Mod::Transform>(
      at_head(mod_args, bh, w.shift), 1.f / scale);
  const float sl2 = FOLD ? scale_log2 : 1.f;
  const int full_lo = static_cast<int>(min(key_range(w, qt.i_last).lo, w.L));
  const int full_hi = static_cast<int>(max(key_range(w, i0).hi, -1LL));
  const auto dz = dropout_at<float>(bh, drop...);  // philox.cuh: none without a DropoutArgs

  for (int n = 0; n < n_tiles; ++n) {
    const int j0 = j_first + n * BLOCK_N;
    cp_async_wait<STAGES - 2>();
    __syncthreads();  // tile n landed for everyone; everyone finished tile n - 1's buffers
    {
      const int nn = n + STAGES - 1;
      const int buf = nn % STAGES;
      if (nn < n_tiles) {
        const int jn = j_first + nn * BLOCK_N;
        cp_tile<BLOCK_N, HEAD_DIM, THREADS, T, false, PD>(sK + buf * TILE_BYTES, in.k, k_rs, jn,
                                                          j_limit);
        cp_tile<BLOCK_N, DV, THREADS, T, false, PD>(sV + buf * TILE_BYTES, in.v, v_rs, jn,
                                                    j_limit);
      }
      cp_async_commit();
    }
    const u32 kbuf = sK + (n % STAGES) * TILE_BYTES;
    const u32 vbuf = sV + (n % STAGES) * TILE_BYTES;

    // S = Q K^T and dP = dO V^T. (Not rows_times_queries: its B lane address, formed before the
    // first A load, reorders this kernel's PTX.)
    float s[NF][4], dp[NF][4];
    zero(s);
    zero(dp);
#pragma unroll
    for (int kk = 0; kk < KD; ++kk) {
      u32 a[4];
      ldsm_x4(sQ + a_lane + kk * 32, a);
      mma_kstep<T, false, 16 * ROW_BYTES>(s, a, kbuf + bn_lane + kk * 32);
    }
#pragma unroll
    for (int kk = 0; kk < KDV; ++kk) {
      u32 a[4];
      ldsm_x4(sdO + a_lane + kk * 32, a);
      mma_kstep<T, false, 16 * ROW_BYTES>(dp, a, vbuf + bn_lane + kk * 32);
    }

    // Mask (rows = queries, columns = keys), only in tiles not entirely visible to the block.
    float gr[Mod::HAS_GRAD ? NF : 1][4];  // the modifier's derivative (HAS_GRAD)
    if (Mod::READS_INPUTS || j0 < full_lo || j0 + BLOCK_N - 1 > full_hi) {
      const int i = i0 + warp * 16 + g;
      if constexpr (Mod::HAS_GRAD) mask_rows(s, i, j0, t, Nq, pr, with_grad(mod, gr));
      else if constexpr (FOLD && HAS_MB) mask_rows(s, i, j0, t, Nq, pr, raw);
      else mask_rows(s, i, j0, t, Nq, pr, mod);
    } else if constexpr (HAS_MB && !Mod::READS_INPUTS) {  // a transform alone, tile visible
      if constexpr (FOLD) modify_all(s, raw, i0 + warp * 16 + g, j0, t);
      else modify_all(s, with_grad(mod, gr), i0 + warp * 16 + g, j0, t);
    }

    // dropout: dP's dropped entries 0, the kept ones times 1 / (1 - p) (no code without)
    drop_rows<true>(dp, dz, i0 + warp * 16 + g, j0, t);

    // dS = scale * P (dP - delta) (times the modifier's derivative),
    // P = exp2(S * scale * log2e - lse2[row]).
#pragma unroll
    for (int nf = 0; nf < NF; ++nf)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float p = ex2(fmaf(s[nf][e], sl2, -l2r[e / 2]));
        s[nf][e] = scale * p * (dp[nf][e] - der[e / 2]) * grad_of<Mod::HAS_GRAD>(gr, nf, e);
      }

    // dQ += dS K: dS packed from the accumulators (k = keys), K read transposed.
#pragma unroll
    for (int kk = 0; kk < KN; ++kk) {
      u32 da[4];
      acc_to_a<T>(s[2 * kk], s[2 * kk + 1], da);
      mma_kstep<T, true, 32>(dq, da, kbuf + bt_lane + kk * 16 * ROW_BYTES);
    }
  }
  cp_async_wait<0>();  // no copy outlives the block

#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int i = i0 + warp * 16 + g + 8 * h;
    if (i < Nq) {
      float* row = dq_acc + (bh * Nq + i) * HEAD_DIM + 2 * t;
#pragma unroll
      for (int df = 0; df < DF; ++df)
        *reinterpret_cast<float2*>(row + df * 8) = make_float2(dq[df][2 * h], dq[df][2 * h + 1]);
    }
  }
}

// ---- FA2-style warp grids (bwd_mma_dkdv_grid: _mma_bwd.DKDV_TILES_LARGE_SMEM) ---------------------
// Same ABI, grid and semantics as bwd_mma_dkdv with 8 warps and BLOCK_N = 128 keys, without the
// boolean mask / bias (HAS_MB = false; the host keeps bwd_mma_dkdv for those). Per query tile of
// BLOCK_M rows (32, 64 or 128), three phases on three different warp grids:
//   1. S^T = K Q^T and dP^T = V dO^T on a 4 (keys) x 2 (queries) grid: warp (wk, wq) = (warp / 2,
//      warp % 2) owns keys [32 wk, 32 wk + 32) x queries [wq BLOCK_M / 2, ..): per 16-wide k-step it
//      loads 2 A (K or V) and BLOCK_M / 32 B (Q or dO) ldmatrix.x4 for 2 * BLOCK_M / 8 mma (0.5 x4
//      per mma at BLOCK_M = 64, against 0.625 when one warp owns 16 keys x all queries). P^T and
//      dS^T (16-bit, scale folded into dS) go to shared memory, rows = keys ([BLOCK_N][BLOCK_M + 8]).
//   2. (after a barrier) dV += P^T dO and dK += dS^T Q on a 4 (keys) x 2 (head dim) grid: warp
//      (warp / 2, warp % 2) owns keys [32 (warp / 2), +32) x dims [(warp % 2) HEAD_DIM / 2, +HEAD_DIM/2),
//      A = P^T / dS^T by ldmatrix, B = dO / Q by ldmatrix.trans (0.375 x4 per mma at HEAD_DIM 128).
//   3. with DQ_ATOMIC, dQ = dS K on a DQ_WM (queries) x 8 / DQ_WM (head dim) grid, DQ_WM = 2 (4 at
//      BLOCK_M = 128): warp (warp % DQ_WM, warp / DQ_WM) owns query rows [(warp % DQ_WM) BLOCK_M /
//      DQ_WM, ..) x the matching head-dim slice, A = dS by ldmatrix.trans of dS^T, B = K by
//      ldmatrix.trans. Its product runs right after the barrier, before phase 2, and its
//      red.global.add go out a few per k-step of phase 2 (tcb::dq_reduction_at).
// The next iteration's top barrier protects P^T / dS^T and the Q / dO slot: two barriers per tile, as
// bwd_mma_dkdv. Shared memory (_mma_bwd.dkdv_smem_bytes with OPT_GRID): bwd_mma_dkdv's + P^T.
// The visibility test runs per warp sub-tile (32 keys x BLOCK_M / 2 queries) only where that sub-tile
// is not entirely visible; a sub-tile with nothing visible skips its S^T / dP^T products.
namespace tcb {
// acc[MF][NF] (+)= A B^T over KSTEPS k-steps of 16, A = MF * 16 rows at a_base (non-trans ldmatrix,
// rows of A_ROW bytes, k contiguous), B = NF * 8 rows at b_base (non-trans, rows of B_ROW bytes).
template <typename T, int MF, int NF, int KSTEPS, int A_ROW, int B_ROW>
__device__ __forceinline__ void gemm_nt(float (&acc)[MF][NF][4], u32 a_base, u32 b_base) {
  using namespace tc;
#pragma unroll
  for (int kk = 0; kk < KSTEPS; ++kk) {
    u32 a[MF][4];
#pragma unroll
    for (int mi = 0; mi < MF; ++mi) ldsm_x4(a_base + mi * 16 * A_ROW + kk * 32, a[mi]);
    mma_kstep<T, false, 16 * B_ROW>(acc, a, b_base + kk * 32);
  }
}
// acc[MF][NF] += A B over KSTEPS k-steps of 16, B = (k rows) x (NF * 8 columns) row-major at b_base
// read by ldmatrix.trans (rows of B_ROW bytes); A either non-trans at a_base (rows = M, k contiguous,
// A_TRANS = false) or transposed from a (k rows) x (M columns) matrix (A_TRANS = true).
// hook(kk) runs after k-step kk's products (NoHook: nothing).
struct NoHook {
  __device__ __forceinline__ void operator()(int) const {}
};
template <typename T, int MF, int NF, int KSTEPS, int A_ROW, int B_ROW, bool A_TRANS,
          typename Hook = NoHook>
__device__ __forceinline__ void gemm_nn(float (&acc)[MF][NF][4], u32 a_base, u32 b_base,
                                        Hook hook = Hook()) {
  using namespace tc;
#pragma unroll
  for (int kk = 0; kk < KSTEPS; ++kk) {
    u32 a[MF][4];
#pragma unroll
    for (int mi = 0; mi < MF; ++mi) {
      if (A_TRANS)
        ldsm_x4_t(a_base + kk * 16 * A_ROW + mi * 32, a[mi]);
      else
        ldsm_x4(a_base + mi * 16 * A_ROW + kk * 32, a[mi]);
    }
    mma_kstep<T, true, 32>(acc, a, b_base + kk * 16 * B_ROW);
    hook(kk);
  }
}
// Packs a (MF * 16) x (NF * 8) accumulator block to 16 bits and stores it at base (this warp's
// block origin; rows of ROW bytes): c0, c1 -> (row g, cols 2t, 2t+1), c2, c3 -> row g + 8.
template <typename T, int MF, int NF, int ROW>
__device__ __forceinline__ void store_acc16(const float (&acc)[MF][NF][4], u32 base, int g, int t) {
  using namespace tc;
#pragma unroll
  for (int mi = 0; mi < MF; ++mi)
#pragma unroll
    for (int nf = 0; nf < NF; ++nf) {
      const u32 a = base + (mi * 16 + g) * ROW + (nf * 8 + 2 * t) * 2;
      st_shared_b32(a, Mma<T>::pack(acc[mi][nf][0], acc[mi][nf][1]));
      st_shared_b32(a + 8 * ROW, Mma<T>::pack(acc[mi][nf][2], acc[mi][nf][3]));
    }
}
}  // namespace tcb

template <typename T, int HEAD_DIM, int BLOCK_M, bool DQ_ATOMIC, int MIN_BLOCKS>
__global__ void __launch_bounds__(256, MIN_BLOCKS)
bwd_mma_dkdv_grid(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                  const T* __restrict__ dout, const float* __restrict__ lse2,
                  const float* __restrict__ delta, float* __restrict__ dq_acc,
                  float* __restrict__ dk_acc, float* __restrict__ dv_acc,
                  const TileClasses /* no mask here */, ATTN_INPUTS(float), const AttnArgs a,
                  int Nq_pad, int out16) {
  using namespace tc;
  ATTN_ARGS_LOCALS(a, float);
  constexpr int THREADS = 256;
  constexpr int BLOCK_N = 128;
  constexpr int WN = 32;                // keys per warp (phases 1 and 2)
  constexpr int MF = WN / 16;           // m-fragments (keys)
  constexpr int QW = BLOCK_M / 2;       // queries per warp in phase 1
  constexpr int NQF = QW / 8;           // n-fragments of S^T / dP^T
  constexpr int KD = HEAD_DIM / 16;     // k-steps of K Q^T, V dO^T
  constexpr int KM = BLOCK_M / 16;      // k-steps of P^T dO, dS^T Q
  constexpr int DW = HEAD_DIM / 2;      // head dims per warp for dK, dV
  constexpr int DNF = DW / 8;
  // dQ grid: DQ_WM warps along the query rows x 8 / DQ_WM along the head dim.
  constexpr int DQ_WM = BLOCK_M >= 128 ? 4 : 2;
  constexpr int QQ = BLOCK_M / DQ_WM;   // query rows per warp for dQ
  constexpr int QMF = QQ / 16;          // m-fragments of dQ (query rows)
  constexpr int QDW = HEAD_DIM * DQ_WM / 8;  // head dims per warp for dQ
  constexpr int QDF = QDW / 8;
  constexpr int ROW_BYTES = (HEAD_DIM + 8) * 2;
  constexpr int PS_ROW = (BLOCK_M + 8) * 2;  // P^T / dS^T rows (keys), padded
  constexpr int QT_BYTES = BLOCK_M * ROW_BYTES;
  static_assert(BLOCK_M % 32 == 0 && BLOCK_M <= LSE_PAD && LSE_PAD % BLOCK_M == 0, "BLOCK_M");
  static_assert(HEAD_DIM % 64 == 0, "head dim: 64 or 128 (DW, QDW multiples of 16)");
  static_assert(QQ % 16 == 0 && QDW % 16 == 0, "dQ warp grid");
  static_assert(THREADS >= BLOCK_M / 2, "lse2/delta copies: one 16-byte chunk per thread");

  const int n_ntiles = (Nk + BLOCK_N - 1) / BLOCK_N;
  const long long bh = blockIdx.x / n_ntiles;
  const int j0 = static_cast<int>(blockIdx.x % n_ntiles) * BLOCK_N;

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int g = lane / 4, t = lane % 4;
  const int wk = warp / 2;   // key block of phases 1, 2
  const int wq = warp % 2;   // query half of phase 1, head-dim half of phase 2
  const int kr0 = wk * WN;   // this warp's first key row within the tile
  const int qc0 = wq * QW;   // this warp's first query within the tile (phase 1)
  const int dc0 = wq * DW;   // this warp's first head dim of dK, dV
  const int qq0 = (warp % DQ_WM) * QQ;   // this warp's first query row of dQ
  const int dq0 = (warp / DQ_WM) * QDW;  // this warp's first head dim of dQ

  const tcb::KeyBlock<T> kb = tcb::key_block<HEAD_DIM, BLOCK_M, BLOCK_N>(
      bh, j0, q, k, v, dout, lse2, delta, offsets, kv_lens, BH, Nq, Nk, left, right,
      bottom_right, Nq_pad);
  const Window& w = kb.w;
  const Bounds32& pr = kb.pr;

  // K, V [BLOCK_N], Q, dO [2][BLOCK_M] rows of ROW_BYTES; dS^T, P^T [BLOCK_N] rows of PS_ROW;
  // lse2, delta [2][BLOCK_M] floats.
  u32 sK, sV, sQ, sdO, sdS, sL, sD, sP;
  shared_regions(sK, BLOCK_N * ROW_BYTES, sV, BLOCK_N * ROW_BYTES, sQ, 2 * QT_BYTES, sdO,
                 2 * QT_BYTES, sdS, BLOCK_N * PS_ROW, sL, 2 * BLOCK_M * 4, sD, 2 * BLOCK_M * 4,
                 sP);

  // ldmatrix lane offsets (mma.cuh layouts), all relative to a block's first row / column:
  //  A non-trans (rows = M, k contiguous): row lane % 16, column 8 * (lane / 16)
  //  B non-trans (rows = N, k contiguous), x4 over two n-fragments: row (lane % 8) + 8 * (lane / 16),
  //    column 8 * ((lane / 8) % 2)
  //  B trans (rows = k, N contiguous), x4 over two n-fragments: row (lane % 8) + 8 * ((lane / 8) % 2),
  //    column 8 * (lane / 16)
  //  A trans (rows = k, M contiguous): row (lane % 8) + 8 * (lane / 16), column 8 * ((lane / 8) % 2)
  const u32 a_lane = (lane % 16) * ROW_BYTES + (lane / 16) * 16;
  const u32 bn_lane = (lane % 8 + 8 * (lane / 16)) * ROW_BYTES + ((lane / 8) % 2) * 16;
  const u32 bt_lane = (lane % 8 + 8 * ((lane / 8) % 2)) * ROW_BYTES + (lane / 16) * 16;
  const u32 pa_lane = (lane % 16) * PS_ROW + (lane / 16) * 16;
  const u32 ds_lane = (lane % 8 + 8 * (lane / 16)) * PS_ROW + ((lane / 8) % 2) * 16;

  auto load_query_tile = [&](int slot, int i0) {
    tcb::copy_query_tile<BLOCK_M, HEAD_DIM, THREADS>(sQ, sdO, sL, sD, slot, kb.q, q_rs, kb.dout,
                                                     kb.lse2, kb.delta, i0, Nq);
  };

  if (kb.n_mt > 0) {
    cp_tile<BLOCK_N, HEAD_DIM, THREADS>(sK, kb.k, k_rs, j0, static_cast<int>(w.L));
    cp_tile<BLOCK_N, HEAD_DIM, THREADS>(sV, kb.v, v_rs, j0, static_cast<int>(w.L));
    load_query_tile(0, kb.m_first * BLOCK_M);
  }
  cp_async_commit();

  float dk[MF][DNF][4], dv[MF][DNF][4];
  zero(dk);
  zero(dv);

  const float NEG = neg_inf<float>();
  const float sl2 = scale * LOG2E;
  const int jw0 = j0 + kr0;  // this warp's first key (phases 1, 2)

  for (int it = 0; it < kb.n_mt; ++it) {
    const int i0 = (kb.m_first + it) * BLOCK_M;
    const int slot = it & 1;
    cp_async_wait<0>();
    __syncthreads();  // tile `it` landed; every warp finished tile it - 1 (its slot, P^T, dS^T)
    if (it + 1 < kb.n_mt) load_query_tile(slot ^ 1, i0 + BLOCK_M);
    cp_async_commit();

    const u32 qs = sQ + slot * QT_BYTES, dos = sdO + slot * QT_BYTES;
    const u32 ls = sL + slot * BLOCK_M * 4, des = sD + slot * BLOCK_M * 4;

    // ---- phase 1: this warp's 32 keys x QW queries of S^T, P^T, dP^T, dS^T
    // A sub-tile with no visible (query, key) pair (lo, hi non-decreasing: it is enough that the
    // last key precedes lo(first query) or the first key follows hi(last query)) skips its
    // products: P^T = dS^T = 0 (stored as zeros), its SM sub-partition partner gets the tensor cores.
    const int iw0 = i0 + qc0;
    const int iw_last = min(iw0 + QW, Nq) - 1;
    const bool any_vis = iw0 < Nq && jw0 <= min(iw_last + pr.dhi, pr.L_last) &&
                         jw0 + WN - 1 >= max(iw0 + pr.dlo, 0);
    float s[MF][NQF][4];
    zero(s);
    if (any_vis)
      tcb::gemm_nt<T, MF, NQF, KD, ROW_BYTES, ROW_BYTES>(s, sK + kr0 * ROW_BYTES + a_lane,
                                                          qs + qc0 * ROW_BYTES + bn_lane);
    if (!any_vis) {
      for_each_entry(s, [&](float& x, int, int, int) { x = NEG; });  // P^T below must be 0 too
    } else if (!tile_all_visible(pr, iw0, iw_last, jw0, WN)) {
      // Padding query rows (>= Nq) need no test: their lse2 is +inf, so P = 0.
#pragma unroll
      for (int mi = 0; mi < MF; ++mi) mask_key_rows(s[mi], jw0 + mi * 16 + g, iw0, t, Nq, pr, NoMod());
    }
    // P^T = exp2(S^T * scale * log2e - lse2[query]) (0 where invisible or on empty / padding rows)
    tcb::with_query_values(s, ls, qc0, t, [&](float x, float l2, int, int, int) {
      return ex2(fmaf(x, sl2, -l2));
    });
    tcb::store_acc16<T, MF, NQF, PS_ROW>(s, sP + kr0 * PS_ROW + qc0 * 2, g, t);

    float dp[MF][NQF][4];
    zero(dp);
    if (any_vis)
      tcb::gemm_nt<T, MF, NQF, KD, ROW_BYTES, ROW_BYTES>(dp, sV + kr0 * ROW_BYTES + a_lane,
                                                          dos + qc0 * ROW_BYTES + bn_lane);
    // dS^T = scale * P^T (dP^T - delta[query])
    tcb::with_query_values(dp, des, qc0, t, [&](float x, float delta, int mi, int nf, int e) {
      return scale * s[mi][nf][e] * (x - delta);
    });
    tcb::store_acc16<T, MF, NQF, PS_ROW>(dp, sdS + kr0 * PS_ROW + qc0 * 2, g, t);
    __syncthreads();  // P^T and dS^T of every warp in shared memory

    // ---- phase 3 (product): dQ[i0 + qq0 .., dq0 ..] = dS K over the tile's keys, into registers
    float acc[QMF][QDF][4];
    if (DQ_ATOMIC) {
      zero(acc);
      tcb::gemm_nn<T, QMF, QDF, BLOCK_N / 16, PS_ROW, ROW_BYTES, true>(
          acc, sdS + qq0 * 2 + ds_lane, sK + dq0 * 2 + bt_lane);
    }
    // Reduction r: m-fragment mi = r / (2 QDF), row half h = (r / QDF) % 2, columns nf = r % QDF;
    // k-step s of phase 2 (dV's KM, then dK's KM) issues those with tcb::dq_reduction_at(r, s).
    constexpr int NR = QMF * 2 * QDF;
    auto dq_reds = [&](int step) {
      if (!DQ_ATOMIC) return;
#pragma unroll
      for (int r = 0; r < NR; ++r) {
        if (!tcb::dq_reduction_at(r, step, NR, 2 * KM)) continue;
        const int mi = r / (2 * QDF), h = (r / QDF) % 2, nf = r % QDF;
        const int i = i0 + qq0 + mi * 16 + g + 8 * h;
        if (i < Nq)
          red_add_f32x2(dq_acc + (bh * Nq + i) * HEAD_DIM + dq0 + 2 * t + nf * 8,
                        acc[mi][nf][2 * h], acc[mi][nf][2 * h + 1]);
      }
    };

    // ---- phase 2: dV += P^T dO, dK += dS^T Q (32 keys x DW dims per warp), phase 3's
    // reductions spread over their k-steps
    tcb::gemm_nn<T, MF, DNF, KM, PS_ROW, ROW_BYTES, false>(
        dv, sP + kr0 * PS_ROW + pa_lane, dos + dc0 * 2 + bt_lane, [&](int kk) { dq_reds(kk); });
    tcb::gemm_nn<T, MF, DNF, KM, PS_ROW, ROW_BYTES, false>(
        dk, sdS + kr0 * PS_ROW + pa_lane, qs + dc0 * 2 + bt_lane,
        [&](int kk) { dq_reds(KM + kk); });
  }

  // Every key row of the tile below Nk is written, zeros where no query sees it.
  for_frag_rows<MF>(jw0, g, [&](int mi, int h, int j) {
    if (j < Nk) {
      const long long e = (bh * Nk + j) * HEAD_DIM + dc0 + 2 * t;
      tcb::store_kv_rows<T>(dk_acc, dv_acc, e, e, dk[mi], dv[mi], h, out16);
    }
  });
}
