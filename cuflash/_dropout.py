"""Dropout's random bits on the host: Philox4x32-7 in vectorized uint32 NumPy arithmetic, the
same bits as kernels_cu/philox.cuh (DESIGN.md "Dropout", README "Dropout").

The keep bit of element (bh, i, j) (bh the output's flat (batch, head) index, i the query row, j
the key) for a call's ``dropout_seed = (seed, offset)``:

    (r0, r1, r2, r3) = Philox4x32-7(counter = (j >> 4, i, bh, offset),
                                     key = (seed & 0xffffffff, seed >> 32))
    keep = byte j & 15 of the 16 (byte j & 3, low first, of word r[(j >> 2) & 3]) >= threshold,
    threshold = round(dropout_p * 256)

one Philox call per 16 consecutive keys of a row; kept weights are scaled by
256 / (256 - threshold). The NumPy path (cuflash/_numpy.py) draws its tiles' bits here, and the
dense reference (cuflash/reference.py) materializes the whole mask here: the one piece of code the
reference shares with a fast path (a test checks this generator against a scalar Philox written
from its definition and Random123's known answers at 10 rounds).
"""
import math

import numpy as np

M0, M1 = 0xD2511F53, 0xCD9E8D57   # Random123's multipliers
W0, W1 = 0x9E3779B9, 0xBB67AE85   # its key increments (Weyl sequence)
ROUNDS = 7  # as FlashAttention 2 draws (kernels_cu/philox.cuh PHILOX_ROUNDS)
_MASK32 = 0xFFFFFFFF
MAX_SEED = 2**64 - 1
MAX_OFFSET = 2**32 - 1


def threshold(p):
    """The byte threshold of dropout probability p: round(p * 256) (halves up; p * 256 is exact in
    float64), a key being dropped where its byte is below it, so it is kept with probability
    1 - threshold / 256: dropout_p's granularity is 1/256. None where p rounds to 1 (p >=
    255.5 / 256, which the public functions refuse)."""
    x = float(p) * 256.0
    t = math.floor(x)
    t += x - t >= 0.5  # (exact)
    return t if t < 256 else None


def rscale(p):
    """The kept weights' factor: 256 / (256 - threshold(p)), 1 / the keep probability (so the
    dropped output's expectation is the undropped one)."""
    return 256.0 / (256 - threshold(p))


def philox4x32(counter, key, rounds=ROUNDS):
    """Philox4x32-``rounds`` of ``counter`` (four uint32 arrays that broadcast together) under
    ``key`` (two ints): the four uint32 output words, arrays of the counters' broadcast shape."""
    c0, c1, c2, c3 = (np.asarray(c, dtype=np.uint32) for c in counter)
    c0, c1, c2, c3 = np.broadcast_arrays(c0, c1, c2, c3)
    k0, k1 = int(key[0]) & _MASK32, int(key[1]) & _MASK32
    m0, m1, shift = np.uint64(M0), np.uint64(M1), np.uint64(32)
    for r in range(rounds):
        if r > 0:
            k0, k1 = (k0 + W0) & _MASK32, (k1 + W1) & _MASK32
        p0 = c0.astype(np.uint64) * m0  # exact: both factors below 2**32
        p1 = c2.astype(np.uint64) * m1
        hi0, lo0 = (p0 >> shift).astype(np.uint32), p0.astype(np.uint32)
        hi1, lo1 = (p1 >> shift).astype(np.uint32), p1.astype(np.uint32)
        c0, c1, c2, c3 = (hi1 ^ c1 ^ np.uint32(k0), lo1, hi0 ^ c3 ^ np.uint32(k1), lo0)
    return c0, c1, c2, c3


def keep(seed, offset, thresh, bh, rows, j0, j1):
    """The keep bits, bool, of keys [j0, j1) for the (batch, head)s ``bh`` and query rows
    ``rows`` (int arrays that broadcast together, to a shape S): an array S + (j1 - j0,)."""
    bh, rows = np.broadcast_arrays(np.asarray(bh, dtype=np.int64), np.asarray(rows, dtype=np.int64))
    b0 = j0 >> 4  # the calls of the 16-key blocks the keys touch
    blocks = np.arange(b0, (((j1 - 1) >> 4) + 1) if j1 > j0 else b0, dtype=np.int64)
    words = philox4x32((blocks, rows[..., None], bh[..., None], np.int64(offset)),
                       (seed & _MASK32, (seed >> 32) & _MASK32))
    shifts = np.arange(0, 32, 8, dtype=np.uint32)
    byte = np.stack([(w[..., None] >> shifts) & np.uint32(0xFF) for w in words], axis=-2)
    byte = byte.astype(np.uint8).reshape(bh.shape + (16 * blocks.size,))  # key 16 b0 + index
    start = j0 - 16 * b0
    return byte[..., start:start + max(0, j1 - j0)] >= np.uint8(thresh)


def dense_keep(lead, Nq, Nk, dropout_p, dropout_seed):
    """The whole keep mask, bool lead + (Nq, Nk), of a call's dropout_p and (seed, offset): what
    cuflash/reference.py applies (and tests may look at)."""
    seed, offset = dropout_seed
    BH = int(np.prod(lead, dtype=np.int64))
    z = keep(seed, offset, threshold(dropout_p), np.arange(BH)[:, None], np.arange(Nq)[None, :],
             0, Nk)
    return z.reshape(tuple(lead) + (Nq, Nk))
