"""TF32 wgmma on the device: the operand layouts a float32 Hopper forward would use, checked against
NumPy, and the instruction's throughput (issue 16; NOTES' design sketch for float32 on wgmma).

    PYTHONPATH=. python3 tools/tf32_probe.py          # check, then time (an sm_90a device)
    python3 tools/tf32_probe.py compile               # NVRTC + ptxas only (no device needed)

check: one warpgroup, float32 tiles in shared memory with the 128-byte swizzle (column blocks of
32 floats, 16-byte chunk c of row r at c ^ (r % 8), bases 1024-aligned), then
  S = Q K^T   wgmma m64n64k8 .tf32, A = Q and B = K both K-major in shared memory;
  O = P V     wgmma m64n64k8 .tf32, A = P from S's accumulators (no shuffle), B = V^T K-major,
              its keys permuted within each group of 8 (k-slot s holds key 2s for s < 4, key
              2 (s - 4) + 1 else), so that A = {s0, s2, s1, s3} of each 8-key accumulator block.
Each result is compared with float64 products of the inputs truncated to TF32 (the top 19 bits)
and rounded to nearest TF32: either within 1e-3 of the largest entry means the layout is right
(a wrong one is off by the entries themselves), the smaller says which the hardware reads.
accuracy: O = P V over 4096 keys (P in [0, 1), V normal) with one TF32 product or three (hi + lo
splits), accumulated on the tensor cores or in a fresh accumulator per 64-key tile added in
float32 (the tensor cores' sums round toward zero: tools/tf32_rounding.py), against float64.
time: 2 warpgroups per block, one block per SM, a chain of m64n128k8 products on resident tiles:
the TF32 tensor rate an attention kernel could reach (TFLOP/s).
"""
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tf32_rounding import tf32 as tf32_round, truncated as tf32_trunc  # noqa: E402

