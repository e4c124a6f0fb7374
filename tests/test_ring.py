"""Ring attention (cuflash.ring) in its single-process emulation: P ranks, the real schedule,
exchanges as copies; on NumPy, and on one GPU when there is one, against the dense reference."""
import numpy as np
import pytest

from cuflash import reference, ring
from helpers import FLOORS, assert_close_to_reference, naive_attention, naive_attention_backward


def _xp(name):
    if name == "numpy":
        return np
    cupy = pytest.importorskip("cupy")
    try:
        cupy.cuda.runtime.getDeviceCount()
        cupy.zeros(1)
    except Exception:
        pytest.skip("no usable GPU")
    return cupy


def _host(x):
    return x.get() if hasattr(x, "get") and not isinstance(x, np.ndarray) else np.asarray(x)


CASES = [  # (P, layout, options)
    (1, "zigzag", dict(causal=True)),
    (2, "zigzag", dict(causal=True)),
    (4, "zigzag", dict(causal=True)),
    (3, "contiguous", dict(causal=True)),
    (4, "zigzag", {}),
    (2, "contiguous", dict(window=(9, 3))),
    (4, "zigzag", dict(causal=True, window=(20, None))),
    (8, "zigzag", dict(causal=True)),
    (4, "zigzag", dict(causal=True, kv_lens=[[150], [0]])),   # the first 150 of 192 tokens
    (3, "contiguous", dict(kv_lens=[[100], [144]])),
]


@pytest.mark.parametrize("xp_name", ["numpy", "cupy"])
@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("P, layout, options", CASES, ids=[f"{c[0]}-{c[1]}-{c[2]}" for c in CASES])
def test_ring_matches_the_whole_sequence(rng, xp_name, dtype, P, layout, options):
    xp = _xp(xp_name)
    N = 48 * P
    q, k, v, dout = (rng.standard_normal((2, 3, N, 8)).astype(dtype) for _ in range(4))
    k, v = k[:, :1], v[:, :1]  # grouped-query: one kv head for three query heads
    shards = [ring.shard(xp.asarray(x), P, layout) for x in (q, k, v, dout)]

    def rank(r):
        q_r, k_r, v_r, do_r = (s[r.rank] for s in shards)
        out, lse = ring.attention(q_r, k_r, v_r, r, layout=layout, return_lse=True, **options)
        grads = ring.attention_backward(do_r, q_r, k_r, v_r, out, lse, r, layout=layout,
                                        **options)
        return (out, lse) + grads

    results = ring.emulate(P, rank)
    got = [_host(ring.unshard([res[i] for res in results], layout, axis=-1 if i == 1 else -2))
           for i in range(5)]
    ref_out, ref_lse = reference.attention(q, k, v, align="top-left", return_lse=True, **options)
    ref_grads = reference.attention_backward(dout, q, k, v, got[0], got[1], align="top-left",
                                             **options)
    low = dtype != "float64"
    floor = FLOORS[dtype]
    naive = naive_attention(q, k, v, align="top-left", **options) if low else (None, None)
    assert_close_to_reference(got[0], ref_out, naive[0], floor, "out")
    assert_close_to_reference(got[1], ref_lse, naive[1], floor, "lse")
    naive_g = (naive_attention_backward(dout, q, k, v, got[0], got[1], align="top-left",
                                        **options) if low else (None,) * 3)
    for name, g, r, n in zip(("dq", "dk", "dv"), got[2:], ref_grads, naive_g):
        assert g.dtype == np.dtype(dtype), name
        assert_close_to_reference(g, r, n, floor * 4, name)


def test_zigzag_balances_causal_work():
    """Under a causal mask every rank computes the same number of visible block pairs."""
    P, n_local = 4, 16
    work = []
    for r in range(P):
        pairs = [(qs, ks, o) for held in range(P)
                 for qs, ks, o in ring._pairs(r, P, held, "zigzag", n_local, True, None)]
        work.append(sum(1 if not o else 0.5 for _, _, o in pairs))
    assert len(set(work)) == 1, work


def test_shard_round_trip(rng):
    x = rng.standard_normal((2, 24, 3))
    for layout in ring.LAYOUTS:
        parts = ring.shard(x, 3, layout)
        assert all(p.shape == (2, 8, 3) for p in parts) if layout == "contiguous" else True
        np.testing.assert_array_equal(ring.unshard(parts, layout), x)
    assert [p[0, 0, 0] for p in ring.shard(np.arange(8.0).reshape(1, 8, 1), 2)] == [0.0, 2.0]


def test_ring_errors(rng):
    q = rng.standard_normal((1, 10, 4))
    with pytest.raises(ValueError, match="^shard: the sequence length 10 must be a multiple of 4"):
        ring.shard(q, 2)
    with pytest.raises(ValueError, match="^ring.attention: layout must be"):
        ring.emulate(1, lambda r: ring.attention(q, q, q, r, layout="rows"))
    with pytest.raises(TypeError, match="^ring.attention: ring must be"):
        ring.attention(q, q, q, object())
    with pytest.raises(ValueError, match="^emulate: size must be a positive int"):
        ring.emulate(0, lambda r: None)
    with pytest.raises(ValueError, match=r"^ring.attention: kv_lens must lie in \[0, Nk\] = \[0, 20\]"):
        ring.emulate(2, lambda r: ring.attention(q, q, q, r, kv_lens=21))
    with pytest.raises(TypeError, match="^ring.attention: kv_lens must hold integers"):
        ring.emulate(2, lambda r: ring.attention(q, q, q, r, kv_lens=[1.5]))


@pytest.mark.gpu
def test_ring_over_nccl():
    """The real ring: one process per GPU over NCCL (examples/ring_attention.py), against one call
    on the whole sequence. Needs 2 or more GPUs (skipped otherwise, and not counted as run)."""
    import os
    import subprocess
    import sys
    from pathlib import Path
    cupy = pytest.importorskip("cupy")
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception:
        count = 0
    if count < 2:
        pytest.skip("needs 2 or more GPUs")
    root = Path(__file__).resolve().parent.parent
    env = dict(os.environ, PYTHONPATH=str(root))
    done = subprocess.run([sys.executable, str(root / "examples" / "ring_attention.py"),
                           "--ranks", str(min(count, 8))], capture_output=True, text=True,
                          timeout=600, cwd=root, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "NCCL" in done.stdout, done.stdout
