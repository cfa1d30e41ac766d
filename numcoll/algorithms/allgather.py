"""Allgather: every rank ends with every rank's chunk."""

from __future__ import annotations

from .ring import run_ring

__all__ = ["allgather_ring"]


def allgather_ring(comm, buf, chunks, segment_count: int) -> None:
    """Ring allgather, segment-pipelined; ``buf``'s chunk ``comm.rank`` holds
    this rank's input on entry, every chunk on exit. Chunks may differ in size.

    Cost: P-1 steps; each rank sends and receives S (P-1)/P bytes (S = output).
    Source: the allgather phase of Patarasuk & Yuan (JPDC 2009).
    """
    run_ring(comm, buf, chunks, segment_count, comm.size - 1, 2 * (comm.size - 1))