# The project's wgmma helpers (kernels_cu/wgmma.cuh: descriptors, fences, operand macros) and
# the probe's kernels after them; the .tf32 instructions are the probe's own.
PROBE_SRC = r"""
using tc::u32;
using tc::smem_u32;
using wg::u64;

__device__ __forceinline__ u64 desc(u32 addr) {  // K-major, 128-byte swizzle (rows_times_rows's)
  return wg::desc_sw128(addr, 0, wg::SW128_SBO);
}
// element (r, c) of a float tile stored as column blocks of 32 floats, rows of 128 bytes
__device__ __forceinline__ u32 sw_offset(int r, int c, int rows) {
  return (c / 32) * rows * 128 + r * 128 + ((((c % 32) / 4) ^ (r % 8)) * 16) + (c % 4) * 4;
}

__device__ __forceinline__ void ss_n64(float (&d)[8][4], u64 a, u64 b, int acc) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n64k8.f32.tf32.tf32 {" CUFLASH_WG_DSTR32 "}"
               ", %32, %33, p, 1, 1;\n}\n"
               : CUFLASH_WG_DOPS32(d) : "l"(a), "l"(b), "r"(acc));
}
__device__ __forceinline__ void rs_n64(float (&d)[8][4], const u32 (&a)[4], u64 b, int acc) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n64k8.f32.tf32.tf32 {" CUFLASH_WG_DSTR32 "}"
               ", {%32, %33, %34, %35}, %36, p, 1, 1;\n}\n"
               : CUFLASH_WG_DOPS32(d)
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(acc));
}
__device__ __forceinline__ void ss_n128(float (&d)[16][4], u64 a, u64 b) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n128k8.f32.tf32.tf32 {" CUFLASH_WG_DSTR64 "}"
               ", %64, %65, p, 1, 1;\n}\n"
               : CUFLASH_WG_DOPS64(d) : "l"(a), "l"(b), "r"(1));
}
using wg::fence;
using wg::commit;

// q (64 x 64), k (64 x 64), v (64 x 64) row-major float32; s_out, o_out (64 x 64)
extern "C" __global__ void __launch_bounds__(128) probe(const float* q, const float* k,
                                                        const float* v, float* s_out,
                                                        float* o_out) {
  extern __shared__ __align__(1024) unsigned char raw[];
  const u32 base = (smem_u32(raw) + 1023u) & ~1023u;
  const u32 sQ = base, sK = sQ + 64 * 64 * 4, sVt = sK + 64 * 64 * 4;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
  for (int i = tid; i < 64 * 64; i += 128) {
    const int r = i / 64, c = i % 64;
    asm volatile("st.shared.f32 [%0], %1;" ::"r"(sQ + sw_offset(r, c, 64)), "f"(q[i]));
    asm volatile("st.shared.f32 [%0], %1;" ::"r"(sK + sw_offset(r, c, 64)), "f"(k[i]));
    // V^T: row d = c; position s of each 8 holds key 2 s (s < 4) or 2 (s - 4) + 1: key r -> p
    const int p = 8 * (r / 8) + ((r % 2) ? 4 + (r % 8) / 2 : (r % 8) / 2);
    asm volatile("st.shared.f32 [%0], %1;" ::"r"(sVt + sw_offset(c, p, 64)), "f"(v[i]));
  }
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  __syncthreads();
  float s[8][4];
  fence();
#pragma unroll
  for (int kk = 0; kk < 8; ++kk) {  // 8 k-steps of 8 floats: 4 per 128-byte row, 2 blocks
    const u32 off = (kk / 4) * 64 * 128 + (kk % 4) * 32;
    ss_n64(s, desc(sQ + off), desc(sK + off), kk > 0);
  }
  commit();
  wg::wait<0>();
  const int r0 = 16 * warp + g;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    s_out[r0 * 64 + 8 * j + 2 * t] = s[j][0];
    s_out[r0 * 64 + 8 * j + 2 * t + 1] = s[j][1];
    s_out[(r0 + 8) * 64 + 8 * j + 2 * t] = s[j][2];
    s_out[(r0 + 8) * 64 + 8 * j + 2 * t + 1] = s[j][3];
  }
  float o[8][4];
#pragma unroll
  for (int kk = 0; kk < 8; ++kk) {  // keys 8 kk .. 8 kk + 7: S's accumulator block kk as A
    const u32 a[4] = {__float_as_uint(s[kk][0]), __float_as_uint(s[kk][2]),
                      __float_as_uint(s[kk][1]), __float_as_uint(s[kk][3])};
    fence();  // (registers written since the last wgmma)
    rs_n64(o, a, desc(sVt + (kk / 4) * 64 * 128 + (kk % 4) * 32), kk > 0);
  }
  commit();
  wg::wait<0>();
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    o_out[r0 * 64 + 8 * j + 2 * t] = o[j][0];
    o_out[r0 * 64 + 8 * j + 2 * t + 1] = o[j][1];
    o_out[(r0 + 8) * 64 + 8 * j + 2 * t] = o[j][2];
    o_out[(r0 + 8) * 64 + 8 * j + 2 * t + 1] = o[j][3];
  }
}

__device__ __forceinline__ u32 tf32_rn(float x) {
  u32 r;
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
  return r;
}

// O (64 x 64) = P (64 x 64 T) V (64 T x 64), key tile after key tile (64 keys each), V^T staged in
// shared memory (unpermuted: A's k-slots in key order, P read from global memory). mode: bit 0
// three TF32 products (P and V split hi + lo, hi = tf32_rn(x), lo = tf32_rn(x - hi); without it
// one product of the raw floats), bit 1 a fresh accumulator per tile added to O in float32
// (without it every tile accumulates into O on the tensor cores).
extern "C" __global__ void __launch_bounds__(128) chain(const float* p, const float* v, int T,
                                                       int mode, float* o_out) {
  extern __shared__ __align__(1024) unsigned char raw[];
  const u32 base = (smem_u32(raw) + 1023u) & ~1023u;
  const u32 sHi = base, sLo = base + 64 * 64 * 4;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
  const bool three = mode & 1, fresh = mode & 2;
  const int K = 64 * T, r0 = 16 * warp + g;
  float o[8][4], pv[8][4];
  for (int j = 0; j < 8; ++j)
    for (int e = 0; e < 4; ++e) o[j][e] = pv[j][e] = 0.f;
  for (int tile = 0; tile < T; ++tile) {
    __syncthreads();  // the previous tile's products are done with the staged V^T
    for (int i = tid; i < 64 * 64; i += 128) {
      const int key = i / 64, d = i % 64;
      const float x = v[(64 * tile + key) * 64 + d];
      const float hi = three ? __uint_as_float(tf32_rn(x)) : x;
      asm volatile("st.shared.f32 [%0], %1;" ::"r"(sHi + sw_offset(d, key, 64)), "f"(hi));
      asm volatile("st.shared.f32 [%0], %1;" ::"r"(sLo + sw_offset(d, key, 64)),
                   "f"(__uint_as_float(tf32_rn(x - hi))));
    }
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < 8; ++kk) {
      const int c = 64 * tile + 8 * kk + t;
      const float x[4] = {p[r0 * K + c], p[(r0 + 8) * K + c], p[r0 * K + c + 4],
                          p[(r0 + 8) * K + c + 4]};
      u32 hi[4], lo[4];
      for (int e = 0; e < 4; ++e) {
        hi[e] = three ? tf32_rn(x[e]) : __float_as_uint(x[e]);
        lo[e] = tf32_rn(x[e] - __uint_as_float(hi[e]));
      }
      const u32 off = (kk / 4) * 64 * 128 + (kk % 4) * 32;
      const int acc = fresh ? kk > 0 : 1;
      fence();  // (registers written since the last wgmma)
      if (fresh) {
        rs_n64(pv, hi, desc(sHi + off), acc);
        if (three) {
          rs_n64(pv, hi, desc(sLo + off), 1);
          rs_n64(pv, lo, desc(sHi + off), 1);
        }
      } else {
        rs_n64(o, hi, desc(sHi + off), acc);
        if (three) {
          rs_n64(o, hi, desc(sLo + off), 1);
          rs_n64(o, lo, desc(sHi + off), 1);
        }
      }
    }
    commit();
    wg::wait<0>();
    if (fresh)
      for (int j = 0; j < 8; ++j)
        for (int e = 0; e < 4; ++e) o[j][e] += pv[j][e];
  }
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    o_out[r0 * 64 + 8 * j + 2 * t] = o[j][0];
    o_out[r0 * 64 + 8 * j + 2 * t + 1] = o[j][1];
    o_out[(r0 + 8) * 64 + 8 * j + 2 * t] = o[j][2];
    o_out[(r0 + 8) * 64 + 8 * j + 2 * t + 1] = o[j][3];
  }
}

// reps chains of 16 k-steps (K = 128) of m64n128k8 per warpgroup on resident tiles
extern "C" __global__ void __launch_bounds__(256) rate(int reps, float* sink) {
  extern __shared__ __align__(1024) unsigned char raw[];
  const u32 base = (smem_u32(raw) + 1023u) & ~1023u;
  const u32 sA = base + (threadIdx.x / 128) * 64 * 128 * 4, sB = base + 2 * 64 * 128 * 4;
  for (int i = threadIdx.x; i < (2 * 64 + 128) * 128; i += 256)
    asm volatile("st.shared.f32 [%0], %1;" ::"r"(base + 4 * i), "f"(1e-3f * (i % 7)));
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  __syncthreads();
  float d[16][4];
  for (int j = 0; j < 16; ++j) d[j][0] = d[j][1] = d[j][2] = d[j][3] = 0.f;
  for (int r = 0; r < reps; ++r) {
    fence();
#pragma unroll
    for (int kk = 0; kk < 16; ++kk) {
      const u32 off = (kk / 4) * 64 * 128 + (kk % 4) * 32;
      ss_n128(d, desc(sA + off), desc(sB + (kk / 4) * 128 * 128 + (kk % 4) * 32));
    }
    commit();
    wg::wait<0>();
  }
  float x = 0.f;
  for (int j = 0; j < 16; ++j) x += d[j][0] + d[j][1] + d[j][2] + d[j][3];
  if (x == 12345.f) sink[0] = x;  // (keeps the products)
}
"""


