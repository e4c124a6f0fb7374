"""The runtime layer below the CUDA paths: what every path needs to compile, size, launch kernels.

* the one compile cache: the source of kernels_cu/<file> with its local includes inlined (so CuPy's
  disk cache, keyed on the source text and options, sees every header edit, and NVRTC needs no
  include path), compiled once per (device, file, name expression, arch) (`get_function`), and
  the device-free NVRTC build with its ptxas report for CI (`resource_usage`);
* the device facts the kernel choices read (`device_info`, `nvrtc_version`), cached per device;
* output allocation, NaN-poisoned under the tests' override (`empty`), and the device copies of
  small host tables, cached by content (`on_device`);
* the kernel argument pack: the offset table and what every main kernel takes after its own
  tensors, four input pointers and the AttnArgs struct or its fields flat (`Args`,
  `ARGS_FIELDS`; DESIGN.md "Kernel ABI"), and the grid and shared-memory helpers (`bh_grid`,
  `opt_in`);
* the test switches (`overrides`; cuflash._gpu.override sets them);
* CUDA graph capture (`graph_safe`): the memory a call allocates while its stream captures is
  kept for the graph's replays.

CuPy is imported lazily: this module imports on machines without CuPy. Launches go to the current
CuPy stream; nothing here synchronizes. ``CUFLASH_DEBUG=1`` prints registers, static shared memory
and local (spill) bytes of each kernel the first time it is loaded on a device.
"""
import contextlib
import ctypes
import functools
import io
import math
import os
import re
import struct
import sys
import threading
from collections import namedtuple
from pathlib import Path

import numpy as np

from . import _broadcast, _config, _dropout, _memo, _modifiers
from ._validate import clamped_lens, element_strides

OPTIONS = ("-std=c++17",)
_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$')
_PRAGMA_ONCE = re.compile(r"^\s*#\s*pragma\s+once\s*$")
NULL = np.uint64(0)  # a null device pointer (8 bytes, as CuPy passes array pointers)
MAX_GRID_Y = 65535
MAX_GRID_X = 2**31 - 1

_lock = threading.Lock()
_sources = {}       # file name -> inlined source text
_functions = {}     # (device id, file name, name expression, arch) -> (RawModule, RawKernel)
_device_infos = {}  # device id -> DeviceInfo
_smem_set = {}      # id(kernel) -> largest max_dynamic_shared_size_bytes already set

# ---- test switches ------------------------------------------------------------------------------
# path: a path NAME forced wherever it can run (cuflash._gpu dispatches); variant: the decode
# kernel ("simt": decode_split everywhere); poison: fill every output buffer with NaN first, proving
# that each element is written; wgmma: the tensor-core backward may take its wgmma tiles.
Overrides = namedtuple("Overrides", "path variant poison wgmma")
_overrides = Overrides(path=None, variant=None, poison=False, wgmma=True)


def overrides():
    """The test switches in force (the defaults outside cuflash._gpu.override)."""
    return _overrides


def _set_overrides(value):
    global _overrides
    _overrides = value


# ---- device facts -------------------------------------------------------------------------------
# What the kernel choices need to know of a device (the one home for these queries).
DeviceInfo = namedtuple("DeviceInfo", "cc smem_optin sm_count")


def device_info(device_id=None):
    """DeviceInfo of a device (default: the current one), cached: compute capability as an int
    (90 for sm_90), opt-in shared memory per block in bytes, and the number of SMs."""
    import cupy

    dev = cupy.cuda.Device().id if device_id is None else int(device_id)
    info = _device_infos.get(dev)
    if info is None:
        device = cupy.cuda.Device(dev)
        info = DeviceInfo(int(device.compute_capability),
                          int(device.attributes["MaxSharedMemoryPerBlockOptin"]),
                          int(cupy.cuda.runtime.getDeviceProperties(dev)["multiProcessorCount"]))
        with _lock:
            info = _device_infos.setdefault(dev, info)
    return info


# NVRTC before 12.9 rejects a second -arch ("defined more than once"), and CuPy always appends
# its own after ours (_runtime.get_function); from 12.9 on, sm_90a wins in either order (checked
# with the libraries of nvidia-cuda-nvrtc-cu12 12.0-12.6, 12.8 and 12.9, and NVRTC 13.0).
WG_MIN_NVRTC = (12, 9)


def wgmma_available():
    """Whether the current device runs the sm_90a kernels (wgmma, TMA): sm_90a code runs on
    compute capability 9.0 only, and CuPy's NVRTC must build it (WG_MIN_NVRTC)."""
    return device_info().cc == 90 and nvrtc_version() >= WG_MIN_NVRTC


@functools.cache
def nvrtc_version():
    """The (major, minor) version of the NVRTC CuPy compiles with (cached)."""
    import cupy

    return tuple(cupy.cuda.nvrtc.getVersion())


