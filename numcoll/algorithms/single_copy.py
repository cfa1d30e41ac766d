"""Single-copy algorithms: each rank reads what it needs from the peers' buffers
where they lie, with one kernel copy (cross-memory attach, ``process_vm_readv``).

The arena algorithms (:mod:`.shared`) copy every byte twice: the owner copies
it into its arena slot, the reader copies it out. Here the arena carries only
a few words per rank -- *where* each rank's buffer lies in its own address
space -- and each reader copies straight from the owner's buffer into its own
(:meth:`numcoll.comm.Comm.read_peer`), as Open MPI's shared-memory transport
does with CMA. Any plain array qualifies: nothing is allocated in shared
memory beforehand. The group offers these only where the kernel lets its
ranks read each other (:mod:`transports.shm.single_copy` says when, and how
every rank agrees on it at set-up). In the rooted collectives the root also
*writes* its end of each copy into the peer (:meth:`~numcoll.comm.Comm.write_peer`,
``process_vm_writev``, which the kernel allows where it allows the read), so
that the root and the peer copy at once (:func:`_root_share`).

Every algorithm here is three phases over the arena:

1. *where*: every rank publishes the address and length of each range a
   peer will read, or write (one step); from then on the ranges to read
   hold their inputs;
2. the copies: each rank copies what it needs from the peers' ranges into
   its own buffers, or its part of a copy into the ranges published for it,
   and writes nowhere else;
3. *done* (one step): every rank publishes whether its copies succeeded.

Why the reads are safe (the source stays valid and unchanged until every
reader is done): a rank publishes *done* only after its last read returned,
and no rank leaves the algorithm -- so no caller can free, reuse or write
the buffers it published -- before the *done* step has every rank's part.
During phase 2 no byte is written by one rank and read or written by
another: each algorithm's docstring says which bytes it reads and writes; a
range published to be read is never written, and a range published to be
written is written only by the one peer it was published for, and its owner
neither reads nor writes it before *done*. Between phases the arena's
release/acquire publication orders the owner's writes of its input before
any reader's copy.

If a read (or write) is refused by the kernel (``EPERM``: this process's reader was
re-named by another group since the group agreed; a seccomp filter), the
*done* step says so, every rank learns it in the same step and marks its
reads failed (:meth:`numcoll.comm.Comm.refuse_single_copy`: later reads fail
at once, without a syscall), and the call is finished through the arena
(the ``shared`` algorithm of the same collective, on the same buffers, whose
inputs are still intact): a refused read costs time, never a wrong result.

Cost: two synchronisations; every byte is copied once (by its reader, or
in the rooted collectives partly by the root).

The three phases run as one compiled call (:func:`exchange`, through
:meth:`numcoll.comm.Comm.single_copy_exchange`) while every peer keeps up;
wherever that call stops -- a late peer, a failed copy, a refusal -- they go
on step by step here, from that phase.

The ``cma_measured`` twins (what the automatic choice picks) let rank 0 say,
in its *where*, whether this call copies at all: where its recent times
(:func:`_say`) found the arena faster for calls of this kind, every rank
reads that say from the same step, takes no *done* step and runs the
``shared`` algorithm on the same buffers instead -- the ranks cannot part,
and the machine's state (its cores near or far) picks the way, call by call.
"""

from __future__ import annotations

import time
from typing import Callable, NamedTuple

import numpy as np

from ..comm import COPY_READ as READ
from ..comm import COPY_WRITE as WRITE
from ..comm import WHERE_HEADER_NBYTES as _WHERE_HEADER_NBYTES
from .shared import allgather_shared, broadcast_shared, gather_shared, scatter_shared
from .shared_alltoall import alltoall_shared
from .single_copy_say import _learnt, _say, measured_key
from .verdict import done_step as _done
from .verdict import verdict as _verdict

__all__ = ["Parts", "exchange", "checked", "published_nbytes", "fused_plan", "resume",
           "allgather_cma", "broadcast_cma", "gather_cma", "scatter_cma", "alltoall_cma",
           "allgather_parts", "broadcast_parts", "gather_parts", "scatter_parts",
           "alltoall_parts", "allgather_cma_measured", "broadcast_cma_measured",
           "gather_cma_measured", "scatter_cma_measured", "alltoall_cma_measured",
           "where_nbytes"]

