"""cuflash's CUDA host path on a machine without a GPU: a recording stand-in for CuPy.

The stand-in ("fake CuPy") keeps every array's shape, strides, dtype and a real, 512-byte-aligned
host address, runs no kernel and copies no data: kernels are recorded, never run, and reading a
device value on the host (int(), bool(), .get(), .item()) raises HiddenSync. The device is an
H200 as cuflash sees it (compute capability 9.0, 132 SMs, 227 KiB of opt-in shared memory,
NVRTC 13.0). So on a CPU machine it shows:

* `time`: the host time per call of the issue-17 cases in a plain loop, less CuPy's own costs
  (those are stubs here: add the launch and allocation floors measured on the device, RESULTS.md);
* `trace OUT.json`: every launch of a case matrix (kernel, grid, block, shared memory, the
  parameter bytes with each address written as (allocation number, offset)) over several calls,
  so that two trees' traces compare: a host refactor that leaves the trace unchanged launches the
  same kernels with the same arguments;
* `profile CASE`: cProfile of one case's loop.

Run from the repository root: ``python tests/fake_cupy.py time`` (or, for an A/B, with PYTHONPATH
set to another tree: ``PYTHONPATH=/tmp/old python tests/fake_cupy.py trace old.json``).
tests/test_host_trace.py runs the trace in CI.
"""
import argparse
import contextlib
import ctypes
import gc
import itertools
import json
import math
import sys
import time
import types

import numpy as np

# ---- the stand-in ------------------------------------------------------------------------------


class HiddenSync(RuntimeError):
    """A device value read on the host."""


class _State:
    allocations = []   # (base address, size, number) while recording
    tables = set()     # base addresses of device copies of host data and of zeroed buffers
    launches = []      # recorded launches and elementwise calls
    record = False
    capturing = False  # the current stream captures a CUDA graph (a test sets it)


def _reserve():
    """16 GiB of address space that is never touched (nothing writes array bytes), so that
    allocations bump through it and no address comes back while recording: an anonymous mapping
    without swap reservation (MAP_NORESERVE, Linux), so that machines with less memory take it;
    elsewhere a smaller plain buffer."""
    import mmap
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_NORESERVE", 0x4000)
    for size in (1 << 34, 1 << 32):
        try:
            return np.frombuffer(mmap.mmap(-1, size, flags=flags), dtype=np.uint8)
        except (OSError, ValueError, OverflowError):
            continue
    return np.empty(1 << 31, dtype=np.uint8)


_ARENA = _reserve()
_BASE = -_ARENA.ctypes.data % 512
_next = [_BASE]


