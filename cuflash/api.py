"""The public functions: validate -> normalize -> dispatch (NumPy path or CUDA path)."""
import numpy as np

from . import _broadcast
from ._validate import check_backward_inputs, check_flag, check_merge_inputs, make_problem

_VISIBILITY_DOC = """
    Visibility. Query row ``i`` sits at the aligned position ``p``: ``p = i + L - Nq`` with
    ``align="bottom-right"`` (the FlashAttention >= 2.1 convention; ``L`` is ``kv_lens`` for that
    sequence, else ``Nk``) and ``p = i`` with ``align="top-left"`` (torch SDPA's ``is_causal``).
    Key ``j`` is visible iff ``j < L``, ``j <= p`` when ``causal``, ``p - left <= j <= p + right``
    for ``window=(left, right)`` (None = unbounded on that side), ``mask[..., i, j]`` is True, and
    ``bias[..., i, j] != -inf`` (a NaN bias entry is visible).
    Causal pictures (``x`` = visible), Nq = 2, Nk = 5 and Nq = 5, Nk = 2::

        bottom-right     top-left         bottom-right    top-left
        x x x x .        x . . . .        . .             x .
        x x x x x        x x . . .        . .             x x
                                          . .             x x
                                          x .             x x
                                          x x             x x

    Empty rows and non-finite values. Only a row with no visible key (Nk = 0 included) gives an
    output row of exactly 0 and lse = -inf (FlashAttention-2 returns +inf there; -inf is the log
    of an empty sum). Every other row follows the dense formula in IEEE arithmetic: a NaN logit
    (NaN in q, in a visible key, or a NaN bias entry), a +inf logit, or logits that are all -inf
    (e.g. overflow in float32) make the row's output and lse NaN. Keys past kv_lens are never
    read; NaN or inf in v reaches out as arithmetic says.
"""

_OPTIONS_DOC = """
    scale : float, optional
        Multiplies q·kᵀ; defaults to 1/sqrt(Dk). Must be finite, with scale·log2(e) finite in
        the accumulator dtype (|scale| <= 2.36e38 with float32 accumulation). 0 is uniform
        attention over the visible keys.
    causal : bool
        Query at aligned position p sees keys j <= p.
    align : {"bottom-right", "top-left"}
        Where the queries sit when Nq != Nk (see Visibility).
    window : (left, right), optional
        Key j is visible from aligned position p iff p - left <= j <= p + right; None on a side
        means unbounded. Combined with causal and mask by AND.
    mask : bool array, optional
        Broadcastable to (..., Nq, Nk); True = may attend. Never expanded in memory.
    bias : float array, optional
        Broadcastable to (..., Nq, Nk); added to the scaled logits (no gradient). Cast to the
        accumulator dtype (float32 unless the inputs are float64), values unchecked: a finite
        float64 entry beyond float32's range becomes +-inf. A -inf entry hides that key; a +inf
        or NaN entry makes its row NaN. A finite padding bias such as finfo(float32).min does
        not hide keys: a row that only has such logits is a uniform softmax with a finite lse.
    kv_lens : int or int array, optional
        Broadcastable to the leading dims: only the first kv_lens keys of that sequence exist.
        Bottom-right alignment then aligns to kv_lens, not to Nk.
"""


def _dispatch(problem):
    if problem.xp is np:
        from . import _numpy
        return _numpy
    from . import _gpu
    return _gpu


def _forward(problem):
    xp = problem.xp
    if problem.BH == 0 or problem.Nq == 0 or problem.Nk == 0:
        # nothing to compute: every row is empty (or there are no rows)
        out = xp.zeros(problem.out_shape, dtype=problem.dtype)
        lse = xp.full(problem.lse_shape, -np.inf, dtype=problem.acc_dtype)
        return out, lse
    out, lse = _dispatch(problem).forward(problem)
    return out.reshape(problem.out_shape), lse.reshape(problem.lse_shape)