#: Marks a published *where* (b"ncsingle" as a little-endian word).
_MAGIC = int.from_bytes(b"ncsinglc", "little")


def where_nbytes(entries: int) -> int:
    """Bytes of a *where* with ``entries`` (address, length) pairs: what the
    arena's slot must hold (the choice checks it)."""
    return _WHERE_HEADER_NBYTES + 16 * entries


def _address(view) -> int:
    return view.__array_interface__["data"][0]


class Parts(NamedTuple):
    """One rank's side of a single-copy call, as an algorithm lays it out:
    what every phase does with which bytes (one source for the ordinary
    path, :func:`exchange`, and a fused start's plan, :func:`fused_plan`)."""

    #: What this rank publishes in its *where*: contiguous arrays a peer will
    #: read or write (one entry each), or None (an entry no peer uses).
    ranges: list
    #: This rank's copies, rows ``(kind, peer, entry, buf, start, count)``:
    #: READ ``peer``'s published range ``entry`` into ``buf``'s elements
    #: ``start:start + count``, or WRITE those elements into it.
    copies: list
    #: ``fallback(comm)``: the arena's algorithm on the same buffers (their
    #: inputs intact), where the call does not copy.
    fallback: Callable
    #: ``(buf, start, count)``: the published ranges peers write into.
    written: list
    #: The name of ``fallback``'s algorithm (what the flight recorder says ran).
    arena: str = "shared"
    #: ``on_refusal(comm)``: what finishes the call where a copy was refused,
    #: if not ``fallback`` (a call whose copies already changed its buffers).
    on_refusal: Callable | None = None
    #: A fused start's *where* (int64 words), where an algorithm lays out its
    #: own (the arena's alltoall: its round 0's header); None: from ``ranges``.
    where: np.ndarray | None = None
    #: ``resume(comm, state, step)``: the rest of a fused start that stopped
    #: (as :func:`resume`'s arguments), where the algorithm finishes it itself.
    resume: Callable | None = None


def exchange(comm, parts: Parts, measured: bool = False, then=None,
             copier=None) -> bool | None:
    """All three phases of ``parts``: publish its ranges, make its copies,
    publish *done*; then ``then()``, if given. Where a copy was refused, or,
    ``measured``, rank 0 said in its *where* that the arena is the faster
    way for this call (:func:`_say`), ``parts.fallback`` runs instead, on
    every rank (and ``then`` does not). True (copied), False (a copy was
    refused), None (rank 0 said the arena); rank 0 of a measured call times
    it whole, ``then`` included.

    One compiled call takes the whole of it while every peer keeps up
    (:meth:`numcoll.comm.Comm.single_copy_exchange`); where it stops, the
    phases go on here, step by step, from where it stopped. ``copier``, if
    given, makes copies of its own between the *where* and the *done*
    (step by step, no compiled call): ``copier(tables)``, every peer's
    *where* as rows ``(address, nbytes)`` by rank, returns a refusal's text
    or None (:func:`checked` checks a row's length)."""
    learn = measured and comm.rank == 0
    if learn:
        tuning = comm.single_copy_tuning()
        key = measured_key(comm.op_name, published_nbytes(parts))
        said = _say(tuning, key)
        began = time.perf_counter()
    else:
        said = False
    words, views, table = _where(parts, said)
    got = comm.single_copy_exchange(words.view(np.uint8), table) if copier is None else None
    state, step = got if got is not None else (None, None)
    copied = _resume(comm, parts.copies, views, state, step, said, words, copier)
    _finish(comm, parts, copied, measured)
    if copied and then is not None:
        then()
    if learn:
        _learnt(tuning, key, said, time.perf_counter() - began)
    return copied


def published_nbytes(parts: Parts) -> int:
    """The bytes ``parts`` publishes for its peers: what rank 0 keys its
    times of a measured call by (:func:`.single_copy_say.measured_key`)."""
    return sum(v.nbytes for v in parts.ranges if v is not None)


