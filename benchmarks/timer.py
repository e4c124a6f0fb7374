"""Timing on one CUDA stream: the device time of a call (CUDA events around each run, which is
queued behind a GPU spin that hides the host's enqueue time and a write of 2 x L2 that flushes
the cache), the host's enqueue time in the same runs, the wall and host time per call of a plain
back-to-back loop (no spin, no flush, no sync between calls), the device-to-device copy
bandwidth, and the peak device memory of one call."""
import statistics
import time

import numpy as np

DEFAULT_L2_BYTES = 60 * 2**20
COPY_BYTES = 2**30                   # each of source and destination of the copy measurement

SPIN_SOURCE = r"""
extern "C" __global__ void bench_spin(unsigned long long ns) {
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); } while (t - t0 < ns);
}
"""


class Timer:
    """Median time of a callable with CUDA events on one stream, L2 flushed before each run."""

    def __init__(self, cp, stream, target_s, spin_us, l2_bytes):
        self.cp, self.stream, self.target_s = cp, stream, target_s
        self.flush_buffer = cp.empty(2 * l2_bytes // 4, dtype=cp.int32)
        self.spin_kernel = cp.RawKernel(SPIN_SOURCE, "bench_spin")
        self.spin_ns = np.uint64(int(spin_us * 1000))
        self.spin_us = spin_us

    def _prepare_run(self):
        # the spin keeps the GPU busy while the host enqueues the flush and the timed call, so
        # host-side overhead shorter than the spin stays out of the measurement
        self.spin_kernel((1,), (1,), (self.spin_ns,))
        self.flush_buffer.fill(0)

    def _runs(self, fn, n):
        cp = self.cp
        events = [(cp.cuda.Event(), cp.cuda.Event()) for _ in range(n)]
        host = []
        for start, end in events:
            self._prepare_run()
            start.record(self.stream)
            t0 = time.perf_counter()
            fn()
            host.append(time.perf_counter() - t0)
            end.record(self.stream)
        self.stream.synchronize()
        return [cp.cuda.get_elapsed_time(s, e) for s, e in events], host

    def loop(self, fn, calls):
        """Back to back, as an application calls it: the device synchronized once before and once
        after `calls` calls, nothing in between. Wall time per call, and the host's enqueue time
        per call (perf_counter around each call, median)."""
        device = self.cp.cuda.Device()
        host = []
        device.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            t0 = time.perf_counter()
            fn()
            host.append(time.perf_counter() - t0)
        device.synchronize()
        wall = time.perf_counter() - start
        return {"loop_us": wall / calls * 1e6, "host_us": statistics.median(host) * 1e6,
                "loop_calls": calls}

    def measure(self, fn):
        """Device time behind the spin (ms and its spread), then the plain loop (loop_us, host_us)."""
        fn()                                   # untimed: compilation, planning, handles
        self.stream.synchronize()
        probe, _ = self._runs(fn, 1)
        if probe[0] * 1e-3 >= self.target_s:   # slow: three runs in all
            runs = 2
        else:
            warm, _ = self._runs(fn, 3)
            per_run = max(statistics.median(probe + warm), 1e-3) * 1e-3
            runs = int(min(1000, max(10, self.target_s / per_run)))
        times, host = self._runs(fn, runs)
        if runs == 2:
            times = probe + times
        spin_host_us = statistics.median(host) * 1e6
        result = {
            "ms": statistics.median(times), "ms_min": min(times), "ms_mean": statistics.fmean(times),
            "ms_p20": float(np.percentile(times, 20)), "ms_p80": float(np.percentile(times, 80)),
            "runs": len(times), "spin_host_us": spin_host_us,
            "times_ms": [round(t, 5) for t in times],
        }
        if spin_host_us > self.spin_us:
            result["host_bound_warning"] = (f"enqueueing took {spin_host_us:.0f} us > spin "
                                            f"{self.spin_us:.0f} us: host time may be included")
        result.update(self.loop(fn, len(times)))      # as many calls as timed runs
        return result


def measure_copy_bandwidth(cp, timer):
    """Device-to-device copy bandwidth: (bytes read + bytes written) / median time, in TB/s."""
    src = cp.empty(COPY_BYTES // 4, dtype=cp.int32)
    src.fill(1)
    dst = cp.empty_like(src)
    timing = timer.measure(lambda: dst.data.copy_from_device_async(src.data, COPY_BYTES,
                                                                   timer.stream))
    tbps = 2 * COPY_BYTES / (timing["ms"] * 1e-3) / 1e12
    return {"bytes_each_way": COPY_BYTES, "tbps": tbps, **timing}


def cupy_peak_bytes(cp, stream, fn):
    """High-water mark of CuPy pool memory handed out during one call (its outputs included)."""

    class PeakHook(cp.cuda.MemoryHook):
        name = "cuflash_bench_peak"

        def __init__(self):
            self.current = self.peak = 0

        def malloc_postprocess(self, **kw):
            self.current += kw["mem_size"]
            self.peak = max(self.peak, self.current)

        def free_postprocess(self, **kw):
            self.current -= kw["mem_size"]

    hook = PeakHook()
    with hook:
        result = fn()
        stream.synchronize()
        del result
    return hook.peak


def torch_peak_bytes(torch, fn):
    """Peak torch-allocator memory above what was allocated before the call."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    result = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del result
    return peak
