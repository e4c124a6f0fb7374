"""Context parallelism: exact attention over one sequence sharded across P ranks (ring attention).

Each rank holds a shard of the sequence's queries, keys and values (and later of dout, out and
lse). The key/value shards travel around a ring: at step s rank r holds the shard of rank
(r - s) mod P, attends its own queries to it with :func:`cuflash.attention` (``positions`` says
where both blocks sit in the sequence) and merges the partial result into its running one with
:func:`cuflash.merge`. After P steps each rank has exact attention of its queries over the whole
sequence. The backward sends the same shards around, and with them the dK / dV accumulated for
them so far; each rank adds its own queries' share from the global out and lse
(``attention_backward`` of one block pair with the final out and lse is that pair's exact part of
the gradient), and after P steps every accumulator is back with its shard's owner.

Layouts (``layout=``): "zigzag" (the default) cuts the sequence into 2P chunks and gives rank r
chunks r and 2P - 1 - r, so that under a causal mask every rank has the same work; "contiguous"
gives rank r the r-th of P equal slices. :func:`shard` and :func:`unshard` convert whole arrays.
Blocks whose keys a causal or windowed mask hides entirely are skipped; blocks it shows entirely
run without the bound.

Rings: :class:`NcclRing` is one process of P, one GPU each, over a ``cupy.cuda.nccl``
communicator; its exchanges run on their own CUDA stream, overlapped with the step's
attention. :func:`emulate` runs P ranks in one process (one thread per rank, exchanges as copies):
the same schedule, on NumPy or on one GPU, which the tests check against the dense reference.
"""
import threading

import numpy as np

from . import _broadcast, _validate
from .api import attention as _attention, attention_backward as _attention_backward, merge

__all__ = ["attention", "attention_backward", "shard", "unshard", "emulate", "NcclRing"]

LAYOUTS = ("zigzag", "contiguous")


# ---- layouts ----------------------------------------------------------------------------------

def _chunks(rank, size, layout, n_local):
    """(local start, global start, length) of the chunks rank ``rank`` holds, n_local rows."""
    if layout == "zigzag":
        c = n_local // 2
        return ((0, rank * c, c), (c, (2 * size - 1 - rank) * c, c))
    return ((0, rank * n_local, n_local),)


def _check_layout(fn, layout, n, size):
    if layout not in LAYOUTS:
        raise ValueError(f"{fn}: layout must be 'zigzag' or 'contiguous', got {layout!r}")
    parts = 2 * size if layout == "zigzag" else size
    if n % parts:
        raise ValueError(f"{fn}: the sequence length {n} must be a multiple of {parts} "
                         f"({layout} over {size} ranks)")


def shard(x, size, layout="zigzag", axis=-2):
    """The P = ``size`` local shards of a whole sequence ``x`` (sequence on ``axis``)."""
    _check_layout("shard", layout, x.shape[axis], size)
    axis = axis % x.ndim
    if layout == "contiguous":
        n = x.shape[axis] // size
        return [x[(slice(None),) * axis + (slice(r * n, (r + 1) * n),)] for r in range(size)]
    c = x.shape[axis] // (2 * size)
    xp = _validate._xp_of(_validate._library(x))

    def rows(i):
        return x[(slice(None),) * axis + (slice(i * c, (i + 1) * c),)]

    return [xp.concatenate([rows(r), rows(2 * size - 1 - r)], axis=axis) for r in range(size)]


def unshard(shards, layout="zigzag", axis=-2):
    """The whole sequence from the P local shards :func:`shard` made."""
    size = len(shards)
    xp = _validate._xp_of(_validate._library(shards[0]))
    if layout == "contiguous":
        return xp.concatenate(list(shards), axis=axis)
    _check_layout("unshard", layout, size * shards[0].shape[axis], size)
    axis = axis % shards[0].ndim
    c = shards[0].shape[axis] // 2
    parts = [None] * (2 * size)
    for r, s in enumerate(shards):
        parts[r] = s[(slice(None),) * axis + (slice(0, c),)]
        parts[2 * size - 1 - r] = s[(slice(None),) * axis + (slice(c, 2 * c),)]
    return xp.concatenate(parts, axis=axis)


# ---- the schedule -----------------------------------------------------------------------------

def _seen(q_start, nq, k_start, nk, causal, window):
    """How keys [k_start, k_start + nk) look to queries [q_start, q_start + nq) by position:
    'none' (hidden from every query), 'all' (shown to every query), or 'some'."""
    left, right = (None, None) if window is None else window
    if causal:
        right = 0 if right is None else min(right, 0)
    q_last, k_last = q_start + nq - 1, k_start + nk - 1
    if (right is not None and k_start > q_last + right) or \
            (left is not None and k_last < q_start - left):
        return "none"
    if (right is None or k_last <= q_start + right) and (left is None or k_start >= q_last - left):
        return "all"
    return "some"


