"""The public functions: validate -> normalize -> dispatch (NumPy path or CUDA path)."""

import numpy as np

from . import _broadcast, _modifiers, _paged, _runtime, _sinks, _validate, _varlen
from ._validate import (PACKED_REFUSED, check_append, check_backward_inputs, check_flag,
                        check_merge_inputs, check_packed, check_packed_backward, make_problem)

# Pieces shared by the docstrings of attention, attention_backward and attention_vjp; the loop at
# the bottom of this file puts each in at its {name} line.
_QKV_DOC = """\
    q : numpy.ndarray or cupy.ndarray, shape (..., Nq, Dk)
        The queries.
    k : numpy.ndarray or cupy.ndarray, shape (..., Nk, Dk)
        The keys.
    v : numpy.ndarray or cupy.ndarray, shape (..., Nk, Dv)
        The values, one row per key. For all three: NumPy arrays run on the CPU, CuPy arrays on
        their GPU; every array argument but kv_lens must come from one library (and, for CuPy,
        one device). One dtype for q, k and v: float16, bfloat16 (``ml_dtypes.bfloat16``),
        float32 or float64. Dk and Dv may be any value from 1 to 256, and may differ. The
        leading dims ``...`` broadcast the NumPy way, except on axis -3 (the head axis), where k
        and v may have Hkv heads where q has H, with H % Hkv == 0: query head h reads kv head
        h // (H // Hkv) (grouped-query attention; Hkv == 1 is multi-query attention), and
        neither is copied. k and v hold the same keys: their leading dims broadcast against each
        other the plain way (on axis -3 the same number of heads, or 1). Any strides: a
        (B, N, H, D) array passed as ``x.swapaxes(1, 2)`` is read in place; only an innermost
        axis that is not contiguous is copied."""

_OPTIONS_DOC = """\
    scale : float or None, default None
        Multiplies q·kᵀ before the softmax. None means 1/sqrt(Dk). A real number (not a bool),
        finite, with scale·log2(e) finite in the accumulator dtype: |scale| <= 2.36e38 with
        float32 accumulation. 0 is uniform attention over the visible keys.
    causal : bool, default False
        If True, the query at aligned position p sees only the keys j <= p (see Notes).
    align : {"bottom-right", "top-left"}, default "bottom-right"
        Where query row i sits among the keys when Nq != Nk: at the aligned position
        p = i + L - Nq with "bottom-right" (FlashAttention >= 2.1: the last query lines up with
        the last key; L is the sequence's kv_lens, else Nk), at p = i with "top-left" (torch
        SDPA's ``is_causal``). It only matters with causal, window or alibi_slopes.
    window : (left, right) or None, default None
        A sliding window: key j is visible from aligned position p iff
        p - left <= j <= p + right. A tuple or list of two non-negative ints; None on a side
        means unbounded on that side. None means no window. It combines with causal by AND
        (causal=True caps right at 0).
    mask : bool array or None, default None
        True where a query may attend to a key. Boolean, of q's library, with at least 2 dims,
        broadcastable to (..., Nq, Nk) (it may not enlarge the leading dims); never expanded in
        memory. None means no mask.
    bias : float array or None, default None
        Added to the scaled logits, scale·q·kᵀ + bias (its gradient: return_dbias of
        attention_backward). float16, bfloat16, float32 or float64, of q's library,
        broadcastable to (..., Nq, Nk) like mask. Cast to the accumulator dtype, its values
        unchecked: a finite float64 entry beyond float32's range becomes +-inf. A -inf entry
        hides that key; a NaN entry is visible, and a NaN or +inf entry makes its row NaN. A
        finite padding bias such as finfo(float32).min hides nothing: a row that only has such
        logits is a uniform softmax with a finite lse.
        None means no bias.
    softcap : float or None, default None
        Logit softcapping (Gemma 2, Grok): the scaled logit x = scale·q·kᵀ becomes
        ``softcap·tanh(x / softcap)``, then the bias is added, so every logit lies within
        ±softcap of its bias. Its derivative ``1 - tanh²(x / softcap)`` enters the gradients.
        A finite real number > 0 (a bool is refused); None or 0 means no softcap.
    sinks : float or real array or None, default None
        Attention sinks: a logit per head that joins every row's softmax denominator with no
        value, ``out_i = sum_j exp(s_ij - L_i)·v_j`` with
        ``L_i = log(sum_j exp(s_ij) + exp(t))``, t the sink of row i's head and s_ij the logits
        above (scale, softcap, bias, every mask option). A real number, or a real array (an
        integer or float dtype, of q's library) broadcastable to the output's leading dims
        ``...``: (H,) for (B, H, N, D) inputs, one sink per query head; (B, H) per batch and
        head. Its values are not restricted: -inf is no sink, a NaN sink makes its head's rows
        NaN, +inf (a +inf logit) too. The returned lse is L (the sink included); a row that sees
        no key gives out 0 and lse = t. With sinks, :func:`attention_backward` also returns the
        sink's gradient. None means no sinks.
    alibi_slopes : float or real array or None, default None
        ALiBi (attention with linear biases): after scale and softcap, the logit of query i and
        key j gets ``-slope·|p - j|``, p the query's aligned position as causal aligns it (see
        Notes: bottom-right or top-left, kv_lens, positions' q_start - k_start), slope its
        head's. A real number, or a real array (an integer or float dtype, of q's library)
        broadcastable to the output's leading dims ``...``: (H,) one slope per query head, (B, H)
        per batch and head. Never materialized as an (Nq, Nk) bias. A host slope must be finite
        (NaN or inf: ValueError); a CuPy array's values are not checked (that would synchronize)
        and give what the formula gives (NaN and inf slopes make their rows NaN). No gradient
        with respect to the slopes is computed; dq, dk, dv carry the bias's derivative (1 with
        respect to the score). None means no ALiBi.
    kv_lens : int, sequence of ints, int array or None, default None
        Per sequence, how many keys exist: only keys j < kv_lens are read (the rest may hold
        anything, NaN included). Broadcastable to the leading dims ``...`` of the output (a
        plain int for 2-D inputs), each value in [0, Nk]. Host data (an int, a list, a NumPy
        array) serves NumPy and CuPy inputs alike and is checked on the host. A CuPy array, only
        with CuPy inputs, stays on the device: the kernels read it (no synchronization, nothing
        planned from its values, so a decode loop can update it in place and a CUDA graph replays
        with its new values), and a value outside [0, Nk] is clamped there (below 0: no key;
        above Nk: Nk keys), not refused. Bottom-right alignment aligns to kv_lens, not to Nk.
        None means all Nk keys.
    positions : (q_start, k_start) or None, default None
        Where q's rows and k's keys sit in a longer sequence: query row i at position
        q_start + i, key j at k_start + j (two non-negative ints, a tuple or list). Causal and
        window then compare these positions: the aligned position p moves by
        q_start - k_start. For blocks of one sequence computed apart and combined with
        :func:`merge` (``cuflash.ring`` does this across devices). It only matters with causal
        or window or alibi_slopes. None means (0, 0).
    precision : {None, "highest", "high"}, default None
        How float32 inputs multiply on the GPU's tensor cores. None or "highest": as exact as
        float32 (each product of q·kᵀ and P·v as three TensorFloat-32 products of split
        operands, error no larger than a plain float32 implementation's). "high": one
        TensorFloat-32 product (10-bit mantissas, like ``torch.backends.cuda.matmul.allow_tf32``):
        faster, with a relative error of the logits around 1e-3·|q|·|k|. Other dtypes, and the
        NumPy path, compute as they always do whatever the value.
    dropout_p : float, default 0.0
        Attention dropout, as FlashAttention and torch SDPA apply it: each weight of the softmax
        P (the undropped one: l and lse are unchanged) is kept with probability 1 - p' and then
        scaled by 1 / (1 - p'), ``out = (Z ∘ P / (1 - p'))·v`` with Z the keep mask and
        p' = round(256·dropout_p) / 256 (dropout's granularity is 1/256, as in FlashAttention;
        the scale follows p', so the expected out is the undropped one). A real number in
        [0, 1) below 255.5/256; 0 is no dropout (and then the same kernels, and bitwise the same
        results, as without the option). Z is a pure function of dropout_seed
        and of each element's (batch·head, query, key) index (Philox4x32-7, see Notes), so
        the same seed gives the same mask on every path, tile size and device, on NumPy and CuPy
        alike, and :func:`attention_backward` redraws it from the same seed.
    dropout_seed : int or (int, int) or None, default None
        The dropout mask's key: an int seed in [0, 2**64), or a pair (seed, offset) with offset
        in [0, 2**32) (a plain int is (seed, 0)); a training loop keeps one seed and moves the
        offset per step and layer. Required when dropout_p > 0; checked, then ignored, when
        dropout_p is 0. It is data, not part of what a call plans (a new seed re-plans
        nothing); a CUDA graph captures it by value. The backward must get the forward's seed
        (:func:`attention_vjp` keeps it)."""

