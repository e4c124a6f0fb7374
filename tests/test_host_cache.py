"""The per-signature caches of the host path (cuflash._memo; issue 17): a repeated call skips the
work its first call did, and nothing it skips changes what it gives or what it refuses."""
import gc
import weakref

import numpy as np
import pytest

import cuflash
from cuflash import _validate, reference
from helpers import assert_close_to_reference, FLOORS

# (a valid option, a look-alike that must still be refused after it): equal under ==, or equal
# after np.asarray, but not the same argument
LOOK_ALIKES = [
    (dict(causal=True), dict(causal=1), TypeError, "causal"),
    (dict(causal=False), dict(causal=0), TypeError, "causal"),
    (dict(scale=1), dict(scale=True), TypeError, "scale"),
    (dict(window=(1, 2)), dict(window=(True, 2)), ValueError, "window left"),
    (dict(window=(1, 2)), dict(window=(1.0, 2)), ValueError, "window left"),
    (dict(kv_lens=[[1], [0]]), dict(kv_lens=[[True], [False]]), TypeError, "kv_lens"),
    (dict(kv_lens=[[3], [4]]), dict(kv_lens=[[3.0], [4.0]]), TypeError, "kv_lens"),
    (dict(kv_lens=[[3], [4]]), dict(kv_lens=[[3], [9]]), ValueError, "kv_lens"),
    (dict(mask=np.ones((5, 7), bool)), dict(mask=np.ones((5, 7), np.uint8)), TypeError, "mask"),
    (dict(precision="high"), dict(precision="fast"), ValueError, "precision"),
]


def test_precision_is_part_of_the_signature(rng):
    """Two calls that differ only in precision get their own Problems (the wide path reads it)."""
    q, k, v = _qkv(rng)
    high = _validate.make_problem(q, k, v, precision="high")
    highest = _validate.make_problem(q, k, v)
    assert high.key != highest.key
    assert high.precision == "high" and highest.precision == "highest"
    assert _validate.make_problem(q, k, v, precision="highest").precision == "highest"


def _qkv(rng, dtype=np.float32):
    return (rng.standard_normal((2, 1, n, 8)).astype(dtype) for n in (5, 7, 7))


@pytest.mark.parametrize("good, bad, error, word", LOOK_ALIKES, ids=[str(x[1]) for x in LOOK_ALIKES])
def test_a_known_signature_does_not_let_a_look_alike_through(rng, good, bad, error, word):
    q, k, v = _qkv(rng)
    cuflash.attention(q, k, v, **good)
    cuflash.attention(q, k, v, **good)  # now from the cache
    with pytest.raises(error, match=rf"^attention: .*{word}"):
        cuflash.attention(q, k, v, **bad)


def test_the_cached_problem_equals_a_fresh_one(rng, monkeypatch):
    q, k, v = _qkv(rng)
    mask = rng.random((5, 7)) < 0.7
    bias = rng.standard_normal((1, 1, 5, 7))
    options = dict(causal=True, window=(3, None), mask=mask, bias=bias, kv_lens=[[6], [7]])
    first = _validate.make_problem(q, k, v, **options)
    q2, k2, v2 = (x + 1 for x in (q, k, v))
    mask2, bias2 = ~mask, bias * 2
    cached = _validate.make_problem(q2, k2, v2, **dict(options, mask=mask2, bias=bias2))
    monkeypatch.setattr(_validate, "_problems", _validate._memo.Memo())
    fresh = _validate.make_problem(q2, k2, v2, **dict(options, mask=mask2, bias=bias2))
    # one number per signature: a signature made anew (after eviction) gets a new one
    assert first.key == cached.key is not None and fresh.key not in (None, cached.key)
    for name, value in vars(fresh).items():
        if name in ("key", "layout_key"):
            continue
        got = getattr(cached, name)
        if isinstance(value, np.ndarray):
            assert np.array_equal(got, value) and got.dtype == value.dtype, name
        else:
            assert got == value or got is value, name
    assert cached.q is q2 and cached.k is k2 and cached.v is v2


