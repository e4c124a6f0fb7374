"""The score modifiers: the one host table of the score transforms (kernels_cu/modifiers.cuh).

Every path applies, to each (query i, key j) visible by position,

    logit = F(scale * q_i . k_j) + bias[i, j]      (-inf where the mask or a -inf bias hides)

with F the problem's transforms in table order (the identity without any). One entry here is all
the host knows of a transform: the keyword of the public functions that turns it on, its C++ type,
its scalars (AttnArgs' mod0, mod1, ...: ModArgs on the device), its check, and its NumPy
definition with its derivative (the CPU path; tests/ hold their own dense definition in
cuflash/reference.py). The kernels' score-modifier type for a problem (`score_mod`) and the
transform type of the kernels that take one (`transform`) are named here and nowhere else.

A transform may read where it is applied (`At`: the query's aligned position, the key, its head's
entry of a per-(batch, head) table): ALiBi. Its table is an array option that _validate checks
(`alibi_slopes`, Problem.alibi) and the kernels read through AttnArgs' mod_table (`table`).
Chains: the generic kernels and the lost-row kernels take every chain (`CHAINS`); the tensor-core
paths and decode_split one transform at most (`SINGLE`: their catalog stays one instantiation per
transform), so a call with softcap and ALiBi together runs on the generic kernels.

A leaf module: NumPy only.
"""
import itertools
import math
from collections import namedtuple

import numpy as np

MOD_ARGS = 2  # kernels_cu/modifiers.cuh MOD_ARGS: AttnArgs' mod0, mod1


def _check_softcap(fn, value):
    """softcap: a finite real > 0 (0 and None: off, as in FlashAttention)."""
    if value is None:
        return None
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer,
                                                                      np.floating)):
        raise TypeError(f"{fn}: softcap must be a real number or None, got "
                        f"{type(value).__name__}")
    cap = float(value)
    if cap == 0.0:
        return None
    if not (math.isfinite(cap) and cap > 0):
        raise ValueError(f"{fn}: softcap must be finite and > 0 (0 or None: off), got {value!r}")
    return (cap,)


def _softcap(x, at, cap):
    return cap * np.tanh(x / cap)


def _softcap_grad(x, at, cap):
    return 1 - np.tanh(x / cap) ** 2


def _checked(fn, value):
    """An array option's scalars, which _validate checked (None: off)."""
    return value


# Where a NumPy block of logits (heads, rows, keys) sits: `pos` (heads or 1, rows, 1) the rows'
# aligned positions (_validate.aligned_position, without the positions' offset), `keys` (keys,)
# the key indices, `table` (heads or 1, 1, 1) the heads' entries of Problem.alibi (None without).
At = namedtuple("At", "pos keys table")


def _alibi(x, at, d):
    """ALiBi: x - slope * |p_i + d - j| (d: the positions' offset q_start - k_start)."""
    return x - (at.table * np.abs(at.pos + d - at.keys)).astype(x.dtype)


def _alibi_grad(x, at, d):
    return np.ones_like(x)


# name: the keyword; cxx: the C++ type ({acc}: the accumulator C type; {natural}: true / false,
# natural units or log2 units; {arith}: how precisely, by the inputs' dtype, modifiers.cuh ARITH_*);
# check(fn, value) -> its scalars (a tuple) or None when off; forward(x, at, *scalars) -> F(x)
# and grad(x, at, *scalars) -> dF/dx on NumPy arrays of natural-unit logits (at: `At`).
Transform = namedtuple("Transform", "name cxx check forward grad")
TRANSFORMS = (
    Transform("softcap", "Softcap<{acc}, {natural}, {arith}>", _check_softcap, _softcap,
              _softcap_grad),
    # alibi_slopes: _validate._check_alibi; the scalar is the positions' offset q_start - k_start
    Transform("alibi", "Alibi<{acc}>", _checked, _alibi, _alibi_grad),
)
NAMES = tuple(t.name for t in TRANSFORMS)
_BY_NAME = {t.name: t for t in TRANSFORMS}
# Every chain of transforms a call can ask for (each subset, in table order): the generic and
# lost-row kernels' catalog; SINGLE, the chains of one transform at most: the other paths'.
CHAINS = tuple(c for r in range(len(NAMES) + 1) for c in itertools.combinations(NAMES, r))
SINGLE = tuple(c for c in CHAINS if len(c) <= 1)
# Transforms that read the position (i, j) of a logit (modifiers.cuh POSITIONAL)
POSITIONAL = ("alibi",)
# Transforms F(x) = x + g(i, j) (modifiers.cuh ADDITIVE): alone, the Hopper forward and the
# tensor-core backward keep the scale folded and their registers are those of the plain call
ADDITIVE = ("alibi",)


