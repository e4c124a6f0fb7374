"""The CPU path: the kernels' tiled online softmax, written in NumPy.

Each step handles one tile of ``BLOCK_N`` keys for every (batch, head) and every query row at once,
so the working set is O(BH * Nq * BLOCK_N) scores plus the O(BH * N * D) inputs and outputs; the
(Nq, Nk) score matrix never exists. Per row the state is (m, l, acc) as in DESIGN.md: the running
maximum, the running denominator and the running unnormalized output, all in ``acc_dtype``.

The visibility predicate mirrors ``kernels_cu/mask.cuh``: for query row i of a sequence with L
valid keys, the aligned position is p = i + L - Nq (bottom-right) or p = i (top-left), and key j is
visible iff lo <= j <= hi with lo = p - left, hi = min(p + right, L - 1), and mask[i, j], and
bias[i, j] != -inf (a NaN bias is visible: its logit is NaN). Since lo and hi are non-decreasing in
i, key tiles outside [min lo, max hi] are skipped without computing a score.

Non-finite values follow the dense formula (README "Empty rows and non-finite values"): only a row
with no visible key is empty (out 0, lse -inf); a NaN or +inf visible logit, or a row whose every
visible logit is -inf, gives NaN. The backward recomputes "lost" rows, whose |lse| is too large to
carry log(l) (cuflash._config.LOST_LSE), exactly from their own max and sum in float64.

``forward`` returns ``out`` (BH, Nq, Dv) in the input dtype and ``lse`` (BH, Nq) in acc_dtype;
``backward`` returns per-(batch, head) gradients (BH, Nq, Dk), (BH, Nk, Dk), (BH, Nk, Dv) in
acc_dtype, which the API sums back to the inputs' own shapes and casts.
"""
import numpy as np
from numpy.lib.stride_tricks import as_strided

from . import _config
from ._validate import key_range

BLOCK_N = 128  # keys per step; read at call time so that tests can shrink it


def _gather(x, offsets, acc_dtype):
    """Per-(batch, head) matrices of ``x``: (BH, N, D) in acc_dtype, read through the offset map.

    ``offsets`` are element offsets from ``x``'s first element (x.data), as the kernels receive
    them. They may be negative (negative strides), so the flat view starts at the lowest address.
    """
    n, d = x.shape[-2:]
    bh = offsets.size
    if x.size == 0 or bh == 0:
        return np.zeros((bh, n, d), dtype=acc_dtype)
    item = x.dtype.itemsize
    # Flip every negative-stride axis: same memory, and the view starts at the lowest address.
    low = x[tuple(slice(None, None, -1) if s < 0 else slice(None) for s in x.strides)]
    shift = (x.ctypes.data - low.ctypes.data) // item
    span = 1 + sum((size - 1) * abs(stride) for size, stride in zip(x.shape, x.strides)) // item
    flat = as_strided(low, shape=(span,), strides=(item,), writeable=False)
    row_stride = x.strides[-2] // item
    index = ((offsets.reshape(bh, 1, 1) + shift)
             + np.arange(n, dtype=np.int64).reshape(1, n, 1) * row_stride
             + np.arange(d, dtype=np.int64).reshape(1, 1, d))
    return flat[index].astype(acc_dtype)