_PACKED_DOC = """\
    cu_seqlens_q : int array or sequence of ints, shape (B + 1,), or None, default None
        Packed variable-length batches (FlashAttention's ``flash_attn_varlen_func``): q is then
        (total_q, H, Dk), k (total_k, Hkv, Dk) and v (total_k, Hkv, Dv), B sequences packed
        along axis 0, sequence b's queries q[cu_seqlens_q[b]:cu_seqlens_q[b + 1]] and its keys
        k[cu_seqlens_k[b]:cu_seqlens_k[b + 1]]. The offsets start at 0, never decrease and end
        at total_q (total_k); int32 (FlashAttention's) or int64. out is (total_q, H, Dv) and lse
        (total_q, H) (FlashAttention's (H, total_q) is ``lse.T``); the gradients are packed
        like q, k and v. Every option applies per sequence, with its lengths Lq, Lk in place of
        Nq, Nk: causal bottom-right lets query i see the keys j <= i + Lk - Lq, top-left
        j <= i; window and alibi_slopes align the same way; a sequence with Lk = 0 has empty
        rows. sinks and alibi_slopes broadcast to (B, H). mask, bias, kv_lens, positions and
        block_table are refused (ValueError). Host offsets (a NumPy array or a sequence of
        ints) are checked; a CuPy array (CuPy inputs) stays on the device unchecked (offsets
        that break these rules give unspecified rows, never an access outside the arrays) and
        needs max_seqlen_q. Given together with cu_seqlens_k, or not at all. None: not packed.
    cu_seqlens_k : int array or sequence of ints, shape (B + 1,), or None, default None
        The keys' offsets, like cu_seqlens_q (and max_seqlen_k with a CuPy array).
    max_seqlen_q : int or None, default None
        The longest query sequence: required with a CuPy cu_seqlens_q (the padded length,
        which is not read from the device); optional with host offsets, and then at least their
        longest sequence (the work is padded to the longest sequence whatever the value).
    max_seqlen_k : int or None, default None
        The same for the keys and cu_seqlens_k."""

_DBIAS_DOC = """\
    return_dbias : bool, default False
        If True, also return dbias, the gradient of the loss with respect to bias (a trainable
        additive bias, e.g. a pair bias or a learned relative-position table): with the logit
        ``s_ij = F(scale·q_i·k_j) + bias_ij`` (F: softcap, ALiBi; the identity without them),
        ``dbias_ij = dS_ij = P_ij·(dout_i·v_j - D_i)``, ``D_i = sum(dout_i·out_i)``,
        ``P_ij = exp(s_ij - lse_i)``, per (batch, head, query, key), exactly 0 wherever P is 0
        (every pair the visibility rules hide: causal, window, kv_lens, mask, a -inf bias;
        empty rows), and NaN where P is (a NaN lse). A softcap's
        derivative does not enter it (the bias is added after the cap); sinks enter through lse.
        It is summed over the axes on which bias broadcasts (a (1, H, Nq, Nk) bias over the batch,
        an (Nq, Nk) one over batch and heads, a (B, 1, 1, Nk) one over heads and queries), and
        returned in bias's own shape and dtype, of q's library; it is computed and summed in the
        accumulator dtype (float32, or float64 for float64 inputs), then cast. On the GPU the
        backward writes dS into a (..., Nq, Nk) accumulator-dtype buffer (4 or 8 bytes per
        element, batch and heads included) before that sum, and with softcap or ALiBi runs on
        the generic CUDA kernels (README "Bias gradient"). Needs a bias (ValueError
        otherwise)."""

_TYPE_ERRORS_DOC = """\
        - q, k or v is not a numpy.ndarray or cupy.ndarray (a list is not accepted), or mask
          or bias is given as something else.
        - The array arguments mix NumPy and CuPy.
        - q, k and v do not have one dtype among float16, bfloat16, float32 and float64.
        - scale is neither None nor a real number (a bool is refused).
        - causal is not a bool (1, 0 and None are refused).
        - mask is not boolean, or bias is not float16, bfloat16, float32 or float64.
        - kv_lens does not hold integers (bools are refused), or is a cupy.ndarray with NumPy
          inputs.
        - precision is neither None nor a string.
        - softcap is neither None nor a real number (a bool is refused).
        - sinks is neither None, a real number nor an array of q's library (a bool is refused),
          or its dtype is bool or complex.
        - alibi_slopes likewise.
        - cu_seqlens_q or cu_seqlens_k is not int32 / int64, or is a cupy.ndarray with NumPy
          inputs; max_seqlen_q / max_seqlen_k is not an int, or is None with CuPy offsets.
        - dropout_p is not a real number (a bool is refused); dropout_p > 0 without
          dropout_seed; dropout_seed, its seed or its offset is not an int (a bool is refused).
        - A keyword the function does not take (Python's own TypeError)."""

