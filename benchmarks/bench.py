#!/usr/bin/env python3
"""cuflash benchmark: cuflash side by side with FlashAttention-4, torch SDPA, FlexAttention and naive
CuPy attention, on one GPU.

Run on a GPU machine from the repository root::

    python benchmarks/bench.py                       # the whole matrix (dense, det, options, ...)
    python benchmarks/bench.py --quick               # a small subset, for smoke runs
    python benchmarks/bench.py --cases options       # only the option cases
    python benchmarks/bench.py --layouts bnhd        # only (B, N, H, D)-stored inputs
    python benchmarks/bench.py --dry-run             # print the plan and FLOP counts (no GPU)
    python benchmarks/bench.py --self-test           # check the FLOP counting against NumPy (no GPU)
    python benchmarks/bench.py --cpu                 # the NumPy path vs naive NumPy (no GPU)

What it measures
----------------
* Dense prefill (issue 3; --cases fwd,bwd): 16k tokens in total (batch = 16384 // N), heads x head
  dim = 2048, head dim 64 and 128, N = 512 ... 16k, causal and not, fp16 and bf16, forward and
  backward, in each storage layout of --layouts.
* Deterministic backward (issue 15; --cases det): the dense grid's backward cases (the same
  --dtypes, --heads-dims, --seqlens, --layouts and --quick), timed for cuflash's default backward
  and for cuflash-det, the same call with deterministic=True; each cuflash-det row's note gives
  its cost over the default ("det cost +x %"). No peers (the bwd set times them).
* Layouts: "bhnd" stores q, k, v and dout as (B, H, N, D); "bnhd" as (B, N, H, D). Every
  implementation reads the same buffers: cuflash and SDPA through (B, H, N, D) views (swapaxes of
  the bnhd buffers), FA4 through (B, N, H, D) views (swapaxes of the bhnd buffers).
* Options (--cases options): N = 4096, bf16, D = 128, 16k tokens, forward and backward: GQA 32/8
  causal, sliding window (1023, 0), D = 96, Dk = 192 / Dv = 128 causal, D = 256, a boolean padding
  mask (B, 1, 1, Nk) with 62 % valid keys, a block-sparse mask (half the 128 x 128 blocks), an
  additive float32 bias (1, H, N, N), softcap 30 and dropout p = 0.1 (each causal and not; the
  call without dropout is the dense grid's D = 128, N = 4096 row).
* Wider dtypes (--cases wide): float32 and float64, D = 128, N = 1024 and 4096, causal and not,
  forward and backward.
* Options on the wider dtypes (--cases wide-options): float32 and float64, N = 4096, D = 64,
  forward and backward: the plain case, window (1023, 0), the padding mask, an additive bias in the
  accumulator dtype, Dk = 64 / Dv = 32 (issue 16's "within 15 % of the plain case").
* Small calls (issue 17; --cases small): bf16 causal forward and backward at (B, H, N, D) =
  (1, 8, 128, 64) and (4, 16, 512, 128), and decode B = 1 against 4096 keys: the host's cost per
  call is the time there, so read loop_us and host_us.
* Decode (issue 4; --cases decode): Hq = 32, Hkv = 8, D = 128, bf16, Nq = 1 against KV caches of
  (B, L) = (1, 128k), (8, 32k), (32, 8k), (64, 4k), plus one uneven batch (B = 32, L = 8k, kv_lens
  uniform in [1, L]). Reported as time and KV bytes read per second, next to the device-to-device
  copy bandwidth measured in the same run.

Implementations (same process, same inputs, same CUDA stream): cuflash; FlashAttention-4
(flash_attn.cute.flash_attn_func); torch SDPA with the flash, cuDNN, efficient and (wide dtypes) math
backends; FlexAttention with a block mask (mask cases); naive CuPy attention (matmul, softmax in the
accumulator dtype, matmul; dense and wide cases, skipped when its N x N buffers would pass 40 GiB or
N >= 8k). torch tensors share the CuPy buffers through DLPack, no copy. A peer that is not
importable, or that refuses a case, is recorded as skipped with the reason; one that fails
otherwise (out of memory) is recorded with its error, and the run goes on.

FLOPs (the FlashAttention convention): forward = 4 * B * H * D * (visible query-key pairs per head),
with D = (Dk + Dv) / 2; causal and windows count the exact visible pairs (bottom-right alignment),
boolean masks their True entries; backward = 2.5 x forward. The same count is used for every
implementation, whatever work it actually does.

Timing: CUDA events on one stream shared by CuPy and torch; before each timed call a short spin
kernel (so the host can enqueue the call before the GPU reaches the start event) and a write of
2 x L2 bytes (so no input is served from L2); the first call (compilation, planning) is untimed;
median of as many runs as fit in --target-seconds (3 to 1000). Then as many calls back to back,
with no spin, no flush and no sync between them: wall time per call (loop_us) and the host's
enqueue time per call (host_us).

Outputs under --out: bench_<stamp>.json (every number, written after every measurement, plus GPU,
date, git commit and versions), table_<stamp>.txt (the printed table), one PNG per case of TFLOP/s vs
N (one line per implementation), options.png and decode.png (bars per case). The report gives
measured numbers and ratios (cuflash / peer, decode / copy bandwidth), no pass/fail verdicts.

Modules (next to this file): cases (the case matrix, FLOPs and bytes), implementations (cuflash
and the peers), timer (device and host timing, copy bandwidth, peak memory), report (metadata,
ratios, table, JSON, plots, the dry-run plan); this file runs them (the command line).
"""
import argparse
import contextlib
import datetime
import math
import os
import signal
import sys
import time
from dataclasses import asdict, dataclass

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the sibling modules below
from cases import (ALL_IMPLS, CASE_SETS, DTYPES, FLOP_CONVENTION, HEAD_DIMS,  # noqa: E402
                   HIDDEN, LAYOUTS, QUICK_DTYPES, QUICK_HEAD_DIMS, QUICK_SEQLENS, SEQLENS,
                   TORCH_IMPLS, TOTAL_TOKENS, build_cases, case_flops, impls_for, kv_bytes,
                   self_test, skip_reason)
