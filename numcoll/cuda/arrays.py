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

from ..dtypes import dtype_name, is_supported

__all__ = ["as_device_array"]


def as_device_array(obj, op: str, as_dtype=None):
    """A Numba device-array view of ``obj`` (a CUDA array), never a copy.

    ``as_dtype``: reinterpret the memory as this dtype of the same item size
    (a torch bfloat16 tensor arrives as its int16 view: torch exports no
    interface for bfloat16).

    Raises ``TypeError`` ("invalid tensor type") when numba.cuda is missing or
    the dtype is not one numcoll supports. An array whose interface says it
    is read-only is marked so that :func:`numcoll.memory.arrays.check_writable`
    refuses it as an output.
    """
    try:
        from . import device
    except ImportError as exc:
        raise TypeError(f"{op}: invalid tensor type: {type(obj).__name__} is a CUDA array "
                        f"but numba.cuda cannot be imported ({exc.__cause__ or exc}); install "
                        "numba-cuda") from None
    dev = device.view(obj)
    if dev is None:
        raise TypeError(f"{op}: invalid tensor type: {type(obj).__name__} is not a CUDA array")
    if as_dtype is not None:
        dev = dev.view(as_dtype)
    if not is_supported(dev.dtype):
        raise TypeError(f"{op}: invalid tensor type: dtype {dtype_name(dev.dtype)} is not "
                        "supported")
    if device.is_read_only(obj):
        try:
            dev._numcoll_readonly = True
        except AttributeError:  # pragma: no cover - a device array without __dict__
            pass
    return dev
