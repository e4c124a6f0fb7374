"""Find kernels_cu/, build the source text, compile one instantiation per request, memoize per device.

The source handed to NVRTC is self-contained: local ``#include "x.cuh"`` lines are inlined here,
so CuPy's disk cache (keyed on the source text and options) sees every header edit, and NVRTC needs
no include path. CuPy is imported lazily: this module imports on machines without CuPy.

``CUFLASH_DEBUG=1`` prints registers, static shared memory and local (spill) bytes of each kernel
the first time it is loaded on a device.
"""
import functools
import os
import re
import sys
import threading
from collections import namedtuple
from pathlib import Path

from . import _config

OPTIONS = ("-std=c++17",)
_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$')
_PRAGMA_ONCE = re.compile(r"^\s*#\s*pragma\s+once\s*$")

_lock = threading.Lock()
_sources = {}   # file name -> inlined source text
_device_infos = {}  # device id -> DeviceInfo

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
_functions = {}  # (device id, file name, name expression) -> (RawModule, RawKernel)


@functools.cache
def nvrtc_version():
    """The (major, minor) version of the NVRTC CuPy compiles with (cached)."""
    import cupy

    return tuple(cupy.cuda.nvrtc.getVersion())


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


def get_kernel(kernel, dtype, bucket=None, path="generic"):
    """The compiled RawKernel of one instantiation on the current device (compiled on first use)."""
    return get_function(_config.SOURCES[kernel], _config.name_expression(kernel, dtype, bucket, path))


def get_function(filename, expr, arch=None):
    """The compiled RawKernel `expr` of kernels_cu/<filename> on the current device (memoized).
    arch: an NVRTC target to compile for instead of CuPy's default for the device ("sm_90a" for
    kernels with wgmma). CuPy appends its own -arch after it: NVRTC 12.9+ then builds sm_90a,
    earlier versions refuse two (_tc_bwd.WG_MIN_NVRTC)."""
    import cupy

    key = (cupy.cuda.Device().id, filename, expr)
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


def _compile(filename, exprs, arch):
    """Device-free NVRTC build of `exprs` from one source file; returns (log, {expr: lowered name})."""
    import io

    from cupy.cuda import compiler

    prog = compiler._NVRTCProgram(source(filename), filename, name_expressions=list(exprs))
    log = io.StringIO()
    options = OPTIONS + (f"-arch={arch}", "--ptxas-options=-v")
    _, mapping = prog.compile(options, log)
    return log.getvalue(), mapping


def compile_ptx_log(expr, arch="sm_90a"):
    """Compile one name expression (or a list from one source file) for `arch` without a device and
    return NVRTC's program log, which includes the ptxas resource report (`--ptxas-options=-v`).
    Needs a real architecture (sm_80, sm_90a, ...) so that NVRTC assembles the code itself."""
    exprs = [expr] if isinstance(expr, str) else list(expr)
    return _compile(_source_of(exprs[0]), exprs, arch)[0]


def _source_of(expr):
    stem = expr.split("<", 1)[0].strip()
    for kernel, name in _config._KERNEL_NAMES.items():
        if name == stem:
            return _config.SOURCES[kernel]
    raise KeyError(f"unknown kernel in name expression {expr!r}")


_FUNC = re.compile(r"Function properties for (\S+)")
_STACK = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")


def parse_ptxas_log(log):
    """{mangled kernel name: {'registers', 'stack', 'spill_stores', 'spill_loads'}} from a ptxas -v log."""
    info = {}
    current = None
    for line in log.splitlines():
        m = re.search(r"Compiling entry function '([^']+)'", line)
        if m:
            current = info.setdefault(m.group(1), {})
            continue
        m = _FUNC.search(line)
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


def resource_usage(exprs, arch="sm_90a"):
    """{expr: ptxas resource dict} for name expressions that share one source file."""
    exprs = list(exprs)
    log, mapping = _compile(_source_of(exprs[0]), exprs, arch)
    per_kernel = parse_ptxas_log(log)
    return {e: per_kernel.get(mapping[e], {}) for e in exprs}