from implementations import (Refused, load_cuflash, load_cupy, load_fa4,  # noqa: E402
                             load_flex, load_torch, make_inputs, make_to_torch, prepare)
from report import (add_ratios, collect_meta, decode_summary, format_table,  # noqa: E402
                    print_plan, read_rows, uneven_summary, write_json, write_plots)
from timer import (DEFAULT_L2_BYTES, Timer, cupy_peak_bytes,  # noqa: E402
                   measure_copy_bandwidth, torch_peak_bytes)

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_OUT = os.path.join(REPO_ROOT, "benchmarks", "results")


# ---- running ----------------------------------------------------------------------------------

def free_pools(env):
    env.stream.synchronize()
    env.cp.get_default_memory_pool().free_all_blocks()
    if env.torch is not None:
        env.torch.cuda.empty_cache()


@dataclass
class Env:
    cp: object
    cf: object
    torch: object
    fa4: object                       # flash_attn.cute.flash_attn_func, or None
    flex: object                      # (compiled flex_attention, create_block_mask), or None
    unavailable: dict                 # {impl: why it cannot run in this process}
    to_torch: object
    stream: object
    timer: object


def base_row(case, impl):
    row = {k: v for k, v in asdict(case).items() if k != "kv_lens"}
    row.update(impl=impl, group=case.group, label=case.label, flops=case_flops(case),
               uneven=bool(case.kv_lens), dv=case.d_v)
    if case.kind == "decode":
        row["kv_bytes"] = kv_bytes(case)
        row["valid_keys"] = sum(case.kv_lens or (case.nk,) * case.b)
    return row


def measure_one(env, case, impl, x):
    """Time one implementation on one case; a peer's refusal becomes a skip reason, every other
    failure an error string."""
    try:
        prepared = prepare(env, case, x, impl)
        with prepared.context():
            timing = env.timer.measure(prepared.fn)
            if prepared.memory == "cupy":
                peak = cupy_peak_bytes(env.cp, env.stream, prepared.fn)
            else:
                peak = torch_peak_bytes(env.torch, prepared.fn)
        seconds = timing["ms"] * 1e-3
        result = dict(timing, tflops=case_flops(case) / seconds / 1e12, peak_bytes=peak,
                      notes=prepared.notes)
        if case.kind == "decode":
            result["tbps"] = kv_bytes(case) / seconds / 1e12
        return result
    except Refused as e:
        return {"skipped": f"skipped: {e}"}
    except Exception as e:
        return {"error": f"{type(e).__name__}: {str(e).strip()[:400]}"}
    finally:
        prepared = None
        free_pools(env)


def progress(total):
    try:
        from tqdm import tqdm
        # off a terminal (the device machine's captured output), redraw rarely
        return tqdm(total=total, unit="run", dynamic_ncols=True,
                    mininterval=0.1 if sys.stderr.isatty() else 10.0)
    except ImportError:
        return _PlainProgress(total)


class _PlainProgress:
    def __init__(self, total):
        self.total, self.n = total, 0

    def set_description(self, text, refresh=True):
        print(f"[{self.n + 1}/{self.total}] {text}", file=sys.stderr, flush=True)

    def update(self, n=1):
        self.n += n

    def close(self):
        pass


