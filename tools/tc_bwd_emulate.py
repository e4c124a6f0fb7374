"""NumPy emulation of the fragment index math of kernels_cu/bwd_sm80.cu (no GPU needed).

Warp primitives are modelled per lane from the PTX specification (mma_sm80.cuh's header comment):
ldmatrix .x4 (with and without .trans), mma.sync m16n8k16 row.col, 32-bit shared stores and
v2.f32 shared loads, with shared memory as one array indexed by byte address. The spec encoding is
first checked on the forward kernel's own lane offsets (fwd_sm80.cu, proven on the GPU): S = Q K^T
and O = P V. Then the backward kernels' loops are transliterated lane by lane (same offsets, same
packing order, same tile walk, same predicate) and compared with dense float64 gradients on small
awkward shapes (causal both alignments, window, kv_lens, padding rows). Precision is not modelled
(values stay float64); only where each element goes.

    python3 tools/tc_bwd_emulate.py [--grid-only | --swz-only]
        (--grid-only: bwd_sm80_dkdv_g alone; --swz-only: bwd_sm80_dkdv with DKDV_SWZ alone)
"""
import itertools
import math
import sys

import numpy as np

LOG2E = 1.4426950408889634


# ---- warp primitives ---------------------------------------------------------------------------
LANE = np.arange(32)
G, T4 = LANE // 4, LANE % 4


