"""First-call compile time of the hot kernels, and the disk-cache hit in a later process.

Run on a GPU machine:

    PYTHONPATH=. python3 tools/compile_time.py            # parent: cold cache, then warm cache

The parent points CUPY_CACHE_DIR at an empty folder and runs this file twice as a child (`--child`):
the first child compiles every kernel it touches, the second finds them on disk. Each child times,
per call kind, the first call (compile + load + run) and the second (run only), with a device
synchronize after each.
"""
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def child():
    import cupy as cp
    import ml_dtypes
    import numpy as np

    import cuflash

    bf16 = ml_dtypes.bfloat16
    rng = np.random.default_rng(0)

    def arr(*shape):
        return cp.asarray(rng.standard_normal(shape, dtype=np.float32).astype(bf16))

    # inputs first (host random numbers stay out of the timings); the calls in order, so that
    # each call's first run compiles only its own kernels
    x128 = [arr(2, 8, 512, 128) for _ in range(4)]
    x64 = [arr(2, 8, 512, 64) for _ in range(3)]
    xdec = [arr(2, 8, 1, 128), arr(2, 2, 4096, 128), arr(2, 2, 4096, 128)]
    fwd = {}

    def forward128():
        fwd["out"], fwd["lse"] = cuflash.attention(*x128[:3], return_lse=True)

    cases = {
        "forward D=128 (tensor cores)": forward128,
        "forward D=64 causal (tensor cores)": lambda: cuflash.attention(*x64, causal=True),
        "decode GQA 4 D=128 (decode_tc)": lambda: cuflash.attention(*xdec),
        "backward D=128 (tensor cores)": lambda: cuflash.attention_backward(
            x128[3], *x128[:3], fwd["out"], fwd["lse"]),
    }
    for name, fn in cases.items():
        times = []
        for _ in range(2):
            t0 = time.perf_counter()
            fn()
            cp.cuda.Device().synchronize()
            times.append(time.perf_counter() - t0)
        print(f"  {name:40s} first call {times[0]:7.3f} s   second {times[1] * 1e3:7.2f} ms",
              flush=True)


def main():
    if "--child" in sys.argv:
        child()
        return 0
    cache = tempfile.mkdtemp(prefix="cupy-cache-")
    env = dict(os.environ, CUPY_CACHE_DIR=cache)
    for label in ("cold cache (new process, empty CUPY_CACHE_DIR)", "warm cache (new process)"):
        print(label, flush=True)
        t0 = time.perf_counter()
        subprocess.run([sys.executable, os.path.abspath(__file__), "--child"], env=env, check=True)
        print(f"  process total {time.perf_counter() - t0:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
