"""Reduce: the root ends with the reduction of every rank's buffer."""

from __future__ import annotations

from .partition import chunk_bounds, segments
from .ring import run_ring

__all__ = ["reduce_binomial", "reduce_ring"]


def reduce_binomial(comm, buf, root: int, segment_count: int | None = None) -> None:
    """Binomial tree towards the root: a rank reduces what its children send,
    then sends its partial result to its parent. Non-root buffers are used as
    scratch.

    Cost: ceil(log2 P) steps of S bytes — for small messages.
    Source: MPICH binomial reduce (Thakur, Rabenseifner & Gropp, 2005).
    """
    size = comm.size
    vrank = (comm.rank - root) % size
    whole = (0, buf.count)
    mask = 1
    while mask < size:
        if vrank & mask:
            parent = (vrank - mask + root) % size
            comm.wait(comm.isend(parent, mask.bit_length(), buf.send_view(*whole)))
            return
        if vrank + mask < size:
            child = (vrank + mask + root) % size
            buf.reduce_from(*whole, comm.wait(comm.irecv(child, mask.bit_length())))
        mask <<= 1


def reduce_ring(comm, buf, root: int, segment_count: int) -> None:
    """Ring reduce-scatter, then every rank sends its reduced chunk to the root
    (Rabenseifner's reduce). Non-root buffers are used as scratch.

    Cost: P-1 ring steps plus one gather step; each rank sends about
    S (P-1)/P + S/P bytes, the root receives S — for large messages.
    Source: R. Rabenseifner, "Optimization of collective reduction operations",
    ICCS 2004.
    """
    size, rank = comm.size, comm.rank
    if size == 1:
        return
    chunks = chunk_bounds(buf.count, size)
    run_ring(comm, buf, chunks, segment_count, 0, size - 1)
    gather_step = size - 1
    if rank == root:
        receives = []
        for peer in range(size):
            if peer != root:
                receives += [(s, n, comm.irecv(peer, gather_step, buf.recv_view(s, n)))
                             for s, n in segments(*chunks[peer], segment_count)]
        for start, count, pending in receives:
            comm.wait(pending)
            buf.recv_done(start, count)
    else:
        comm.wait_all([comm.isend(root, gather_step, buf.send_view(s, n))
                       for s, n in segments(*chunks[rank], segment_count)])