class Smem:
    """Shared memory: element of any width at byte address a lives in self.m[a]. Counts the
    ldmatrix phases (8 row addresses of one 8x8 matrix) whose rows share a 16-byte bank group
    (a bank conflict) in ldsm_phases / ldsm_conflicts."""

    def __init__(self, nbytes):
        self.m = np.full(nbytes + 64, np.nan)
        self.ldsm_phases = self.ldsm_conflicts = 0

    def store_tile(self, dst, row_bytes, mat):
        """Rows of a 16-bit matrix at dst + r * row_bytes + 2 c (as cp_tile / cp.async)."""
        for r in range(mat.shape[0]):
            self.m[dst + r * row_bytes + 2 * np.arange(mat.shape[1])] = mat[r]

    def store_f32(self, dst, vec):
        self.m[dst + 4 * np.arange(len(vec))] = vec

    def ldsm_x4(self, addr, trans=False):
        """addr: (32,) byte addresses; returns 4 registers, each (32, 2) = (lo, hi) per lane."""
        regs = []
        for i in range(4):
            rows = addr[8 * i:8 * i + 8]
            self.ldsm_phases += 1
            self.ldsm_conflicts += len(set((rows % 128) // 16)) < 8
            M = np.array([[self.m[rows[r] + 2 * c] for c in range(8)] for r in range(8)])
            if trans:
                M = M.T
            regs.append(np.stack([M[G, 2 * T4], M[G, 2 * T4 + 1]], axis=1))
        return regs

    def st_b32(self, addr, reg):
        self.m[addr] = reg[:, 0]
        self.m[addr + 2] = reg[:, 1]

    def ld_v2f(self, addr):
        return self.m[addr], self.m[addr + 4]


# ---- shared tile layouts and the tile copy (mma_sm80.cuh), on scalars or lane arrays -------------
def stored_chunk(swz, r, c):
    """tc::stored_chunk: where chunk c of row r sits in its row (swz: FA2's XOR swizzle)."""
    return c ^ (r & 7) if swz else c


def chunk_offset(swz, row, r, c):
    """tc::chunk_offset<SWZ, ROW>: byte offset of chunk c of row r in a tile of `row`-byte rows."""
    return r * row + stored_chunk(swz, r, c) * 16


def tile_addr(swz, lane_addr, row_off, col_off):
    """tc::tile_addr<SWZ>: the 8x8 block row_off / col_off bytes past the lane's own address."""
    return (lane_addr ^ col_off) + row_off if swz else lane_addr + row_off + col_off


LINES = {}  # layout and row size -> [row copies, 128-byte shared lines they touch] (cp_tile)
LDSM = {}  # layout -> [ldmatrix phases, phases with a bank conflict] (emulate_dkdv)


def cp_tile(sm, dst, M, row0, rows, limit, D, threads, swz):
    """tc::cp_tile<ROWS, HEAD_DIM, THREADS, T, SWZ>, thread by thread (the THREADS % CPR == 0
    branch): thread t copies chunk t % CPR of rows t / CPR + RPI * it, zeros from row `limit` on.
    Also counts the 128-byte shared lines each copied row touches (LINES)."""
    CPR = D // 8
    ROW = D * 2 if swz else (D + 8) * 2
    assert threads % CPR == 0
    RPI = threads // CPR
    assert not swz or (CPR % 8 == 0 and RPI % 8 == 0), "the kernel's static_asserts"
    tid = np.arange(threads)
    r_thr, c_thr = tid // CPR, tid % CPR
    d = dst + r_thr * ROW + stored_chunk(swz, r_thr, c_thr) * 16
    stat = LINES.setdefault(f"{'swizzled' if swz else 'padded'}, rows of {ROW} B", [0, 0])
    for it in range(-(-rows // RPI)):
        r = it * RPI + r_thr
        act = r < rows
        src = np.zeros((threads, 8))
        ok = act & (row0 + r < limit)
        for t in np.nonzero(ok)[0]:
            src[t] = M[row0 + r[t], 8 * c_thr[t]:8 * c_thr[t] + 8]
        addr = d + it * RPI * ROW
        for t in np.nonzero(act)[0]:
            sm.m[addr[t] + 2 * np.arange(8)] = src[t]
        for rr in np.unique(r[act]):
            stat[0] += 1
            stat[1] += len(set(addr[act & (r == rr)] // 128))


def mma(c, a, b0, b1):
    """c (32, 4) += A B for the fragments of mma.m16n8k16.row.col."""
    A = np.zeros((16, 16))
    B = np.zeros((16, 8))
    C = np.zeros((16, 8))
    for ln in range(32):
        g, t = ln // 4, ln % 4
        A[g, 2 * t:2 * t + 2] = a[0][ln]
        A[g + 8, 2 * t:2 * t + 2] = a[1][ln]
        A[g, 2 * t + 8:2 * t + 10] = a[2][ln]
        A[g + 8, 2 * t + 8:2 * t + 10] = a[3][ln]
        B[2 * t:2 * t + 2, g] = b0[ln]
        B[2 * t + 8:2 * t + 10, g] = b1[ln]
        C[g, 2 * t:2 * t + 2] = c[ln, 0:2]
        C[g + 8, 2 * t:2 * t + 2] = c[ln, 2:4]
    C += A @ B
    out = np.empty_like(c)
    for ln in range(32):
        g, t = ln // 4, ln % 4
        out[ln, 0:2] = C[g, 2 * t:2 * t + 2]
        out[ln, 2:4] = C[g + 8, 2 * t:2 * t + 2]
    c[:] = out


def pack(lo, hi):
    return np.stack([lo, hi], axis=1)


def zeros_acc(n):
    return [np.zeros((32, 4)) for _ in range(n)]


# ---- the visibility predicate (mask.cuh), scalar ------------------------------------------------
class Win:
    def __init__(self, Nq, L, left, right, br):
        self.shift = L - Nq if br else 0
        self.L, self.left, self.right = L, left, right
        CL = 1 << 30
        self.dlo = max(-CL, min(CL, self.shift - left))
        self.dhi = max(-CL, min(CL, self.shift + right))
        self.L_last = L - 1

    def key_range(self, i):
        p = i + self.shift
        return max(p - self.left, 0), min(p + self.right, self.L - 1)

    def tile_key_range(self, i0, i1):
        return self.key_range(i0)[0], self.key_range(i1)[1]

    def tile_query_range(self, j0, j1, Nq):
        j1 = min(j1, self.L - 1)
        if j0 > j1:
            return 0, -1
        return max(j0 - self.right - self.shift, 0), min(j1 + self.left - self.shift, Nq - 1)


def dense_visible(Nq, Nk, L, left, right, br):
    i = np.arange(Nq)[:, None]
    j = np.arange(Nk)[None, :]
    p = i + (L - Nq if br else 0)
    return (j < L) & (j >= p - left) & (j <= p + right)


# ---- the forward's proven offsets (spec check) -------------------------------------------------
def check_forward_spec(rng):
    D, BM, BN = 32, 16, 16
    RB = (D + 8) * 2
    sm = Smem(RB * (BM + 2 * BN))
    sQ, sK, sV = 0, BM * RB, (BM + BN) * RB
    Q, K, V = (rng.standard_normal((n, D)) for n in (BM, BN, BN))
    sm.store_tile(sQ, RB, Q)
    sm.store_tile(sK, RB, K)
    sm.store_tile(sV, RB, V)
    q_lane = sQ + (LANE % 16) * RB + (LANE // 16) * 16
    k_lane = (LANE % 8 + 8 * (LANE // 16)) * RB + ((LANE // 8) % 2) * 16
    v_lane = (LANE % 8 + 8 * ((LANE // 8) % 2)) * RB + (LANE // 16) * 16
    s = zeros_acc(BN // 8)
    for kk in range(D // 16):
        qa = sm.ldsm_x4(q_lane + kk * 32)
        for p in range(BN // 16):
            kb = sm.ldsm_x4(sK + k_lane + p * 16 * RB + kk * 32)
            mma(s[2 * p], qa, kb[0], kb[1])
            mma(s[2 * p + 1], qa, kb[2], kb[3])
    S = np.zeros((BM, BN))
    for nf in range(BN // 8):
        for e in range(4):
            S[G + 8 * (e // 2), nf * 8 + 2 * T4 + e % 2] = s[nf][:, e]
    assert np.allclose(S, Q @ K.T), "spec: S = Q K^T with the forward's offsets"
    P = rng.standard_normal((BM, BN))
    for nf in range(BN // 8):
        for e in range(4):
            s[nf][:, e] = P[G + 8 * (e // 2), nf * 8 + 2 * T4 + e % 2]
    acc = zeros_acc(D // 8)
    for kk in range(BN // 16):
        pa = [pack(s[2 * kk][:, 0], s[2 * kk][:, 1]), pack(s[2 * kk][:, 2], s[2 * kk][:, 3]),
              pack(s[2 * kk + 1][:, 0], s[2 * kk + 1][:, 1]),
              pack(s[2 * kk + 1][:, 2], s[2 * kk + 1][:, 3])]
        for p in range(D // 16):
            vb = sm.ldsm_x4(sV + v_lane + kk * 16 * RB + p * 32, trans=True)
            mma(acc[2 * p], pa, vb[0], vb[1])
            mma(acc[2 * p + 1], pa, vb[2], vb[3])
    O = np.zeros((BM, D))
    for df in range(D // 8):
        for e in range(4):
            O[G + 8 * (e // 2), df * 8 + 2 * T4 + e % 2] = acc[df][:, e]
    assert np.allclose(O, P @ V), "spec: O = P V with the forward's offsets"


# ---- bwd_sm80_dkdv, transliterated --------------------------------------------------------------
def emulate_dkdv(Q, K, V, dO, lse2_pad, delta_pad, Nq_pad, scale, win, D, BM, NWARPS,
                 dq_out, dk_out, dv_out, swz=False, kv_in_regs=False, smem_base=0):
    """swz: DKDV_SWZ (K, V, Q, dO swizzled); kv_in_regs: K and V fragments loaded once (it == 0);
    smem_base: the address of the dynamic shared memory (swz rounds it up to a row)."""
    Nq, Nk = Q.shape[0], K.shape[0]
    BN = 16 * NWARPS
    THREADS = 32 * NWARPS
    NQF, DF, KD, KM = BM // 8, D // 8, D // 16, BM // 16
    RB = D * 2 if swz else (D + 8) * 2
    DS_ROW = (BM + 8) * 2
    QT = BM * RB
    WM = BM // 16
    WD = NWARPS // WM
    DQ_COLS = D // WD
    CH = DQ_COLS if DQ_COLS <= 64 else DQ_COLS // 2
    assert not swz or CH == DQ_COLS, "the kernel has no dQ column chunks"
    sK = (smem_base + RB - 1) & ~(RB - 1) if swz else smem_base
    sV = sK + BN * RB
    sQ = sV + BN * RB
    sdO = sQ + 2 * QT
    sdS = sdO + 2 * QT
    sL = sdS + BN * DS_ROW
    sD = sL + 2 * BM * 4
    n_nt = -(-Nk // BN)
    sl2 = scale * LOG2E
    sms = []  # each key tile's shared memory (for the ldmatrix bank-conflict count)
    for jt in range(n_nt):
        j0 = jt * BN
        sm = Smem(sD + 2 * BM * 4)
        sms.append(sm)
        qlo, qhi = win.tile_query_range(j0, j0 + BN - 1, Nq)
        m_first = qlo // BM if qlo <= qhi else 0
        n_mt = qhi // BM - m_first + 1 if qlo <= qhi else 0

        def load_query_tile(slot, i0):
            cp_tile(sm, sQ + slot * QT, Q, i0, BM, Nq, D, THREADS, swz)
            cp_tile(sm, sdO + slot * QT, dO, i0, BM, Nq, D, THREADS, swz)
            sm.store_f32(sL + slot * BM * 4, lse2_pad[i0:i0 + BM])
            sm.store_f32(sD + slot * BM * 4, delta_pad[i0:i0 + BM])

        if n_mt > 0:
            cp_tile(sm, sK, K, j0, BN, win.L, D, THREADS, swz)
            cp_tile(sm, sV, V, j0, BN, win.L, D, THREADS, swz)
        dk = [zeros_acc(DF) for _ in range(NWARPS)]
        dv = [zeros_acc(DF) for _ in range(NWARPS)]
        ka, va = [None] * NWARPS, [None] * NWARPS
        bn_lane = chunk_offset(swz, RB, LANE % 8 + 8 * (LANE // 16), (LANE // 8) % 2)
        bt_lane = chunk_offset(swz, RB, LANE % 8 + 8 * ((LANE // 8) % 2), LANE // 16)
        ds_lane = (LANE % 8 + 8 * (LANE // 16)) * DS_ROW + ((LANE // 8) % 2) * 16
        for it in range(n_mt):
            i0 = (m_first + it) * BM
            slot = it & 1
            load_query_tile(slot, i0)  # (the kernel prefetched it one step earlier)
            qs, dos = sQ + slot * QT, sdO + slot * QT
            ls, des = sL + slot * BM * 4, sD + slot * BM * 4
            i_last = min(i0 + BM, Nq) - 1
            full = (max(i_last + win.dlo, 0) <= j0 and j0 + BN - 1 <= min(i0 + win.dhi, win.L_last))
            for warp in range(NWARPS):
                a_lane = chunk_offset(swz, RB, warp * 16 + LANE % 16, LANE // 16)
                jw = j0 + warp * 16 + G
                if kv_in_regs and it == 0:
                    ka[warp] = [sm.ldsm_x4(tile_addr(swz, sK + a_lane, 0, kk * 32))
                                for kk in range(KD)]
                    va[warp] = [sm.ldsm_x4(tile_addr(swz, sV + a_lane, 0, kk * 32))
                                for kk in range(KD)]
                s = zeros_acc(NQF)
                for kk in range(KD):
                    a = ka[warp][kk] if kv_in_regs else sm.ldsm_x4(
                        tile_addr(swz, sK + a_lane, 0, kk * 32))
                    for p in range(NQF // 2):
                        b = sm.ldsm_x4(tile_addr(swz, qs + bn_lane, p * 16 * RB, kk * 32))
                        mma(s[2 * p], a, b[0], b[1])
                        mma(s[2 * p + 1], a, b[2], b[3])
                if not full:
                    for h in range(2):
                        j = jw + 8 * h
                        for nf in range(NQF):
                            for e in range(2):
                                i = i0 + nf * 8 + 2 * T4 + e
                                bad = (j > win.L_last) | (j < i + win.dlo) | (j > i + win.dhi)
                                s[nf][:, 2 * h + e] = np.where(bad, -np.inf, s[nf][:, 2 * h + e])
                for nf in range(NQF):
                    l0, l1 = sm.ld_v2f(ls + (nf * 8 + 2 * T4) * 4)
                    for h in range(2):
                        s[nf][:, 2 * h] = np.exp2(s[nf][:, 2 * h] * sl2 - l0)
                        s[nf][:, 2 * h + 1] = np.exp2(s[nf][:, 2 * h + 1] * sl2 - l1)
                for kk in range(KM):
                    pa = [pack(s[2 * kk][:, 0], s[2 * kk][:, 1]),
                          pack(s[2 * kk][:, 2], s[2 * kk][:, 3]),
                          pack(s[2 * kk + 1][:, 0], s[2 * kk + 1][:, 1]),
                          pack(s[2 * kk + 1][:, 2], s[2 * kk + 1][:, 3])]
                    for p in range(DF // 2):
                        b = sm.ldsm_x4(tile_addr(swz, dos + bt_lane, kk * 16 * RB, p * 32),
                                       trans=True)
                        mma(dv[warp][2 * p], pa, b[0], b[1])
                        mma(dv[warp][2 * p + 1], pa, b[2], b[3])
                dp = zeros_acc(NQF)
                for kk in range(KD):
                    a = va[warp][kk] if kv_in_regs else sm.ldsm_x4(
                        tile_addr(swz, sV + a_lane, 0, kk * 32))
                    for p in range(NQF // 2):
                        b = sm.ldsm_x4(tile_addr(swz, dos + bn_lane, p * 16 * RB, kk * 32))
                        mma(dp[2 * p], a, b[0], b[1])
                        mma(dp[2 * p + 1], a, b[2], b[3])
                for nf in range(NQF):
                    d0, d1 = sm.ld_v2f(des + (nf * 8 + 2 * T4) * 4)
                    for h in range(2):
                        dp[nf][:, 2 * h] = scale * s[nf][:, 2 * h] * (dp[nf][:, 2 * h] - d0)
                        dp[nf][:, 2 * h + 1] = scale * s[nf][:, 2 * h + 1] * (dp[nf][:, 2 * h + 1] - d1)
                for kk in range(KM):
                    da = [pack(dp[2 * kk][:, 0], dp[2 * kk][:, 1]),
                          pack(dp[2 * kk][:, 2], dp[2 * kk][:, 3]),
                          pack(dp[2 * kk + 1][:, 0], dp[2 * kk + 1][:, 1]),
                          pack(dp[2 * kk + 1][:, 2], dp[2 * kk + 1][:, 3])]
                    row = sdS + (warp * 16 + G) * DS_ROW + (kk * 16 + 2 * T4) * 2
                    sm.st_b32(row, da[0])
                    sm.st_b32(row + 8 * DS_ROW, da[1])
                    sm.st_b32(row + 16, da[2])
                    sm.st_b32(row + 8 * DS_ROW + 16, da[3])
                    for p in range(DF // 2):
                        b = sm.ldsm_x4(tile_addr(swz, qs + bt_lane, kk * 16 * RB, p * 32),
                                       trans=True)
                        mma(dk[warp][2 * p], da, b[0], b[1])
                        mma(dk[warp][2 * p + 1], da, b[2], b[3])
            # __syncthreads(); dQ
            for warp in range(NWARPS):
                wm, wd = warp % WM, warp // WM
                col0 = wd * DQ_COLS
                for c0 in range(0, DQ_COLS, CH):
                    acc = zeros_acc(CH // 8)
                    for kk in range(BN // 16):
                        a = sm.ldsm_x4(sdS + ds_lane + kk * 16 * DS_ROW + wm * 32, trans=True)
                        for p in range(CH // 16):
                            b = sm.ldsm_x4(tile_addr(swz, sK + bt_lane, kk * 16 * RB,
                                                     (col0 + c0) * 2 + p * 32), trans=True)
                            mma(acc[2 * p], a, b[0], b[1])
                            mma(acc[2 * p + 1], a, b[2], b[3])
                    for h in range(2):
                        i = i0 + wm * 16 + G + 8 * h
                        for nf in range(CH // 8):
                            for ln in range(32):
                                if i[ln] < Nq:
                                    c = col0 + c0 + nf * 8 + 2 * T4[ln]
                                    dq_out[i[ln], c] += acc[nf][ln, 2 * h]
                                    dq_out[i[ln], c + 1] += acc[nf][ln, 2 * h + 1]
        for warp in range(NWARPS):
            for h in range(2):
                j = j0 + warp * 16 + G + 8 * h
                for df in range(DF):
                    for ln in range(32):
                        if j[ln] < Nk:
                            c = df * 8 + 2 * T4[ln]
                            dk_out[j[ln], c:c + 2] = dk[warp][df][ln, 2 * h:2 * h + 2]
                            dv_out[j[ln], c:c + 2] = dv[warp][df][ln, 2 * h:2 * h + 2]
    st = LDSM.setdefault("swizzled" if swz else "padded", [0, 0])
    for sm in sms:
        st[0] += sm.ldsm_phases
        st[1] += sm.ldsm_conflicts


# ---- bwd_sm80_dkdv_g (FA2-style warp grids), transliterated -------------------------------------
SKIPPED = [0]  # warp sub-tiles that skipped their S^T / dP^T products (no visible pair)

def emulate_dkdv_g(Q, K, V, dO, lse2_pad, delta_pad, Nq_pad, scale, win, D, BM, dq_atomic,
                   dq_out, dk_out, dv_out):
    """8 warps, 128 keys per block. Phase 1 (S^T, dP^T) on a 4 keys x 2 queries warp grid, phase 2
    (dV, dK) on 4 keys x 2 head-dim halves, phase 3 (dQ) on 2 query halves x 4 head-dim quarters;
    all warps finish a phase before the next starts (the kernel's barrier). P^T and dS^T are reset
    to NaN at the top of each query tile, so a read of an element no warp wrote shows up as NaN."""
    Nq, Nk = Q.shape[0], K.shape[0]
    BN, WN, MF = 128, 32, 2
    QW = BM // 2
    NQF, KD, KM = QW // 8, D // 16, BM // 16
    DW, QDW = D // 2, D // 4
    DQ_WM = 4 if BM >= 128 else 2
    QQ = BM // DQ_WM
    QDW = D * DQ_WM // 8
    DNF, QMF, QDF = DW // 8, QQ // 16, QDW // 8
    RB = (D + 8) * 2
    PS = (BM + 8) * 2
    QT = BM * RB
    sK = 0
    sV = sK + BN * RB
    sQ = sV + BN * RB
    sdO = sQ + 2 * QT
    sdS = sdO + 2 * QT
    sL = sdS + BN * PS
    sD = sL + 2 * BM * 4
    sP = sD + 2 * BM * 4
    total = sP + BN * PS
    a_lane = (LANE % 16) * RB + (LANE // 16) * 16
    bn_lane = (LANE % 8 + 8 * (LANE // 16)) * RB + ((LANE // 8) % 2) * 16
    bt_lane = (LANE % 8 + 8 * ((LANE // 8) % 2)) * RB + (LANE // 16) * 16
    pa_lane = (LANE % 16) * PS + (LANE // 16) * 16
    ds_lane = (LANE % 8 + 8 * (LANE // 16)) * PS + ((LANE // 8) % 2) * 16
    sl2 = scale * LOG2E

    def zacc(mf, nf):
        return [[np.zeros((32, 4)) for _ in range(nf)] for _ in range(mf)]

    def gemm_nt(sm, acc, mf, nf, ksteps, a_base, a_row, b_base, b_row):
        for kk in range(ksteps):
            a = [sm.ldsm_x4(a_base + mi * 16 * a_row + kk * 32) for mi in range(mf)]
            for p in range(nf // 2):
                b = sm.ldsm_x4(b_base + p * 16 * b_row + kk * 32)
                for mi in range(mf):
                    mma(acc[mi][2 * p], a[mi], b[0], b[1])
                    mma(acc[mi][2 * p + 1], a[mi], b[2], b[3])

    def gemm_nn(sm, acc, mf, nf, ksteps, a_base, a_row, b_base, b_row, a_trans):
        for kk in range(ksteps):
            if a_trans:
                a = [sm.ldsm_x4(a_base + kk * 16 * a_row + mi * 32, trans=True) for mi in range(mf)]
            else:
                a = [sm.ldsm_x4(a_base + mi * 16 * a_row + kk * 32) for mi in range(mf)]
            for p in range(nf // 2):
                b = sm.ldsm_x4(b_base + kk * 16 * b_row + p * 32, trans=True)
                for mi in range(mf):
                    mma(acc[mi][2 * p], a[mi], b[0], b[1])
                    mma(acc[mi][2 * p + 1], a[mi], b[2], b[3])

    def store_acc16(sm, acc, mf, nf, base, row):
        for mi in range(mf):
            for n in range(nf):
                addr = base + (mi * 16 + G) * row + (n * 8 + 2 * T4) * 2
                sm.st_b32(addr, pack(acc[mi][n][:, 0], acc[mi][n][:, 1]))
                sm.st_b32(addr + 8 * row, pack(acc[mi][n][:, 2], acc[mi][n][:, 3]))

    def rows(M, r0, n, limit):
        out = np.zeros((n, M.shape[1]))
        for r in range(n):
            if r0 + r < limit:
                out[r] = M[r0 + r]
        return out

    n_nt = -(-Nk // BN)
    skipped = SKIPPED
    for jt in range(n_nt):
        j0 = jt * BN
        sm = Smem(total)
        qlo, qhi = win.tile_query_range(j0, j0 + BN - 1, Nq)
        m_first = qlo // BM if qlo <= qhi else 0
        n_mt = qhi // BM - m_first + 1 if qlo <= qhi else 0
        if n_mt > 0:
            sm.store_tile(sK, RB, rows(K, j0, BN, win.L))
            sm.store_tile(sV, RB, rows(V, j0, BN, win.L))
        dk = [zacc(MF, DNF) for _ in range(8)]
        dv = [zacc(MF, DNF) for _ in range(8)]
        for it in range(n_mt):
            i0 = (m_first + it) * BM
            slot = it & 1
            sm.store_tile(sQ + slot * QT, RB, rows(Q, i0, BM, Nq))
            sm.store_tile(sdO + slot * QT, RB, rows(dO, i0, BM, Nq))
            sm.store_f32(sL + slot * BM * 4, lse2_pad[i0:i0 + BM])
            sm.store_f32(sD + slot * BM * 4, delta_pad[i0:i0 + BM])
            sm.m[sdS:sdS + BN * PS] = np.nan
            sm.m[sP:sP + BN * PS] = np.nan
            qs, dos = sQ + slot * QT, sdO + slot * QT
            ls, des = sL + slot * BM * 4, sD + slot * BM * 4
            # phase 1
            for warp in range(8):
                wk, wq = warp // 2, warp % 2
                kr0, qc0 = wk * WN, wq * QW
                jw0, iw0 = j0 + kr0, i0 + qc0
                i_last = min(iw0 + QW, Nq) - 1
                any_vis = (iw0 < Nq and jw0 <= min(i_last + win.dhi, win.L_last)
                           and jw0 + WN - 1 >= max(iw0 + win.dlo, 0))
                skipped[0] += not any_vis
                s = zacc(MF, NQF)
                if any_vis:
                    gemm_nt(sm, s, MF, NQF, KD, sK + kr0 * RB + a_lane, RB, qs + qc0 * RB + bn_lane,
                            RB)
                full = max(i_last + win.dlo, 0) <= jw0 and jw0 + WN - 1 <= min(iw0 + win.dhi,
                                                                                 win.L_last)
                if not any_vis:
                    for mi in range(MF):
                        for nf in range(NQF):
                            s[mi][nf][:] = -np.inf
                elif not full:
                    for mi in range(MF):
                        for h in range(2):
                            j = jw0 + mi * 16 + G + 8 * h
                            for nf in range(NQF):
                                for e in range(2):
                                    i = iw0 + nf * 8 + 2 * T4 + e
                                    bad = (j > win.L_last) | (j < i + win.dlo) | (j > i + win.dhi)
                                    s[mi][nf][:, 2 * h + e] = np.where(bad, -np.inf,
                                                                       s[mi][nf][:, 2 * h + e])
                for nf in range(NQF):
                    l0, l1 = sm.ld_v2f(ls + (qc0 + nf * 8 + 2 * T4) * 4)
                    for mi in range(MF):
                        for h in range(2):
                            s[mi][nf][:, 2 * h] = np.exp2(s[mi][nf][:, 2 * h] * sl2 - l0)
                            s[mi][nf][:, 2 * h + 1] = np.exp2(s[mi][nf][:, 2 * h + 1] * sl2 - l1)
                store_acc16(sm, s, MF, NQF, sP + kr0 * PS + qc0 * 2, PS)
                dp = zacc(MF, NQF)
                if any_vis:
                    gemm_nt(sm, dp, MF, NQF, KD, sV + kr0 * RB + a_lane, RB,
                            dos + qc0 * RB + bn_lane, RB)
                for nf in range(NQF):
                    d0, d1 = sm.ld_v2f(des + (qc0 + nf * 8 + 2 * T4) * 4)
                    for mi in range(MF):
                        for h in range(2):
                            dp[mi][nf][:, 2 * h] = scale * s[mi][nf][:, 2 * h] * (dp[mi][nf][:, 2 * h] - d0)
                            dp[mi][nf][:, 2 * h + 1] = scale * s[mi][nf][:, 2 * h + 1] * (
                                dp[mi][nf][:, 2 * h + 1] - d1)
                store_acc16(sm, dp, MF, NQF, sdS + kr0 * PS + qc0 * 2, PS)
            # __syncthreads(); phase 2
            for warp in range(8):
                wk, wq = warp // 2, warp % 2
                kr0, dc0 = wk * WN, wq * DW
                gemm_nn(sm, dv[warp], MF, DNF, KM, sP + kr0 * PS + pa_lane, PS,
                        dos + dc0 * 2 + bt_lane, RB, False)
                gemm_nn(sm, dk[warp], MF, DNF, KM, sdS + kr0 * PS + pa_lane, PS,
                        qs + dc0 * 2 + bt_lane, RB, False)
            # phase 3
            if dq_atomic:
                for warp in range(8):
                    wk, wq = warp // 2, warp % 2
                    qq0, dq0 = (warp % DQ_WM) * QQ, (warp // DQ_WM) * QDW
                    acc = zacc(QMF, QDF)
                    gemm_nn(sm, acc, QMF, QDF, BN // 16, sdS + qq0 * 2 + ds_lane, PS,
                            sK + dq0 * 2 + bt_lane, RB, True)
                    for mi in range(QMF):
                        for h in range(2):
                            i = i0 + qq0 + mi * 16 + G + 8 * h
                            for nf in range(QDF):
                                for ln in range(32):
                                    if i[ln] < Nq:
                                        c = dq0 + nf * 8 + 2 * T4[ln]
                                        dq_out[i[ln], c] += acc[mi][nf][ln, 2 * h]
                                        dq_out[i[ln], c + 1] += acc[mi][nf][ln, 2 * h + 1]
        for warp in range(8):
            wk, wq = warp // 2, warp % 2
            kr0, dc0 = wk * WN, wq * DW
            for mi in range(MF):
                for h in range(2):
                    j = j0 + kr0 + mi * 16 + G + 8 * h
                    for nf in range(DNF):
                        for ln in range(32):
                            if j[ln] < Nk:
                                c = dc0 + nf * 8 + 2 * T4[ln]
                                dk_out[j[ln], c:c + 2] = dk[warp][mi][nf][ln, 2 * h:2 * h + 2]
                                dv_out[j[ln], c:c + 2] = dv[warp][mi][nf][ln, 2 * h:2 * h + 2]


# ---- bwd_sm80_dq, transliterated ----------------------------------------------------------------
def emulate_dq(Q, K, V, dO, lse2_pad, delta_pad, scale, win, D, BN, NWARPS, STAGES, dq_out):
    Nq, Nk = Q.shape[0], K.shape[0]
    BM = 16 * NWARPS
    NF, DF, KD, KN = BN // 8, D // 8, D // 16, BN // 16
    RB = (D + 8) * 2
    TB = BN * RB
    sl2 = scale * LOG2E
    n_mt = -(-Nq // BM)
    for mt in range(n_mt):
        i0 = mt * BM
        i_last = min(i0 + BM, Nq) - 1
        lo, hi = win.tile_key_range(i0, i_last)
        n_tiles = (hi - lo) // BN + 1 if hi >= lo else 0
        j_limit = hi + 1
        sQ, sdO = 0, BM * RB
        sK = 2 * BM * RB
        sV = sK + STAGES * TB
        sm = Smem(sV + STAGES * TB)

        def rows(M, r0, n, limit):
            out = np.zeros((n, M.shape[1]))
            for r in range(n):
                if r0 + r < limit:
                    out[r] = M[r0 + r]
            return out

        sm.store_tile(sQ, RB, rows(Q, i0, BM, Nq))
        sm.store_tile(sdO, RB, rows(dO, i0, BM, Nq))
        full_lo = min(win.key_range(i_last)[0], win.L)
        full_hi = max(win.key_range(i0)[1], -1)
        bn_lane = (LANE % 8 + 8 * (LANE // 16)) * RB + ((LANE // 8) % 2) * 16
        bt_lane = (LANE % 8 + 8 * ((LANE // 8) % 2)) * RB + (LANE // 16) * 16
        dq = [zeros_acc(DF) for _ in range(NWARPS)]
        for n in range(n_tiles):
            j0 = lo + n * BN
            kbuf = sK + (n % STAGES) * TB
            vbuf = sV + (n % STAGES) * TB
            sm.store_tile(kbuf, RB, rows(K, j0, BN, j_limit))
            sm.store_tile(vbuf, RB, rows(V, j0, BN, j_limit))
            for warp in range(NWARPS):
                a_lane = (warp * 16 + LANE % 16) * RB + (LANE // 16) * 16
                ir = i0 + warp * 16 + G
                l2r = [lse2_pad[ir], lse2_pad[ir + 8]]
                der = [delta_pad[ir], delta_pad[ir + 8]]
                s, dp = zeros_acc(NF), zeros_acc(NF)
                for kk in range(KD):
                    a = sm.ldsm_x4(sQ + a_lane + kk * 32)
                    for p in range(NF // 2):
                        b = sm.ldsm_x4(kbuf + bn_lane + p * 16 * RB + kk * 32)
                        mma(s[2 * p], a, b[0], b[1])
                        mma(s[2 * p + 1], a, b[2], b[3])
                for kk in range(KD):
                    a = sm.ldsm_x4(sdO + a_lane + kk * 32)
                    for p in range(NF // 2):
                        b = sm.ldsm_x4(vbuf + bn_lane + p * 16 * RB + kk * 32)
                        mma(dp[2 * p], a, b[0], b[1])
                        mma(dp[2 * p + 1], a, b[2], b[3])
                if j0 < full_lo or j0 + BN - 1 > full_hi:
                    for h in range(2):
                        i = ir + 8 * h
                        c_lo = np.maximum(i + win.dlo, 0) - j0
                        c_hi = np.where(i < Nq, np.minimum(i + win.dhi, win.L_last) - j0, -1)
                        for nf in range(NF):
                            for e in range(2):
                                c = nf * 8 + 2 * T4 + e
                                bad = (c < c_lo) | (c > c_hi)
                                s[nf][:, 2 * h + e] = np.where(bad, -np.inf, s[nf][:, 2 * h + e])
                for nf in range(NF):
                    for e in range(4):
                        p_ = np.exp2(s[nf][:, e] * sl2 - l2r[e // 2])
                        s[nf][:, e] = scale * p_ * (dp[nf][:, e] - der[e // 2])
                for kk in range(KN):
                    da = [pack(s[2 * kk][:, 0], s[2 * kk][:, 1]),
                          pack(s[2 * kk][:, 2], s[2 * kk][:, 3]),
                          pack(s[2 * kk + 1][:, 0], s[2 * kk + 1][:, 1]),
                          pack(s[2 * kk + 1][:, 2], s[2 * kk + 1][:, 3])]
                    for p in range(DF // 2):
                        b = sm.ldsm_x4(kbuf + bt_lane + kk * 16 * RB + p * 32, trans=True)
                        mma(dq[warp][2 * p], da, b[0], b[1])
                        mma(dq[warp][2 * p + 1], da, b[2], b[3])
        for warp in range(NWARPS):
            for h in range(2):
                i = i0 + warp * 16 + G + 8 * h
                for df in range(DF):
                    for ln in range(32):
                        if i[ln] < Nq:
                            c = df * 8 + 2 * T4[ln]
                            dq_out[i[ln], c:c + 2] = dq[warp][df][ln, 2 * h:2 * h + 2]


# ---- dense reference and driver ----------------------------------------------------------------
def dense(Q, K, V, dO, scale, vis):
    s = np.where(vis, scale * Q @ K.T, -np.inf)
    m = s.max(1, keepdims=True, initial=-np.inf)
    ok = m > -np.inf
    e = np.exp(s - np.where(ok, m, 0))
    l = e.sum(1, keepdims=True)
    P = np.where(ok, e / np.where(ok, l, 1), 0)
    O = P @ V
    lse = np.where(ok[:, 0], (np.where(ok, m, 0) + np.log(np.where(ok, l, 1)))[:, 0], -np.inf)
    delta = (dO * O).sum(1)
    dV = P.T @ dO
    dS = P * (dO @ V.T - delta[:, None])
    return lse, delta, scale * dS @ K, scale * dS.T @ Q, dV


def run_case(rng, Nq, Nk, D, L, left, right, br, BM, NWARPS, BN_dq, NW_dq, dq_det=True, **opt):
    """opt: emulate_dkdv's layout options (swz, kv_in_regs, smem_base); dq_det=False skips
    bwd_sm80_dq (its error reads 0)."""
    Q, K, V, dO = (rng.standard_normal((n, D)) for n in (Nq, Nk, Nk, Nq))
    scale = 1 / math.sqrt(D)
    vis = dense_visible(Nq, Nk, L, left, right, br)
    lse, delta, dQ, dK, dV = dense(Q, K, V, dO, scale, vis)
    PAD = 128
    Nq_pad = -(-Nq // PAD) * PAD
    lse2 = np.full(Nq_pad, np.inf)
    lse2[:Nq] = np.where(np.isneginf(lse), np.inf, lse * LOG2E)
    dpad = np.zeros(Nq_pad)
    dpad[:Nq] = delta
    win = Win(Nq, L, left, right, br)
    dq = np.zeros((Nq, D))
    dk = np.full((Nk, D), np.nan)
    dv = np.full((Nk, D), np.nan)
    emulate_dkdv(Q, K, V, dO, lse2, dpad, Nq_pad, scale, win, D, BM, NWARPS, dq, dk, dv, **opt)
    dq2 = np.full((Nq, D), np.nan)
    if dq_det:
        emulate_dq(Q, K, V, dO, lse2, dpad, scale, win, D, BN_dq, NW_dq, 2, dq2)
    else:
        dq2 = dQ.copy()
    errs = [float(np.nanmax(np.abs(a - b), initial=0)) if a.size else 0.0
            for a, b in ((dq, dQ), (dk, dK), (dv, dV), (dq2, dQ))]
    nan = any(np.isnan(x).any() for x in (dq, dk, dv, dq2))
    return errs, nan


def run_case_g(rng, Nq, Nk, D, L, left, right, br, BM, dq_atomic=True):
    Q, K, V, dO = (rng.standard_normal((n, D)) for n in (Nq, Nk, Nk, Nq))
    scale = 1 / math.sqrt(D)
    vis = dense_visible(Nq, Nk, L, left, right, br)
    lse, delta, dQ, dK, dV = dense(Q, K, V, dO, scale, vis)
    PAD = 128
    Nq_pad = -(-Nq // PAD) * PAD
    lse2 = np.full(Nq_pad, np.inf)
    lse2[:Nq] = np.where(np.isneginf(lse), np.inf, lse * LOG2E)
    dpad = np.zeros(Nq_pad)
    dpad[:Nq] = delta
    win = Win(Nq, L, left, right, br)
    dq = np.zeros((Nq, D))
    dk = np.full((Nk, D), np.nan)
    dv = np.full((Nk, D), np.nan)
    emulate_dkdv_g(Q, K, V, dO, lse2, dpad, Nq_pad, scale, win, D, BM, dq_atomic, dq, dk, dv)
    errs = [float(np.nanmax(np.abs(a - b), initial=0)) if a.size else 0.0
            for a, b in ((dq, dQ), (dk, dK), (dv, dV))]
    if not dq_atomic:
        errs[0] = 0.0
    nan = any(np.isnan(x).any() for x in (dq, dk, dv))
    return errs, nan


def main_g(quick=False):
    """bwd_sm80_dkdv_g (FA2-style warp grids): head dims 64, 128; BLOCK_M 32, 64, 128."""
    rng = np.random.default_rng(1)
    big = 10 ** 6
    fails = 0
    cases = [
        # (Nq, Nk, D, L, left, right, br, BM)
        (70, 150, 64, 150, big, big, True, 64),     # plain, 2 key tiles, padding rows
        (150, 140, 64, 140, big, 0, True, 64),      # causal bottom-right, 3 query tiles
        (150, 140, 64, 140, big, 0, False, 32),     # causal top-left, BLOCK_M 32
        (40, 200, 64, 200, 9, 3, True, 32),         # window
        (100, 170, 64, 91, big, 0, True, 64),       # kv_lens < Nk, causal
        (33, 50, 64, 0, big, big, True, 64),        # kv_lens = 0
        (1, 140, 64, 140, big, 0, True, 64),        # one query
        (130, 1, 64, 1, big, big, False, 32),       # one key
        (90, 130, 128, 130, big, 0, False, 64),     # D = 128, causal top-left
        (75, 129, 128, 120, 30, 5, True, 32),       # D = 128, window + kv_lens
        (300, 260, 64, 250, big, 0, True, 128),     # BLOCK_M 128 (dQ grid 4 x 2), causal, kv_lens
        (130, 140, 64, 140, 70, 20, False, 128),    # BLOCK_M 128, window top-left
    ]
    if quick:
        cases = cases[:2] + cases[8:9]
    for case in cases:
        for dq_atomic in ((True, False) if case[-1] == 64 and case[2] == 64 and case[0] == 150
                          else (True,)):
            errs, nan = run_case_g(rng, *case, dq_atomic=dq_atomic)
            ok = max(errs) < 1e-9 and not nan
            fails += not ok
            print(f"{'ok  ' if ok else 'FAIL'} dkdv_g Nq={case[0]:3d} Nk={case[1]:3d} D={case[2]} "
                  f"L={case[3]:3d} window=({case[4] if case[4] < big else None},"
                  f"{case[5] if case[5] < big else None}) br={case[6]} BM={case[7]} "
                  f"dq_atomic={dq_atomic} err dq={errs[0]:.1e} dk={errs[1]:.1e} dv={errs[2]:.1e} "
                  f"nan={nan}", flush=True)
    print(f"warp sub-tiles skipped (nothing visible): {SKIPPED[0]}")
    if not quick and SKIPPED[0] == 0:
        print("FAIL the skip path was never taken")
        fails += 1
    return fails


def main_swz(rng, quick=False):
    """bwd_sm80_dkdv with DKDV_SWZ: K, V, Q, dO in unpadded rows with the XOR swizzle, copied by
    cp_tile and read through tile_addr as the kernel does, from a shared base that is 16-byte but
    not row aligned (the kernel rounds it up). Then a negative control: the same copy read with
    the padded layout's additive addresses must fail (else these checks could not see a bad
    swizzle)."""
    global tile_addr
    big = 10 ** 6
    fails = 0
    cases = [
        # (Nq, Nk, D, L, left, right, br), (BLOCK_M, NWARPS), kv_in_regs
        ((37, 45, 64, 45, big, big, True), (32, 2), True),      # plain; dQ one warp column (WD 1)
        ((45, 37, 64, 37, big, 0, True), (32, 4), True),        # causal br, Nq > Nk; WD 2: col0 32
        ((45, 37, 64, 37, big, 0, False), (32, 4), True),       # causal top-left
        ((20, 70, 64, 70, 9, 3, True), (32, 2), True),          # window
        ((33, 50, 64, 21, big, 0, True), (32, 4), True),        # kv_lens < Nk, causal
        ((33, 50, 64, 0, big, big, True), (32, 2), True),       # kv_lens = 0
        ((1, 40, 64, 40, big, 0, True), (32, 4), True),         # one query
        ((50, 1, 64, 1, big, big, False), (32, 2), True),       # one key
        ((150, 140, 64, 140, big, 0, True), (64, 8), True),     # the candidate's tile, causal
        ((70, 150, 64, 150, big, big, True), (64, 8), True),    # its tile, 2 key tiles, padding
        ((40, 70, 64, 70, 30, 5, False), (32, 4), False),       # K, V A-fragments from shared
        ((30, 45, 128, 40, big, 0, True), (32, 4), False),      # D = 128 (16 chunks per row)
    ]
    if quick:
        cases = cases[:2] + cases[8:9]
    for case, (bm, nw), regs in cases:
        errs, nan = run_case(rng, *case, bm, nw, 16, 2, dq_det=False, swz=True, kv_in_regs=regs,
                             smem_base=48)
        ok = max(errs) < 1e-9 and not nan
        fails += not ok
        print(f"{'ok  ' if ok else 'FAIL'} swz Nq={case[0]:3d} Nk={case[1]:3d} D={case[2]:3d} "
              f"L={case[3]:3d} window=({case[4] if case[4] < big else None},"
              f"{case[5] if case[5] < big else None}) br={case[6]} BM={bm} warps={nw} "
              f"kv_regs={regs} err dq={errs[0]:.1e} dk={errs[1]:.1e} dv={errs[2]:.1e} nan={nan}",
              flush=True)
    good = tile_addr
    tile_addr = lambda swz, lane_addr, row_off, col_off: lane_addr + row_off + col_off  # noqa
    try:
        errs, nan = run_case(rng, 45, 37, 64, 37, big, 0, True, 32, 4, 16, 2, dq_det=False,
                             swz=True, kv_in_regs=True, smem_base=48)
    finally:
        tile_addr = good
    caught = nan or max(errs) > 1e-3
    fails += not caught
    print(f"{'ok  ' if caught else 'FAIL'} swz negative control (additive reads of the swizzled "
          f"tiles): err dq={errs[0]:.1e} dk={errs[1]:.1e} dv={errs[2]:.1e} nan={nan}")
    for layout, (n, lines) in sorted(LINES.items()):
        print(f"cp_tile {layout}: {n} row copies touch {lines / n:.3f} 128-byte shared lines each")
    for layout, (n, bad) in sorted(LDSM.items()):
        print(f"ldmatrix {layout}: {n} phases, {bad} with a bank conflict")
    if LDSM.get("swizzled", [0, 0])[1]:
        print("FAIL bank conflicts in the swizzled layout")
        fails += 1
    return fails


def main():
    rng = np.random.default_rng(0)
    check_forward_spec(rng)
    print("spec check on the forward's offsets: ok")
    fails = 0
    big = 10 ** 6
    cases = [
        # (Nq, Nk, D, L, left, right, br)
        (37, 45, 32, 45, big, big, True),      # plain
        (45, 37, 32, 37, big, 0, True),        # causal bottom-right, Nq > Nk (empty rows)
        (45, 37, 32, 37, big, 0, False),       # causal top-left
        (20, 70, 32, 70, 9, 3, True),          # window
        (33, 50, 32, 21, big, 0, True),        # kv_lens < Nk, causal
        (33, 50, 32, 0, big, big, True),       # kv_lens = 0
        (1, 40, 32, 40, big, 0, True),         # one query
        (50, 1, 32, 1, big, big, False),       # one key
    ]
    configs = [  # (dkdv BLOCK_M, NWARPS, dq BLOCK_N, dq NWARPS)
        (32, 2, 16, 2),   # WM = 2, WD = 1 (DQ_COLS = 32)
        (16, 2, 32, 1),   # WM = 1, WD = 2 (DQ_COLS = 16)
    ]
    for case, cfg in itertools.product(cases, configs):
        errs, nan = run_case(rng, *case, *cfg)
        ok = max(errs) < 1e-9 and not nan
        fails += not ok
        print(f"{'ok  ' if ok else 'FAIL'} Nq={case[0]:3d} Nk={case[1]:3d} D={case[2]} L={case[3]:3d} "
              f"window=({case[4] if case[4] < big else None},{case[5] if case[5] < big else None}) "
              f"br={case[6]} cfg={cfg}  err dq={errs[0]:.1e} dk={errs[1]:.1e} dv={errs[2]:.1e} "
              f"dq(det)={errs[3]:.1e} nan={nan}")
    # D = 64 with the chunked dQ (DQ_COLS = 64 -> one chunk; D = 128 WD = 1 -> two chunks)
    for case, cfg in (((40, 70, 64, 70, big, 0, True), (16, 4, 32, 2)),
                      ((30, 33, 128, 33, 10, 2, False), (16, 1, 16, 1))):
        errs, nan = run_case(rng, *case, *cfg)
        ok = max(errs) < 1e-9 and not nan
        fails += not ok
        print(f"{'ok  ' if ok else 'FAIL'} Nq={case[0]} Nk={case[1]} D={case[2]} cfg={cfg} "
              f"errs={['%.1e' % e for e in errs]} nan={nan}")
    fails += main_swz(rng)
    fails += main_g()
    print("emulation:", "all ok" if not fails else f"{fails} FAILED")
    return 1 if fails else 0


if __name__ == "__main__":
    if sys.argv[1:] == ["--grid-only"]:
        sys.exit(1 if main_g() else 0)
    if sys.argv[1:] == ["--swz-only"]:
        sys.exit(1 if main_swz(np.random.default_rng(3)) else 0)
    sys.exit(main())
