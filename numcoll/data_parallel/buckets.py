"""Gradient bucket assignment, as torch's ``dist._compute_bucket_assignment_by_size``."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from ..memory.arrays import as_array

__all__ = ["DEFAULT_FIRST_BUCKET_BYTES", "compute_bucket_assignment_by_size"]

#: The first bucket's cap, torch's ``dist._DEFAULT_FIRST_BUCKET_BYTES`` (1 MiB): a
#: small first bucket starts communication early in the backward pass.
DEFAULT_FIRST_BUCKET_BYTES = 1 << 20


def compute_bucket_assignment_by_size(
        arrays: Sequence, bucket_size_limits: Sequence[int],
        expect_sparse_gradient: Sequence[bool] | None = None,
        tensor_indices: Sequence[int] | None = None) -> tuple[list[list[int]], list[int]]:
    """Group arrays into buckets of one dtype (and memory) each, by byte size.

    The rules are those of torch's ``compute_bucket_assignment_by_size``
    (``reducer.cpp``): arrays are visited in order and appended to the open
    bucket of their dtype; a bucket closes once its bytes reach its limit, and
    that dtype then moves to the next limit in ``bucket_size_limits`` (the last
    one repeats). An array with ``expect_sparse_gradient[index]`` gets a bucket
    of its own with limit 0. Without ``tensor_indices`` array ``i`` has index
    ``i`` and the buckets are sorted by their smallest index; with them, array
    ``i`` has index ``tensor_indices[i]`` (the order gradients became ready)
    and the buckets stay in the order they closed, open ones last.

    Returns
    -------
    (bucket_indices, per_bucket_size_limits)
    """
    name = "compute_bucket_assignment_by_size"
    arrays = list(arrays)
    if not arrays:
        raise ValueError(f"{name}: requires non-empty tensor list")
    limits = [int(x) for x in bucket_size_limits]
    if not limits or any(x < 0 for x in limits):
        raise ValueError(f"{name}: bucket_size_limits must be a non-empty list of byte counts "
                         f">= 0, got {list(bucket_size_limits)}")
    if expect_sparse_gradient is not None and len(expect_sparse_gradient) not in (0, len(arrays)):
        raise ValueError(f"{name}: expect_sparse_gradient has {len(expect_sparse_gradient)} "
                         f"entries for {len(arrays)} arrays")
    if tensor_indices is not None and len(tensor_indices) not in (0, len(arrays)):
        raise ValueError(f"{name}: tensor_indices has {len(tensor_indices)} entries for "
                         f"{len(arrays)} arrays")
    sparse = list(expect_sparse_gradient or [])
    indices = list(tensor_indices or [])

    result: list[tuple[list[int], int]] = []
    open_buckets: dict = {}     # (dtype, memory) -> [indices, nbytes, limit]; insertion order
    limit_pos: dict = {}        # (dtype, memory) -> position in limits
    for i, a in enumerate(arrays):
        index = int(indices[i]) if indices else i
        if sparse and sparse[index]:
            result.append(([index], 0))
            continue
        key, nbytes = _key_and_nbytes(a, name)
        bucket = open_buckets.setdefault(key, [[], 0, 0])
        bucket[0].append(index)
        bucket[1] += nbytes
        pos = limit_pos.setdefault(key, 0)
        bucket[2] = limits[pos]
        if bucket[1] >= bucket[2]:
            result.append((bucket[0], bucket[2]))
            del open_buckets[key]
            limit_pos[key] = min(pos + 1, len(limits) - 1)
    result.extend((b[0], b[2]) for b in open_buckets.values())
    if not indices:
        result.sort(key=lambda r: min(r[0]))
    return [r[0] for r in result], [r[1] for r in result]


def _key_and_nbytes(a, name: str):
    from ..memory.sparse import SparseCOO  # a sparse array is refused, as torch does

    if isinstance(a, SparseCOO):
        raise TypeError(f"{name}: No support for sparse tensors.")
    arr = as_array(a, name)
    where = "host" if isinstance(arr, np.ndarray) else "device"
    return (arr.dtype, where), arr.size * arr.dtype.itemsize
