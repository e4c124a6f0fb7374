"""Standalone check of the split-KV decode path (kernels_cu/decode.cu via cuflash/_decode.py).

Stages (each in try/except; a failure prints FAIL and its traceback and the next stage runs):

  build    NVRTC compile for sm_80 and sm_90a with the ptxas report: registers / stack / spills
           of the hot instantiations (no GPU needed).
  host     NumPy emulation of the schedule (grouping, row tiles, extents, split items) plus the
           per-item softmax and the merge rule (with the kernels' workspace encoding of visibility
           and non-finite partials), against cuflash.reference (no GPU needed).
  correct  GPU: the kernels (fused and separate combine) on poisoned outputs against
           cuflash.reference (float64), all four dtypes, GQA / MQA / MHA, Nq in {1, 3, 16}, causal
           with both alignments, window, kv_lens (0 and uneven), mask, bias, strided K/V,
           D in {64, 128, 256, 80, 33}, Dk != Dv, forced small splits so that some splits are
           empty for some rows. Tolerance: error <= 2 x the error of rounding the exact result to
           the dtype + a floor per dtype (lse: absolute, per accumulator dtype).
  timing   GPU: Hq = 32, Hkv = 8, D = 128, bf16, Nq = 1, (B, L) in the issue's four shapes plus an
           uneven kv_lens batch; CUDA events, median of REPS after warm-up, two input sets rotated
           (512 MiB of K/V each, far above the 60 MiB L2), host preparation (the Plan) outside
           the timed region. KV bytes = 2 * B * Hkv * L * D * 2 (uneven: sum of the lengths).
           Peers on the same data: torch SDPA flash and cuDNN (enable_gqa), and the device copy
           bandwidth (cudaMemcpyAsync D2D, read + write bytes) measured in the same run.
           Also the candidates of cuflash._decode (VARIANTS kernels, SPLIT_RULES) listed in
           TIMING_VARIANTS, each first checked against today's kernel on the same inputs; the
           uneven batch is benchmarks/bench.py's (seed 0, 52.7 % of the keys valid). The host
           stage prints the schedules of these shapes (blocks, keys per block) per rule.

  trace    GPU: where one call's time goes (check_trace: a -DDECODE_TRACE build of decode_tc
           records per-block %globaltimer marks).
  hostcost GPU: host microseconds of one public decode call, cached Plan and growing kv_lens,
           with cProfile's top functions.

    PYTHONPATH=. python3 tools/decode_check.py                 # host, correct, timing (< 3 min)
    PYTHONPATH=. python3 tools/decode_check.py build host      # no GPU needed (build: ~2 min)
"""
import os
import sys
import time
import traceback

import numpy as np

# this checkout's cuflash, also when another copy is installed in the interpreter's environment
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

STAGES = ("build", "host", "correct", "timing", "scaling", "trace", "hostcost")
FAILS = []


def stage(name):
    def wrap(fn):
        def run(*a, **kw):
            t0 = time.time()
            print(f"== {name}", flush=True)
            try:
                result = fn(*a, **kw)
                print(f"== {name} done in {time.time() - t0:.1f} s", flush=True)
                return result
            except Exception:
                FAILS.append(name)
                print(f"FAIL stage {name}:", flush=True)
                traceback.print_exc()
                sys.stdout.flush()
        return run
    return wrap


# ---- build -------------------------------------------------------------------------------------

def build_exprs():
    from cuflash import _config, _decode

    exprs = []
    for dt in _config.supported_dtype_names():
        for b in _config.HEAD_DIM_BUCKETS:
            r = 1
            while r <= _decode.max_rows(dt, b):
                exprs.append(_decode.name_expression(dt, b, r, False, True))
                r *= 2
        exprs.append(_decode.name_expression(dt, 128, 4, True, True))
        exprs.append(_decode.name_expression(dt, 128, 4, False, False))
        exprs.append(_decode.combine_expression(dt, 4))
    # the tensor-core candidates (TC_VARIANTS of _decode, decode_tc), bf16 and fp16, D = 64 and 128
    exprs += [_decode.tc_expression(dt, b, name) for dt in ("bfloat16", "float16")
              for b in _decode.TC_HEAD_DIMS for name in _decode.TC_VARIANTS]
    return exprs


@stage("build")
def check_build(archs=("sm_80", "sm_90a")):
    from cuflash import _kernels

    exprs = build_exprs()
    bad = []
    for arch in archs:
        log, mapping = _kernels._compile("decode.cu", exprs, arch)
        info = _kernels.parse_ptxas_log(log)
        for e in exprs:
            r = info.get(mapping[e], {})
            spill = r.get("spill_stores", -1) + r.get("spill_loads", -1)
            flag = "" if spill == 0 and r.get("stack", 0) == 0 else "   <-- stack/spill"
            print(f"  {arch:7s} {e:58s} regs {r.get('registers')} stack {r.get('stack')} "
                  f"spill {r.get('spill_stores')}/{r.get('spill_loads')}{flag}")
            if spill != 0:
                bad.append((arch, e))
    if bad:
        raise AssertionError(f"register spills in {bad}")


# ---- host emulation ----------------------------------------------------------------------------

