"""Where a decode call's time goes, on a GPU: the device timeline per block, and the host cost.

  trace     a -DDECODE_TRACE build of decode_tc (the kernel the default plan picks for these
            shapes; kernels_cu/decode.cu records per-block %globaltimer marks) runs bench.py's
            decode shapes (bf16, Hq 32, Hkv 8, D 128, Nq 1; (B, L) = (1, 128k), (8, 32k),
            (32, 8k), (64, 4k) and the uneven batch) with the L2 flushed before each call (as
            bench.py); per shape the median over 5 calls of: the event time, the kernel span
            (first entry to last exit), block entry spread, entry -> first copies issued (the
            table loads), entry -> first stage landed, the key loops, the merge of the last block
            of each row tile, and the tail after the median loop end. Times in us. With $OUT set,
            the last call's raw marks go to $OUT/trace_<shape>.npy.
  hostcost  host microseconds of one public cuflash.attention decode call (B = 32, L = 8192),
            from Python to the launch returning, with a long GPU spin queued first so the host
            never waits on the device: the same kv_lens every call (the plan cache hits) and
            kv_lens growing by one key per call (token-by-token decoding); then cProfile's top
            functions of each.

    PYTHONPATH=. python3 tools/decode_check.py [trace] [hostcost]      # both by default
"""
import os
import sys
import time

import numpy as np

# this checkout's cuflash, also when another copy is installed in the interpreter's environment
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SHAPES = ((1, 131072), (8, 32768), (32, 8192), (64, 4096))
HQ, HKV, D = 32, 8, 128
SPIN_US = 400  # GPU spin before each traced call: the host's enqueue time stays out
_SPIN = r"""
extern "C" __global__ void spin(unsigned long long ns) {
  unsigned long long t0, t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); } while (t - t0 < ns);
}"""


def uneven_lens(seed=0, B=32, L=8192):
    """benchmarks/bench.py's uneven batch: kv_lens uniform in [1, L], default_rng(seed) (52.7 %
    of the keys valid at the defaults)."""
    return np.random.default_rng(seed).integers(1, L + 1, size=B)