def _global_lens(fn, kv_lens, q, k, v, n):
    """The whole sequence's kv_lens (n keys in all), checked as cuflash.attention checks them:
    a host int64 array of the leading dims (a CuPy one copied once), or None."""
    if kv_lens is None:
        return None
    lead = _broadcast.broadcast_lead((q.shape[:-2], k.shape[:-2], v.shape[:-2]))
    if lead is None:  # the first pair's call names the shapes
        return np.asarray(kv_lens)
    return _validate._check_kv_lens(fn, kv_lens, lead, n, _validate._library(q))


def _pairs(rank, size, held, layout, n_local, causal, window, lens=None):
    """(query slice, key slice, options) of the block pairs rank computes with the shard of rank
    ``held``; pairs the bounds hide entirely are left out. ``lens``: the sequence's valid lengths
    (host int64, broadcastable to the leading dims) or None; a key chunk gets the part of them
    that falls in it, and a chunk past every length is left out too."""
    for q0, qg, nq in _chunks(rank, size, layout, n_local):
        for k0, kg, nk in _chunks(held, size, layout, n_local):
            seen = _seen(qg, nq, kg, nk, causal, window)
            if seen == "none":
                continue
            opts = {} if seen == "all" else dict(causal=causal, window=window, align="top-left",
                                                 positions=(qg, kg))
            if lens is not None:
                local = np.clip(lens - kg, 0, nk)
                if not local.any():
                    continue
                opts["kv_lens"] = local
            yield slice(q0, q0 + nq), slice(k0, k0 + nk), opts


def _rows(x, s):
    return x[..., s, :]


def _check_ring(fn, ring):
    if not all(hasattr(ring, a) for a in ("rank", "size", "start_exchange", "finish_exchange")):
        raise TypeError(f"{fn}: ring must be a cuflash.ring.NcclRing or the ring emulate passes, "
                        f"got {type(ring).__name__}")


def attention(q, k, v, ring, *, scale=None, causal=False, window=None, kv_lens=None,
              layout="zigzag", return_lse=False):
    """Exact attention of this rank's queries over the whole sharded sequence.

    q, k, v : this rank's shards (..., n_local, D), as :func:`shard` cuts them (the same n_local
    on every rank). ring : an :class:`NcclRing` or the ring :func:`emulate` passes. Returns out
    (and lse) of this rank's queries, in its layout. Positions are global: ``causal`` and
    ``window`` (as in :func:`cuflash.attention`, top-left: the sequence's queries and keys are
    the same tokens) compare a query's and a key's places in the whole sequence; ``kv_lens``
    (as in :func:`cuflash.attention`, host data or a CuPy array, copied to the host once) are the
    whole sequence's valid lengths: keys at or past them do not exist."""
    _check_ring("ring.attention", ring)
    n_local = q.shape[-2]
    _check_layout("ring.attention", layout, n_local * ring.size, ring.size)
    out = [None] * len(_chunks(0, ring.size, layout, n_local))
    lse = [None] * len(out)
    lens = _global_lens("ring.attention", kv_lens, q, k, v, n_local * ring.size)
    held = (k, v)
    for step in range(ring.size):
        owner = (ring.rank - step) % ring.size
        pending = ring.start_exchange(held) if step + 1 < ring.size else None
        for qs, ks, opts in _pairs(ring.rank, ring.size, owner, layout, n_local, causal, window,
                                   lens):
            part = _attention(_rows(q, qs), _rows(held[0], ks), _rows(held[1], ks), scale=scale,
                              return_lse=True, **opts)
            c = qs.start // (qs.stop - qs.start)
            out[c], lse[c] = part if out[c] is None else merge(out[c], lse[c], *part)
        if pending is not None:
            held = ring.finish_exchange(pending)
    xp = _validate._xp_of(_validate._library(q))
    for c, (q0, _, nq) in enumerate(_chunks(ring.rank, ring.size, layout, n_local)):
        if out[c] is None:  # every key hidden from this chunk (cannot happen top-left causal)
            out[c] = xp.zeros(q.shape[:-2] + (nq, v.shape[-1]), dtype=q.dtype)
            lse[c] = xp.full(q.shape[:-2] + (nq,), -np.inf, dtype=np.float64
                             if q.dtype == np.float64 else np.float32)
    out = xp.concatenate(out, axis=-2)
    lse = xp.concatenate(lse, axis=-1)
    return (out, lse) if return_lse else out