def _where(parts: Parts, said: bool) -> tuple[np.ndarray, list, np.ndarray]:
    """What ``parts`` publishes and copies, rank 0 saying ``said``: the
    *where*'s words, the copies' local views, and the copy table the
    compiled phases take (int64 rows ``(kind, peer, entry, local address,
    nbytes)``)."""
    ranges, copies = parts.ranges, parts.copies
    words = np.zeros(4 + 2 * len(ranges), np.int64)
    words[0], words[1], words[2] = _MAGIC, len(ranges), said
    for i, view in enumerate(ranges):
        if view is not None and view.nbytes:
            words[4 + 2 * i] = _address(view)
            words[5 + 2 * i] = view.nbytes
    views = _views(copies)
    table = np.array([(kind, peer, entry, _address(v), v.nbytes)
                      for (kind, peer, entry, *_), v in zip(copies, views)],
                     np.int64).reshape(-1, 5)
    return words, views, table


def _views(copies) -> list:
    """The local end of every copy row: the elements read into or written from."""
    return [buf.recv_view(start, count) if kind == READ else buf.send_view(start, count)
            for kind, _, _, buf, start, count in copies]


def fused_plan(parts: Parts) -> tuple[np.ndarray, np.ndarray]:
    """What a fused start (:mod:`numcoll.fast.copy`) of the call ``parts``
    lays out publishes and copies, made once, exactly as :func:`exchange` makes
    them each call: the *where* (bytes; rank 0's say 0, copy) and the copy
    table (int64 rows ``(kind, peer, entry, local address, nbytes)``)."""
    words, _, table = _where(parts, False)
    return (words if parts.where is None else parts.where).view(np.uint8), table


def resume(comm, parts: Parts, state: str, step: int, measured: bool,
           copier=None) -> bool | None:
    """The rest of the call ``parts`` lays out, whose phases a fused start
    (:mod:`numcoll.collectives.fused_copy`) took as far as ``state``
    (:meth:`numcoll.comm.Comm.single_copy_exchange`'s states; its *where*
    step ``step``): the copies (``copier``'s first, as :func:`exchange`'s),
    *done* and verdict step by step, or, where rank 0 said so (``measured``)
    or a copy was refused, the fallback; or the algorithm's own
    ``parts.resume``. :func:`exchange`'s answer (``then`` not run)."""
    if parts.resume is not None:
        return parts.resume(comm, state, step)
    copied = _resume(comm, parts.copies, _views(parts.copies), state, step, False,
                     copier=copier)
    _finish(comm, parts, copied, measured)
    return copied


def _finish(comm, parts: Parts, copied: bool | None, measured: bool) -> None:
    """After the phases (``copied``: :func:`_resume`'s answer): the copied
    bytes marked arrived, or the fallback where nothing was copied; and,
    ``measured``, the record of which way the call went."""
    if copied:
        for kind, _, _, buf, start, count in parts.copies:
            if kind == READ and count:
                buf.recv_done(start, count)
        for buf, start, count in parts.written:
            buf.recv_done(start, count)
    elif copied is False and parts.on_refusal is not None:
        parts.on_refusal(comm)
    else:
        parts.fallback(comm)
    if measured and copied is not False:  # (a refusal's fallback is recorded as such)
        comm.ran_instead(parts.arena if copied is None else "cma")


def _resume(comm, copies, views, state: str | None, step: int | None, said: bool,
            words=None, copier=None) -> bool | None:
    """The phases from where the compiled call stopped: ``state`` (one of
    :meth:`numcoll.comm.Comm.single_copy_exchange`'s, or None: nothing
    published yet, ``words`` to publish) at *where* step ``step``;
    ``copier(tables)`` first, if given (:func:`exchange`). True (every copy
    made), False (a copy refused), None (rank 0 said: the arena)."""
    if state == "arena":
        return None
    if state == "done":
        return True
    if state == "verdict":
        comm.shared_wait(step + 1)
        return _verdict(comm, step + 1, None)
    if state is None:
        step = comm.shared_step(words.view(np.uint8))
    elif state == "where":
        comm.shared_wait(step)
    tables, said = _tables(comm, step, said)
    if said:
        return None
    refused = copier(tables) if copier is not None else None
    for (kind, peer, entry, buf, _, count), view in zip(copies, views):
        refused = refused or _copy(comm, kind, buf, view, count, peer, tables[peer][entry])
    return _done(comm, refused)


