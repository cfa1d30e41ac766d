"""Broadcast: every rank ends with the root's buffer."""

from __future__ import annotations

from .partition import segments

__all__ = ["broadcast_binomial", "broadcast_chain"]


def broadcast_binomial(comm, buf, root: int, segment_count: int | None = None) -> None:
    """Binomial tree: in round k, every rank that has the data sends it to the
    rank 2**k further along (ranks relative to the root).

    Cost: ceil(log2 P) steps of S bytes — latency optimal, for small messages.
    Source: the MPICH binomial broadcast (Thakur, Rabenseifner & Gropp, 2005).
    """
    size = comm.size
    if size == 1:
        return
    vrank = (comm.rank - root) % size
    whole = (0, buf.count)
    mask = 1
    while mask < size:
        if vrank & mask:
            parent = (vrank - mask + root) % size
            comm.wait(comm.irecv(parent, 0, buf.recv_view(*whole)))
            buf.recv_done(*whole)
            break
        mask <<= 1
    sends = []
    mask >>= 1
    while mask > 0:
        if vrank + mask < size:
            child = (vrank + mask + root) % size
            sends.append(comm.isend(child, 0, buf.send_view(*whole)))
        mask >>= 1
    comm.wait_all(sends)


def broadcast_chain(comm, buf, root: int, segment_count: int) -> None:
    """Pipelined chain root -> root+1 -> ... -> root-1: each rank forwards a
    segment as soon as it has it.

    Cost: P-1 + S/s - 1 steps of a segment s; every link carries S bytes once,
    so time tends to S / bandwidth for large S (busbw = algbw).
    Source: the pipelined broadcast of Gloo's ``broadcast_one_to_all`` family /
    MPI "pipelined chain" (Träff & Ripke, 2008).
    """
    size = comm.size
    if size == 1:
        return
    vrank = (comm.rank - root) % size
    prev, nxt = (comm.rank - 1) % size, (comm.rank + 1) % size
    pieces = segments(0, buf.count, segment_count)
    forwards = vrank < size - 1
    sends = []
    if vrank == 0:
        sends = [comm.isend(nxt, 0, buf.send_view(s, n)) for s, n in pieces]
    else:
        # Post every receive up front so each segment lands in place.
        receives = [comm.irecv(prev, 0, buf.recv_view(s, n)) for s, n in pieces]
        for (start, count), pending in zip(pieces, receives):
            comm.wait(pending)
            buf.recv_done(start, count)
            if forwards:
                sends.append(comm.isend(nxt, 0, buf.send_view(start, count)))
    comm.wait_all(sends)
