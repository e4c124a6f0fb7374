"""Every kernel instantiation the package can request compiles with NVRTC, without a GPU.

Runs in CI (no device): NVRTC assembles for real architectures (sm_80, sm_90a) and its ptxas report
(`--ptxas-options=-v`) gives registers, stack frame and spill bytes per kernel. The hot kernels
(forward and backward, HEAD_DIM <= 128) must not spill or use a stack frame. One NVRTC program per
(source file, architecture) compiles all of its instantiations at once; the programs build in
parallel, one process per CPU (the largest first), when the first test asks for one.
"""
import atexit
import itertools
import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor

import pytest

pytest.importorskip("cupy")
compiler = pytest.importorskip("cupy.cuda.compiler")

from cuflash import _config, _decode, _generic, _gpu, _mma_fwd, _runtime  # noqa: E402

ARCHS = ("sm_80", "sm_90a")
NO_SPILL_MAX_HEAD_DIM = 128
INSTANTIATIONS = _gpu.instantiations()  # the catalog: every path's instantiations()
CC90_ONLY = _gpu.cc90_only_instantiations()
CC80_ONLY = _gpu.cc80_only_instantiations()

_builds = {}  # (filename, arch) -> a future of _build's result


def _exprs(filename):
    """The catalog's name expressions of one source file."""
    return [e for *_, f, e in INSTANTIATIONS if f == filename]


def _build(filename, exprs, arch):
    """One NVRTC program's ptxas report, or the compiler's log as a string (an exception raised in
    a worker process need not survive the trip back)."""
    try:
        return _runtime.resource_usage(filename, exprs, arch)
    except compiler.CompileException as exc:
        return str(exc)


def _start_builds(items):
    """The (file, arch) programs that the session's selected tests use, submitted at once to a
    pool of one process per CPU."""
    wanted = {(i.callspec.params["filename"], i.callspec.params["arch"]) for i in items
              if getattr(i, "originalname", None) == "test_compiles_without_spills"}
    by_file = {f: _exprs(f) for f in {f for *_, f, _ in INSTANTIATIONS}}
    pool = ProcessPoolExecutor(max_workers=max(1, len(os.sched_getaffinity(0))),
                               mp_context=multiprocessing.get_context("spawn"))
    atexit.register(pool.shutdown, cancel_futures=True)
    for f, exprs in sorted(by_file.items(), key=lambda item: -len(item[1])):
        for arch in ARCHS:
            if (f, arch) in wanted:
                _builds[(f, arch)] = pool.submit(_build, f, exprs, arch)


def _usage(filename, arch, items):
    """{expr: ptxas resource dict} for every instantiation of `filename` (compiled once per arch;
    `items`: the session's tests)."""
    if not _builds:
        _start_builds(items)
    future = _builds.get((filename, arch))
    result = (future.result() if future is not None
              else _build(filename, _exprs(filename), arch))  # (not selected: here)
    if isinstance(result, str):
        pytest.fail(f"NVRTC failed for {filename} on {arch}:\n{result}")
    return result


def test_instantiation_table_is_complete():
    kernels = {k for k, *_ in INSTANTIATIONS}
    assert kernels == {"fwd", "bwd_preprocess", "bwd_dkdv", "bwd_dq", "fwd_mma", "fwd_wgmma", "fwd_wide", "bwd_wide_dkdv", "bwd_wide_dq",
                       "decode_split", "decode_split_paged", "fwd_lost_rows", "decode_tc",
                       "decode_tc_paged", "bwd_mma_prep", "bwd_mma_dkdv",
                       "bwd_mma_dkdv_grid", "bwd_mma_dq",
                       "bwd_lost_rows", "bwd_lost_keys", "mask_tile_classes",
                       "sink_join_rows", "sink_row_dot", "tf32_operand"}
    assert len(INSTANTIATIONS) == len(set(e for *_, e in INSTANTIATIONS))
    for path in _gpu.PATHS:  # and the paths agree on the kernels they share (the lost rows')
        assert set(path.instantiations()) <= set(INSTANTIATIONS), path.NAME