def trace(reps=5):
    import cupy as cp
    import ml_dtypes

    from cuflash import _decode, _runtime
    from cuflash._validate import make_problem

    bf16 = ml_dtypes.bfloat16
    rng = np.random.default_rng(5)
    l2 = int(cp.cuda.runtime.getDeviceProperties(0)["l2CacheSize"])
    flush = cp.empty(2 * l2 // 4, dtype=cp.int32)
    spin = cp.RawKernel(_SPIN, "spin")
    traced = {}  # expr -> (kernel, trace buffer)
    for B, L in SHAPES + (("uneven", 8192),):
        uneven = B == "uneven"
        Bn = 32 if uneven else B
        q = cp.asarray(rng.standard_normal((Bn, HQ, 1, D), dtype=np.float32)).astype(bf16)
        k = cp.random.standard_normal((Bn, HKV, L, D), dtype=cp.float32).astype(bf16)
        v = cp.random.standard_normal((Bn, HKV, L, D), dtype=cp.float32).astype(bf16)
        lens = uneven_lens(0, Bn, L) if uneven else None
        kv_bytes = 2 * HKV * (int(lens.sum()) if uneven else Bn * L) * D * 2
        plan = _decode.Plan(make_problem(q, k, v, kv_lens=None if lens is None
                                         else lens.reshape(Bn, 1)))
        if "decode_tc" not in plan.expr:  # decode_tc alone records the marks
            raise SystemExit(f"{B} x {L}: the plan runs {plan.expr}, not decode_tc")
        ref = plan.run()[0].astype(cp.float32)
        if plan.expr not in traced:
            mod = cp.RawModule(code=_runtime.source(_decode.SOURCE),
                               options=_runtime.OPTIONS + ("-DDECODE_TRACE",),
                               name_expressions=[plan.expr])
            func = mod.get_function(plan.expr)
            func.max_dynamic_shared_size_bytes = plan.dyn_smem
            traced[plan.expr] = (func, mod.get_global("decode_trace"))
            print(f"  traced {plan.expr}: {func.attributes['num_regs']} registers "
                  f"(untraced: {plan.kernel.attributes['num_regs']})")
        plan.kernel, buf = traced[plan.expr]
        trace_rows = buf.mem.size // 64  # decode_trace[DECODE_TRACE_ROWS][8] of uint64
        n = min(plan.n_items, plan.per_sm * _runtime.device_info().sm_count, trace_rows)
        rows, ends, fin = [], [], []
        for rep in range(reps + 1):
            spin((1,), (1,), (np.uint64(SPIN_US * 1000),))
            flush.fill(0)
            a, b = cp.cuda.Event(), cp.cuda.Event()
            a.record()
            o = plan.run()[0]
            b.record()
            b.synchronize()
            t = cp.ndarray((trace_rows, 8), dtype=cp.uint64, memptr=buf)[:n].get()
            if rep == 0:  # warm-up; check the traced kernel's answer once
                diff = float(cp.abs(o.astype(cp.float32) - ref).max())
                if not diff <= 1e-2:
                    print(f"  FAIL {B} {L}: the traced kernel differs from the untraced by {diff}")
                continue
            ev = cp.cuda.get_elapsed_time(a, b) * 1e3
            rel = (t[:, :5] - t[:, 0].min()).astype(np.float64) / 1e3
            merged = t[:, 6] == 1
            loop_end = np.median(rel[:, 3])
            if rep == reps and os.environ.get("OUT"):  # the last call's raw marks, for plots
                np.save(os.path.join(os.environ["OUT"], f"trace_{B}x{L}.npy"), t)
            ends.append(np.percentile(rel[:, 3] - loop_end, [0, 10, 90, 100]))
            solo = t[:, 6] == 0  # blocks that do not merge: loop end -> states shared -> exit
            fin.append((np.median((t[solo, 7] - t[solo, 3]) / 1e3),
                        np.median((t[solo, 4] - t[solo, 7]) / 1e3)))
            rows.append((ev, rel[:, 4].max(), rel[:, 0].max(), np.median(rel[:, 1] - rel[:, 0]),
                         np.median(rel[:, 2] - rel[:, 0]), np.median(rel[:, 3] - rel[:, 2]),
                         np.median(rel[merged, 4] - rel[merged, 3]) if merged.any() else 0.0,
                         rel[:, 4].max() - loop_end, loop_end, len(np.unique(t[:, 5]))))
        r = np.median(np.array(rows), axis=0)
        name = f"{B}x{L}" if not uneven else f"uneven32x{L}"
        print(f"  {name:14s} items {plan.n_items:4d} blocks {n:4d} S={plan.split:6d}  event "
              f"{r[0]:6.1f} = span {r[1]:6.1f} + {r[0] - r[1]:4.1f} | entry spread {r[2]:5.1f} | "
              f"issue {r[3]:4.1f} | first data {r[4]:4.1f} | loop {r[5]:6.1f} | merge {r[6]:4.1f}"
              f" | tail after median loop end {r[7]:5.1f} (at {r[8]:6.1f}) | {int(r[9])} SMs | "
              f"{kv_bytes / (r[0] * 1e-6) / 1e12:.2f} TB/s by event, "
              f"{kv_bytes / (r[5] * 1e-6) / 1e12:.2f} in the median loop")
        e = np.median(np.array(ends), axis=0)
        print(f"  {'':14s} loop ends relative to the median: min {e[0]:+.1f}, p10 {e[1]:+.1f}, "
              f"p90 {e[2]:+.1f}, max {e[3]:+.1f}; blocks that do not merge: loop end -> states "
              f"in shared memory {np.median([x[0] for x in fin]):.1f}, -> exit "
              f"{np.median([x[1] for x in fin]):.1f}")
        del q, k, v, plan, ref
        cp.get_default_memory_pool().free_all_blocks()
    empty = cp.RawKernel('extern "C" __global__ void nop() {}', "nop")  # the launch floor
    for _ in range(3):
        spin((1,), (1,), (np.uint64(SPIN_US * 1000),))
        a, b = cp.cuda.Event(), cp.cuda.Event()
        a.record()
        empty((1,), (1,), ())
        b.record()
        b.synchronize()
    print(f"  an empty kernel: {cp.cuda.get_elapsed_time(a, b) * 1e3:.1f} us by event")


def hostcost(calls=200):
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
    spin = cp.RawKernel(_SPIN, "spin")

    def run(grow):
        per = []
        for i in range(calls):
            lens = base + i if grow else base
            t = time.perf_counter()
            cuflash.attention(q, k, v, kv_lens=lens)
            per.append(time.perf_counter() - t)
        return per

    for label, grow in (("same kv_lens (cached plan)", False), ("kv_lens + 1 per call", True)):
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
    stages = {"trace": trace, "hostcost": hostcost}
    bad = [a for a in argv if a not in stages]
    if bad:
        raise SystemExit(f"unknown stage(s) {bad}; choose from {sorted(stages)}")
    for name in argv or list(stages):
        t0 = time.time()
        print(f"== {name}", flush=True)
        stages[name]()
        print(f"== {name} done in {time.time() - t0:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