def emulate(p, capacity=64, split=None, rule=None, rows=None, block_keys=None):
    """The decode path's algorithm in float64 NumPy, from the Schedule tables alone (rows and
    block_keys: decode_tc's layout, 16 rows and its stage keys; default decode_split's), with the
    kernels' workspace encoding (kernels_cu/decode.cu "Results per item"): each partial's (max,
    sum) = (-inf, 0) for a row with no visible key in the item, (+inf, 0) for visible keys whose
    logits are all -inf (l == 0), (m, NaN) when a NaN reached l; the merge treats the first two
    as identities, and a row all of whose partials are identities is empty (0, -inf) unless one
    of them is (+inf, 0) (NaN, NaN)."""
    from cuflash import _decode
    from cuflash._validate import element_strides

    s = _decode.Schedule(p, capacity, split, rule, rows, block_keys)
    BH, Nq, Dv = p.BH, p.Nq, p.Dv
    flat = {}
    for name, x, mp in (("q", p.q, p.q_map), ("k", p.k, s.k_map), ("v", p.v, s.v_map)):
        st = element_strides(x)
        extent = 1 + sum((n - 1) * abs(t) for n, t in zip(x.shape, st))
        base = np.lib.stride_tricks.as_strided(x, shape=(extent,), strides=(x.itemsize,))
        flat[name] = (base.astype(np.float64), np.asarray(mp).reshape(BH), st[-2])

    def mat(name, off, n, d):  # rows of the matrix at element offset `off`
        base, _, rs = flat[name]
        idx = off + np.arange(n)[:, None] * rs + np.arange(d)[None, :]
        return base[idx]

    mask = None if p.mask is None else np.asarray(p.mask).reshape(BH, Nq, p.Nk)
    bias = None if p.bias is None else np.asarray(p.bias, dtype=np.float64).reshape(BH, Nq, p.Nk)
    n_items = s.items.shape[0]
    part_o = np.full((n_items, s.rows, Dv), np.nan)
    part_m = np.full((n_items, s.rows), np.nan)
    part_l = np.full((n_items, s.rows), np.nan)
    written = np.zeros((n_items, s.rows), dtype=bool)
    # in launch order, with the workspace slot of the kernels' items table
    assert sorted(s.launch.tolist()) == list(range(n_items))
    for tid, k0, k1, it, koff, voff in s.items_x():  # K / V as decode_tc reads
        g, tile, first, count = s.tiles[tid]
        keys = np.arange(k0, k1)  # this block's keys
        L = int(s.lens[s.groups[g, 0]])
        K = mat("k", koff, p.Nk, p.Dk)
        V = mat("v", voff, p.Nk, p.Dv)
        shift = L - Nq if p.bottom_right else 0
        for r in range(s.rows):
            rho = tile * s.rows + r
            if rho >= s.G * Nq or s.groups[g, rho % s.G] < 0:
                continue
            i, bh = rho // s.G, s.groups[g, rho % s.G]
            written[it, r] = True
            lo = max(i + shift - p.left, 0)
            hi = min(i + shift + p.right, L - 1)
            j = keys[(keys >= lo) & (keys <= hi)]
            qrow = mat("q", flat["q"][1][bh], Nq, p.Dk)[i]
            with np.errstate(invalid="ignore", over="ignore"):
                sc = (K[j] @ qrow) * p.scale
            vis = np.ones(j.size, dtype=bool)
            if mask is not None:
                vis &= mask[bh, i, j]
            if bias is not None:
                sc = sc + bias[bh, i, j]
                vis &= bias[bh, i, j] != -np.inf  # a NaN bias is visible
            if not vis.any():
                part_m[it, r], part_l[it, r] = -np.inf, 0.0  # identity; the row sees nothing here
                continue
            sc = np.where(vis, sc, -np.inf)
            fin = sc[~np.isnan(sc)]  # fmaxf leaves NaN out of the max; it reaches l below
            m = fin.max(initial=-np.inf)
            m_ref = 0.0 if m == -np.inf else m
            with np.errstate(invalid="ignore"):
                e = np.exp(sc - m_ref)
                l = e.sum()
                if l == 0:
                    part_m[it, r], part_l[it, r] = np.inf, 0.0  # identity, but the row sees keys
                    continue
                part_o[it, r] = e @ V[j] / l
            part_m[it, r] = m_ref if np.isfinite(m_ref) else 0.0
            part_l[it, r] = l
    out = np.full((BH, Nq, Dv), np.nan)
    lse = np.full((BH, Nq), np.nan)
    for tid, (g, tile, first, count) in enumerate(s.tiles):
        for r in range(s.rows):
            rho = tile * s.rows + r
            if rho >= s.G * Nq or s.groups[g, rho % s.G] < 0:
                continue
            i, bh = rho // s.G, s.groups[g, rho % s.G]
            ms, ls = part_m[first:first + count, r], part_l[first:first + count, r]
            assert written[first:first + count, r].all(), "a partial was never written"
            if np.all(ms == -np.inf):
                out[bh, i], lse[bh, i] = 0.0, -np.inf
                continue
            kept = np.isfinite(ms)  # not an identity
            if np.isnan(ls[kept]).any() or not kept.any():  # NaN, or visible keys but l == 0
                out[bh, i], lse[bh, i] = np.nan, np.nan
                continue
            M = ms[kept].max()
            w = np.where(kept, ls * np.exp(np.where(kept, ms, M) - M), 0.0)
            o = sum(w[k] * part_o[first + k, r] for k in range(count) if kept[k] and w[k] > 0)
            out[bh, i] = o / w.sum()
            lse[bh, i] = M + np.log(w.sum())
    return out.reshape(p.out_shape), lse.reshape(p.lse_shape), s


def rand(rng, shape, dtype=np.float32):
    return rng.standard_normal(shape).astype(dtype)


