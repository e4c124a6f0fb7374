"""Which keys each query sees, read off real calls; then the seed's 4-token worked example.

Every picture below comes from cuflash.attention itself: with q = k = 0 every visible key gets the
same weight, so with v = the identity, out[i, j] > 0 exactly when query i sees key j. The float64
reference (cuflash.reference) is asked the same question and must agree.

Run: python examples/masks_and_alignment.py   (on CuPy if a GPU is usable, else NumPy)
"""
import numpy as np

import cuflash

try:  # CuPy when a CUDA GPU is usable, else NumPy
    import cupy
    xp = cupy if cupy.is_available() else np
except ImportError:
    xp = np
to_host = getattr(xp, "asnumpy", np.asarray)  # a CuPy array to NumPy; NumPy stays NumPy


def visible(nq, nk, **options):
    """Bool (nq, nk): may query i attend to key j, from cuflash.attention and from the reference."""
    q, k, v = xp.zeros((nq, 1)), xp.zeros((nk, 1)), xp.eye(nk)
    seen = to_host(cuflash.attention(q, k, v, **options)) > 0
    assert (seen == (cuflash.reference.attention(q, k, v, **options) > 0)).all()
    return seen


def show(title_and_grids):
    """Print several pictures side by side ('x' = visible, '.' = hidden)."""
    titles = [t for t, _ in title_and_grids]
    rows = [[" ".join("x" if s else "." for s in row) for row in g] for _, g in title_and_grids]
    width = max(max(len(t) for t in titles), max(len(r[0]) for r in rows)) + 4
    print("".join(t.ljust(width) for t in titles))
    for i in range(max(len(r) for r in rows)):
        print("".join((r[i] if i < len(r) else "").ljust(width) for r in rows))
    print()


print(f"backend: {xp.__name__}\n")
for nq, nk in ((3, 6), (6, 3)):
    print(f"causal=True, Nq={nq}, Nk={nk} (rows: queries, columns: keys)")
    show([(f"align='{a}'", visible(nq, nk, causal=True, align=a))
          for a in ("bottom-right", "top-left")])
# A row of dots is an empty row: its output is exactly 0 and its lse is -inf (never NaN).
out, lse = cuflash.attention(xp.ones((6, 2)), xp.ones((3, 2)), xp.ones((3, 2)), causal=True,
                             return_lse=True)
print(f"Empty rows (causal, Nq=6, Nk=3, bottom-right): out[0] = {to_host(out)[0]}, "
      f"lse[0] = {float(lse[0])}\n")

print("Nq = Nk = 6: a sliding window; window=(left, right) with left keys behind, right ahead")
show([("window=(2, 0)", visible(6, 6, window=(2, 0))),
      ("window=(1, 1)", visible(6, 6, window=(1, 1))),
      ("causal, kv_lens=4", visible(6, 6, causal=True, kv_lens=4))])

# Packed sequences (cu_seqlens): each sequence is its own problem, aligned by its own lengths.
# Rows are the packed query tokens, columns the packed key tokens; nothing crosses sequences.
def visible_packed(cu_q, cu_k, **options):
    nq, nk = cu_q[-1], cu_k[-1]
    q, k, v = xp.zeros((nq, 1, 1)), xp.zeros((nk, 1, 1)), xp.eye(nk).reshape(nk, 1, nk)
    packed = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    seen = to_host(cuflash.attention(q, k, v, **packed, **options))[:, 0] > 0
    assert (seen == (cuflash.reference.attention(q, k, v, **packed, **options)[:, 0] > 0)).all()
    return seen


print("Packed: cu_seqlens_q=[0, 2, 5], cu_seqlens_k=[0, 4, 6] (Lq, Lk = 2, 4 and 3, 2), causal")
show([(f"align='{a}'", visible_packed([0, 2, 5], [0, 4, 6], causal=True, align=a))
      for a in ("bottom-right", "top-left")])

# ALiBi changes no visibility, only the weights: with q = k = 0, out[i, j] is the weight query i
# gives key j, exp(-s |p - j|) over its row's sum; slope s = ln 2 halves it per key of distance.
def weights(nq, nk, **options):
    q, k, v = xp.zeros((nq, 1)), xp.zeros((nk, 1)), xp.eye(nk)
    w = to_host(cuflash.attention(q, k, v, **options))
    assert np.allclose(w, cuflash.reference.attention(q, k, v, **options), atol=1e-9)
    return w


print("ALiBi, alibi_slopes=ln 2 (the weight halves per key of distance), Nq = Nk = 5")
grids = [(title, [" ".join(f"{x:.2f}" if x > 0 else " .  " for x in row) for row in w])
         for title, w in (("causal=True", weights(5, 5, causal=True, alibi_slopes=np.log(2))),
                          ("window=(1, 1)", weights(5, 5, window=(1, 1),
                                                    alibi_slopes=np.log(2))))]
for line in zip(*[[title.ljust(28)] + [r.ljust(28) for r in rows] for title, rows in grids]):
    print("".join(line).rstrip())
print()

# The seed's worked example: N = 4 tokens, d = 2, query row 0. Raw dot products q0·k_j are
# [1, 0, 1, 0]; the default scale 1/sqrt(d) = 1/sqrt(2) gives the scores [0.707, 0, 0.707, 0].
q = xp.asarray([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0], [0.0, 1.0]])
k = q.copy()
v = xp.asarray([[1.0, 1.0], [2.0, 0.0], [0.0, 2.0], [1.0, 1.0]])
print("The 4-token example (scale 1/sqrt(2)): row 0 of the output, expected ~ [0.830, 1.170]")
row0 = to_host(cuflash.attention(q, k, v))[0]
print(f"  all 4 keys in one call:         [{row0[0]:.3f}, {row0[1]:.3f}]")
# The seed's two tiles as two separate calls, then merged: the same answer without the 4x4 matrix.
out_1, lse_1 = cuflash.attention(q, k[:2], v[:2], return_lse=True)
out_2, lse_2 = cuflash.attention(q, k[2:], v[2:], return_lse=True)
out, _ = cuflash.merge(out_1, lse_1, out_2, lse_2)
row0 = to_host(out)[0]
print(f"  tiles (keys 0,1), (2,3) merged: [{row0[0]:.3f}, {row0[1]:.3f}]")
