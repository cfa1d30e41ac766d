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

from .shared import allreduce_shared_split
from .single_copy import READ, Parts, _arena, _peers, allgather_parts, exchange

__all__ = ["allreduce_cma", "allreduce_cma_measured"]

#: The scratch the peers' chunks are read into, kept with the group (in the
#: dict the single-copy algorithms keep there) and grown to the largest call's
#: need: fresh pages each call would cost a page fault a page inside the copy.
_SCRATCH = "allreduce_cma scratch"


def allreduce_cma(comm, buf, segment_count: int | None = None, measured: bool = False) -> None:
    """Allreduce by single-copy reads: ``buf`` is cut into P chunks, rank r
    owns chunk r.

    1. Reduce-scatter: rank r publishes its chunks q != r and reads chunk r
       of every peer into scratch (writing nothing a peer reads); after the
       *done* step it reduces them into its own chunk r (its own part first,
       then the peers' in rank order). Each chunk is reduced by its owner
       alone, so every rank ends with the same bits.
    2. Allgather: rank r publishes its reduced chunk r and reads every peer's
       reduced chunk q into its chunk q (:func:`.single_copy.allgather_cma`'s
       phases): its chunks q != r are no longer read by anyone once the
       first *done* step is complete.

    Where a copy of step 1 is refused (or, ``measured``, rank 0 said the
    arena), the buffers are intact and the arena's ``shared_split`` runs the
    whole call instead; where one of step 2 is refused, the arena's
    allgather finishes it from the reduced chunks.
    Cost: four synchronisations; each rank reads 2 (P-1)/P S once and
    reduces (P-1)/P S (``shared_split``: copies (P-1)/P S in, S/P into its
    slot and (P-1)/P S out). Source: Open MPI's vader BTL with CMA under a
    reduce-scatter/allgather allreduce (Rabenseifner's).
    """
    size, rank = comm.size, comm.rank
    if size == 1 or buf.count == 0:
        return
    chunks = _chunks(buf.count, size)
    first, n = chunks[rank]
    scratch = _scratch(comm, (size - 1) * n * buf.itemsize).view(buf.dtype)
    peers = _peers(rank, size)
    parts = [_Scratch(scratch[k * n:(k + 1) * n]) for k in range(size - 1)]
    reduce_scatter = Parts(
        [buf.send_view(*chunk) if q != rank else None for q, chunk in enumerate(chunks)],
        [(READ, q, rank, part, 0, n) for q, part in zip(peers, parts)],
        _arena(allreduce_shared_split, buf, segment_count), [], "shared_split")
    by_rank = sorted(zip(peers, parts), key=lambda pair: pair[0])

    def reduce_and_gather():
        for _, part in by_rank:
            buf.reduce_from(first, n, part.array)
        exchange(comm, allgather_parts(rank, size, buf, chunks, segment_count))

    exchange(comm, reduce_scatter, measured, then=reduce_and_gather)


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


def _chunks(count: int, size: int) -> list[tuple[int, int]]:
    """``count`` elements as ``size`` chunks ``(first, n)``, back to back,
    the first ``count % size`` one element longer."""
    base, extra = divmod(count, size)
    chunks, first = [], 0
    for q in range(size):
        n = base + (q < extra)
        chunks.append((first, n))
        first += n
    return chunks


def _scratch(comm, nbytes: int) -> np.ndarray:
    """``nbytes`` of this group's scratch (kept, grown to whole pages)."""
    kept = comm.single_copy_tuning()
    scratch = kept.get(_SCRATCH)
    if scratch is None or scratch.nbytes < nbytes:
        scratch = kept[_SCRATCH] = np.empty(-(-nbytes // 4096) * 4096, np.uint8)
    return scratch[:nbytes]
