"""CUDA coalescing: pack many device arrays into one flat device buffer, and back,
in one kernel launch each.

The GPU twin of :mod:`.pack`. The arrays are described by two small device
vectors built once per list (:class:`DevicePackPlan`): each array's device
address and its offset in the buffer, in words (the array's items, or 8-byte
words for complex128). A grid-stride loop runs over the buffer's words; each
thread finds its array by binary search over the offsets and loads (or stores)
through the array's address, so a launch covers the whole list however many
arrays it holds. The scaling variant multiplies by a factor as it copies
(float32/float64 buffers).

Under the CUDA simulator device memory is host memory, so the loads and stores
go through ``ctypes`` there; on a GPU they are ``inttoptr`` + load/store
intrinsics. Import lazily (it loads ``numba.cuda``).
"""

from __future__ import annotations

import ctypes

import numpy as np

from ..dtypes import dtype_name, is_half
from .kernels import _launch
from .device import _SIMULATED, _as_device, _device_pointer, _flat, _to_device, cuda

__all__ = ["DevicePackPlan"]

_JIT = dict(cache=True)
# Host code never calls through the module ``cuda``: the simulator swaps it for a
# per-launch fake while a kernel of this module runs (see device).
_device_array = cuda.device_array

if _SIMULATED:
    def _element(addr, index, like):
        itemsize = like.dtype.itemsize
        raw = (ctypes.c_char * itemsize).from_address(int(addr) + int(index) * itemsize)
        return np.frombuffer(raw, like.dtype)

    @cuda.jit(device=True)
    def _load(addr, index, like):
        return _element(addr, index, like)[0]

    @cuda.jit(device=True)
    def _store(addr, index, value, like):
        _element(addr, index, like)[0] = value
else:
    # The same generic intrinsics the CPU pack kernels use: typed loads and
    # stores through an integer address, which compile for either target.
    from ..kernels.pack import _load, _store


@cuda.jit(device=True)
def _owner(offsets, word):
    """The array holding ``word``: the last k with offsets[k] <= word (empty arrays skipped)."""
    lo = 0
    hi = offsets.size - 1
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if offsets[mid] <= word:
            lo = mid
        else:
            hi = mid
    return lo


@cuda.jit(**_JIT)
def _pack_kernel(buf, addrs, offsets):
    for e in range(cuda.grid(1), buf.size, cuda.gridsize(1)):
        k = _owner(offsets, e)
        buf[e] = _load(addrs[k], e - offsets[k], buf)


@cuda.jit(**_JIT)
def _pack_scaled_kernel(buf, addrs, offsets, factor):
    for e in range(cuda.grid(1), buf.size, cuda.gridsize(1)):
        k = _owner(offsets, e)
        buf[e] = _load(addrs[k], e - offsets[k], buf) * factor


@cuda.jit(**_JIT)
def _unpack_kernel(buf, addrs, offsets):
    for e in range(cuda.grid(1), buf.size, cuda.gridsize(1)):
        k = _owner(offsets, e)
        _store(addrs[k], e - offsets[k], buf[e], buf)


class DevicePackPlan:
    """The layout of device ``arrays`` (one dtype, C-contiguous) in a flat device buffer.

    ``launches`` counts kernel launches (one per :meth:`pack` / :meth:`unpack`).
    """

    def __init__(self, arrays, name: str = "pack"):
        arrays = [_as_device(name, f"array {i}", a) for i, a in enumerate(arrays)]
        if not arrays:
            raise ValueError(f"{name}: requires non-empty tensor list")
        if all(is_half(a.dtype) for a in arrays):
            # float16/bfloat16 move as their 16-bit patterns (the buffer is uint16).
            arrays = [a.view(np.uint16) for a in arrays]
        dtype = arrays[0].dtype
        for i, a in enumerate(arrays):
            if a.dtype != dtype:
                raise TypeError(f"{name}: tensors must all have the same type (index {i} is "
                                f"{dtype_name(a.dtype)}, index 0 is {dtype_name(dtype)})")
            _flat(name, f"array {i}", a)
        self.arrays, self.dtype = arrays, dtype
        self.counts = np.array([a.size for a in arrays], np.int64)
        self.count = int(self.counts.sum())
        # Copies move words: the items themselves, or 8-byte halves of complex128.
        self._word = np.dtype(f"u{min(dtype.itemsize, 8)}")
        per_item = dtype.itemsize // self._word.itemsize
        offsets = np.zeros(len(arrays) + 1, np.int64)
        np.cumsum(self.counts * per_item, out=offsets[1:])
        self._offsets = _to_device(offsets)
        self._addrs = _to_device(np.array([_device_pointer(a) if a.size else 0
                                           for a in arrays], np.int64))
        self.launches = 0

    def empty(self):
        """A new flat device buffer for this plan."""
        return _device_array(self.count, self.dtype)

    def _words(self, buf):
        if buf.dtype != self.dtype or buf.size != self.count:
            raise ValueError(f"pack: the buffer must hold {self.count} "
                             f"{dtype_name(self.dtype)} elements, got {buf.size} "
                             f"{dtype_name(buf.dtype)}")
        return _flat("pack", "buffer", buf).view(self._word)

    def pack(self, buf=None, scale: float | None = None):
        """Copy every array into ``buf`` (a new device buffer if None), times ``scale``."""
        buf = self.empty() if buf is None else _as_device("pack", "buffer", buf, writable=True)
        if scale is None or scale == 1:
            words = self._words(buf)
            _launch(_pack_kernel, words.size, 0, words, self._addrs, self._offsets)
        elif self.dtype in (np.float32, np.float64):
            self._words(buf)
            _launch(_pack_scaled_kernel, buf.size, 0, buf, self._addrs, self._offsets,
                    self.dtype.type(scale))
        else:
            raise TypeError(f"pack: scaling while packing takes float32/float64 device arrays, "
                            f"got {dtype_name(self.dtype)}")
        self.launches += 1
        return buf

    def unpack(self, buf) -> None:
        """Copy ``buf`` back into the arrays."""
        words = self._words(_as_device("unpack", "buffer", buf))
        _launch(_unpack_kernel, words.size, 0, words, self._addrs, self._offsets)
        self.launches += 1
