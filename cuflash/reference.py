"""Dense float64 attention: the executable spec that every other path is tested against.

This module materializes the full ``(..., Nq, Nk)`` score matrix, so it is meant for tests and small
problems only. It deliberately shares no code with the fast paths: inputs are checked by
``cuflash._validate.make_problem`` (so that bad input fails here exactly as it does in
``cuflash.attention``), and then everything is rebuilt from the raw arguments and the definitions in
``cuflash.attention``'s docstring: GQA by ``np.repeat``, leading dims by ``np.broadcast_to``, and the
visibility mask literally from its definition.

Inputs may be NumPy or CuPy arrays (CuPy arrays are copied to the host). Results are always NumPy
``float64`` arrays, whatever the input dtype.

One piece is shared with the fast paths on purpose: dropout's keep mask comes from
``cuflash._dropout`` (Philox4x32-7 in NumPy, the same bits as kernels_cu/philox.cuh), since a
mask drawn any other way could not agree with theirs; tests/test_dropout.py checks that generator
against a scalar Philox written from its definition and Random123's known answers.
"""
import math

import numpy as np

from . import _config, _dropout, _validate

__all__ = ["attention", "attention_backward", "dropout_mask"]


def _host(x):
    """A NumPy view or copy of ``x`` (NumPy or CuPy array, or array-like); None stays None."""
    if x is None:
        return None
    if hasattr(x, "get") and not isinstance(x, np.ndarray):
        x = x.get()
    return np.asarray(x)


def _check(q, k, v, scale, causal, align, window, mask, bias, kv_lens, positions=None,
           softcap=None, sinks=None, alibi_slopes=None, dropout_p=0.0, dropout_seed=None):
    """Reject bad input with the library's own messages; returns the checked dropout
    (dropout_p, (seed, offset) or None); the Problem itself is not used otherwise."""
    p = _validate.make_problem(q, k, v, scale=scale, causal=causal, align=align, window=window,
                               mask=mask, bias=bias, kv_lens=kv_lens, positions=positions,
                               softcap=softcap, sinks=sinks, alibi_slopes=alibi_slopes,
                               dropout_p=dropout_p, dropout_seed=dropout_seed)
    return p.dropout_p, p.dropout_seed


def dropout_mask(q, k, v, dropout_p, dropout_seed):
    """The keep mask Z (bool, lead + (Nq, Nk)) that ``cuflash.attention(q, k, v,
    dropout_p=dropout_p, dropout_seed=dropout_seed)`` applies, lead the output's leading shape
    (README "Dropout": key j of row i of the flat (batch, head) bh is kept iff byte
    b = 2 ((j // 8) % 8) + j % 2 (byte b % 4 of word b // 4) of Philox4x32-7(counter=
    ((j // 64) * 4 + (j // 2) % 4, i, bh, offset), key=(seed % 2**32, seed // 2**32)) is at least
    round(256 dropout_p)). All True for dropout_p = 0."""
    dropout_p, seed = _check(q, k, v, None, False, "bottom-right", None, None, None, None,
                             dropout_p=dropout_p, dropout_seed=dropout_seed)
    q, k, v = (_host(x) for x in (q, k, v))
    lead = _lead_shape(q, k, v)
    if not dropout_p:
        return np.ones(lead + (q.shape[-2], k.shape[-2]), dtype=bool)
    return _dropout.dense_keep(lead, q.shape[-2], k.shape[-2], dropout_p, seed)


def _lead_shape(q, k, v):
    """The output's leading shape: NumPy broadcasting, except k/v may have H / g heads (GQA)."""
    leads = [x.shape[:-2] for x in (q, k, v)]
    ndim = max(len(s) for s in leads)
    leads = [(1,) * (ndim - len(s)) + s for s in leads]
    if ndim == 0:
        return ()
    body = np.broadcast_shapes(*(s[:-1] for s in leads))
    heads = [s[-1] for s in leads]
    nheads = 0 if 0 in heads else max(heads)
    return tuple(body) + (nheads,)