def _tables(comm, step: int, said: bool) -> tuple[list, bool]:
    """Every peer's *where* of ``step``: an int64 array of (address, nbytes)
    pairs per rank (None for this rank); and rank 0's say (``said``, if this
    is rank 0)."""
    tables = [None] * comm.size
    for q in range(comm.size):
        if q == comm.rank:
            continue
        theirs = np.frombuffer(comm.shared_view(step, q, 0, _WHERE_HEADER_NBYTES), np.int64)
        if theirs[0] != _MAGIC:
            comm.size_mismatch(q, f"rank {q} runs another algorithm than this rank's "
                                  "single-copy one")
        if q == 0:
            said = bool(theirs[2])
        n = int(theirs[1])
        tables[q] = np.frombuffer(comm.shared_view(step, q, _WHERE_HEADER_NBYTES, 16 * n),
                                  np.int64).reshape(n, 2)
    return tables, said


def _copy(comm, kind: int, buf, view, count: int, peer: int, entry) -> str | None:
    """READ ``peer``'s published range ``entry`` into ``view`` (``count`` of
    ``buf``'s elements), or WRITE ``view`` into it; a refusal's text, or None."""
    address = checked(comm, kind, peer, entry, count * buf.itemsize)
    if not count:
        return None
    copy = comm.read_peer if kind == READ else comm.write_peer
    return copy(peer, address, view.view(np.uint8))


def checked(comm, kind: int, peer: int, entry, nbytes: int) -> int:
    """The address of ``peer``'s published range ``entry`` (a row of its
    *where*), which this rank reads (READ) or writes ``nbytes`` of; the
    ordinary path's wrong-size error if its length is another."""
    address, theirs = int(entry[0]), int(entry[1])
    if theirs != nbytes:
        comm.size_mismatch(peer, f"rank {peer} offers {theirs} bytes, this rank reads {nbytes}"
                           if kind == READ else
                           f"rank {peer} takes {theirs} bytes, this rank writes {nbytes}")
    return address


def allgather_cma(comm, buf, chunks, segment_count: int | None = None,
                  measured: bool = False) -> None:
    """Allgather by single-copy reads: ``buf``'s chunk ``comm.rank`` holds this
    rank's input; afterwards every chunk holds its rank's.

    Rank r publishes its chunk r and reads chunk q from every peer q straight
    into its chunk q; it writes only chunks q != r, which no peer reads
    (each reads only its owner's chunk). Every peer reads at once: P-1
    direct reads per rank, no ring.
    Cost: two synchronisations; each rank copies (P-1) S/P once (the arena's
    ``allgather_shared``: twice). Source: Open MPI's vader BTL with CMA.
    """
    if comm.size > 1:
        exchange(comm, allgather_parts(comm.rank, comm.size, buf, chunks, segment_count), measured)


def allgather_parts(rank: int, size: int, buf, chunks, segment_count: int | None = None) -> Parts:
    """:func:`allgather_cma`'s :class:`Parts` on rank ``rank`` of ``size``."""
    first, n = chunks[rank]
    return Parts([buf.send_view(first, n)],
                 [(READ, q, 0, buf, *chunks[q]) for q in _peers(rank, size)],
                 _arena(allgather_shared, buf, chunks, segment_count), [])


def broadcast_cma(comm, buf, root: int, segment_count: int | None = None,
                  measured: bool = False) -> None:
    """Broadcast by single-copy copies: the root publishes its buffer's head,
    every other rank publishes its own buffer's tail (its last
    ``count // P`` elements); each non-root reads the head from the root
    while the root writes its tail into every non-root's (:func:`_root_share`).
    Each rank writes only its own buffer, or the tails published to it,
    which their owners do not touch meanwhile; the root's buffer is only read.
    Cost: two synchronisations; one copy of S per non-root, (P-1)/P S of it
    by the non-root, S/P by the root (the arena's ``broadcast_shared``: one
    in at the root, one out per rank, per slot)."""
    if comm.size > 1:
        exchange(comm, broadcast_parts(comm.rank, comm.size, buf, root, segment_count), measured)


