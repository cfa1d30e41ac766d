"""CUDA arrays as collectives see them: Numba device-array views of what the caller passed.

Anything with ``__cuda_array_interface__`` (Numba device arrays, CuPy, torch
CUDA tensors) is viewed, without a copy, as a Numba ``DeviceNDArray``; the
collectives then work on that view, so results land in the caller's memory.
Converting a foreign array synchronises the stream its producer exported in
the interface (version 3's ``stream`` key; Numba does this by default), on the
caller's thread at the call: see :mod:`numcoll.cuda` for the whole stream contract.

numba.cuda is imported on the first conversion, never when this module is
imported, so ``import numcoll`` stays fast on machines without CUDA.
"""

from __future__ import annotations

import numpy as np

from .dtypes import dtype_name, is_supported

__all__ = ["as_device_array", "is_device"]


def is_device(obj) -> bool:
    """True for CUDA memory: an object with ``__cuda_array_interface__`` or a
    Numba device array (the simulator's have only the latter)."""
    if isinstance(obj, np.ndarray):
        return False
    return hasattr(obj, "__cuda_array_interface__") or bool(getattr(obj, "__cuda_ndarray__", False))


def as_device_array(obj, op: str):
    """A Numba device-array view of ``obj`` (a CUDA array), never a copy.

    Raises ``TypeError`` ("invalid tensor type") when numba.cuda is missing or
    the dtype is not one numcoll supports. An array whose interface says it
    is read-only is marked so that :func:`numcoll.arrays.check_writable`
    refuses it as an output.
    """
    try:
        from numba import cuda
    except Exception as exc:  # noqa: BLE001 - depends on the installation
        raise TypeError(f"{op}: invalid tensor type: {type(obj).__name__} is a CUDA array "
                        f"but numba.cuda cannot be imported ({exc}); install numba-cuda") from None
    desc = getattr(obj, "__cuda_array_interface__", None)
    if getattr(obj, "__cuda_ndarray__", False):
        dev = obj                                   # Numba's own (or the simulator's)
    elif desc is None:
        raise TypeError(f"{op}: invalid tensor type: {type(obj).__name__} is not a CUDA array")
    elif hasattr(cuda, "as_cuda_array"):
        # Synchronises the stream the producer exported (CUDA array interface v3).
        dev = cuda.as_cuda_array(obj)
    else:
        dev = _simulated_foreign(obj, desc)
    if not is_supported(dev.dtype):
        raise TypeError(f"{op}: invalid tensor type: dtype {dtype_name(dev.dtype)} is not "
                        "supported")
    if desc is not None and desc["data"][1]:
        try:
            dev._numcoll_readonly = True
        except AttributeError:  # pragma: no cover - a device array without __dict__
            pass
    return dev


def _simulated_foreign(obj, desc):
    """Under Numba's CUDA simulator "device" memory is host memory, so a foreign
    interface can only point at host memory: wrap it as a simulated device array."""
    from numba.cuda.cudadrv.devicearray import FakeCUDAArray

    from .kernels.cuda_device import _SimulatedForeign

    return FakeCUDAArray(np.asarray(_SimulatedForeign(obj, desc)))
