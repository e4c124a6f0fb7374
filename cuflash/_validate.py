"""Every check of user input, and its message, lives here.

``make_problem`` turns the arguments of ``cuflash.attention`` into a :class:`Problem`: validated,
normalized, and ready for any path (NumPy, generic CUDA, tensor cores). Nothing after it checks
user input again, and nothing in it launches work on a GPU. ``kv_lens`` may be host data (an int,
a sequence, a NumPy array) for either library; given as a CuPy array its values are copied to the
host to be checked (one small synchronizing copy). No other value is read: array contents (NaN,
+-inf, a bias beyond the accumulator's range) are never checked, because for CuPy inputs that would
need a device-to-host synchronization; what they give is the README's non-finite contract.

Every message starts with the public function it is raised for (``fn``: "attention",
"attention_backward", "attention_vjp", "merge") and names the argument.
"""
import contextlib
import functools
import itertools
import math
import numbers
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from . import _broadcast, _dropout, _memo, _modifiers
from ._config import MAX_HEAD_DIM, accumulator_dtype, supported_dtype_names

ALIGNS = ("bottom-right", "top-left")
LOG2E = math.log2(math.e)  # the kernels' exp2 folds scale * LOG2E


@dataclass
class Problem:
    xp: Any
    q: Any
    k: Any
    v: Any
    lead: tuple
    Nq: int
    Nk: int
    Dk: int
    Dv: int
    dtype: np.dtype
    acc_dtype: np.dtype
    scale: float
    causal: bool
    bottom_right: bool
    left: int
    right: int
    mask: Optional[Any]
    bias: Optional[Any]
    kv_lens: Optional[np.ndarray]
    q_map: np.ndarray
    k_map: np.ndarray
    v_map: np.ndarray
    # A number per (signature, host kv_lens values) (the signature: shapes, strides, dtypes,
    # devices, options; see `signature`): the key of every per-layout cache (cuflash._memo); None
    # where the call has no signature.
    key: Optional[int] = None
    # The number of the call's signature with host kv_lens by their layout alone (the same for
    # every kv_lens value; equal to key without host kv_lens): the key of what depends on the
    # layout only (the decode path's plans by length bucket). None where key is None.
    layout_key: Optional[int] = None
    copied: bool = False  # q, k or v had an innermost axis that is not contiguous (copied)
    # float32 on tensor cores: "highest" (three TF32 products per GEMM, as exact as float32) or
    # "high" (one TF32 product); the other dtypes compute as they always do
    precision: str = "highest"
    # kv_lens given as a CuPy array (kv_lens is then None: its values stay on the device):
    # lens_device: the caller's CuPy kv_lens as given, one per call; lens_map (BH,) the element
    # of it that each (batch, head) reads (its broadcast); lens_clamped: (BH,) int64 clamped to
    # [0, Nk] on the device, made on demand (clamped_lens) for the kernels that read that form.
    lens_device: Optional[Any] = None
    lens_map: Optional[np.ndarray] = None
    lens_clamped: Optional[Any] = None
    # host kv_lens of at most LENS_VALUES_MAX elements (no pages): lens_values the caller's values
    # as Python ints (flattened), lens_elems (BH,) the element each (batch, head) reads, so that a
    # token loop's checks (the range, a decode plan's span) run on a few ints instead of NumPy
    # reductions on (BH,) arrays (issue 17); None otherwise
    lens_values: Optional[tuple] = None
    lens_elems: Optional[np.ndarray] = None
    # this call's caller drops lse (attention without return_lse, on the short way): the paths
    # with a prepared forward (decode, fwd_mma, fwd_wgmma) then give it as a bare MemoryPointer
    lse_unused: bool = False
    # the score transforms (cuflash/_modifiers.py): ((name, scalars), ...) in its table's order
    transforms: tuple = ()
    # attention sinks (cuflash/_sinks.py): sinks (BH,) float64, of q's library, each (batch,
    # head)'s sink logit; sinks_shape and sinks_dtype: the shape and dtype of their gradient (the
    # caller's shape; its float dtype, else the accumulator's). None: no sinks.
    sinks: Optional[Any] = None
    sinks_shape: Optional[tuple] = None
    sinks_dtype: Optional[np.dtype] = None
    # ALiBi (the "alibi" transform): alibi (BH,) float64, of q's library, each (batch, head)'s
    # slope; None: no ALiBi.
    alibi: Optional[Any] = None
    # a paged KV cache (cuflash/_paged.py): k, v are then the page pools, their k_map / v_map the
    # kv heads' offsets within a page (the batch axis reads stride 0), Nk = max_pages *
    # page_size; None: k and v hold the keys themselves
    pages: Optional["Pages"] = None
    # the bias's gradient (attention_backward / attention_vjp return_dbias=True): dbias says the
    # backward returns it; bias_shape and bias_dtype are the caller's bias's (the gradient's shape
    # and dtype: it is summed over the axes on which the bias broadcasts). bias_shape is set
    # whenever there is a bias.
    dbias: bool = False
    bias_shape: Optional[tuple] = None
    bias_dtype: Optional[np.dtype] = None
    # dropout (cuflash/_dropout.py, kernels_cu/philox.cuh): its probability in [0, 1), part of the
    # signature (0.0: none, and every kernel is the one without dropout), and this call's
    # (seed, offset) as ints, data that is not (None without dropout)
    dropout_p: float = 0.0
    dropout_seed: Optional[tuple] = None
    # No data but q, k and v changes from call to call of this signature: no mask, bias,
    # kv_lens (host or device), sinks, ALiBi slopes, pages, dropout or dropout seed, and q, k, v
    # read in place (not copied). Such a call's Problem is the signature's with its q, k, v (with_arrays), and
    # cuflash._gpu may run it the way the signature's last call ran (its path's prepared run).
    # Set for the signatures make_problem memoizes.
    plain: bool = False
    # Plain but for a CuPy kv_lens (its values stay on the device, so nothing planned depends on
    # them), or plain: cuflash._gpu keeps such a signature's prepared run too (the runs read
    # lens_device per call).
    repeatable: bool = False
    # Plain but for host kv_lens (NumPy values checked per call; a key per values): the
    # signature of a token loop, whose paths may keep a prepared run for every length
    # (cuflash._gpu, a path's prepare_lens).
    lens_repeatable: bool = False

    def with_arrays(self, q, k, v, mask, bias, kv_lens=None, sinks=None, alibi_slopes=None,
                    block_table=None, dropout_seed=None):
        """This Problem for another call of the same signature: its arrays (and a CuPy
        kv_lens', the sinks, the ALiBi slopes, a CuPy block_table and the dropout's checked
        (seed, offset)), the rest shared."""
        if self.repeatable or self.lens_repeatable:  # (the common call: the rest is None)
            new = object.__new__(Problem)
            new.__dict__.update(self.__dict__)
            new.q, new.k, new.v = q, k, v
            if self.lens_map is not None:
                new.lens_device, new.lens_clamped = kv_lens, None
            if self.pages is not None:  # (a CuPy table)
                new.pages = self.pages.with_table(block_table)
            return new
        xp = self.xp
        if self.copied:
            q, k, v = (_innermost_contiguous(xp, x) for x in (q, k, v))
        full = self.lead + (self.Nq, self.Nk)
        new = object.__new__(Problem)
        new.__dict__.update(self.__dict__)
        new.q, new.k, new.v = q, k, v
        new.mask = None if mask is None else xp.broadcast_to(mask, full)
        new.bias = (None if bias is None else
                    xp.broadcast_to(bias.astype(self.acc_dtype, copy=False), full))
        if self.lens_map is not None:
            new.lens_device, new.lens_clamped = kv_lens, None
        new.sinks = _sinks_per_head(xp, q, sinks, self.lead)
        new.alibi = _sinks_per_head(xp, q, alibi_slopes, self.lead)
        if self.pages is not None:
            new.pages = self.pages.with_table(block_table)
        new.dropout_seed = dropout_seed if self.dropout_p else None
        return new

    # (computed once per signature: the Problem of a known signature copies them; lead, Nq and
    # Dv never change after make_problem)
    @functools.cached_property
    def BH(self):
        return math.prod(self.lead)

    @functools.cached_property
    def out_shape(self):
        return self.lead + (self.Nq, self.Dv)

    @functools.cached_property
    def lse_shape(self):
        return self.lead + (self.Nq,)


@dataclass
class Pages:
    """A paged KV cache's layout and its block table, as make_problem checked them.

    table: (B, max_pages) int32, the kernels' form: a host NumPy copy (its entries that the host
    lengths reach checked, `_check_pages`), or on the device the caller's CuPy table when it is
    int32 with unit column stride, else a converted copy (one elementwise kernel, no
    synchronization; its values unchecked: every reader clamps an entry to [0, num_pages - 1]).
    table_rs: the table's row stride (elements); k_ps, v_ps: the pools' page strides (elements).
    """
    table: Any
    page_size: int
    num_pages: int
    max_pages: int
    table_rs: int
    k_ps: int
    v_ps: int
    host: bool  # the caller's table is a NumPy array (then `table` is its checked int32 copy)

    @property
    def layout(self):
        """What the per-layout caches key on besides the Problem's own fields."""
        return (self.page_size, self.num_pages, self.max_pages, self.table_rs, self.k_ps,
                self.v_ps, self.host)

    def with_table(self, block_table):
        """These pages with another call's CuPy block table (a host table is part of the call's
        signature by value: the checked copy stands)."""
        if self.host:
            return self
        new = object.__new__(Pages)
        new.__dict__.update(self.__dict__)
        new.table = _device_table(block_table)
        return new


# ---------------------------------------------------------------------------------------------
# array kinds

