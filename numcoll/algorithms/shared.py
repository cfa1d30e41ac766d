"""Algorithms for ranks that share memory: one synchronisation per step.

On a group whose transport has a shared arena (the ``shm`` transport, ranks
on one host; :mod:`transports.shm.arena`), a step is: every rank copies its
part into its own slot, publishes it and waits for every rank's
(:meth:`numcoll.comm.Comm.shared_step`); then each rank reads what it needs
straight from the others' slots (:meth:`~numcoll.comm.Comm.shared_view`) --
reducing in place, with no message and no copy out first. A step moves at
most C bytes per rank (the arena's slot), so larger buffers take rounds of
steps; every rank runs the same rounds, which the arena's step counts check.

Reductions are combined in rank order (rank 0's part, then 1's, ...) by
whichever rank computes an element, so every rank ends with bitwise the same
result, as with the ring (two ranks: see ``_combine``).

Prior art: the shared-memory allreduce Intel contributed to DeepSpeed (and,
briefly, Gloo: pytorch/gloo#458): copy in, flag, wait, every rank reduces all
buffers for small calls; reduce-scatter + allgather through per-rank buffers
for large ones.
"""

from __future__ import annotations

import numpy as np

from .partition import chunk_bounds, segments

__all__ = ["allreduce_shared", "allreduce_shared_split", "reduce_shared",
           "reduce_scatter_shared", "allgather_shared", "broadcast_shared", "gather_shared",
           "scatter_shared", "barrier_shared"]


def _bytes(a) -> np.ndarray:
    return a.view(np.uint8)


def _copy_in(buf, start: int, count: int, src) -> None:
    """``buf``'s elements ``start:start + count`` := the bytes ``src``."""
    np.copyto(_bytes(buf.recv_view(start, count)), src)
    buf.recv_done(start, count)


def _combine(comm, buf, step: int, start: int, count: int, at: int = 0,
             scratch=None) -> None:
    """``buf``'s elements ``start:start + count`` := the reduction, in rank
    order, of what every rank published at ``step`` from byte ``at`` on.

    Those elements hold this rank's own part on entry. Rank 0 starts from
    them; the others start from a copy of rank 0's part, reading their own
    back from their slot -- or, with ``scratch`` (bytes free until the
    result is written: this rank's part was not published), from a copy
    kept there first. Two ranks need no copy: rank 1 combines rank 0's part
    into its own, and op(x1, x0) == op(x0, x1) bit for bit for the
    commutative ops (which recursive doubling assumes as well).
    """
    nbytes = count * buf.itemsize
    rank = comm.rank
    if comm.size == 2 or rank == 0:
        for peer in range(comm.size):
            if peer != rank:
                buf.reduce_from(start, count, comm.shared_view(step, peer, at, nbytes))
        return
    own = None
    if scratch is not None:
        own = scratch[at:at + nbytes]
        np.copyto(own, _bytes(buf.send_view(start, count)))
    _copy_in(buf, start, count, comm.shared_view(step, 0, at, nbytes))
    for peer in range(1, comm.size):
        buf.reduce_from(start, count, own if peer == rank and own is not None
                        else comm.shared_view(step, peer, at, nbytes))


def _published_rounds(comm, buf, segment_count: int | None):
    """Publish ``buf`` round by round (a step each, at most a slot of bytes);
    yield ``(start, count, step)`` once every rank has published that round."""
    for start, count in segments(0, buf.count, _per_round(comm, buf.itemsize, segment_count)):
        yield start, count, comm.shared_step(_bytes(buf.send_view(start, count)))


def _per_round(comm, itemsize: int, segment_count: int | None, parts: int = 1,
               reserved_nbytes: int = 0) -> int:
    """Elements per round of each of ``parts`` pieces: what fits the arena's
    slot (less ``reserved_nbytes``), and at most ``segment_count`` (so tests
    can force many rounds)."""
    return round_elements(comm.arena_slot_nbytes, itemsize, segment_count, parts,
                          reserved_nbytes)


