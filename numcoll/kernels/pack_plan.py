"""Pack plans: where each array of a list lives in one flat buffer.

A plan is built once for a list of arrays (a gradient bucket, a group of
``broadcast_coalesced``) and then packs and unpacks them with one Numba call
each (:mod:`.pack`), however many arrays there are. Building a
plan costs about 0.5 us per array (checks, and reading each array's address); packing
costs only the memory traffic, so a plan pays for itself the second time it
is used -- and the Reducer uses its plans every step.
"""

from __future__ import annotations

import numpy as np

from ..dtypes import dtype_name, is_half
from .cpu import scale_into
from .pack import _address, _pack_kernel, _pack_scaled_kernel, _unpack_kernel

__all__ = ["PackPlan"]

_SCALED_KINDS = "fc"   # dtypes the scaling kernel takes (float16/bfloat16 scale after packing)


class PackPlan:
    """The layout of ``arrays`` (one dtype, C-contiguous) in a flat buffer, back to back.

    Parameters
    ----------
    arrays : list of NumPy arrays of one dtype, each C-contiguous.
    name : the operation named in error messages.

    The plan keeps references to the arrays: the kernels copy to and from their
    addresses, which therefore stay valid as long as the plan lives.
    """

    __slots__ = ("arrays", "dtype", "counts", "offsets", "count", "_addrs", "_nbytes",
                 "_byte_offsets")

    def __init__(self, arrays, name: str = "pack"):
        arrays = list(arrays)
        if not arrays:
            raise ValueError(f"{name}: requires non-empty tensor list")
        dtype = arrays[0].dtype
        for i, a in enumerate(arrays):
            if not isinstance(a, np.ndarray):
                raise TypeError(f"{name}: expected NumPy arrays, got {type(a).__name__} at "
                                f"index {i}")
            if a.dtype != dtype:
                raise TypeError(f"{name}: tensors must all have the same type (index {i} is "
                                f"{dtype_name(a.dtype)}, index 0 is {dtype_name(dtype)})")
            if not a.flags.c_contiguous:
                raise ValueError(f"{name}: array at index {i} is not contiguous (shape "
                                 f"{a.shape}, strides {a.strides})")
        self.arrays = arrays
        self.dtype = dtype
        self.counts = np.fromiter((a.size for a in arrays), np.int64, len(arrays))
        self.offsets = np.zeros(len(arrays), np.int64)
        np.cumsum(self.counts[:-1], out=self.offsets[1:])
        self.count = int(self.counts.sum())
        # Numba has no float16/bfloat16 arrays: read their addresses through uint16 views.
        typed = (a.view(np.uint16) for a in arrays) if is_half(dtype) else arrays
        self._addrs = np.fromiter(map(_address, typed), np.int64, len(arrays))
        self._nbytes = self.counts * dtype.itemsize
        self._byte_offsets = self.offsets * dtype.itemsize

    def __len__(self) -> int:
        return len(self.arrays)

    def empty(self) -> np.ndarray:
        """A new flat buffer for this plan."""
        return np.empty(self.count, self.dtype)

    def _check_buffer(self, buf: np.ndarray, name: str, writable: bool) -> None:
        if not isinstance(buf, np.ndarray) or buf.dtype != self.dtype or buf.ndim != 1 \
                or buf.size != self.count or not buf.flags.c_contiguous:
            raise ValueError(
                f"{name}: the buffer must be a contiguous 1-D {dtype_name(self.dtype)} array of "
                f"{self.count} elements, got "
                f"{getattr(buf, 'dtype', type(buf).__name__)} {getattr(buf, 'shape', '')}")
        if writable and not buf.flags.writeable:
            raise ValueError(f"{name}: the buffer is read-only")

    def pack(self, buf: np.ndarray | None = None, scale: float | None = None) -> np.ndarray:
        """Copy every array into ``buf`` (a new buffer if None), times ``scale`` if given."""
        if buf is None:
            buf = self.empty()
        else:
            self._check_buffer(buf, "pack", writable=True)
        if self.count == 0:
            return buf
        if scale is None or scale == 1:
            _pack_kernel(buf.view(np.uint8), self._addrs, self._nbytes, self._byte_offsets)
        elif self.dtype.kind in _SCALED_KINDS and not is_half(self.dtype):
            _pack_scaled_kernel(buf, self._addrs, self.counts, self.offsets,
                                buf.dtype.type(scale))
        elif is_half(self.dtype):
            # 16-bit floats: copy, then one scaling pass in float32 (rounded once).
            _pack_kernel(buf.view(np.uint8), self._addrs, self._nbytes, self._byte_offsets)
            scale_into(buf, 1 / scale)
        else:
            raise TypeError(f"pack: cannot scale {dtype_name(self.dtype)} arrays")
        return buf

    def unpack(self, buf: np.ndarray) -> None:
        """Copy ``buf`` back into the arrays."""
        self._check_buffer(buf, "unpack", writable=False)
        if self.count:
            _unpack_kernel(buf.view(np.uint8), self._addrs, self._nbytes, self._byte_offsets)

    def views(self, buf: np.ndarray) -> list[np.ndarray]:
        """Each array's place in ``buf``, as a view with the array's shape."""
        return [buf[o:o + n].reshape(a.shape)
                for a, o, n in zip(self.arrays, self.offsets.tolist(), self.counts.tolist())]
