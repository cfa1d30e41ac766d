"""Algorithms for shared arrays: every rank reads the others' arrays where they lie.

When every rank's array lies in memory the whole group maps
(:mod:`numcoll.memory.shared`), nothing needs to travel through the arena:
rank ``r`` can read rank ``q``'s array itself (:meth:`numcoll.comm.Comm.shared_array`),
the single-copy paths of MPI's shared-memory transports (CMA, XPMEM). The
arena only synchronises:

1. *where*: every rank publishes where its array lies -- the allocation's
   key, the byte offset and length (and, for alltoall, where its block for
   each rank starts) -- and waits for every rank's: from then on every
   array holds its rank's input;
2. the work: each rank reads what it needs from the others' arrays and
   writes only into its own;
3. *done* (one more step, two for allreduce): every rank has finished
   reading, so each may return and its caller write its array again.

What each rank reads and writes never overlaps what another writes in the
same phase (argued per algorithm), and every element of a result is
computed by exactly one rank and copied by the others, so every rank ends
with bitwise the same result.
"""

from __future__ import annotations

import numpy as np

from .partition import chunk_bounds, segments
from .shared import _copy_in

__all__ = ["allreduce_shared_arrays", "broadcast_shared_arrays", "reduce_shared_arrays",
           "allgather_shared_arrays", "reduce_scatter_shared_arrays",
           "alltoall_shared_arrays", "WHERE_NBYTES"]

#: Marks a published *where* (b"ncshared" as a little-endian word), so that a
#: rank that published anything else is caught.
_MAGIC = int.from_bytes(b"ncshared", "little")
#: A *where*: magic, allocation key, byte offset, byte length (then, for
#: alltoall, a (first element, count) pair per rank).
_WORDS = 4
WHERE_NBYTES = 8 * _WORDS


def _where(comm, where: tuple[int, int], nbytes: int, table=()) -> tuple[list, list]:
    """Step 1: publish where this rank's array lies (``where``: key and byte
    offset; ``nbytes`` long) and ``table``; return every peer's array (uint8,
    None for this rank) and every peer's table, once every rank has published."""
    words = np.empty(_WORDS + len(table), np.int64)
    words[:_WORDS] = (_MAGIC, where[0], where[1], nbytes)
    words[_WORDS:] = table
    published = words.view(np.uint8)
    step = comm.shared_step(published)
    arrays, tables = [None] * comm.size, [None] * comm.size
    for q in range(comm.size):
        if q == comm.rank:
            continue
        theirs = np.frombuffer(comm.shared_view(step, q, 0, published.size), np.int64)
        if theirs[0] != _MAGIC:
            comm.size_mismatch(q, f"rank {q} passed an array that is not a shared array of "
                                  "this group, this rank a shared one")
        arrays[q] = comm.shared_array(q, int(theirs[1]), int(theirs[2]), int(theirs[3]))
        tables[q] = theirs[_WORDS:].copy()
    return arrays, tables


def _part(peer_bytes, start: int, count: int, itemsize: int):
    return peer_bytes[start * itemsize:(start + count) * itemsize]


def allreduce_shared_arrays(comm, buf, where, block_count: int) -> None:
    """Allreduce of shared arrays, in place.

    After *where*, rank r owns share r (1/P of the elements), in blocks of
    ``block_count``. For each block: rank r reduces that block of its share
    of every rank's array into its own array (taking it from every peer in
    turn while it is in cache); a step; then it copies that block of every
    other share from the rank that reduced it -- while that rank's writes
    are still in its cache: on a CPU where reading lines another core has
    just modified costs several times a local read once they have left its
    L2 (the 2-core AMD EPYC this was tuned on: ~8 GB/s against ~60), copying
    a block right after it was reduced is what makes this fast. A last step
    lets every rank return.

    Rank r writes only its own array: block b of share r while the others
    read their own shares of it (never share r), and block b of the other
    shares after the step, when their reducers are done with it and no one
    reads it any more until the next call.
    Cost: 2 + B synchronisations (B blocks per share); each rank reads
    (P-1) S/P from the peers to reduce and (P-1) S/P to copy, and writes S:
    about a third of the arena's memory traffic (copy in, then reduce from
    every slot).
    Source: the reduce-scatter + allgather of Rabenseifner (2004) over a
    single address space, as MPI's CMA/XPMEM shared-memory paths run it.
    """
    size, rank, itemsize = comm.size, comm.rank, buf.itemsize
    if size == 1:
        return
    peers, _ = _where(comm, where, buf.count * itemsize)
    chunks = chunk_bounds(buf.count, size)
    order = [(rank + k) % size for k in range(1, size)]
    longest = chunks[0][1]
    for offset in range(0, longest, block_count):
        first, n = chunks[rank]
        count = max(0, min(block_count, n - offset))
        if count:
            for q in order:
                buf.reduce_from(first + offset, count,
                                _part(peers[q], first + offset, count, itemsize))
        comm.shared_step(None)
        for q in order:
            first, n = chunks[q]
            count = max(0, min(block_count, n - offset))
            if count:
                _copy_in(buf, first + offset, count,
                         _part(peers[q], first + offset, count, itemsize))
    comm.shared_step(None)