def round_elements(slot_nbytes: int, itemsize: int, segment_count: int | None, parts: int = 1,
                   reserved_nbytes: int = 0) -> int:
    """:func:`_per_round` for a slot of ``slot_nbytes`` (what a fused plan,
    which has no Comm, lays out alike)."""
    fits = (slot_nbytes - reserved_nbytes) // (parts * itemsize)
    if fits < 1:
        raise ValueError(f"the shared arena's {slot_nbytes}-byte slot cannot hold "
                         f"{parts} elements of {itemsize} bytes")
    return fits if segment_count is None else max(1, min(fits, segment_count))


def allreduce_shared(comm, buf, segment_count: int | None = None) -> None:
    """Allreduce through the shared arena, every rank reducing every slot.

    Per round (at most C bytes per rank): one step -- every rank publishes its
    part, then combines all P slots in rank order into its buffer.
    Cost per round of S bytes: one synchronisation; each rank copies S in and
    reduces (P-1) S from shared memory. Latency-optimal: for small messages,
    and for two ranks at any size.
    Source: DeepSpeed's shared-memory allreduce (Intel), see the module docstring.
    """
    if comm.size == 1:
        return
    for start, count, step in _published_rounds(comm, buf, segment_count):
        _combine(comm, buf, step, start, count)


