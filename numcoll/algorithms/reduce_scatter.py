"""Reduce-scatter: rank ``r`` ends with the reduction of every rank's chunk ``r``."""

from __future__ import annotations

from .ring import run_ring

__all__ = ["reduce_scatter_ring"]


def reduce_scatter_ring(comm, buf, chunks, segment_count: int) -> None:
    """The reduce-scatter half of the ring allreduce, segment-pipelined.

    ``chunks[c]`` is the (start, count) in ``buf`` of rank ``c``'s share (sizes
    may differ per rank); afterwards ``buf``'s chunk ``comm.rank`` is reduced.
    Cost: P-1 steps; each rank sends and receives S (P-1)/P bytes, where S is
    the whole input. (Gloo instead runs one allreduce of all of S and keeps a
    slice: twice the bytes.)
    Source: Patarasuk & Yuan (JPDC 2009).
    """
    run_ring(comm, buf, chunks, segment_count, 0, comm.size - 1)