def case_inputs(xp, rng, c):
    """Arrays for one case dict; xp = numpy or cupy."""
    B, H, Hkv, Nq, Nk, Dk, Dv = (c[x] for x in ("B", "H", "Hkv", "Nq", "Nk", "Dk", "Dv"))
    dt = c.get("dtype", "float32")
    if dt == "bfloat16":
        import ml_dtypes
        dt = ml_dtypes.bfloat16
    q = rand(rng, (B, H, Nq, Dk))
    if c.get("strided"):  # (B, Nk, Hkv, D) storage viewed as (B, Hkv, Nk, D)
        k = rand(rng, (B, Nk, Hkv, Dk)).transpose(0, 2, 1, 3)
        v = rand(rng, (B, Nk, Hkv, Dv)).transpose(0, 2, 1, 3)
    else:
        k = rand(rng, (B, Hkv, Nk, Dk))
        v = rand(rng, (B, Hkv, Nk, Dv))
    opts = dict(causal=c.get("causal", False), align=c.get("align", "bottom-right"),
                window=c.get("window"))
    if c.get("kv_lens") is not None:
        opts["kv_lens"] = np.asarray(c["kv_lens"]).reshape(B, 1)
    if c.get("mask"):
        m = rng.random((B, H, Nq, Nk)) < 0.7
        m[0, 0, 0, :] = False  # one fully masked row
        opts["mask"] = m
    if c.get("bias"):
        b = rand(rng, (1, H, Nq, Nk)) * 0.5
        b[..., ::7] = -np.inf
        opts["bias"] = b

    def conv(x):
        if x is None or not hasattr(x, "dtype"):
            return x
        if x.dtype == np.float32:
            x = x.astype(dt)
        return xp.asarray(x) if xp is not np else x

    if c.get("strided"):  # convert the (B, Nk, Hkv, D) storage, then take the strided view
        k, v = (conv(np.ascontiguousarray(x.transpose(0, 2, 1, 3))).transpose(0, 2, 1, 3)
                for x in (k, v))
        q = conv(q)
    else:
        q, k, v = (conv(x) for x in (q, k, v))
    for key in ("mask", "bias"):
        if key in opts:
            opts[key] = xp.asarray(opts[key]) if xp is not np else opts[key]
    if "bias" in opts and xp is not np:
        opts["bias"] = opts["bias"].astype(np.float32)
    return q, k, v, opts


CASES = [
    # name, case dict
    ("gqa-nq1", dict(B=2, H=8, Hkv=2, Nq=1, Nk=1500, Dk=128, Dv=128)),
    ("gqa-nq1-causal-kvlens", dict(B=3, H=8, Hkv=2, Nq=1, Nk=2000, Dk=128, Dv=128, causal=True,
                                   kv_lens=[0, 1999, 700])),
    ("gqa-nq3-causal-br", dict(B=2, H=8, Hkv=2, Nq=3, Nk=1100, Dk=64, Dv=64, causal=True)),
    ("gqa-nq3-causal-tl", dict(B=2, H=8, Hkv=2, Nq=3, Nk=1100, Dk=64, Dv=64, causal=True,
                               align="top-left")),
    ("gqa-nq16-causal-br", dict(B=1, H=8, Hkv=2, Nq=16, Nk=900, Dk=128, Dv=128, causal=True)),
    ("gqa-nq16-window", dict(B=2, H=8, Hkv=2, Nq=16, Nk=1200, Dk=128, Dv=128, window=(300, 5),
                             kv_lens=[1200, 611])),
    ("mqa-nq3-window-tl", dict(B=1, H=6, Hkv=1, Nq=3, Nk=1000, Dk=256, Dv=256, causal=True,
                               align="top-left", window=(200, None))),
    ("mha-d80-uneven", dict(B=4, H=2, Hkv=2, Nq=1, Nk=1300, Dk=80, Dv=80,
                            kv_lens=[1, 1300, 513, 0])),
    ("gqa-dk96-dv64-strided", dict(B=2, H=4, Hkv=2, Nq=2, Nk=700, Dk=96, Dv=64, strided=True,
                                   causal=True)),
    ("gqa-d33-unaligned", dict(B=1, H=4, Hkv=2, Nq=1, Nk=800, Dk=33, Dv=33)),
    ("gqa-mask-bias", dict(B=2, H=4, Hkv=2, Nq=3, Nk=900, Dk=64, Dv=64, mask=True, bias=True,
                           causal=True)),
]


