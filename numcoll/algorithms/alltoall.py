"""All-to-all: rank r's block for rank q ends up as rank q's block from rank r."""

from __future__ import annotations

from .partition import segments

__all__ = ["alltoall_pairwise"]


def alltoall_pairwise(comm, send_buf, send_chunks, recv_buf, recv_chunks,
                      segment_count: int) -> None:
    """Pairwise exchange: at step s rank r sends to r+s and receives from r-s.

    Every receive is posted first, straight into its place in ``recv_buf``, so
    the order in which blocks arrive does not matter; the sends then go out in
    pairwise order, which spreads the load over the links.
    Cost: P-1 steps; each rank sends and receives S (P-1)/P bytes.
    Source: the pairwise-exchange alltoall of Thakur, Rabenseifner & Gropp (2005).
    """
    size, rank = comm.size, comm.rank
    receives = []
    for step in range(1, size):
        src = (rank - step) % size
        receives += [(s, n, comm.irecv(src, 0, recv_buf.recv_view(s, n)))
                     for s, n in segments(*recv_chunks[src], segment_count)]
    sends = []
    for step in range(1, size):
        dst = (rank + step) % size
        sends += [comm.isend(dst, 0, send_buf.send_view(s, n))
                  for s, n in segments(*send_chunks[dst], segment_count)]
    for start, count, pending in receives:
        comm.wait(pending)
        recv_buf.recv_done(start, count)
    comm.wait_all(sends)
