"""Where a collective's arrays live -- host (NumPy) or device (CUDA) memory --
and the few operations the collectives need on them.

A collective decides once, at the call, with :func:`memory_of`: every array
on the host gives :data:`HOST`, every array on the device a new
:class:`numcoll.cuda.memory.DeviceArrays` (imported then, so that
``import numcoll`` never loads numba.cuda); a mix is refused. Both offer the
same methods, so each collective is written once. The host ones are the
plain NumPy operations the collectives always used.
"""

from __future__ import annotations

import numpy as np

from .buffers import HostBuffer

__all__ = ["HOST", "HostArrays", "memory_of"]


class HostArrays:
    """NumPy memory: flat views, copies and :class:`~numcoll.memory.buffers.HostBuffer`."""

    is_device = False

    @staticmethod
    def contiguous(a) -> bool:
        return a.flags.c_contiguous

    @staticmethod
    def empty(count: int, dtype) -> np.ndarray:
        return np.empty(count, dtype)

    @staticmethod
    def flat(a: np.ndarray, copy_in: bool) -> np.ndarray:
        """``a``'s memory as a flat array, or a flat copy (filled from ``a`` if
        ``copy_in``) when ``a`` is not contiguous."""
        if a.flags.c_contiguous:
            return a.reshape(-1)
        return np.ascontiguousarray(a).reshape(-1) if copy_in else np.empty(a.size, a.dtype)

    @staticmethod
    def overlaps(a: np.ndarray, b: np.ndarray) -> bool:
        return bool(np.may_share_memory(a, b))

    @staticmethod
    def copy(a: np.ndarray) -> np.ndarray:
        return a.copy()

    @staticmethod
    def assign(dst: np.ndarray, src: np.ndarray) -> None:
        np.copyto(dst, src)

    @staticmethod
    def write(out: np.ndarray, flat: np.ndarray) -> None:
        np.copyto(out, flat.reshape(out.shape))

    @staticmethod
    def pack(arrays, buf: np.ndarray) -> None:
        """``arrays`` (one dtype) back to back at the start of ``buf``. A plain
        loop: a :class:`~numcoll.kernels.pack_plan.PackPlan` pays off only when
        reused (building one costs ~12 us for a single array, 37 us for 50 small
        ones, against 0.7 us and 24 us for this loop)."""
        start = 0
        for a in arrays:
            buf[start:start + a.size] = a.reshape(-1) if a.flags.c_contiguous else a.ravel()
            start += a.size

    @staticmethod
    def buffer(flat: np.ndarray, reduce=None) -> HostBuffer:
        return HostBuffer(flat, reduce)

    @staticmethod
    def steps(red):
        """The plan's steps on host memory (:class:`numcoll.memory.reduction.HostSteps`)."""
        return red.host_steps

    @staticmethod
    def wrap(run):
        return run


#: The host memory (stateless, shared).
HOST = HostArrays()


def memory_of(op: str, *array_lists):
    """:data:`HOST`, or a new ``DeviceArrays`` when the arrays (already converted
    by :func:`numcoll.memory.arrays.as_array`) are CUDA arrays; ``TypeError`` for a mix."""
    on_host = on_device = False
    for arrays in array_lists:
        for a in arrays:
            if isinstance(a, np.ndarray):
                on_host = True
            else:
                on_device = True
    if not on_device:
        return HOST
    if on_host:
        raise TypeError(f"{op}: cannot mix host (NumPy) and device (CUDA) arrays in one call")
    from ..cuda.memory import DeviceArrays  # lazy: imports numba.cuda

    return DeviceArrays([a for arrays in array_lists for a in arrays])