@pytest.mark.parametrize("kernel,dtype,bucket", [(k, d, b) for k, d, b, _, _ in INSTANTIATIONS
                                                 if b and k in _generic.TILED_KERNELS])
def test_shared_memory_fits_sm80(kernel, dtype, bucket):
    acc = _config.c_types(dtype)[1]
    assert _generic.smem_bytes(kernel, acc, bucket) <= _config.SMEM_LIMIT_SM80


def test_source_is_self_contained():
    for filename in {f for *_, f, _ in INSTANTIATIONS}:
        src = _runtime.source(filename)
        assert "#include" not in src, f"{filename}: an include survived inlining"


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("kernel,dtype,bucket,filename,expr", INSTANTIATIONS,
                         ids=[e for *_, e in INSTANTIATIONS])
def test_compiles_without_spills(kernel, dtype, bucket, filename, expr, arch, request):
    info = _usage(filename, arch, request.session.items)[expr]
    assert "registers" in info, f"{expr}: no ptxas report for {arch}"
    if arch == "sm_80" and expr in CC90_ONLY:
        return  # requested on sm_90+ devices only (the TILES_CC90 of _mma_fwd, _wide)
    if arch == "sm_90a" and expr in CC80_ONLY:
        return  # requested below sm_90 only (the tiles _mma_fwd.TILES_CC90 replaces)
    if bucket is None or bucket <= NO_SPILL_MAX_HEAD_DIM:
        assert info["spill_stores"] == 0 and info["spill_loads"] == 0, f"{expr} on {arch}: {info}"
        assert info["stack"] == 0, f"{expr} on {arch}: {info}"


def test_wide_tiles_fit():
    """The wide forward's sm_80 tiles fit sm_80's shared memory, its sm_90 tiles sm_90's."""
    from cuflash import _wide
    for tiles, limit in ((_wide.TILES, _config.SMEM_LIMIT_SM80),
                         (_wide.TILES_CC90, 227 * 1024)):
        for (dt, bucket, _), t in tiles.items():
            assert _wide.smem_bytes(dt, t, bucket) <= limit, (dt, bucket)
    for table, limit in ((_wide.BWD_TILES, _config.SMEM_LIMIT_SM80),
                         (_wide.BWD_TILES_CC90, 227 * 1024)):
        for (dt, bucket, _), tiles in table.items():
            assert max(_wide.bwd_smem_bytes(dt, tiles, bucket)) <= limit, (dt, bucket)


def test_decode_tc_fits_sm80():
    for bucket in _decode.TC_HEAD_DIMS:
        assert _decode.tc_smem_bytes(bucket) <= _config.SMEM_LIMIT_SM80


@pytest.mark.parametrize("head_dim,has_mb", sorted(_mma_fwd.TILES))
def test_tensor_core_tiles_fit_sm90(head_dim, has_mb):
    """Tiles that exceed sm_80's 163 KiB are only taken where the device allows (_mma_fwd.takes)."""
    assert _mma_fwd.smem_bytes(head_dim, has_mb) <= 227 * 1024


def test_wgmma_float32_tiles_fit_sm90():
    """The float32 Hopper forward's tiles (float32 Q, K and V^T) fit sm_90's 227 KiB."""
    from cuflash import _wgmma_fwd
    tiles = list(_wgmma_fwd.F32_TILES.items()) + list(_wgmma_fwd.F32_MB_TILES.items())
    for (dims, passes), tile in tiles:
        parts = 2 if passes == 3 else 1  # (hi and lo tiles)
        assert _wgmma_fwd.smem_bytes(dims, tile, _wgmma_fwd.MB_NONE, 4 * parts) <= 227 * 1024, \
            (dims, passes)