def aligned_position(i, L, Nq, bottom_right):
    """Query row(s) i's aligned position p for L valid keys: i + (L - Nq) bottom-right, i
    top-left (mask.cuh Window::shift on the device); i and L broadcast as NumPy arrays. The
    positions' offset q_start - k_start is not in it: the window bounds carry it (left - d,
    right + d), ALiBi its scalar."""
    i, L = np.asarray(i, dtype=np.int64), np.asarray(L, dtype=np.int64)
    return i + (L - Nq) if bottom_right else i + 0 * L


def key_range(i, L, Nq, left, right, bottom_right):
    """The keys query row(s) i see by position, [lo, hi] (empty when lo > hi), for L valid keys:
    the visibility rule of DESIGN.md (kernels_cu/mask.cuh key_range on the device). p =
    aligned_position, lo = max(p - left, 0), hi = min(p + right, L - 1); i and L broadcast as
    NumPy arrays. The host's one copy: the CPU path, the decode schedule and the Hopper
    forward's dispatch read it."""
    p = aligned_position(i, L, Nq, bottom_right)
    L = np.asarray(L, dtype=np.int64)
    return np.maximum(p - left, 0), np.minimum(p + right, L - 1)


def _library(x):
    """'numpy', 'cupy' or None for anything that is not an array of either (by its type,
    memoized: a CuPy array's `device` is an object made per access)."""
    t = type(x)
    lib = _libraries.get(t, _UNKNOWN)
    if lib is _UNKNOWN:
        if isinstance(x, np.ndarray):
            lib = "numpy"
        elif (t.__module__ or "").startswith("cupy") and hasattr(x, "device") and \
                hasattr(x, "data"):
            lib = "cupy"
        else:
            lib = None
        _libraries[t] = lib
    return lib


_UNKNOWN = object()
_libraries = {}  # type -> 'numpy', 'cupy' or None


def _xp_of(name):
    if name == "numpy":
        return np
    import cupy
    return cupy


def _check_array(fn, name, x):
    if _library(x) is None:
        raise TypeError(f"{fn}: {name} must be a numpy.ndarray or cupy.ndarray, "
                        f"got {type(x).__name__}")


def _check_same_family(fn, named, first, lib, device):
    """Every array argument must come from the same library (and, for CuPy, the same device)."""
    for name, x in named:
        if x is None:
            continue
        other = _library(x)
        if other is None:
            _check_array(fn, name, x)  # (raises)
        if other != lib:
            raise TypeError(
                f"{fn}: every array argument must come from one library: {first} is a "
                f"{lib}.ndarray but {name} is a {other}.ndarray")
        if lib == "cupy" and x.data.device_id != device:
            raise ValueError(
                f"{fn}: all arrays must be on one device: {first} is on cuda device {device} but "
                f"{name} is on cuda device {x.device.id}")


def _dtype_name(dt):
    return np.dtype(dt).name


# ---------------------------------------------------------------------------------------------
# scalar options

def _check_scale(fn, scale, Dk, acc_dtype):
    """A real number whose product with log2(e) is finite in the accumulator dtype.

    The kernels fold scale * log2(e) into their exp2, so that product must not overflow; a scale
    beyond it (1e39 for float32 accumulation) would turn every row into NaN. A tiny scale is
    kept: where it rounds to 0 in the accumulator it changes no logit by more than about 2e-7
    (|q.k| < 3.4e38), i.e. it is uniform attention up to rounding, as scale = 0 is.
    """
    if scale is None:
        return 1.0 / math.sqrt(Dk)
    if isinstance(scale, (bool, np.bool_)) or not isinstance(scale, numbers.Real):
        raise TypeError(f"{fn}: scale must be a real number or None, got {type(scale).__name__}")
    scale = float(scale)
    if not math.isfinite(scale):
        raise ValueError(f"{fn}: scale must be finite, got {scale}")
    limit = float(np.finfo(acc_dtype).max) / LOG2E
    if abs(scale) > limit:
        raise ValueError(
            f"{fn}: scale must be at most {limit:.4g} in magnitude with {acc_dtype} accumulation "
            f"(scale * log2(e) must be finite in {acc_dtype}), got {scale}")
    return scale


