"""A paged KV cache (issue 17): attention(..., block_table=...) on every path against the float64
reference on the contiguous cache, which each test builds itself with NumPy indexing from the
pages; paged_append; the named errors; CUDA graphs.

Pages that no sequence names, and rows of a sequence's last page past its length, hold NaN: a
kernel that read them would give NaN rows."""
import numpy as np
import pytest

import cuflash
from helpers import BFLOAT16, check_forward, dtype_of, to_array, to_host

PAGE_SIZES = [16, 32, 64, 100, 256]


def make_cache(rng, B, Hkv, lens, page_size, Dk, Dv, max_pages=None, spare=3, unread=-1):
    """Host page pools (num_pages, Hkv, page_size, D) in float64, a shuffled int32 block table
    (B, max_pages) and the contiguous (B, Hkv, max_pages * page_size, D) keys and values it
    stands for (built here, page by page). Entries past a sequence's pages are `unread`; pages
    nobody names and rows past a length are NaN."""
    lens = np.asarray(lens)
    need = -(-lens // page_size)
    max_pages = max_pages or max(int(need.max()), 1)
    num_pages = int(need.sum()) + spare
    order = rng.permutation(num_pages)
    kp = np.full((num_pages, Hkv, page_size, Dk), np.nan)
    vp = np.full((num_pages, Hkv, page_size, Dv), np.nan)
    table = np.full((B, max_pages), unread, dtype=np.int64)
    K = np.full((B, Hkv, max_pages * page_size, Dk), np.nan)
    V = np.full((B, Hkv, max_pages * page_size, Dv), np.nan)
    used = 0
    for b in range(B):
        for c in range(int(need[b])):
            page = order[used]
            used += 1
            table[b, c] = page
            rows = min(page_size, int(lens[b]) - c * page_size)
            kp[page, :, :rows] = rng.standard_normal((Hkv, rows, Dk))
            vp[page, :, :rows] = rng.standard_normal((Hkv, rows, Dv))
            K[b, :, c * page_size:(c + 1) * page_size] = kp[page]
            V[b, :, c * page_size:(c + 1) * page_size] = vp[page]
    # the reference's dense products read every key: zeros where the pages hold NaN
    return kp, vp, table.astype(np.int32), np.nan_to_num(K), np.nan_to_num(V)


# ---- the NumPy path and the checks (no GPU) -----------------------------------------------------

@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("options", [{}, dict(causal=True), dict(softcap=5.0),
                                     dict(window=(40, 0), causal=True)], ids=str)
def test_paged_numpy_matches_reference(page_size, options, rng):
    """NumPy inputs gather the pages (cuflash/_paged.py) and run the CPU path: decode and a
    prefill chunk, GQA, uneven lengths (one empty), shuffled pages."""
    B, H, Hkv, Dk, Dv = 3, 4, 2, 16, 8
    lens = np.array([page_size * 2 + 5, 0, 3 * page_size - 1])
    kp, vp, table, K, V = make_cache(rng, B, Hkv, lens, page_size, Dk, Dv)
    for Nq in (1, 7):
        q = rng.standard_normal((B, H, Nq, Dk)).astype(np.float32)
        kf, vf = kp.astype(np.float32), vp.astype(np.float32)
        out, lse = cuflash.attention(q, kf, vf, block_table=table, kv_lens=lens,
                                     return_lse=True, **options)
        check_forward(out, lse, q, K.astype(np.float32), V.astype(np.float32),
                      kv_lens=lens[:, None], **options)


def test_paged_flash_attention_layout(rng):
    """A (num_pages, page_size, Hkv, D) cache (FlashAttention / vLLM) passed as swapaxes(1, 2),
    with q (B, Nq, H, D) as q.swapaxes(1, 2): read in place, the same result; kv_lens None is
    every page full."""
    B, H, Hkv, D, ps = 2, 4, 2, 8, 16
    kp, vp, table, K, V = make_cache(rng, B, Hkv, [32, 32], ps, D, D)
    fa_k, fa_v = (np.ascontiguousarray(x.swapaxes(1, 2)) for x in (kp, vp))
    q = rng.standard_normal((B, 3, H, D))
    out = cuflash.attention(q.swapaxes(1, 2), fa_k.swapaxes(1, 2), fa_v.swapaxes(1, 2),
                            block_table=table)
    ref = cuflash.reference.attention(q.swapaxes(1, 2), K, V)
    assert np.abs(out - ref).max() < 1e-12


def test_paged_per_sequence_lens_forms(rng):
    """kv_lens per sequence: (B,), (B, 1), a list and an int give one result."""
    kp, vp, table, K, V = make_cache(rng, 2, 1, [40, 40], 16, 8, 8)
    q = rng.standard_normal((2, 2, 1, 8))
    outs = [cuflash.attention(q, kp, vp, block_table=table, kv_lens=x)
            for x in (np.array([40, 40]), np.array([[40], [40]]), [40, 40], 40)]
    for o in outs[1:]:
        assert np.array_equal(o, outs[0])
    ref = cuflash.reference.attention(q, K[:, :, :40], V[:, :, :40])
    assert np.abs(outs[0] - ref).max() < 1e-12


def test_paged_append_numpy(rng):
    """paged_append writes row t of sequence b at position kv_lens[b] + t (across page ends, in
    shuffled pages) and nothing else; kv_lens is not advanced."""
    B, Hkv, Dk, Dv, ps = 3, 2, 8, 4, 16
    lens = np.array([15, 0, 40])
    kp, vp, table, K, V = make_cache(rng, B, Hkv, lens + 20, ps, Dk, Dv)
    n = 18
    k_new, v_new = rng.standard_normal((B, Hkv, n, Dk)), rng.standard_normal((B, Hkv, n, Dv))
    kp0, vp0 = kp.copy(), vp.copy()
    given = lens.copy()
    cuflash.paged_append(kp, vp, table, given, k_new, v_new)
    assert np.array_equal(given, lens)
    want_k, want_v = kp0.copy(), vp0.copy()
    for b in range(B):
        for t in range(n):
            pos = lens[b] + t
            want_k[table[b, pos // ps], :, pos % ps] = k_new[b, :, t]
            want_v[table[b, pos // ps], :, pos % ps] = v_new[b, :, t]
    assert np.array_equal(kp, want_k, equal_nan=True)
    assert np.array_equal(vp, want_v, equal_nan=True)


def test_paged_append_then_attention_numpy(rng):
    """A decode step as a loop runs it: append, advance the lengths, attend."""
    B, H, Hkv, D, ps = 2, 4, 2, 8, 32
    lens = np.array([30, 64])
    kp, vp, table, K, V = make_cache(rng, B, Hkv, lens + 1, ps, D, D, max_pages=3)
    k_new, v_new = rng.standard_normal((B, Hkv, 1, D)), rng.standard_normal((B, Hkv, 1, D))
    cuflash.paged_append(kp, vp, table, lens, k_new, v_new)
    lens = lens + 1
    q = rng.standard_normal((B, H, 1, D))
    out = cuflash.attention(q, kp, vp, block_table=table, kv_lens=lens)
    for b in range(B):
        Kb, Vb = K[b, :, :lens[b]].copy(), V[b, :, :lens[b]].copy()
        Kb[:, -1], Vb[:, -1] = k_new[b, :, 0], v_new[b, :, 0]
        ref = cuflash.reference.attention(q[b], Kb, Vb)
        assert np.abs(out[b] - ref).max() < 1e-12


def _small(rng):
    kp, vp, table, _, _ = make_cache(rng, 2, 2, [20, 33], 16, 8, 8, spare=1)
    q = rng.standard_normal((2, 4, 1, 8))
    return q, kp, vp, table


def _changed(args, change):
    """args with a test case's change: keyword values, or bad_entry=(b, c, value), the block
    table with entry (b, c) set to value."""
    change = dict(change)
    if "bad_entry" in change:
        b, c, value = change.pop("bad_entry")
        change["block_table"] = args["block_table"].copy()
        change["block_table"][b, c] = value
    return {**args, **change}


@pytest.mark.parametrize("change, error, message", [
    (dict(block_table=[[0, 1], [2, 3]]), TypeError, "block_table must be a numpy.ndarray"),
    (dict(block_table=np.zeros((2, 3), np.float32)), TypeError, "int32 or int64"),
    (dict(block_table=np.zeros((3, 3), np.int32)), ValueError, r"shape \(B, max_pages\)"),
    (dict(block_table=np.zeros(3, np.int32)), ValueError, r"shape \(B, max_pages\)"),
    (dict(q=np.zeros((2, 1, 8))), ValueError, r"q must have shape \(B, H, Nq, Dk\)"),
    (dict(k=np.zeros((6, 2, 16))), ValueError, "k must be a page pool"),
    (dict(v=np.zeros((6, 2, 32, 8))), ValueError, "the same pages"),
    (dict(k=np.zeros((6, 2, 8, 8)), v=np.zeros((6, 2, 8, 8))), ValueError, "at least 16"),
    (dict(k=np.zeros((6, 2, 16, 16))[..., ::2]), ValueError, "last axis must be contiguous"),
    (dict(kv_lens=[20, 49]), ValueError, r"kv_lens must lie in \[0, Nk\] = \[0, 48\]"),
    (dict(kv_lens=[1, 2, 3]), ValueError, "kv_lens must broadcast"),
    (dict(bad_entry=(1, 2, 6)), ValueError, r"block_table\[1, 2\] = 6"),
    (dict(bad_entry=(0, 0, -1)), ValueError, r"\[0, num_pages\) = \[0, 6\)"),
], ids=lambda x: str(x)[:30])
def test_paged_errors(change, error, message, rng):
    """Named errors before any work, the public function and the argument in the message."""
    q, kp, vp, table = _small(rng)
    args = _changed(dict(q=q, k=kp, v=vp, block_table=table, kv_lens=[20, 33]), change)
    with pytest.raises(error, match="attention: .*" + message):
        cuflash.attention(args.pop("q"), args.pop("k"), args.pop("v"), **args)


def test_paged_unread_entries_are_not_checked(rng):
    """Entries past a sequence's pages are never read: -1 there is no error (a host table with
    host lengths), and neither is a later column past the length."""
    q, kp, vp, table = _small(rng)
    assert table[0, 2] == -1  # sequence 0 has 20 keys: pages 0 and 1 of 3
    bad = table.copy()
    bad[0, 1] = 10**6  # column 1 holds keys 16-31: read for 20 keys, not for 16
    cuflash.attention(q, kp, vp, block_table=table, kv_lens=[20, 33])
    cuflash.attention(q, kp, vp, block_table=bad, kv_lens=[16, 33])
    with pytest.raises(ValueError, match=r"block_table\[0, 1\]"):
        cuflash.attention(q, kp, vp, block_table=bad, kv_lens=[17, 33])


def test_paged_backward_takes_no_block_table(rng):
    """The paged cache is for the forward: the backward and vjp do not take the keyword."""
    q, kp, vp, table = _small(rng)
    with pytest.raises(TypeError, match="block_table"):
        cuflash.attention_backward(q, q, kp, vp, q, q[..., 0], block_table=table)
    with pytest.raises(TypeError, match="block_table"):
        cuflash.attention_vjp(q, kp, vp, block_table=table)


@pytest.mark.parametrize("change, error, message", [
    (dict(kv_lens=None), TypeError, "kv_lens must be an int"),
    (dict(kv_lens=[0.5, 1.0]), TypeError, "kv_lens must hold integers"),
    (dict(kv_lens=[0, 1, 2]), ValueError, r"kv_lens must be an int or have shape \(B,\)"),
    (dict(kv_lens=[0, 47]), ValueError, r"kv_lens \+ n must lie in \[0, max_pages \* page_size\]"),
    (dict(kv_lens=[-1, 0]), ValueError, "kv_lens [+] n must lie"),
    (dict(k_new=np.zeros((2, 2, 2, 8), np.float32)), TypeError, "k_new must have k_pages' dtype"),
    (dict(k_new=np.zeros((2, 3, 2, 8))), ValueError, r"k_new must have shape \(B, Hkv, n, D\)"),
    (dict(v_new=np.zeros((2, 2, 3, 8))), ValueError, r"v_new must have shape"),
    (dict(block_table=np.zeros((2, 3), np.int16)), TypeError, "int32 or int64"),
    (dict(block_table=np.zeros((3, 3), np.int32)), ValueError, r"shape \(B, max_pages\)"),
    (dict(k_pages=np.zeros((6, 2, 8, 8)), v_pages=np.zeros((6, 2, 8, 8))), ValueError,
     "at least 16"),
    (dict(k_pages=[[0.0]]), TypeError, "k_pages must be a numpy.ndarray"),
    (dict(bad_entry=(1, 2, 9)), ValueError, r"block_table\[1, 2\] = 9"),
], ids=lambda x: str(x)[:30])
def test_paged_append_errors(change, error, message, rng):
    _, kp, vp, table = _small(rng)
    # (bad_entry: sequence 1 writes keys 33, 34, column 2)
    args = _changed(dict(k_pages=kp, v_pages=vp, block_table=table, kv_lens=[20, 33],
                         k_new=np.zeros((2, 2, 2, 8)), v_new=np.zeros((2, 2, 2, 8))), change)
    with pytest.raises(error, match="paged_append: .*" + message):
        cuflash.paged_append(**args)


# ---- the GPU ---------------------------------------------------------------------------------

GPU_DTYPES = ["float16", "float32"] + (["bfloat16"] if BFLOAT16 is not None else [])

# (name, H, Hkv, Nq, lens, Dk, Dv, options)
DECODE_CASES = [
    ("gqa-1", 8, 2, 1, [1500, 37, 0, 700], 128, 128, {}),
    ("gqa-3-causal", 8, 2, 3, [900, 600], 64, 64, dict(causal=True)),
    ("mqa-softcap", 4, 1, 2, [800, 1], 128, 128, dict(softcap=20.0)),
    ("d96-window", 4, 2, 1, [1100, 530], 96, 96, dict(window=(300, 0))),
]


def _device_cache(rng, case, page_size, dtype, **kwargs):
    import cupy
    _, H, Hkv, Nq, lens, Dk, Dv, options = case
    B = len(lens)
    kp, vp, table, K, V = make_cache(rng, B, Hkv, lens, page_size, Dk, Dv, **kwargs)
    dt = dtype_of(dtype)
    q = to_array(cupy, rng.standard_normal((B, H, Nq, Dk)), dt)
    # the contiguous reference cache of the dtype's values
    K, V = (to_host(to_array(cupy, x, dt)) for x in (K, V))
    return (q, to_array(cupy, kp, dt), to_array(cupy, vp, dt), table, K, V,
            np.asarray(lens), options)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("force", ["auto", "split", "split-simt"])
@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("case", DECODE_CASES, ids=[c[0] for c in DECODE_CASES])
def test_paged_decode(case, page_size, force, dtype, rng, override):
    """The decode kernels read the pages in place (decode_tc_paged for 16-bit D = 128,
    decode_split_paged otherwise; "split": small splits, many items per block; "split-simt":
    decode_split everywhere), with outputs NaN-poisoned first."""
    from cuflash import _paged, _validate
    override(path=None if force == "auto" else force, poison=True)
    q, kp, vp, table, K, V, lens, options = _device_cache(rng, case, page_size, dtype)
    p = _validate.make_problem(q, kp, vp, block_table=table, kv_lens=lens, **options)
    assert _paged.native(p)
    out, lse = cuflash.attention(q, kp, vp, block_table=table, kv_lens=lens, return_lse=True,
                                 **options)
    check_forward(out, lse, q, K, V, kv_lens=lens[:, None], **options)


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [16, 100])
@pytest.mark.parametrize("table_dtype", ["int32", "int64"])
def test_paged_decode_device_table_and_lens(page_size, table_dtype, rng, override):
    """A CuPy block table (int32 read in place, int64 converted on the device) and CuPy kv_lens:
    out-of-range lengths are clamped (-3: no key, beyond max_pages * page_size: every key), and
    so are table entries where read (10**6 reads the last page, -5 the first), as the
    docstring says."""
    import cupy
    override(poison=True)
    ps = page_size
    case = ("dev", 8, 2, 1, [7 * ps - 3, 3 * ps, 9 * ps], 128, 128, {})
    q, kp, vp, table, K, V, lens, _ = _device_cache(rng, case, ps, "float16", unread=0)
    given = np.array([-3, 3 * ps, 9 * ps + 9])
    host = np.clip(given, 0, 9 * ps)
    out, lse = cuflash.attention(q, kp, vp, block_table=cupy.asarray(table.astype(table_dtype)),
                                 kv_lens=cupy.asarray(given), return_lse=True)
    check_forward(out, lse, q, K, V, kv_lens=host[:, None])
    wild = table.astype(np.int64)
    wild[1, 0], wild[1, 1] = 10**6, -5
    clamped = np.clip(wild, 0, kp.shape[0] - 1).astype(np.int32)
    a = cuflash.attention(q, kp, vp, block_table=cupy.asarray(wild.astype(table_dtype)),
                          kv_lens=cupy.asarray(host))
    b = cuflash.attention(q, kp, vp, block_table=cupy.asarray(clamped), kv_lens=cupy.asarray(host))
    assert np.array_equal(to_host(a), to_host(b), equal_nan=True)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize("page_size", [16, 100])
@pytest.mark.parametrize("force", ["auto", "generic"])
def test_paged_prefill_gathers(force, page_size, dtype, rng, override):
    """Nq beyond decode's limit (a prefill chunk against the cache), and any forced path other
    than the split path: the pages are gathered, then the ordinary path runs."""
    from cuflash import _paged, _validate
    override(path=None if force == "auto" else force, poison=True)
    case = ("prefill", 4, 2, 40, [500, 61], 64, 64, dict(causal=True))
    q, kp, vp, table, K, V, lens, options = _device_cache(rng, case, page_size, dtype)
    p = _validate.make_problem(q, kp, vp, block_table=table, kv_lens=lens, **options)
    assert not _paged.native(p)
    out, lse = cuflash.attention(q, kp, vp, block_table=table, kv_lens=lens, return_lse=True,
                                 **options)
    check_forward(out, lse, q, K, V, kv_lens=lens[:, None], **options)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize("lens_on", ["host", "device"])
@pytest.mark.parametrize("table_on", ["host", "device32", "device64"])
def test_paged_append_cupy(table_on, lens_on, dtype, rng):
    """paged_append on CuPy pools equals the NumPy append, bit for bit; with device lengths a
    row that would land past the cache's capacity is not written."""
    import cupy
    B, Hkv, Dk, Dv, ps = 3, 2, 128, 64, 16
    lens = np.array([15, 0, 40])
    kp, vp, table, _, _ = make_cache(rng, B, Hkv, lens + 20, ps, Dk, Dv, unread=0)
    n = 18
    k_new, v_new = rng.standard_normal((B, Hkv, n, Dk)), rng.standard_normal((B, Hkv, n, Dv))
    dt = np.dtype(dtype)
    kh, vh, knh, vnh = (x.astype(dt) for x in (kp, vp, k_new, v_new))
    kd, vd = cupy.asarray(kh), cupy.asarray(vh)
    t = {"host": table, "device32": cupy.asarray(table),
         "device64": cupy.asarray(table.astype(np.int64))}[table_on]
    given = lens if lens_on == "host" else cupy.asarray(lens)
    cuflash.paged_append(kd, vd, t, given, cupy.asarray(knh), cupy.asarray(vnh))
    cuflash.paged_append(kh, vh, table, lens, knh, vnh)
    assert np.array_equal(to_host(kd), kh, equal_nan=True)
    assert np.array_equal(to_host(vd), vh, equal_nan=True)
    if lens_on == "device":  # capacity 4 pages * 16 = 64: sequence 2 writes 40..57 of them
        before = to_host(kd)
        cuflash.paged_append(kd, vd, t, cupy.asarray([0, 0, 60]),
                             cupy.asarray(knh[:, :, :8]), cupy.asarray(vnh[:, :, :8]))
        after = to_host(kd)
        assert table.shape[1] * ps == 64
        assert np.array_equal(after[table[2, 3], :, 12:], knh[2, :, :4])
        changed = ~np.all((after == before) | (np.isnan(after) & np.isnan(before)), axis=(1, 3))
        assert changed.sum() <= 2 * 8 + 4  # nothing outside the written rows


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [16, 64])
def test_paged_graph_replay(page_size, rng):
    """One decode step (paged_append, then attention on the pages) captured in a CUDA graph with
    a CuPy block table and kv_lens; each replay after new q, new rows, a new table and lens += 1
    gives the eager calls' result bit for bit."""
    import cupy
    case = ("graph", 8, 2, 1, [900, 1300], 128, 128, {})
    B, Hkv, D = 2, 2, 128
    q, kp, vp, table, _, _, lens, _ = _device_cache(rng, case, page_size, "float16",
                                                    max_pages=1400 // page_size + 2, unread=0,
                                                    spare=8)
    kp[cupy.isnan(kp)] = 0
    vp[cupy.isnan(vp)] = 0
    t = cupy.asarray(table)
    lens_d = cupy.asarray(lens)
    k_new, v_new = (to_array(cupy, rng.standard_normal((B, Hkv, 1, D)), np.float16)
                    for _ in "kv")

    def step():
        cuflash.paged_append(kp, vp, t, lens_d, k_new, v_new)
        return cuflash.attention(q, kp, vp, block_table=t, kv_lens=lens_d + 1,
                                 return_lse=True)

    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        step()
        stream.synchronize()
        cuflash.release_graph_memory()
        stream.begin_capture()
        try:
            captured = step()
        finally:
            graph = stream.end_capture()
        for trial in range(2):
            lens_d += 1
            q[...] = to_array(cupy, rng.standard_normal(q.shape), np.float16)
            k_new[...] = to_array(cupy, rng.standard_normal(k_new.shape), np.float16)
            t[1] = cupy.asarray(np.roll(table[1], trial + 1))  # a new page order, same pages
            kp_before, vp_before = kp.copy(), vp.copy()
            graph.launch(stream)
            got = [x.copy() for x in captured]
            kp[...], vp[...] = kp_before, vp_before
            want = step()
            stream.synchronize()
            for g, w in zip(got, want):
                assert np.array_equal(to_host(g), to_host(w), equal_nan=True), trial
        del graph
    assert cuflash.release_graph_memory() > 0


@pytest.mark.gpu
def test_paged_decode_never_synchronizes(rng):
    """A paged decode step with a CuPy table and kv_lens only enqueues work: under stream
    capture any synchronizing call or device-to-host copy raises."""
    import cupy
    case = ("sync", 32, 8, 1, [4000, 17, 0, 4096], 128, 128, {})
    q, kp, vp, table, _, _, lens, _ = _device_cache(rng, case, 16, "bfloat16"
                                                    if BFLOAT16 is not None else "float16",
                                                    unread=0)
    t, lens_d = cupy.asarray(table), cupy.asarray(lens)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        cuflash.attention(q, kp, vp, block_table=t, kv_lens=lens_d)
        stream.synchronize()
        lens_d += 1
        stream.begin_capture()
        try:
            cuflash.attention(q, kp, vp, block_table=t, kv_lens=lens_d)
        finally:
            stream.end_capture()
    cuflash.release_graph_memory()
