"""A paged KV cache (``attention(..., block_table=...)``, ``paged_append``; README "Paged KV cache").

k and v are page pools (num_pages, Hkv, page_size, D) in cuflash's axis order (a FlashAttention /
vLLM cache (num_pages, page_size, Hkv, D) passed as ``.swapaxes(1, 2)``, read in place), and
``block_table[b, c]`` names the page that holds keys c * page_size ... (c + 1) * page_size - 1 of
sequence b: key j of sequence b is row j % page_size of page block_table[b, j // page_size].
The Problem (cuflash/_validate.py) carries the pools as k and v, the kv heads' offsets within a
page as k_map / v_map, Nk = max_pages * page_size, and the layout and table in ``pages``.

Who reads the pages:
- the split-KV decode path natively (`native`): kernels_cu/decode.cu's decode_split_paged and
  decode_tc_paged compute each key row's address from the table (cuflash/_decode.py);
- every other case (prefill with a cache, Nq beyond decode's limit, the NumPy path, a forced
  path) is the simplest correct thing: `gather` copies the pages into contiguous (B, Hkv, Nk, D)
  arrays, once per call, and the ordinary paths run on them.

Entries of the table are clamped to [0, num_pages - 1] wherever they are read (a CuPy table is
never checked: that would synchronize); a host table's entries that the lengths reach are checked
by make_problem. The append helper (`append`) writes new keys and values into the pages in place.
"""

import numpy as np

from . import _broadcast, _decode, _memo, _runtime
from ._validate import element_strides

_kernels = {}
_native = _memo.Memo(256)


def native(p):
    """Whether the decode kernels read this paged Problem's pages themselves: CuPy inputs that the
    split-KV path takes (its SUPPORT RULE but for the key count: gathering the cache would cost
    more than decoding it) and no test switch forcing another path. Memoized like the
    dispatcher's choice: by the signature, the switches and the arrays' alignments."""
    if p.xp is np:
        return False
    ov = _runtime.overrides()
    key = None if p.key is None else (p.key, ov) + tuple(x.data.ptr % 256 for x in (p.q, p.k, p.v))
    return _native.build(key, lambda: ov.path in (None, _decode.NAME) and _decode.takes(p)
                         and (_decode.DROPOUT or not p.dropout_p))


def resolve(p):
    """The Problem a paged call runs: p itself where `native`, else p on the gathered keys."""
    return p if native(p) else gather(p)


def _table(p):
    """The block table on p's library, every entry clamped to [0, num_pages - 1]."""
    pg, xp = p.pages, p.xp
    if xp is np:
        return pg.table  # checked where read; the rest is 0
    with p.q.device:
        table = _runtime.on_device(pg.table) if pg.host else pg.table
        return xp.clip(table, 0, pg.num_pages - 1)


def gather(p):
    """p with its pages gathered into contiguous k (B, Hkv, Nk, Dk) and v (B, Hkv, Nk, Dv): an
    ordinary Problem (pages None) for every path. One copy of each pool's pages that the table
    names, on the current stream, without a synchronization."""
    xp, pg = p.xp, p.pages
    table = _table(p)
    B, Nk = table.shape[0], pg.max_pages * pg.page_size

    def keys(pool):
        x = xp.take(pool, table.reshape(-1), axis=0)  # (B * max_pages, Hkv, page_size, D)
        x = x.reshape((B, pg.max_pages) + pool.shape[1:]).transpose(0, 2, 1, 3, 4)
        return xp.ascontiguousarray(x).reshape(B, pool.shape[1], Nk, pool.shape[-1])

    with _runtime.device_of(p.q):
        k, v = keys(p.k), keys(p.v)
    new = object.__new__(type(p))
    new.__dict__.update(p.__dict__)
    new.k, new.v, new.pages, new.copied = k, v, None, False
    new.k_map, new.v_map = (_broadcast.lead_offsets(p.lead, x.shape[:-2], element_strides(x)[:-2])
                            for x in (k, v))
    new.key = None if p.key is None else (p.key, "gathered")
    return new


def append(a):
    """Write a checked append (cuflash/_validate.py check_append) into the pages, in place: token
    t of sequence b goes to position kv_lens[b] + t, row (kv_lens[b] + t) % page_size of page
    block_table[b, (kv_lens[b] + t) // page_size] (clamped to [0, num_pages - 1]); positions
    outside [0, max_pages * page_size) are not written."""
    if a.xp is np:
        pos = a.lens[:, None] + np.arange(a.n)[None, :]            # (B, n)
        inside = (pos >= 0) & (pos < a.capacity)
        b = np.broadcast_to(np.arange(a.B)[:, None], pos.shape)[inside]
        pos = pos[inside]
        page = np.clip(a.table[b, pos // a.page_size], 0, a.num_pages - 1)
        row = pos % a.page_size
        t = (pos - a.lens[b])
        for pool, new in ((a.k_pages, a.k_new), (a.v_pages, a.v_new)):
            pool[page, :, row, :] = new[b, :, t, :]
        return
    import cupy

    kernel = _kernels.get("append")
    if kernel is None:  # one thread per element of the new rows, moved as raw bits
        kernel = _kernels["append"] = cupy.ElementwiseKernel(
            "raw T x, raw int32 table, raw I lens, int64 table_rs, int64 n, int64 hkv, int64 d, "
            "int64 page_size, int64 capacity, int64 last_page, int64 ps, int64 hs, int64 rs",
            "raw T pool",
            """
            const long long c = i % d, t = (i / d) % n, h = (i / (d * n)) % hkv;
            const long long b = i / (d * n * hkv);
            const long long pos = static_cast<long long>(lens[b]) + t;
            if (pos >= 0 && pos < capacity) {
              long long page = table[b * table_rs + pos / page_size];
              page = page < 0 ? 0 : (page > last_page ? last_page : page);
              pool[page * ps + h * hs + (pos % page_size) * rs + c] = x[i];
            }
            """, "cuflash_paged_append")
    with a.k_pages.device:
        # host tables and lengths: device copies cached by content (a capture needs CuPy ones)
        table, lens = (_runtime.on_device(x) if isinstance(x, np.ndarray) else x
                       for x in (a.table, a.lens))
        _runtime.keep_captured((table, lens))
        for pool, new in ((a.k_pages, a.k_new), (a.v_pages, a.v_new)):
            if new.size == 0:
                continue
            bits = np.dtype(f"u{pool.dtype.itemsize}")
            src = cupy.ascontiguousarray(new).view(bits)
            ps, hs, rs, _ = element_strides(pool)
            kernel(src, table, lens, np.int64(a.table_rs), np.int64(a.n), np.int64(a.hkv),
                   np.int64(pool.shape[-1]), np.int64(a.page_size), np.int64(a.capacity),
                   np.int64(a.num_pages - 1), np.int64(ps), np.int64(hs), np.int64(rs),
                   _raw_view(pool, bits), size=src.size)


def _raw_view(pool, bits):
    """The pool's memory as `bits` elements from its base, for the raw output of the append
    kernel (which indexes it by the pool's own element strides)."""
    import cupy

    span = sum((s - 1) * st for s, st in zip(pool.shape, element_strides(pool))) + 1
    mem = cupy.ndarray((span,), dtype=pool.dtype, memptr=pool.data)
    return mem.view(bits)