def check_flag(name, value, fn="attention"):
    """A keyword flag must be a real bool (1/0 or None are more likely mistakes than intent)."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{fn}: {name} must be a bool, got {type(value).__name__} {value!r}")
    return bool(value)


def _check_align(fn, align):
    if not isinstance(align, str) or align not in ALIGNS:
        raise ValueError(f"{fn}: align must be 'bottom-right' or 'top-left', got {align!r}")
    return align == "bottom-right"


PRECISIONS = ("highest", "high")


def _check_precision(fn, precision):
    """None is "highest"."""
    if precision is None:
        return "highest"
    if not isinstance(precision, str):
        raise TypeError(f"{fn}: precision must be None, 'highest' or 'high', got "
                        f"{type(precision).__name__} {precision!r}")
    if precision not in PRECISIONS:
        raise ValueError(f"{fn}: precision must be None, 'highest' or 'high', got {precision!r}")
    return precision


def _check_positions(fn, positions):
    """(q_start, k_start) as ints; None is (0, 0)."""
    if positions is None:
        return 0, 0
    if not isinstance(positions, (tuple, list)) or len(positions) != 2:
        raise ValueError(
            f"{fn}: positions must be None or a pair (q_start, k_start), got {positions!r}")
    starts = []
    for name, value in zip(("q_start", "k_start"), positions):
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
            raise ValueError(f"{fn}: positions {name} must be a non-negative int, got {value!r}")
        if value < 0:
            raise ValueError(f"{fn}: positions {name} must be non-negative, got {value}")
        starts.append(int(value))
    return tuple(starts)


def _check_window(fn, window, causal, unbounded, shift=0):
    """(left, right) as ints; None sides become ``unbounded``, and causal caps right at 0. The
    positions' shift q_start - k_start moves the aligned position p: p - left <= j <= p + right
    with p + shift is the same test with left - shift and right + shift, clamped to
    [-unbounded, unbounded] (beyond it a side hides or shows every key either way)."""
    left = right = None  # None: unbounded on that side
    if window is not None:
        if not isinstance(window, (tuple, list)) or len(window) != 2:
            raise ValueError(f"{fn}: window must be None or a pair (left, right), got {window!r}")
        sides = []
        for side, value in zip(("left", "right"), window):
            if value is not None:
                if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
                    raise ValueError(
                        f"{fn}: window {side} must be a non-negative int or None, got {value!r}")
                if value < 0:
                    raise ValueError(f"{fn}: window {side} must be non-negative, got {value}")
                value = int(value)
            sides.append(value)
        left, right = sides
    if causal:
        right = 0 if right is None else min(right, 0)
    # shift the bounded sides first, then clamp: a wide window far from the keys still hides them
    left = unbounded if left is None else max(-unbounded, min(left - shift, unbounded))
    right = unbounded if right is None else max(-unbounded, min(right + shift, unbounded))
    return left, right


def _check_dropout_p(fn, dropout_p):
    """A real number in [0, 1) (not a bool) that does not round to 1 at the granularity 1/256;
    0 is no dropout."""
    if isinstance(dropout_p, (bool, np.bool_)) or not isinstance(dropout_p, numbers.Real):
        raise TypeError(f"{fn}: dropout_p must be a real number in [0, 1), got "
                        f"{type(dropout_p).__name__} {dropout_p!r}")
    p = float(dropout_p)
    if not 0.0 <= p < 1.0:  # (NaN fails too)
        raise ValueError(f"{fn}: dropout_p must lie in [0, 1), got {dropout_p!r}")
    if _dropout.threshold(p) is None:
        raise ValueError(f"{fn}: dropout_p rounds to 1 at dropout's granularity 1/256 (it must "
                         f"be below 255.5/256 = 0.998046875), got {dropout_p!r}")
    return p


def _seed_int(fn, name, value, limit):
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{fn}: dropout_seed's {name} must be an int, got "
                        f"{type(value).__name__} {value!r}")
    if not 0 <= value <= limit:
        raise ValueError(f"{fn}: dropout_seed's {name} must lie in [0, {limit}], got {value}")
    return int(value)


def check_dropout_seed(fn, dropout_seed, dropout_p):
    """(seed, offset) as ints: dropout_seed is an int seed (offset 0) or a pair (seed, offset),
    seed in [0, 2**64), offset in [0, 2**32); required when dropout_p > 0 (TypeError without),
    checked and then ignored when it is 0 (returns None). Checked on every call: its values are
    not part of the signature (data, like an array's contents)."""
    if dropout_seed is None:
        if dropout_p:
            raise TypeError(f"{fn}: dropout_p={dropout_p!r} needs dropout_seed (an int seed, or a "
                            "pair (seed, offset) of ints), got None")
        return None
    if isinstance(dropout_seed, (tuple, list)):
        if len(dropout_seed) != 2:
            raise ValueError(f"{fn}: dropout_seed must be an int or a pair (seed, offset), got "
                             f"{dropout_seed!r}")
        seed, offset = dropout_seed
    else:
        seed, offset = dropout_seed, 0
    seed = _seed_int(fn, "seed", seed, _dropout.MAX_SEED)
    offset = _seed_int(fn, "offset", offset, _dropout.MAX_OFFSET)
    return (seed, offset) if dropout_p else None


# ---------------------------------------------------------------------------------------------
# array options

def _check_mask(fn, mask, full, lib):
    if mask is None:
        return None
    if mask.dtype != np.bool_:
        raise TypeError(
            f"{fn}: mask must be a boolean array (True = may attend), got dtype {mask.dtype}")
    if mask.ndim < 2 or not _broadcasts_to(mask.shape, full):
        raise ValueError(
            f"{fn}: mask must broadcast to (..., Nq, Nk) = {full}, got mask.shape={mask.shape}")
    return _xp_of(lib).broadcast_to(mask, full)


def _check_bias(fn, bias, full, lib, acc_dtype):
    """Cast to the accumulator dtype (values are not read: beyond its range they become +-inf)."""
    if bias is None:
        return None
    if _dtype_name(bias.dtype) not in supported_dtype_names():
        raise TypeError(
            f"{fn}: bias must be a floating array ({', '.join(supported_dtype_names())}), "
            f"got dtype {bias.dtype}")
    if bias.ndim < 2 or not _broadcasts_to(bias.shape, full):
        raise ValueError(
            f"{fn}: bias must broadcast to (..., Nq, Nk) = {full}, got bias.shape={bias.shape}")
    return _xp_of(lib).broadcast_to(bias.astype(acc_dtype, copy=False), full)


def _check_return_dbias(fn, return_dbias, bias):
    """return_dbias: a bool, True only with a bias (whose gradient it asks for)."""
    return_dbias = check_flag("return_dbias", return_dbias, fn)
    if return_dbias and bias is None:
        raise ValueError(f"{fn}: return_dbias=True asks for the gradient of bias, "
                         f"but bias is None")
    return return_dbias


def _check_sinks(fn, sinks, lead, lib, device, acc_dtype):
    """A real number, or a real array of q's library broadcastable to the leading dims; returns
    the (shape, dtype) of its gradient (a float array's dtype, else the accumulator's). Values
    are not read: any value is the dense formula's (README "Attention sinks")."""
    if sinks is None:
        return None, None
    if isinstance(sinks, numbers.Real) and not isinstance(sinks, (bool, np.bool_)):
        return (), acc_dtype
    floating = _check_per_head(fn, "sinks", sinks, lead, lib, device,
                               "(one sink per head: (H,) for (B, H, N, D) inputs)")
    return tuple(sinks.shape), np.dtype(sinks.dtype) if floating else acc_dtype


def _check_per_head(fn, name, x, lead, lib, device, per_head):
    """A per-head array option (sinks, alibi_slopes): of q's library, of real numbers,
    broadcastable to the leading dims (`per_head` says how, in the message); returns whether its
    dtype is a float one."""
    if _library(x) is None:
        raise TypeError(f"{fn}: {name} must be a real number or a numpy.ndarray or cupy.ndarray "
                        f"of real numbers, got {type(x).__name__}")
    _check_same_family(fn, ((name, x),), "q", lib, device)
    floating = _dtype_name(x.dtype) in supported_dtype_names()
    if not floating and (x.dtype == np.bool_ or not np.issubdtype(x.dtype, np.integer)):
        raise TypeError(f"{fn}: {name} must hold real numbers (an integer dtype or "
                        f"{', '.join(supported_dtype_names())}), got dtype {x.dtype}")
    if not _broadcasts_to(x.shape, lead):
        raise ValueError(f"{fn}: {name} must broadcast to the leading dims {lead} {per_head}, "
                         f"got {name}.shape={x.shape}")
    return floating


def _check_alibi(fn, slopes, lead, lib, device):
    """ALiBi's slopes: a finite real number, or a real array of q's library broadcastable to the
    leading dims ((H,) per head, (B, H) per batch and head). A host array's values must be
    finite (a named ValueError); a CuPy array's are not read (no synchronization): NaN or inf
    there give what the dense formula gives (README "ALiBi")."""
    if slopes is None:
        return False
    if isinstance(slopes, numbers.Real) and not isinstance(slopes, (bool, np.bool_)):
        if not math.isfinite(float(slopes)):
            raise ValueError(f"{fn}: alibi_slopes must be finite, got {slopes!r}")
        return True
    floating = _check_per_head(fn, "alibi_slopes", slopes, lead, lib, device,
                               "(one slope per head: (H,) for (B, H, N, D) inputs, or (B, H))")
    if isinstance(slopes, np.ndarray) and floating:
        bad = ~np.isfinite(slopes.astype(np.float64))
        if bad.any():
            raise ValueError(f"{fn}: alibi_slopes must be finite, got "
                             f"{slopes.astype(np.float64)[bad][0]!r} at index "
                             f"{tuple(int(x) for x in np.argwhere(bad)[0])}")
    return True


# ALiBi on float32 accumulators (16-bit and float32 inputs on a GPU) computes each distance
# exactly without an integer conversion (kernels_cu/modifiers.cuh Alibi), which holds while
# Nq + Nk + |q_start - k_start| stays below this (2^22, less a tile of padding rows).
ALIBI_SPAN = 2**22 - 256


def _check_alibi_span(fn, Nq, Nk, offset):
    """ALiBi's positions on the GPU kernels with float32 accumulators: below ALIBI_SPAN."""
    if Nq + Nk + abs(offset) >= ALIBI_SPAN:
        raise ValueError(
            f"{fn}: alibi_slopes with float16, bfloat16 or float32 inputs on the GPU needs "
            f"Nq + Nk + |q_start - k_start| < {ALIBI_SPAN} (the kernels' exact float32 "
            f"distances), got Nq={Nq}, Nk={Nk}, q_start - k_start={offset}; float64 inputs or "
            f"NumPy arrays take any length")


def _sinks_per_head(xp, q, sinks, lead):
    """A checked sinks as each output (batch, head) reads it: (BH,) float64 on q's device (one
    fill or copy on the current stream), None without sinks."""
    if sinks is None:
        return None
    with (q.device if xp is not np else contextlib.nullcontext()):
        if _library(sinks) is None:
            return xp.full(math.prod(lead), float(sinks), dtype=np.float64)
        return xp.ascontiguousarray(xp.broadcast_to(sinks, lead), dtype=np.float64).reshape(-1)


_clamp = None


def _clamped(x, n, dtype, shape=None):
    """A copy of the CuPy integer array x of `dtype` with every entry clamped to [0, n], x
    broadcast to `shape` (default its own) (one elementwise kernel on the current stream: no
    synchronization)."""
    import cupy

    global _clamp
    if _clamp is None:
        _clamp = cupy.ElementwiseKernel(
            "T x, int64 n", "Y y", "y = x < T(0) ? Y(0) : (x > n ? Y(n) : Y(x))",
            "cuflash_clamp")
    return _clamp(x, np.int64(n), cupy.empty(x.shape if shape is None else shape, dtype))


def clamped_lens(p):
    """p's CuPy kv_lens as most kernels read it: (BH,) int64 clamped to [0, Nk], made once per
    Problem, on demand (one elementwise kernel on the current stream: no synchronization). The
    decode kernels read the caller's array in place where they can (reads_in_place)."""
    if p.lens_clamped is None:
        import cupy

        x = p.lens_device
        with (contextlib.nullcontext() if x.data.device_id == cupy.cuda.runtime.getDevice()
              else x.device):  # (the common case: no context)
            p.lens_clamped = _clamped(x, p.Nk, np.int64, p.lead).reshape(-1)
    return p.lens_clamped


def reads_in_place(kv_lens):
    """Whether the decode kernels read this CuPy kv_lens in place (kernels_cu/decode.cu
    valid_keys): C-contiguous int32 or int64 (part of its signature: _lens_key)."""
    return kv_lens.flags.c_contiguous and kv_lens.dtype in (np.int32, np.int64)


def _check_device_lens(fn, kv_lens, lead, device):
    """The checks a CuPy kv_lens takes on the host (its dtype, shape and device; its values are
    clamped on the device instead, see clamped_lens); returns lens_map."""
    if kv_lens.dtype == np.bool_ or not np.issubdtype(kv_lens.dtype, np.integer):
        raise TypeError(f"{fn}: kv_lens must hold integers, got dtype {kv_lens.dtype}")
    if not _broadcasts_to(kv_lens.shape, lead):
        raise ValueError(f"{fn}: kv_lens must broadcast to the leading dims {lead}, "
                         f"got kv_lens.shape={kv_lens.shape}")
    if kv_lens.device.id != device:
        raise ValueError(f"{fn}: all arrays must be on one device: q is on cuda device {device} "
                         f"but kv_lens is on cuda device {kv_lens.device.id}")
    index = np.arange(kv_lens.size, dtype=np.int64).reshape(kv_lens.shape)
    return np.ascontiguousarray(np.broadcast_to(index, lead)).reshape(-1)


def _check_kv_lens(fn, kv_lens, lead, Nk, lib):
    """Host kv_lens as an int64 array of the leading dims (or None). A CuPy kv_lens is copied to
    the host here (synchronizing): make_problem keeps it on the device instead (cuflash.ring
    needs its values)."""
    if kv_lens is None:
        return None
    kind = _library(kv_lens)
    if kind == "cupy" and lib != "cupy":
        raise TypeError(f"{fn}: kv_lens must be an int, a sequence of ints or a numpy.ndarray "
                        "for NumPy inputs, got a cupy.ndarray")
    host = kv_lens.get() if kind == "cupy" else kv_lens
    try:
        arr = np.asarray(host)
    except Exception:  # ragged sequences and the like
        raise TypeError(
            f"{fn}: kv_lens must be an int or an array of ints, got {type(kv_lens).__name__}")
    if arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer):
        raise TypeError(f"{fn}: kv_lens must hold integers, got dtype {arr.dtype}")
    if not _broadcasts_to(arr.shape, lead):
        raise ValueError(f"{fn}: kv_lens must broadcast to the leading dims {lead}, "
                         f"got kv_lens.shape={arr.shape}")
    _check_lens_range(fn, arr, Nk)
    return np.ascontiguousarray(np.broadcast_to(arr.astype(np.int64), lead))


LENS_VALUES_MAX = 64  # host kv_lens up to this size keep their values as Python ints


