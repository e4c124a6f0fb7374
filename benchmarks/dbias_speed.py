"""The bias gradient's cost (issue 18's target: the backward with dbias at most the backward
without it plus one pass over the bias). bf16, B = 4, H = 8, N = 2048, D = 64 and 128, causal and
not, a float32 bias of shape (B, H, N, N) (no broadcast sum) and (H, N, N) (summed over the
batch). Per case: the backward with the bias and without dbias ("plain"), with return_dbias
("dbias"), and one pass over a (B, H, N, N) float32 buffer (a fill: one write of the dense
dbias), in ms; target = (plain + pass) / dbias (>= 1.0: met). CUDA events around each call on one
stream after warm-up (compilation included), median of RUNS, the variants interleaved run by
run. Prints the backward path of each variant. Beside them, the peer of issue 18's target: torch
SDPA's efficient backend with a trainable float mask (the bias as bf16, its dtype rule), the time
of torch.autograd.grad for q, k, v and the mask after one forward ("sdpa-eff"; non-causal only:
SDPA takes no mask with is_causal), and ratio = sdpa-eff / dbias (>= 1.0: met).

    PYTHONPATH=. python benchmarks/dbias_speed.py [--runs 15]
"""
import argparse
import statistics

import numpy as np


def _time(cp, fn):
    start, end = cp.cuda.Event(), cp.cuda.Event()
    start.record()
    fn()
    end.record()
    end.synchronize()
    return cp.cuda.get_elapsed_time(start, end)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=15)
    args = parser.parse_args()
    import cupy as cp
    import ml_dtypes

    import cuflash
    from cuflash import _gpu, _validate

    B, H, N = 4, 8, 2048
    rng = np.random.default_rng(0)
    dense = cp.empty((B, H, N, N), dtype=cp.float32)  # the one pass: a fill of this
    print(f"bf16, B={B} H={H} N={N}; ms = median of {args.runs} (CUDA events); "
          "target = (plain + pass) / dbias")
    try:
        import torch
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:
        torch = None

    def sdpa_eff(q, k, v, dout, bias):
        """The gradients of SDPA-efficient with a trainable mask, as a timed function."""
        tq, tk, tv = (torch.from_dlpack(x).requires_grad_() for x in (q, k, v))
        mask = torch.from_dlpack(bias).to(torch.bfloat16)
        mask = (mask if mask.ndim == 4 else mask[None]).requires_grad_()
        with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
            o = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, attn_mask=mask)
        tdo = torch.from_dlpack(dout)

        def grads():
            return torch.autograd.grad(o, (tq, tk, tv, mask), tdo, retain_graph=True)
        grads()  # (a refusal raises here)
        return grads

    print(f"{'case':<24} {'plain':>8} {'dbias':>8} {'pass':>7} {'target':>7} {'sdpa-eff':>8} "
          f"{'ratio':>6}  paths")
    for D in (128, 64):
        def bf16(shape):
            host = rng.standard_normal(shape).astype(ml_dtypes.bfloat16)
            return cp.asarray(host.view(np.uint16)).view(ml_dtypes.bfloat16)
        q, k, v, dout = (bf16((B, H, N, D)) for _ in range(4))
        for shape in ((B, H, N, N), (H, N, N)):
            bias = cp.asarray(rng.standard_normal(shape, dtype=np.float32))
            for causal in (False, True):
                opts = dict(causal=causal, bias=bias)
                out, lse = cuflash.attention(q, k, v, return_lse=True, **opts)
                paths = [_gpu.backward_path(_validate.make_problem(q, k, v, return_dbias=d,
                                                                   **opts)) for d in (False, True)]
                fns = {
                    "plain": lambda: cuflash.attention_backward(dout, q, k, v, out, lse, **opts),
                    "dbias": lambda: cuflash.attention_backward(dout, q, k, v, out, lse,
                                                                return_dbias=True, **opts),
                    "pass": lambda: dense.fill(0),
                }
                if torch is not None and not causal:
                    try:
                        fns["sdpa-eff"] = sdpa_eff(q, k, v, dout, bias)
                    except (RuntimeError, TypeError) as e:  # the backend refused it
                        print(f"  sdpa-eff refused: {e}".splitlines()[0])
                for fn in fns.values():  # warm-up (and compilation)
                    for _ in range(3):
                        fn()
                cp.cuda.Stream.null.synchronize()
                times = {n: [] for n in fns}
                for _ in range(args.runs):
                    for n, fn in fns.items():
                        times[n].append(_time(cp, fn))
                med = {n: statistics.median(t) for n, t in times.items()}
                name = f"D{D} {'causal' if causal else 'full'} {'x'.join(map(str, shape))}"
                peer = (f"{med['sdpa-eff']:8.3f} {med['sdpa-eff'] / med['dbias']:6.3f}"
                        if "sdpa-eff" in med else f"{'-':>8} {'-':>6}")
                print(f"{name:<24} {med['plain']:8.3f} {med['dbias']:8.3f} {med['pass']:7.3f} "
                      f"{(med['plain'] + med['pass']) / med['dbias']:7.3f} {peer}  "
                      f"{paths[0]} / {paths[1]}")


if __name__ == "__main__":
    main()
