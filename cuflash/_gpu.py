"""The CUDA dispatcher: ordered registries of paths, the tests' override, the catalog of kernels.

A path is a module with the same small interface: NAME; for the forward `takes(p)` and
`forward(p)` -> (out (p.out_shape, C-contiguous, of p.dtype), lse (p.lse_shape, of the
accumulator dtype)), and SINKS:
whether its kernels join attention sinks themselves (then its forward returns the softmax with
p.sinks; the others' results are joined with them here, cuflash._sinks.join); for the
backward `takes_backward(p)` and `backward(p, dout, out, lse, deterministic, sink_probs)` -> (dq, dk, dv) per
output (batch, head); and `instantiations()`, the (kernel, dtype name, bucket or head dim or None,
source file, name expression) tuples it can request; TRANSFORMS: the chains of score transforms
its kernels take (cuflash/_modifiers.py CHAINS or SINGLE; a path is skipped for a Problem whose
chain is not among them); a backward path also lists DBIAS, the chains for which its kernels store
the bias's gradient (with p.dbias its backward returns (dq, dk, dv, dbias), dbias (BH, Nq, Nk) in
its accumulator dtype; a path is skipped for a p.dbias Problem whose chain is not among them);
DROPOUT: whether its kernels take dropout (kernels_cu/philox.cuh; a path that does not is skipped
for a Problem with dropout_p > 0, so the generic kernels take it). The first path of FORWARD
(BACKWARD) that takes a Problem runs it, under its arrays' device, on the current CuPy stream,
never synchronizing.
Every path reads the same Problem, with BH, Nq, Nk > 0 (cuflash/api.py answers the empty ones).
A forward path may also offer `prepare(p)`: the callable that its forward(p) calls with p, built
once per layout, which runs any Problem of p's key; for a repeatable Problem (Problem.repeatable:
plain, or plain but for a CuPy kv_lens) it is kept here and a repeated call of that key runs it
directly (`Repeat`). Likewise `prepare_lens(p)`, a callable that runs every Problem of p's
layout whatever its host kv_lens (Problem.lens_repeatable: a token loop), kept by the layout's
key (no path's choice reads the lengths' values). A backward path likewise
`prepare_backward(p, deterministic)`, called with (p, dout, out, lse, sink_probs).
"""
import contextlib

from . import (_decode, _generic, _memo, _mma_bwd, _mma_fwd, _modifiers, _runtime, _sinks,
               _wgmma_fwd, _wide)

FORWARD = (_decode, _wgmma_fwd, _mma_fwd, _wide, _generic)  # decode, Hopper, tensor cores, generic
BACKWARD = (_mma_bwd, _wide, _generic)
PATHS = (_generic, _mma_fwd, _wgmma_fwd, _wide, _mma_bwd, _decode)


_chosen = _memo.Memo(256)


def _choose(paths, takes, p):
    """The first of `paths` whose `takes` accepts p; a forced path (override) is the only one
    tried before the generic kernels, in the direction where a path of that name exists.
    Memoized by the Problem's signature, the test switches and its arrays' alignments (the
    tensor-core paths need 16-byte aligned bases; the rest of what `takes` reads is layout)."""
    ov = _runtime.overrides()
    key = None if p.key is None else (
        takes, p.key, ov, p.q.data.ptr % 256, p.k.data.ptr % 256, p.v.data.ptr % 256,
        None if p.mask is None else p.mask.data.ptr % 256,
        None if p.bias is None else p.bias.data.ptr % 256)

    def choose():
        candidates = paths
        if ov.path is not None and any(x.NAME == ov.path for x in paths):
            candidates = [x for x in paths if x.NAME in (ov.path, _generic.NAME)]
        names = _modifiers.names(p)
        dbias = p.dbias and takes == "takes_backward"  # the bias's gradient: DBIAS paths only
        return next(x for x in candidates if names in x.TRANSFORMS
                    and (not dbias or names in x.DBIAS)
                    and (x.DROPOUT or not p.dropout_p) and getattr(x, takes)(p))

    return _chosen.build(key, choose)


def forward_path(p):
    """The NAME of the path that runs the forward of p: 'split', 'wgmma', 'mma', 'wide' or
    'generic'."""
    return _choose(FORWARD, "takes", p).NAME


def backward_path(p):
    """The NAME of the path that runs the backward of p: 'mma', 'wide' or 'generic'."""
    return _choose(BACKWARD, "takes_backward", p).NAME


class Repeat:
    """A repeatable Problem's path choice, kept with what it was made under: the prepared run of its
    path (`prepare`, `prepare_backward`), the test switches, the device, and the alignments of q,
    k and v that _choose keyed it by. A repeated call of that key which matches them runs it at
    once, without the choice's key or the path's caches (issue 17: a small call's host time is
    its cost)."""

    __slots__ = ("run", "overrides", "device", "residues")

    def __init__(self, run, p):
        self.run, self.overrides = run, _runtime.overrides()
        self.device, self.residues = p.q.data.device_id, _residues(p)

    def serves(self, p):
        return (self.overrides is _runtime.overrides() and self.residues == _residues(p)
                and self.device == _runtime.current_device())


