"""Gather and scatter: the root receives from, or sends to, every rank directly."""

from __future__ import annotations

from .partition import segments

__all__ = ["gather_direct", "scatter_direct"]


def gather_direct(comm, send_buf, recv_bufs, root: int, segment_count: int) -> None:
    """Every rank sends ``send_buf`` to the root, which receives rank q's
    straight into ``recv_bufs[q]`` (its own is copied by the caller).

    Cost: 1 step; the root receives S (P-1)/P bytes. Linear in P at the root,
    like Gloo's gather.
    """
    if comm.rank == root:
        receives = []
        for peer in range(comm.size):
            if peer != root:
                rb = recv_bufs[peer]
                receives += [(rb, s, n, comm.irecv(peer, 0, rb.recv_view(s, n)))
                             for s, n in segments(0, rb.count, segment_count)]
        for rb, start, count, pending in receives:
            comm.wait(pending)
            rb.recv_done(start, count)
    else:
        comm.wait_all([comm.isend(root, 0, send_buf.send_view(s, n))
                       for s, n in segments(0, send_buf.count, segment_count)])


def scatter_direct(comm, send_bufs, recv_buf, root: int, segment_count: int) -> None:
    """The root sends ``send_bufs[q]`` to rank q, which receives it straight
    into ``recv_buf`` (the root's own is copied by the caller).

    Cost: 1 step; the root sends S (P-1)/P bytes.
    """
    if comm.rank == root:
        sends = []
        for peer in range(comm.size):
            if peer != root:
                sb = send_bufs[peer]
                sends += [comm.isend(peer, 0, sb.send_view(s, n))
                          for s, n in segments(0, sb.count, segment_count)]
        comm.wait_all(sends)
    else:
        pieces = segments(0, recv_buf.count, segment_count)
        receives = [comm.irecv(root, 0, recv_buf.recv_view(s, n)) for s, n in pieces]
        for (start, count), pending in zip(pieces, receives):
            comm.wait(pending)
            recv_buf.recv_done(start, count)