_VALUE_ERRORS_DOC = """\
        - CuPy arrays are on different devices.
        - q, k or v has fewer than 2 dims; q and k differ in Dk (axis -1); k and v differ in Nk
          (axis -2); Dk or Dv is outside [1, 256].
        - The leading dims do not combine: k's and v's do not broadcast against each other, or
          q's do not broadcast against theirs (with the grouped-query rule on axis -3).
        - scale is not finite, or |scale| > finfo(accumulator dtype).max / log2(e).
        - align is neither "bottom-right" nor "top-left".
        - window is neither None nor a pair (a tuple or list of two), or a side is neither None
          nor a non-negative int (a float or a bool side included).
        - mask or bias has fewer than 2 dims or does not broadcast to (..., Nq, Nk).
        - kv_lens does not broadcast to the leading dims, or (host data) holds a value outside
          [0, Nk]; a CuPy kv_lens is on another device than q.
        - positions is neither None nor a pair, or a start is not a non-negative int.
        - precision is a string other than "highest" and "high".
        - softcap is negative, NaN or infinite.
        - sinks does not broadcast to the leading dims ``...``, or is on another device than q.
        - alibi_slopes likewise, or a host slope (a number or a NumPy array) is NaN or
          infinite.
        - With cu_seqlens: only one of the two is given (or max_seqlen without them); they are
          not (B + 1,) of one length; q, k, v are not (total, heads, D) with k's and v's
          (total_k, Hkv) equal; host offsets do not start at 0, decrease or do not end at the
          token count; max_seqlen is below the longest host sequence; mask, bias, kv_lens,
          positions or block_table is given.
        - dropout_p is outside [0, 1) (NaN included); dropout_seed is a sequence of other than
          two items, its seed is outside [0, 2**64) or its offset outside [0, 2**32);
          dropout_p > 0 with return_dbias or with cu_seqlens."""

_NOTES_DOC = """\
    **Which keys a query sees.** Query row i sits at the aligned position p = i + L - Nq
    (``align="bottom-right"``) or p = i (``align="top-left"``), where L is the sequence's kv_lens,
    else Nk, plus q_start - k_start with ``positions=(q_start, k_start)``. Key j is visible iff j < L, and j <= p when causal, and p - left <= j <= p + right
    with ``window=(left, right)``, and ``mask[..., i, j]`` is True, and ``bias[..., i, j]`` is not
    -inf: all of these combine by AND. The Examples of :func:`attention` print these masks.

    **Empty rows.** A row with no visible key (everything hidden, Nk = 0 or kv_lens = 0, or one
    of the first Nq - Nk queries of a causal bottom-right call with Nq > Nk) has an output row of
    exactly 0 and lse = -inf, and gets zero gradients. It is the only case that gives 0 / -inf.
    FlashAttention-2 returns lse = +inf there; -inf is the log of an empty sum, and it is what
    makes an empty part the identity of :func:`merge`. Zero-sized batches or Nq = 0 give empty
    results.

    **Non-finite values.** Every other row is the dense formula in IEEE arithmetic, in the
    accumulator dtype (float32, or float64 for float64 inputs): with x the logits of the visible
    keys and m = max x, out = sum(exp(x - m)·v) / sum(exp(x - m)) and
    lse = m + log(sum(exp(x - m))). So a NaN that a row sees (in q, in the k of a visible key, a
    NaN bias entry) makes that row's out and lse NaN; NaN or inf in the v of a visible key
    reaches out as arithmetic says, and so may the v of a key hidden by mask or bias (as 0·NaN,
    like a dense product); a +inf logit, or logits that are all -inf (float32 overflow, e.g.
    q ~ 1e20 against k ~ -1e20), give NaN out and lse, not an empty row. Keys past kv_lens are
    never read. Array values (q, k, v, mask, bias, and out, lse and dout in the backward) are
    never checked, because on the GPU that would need a synchronization; only a host kv_lens is
    (a CuPy one is clamped on the device).

    **Dropout.** With ``dropout_seed = (seed, offset)``, key j of query row i of the output's
    flat (batch, head) index bh is kept iff byte ``j % 4`` (low first) of ``r[(j // 4) % 4]`` is
    at least ``round(256·dropout_p)``, where ``r = Philox4x32-7(counter=(j // 16, i, bh, offset),
    key=(seed % 2**32, seed // 2**32))`` (one Philox call per 16 consecutive keys; i and j are
    the indices in q's rows and k's keys, bh counts the output's leading dims in C order).
    ``cuflash.reference.dropout_mask`` materializes it."""


# The options each public function hands to make_problem, named as in its signature (one list,
# so that a new option is added to the signatures and here, not to every call).
OPTIONS = ("scale", "causal", "align", "window", "mask", "bias", "kv_lens", "positions",
           "precision", "softcap", "sinks", "alibi_slopes", "dropout_p", "dropout_seed")
# the OPTIONS that are score transforms' keywords (make_problem's **modifiers)
MODIFIERS = tuple(name for name in OPTIONS if name in _modifiers.NAMES)
# packed variable-length batches' keywords (cuflash/_varlen.py), not make_problem's
PACKED = ("cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k")


def _options(names):
    """The OPTIONS' values among a public function's locals()."""
    return {name: names[name] for name in OPTIONS}


def _problem(fn, q, k, v, names):
    """make_problem of a public function's arguments (its locals(): the OPTIONS, and block_table
    and return_dbias where it takes them), passed in order."""
    get = names.get
    return _validate.problem(fn, q, k, v, names["scale"], names["causal"], names["align"],
                             names["window"], names["mask"], names["bias"], names["kv_lens"],
                             names["positions"], names["precision"],
                             {name: names[name] for name in MODIFIERS}, names["sinks"],
                             names["alibi_slopes"], get("block_table"),
                             get("return_dbias", False), names["dropout_p"],
                             names["dropout_seed"])


_backends = {}  # problem.xp -> its module (cuflash._numpy, cuflash._gpu), imported once


def _dispatch(problem):
    backend = _backends.get(problem.xp)
    if backend is None:
        if problem.xp is np:
            from . import _numpy as backend
        else:
            from . import _gpu as backend
        _backends[problem.xp] = backend
    return backend


def _forward(problem):
    xp = problem.xp
    if problem.BH == 0 or problem.Nq == 0 or problem.Nk == 0:
        # nothing to compute: every row is empty (or there are no rows)
        out = xp.zeros(problem.out_shape, dtype=problem.dtype)
        lse = xp.full(problem.lse_shape, -np.inf, dtype=problem.acc_dtype)
        joined = False
    else:
        if problem.pages is not None:  # the decode kernels read the pages; elsewhere gathered
            problem = _paged.resolve(problem)
        out, lse = _dispatch(problem).forward(problem)
        if out.shape != problem.out_shape:  # (the CUDA paths give the caller's shapes)
            out, lse = out.reshape(problem.out_shape), lse.reshape(problem.lse_shape)
        joined = xp is not np  # cuflash._gpu.forward gives the softmax with the sinks
    if problem.sinks is not None and not joined:  # the sink-free softmax joined with the sinks
        out, lse = _sinks.join(problem, out, lse)
    return out, lse