def _backward(problem, dout, out, lse, deterministic=False):
    xp = problem.xp
    if problem.BH == 0 or problem.Nq == 0 or problem.Nk == 0:
        return tuple(xp.zeros(x.shape, dtype=problem.dtype) for x in (problem.q, problem.k, problem.v))
    dq, dk, dv = _dispatch(problem).backward(problem, dout, out, lse, deterministic=deterministic)
    # gradients were computed per output (batch, head): sum them back over broadcast/GQA axes
    grads = []
    for g, x in ((dq, problem.q), (dk, problem.k), (dv, problem.v)):
        g = g.reshape(problem.lead + g.shape[-2:])
        with np.errstate(over="ignore"):  # beyond the dtype's range: inf, as a cast gives
            grads.append(_broadcast.reduce_to_lead(xp, g, x.shape).astype(problem.dtype,
                                                                         copy=False))
    return tuple(grads)


def attention(q, k, v, *, scale=None, causal=False, align="bottom-right", window=None, mask=None,
              bias=None, kv_lens=None, return_lse=False):
    """Exact softmax attention, computed tile by tile in O(N) extra memory.

    Parameters
    ----------
    q : array (..., Nq, Dk)
    k : array (..., Nk, Dk)
    v : array (..., Nk, Dv)
        NumPy arrays run on the CPU, CuPy arrays on their GPU; mixing them is a TypeError. One
        dtype for all three: float16, bfloat16 (ml_dtypes), float32 or float64. Leading dims
        broadcast the NumPy way; on axis -3 k and v may have Hkv heads with H % Hkv == 0
        (grouped-query attention: query head h reads kv head h // (H // Hkv)). k and v hold the
        same keys: their leading dims must broadcast against each other without grouping (on
        axis -3 the same head count, or 1). Any strides; only an innermost axis that is not
        contiguous is copied. Dk, Dv <= 256.
    {options}    return_lse : bool
        Also return the log-sum-exp of the visible scaled (biased) logits per row.

    Returns
    -------
    out : array (..., Nq, Dv) of the input dtype
    lse : array (..., Nq), float32 (float64 for float64 inputs); only with return_lse.
    {visibility}
    Accumulation is in float32 (float64 for float64 inputs).
    """
    return_lse = check_flag("return_lse", return_lse, "attention")
    problem = make_problem(q, k, v, scale=scale, causal=causal, align=align, window=window,
                           mask=mask, bias=bias, kv_lens=kv_lens, fn="attention")
    out, lse = _forward(problem)
    return (out, lse) if return_lse else out


def attention_backward(dout, q, k, v, out, lse, *, scale=None, causal=False, align="bottom-right",
                       window=None, mask=None, bias=None, kv_lens=None, deterministic=False):
    """Gradients of :func:`attention` with respect to q, k and v.

    ``out`` and ``lse`` are the forward's results for the same inputs and options. Score tiles are
    recomputed from q, k and lse; no probability matrix is stored. With D = rowsum(dout ∘ out) and
    P = exp(scale·q·kᵀ + bias - lse) on visible pairs: dv = Pᵀ·dout, dS = P ∘ (dout·vᵀ - D),
    dq = scale·dS·k, dk = scale·dSᵀ·q. Gradients of broadcast or grouped k/v are summed into
    their own shapes.

    A row with lse = -inf is empty and contributes nothing; a NaN lse gives NaN gradients (dq of
    that row, dk and dv of the keys it sees), never silent zeros. A row whose |lse| is at least
    2**12 (2**24 for float64 inputs), e.g. one padded with an additive finfo(float32).min bias,
    cannot carry log(l) in its lse: its max and sum are recomputed exactly (in float64) in the
    backward, at extra cost for those rows only.

    ``deterministic=True`` makes the gradients bitwise identical run to run on every path (the
    tensor-core path otherwise adds dq with atomics, in no fixed order; the NumPy and generic CUDA
    paths are deterministic either way).

    Returns
    -------
    dq, dk, dv : arrays shaped and typed like q, k, v.
    """
    deterministic = check_flag("deterministic", deterministic, "attention_backward")
    problem = make_problem(q, k, v, scale=scale, causal=causal, align=align, window=window,
                           mask=mask, bias=bias, kv_lens=kv_lens, fn="attention_backward")
    check_backward_inputs(problem, dout, out, lse, fn="attention_backward")
    return _backward(problem, dout, out, lse, deterministic)