@stage("host")
def check_host():
    from cuflash import _decode, reference
    from cuflash._validate import make_problem

    rng = np.random.default_rng(1)
    # split rule and grouping units
    assert _decode.split_size([131072] * 8, 264, 32) * 33 >= 131072
    assert sum(-(-131072 // _decode.split_size([131072] * 8, 264, 32)) for _ in range(8)) <= 264
    g, G = _decode.group_heads(np.repeat(np.arange(4), 8), np.repeat(np.arange(4), 8),
                               np.full(32, 9))
    assert G == 8 and (g == np.arange(32).reshape(4, 8)).all()
    g, G = _decode.group_heads(np.zeros(4, int), np.zeros(4, int), np.array([3, 5, 3, 5]))
    assert G == 2 and sorted(map(tuple, g.tolist())) == [(0, 2), (1, 3)]
    for name, c in CASES:
        for split in (None, 64, 40, "balanced"):
            q, k, v, opts = case_inputs(np, rng, dict(c, dtype="float64"))
            p = make_problem(q, k, v, **opts)
            rule = split if split == "balanced" else None
            out, lse, s = emulate(p, split=None if rule else split, rule=rule)
            ro, rl = reference.attention(q, k, v, return_lse=True, **opts)
            err = float(np.max(np.abs(out - ro))) if out.size else 0.0
            with np.errstate(invalid="ignore"):
                lerr = float(np.max(np.abs(np.where(np.isinf(rl), 0, lse - rl)))) if lse.size else 0.0
            same_inf = bool(np.all(np.isinf(lse) == np.isinf(rl)))
            ok = err < 1e-10 and lerr < 1e-10 and same_inf
            print(f"  {'ok  ' if ok else 'FAIL'} {name:24s} split={str(split)[:4]:4s} "
                  f"S={s.split:5d} items={s.items.shape[0]:4d} G={s.G} rows={s.rows} "
                  f"err={err:.1e} lse={lerr:.1e}")
            if not ok:
                FAILS.append(f"host {name} split={split}")
    schedule_report()


def timing_problem(B, L, lens=None, dtype="bfloat16"):
    """A stand-in Problem of the timing stage's layout (B, HQ, 1, D) / (B, HKV, L, D), contiguous,
    for the host Schedule only (no arrays): bh -> kv head (bh // HQ) * HKV + (bh % HQ) // G."""
    import types

    import ml_dtypes

    bh = np.arange(B * HQ)
    kv = (bh // HQ) * HKV + (bh % HQ) // (HQ // HKV)
    dt = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
    return types.SimpleNamespace(
        BH=B * HQ, Nk=L, Nq=1, Dk=D, Dv=D, dtype=dt, mask=None, bias=None, k_map=kv * L * D,
        v_map=kv * L * D, kv_lens=None if lens is None else np.repeat(lens, HQ).reshape(B, HQ),
        left=L + 1, right=L + 1, bottom_right=True)


def uneven_lens(seed=0, B=32, L=8192):
    """benchmarks/bench.py's uneven batch: kv_lens uniform in [1, L], default_rng(seed)."""
    return np.random.default_rng(seed).integers(1, L + 1, size=B)


def schedule_report(sms=132, per_sm=2):
    """Blocks and keys per block of the timing shapes under the split rules (H200: 132 SMs; 2
    blocks per SM for today's kernel, 3 or 4 for the candidates), and the list-schedule end (in
    keys, + SPLIT_OVERHEAD_KEYS per block) that the "balanced" rule minimizes. No GPU needed."""
    from cuflash import _decode

    print(f"  schedules ({sms} SMs; end = greedy list schedule in keys incl. "
          f"{_decode.SPLIT_OVERHEAD_KEYS}/block):")
    shapes = [(f"{B}x{L}", timing_problem(B, L)) for B, L in SHAPES]
    lens = uneven_lens()
    shapes.append((f"uneven32x8192 ({lens.sum() / (32 * 8192):.3f} valid)",
                   timing_problem(32, 8192, lens)))
    full_end = {}
    for per in (per_sm, 3, 4):
        cap = sms * per
        for rule in ("waves", "balanced", "balanced-o64"):
            for name, p in shapes:
                s = _decode.Schedule(p, cap, None, rule)
                keys = s.items[:, 2] - s.items[:, 1]
                # tile order (the "waves" rule's launch) vs s.launch order (the other rules)
                end_t = _decode.list_schedule_end(keys + _decode.SPLIT_OVERHEAD_KEYS, cap)
                end = _decode.list_schedule_end(keys[s.launch] + _decode.SPLIT_OVERHEAD_KEYS, cap)
                full_end.setdefault((per, rule, name.split(" ")[0]), end)
                rel = ""
                if name.startswith("uneven"):
                    ref = full_end.get((per, rule, "32x8192"))
                    rel = f" x-end/full32x8192 {end / ref:.3f}" if ref else ""
                print(f"    cap {cap:4d} ({per}/SM) {rule:12s} {name:32s} S {s.split:6d} "
                      f"blocks {keys.size:5d} keys/block max {keys.max():6d} mean "
                      f"{keys.mean():7.0f} split tiles {int((s.tiles[:, 3] > 1).sum()):4d} "
                      f"end {end_t:6d} / x {end:6d}{rel}")


# ---- GPU correctness ---------------------------------------------------------------------------

def _err(a, b):
    a = np.asarray(a, dtype=np.float64)
    return float(np.max(np.abs(a - b))) if a.size else 0.0


_FLOORS = {"float16": 1e-3, "bfloat16": 8e-3, "float32": 1e-5, "float64": 1e-12}
_LSE_TOL = {"float16": 1e-4, "bfloat16": 1e-4, "float32": 1e-4, "float64": 1e-10}


def _score(plan, ref_o, ref_l, g_err, dtype):
    """Run a Plan and judge it against the float64 reference: (ok, out error, lse error, NaN seen).
    Tolerance: 2 x the error of rounding the exact result to the dtype (g_err) + a floor."""
    import cupy as cp

    o, l = plan.run()
    o = cp.asnumpy(o.astype(cp.float64)).reshape(ref_o.shape)
    l = cp.asnumpy(l).reshape(ref_l.shape)
    nan = bool(np.isnan(o).any() or np.isnan(l).any())
    err = _err(o, ref_o)
    inf_ok = bool(np.all(np.isinf(l) == np.isinf(ref_l)))
    lerr = _err(np.where(np.isinf(l), 0, l), np.where(np.isinf(ref_l), 0, ref_l))
    ok = (not nan) and err <= 2 * g_err + _FLOORS[dtype] and inf_ok and lerr <= _LSE_TOL[dtype]
    return ok, err, lerr, nan


@stage("correct")
def check_correct():
    import cupy as cp

    from cuflash import _decode, reference
    from cuflash._validate import make_problem

    rng = np.random.default_rng(2)
    all_dtypes = ("float16", "bfloat16", "float32", "float64")
    n_ok = n_all = 0
    for idx, (name, c) in enumerate(CASES):
        # every dtype on the first cases and the unaligned one; two dtypes elsewhere (compile time)
        dtypes = all_dtypes if idx < 4 or "unaligned" in name else \
            (("bfloat16", "float64") if idx % 2 else ("float16", "float32"))
        for dt in dtypes:
            try:
                q, k, v, opts = case_inputs(cp, rng, dict(c, dtype=dt))
                p = make_problem(q, k, v, **opts)
                if not _decode.fits(p):  # rows not whole 16-byte vectors: never this path's
                    print(f"  skip {name:24s} {dt:8s} (_decode.fits: the generic path takes it)")
                    continue
                ref_o, ref_l = reference.attention(q, k, v, return_lse=True, **opts)
                # baseline: the error of merely rounding the exact result to the dtype
                g_err = _err(ref_o.astype(q.dtype).astype(np.float64), ref_o)
                for fused in (True, False):
                    for split in (None, 64):
                        n_all += 1
                        plan = _decode.plan(p, fused=fused, poison=True, split=split,
                                            variant="simt")
                        ok, err, lerr, nan = _score(plan, ref_o, ref_l, g_err, dt)
                        tol = 2 * g_err + _FLOORS[dt]
                        n_ok += ok
                        if not ok or split is None and fused:
                            print(f"  {'ok  ' if ok else 'FAIL'} {name:24s} {dt:8s} "
                                  f"fused={int(fused)} S={plan.split:5d} items={plan.n_items:4d} "
                                  f"rows={plan.rows} err={err:.2e} (rounding {g_err:.2e}, tol "
                                  f"{tol:.1e}) lse={lerr:.1e} nan={nan} {plan.expr}")
                        if not ok:
                            FAILS.append(f"correct {name} {dt} fused={fused} split={split}")
            except Exception:
                n_all += 1
                FAILS.append(f"correct {name} {dt}")
                print(f"  FAIL {name} {dt}:")
                traceback.print_exc()
    # the tensor-core candidates (_decode.TC_VARIANTS, decode_tc) on every case they fit, bf16
    # (fp16 on the first two), fused and separate, default / forced-small / "balanced" splits
    runs = [(n, c, "bfloat16") for n, c in CASES] + [(n, c, "float16") for n, c in CASES[:2]]
    for name, c, dtype in runs:
        q, k, v, opts = case_inputs(cp, rng, dict(c, dtype=dtype))
        p = make_problem(q, k, v, **opts)
        if not _decode.tc_fits(p):
            print(f"  (tc: {name} does not fit)")
            continue
        ref_o, ref_l = reference.attention(q, k, v, return_lse=True, **opts)
        g_err = _err(ref_o.astype(q.dtype).astype(np.float64), ref_o)
        for variant in _decode.TC_VARIANTS:
            for split, rule in ((None, None), (64, None), (None, "balanced")):
                for fused in (True, False):
                    n_all += 1
                    try:
                        plan = _decode.plan(p, fused=fused, poison=True, split=split,
                                            variant=variant, split_rule=rule)
                        ok, err, _, _ = _score(plan, ref_o, ref_l, g_err, dtype)
                    except Exception:
                        traceback.print_exc()
                        ok, err, plan = False, float("nan"), None
                    n_ok += ok
                    if not ok or (split is None and rule is None and fused):
                        print(f"  {'ok  ' if ok else 'FAIL'} {name:24s} {dtype:8s} {variant:6s} "
                              f"fused={int(fused)} split={split} rule={rule} err={err:.2e} "
                              f"{plan.expr if plan else ''} per_sm={plan.per_sm if plan else ''}")
                    if not ok:
                        FAILS.append(f"correct {name} {dtype} {variant} fused={fused} "
                                     f"split={split} rule={rule}")
    # the public path, for the record (dispatch is the lead's; supports() is reported only)
    q, k, v, opts = case_inputs(cp, rng, dict(CASES[0][1], dtype="bfloat16"))
    print(f"  supports(gqa-nq1) = {_decode.supports(make_problem(q, k, v, **opts))}")
    print(f"  correctness: {n_ok}/{n_all} ok")


# ---- timing ------------------------------------------------------------------------------------

SHAPES = ((1, 131072), (8, 32768), (32, 8192), (64, 4096))
# (label, fused, waves, variant of _decode.TC_VARIANTS or "simt", split rule of
# _decode.SPLIT_RULES); the first is today's default and the reference output of the others
TIMING_VARIANTS = (
    ("auto", True, 1, None, None),
    ("tc16s2h1 sep", False, 1, "tc16s2h1", None),
)
# Timed before (the results are in cuflash/_decode.py's TC_VARIANTS comment): `timing all`.
OLD_TIMING_VARIANTS = (  # (the STAGES 3 / 4 tiles are gone: decode_tc needs STAGES == 2)
    ("simt", True, 1, "simt", None), ("simt bal", True, 1, "simt", "balanced"),
    ("tc16s2", True, 1, "tc16s2", None), ("tc16s2 bal", True, 1, "tc16s2", "balanced"),
    ("tc16s2 sep", False, 1, "tc16s2", None),
    ("tc16s2h", True, 1, "tc16s2h", "balanced"),
)
HQ, HKV, D = 32, 8, 128
REPS, WARM = 20, 5


SPIN_US = 400  # GPU spin before each timed call: the host's enqueue time stays out (as bench.py)
_spin = []


def _spin_kernel():
    import cupy as cp

    if not _spin:
        _spin.append(cp.RawKernel(r"""
extern "C" __global__ void spin(unsigned long long ns) {
  unsigned long long t0;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  for (;;) {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    if (t - t0 >= ns) break;
  }
}""", "spin"))
    return _spin[0]


def _time(fn, sets, reps=REPS, warm=WARM):
    """Median ms of fn(inputs) over reps, rotating input sets; warm-up first. A GPU spin before
    each call keeps host enqueue time (under SPIN_US) out of the measurement."""
    import cupy as cp

    spin = _spin_kernel()
    for i in range(warm):
        fn(sets[i % len(sets)])
    cp.cuda.get_current_stream().synchronize()
    times = []
    for i in range(reps):
        a, b = cp.cuda.Event(), cp.cuda.Event()
        x = sets[i % len(sets)]
        spin((1,), (1,), (np.uint64(SPIN_US * 1000),))
        a.record()
        fn(x)
        b.record()
        b.synchronize()
        times.append(cp.cuda.get_elapsed_time(a, b))
    return float(np.median(times))


def _copy_bw():
    import cupy as cp

    n = 1 << 30
    src = cp.empty(n, dtype=cp.uint8)
    src.fill(1)
    dst = cp.empty_like(src)
    ms = _time(lambda _: cp.cuda.runtime.memcpyAsync(dst.data.ptr, src.data.ptr, n, 3,
                                                     cp.cuda.get_current_stream().ptr), [None])
    return 2 * n / (ms * 1e-3)


def _read_bw():
    """A read-only stream for reference: 1 GiB of uint4 loads (grid-stride, 2 x 132 x 4 blocks of
    256 threads, 4 loads in flight per thread), xor-reduced to one word per thread."""
    import cupy as cp

    kern = cp.RawKernel(r"""
extern "C" __global__ void read_stream(const uint4* __restrict__ src, unsigned long long n,
                                       unsigned* __restrict__ sink) {
  unsigned acc = 0;
  const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
  unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
  for (; i + 3 * stride < n; i += 4 * stride) {
    uint4 a = __ldcs(src + i), b = __ldcs(src + i + stride), c = __ldcs(src + i + 2 * stride),
          d = __ldcs(src + i + 3 * stride);
    acc ^= a.x ^ a.y ^ a.z ^ a.w ^ b.x ^ b.y ^ b.z ^ b.w ^ c.x ^ c.y ^ c.z ^ c.w ^ d.x ^ d.y ^ d.z ^ d.w;
  }
  for (; i < n; i += stride) { uint4 a = __ldcs(src + i); acc ^= a.x ^ a.y ^ a.z ^ a.w; }
  sink[(unsigned long long)blockIdx.x * blockDim.x + threadIdx.x] = acc;
}""", "read_stream")
    nbytes = 1 << 30
    src = cp.ones(nbytes // 4, dtype=cp.uint32)
    blocks = 132 * 8
    sink = cp.empty(blocks * 256, dtype=cp.uint32)
    n = np.uint64(nbytes // 16)
    ms = _time(lambda _: kern((blocks,), (256,), (src, n, sink)), [None])
    return nbytes / (ms * 1e-3)


@stage("timing")
def check_timing():
    import cupy as cp
    import ml_dtypes

    from cuflash import _decode
    from cuflash._validate import make_problem

    try:
        import torch
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:
        torch = None
    bf16 = ml_dtypes.bfloat16
    rng = np.random.default_rng(3)
    copy = _copy_bw()
    print(f"  copy bandwidth {copy / 1e12:.3f} TB/s (cudaMemcpyAsync D2D, 1 GiB, read + write)")
    print(f"  read bandwidth {_read_bw() / 1e12:.3f} TB/s (a read-only stream kernel, 1 GiB)")
    rows = []

    def mk(B, L):
        q = cp.asarray(rng.standard_normal((B, HQ, 1, D), dtype=np.float32)).astype(bf16)
        k = cp.random.standard_normal((B, HKV, L, D), dtype=cp.float32).astype(bf16)
        v = cp.random.standard_normal((B, HKV, L, D), dtype=cp.float32).astype(bf16)
        return q, k, v

    def torch_fn(backend, q, k, v):
        def view(x):
            return torch.from_dlpack(x.view(cp.int16)).view(torch.bfloat16)
        tq, tk, tv = view(q), view(k), view(v)

        def run():
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(tq, tk, tv, enable_gqa=True)
        run()  # fails here if the backend refuses
        return run

    # TIMING_VARIANTS' rows: today's default first (the reference output)
    variants = TIMING_VARIANTS + (OLD_TIMING_VARIANTS if "all" in sys.argv[1:] else ())
    for B, L in SHAPES + (("uneven", 8192),):
        uneven = B == "uneven"
        Bn = 32 if uneven else B
        try:
            sets = [mk(Bn, L) for _ in range(2)]
            lens = uneven_lens(0, Bn, L) if uneven else None  # bench.py's batch (52.7 %)
            kv_bytes = 2 * HKV * (int(lens.sum()) if uneven else Bn * L) * D * 2
            res = {}
            ref_out = None
            for label, fused, waves, variant, rule in variants:
                try:
                    plans = [_decode.plan(make_problem(q, k, v, kv_lens=None if lens is None
                                                       else lens.reshape(Bn, 1)),
                                          fused=fused, waves=waves, variant=variant,
                                          split_rule=rule) for q, k, v in sets]
                    outs = [pl._outputs() for pl in plans]
                    # check the candidate against today's kernel on the same inputs first
                    o0 = plans[0].run(*outs[0])[0].astype(cp.float32)
                    if ref_out is None:
                        ref_out, diff = o0, 0.0
                    else:
                        diff = float(cp.abs(o0 - ref_out).max())
                        if not diff <= 1e-2:
                            FAILS.append(f"timing {B} {L} {label}: differs from default by {diff}")
                    ms = _time(lambda pl: pl.run(*outs[plans.index(pl)]), plans)
                    res[label] = (ms, f"S={plans[0].split} items={plans[0].n_items} "
                                      f"cap={plans[0].capacity} ({plans[0].per_sm}/SM) "
                                      f"maxdiff {diff:.1e}")
                except Exception:
                    print(f"  FAIL timing {B},{L} {label}:")
                    traceback.print_exc()
                    FAILS.append(f"timing {B} {L} {label}")
            for label, backend in (("flash", "FLASH_ATTENTION"), ("cudnn", "CUDNN_ATTENTION")):
                if torch is None or uneven:
                    continue
                try:
                    fns = [torch_fn(getattr(SDPBackend, backend), *s) for s in sets]
                    res[label] = (_time(lambda f: f(), fns), "")
                except Exception as exc:
                    res[label] = (float("nan"), f"n/a: {type(exc).__name__}: {str(exc)[:80]}")
            rows.append((f"{B}x{L}" if not uneven else f"uneven32x{L}", kv_bytes, res))
            for label, (ms, note) in res.items():
                print(f"  {rows[-1][0]:14s} {label:9s} {ms * 1e3:8.1f} us "
                      f"{kv_bytes / (ms * 1e-3) / 1e12:6.3f} TB/s  {note}")
            del sets
            cp.get_default_memory_pool().free_all_blocks()
        except Exception:
            print(f"  FAIL timing {B},{L}:")
            traceback.print_exc()
            FAILS.append(f"timing {B} {L}")
    # compact table last
    labels = [v[0] for v in variants] + ["flash", "cudnn"]
    print(f"\nDecode, Hq={HQ} Hkv={HKV} D={D} bf16 Nq=1; KV TB/s (time us); copy {copy / 1e12:.3f} TB/s")
    print(f"{'shape':15s}" + "".join(f"{x:>20s}" for x in labels) + f"{'best/copy':>11s}{'best/cudnn':>11s}")
    for name, kvb, res in rows:
        cells, ours = [], []
        for x in labels:
            ms = res.get(x, (float("nan"),))[0]
            bw = kvb / (ms * 1e-3) / 1e12 if ms == ms else float("nan")
            cells.append(f"{bw:8.3f} ({ms * 1e3:7.1f})")
            if x in labels[:-2] and bw == bw:
                ours.append(bw)
        best = max(ours) if ours else float("nan")
        cud = res.get("cudnn", (float("nan"),))[0]
        cud_bw = kvb / (cud * 1e-3) / 1e12 if cud == cud else float("nan")
        print(f"{name:15s}" + "".join(f"{c:>20s}" for c in cells)
              + f"{best / (copy / 1e12):11.3f}{best / cud_bw:11.3f}")
    # per configuration: uneven time / full 32x8192 time (target <= 1.1 x the valid-key fraction)
    by = {name: res for name, _, res in rows}
    full, unev = by.get("32x8192"), by.get("uneven32x8192")
    if full and unev:
        frac = uneven_lens().sum() / (32 * 8192)
        print(f"\nuneven / full time (valid keys {frac:.3f}, target <= {1.1 * frac:.3f}):")
        for x in labels[:-2]:
            a, b = unev.get(x, (float("nan"),))[0], full.get(x, (float("nan"),))[0]
            print(f"  {x:12s} {a / b:6.3f}")


@stage("scaling")
def check_scaling():
    """Time vs keys at B = 32 (bf16, Hq 32, Hkv 8, D 128) for a few kernels and wave counts: the
    slope is the streaming rate, the intercept the fixed cost per call."""
    import cupy as cp
    import ml_dtypes

    from cuflash import _decode
    from cuflash._validate import make_problem

    bf16 = ml_dtypes.bfloat16
    Ls = (1024, 2048, 4096, 8192, 16384)
    B = 32
    data = {}
    for L in Ls:
        q = cp.random.standard_normal((B, HQ, 1, D), dtype=cp.float32).astype(bf16)
        k = cp.random.standard_normal((B, HKV, L, D), dtype=cp.float32).astype(bf16)
        v = cp.random.standard_normal((B, HKV, L, D), dtype=cp.float32).astype(bf16)
        data[L] = (q, k, v)
    for variant in SCALING_VARIANTS:
        for waves in (1, 2, 4):
            ts = []
            for L in Ls:
                q, k, v = data[L]
                pl = _decode.plan(make_problem(q, k, v), waves=waves, variant=variant)
                outs = pl._outputs()
                ts.append(_time(lambda p_: p_.run(*outs), [pl]) * 1e3)
            by = np.array([2 * B * HKV * L * D * 2 for L in Ls], dtype=np.float64)
            slope, icpt = np.polyfit(by, np.array(ts), 1)
            print(f"  {str(variant):8s} waves {waves}: " +
                  " ".join(f"{t:7.1f}" for t in ts) +
                  f"  us | fit {1e-6 / slope:.2f} TB/s + {icpt:.1f} us")


SCALING_VARIANTS = ("simt", "tc16s2", "tc16s2h")


@stage("trace")
def check_trace(reps=5):
    """GPU: where one call's time goes. decode_tc compiled with -DDECODE_TRACE (per-block
    %globaltimer marks, kernels_cu/decode.cu) runs the timing shapes with the L2 flushed before
    each call (as bench.py: a buffer of twice the L2 filled with zeros); per shape the median over
    `reps` calls of: the event time, the kernel span (first entry to last exit), block entry
    spread, entry -> first copies issued (the dependent table loads), entry -> first stage landed,
    the key loops, the merge of the last block of each row tile, and the tail after the median
    loop end. Times in us."""
    import cupy as cp
    import ml_dtypes

    from cuflash import _decode, _kernels
    from cuflash._validate import make_problem

    bf16 = ml_dtypes.bfloat16
    rng = np.random.default_rng(5)
    expr = _decode.tc_expression("bfloat16", D, _decode.DEFAULT_TC)
    mod = cp.RawModule(code=_kernels.source(_decode.SOURCE),
                       options=_kernels.OPTIONS + ("-DDECODE_TRACE",), name_expressions=[expr])
    func = mod.get_function(expr)
    smem = _decode.tc_smem_bytes(D, _decode.DEFAULT_TC)
    func.max_dynamic_shared_size_bytes = smem
    print(f"  traced {expr}: {func.attributes['num_regs']} registers, "
          f"{_decode._blocks_per_sm(func, smem)} blocks/SM")
    trace = mod.get_global("decode_trace")
    l2 = int(cp.cuda.runtime.getDeviceProperties(0)["l2CacheSize"])
    flush = cp.empty(2 * l2 // 4, dtype=cp.int32)
    spin = _spin_kernel()
    empty = cp.RawKernel('extern "C" __global__ void nop() {}', "nop")  # the launch floor
    for B, L in SHAPES + (("uneven", 8192),):
        uneven = B == "uneven"
        Bn = 32 if uneven else B
        q = cp.asarray(rng.standard_normal((Bn, HQ, 1, D), dtype=np.float32)).astype(bf16)
        k = cp.random.standard_normal((Bn, HKV, L, D), dtype=cp.float32).astype(bf16)
        v = cp.random.standard_normal((Bn, HKV, L, D), dtype=cp.float32).astype(bf16)
        lens = uneven_lens(0, Bn, L) if uneven else None
        kv_bytes = 2 * HKV * (int(lens.sum()) if uneven else Bn * L) * D * 2
        plan = _decode.plan(make_problem(q, k, v, kv_lens=None if lens is None
                                         else lens.reshape(Bn, 1)))
        assert plan.variant == _decode.DEFAULT_TC, plan.variant
        ref = plan.run()[0].astype(cp.float32)
        plan.kernel = func
        n = min(plan.n_items, plan.per_sm * _kernels.device_info().sm_count)  # blocks
        rows, ends, fin = [], [], []
        for rep in range(reps + 1):
            spin((1,), (1,), (np.uint64(SPIN_US * 1000),))
            flush.fill(0)
            a, b = cp.cuda.Event(), cp.cuda.Event()
            a.record()
            o = plan.run()[0]
            b.record()
            b.synchronize()
            t = cp.ndarray((_TRACE_ROWS, 8), dtype=cp.uint64, memptr=trace)[:n].get()
            if rep == 0:  # warm-up; check the traced kernel's answer once
                diff = float(cp.abs(o.astype(cp.float32) - ref).max())
                if not diff <= 1e-2:
                    FAILS.append(f"trace {B} {L}: differs from the untraced kernel by {diff}")
                continue
            ev = cp.cuda.get_elapsed_time(a, b) * 1e3
            t0 = t[:, 0].min()
            rel = (t[:, :5] - t0).astype(np.float64) / 1e3
            merged = t[:, 6] == 1
            loop_end = np.median(rel[:, 3])
            if rep == reps and os.environ.get("OUT"):  # the last call's raw marks, for plots
                np.save(os.path.join(os.environ["OUT"], f"trace_{B}x{L}.npy"), t)
            ends.append(np.percentile(rel[:, 3] - np.median(rel[:, 3]), [0, 10, 90, 100]))
            solo = t[:, 6] == 0  # blocks that do not merge: loop end -> states shared -> exit
            fin.append((np.median((t[solo, 7] - t[solo, 3]) / 1e3),
                        np.median((t[solo, 4] - t[solo, 7]) / 1e3)))
            rows.append((ev, rel[:, 4].max(), rel[:, 0].max(), np.median(rel[:, 1] - rel[:, 0]),
                         np.median(rel[:, 2] - rel[:, 0]), np.median(rel[:, 3] - rel[:, 2]),
                         np.median(rel[merged, 4] - rel[merged, 3]) if merged.any() else 0.0,
                         rel[:, 4].max() - loop_end, loop_end,
                         len(np.unique(t[:, 5]))))
        r = np.median(np.array(rows), axis=0)
        name = f"{B}x{L}" if not uneven else f"uneven32x{L}"
        print(f"  {name:14s} items {plan.n_items:4d} blocks {n:4d} S={plan.split:6d}  event {r[0]:6.1f} = span {r[1]:6.1f}"
              f" + {r[0] - r[1]:4.1f} | entry spread {r[2]:5.1f} | issue {r[3]:4.1f} | first data "
              f"{r[4]:4.1f} | loop {r[5]:6.1f} | merge {r[6]:4.1f} | tail after median loop end "
              f"{r[7]:5.1f} (at {r[8]:6.1f}) | {int(r[9])} SMs | "
              f"{kv_bytes / (r[0] * 1e-6) / 1e12:.2f} TB/s by event, "
              f"{kv_bytes / (r[5] * 1e-6) / 1e12:.2f} in the median loop")
        e = np.median(np.array(ends), axis=0)
        print(f"  {'':14s} loop ends relative to the median: min {e[0]:+.1f}, p10 {e[1]:+.1f}, "
              f"p90 {e[2]:+.1f}, max {e[3]:+.1f}; blocks that do not merge: loop end -> states "
              f"in shared memory {np.median([x[0] for x in fin]):.1f}, -> exit "
              f"{np.median([x[1] for x in fin]):.1f}")
        del q, k, v, plan
        cp.get_default_memory_pool().free_all_blocks()
    for _ in range(3):
        spin((1,), (1,), (np.uint64(SPIN_US * 1000),))
        a, b = cp.cuda.Event(), cp.cuda.Event()
        a.record()
        empty((1,), (1,), ())
        b.record()
        b.synchronize()
    print(f"  an empty kernel: {cp.cuda.get_elapsed_time(a, b) * 1e3:.1f} us by event")


_TRACE_ROWS = 8192  # kernels_cu/decode.cu DECODE_TRACE_ROWS


@stage("hostcost")
def check_hostcost(calls=200):
    """GPU: host time of one cuflash.attention decode call (the user's whole call, from Python to
    the launch returning), B = 32, L = 8192 (bf16, Hq 32, Hkv 8, D 128, Nq 1): the same kv_lens
    every call (the Plan cache hits) and kv_lens growing by one key per call (token-by-token
    decoding: a new Plan per call). Median us per call with a long GPU spin queued first, so the
    host never waits on the device; then cProfile's top functions of each."""
    import cProfile
    import io
    import pstats

    import cupy as cp
    import ml_dtypes

    import cuflash

    bf16 = ml_dtypes.bfloat16
    B, L = 32, 8192
    q = cp.zeros((B, HQ, 1, D), dtype=bf16)
    k = cp.zeros((B, HKV, L, D), dtype=bf16)
    v = cp.zeros((B, HKV, L, D), dtype=bf16)
    base = uneven_lens(0, B, L - calls - 1).reshape(B, 1)
    spin = _spin_kernel()

    def run(grow):
        per = []
        for i in range(calls):
            lens = base + i if grow else base
            t = time.perf_counter()
            cuflash.attention(q, k, v, kv_lens=lens)
            per.append(time.perf_counter() - t)
        return per

    for label, grow in (("same kv_lens (cached Plan)", False), ("kv_lens + 1 per call", True)):
        run(grow)  # warm-up: compile, caches
        cp.cuda.get_current_stream().synchronize()
        spin((1,), (1,), (np.uint64(2_000_000_000),))  # 2 s of GPU time queued ahead
        per = run(grow)
        prof = cProfile.Profile()
        prof.enable()
        run(grow)
        prof.disable()
        cp.cuda.get_current_stream().synchronize()
        print(f"  {label}: median {np.median(per) * 1e6:.0f} us per call "
              f"(p90 {np.percentile(per, 90) * 1e6:.0f})")
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(14)
        print("\n".join("    " + x for x in out.getvalue().splitlines()[6:24]))


def main(argv):
    stages = [a for a in argv if a in STAGES] or ["host", "correct", "timing"]
    t0 = time.time()
    if "build" in stages:
        check_build()
    if "host" in stages:
        check_host()
    if "correct" in stages:
        check_correct()
    if "timing" in stages:
        check_timing()
    if "scaling" in stages:
        check_scaling()
    if "trace" in stages:
        check_trace()
    if "hostcost" in stages:
        check_hostcost()
    print(f"\n{len(FAILS)} failure(s) in {time.time() - t0:.0f} s" + (": " + "; ".join(FAILS[:20])
                                                                  if FAILS else ""))
    return 1 if FAILS else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
