"""Shared arrays at module level: ``empty_shared`` and ``zeros_shared``.

::

    x = nc.empty_shared((1 << 20,), np.float32)   # every rank of the group, together
    x[...] = local_values()
    nc.all_reduce(x)                               # reads the peers' x where they lie

The array lives in memory every rank of the group maps
(:mod:`numcoll.memory.shared`); collectives on shared arrays of the group
read the other ranks' arrays in place (:mod:`numcoll.collectives.shared_arrays`).
"""

from __future__ import annotations

import numpy as np

from ..memory import shared
from .world import _resolve

__all__ = ["empty_shared", "zeros_shared"]


def empty_shared(shape, dtype, group=None) -> np.ndarray | None:
    """A new array of ``shape`` and ``dtype`` in memory every rank of ``group``
    (default: the default group) maps.

    Collective: every rank of the group calls it, in the same order, with the
    same shape and dtype (a rank that asks for another size fails naming
    both). Collectives of ``group`` on shared arrays -- ``all_reduce``,
    ``broadcast``, ``reduce``, ``all_gather_into_tensor`` and
    ``reduce_scatter_tensor`` (of a shared input), ``all_to_all_single`` (of
    a shared input) and their persistent forms -- read the other ranks'
    arrays where they lie when every rank passes a shared array of at least
    ``NUMCOLL_SHARED_ARRAYS_MIN_NBYTES`` (results still land in each rank's
    own array). The memory starts zeroed; it is released when the array
    and every view of it are gone and the group is shut down, and nothing
    is left behind after any exit (anonymous memory files). On a group whose
    ranks share no memory (threads over ``inproc``, ``tcp``, ``ipc``) it is
    an ordinary NumPy array. A rank outside ``group`` gets None (and a warning).
    """
    pg = _resolve(group, "empty_shared")
    return None if pg is None else shared.empty(pg.context.shared_memory, pg.rank(), shape,
                                                dtype)


def zeros_shared(shape, dtype, group=None) -> np.ndarray | None:
    """:func:`empty_shared`, zero-filled (as the memory of a new shared array is)."""
    pg = _resolve(group, "zeros_shared")
    return None if pg is None else shared.empty(pg.context.shared_memory, pg.rank(), shape,
                                                dtype, "zeros_shared")
