"""Is a kernel change PTX-identical? Hashes of every instantiation's PTX, without a GPU.

    python tools/ptx_identity.py hash OUT.json [--arch compute_90a] [--file decode.cu] [--jobs 2]
    python tools/ptx_identity.py compare OLD.json NEW.json

`hash` compiles (NVRTC, no device) every name expression the package can request
(cuflash._gpu.instantiations(), the CI build's list) of the tree that `import cuflash` finds (set
PYTHONPATH to hash another checkout, e.g. a `git worktree` of the base), 40 expressions per NVRTC
program, and hashes each kernel's PTX entry with comments, .loc / .file lines and NVRTC's
per-build _INTERNAL_ names stripped. `compare` lists the instantiations whose hash differs. Equal
hashes for compute_90a and compute_80 mean the kernels behave and run exactly as before, so a
refactor that keeps them needs no GPU run to be trusted. About 8 minutes per architecture for the
whole catalog on 2 CPUs.
"""
import argparse
import collections
import hashlib
import json
import os
import re
import sys
from concurrent.futures import ProcessPoolExecutor

_ENTRY = re.compile(r"(?=^(?:\.visible |\.weak )?\.(?:entry|func) )", re.M)
_NAME = re.compile(r"(?:\.visible |\.weak )?\.(?:entry|func) (?:\([^)]*\) )?(\S+?)\(")


def _normalized(ptx):
    ptx = re.sub(r"//[^\n]*", "", ptx)
    ptx = re.sub(r"^\s*\.(?:loc|file)[^\n]*\n", "", ptx, flags=re.M)
    return re.sub(r"_INTERNAL_\w+?_cu_[0-9a-f]+_\d+", "_INTERNAL_", ptx)


def _hash_group(job):
    filename, exprs, arch = job
    from cupy.cuda import compiler

    from cuflash import _runtime
    program = compiler._NVRTCProgram(_runtime.source(filename), filename, name_expressions=exprs)
    ptx, mapping = program.compile(_runtime.OPTIONS + (f"-arch={arch}",))
    ptx = _normalized(ptx.decode() if isinstance(ptx, bytes) else ptx)
    entries = {}
    for part in _ENTRY.split(ptx):
        m = _NAME.match(part)
        if m:
            entries[m.group(1)] = part
    return {f"{filename}|{e}": hashlib.sha1(entries.get(mapping[e], "MISSING").encode())
            .hexdigest()[:16] for e in exprs}


def hash_tree(out, arch, only, jobs):
    from cuflash import _gpu
    by_file = collections.defaultdict(list)
    for inst in _gpu.instantiations():
        if not only or inst[-2] == only:
            by_file[inst[-2]].append(inst[-1])
    work = [(f, es[i:i + 40], arch) for f, es in by_file.items() for i in range(0, len(es), 40)]
    hashes = {}
    with ProcessPoolExecutor(jobs) as pool:
        for part in pool.map(_hash_group, work):
            hashes.update(part)
    missing = [k for k, v in hashes.items() if v == hashlib.sha1(b"MISSING").hexdigest()[:16]]
    if missing:
        sys.exit(f"no PTX entry found for {len(missing)} expressions, e.g. {missing[0]}")
    with open(out, "w") as f:
        json.dump(hashes, f, indent=0, sort_keys=True)
    print(f"{len(hashes)} instantiations ({arch}) -> {out}")


def compare(old_path, new_path):
    with open(old_path) as f:
        old = json.load(f)
    with open(new_path) as f:
        new = json.load(f)
    differ = sorted(k for k in old.keys() & new.keys() if old[k] != new[k])
    print(f"{len(old)} / {len(new)} instantiations; {len(differ)} differ; "
          f"{len(old.keys() - new.keys())} only in the old, {len(new.keys() - old.keys())} only "
          "in the new")
    for name, n in collections.Counter(k.split("|")[0] for k in differ).most_common():
        print(f"  {name}: {n} differ")
    for k in differ[:20]:
        print("   ", k)
    return 1 if differ or old.keys() != new.keys() else 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    h = sub.add_parser("hash")
    h.add_argument("out")
    h.add_argument("--arch", default="compute_90a")
    h.add_argument("--file", default=None, help="only this kernels_cu file's instantiations")
    h.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    c = sub.add_parser("compare")
    c.add_argument("old")
    c.add_argument("new")
    a = ap.parse_args()
    if a.cmd == "hash":
        hash_tree(a.out, a.arch, a.file, a.jobs)
    else:
        sys.exit(compare(a.old, a.new))


if __name__ == "__main__":
    main()
