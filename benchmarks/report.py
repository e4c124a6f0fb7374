"""What comes out: run metadata, cuflash/peer ratios, the printed table, the JSON file, the plots
and the dry-run plan. Measured numbers and ratios only; no pass/fail verdicts."""
import datetime
import importlib.metadata
import json
import os
import platform
import subprocess
import sys

import numpy as np

from cases import DECODE_D, DECODE_DTYPE, DECODE_HKV, DECODE_HQ, FLOP_CONVENTION, case_flops, \
    impls_for, kv_bytes, skip_reason

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def git_commit():
    """(commit, dirty) of the checkout; CUFLASH_COMMIT overrides it where the tree was copied
    without its own .git (the device machine), as (that commit, None)."""
    if os.environ.get("CUFLASH_COMMIT"):
        return os.environ["CUFLASH_COMMIT"], None
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                                text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=REPO_ROOT, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None, None
    if commit.returncode != 0:
        return None, None
    return commit.stdout.strip(), bool(dirty.stdout.strip())


def source_fingerprint():
    """SHA-256 of the package and kernel sources (cuflash/*.py, kernels_cu/*, by relative path):
    names the code that ran where the checkout's .git is missing or stale (the device machine's
    copy); compare with the same hash of `git archive <rev> cuflash kernels_cu`."""
    import hashlib
    h = hashlib.sha256()
    for folder in ("cuflash", "kernels_cu"):
        root = os.path.join(REPO_ROOT, folder)
        for name in sorted(os.listdir(root)):
            path = os.path.join(root, name)
            if os.path.isfile(path) and not name.endswith(".pyc"):
                h.update(f"{folder}/{name}\0".encode())
                with open(path, "rb") as f:
                    h.update(f.read())
    return h.hexdigest()


def package_version(name):
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def collect_meta(cp, cf, torch, args, bf16_dlpack):
    dev = cp.cuda.Device()
    props = cp.cuda.runtime.getDeviceProperties(dev.id)
    commit, dirty = git_commit()
    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "git_commit": commit, "git_dirty": dirty, "source_sha256": source_fingerprint(),
        "gpu": props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"]),
        "compute_capability": dev.compute_capability,
        "sm_count": props.get("multiProcessorCount"),
        "l2_bytes": props.get("l2CacheSize"),
        "memory_bytes": props.get("totalGlobalMem"),
        "python": platform.python_version(), "numpy": np.__version__,
        "cupy": cp.__version__, "cuda_runtime": cp.cuda.runtime.runtimeGetVersion(),
        "cuda_driver": cp.cuda.runtime.driverGetVersion(),
        "cuflash": getattr(cf, "__version__", None),
        "torch": torch.__version__ if torch else None,
        "torch_cuda": torch.version.cuda if torch else None,
        "cudnn": torch.backends.cudnn.version() if torch else None,
        # where FA4 was imported from (a source tree on PYTHONPATH has no package version)
        "fa4": getattr(sys.modules.get("flash_attn.cute"), "__file__", None),
        "cutlass_dsl": package_version("nvidia-cutlass-dsl"), "triton": package_version("triton"),
        "bf16_dlpack": bf16_dlpack,
        "flop_convention": FLOP_CONVENTION,
        "args": {k: v for k, v in vars(args).items()},
    }
    return meta


# ---- ratios -----------------------------------------------------------------------------------

def add_ratios(rows):
    """On every peer row: cuflash / peer = peer time / cuflash time (> 1: cuflash is faster); on a
    cuflash-det row, deterministic=True's time over the default backward's."""
    cuflash_ms = {r["label"]: r["ms"] for r in rows if r["impl"] == "cuflash" and "ms" in r}
    for r in rows:
        if r["impl"] != "cuflash" and "ms" in r and r["label"] in cuflash_ms:
            r["cuflash_over_peer"] = r["ms"] / cuflash_ms[r["label"]]


def uneven_summary(rows):
    """cuflash on the uneven batch against the same (B, L) with every key valid."""
    uneven = next((r for r in rows if r["impl"] == "cuflash" and r.get("uneven") and "ms" in r),
                  None)
    if uneven is None:
        return None
    full = next((r for r in rows if r["impl"] == "cuflash" and r["kind"] == "decode"
                 and not r["uneven"] and r["b"] == uneven["b"] and r["nk"] == uneven["nk"]
                 and "ms" in r), None)
    if full is None:
        return None
    return {"valid_fraction": uneven["valid_keys"] / full["valid_keys"],
            "time_fraction": uneven["ms"] / full["ms"]}