def broadcast_parts(rank: int, size: int, buf, root: int,
                    segment_count: int | None = None) -> Parts:
    """:func:`broadcast_cma`'s :class:`Parts` on rank ``rank`` of ``size``."""
    pushed = _root_share(buf.count, size)
    kept = buf.count - pushed
    fallback = _arena(broadcast_shared, buf, root, segment_count)
    if rank == root:
        return Parts([buf.send_view(0, kept)],
                     [(WRITE, q, 0, buf, kept, pushed) for q in _peers(rank, size)],
                     fallback, [])
    return Parts([buf.recv_view(kept, pushed)], [(READ, root, 0, buf, 0, kept)], fallback,
                 [(buf, kept, pushed)])


def gather_cma(comm, send_buf, recv_bufs, root: int, segment_count: int | None = None,
               measured: bool = False) -> None:
    """Gather by single-copy copies: every other rank q publishes the head of
    ``send_buf`` (its first ``count // P`` elements), the root publishes the
    tail of each ``recv_bufs[q]``; the root reads each head into
    ``recv_bufs[q]`` while rank q writes the rest into the tail published to
    it (:func:`_root_share`). The root writes only its outputs' heads, rank q
    only the tail of ``recv_bufs[q]``, which no one else touches.
    Cost: two synchronisations; (P-1) S/P copied once, 1/P of each rank's
    part by the root, the rest by its owner."""
    if comm.size > 1:
        exchange(comm, gather_parts(comm.rank, comm.size, send_buf, recv_bufs, root, segment_count),
                 measured)


def gather_parts(rank: int, size: int, send_buf, recv_bufs, root: int,
                 segment_count: int | None = None) -> Parts:
    """:func:`gather_cma`'s :class:`Parts` on rank ``rank`` of ``size``."""
    fallback = _arena(gather_shared, send_buf, recv_bufs, root, segment_count)
    if rank != root:
        head = _root_share(send_buf.count, size)
        return Parts([send_buf.send_view(0, head)],
                     [(WRITE, root, rank, send_buf, head, send_buf.count - head)], fallback, [])
    heads = [_root_share(b.count, size) for b in recv_bufs]
    tails = [(b, heads[q], b.count - heads[q]) for q, b in enumerate(recv_bufs)]
    return Parts([None if q == root else b.recv_view(at, n) for q, (b, at, n) in enumerate(tails)],
                 [(READ, q, 0, recv_bufs[q], 0, heads[q]) for q in _peers(rank, size)],
                 fallback, [t for q, t in enumerate(tails) if q != root])


def scatter_cma(comm, send_bufs, recv_buf, root: int, segment_count: int | None = None,
                measured: bool = False) -> None:
    """Scatter by single-copy copies: the root publishes the head of every
    ``send_bufs[q]``, rank q publishes the tail of ``recv_buf`` (its last
    ``count // P`` elements); rank q reads its head from the root while the
    root writes the tail of ``send_bufs[q]`` into it (:func:`_root_share`). Each
    rank writes only ``recv_buf``, or the tails published to it; the root's
    inputs are only read.
    Cost: two synchronisations; every non-root's S/P copied once, 1/P of it
    by the root, the rest by the non-root."""
    if comm.size > 1:
        parts = scatter_parts(comm.rank, comm.size, send_bufs, recv_buf, root, segment_count)
        exchange(comm, parts, measured)


def scatter_parts(rank: int, size: int, send_bufs, recv_buf, root: int,
                  segment_count: int | None = None) -> Parts:
    """:func:`scatter_cma`'s :class:`Parts` on rank ``rank`` of ``size``."""
    fallback = _arena(scatter_shared, send_bufs, recv_buf, root, segment_count)
    if rank != root:
        pushed = _root_share(recv_buf.count, size)
        kept = recv_buf.count - pushed
        return Parts([recv_buf.recv_view(kept, pushed)], [(READ, root, rank, recv_buf, 0, kept)],
                     fallback, [(recv_buf, kept, pushed)])
    heads = [b.count - _root_share(b.count, size) for b in send_bufs]
    return Parts([b.send_view(0, heads[q]) if q != root else None
                  for q, b in enumerate(send_bufs)],
                 [(WRITE, q, 0, send_bufs[q], heads[q], send_bufs[q].count - heads[q])
                  for q in _peers(rank, size)], fallback, [])


