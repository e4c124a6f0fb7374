"""The CUDA path: turn a Problem into the kernels' arguments and launch them.

Everything here runs on the current CuPy stream and never synchronizes. Per (batch, head) matrix
the kernels read from an offset table (DESIGN.md), so broadcasting, GQA and arbitrary strides
cost no copies.
"""

import cupy
import numpy as np

from . import _broadcast, _config, _decode, _kernels, _launch, _tc_bwd
from ._validate import element_strides

_Q, _K, _V, _MASK, _BIAS = range(5)

# Tests set this to fill every buffer the kernels write with NaN first, proving that each element
# is written (CuPy's pool would otherwise hand back whatever memory held before).
POISON = False


# Tests set this to run every problem a path can take on that path ("generic" forces the generic
# kernels everywhere); None lets forward_path choose.
FORCE_PATH = None

_MAX_SM80_LEN = 1 << 29  # fwd_sm80's 32-bit visibility arithmetic is exact below this


def tensor_core_layout(p):
    """What every tensor-core kernel needs (fwd_sm80.cu and bwd_sm80.cu, "Requirements"): 16-bit
    inputs, Dk == Dv, scale > 0, lengths within their 32-bit arithmetic, sm_80+, and 16-byte rows:
    unit innermost stride, rows and matrices 8 elements apart, aligned bases."""
    if p.dtype.name not in _config.SM80_DTYPES or p.Dk != p.Dv:
        return False
    if not p.scale > 0 or max(p.Nq, p.Nk) > _MAX_SM80_LEN:
        return False  # the kernels fold the scale into exp2 and take maxima of unscaled scores
    if _kernels.device_info().cc < 80:
        return False
    for x, offsets in ((p.q, p.q_map), (p.k, p.k_map), (p.v, p.v_map)):
        strides = element_strides(x)
        if strides[-1] != 1 or strides[-2] % 8 or x.data.ptr % 16 or np.any(offsets % 8):
            return False
    return True


def _sm80_fits(p):
    """Whether the tensor-core forward takes this Problem."""
    if p.Dk not in _config.SM80_HEAD_DIMS or not tensor_core_layout(p):
        return False
    has_mb = p.mask is not None or p.bias is not None
    return _config.sm80_smem_bytes(p.Dk, has_mb) <= _kernels.device_info().smem_optin


def forward_path(p):
    """'split' (split-KV decode) for few queries against many keys, else 'sm80' (tensor cores)
    when the Problem fits it, else 'generic'. FORCE_PATH='split' takes the split path wherever
    it can run, with small splits."""
    if FORCE_PATH == "generic":
        return "generic"
    if FORCE_PATH in ("split", "split-simt"):
        return "split" if _decode.fits(p) else "generic"
    if _decode.supports(p):
        return "split"
    return "sm80" if _sm80_fits(p) else "generic"


_FORCED_SPLIT_KEYS = 64


def _empty(shape, dtype):
    buf = cupy.empty(shape, dtype=dtype)
    if POISON:
        if np.dtype(dtype).name == "bfloat16":  # a quiet NaN, written as bits
            buf.view(np.uint16).fill(0x7FC0)
        else:
            buf.fill(np.nan)
    return buf


_TABLE_CACHE_SIZE = 256
_TABLE_CACHE_MAX_BYTES = 1 << 20
_tables = {}


def _on_device(host):
    """A device copy of a small host table, cached by content.

    A copy from pageable host memory waits for the stream to drain first, which would stall the
    host on every call; repeated calls with the same layout (the common case) reuse the copy.
    """
    if host.nbytes > _TABLE_CACHE_MAX_BYTES:
        return cupy.asarray(host)
    key = (cupy.cuda.Device().id, host.dtype.str, host.shape, host.tobytes())
    table = _tables.get(key)
    if table is None:
        if len(_tables) >= _TABLE_CACHE_SIZE:
            _tables.pop(next(iter(_tables)))  # oldest first
        table = _tables[key] = cupy.asarray(host)
    return table


