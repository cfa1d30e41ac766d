"""The pipelined ring shared by allreduce, reduce_scatter and allgather.

Ranks form a ring (send right, receive left). At ring step ``t`` rank ``r``
sends chunk ``(r - t - 1) mod P`` and receives chunk ``(r - t - 2) mod P``;
steps ``0 .. P-2`` reduce what arrives (reduce-scatter: afterwards rank ``r``
holds the reduced chunk ``r``), steps ``P-1 .. 2P-3`` store it (allgather: the
reduced chunks travel once around the ring). The chunk received at step ``t``
is the one sent at step ``t+1``, so each segment is forwarded as soon as it is
reduced or stored: one segment is on the wire while the next is reduced.

Reference: P. Patarasuk and X. Yuan, "Bandwidth optimal all-reduce algorithms
for clusters of workstations", JPDC 69(2), 2009.
"""

from __future__ import annotations

from .partition import segments

__all__ = ["run_ring"]


def run_ring(comm, buf, chunks, segment_count: int, first_step: int, end_step: int) -> None:
    """Run ring steps ``first_step .. end_step - 1`` over ``buf``.

    ``chunks[c]`` is the (start, count) of chunk ``c`` (one per rank, sizes may
    differ). Steps below ``P - 1`` reduce, the rest store. Writes into a chunk
    only ever follow, causally, the completion of every send of that chunk (its
    new contents come from a peer that already received the old ones), so
    zero-copy sends straight from ``buf`` are safe.
    """
    size, rank = comm.size, comm.rank
    if size == 1 or first_step >= end_step:
        return
    right, left = (rank + 1) % size, (rank - 1) % size
    reduce_steps = size - 1

    def chunk_sent(t):
        return chunks[(rank - t - 1) % size]

    def chunk_received(t):
        return chunks[(rank - t - 2) % size]

    def post_receives(t):
        # Stores can land straight in the buffer; reductions receive the frame
        # and reduce from it.
        pieces = segments(*chunk_received(t), segment_count)
        if t < reduce_steps:
            return [(s, n, comm.irecv(left, t, None)) for s, n in pieces]
        return [(s, n, comm.irecv(left, t, buf.recv_view(s, n))) for s, n in pieces]

    sends = [comm.isend(right, first_step, buf.send_view(s, n))
             for s, n in segments(*chunk_sent(first_step), segment_count)]
    receives = post_receives(first_step)
    for t in range(first_step, end_step):
        upcoming = post_receives(t + 1) if t + 1 < end_step else []
        for start, count, pending in receives:
            data = comm.wait(pending)
            if t < reduce_steps:
                buf.reduce_from(start, count, data)
            else:
                buf.recv_done(start, count)
            if t + 1 < end_step:
                sends.append(comm.isend(right, t + 1, buf.send_view(start, count)))
        receives = upcoming
    comm.wait_all(sends)
