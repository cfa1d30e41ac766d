"""Staging between host and device: pinned host buffers and asynchronous copies.

Device-array collectives move data through host memory; these helpers give
them page-locked buffers and byte-exact copies on a stream. Like every CUDA
module of numcoll, import it lazily (it loads ``numba.cuda``); the functions
are re-exported by :mod:`.cuda`.
"""

from __future__ import annotations

import warnings

import numpy as np

from .device import _SIMULATED, _as_device, _flat, _pinned_array, _reason

__all__ = ["pinned_empty", "to_device_async", "to_host_async"]

_pinning_warned = False


def pinned_empty(nbytes: int) -> np.ndarray:
    """An uninitialised page-locked (pinned) host buffer of ``nbytes`` bytes (uint8).

    Copies between pinned memory and the device run asynchronously on a
    stream and at full PCIe/NVLink speed; that is what the staging buffers
    of device-array collectives need.

    Where pinning is not possible the buffer is ordinary (pageable) NumPy
    memory, which works the same but makes copies synchronous with the host:
    always under the simulator (its ``pinned_array`` is plain NumPy), and on a
    real GPU when the driver refuses (e.g. the locked-memory limit), with a
    RuntimeWarning the first time.
    """
    nbytes = int(nbytes)
    if nbytes < 0:
        raise ValueError(f"pinned_empty: nbytes must be >= 0, got {nbytes}")
    if nbytes == 0 or _SIMULATED:
        return np.empty(nbytes, np.uint8)
    try:
        return _pinned_array(nbytes, dtype=np.uint8)
    except Exception as exc:  # driver errors, out of lockable memory, no device
        global _pinning_warned
        if not _pinning_warned:
            _pinning_warned = True
            warnings.warn(f"numcoll: cannot pin {nbytes} host bytes ({_reason(exc)}); staging "
                          "through pageable memory (slower, synchronous copies)",
                          RuntimeWarning, stacklevel=2)
        return np.empty(nbytes, np.uint8)


def _byte_views(where: str, dev_view, host_view, host_writable: bool):
    dev = _flat(where, "dev_view", _as_device(where, "dev_view", dev_view,
                                              writable=not host_writable))
    if not isinstance(host_view, np.ndarray):
        raise TypeError(f"{where}: host_view must be a numpy.ndarray, "
                        f"got {type(host_view).__name__}")
    if not host_view.flags.c_contiguous:
        raise ValueError(f"{where}: host_view must be C-contiguous")
    if host_writable and not host_view.flags.writeable:
        raise ValueError(f"{where}: host_view is read-only")
    dev_nbytes = dev.size * dev.dtype.itemsize
    if dev_nbytes != host_view.nbytes:
        raise ValueError(f"{where}: size mismatch: dev_view has {dev_nbytes} bytes, "
                         f"host_view has {host_view.nbytes}")
    # Byte views: the copy then needs no dtype or shape agreement, only the size.
    return dev.view(np.uint8), host_view.reshape(-1).view(np.uint8)


def to_host_async(dev_view, host_view: np.ndarray, stream=0) -> None:
    """Copy a device array into a host array of the same byte size, on ``stream``.

    Asynchronous when ``host_view`` is pinned (see :func:`pinned_empty`) and
    ``stream`` is not 0: synchronise the stream before reading ``host_view``.
    Dtypes may differ (the bytes are copied); both must be C-contiguous.
    """
    dev, host = _byte_views("to_host_async", dev_view, host_view, True)
    if dev.size:
        dev.copy_to_host(host, stream=stream)


def to_device_async(host_view: np.ndarray, dev_view, stream=0) -> None:
    """Copy a host array into a device array of the same byte size, on ``stream``.

    Asynchronous when ``host_view`` is pinned and ``stream`` is not 0: do not
    overwrite ``host_view`` before the stream has passed the copy.
    """
    dev, host = _byte_views("to_device_async", dev_view, host_view, False)
    if dev.size:
        dev.copy_to_device(host, stream=stream)
