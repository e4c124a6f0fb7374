"""Ring attention: one causal sequence sharded over P ranks, exact, checked against one call.

    python examples/ring_attention.py            # P = 2 ranks
    python examples/ring_attention.py --ranks 4

With at least P GPUs it starts one process per GPU, joined by a NCCL communicator
(cuflash.ring.NcclRing); otherwise it runs the same schedule for P emulated ranks in this process
(cuflash.ring.emulate: on the GPU if there is one, else on NumPy). Either way each rank holds two
mirrored chunks of the sequence (the zigzag layout) and the result is compared with attention over
the whole sequence on one device.
"""
import argparse
import multiprocessing as mp

import numpy as np

import cuflash
from cuflash import ring

B, H, D = 1, 4, 64


def inputs(n, seed=0):
    rng = np.random.default_rng(seed)
    return tuple(rng.standard_normal((B, H, n, D)).astype(np.float32) for _ in range(4))


def rank_work(r, q, k, v, dout):
    """What every rank runs: its shards in, its shards of out and of the gradients out."""
    P = r.size
    q_r, k_r, v_r, do_r = (ring.shard(x, P)[r.rank] for x in (q, k, v, dout))
    out, lse = ring.attention(q_r, k_r, v_r, r, causal=True, return_lse=True)
    dq, dk, dv = ring.attention_backward(do_r, q_r, k_r, v_r, out, lse, r, causal=True)
    return out, dq, dk, dv


def nccl_rank(rank, size, uid, n, queue):
    import cupy
    from cupy.cuda import nccl
    cupy.cuda.Device(rank).use()
    comm = nccl.NcclCommunicator(size, uid, rank)
    q, k, v, dout = (cupy.asarray(x) for x in inputs(n))
    parts = rank_work(ring.NcclRing(comm, rank, size), q, k, v, dout)
    queue.put((rank, [x.get() for x in parts]))


def gpus():
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount()
    except Exception:
        return 0


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--tokens-per-rank", type=int, default=512)
    args = parser.parse_args()
    P, n = args.ranks, args.ranks * args.tokens_per_rank
    q, k, v, dout = inputs(n)
    if gpus() >= P > 1:
        from cupy.cuda import nccl
        how = f"{P} processes, one GPU each, NCCL"
        uid = nccl.get_unique_id()
        ctx = mp.get_context("spawn")
        queue = ctx.Queue()
        procs = [ctx.Process(target=nccl_rank, args=(r, P, uid, n, queue)) for r in range(P)]
        for p in procs:
            p.start()
        results = dict(queue.get() for _ in procs)
        for p in procs:
            p.join()
        results = [results[r] for r in range(P)]
    else:
        xp = np
        if gpus():
            import cupy as xp
        how = f"{P} emulated ranks in one process on {'the GPU' if xp is not np else 'NumPy'}"
        arrays = [xp.asarray(x) for x in (q, k, v, dout)]
        results = ring.emulate(P, lambda r: rank_work(r, *arrays))
        results = [[x.get() if hasattr(x, "get") and not isinstance(x, np.ndarray) else x
                    for x in res] for res in results]
    got = [ring.unshard([res[i] for res in results]) for i in range(4)]
    out, lse = cuflash.attention(q, k, v, causal=True, return_lse=True)
    grads = cuflash.attention_backward(dout, q, k, v, out, lse, causal=True)
    errors = [float(np.max(np.abs(a - b))) for a, b in zip(got, (out,) + grads)]
    print(f"ring attention over {n} tokens, {how}")
    for name, err in zip(("out", "dq", "dk", "dv"), errors):
        print(f"  max |{name} - one call| = {err:.2e}")
    assert max(errors) < 1e-4, errors


if __name__ == "__main__":
    main()