def _lens_elements(arr, lead):
    """(lens_values, lens_elems) of checked host kv_lens `arr` (Problem), (None, None) when it is
    larger than LENS_VALUES_MAX."""
    if arr.size > LENS_VALUES_MAX:
        return None, None
    index = np.arange(arr.size, dtype=np.int64).reshape(arr.shape)
    elems = np.ascontiguousarray(np.broadcast_to(index, lead)).reshape(-1)
    elems.flags.writeable = False
    return _lens_ints(arr), elems


def _lens_ints(arr):
    """Host kv_lens' values as Python ints, flattened (Problem.lens_values): exact for every
    integer dtype, so the range check on them needs no int64 view."""
    return tuple(arr.ravel().tolist())


def _check_lens_range(fn, arr, Nk):
    if arr.size and (arr.min() < 0 or arr.max() > Nk):
        raise ValueError(f"{fn}: kv_lens must lie in [0, Nk] = [0, {Nk}], "
                         f"got values from {arr.min()} to {arr.max()}")


# ---------------------------------------------------------------------------------------------
# a paged KV cache

MIN_PAGE_SIZE = 16
MAX_PAGED_KEYS = 2**31 - 1  # max_pages * page_size: the kernels' key index is 32-bit there


def _check_table_kind(fn, block_table, lib, device, first, inputs):
    """block_table's type, library, device and dtype (of the arrays `inputs`, whose device is
    `first`'s); returns its library."""
    kind = _library(block_table)
    if kind is None:
        raise TypeError(f"{fn}: block_table must be a numpy.ndarray or cupy.ndarray of int32 or "
                        f"int64, got {type(block_table).__name__}")
    if kind == "cupy" and lib != "cupy":
        raise TypeError(f"{fn}: block_table must be a numpy.ndarray for NumPy {inputs}, got a "
                        "cupy.ndarray")
    if kind == "cupy" and block_table.device.id != device:
        raise ValueError(f"{fn}: all arrays must be on one device: {first} is on cuda device "
                         f"{device} but block_table is on cuda device {block_table.device.id}")
    if block_table.dtype not in (np.int32, np.int64):
        raise TypeError(f"{fn}: block_table must have dtype int32 or int64, got "
                        f"{block_table.dtype}")
    return kind


def _check_ranks(fn, named, ndim, must, same):
    """Each (name, array, shape) of `named` has ndim axes ("{fn}: " + must.format(name) + shape
    otherwise), and the last two (k and v) agree on all but their last axis ("must hold the same"
    + same)."""
    for name, x, shape in named:
        if x.ndim != ndim:
            raise ValueError(f"{fn}: {must.format(name)} {shape}, got {name}.shape={x.shape}")
    (kn, k, _), (vn, v, _) = named[-2:]
    if k.shape[:-1] != v.shape[:-1]:
        raise ValueError(f"{fn}: {kn} and {vn} must hold the same {same}, got {kn}.shape="
                         f"{k.shape} and {vn}.shape={v.shape}")


def _check_pools(fn, named_k, named_v, context=""):
    """Two page pools (num_pages, Hkv, page_size, D) with one page layout and pages of at least
    MIN_PAGE_SIZE rows; returns (num_pages, Hkv, page_size)."""
    (kn, k), (vn, v) = named_k, named_v
    pool = "(num_pages, Hkv, page_size, D)"
    _check_ranks(fn, ((kn, k, pool), (vn, v, pool)), 4, context + "{} must be a page pool of shape",
                 "pages (num_pages, Hkv, page_size)")
    if k.shape[2] < MIN_PAGE_SIZE:
        raise ValueError(f"{fn}: the page size (axis 2 of {kn} and {vn}) must be at least "
                         f"{MIN_PAGE_SIZE}, got {kn}.shape={k.shape}")
    return k.shape[:3]


def _check_pages(fn, q, k, v, block_table, lib, device):
    """The checks of a paged call's shapes and block table that need no values: q (B, H, Nq, Dk),
    k and v page pools (num_pages, Hkv, page_size, D) with one page layout and a contiguous last
    axis, block_table (B, max_pages) int32 / int64 of q's library (a NumPy table also serves
    CuPy inputs). Returns Pages with the table not yet set (_checked_table sets it)."""
    kind = _check_table_kind(fn, block_table, lib, device, "q", "inputs")
    if q.ndim != 4:
        raise ValueError(f"{fn}: with block_table, q must have shape (B, H, Nq, Dk), got "
                         f"q.shape={q.shape}")
    num_pages, _, page_size = _check_pools(fn, ("k", k), ("v", v), "with block_table, ")
    B = q.shape[0]
    if block_table.ndim != 2 or block_table.shape[0] != B:
        raise ValueError(f"{fn}: block_table must have shape (B, max_pages) with B = "
                         f"q.shape[0] = {B}, got block_table.shape={block_table.shape}")
    max_pages = block_table.shape[1]
    if max_pages * page_size > MAX_PAGED_KEYS:
        raise ValueError(f"{fn}: max_pages * page_size must be below 2**31, got {max_pages} * "
                         f"{page_size}")
    if num_pages == 0 and max_pages > 0:
        raise ValueError(f"{fn}: k and v hold no page (k.shape={k.shape}) but block_table has "
                         f"{max_pages} columns")
    for name, x in (("k", k), ("v", v)):
        item = x.dtype.itemsize
        if (x.shape[-1] > 1 and x.strides[-1] != item) or any(st % item for st in x.strides):
            raise ValueError(f"{fn}: with block_table, {name}'s last axis must be contiguous "
                             f"(a page pool is read in place, never copied), got "
                             f"{name}.strides={x.strides}")
    return Pages(table=None, page_size=int(page_size), num_pages=int(num_pages),
                 max_pages=int(max_pages), table_rs=0, k_ps=element_strides(k)[0],
                 v_ps=element_strides(v)[0], host=kind == "numpy")


def _per_sequence_lens(kv_lens, B):
    """With a block table kv_lens is per sequence, like block_table's rows: an int or (B,) (also
    anything that broadcasts to (B, H) the plain way, (B, 1) for one); a (B,) array becomes the
    (B, 1) that broadcasts to the leading dims (B, H). A view: no copy, no synchronization."""
    if kv_lens is None or isinstance(kv_lens, numbers.Integral):
        return kv_lens
    shape = getattr(kv_lens, "shape", None)
    if shape is None:
        try:
            shape = np.shape(kv_lens)
        except Exception:  # ragged: _check_kv_lens names it
            return kv_lens
    if len(shape) == 1 and shape[0] == B:
        return kv_lens.reshape(B, 1) if _library(kv_lens) else np.asarray(kv_lens).reshape(B, 1)
    return kv_lens