def decode_summary(rows, copy, uneven):
    """Lines after the table: each cuflash decode row's KV bytes per second as a fraction of the
    copy bandwidth measured in the same run, and the uneven batch's time against the full one's."""
    lines = []
    for r in rows:
        if r["kind"] == "decode" and r["impl"] == "cuflash" and "tbps" in r and copy:
            lines.append(f"  {r['label']}: {r['tbps']:.2f} TB/s = {r['tbps'] / copy['tbps']:.0%} "
                         f"of copy {copy['tbps']:.2f} TB/s")
    if uneven:
        lines.append(f"  uneven kv_lens: time {uneven['time_fraction']:.2f} of the full batch for "
                     f"{uneven['valid_fraction']:.2f} of its keys")
    return ["", "decode, cuflash:"] + lines if lines else []


# ---- table, JSON, plots -------------------------------------------------------------------------

def _fmt(value, spec):
    return "" if value is None else format(value, spec)


def format_table(rows, copy):
    header = (f"{'case':<34} {'N/L':>6} {'impl':<16} {'ms':>9} {'TFLOP/s':>8} {'TB/s':>6} "
              f"{'cuflash/':>8} {'loop':>9} {'host':>7} {'peak':>7}  note")
    sub = (f"{'':<34} {'':>6} {'':<16} {'':>9} {'':>8} {'':>6} {'peer':>8} {'us/call':>9} "
           f"{'us/call':>7} {'MiB':>7}")
    lines = [FLOP_CONVENTION, "", header, sub]
    previous = None
    for r in rows:
        case = r["label"].rsplit(" N=", 1)[0] if r["kind"] != "decode" else \
            f"decode B={r['b']}" + (" uneven" if r["uneven"] else "")
        if previous is not None and r["group"] != previous:
            lines.append("")
        previous = r["group"]
        ratio = r.get("cuflash_over_peer")
        notes = [str(v) for v in (r.get("notes") or {}).values()]
        if r["impl"] == "cuflash-det" and ratio:
            # issue 15 bounds deterministic=True's cost: its rows spell their ratio as that cost
            notes.insert(0, f"det cost {100 * (ratio - 1):+.1f} %")
        note = r.get("error") or r.get("skipped") or "; ".join(
            notes + (["host-bound?"] if "host_bound_warning" in r else []))
        peak = r.get("peak_bytes")
        lines.append(
            f"{case:<34} {r['nk'] if r['kind'] == 'decode' else r['nq']:>6} {r['impl']:<16} "
            f"{_fmt(r.get('ms'), '9.4f'):>9} {_fmt(r.get('tflops'), '8.1f'):>8} "
            f"{_fmt(r.get('tbps'), '6.2f'):>6} "
            f"{(_fmt(ratio, '.2f') + 'x') if ratio else '':>8} "
            f"{_fmt(r.get('loop_us'), '9.1f'):>9} {_fmt(r.get('host_us'), '7.1f'):>7} "
            f"{_fmt(None if peak is None else peak / 2**20, '7.0f'):>7}  {note[:90]}")
    if copy:
        lines += ["", f"device-to-device copy: {copy['tbps']:.2f} TB/s (bytes read + written, "
                      f"{copy['bytes_each_way'] / 2**30:.0f} GiB each way, median of {copy['runs']})"]
    return "\n".join(lines)


def write_json(path, meta, rows, copy, uneven=None, status="running"):
    data = {"meta": meta, "status": status, "copy_bandwidth": copy, "rows": rows,
            "decode_uneven": uneven}
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, default=str)
    os.replace(tmp, path)


