import sys
sys.path.insert(0, ".")
from cuflash import _config, _kernels
exprs = [e for _, _, _, f, e in _config.all_instantiations() if f == "bwd_sm80.cu"]
log, mapping = _kernels._compile("bwd_sm80.cu", exprs, sys.argv[1])
per = _kernels.parse_ptxas_log(log)
missing = [e for e in exprs if "registers" not in per.get(mapping[e], {})]
print(sys.argv[1], sys.argv[2], len(exprs), "missing", len(missing), "log lines", len(log.splitlines()),
      "entries", log.count("Compiling entry"), "used", log.count("Used "), flush=True)
if missing:
    print("MISSING", missing[:2], mapping.get(missing[0]))
    m = mapping[missing[0]]
    i = log.find(m)
    print("found at", i, repr(log[max(0, i - 300): i + 600]) if i >= 0 else repr(log[-800:]))