def test_host_kv_lens_arrays_take_the_short_way(rng, monkeypatch):
    """A NumPy kv_lens of a known signature, plain otherwise (a token loop's call), takes the
    short way (_validate.repeated_problem): no validation anew, only its values checked; out of
    [0, Nk] (negative, or above Nk) a ValueError naming the function, as the whole way gives."""
    q, k, v = _qkv(rng)
    Nk = k.shape[-2]
    cuflash.attention(q, k, v, kv_lens=np.array([[6], [7]]))
    cuflash.attention(q, k, v, kv_lens=np.array([[6], [7]], dtype=np.uint64))

    def whole_way(*a, **kw):
        raise AssertionError("took the whole way")
    monkeypatch.setattr(_validate, "problem", whole_way)
    lengths = ([[5], [0]], [[Nk], [1]], [[6], [7]])
    outs = [cuflash.attention(q, k, v, kv_lens=np.array(lens)) for lens in lengths]
    bad_lens = [np.array(x) for x in ([[-1], [0]], [[0], [Nk + 1]], [[-2**62], [2**62]])]
    bad_lens.append(np.array([[2**63 + 5], [1]], dtype=np.uint64))  # (negative as an int64)
    for bad in bad_lens:
        with pytest.raises(ValueError, match=r"^attention: kv_lens must lie in \[0, Nk\]"):
            cuflash.attention(q, k, v, kv_lens=bad)
    monkeypatch.undo()
    for out, lens in zip(outs, lengths):
        ref = reference.attention(q, k, v, kv_lens=np.array(lens))
        np.testing.assert_allclose(out, ref, rtol=0, atol=1e-5)


def test_host_kv_lens_values_share_the_signature(rng, monkeypatch):
    """Host kv_lens are in the signature by type, dtype and shape: a call with new values is
    not validated anew (a token loop's lengths change every step), only its values are checked;
    each value gets its own Problem.key (what the per-key caches see) under one layout_key."""
    q, k, v = _qkv(rng)
    first = _validate.make_problem(q, k, v, causal=True, kv_lens=[[6], [7]])
    cuflash.attention(q, k, v, causal=True, kv_lens=[[6], [7]])

    def no_validation(*a, **kw):
        raise AssertionError("validated anew")
    monkeypatch.setattr(_validate, "_make_problem", no_validation)
    other = _validate.make_problem(q, k, v, causal=True, kv_lens=[[5], [0]])
    again = _validate.make_problem(q, k, v, causal=True, kv_lens=np.array([[6], [7]]).tolist())
    assert first.layout_key == other.layout_key == again.layout_key is not None
    assert first.key == again.key != other.key
    assert other.kv_lens.tolist() == [[5], [0]] and again.kv_lens.tolist() == [[6], [7]]
    with pytest.raises(ValueError, match=r"^attention: kv_lens must lie in \[0, Nk\]"):
        _validate.make_problem(q, k, v, causal=True, kv_lens=[[-1], [0]])
    outs = [cuflash.attention(q, k, v, causal=True, kv_lens=lens)
            for lens in ([[5], [0]], [[7], [1]], [[6], [7]])]
    monkeypatch.undo()  # (the reference validates its own calls)
    for out, lens in zip(outs, ([[5], [0]], [[7], [1]], [[6], [7]])):
        ref = reference.attention(q, k, v, causal=True, kv_lens=np.array(lens))
        np.testing.assert_allclose(out, ref, rtol=0, atol=1e-5)


def test_the_cache_keeps_no_array_of_the_caller(rng):
    q, k, v = _qkv(rng)
    mask = np.ones((5, 7), bool)
    cuflash.attention(q, k, v, mask=mask)
    refs = [weakref.ref(x) for x in (q, k, v, mask)]
    del q, k, v, mask
    gc.collect()
    assert all(r() is None for r in refs)


