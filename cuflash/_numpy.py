"""The CPU path: the kernels' tiled online softmax, written in NumPy.

The work is cut like the kernels': blocks of query rows (all heads of a chunk at once, so that
each NumPy call is a batch of BLAS products) against tiles of ``BLOCK_N`` keys. A step's scores,
(heads, rows, keys), stay within ``TILE`` elements, small enough to live in cache; the (Nq, Nk)
score matrix never exists. Per row the state is (m, l, acc) as in DESIGN.md: the running
maximum, the running denominator and the running unnormalized output, all in ``acc_dtype``.

The visibility predicate mirrors ``kernels_cu/mask.cuh``: for query row i of a sequence with L
valid keys, the aligned position is p = i + L - Nq (bottom-right) or p = i (top-left), and key j is
visible iff lo <= j <= hi with lo = p - left, hi = min(p + right, L - 1), and mask[i, j], and
bias[i, j] != -inf (a NaN bias is visible: its logit is NaN). A block of rows skips every key tile
outside its rows' [min lo, max hi] without computing a score (half the work when causal), and a
tile that every row of the block sees whole by position takes no position test.

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

from . import _config, _dropout, _modifiers
from ._validate import aligned_position, key_range

# Read at call time, so that tests can shrink them: keys per tile, query rows per block (None:
# as many as TILE allows), and the most scores one step holds (heads x rows x keys).
BLOCK_N = 256
BLOCK_M = None
TILE = 1 << 18


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


def _core(x):
    """``x`` (a broadcast view) without its broadcast axes' repeats, for a scan of its values."""
    return x[tuple(0 if s == 0 else slice(None) for s in x.strides)]