def allreduce_shared_split(comm, buf, segment_count: int | None = None) -> None:
    """Allreduce through the shared arena as a pipelined reduce-scatter and
    allgather: one synchronisation per round, and only the bytes a peer reads
    copied in.

    A round of S bytes (at most a slot) is cut into P chunks; rank r reduces
    chunk r. Each rank's slot is laid out like a round, chunk q at a fixed
    place (``q * cap`` elements, ``cap`` the most a chunk holds), and every
    step carries two rounds at once: the *reduced* chunk r of round k, which
    the peers copy out, and the *raw* chunks q != r of round k + 1, which
    rank q reduces -- never chunk r's own raw bytes, which only rank r reads,
    from its own buffer. So R rounds take R + 1 steps:

    - step 0: publish round 0's raw chunks q != r;
    - step k + 1: combine chunk r of round k (own buffer, peers' slots of
      step k), write it and round k + 1's raw chunks into the next slot,
      publish; once every rank has, copy round k's other chunks out of the
      peers' slots.

    The reduced chunk and the next round's inputs share the step because they
    sit at different places of the slot; the arena's two-set rule (a set is
    rewritten only after every rank published the step after it) keeps each
    read before the write that reuses its memory: this rank copies round k
    out of step k + 1's slots, and reads round k + 1's chunk r from them,
    before it publishes step k + 2.

    Cost per round of S bytes: one synchronisation; each rank copies
    (P-1)/P S in, reduces S/P from P sources, copies S/P into its slot and
    (P-1)/P S out -- against ``allreduce_shared``'s S in and (P-1) S reduced:
    less memory traffic for one more step per call, which pays from about
    1 MiB on (``shared_split_nbytes`` in :mod:`numcoll.config`). Chunk r is
    combined in rank order by rank r alone, so every rank ends with the same
    bits. Source: DeepSpeed's shared-memory allreduce (Intel), see the module
    docstring, pipelined.
    """
    size, rank, itemsize = comm.size, comm.rank, buf.itemsize
    if size == 1 or buf.count == 0:
        return
    cap = _per_round(comm, itemsize, None, parts=size)  # elements per chunk place
    if segment_count is not None:
        cap = max(1, min(cap, segment_count // size))
    rounds = segments(0, buf.count, cap * size)
    slot_nbytes, mine = cap * size * itemsize, rank * cap * itemsize
    _put_raw(comm, buf, rounds[0], cap, rank)
    step = comm.shared_step(None, slot_nbytes)
    for k, (start, count) in enumerate(rounds):
        slot = comm.next_slot()
        chunks = chunk_bounds(count, size)
        first, n = chunks[rank]
        if n:
            _combine(comm, buf, step, start + first, n, mine, slot)
            np.copyto(slot[mine:mine + n * itemsize], _bytes(buf.send_view(start + first, n)))
        if k + 1 < len(rounds):
            _put_raw(comm, buf, rounds[k + 1], cap, rank)
        step = comm.shared_step(None, slot_nbytes)
        for peer, (first, n) in enumerate(chunks):
            if peer != rank and n:
                _copy_in(buf, start + first, n,
                         comm.shared_view(step, peer, peer * cap * itemsize, n * itemsize))


def _put_raw(comm, buf, round_: tuple[int, int], cap: int, rank: int) -> None:
    """Write round ``round_``'s chunks other than ``rank``'s into this rank's
    next slot, chunk q at element ``q * cap``."""
    start, count = round_
    slot, itemsize = comm.next_slot(), buf.itemsize
    for q, (first, n) in enumerate(chunk_bounds(count, comm.size)):
        if q != rank and n:
            at = q * cap * itemsize
            np.copyto(slot[at:at + n * itemsize], _bytes(buf.send_view(start + first, n)))


def reduce_shared(comm, buf, root: int, segment_count: int | None = None) -> None:
    """Reduce through the shared arena: per round every other rank publishes
    its part and the root combines the P parts in rank order, its own read
    from its buffer; the others only publish (their buffers are only read:
    the builder may hand the caller's array as it is).
    Cost per round of S bytes: one synchronisation; every rank but the root
    copies S in, the root reduces (P-1) S from shared memory and copies
    nothing in (nobody reads its slot: it publishes an empty step, and keeps
    its own part there for the rank order when P > 2 and it is not rank 0).
    """
    size, rank = comm.size, comm.rank
    if size == 1:
        return
    if rank != root:
        for _ in _published_rounds(comm, buf, segment_count):
            pass
        return
    for start, count in segments(0, buf.count, _per_round(comm, buf.itemsize, segment_count)):
        scratch = comm.next_slot()  # this step's own slot: published empty, read by no one
        step = comm.shared_step(None, 0)
        _combine(comm, buf, step, start, count, 0, scratch if size > 2 and rank else None)


def reduce_scatter_shared(comm, buf, chunks, segment_count: int | None = None) -> None:
    """Reduce-scatter through the shared arena: ``chunks[c]`` (start, count) of
    ``buf`` is rank c's share; afterwards chunk ``comm.rank`` holds the reduction.

    Each round every rank publishes a piece of every chunk (at most C/P bytes
    each) and rank r reduces the pieces of chunk r from all P slots.
    Cost per round: one synchronisation; every rank copies its round in and
    reads P pieces of its own chunk.
    """
    size, rank, itemsize = comm.size, comm.rank, buf.itemsize
    if size == 1:
        return
    per_chunk = _per_round(comm, itemsize, segment_count, parts=size)
    longest = max(n for _, n in chunks)
    for offset in range(0, longest, per_chunk):
        pieces = [(first + offset, max(0, min(per_chunk, n - offset))) for first, n in chunks]
        slot = comm.next_slot()
        at = 0
        for first, n in pieces:
            if n:
                np.copyto(slot[at:at + n * itemsize], _bytes(buf.send_view(first, n)))
                at += n * itemsize
        step = comm.shared_step(None, at)
        first, n = pieces[rank]
        if not n:
            continue
        _combine(comm, buf, step, first, n, sum(k for _, k in pieces[:rank]) * itemsize)


def allgather_shared(comm, buf, chunks, segment_count: int | None = None) -> None:
    """Allgather through the shared arena: ``buf``'s chunk ``comm.rank`` holds
    this rank's input; afterwards every chunk holds its rank's.

    Each round every rank publishes a piece of its chunk (at most C bytes)
    and copies the others' pieces out. Cost per round: one synchronisation;
    each rank copies its piece in once and P-1 pieces out.
    """
    size, rank, itemsize = comm.size, comm.rank, buf.itemsize
    if size == 1:
        return
    per_round = _per_round(comm, itemsize, segment_count)
    longest = max(n for _, n in chunks)
    mine_first, mine_n = chunks[rank]
    for offset in range(0, longest, per_round):
        n = max(0, min(per_round, mine_n - offset))
        step = comm.shared_step(_bytes(buf.send_view(mine_first + offset, n)) if n else None)
        for peer, (first, total) in enumerate(chunks):
            k = max(0, min(per_round, total - offset))
            if peer != rank and k:
                _copy_in(buf, first + offset, k, comm.shared_view(step, peer, 0, k * itemsize))


def broadcast_shared(comm, buf, root: int, segment_count: int | None = None) -> None:
    """Broadcast through the shared arena: the root publishes rounds of at most
    C bytes, every other rank publishes nothing and copies the root's out.
    Cost per round: one synchronisation, one copy in (root) and one out (others)."""
    size, itemsize = comm.size, buf.itemsize
    if size == 1:
        return
    per_round = _per_round(comm, itemsize, segment_count)
    for start, count in segments(0, buf.count, per_round):
        if comm.rank == root:
            comm.shared_step(_bytes(buf.send_view(start, count)))
        else:
            step = comm.shared_step(None)
            _copy_in(buf, start, count, comm.shared_view(step, root, 0, count * itemsize))


def gather_shared(comm, send_buf, recv_bufs, root: int, segment_count: int | None = None) -> None:
    """Gather through the shared arena: per round every other rank publishes a
    piece of ``send_buf`` (at most C bytes) and the root copies each into
    ``recv_bufs[q]`` (its own is copied by the caller). Cost per round: one
    synchronisation; one copy in per rank, P-1 copies out at the root."""
    size, itemsize = comm.size, send_buf.itemsize
    if size == 1:
        return
    per_round = _per_round(comm, itemsize, segment_count)
    for start, count in segments(0, send_buf.count, per_round):
        if comm.rank != root:
            comm.shared_step(_bytes(send_buf.send_view(start, count)))
            continue
        step = comm.shared_step(None)
        for peer in range(size):
            if peer != root:
                _copy_in(recv_bufs[peer], start, count,
                         comm.shared_view(step, peer, 0, count * itemsize))


def scatter_shared(comm, send_bufs, recv_buf, root: int,
                   segment_count: int | None = None) -> None:
    """Scatter through the shared arena: per round the root publishes a piece
    of every ``send_bufs[q]``, q != root (at most C/(P-1) bytes each, at
    :func:`_place` ``(q, root)``) and rank q copies its own out (the root's is
    copied by the caller). Cost per round: one synchronisation; the root
    copies P-1 pieces in, every other rank one out."""
    size, rank, itemsize = comm.size, comm.rank, recv_buf.itemsize
    if size == 1:
        return
    per_peer = _per_round(comm, itemsize, segment_count, parts=size - 1)
    stride = per_peer * itemsize
    for start, count in segments(0, recv_buf.count, per_peer):
        nbytes = count * itemsize
        if rank == root:
            slot = comm.next_slot()
            for peer in range(size):
                if peer != root:
                    at = _place(peer, root) * stride
                    np.copyto(slot[at:at + nbytes],
                              _bytes(send_bufs[peer].send_view(start, count)))
            comm.shared_step(None, (size - 2) * stride + nbytes)
            continue
        step = comm.shared_step(None)
        _copy_in(recv_buf, start, count,
                 comm.shared_view(step, root, _place(rank, root) * stride, nbytes))


def _place(q: int, writer: int) -> int:
    """Where, in pieces, rank ``writer``'s slot holds its piece for rank ``q``
    (``q != writer``): the P-1 peers in rank order, no hole for the writer."""
    return q - (q > writer)


def barrier_shared(comm) -> None:
    """Barrier: one step of the shared arena with nothing in it (every rank
    publishes, then waits for every other's). Cost: one synchronisation."""
    if comm.size > 1:
        comm.shared_step(None)