class Memory:
    """An allocation: 512-byte aligned, numbered in order, never reused while recording."""

    def __init__(self, size):
        self.size = int(size)
        at = _next[0]
        if at + self.size + 512 > _ARENA.size:
            if _State.record:
                raise MemoryError("fake CuPy: the arena is spent")
            at = _BASE
        _next[0] = at + -(-max(self.size, 1) // 512) * 512
        self.buf, self.offset0 = _ARENA, at
        self.ptr = _ARENA.ctypes.data + at
        if _State.record:
            _State.allocations.append((self.ptr, self.size, len(_State.allocations)))


class MemoryPointer:
    def __init__(self, mem, offset=0):
        self.mem, self.offset = mem, int(offset)
        self.ptr = mem.ptr + self.offset
        self.at = mem.offset0 + self.offset  # in the arena
        self.device_id = 0

    def __add__(self, n):
        return MemoryPointer(self.mem, self.offset + int(n))

    def __int__(self):
        return self.ptr

    def memset_async(self, value, size, stream=None):
        _record("memset", ["ptr", _allocation_of(self.ptr)], int(size))

    def copy_from_device_async(self, src, size, stream=None):
        _record("copy", ["ptr", _allocation_of(self.ptr)], ["ptr", _allocation_of(src.ptr)],
                int(size))

    copy_from_async = copy_from_device_async

    def copy_from_host_async(self, src, size, stream=None):  # (src: a ctypes pointer)
        if _State.capturing:
            raise RuntimeError("the current stream is capturing: a copy from host memory would "
                               "read it again at every replay")
        _State.tables.add(self.mem.ptr)  # (a device copy of host data, as _asarray's)
        _record("upload", [int(size)], "|u1", ctypes.string_at(src.value, min(size, 64)).hex())


class _Pinned(bytearray):
    """cupy.cuda.alloc_pinned_memory: host bytes (the buffer protocol) and their address."""

    def __init__(self, size):
        super().__init__(max(int(size), 1))
        self.ptr = ctypes.addressof((ctypes.c_char * len(self)).from_buffer(self))


class Event:
    """An event that is always done (the stand-in's device runs nothing)."""

    done = True

    def __init__(self, block=False, disable_timing=False, interprocess=False):
        pass

    def record(self, stream=None):
        pass

    def synchronize(self):
        pass


class _Context:
    """A `with` target that does nothing (a device, a stream)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def synchronize(self):
        pass


class Device(_Context):
    def __init__(self, device=None):
        self.id = 0 if device is None else int(device)
        self.compute_capability = "90"
        self.attributes = {"MaxSharedMemoryPerBlockOptin": 232448}


class Stream(_Context):
    null = None

    def __init__(self, non_blocking=False, ptr=1):
        self.ptr = ptr

    def is_capturing(self):
        return _State.capturing

    def wait_event(self, event):
        pass


_STREAM = Stream(ptr=0x5000)


def _sync(*_):
    raise HiddenSync("a device value read on the host")


def _np(x):
    return x._a if isinstance(x, ndarray) else x


class ndarray:
    """A device array: shape, strides, dtype and an address; its host bytes are never read."""

    def __init__(self, shape, dtype=float, memptr=None, strides=None, order="C", _a=None,
                 _mem=None):
        if _a is not None:
            self._a, self._mem = _a, _mem
            self.data = MemoryPointer(_mem, _a.__array_interface__["data"][0] - _mem.ptr)
            return
        dtype = np.dtype(dtype)
        shape = (shape,) if isinstance(shape, (int, np.integer)) else tuple(shape)
        if memptr is None:
            memptr = MemoryPointer(Memory(math.prod(shape) * dtype.itemsize))
        self._mem, self.data = memptr.mem, memptr
        self._a = np.ndarray(shape, dtype, buffer=_ARENA, offset=memptr.at, strides=strides,
                             order=order)

    # metadata
    shape = property(lambda self: self._a.shape)
    dtype = property(lambda self: self._a.dtype)
    strides = property(lambda self: self._a.strides)
    ndim = property(lambda self: self._a.ndim)
    size = property(lambda self: self._a.size)
    nbytes = property(lambda self: self._a.nbytes)
    itemsize = property(lambda self: self._a.itemsize)
    flags = property(lambda self: self._a.flags)
    device = property(lambda self: Device(0))
    T = property(lambda self: _view(self, self._a.T))

    def __len__(self):
        return len(self._a)

    __int__ = __float__ = __bool__ = __index__ = get = item = tolist = _sync

    def __array__(self, *a, **k):
        raise TypeError("Implicit conversion to a NumPy array is not allowed (fake CuPy)")

    def __getitem__(self, key):
        return _view(self, self._a[_unwrap(key)])

    def __setitem__(self, key, value):
        _record("setitem", self._a[_unwrap(key)].shape)

    def reshape(self, *shape, order="C"):
        out = self._a.reshape(*shape, order=order)
        if order == "C" and self._a.flags.c_contiguous:  # a view at the same address
            view = object.__new__(ndarray)
            view._a, view._mem, view.data = out, self._mem, self.data
            return view
        if np.may_share_memory(out, self._a):
            return _view(self, out)
        return _fresh(out.shape, out.dtype)

    def view(self, dtype=None):
        return _view(self, self._a.view(dtype))

    def astype(self, dtype, copy=True, order="K"):
        if not copy and np.dtype(dtype) == self.dtype:
            return self
        _record("astype", self.shape)
        return _fresh(self.shape, dtype)

    def copy(self, order="C"):
        _record("copy", self.shape)
        return _fresh(self.shape, self.dtype)

    def fill(self, value):
        _record("fill", self.shape)

    def sum(self, axis=None, dtype=None, keepdims=False):
        _record("sum", self.shape)
        axes = range(self.ndim) if axis is None else \
            [a % self.ndim for a in ((axis,) if np.isscalar(axis) else axis)]
        shape = tuple(1 if i in axes else n for i, n in enumerate(self.shape) if keepdims or
                      i not in axes)
        return _fresh(shape, dtype or self.dtype)

    def __getattr__(self, name):  # views and the like: NumPy's, on the same memory
        attr = getattr(self._a, name)
        if not callable(attr):
            return attr

        def call(*args, **kwargs):
            out = attr(*(_unwrap(a) for a in args), **kwargs)
            return _view(self, out) if isinstance(out, np.ndarray) else out
        return call

    def _binary(self, other, *_):
        other = _np(other)
        shape = np.broadcast_shapes(self.shape, np.shape(other))
        dtype = np.result_type(self._a.dtype, other if np.isscalar(other) else other.dtype)
        _record("binary", shape)
        return _fresh(shape, dtype)

    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = __truediv__ = _binary
    __rtruediv__ = __lt__ = __le__ = __gt__ = __ge__ = __eq__ = __ne__ = __and__ = _binary
    __or__ = _binary

    def __neg__(self):
        _record("unary", self.shape)
        return _fresh(self.shape, self.dtype)
    __hash__ = object.__hash__


ndarray.__module__ = "cupy"


def _unwrap(key):
    if isinstance(key, tuple):
        return tuple(_np(k) for k in key)
    return _np(key)


def _view(base, a):
    if isinstance(a, np.ndarray) and a.size and np.may_share_memory(a, base._a):
        return ndarray(None, _a=a, _mem=base._mem)
    return _fresh(a.shape, a.dtype) if isinstance(a, np.ndarray) else a


def _fresh(shape, dtype):
    return ndarray(shape, dtype)


def _record(kind, *what):
    if _State.record:
        _State.launches.append([kind] + [list(w) if isinstance(w, tuple) else w for w in what])


def _asarray(x, dtype=None):
    if isinstance(x, ndarray):
        return x if dtype is None or np.dtype(dtype) == x.dtype else x.astype(dtype)
    host = np.asarray(x, dtype=dtype)
    if _State.capturing:  # (as CuPy refuses it)
        raise RuntimeError("the current stream is capturing, so H2D transfers are disallowed")
    out = _fresh(host.shape, host.dtype)
    _State.tables.add(out._mem.ptr)  # (a device copy of host data: a table, cached or not)
    _record("upload", host.shape, host.dtype.str, host.reshape(-1)[:8].tobytes().hex())
    return out


def _ascontiguousarray(x, dtype=None):
    x = _asarray(x, dtype)
    return x if x.flags.c_contiguous else x.copy()


def _zeros(shape, dtype=float, *a, **k):
    out = _fresh(shape, dtype)
    _State.tables.add(out._mem.ptr)  # (initialized device state, which a cache may keep)
    return out


def _like(fn):
    def make(shape, dtype=float, *a, **k):
        return _fresh(shape, dtype)
    return make


class _Kernel:
    def __init__(self, name):
        self.name = name
        self.kernel = types.SimpleNamespace(ptr=id(self))
        self.attributes = {"num_regs": 0, "shared_size_bytes": 0, "local_size_bytes": 0,
                           "max_threads_per_block": 1024}
        self.max_dynamic_shared_size_bytes = 0

    def __call__(self, grid, block, args, shared_mem=0):
        if _State.record:
            _State.launches.append(["rawkernel", self.name, list(grid), list(block), shared_mem,
                                    [_argument(a) for a in args]])


def _argument(a):
    """A RawKernel argument as the trace writes it."""
    if isinstance(a, (ndarray, MemoryPointer)):
        return ["ptr", _allocation_of(a.data.ptr if isinstance(a, ndarray) else a.ptr)]
    if isinstance(a, np.generic):
        return [a.dtype.str, a.tobytes().hex()]
    return [type(a).__name__, repr(a)]


class RawModule:
    def __init__(self, code=None, options=(), name_expressions=()):
        self.exprs = list(name_expressions)

    def get_function(self, name):
        return _kernels.setdefault(name, _Kernel(name))


_kernels = {}
_names = {}


class ElementwiseKernel:
    def __init__(self, in_params, out_params, operation, name="kernel", **kwargs):
        self.name = name
        params = [p.split() for p in (in_params + "," + out_params).split(",") if p.strip()]
        self.n_in = len([p for p in in_params.split(",") if p.strip()])
        self.raw = [p[0] == "raw" for p in params]  # raw arrays are indexed, not broadcast

    def __call__(self, *args, **kwargs):
        arrays = [a for a in args if isinstance(a, ndarray)]
        _record("elementwise", self.name, [list(a.shape) for a in arrays])
        if len(args) > self.n_in:
            outs = args[self.n_in:]
            # as CuPy: the inputs broadcast to the outputs' shape, which they do not change
            shapes = [a.shape for a, raw in zip(args, self.raw)
                      if isinstance(a, ndarray) and not raw]
            if np.broadcast_shapes(*shapes) != outs[0].shape:
                raise ValueError(f"fake CuPy: {self.name}: shapes {shapes}")
            return outs[0] if len(outs) == 1 else tuple(outs)
        shape = np.broadcast_shapes(*(a.shape for a in arrays)) if arrays else ()
        return _fresh(shape, arrays[0].dtype if arrays else np.float64)


class ReductionKernel(ElementwiseKernel):
    def __init__(self, in_params, out_params, map_expr, reduce_expr, post_map_expr, identity,
                 name="reduce_kernel", **kwargs):
        super().__init__(in_params, out_params, map_expr, name)

    def __call__(self, *args, axis=None, **kwargs):
        a = args[0]
        axes = [x % a.ndim for x in ((axis,) if np.isscalar(axis) else axis)]
        _record("reduction", self.name, list(a.shape))
        return _fresh(tuple(n for i, n in enumerate(a.shape) if i not in axes), np.float64)


_by_params = {}  # Launch.params (the address the driver reads) -> its Launch


def _launch(func, gx, gy, gz, bx, by, bz, smem, stream, params, extra):
    """cupy.cuda.driver.launchKernel: the parameter bytes as they are at the launch."""
    if not _State.record:
        return
    launch = _by_params[params]
    name = next((k.name for k in _kernels.values() if k.kernel.ptr == func), str(func))
    _State.launches.append(["launch", name, [gx, gy, gz], [bx, by, bz], smem,
                            (launch.layout, launch.buf.view(np.uint8).tobytes(),
                             len(launch.packed))])


def _hook_launches():
    from cuflash import _runtime
    build = _runtime.Launch._build

    def recorded(self, args):
        build(self, args)
        _by_params[self.params] = self
    _runtime.Launch._build = recorded


def _allocation_of(address):
    """[allocation number, offset] of a recorded address, or None."""
    for base, size, number in _State.allocations:
        if base <= address < base + max(size, 1):
            return [number, address - base]
    return None


def install():
    """Put the stand-in in sys.modules as cupy (before cuflash is imported)."""
    cupy = types.ModuleType("cupy")
    cuda = types.ModuleType("cupy.cuda")
    runtime = types.SimpleNamespace(
        getDevice=lambda: 0, getDeviceCount=lambda: 1,
        getDeviceProperties=lambda d: {"multiProcessorCount": 132, "major": 9, "minor": 0})
    driver = types.SimpleNamespace(launchKernel=_launch)
    nvrtc = types.SimpleNamespace(getVersion=lambda: (13, 0))
    cuda.Device, cuda.Stream, cuda.MemoryPointer = Device, Stream, MemoryPointer
    cuda.runtime, cuda.driver, cuda.nvrtc = runtime, driver, nvrtc
    cuda.get_current_stream = lambda: _STREAM
    cuda.alloc_pinned_memory, cuda.Event = _Pinned, Event
    cuda.alloc = lambda n: MemoryPointer(Memory(n))
    cuda.get_allocator = lambda: cuda.alloc
    cuda.using_allocator = lambda f: contextlib.nullcontext()  # (the pool stands in for any)
    cuda.is_available = lambda: True
    cupy.cuda, cupy.ndarray = cuda, ndarray
    cupy.RawModule, cupy.ElementwiseKernel, cupy.ReductionKernel = (RawModule, ElementwiseKernel,
                                                                    ReductionKernel)
    cupy.asarray, cupy.ascontiguousarray = _asarray, _ascontiguousarray
    cupy.empty = cupy.full = cupy.ones = _like(None)
    cupy.zeros = _zeros
    cupy.empty_like = cupy.zeros_like = lambda a, dtype=None: _fresh(a.shape, dtype or a.dtype)
    cupy.broadcast_to = lambda a, shape: _view(a, np.broadcast_to(a._a, shape))
    cupy.get_array_module = lambda *a: cupy
    for name in ("float16", "float32", "float64", "int32", "int64", "uint8", "bool_", "dtype"):
        setattr(cupy, name, getattr(np, name))
    sys.modules["cupy"], sys.modules["cupy.cuda"] = cupy, cuda
    return cupy


def _fake_tma():
    """Tensor maps without the driver: the address and the layout written into the 128 bytes."""
    from cuflash import _tma

    def encode(out, dtype, rank, ptr, dims, strides, box, elem, interleave, swizzle, l2, oob):
        words = [ptr.value or 0, dtype, rank, swizzle] + list(dims) + list(strides) + list(box)
        ctypes.memmove(out, np.array(words[:16] + [0] * (16 - len(words[:16])),
                                     dtype=np.uint64).ctypes.data, 128)
        return 0
    _tma._encode = lambda: encode


# ---- the cases ----------------------------------------------------------------------------------

def _inputs(cupy, B, H, Hkv, Nq, Nk, D, dtype="bfloat16", bnhd=False):
    """q, k, v as (B, H, N, D) arrays; bnhd: as views of (B, N, H, D) buffers."""
    import ml_dtypes  # noqa: F401
    dt = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
    if bnhd:
        return tuple(cupy.empty((B, N, h, D), dt).swapaxes(1, 2)
                     for h, N in ((H, Nq), (Hkv, Nk), (Hkv, Nk)))
    q = cupy.empty((B, H, Nq, D), dt)
    k = cupy.empty((B, Hkv, Nk, D), dt)
    v = cupy.empty((B, Hkv, Nk, D), dt)
    return q, k, v


# (name, (B, H, Hkv, Nq, Nk, D), options, what): what = fwd, bwd or both
CASES = [
    ("small", (1, 8, 8, 128, 128, 64), dict(causal=True), "both"),
    ("mid", (4, 16, 16, 512, 512, 128), dict(causal=True), "both"),
    ("mid-nocausal-fp16", (4, 16, 16, 512, 512, 128), dict(dtype="float16"), "both"),
    ("decode", (1, 32, 8, 1, 4096, 128), {}, "fwd"),
    ("decode-lens", (8, 32, 8, 1, 8192, 128), dict(kv_lens=4000), "fwd"),
    # no split: the workspace is carved with out and lse
    ("decode-batch", (64, 32, 8, 1, 512, 128), {}, "fwd"),
    # issue 17's token-by-token loop: lengths (about 4000 of 8192) growing by one per call, on
    # the host ("grow") or in a CuPy array ("device")
    ("decode-grow", (8, 32, 8, 1, 8192, 128), dict(kv_lens="grow"), "fwd"),
    ("decode-device", (8, 32, 8, 1, 8192, 128), dict(kv_lens="device"), "fwd"),
    # a paged cache (pages of 64 keys, a CuPy block table and kv_lens: a decode loop's form)
    ("decode-paged", (8, 32, 8, 1, 4096, 128), dict(pages=64, kv_lens="device"), "fwd"),
    ("window-gqa", (2, 8, 2, 1024, 1024, 128), dict(window=(256, 0)), "both"),
    ("bias", (2, 4, 4, 256, 256, 64), dict(bias=(4, 256, 256)), "both"),
    ("mask", (2, 4, 4, 256, 384, 64), dict(mask=(2, 1, 256, 384)), "both"),
    ("dropout", (4, 16, 16, 512, 512, 128), dict(causal=True, dropout_p=0.1,
                                                 dropout_seed=(3, 5)), "both"),  # mid + dropout
    ("softcap", (2, 8, 8, 512, 512, 64), dict(softcap=30.0), "both"),
    ("fp32", (2, 4, 4, 256, 256, 64), dict(dtype="float32"), "both"),
    ("fp64", (1, 2, 2, 128, 128, 64), dict(dtype="float64"), "both"),
    ("D96", (2, 4, 4, 256, 256, 96), {}, "both"),
    ("deterministic", (2, 8, 2, 256, 256, 128), dict(causal=True, deterministic=True), "bwd"),
    ("sinks-alibi", (2, 8, 8, 256, 256, 64), dict(sinks=(8,), alibi_slopes=(2, 8)), "both"),
    ("dbias", (2, 4, 4, 256, 256, 64), dict(bias=(4, 256, 256), return_dbias=True), "bwd"),
    # q, k, v and dout as (B, H, N, D) views of (B, N, H, D) buffers (the layout models use)
    ("bnhd", (4, 16, 16, 512, 512, 128), dict(causal=True, layout="bnhd"), "both"),
]


_GROWN = itertools.count(0, 2)  # "grow" cases: each _calls' lengths start past the last's


def _calls(cupy, case, shrink=False):
    """The case's calls (fwd, bwd or both) on fresh arrays. shrink: long caches cut to 4,608 keys
    of 4 sequences (the trace's, so that its never-reused address space stays small)."""
    import cuflash
    _, (B, H, Hkv, Nq, Nk, D), options, what = case
    if shrink and Nk > 4608:
        B, Nk = min(B, 4), 4608
    options = dict(options)
    bnhd = options.pop("layout", "bhnd") == "bnhd"
    q, k, v = _inputs(cupy, B, H, Hkv, Nq, Nk, D, options.pop("dtype", "bfloat16"), bnhd)
    if "bias" in options:
        options["bias"] = cupy.empty(options["bias"], np.float32)
    if "mask" in options:
        options["mask"] = cupy.empty(options["mask"], np.bool_)
    for name in ("sinks", "alibi_slopes"):
        if name in options:
            options[name] = cupy.empty(options[name], np.float32)
    backward_only = {name: options.pop(name) for name in ("deterministic", "return_dbias")
                     if name in options}
    grow = options.get("kv_lens") == "grow"
    if grow:  # (on from the last call's lengths: a token loop's never come back)
        options["kv_lens"] = (4000 + np.arange(B, dtype=np.int64).reshape(B, 1) * 37 % 400
                              + next(_GROWN))
    elif options.get("kv_lens") == "device":
        options["kv_lens"] = cupy.empty((B, 1), np.int64)
    if "pages" in options:  # k, v as page pools (num_pages, Hkv, page_size, D), a CuPy table
        size = options.pop("pages")
        k, v = (cupy.empty((B * Nk // size, Hkv, size, D), q.dtype) for _ in range(2))
        options["block_table"] = cupy.empty((B, Nk // size), np.int32)
        options["kv_lens"] = cupy.empty((B,), np.int64)  # (per sequence, as with a table)

    def fwd(return_lse=False):  # (a loop's call; the first keeps lse for the backward)
        if grow:
            options["kv_lens"] = options["kv_lens"] + 1  # (a new array, as a loop would make)
        return cuflash.attention(q, k, v, return_lse=return_lse, **options)
    out, lse = fwd(True)
    dout = (cupy.empty((B, Nq, H, out.shape[-1]), out.dtype).swapaxes(1, 2) if bnhd
            else cupy.empty(out.shape, out.dtype))

    def bwd():
        return cuflash.attention_backward(dout, q, k, v, out, lse, **options, **backward_only)
    return {"fwd": [fwd], "bwd": [bwd], "both": [fwd, bwd]}[what]


def time_cases(names, calls=2000, rounds=20):
    """Host µs per call of each case in a plain loop: the best of `rounds` rounds of
    calls / rounds calls each (the least disturbed by other work on the machine), with the
    garbage collector paused in the rounds (collected between them)."""
    cupy = install()
    _fake_tma()
    rows = []
    per_round = max(calls // rounds, 1)
    for case in CASES:
        if names and case[0] not in names:
            continue
        for fn in _calls(cupy, case):
            fn()
            best = math.inf
            for _ in range(rounds):
                gc.collect()
                gc.disable()
                t0 = time.perf_counter()
                for _ in range(per_round):
                    fn()
                best = min(best, (time.perf_counter() - t0) / per_round)
                gc.enable()
            rows.append((case[0], fn.__name__, best * 1e6))
            print(f"{case[0]:>20} {fn.__name__}: {best * 1e6:8.1f} us/call", flush=True)
    return rows


def trace_cases(out_path, names, calls=3):
    """Each case's launches over `calls` calls, each call on fresh inputs (new addresses): in
    each, an address is ["new", k, offset] for the k-th allocation of this call (its inputs, its
    outputs, its workspaces) that it names, ["table", k, offset] for a device copy of host data
    or a zeroed buffer made before (a cached table, counters), ["old", k, offset] for another
    earlier allocation (a stale address). From the second call on, a case's calls compare
    equal."""
    cupy = install()
    _fake_tma()
    _State.record = True
    _hook_launches()
    trace = {}
    for case in CASES:
        if names and case[0] not in names:
            continue
        for n in range(calls):
            first_new = len(_State.allocations)
            for fn in _calls(cupy, case, shrink=True):
                _State.launches = []
                fn()
                trace[f"{case[0]}/{fn.__name__}/{n}"] = _renumber(
                    [_normalize(x) for x in _State.launches], first_new)
    with open(out_path, "w") as f:
        json.dump(trace, f, indent=0, sort_keys=True)
    print(f"{len(trace)} calls, {sum(map(len, trace.values()))} events -> {out_path}")


def _normalize(event):
    """A launch with its parameters in words: an address as [allocation, offset], a number or a
    struct's 8-byte words as such (those that fall in an allocation as [allocation, offset])."""
    if event[0] != "launch":
        return event
    _, name, grid, block, smem, (layout, raw, size) = event
    words = []
    for n, (_, off, kind) in enumerate(layout):
        end = layout[n + 1][1] if n + 1 < len(layout) else size
        if kind in (False, True):
            words.append(["ptr", _allocation_of(int.from_bytes(raw[off:off + 8], "little"))])
        else:
            chunk = raw[off:end] + bytes(-(end - off) % 8)
            words.append([["ptr", _allocation_of(int(w))] if _allocation_of(int(w)) else int(w)
                          for w in np.frombuffer(chunk, dtype=np.uint64)])
    return ["launch", name, grid, block, smem, words]


def _renumber(events, first_new):
    """Addresses as [age, k, offset]: age "new" for allocations numbered first_new and up, else
    "table" for a device copy of host data or a zeroed buffer (what a cache keeps: tables,
    self-resetting counters), else "old" (an earlier call's buffer); k counts each age's
    allocations in the order the events first name them."""
    numbers = {"new": {}, "table": {}, "old": {}}
    tables = {number for base, _, number in _State.allocations if base in _State.tables}

    def walk(x):
        if isinstance(x, list) and len(x) == 2 and x[0] == "ptr" and x[1] is not None:
            age = ("new" if x[1][0] >= first_new else "table" if x[1][0] in tables else "old")
            seen = numbers[age]
            return ["ptr", [age, seen.setdefault(x[1][0], len(seen)), x[1][1]]]
        if isinstance(x, list):
            return [walk(y) for y in x]
        return x
    return walk(events)


def profile_case(name, calls=3000, sort="tottime"):
    import cProfile
    import pstats
    cupy = install()
    _fake_tma()
    case = next(c for c in CASES if c[0] == name)
    for fn in _calls(cupy, case):
        fn()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(calls):
            fn()
        prof.disable()
        print(f"---- {name} {fn.__name__}")
        pstats.Stats(prof).sort_stats(sort).print_stats(25)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("time")
    t.add_argument("cases", nargs="*")
    t.add_argument("--calls", type=int, default=2000)
    r = sub.add_parser("trace")
    r.add_argument("out")
    r.add_argument("cases", nargs="*")
    p = sub.add_parser("profile")
    p.add_argument("case")
    p.add_argument("--calls", type=int, default=3000)
    p.add_argument("--sort", default="tottime", help="pstats order (tottime, cumulative, ...)")
    a = ap.parse_args()
    if a.cmd == "time":
        time_cases(a.cases, a.calls)
    elif a.cmd == "trace":
        trace_cases(a.out, a.cases)
    else:
        profile_case(a.case, a.calls, a.sort)


if __name__ == "__main__":
    main()