def _residues(p):
    return p.q.data.ptr % 256, p.k.data.ptr % 256, p.v.data.ptr % 256


_repeats = _memo.Memo(256)  # Problem.key of a repeatable forward -> Repeat
_repeats_bwd = {False: _memo.Memo(256), True: _memo.Memo(256)}  # by `deterministic`, likewise


def forward(p):
    """(out, lse) of p by the first path that takes it, with p's sinks if it has any."""
    key = p.layout_key if p.lens_repeatable else p.key
    repeat = _repeats.get(key)
    if repeat is not None and repeat.serves(p):
        return repeat.run(p)
    with _runtime.device_of(p.q):
        path = _choose(FORWARD, "takes", p)
        if p.repeatable and p.key is not None and hasattr(path, "prepare"):
            repeat = Repeat(path.prepare(p), p)
            _repeats.put(p.key, repeat)
            return repeat.run(p)
        if p.lens_repeatable and key is not None and hasattr(path, "prepare_lens"):
            repeat = Repeat(path.prepare_lens(p), p)  # (a run for every host kv_lens)
            _repeats.put(key, repeat)
            return repeat.run(p)
        out, lse = path.forward(p)
        if p.sinks is not None and not path.SINKS:  # the sink-free softmax joined with the sinks
            out, lse = _sinks.join(p, out, lse)
        return out, lse


def backward(p, dout, out, lse, deterministic=False, sink_probs=None):
    """dq, dk, dv per output (batch, head), in the accumulator dtype (the tensor-core path may give
    dk, dv in the inputs' dtype already), and with p.dbias the logits' gradient (BH, Nq, Nk). The
    generic kernels are deterministic by construction (no atomics); the tensor-core path adds dq
    with atomics unless ``deterministic``, which then takes its fixed-order dq kernel.
    ``sink_probs`` (with sinks): each row's sink probability, (BH, Nq) float64, which the lost-row
    fix overwrites on its rows (_generic.launch_lost)."""
    repeats = _repeats_bwd[deterministic]
    repeat = repeats.get(p.key)
    if repeat is not None and repeat.serves(p):
        return repeat.run(p, dout, out, lse, sink_probs)
    with _runtime.device_of(p.q):
        path = _choose(BACKWARD, "takes_backward", p)
        if p.repeatable and p.key is not None and hasattr(path, "prepare_backward"):
            repeat = Repeat(path.prepare_backward(p, deterministic), p)
            repeats.put(p.key, repeat)
            return repeat.run(p, dout, out, lse, sink_probs)
        return path.backward(p, dout, out, lse, deterministic, sink_probs)


# path argument of override -> (Overrides.path, Overrides.variant)
_FORCED = {None: (None, None), "split-simt": (_decode.NAME, "simt"),
           **{x.NAME: (x.NAME, None) for x in PATHS}}
_KEEP = object()


@contextlib.contextmanager
def override(*, path=_KEEP, poison=_KEEP, wgmma=_KEEP):
    """The tests' switches for the body of a ``with`` block; the ones not given keep their value.

    path: None (the automatic choice), or the NAME of a path ("generic", "mma", "wgmma", "wide",
    "split") to run
    wherever it takes the Problem, the generic kernels elsewhere, in each direction that has a path
    of that name (the other direction chooses as usual); the split path when forced takes every
    Problem its kernels can run, with small splits; "split-simt": that on decode_split everywhere.
    poison: fill every buffer the kernels write with NaN first, so an element left unwritten shows.
    wgmma: False keeps the tensor-core backward on its mma.sync tiles on sm_90 devices too."""
    old = new = _runtime.overrides()
    if path is not _KEEP:
        if path not in _FORCED:
            raise ValueError(f"path must be one of {list(_FORCED)}, got {path!r}")
        new = new._replace(path=_FORCED[path][0], variant=_FORCED[path][1])
    if poison is not _KEEP:
        new = new._replace(poison=bool(poison))
    if wgmma is not _KEEP:
        new = new._replace(wgmma=bool(wgmma))
    _runtime._set_overrides(new)
    try:
        yield new
    finally:
        _runtime._set_overrides(old)


def instantiations():
    """Every (kernel, dtype name, bucket or head dim or None, source file, name expression) the
    package can request (the paths' instantiations, each expression once): CI builds them all."""
    found = {}
    for path in PATHS + (_sinks,):  # and the sinks' row kernels
        for inst in path.instantiations():
            found.setdefault(inst[-1], inst)
    return list(found.values())


def cc90_only_instantiations():
    """Name expressions requested only on compute capability 9.0+ devices (held to zero spills on
    sm_90a only)."""
    return set().union(*(x.cc90_only() for x in PATHS if hasattr(x, "cc90_only")))


def cc80_only_instantiations():
    """Name expressions requested only on devices below compute capability 9.0 (held to zero
    spills on sm_80 only)."""
    return set().union(*(x.cc80_only() for x in PATHS if hasattr(x, "cc80_only")))