def _arena(algorithm, *args) -> Callable:
    """A :class:`Parts` fallback: ``algorithm(comm, *args)``, the arena's."""
    return lambda comm: algorithm(comm, *args)


def _peers(rank: int, size: int):
    """The other ranks, from ``rank + 1`` on: every rank starts with a
    different peer."""
    return [(rank + k) % size for k in range(1, size)]


def _root_share(count: int, size: int) -> int:
    """Of a rooted collective's ``count`` elements between the root and one
    other rank, how many the root copies (its end of them: the last ones,
    written into the peer, or the first ones, read from it) while the other
    rank copies the rest at once, so that two cores copy side by side: 1/P
    of each, as the root serves P - 1 peers. Two ranks, 16 and 64 MiB
    through ``process_vm_readv``/``writev``: each copying half took
    0.54-0.70x the time of one copying it all."""
    return count // size


def alltoall_cma(comm, send_buf, send_chunks, recv_buf, recv_chunks,
                 segment_count: int | None = None, measured: bool = False) -> None:
    """All-to-all by single-copy reads: rank r publishes where its block for
    every rank lies in ``send_buf`` and reads its block from every peer q
    into ``recv_buf``'s chunk q (its own block is the caller's). Ranks may
    send each other different amounts: a block of another length than the
    reader expects fails as a wrong-size message. Each rank writes only
    ``recv_buf``, which no one reads.
    Cost: two synchronisations; one copy of (P-1)/P S per rank."""
    if comm.size > 1:
        exchange(comm, alltoall_parts(comm.rank, comm.size, send_buf, send_chunks, recv_buf,
                                      recv_chunks, segment_count), measured)


def alltoall_parts(rank: int, size: int, send_buf, send_chunks, recv_buf, recv_chunks,
                   segment_count: int | None = None) -> Parts:
    """:func:`alltoall_cma`'s :class:`Parts` on rank ``rank`` of ``size``."""
    return Parts([send_buf.send_view(first, n) if q != rank else None
                  for q, (first, n) in enumerate(send_chunks)],
                 [(READ, q, rank, recv_buf, *recv_chunks[q]) for q in _peers(rank, size)],
                 _arena(alltoall_shared, send_buf, send_chunks, recv_buf, recv_chunks,
                        segment_count), [])


# The ``cma_measured`` algorithms: single copy or the arena, call by call, as
# rank 0 measured them lately (_say). What the automatic choice picks from
# ``single_copy_min_nbytes`` (and its twins: numcoll.config); ``cma`` and
# ``shared``, forced, do one way only.
def allgather_cma_measured(comm, buf, chunks, segment_count: int | None = None) -> None:
    """:func:`allgather_cma`, or the arena's allgather where rank 0 measured it faster."""
    allgather_cma(comm, buf, chunks, segment_count, measured=True)


def broadcast_cma_measured(comm, buf, root: int, segment_count: int | None = None) -> None:
    """:func:`broadcast_cma`, or the arena's broadcast where rank 0 measured it faster."""
    broadcast_cma(comm, buf, root, segment_count, measured=True)


def gather_cma_measured(comm, send_buf, recv_bufs, root: int,
                        segment_count: int | None = None) -> None:
    """:func:`gather_cma`, or the arena's gather where rank 0 measured it faster."""
    gather_cma(comm, send_buf, recv_bufs, root, segment_count, measured=True)


def scatter_cma_measured(comm, send_bufs, recv_buf, root: int,
                         segment_count: int | None = None) -> None:
    """:func:`scatter_cma`, or the arena's scatter where rank 0 measured it faster."""
    scatter_cma(comm, send_bufs, recv_buf, root, segment_count, measured=True)


def alltoall_cma_measured(comm, send_buf, send_chunks, recv_buf, recv_chunks,
                          segment_count: int | None = None) -> None:
    """:func:`alltoall_cma`, or the arena's all-to-all where rank 0 measured it faster."""
    alltoall_cma(comm, send_buf, send_chunks, recv_buf, recv_chunks, segment_count,
                 measured=True)
