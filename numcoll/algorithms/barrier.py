"""Barriers."""

from __future__ import annotations

__all__ = ["barrier_dissemination"]

_EMPTY = b""


def barrier_dissemination(comm) -> None:
    """Dissemination barrier: in round k rank r signals r + 2**k and waits for
    r - 2**k. After ceil(log2 P) rounds every rank has heard, transitively,
    from every other, so none leaves before all have arrived.

    Cost: ceil(log2 P) steps of 0-byte messages.
    Source: D. Hensgen, R. Finkel, U. Manber, "Two algorithms for barrier
    synchronization", IJPP 17(1), 1988.
    """
    size, rank = comm.size, comm.rank
    distance, step = 1, 0
    while distance < size:
        comm.sendrecv((rank + distance) % size, (rank - distance) % size, step, _EMPTY)
        distance <<= 1
        step += 1