def attention_backward(dout, q, k, v, out, lse, ring, *, scale=None, causal=False, window=None,
                       kv_lens=None, layout="zigzag", deterministic=False):
    """Gradients (dq, dk, dv) of this rank's shards, from its shards of dout, out and lse (what
    :func:`attention` returned on this rank). The same gradients as one call on the whole
    sequence, up to the order of floating-point sums."""
    _check_ring("ring.attention_backward", ring)
    n_local = q.shape[-2]
    _check_layout("ring.attention_backward", layout, n_local * ring.size, ring.size)
    xp = _validate._xp_of(_validate._library(q))
    acc = np.float64 if q.dtype == np.float64 else np.float32
    dq = xp.zeros(q.shape, dtype=acc)
    lens = _global_lens("ring.attention_backward", kv_lens, q, k, v, n_local * ring.size)
    held = (k, v, xp.zeros(k.shape, dtype=acc), xp.zeros(v.shape, dtype=acc))
    for step in range(ring.size):
        owner = (ring.rank - step) % ring.size
        kv = ring.start_exchange(held[:2]) if step + 1 < ring.size else None
        dk, dv = held[2], held[3]
        for qs, ks, opts in _pairs(ring.rank, ring.size, owner, layout, n_local, causal, window,
                                   lens):
            g = _attention_backward(_rows(dout, qs), _rows(q, qs), _rows(held[0], ks),
                                    _rows(held[1], ks), _rows(out, qs), lse[..., qs],
                                    scale=scale, deterministic=deterministic, **opts)
            dq[..., qs, :] += g[0]
            dk[..., ks, :] += g[1]
            dv[..., ks, :] += g[2]
        # the accumulators travel after this step's share is in (every step, the last one
        # included: P moves bring each back to its shard's owner)
        grads = ring.finish_exchange(ring.start_exchange((dk, dv)))
        held = (ring.finish_exchange(kv) if kv is not None else held[:2]) + grads
    return tuple(g.astype(x.dtype) for g, x in zip((dq, held[2], held[3]), (q, k, v)))


# ---- rings --------------------------------------------------------------------------------------

class _World:
    """What the emulated ranks share: one slot per rank and a barrier."""

    def __init__(self, size):
        self.size = size
        self.slots = [None] * size
        self.barrier = threading.Barrier(size)


class _EmulatedRing:
    """One emulated rank: an exchange copies the arrays into the next rank's slot."""

    def __init__(self, world, rank):
        self.world, self.rank, self.size = world, rank, world.size

    def start_exchange(self, arrays):
        w = self.world
        w.barrier.wait()  # every rank is done reading its slot
        w.slots[(self.rank + 1) % self.size] = tuple(x.copy() for x in arrays)
        w.barrier.wait()  # every rank has written
        return w.slots[self.rank]

    def finish_exchange(self, pending):
        return pending


def emulate(size, fn):
    """Run ``fn(ring)`` for P = ``size`` emulated ranks in one process, one thread per rank
    (``ring.rank``, ``ring.size``; exchanges as copies, in the schedule's order); returns the
    P results in rank order. The first exception of a rank is raised."""
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ValueError(f"emulate: size must be a positive int, got {size!r}")
    world = _World(size)
    results, errors = [None] * size, []
    device = None
    try:
        import cupy
        device = cupy.cuda.Device().id
    except Exception:  # no CuPy or no GPU: NumPy ranks
        pass

    def run(rank):
        try:
            if device is not None:
                import cupy
                cupy.cuda.Device(device).use()
            results[rank] = fn(_EmulatedRing(world, rank))
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors.append(e)
            world.barrier.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    real = [e for e in errors if not isinstance(e, threading.BrokenBarrierError)]
    if real or errors:
        raise (real or errors)[0]
    return results


class NcclRing:
    """One rank of a ring over a NCCL communicator (``cupy.cuda.nccl.NcclCommunicator``), one GPU
    per process. Exchanges send to rank + 1 and receive from rank - 1 on a stream of their own,
    after the current stream's work so far; ``finish_exchange`` makes the current stream wait for
    them, so the step's attention runs while the shards are in flight."""

    def __init__(self, comm, rank, size):
        import cupy
        self.comm, self.rank, self.size = comm, int(rank), int(size)
        self.stream = cupy.cuda.Stream(non_blocking=True)

    def start_exchange(self, arrays):
        import cupy
        from cupy.cuda import nccl
        arrays = tuple(cupy.ascontiguousarray(x) for x in arrays)  # before the event below
        received = tuple(cupy.empty_like(x) for x in arrays)
        self.stream.wait_event(cupy.cuda.get_current_stream().record())
        nxt, prev = (self.rank + 1) % self.size, (self.rank - 1) % self.size
        nccl.groupStart()
        for x, y in zip(arrays, received):  # as bytes: every dtype, bfloat16 included
            self.comm.send(x.data.ptr, x.nbytes, nccl.NCCL_UINT8, nxt, self.stream.ptr)
            self.comm.recv(y.data.ptr, y.nbytes, nccl.NCCL_UINT8, prev, self.stream.ptr)
        nccl.groupEnd()
        return received, self.stream.record(), arrays  # the sent arrays live until it is done

    def finish_exchange(self, pending):
        import cupy
        received, done, _keep = pending
        cupy.cuda.get_current_stream().wait_event(done)
        return received