def test_wgmma_backward_tiles_fit_sm90():
    """Every wgmma dK/dV tile the backward can request (plain, mask / bias, dQ on wgmma, the
    dbias twins, GQA's OPT_GROUP) fits sm_90's 227 KiB of opt-in shared memory: dkdv_tile takes
    a tile only where it fits, so a tile that outgrew it (the dQ block of DQ_BULK added 34 KiB
    at D=128) would silently fall back to a slower kernel."""
    from cuflash import _mma_bwd
    for dims in _mma_bwd.DKDV_TILES_WG:
        tiles = [_mma_bwd.wg_tile(dims, mb, atomic, dropout, tf, bias)
                 for mb, atomic, dropout, tf, bias in itertools.product(
                     (False, True), (False, True), (False, True), _mma_bwd.TRANSFORMS[:2],
                     (False, True))]
        tiles += [_mma_bwd.dbias_tile(dims, atomic, True) for atomic in (True, False)
                  if dims not in _mma_bwd.DBIAS_DECLINED]
        tiles += [t._replace(opt=t.opt | _mma_bwd.OPT_GROUP) for t in tiles]
        for tile in tiles:
            assert tile.opt & _mma_bwd.OPT_WG, (dims, tile)
            assert _mma_bwd.dkdv_smem_bytes(dims, tile) <= 227 * 1024, (dims, tile)


def test_host_lens_struct_matches_its_host_mirror():
    """kernels_cu/decode.cu HostLens (the decode kernels' last parameter: host kv_lens by value)
    and cuflash._decode.HOST_LENS: HOST_LENS_MAX int64 lengths, the host's limit on the values
    it keeps (_validate.LENS_VALUES_MAX), 16-byte aligned as Launch places structs."""
    import re
    from cuflash import _decode, _validate
    src = (_runtime.kernels_dir() / "decode.cu").read_text()
    n = int(re.search(r"constexpr int HOST_LENS_MAX = (\d+);", src).group(1))
    assert re.search(r"struct alignas\(16\) HostLens \{\s*long long v\[HOST_LENS_MAX\];\s*\};",
                     src)
    assert n == _validate.LENS_VALUES_MAX
    assert _decode.HOST_LENS.itemsize == 8 * n and _decode.HOST_LENS["v"].shape == (n,)


def test_kernel_args_struct_matches_its_host_mirror():
    """kernels_cu/args.cuh AttnArgs, its flat form ATTN_ARGS_PARAMS and cuflash._runtime.ARGS_FIELDS:
    the same fields in the same order with the same C types (NumPy's aligned layout is then C's;
    Args.flat_tail passes the fields in this order)."""
    import re
    src = (_runtime.kernels_dir() / "args.cuh").read_text()
    body = re.search(r"struct AttnArgs \{(.*?)\};", src, re.S).group(1)
    c_types = {"const long long*": "<u8", "const unsigned char*": "<u8", "const void*": "<u8",
               "const double*": "<u8",
               "long long": "<i8", "int": "<i4", "double": "<f8"}
    fields = []
    for decl in re.sub(r"//[^\n]*", "", body).split(";"):
        decl = " ".join(decl.split())
        if not decl:
            continue
        ctype = next(t for t in sorted(c_types, key=len, reverse=True) if decl.startswith(t + " "))
        fields += [(name.strip(), c_types[ctype]) for name in decl[len(ctype):].split(",")]
    assert fields == list(_runtime.ARGS_FIELDS)
    flat = re.search(r"#define ATTN_ARGS_PARAMS\(Scale\)(.*?)\n\n", src, re.S).group(1)
    params = [" ".join(x.replace("\\", " ").split()).rsplit(" ", 1) for x in flat.split(",")]
    assert [(name, "<f8" if ctype == "Scale" else c_types[ctype]) for ctype, name in params] == \
        list(_runtime.ARGS_FIELDS)
