"""TMA tensor maps for the Hopper kernels (kernels_cu/tma.cuh), made on the host by the driver's
cuTensorMapEncodeTiled through ctypes (libcuda ships with every CUDA driver; no new dependency).

A map is 128 opaque bytes, passed to a kernel by value as a NumPy scalar of MAP_DTYPE (CuPy hands
each argument to the driver by pointer, and the driver lays it out as the kernel declares it).
The caller memoizes the maps it makes (cuflash/_wgmma_fwd.py: one Launch per inputs' addresses
and layouts and staging rule) and their layouts (TiledMap, per layout and alignment): a fresh array
of a known layout costs the driver's encoding alone.
"""
import ctypes
import functools

import numpy as np

MAP_DTYPE = np.dtype([("v", "<u8", (16,))])
NO_MAP = np.zeros((), dtype=MAP_DTYPE)[()]  # the argument where an input is absent
# CU_TENSOR_MAP_DATA_TYPE_UINT8, _FLOAT16, _FLOAT32, _BFLOAT16
_DATA_TYPE = {"bool": 0, "uint8": 0, "float16": 6, "float32": 7, "bfloat16": 9}
SWIZZLE_NONE, SWIZZLE_128B = 0, 3
_L2_PROMOTION_256B = 3
_OOB_FILL_ZEROS = 0
MAX_BOX = 256


@functools.cache
def _encode():
    c = ctypes
    fn = c.CDLL("libcuda.so.1").cuTensorMapEncodeTiled
    fn.restype = c.c_int
    fn.argtypes = [c.c_void_p, c.c_int, c.c_uint32, c.c_void_p, c.POINTER(c.c_uint64),
                   c.POINTER(c.c_uint64), c.POINTER(c.c_uint32), c.POINTER(c.c_uint32),
                   c.c_int, c.c_int, c.c_int, c.c_int]
    return fn


class TiledMap:
    """A tensor map's layout (`dims` innermost first, the innermost one contiguous, `byte_strides`
    of the others, `box` the elements one copy moves per dimension: with the 128-byte swizzle,
    box[0] elements make one 128-byte row; zeros outside the tensor), with its driver arguments
    made once; `at(ptr)` encodes the map of a tensor at device address `ptr` (a fresh array of a
    known layout costs the driver's encoding alone)."""

    def __init__(self, dtype_name, dims, byte_strides, box, swizzle=SWIZZLE_128B):
        c = ctypes
        self.rank = rank = len(dims)
        self.dtype = _DATA_TYPE[dtype_name]
        self.dims = (c.c_uint64 * rank)(*dims)
        self.strides = (c.c_uint64 * (rank - 1))(*byte_strides)
        self.box = (c.c_uint32 * rank)(*box)
        self.steps = (c.c_uint32 * rank)(*([1] * rank))
        self.swizzle = swizzle

    def at(self, ptr):
        """The map (a NumPy scalar of MAP_DTYPE) at address `ptr`, or None where the driver
        refuses it."""
        store = (ctypes.c_char * (MAP_DTYPE.itemsize + 64))()  # a 64-byte-aligned window in it
        at = -ctypes.addressof(store) % 64
        status = _encode()(ctypes.addressof(store) + at, self.dtype, self.rank,
                           ctypes.c_void_p(ptr), self.dims, self.strides, self.box, self.steps, 0,
                           self.swizzle, _L2_PROMOTION_256B, _OOB_FILL_ZEROS)
        if status != 0:
            return None
        return np.frombuffer(store, dtype=MAP_DTYPE, count=1, offset=at)[0]  # (a view of it)


def tiled_map(dtype_name, ptr, dims, byte_strides, box, swizzle=SWIZZLE_128B):
    """The tensor map of one tensor at `ptr` (TiledMap.at), or None."""
    return TiledMap(dtype_name, dims, byte_strides, box, swizzle).at(ptr)


def head_layout(x, x_map, B, H):
    """How input x is read per output (batch b, head h) of a (B, H) grid, as a 4-D tensor map sees
    it: (hdiv, bmul, Hx, Bx, head stride, batch stride) in elements, such that matrix (b, h) sits
    at (b * bmul) * batch stride + (h // hdiv) * head stride (the offset table `x_map` of shape
    lead, checked); Hx, Bx the map's head and batch extents (1 where broadcast). None when the
    offsets are not of that form (several broadcast leading axes, say)."""
    off = np.asarray(x_map).reshape(B, H)
    Hx = x.shape[-3] if x.ndim >= 3 else 1
    hdiv = H // Hx if H % Hx == 0 else 0
    if hdiv == 0:
        return None
    sh = int(off[0, hdiv] - off[0, 0]) if Hx > 1 else 0
    sb = int(off[1, 0] - off[0, 0]) if B > 1 else 0
    if sh == 0:
        Hx, hdiv = 1, H
    bmul = 1 if sb != 0 else 0
    want = (np.arange(B)[:, None] * sb) + (np.arange(H)[None, :] // hdiv) * sh
    if off[0, 0] != 0 or not np.array_equal(off, want):
        return None
    return hdiv, bmul, Hx, (B if bmul else 1), sh, sb