class _Tiles:
    """What both passes need: gathered q/k/v, per-row key ranges, the blocking, and scores."""

    def __init__(self, problem):
        p = problem
        self.p = p
        self.acc = acc = p.acc_dtype
        bh = p.BH
        self.q = _gather(p.q, p.q_map, acc)
        self.k = _gather(p.k, p.k_map, acc)
        self.v = _gather(p.v, p.v_map, acc)
        lengths = (np.full(bh, p.Nk, dtype=np.int64) if p.kv_lens is None
                   else np.asarray(p.kv_lens, dtype=np.int64).reshape(bh))
        if p.kv_lens is not None:  # keys past kv_lens do not exist: their k, v may hold NaN
            past = np.arange(p.Nk).reshape(1, p.Nk) >= lengths.reshape(bh, 1)
            self.k[past] = 0
            self.v[past] = 0
        rows, lens = np.arange(p.Nq).reshape(1, p.Nq), lengths.reshape(bh, 1)
        self.lo, self.hi = key_range(rows, lens, p.Nq, p.left, p.right,
                                     p.bottom_right)  # (BH, Nq) each
        # the rows' aligned positions (BH, Nq), for a transform that reads them (ALiBi)
        self.pos = aligned_position(rows, lens, p.Nq, p.bottom_right)
        # q carries the scale when that cannot overflow (|scale| <= 1); else the scores take it.
        self.scale = acc.type(p.scale)
        self.prescaled = abs(p.scale) <= 1
        self.qs = self.q * self.scale if self.prescaled else self.q
        self.kt = np.swapaxes(self.k, -1, -2)
        self.heads = np.unravel_index(np.arange(bh), p.lead) if p.lead else ()
        self.bias_hides = p.bias is not None and bool(np.any(_core(p.bias) == -np.inf))
        # dropout: the keep bits' threshold, the kept weights' factor in acc (cuflash/_dropout.py)
        self.dropout = bool(p.dropout_p)
        if self.dropout:
            self.threshold = _dropout.threshold(p.dropout_p)
            self.rscale = acc.type(_dropout.rscale(p.dropout_p))

    # -- blocking --------------------------------------------------------------------------
    def blocks(self):
        """(heads, rows) slices of the query blocks, together covering (BH, Nq)."""
        p = self.p
        bn = max(1, min(BLOCK_N, p.Nk))
        bm = BLOCK_M or max(1, min(p.Nq, TILE // (bn * max(p.BH, 1))))
        hb = max(1, min(p.BH, TILE // (bn * bm)))
        for h0 in range(0, p.BH, hb):
            for i0 in range(0, p.Nq, bm):
                yield slice(h0, h0 + hb), slice(i0, i0 + bm)

    def key_tiles(self, hs, rs):
        """(j0, j1, whole) of the key tiles some row of the block sees by position; ``whole``:
        every row sees every key of the tile by position."""
        lo, hi = self.lo[hs, rs], self.hi[hs, rs]
        seeing = lo <= hi
        if not seeing.any():
            return
        first, last = int(lo[seeing].min()), int(hi[seeing].max())
        lo_max, hi_min = int(lo.max()), int(hi.min())
        block = BLOCK_N
        for j0 in range((first // block) * block, last + 1, block):
            j1 = min(j0 + block, self.p.Nk)
            whole = lo_max <= j0 and hi_min >= j1 - 1
            if whole or np.any((lo <= j1 - 1) & (hi >= j0) & seeing):
                yield j0, j1, whole

    def _lead(self, x, hs, rs, j0, j1):
        """Block (hs, rs) x keys [j0, j1) of a lead + (Nq, Nk) view: (heads or 1, rows, keys)."""
        tile = x[..., rs, j0:j1]
        if not self.p.lead:
            return tile[None]
        if all(s == 0 for s in x.strides[:-2]):  # one matrix for every head: broadcast it
            return tile[(0,) * len(self.p.lead)][None]
        return tile[tuple(h[hs] for h in self.heads)]

    # -- dropout ---------------------------------------------------------------------------
    def keep(self, bh, rows, j0, j1):
        """Dropout's keep bits of keys [j0, j1) for the (batch, head)s ``bh`` and rows ``rows``
        (int arrays that broadcast to S): S + (j1 - j0,) (kernels_cu/philox.cuh's bits)."""
        seed, offset = self.p.dropout_seed
        return _dropout.keep(seed, offset, self.threshold, bh, rows, j0, j1)

    def block_keep(self, hs, rs, j0, j1):
        """The keep bits of block (hs, rs) x keys [j0, j1): (heads, rows, keys)."""
        return self.keep(np.arange(self.p.BH)[hs, None], np.arange(self.p.Nq)[None, rs], j0, j1)

    # -- scores ----------------------------------------------------------------------------
    def at(self, hs, rs, j0, j1):
        """Where block (hs, rs) x keys [j0, j1) sits, for the transforms (_modifiers.At)."""
        table = None if self.p.alibi is None else self.p.alibi[hs].reshape(-1, 1, 1)
        return _modifiers.At(self.pos[hs, rs, None], np.arange(j0, j1, dtype=np.int64), table)

    def scores(self, hs, rs, j0, j1, whole, grad=False):
        """Scaled, transformed (cuflash/_modifiers.py), biased scores of block (hs, rs) against
        keys [j0, j1), hidden ones at -inf, and ``hidden`` (heads, rows, keys), or None where
        every score is visible; with ``grad`` also the transforms' derivative (None without
        any; 1 where hidden)."""
        p = self.p
        s = self.qs[hs, rs] @ self.kt[hs, :, j0:j1]
        if not self.prescaled:
            s *= self.scale
        g = None
        if p.transforms:
            at = self.at(hs, rs, j0, j1)
            s, g = (_modifiers.forward_and_grad(p, s, at) if grad else
                    (_modifiers.forward(p, s, at), None))
        hidden = None
        if not whole:
            keys = np.arange(j0, j1, dtype=np.int64)
            hidden = ((keys < self.lo[hs, rs, None]) | (keys > self.hi[hs, rs, None]))
        if p.mask is not None:
            shown = self._lead(p.mask, hs, rs, j0, j1)
            hidden = ~shown if hidden is None else (hidden | ~shown)
        if p.bias is not None:
            bias = self._lead(p.bias, hs, rs, j0, j1)
            s += bias
            if self.bias_hides:
                hidden = (bias == -np.inf) if hidden is None else (hidden | (bias == -np.inf))
        if hidden is not None:
            hidden = np.broadcast_to(hidden, s.shape)
            np.copyto(s, -np.inf, where=hidden)
            if g is not None:
                np.copyto(g, 1, where=hidden)
        return (s, hidden, g) if grad else (s, hidden)

    def row_scores(self, j0, j1, rows):
        """Float64 scores of keys [j0, j1) for the (bh, i) pairs ``rows``, hidden at -inf, and
        the transforms' derivative (1 where hidden): two (len(rows[0]), j1 - j0) arrays."""
        p, f64 = self.p, np.float64
        b, i = rows
        keys = np.arange(j0, j1, dtype=np.int64)
        s = np.einsum("nd,njd->nj", self.q[b, i].astype(f64), self.k[b, j0:j1].astype(f64))
        s *= f64(p.scale)
        table = None if p.alibi is None else p.alibi[b].reshape(-1, 1)
        s, g = _modifiers.forward_and_grad(p, s, _modifiers.At(self.pos[b, i, None], keys, table))
        visible = (self.lo[b, i, None] <= keys) & (keys <= self.hi[b, i, None])
        pick = tuple(h[b] for h in self.heads) + (i,)
        if p.mask is not None:
            visible &= p.mask[..., j0:j1][pick]
        if p.bias is not None:
            bias = p.bias[..., j0:j1][pick].astype(f64)
            visible &= bias != -np.inf
            s += bias
        return np.where(visible, s, -np.inf), np.where(visible, g, 1)


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
        for hs, rs in t.blocks():
            m_b, l_b, acc_b, seen_b = m[hs, rs], l[hs, rs], acc[hs, rs], seen[hs, rs]  # views
            for j0, j1, whole in t.key_tiles(hs, rs):
                s, hidden = t.scores(hs, rs, j0, j1, whole)
                if hidden is None:
                    seen_b[...] = True
                else:
                    shown = ~hidden.all(axis=-1)
                    if not shown.any():
                        continue
                    seen_b |= shown
                m_new = np.maximum(m_b, s.max(axis=-1))  # NaN if a visible logit is NaN
                # A row with no finite logit yet keeps m = -inf and shifts by 0, so that no
                # exp(-inf - (-inf)) is ever evaluated: its alpha and p are exp(-inf) = 0.
                shift = np.where(m_new == -np.inf, acc_t.type(0), m_new)
                alpha = np.exp(m_b - shift)               # rescale factor of the old state
                s -= shift[..., None]
                prob = np.exp(s, out=s)                   # this tile's mass on the new reference
                l_b *= alpha                              # rescale BOTH l ...
                l_b += prob.sum(axis=-1)                  # (l: the undropped sum)
                acc_b *= alpha[..., None]                 # ... and acc
                if t.dropout:                             # dropout acts on P V only
                    np.copyto(prob, 0, where=~t.block_keep(hs, rs, j0, j1))
                acc_b += prob @ t.v[hs, j0:j1]
                m_b[...] = m_new
        # Empty rows (no visible key): 0 and -inf. A row that sees keys but has l = 0 (every
        # visible logit -inf) is 0 / 0 = NaN, like a NaN l.
        denom = np.where(l == 0, np.nan, l)
        out = np.where(seen[..., None], acc / denom[..., None], 0)
        if t.dropout:  # the kept weights' factor
            out *= t.rscale
        out = out.astype(p.dtype)
        lse = np.where(seen, m + np.log(denom), -np.inf).astype(acc_t)
    return out, lse


def _rows(x, problem, width, dtype):
    """An output-shaped array (lead + (Nq, width)) as (BH, Nq, width) in ``dtype``."""
    return np.asarray(x).reshape(problem.BH, problem.Nq, width).astype(dtype)


def backward(problem, dout, out, lse, deterministic=False, sink_probs=None):
    """Gradients per output (batch, head) in acc dtype: dq (BH, Nq, Dk), dk (BH, Nk, Dk),
    dv (BH, Nk, Dv), and with ``problem.dbias`` the logits' gradient dbias (BH, Nq, Nk) (0
    where P is 0; the API sums it into the bias's shape). P is recomputed per tile from q, k
    and lse; D = rowsum(dout * out). With sinks, the lost rows' sink probabilities are written
    into ``sink_probs`` (BH, Nq)."""
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
    lse_shift = np.where((lse == -np.inf) | lost, np.inf, lse)
    dq = np.zeros((p.BH, p.Nq, p.Dk), dtype=acc_t)
    dk = np.zeros((p.BH, p.Nk, p.Dk), dtype=acc_t)
    dv = np.zeros((p.BH, p.Nk, p.Dv), dtype=acc_t)
    dbias = np.zeros((p.BH, p.Nq, p.Nk), dtype=acc_t) if p.dbias else None
    with np.errstate(invalid="ignore", over="ignore"):
        for hs, rs in t.blocks():
            do_b, dq_b, q_b = dout[hs, rs], dq[hs, rs], t.qs[hs, rs]
            delta_b, shift_b = delta[hs, rs, None], lse_shift[hs, rs, None]
            nan_lse = bool(np.isnan(shift_b).any())
            for j0, j1, whole in t.key_tiles(hs, rs):
                s, hidden, g = t.scores(hs, rs, j0, j1, whole, grad=True)
                s -= shift_b
                prob = np.exp(s, out=s)
                if nan_lse and hidden is not None:  # a NaN lse - (-inf): hidden keys stay 0
                    np.copyto(prob, 0, where=hidden)
                ds = do_b @ np.swapaxes(t.v[hs, j0:j1], -1, -2)   # dP
                if t.dropout:  # dV = (Z P r)^T dO (r at the end), dS = P (Z dP r - D)
                    dropped = ~t.block_keep(hs, rs, j0, j1)
                    dv[hs, j0:j1] += np.swapaxes(np.where(dropped, 0, prob), -1, -2) @ do_b
                    ds *= t.rscale
                    np.copyto(ds, 0, where=dropped)
                else:
                    dv[hs, j0:j1] += np.swapaxes(prob, -1, -2) @ do_b
                ds -= delta_b
                ds *= prob                                          # dS = P (dP - D)
                if dbias is not None:  # the logits' gradient, before F'(x)
                    dbias[hs, rs, j0:j1] = np.where(prob == 0, 0, ds)
                if g is not None:
                    ds *= g                                         # ... F'(x)
                dq_b += ds @ t.k[hs, j0:j1]
                dk[hs, j0:j1] += np.swapaxes(ds, -1, -2) @ q_b
        dq *= t.scale                 # dS / dq = scale k; dk took q's scale already if q has it
        if not t.prescaled:
            dk *= t.scale
        if t.dropout:
            dv *= t.rscale
        if lost.any():
            _lost_rows(t, np.nonzero(lost), dout, _rows(out, p, p.Dv, np.float64), dq, dk, dv,
                       sink_probs, dbias)
    return (dq, dk, dv) if dbias is None else (dq, dk, dv, dbias)


def _lost_rows(t, rows, dout, out, dq, dk, dv, sink_probs=None, dbias=None):
    """Add the gradients of the lost rows ``rows`` = (bh, i), recomputed in float64 from their
    own max and sum (two passes over the key tiles; the sink, if any, joins the sum), to dq, dk,
    dv; with sinks, write their exact sink probabilities into sink_probs; with dbias (BH, Nq, Nk),
    write their logits' gradients there. ``out``: (BH, Nq, Dv)."""
    f64 = np.float64
    b, i = rows
    m = np.full(b.size, -np.inf)
    l = np.zeros(b.size)
    every_row = slice(None), slice(None)
    for j0, j1, _ in t.key_tiles(*every_row):  # pass 1: the rows' max and sum, online
        s, _ = t.row_scores(j0, j1, rows)
        m_new = np.maximum(m, s.max(axis=-1))
        shift = np.where(m_new == -np.inf, 0, m_new)
        l = l * np.exp(m - shift) + np.exp(s - shift[:, None]).sum(axis=-1)
        m = m_new
    if t.p.sinks is not None:  # the sink column (value 0): one more logit of the row's sum
        sink = t.p.sinks[b]
        m_new = np.maximum(m, sink)
        shift = np.where(m_new == -np.inf, 0, m_new)
        l = l * np.exp(m - shift) + np.exp(sink - shift)
        m = m_new
        sink_probs[b, i] = np.exp(sink - shift) / l
    shift = np.where(m == -np.inf, 0, m)[:, None]
    l = l[:, None]
    do = dout[b, i].astype(f64)                    # (n, Dv)
    d = (do * out[b, i]).sum(axis=-1)[:, None]     # delta, in float64 too
    q = t.q[b, i].astype(f64)                      # (n, Dk)
    scale = f64(t.p.scale)
    grad_q = np.zeros(q.shape)
    for j0, j1, _ in t.key_tiles(*every_row):  # pass 2: P, dS and the three products
        s, g = t.row_scores(j0, j1, rows)
        prob = np.exp(s - shift) / l               # (n, tile)
        k, v = t.k[b, j0:j1].astype(f64), t.v[b, j0:j1].astype(f64)   # (n, tile, D)
        dp = np.einsum("nd,njd->nj", do, v)
        if t.dropout:  # the rows' keep bits: dS = P (Z dP r - D), dV += (Z P r)^T dO
            z = t.keep(b[:, None], i[:, None], j0, j1)[:, 0]
            r = _dropout.rscale(t.p.dropout_p)
            dp = np.where(z, dp * r, 0)
        ds = prob * (dp - d)
        if dbias is not None:
            dbias[b[:, None], i[:, None], np.arange(j0, j1)[None, :]] = np.where(prob == 0, 0, ds)
        ds *= g
        grad_q += np.einsum("nj,njd->nd", ds, k) * scale
        np.add.at(dk, (b[:, None], np.arange(j0, j1)[None, :]),
                  (ds[..., None] * q[:, None, :] * scale).astype(dk.dtype))
        if t.dropout:
            prob = np.where(z, prob * r, 0)
        np.add.at(dv, (b[:, None], np.arange(j0, j1)[None, :]),
                  (prob[..., None] * do[:, None, :]).astype(dv.dtype))
    np.add.at(dq, (b, i), grad_q.astype(dq.dtype))