def _backward(problem, dout, out, lse, deterministic=False):
    """(dq, dk, dv), then dsinks with sinks, then dbias with return_dbias."""
    xp = problem.xp
    # with sinks: each row's sink probability, exact on lost rows after the backward's fix
    prob = None if problem.sinks is None else _sinks.probabilities(problem, lse)
    dbias = None
    if problem.BH == 0 or problem.Nq == 0 or problem.Nk == 0:
        grads = [xp.zeros(x.shape, dtype=problem.dtype) for x in (problem.q, problem.k, problem.v)]
        if problem.dbias:
            dbias = xp.zeros(problem.bias_shape, dtype=problem.bias_dtype)
    else:
        dq, dk, dv, *rest = _dispatch(problem).backward(problem, dout, out, lse,
                                                        deterministic=deterministic,
                                                        sink_probs=prob)
        # gradients were computed per output (batch, head): sum them back over broadcast/GQA axes
        grads = []
        # (beyond the dtype's range: inf, as a cast gives; NumPy would warn)
        with np.errstate(over="ignore") if xp is np else _runtime.NULL_CONTEXT:
            for g, x in ((dq, problem.q), (dk, problem.k), (dv, problem.v)):
                if g.size == x.size:  # x not broadcast, or summed over GQA's groups already
                    g = g if g.shape == x.shape else g.reshape(x.shape)  # (_mma_bwd OPT_GROUP)
                else:
                    g = _broadcast.reduce_to_lead(xp, g.reshape(problem.lead + g.shape[-2:]),
                                                  x.shape)
                grads.append(g if g.dtype == problem.dtype else g.astype(problem.dtype))
            if problem.dbias:  # dS per (batch, head, query, key), summed where bias broadcasts
                g = rest[0].reshape(problem.lead + (problem.Nq, problem.Nk))
                dbias = _broadcast.sum_to_shape(xp, g, problem.bias_shape).astype(
                    problem.bias_dtype, copy=False)
    if prob is not None:
        grads.append(_sinks.gradient(problem, dout, out, prob))
    if dbias is not None:
        grads.append(dbias)
    return tuple(grads)


def _packed(fn, q, k, v, names, block_table=None, **backward_inputs):
    """A packed call (cu_seqlens; cuflash/_varlen.py) as (Packed, its query and key Rows, the
    padded Problem), or None when the call is not packed. Every check (the backward's
    dout / out / lse too) runs before the padded q, k and v are filled."""
    if (names["cu_seqlens_q"] is None and names["cu_seqlens_k"] is None
            and names["max_seqlen_q"] is None and names["max_seqlen_k"] is None):
        return None  # (the common call, which builds nothing here)
    options = _options(names)
    packed = check_packed(fn, q, k, v, *(names[name] for name in PACKED), options["align"],
                          block_table=block_table,
                          **{name: options[name] for name in PACKED_REFUSED if name in options},
                          dropout_p=options["dropout_p"] or None)  # (0: none)
    if packed is None:
        return None
    xp, B = packed.xp, packed.B
    with _runtime.device_of(q):
        bufs = [_varlen.empty(xp, x.shape, n, B, x.dtype)
                for x, n in ((q, packed.max_q), (k, packed.max_k), (v, packed.max_k))]
        options["kv_lens"] = packed.kv_lens
        problem = make_problem(*(view for _, view in bufs), fn=fn,
                               return_dbias=names.get("return_dbias", False), **options)
        if backward_inputs:
            check_packed_backward(packed, problem, fn=fn, **backward_inputs)
        rows = _varlen.rows(packed)
        for (buf, _), x, r in zip(bufs, (q, k, v), (rows[0], rows[1], rows[1])):
            _varlen.fill(xp, buf, x, r)
    return packed, rows, problem


def _packed_forward(packed, rows, problem):
    """out (total_q, H, Dv) and lse (total_q, H) of a packed call."""
    with _runtime.device_of(packed.q):
        out, lse = _forward(problem)  # (B, H, max_q, Dv), (B, H, max_q)
        return _varlen.unpad(packed.xp, out, rows[0]), _varlen.unpad(packed.xp, lse, rows[0])


def _packed_backward(packed, rows, problem, dout, out, lse, deterministic):
    """The packed gradients: dout, out and lse padded as q is (padding rows: 0, 0 and -inf,
    i.e. empty rows that add nothing), the padded gradients gathered back."""
    xp = packed.xp
    with _runtime.device_of(packed.q):
        padded = []
        for x, value in ((dout, 0), (out, 0), (lse, -np.inf)):
            buf, view = _varlen.empty(xp, x.shape, packed.max_q, packed.B, x.dtype)
            _varlen.fill(xp, buf, x, rows[0], value)
            padded.append(_varlen.contiguous(xp, view))  # the paths' and the sinks' layout
        grads = _backward(problem, *padded, deterministic)
        return tuple(_varlen.unpad(xp, g, r) for g, r in zip(grads, rows[:1] + rows[1:] * 2)) \
            + grads[3:]