def write_plots(out_dir, rows, copy, meta):
    """One PNG per dense or wide case (TFLOP/s vs N, a line per implementation), options.png
    (TFLOP/s per option case) and decode.png (KV bytes per second per shape)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        print(f"no plots: matplotlib not importable ({e})", file=sys.stderr)
        return []
    paths = []
    for group in dict.fromkeys(r["group"] for r in rows
                               if r["kind"] != "decode" and not r.get("option")):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for impl in dict.fromkeys(r["impl"] for r in rows):
            pts = [(r["nq"], r["tflops"]) for r in rows
                   if r["group"] == group and r["impl"] == impl and "tflops" in r]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=impl)
        ax.set_xscale("log", base=2)
        ns = sorted({r["nq"] for r in rows if r["group"] == group})
        ax.set_xticks(ns, [f"{n // 1024}k" if n >= 1024 else str(n) for n in ns])
        ax.set_xlabel("sequence length N (batch = 16384 // N)")
        ax.set_ylabel("TFLOP/s (FlashAttention convention)")
        ax.set_title(f"{group} — {meta.get('gpu', '')}", fontsize=10)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
        paths.append(_save(fig, plt, os.path.join(out_dir, f"{group}.png")))
    options = [r for r in rows if r.get("option")]
    if options:
        paths.append(_bars(plt, options, "tflops", "TFLOP/s (FlashAttention convention)",
                           f"options, N = {options[0]['nq']} — {meta.get('gpu', '')}",
                           os.path.join(out_dir, "options.png"), lambda r: r["group"]))
    decode = [r for r in rows if r["kind"] == "decode"]
    if decode:
        paths.append(_bars(plt, decode, "tbps", "KV bytes read / s (TB/s)",
                           f"decode, Hq={DECODE_HQ} Hkv={DECODE_HKV} D={DECODE_D} {DECODE_DTYPE}, "
                           f"Nq=1 — {meta.get('gpu', '')}", os.path.join(out_dir, "decode.png"),
                           lambda r: r["label"].split(" ", 2)[2],
                           ("d2d copy", copy["tbps"]) if copy else None))
    return paths


def _bars(plt, rows, key, ylabel, title, path, name, line=None):
    """Grouped bars of r[key]: a group per case (named name(r)), a bar per implementation; line:
    (label, value) of a horizontal reference line."""
    labels = list(dict.fromkeys(r["label"] for r in rows))
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    names = {r["label"]: name(r) for r in rows}
    fig, ax = plt.subplots(figsize=(max(8, 0.6 * len(labels)), 4.5))
    width = 0.8 / len(impls)
    for i, impl in enumerate(impls):
        vals = [next((r.get(key, 0) for r in rows if r["label"] == lab and r["impl"] == impl), 0)
                for lab in labels]
        ax.bar([j + i * width for j in range(len(labels))], vals, width, label=impl)
    if line:
        ax.axhline(line[1], color="k", linestyle="--", label=line[0])
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(labels))])
    ax.set_xticklabels([names[lab] for lab in labels], fontsize=7, rotation=30, ha="right")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    return _save(fig, plt, path)


def _save(fig, plt, path):
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def read_rows(path):
    """The rows of a JSON file write_json wrote (those of an interrupted run), or []."""
    try:
        with open(path) as f:
            return json.load(f)["rows"]
    except (OSError, ValueError, KeyError):
        return []


# ---- the dry run ------------------------------------------------------------------------------

def print_plan(cases, impls):
    print(FLOP_CONVENTION)
    print()
    print(f"{'case':<42} {'B':>3} {'Hq':>3} {'Hkv':>3} {'Nq':>6} {'Nk':>6} {'Dk':>4} {'Dv':>4} "
          f"{'GFLOP':>10} {'KV MiB':>8}  implementations")
    measurements = 0
    for case in cases:
        parts = []
        for impl in impls_for(case, impls):
            reason = skip_reason(case, impl)
            parts.append(f"{impl} ({reason})" if reason else impl)
            measurements += reason is None
        kv = f"{kv_bytes(case) / 2**20:8.0f}" if case.kind == "decode" else f"{'':>8}"
        print(f"{case.label:<42} {case.b:>3} {case.hq:>3} {case.hkv:>3} {case.nq:>6} {case.nk:>6} "
              f"{case.d:>4} {case.d_v:>4} {case_flops(case) / 1e9:>10.1f} {kv}  {', '.join(parts)}")
    print(f"\n{len(cases)} cases, up to {measurements} measurements (torch SDPA, FA4 and "
          f"FlexAttention only where importable on the GPU machine; a peer that refuses a case "
          f"there is recorded as skipped)")
