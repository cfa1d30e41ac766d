"""Allreduce by single-copy reads: a reduce-scatter, then an allgather, each
reading the peers' buffers where they lie (:mod:`.single_copy`).

The arena's allreduce (``shared_split``) copies every byte into a slot and
out of the writer's slot again; with the VM's cores apart (a cache line's
round trip 0.15-0.2 µs instead of 0.03-0.07) those copies of lines another
core has just written fall to a few GB/s, and its 16 MiB allreduce on 2
ranks took 1.4x Open MPI's time (4.1 ms against 2.9). Here every byte a rank
needs is read once from where the peer keeps it, with ``process_vm_readv``,
as Open MPI reads its peers with CMA.
"""

from __future__ import annotations

import numpy as np

from .partition import chunk_bounds, segments
from .shared import allgather_shared, allreduce_shared_split
from .shared_alltoall import alltoall_shared
from .single_copy import READ, Parts, _arena, allgather_parts, checked, exchange

__all__ = ["allreduce_cma", "allreduce_cma_measured"]

#: Bytes of a piece: the peers' piece is read into scratch and reduced into
#: this rank's chunk at once, while it is still in the cache (2 ranks, 8 MiB
#: of a peer read and reduced: 1.5-1.7 ms whole, 1.0-1.4 ms in 512 KiB
#: pieces; a NumPy ``a += b`` of 8 MiB took 733 us here, of 512 KiB 21 us).
_PIECE_NBYTES = 512 << 10
#: The scratch the peers' pieces are read into, kept with the group (in the
#: dict the single-copy algorithms keep there) and grown to the largest call's
#: need: fresh pages each call would cost a page fault a page inside the copy.
_SCRATCH = "allreduce_cma scratch"


def allreduce_cma(comm, buf, segment_count: int | None = None, measured: bool = False) -> None:
    """Allreduce by single-copy reads: ``buf`` is cut into P chunks, rank r
    owns chunk r.

    1. Reduce-scatter: rank r publishes its chunks q != r and reads chunk r
       of every peer, a piece at a time, into scratch, reducing each piece
       into its own chunk r at once (its own part first, then the peers' in
       rank order), while the piece is still in the cache; it writes only
       its chunk r, which no peer reads. Each chunk is reduced by its owner
       alone, so every rank ends with the same bits. A plain sum (the
       buffer's ``plain_sum``) reads and adds every piece in one compiled
       call (:meth:`numcoll.comm.Comm.read_sum_peers`); other reductions go
       piece by piece from here.
    2. Allgather: rank r publishes its reduced chunk r and reads every peer's
       reduced chunk q into its chunk q (:func:`.single_copy.allgather_cma`'s
       phases): its chunks q != r are no longer read by anyone once the
       first *done* step is complete.

    Where rank 0 says the arena (``measured``) the buffers are intact and
    the arena's ``shared_split`` runs the whole call. Where a read of step 1
    is refused, every rank's chunks but its own are intact and its own is
    reduced up to a piece: an arena all-to-all brings each rank the rest of
    its chunk r from every peer, it reduces what it had not, and the arena's
    allgather ends the call; where one of step 2 is refused, the arena's
    allgather finishes it from the reduced chunks.
    Cost: four synchronisations; each rank reads 2 (P-1)/P S once and
    reduces (P-1)/P S (``shared_split``: copies (P-1)/P S in, S/P into its
    slot and (P-1)/P S out). Source: Open MPI's vader BTL with CMA under a
    reduce-scatter/allgather allreduce (Rabenseifner's).
    """
    size, rank, itemsize = comm.size, comm.rank, buf.itemsize
    if size == 1 or buf.count == 0:
        return
    chunks = chunk_bounds(buf.count, size)
    first, n = chunks[rank]
    others = [q for q in range(size) if q != rank]  # (rank order: the reduction's)
    piece = max(1, min(n, _PIECE_NBYTES // itemsize))
    scratch = _scratch(comm, (size - 1) * piece * itemsize).view(buf.dtype)
    slots = [scratch[k * piece:(k + 1) * piece] for k in range(size - 1)]
    reduced = [0]  # elements of chunk r reduced so far
    summed = getattr(buf, "plain_sum", False)
    mine = buf.recv_view(first, n) if summed else None
    summed = summed and mine.flags.aligned

    def read_and_reduce(tables) -> str | None:
        at = [checked(comm, READ, q, tables[q][rank], n * itemsize) for q in others]
        if summed:
            # A sum's pieces in one compiled call: Python run between the reads
            # evicts the lines they bring (2 ranks, forced cma, alternated in
            # one launch: 4 MiB 1058-1412 -> 906-917 us a call, 16 MiB
            # 5.3-7.1 -> 4.3-5.3 ms). What it could not read is read below,
            # which says why.
            reduced[0] = comm.read_sum_peers(np.array(others, np.int64), np.array(at, np.int64),
                                             mine, scratch, piece, 0)
        for start, m in segments(first + reduced[0], n - reduced[0], piece):
            offset = (start - first) * itemsize
            for q, address, slot in zip(others, at, slots):
                refused = comm.read_peer(q, address + offset, slot[:m].view(np.uint8))
                if refused is not None:
                    return refused
            for slot in slots:
                buf.reduce_from(start, m, slot[:m])
            reduced[0] = start - first + m
        return None

    def finish_refused(comm) -> None:
        raw = _Scratch(np.empty(size * n, buf.dtype))
        alltoall_shared(comm, buf, chunks, raw, [(q * n, n) for q in range(size)],
                        segment_count)
        done = reduced[0]
        for q in others:
            buf.reduce_from(first + done, n - done, raw.array[q * n + done:(q + 1) * n])
        allgather_shared(comm, buf, chunks, segment_count)

    reduce_scatter = Parts(
        [buf.send_view(*chunk) if q != rank else None for q, chunk in enumerate(chunks)], [],
        _arena(allreduce_shared_split, buf, segment_count), [], "shared_split", finish_refused)
    exchange(comm, reduce_scatter, measured,
             then=lambda: exchange(comm, allgather_parts(rank, size, buf, chunks, segment_count)),
             copier=read_and_reduce)


def allreduce_cma_measured(comm, buf, segment_count: int | None = None) -> None:
    """:func:`allreduce_cma`, or the arena's ``shared_split`` where rank 0
    measured it faster."""
    allreduce_cma(comm, buf, segment_count, measured=True)


class _Scratch:
    """A flat NumPy array of scratch as a work buffer that peers' chunks are
    read into (the host's: nothing to do once they arrived)."""

    __slots__ = ("array", "count", "itemsize")

    def __init__(self, array: np.ndarray):
        self.array, self.count, self.itemsize = array, array.size, array.itemsize

    def recv_view(self, start: int, count: int) -> np.ndarray:
        return self.array[start:start + count]

    def recv_done(self, start: int, count: int) -> None:
        """The bytes have arrived (nothing to do on the host)."""


def _scratch(comm, nbytes: int) -> np.ndarray:
    """``nbytes`` of this group's scratch (kept, grown to whole pages)."""
    kept = comm.single_copy_tuning()
    scratch = kept.get(_SCRATCH)
    if scratch is None or scratch.nbytes < nbytes:
        scratch = kept[_SCRATCH] = np.empty(-(-nbytes // 4096) * 4096, np.uint8)
    return scratch[:nbytes]