# ---- sources and the compile cache -------------------------------------------------------------

def kernels_dir():
    """The kernels_cu/ folder: the installed copy (cuflash/kernels_cu) or the source tree's."""
    pkg = Path(__file__).resolve().parent
    for cand in (pkg / "kernels_cu", pkg.parent / "kernels_cu"):
        if (cand / "common.cuh").is_file():
            return cand
    raise FileNotFoundError(
        f"cuflash: CUDA sources not found in {pkg / 'kernels_cu'} or {pkg.parent / 'kernels_cu'}")


def _inline(path, seen):
    lines = []
    for line in path.read_text().splitlines():
        if _PRAGMA_ONCE.match(line):
            continue
        m = _INCLUDE.match(line)
        if m:
            inc = (path.parent / m.group(1)).resolve()
            if inc.is_file():
                if inc not in seen:  # every header is guarded by #pragma once
                    seen.add(inc)
                    lines.append(f"// ---- begin {m.group(1)}")
                    lines.extend(_inline(inc, seen))
                    lines.append(f"// ---- end {m.group(1)}")
                continue
        lines.append(line)
    return lines


def source(filename):
    """The full text of kernels_cu/<filename> with its local includes inlined (memoized)."""
    with _lock:
        src = _sources.get(filename)
        if src is None:
            path = kernels_dir() / filename
            src = "\n".join(_inline(path, {path.resolve()})) + "\n"
            _sources[filename] = src
        return src


def get_function(filename, expr, arch=None):
    """The compiled RawKernel `expr` of kernels_cu/<filename> on the current device (memoized).
    arch: an NVRTC target to compile for instead of CuPy's default for the device ("sm_90a" for
    kernels with wgmma). CuPy appends its own -arch after it: NVRTC 12.9+ then builds sm_90a,
    earlier versions refuse two (WG_MIN_NVRTC)."""
    import cupy

    key = (cupy.cuda.Device().id, filename, expr, arch)
    with _lock:
        hit = _functions.get(key)
    if hit is not None:
        return hit[1]
    options = OPTIONS + ((f"-arch={arch}",) if arch else ())
    module = cupy.RawModule(code=source(filename), options=options, name_expressions=[expr])
    func = module.get_function(expr)
    if os.environ.get("CUFLASH_DEBUG", "") not in ("", "0"):
        a = func.attributes
        print(f"cuflash: {expr} on device {key[0]}: {a['num_regs']} registers, "
              f"{a['shared_size_bytes']} B static shared, {a['local_size_bytes']} B local, "
              f"max {a['max_threads_per_block']} threads/block", file=sys.stderr)
    with _lock:
        _functions.setdefault(key, (module, func))
        return _functions[key][1]


_FUNC = re.compile(r"Function properties for (\S+)")
_STACK = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")


def parse_ptxas_log(log):
    """{mangled kernel name: {'registers', 'stack', 'spill_stores', 'spill_loads'}} of a ptxas -v
    log."""
    info = {}
    current = None
    for line in log.splitlines():
        m = re.search(r"Compiling entry function '([^']+)'", line) or _FUNC.search(line)
        if m:
            current = info.setdefault(m.group(1), {})
            continue
        if current is None:
            continue
        m = _STACK.search(line)
        if m:
            current["stack"], current["spill_stores"], current["spill_loads"] = map(int, m.groups())
            continue
        m = re.search(r"Used (\d+) registers", line)
        if m:
            current["registers"] = int(m.group(1))
    return info


def resource_usage(filename, exprs, arch="sm_90a"):
    """{expr: ptxas resource dict} of name expressions of kernels_cu/<filename>, from one
    device-free NVRTC build for `arch` (a real architecture, so that NVRTC assembles the code)."""
    from cupy.cuda import compiler

    exprs = list(exprs)
    prog = compiler._NVRTCProgram(source(filename), filename, name_expressions=exprs)
    log = io.StringIO()
    _, mapping = prog.compile(OPTIONS + (f"-arch={arch}", "--ptxas-options=-v"), log)
    per_kernel = parse_ptxas_log(log.getvalue())
    # a function the kernels call (not inlined: lost_rows.cuh fwd_fix_rows_apart) has its own
    # stack frame and spills: the worst of them is counted against every kernel of the program
    entries = set(mapping.values())
    worst = {f: max([0] + [v.get(f, 0) for name, v in per_kernel.items() if name not in entries])
             for f in ("stack", "spill_stores", "spill_loads")}

    def with_calls(info):
        return {f: max(x, worst[f]) if f in worst else x for f, x in info.items()}
    return {e: with_calls(per_kernel.get(mapping[e], {})) for e in exprs}


# ---- buffers and tables ------------------------------------------------------------------------