class _Args:
    """The kernel arguments shared by the forward and backward launches of one Problem."""

    def __init__(self, p):
        BH = p.BH
        table = np.zeros((5, BH), dtype=np.int64)
        table[_Q], table[_K], table[_V] = (m.reshape(BH) for m in (p.q_map, p.k_map, p.v_map))
        self.mask_rs = self.mask_cs = self.bias_rs = self.bias_cs = 0
        if p.mask is not None:
            st = element_strides(p.mask)
            table[_MASK] = _broadcast.lead_offsets(p.lead, p.lead, st[:-2]).reshape(BH)
            self.mask_rs, self.mask_cs = st[-2:]
        if p.bias is not None:
            st = element_strides(p.bias)
            table[_BIAS] = _broadcast.lead_offsets(p.lead, p.lead, st[:-2]).reshape(BH)
            self.bias_rs, self.bias_cs = st[-2:]
        self.offsets = _on_device(table)
        self.kv_lens = None if p.kv_lens is None else _on_device(p.kv_lens.reshape(BH))
        self.q_rs, self.k_rs, self.v_rs = (element_strides(x)[-2] for x in (p.q, p.k, p.v))

    def common(self, p):
        """Arguments in the order every main kernel takes them after its own pointers."""
        return dict(offsets=self.offsets, mask=p.mask, bias=p.bias, kv_lens=self.kv_lens,
                    q_rs=self.q_rs, k_rs=self.k_rs, v_rs=self.v_rs,
                    mask_rs=self.mask_rs, mask_cs=self.mask_cs,
                    bias_rs=self.bias_rs, bias_cs=self.bias_cs,
                    BH=p.BH, Nq=p.Nq, Nk=p.Nk, Dk=p.Dk, Dv=p.Dv, scale=p.scale,
                    left=p.left, right=p.right, bottom_right=int(p.bottom_right))


def forward(p):
    path = forward_path(p)
    if path == "split":
        with p.q.device:
            forced = FORCE_PATH in ("split", "split-simt")
            return _decode.forward(p, split=_FORCED_SPLIT_KEYS if forced else None,
                                   variant="simt" if FORCE_PATH == "split-simt" else None)
    with p.q.device:
        args = _Args(p)
        out = _empty((p.BH, p.Nq, p.Dv), dtype=p.dtype)
        lse = _empty((p.BH, p.Nq), dtype=p.acc_dtype)
        launch = _launch.launch_fwd_sm80 if path == "sm80" else _launch.launch_fwd
        launch(p.q, p.k, p.v, out, lse, **args.common(p))
        return out, lse


def backward_path(p):
    """'sm80' (tensor-core backward) when the Problem fits it, else 'generic'."""
    if FORCE_PATH == "generic":
        return "generic"
    return "sm80" if _tc_bwd.supports(p) else "generic"


def backward(p, dout, out, lse, deterministic=False):
    """Returns dq, dk, dv per output (batch, head), in the accumulator dtype (the tensor-core path
    may give dk, dv in the inputs' dtype already, see cuflash._tc_bwd.backward).

    The generic kernels are deterministic by construction (no atomics); the tensor-core path adds
    dq with atomics unless ``deterministic``, which then takes its fixed-order dq kernel."""
    if backward_path(p) == "sm80":
        return _tc_bwd.backward(p, dout, out, lse, deterministic=deterministic)
    with p.q.device:
        args = _Args(p)
        BH = p.BH
        dout = cupy.ascontiguousarray(dout).reshape(BH, p.Nq, p.Dv)
        out = cupy.ascontiguousarray(out).reshape(BH, p.Nq, p.Dv)
        lse = cupy.ascontiguousarray(lse.astype(p.acc_dtype, copy=False)).reshape(BH, p.Nq)
        lse_eff = _empty((BH, p.Nq), dtype=p.acc_dtype)  # lost rows: +inf (skipped)
        delta = _empty((BH, p.Nq), dtype=p.acc_dtype)
        _launch.launch_bwd_preprocess(dout, out, lse, lse_eff, delta, BH * p.Nq, p.Dv)
        dq = _empty((BH, p.Nq, p.Dk), dtype=p.acc_dtype)
        dk = _empty((BH, p.Nk, p.Dk), dtype=p.acc_dtype)
        dv = _empty((BH, p.Nk, p.Dv), dtype=p.acc_dtype)
        common = args.common(p)
        _launch.launch_bwd_dkdv(p.q, p.k, p.v, dout, lse_eff, delta, dk, dv, **common)
        _launch.launch_bwd_dq(p.q, p.k, p.v, dout, lse_eff, delta, dq, **common)
        _launch.launch_lost(p.q, p.k, p.v, dout, out, lse, dq, dk, dv, **common)
        return dq, dk, dv