def _expand(x, lead):
    """``x`` (..., N, D) read by every output (batch, head): shape lead + (N, D), GQA by repeat."""
    if len(lead) == 0:
        return x
    x = x.reshape((1,) * (len(lead) + 2 - x.ndim) + x.shape)
    nheads, xheads = lead[-1], x.shape[-3]
    if xheads not in (1, nheads):
        x = np.repeat(x, nheads // xheads, axis=-3)  # query head h reads kv head h // (H // Hx)
    return np.broadcast_to(x, lead + x.shape[-2:])


def _sum_to(grad, shape):
    """Adjoint of ``_expand``: sum ``grad`` (lead + (N, D)) back to an input's ``shape``."""
    lead = grad.shape[:-2]
    if math.prod(lead) == 0:
        return np.zeros(shape)
    if len(lead) == 0:
        return grad.reshape(shape)
    xlead = (1,) * (len(lead) - (len(shape) - 2)) + tuple(shape[:-2])
    nheads, xheads = lead[-1], xlead[-1]
    # GQA / head broadcast: output heads h = g * group + r all came from input head g.
    grad = grad.reshape(lead[:-1] + (xheads, nheads // xheads) + grad.shape[-2:]).sum(axis=-3)
    for axis, (size, xsize) in enumerate(zip(lead[:-1], xlead[:-1])):
        if xsize == 1 and size != 1:
            grad = grad.sum(axis=axis, keepdims=True)
    return grad.reshape(shape)


def _unbroadcast(grad, shape):
    """Adjoint of ``np.broadcast_to(x, grad.shape)`` for an ``x`` of ``shape`` (plain NumPy
    broadcasting): grad summed over the axes x was repeated along."""
    extra = grad.ndim - len(shape)
    grad = grad.sum(axis=tuple(range(extra)))
    for axis, size in enumerate(shape):
        if size == 1:
            grad = grad.sum(axis=axis, keepdims=True)
    return grad


def _positions(lead, nq, nk, align, kv_lens, positions=None):
    """(p, j, length): query i's aligned position p (lead + (Nq, 1)), the keys j (1, Nk) and the
    valid lengths (lead + (1, 1)), straight from the definition."""
    i = np.arange(nq).reshape(nq, 1)
    j = np.arange(nk).reshape(1, nk)
    if kv_lens is None:
        length = np.full(lead, nk, dtype=np.int64)
    else:
        length = np.broadcast_to(np.asarray(kv_lens).astype(np.int64), lead)
    length = length[..., None, None]
    # The query's aligned position: bottom-right aligns the last query with the last existing key.
    p = i + (length - nq) if align == "bottom-right" else i + 0 * length
    if positions is not None:  # row i is at q_start + i, key j at k_start + j
        p = p + (positions[0] - positions[1])
    return p, j, length


def _visible(lead, nq, nk, causal, align, window, mask, bias, kv_lens, positions=None):
    """Dense bool array lead + (Nq, Nk): may query i attend to key j, straight from the definition."""
    p, j, length = _positions(lead, nq, nk, align, kv_lens, positions)
    visible = j < length
    if causal:
        visible = visible & (j <= p)
    if window is not None:
        left, right = window
        if left is not None:
            visible = visible & (p - left <= j)
        if right is not None:
            visible = visible & (j <= p + right)
    if mask is not None:
        visible = visible & mask
    if bias is not None:
        visible = visible & (bias != -np.inf)  # a -inf bias hides the key; a NaN one does not
    return np.broadcast_to(visible, lead + (nq, nk))


class _Dense:
    """The dense computation, shared by the float64 spec and the same-dtype naive baselines.

    ``work`` is the dtype arithmetic happens in; ``rnd`` rounds each intermediate result to the
    storage dtype (identity for the spec). The public functions use float64 and no rounding.

    With sinks, every row gets one more column, materialized: the logit of its head's sink, a
    key that is visible unless the sink is -inf, with value 0 (the last column of ``logits()``,
    ``visible`` and ``values``).
    """

    def __init__(self, q, k, v, scale, causal, align, window, mask, bias, kv_lens,
                 positions=None, work=np.float64, storage=None, softcap=None, sinks=None,
                 alibi_slopes=None, dropout_p=0.0, dropout_seed=None):
        self.work = work
        self.softcap = None if not softcap else float(softcap)  # None or 0: none
        self.storage = storage
        q, k, v = (_host(x) for x in (q, k, v))
        self.shapes = q.shape, k.shape, v.shape
        self.lead = _lead_shape(q, k, v)
        nq, nk = q.shape[-2], k.shape[-2]
        self.out_shape = self.lead + (nq, v.shape[-1])
        self.scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
        self.q, self.k, self.v = (self.rnd(_expand(x.astype(work), self.lead)) for x in (q, k, v))
        mask = _host(mask)
        bias = _host(bias)
        self.bias_shape = None if bias is None else bias.shape  # the shape of its gradient
        if bias is not None:
            bias = np.broadcast_to(bias.astype(np.float64), self.lead + (nq, nk))
        self.bias = bias
        self.lost_limit = _config.lost_lse_limit(_config.accumulator_dtype(q.dtype))
        self.visible = _visible(self.lead, nq, nk, causal, align, window,
                                None if mask is None else mask.astype(bool), bias, _host(kv_lens),
                                positions)
        # ALiBi: -slope * |p - j| (lead + (Nq, Nk)), slope the (batch, head)'s, p the query's
        # aligned position as the mask has it
        self.alibi = None
        if alibi_slopes is not None:
            p, j, _ = _positions(self.lead, nq, nk, align, _host(kv_lens), positions)
            slope = np.broadcast_to(_host(alibi_slopes).astype(np.float64), self.lead)
            self.alibi = -slope[..., None, None] * np.abs(p - j)
        self.values = self.v
        # dropout: the kept weights' factor Z r, r = 1 / (1 - p) at p's granularity 1/256
        # (cuflash/_dropout.py rscale), lead + (Nq, Nk) (1 without dropout)
        self.drop = None
        if dropout_p:  # (a seed alone is (seed, 0), as the public functions read it)
            if not isinstance(dropout_seed, (tuple, list)):
                dropout_seed = (dropout_seed, 0)
            z = _dropout.dense_keep(self.lead, nq, nk, dropout_p, dropout_seed)
            self.drop = z * _dropout.rscale(dropout_p)
        self.sinks = None
        if sinks is not None:
            self.sinks_shape = np.shape(_host(sinks))
            t = np.broadcast_to(_host(sinks).astype(np.float64), self.lead)[..., None, None]
            self.sinks = np.broadcast_to(self.rnd(t.astype(work)), self.lead + (nq, 1))
            self.visible = np.concatenate([self.visible, self.sinks != -np.inf], axis=-1)
            self.values = np.concatenate([self.v, np.zeros(self.lead + (1, self.v.shape[-1]))],
                                         axis=-2)
            if self.drop is not None:  # the sink column (value 0) is kept
                self.drop = np.concatenate([self.drop, np.ones(self.lead + (nq, 1))], axis=-1)

    def _dropped(self, x):
        """x (lead + (Nq, Nk [+ 1])) times Z / (1 - p): a dropped entry is exactly 0, also where x
        is NaN or inf (README "Dropout"), a kept one scaled."""
        return np.where(self.drop != 0, self.rnd(x * self.drop), 0)

    def rnd(self, x):
        if self.storage is None:
            return x
        return np.asarray(x).astype(self.storage).astype(self.work)

    def logits(self, with_grad=False):
        """The logits, -inf where invisible (which also hides inf / NaN there); with_grad: and
        d logit / d(scaled score), the softcap's 1 - tanh^2 (1 without a softcap)."""
        s = self.rnd(self.scale * self.rnd(self.q @ np.swapaxes(self.k, -1, -2)))
        grad = 1.0
        if self.softcap is not None:  # softcap * tanh(s / softcap), before the bias
            t = self.rnd(np.tanh(self.rnd(s / self.softcap)))
            grad = self.rnd(1 - t * t)
            s = self.rnd(self.softcap * t)
        if self.alibi is not None:  # after the softcap, before the bias; d/ds = 1
            s = self.rnd(s + self.rnd(self.alibi.astype(self.work)))
        if self.bias is not None:
            s = self.rnd(s + self.bias.astype(self.work))
        if self.sinks is not None:  # the sink column (its logit does not depend on q or k)
            s = np.concatenate([s, self.sinks], axis=-1)
            grad = np.concatenate([np.broadcast_to(grad, s.shape[:-1] + (s.shape[-1] - 1,)),
                                   np.ones(s.shape[:-1] + (1,))], axis=-1)
        s = np.where(self.visible, s, -np.inf)
        return (s, grad) if with_grad else s

    def forward(self):
        # Masked-out entries never reach exp or log as -inf - (-inf); this only silences
        # overflow of extreme (or deliberately low-precision) logits.
        with np.errstate(all="ignore"):
            return self._forward()

    def backward(self, dout, out, lse, dbias=False):
        with np.errstate(all="ignore"):
            return self._backward(dout, out, lse, dbias)

    def _stats(self, s):
        """Per row: whether it sees a key, its max m (NaN if a visible logit is NaN) and sum l."""
        seen = self.visible.any(axis=-1, keepdims=True)
        m = s.max(axis=-1, keepdims=True, initial=-np.inf)
        m0 = np.where(m == -np.inf, 0, m)  # no finite logit: shift by 0, never -inf - (-inf)
        e = self.rnd(np.exp(s - m0))  # exp(-inf) = 0 on invisible keys
        l = self.rnd(e.sum(axis=-1, keepdims=True))
        return seen, m0, e, l

    def _forward(self):
        # Only a row with no visible key is empty (out 0, lse -inf). A row that sees keys follows
        # IEEE arithmetic: a NaN or +inf logit gives NaN, and so does a row whose every visible
        # logit is -inf (l = 0: 0 / 0). With a sink, such a row stays NaN (README "Attention
        # sinks": an overflow, not an empty row), though the sink alone would make l > 0.
        s = self.logits()
        seen, m0, e, l = self._stats(s)
        num = self.rnd((e if self.drop is None else self._dropped(e)) @ self.values)
        out = np.where(seen, self.rnd(num / np.where(seen, l, 1)), 0)
        lse = np.where(l == 0, np.nan, m0 + np.log(np.where(l == 0, 1, l)))
        lse = np.where(seen, lse, -np.inf)
        if self.sinks is not None:
            keys = self.visible[..., :-1]
            dead = keys.any(axis=-1, keepdims=True) & ~(keys & (s[..., :-1] > -np.inf)).any(
                axis=-1, keepdims=True)
            out, lse = np.where(dead, np.nan, out), np.where(dead, np.nan, lse)
        return out, lse[..., 0]

    def _backward(self, dout, out, lse, dbias=False):
        s, grad = self.logits(with_grad=True)
        lse = np.broadcast_to(self.rnd(_host(lse).astype(self.work)), s.shape[:-1])[..., None]
        dout = np.broadcast_to(self.rnd(_host(dout).astype(self.work)), self.out_shape)
        out = np.broadcast_to(self.rnd(_host(out).astype(self.work)), self.out_shape)
        # P = exp(s - lse) on visible keys of rows with lse > -inf (a NaN lse gives NaN). A
        # "lost" row (finite |lse| >= the limit) cannot carry log(l) in its lse: its P is
        # recomputed from its own max and sum instead.
        empty = lse == -np.inf
        z = np.where(self.visible & ~empty, s - np.where(empty, 0, lse), -np.inf)
        p = np.exp(z)
        lost = np.isfinite(lse) & (np.abs(lse) >= self.lost_limit)
        if lost.any():
            _, m0, e, l = self._stats(s)
            p = np.where(lost, e / np.where(l == 0, 1, l), p)
        p = self.rnd(p)
        delta = self.rnd((dout * out).sum(axis=-1, keepdims=True))
        pz = p if self.drop is None else self._dropped(p)  # the dropped, scaled weights
        dv = self.rnd(np.swapaxes(pz, -1, -2) @ dout)
        dp = self.rnd(dout @ np.swapaxes(self.values, -1, -2))
        if self.drop is not None:  # d out / d P = Z / (1 - p) * (dout . v)
            dp = self._dropped(dp)
        dlogit = self.rnd(p * self.rnd(dp - delta))  # d(loss) / d(logit): the bias's gradient
        ds = self.rnd(dlogit * grad)
        nk = self.k.shape[-2]  # the columns past nk: the sink's
        dq = self.rnd(self.scale * self.rnd(ds[..., :nk] @ self.k))
        dk = self.rnd(self.scale * self.rnd(np.swapaxes(ds[..., :nk], -1, -2) @ self.q))
        qs, ks, vs = self.shapes
        grads = (self.rnd(_sum_to(dq, qs)), self.rnd(_sum_to(dk, ks)),
                 self.rnd(_sum_to(dv[..., :nk, :], vs)))
        if self.sinks is not None:
            dsinks = ds[..., nk].sum(axis=-1)  # lead: d(loss) / d(sink logit), over the rows
            grads += (self.rnd(_sum_to(dsinks[..., None, None], self.sinks_shape + (1, 1))
                               .reshape(self.sinks_shape)),)
        if dbias:  # exactly 0 where P is 0 (hidden pairs, empty rows), summed where bias broadcasts
            grads += (self.rnd(_unbroadcast(np.where(p == 0, 0, dlogit)[..., :nk],
                                            self.bias_shape)),)
        return grads


def attention(q, k, v, *, scale=None, causal=False, align="bottom-right", window=None, mask=None,
              bias=None, kv_lens=None, positions=None, softcap=None, sinks=None,
              alibi_slopes=None, dropout_p=0.0, dropout_seed=None, cu_seqlens_q=None,
              cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, return_lse=False):
    """Dense float64 attention with exactly the semantics of ``cuflash.attention``.

    Returns ``out`` (``lead + (Nq, Dv)``), or ``(out, lse)`` (``lse``: ``lead + (Nq,)``), as NumPy
    float64 arrays whatever the input dtype or array module. Empty rows give out = 0, lse = -inf.
    The logits are ``softcap * tanh(scale q k^T / softcap) + bias`` with a softcap, and with
    ALiBi ``... - slope * |p_i - j| + bias`` (p_i the query's aligned position). With sinks
    every row's softmax has one more column, of its head's sink logit and value 0 (visible unless
    the sink is -inf): an empty row then gives out = 0, lse = the sink. With dropout,
    ``out = (Z * P / (1 - p')) @ v`` (p' = round(256 dropout_p) / 256) with P the undropped
    softmax (lse is its) and Z ``dropout_mask(q, k, v, dropout_p, dropout_seed)``.

    With ``cu_seqlens_q`` / ``cu_seqlens_k`` (packed sequences: q (total_q, H, Dk), ...) it is
    this function on each sequence alone, its (H, Lq, D) slices of q, k, v and the (H,) rows of
    sinks and alibi_slopes broadcast to (B, H): out (total_q, H, Dv), lse (total_q, H).
    """
    packed = _packed("attention", q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                     max_seqlen_k, align, mask, bias, kv_lens, positions, dropout_p)
    if packed is not None:
        options = dict(scale=scale, causal=causal, align=align, window=window, softcap=softcap)
        out = np.zeros(packed.out_shape)
        lse = np.full(packed.lse_shape, -np.inf)
        for b, rows, keys in _sequences(packed):
            ob, lb = attention(*_slices(packed, rows, keys), return_lse=True, **options,
                               sinks=_row(sinks, b, packed), alibi_slopes=_row(alibi_slopes, b,
                                                                               packed))
            out[rows], lse[rows] = ob.swapaxes(0, 1), lb.T
        return (out, lse) if return_lse else out
    dropout_p, seed = _check(q, k, v, scale, causal, align, window, mask, bias, kv_lens,
                             positions, softcap, sinks, alibi_slopes, dropout_p, dropout_seed)
    out, lse = _Dense(q, k, v, scale, causal, align, window, mask, bias, kv_lens,
                      positions, softcap=softcap, sinks=sinks, alibi_slopes=alibi_slopes,
                      dropout_p=dropout_p, dropout_seed=seed).forward()
    return (out, lse) if return_lse else out


def attention_backward(dout, q, k, v, out, lse, *, scale=None, causal=False, align="bottom-right",
                       window=None, mask=None, bias=None, kv_lens=None, positions=None,
                       softcap=None, sinks=None, alibi_slopes=None, dropout_p=0.0,
                       dropout_seed=None, cu_seqlens_q=None, cu_seqlens_k=None,
                       max_seqlen_q=None, max_seqlen_k=None, return_dbias=False):
    """Dense float64 gradients ``(dq, dk, dv)`` of ``attention``, shaped like ``q``, ``k``, ``v``
    (and ``dsinks``, shaped like ``sinks``, with sinks).

    Uses the same formula as the API, from the *passed* ``out`` and ``lse`` (not recomputed ones):
    ``P = exp(S - lse)`` on visible keys of rows with ``lse > -inf`` (a NaN ``lse`` gives NaN; 0 on
    invisible keys and empty rows), except on "lost" rows, whose finite ``|lse|`` is at least
    ``cuflash._config.LOST_LSE`` (2**12 in float32, 2**24 in float64) and so cannot carry
    ``log(l)``: there ``P = softmax(S)`` from the row's own max and sum;
    ``D = rowsum(dout * out)``, ``dV = P^T dout``, ``dS = P * (dout V^T - D)``,
    ``dQ = scale dS K``, ``dK = scale dS^T Q``; gradients of broadcast or grouped inputs are summed
    into the input's own shape. With a softcap dS carries its derivative too,
    ``dS = P * (dout V^T - D) * (1 - tanh^2(scale q k^T / softcap))``. Empty rows contribute
    nothing. With sinks the sink column joins P and dS (its value 0, so its dP is 0) and
    ``dsinks = sum_i dS[i, sink] = -sum_i P[i, sink] D_i``, summed into sinks' shape; a lost row's
    max and sum include it. ALiBi adds a constant to each logit: dS is unchanged (no gradient
    with respect to the slopes). With ``return_dbias=True`` the last result is ``dbias``, the
    gradient of the logit ``P * (dout V^T - D)`` (the softcap's derivative not applied: the bias
    is added after the cap), 0 where P is 0, summed over the axes on which bias broadcasts into
    bias's shape. With dropout (Z the forward's mask, r = 1 / (1 - p'), p' = dropout_p rounded to
    a multiple of 1/256):
    ``dV = (r Z * P)^T dout`` and ``dS = P * (r Z * (dout V^T) - D)``, D from the passed
    (dropped) out. Results are NumPy float64. Packed sequences (cu_seqlens) as in
    :func:`attention`: each sequence alone, dsinks summed over them into sinks' shape.
    """
    if return_dbias and bias is None:
        raise ValueError("attention_backward: return_dbias=True asks for the gradient of bias, "
                         "but bias is None")
    if return_dbias and dropout_p:
        raise ValueError("attention_backward: return_dbias=True with dropout_p > 0 is not "
                         f"supported yet, got dropout_p={dropout_p!r}")
    packed = _packed("attention_backward", q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                     max_seqlen_k, align, mask, bias, kv_lens, positions, dropout_p)
    if packed is not None:
        options = dict(scale=scale, causal=causal, align=align, window=window, softcap=softcap)
        grads = [np.zeros(x.shape) for x in (packed.q, packed.k, packed.v)]
        dsinks = np.zeros((packed.B, packed.H))
        dout, out, lse = (_host(x).astype(np.float64) for x in (dout, out, lse))
        for b, rows, keys in _sequences(packed):
            g = attention_backward(dout[rows].swapaxes(0, 1), *_slices(packed, rows, keys),
                                   out[rows].swapaxes(0, 1), lse[rows].T, **options,
                                   sinks=_row(sinks, b, packed),
                                   alibi_slopes=_row(alibi_slopes, b, packed))
            for grad, part, span in zip(grads, g, (rows, keys, keys)):
                grad[span] = part.swapaxes(0, 1)
            if sinks is not None:
                dsinks[b] = g[3]
        if sinks is None:
            return tuple(grads)
        shape = np.shape(_host(sinks))
        return tuple(grads) + (_sum_to(dsinks[..., None, None], shape + (1, 1)).reshape(shape),)
    dropout_p, seed = _check(q, k, v, scale, causal, align, window, mask, bias, kv_lens,
                             positions, softcap, sinks, alibi_slopes, dropout_p, dropout_seed)
    dense = _Dense(q, k, v, scale, causal, align, window, mask, bias, kv_lens, positions,
                   softcap=softcap, sinks=sinks, alibi_slopes=alibi_slopes,
                   dropout_p=dropout_p, dropout_seed=seed)
    return dense.backward(dout, out, lse, dbias=bool(return_dbias))


# ---- packed sequences (cu_seqlens): the dense reference on each sequence alone --------------

def _packed(fn, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, align, mask,
            bias, kv_lens, positions, dropout_p):
    """The library's checks of a packed call, on host copies (None: not packed)."""
    return _validate.check_packed(fn, *(_host(x) for x in (q, k, v)), _host(cu_seqlens_q),
                                  _host(cu_seqlens_k), max_seqlen_q, max_seqlen_k, align,
                                  mask=mask, bias=bias, kv_lens=kv_lens, positions=positions,
                                  dropout_p=dropout_p or None)


def _sequences(packed):
    """(b, its query rows, its key rows) of each sequence that has queries."""
    for b in range(packed.B):
        rows = slice(int(packed.cu_q[b]), int(packed.cu_q[b + 1]))
        keys = slice(int(packed.cu_k[b]), int(packed.cu_k[b + 1]))
        if rows.stop > rows.start:
            yield b, rows, keys


def _slices(packed, rows, keys):
    """Sequence b's q (H, Lq, Dk), k (Hkv, Lk, Dk), v (Hkv, Lk, Dv)."""
    return (packed.q[rows].swapaxes(0, 1), packed.k[keys].swapaxes(0, 1),
            packed.v[keys].swapaxes(0, 1))


def _row(x, b, packed):
    """Sequence b's (H,) row of a per-head option broadcast to (B, H) (None stays None)."""
    if x is None:
        return None
    return np.broadcast_to(_host(x).astype(np.float64), (packed.B, packed.H))[b]
