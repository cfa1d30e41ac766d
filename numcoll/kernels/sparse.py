"""CPU kernel for sparse arrays: coalescing (sort + segment sum) in one Numba call.

Entries are given as linear indices (``np.ravel_multi_index`` of the sparse
coordinates) and rows of values. A stable sort keeps entries with equal
indices in input order, so the segment sums add them in a fixed order: ranks
that coalesce the same gathered entries get bitwise identical sums.
Private: :mod:`numcoll.memory.sparse` validates and shapes the arrays.
"""

from __future__ import annotations

import numpy as np
from numba import njit

# This kernel allocates its outputs, so it keeps Numba's runtime (no _nrt=False).
_JIT = dict(nogil=True, cache=True)


@njit(**_JIT)
def _coalesce_kernel(keys, values):
    """Unique sorted ``keys`` and, per key, the sum of its rows of ``values`` (2-D)."""
    n = keys.size
    order = np.argsort(keys, kind="mergesort")
    unique = 0
    for i in range(n):
        if i == 0 or keys[order[i]] != keys[order[i - 1]]:
            unique += 1
    out_keys = np.empty(unique, np.int64)
    out_values = np.zeros((unique, values.shape[1]), values.dtype)
    j = -1
    for i in range(n):
        src = order[i]
        if i == 0 or keys[src] != out_keys[j]:
            j += 1
            out_keys[j] = keys[src]
        for c in range(values.shape[1]):
            out_values[j, c] += values[src, c]
    return out_keys, out_values


@njit(**_JIT)
def _scatter_rows_kernel(dense, mask, keys, rows):
    """``dense[keys[i]] = rows[i]`` and ``mask[keys[i]] = 1`` (2-D ``dense`` and ``rows``)."""
    for i in range(keys.size):
        k = keys[i]
        for c in range(rows.shape[1]):
            dense[k, c] = rows[i, c]
        mask[k] = 1


@njit(**_JIT)
def _gather_rows_kernel(dense, keys):
    """The rows ``dense[keys]`` as a new 2-D array."""
    out = np.empty((keys.size, dense.shape[1]), dense.dtype)
    for i in range(keys.size):
        for c in range(dense.shape[1]):
            out[i, c] = dense[keys[i], c]
    return out