def _checked_table(fn, pages, block_table, kv_lens, lead):
    """Pages with its table: a host table's entries that a sequence reads (its columns below
    ceil(length / page_size), with the host kv_lens; every column with lengths on the device)
    must lie in [0, num_pages) (ValueError); the others are never read and become 0 in the
    int32 copy. A CuPy table is taken as it is (`_device_table`)."""
    if not pages.host:
        pages.table = _device_table(block_table)
        pages.table_rs = int(pages.table.strides[0] // 4) if pages.table.shape[0] > 1 else 0
        return pages
    table = np.asarray(block_table).astype(np.int64)
    B, max_pages, ps = table.shape[0], pages.max_pages, pages.page_size
    if kv_lens is None:  # every column (also with lengths on the device: unknown here)
        need = np.full(B, max_pages, dtype=np.int64)
    else:
        need = -(-np.asarray(kv_lens, dtype=np.int64).reshape(lead).max(axis=-1, initial=0)
                 // ps)
    read = np.arange(max_pages)[None, :] < need[:, None]
    bad = read & ((table < 0) | (table >= pages.num_pages))
    if bad.any():
        b, c = (int(x[0]) for x in np.nonzero(bad))
        raise ValueError(f"{fn}: block_table entries must lie in [0, num_pages) = [0, "
                         f"{pages.num_pages}) where a sequence reads them, got block_table[{b}, "
                         f"{c}] = {table[b, c]}")
    pages.table = np.ascontiguousarray(np.where(read, table, 0).astype(np.int32))
    pages.table.flags.writeable = False
    pages.table_rs = max_pages
    return pages


def _device_table(block_table):
    """A CuPy block table as the kernels read it: the caller's array when it is int32 with unit
    column stride, else an int32 copy with every entry clamped to [0, 2**31 - 1] (one elementwise
    kernel on the current stream: no synchronization). The readers clamp to the pages there is."""
    if block_table is None:
        return None
    if block_table.dtype == np.int32 and (block_table.shape[1] <= 1
                                          or block_table.strides[1] == 4) \
            and block_table.strides[0] % 4 == 0:
        return block_table
    with block_table.device:
        return _clamped(block_table, 2**31 - 1, np.int32)


@dataclass
class Append:
    """A checked paged_append: the pools and new rows as given, the table as the writers read it
    (host: int64, checked where written; CuPy: `_device_table`), lens (B,) (host int64, or the
    caller's CuPy values viewed as (B,))."""
    xp: Any
    k_pages: Any
    v_pages: Any
    k_new: Any
    v_new: Any
    table: Any
    table_rs: int
    lens: Any
    B: int
    n: int
    hkv: int
    page_size: int
    num_pages: int
    capacity: int


def check_append(k_pages, v_pages, block_table, kv_lens, k_new, v_new, fn="paged_append"):
    """Every check of paged_append's arguments (cuflash/_paged.py append writes them)."""
    named = (("k_pages", k_pages), ("v_pages", v_pages), ("k_new", k_new), ("v_new", v_new))
    for name, x in named:
        if x is None:
            raise TypeError(f"{fn}: {name} must be an array, got None")
    _check_array(fn, "k_pages", k_pages)
    lib = _library(k_pages)
    device = k_pages.device.id if lib == "cupy" else None
    _check_same_family(fn, named[1:], "k_pages", lib, device)
    names = supported_dtype_names()
    if _dtype_name(k_pages.dtype) not in names:
        raise TypeError(f"{fn}: k_pages must have dtype {', '.join(names)}, got "
                        f"{k_pages.dtype}")
    for name, x in named[1:]:
        if x.dtype != k_pages.dtype:
            raise TypeError(f"{fn}: {name} must have k_pages' dtype {k_pages.dtype}, got "
                            f"{x.dtype}")
    num_pages, hkv, page_size = _check_pools(fn, *named[:2])
    for name, x, pool in (("k_new", k_new, k_pages), ("v_new", v_new, v_pages)):
        if x.ndim != 4 or x.shape[1] != hkv or x.shape[3] != pool.shape[3] \
                or x.shape[:3:2] != k_new.shape[:3:2]:
            raise ValueError(f"{fn}: {name} must have shape (B, Hkv, n, D) = (B, {hkv}, n, "
                             f"{pool.shape[3]}) with k_new's B and n, got {name}.shape={x.shape}"
                             f" (k_new.shape={k_new.shape})")
    B, n = k_new.shape[0], k_new.shape[2]
    kind = _check_table_kind(fn, block_table, lib, device, "k_pages", "pages")
    if block_table.ndim != 2 or block_table.shape[0] != B:
        raise ValueError(f"{fn}: block_table must have shape (B, max_pages) with B = "
                         f"k_new.shape[0] = {B}, got block_table.shape={block_table.shape}")
    capacity = block_table.shape[1] * page_size
    if num_pages == 0 and capacity > 0:
        raise ValueError(f"{fn}: k_pages holds no page but block_table has "
                         f"{block_table.shape[1]} columns")
    # kv_lens: where each sequence's new rows start; an int or (B,) (or (B, 1))
    if kv_lens is None:
        raise TypeError(f"{fn}: kv_lens must be an int or an array of B ints, got None")
    if _library(kv_lens) == "cupy":
        if lib != "cupy":
            raise TypeError(f"{fn}: kv_lens must be an int, a sequence of ints or a "
                            "numpy.ndarray for NumPy pages, got a cupy.ndarray")
        if kv_lens.device.id != device:
            raise ValueError(f"{fn}: all arrays must be on one device: k_pages is on cuda "
                             f"device {device} but kv_lens is on cuda device "
                             f"{kv_lens.device.id}")
        if kv_lens.dtype == np.bool_ or not np.issubdtype(kv_lens.dtype, np.integer):
            raise TypeError(f"{fn}: kv_lens must hold integers, got dtype {kv_lens.dtype}")
        if kv_lens.size != B or kv_lens.ndim not in (1, 2) or kv_lens.shape[0] != B:
            raise ValueError(f"{fn}: kv_lens must have shape (B,) or (B, 1) with B = {B}, got "
                             f"kv_lens.shape={kv_lens.shape}")
        lens, host_lens = kv_lens.reshape(B), None
    else:
        try:
            arr = np.asarray(kv_lens)
        except Exception:
            raise TypeError(f"{fn}: kv_lens must be an int or an array of ints, got "
                            f"{type(kv_lens).__name__}")
        if arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer):
            raise TypeError(f"{fn}: kv_lens must hold integers, got dtype {arr.dtype}")
        if arr.ndim and (arr.size != B or arr.shape[0] != B or arr.ndim > 2):
            raise ValueError(f"{fn}: kv_lens must be an int or have shape (B,) or (B, 1) with "
                             f"B = {B}, got kv_lens.shape={arr.shape}")
        host_lens = np.ascontiguousarray(np.broadcast_to(arr.reshape(-1), (B,))).astype(np.int64)
        if B and (host_lens.min() < 0 or host_lens.max() + n > capacity):
            raise ValueError(f"{fn}: kv_lens + n must lie in [0, max_pages * page_size] = "
                             f"[0, {capacity}] (n = {n} new rows), got kv_lens from "
                             f"{host_lens.min()} to {host_lens.max()}")
        lens = host_lens
    if kind == "numpy":
        table = np.asarray(block_table).astype(np.int64)
        if host_lens is None:
            written = np.ones(table.shape, dtype=bool)
        else:
            cols = np.arange(table.shape[1])[None, :]
            first = host_lens[:, None] // page_size
            written = (cols >= first) & (cols * page_size < host_lens[:, None] + n) & (n > 0)
        bad = written & ((table < 0) | (table >= num_pages))
        if bad.any():
            b, c = (int(x[0]) for x in np.nonzero(bad))
            raise ValueError(f"{fn}: block_table entries must lie in [0, num_pages) = [0, "
                             f"{num_pages}) where new rows are written, got block_table[{b}, {c}]"
                             f" = {table[b, c]}")
        table_rs = table.shape[1]
        if lib == "cupy":
            table = np.ascontiguousarray(np.where(written, table, 0).astype(np.int32))
    else:
        table = _device_table(block_table)
        table_rs = int(table.strides[0] // 4) if table.shape[0] > 1 else 0
    return Append(xp=_xp_of(lib), k_pages=k_pages, v_pages=v_pages, k_new=k_new, v_new=v_new,
                  table=table, table_rs=table_rs, lens=lens, B=B, n=n, hkv=hkv,
                  page_size=page_size, num_pages=num_pages, capacity=capacity)


def _broadcasts_to(shape, target):
    if len(shape) > len(target):
        return False
    for s, t in zip(reversed(shape), reversed(target)):
        if s != 1 and s != t:
            return False
    return True


def _plain_broadcast(a, b):
    """Do two shapes broadcast the NumPy way?"""
    try:
        np.broadcast_shapes(a, b)
    except ValueError:
        return False
    return True


def _innermost_contiguous(xp, x):
    """q/k/v may have any strides except on the innermost axis (copied only then)."""
    item = x.dtype.itemsize
    if x.shape[-1] > 1 and x.strides[-1] != item or any(s % item for s in x.strides):
        return xp.ascontiguousarray(x)
    return x


def element_strides(x):
    return tuple(s // x.dtype.itemsize for s in x.strides)


# ---------------------------------------------------------------------------------------------
# the entry points

def _array_key(x):
    key = (type(x), x.shape, x.strides, x.dtype)
    return key if isinstance(x, np.ndarray) else key + (x.data.device_id,)


def _side_key(value):
    return type(value), value


def _lens_key(kv_lens, block_table):
    """kv_lens' part of a signature: a CuPy one by its dtype, shape and device (its values stay
    on the device); a host one by type, dtype and shape (its values are checked per call), by
    value too with a host block_table (whose check reads them)."""
    if _library(kv_lens) == "cupy":
        return ("cupy", kv_lens.dtype.str, kv_lens.shape, kv_lens.device.id,
                kv_lens.flags.c_contiguous)
    arr = np.asarray(kv_lens)
    lens = (type(kv_lens), arr.dtype, arr.shape)
    if block_table is not None and _library(block_table) != "cupy":
        lens += (arr.tobytes(),)
    return lens


def _pair_key(pair):
    """A window's or positions' part of a signature (TypeError where it has none)."""
    if pair is None:
        return None
    if type(pair) not in (tuple, list):
        raise TypeError
    return (type(pair),) + tuple(_side_key(s) for s in pair)


def _sinks_key(sinks):
    """sinks' (or alibi_slopes') part of a signature: its type alone for a number (its value is
    read per call)."""
    if sinks is None:
        return None
    return (type(sinks),) if _library(sinks) is None else _array_key(sinks)


def _table_key(block_table):
    """block_table's part of a signature: a host table by value (its entries are checked), a
    CuPy one by its layout (its values stay on the device)."""
    if block_table is None:
        return None
    if _library(block_table) == "cupy":
        return ("cupy",) + _array_key(block_table)
    arr = np.asarray(block_table)
    return (type(block_table), arr.dtype, arr.shape, arr.tobytes())


def _seed_key(dropout_seed):
    """dropout_seed's part of a signature: its types only (its values are checked per call)."""
    if isinstance(dropout_seed, (tuple, list)):
        return (type(dropout_seed),) + tuple(type(x) for x in dropout_seed)
    return type(dropout_seed)


def signature(q, k, v, scale, causal, align, window, mask, bias, kv_lens, fn, positions=None,
              precision=None, modifiers=None, sinks=None, alibi_slopes=None, block_table=None,
              return_dbias=False, dropout_p=0.0, dropout_seed=None):
    """A hashable summary of everything ``make_problem`` reads, or None.

    Two calls with one signature pass or fail validation alike and give equal Problems but for
    their arrays and host kv_lens' values. Types are part of it (True == 1, but causal=1 is
    refused); host kv_lens by type, dtype and shape (their values are checked per call,
    `_with_host_lens`; by value too with a host block_table, whose check reads them); a CuPy
    kv_lens by its dtype, shape and device (its values stay on the device)."""
    key = _key(q, k, v, scale, causal, align, window, mask, bias, kv_lens, fn, positions,
               precision, modifiers, sinks, alibi_slopes, block_table, return_dbias, dropout_p,
               dropout_seed)
    try:
        hash(key)
    except TypeError:
        return None
    return key


def _key(q, k, v, scale, causal, align, window, mask, bias, kv_lens, fn, positions, precision,
         modifiers, sinks, alibi_slopes, block_table, return_dbias, dropout_p, dropout_seed):
    """signature's key, None, or one that turns out unhashable (make_problem's lookup tells):
    one flat tuple, the options that are off left out and the others tagged by name (a small
    call's host time is its cost: a nested tuple is hashed anew at each lookup)."""
    try:
        key = plain_key(fn, q, k, v, scale, causal, align, precision, return_dbias, dropout_p)
        for tag, x, part in (("mask", mask, _array_key), ("bias", bias, _array_key),
                             ("window", window, _pair_key), ("positions", positions, _pair_key),
                             ("kv_lens", kv_lens, _lens_key), ("sinks", sinks, _sinks_key),
                             ("alibi", alibi_slopes, _alibi_key),
                             ("block_table", block_table, _table_key),
                             ("seed", dropout_seed, _seed_key)):
            if x is not None:
                key += (tag, part(x, block_table) if part is _lens_key else part(x))
        if modifiers:  # (None: off, like an absent one)
            key += tuple((n, type(x), x) for n, x in sorted(modifiers.items()) if x is not None)
    except (AttributeError, TypeError, ValueError):
        return None
    return key


def plain_key(fn, q, k, v, scale, causal, align, precision, return_dbias=False, dropout_p=0.0):
    """The signature of a call whose other options are all off (None, or absent), as `_key`
    makes it (AttributeError where q, k or v is not an array)."""
    return (fn, _array_key(q), _array_key(k), _array_key(v), type(scale), scale,
            type(causal), causal, type(align), align, type(precision), precision,
            type(return_dbias), return_dbias, type(dropout_p), dropout_p)


def repeated_problem(fn, q, k, v, scale, causal, align, precision, dropout_p, kv_lens,
                     block_table=None, softcap=None):
    """The Problem of a call whose options but these are all off, if an earlier call had its
    signature and it is repeatable (plain, or plain but for a CuPy kv_lens and a CuPy
    block_table: then no check of this call's can fail that the earlier call passed, and its
    Problem is the signature's with this call's arrays) or plain but for a NumPy kv_lens (then
    their values are checked: `_with_host_lens`), else None (the call takes the whole way,
    `problem`)."""
    if block_table is not None and _library(block_table) != "cupy":
        return None  # (a host table: part of the signature by value)
    host_lens = kv_lens is not None and _library(kv_lens) != "cupy"
    if host_lens and (block_table is not None or type(kv_lens) is not np.ndarray):
        return None  # (host lengths: a NumPy array without pages, checked below)
    try:
        key = plain_key(fn, q, k, v, scale, causal, align, precision, False, dropout_p)
        if kv_lens is not None:  # (as _key tags them)
            key += ("kv_lens", _lens_key(kv_lens, block_table))
        if block_table is not None:
            key += ("block_table", _table_key(block_table))
        if softcap is not None:  # (the score transforms' keywords come last)
            key += (("softcap", type(softcap), softcap),)
        known = _problems.get(key)
    except (AttributeError, TypeError, ValueError):  # (not arrays, ...: the whole way tells)
        return None
    if known is None or not (known.lens_repeatable if host_lens else known.repeatable):
        return None
    if known.pages is not None:
        kv_lens = _per_sequence_lens(kv_lens, q.shape[0])
    p = known.with_arrays(q, k, v, None, None, kv_lens, None, None, block_table)
    if host_lens:
        p.kv_lens, p.key, p.lens_values = _with_host_lens(fn, known, kv_lens)
    return p


def _alibi_key(slopes):
    """alibi_slopes' part of a signature: a host number or NumPy array by value (it is checked),
    a CuPy array by its layout."""
    if slopes is None or _library(slopes) == "cupy":
        return _sinks_key(slopes)
    if isinstance(slopes, np.ndarray):
        return _array_key(slopes) + (slopes.tobytes(),)
    return _side_key(slopes)


_problems = _memo.Memo(256)  # signature -> Problem without arrays (Problem.with_arrays)
# Problem.key: a number per signature (a new one if it comes back after eviction), cheap to hash
# in the paths' per-layout tables (a signature is a nested tuple, hashed anew at each lookup)
_key_numbers = itertools.count(1)


def make_problem(q, k, v, *, scale=None, causal=False, align="bottom-right", window=None,
                 mask=None, bias=None, kv_lens=None, positions=None, precision=None,
                 sinks=None, alibi_slopes=None, block_table=None, return_dbias=False,
                 dropout_p=0.0, dropout_seed=None, fn="attention", **modifiers):
    """Validate and normalize the arguments of ``fn`` (the public function, named in messages);
    `modifiers`: the score transforms' keywords (cuflash/_modifiers.py, e.g. softcap=). With a
    block_table, k and v are page pools (`_check_pages`) and the Problem says so (`pages`).
    return_dbias (attention_backward, attention_vjp): the backward also gives the bias's
    gradient (`Problem.dbias`).

    A call whose signature an earlier valid call had skips the checks: its Problem is the earlier
    one's with this call's arrays."""
    return problem(fn, q, k, v, scale, causal, align, window, mask, bias, kv_lens, positions,
                   precision, modifiers, sinks, alibi_slopes, block_table, return_dbias,
                   dropout_p, dropout_seed)


def problem(fn, q, k, v, scale, causal, align, window, mask, bias, kv_lens, positions,
            precision, modifiers, sinks, alibi_slopes, block_table, return_dbias, dropout_p,
            dropout_seed):
    """make_problem with its arguments in order (the public functions' call: no keywords to
    pack and unpack; a small call's host time is its cost)."""
    key = _key(q, k, v, scale, causal, align, window, mask, bias, kv_lens, fn, positions,
               precision, modifiers, sinks, alibi_slopes, block_table, return_dbias, dropout_p,
               dropout_seed)
    if key is not None:
        try:
            known = _problems.get(key)
        except TypeError:  # unhashable (a list in a window, ...): no signature
            known = key = None
        if known is not None:
            if known.pages is not None:
                kv_lens = _per_sequence_lens(kv_lens, q.shape[0])
            if known.repeatable:
                return known.with_arrays(q, k, v, None, None, kv_lens, None, None, block_table)
            seed = check_dropout_seed(fn, dropout_seed, known.dropout_p)  # data: every call
            p = known.with_arrays(q, k, v, mask, bias, kv_lens, sinks, alibi_slopes,
                                  block_table, seed)
            if known.kv_lens is not None:
                p.kv_lens, p.key, p.lens_values = _with_host_lens(fn, known, kv_lens)
            return p
    p = _make_problem(q, k, v, scale=scale, causal=causal, align=align, window=window,
                      mask=mask, bias=bias, kv_lens=kv_lens, positions=positions,
                      precision=precision, sinks=sinks, alibi_slopes=alibi_slopes,
                      block_table=block_table, return_dbias=return_dbias, dropout_p=dropout_p,
                      dropout_seed=dropout_seed, fn=fn, modifiers=modifiers)
    if key is not None:
        p.key = p.layout_key = next(_key_numbers)
        for x in (p.q_map, p.k_map, p.v_map, p.kv_lens):  # shared by the calls of this key
            if x is not None:
                x.flags.writeable = False
        p.BH, p.out_shape, p.lse_shape  # computed once, for every call of the signature
        # no per-call data but q, k, v and the lengths (a seed is checked per call, even unused)
        bare_options = (p.mask is None and p.bias is None and p.sinks is None
                        and p.alibi is None and not p.dropout_p and dropout_seed is None
                        and not p.copied)
        p.repeatable = (bare_options and p.kv_lens is None
                        and (p.pages is None or not p.pages.host))  # (a CuPy table is data)
        p.plain = p.repeatable and p.lens_map is None and p.pages is None
        p.lens_repeatable = bare_options and p.kv_lens is not None and p.pages is None
        bare = object.__new__(Problem)  # the cache keeps no array of the caller's
        bare.__dict__.update(p.__dict__)
        bare.q = bare.k = bare.v = bare.mask = bare.bias = bare.lens_device = bare.sinks = None
        bare.alibi = bare.dropout_seed = bare.lens_clamped = None
        if p.pages is not None and not p.pages.host:
            bare.pages = p.pages.with_table(None)  # no device table of the caller's
        _problems.build(key, lambda: bare)
    return p


def _with_host_lens(fn, known, kv_lens):
    """(kv_lens, key, lens_values) of a call whose signature `known` has, with host kv_lens:
    their values checked as `_check_kv_lens` checks them, a key per (signature, values), the
    signature's own for the values it was made with, and the values as Python ints where the
    signature keeps them (Problem.lens_values)."""
    arr = np.asarray(kv_lens)  # (its type, dtype and shape are the signature's: checked)
    values = arr.tobytes()

    def check():
        lens = np.empty(known.lead, dtype=np.int64)
        lens[...] = arr  # (broadcast: the signature checked arr's shape)
        if known.lens_elems is not None:  # a few values: their range on Python ints
            ints = _lens_ints(arr)
            if ints and (min(ints) < 0 or max(ints) > known.Nk):
                _check_lens_range(fn, arr, known.Nk)  # (raises, naming the range)
        else:
            ints = None
            if lens.size and lens.view(np.uint64).max() > known.Nk:  # (negative: above 2**63)
                _check_lens_range(fn, arr, known.Nk)
        if lens.tobytes() == known.kv_lens.tobytes():
            return known.kv_lens, known.key, known.lens_values
        lens.flags.writeable = False
        return lens, next(_key_numbers), ints

    return _host_lens.build((known.key, values), check)


# (signature number, the caller's kv_lens bytes: dtype and shape are the signature's) ->
# (kv_lens checked, Problem.key, lens_values)
_host_lens = _memo.Memo(256)


def _make_problem(q, k, v, *, scale, causal, align, window, mask, bias, kv_lens, positions,
                  precision, sinks, alibi_slopes, block_table, return_dbias, dropout_p,
                  dropout_seed, fn, modifiers):
    _check_array(fn, "q", q)
    lib = _library(q)
    device = q.device.id if lib == "cupy" else None
    for name, x in (("k", k), ("v", v)):
        _check_array(fn, name, x)
    _check_same_family(fn, (("k", k), ("v", v), ("mask", mask), ("bias", bias)), "q", lib,
                       device)
    xp = _xp_of(lib)
    # k's and v's shapes as the checks below read them: with pages, the keys' (B, Hkv, Nk, D)
    kshape, vshape, pages = k.shape, v.shape, None
    if block_table is not None:
        pages = _check_pages(fn, q, k, v, block_table, lib, device)
        B, Nk = q.shape[0], pages.max_pages * pages.page_size
        kshape, vshape = (B, k.shape[1], Nk, k.shape[-1]), (B, v.shape[1], Nk, v.shape[-1])
        kv_lens = _per_sequence_lens(kv_lens, B)

    _check_dtypes(fn, q, k, v)
    for name, x, shape in (("q", q, "(..., Nq, Dk)"), ("k", k, "(..., Nk, Dk)"),
                           ("v", v, "(..., Nk, Dv)")):
        if x.ndim < 2:
            raise ValueError(f"{fn}: {name} must have shape {shape} with at least 2 dims, "
                             f"got {name}.shape={x.shape}")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(
            f"{fn}: q and k must have the same head dim (axis -1), got q.shape={q.shape} and "
            f"k.shape={k.shape}")
    if k.shape[-2] != v.shape[-2]:
        raise ValueError(
            f"{fn}: k and v must have the same number of keys (axis -2), got k.shape={k.shape} "
            f"and v.shape={v.shape}")
    Nq, Dk = q.shape[-2:]
    Nk, Dv = vshape[-2:]
    for name, d in (("Dk (q.shape[-1])", Dk), ("Dv (v.shape[-1])", Dv)):
        if not 1 <= d <= MAX_HEAD_DIM:
            raise ValueError(f"{fn}: head dim {name} must be in [1, {MAX_HEAD_DIM}], got {d}")
    # k and v describe the same keys: their leading dims broadcast against each other the plain
    # NumPy way (no grouping between them), and only then meet q's, with GQA on the head axis.
    if not _plain_broadcast(kshape[:-2], vshape[:-2]):
        raise ValueError(
            f"{fn}: the leading dims of k and v must broadcast against each other (on axis -3: "
            f"the same number of kv heads, or 1), got k.shape={k.shape} and v.shape={v.shape}")
    lead = _broadcast.broadcast_lead((q.shape[:-2], kshape[:-2], vshape[:-2]))
    if lead is None:
        raise ValueError(
            f"{fn}: the leading dims of q, k and v must broadcast (on axis -3 k and v may "
            f"instead hold H/g heads, grouped-query attention), got q.shape={q.shape}, "
            f"k.shape={k.shape}, v.shape={v.shape}")

    dtype = np.dtype(q.dtype)
    acc_dtype = accumulator_dtype(dtype)
    scale = _check_scale(fn, scale, Dk, acc_dtype)
    causal = check_flag("causal", causal, fn)
    bottom_right = _check_align(fn, align)
    q_start, k_start = _check_positions(fn, positions)
    left, right = _check_window(fn, window, causal, Nq + Nk, q_start - k_start)
    full = lead + (Nq, Nk)
    mask = _check_mask(fn, mask, full, lib)
    bias_shape, bias_dtype = (None, None) if bias is None else (tuple(bias.shape), bias.dtype)
    bias = _check_bias(fn, bias, full, lib, acc_dtype)
    dbias = _check_return_dbias(fn, return_dbias, bias)
    lens_device = lens_map = lens_values = lens_elems = None
    if lib == "cupy" and _library(kv_lens) == "cupy":  # read on the device: no synchronization
        lens_map = _check_device_lens(fn, kv_lens, lead, device)
        lens_device, kv_lens = kv_lens, None  # (clamped on demand: clamped_lens)
    else:
        given_lens = kv_lens
        kv_lens = _check_kv_lens(fn, kv_lens, lead, Nk, lib)
        if kv_lens is not None and pages is None:
            lens_values, lens_elems = _lens_elements(np.asarray(given_lens), lead)
    precision = _check_precision(fn, precision)
    # ALiBi's scalar: the positions' offset of the aligned position (its slopes are per head)
    alibi = _check_alibi(fn, alibi_slopes, lead, lib, device)
    if alibi and lib == "cupy" and acc_dtype != np.float64:
        _check_alibi_span(fn, Nq, Nk, q_start - k_start)
    transforms = _modifiers.check(fn, alibi=(float(q_start - k_start),) if alibi else None,
                                  **modifiers)
    sinks_shape, sinks_dtype = _check_sinks(fn, sinks, lead, lib, device, acc_dtype)
    dropout_p = _check_dropout_p(fn, dropout_p)
    dropout_seed = check_dropout_seed(fn, dropout_seed, dropout_p)
    if dbias and dropout_p:  # (no kernel stores dS with the dropout's keep bits yet)
        raise ValueError(f"{fn}: return_dbias=True with dropout_p > 0 is not supported yet, got "
                         f"dropout_p={dropout_p!r}")

    if pages is not None:
        pages = _checked_table(fn, pages, block_table, kv_lens, lead)
    given = (q, k, v)
    q, k, v = (_innermost_contiguous(xp, x) for x in given)  # (page pools: checked unit stride)
    copied = any(a is not b for a, b in zip((q, k, v), given))
    # with pages, the kv heads' offsets within a page: the batch axis reads stride 0 (the block
    # table picks each sequence's pages)
    layouts = [(q.shape[:-2], element_strides(q)[:-2])] + [
        (shape[:-2], element_strides(x)[:-2] if pages is None else (0, element_strides(x)[1]))
        for x, shape in ((k, kshape), (v, vshape))]
    maps = [_broadcast.lead_offsets(lead, shape, strides) for shape, strides in layouts]
    return Problem(xp=xp, q=q, k=k, v=v, lead=lead, Nq=Nq, Nk=Nk, Dk=Dk, Dv=Dv, dtype=dtype,
                   acc_dtype=acc_dtype, scale=scale, causal=causal, bottom_right=bottom_right,
                   left=left, right=right, mask=mask, bias=bias, kv_lens=kv_lens,
                   q_map=maps[0], k_map=maps[1], v_map=maps[2], copied=copied,
                   precision=precision, lens_device=lens_device, lens_map=lens_map,
                   lens_values=lens_values, lens_elems=lens_elems,
                   transforms=transforms, sinks=_sinks_per_head(xp, q, sinks, lead),
                   sinks_shape=sinks_shape, sinks_dtype=sinks_dtype,
                   alibi=_sinks_per_head(xp, q, alibi_slopes, lead), pages=pages, dbias=dbias,
                   bias_shape=bias_shape, bias_dtype=bias_dtype, dropout_p=dropout_p,
                   dropout_seed=dropout_seed)


def _check_dtypes(fn, q, k, v):
    """q, k and v: one dtype among the supported ones."""
    names = supported_dtype_names()
    for name, x in (("q", q), ("k", k), ("v", v)):
        if _dtype_name(x.dtype) not in names:
            raise TypeError(f"{fn}: {name} must have dtype {', '.join(names)}, got {x.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(
            f"{fn}: q, k and v must have one dtype, got q.dtype={q.dtype}, k.dtype={k.dtype}, "
            f"v.dtype={v.dtype}")


def check_backward_inputs(problem, dout, out, lse, fn="attention_backward", shapes=None):
    """dout and out must have the output's shape and dtype; lse the lse's shape, float dtype.
    shapes: (out's, lse's) where they are not the Problem's (a packed call's). What passed once
    for a signature (Problem.key) and the signatures of dout, out, lse passes again: not checked
    again (a small call's host time is its cost)."""
    key = None
    if problem.key is not None and shapes is None:
        try:
            key = (fn, problem.key, _array_key(dout), _array_key(out), _array_key(lse))
        except AttributeError:  # (not arrays: the checks name them)
            pass
        if key in _checked_backward:
            return
    _check_backward_inputs(problem, dout, out, lse, fn, shapes)
    if key is not None:
        _checked_backward.put(key, True)


_checked_backward = _memo.Memo(256)  # (fn, Problem.key, dout's, out's, lse's signature) passed


def _check_backward_inputs(problem, dout, out, lse, fn, shapes):
    out_shape, lse_shape = shapes or (problem.out_shape, problem.lse_shape)
    lib = "numpy" if problem.xp is np else "cupy"
    device = problem.q.data.device_id if lib == "cupy" else None
    _check_same_family(fn, (("dout", dout), ("out", out), ("lse", lse)), "q", lib, device)
    for name, x in (("dout", dout), ("out", out)):
        if x is None:
            raise TypeError(f"{fn}: {name} must be an array, got None")
        if tuple(x.shape) != out_shape:
            raise ValueError(
                f"{fn}: {name} must have the output's shape (..., Nq, Dv) = {out_shape}, "
                f"got {name}.shape={x.shape}")
        if x.dtype != problem.dtype:
            raise TypeError(f"{fn}: {name} must have q's dtype {problem.dtype}, got {x.dtype}")
    if lse is None:
        raise TypeError(f"{fn}: lse must be an array, got None")
    if tuple(lse.shape) != lse_shape:
        raise ValueError(f"{fn}: lse must have shape (..., Nq) = {lse_shape}, "
                         f"got lse.shape={lse.shape}")
    if lse.dtype not in (np.float32, np.float64):
        raise TypeError(f"{fn}: lse must be float32 or float64, got {lse.dtype}")


def check_merge_inputs(out_a, lse_a, out_b, lse_b, fn="merge"):
    named = (("out_a", out_a), ("lse_a", lse_a), ("out_b", out_b), ("lse_b", lse_b))
    _check_array(fn, "out_a", out_a)
    lib = _library(out_a)
    device = out_a.device.id if lib == "cupy" else None
    for name, x in named:
        if x is None:
            raise TypeError(f"{fn}: {name} must be an array, got None")
    _check_same_family(fn, named, "out_a", lib, device)
    for name, x in named:
        if _dtype_name(x.dtype) not in supported_dtype_names():
            raise TypeError(f"{fn}: {name} must have a floating dtype, got {x.dtype}")
    if out_a.dtype != out_b.dtype:
        raise TypeError(
            f"{fn}: out_a and out_b must have one dtype, got {out_a.dtype} and {out_b.dtype}")
    if out_a.ndim < 1 or out_a.shape != out_b.shape:
        raise ValueError(f"{fn}: out_a and out_b must have one shape (..., Nq, Dv), "
                         f"got {out_a.shape} and {out_b.shape}")
    for name, x in (("lse_a", lse_a), ("lse_b", lse_b)):
        if x.shape != out_a.shape[:-1]:
            raise ValueError(
                f"{fn}: {name} must have shape out.shape[:-1] = {out_a.shape[:-1]}, got {x.shape}")
    return _xp_of(lib)


# ---------------------------------------------------------------------------------------------
# packed variable-length batches (cu_seqlens; cuflash/_varlen.py runs them)

# What a packed call refuses: FlashAttention defines none of these for packed sequences, and each
# sequence is aligned by its own lengths (kv_lens are cu_seqlens_k's, positions would shift every
# sequence alike, a mask or bias has no (Nq, Nk) matrix to broadcast over).
PACKED_REFUSED = ("mask", "bias", "kv_lens", "positions", "block_table")


@dataclass
class Packed:
    """A checked packed call: B sequences, sequence b's queries q[cu_q[b]:cu_q[b + 1]] and keys
    k[cu_k[b]:cu_k[b + 1]]. cu_q / cu_k: host offsets (B + 1,) int64, checked (a NumPy array or
    a sequence of ints), or the caller's CuPy array, never read on the host (`q_host` /
    `k_host` False). max_q / max_k: the padded lengths (the longest sequence with host offsets,
    max_seqlen_q / max_seqlen_k with device ones)."""
    xp: Any
    q: Any
    k: Any
    v: Any
    B: int
    H: int
    Hkv: int
    max_q: int
    max_k: int
    bottom_right: bool
    cu_q: Any
    cu_k: Any
    q_host: bool
    k_host: bool

    @property
    def kv_lens(self):
        """The padded Problem's kv_lens: each sequence's key count, (B, 1) (host int64 with host
        offsets; a CuPy difference, one elementwise kernel, with device ones)."""
        return (self.cu_k[1:] - self.cu_k[:-1]).reshape(self.B, 1)

    @property
    def out_shape(self):
        return (self.q.shape[0], self.H, self.v.shape[-1])

    @property
    def lse_shape(self):
        return (self.q.shape[0], self.H)


def _check_offsets(fn, name, cu, lib, device):
    """cu_seqlens' kind, dtype and shape; returns (array, on the host)."""
    kind = _library(cu)
    if kind == "cupy":
        if lib != "cupy":
            raise TypeError(f"{fn}: {name} must be a sequence of ints or a numpy.ndarray for "
                            "NumPy inputs, got a cupy.ndarray")
        if cu.device.id != device:
            raise ValueError(f"{fn}: all arrays must be on one device: q is on cuda device "
                             f"{device} but {name} is on cuda device {cu.device.id}")
        arr = cu
    else:
        try:
            arr = np.asarray(cu)
        except Exception:  # ragged sequences and the like
            raise TypeError(f"{fn}: {name} must be an int32 or int64 array of offsets, got "
                            f"{type(cu).__name__}")
    if arr.dtype not in (np.int32, np.int64):
        raise TypeError(f"{fn}: {name} must hold int32 (FlashAttention's) or int64 offsets, got "
                        f"dtype {arr.dtype}")
    if arr.ndim != 1 or arr.shape[0] < 1:
        raise ValueError(f"{fn}: {name} must have shape (B + 1,) (offsets starting at 0), got "
                         f"{name}.shape={arr.shape}")
    return arr, kind != "cupy"


def _host_offsets(fn, name, arr, tokens, total):
    """Host offsets' values: 0 first, non-decreasing, the packed token count last."""
    a = arr.astype(np.int64)
    if a[0] != 0:
        raise ValueError(f"{fn}: {name} must start at 0, got {name}[0] = {a[0]}")
    down = np.nonzero(a[1:] < a[:-1])[0]
    if down.size:
        i = int(down[0])
        raise ValueError(f"{fn}: {name} must be non-decreasing, got {name}[{i}] = {a[i]} > "
                         f"{name}[{i + 1}] = {a[i + 1]}")
    if a[-1] != total:
        raise ValueError(f"{fn}: {name}[-1] must be the number of packed tokens {tokens} = "
                         f"{total}, got {a[-1]}")
    a.flags.writeable = False
    return a


def _check_max_seqlen(fn, name, value, cu, host, cu_name, total):
    """The padded length: the longest sequence with host offsets (max_seqlen, if given, must be
    at least that), max_seqlen itself with device offsets (required: their values stay there)."""
    if value is not None and (isinstance(value, (bool, np.bool_))
                              or not isinstance(value, numbers.Integral)):
        raise TypeError(f"{fn}: {name} must be a non-negative int or None, got "
                        f"{type(value).__name__} {value!r}")
    if value is not None and value < 0:
        raise ValueError(f"{fn}: {name} must be non-negative, got {value}")
    if host:
        longest = int((cu[1:] - cu[:-1]).max(initial=0))
        if value is not None and value < longest:
            raise ValueError(f"{fn}: {name} must be at least the longest sequence's length "
                             f"{longest} (from {cu_name}), got {value}")
        return longest
    if value is None:
        raise TypeError(f"{fn}: {name} must be an int with a cupy.ndarray {cu_name} (its values "
                        "stay on the device, so the padded length is not read from them), got "
                        "None")
    if total and (value == 0 or cu.shape[0] == 1):
        raise ValueError(f"{fn}: {name} = {value} with {cu.shape[0] - 1} sequences leaves no "
                         f"room for the {total} packed tokens")
    return int(value)


def check_packed(fn, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, align,
                 **refused):
    """A packed call's checks before anything is allocated or launched, or None when the call
    is not packed (no cu_seqlens). q (total_q, H, Dk), k (total_k, Hkv, Dk), v (total_k, Hkv,
    Dv); `refused`: the PACKED_REFUSED options' values. make_problem checks the rest (scale,
    causal, window, softcap, sinks, ALiBi, head dims) on the padded arrays."""
    if cu_seqlens_q is None and cu_seqlens_k is None:
        for name, value in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
            if value is not None:
                raise ValueError(f"{fn}: {name} is only taken with cu_seqlens_q and "
                                 f"cu_seqlens_k, got {name}={value!r} without them")
        return None
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if cu is None:
            raise ValueError(f"{fn}: cu_seqlens_q and cu_seqlens_k must be given together, got "
                             f"{name}=None")
    for name, value in refused.items():
        if value is not None:
            raise ValueError(f"{fn}: {name} is not defined for packed sequences (cu_seqlens_q, "
                             f"cu_seqlens_k; each sequence is aligned by its own lengths), got "
                             f"{name} of type {type(value).__name__}")
    _check_array(fn, "q", q)
    lib = _library(q)
    device = q.device.id if lib == "cupy" else None
    _check_same_family(fn, (("k", k), ("v", v)), "q", lib, device)
    _check_dtypes(fn, q, k, v)
    _check_ranks(fn, (("q", q, "(total_q, H, Dk)"), ("k", k, "(total_k, Hkv, Dk)"),
                      ("v", v, "(total_k, Hkv, Dv)")), 3, "with cu_seqlens, {} must have shape",
                 "tokens and kv heads (total_k, Hkv)")
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"{fn}: q and k must have the same head dim (axis -1), got "
                         f"q.shape={q.shape} and k.shape={k.shape}")
    H, Hkv = q.shape[1], k.shape[1]
    if (H == 0) != (Hkv == 0) or (Hkv and H % Hkv):
        raise ValueError(f"{fn}: q's heads (axis 1) must be a multiple of k's and v's "
                         f"(grouped-query attention), got q.shape={q.shape} and k.shape={k.shape}")
    (cq, q_host), (ck, k_host) = (_check_offsets(fn, name, cu, lib, device) for name, cu in
                                  (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)))
    if cq.shape != ck.shape:
        raise ValueError(f"{fn}: cu_seqlens_q and cu_seqlens_k must have one length B + 1, got "
                         f"cu_seqlens_q.shape={cq.shape} and cu_seqlens_k.shape={ck.shape}")
    if q_host:
        cq = _host_offsets(fn, "cu_seqlens_q", cq, "q.shape[0]", q.shape[0])
    if k_host:
        ck = _host_offsets(fn, "cu_seqlens_k", ck, "k.shape[0]", k.shape[0])
    max_q = _check_max_seqlen(fn, "max_seqlen_q", max_seqlen_q, cq, q_host, "cu_seqlens_q",
                              q.shape[0])
    max_k = _check_max_seqlen(fn, "max_seqlen_k", max_seqlen_k, ck, k_host, "cu_seqlens_k",
                              k.shape[0])
    return Packed(xp=_xp_of(lib), q=q, k=k, v=v, B=cq.shape[0] - 1, H=H, Hkv=Hkv, max_q=max_q,
                  max_k=max_k, bottom_right=_check_align(fn, align), cu_q=cq, cu_k=ck,
                  q_host=q_host, k_host=k_host)


def check_packed_backward(packed, problem, dout, out, lse, fn="attention_backward"):
    """dout, out and lse of a packed call: out's (total_q, H, Dv), lse (total_q, H)."""
    total_q = packed.q.shape[0]
    check_backward_inputs(problem, dout, out, lse, fn,
                          shapes=((total_q, packed.H, problem.Dv), (total_q, packed.H)))
