"""Turning what the caller passed into arrays, and the checks on them.

Buffer checks live here, in one place, with the Gloo backend's wording
(``invalid tensor type``, ``invalid tensor size`` ...) so error messages match
what torch.distributed users know. Every message names the operation.
"""

from __future__ import annotations

import sys
from typing import Sequence

import numpy as np

from ..dtypes import SUPPORTED_DTYPES, bfloat16, dtype_name, is_supported
from .host import HOST
from .overlap import check_no_internal_overlap, check_overlap

__all__ = [
    "as_array",
    "as_array_list",
    "check_same_type_and_size",
    "check_writable",
    "is_device_array",
    "memory_of",
    "uniform_arrays",
]


_SUPPORTED = frozenset(SUPPORTED_DTYPES)


def is_device_array(obj) -> bool:
    """True for CUDA memory: anything with ``__cuda_array_interface__``, and Numba
    device arrays (the CUDA simulator's have no interface, only ``__cuda_ndarray__``)."""
    return hasattr(obj, "__cuda_array_interface__") or bool(getattr(obj, "__cuda_ndarray__",
                                                                    False))


def as_array(obj, op: str) -> np.ndarray:
    """A NumPy view of ``obj`` sharing its memory (results must land in the
    caller's memory, so nothing that would need a copy is accepted)."""
    if isinstance(obj, np.ndarray):
        arr = obj
    elif (torch := sys.modules.get("torch")) is not None and isinstance(obj, torch.Tensor):
        arr = _torch_view(obj, torch, op)
    elif is_device_array(obj):
        from ..cuda.arrays import as_device_array  # lazy: no numba.cuda on import

        return as_device_array(obj, op)
    elif hasattr(obj, "__array_interface__") or hasattr(obj, "__array__") or _has_buffer(obj):
        # torch CPU tensors, memoryviews, bytearrays...: NumPy views them in place.
        arr = np.asarray(obj)
    else:
        raise TypeError(
            f"{op}: invalid tensor type: expected a NumPy array (or an object NumPy can "
            f"view without a copy), got {type(obj).__name__}")
    if not is_supported(arr.dtype):
        raise TypeError(f"{op}: invalid tensor type: dtype {dtype_name(arr.dtype)} is not "
                        "supported")
    return arr


def _torch_view(tensor, torch, op: str):
    """A torch tensor in place, as gloo takes it: ``detach()`` shares the
    storage (so tensors that require grad are used, not refused), and
    bfloat16 — which ``Tensor.numpy()`` refuses — is reinterpreted as int16
    and viewed as ml_dtypes' bfloat16, bit for bit. torch is never imported
    here: a tensor can only exist if the caller imported it."""
    t = tensor.detach()
    if t.device.type != "cpu":
        from ..cuda.arrays import as_device_array

        if t.dtype == torch.bfloat16:
            # torch exports no __cuda_array_interface__ for bfloat16; its int16
            # view (same storage, pointer, shape and strides, and the stream
            # torch exports) is viewed, then reinterpreted, bit for bit.
            return as_device_array(t.view(torch.int16), op, as_dtype=bfloat16)
        return as_device_array(t, op)
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(bfloat16)
    try:
        return t.numpy()
    except (TypeError, RuntimeError) as exc:   # e.g. conjugate views, unsupported dtypes
        raise TypeError(f"{op}: invalid tensor type: {exc}") from None


def _has_buffer(obj) -> bool:
    try:
        memoryview(obj)
    except TypeError:
        return False
    return True


def as_array_list(arrays, op: str, *, allow_single: bool = True) -> list:
    """One array or a sequence of arrays -> list of arrays."""
    if allow_single and not isinstance(arrays, (list, tuple)):
        return [as_array(arrays, op)]
    if not isinstance(arrays, (list, tuple)):
        raise TypeError(f"{op}: expected a list of arrays, got {type(arrays).__name__}")
    return [as_array(a, op) for a in arrays]