def source():
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from cuflash import _runtime
    return _runtime.source("wgmma.cuh") + PROBE_SRC


def module():
    import cupy as cp
    return cp.RawModule(code=source(), options=("-arch=sm_90a", "-std=c++17"))


def compile_only():
    """NVRTC + ptxas for sm_90a with no device (registers and spills of both kernels)."""
    from cupy.cuda import compiler
    import io
    prog = compiler._NVRTCProgram(source(), "tf32_probe.cu")
    log = io.StringIO()
    prog.compile(("-arch=sm_90a", "-std=c++17", "--ptxas-options=-v"), log)
    print(log.getvalue())
    return 0


def check(mod):
    import cupy as cp
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((64, 64)).astype(np.float32) for _ in range(3))
    s_out = cp.zeros((64, 64), cp.float32)
    o_out = cp.zeros((64, 64), cp.float32)
    f = mod.get_function("probe")
    f.max_dynamic_shared_size_bytes = 3 * 64 * 64 * 4 + 1024
    f((1,), (128,), (cp.asarray(q), cp.asarray(k), cp.asarray(v), s_out, o_out),
      shared_mem=3 * 64 * 64 * 4 + 1024)
    s, o = s_out.get(), o_out.get()
    ok = True
    for name, got, ref_of in (
            ("S = Q K^T", s, lambda cv: cv(q).astype(np.float64) @ cv(k).astype(np.float64).T),
            ("O = S V", o, lambda cv: cv(s).astype(np.float64) @ cv(v).astype(np.float64))):
        errs = {}
        for how, cv in (("truncated", tf32_trunc), ("rounded", tf32_round)):
            ref = ref_of(cv)
            errs[how] = float(np.abs(got - ref).max() / np.abs(ref).max())
        good = min(errs.values()) < 1e-3  # (a wrong layout gives errors of order 1)
        ok &= good
        print(f"{name}: max error / max |ref| against inputs truncated to TF32 "
              f"{errs['truncated']:.2e}, rounded to nearest {errs['rounded']:.2e} -> "
              f"{'layout OK' if good else 'FAIL (layout)'}")
    return ok