def check(fn, **values):
    """The transforms a call asks for, as a tuple of (name, scalars) in table order (the
    Problem's `transforms`, hashable: part of its signature). Unknown names are a caller bug."""
    chosen = []
    for t in TRANSFORMS:
        scalars = t.check(fn, values.pop(t.name, None))
        if scalars is not None:
            chosen.append((t.name, scalars))
    assert not values, values
    return tuple(chosen)


def scalars(p):
    """AttnArgs' mod0, mod1, ... of a problem: its transforms' scalars in order, zero-padded."""
    flat = [x for _, s in p.transforms for x in s]
    assert len(flat) <= MOD_ARGS, flat
    return flat + [0.0] * (MOD_ARGS - len(flat))


def table(p):
    """The per-head table of a problem's transforms (AttnArgs' mod_table): its (BH,) float64
    ALiBi slopes on the device, None without."""
    return p.alibi


def positional(names):
    """Whether the chain reads positions (kernels whose rows span several heads take none)."""
    return any(n in POSITIONAL for n in names)


def modified(p):
    """Whether the kernels need a score modifier: a mask, a bias or a transform."""
    return p.mask is not None or p.bias is not None or bool(p.transforms)


def additive(names):
    """Whether a chain is additive transforms alone (at least one)."""
    return bool(names) and all(n in ADDITIVE for n in names)


def _b(x):
    return "true" if x else "false"


# modifiers.cuh ARITH_*: accurate functions (float32 / float64 inputs), one MUFU exponential
# (float16), the MUFU's approximations (bfloat16: logits of 8 bits)
ARITH = {"float16": 1, "bfloat16": 2}


def arith(dtype_name):
    return ARITH.get(dtype_name, 0)


def transform(names, acc="float", natural=False, dtype_name="float32"):
    """The C++ transform type of the named transforms (modifiers.cuh; NoTransform for none) for
    kernels of inputs of dtype `dtype_name`."""
    types = [_BY_NAME[n].cxx.format(acc=acc, natural=_b(natural), arith=arith(dtype_name))
             for n in names]
    if not types:
        return "NoTransform"
    out = types[-1]
    for t in reversed(types[:-1]):
        out = f"Then<{t}, {out}>"
    return out


def names(p):
    return tuple(n for n, _ in p.transforms)


def score_mod(has_mb, names=(), acc="float", natural=None, dtype_name="float32"):
    """The C++ score-modifier type (kernels_cu/attn_core.cuh) a tensor-core kernel with accumulator
    C type `acc` and inputs of `dtype_name` is instantiated with: the identity, or the mask / bias
    (has_mb) and transforms in log2 units or natural ones (default: natural for double, as
    fwd_wide.cu computes float64; bwd_wide.cu always)."""
    if not has_mb and not names:
        return "NoMod"
    natural = acc == "double" if natural is None else natural
    if not names:
        return f"MaskBiasModT<{acc}, true>" if natural else \
            "MaskBiasMod" if acc == "float" else f"MaskBiasModT<{acc}>"
    return (f"ScoreModT<{acc}, {_b(natural)}, {_b(has_mb)}, "
            f"{transform(names, acc, natural, dtype_name)}>")


def forward(p, x, at):
    """F(x) on NumPy natural-unit logits (the CPU path) at `at` (`At`)."""
    for name, s in p.transforms:
        x = _BY_NAME[name].forward(x, at, *s)
    return x


def forward_and_grad(p, x, at):
    """(F(x), dF/dx) on NumPy natural-unit logits (the CPU path's backward) at `at`."""
    g = np.ones_like(x)
    for name, s in p.transforms:
        t = _BY_NAME[name]
        g = g * t.grad(x, at, *s)
        x = t.forward(x, at, *s)
    return x, g