def check_same_type_and_size(arrays: Sequence, op: str, like=None) -> None:
    """Gloo's assertTypeAndSizesMatch: every array has ``like``'s (or the
    first's) dtype and shape."""
    if not arrays and like is None:
        return
    ref = like if like is not None else arrays[0]
    for i, a in enumerate(arrays):
        if a.dtype != ref.dtype or _is_dev(a) != _is_dev(ref):
            raise TypeError(
                f"{op}: invalid tensor type at index {i} (expected "
                f"{_describe(ref)}, got {_describe(a)})")
        if a.shape != ref.shape:
            raise ValueError(
                f"{op}: invalid tensor size at index {i} (expected {tuple(ref.shape)}, "
                f"got {tuple(a.shape)})")


def _is_dev(a) -> bool:
    return not isinstance(a, np.ndarray)


def _describe(a) -> str:
    where = "device" if _is_dev(a) else "host"
    return f"{dtype_name(a.dtype)} on the {where}"


def check_writable(arrays: Sequence, op: str, what: str = "output") -> None:
    """Arrays a call writes: writable, and none overlapping itself (torch's
    words; see :mod:`.overlap`, which also rules on arrays that overlap each other)."""
    for i, a in enumerate(arrays):
        if isinstance(a, np.ndarray):
            flags = a.flags
            if not flags.writeable:
                raise ValueError(f"{op}: {what} array at index {i} is read-only")
            if flags.c_contiguous:
                continue  # the usual case: no element can meet another
        elif getattr(a, "_numcoll_readonly", False):   # set by cuda.arrays.as_device_array
            raise ValueError(f"{op}: {what} array at index {i} is read-only (its "
                             "__cuda_array_interface__ says so)")
        check_no_internal_overlap(a, op, f"{what} array at index {i}")


def memory_of(op: str, *array_lists):
    """Where the arrays (already converted by :func:`as_array`) live: the host
    memory :data:`numcoll.memory.host.HOST`, or a new
    :class:`numcoll.cuda.memory.DeviceArrays` for CUDA arrays (imported then,
    so that ``import numcoll`` never loads numba.cuda); ``TypeError`` for a mix."""
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


def uniform_arrays(arrays, op: str, *, writable: bool = True, nonempty: bool = True):
    """The checks of a call on one list of alike arrays (allreduce, broadcast):
    ``arrays`` (one array or a list) converted, non-empty (Gloo's
    ``requires non-empty tensor list``), every one of the first's dtype and
    shape, writable. Returns ``(list of arrays, their memory)``. One function,
    so the busiest calls pay one call for all of it.

    Every array receives the same result, so one passed twice is allowed;
    arrays that partly overlap are refused (:mod:`.overlap`)."""
    if type(arrays) is list and len(arrays) == 1 and writable:
        # The busiest case of all (``nc.all_reduce(x)``): one C-contiguous,
        # writable NumPy array of a supported dtype needs no further check.
        a = arrays[0]
        if type(a) is np.ndarray and a.dtype in _SUPPORTED:
            flags = a.flags
            if flags.c_contiguous and flags.writeable:
                return arrays, HOST
    if isinstance(arrays, np.ndarray):
        arrays = [arrays]
    elif not isinstance(arrays, (list, tuple)):
        arrays = [as_array(arrays, op)]
    if type(arrays) is not list or not all(type(a) is np.ndarray and a.dtype in _SUPPORTED
                                           for a in arrays):
        arrays = [as_array(a, op) for a in arrays]
    if not arrays:
        if nonempty:
            raise ValueError(f"{op}: requires non-empty tensor list")
        return arrays, HOST
    xp = memory_of(op, arrays) if type(arrays[0]) is not np.ndarray or len(arrays) > 1 else HOST
    check_same_type_and_size(arrays, op)
    if writable:
        check_writable(arrays, op)
        if len(arrays) > 1:
            check_overlap(op, arrays, same_result=True)
    return arrays, xp