def broadcast_shared_arrays(comm, buf, where, root: int) -> None:
    """Broadcast of shared arrays: after *where*, every other rank copies the
    root's array into its own; a step lets the root return.
    Cost: two synchronisations, one copy per rank (the arena: two, one in
    and one out, per round)."""
    if comm.size == 1:
        return
    peers, _ = _where(comm, where, buf.count * buf.itemsize)
    if comm.rank != root and buf.count:
        _copy_in(buf, 0, buf.count, peers[root])
    comm.shared_step(None)


def reduce_shared_arrays(comm, buf, where, root: int, block_count: int) -> None:
    """Reduce of shared arrays: after *where*, the root reduces every other
    rank's array into its own, block by block; a step lets the others
    return. The other ranks' arrays are read, never written.
    Cost: two synchronisations; the root reads (P-1) S from its peers."""
    size, rank, itemsize = comm.size, comm.rank, buf.itemsize
    if size == 1:
        return
    peers, _ = _where(comm, where, buf.count * itemsize)
    if rank == root:
        order = [(root + k) % size for k in range(1, size)]
        for start, count in segments(0, buf.count, block_count):
            for q in order:
                buf.reduce_from(start, count, _part(peers[q], start, count, itemsize))
    comm.shared_step(None)


def allgather_shared_arrays(comm, out, where, per_rank: int) -> None:
    """Allgather of shared inputs: ``out`` holds ``per_rank`` elements per
    rank (this rank's block already filled); after *where*, each rank copies
    every other rank's input into its block of ``out``; a step lets every
    rank return (no one reads its input any more).
    Cost: two synchronisations, (P-1) S/P copied per rank, one copy."""
    size, rank, itemsize = comm.size, comm.rank, out.itemsize
    if size == 1:
        return
    peers, _ = _where(comm, where, per_rank * itemsize)
    for q in range(size):
        if q != rank and per_rank:
            _copy_in(out, q * per_rank, per_rank, peers[q])
    comm.shared_step(None)


def reduce_scatter_shared_arrays(comm, out, where, share: int, block_count: int) -> None:
    """Reduce-scatter of shared inputs (``share`` elements per rank): ``out``
    holds this rank's share of its own input; after *where*, rank r reduces
    share r of every other rank's input into it, block by block; a step.
    Rank r writes only ``out`` (its own input's share r at most, which no one
    else reads). Cost: two synchronisations; (P-1) S/P read per rank."""
    size, rank, itemsize = comm.size, comm.rank, out.itemsize
    if size == 1:
        return
    peers, _ = _where(comm, where, share * size * itemsize)
    order = [(rank + k) % size for k in range(1, size)]
    for start, count in segments(0, share, block_count):
        for q in order:
            out.reduce_from(start, count,
                            _part(peers[q], rank * share + start, count, itemsize))
    comm.shared_step(None)


def alltoall_shared_arrays(comm, where, send_nbytes: int, send_chunks, recv, recv_chunks) -> None:
    """All-to-all of shared inputs: after *where* (which also says where each
    rank's block for every rank starts, and its length), rank r copies its
    block from every other rank's input into ``recv`` (this rank's own block
    is the caller's); a step.
    Cost: two synchronisations, one copy of (P-1)/P S per rank."""
    size, rank, itemsize = comm.size, comm.rank, recv.itemsize
    if size == 1:
        return
    table = [v for first, n in send_chunks for v in (first, n)]
    peers, tables = _where(comm, where, send_nbytes, table)
    for q in range(size):
        if q == rank:
            continue
        first, n = int(tables[q][2 * rank]), int(tables[q][2 * rank + 1])
        start, count = recv_chunks[q]
        if n != count:
            comm.size_mismatch(q, f"rank {q} sends this rank {n} elements, this rank "
                                  f"expects {count}")
        if count:
            _copy_in(recv, start, count, _part(peers[q], first, count, itemsize))
    comm.shared_step(None)