def run_cases(env, cases, impls, args, deadline, save):
    rows = []
    bar = progress(sum(len(impls_for(c, impls)) for c in cases))
    try:
        for case in cases:
            x = None
            for impl in impls_for(case, impls):
                bar.set_description(f"{case.label} {impl}", refresh=False)
                row = base_row(case, impl)
                reason = skip_reason(case, impl, env.unavailable)
                if reason is None and time.monotonic() > deadline:
                    reason = "skipped: --max-seconds budget spent"
                if reason:
                    row["skipped"] = reason
                else:
                    try:
                        x = x if x is not None else make_inputs(env.cp, case, args.seed)
                        row.update(measure_one(env, case, impl, x))
                    except Exception as e:  # the inputs themselves did not fit
                        row["error"] = f"inputs: {type(e).__name__}: {str(e).strip()[:300]}"
                rows.append(row)
                save(rows)
                bar.update(1)
            del x
            free_pools(env)
    finally:
        bar.close()
    return rows


# ---- command line -----------------------------------------------------------------------------

def _csv(kind, allowed=None):
    def parse(text):
        items = [kind(s.strip()) for s in text.split(",") if s.strip()]
        if allowed is not None:
            bad = [s for s in items if s not in allowed]
            if bad:
                raise argparse.ArgumentTypeError(f"unknown {bad}; choose from {','.join(allowed)}")
        return items
    return parse


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=FLOP_CONVENTION)
    p.add_argument("--quick", action="store_true",
                   help="small subset: dense and det N = 1k, 4k, bf16, D = 128; every option "
                        "case; wide fp32 N = 1k; decode B=8 L=32k + uneven; 0.15 s per "
                        "measurement")
    p.add_argument("--cases", type=_csv(str, CASE_SETS), default=list(CASE_SETS),
                   help="comma list of " + ",".join(CASE_SETS) + " (fwd, bwd: the dense grid; "
                        "det: its backward, cuflash with and without deterministic=True; "
                        "options and wide: forward and backward each; default all)")
    p.add_argument("--layouts", type=_csv(str, LAYOUTS), default=list(LAYOUTS),
                   help="storage layouts of the prefill inputs (dense, det, options, wide), comma "
                        "list of bhnd,bnhd (default both; decode is bhnd)")
    p.add_argument("--dtypes", type=_csv(str, DTYPES), default=None,
                   help="comma list of bf16,fp16 (dense grid and det; options and decode are "
                        "bf16, wide fp32 and fp64)")
    p.add_argument("--heads-dims", type=_csv(int), default=None,
                   help="comma list of dense and det head dims (default 64,128; "
                        "heads = 2048 // D)")
    p.add_argument("--seqlens", type=_csv(int), default=None,
                   help="comma list of dense and det N (default 512,...,16384)")
    p.add_argument("--options", type=_csv(str), default=None,
                   help="comma list of the option cases to run (their names, e.g. dropout10; "
                        "default all)")
    p.add_argument("--impls", type=_csv(str, ALL_IMPLS), default=list(ALL_IMPLS),
                   help="comma list of " + ",".join(ALL_IMPLS))
    p.add_argument("--out", default=DEFAULT_OUT, help="output folder (default benchmarks/results)")
    p.add_argument("--max-seconds", type=float, default=None,
                   help="start no new measurement after this many seconds (the rest is recorded "
                        "as skipped); outputs are written either way")
    p.add_argument("--target-seconds", type=float, default=None,
                   help="time box of one measurement (default 0.4, 0.15 with --quick)")
    p.add_argument("--spin-us", type=float, default=200.0,
                   help="GPU spin before each timed run that hides host enqueue time (default 200)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dry-run", action="store_true", help="print the plan and FLOPs; no GPU")
    p.add_argument("--self-test", action="store_true",
                   help="check the FLOP and mask counting against NumPy; no GPU")
    p.add_argument("--cpu", action="store_true",
                   help="cuflash on NumPy arrays vs naive NumPy attention (benchmarks/cpu.py); "
                        "no GPU")
    args = p.parse_args(argv)
    args.dtypes = args.dtypes or list(QUICK_DTYPES if args.quick else DTYPES)
    args.heads_dims = args.heads_dims or list(QUICK_HEAD_DIMS if args.quick else HEAD_DIMS)
    args.seqlens = args.seqlens or list(QUICK_SEQLENS if args.quick else SEQLENS)
    if args.target_seconds is None:
        args.target_seconds = 0.15 if args.quick else 0.4
    bad = [n for n in args.seqlens if n <= 0 or TOTAL_TOKENS % n]
    if bad:
        p.error(f"--seqlens must divide {TOTAL_TOKENS}, got {bad}")
    bad = [d for d in args.heads_dims if d <= 0 or HIDDEN % d]
    if bad:
        p.error(f"--heads-dims must divide {HIDDEN}, got {bad}")
    return args