def attention_vjp(q, k, v, *, scale=None, causal=False, align="bottom-right", window=None,
                  mask=None, bias=None, kv_lens=None, deterministic=False, return_lse=None):
    """Forward pass plus a function for its vector-Jacobian product.

    Returns ``(out, vjp)`` where ``vjp(dout)`` returns ``(dq, dk, dv)``; for training without a
    framework. Takes the options of :func:`attention` and ``deterministic`` of
    :func:`attention_backward`; ``return_lse`` is refused (a TypeError): vjp keeps lse itself.
    """
    if return_lse is not None:
        raise TypeError("attention_vjp: takes no return_lse option (it keeps lse itself)")
    deterministic = check_flag("deterministic", deterministic, "attention_vjp")
    problem = make_problem(q, k, v, scale=scale, causal=causal, align=align, window=window,
                           mask=mask, bias=bias, kv_lens=kv_lens, fn="attention_vjp")
    out, lse = _forward(problem)

    def vjp(dout):
        check_backward_inputs(problem, dout, out, lse, fn="attention_vjp")
        return _backward(problem, dout, out, lse, deterministic)

    return out, vjp


def merge(out_a, lse_a, out_b, lse_b):
    """Attention over the union of two disjoint key sets, from the two partial results.

    Each part is (out, lse) as returned by ``attention(..., return_lse=True)``. Both parts are
    put on a common maximum m = max(lse_a, lse_b): weights w = exp(lse - m) rescale numerator
    and denominator alike, out = (w_a·out_a + w_b·out_b) / (w_a + w_b), lse = m + log(w_a + w_b).
    An empty part (lse = -inf) is the identity, whatever its out holds; two empty parts give out
    0 and lse -inf. A NaN or +inf lse on either side gives NaN out and lse for that row: the
    other side is never dropped silently. Works on any leading dims; out keeps its dtype, lse is
    float32 or wider.
    """
    xp = check_merge_inputs(out_a, lse_a, out_b, lse_b, fn="merge")
    lse_dtype = np.result_type(lse_a.dtype, lse_b.dtype, np.float32)
    acc = np.dtype(np.float64) if lse_dtype == np.float64 or out_a.dtype == np.float64 \
        else np.dtype(np.float32)
    la = lse_a.astype(acc, copy=False)
    lb = lse_b.astype(acc, copy=False)
    with np.errstate(invalid="ignore"):       # inf - inf is the documented NaN, not a warning
        m = xp.maximum(la, lb)                # NaN propagates
        both_empty = m == -np.inf
        m = xp.where(both_empty, 0, m)        # never exp(-inf - (-inf))
        wa = xp.exp(la - m)                   # 0 for an empty side, NaN for NaN or +inf
        wb = xp.exp(lb - m)
        total = wa + wb
        denom = xp.where(both_empty, 1, total)
        # an empty side contributes exactly 0, whatever its out holds; any other side is
        # weighted as the dense formula weights it (0 · NaN stays NaN)
        oa = xp.where((la == -np.inf)[..., None], 0, out_a.astype(acc, copy=False))
        ob = xp.where((lb == -np.inf)[..., None], 0, out_b.astype(acc, copy=False))
        out = (wa[..., None] * oa + wb[..., None] * ob) / denom[..., None]
        lse = xp.where(both_empty, -np.inf, m + xp.log(denom))
    return out.astype(out_a.dtype, copy=False), lse.astype(lse_dtype, copy=False)


attention.__doc__ = attention.__doc__.format(options=_OPTIONS_DOC.lstrip("\n"),
                                             visibility=_VISIBILITY_DOC)
for _f in (attention_backward,):
    _f.__doc__ += "\n    Options as in :func:`attention`.\n"
