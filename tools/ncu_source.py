"""Per-instruction stall table of an ncu report (SourceCounters section), as plain text.

    python3 tools/ncu_source.py REPORT.ncu-rep OUTDIR [TOP]

For each profiled kernel launch: OUTDIR/<id>_<kernel>.txt with one line per SASS instruction
(address, warp-state samples in total and by stall reason, executed count, the instruction), then a
summary of the TOP instructions by samples. Uses ncu's own Python module (ncu_report, found under
the Nsight Compute install: set PYTHONPATH to its extras/python folder).
"""
import os
import re
import sys


def main(argv):
    import ncu_report

    path, outdir = argv[0], argv[1]
    top = int(argv[2]) if len(argv) > 2 else 40
    os.makedirs(outdir, exist_ok=True)
    ctx = ncu_report.load_report(path)
    for ri in range(ctx.num_ranges()):
        rng = ctx.range_by_idx(ri)
        for ai in range(rng.num_actions()):
            act = rng.action_by_idx(ai)
            name = act.name()
            # every metric with per-PC instances
            per_pc = {}
            for mname in act.metric_names():
                m = act.metric_by_name(mname)
                try:
                    if not m.has_correlation_ids():
                        continue
                    cids = m.correlation_ids()
                    n = m.num_instances()
                except Exception:
                    continue
                short = mname.replace("smsp__pcsamp_warps_issue_stalled_", "st_").replace(
                    "smsp__pcsamp_", "")
                for i in range(n):
                    pc = cids.as_uint64(i)
                    try:
                        val = m.as_double(i)
                    except Exception:
                        continue
                    per_pc.setdefault(pc, {})[short] = val
            if not per_pc:
                print("no per-PC metrics for", name)
                continue
            cols = sorted({k for d in per_pc.values() for k in d})
            stall_cols = [c for c in cols if c.startswith("st_") and not c.endswith("_not_issued")]
            total = {c: sum(d.get(c, 0.0) for d in per_pc.values()) for c in cols}
            fname = os.path.join(outdir, f"{ai:02d}_{re.sub(r'[^A-Za-z0-9]+', '_', name)[:60]}.txt")
            with open(fname, "w") as f:
                f.write(f"# {name}\n# totals: " + ", ".join(
                    f"{c}={total[c]:.0f}" for c in cols if total[c]) + "\n")
                lines = []
                for pc in sorted(per_pc):
                    d = per_pc[pc]
                    try:
                        sass = act.sass_by_pc(pc)
                    except Exception:
                        sass = "?"
                    samples = d.get("sample_count", sum(d.get(c, 0) for c in stall_cols))
                    reasons = sorted(((d.get(c, 0), c[3:]) for c in stall_cols), reverse=True)
                    rs = " ".join(f"{r}:{v:.0f}" for v, r in reasons[:4] if v)
                    ex = d.get("inst_executed", d.get("sass__inst_executed", 0))
                    lines.append((samples, f"{pc:6x} {samples:8.0f} {ex:10.0f}  {sass:60s} {rs}"))
                for _, line in lines:
                    f.write(line + "\n")
                f.write(f"\n# top {top} by samples\n")
                for _, line in sorted(lines, key=lambda x: -x[0])[:top]:
                    f.write(line + "\n")
            print("wrote", fname, "per-PC metrics:", len(cols))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
