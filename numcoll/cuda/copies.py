"""Staging between host and device: pinned host buffers and asynchronous copies.

Device-array collectives move data through host memory; these helpers give
them page-locked buffers and byte-exact copies on a stream. Like every CUDA
module of numcoll, import it lazily (it loads ``numba.cuda``); the functions
are re-exported by :mod:`.cuda`.
"""

from __future__ import annotations

import warnings

import numpy as np

from .device import _SIMULATED, _as_device, _flat, _pinned_array, _reason, _to_device

__all__ = ["pinned_empty", "to_device", "to_device_async", "to_host", "to_host_async"]

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


def _bits_dtype(dtype: np.dtype) -> np.dtype | None:
    """The unsigned integer dtype a host array of ``dtype`` is copied as, or
    None when it can be copied as it is. Copies go through the buffer
    protocol, which has no format for ml_dtypes' bfloat16 (NumPy: "cannot
    include dtype 'E' in a buffer"), so such arrays move as their bits."""
    try:
        memoryview(np.empty(0, dtype))
    except (ValueError, TypeError):
        return np.dtype(f"u{dtype.itemsize}")
    return None


def to_device(host, stream=0):
    """A new device array holding a copy of the host array ``host``, of any supported dtype.

    ``numba.cuda.to_device`` for every dtype numcoll reduces, bfloat16
    included: Numba copies through the buffer protocol, which refuses
    ml_dtypes' bfloat16, so this copies its 16-bit patterns and returns a
    device array of dtype bfloat16 viewing them (no conversion, no second copy).

    Parameters
    ----------
    host : numpy.ndarray
        Any layout (a non-contiguous array is copied to a contiguous one first).
    stream : numba.cuda stream or 0
        The stream to copy on (0: synchronous).

    Returns
    -------
    numba.cuda DeviceNDArray
        Same shape and dtype as ``host``.

    Examples
    --------
    >>> import numpy as np, numcoll as nc                      # doctest: +SKIP
    >>> d = nc.cuda.to_device(np.ones(4, nc.bfloat16))           # doctest: +SKIP
    >>> nc.cuda.to_host(d)                                       # doctest: +SKIP
    array([1, 1, 1, 1], dtype=bfloat16)
    """
    host = np.ascontiguousarray(host)       # Numba copies one contiguous region
    bits = _bits_dtype(host.dtype)
    if bits is None:
        return _to_device(host, stream=stream)
    return _to_device(host.view(bits), stream=stream).view(host.dtype)


def to_host(dev, stream=0) -> np.ndarray:
    """A new host array holding a copy of the device array ``dev`` (bfloat16 included).

    Parameters
    ----------
    dev : device array
        A Numba device array or anything with ``__cuda_array_interface__``.
    stream : numba.cuda stream or 0
        The stream to copy on; the copy is complete when this returns only
        for stream 0 (otherwise synchronise the stream first).

    Returns
    -------
    numpy.ndarray
        Same shape and dtype as ``dev``.
    """
    dev = _as_device("to_host", "dev", dev)
    bits = _bits_dtype(dev.dtype)
    if bits is None:
        return dev.copy_to_host(stream=stream)
    return dev.view(bits).copy_to_host(stream=stream).view(dev.dtype)