def accuracy(mod, T=64):
    """O = P V over 64 T keys (P in [0, 1), like softmax weights; V normal) in four modes against
    float64, beside float32 NumPy (BLAS) and the float32 sum of exact products in key order."""
    import cupy as cp
    rng = np.random.default_rng(1)
    p = rng.random((64, 64 * T)).astype(np.float32)
    v = rng.standard_normal((64 * T, 64)).astype(np.float32)
    ref = p.astype(np.float64) @ v.astype(np.float64)
    scale = np.abs(ref).max()
    f = mod.get_function("chain")
    f.max_dynamic_shared_size_bytes = 2 * 64 * 64 * 4 + 1024
    out = cp.zeros((64, 64), cp.float32)
    rows = []
    for mode, name in ((0, "1 x TF32, accumulated on the tensor cores"),
                       (2, "1 x TF32, a fresh accumulator per 64-key tile"),
                       (1, "3 x TF32, accumulated on the tensor cores"),
                       (3, "3 x TF32, a fresh accumulator per 64-key tile")):
        f((1,), (128,), (cp.asarray(p), cp.asarray(v), np.int32(T), np.int32(mode), out),
          shared_mem=2 * 64 * 64 * 4 + 1024)
        rows.append((name, float(np.abs(out.get() - ref).max() / scale)))
    rows.append(("float32 NumPy (BLAS)", float(np.abs(p @ v - ref).max() / scale)))
    seq = np.zeros((64, 64), np.float32)
    for j in range(64 * T):  # (the naive loop's order: one rounding per key)
        seq += p[:, j:j + 1] * v[j]
    rows.append(("float32, key after key (naive)", float(np.abs(seq - ref).max() / scale)))
    print(f"O = P V over {64 * T} keys, max error / max |O| against float64:")
    for name, err in rows:
        print(f"  {name:48s} {err:.2e}")


def time_rate(mod, reps=2000):
    import cupy as cp
    f = mod.get_function("rate")
    smem = (2 * 64 + 128) * 128 * 4 + 1024
    f.max_dynamic_shared_size_bytes = smem
    sms = cp.cuda.Device().attributes["MultiProcessorCount"]
    sink = cp.zeros(1, cp.float32)
    f((sms,), (256,), (np.int32(10), sink), shared_mem=smem)
    s, e = cp.cuda.Event(), cp.cuda.Event()
    best = None
    for _ in range(3):
        s.record()
        f((sms,), (256,), (np.int32(reps), sink), shared_mem=smem)
        e.record()
        e.synchronize()
        ms = cp.cuda.get_elapsed_time(s, e)
        best = ms if best is None else min(best, ms)
    flops = 2 * 64 * 128 * 128 * 2 * reps * sms  # per block: 2 warpgroups x (64 x 128 x 128)
    print(f"TF32 wgmma m64n128k8, {sms} SMs x 2 warpgroups: {flops / best / 1e9:.1f} TFLOP/s "
          f"({best:.3f} ms)")


def main(argv):
    if argv and argv[0] == "compile":
        return compile_only()
    mod = module()
    ok = check(mod)
    accuracy(mod)
    time_rate(mod)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
