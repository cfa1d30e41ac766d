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
from .single_copy import READ, Parts, _arena, allgather_parts, checked, exchange, resume

__all__ = ["CmaAllreduce", "allreduce_cma", "allreduce_cma_measured"]

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
    if comm.size == 1 or buf.count == 0:
        return
    CmaAllreduce(comm.rank, comm.size, buf, segment_count,
                 comm.single_copy_tuning()).run(comm, measured)


class CmaAllreduce:
    """Rank ``rank``'s side of :func:`allreduce_cma` over ``buf`` (of
    ``size`` ranks, at least one element): both phases' :class:`Parts`,
    what its reduce-scatter reads and sums, and how far it got -- one source
    for the ordinary path (:meth:`run`) and a repeated call's compiled start
    (:class:`numcoll.fast.sum.FusedAllreduce`), which finishes a start that
    stopped here (:meth:`resume`). ``kept``: the dict the single-copy
    algorithms keep with the group (the scratch lives there)."""

    def __init__(self, rank: int, size: int, buf, segment_count: int | None, kept: dict):
        self.rank, self.size, self.buf = rank, size, buf
        itemsize = buf.itemsize
        self.chunks = chunks = chunk_bounds(buf.count, size)
        self.first, self.n = first, n = chunks[rank]
        self.others = [q for q in range(size) if q != rank]  # (rank order: the reduction's)
        self.piece = piece = max(1, min(n, _PIECE_NBYTES // itemsize))
        self.scratch = scratch = _scratch(kept, (size - 1) * piece * itemsize).view(buf.dtype)
        self.slots = [scratch[k * piece:(k + 1) * piece] for k in range(size - 1)]
        #: Elements of chunk ``rank`` reduced so far (the peers' parts added).
        self.reduced = 0
        summed = getattr(buf, "plain_sum", False)
        self.mine = mine = buf.recv_view(first, n) if summed else None
        #: Whether a plain sum reads and adds in one compiled call (read_sum).
        self.summed = summed and mine.flags.aligned
        self.segment_count = segment_count
        self.reduce_scatter = Parts(
            [buf.send_view(*chunk) if q != rank else None for q, chunk in enumerate(chunks)],
            [], _arena(allreduce_shared_split, buf, segment_count), [], "shared_split",
            self.finish_refused)
        self.allgather = allgather_parts(rank, size, buf, chunks, segment_count)

    def run(self, comm, measured: bool) -> None:
        """The whole call on the ordinary path."""
        exchange(comm, self.reduce_scatter, measured,
                 then=lambda: exchange(comm, self.allgather),
                 copier=lambda tables: self.read_and_reduce(comm, tables))

    def resume(self, comm, phase: int, state: str, step: int, measured: bool) -> None:
        """The rest of a call whose compiled start stopped in ``phase`` (1:
        the reduce-scatter, ``reduced`` elements summed; 2: the allgather) at
        ``state`` (:func:`.single_copy.resume`'s), that phase's *where* at
        ``step``."""
        if phase == 2:  # (``measured``: the flight recorder hears it copied)
            resume(comm, self.allgather, state, step, measured)
        elif resume(comm, self.reduce_scatter, state, step, measured,
                    copier=lambda tables: self.read_and_reduce(comm, tables)):
            exchange(comm, self.allgather)

    def read_and_reduce(self, comm, tables) -> str | None:
        """Read chunk ``rank`` of every peer (``tables``: their *where*s) from
        element ``reduced`` on, a piece at a time, and add it into this
        rank's chunk; a refusal's text, or None."""
        buf, rank, first, n, piece = self.buf, self.rank, self.first, self.n, self.piece
        itemsize, others = buf.itemsize, self.others
        at = [checked(comm, READ, q, tables[q][rank], n * itemsize) for q in others]
        if self.summed:
            # A sum's pieces in one compiled call: Python run between the reads
            # evicts the lines they bring (2 ranks, forced cma, alternated in
            # one launch: 4 MiB 1058-1412 -> 906-917 us a call, 16 MiB
            # 5.3-7.1 -> 4.3-5.3 ms). What it could not read is read below,
            # which says why.
            self.reduced = comm.read_sum_peers(np.array(others, np.int64),
                                               np.array(at, np.int64), self.mine,
                                               self.scratch, piece, self.reduced)
        for start, m in segments(first + self.reduced, n - self.reduced, piece):
            offset = (start - first) * itemsize
            for q, address, slot in zip(others, at, self.slots):
                refused = comm.read_peer(q, address + offset, slot[:m].view(np.uint8))
                if refused is not None:
                    return refused
            for slot in self.slots:
                buf.reduce_from(start, m, slot[:m])
            self.reduced = start - first + m
        return None

    def finish_refused(self, comm) -> None:
        """A read of the reduce-scatter was refused: every rank's chunks but
        its own are intact and its own is reduced up to ``reduced``; an arena
        all-to-all brings the rest of it from every peer, and the arena's
        allgather ends the call."""
        buf, size, first, n = self.buf, self.size, self.first, self.n
        raw = _Scratch(np.empty(size * n, buf.dtype))
        alltoall_shared(comm, buf, self.chunks, raw, [(q * n, n) for q in range(size)],
                        self.segment_count)
        done = self.reduced
        for q in self.others:
            buf.reduce_from(first + done, n - done, raw.array[q * n + done:(q + 1) * n])
        allgather_shared(comm, buf, self.chunks, self.segment_count)


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


def _scratch(kept: dict, nbytes: int) -> np.ndarray:
    """``nbytes`` of this group's scratch (kept in ``kept``, grown to whole pages)."""
    scratch = kept.get(_SCRATCH)
    if scratch is None or scratch.nbytes < nbytes:
        scratch = kept[_SCRATCH] = np.empty(-(-nbytes // 4096) * 4096, np.uint8)
    return scratch[:nbytes]