def run_cpu(args):
    """The NumPy-path cases: a table on stdout, cpu_<stamp>.json / .txt under --out."""
    import json
    import cpu
    from report import git_commit
    sys.path.insert(0, REPO_ROOT)
    import cuflash
    rows = cpu.run(cuflash, seed=args.seed)
    table = cpu.format_rows(rows)
    print(table)
    os.makedirs(args.out, exist_ok=True)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    meta = dict(git_commit=git_commit(), cpus=os.cpu_count(), numpy=__import__("numpy").__version__)
    with open(os.path.join(args.out, f"cpu_{stamp}.json"), "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    with open(os.path.join(args.out, f"cpu_{stamp}.txt"), "w") as f:
        f.write(table + "\n")
    return 0


def _terminate(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv=None):
    args = parse_args(argv)
    if args.self_test:
        return 0 if self_test() else 1
    if args.cpu:
        return run_cpu(args)
    cases = build_cases(args)
    if args.dry_run:
        print_plan(cases, args.impls)
        return 0

    start = time.monotonic()
    deadline = start + args.max_seconds if args.max_seconds else math.inf
    cp = load_cupy()
    cf = load_cuflash()
    torch, torch_reason = load_torch(cp.cuda.Device().id)
    fa4 = flex = None
    if torch is None:   # FA4 and FlexAttention take torch tensors too
        unavailable = dict.fromkeys(TORCH_IMPLS + ("fa4", "flex"), torch_reason)
    else:
        unavailable = {}
        if "fa4" in args.impls:
            fa4, unavailable["fa4"] = load_fa4()
        if "flex" in args.impls:
            flex, unavailable["flex"] = load_flex(torch)
        unavailable = {impl: why for impl, why in unavailable.items() if why}
    os.makedirs(args.out, exist_ok=True)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    json_path = os.path.join(args.out, f"bench_{stamp}.json")
    signal.signal(signal.SIGTERM, _terminate)

    # one stream for CuPy and torch: events, kernels and DLPack hand-offs are all ordered on it
    stream = cp.cuda.Stream(non_blocking=False)
    rows, copy, status = [], None, "complete"
    with contextlib.ExitStack() as stack:
        stack.enter_context(stream)
        to_torch, bf16_dlpack = None, None
        if torch is not None:
            stack.enter_context(torch.cuda.stream(torch.cuda.ExternalStream(stream.ptr)))
            to_torch, bf16_dlpack = make_to_torch(cp, torch)
        meta = collect_meta(cp, cf, torch, args, bf16_dlpack)
        meta["unavailable"] = unavailable
        l2 = meta["l2_bytes"] or DEFAULT_L2_BYTES
        timer = Timer(cp, stream, args.target_seconds, args.spin_us, l2)
        env = Env(cp, cf, torch, fa4, flex, unavailable, to_torch, stream, timer)
        print(f"{meta['gpu']}  cupy {meta['cupy']}  torch {meta['torch']}  fa4 {meta['fa4']}  "
              f"commit {meta['git_commit']}  -> {json_path}", file=sys.stderr)
        for impl, why in unavailable.items():
            print(f"  {impl}: {why}", file=sys.stderr)
        try:
            if any(c.kind == "decode" for c in cases):
                copy = measure_copy_bandwidth(cp, timer)
                free_pools(env)
            rows = run_cases(env, cases, args.impls, args, deadline,
                             lambda r: write_json(json_path, meta, r, copy))
        except KeyboardInterrupt as e:
            status = f"interrupted ({e})"
            print(f"\n{status}: writing what was measured", file=sys.stderr)
            rows = read_rows(json_path)

    add_ratios(rows)
    uneven = uneven_summary(rows)
    meta["seconds"] = round(time.monotonic() - start, 1)
    write_json(json_path, meta, rows, copy, uneven, status)
    table = format_table(rows, copy)
    with open(os.path.join(args.out, f"table_{stamp}.txt"), "w") as f:
        f.write(table + "\n")
    plots = write_plots(args.out, rows, copy, meta)
    print(table)
    print(f"\nwrote {json_path}, {len(plots)} plots under {args.out} ({status}, "
          f"{meta['seconds']:.0f} s)")
    for line in decode_summary(rows, copy, uneven):
        print(line)
    return 0 if status == "complete" else 2


if __name__ == "__main__":
    sys.exit(main())
