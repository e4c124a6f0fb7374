"""Leading-dimension bookkeeping shared by every path.

The output's leading shape S comes from broadcasting the leading shapes of q, k and v, with one
exception on the head axis (the last leading axis, axis -3 of the arrays): k and v may carry fewer
heads, Hx with H % Hx == 0, and query head h then reads head h // (H // Hx) (grouped-query
attention; Hx == 1 is ordinary broadcasting). Two helpers follow from that rule (and
``sum_to_shape``, the plain rule's adjoint, sums the bias's gradient):

* ``lead_offsets`` gives, for every (batch, head) matrix of the output, the element offset of the
  matrix it reads from an input (the kernels' offset tables), without copying anything;
* ``reduce_to_lead`` sums a gradient computed per output matrix back to an input's own leading
  shape (broadcast axes and GQA groups), which is what the chain rule asks for.
"""
import functools

import numpy as np


def _padded(shape, ndim):
    return (1,) * (ndim - len(shape)) + tuple(shape)


def broadcast_lead(shapes, head_axis_gqa=True):
    """Output leading shape for the given leading shapes, or None if they do not combine.

    The first shape is the query's; on the head axis the others may divide it (GQA).
    """
    ndim = max((len(s) for s in shapes), default=0)
    padded = [_padded(s, ndim) for s in shapes]
    out = []
    for axis in range(ndim):
        sizes = [s[axis] for s in padded]
        if head_axis_gqa and axis == ndim - 1 and 0 not in sizes:
            h = max(sizes)
            if padded[0][axis] not in (1, h):
                return None
            if any(h % x for x in sizes):
                return None
            out.append(h)
        else:
            big = {x for x in sizes if x != 1}
            if len(big) > 1:
                return None
            out.append(big.pop() if big else 1)
    return tuple(out)


@functools.lru_cache(maxsize=256)
def lead_offsets(lead, x_lead_shape, x_lead_strides):
    """Element offset, for each output (batch, head), of the matrix an input reads: int64, shape lead.

    ``x_lead_strides`` are in elements. Axes of size 1 are read with stride 0; on the head axis an
    input with fewer heads is read through h -> h // (H // Hx). Arguments are tuples; the result is
    memoized and read-only (the host work of a call repeats with its layout, not its data).
    """
    ndim = len(lead)
    shape = _padded(x_lead_shape, ndim)
    strides = (0,) * (ndim - len(x_lead_strides)) + tuple(x_lead_strides)
    offsets = np.zeros(lead, dtype=np.int64)
    for axis in range(ndim):
        size, xsize = lead[axis], shape[axis]
        if xsize == 1 or size == 0:
            continue
        index = np.arange(size, dtype=np.int64)
        if xsize != size:  # only the head axis can get here: grouped-query mapping
            index //= size // xsize
        view = [1] * ndim
        view[axis] = size
        offsets = offsets + (index * strides[axis]).reshape(view)
    offsets.flags.writeable = False  # memoized: shared by every call with this layout
    return offsets


def reduce_to_lead(xp, grad, x_shape):
    """Sum ``grad`` of shape lead + (N, D) to ``x_shape`` (an input's own shape)."""
    if grad.shape == x_shape:  # (the common case: nothing broadcast)
        return grad
    lead = grad.shape[:-2]
    ndim = len(lead)
    x_lead = _padded(x_shape[:-2], ndim)
    for axis in range(ndim):
        size, xsize = lead[axis], x_lead[axis]
        if xsize == size:
            continue
        if xsize == 1:
            grad = grad.sum(axis=axis, keepdims=True)
        else:  # GQA: the query heads of one group sum into their kv head
            shape = grad.shape[:axis] + (xsize, size // xsize) + grad.shape[axis + 1:]
            grad = grad.reshape(shape).sum(axis=axis + 1)
    return grad if grad.shape == x_shape else grad.reshape(x_shape)


def sum_to_shape(xp, grad, shape):
    """Sum ``grad`` over the axes on which an array of ``shape`` broadcasts to grad.shape (the
    plain NumPy rule, no grouped heads): the adjoint of ``xp.broadcast_to(x, grad.shape)``.
    ``grad`` itself when nothing broadcasts."""
    shape = tuple(shape)
    extra = grad.ndim - len(shape)
    axes = tuple(range(extra)) + tuple(
        extra + a for a, n in enumerate(shape) if n == 1 and grad.shape[extra + a] != 1)
    if axes:
        grad = grad.sum(axis=axes, keepdims=True)
    return grad.reshape(shape)