def attention(q, k, v, *, scale=None, causal=False, align="bottom-right", window=None, mask=None,
              bias=None, kv_lens=None, positions=None, precision=None, softcap=None, sinks=None,
              alibi_slopes=None, dropout_p=0.0, dropout_seed=None, block_table=None,
              cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
              return_lse=False):
    """Exact softmax attention, computed tile by tile in O(N) extra memory.

    ``softmax(scale·q·kᵀ + bias)·v`` over the keys each query sees, without ever holding the
    Nq×Nk score matrix: keys are streamed in tiles with an online softmax. Nothing is
    approximated; the result is exact up to floating-point rounding.

    Parameters
    ----------
{qkv}
{options}
{packed}
    block_table : int32 or int64 array of shape (B, max_pages), or None, default None
        A paged KV cache: k and v are then page pools of shape (num_pages, Hkv, page_size, Dk)
        and (num_pages, Hkv, page_size, Dv), q is (B, H, Nq, Dk), and key j of sequence b is
        row j % page_size of page ``block_table[b, j // page_size]``, so the cache holds
        Nk = max_pages * page_size keys per sequence (pages in any order, shared or not).
        The pools are in cuflash's axis order, like k: a FlashAttention / vLLM cache of shape
        (num_pages, page_size, Hkv, D) is passed as ``k_cache.swapaxes(1, 2)`` (and q as
        ``q.swapaxes(1, 2)``), read in place; their last axis must be contiguous. page_size
        >= 16, any value. kv_lens is then per sequence, like the table's rows: an int or
        (B,) (FlashAttention's cache_seqlens; (B, 1) and (B, H) work too), None meaning every
        page full. A NumPy table serves NumPy and CuPy inputs, and its entries that the lengths
        reach (columns below ceil(kv_lens / page_size); every column with a CuPy kv_lens) must
        lie in [0, num_pages); the others are never read. A CuPy table (with CuPy inputs) is
        read on the device without a check, every entry clamped to [0, num_pages - 1] where it
        is read, so no page outside the pools is ever read. The split-KV decode kernels
        (Nq <= 16) read the pages in place; every other case (a longer prefill against the
        cache, the NumPy path) first gathers the pages into contiguous keys, one copy per
        call. Forward only: :func:`attention_backward` and :func:`attention_vjp` take no
        block_table. None means k and v hold the keys themselves.
    return_lse : bool, default False
        Also return the log-sum-exp of each row's visible scaled (biased) logits, which
        :func:`attention_backward` and :func:`merge` take.

    Returns
    -------
    out : array, shape (..., Nq, Dv)
        Of the input dtype and library; ``...`` is the broadcast leading shape of q, k and v.
        Returned alone unless return_lse is True.
    lse : array, shape (..., Nq)
        Only with ``return_lse=True``, as ``(out, lse)``: the natural-log log-sum-exp of the
        row's visible scaled (biased) logits, in the accumulator dtype (float32, or float64 for
        float64 inputs); -inf for an empty row. With sinks, the sink's exp(t) is in the sum (an
        empty row gives t).

    Raises
    ------
    TypeError
        For a type or dtype it does not accept, before any work is launched:

{type_errors}
        - return_lse is not a bool.
        - block_table is not an int32 or int64 array, or is a cupy.ndarray with NumPy inputs.
    ValueError
        For a shape or value it does not accept, before any work is launched:

{value_errors}
        - With block_table: q is not 4-D; k or v is not (num_pages, Hkv, page_size, D) with
          one (num_pages, Hkv, page_size) for both; page_size < 16; block_table is not
          (B, max_pages) with q's B; max_pages * page_size >= 2**31; k or v has a last axis
          that is not contiguous; a NumPy block_table holds an entry outside [0, num_pages)
          where a sequence reads it.

    See Also
    --------
    paged_append : Write new keys and values into a paged cache.
    attention_backward : The gradients, from out and lse.
    attention_vjp : Out and a function that gives the gradients.
    merge : Combine the results of two disjoint sets of keys.
    cuflash.reference.attention : The same in dense float64 NumPy, the executable spec.

    Notes
    -----
{notes}

    On CuPy inputs each call picks the fastest kernel that takes the problem; every kernel meets
    the same contract. The forward is bitwise reproducible run to run on every path.

    Examples
    --------
    >>> import numpy as np
    >>> import cuflash
    >>> rng = np.random.default_rng(0)
    >>> q = rng.standard_normal((2, 4, 16, 8), dtype=np.float32)  # (batch, heads, Nq, Dk)
    >>> k = rng.standard_normal((2, 2, 16, 8), dtype=np.float32)  # 2 kv heads: grouped-query
    >>> v = rng.standard_normal((2, 2, 16, 4), dtype=np.float32)  # (batch, kv heads, Nk, Dv)
    >>> out, lse = cuflash.attention(q, k, v, causal=True, return_lse=True)
    >>> out.shape, out.dtype, lse.shape, lse.dtype
    ((2, 4, 16, 4), dtype('float32'), (2, 4, 16), dtype('float32'))
    >>> ref = cuflash.reference.attention(q, k, v, causal=True)  # dense, float64
    >>> bool(np.abs(out - ref).max() < 1e-5)
    True

    Which keys each query sees: with q = k = 0 every visible key gets the same weight, so with
    v = the identity, ``out[i, j] > 0`` exactly when query i sees key j (``x``; rows are
    queries, columns keys):

    >>> def picture(nq, nk, **options):
    ...     q, k, v = np.zeros((nq, 1)), np.zeros((nk, 1)), np.eye(nk)
    ...     for row in cuflash.attention(q, k, v, **options):
    ...         print(" ".join("x" if w > 0 else "." for w in row))
    >>> picture(3, 5, causal=True)  # align="bottom-right": the last query sees the last key
    x x x . .
    x x x x .
    x x x x x
    >>> picture(3, 5, causal=True, align="top-left")  # the first query sees the first key
    x . . . .
    x x . . .
    x x x . .
    >>> picture(5, 3, causal=True)  # Nq > Nk, bottom-right: the first 2 rows are empty
    . . .
    . . .
    x . .
    x x .
    x x x
    >>> picture(5, 3, causal=True, align="top-left")
    x . .
    x x .
    x x x
    x x x
    x x x
    >>> picture(3, 5, window=(1, 0))  # a sliding window: the aligned key and 1 behind it
    . x x . .
    . . x x .
    . . . x x
    >>> picture(5, 5, window=(1, 1))
    x x . . .
    x x x . .
    . x x x .
    . . x x x
    . . . x x
    >>> picture(3, 5, causal=True, kv_lens=4)  # 4 keys exist: the last query sees key 3
    x x . . .
    x x x . .
    x x x x .
    >>> picture(3, 5, causal=True, mask=np.array([[True, False, True, False, True]]))
    x . x . .
    x . x . .
    x . x . x

    An empty row is exactly 0, with lse = -inf:

    >>> out, lse = cuflash.attention(np.ones((5, 2)), np.ones((3, 2)), np.ones((3, 2)),
    ...                              causal=True, return_lse=True)
    >>> print(out[0], lse[0])
    [0. 0.] -inf

    Misuse raises before any work, naming the function and the argument:

    >>> cuflash.attention(q, k, v, align="top-right")
    Traceback (most recent call last):
        ...
    ValueError: attention: align must be 'bottom-right' or 'top-left', got 'top-right'
    """
    return_lse = check_flag("return_lse", return_lse, "attention")
    with _runtime.graph_safe(q):
        # a call of a known repeatable signature (every option but the keyed ones off; kv_lens
        # and block_table on the device or none, or a NumPy kv_lens whose values are checked):
        # the signature's Problem with the call's arrays
        if (window is None and mask is None and bias is None
                and positions is None and sinks is None
                and alibi_slopes is None and dropout_seed is None
                and cu_seqlens_q is None and cu_seqlens_k is None and max_seqlen_q is None
                and max_seqlen_k is None):
            problem = _validate.repeated_problem("attention", q, k, v, scale, causal, align,
                                                 precision, dropout_p, kv_lens, block_table,
                                                 softcap)
            if problem is not None:
                problem.lse_unused = not return_lse  # (its own Problem: with_arrays' copy)
                out, lse = _forward(problem)
                return (out, lse) if return_lse else out
        names = locals()  # (one snapshot of the arguments: each costs a small call's time)
        packed = _packed("attention", q, k, v, names, block_table)
        if packed is not None:
            out, lse = _packed_forward(*packed)
        else:
            problem = _problem("attention", q, k, v, names)
            out, lse = _forward(problem)
    return (out, lse) if return_lse else out


