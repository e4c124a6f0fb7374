"""Packed variable-length batches (``cu_seqlens_q`` / ``cu_seqlens_k``; README "Packed sequences").

FlashAttention's varlen layout: B sequences packed along the token axis, q (total_q, H, Dk),
k (total_k, Hkv, Dk), v (total_k, Hkv, Dv), sequence b's queries q[cu_q[b]:cu_q[b + 1]] and keys
k[cu_k[b]:cu_k[b + 1]], every mask option aligned per sequence. No kernel of its own: the
sequences are gathered into a padded (B, H, max_q, D) Problem whose kv_lens are the key counts,
which every path runs, and the results are gathered back into the packed layout.

Alignment is where the padding goes. Sequence b's Lq queries take the LAST Lq of its max_q padded
rows with bottom-right alignment (padded row r = i + max_q - Lq), the first Lq with top-left
(r = i); its Lk keys the first Lk of max_k (kv_lens = Lk hides the rest). The padded Problem's
aligned position of row r is then r + Lk - max_q = i + Lk - Lq (bottom-right) and r = i
(top-left): the per-sequence rule, so causal, windows and ALiBi need nothing else. A sequence
with Lk = 0 has kv_lens 0: its rows are empty (out 0, lse -inf).

Padding rows hold q = 0 and are dropped from the results. In the backward they get dout = 0,
out = 0 and lse = -inf (empty rows: P = 0, D = 0), so they add nothing to dk and dv, and the keys
past a sequence's Lk are never read. The padded rows only see their own sequence's keys, so
nothing crosses from one sequence to another.

`Rows` maps the packed tokens to the padded grid; it is built with array operations of the
inputs' library (CuPy: on the device, on the current stream, without a synchronization), from
host offsets once per layout (memoized; their device copy by `_runtime.on_device`) or from
device offsets at every call (their values are never read on the host; a value that breaks the
offsets' rules gives unspecified results, but every index is clamped into the arrays).
"""
from collections import namedtuple

import numpy as np

from . import _memo, _runtime

# src (B * n,) the packed token each padded row reads (clamped into [0, total - 1]), pad
# (B * n, 1) whether that row is padding; seq, row (total,) each token's sequence and padded row.
Rows = namedtuple("Rows", "src pad seq row n")

_rows = _memo.Memo(64)


def _build_rows(xp, cu, total, n, end_aligned):
    """Rows of one side (queries: end_aligned with bottom-right alignment; keys: never)."""
    cu = cu.astype(np.int64)
    B = cu.shape[0] - 1
    start, end = cu[:-1, None], cu[1:, None]
    length = xp.clip(end - start, 0, n)                                # (B, 1)
    r = xp.arange(n, dtype=np.int64)[None, :]
    i = r - (n - length) if end_aligned else r                         # the row's token in b
    src = xp.clip(start + i, 0, max(total - 1, 0)).reshape(-1)
    pad = ((i < 0) | (i >= length)).reshape(-1, 1)
    t = xp.arange(total, dtype=np.int64)
    seq = xp.clip(xp.searchsorted(cu, t, side="right") - 1, 0, max(B - 1, 0))
    first = xp.take(cu, seq)
    row = t - first + (n - xp.take(length.reshape(-1), seq)) if end_aligned else t - first
    found = Rows(src, pad, seq, xp.clip(row, 0, max(n - 1, 0)), n)
    if xp is np:  # shared by the calls of a layout (memoized)
        for x in found[:4]:
            x.flags.writeable = False
    return found


def rows(packed):
    """(query Rows, key Rows) of a checked packed call (cuflash/_validate.py Packed)."""
    xp = packed.xp
    sides = ((packed.cu_q, packed.q_host, packed.q.shape[0], packed.max_q, packed.bottom_right),
             (packed.cu_k, packed.k_host, packed.k.shape[0], packed.max_k, False))
    found = []
    for cu, host, total, n, end_aligned in sides:
        if not host:  # device offsets: rebuilt at every call (a graph replays them)
            found.append(_build_rows(xp, cu, total, n, end_aligned))
            continue
        device = None if xp is np else packed.q.device.id
        key = (device, cu.tobytes(), total, n, end_aligned)
        found.append(_rows.build(key, lambda: _build_rows(
            xp, cu if xp is np else _runtime.on_device(cu), total, n, end_aligned)))
        if xp is not np:  # (a cached Rows: a graph's gathers read it at every replay)
            _runtime.keep_captured(found[-1][:4])
    return tuple(found)


def _bits(x):
    """x viewed as unsigned ints of its item size: moved as raw bits (bfloat16 included)."""
    return x.view(np.dtype(f"u{x.dtype.itemsize}"))


def empty(xp, packed_shape, n, B, dtype):
    """An uninitialized padded buffer for a packed (total, Hx, D...) array: storage (B, n, Hx,
    D...), returned with its (B, Hx, n, D...) view (what the Problem reads: any strides)."""
    shape = (B, n) + tuple(packed_shape[1:])
    buf = np.empty(shape, dtype) if xp is np else _runtime.empty(shape, dtype)  # (poisoned)
    return buf, xp.moveaxis(buf, 2, 1)


def fill(xp, buf, x, rows, value=0):
    """Write the packed x (total, Hx, D...) into buf (empty's storage): padded row s gets token
    rows.src[s], padding rows `value` (0 is written as zero bits)."""
    if buf.size == 0:
        return
    dst = buf.reshape(buf.shape[0] * buf.shape[1], -1)
    target, value = (_bits(dst), 0) if value == 0 else (dst, value)
    if x.shape[0] == 0:  # no token at all (device offsets with max_seqlen > 0)
        target.fill(value)
        return
    src = xp.ascontiguousarray(_bits(x)).reshape(x.shape[0], -1)
    xp.take(src, rows.src, axis=0, out=_bits(dst))
    xp.copyto(target, value, where=rows.pad)


def contiguous(xp, x):
    """x as a C-contiguous array (a copy of its bits where it is not)."""
    return xp.ascontiguousarray(_bits(x)).view(x.dtype)


def unpad(xp, y, rows):
    """A padded result y (B, Hx, n, D...) back in the packed layout (total, Hx, D...)."""
    B, Hx, n = y.shape[:3]
    tail = tuple(y.shape[3:])
    total = rows.seq.shape[0]
    width = int(np.prod(tail, dtype=np.int64))
    if total * Hx * width == 0 or y.size == 0:
        return xp.zeros((total, Hx) + tail, _bits(y).dtype).view(y.dtype)
    index = (rows.seq[:, None] * Hx + xp.arange(Hx, dtype=np.int64)[None, :]) * n \
        + rows.row[:, None]                                            # (total, Hx)
    src = xp.ascontiguousarray(_bits(y)).reshape(B * Hx * n, width)
    return xp.take(src, index.reshape(-1), axis=0).view(y.dtype).reshape((total, Hx) + tail)