def _poison(buf):
    if np.dtype(buf.dtype).name == "bfloat16":  # a quiet NaN, written as bits
        buf.view(np.uint16).fill(0x7FC0)
    else:
        buf.fill(np.nan)


def empty(shape, dtype):
    """An uninitialized device buffer; NaN-filled under override(poison=True)."""
    import cupy

    buf = cupy.empty(shape, dtype=dtype)
    if _overrides.poison:
        _poison(buf)
    return buf


def zeros(shape, dtype):
    """A zero-filled device buffer (a device fill: under stream capture, part of the graph)."""
    return _cupy().zeros(shape, dtype=dtype)


def _aligned(nbytes):
    return -(-nbytes // 256) * 256


def carving(*specs):
    """The carving of carve's specs (memoized), which `carved` turns into buffers."""
    return _carvings.build(specs, lambda: _carving(specs))


def carve(*specs):
    """Uninitialized device buffers carved from one allocation of CuPy's pool (a pool call and
    an ndarray cost microseconds each, and a small call's host time is what it costs: issue 17):
    per spec, a (shape, dtype) gives a C-contiguous ndarray, NaN-filled under
    override(poison=True), a (shape, dtype, strides) an ndarray of those byte strides (a dense
    layout: its elements fill prod(shape) consecutive ones), a (shape, dtype, POINTER) its
    MemoryPointer (a kernel-only buffer that
    the kernels must fill: poisoned the same), a byte count a MemoryPointer (a kernel-only
    workspace: kernels read pointers; never poisoned, like the flags and partials it holds, which
    the kernels read only where they wrote them)."""
    return carved(carving(*specs))


def carved(carving, bare=None):
    """The buffers of a carving (`_carving`): one allocation of CuPy's pool. `bare`: the index of
    a part given as its MemoryPointer although it has a shape (an output the caller drops: a
    forward's lse without return_lse, Problem.lse_unused; an ndarray costs a microsecond), as
    are the parts specified with POINTER (a kernel-only buffer); both NaN-filled like the arrays
    under override(poison=True)."""
    total, parts = carving
    return _parts(_cuda().alloc(total), parts, bare)


def _parts(mem, parts, bare):
    buffers = []
    for n, (at, shape, dtype, pointer, strides) in enumerate(parts):
        ptr = mem + at if at else mem
        if pointer or n == bare:
            if shape is not None and _overrides.poison:
                _poison(_cupy().ndarray(shape, dtype, memptr=ptr))
            buffers.append(ptr)
        else:
            buf = _cupy().ndarray(shape, dtype, ptr, strides)  # (positional: cheaper)
            if _overrides.poison:
                _poison(buf)
            buffers.append(buf)
    return buffers


_carvings = _memo.Memo(256)  # specs -> carving

STREAM_SCRATCH_MAX = 64 << 20  # bytes of scratch a stream keeps between calls (stream_scratch)


def stream_key():
    """The key of buffers that a thread's calls on the current stream share: (device, stream
    handle, thread). One thread's launches on one stream run in the order it enqueued them, and
    a call enqueues all of its launches before the thread's next call: buffers that only the
    launches of one call use are free again for the next. (The thread is part of the key since
    two threads' calls on one stream, the default one say, interleave their launches; it also
    tells apart the streams of the per-thread default stream's one handle.)"""
    return (current_device(), current_stream(), threading.get_ident())


class _StreamScratch:
    """One stream's scratch: an allocation that launches following each other on the stream
    reuse (none runs beside another), and the buffers of each carving in it."""

    def __init__(self, nbytes):
        self.buf = zeros((nbytes,), np.uint8)  # (made once: zeroed, like any cached state)
        self.mem = self.buf.data
        self.nbytes = nbytes
        self.parts = _memo.Memo(64)  # carving -> its buffers here

    def carved(self, carving):
        parts = self.parts.get(carving)
        if parts is None:
            assert all(part[3] for part in carving[1]), "stream scratch: pointers only"
            parts = _parts(self.mem, carving[1], None)
            self.parts.put(carving, parts)
        return parts


# stream_key() -> _StreamScratch; bounded (a caller may make a stream per call): a scratch that
# goes is freed to CuPy's pool for its stream, as a call's own allocation is, so the launches
# queued there still read it before any later allocation on that stream can take it
_stream_scratch = _memo.Memo(16)


def stream_scratch(carving):
    """The buffers of a carving of kernel-only buffers (the kernels write each before they read
    it), from the current stream's scratch: a repeated call allocates nothing. Under stream
    capture (a graph may replay beside this stream's launches), beyond STREAM_SCRATCH_MAX bytes
    and under override(poison=True), the carving's own allocation (`carved`)."""
    total = carving[0]
    if _capture.keeping or total > STREAM_SCRATCH_MAX or _overrides.poison:
        return carved(carving)
    scratch = per_stream(_stream_scratch, lambda s: s.nbytes >= total,
                         lambda: _StreamScratch(total))
    return scratch.carved(carving)


def per_stream(table, fits, make):
    """The entry of bounded memo `table` under the current stream_key(), made by make() when it
    is missing or not fits(entry). (No two threads share a key: no lock.)"""
    key = stream_key()
    entry = table.get(key)
    if entry is None or not fits(entry):
        entry = make()
        table.put(key, entry)
    return entry


POINTER = "pointer"  # a carve spec's third item: the buffer as its MemoryPointer (`carved`)


def _carving(specs):
    """(total bytes, [(byte offset, shape or None, dtype or None, as a pointer, strides or
    None)]) of carve's specs."""
    parts, at = [], 0
    for spec in specs:
        strides = None
        if isinstance(spec, (int, np.integer)):
            size, shape, dtype, pointer = int(spec), None, None, True
        else:
            shape, dtype = tuple(spec[0]), np.dtype(spec[1])
            size = math.prod(shape) * dtype.itemsize
            pointer = spec[2:] == (POINTER,)
            if spec[2:] and not pointer:
                strides = tuple(spec[2])
        parts.append((at, shape, dtype, pointer, strides))
        at += _aligned(size)
    return at, tuple(parts)


def outputs(p, *workspace):
    """A forward's out (p.out_shape, p.dtype) and lse (p.lse_shape, p.acc_dtype), C-contiguous
    (the kernels' (BH, Nq, Dv) and (BH, Nq)), then one MemoryPointer per workspace size in
    bytes, from one allocation (`carve`). Only small workspaces belong here (a forward's flags):
    the caller's out and lse keep the whole allocation alive."""
    return carved(output_carving(p, *workspace))


def output_carving(p, *workspace):
    """The carving of `outputs`, which `carved` turns into buffers (a path's prepared run keeps
    it)."""
    specs = ((p.out_shape, p.dtype), (p.lse_shape, p.acc_dtype)) + workspace
    if p.layout_key is None:
        return carving(*specs)
    return _output_carvings.build((p.layout_key,) + workspace, lambda: _carving(specs))


_output_carvings = _memo.Memo(256)  # (Problem.layout_key,) + workspace sizes -> carving


def carved_outputs(carving, p):
    """The buffers of an `output_carving` for p's call: out, lse, then the workspaces, lse as its
    bare MemoryPointer when the caller drops it (Problem.lse_unused: an ndarray costs a
    microsecond; the prepared forwards take this)."""
    return carved(carving, 1 if p.lse_unused else None)


_TABLE_CACHE_SIZE = 256
_TABLE_CACHE_MAX_BYTES = 1 << 20
_tables = {}


def on_device(host):
    """A device copy of a small host table, cached by content (a new one by `upload`): repeated
    calls with the same layout (the common case) reuse the copy."""
    if host.nbytes > _TABLE_CACHE_MAX_BYTES:
        return upload(host)
    key = (current_device(), host.dtype.str, host.shape, host.tobytes())
    table = _tables.get(key)
    if table is None:
        if len(_tables) >= _TABLE_CACHE_SIZE:
            _tables.pop(next(iter(_tables)))  # oldest first
        table = _tables[key] = upload(host)
    return table


def upload(host, pointer=False):
    """A new device copy of a host array, enqueued on the current stream without waiting for it
    (tests/test_gpu.py test_new_host_kv_lens_do_not_wait_for_the_stream), through one of
    `_staging`'s pinned buffers: cupy.asarray stages a copy too, at about three times the host
    time (measured: a token loop's lengths, issue 17). Beyond a buffer's size, and under CUDA
    graph capture, cupy.asarray (which refuses there: a captured copy would read the buffer
    again at every replay). `pointer`: the copy as a MemoryPointer (a kernel argument), not an
    ndarray."""
    cupy = _cupy()
    if not host.flags.c_contiguous:
        host = np.ascontiguousarray(host)
    n = host.nbytes
    if n == 0 or n > _STAGING_MAX_BYTES or capturing():
        out = cupy.asarray(host)
        return out.data if pointer else out
    with _lock:
        ring = _staging.setdefault(current_device(), [])
        if ring and ring[0][2].done:  # the oldest copy through the ring has run
            slot = ring.pop(0)
        elif len(ring) < _STAGING_BUFFERS:
            mem = cupy.cuda.alloc_pinned_memory(_STAGING_MAX_BYTES)
            slot = (mem, np.frombuffer(mem, np.uint8, _STAGING_MAX_BYTES),
                    cupy.cuda.Event(block=False, disable_timing=True))
        else:  # the stream is that many copies behind
            out = cupy.asarray(host)
            return out.data if pointer else out
        mem, staged, event = slot
        staged[:n] = host.reshape(-1).view(np.uint8)
        out = cupy.cuda.alloc(n) if pointer else cupy.empty(host.shape, host.dtype)
        stream = cupy.cuda.get_current_stream()
        (out if pointer else out.data).copy_from_host_async(ctypes.c_void_p(mem.ptr), n, stream)
        event.record(stream)
        ring.append(slot)
    return out


# device -> [(pinned buffer, a uint8 view of it, the event after its last copy)], oldest copy
# first: `upload`'s staging buffers, each reused once its copy has run
_staging = {}
_STAGING_BUFFERS = 64
_STAGING_MAX_BYTES = 1 << 14


# ---- CUDA graph capture ------------------------------------------------------------------------
# A captured call's kernels read and write its buffers at every replay, long after the call has
# returned and dropped its temporaries (workspaces, flags, dq accumulators, the clamped kv_lens):
# those must not go back to CuPy's pool, which would hand them to other arrays. So while the
# current stream captures, every allocation of the call is kept here, until
# cuflash.release_graph_memory().
_graph_memory = []


NULL_CONTEXT = contextlib.nullcontext()


def graph_safe(x):
    """The context of a public call's body on array x: under CUDA stream capture, its
    allocations are kept for the graph (the calls' device tables must exist already: capture
    after one call of the same layout, as cupy.cuda.Graph requires of any host-to-device copy).
    Outside capture a null context (the common case costs no generator: issue 17's host time).
    The legacy default stream (pointer 0) never captures."""
    if not type(x).__module__.startswith("cupy") or not capturing():
        return NULL_CONTEXT
    return _keeping_allocations()


def capturing():
    """Whether the current CuPy stream is capturing a CUDA graph (then no host-to-device copy may
    be enqueued: a call must find its device tables made)."""
    stream = _cuda().get_current_stream()
    return stream.ptr != 0 and stream.is_capturing()


def current_device():
    """The current CUDA device's number."""
    return _cuda().runtime.getDevice()


def current_stream():
    """The current CuPy stream's handle (0: the legacy default stream)."""
    return _cuda().get_current_stream().ptr


def device_of(x):
    """The context that makes CuPy array x's device current: a null one when it is already
    (entering a cupy.cuda.Device costs a microsecond of a small call's host time) and for a
    NumPy array."""
    if isinstance(x, np.ndarray):
        return NULL_CONTEXT
    import cupy

    dev = x.data.device_id
    return NULL_CONTEXT if dev == cupy.cuda.runtime.getDevice() else cupy.cuda.Device(dev)


@contextlib.contextmanager
def _keeping_allocations():
    import cupy

    alloc = cupy.cuda.get_allocator()

    def keeping(size):
        mem = alloc(size)
        with _lock:
            _graph_memory.append(mem)
        return mem

    before, _capture.keeping = _capture.keeping, True
    try:
        with cupy.cuda.using_allocator(keeping):
            yield
    finally:
        _capture.keeping = before


class _Capture(threading.local):
    """keeping: this thread's public call runs under stream capture (graph_safe): besides its
    allocations, every array a Launch passes is kept (`Launch`)."""
    keeping = False


_capture = _Capture()


def capture_keeping():
    """Whether this thread's public call runs under stream capture (graph_safe)."""
    return _capture.keeping


def keep_captured(args):
    """Under capture (graph_safe), keep the device arrays and pointers among a launch's
    arguments until release_graph_memory(): a graph reads them at every replay, also those that
    the call did not allocate (a plan's tables, a copy of host lengths, a cached table), which
    the caches that hold them may drop before the graph is gone. Every launch calls it (Launch,
    `launch`)."""
    if _capture.keeping:
        kinds = (_cupy().ndarray, _cuda().MemoryPointer)
        with _lock:
            _graph_memory.extend(x for x in args if isinstance(x, kinds))


def launch(kern, grid, block, args, shared_mem=0):
    """A RawKernel call of a few arguments (the generic kernels, the sinks' rows), its arguments
    kept under capture (keep_captured)."""
    keep_captured(args)
    kern(grid, block, args, shared_mem=shared_mem)


def release_graph_memory():
    """Give back the memory kept for captured graphs (see graph_safe); returns the bytes of the
    allocations made while capturing (the arrays kept with them are the caller's or cuflash's
    tables)."""
    with _lock:
        made = {id(m.mem): m.mem for m in _graph_memory if getattr(m, "mem", None) is not None}
        _graph_memory.clear()
    return sum(mem.size for mem in made.values())


# ---- kernel arguments --------------------------------------------------------------------------

def offset_table(p):
    """(table, strides) of a Problem on the host: the kernels' int64 offset table (5, BH), rows
    q, k, v, mask, bias (DESIGN.md "Kernel ABI"; zeros where absent), and the row strides of q, k,
    v with the (row, column) strides of mask and bias (0 where absent), in elements."""
    BH = p.BH
    table = np.zeros((5, BH), dtype=np.int64)
    table[0], table[1], table[2] = (m.reshape(BH) for m in (p.q_map, p.k_map, p.v_map))
    strides = [element_strides(x)[-2] for x in (p.q, p.k, p.v)]
    for row, x in ((3, p.mask), (4, p.bias)):
        st = (0, 0) if x is None else element_strides(x)
        if x is not None:
            table[row] = _broadcast.lead_offsets(p.lead, p.lead, st[:-2]).reshape(BH)
        strides += st[-2:]
    return table, tuple(strides)


# The kernels' AttnArgs (kernels_cu/args.cuh), field by field in its order and C types: the
# strides (int64), the sizes (int32), the scale (double), the window (int32), the transforms'
# scalars (double) and per-head table (a device pointer, 0: null).
ARGS_FIELDS = (tuple((f"{x}_{s}", "<i8") for x, s in (("q", "rs"), ("k", "rs"), ("v", "rs"),
                                                    ("mask", "rs"), ("mask", "cs"),
                                                    ("bias", "rs"), ("bias", "cs")))
               + tuple((x, "<i4") for x in ("BH", "Nq", "Nk", "Dk", "Dv"))
               + (("scale", "<f8"),)
               + tuple((x, "<i4") for x in ("left", "right", "bottom_right"))
               + tuple((f"mod{k}", "<f8") for k in range(_modifiers.MOD_ARGS))
               + (("mod_table", "<u8"),))
ARGS_DTYPE = np.dtype(list(ARGS_FIELDS), align=True)  # C's layout: fields on natural alignment
# kernels_cu/philox.cuh DropoutArgs: the trailing parameter of the kernels instantiated with
# dropout (the seed, the counter's offset word, the keep threshold round(dropout_p 256) and the
# kept weights' factor 256 / (256 - threshold): cuflash/_dropout.py).
DROPOUT_FIELDS = (("seed", "<u8"), ("offset", "<u4"), ("threshold", "<u4"), ("rscale", "<f8"))
DROPOUT_DTYPE = np.dtype(list(DROPOUT_FIELDS), align=True)


def dropout_args(p):
    """The trailing kernel parameters of p's dropout: (DropoutArgs,) as a NumPy structured scalar
    (this call's seed and offset), or () without dropout (the kernels then take none). One
    object per (dropout_p, seed, offset), memoized: a call's launches share it, and a Launch
    rewrites its bytes only when the object changes."""
    if not p.dropout_p:
        return ()
    key = (p.dropout_p, p.dropout_seed)
    return _dropout_structs.build(key, lambda: (_dropout_struct(*key),))


_dropout_structs = _memo.Memo(256)


def _dropout_struct(dropout_p, seed):
    a = np.zeros((), dtype=DROPOUT_DTYPE)
    a["seed"], a["offset"] = seed
    a["threshold"] = _dropout.threshold(dropout_p)
    a["rscale"] = _dropout.rscale(dropout_p)
    return a[()]


class Args:
    """The arguments shared by the main kernels of one Problem. `tail`: what the tensor-core and
    lost-row kernels take after their own tensors (kernels_cu/args.cuh): offsets, mask, bias,
    kv_lens (null where absent), then AttnArgs as a NumPy structured scalar (passed by value);
    `flat_tail(scale_type)`: the same with AttnArgs' fields one by one (the generic kernels).
    All but the mask and bias pointers depend on the layout only: built once per signature."""

    def __init__(self, p):
        self.p = p
        self.strides, self.offsets, self.kv_lens, a = _args_layouts.build(
            p.key, lambda: _args_layout(p))
        if p.lens_device is not None:  # a CuPy kv_lens: this call's, clamped on the device
            self.kv_lens = clamped_lens(p)
        table = _modifiers.table(p)
        if table is not None:  # this call's per-head table (ALiBi's slopes) in a copy of the
            a = np.array(a)      # layout's AttnArgs
            a["mod_table"] = table.data.ptr
            a = a[()]
        self.tail = (self.offsets, ptr(p.mask), ptr(p.bias), ptr(self.kv_lens), a)

    def parts(self):
        """(kv_lens, offsets, tail): no array of the caller's (`p` would keep them alive)."""
        return self.kv_lens, self.offsets, self.tail

    def flat_tail(self, scale_type):
        """The tail with AttnArgs' fields as separate scalars in its order (ATTN_ARGS_PARAMS, the
        generic kernels), the scale as `scale_type`."""
        a = self.tail[-1]
        return self.tail[:-1] + tuple(scale_type(a[name]) if name == "scale" else
                                      np.dtype(c_type).type(a[name])
                                      for name, c_type in ARGS_FIELDS)


_args_layouts = _memo.Memo(256)


class KeptArgs:
    """A prepared run's Args: a plain Problem's parts (Args.parts) are its layout's, kept from
    the first call; any other Problem's are made per call."""

    def __init__(self, p):
        self.kept = Args(p).parts() if p.plain else None

    def __call__(self, p):
        """(kv_lens, offsets, tail) of p."""
        return Args(p).parts() if self.kept is None else self.kept


def _args_layout(p):
    """(strides, offsets table on the device, kv_lens on the device or None, AttnArgs)."""
    table, strides = offset_table(p)
    kv_lens = None if p.kv_lens is None else on_device(p.kv_lens.reshape(p.BH))
    a = np.zeros((), dtype=ARGS_DTYPE)
    for (name, _), s in zip(ARGS_FIELDS, strides):
        a[name] = s
    for name in ("BH", "Nq", "Nk", "Dk", "Dv", "scale", "left", "right"):
        a[name] = getattr(p, name)
    a["bottom_right"] = bool(p.bottom_right)
    for k, value in enumerate(_modifiers.scalars(p)):
        a[f"mod{k}"] = value
    return strides, on_device(table), kv_lens, a[()]


def rows_of_16_bytes(p):
    """Whether q, k and v are read as rows of 16-byte vectors, as every tensor-core kernel does:
    unit innermost stride, row strides and matrix offsets multiples of 16 bytes, aligned bases."""
    epc = 16 // p.dtype.itemsize  # elements per 16 bytes
    for x, offsets in ((p.q, p.q_map), (p.k, p.k_map), (p.v, p.v_map)):
        strides = element_strides(x)
        if strides[-1] != 1 or strides[-2] % epc or x.data.ptr % 16 or np.any(offsets % epc):
            return False
    return True


def ptr(a):
    return NULL if a is None else a


# Set by the tests (tests/conftest.py): every Launch call re-packs its layout's parameters and
# checks them against the first call's.
CHECK_LAUNCHES = os.environ.get("CUFLASH_CHECK_LAUNCHES", "") not in ("", "0")
# CUFLASH_PACKED_LAUNCH=0: every Launch goes through CuPy's RawKernel call instead (the same
# arguments, converted on each call)
PACKED_LAUNCH = os.environ.get("CUFLASH_PACKED_LAUNCH", "1") not in ("", "0")


class Launch:
    """One kernel launch of a layout's recipe: grid, block and dynamic shared memory fixed, the
    parameters packed once into the buffer cuLaunchKernel reads (through cupy.cuda.driver), so a
    repeated call writes only its arrays' addresses. (CuPy's RawKernel call converts every
    argument on every call: about 0.35 us each on the H200's host, beside the launch's own 5.)

    The arguments are CuPy arrays or memory pointers (the call's: their addresses are written
    each call), structured NumPy scalars (AttnArgs, which may hold a call's table address, and
    tensor maps: also written each call), and NumPy numbers, which belong to the layout: the
    first call's are kept. ``CHECK_LAUNCHES`` checks that every later call's are the same."""

    def __init__(self, kern, grid, block, shared_mem=0):
        self.kern = kern
        self.grid = tuple(grid) + (1,) * (3 - len(grid))
        self.block = tuple(block) + (1,) * (3 - len(block))
        self.shared_mem = int(shared_mem)
        self.lock = threading.Lock()
        self.fill = None  # writes a call's addresses into the buffer (_address_filler)
        self.structs = ()  # (argument index, byte offset, bytes) of the structured scalars

    @staticmethod
    def _layout(args):
        """(parameter bytes, [(index, byte offset, kind)]), kind: False / True for an array's /
        memory pointer's address, "struct" for a structured scalar, None for a number."""
        import cupy

        buf, slots = bytearray(), []
        for i, x in enumerate(args):
            if isinstance(x, (cupy.ndarray, cupy.cuda.MemoryPointer)):
                buf += bytes(-len(buf) % 8)
                slots.append((i, len(buf), not isinstance(x, cupy.ndarray)))
                buf += bytes(8)
            elif isinstance(x, np.generic):
                struct = isinstance(x, np.void)
                buf += bytes(-len(buf) % (16 if struct else x.dtype.alignment))
                slots.append((i, len(buf), "struct" if struct else None))
                buf += x.tobytes()
            else:
                raise TypeError(f"cuflash: kernel argument {i} of type {type(x).__name__}: a "
                                "CuPy array, memory pointer or NumPy scalar is expected")
        return bytes(buf), slots

    def _build(self, args):
        cuda = _cuda()
        self.packed, self.layout = self._layout(args)
        raw = bytearray(self.packed + bytes(-len(self.packed) % 8))
        self.buf = np.frombuffer(raw, dtype=np.uint64)  # (over `raw`: the driver reads it)
        base = self.buf.ctypes.data
        self.pointers = np.array([base + off for _, off, _ in self.layout], dtype=np.uint64)
        self.params = self.pointers.ctypes.data  # (a ctypes view per access costs a microsecond)
        self.fill = _address_filler(raw, [(i, off) for i, off, mp in self.layout
                                          if mp is True or mp is False], cuda.MemoryPointer)
        self.bytes = self.buf.view(np.uint8)
        self.structs = tuple((i, off, off + args[i].dtype.itemsize)
                             for i, off, mp in self.layout if mp == "struct")
        self.written = [args[i] for i, *_ in self.structs]  # the structs in the buffer
        self.head = (self.kern.kernel.ptr,) + self.grid + self.block + (self.shared_mem,)
        self.launch_kernel, self.current_stream = cuda.driver.launchKernel, cuda.get_current_stream

    def _check(self, args):
        packed, layout = self._layout(args)
        ends = [off for _, off, _ in layout[1:]] + [len(packed)]
        def kinds(layout):  # (an array or a memory pointer: an address either way)
            return ["address" if mp is True or mp is False else mp for *_, mp in layout]
        if (len(packed) != len(self.packed) or kinds(layout) != kinds(self.layout)
                or any(packed[off:end] != self.packed[off:end]
                       for (_, off, mp), end in zip(layout, ends) if mp is None)):
            raise AssertionError(f"cuflash: a layout parameter of {self.kern.name} changed "
                                 "between two calls of one recipe")

    def __call__(self, args):
        if _capture.keeping:  # (keep_captured)
            keep_captured(args)
        if not PACKED_LAUNCH:  # (a workspace's MemoryPointer passed as its address)
            pointer = _cuda().MemoryPointer
            args = tuple(np.uint64(x.ptr) if isinstance(x, pointer) else x for x in args)
            self.kern(self.grid, self.block, args, shared_mem=self.shared_mem)
            return
        with self.lock:
            if self.fill is None:
                self._build(args)
            elif CHECK_LAUNCHES:
                self._check(args)
            self.fill(args)
            for n, (i, start, end) in enumerate(self.structs):
                if args[i] is not self.written[n]:  # (a layout's AttnArgs is one object)
                    self.bytes[start:end] = np.frombuffer(args[i].tobytes(), dtype=np.uint8)
                    self.written[n] = args[i]
            self.launch_kernel(*self.head, self.current_stream().ptr, self.params, 0)


def _address_filler(raw, slots, pointer):
    """fill(args): writes the addresses of the arrays and memory pointers args[i] at byte offsets
    `off` of `raw` for (i, off) in slots, one struct.pack_into per run of adjacent 8-byte words:
    a generated function, with no loop and no NumPy store per slot (a small call's host time is
    its cost: issue 17; RESULTS thirty-sixth section). A slot takes an array or a memory pointer,
    whichever a call passes (a forward's lse is either, Problem.lse_unused)."""
    runs = []  # [byte offset, [argument indices]]
    for i, off in slots:
        if runs and runs[-1][0] + 8 * len(runs[-1][1]) == off:
            runs[-1][1].append(i)
        else:
            runs.append([off, [i]])
    used = sorted({i for i, _ in slots})
    lines = ["def fill(args):", "    pass"]
    if used:
        lines.append(f"    {', '.join(f'a{i}' for i in used)}, = "
                     f"{', '.join(f'args[{i}]' for i in used)},")
    names = {"raw": raw, "MP": pointer}
    for r, (off, indices) in enumerate(runs):
        names[f"pack{r}"] = struct.Struct(f"<{len(indices)}Q").pack_into
        values = ", ".join(f"a{i}.ptr if a{i}.__class__ is MP else a{i}.data.ptr"
                           for i in indices)
        lines.append(f"    pack{r}(raw, {off}, {values})")
    exec("\n".join(lines), names)  # (its source: the offsets and indices above, no input)
    return names["fill"]


@functools.cache
def _cupy():
    """cupy (imported once: an import statement per launch costs a small call's time)."""
    import cupy

    return cupy


def _cuda():
    return _cupy().cuda


def bh_grid(tiles, BH):
    """(x, y, z): x = tile index, y * z >= BH (the kernels flatten bh = z * gridDim.y + y)."""
    y = min(BH, MAX_GRID_Y)
    z = -(-BH // y)
    if tiles > MAX_GRID_X or z > MAX_GRID_Y:
        raise ValueError(f"problem too large for one launch: {tiles} tiles x {BH} batch*heads")
    return (tiles, y, z)


def opt_in(kern, smem, limit=_config.SMEM_DEFAULT_LIMIT):
    """Raise the kernel's dynamic shared-memory limit once it needs more than `limit` bytes
    (default 48 KiB, above which CUDA asks for the opt-in)."""
    if smem > limit and _smem_set.get(id(kern), 0) < smem:
        kern.max_dynamic_shared_size_bytes = smem
        _smem_set[id(kern)] = smem