def test_repeated_calls_with_new_data(rng):
    """Same signature, new values (and an innermost axis that is copied): every call is right."""
    for _ in range(3):
        q, k, v = _qkv(rng, np.float64)
        q = np.asfortranarray(q)  # innermost stride 5 elements: copied by make_problem
        mask = rng.random((5, 7)) < 0.7
        out, lse = cuflash.attention(q, k, v, mask=mask, causal=True, return_lse=True)
        ref_out, ref_lse = reference.attention(q, k, v, mask=mask, causal=True, return_lse=True)
        assert_close_to_reference(out, ref_out, None, FLOORS["float64"], "out")
        assert_close_to_reference(lse, ref_lse, None, FLOORS["float64"], "lse")


def test_no_signature_for_device_lengths_or_odd_arguments(rng):
    q, k, v = _qkv(rng)
    args = (None, False, "bottom-right")
    assert _validate.signature(q, k, v, *args, None, None, None, None, "attention") is not None
    assert _validate.signature([1], k, v, *args, None, None, None, None, "attention") is None
    assert _validate.signature(q, k, v, *args, iter([1, 2]), None, None, None, "attention") is None
    assert _validate.signature(q, k, v, *args, ([1], 2), None, None, None, "attention") is None


def test_launch_packs_numbers_and_structs_at_their_alignment():
    """_runtime.Launch's parameter buffer lays each argument out as the kernel's C parameters are
    (natural alignment; structs on 16 bytes) and refuses what it cannot pass."""
    from cuflash import _runtime

    a = np.zeros((), dtype=_runtime.ARGS_DTYPE)
    a["Nq"] = 7
    args = (np.int32(3), np.float64(2.5), np.int32(-1), a[()], np.uint64(9))
    packed, layout = _runtime.Launch._layout(args)
    offsets = [off for _, off, _ in layout]
    assert offsets[:3] == [0, 8, 16]
    assert offsets[3] % 16 == 0 and offsets[3] >= 20
    assert offsets[4] == offsets[3] + _runtime.ARGS_DTYPE.itemsize
    assert [kind for *_, kind in layout] == [None, None, None, "struct", None]
    assert np.frombuffer(packed[8:16], np.float64)[0] == 2.5
    assert packed[offsets[3]:offsets[4]] == a.tobytes()
    with pytest.raises(TypeError, match="kernel argument 1"):
        _runtime.Launch._layout((np.int32(1), 5))


def test_address_filler_writes_only_the_address_words():
    """_runtime._address_filler (Launch's per-call writer): each slot's address, an array's
    (.data.ptr) or a memory pointer's (.ptr), whichever a call passes, lands at its byte offset,
    in runs of adjacent words and alone; the bytes between (numbers, structs) stay as packed;
    a launch without addresses writes nothing."""
    from cuflash import _runtime

    class Pointer:  # (as cupy.cuda.MemoryPointer)
        def __init__(self, ptr):
            self.ptr = ptr

    class Array:  # (as cupy.ndarray)
        def __init__(self, ptr):
            self.data = Pointer(ptr)

    raw = bytearray(range(64))
    before = bytes(raw)
    fill = _runtime._address_filler(raw, [(0, 0), (1, 8), (3, 24), (5, 40)], Pointer)
    fill((Array(11), Pointer(12), np.int32(7), Array(13), np.int32(8), Pointer(14)))
    words = np.frombuffer(bytes(raw), np.uint64)
    assert list(words[[0, 1, 3, 5]]) == [11, 12, 13, 14]
    assert bytes(raw[16:24]) == before[16:24] and bytes(raw[32:40]) == before[32:40]
    assert bytes(raw[48:]) == before[48:]
    # the same slot given the other kind on a later call
    fill((Pointer(21), Array(22), np.int32(7), Pointer(23), np.int32(8), Array(24)))
    assert list(np.frombuffer(bytes(raw), np.uint64)[[0, 1, 3, 5]]) == [21, 22, 23, 24]
    none = bytearray(16)
    _runtime._address_filler(none, [], Pointer)((np.int32(1),))
    assert none == bytearray(16)
