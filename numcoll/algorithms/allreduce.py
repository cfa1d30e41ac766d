"""Allreduce algorithms: every rank ends with the reduction of all ranks' buffers.

Both leave bitwise-identical results on every rank: each element is combined
by exactly one path (ring) or by partners that combine the same two operands
(recursive doubling; ``op(a, b) == op(b, a)`` for the commutative ops).
"""

from __future__ import annotations

from .partition import chunk_bounds
from .ring import run_ring

__all__ = ["allreduce_ring", "allreduce_recursive_doubling"]


def allreduce_ring(comm, buf, segment_count: int) -> None:
    """Ring reduce-scatter followed by ring allgather, segment-pipelined.

    Cost: 2(P-1) steps; each rank sends and receives 2 S (P-1)/P bytes —
    bandwidth optimal. Best for large messages.
    Source: Patarasuk & Yuan (JPDC 2009); the pipelining follows Gloo's
    ``allreduce_ring_chunked``.
    """
    chunks = chunk_bounds(buf.count, comm.size)
    run_ring(comm, buf, chunks, segment_count, 0, 2 * (comm.size - 1))


def allreduce_recursive_doubling(comm, buf, segment_count: int | None = None) -> None:
    """Recursive doubling with the non-power-of-two fold of MPICH.

    With P' the largest power of two <= P and R = P - P': the first 2R ranks
    pair up and the even one hands its buffer to the odd one (1 step), the P'
    remaining ranks exchange whole buffers with partners at distance 1, 2, 4 ...
    (log2 P' steps), then the odd ranks hand the result back (1 step).
    Cost: log2(P') + 2 [R > 0] steps of S bytes each — latency optimal, for
    small messages.
    Source: R. Thakur, R. Rabenseifner, W. Gropp, "Optimization of collective
    communication operations in MPICH", IJHPCA 19(1), 2005.
    """
    size, rank = comm.size, comm.rank
    if size == 1:
        return
    whole = (0, buf.count)
    pof2 = 1 << (size.bit_length() - 1)
    extra = size - pof2
    fold_step, final_step = 0, 1

    if rank < 2 * extra:
        if rank % 2 == 0:
            # Hand the buffer to the odd neighbour, which stands in for both.
            comm.wait(comm.isend(rank + 1, fold_step, buf.send_view(*whole)))
            comm.wait(comm.irecv(rank + 1, final_step, buf.recv_view(*whole)))
            buf.recv_done(*whole)
            return
        buf.reduce_from(*whole, comm.wait(comm.irecv(rank - 1, fold_step)))
        vrank = rank // 2
    else:
        vrank = rank - extra

    mask, step = 1, final_step + 1
    while mask < pof2:
        vpartner = vrank ^ mask
        partner = vpartner * 2 + 1 if vpartner < extra else vpartner + extra
        # sendrecv waits for our send too: the buffer is read by a zero-copy
        # send and must not change under it.
        data = comm.sendrecv(partner, partner, step, buf.send_view(*whole))
        buf.reduce_from(*whole, data)
        mask <<= 1
        step += 1

    if rank < 2 * extra:
        comm.wait(comm.isend(rank - 1, final_step, buf.send_view(*whole)))