def attention_backward(dout, q, k, v, out, lse, *, scale=None, causal=False, align="bottom-right",
                       window=None, mask=None, bias=None, kv_lens=None, positions=None,
                       precision=None, softcap=None, sinks=None, alibi_slopes=None,
                       cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
                       max_seqlen_k=None, dropout_p=0.0, dropout_seed=None, deterministic=False,
                       return_dbias=False):
    """Compute the gradients of :func:`attention` with respect to q, k and v (and the bias).


    The score tiles are recomputed from q, k and lse; no probability matrix is stored.

    Parameters
    ----------
    dout : numpy.ndarray or cupy.ndarray, shape (..., Nq, Dv)
        The gradient of the loss with respect to out: out's shape, q's dtype and library.
{qkv}
    out : numpy.ndarray or cupy.ndarray, shape (..., Nq, Dv)
        The forward's output, ``attention(q, k, v, ...)`` with the same inputs and options:
        out's shape, q's dtype and library.
    lse : numpy.ndarray or cupy.ndarray, shape (..., Nq)
        The forward's lse (``return_lse=True``), float32 or float64, of q's library. out and
        lse are not checked against q, k and v: from other inputs or options (sinks included)
        they give wrong gradients.
{options}
{packed}
    deterministic : bool, default False
        If True, the gradients are bitwise identical run to run on every path. Only the
        tensor-core backward needs it (it otherwise adds dq with atomics, in no fixed order);
        the NumPy and generic CUDA paths are deterministic either way.
{dbias_option}

    Returns
    -------
    dq : array, shape and dtype of q
        The gradient with respect to q, of q's library.
    dk : array, shape and dtype of k
        The gradient with respect to k: summed back into k's own shape where k is broadcast
        or grouped (every query head that reads a kv head adds to it).
    dv : array, shape and dtype of v
        The gradient with respect to v, summed back like dk. In each, a value beyond the
        dtype's range becomes +-inf, as a cast gives.
    dsinks : array, shape of sinks
        Only with sinks, as ``(dq, dk, dv, dsinks)``: the gradient with respect to the sinks,
        ``-sum_i exp(t - lse_i)·D_i`` over the rows of each head, summed over the axes on which
        sinks broadcasts; of sinks' dtype if it is a float array, else of the accumulator dtype
        (a 0-d array for a number), of q's library.
    dbias : array, shape and dtype of bias
        Only with ``return_dbias=True``, last: ``(dq, dk, dv, dbias)``, or
        ``(dq, dk, dv, dsinks, dbias)`` with sinks. See return_dbias.

    Raises
    ------
    TypeError
        For a type or dtype it does not accept, before any work is launched:

{type_errors}
        - deterministic or return_dbias is not a bool.
        - dout, out or lse is None or not an array of q's library; dout or out does not have
          q's dtype; lse is not float32 or float64.
    ValueError
        For a shape or value it does not accept, before any work is launched:

{value_errors}
        - dout or out does not have the output's shape (..., Nq, Dv), or lse not (..., Nq).
        - return_dbias is True but bias is None.

    See Also
    --------
    attention : The forward, which gives out and lse.
    attention_vjp : The forward and this backward in one; it keeps out and lse.
    cuflash.reference.attention_backward : The same in dense float64 NumPy.

    Notes
    -----
    With D = rowsum(dout ∘ out) and P = exp(scale·q·kᵀ + bias - lse) on the visible pairs
    (0 elsewhere): dv = Pᵀ·dout, dS = P ∘ (dout·vᵀ - D), dq = scale·dS·k, dk = scale·dSᵀ·q.
    mask gets no gradient; bias gets one with ``return_dbias=True``: dbias = P ∘ (dout·vᵀ - D),
    the gradient of the logit (see return_dbias). With sinks these formulas stand as they are
    (lse includes the sink, and its value 0 adds nothing to D), and
    dsinks = -sum_i exp(t - lse_i)·D_i. With dropout (the forward's dropout_p and dropout_seed:
    the same mask Z is redrawn, r = 1 / (1 - p'), p' = round(256·dropout_p) / 256),
    dv = (r·Z ∘ P)ᵀ·dout and dS = P ∘ (r·Z ∘ (dout·vᵀ) - D), D from the dropped out.

    A row with lse = -inf is empty and contributes nothing; a NaN lse gives NaN gradients (dq of
    that row, dk and dv of the keys it sees), never silent zeros. A row whose |lse| is at least
    2**12 (2**24 for float64 inputs), e.g. one padded with an additive finfo(float32).min bias,
    cannot carry log(l) in its lse: its max and sum (the sink included) are recomputed exactly
    (in float64) in the backward, at extra cost for those rows only.

    The forward's rules, as for :func:`attention`:

{notes}

    Examples
    --------
    >>> import numpy as np
    >>> import cuflash
    >>> rng = np.random.default_rng(0)
    >>> q = rng.standard_normal((2, 4, 6, 8))   # 4 query heads
    >>> k = rng.standard_normal((2, 1, 10, 8))  # 1 kv head: multi-query attention
    >>> v = rng.standard_normal((2, 1, 10, 3))
    >>> out, lse = cuflash.attention(q, k, v, causal=True, return_lse=True)
    >>> dout = rng.standard_normal(out.shape)  # d(loss)/d(out)
    >>> dq, dk, dv = cuflash.attention_backward(dout, q, k, v, out, lse, causal=True)
    >>> dq.shape, dk.shape, dv.shape  # dk, dv: summed over the 4 query heads that share k, v
    ((2, 4, 6, 8), (2, 1, 10, 8), (2, 1, 10, 3))
    >>> ref = cuflash.reference.attention_backward(dout, q, k, v, out, lse, causal=True)
    >>> all(np.allclose(g, r) for g, r in zip((dq, dk, dv), ref))
    True

    A trainable bias's gradient, here of an (H, Nq, Nk) bias that every batch shares (summed
    over the batch):

    >>> bias = rng.standard_normal((4, 6, 10))
    >>> out, lse = cuflash.attention(q, k, v, bias=bias, return_lse=True)
    >>> dq, dk, dv, dbias = cuflash.attention_backward(dout, q, k, v, out, lse, bias=bias,
    ...                                                return_dbias=True)
    >>> dbias.shape
    (4, 6, 10)
    >>> out, lse = cuflash.attention(q, k, v, causal=True, return_lse=True)

    A NaN lse (a row whose forward saw a NaN) gives NaN gradients, not zeros:

    >>> lse[0, 0, 5] = np.nan
    >>> dq, dk, dv = cuflash.attention_backward(dout, q, k, v, out, lse, causal=True)
    >>> bool(np.isnan(dq[0, 0, 5]).all()), bool(np.isnan(dq[0, 0, :5]).any())
    (True, False)
    """
    deterministic = check_flag("deterministic", deterministic, "attention_backward")
    with _runtime.graph_safe(q):
        # a call of a known repeatable signature (as attention's)
        if (window is None and mask is None and bias is None
                and positions is None and sinks is None
                and alibi_slopes is None and dropout_seed is None and return_dbias is False
                and cu_seqlens_q is None and cu_seqlens_k is None and max_seqlen_q is None
                and max_seqlen_k is None):
            problem = _validate.repeated_problem("attention_backward", q, k, v, scale, causal,
                                                 align, precision, dropout_p, kv_lens,
                                                 softcap=softcap)
            if problem is not None:
                check_backward_inputs(problem, dout, out, lse, fn="attention_backward")
                return _backward(problem, dout, out, lse, deterministic)
        names = locals()  # (one snapshot of the arguments)
        packed = _packed("attention_backward", q, k, v, names, dout=dout, out=out, lse=lse)
        if packed is not None:
            return _packed_backward(*packed, dout, out, lse, deterministic)
        problem = _problem("attention_backward", q, k, v, names)
        check_backward_inputs(problem, dout, out, lse, fn="attention_backward")
        return _backward(problem, dout, out, lse, deterministic)