class _Tiles:
    """What both passes need: gathered q/k/v, per-row key ranges, and per-tile scores."""

    def __init__(self, problem):
        p = problem
        self.p = p
        self.acc = p.acc_dtype
        bh = p.BH
        self.q = _gather(p.q, p.q_map, self.acc)
        self.k = _gather(p.k, p.k_map, self.acc)
        self.v = _gather(p.v, p.v_map, self.acc)
        lengths = (np.full(bh, p.Nk, dtype=np.int64) if p.kv_lens is None
                   else np.asarray(p.kv_lens, dtype=np.int64).reshape(bh))
        if p.kv_lens is not None:  # keys past kv_lens do not exist: their k, v may hold NaN
            past = np.arange(p.Nk).reshape(1, p.Nk) >= lengths.reshape(bh, 1)
            self.k[past] = 0
            self.v[past] = 0
        self.lo, self.hi = key_range(np.arange(p.Nq).reshape(1, p.Nq), lengths.reshape(bh, 1),
                                     p.Nq, p.left, p.right, p.bottom_right)  # (BH, Nq) each
        nonempty = self.lo <= self.hi
        # Key range any row can see: every key tile outside it is skipped.
        self.first = int(self.lo[nonempty].min()) if nonempty.any() else 0
        self.last = int(self.hi[nonempty].max()) if nonempty.any() else -1

    def tiles(self):
        """(j0, j1) of every key tile that at least one row can see."""
        block = BLOCK_N
        start = (self.first // block) * block
        for j0 in range(start, self.last + 1, block):
            j1 = min(j0 + block, self.p.Nk)
            if np.any((self.lo <= j1 - 1) & (self.hi >= j0) & (self.lo <= self.hi)):
                yield j0, j1

    def scores(self, j0, j1, rows=None, dtype=None):
        """Scaled (biased) scores of keys [j0, j1) with invisible ones at -inf, and the
        visibility: both (BH, Nq, j1 - j0), or (len(rows[0]), j1 - j0) for the (bh, i) pairs
        ``rows``, computed in ``dtype`` (default: the accumulator dtype)."""
        p, bh = self.p, self.p.BH
        dtype = self.acc if dtype is None else np.dtype(dtype)
        n = j1 - j0
        keys = np.arange(j0, j1, dtype=np.int64)
        if rows is None:
            q, kt, lo, hi = self.q, np.swapaxes(self.k[:, j0:j1], -1, -2), self.lo, self.hi
            pick = (slice(None), slice(None))
        else:
            b, i = rows
            q, kt = self.q[b, i][:, None, :], np.swapaxes(self.k[b, j0:j1], -1, -2)
            lo, hi, pick = self.lo[b, i], self.hi[b, i], (b, i)
        s = (q.astype(dtype) @ kt.astype(dtype)).reshape(lo.shape + (n,)) * dtype.type(p.scale)
        visible = (lo[..., None] <= keys) & (keys <= hi[..., None])
        if p.mask is not None:  # slicing the broadcast view first copies only this tile
            visible &= p.mask[..., j0:j1].reshape(bh, p.Nq, n)[pick]
        if p.bias is not None:
            bias = p.bias[..., j0:j1].reshape(bh, p.Nq, n)[pick].astype(dtype)
            visible &= bias != -np.inf
            s = s + bias
        return np.where(visible, s, -np.inf), visible


def forward(problem):
    """Tiled online softmax: returns out (BH, Nq, Dv) in the input dtype, lse (BH, Nq) in acc."""
    p = problem
    t = _Tiles(p)
    acc_t = t.acc
    m = np.full((p.BH, p.Nq), -np.inf, dtype=acc_t)
    l = np.zeros((p.BH, p.Nq), dtype=acc_t)
    acc = np.zeros((p.BH, p.Nq, p.Dv), dtype=acc_t)
    seen = np.zeros((p.BH, p.Nq), dtype=bool)  # the row has a visible key
    with np.errstate(invalid="ignore", over="ignore"):  # NaN / inf inputs propagate as IEEE says
        for j0, j1 in t.tiles():
            s, visible = t.scores(j0, j1)
            seen |= visible.any(axis=-1)
            m_new = np.maximum(m, s.max(axis=-1))  # NaN if a visible logit is NaN
            # A row with no finite logit yet keeps m = -inf and shifts by 0, so that no
            # exp(-inf - (-inf)) is ever evaluated: its alpha and p are exp(-inf) = 0.
            shift = np.where(m_new == -np.inf, 0, m_new).astype(acc_t)
            alpha = np.exp(m - shift)                 # rescale factor of the old state
            prob = np.exp(s - shift[..., None])       # this tile's mass on the new reference
            l = alpha * l + prob.sum(axis=-1)         # rescale BOTH l ...
            acc = alpha[..., None] * acc + prob @ t.v[:, j0:j1]   # ... and acc
            m = m_new
        # Empty rows (no visible key): 0 and -inf. A row that sees keys but has l = 0 (every
        # visible logit -inf) is 0 / 0 = NaN, like a NaN l.
        denom = np.where(l == 0, np.nan, l)
        out = np.where(seen[..., None], acc / denom[..., None], 0).astype(p.dtype)
        lse = np.where(seen, m + np.log(denom), -np.inf).astype(acc_t)
    return out, lse


def _rows(x, problem, width, dtype):
    """An output-shaped array (lead + (Nq, width)) as (BH, Nq, width) in ``dtype``."""
    return np.asarray(x).reshape(problem.BH, problem.Nq, width).astype(dtype)


def backward(problem, dout, out, lse, deterministic=False):
    """Gradients per output (batch, head) in acc dtype: dq (BH, Nq, Dk), dk (BH, Nk, Dk),
    dv (BH, Nk, Dv). P is recomputed per key tile from q, k and lse; D = rowsum(dout * out)."""
    p = problem
    t = _Tiles(p)
    acc_t = t.acc
    dout = _rows(dout, p, p.Dv, acc_t)
    delta = (dout * _rows(out, p, p.Dv, acc_t)).sum(axis=-1)          # (BH, Nq)
    lse = np.asarray(lse).reshape(p.BH, p.Nq).astype(acc_t)
    # Empty rows (lse = -inf) are shifted by +inf instead, so that their P is exp(-inf) = 0 and
    # no -inf - (-inf) is evaluated; a NaN lse gives NaN on the row's visible keys. Lost rows are
    # left out here (P = 0) and recomputed exactly below.
    lost = np.isfinite(lse) & (np.abs(lse) >= _config.lost_lse_limit(acc_t))
    skip = (lse == -np.inf) | lost
    lse_shift = np.where(skip, np.inf, lse)[..., None]
    scale = acc_t.type(p.scale)
    dq = np.zeros((p.BH, p.Nq, p.Dk), dtype=acc_t)
    dk = np.zeros((p.BH, p.Nk, p.Dk), dtype=acc_t)
    dv = np.zeros((p.BH, p.Nk, p.Dv), dtype=acc_t)
    with np.errstate(invalid="ignore", over="ignore"):
        for j0, j1 in t.tiles():
            s, visible = t.scores(j0, j1)
            prob = np.where(visible & ~skip[..., None], np.exp(s - lse_shift), 0)
            dv[:, j0:j1] = np.swapaxes(prob, -1, -2) @ dout
            dprob = dout @ np.swapaxes(t.v[:, j0:j1], -1, -2)
            ds = prob * (dprob - delta[..., None])
            dq += (ds @ t.k[:, j0:j1]) * scale
            dk[:, j0:j1] = (np.swapaxes(ds, -1, -2) @ t.q) * scale
        if lost.any():
            _lost_rows(t, np.nonzero(lost), dout, _rows(out, p, p.Dv, np.float64), dq, dk, dv)
    return dq, dk, dv


def _lost_rows(t, rows, dout, out, dq, dk, dv):
    """Add the gradients of the lost rows ``rows`` = (bh, i), recomputed in float64 from their
    own max and sum (two passes over the key tiles), to dq, dk, dv. ``out``: (BH, Nq, Dv)."""
    f64 = np.float64
    b, i = rows
    m = np.full(b.size, -np.inf)
    l = np.zeros(b.size)
    for j0, j1 in t.tiles():  # pass 1: the rows' max and sum, online
        s, _ = t.scores(j0, j1, rows, f64)
        m_new = np.maximum(m, s.max(axis=-1))
        shift = np.where(m_new == -np.inf, 0, m_new)
        l = l * np.exp(m - shift) + np.exp(s - shift[:, None]).sum(axis=-1)
        m = m_new
    shift = np.where(m == -np.inf, 0, m)[:, None]
    l = l[:, None]
    do = dout[b, i].astype(f64)                    # (n, Dv)
    d = (do * out[b, i]).sum(axis=-1)[:, None]     # delta, in float64 too
    q = t.q[b, i].astype(f64)                      # (n, Dk)
    scale = f64(t.p.scale)
    grad_q = np.zeros(q.shape)
    for j0, j1 in t.tiles():  # pass 2: P, dS and the three products
        s, _ = t.scores(j0, j1, rows, f64)
        prob = np.exp(s - shift) / l               # (n, tile)
        k, v = t.k[b, j0:j1].astype(f64), t.v[b, j0:j1].astype(f64)   # (n, tile, D)
        ds = prob * (np.einsum("nd,njd->nj", do, v) - d)
        grad_q += np.einsum("nj,njd->nd", ds, k) * scale
        np.add.at(dk, (b[:, None], np.arange(j0, j1)[None, :]),
                  (ds[..., None] * q[:, None, :] * scale).astype(dk.dtype))
        np.add.at(dv, (b[:, None], np.arange(j0, j1)[None, :]),
                  (prob[..., None] * do[:, None, :]).astype(dv.dtype))
    np.add.at(dq, (b, i), grad_q.astype(dq.dtype))
