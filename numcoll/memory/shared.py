"""Shared arrays: NumPy arrays in memory every rank of a group maps.

``nc.empty_shared(shape, dtype, group)`` allocates, on every rank of the
group together, an array in memory the other ranks map too (the transport's
``shared_memory`` capability: :mod:`transports.shm.shared_arrays`). A
collective on such arrays reads the other ranks' arrays where they lie --
one copy, or none, where the ordinary path copies each rank's data into the
shared arena first (:mod:`numcoll.collectives.shared_arrays`).

This module makes the arrays and finds them again:

- :func:`empty`: the allocation, as an array of the shape and dtype asked
  for (the memory starts zeroed: a new memory file is). When the array --
  and every view of it -- is gone, the rank releases its mappings of the
  other ranks' parts (:func:`weakref.finalize`);
- :func:`locate`: where an array lies in this group's shared memory (its
  allocation and byte offset), or None.

Groups whose ranks share no memory (threads over ``inproc``, ``tcp``,
``ipc``, or ``shm`` without its arena) get ordinary NumPy arrays: the
collectives on them run as on any array.
"""

from __future__ import annotations

import math
import weakref

import numpy as np

from ..dtypes import dtype_name, is_supported
from ..errors import NumcollError

__all__ = ["empty", "locate"]


def empty(memory, rank: int, shape, dtype, op_name: str = "empty_shared") -> np.ndarray:
    """A new array of ``shape`` and ``dtype`` in ``memory`` (the group's
    ``shared_memory`` capability; None: an ordinary zeroed array). Collective:
    every rank of the group calls it, in the same order, with the same shape
    and dtype. The memory starts zeroed."""
    shape = _shape(shape, op_name)
    dtype = np.dtype(dtype)
    if not is_supported(dtype):
        raise TypeError(f"{op_name}: invalid tensor type: dtype {dtype_name(dtype)} is not "
                        "supported")
    if memory is None:
        return np.zeros(shape, dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    try:
        allocation = memory.allocate(nbytes)
    except (TypeError, ValueError):
        raise
    except Exception as exc:  # the transport's errors: named here, once
        raise NumcollError(f"{op_name} on rank {rank}: {exc}") from exc
    # Every view of the array (NumPy collapses chains of views) refers to
    # ``owner``: once it is gone, so is every view, and the rank releases its
    # mappings of the other ranks' parts.
    owner = allocation.take()
    weakref.finalize(owner, memory.release, allocation.key)
    return owner[:nbytes].view(dtype).reshape(shape)


def locate(memory, array: np.ndarray) -> tuple[int, int] | None:
    """``(allocation key, byte offset)`` of a C-contiguous ``array`` lying in
    this rank's part of ``memory``'s allocations, or None."""
    if not array.flags.c_contiguous:
        return None
    return memory.find(array.__array_interface__["data"][0], array.nbytes)


def _shape(shape, op_name: str) -> tuple[int, ...]:
    if isinstance(shape, (int, np.integer)):
        shape = (shape,)
    try:
        shape = tuple(int(n) for n in shape)
    except TypeError:
        raise TypeError(f"{op_name}: shape must be an int or a sequence of ints, got "
                        f"{type(shape).__name__}") from None
    if any(n < 0 for n in shape):
        raise ValueError(f"{op_name}: negative dimensions are not allowed: {shape}")
    return shape