def attention_vjp(q, k, v, *, scale=None, causal=False, align="bottom-right", window=None,
                  mask=None, bias=None, kv_lens=None, positions=None, precision=None,
                  softcap=None, sinks=None, alibi_slopes=None, cu_seqlens_q=None,
                  cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, dropout_p=0.0,
                  dropout_seed=None, deterministic=False, return_dbias=False, return_lse=None):
    """Forward pass plus a function for its vector-Jacobian product.

    For training without a framework: ``out, vjp = attention_vjp(q, k, v, ...)``, then
    ``dq, dk, dv = vjp(dout)``. vjp keeps the forward's lse itself (and holds on to q, k, v, out
    and lse, and the sinks, until it is dropped); it may be called any number of times.

    Parameters
    ----------
{qkv}
{options}
{packed}
    deterministic : bool, default False
        As for :func:`attention_backward`: bitwise identical gradients run to run.
    return_dbias : bool, default False
        If True, ``vjp(dout)`` also returns the gradient with respect to bias, last, as
        :func:`attention_backward` with ``return_dbias=True`` does (needs a bias).
    return_lse : None
        Refused: any other value is a TypeError (vjp keeps lse itself; call :func:`attention`
        with ``return_lse=True`` for it).

    Returns
    -------
    out : array, shape (..., Nq, Dv)
        As :func:`attention` returns it.
    vjp : callable
        ``vjp(dout)``, with dout of out's shape, dtype and library, returns ``(dq, dk, dv)``
        (``(dq, dk, dv, dsinks)`` with sinks; dbias last with ``return_dbias=True``):
        ``attention_backward(dout, q, k, v, out, lse, ...)`` with this call's inputs, options
        (the dropout seed included: the same mask),
        out and lse.

    Raises
    ------
    TypeError
        For a type or dtype it does not accept, before any work is launched:

{type_errors}
        - deterministic or return_dbias is not a bool, or return_lse is given.
        - vjp(dout) raises it when dout is None, not an array of q's library, or not of q's
          dtype.
    ValueError
        For a shape or value it does not accept, before any work is launched:

{value_errors}
        - vjp(dout) raises it when dout does not have out's shape.
        - return_dbias is True but bias is None.

    See Also
    --------
    attention : The forward alone, which can also return lse.
    attention_backward : The gradients from an out and lse kept by the caller.

    Notes
    -----
    The gradients follow the Notes of :func:`attention_backward`; the forward's rules:

{notes}

    Examples
    --------
    >>> import numpy as np
    >>> import cuflash
    >>> q, k, v = np.random.default_rng(0).standard_normal((3, 5, 4))  # three (5, 4) arrays
    >>> out, vjp = cuflash.attention_vjp(q, k, v, causal=True)
    >>> dq, dk, dv = vjp(np.ones_like(out))  # the gradients of out.sum()
    >>> dq.shape, dk.shape, dv.shape
    ((5, 4), (5, 4), (5, 4))

    dq against a finite difference of out.sum():

    >>> q2 = q.copy()
    >>> q2[2, 1] += 1e-6
    >>> step = (cuflash.attention(q2, k, v, causal=True).sum() - out.sum()) / 1e-6
    >>> bool(abs(step - dq[2, 1]) < 1e-4)
    True
    """
    if return_lse is not None:
        raise TypeError("attention_vjp: takes no return_lse option (it keeps lse itself)")
    names = locals()  # (one snapshot of the arguments)
    deterministic = check_flag("deterministic", deterministic, "attention_vjp")
    with _runtime.graph_safe(q):
        packed = _packed("attention_vjp", q, k, v, names)
        if packed is not None:
            out, lse = _packed_forward(*packed)
        else:
            problem = _problem("attention_vjp", q, k, v, names)
            out, lse = _forward(problem)

    def vjp(dout):
        if packed is not None:
            check_packed_backward(packed[0], packed[2], dout, out, lse, fn="attention_vjp")
            with _runtime.graph_safe(q):
                return _packed_backward(*packed, dout, out, lse, deterministic)
        check_backward_inputs(problem, dout, out, lse, fn="attention_vjp")
        with _runtime.graph_safe(q):
            return _backward(problem, dout, out, lse, deterministic)

    return out, vjp


def merge(out_a, lse_a, out_b, lse_b):
    """Attention over the union of two disjoint key sets, from the two partial results.

    Each part is ``(out, lse)`` as ``attention(q, k_part, v_part, ..., return_lse=True)``
    returns it, for the same queries over two disjoint sets of keys (keys split across calls or
    devices). The result is attention over the union of the keys each part saw, up to rounding.
    The options apply within each part's own call: bottom-right alignment, for one, aligns to
    that part's keys.

    Parameters
    ----------
    out_a : numpy.ndarray or cupy.ndarray, shape (..., Nq, Dv)
        The first part's output: float16, bfloat16, float32 or float64, any leading dims (at
        least 1 dim in all).
    lse_a : numpy.ndarray or cupy.ndarray, shape out_a.shape[:-1]
        The first part's lse: float16, bfloat16, float32 or float64.
    out_b : numpy.ndarray or cupy.ndarray, shape (..., Nq, Dv)
        The second part's output: out_a's shape and dtype.
    lse_b : numpy.ndarray or cupy.ndarray, shape out_a.shape[:-1]
        The second part's lse. All four arrays come from one library (and, for CuPy, one
        device).

    Returns
    -------
    out : array, shape (..., Nq, Dv)
        Of out_a's dtype.
    lse : array, shape (..., Nq)
        Of dtype float32, or float64 if lse_a or lse_b is float64.

    Raises
    ------
    TypeError
        - An argument is None or not a numpy.ndarray or cupy.ndarray, or they mix NumPy and
          CuPy.
        - An argument's dtype is not float16, bfloat16, float32 or float64, or out_a and out_b
          differ in dtype.
    ValueError
        - CuPy arrays are on different devices.
        - out_a has no dims, or out_a and out_b differ in shape.
        - lse_a or lse_b does not have the shape out_a.shape[:-1].

    See Also
    --------
    attention : Gives each part with ``return_lse=True``.

    Notes
    -----
    Both parts are put on a common maximum m = max(lse_a, lse_b): the weights w = exp(lse - m)
    rescale numerator and denominator alike, out = (w_a·out_a + w_b·out_b) / (w_a + w_b) and
    lse = m + log(w_a + w_b), computed in float32 (float64 if an lse or the outs are float64).

    An empty part (lse = -inf) is the identity, whatever its out holds; two empty parts give
    out 0 and lse -inf. A NaN or +inf lse on either side gives NaN out and lse for that row: the
    other side is never dropped silently. Values are never checked.

    Examples
    --------
    >>> import numpy as np
    >>> import cuflash
    >>> rng = np.random.default_rng(0)
    >>> q = rng.standard_normal((4, 8))
    >>> k, v = rng.standard_normal((10, 8)), rng.standard_normal((10, 3))
    >>> out_a, lse_a = cuflash.attention(q, k[:6], v[:6], return_lse=True)  # keys 0-5
    >>> out_b, lse_b = cuflash.attention(q, k[6:], v[6:], return_lse=True)  # keys 6-9
    >>> out, lse = cuflash.merge(out_a, lse_a, out_b, lse_b)
    >>> full_out, full_lse = cuflash.attention(q, k, v, return_lse=True)  # all 10 keys
    >>> bool(np.allclose(out, full_out) and np.allclose(lse, full_lse))
    True

    An empty part, here one with no keys at all, changes nothing:

    >>> out_0, lse_0 = cuflash.attention(q, k[:0], v[:0], return_lse=True)
    >>> print(out_0[0], lse_0[0])
    [0. 0. 0.] -inf
    >>> out, lse = cuflash.merge(out_a, lse_a, out_0, lse_0)
    >>> bool(np.array_equal(out, out_a) and np.array_equal(lse, lse_a))
    True
    """
    xp = check_merge_inputs(out_a, lse_a, out_b, lse_b, fn="merge")
    with _runtime.graph_safe(out_a):
        return _merge(xp, out_a, lse_a, out_b, lse_b)


def _merge(xp, out_a, lse_a, out_b, lse_b):
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


# The {name} lines of these docstrings start at column 0, so that no Python version dedents the
# docstring (3.13 does unless a line starts at column 0) and the pieces, indented as written, fit.
for _f in (attention, attention_backward, attention_vjp):
    if _f.__doc__:  # None under python -OO
        _f.__doc__ = _f.__doc__.format(qkv=_QKV_DOC, options=_OPTIONS_DOC, packed=_PACKED_DOC,
                                       notes=_NOTES_DOC,
                                       type_errors=_TYPE_ERRORS_DOC,
                                       value_errors=_VALUE_ERRORS_DOC,
                                       dbias_option=_DBIAS_DOC)


def paged_append(k_pages, v_pages, block_table, kv_lens, k_new, v_new):
    """Write new keys and values into a paged KV cache, in place.

    Row t of sequence b goes to the sequence's position p = kv_lens[b] + t: row p % page_size
    of page ``block_table[b, p // page_size]``, in both pools (the layout of
    ``attention(..., block_table=...)``). kv_lens is not advanced: add n to it afterwards
    (``lens += n``) before the next attention call. FlashAttention's
    ``flash_attn_with_kvcache(k=..., v=...)`` does the same append and leaves cache_seqlens too.

    Parameters
    ----------
    k_pages : numpy.ndarray or cupy.ndarray, shape (num_pages, Hkv, page_size, Dk)
        The key pages, written in place (any strides; page_size >= 16).
    v_pages : numpy.ndarray or cupy.ndarray, shape (num_pages, Hkv, page_size, Dv)
        The value pages, the same pages as k_pages.
    block_table : int32 or int64 array, shape (B, max_pages)
        Each sequence's pages, as for :func:`attention`. A NumPy table serves CuPy pools too; a
        CuPy one only CuPy pools.
    kv_lens : int, sequence of ints, int array, shape (B,) or (B, 1)
        Where each sequence's new rows start (its current length). Host data is checked:
        kv_lens >= 0 and kv_lens + n <= max_pages * page_size. A CuPy array (CuPy pools) is
        read on the device (no synchronization); rows that would land outside
        [0, max_pages * page_size) are then not written.
    k_new : array, shape (B, Hkv, n, Dk)
        The new keys, of k_pages' dtype and library (a (B, n, Hkv, D) array as
        ``x.swapaxes(1, 2)``).
    v_new : array, shape (B, Hkv, n, Dv)
        The new values.

    Returns
    -------
    None

    Raises
    ------
    TypeError
        An argument is not an array of the pools' library (kv_lens: host data or a CuPy array
        with CuPy pools), the dtypes differ or are not float16, bfloat16, float32, float64,
        block_table is not int32 / int64, kv_lens does not hold integers.
    ValueError
        The shapes do not fit each other (pools (num_pages, Hkv, page_size, D) with
        page_size >= 16, new rows (B, Hkv, n, D), block_table (B, max_pages), kv_lens B
        values), arrays on different devices, host kv_lens outside [0, capacity - n], or a
        NumPy block_table entry outside [0, num_pages) where rows are written.

    Notes
    -----
    On CuPy pools it is one elementwise kernel per pool on the current stream, capturable in a
    CUDA graph with a CuPy block_table and kv_lens. A CuPy table's entries are clamped to
    [0, num_pages - 1], as attention reads them. Sequences that share a page must not append
    into it in one call (their writes would race).

    Examples
    --------
    >>> import numpy as np
    >>> import cuflash
    >>> k_pages = np.zeros((4, 1, 16, 2), np.float32)   # 4 pages of 16 rows, 1 kv head, D = 2
    >>> v_pages = np.zeros((4, 1, 16, 2), np.float32)
    >>> table = np.array([[2, 0], [3, 1]], np.int32)   # sequence 0: pages 2, 0; 1: pages 3, 1
    >>> new = np.ones((2, 1, 3, 2), np.float32)        # 3 new rows per sequence
    >>> cuflash.paged_append(k_pages, v_pages, table, [15, 0], new, new)
    >>> k_pages[2, 0, 15, 0], k_pages[0, 0, :2, 0], k_pages[3, 0, :3, 0]
    (np.float32(1.0), array([1., 1.], dtype=float32), array([1., 1., 1.], dtype=float32))
    """
    a = check_append(k_pages, v_pages, block_table, kv_lens, k_new, v_new, fn="paged_append")
    with _runtime.graph_safe(k_pages):
        _paged.append(a)


def release_graph_memory():
    """Give back the device memory cuflash keeps for captured CUDA graphs.

    A call made while its stream captures a graph (``stream.begin_capture()``, then
    ``cupy.cuda.Graph.launch`` to replay) writes its outputs and temporaries at every replay,
    so cuflash keeps every buffer such a call allocates. Call this once those graphs are
    destroyed (or never: it holds only what those calls allocated).

    Parameters
    ----------
    None

    Returns
    -------
    int
        The bytes given back to CuPy's allocator.

    Raises
    ------
    Nothing: with nothing kept it returns 0, also without CuPy.

    Notes
    -----
    To capture, call once with the same layout first (that call builds the device tables a
    capture cannot copy), then capture: the replays read the current values of q, k, v, mask,
    bias, dout and a CuPy kv_lens, and write the out, lse and gradients the captured calls
    returned. A host kv_lens (int, list, NumPy array) is captured by value.

    Examples
    --------
    >>> import cuflash
    >>> cuflash.release_graph_memory()  # nothing was captured
    0
    """
    return _runtime.release_graph_memory()
