"""Single-copy calls that repeat, run as one compiled start.

A repeated call that the ordinary path runs single-copy (``cma``, forced, or
``cma_measured``, the automatic choice from ``single_copy_min_nbytes``) pays
that path's Python on every call -- the checks, the plan, the group's Work
and Comm, the *where* and the copy table built anew: 35-50 µs on 2 ranks
where the copies of a 1 MiB allgather take 30, and a footprint that pushes
the buffers' lines out of the caches (2 ranks, 1 MiB, in place: the
ordinary path's copy phase took 84-106 µs, the same copy in a compiled loop
29; ``benchmarks/single_copy_floor.py``).

:class:`FusedCopy` plans such a call once -- the *where* this rank publishes,
the copy table, the pids, all from the algorithm's own
:class:`~numcoll.algorithms.single_copy.Parts`, so that it publishes and
copies exactly what the ordinary path does -- and runs it as
:class:`~numcoll.fast.step.FusedCall` runs a fused arena step: one compiled
start (:mod:`numcoll.collectives.fused_copy`), without the group's lock, a
Work or a Comm. A start that does not finish (a late peer, a copy it cannot
make, a refusal) is promoted and finished by the group from the phase it
reached (:func:`numcoll.algorithms.single_copy.resume`), with the ordinary
path's errors. Planned for ``all_gather_into_tensor``
(:func:`fused_copy_allgather`; there the peers read the input where it
lies), equal-split ``all_to_all_single``, ``gather``, ``scatter``
(:func:`fused_copy_move`) and ``broadcast`` (:func:`fused_copy_broadcast`).

A broadcast's plan can be made for any array of its form
(``fused_copy_broadcast(..., by_form=True)``, numcoll.fast.forms): every
address it publishes or copies to lies in the one array, so each call
moves them to its own array first, and the parts a promoted call finishes
with are made for that array then.

Where this rank copies more than an arena slot holds, the copies run without
the GIL: a compiled claim, then -- the group holding the call, as it holds a
fused call whose peers were late -- the phases in a second compiled call
that lets go of the GIL and waits the arena's spin and yield phases (a
slot's copy is the most any fused step makes holding it).

A start within a slot waits for its peers longer than a fused arena step
does: the arena's spin phase and about a microsecond per KiB it copies
(:data:`WAIT_NS_PER_BYTE`: the peers copy about as much), and a start that
still stopped waiting goes on waiting in compiled code, without the GIL,
once the group holds it (:meth:`FusedCopy.hold`). Before, such a start was
finished through the group's Python, 100-200 us: 2 ranks, forced cma, a
1 MiB alltoall took 200-240 us a call where 512 KiB took 40.

``cma_measured`` (rank 0 says, call by call, whether the call copies or
goes through the arena) is planned too: rank 0 asks first, and an arena
call takes the ordinary path, whose *where* carries the say; the peers'
starts stop there and finish through the arena. Rank 0 keeps the time of
each fused start that copied, so it compares the two ways as they run.
"""

from __future__ import annotations

import time

import numpy as np

from transports.shm.arena import SharedArena
from transports.shm.single_copy_steps import DONE_OPEN, STATES, WHERE_OPEN

from ..algorithms.shared_alltoall import (READ_WHOLE, alltoall_resume, alltoall_round_zero,
                                          alltoall_shared)
from ..algorithms.single_copy import (READ, Parts, allgather_parts, alltoall_parts,
                                      broadcast_parts, fused_plan, gather_parts,
                                      published_nbytes, resume, scatter_parts)
from ..algorithms.single_copy_say import fused_learnt, fused_say, measured_key
from ..collectives import fused_copy, fused_step
from ..memory.host import HostBuffer
from ..memory.overlap import shares_memory
from .moves import plain
from .step import HAS_GIL, FusedCall

__all__ = ["FusedCopy", "fused_copy_allgather", "fused_copy_alltoall", "fused_copy_broadcast",
           "fused_copy_move", "fused_copy_rooted", "reads_whole", "run_held"]

#: How much longer a start within a slot waits for its peers, per byte this
#: rank copies (ns): a peer copying as much as it does at 1 GB/s, several
#: times slower than this VM's kernel copies in its slowest state.
WAIT_NS_PER_BYTE = 1


def _copies_here(pg, call, algorithms=("cma", "cma_measured")) -> bool:
    """Whether ``call`` (as the ordinary builder made it) runs single-copy
    (its algorithm one of ``algorithms``) on a group whose ranks read each
    other where a fused start can run."""
    transport = pg._transport
    return call.algorithm in algorithms and HAS_GIL and pg._size >= 2 \
        and not pg._closed and type(getattr(transport, "arena", None)) is SharedArena \
        and getattr(transport, "single_copy", None) is not None


def fused_copy_allgather(pg, call, out, inp, by_form: bool = False) -> FusedCopy | None:
    """The :class:`FusedCopy` of ``call``, an ``allgather_into_tensor`` of
    ``inp`` into ``out`` that the ordinary builder checked and ran
    single-copy, if a fused start can run it: two C-contiguous NumPy arrays
    of one dtype, ``inp`` either the output's own chunk (torch's in-place
    form) or apart from the output. Else None. (Ranks that are threads of
    one process get one too: a start within a slot looks once, holding the
    GIL the others need, and the group finishes the call.) ``by_form``: a
    plan for any arrays of their form that keeps none, as
    :func:`fused_copy_broadcast`'s (its copies lie in ``out``, its *where*
    in ``inp``), if its copies fit a slot (a larger one keeps its own block)."""
    if call.name != "allgather_into_tensor" or not _copies_here(pg, call) \
            or inp is None or out is None or not plain(inp, out) \
            or out.dtype != inp.dtype or out.size != inp.size * pg._size:
        return None
    rank, size = pg._rank, pg._size
    flat, source = out.reshape(-1).view(np.uint8), inp.reshape(-1).view(np.uint8)
    if source.ctypes.data != flat.ctypes.data + rank * source.nbytes \
            and shares_memory(source, flat):
        return None  # (the ordinary path copies such an input first)
    n, segment = inp.size, pg.context.segment(out.itemsize)
    if by_form and (size - 1) * source.nbytes > pg._transport.arena.slot_nbytes:
        return None

    def parts_of(out, source):  # (of no array but those given: a plan by form keeps this)
        # The peers read this rank's input where it lies, not the chunk of the
        # output the start has just copied it into, whose lines sit modified in
        # this core's cache (forced cma, 2 ranks, out of place: 64 KiB 0.92-0.95x
        # MPI's busbw against 0.56x, 256 KiB 1.04-1.11x against 0.59x).
        return allgather_parts(rank, size, HostBuffer(out.reshape(-1)),
                               [(q * n, n) for q in range(size)], segment)._replace(
                                   ranges=[source])

    fused = FusedCopy(pg, call, parts_of(out, source), flat, [out], source=source)
    if by_form:
        fused.keep_none(flat, source, lambda now: parts_of(
            now.outs[0], now.source.reshape(-1).view(np.uint8)))
    return fused


def fused_copy_move(pg, call, inp, out) -> FusedCopy | None:
    """The :class:`FusedCopy` of ``call`` -- an equal-split ``alltoall_base``,
    a ``gather`` or a ``scatter`` that the ordinary builder checked and ran
    single-copy -- over this rank's ``inp`` and ``out`` as
    :func:`numcoll.fast.moves.plan` takes them (None where this rank passes
    none; a gather's outputs and a scatter's inputs as one array over the
    root's blocks), if a fused start can run it: C-contiguous NumPy arrays
    of one dtype, apart from each other or in the root's in-place form.
    Else None."""
    if call.name not in ("alltoall_base", "gather", "scatter") or not _copies_here(pg, call) \
            or not plain(inp, out):
        return None
    if inp is not None and out is not None and inp.dtype != out.dtype:
        return None
    x, y = (None if a is None else a.reshape(-1) for a in (inp, out))
    laid = _move_parts(pg, call, x, y)
    if laid is None:
        return None
    parts, own = laid
    outs = [] if call.name == "gather" and pg._rank != call.root else [out]
    return FusedCopy(pg, call, parts, (y if y is not None else x).view(np.uint8), outs,
                     own=own)


def _move_parts(pg, call, x, y) -> tuple | None:
    """:func:`fused_copy_move`'s layout of ``call`` over this rank's flat
    ``x`` and ``y`` (its input and output; None where it passes none): the
    :class:`~numcoll.algorithms.single_copy.Parts`, and this rank's own
    block as a ``(destination, source)`` pair (None: nothing to copy), or
    None where a fused start cannot take them."""
    name, rank, size, root = call.name, pg._rank, pg._size, call.root
    seg = pg.context.segment((x if x is not None else y).itemsize)
    if name == "alltoall_base":
        if x is None or y is None or x.size != y.size or x.size % size or shares_memory(x, y):
            return None
        n = x.size // size
        chunks = [(q * n, n) for q in range(size)]
        return (alltoall_parts(rank, size, HostBuffer(x), chunks, HostBuffer(y), chunks, seg),
                (y[rank * n:(rank + 1) * n], x[rank * n:(rank + 1) * n]))
    if rank != root:
        if name == "gather" and x is not None and y is None:
            return gather_parts(rank, size, HostBuffer(x), [], root, seg), None
        if name == "scatter" and y is not None and x is None:
            return scatter_parts(rank, size, [], HostBuffer(y), root, seg), None
        return None
    part, whole = (x, y) if name == "gather" else (y, x)
    if part is None or whole is None or whole.size != part.size * size:
        return None
    n, own = part.size, None
    mine = whole[root * n:(root + 1) * n]
    if mine.ctypes.data != part.ctypes.data:
        if shares_memory(part, whole):
            return None
        own = (mine, part) if name == "gather" else (part, mine)
    blocks = [HostBuffer(whole[q * n:(q + 1) * n]) for q in range(size)]
    parts = gather_parts(rank, size, HostBuffer(part), blocks, root, seg) \
        if name == "gather" else scatter_parts(rank, size, blocks, HostBuffer(part), root, seg)
    return parts, own


def fused_copy_rooted(pg, call, tensor, own) -> FusedCopy | None:
    """A plan by form (numcoll.fast.forms) of ``call``, a ``gather`` or a
    ``scatter`` of ``tensor`` that the ordinary builder checked and ran
    single-copy, the root's list moving through ``own`` (the plan's own
    buffer, which it keeps; None off the root), if its copies fit a slot:
    :func:`fused_copy_move`'s plan, keeping no caller's array. On the root
    every address it publishes or copies to lies in ``own``; elsewhere in
    ``tensor``, pointed at each call's (:func:`numcoll.collectives.fused_copy.point`).
    The root's own block is each call's (its run sets ``own``). Else None."""
    inp, out = (tensor, own) if call.name == "gather" else (own, tensor)
    fused = fused_copy_move(pg, call, inp, out)
    if fused is None or fused.large:
        return None
    dtype, lies = tensor.dtype, (tensor if own is None else own).reshape(-1).view(np.uint8)

    def remake(now):  # (the parts of the call's tensor, now.x's bytes)
        x = now.x.view(dtype)
        whole = None if own is None else own.reshape(-1)
        return _move_parts(pg, call, *((x, whole) if call.name == "gather" else (whole, x)))[0]

    fused.keep_none(lies, lies, remake, kept=own)
    return fused


def fused_copy_alltoall(pg, call, inp, out, rest_nbytes: int | None) -> FusedCopy | None:
    """The :class:`FusedCopy` of ``call``, an equal-split ``alltoall_base``
    that the ordinary builder checked and runs through the arena's
    ``alltoall_shared`` offering reads from ``rest_nbytes`` (the automatic
    choice; None: it offers none), if this rank offers its blocks to be read
    whole there (:func:`~numcoll.algorithms.shared_alltoall.alltoall_header`)
    and a fused start can run it: two C-contiguous NumPy arrays of one
    dtype, apart. Its compiled phases are that algorithm's round 0 (its
    header as the *where*), reads and *done* step; where a peer's header
    says otherwise, the algorithm goes on from round 0
    (:func:`~numcoll.algorithms.shared_alltoall.alltoall_resume`). Else None."""
    rank, size = pg._rank, pg._size
    if call.name != "alltoall_base" or rest_nbytes is None \
            or not _copies_here(pg, call, ("shared",)) or not plain(inp, out) \
            or inp.dtype != out.dtype or not pg._transport.single_copy.usable:
        return None
    x, y = inp.reshape(-1), out.reshape(-1)
    if x.size != y.size or x.size % size or shares_memory(x, y):
        return None
    n, seg = x.size // size, pg.context.segment(x.itemsize)
    chunks = [(q * n, n) for q in range(size)]
    send, recv = HostBuffer(x), HostBuffer(y)
    _, _, header = alltoall_round_zero(pg._transport.arena.slot_nbytes, rank, size, send, chunks,
                                       chunks, seg, rest_nbytes)
    if header[0] != READ_WHOLE:
        return None  # (its data goes in round 0: a fused arena step's, moves.plan)
    parts = Parts([], [(READ, q, rank, recv, *chunks[q]) for q in range(size) if q != rank],
                  lambda comm: alltoall_shared(comm, send, chunks, recv, chunks, seg), [],
                  where=header,
                  resume=lambda comm, state, step: alltoall_resume(
                      comm, send, chunks, recv, chunks, seg, rest_nbytes, state, step))
    own = (y[rank * n:(rank + 1) * n], x[rank * n:(rank + 1) * n])
    return FusedCopy(pg, call, parts, y.view(np.uint8), [out], own=own, ran="shared+cma")


def reads_whole(pg, send, chunks, rest_nbytes: int | None) -> bool:
    """Whether the arena's ``alltoall_shared`` of ``send`` (a HostBuffer, in
    equal ``chunks``) offering reads from ``rest_nbytes`` (None: none) has its
    blocks read whole, its round 0 carrying the header alone: a repeated
    call's plan is then :func:`fused_copy_alltoall`'s, else a fused arena
    step's (:func:`numcoll.fast.moves.plan`), which sends the data in round 0."""
    if rest_nbytes is None:
        return False
    _, _, header = alltoall_round_zero(pg._transport.arena.slot_nbytes, pg._rank, pg._size,
                                       send, chunks, chunks, pg.context.segment(send.itemsize),
                                       rest_nbytes)
    return header[0] == READ_WHOLE  # (as fused_copy_alltoall finds it)


def fused_copy_broadcast(pg, call, x, by_form: bool = False) -> FusedCopy | None:
    """The :class:`FusedCopy` of ``call``, a ``broadcast`` of ``x`` that the
    ordinary builder checked and ran single-copy, if a fused start can run
    it (a C-contiguous, writable NumPy array); else None. ``by_form``: a
    plan for any array of ``x``'s form (numcoll.fast.forms), pointed at each
    call's array (:func:`numcoll.collectives.fused_copy.point`), that keeps
    no array: every address a broadcast publishes or copies to lies in its
    array, at offsets of the form's."""
    if call.name != "broadcast" or not _copies_here(pg, call) or not plain(None, x):
        return None
    flat, segment = x.reshape(-1), pg.context.segment(x.itemsize)

    def parts_of(flat):  # (of no array but the one given: a plan by form keeps this)
        return broadcast_parts(pg._rank, pg._size, HostBuffer(flat), call.root, segment)

    fused = FusedCopy(pg, call, parts_of(flat), flat.view(np.uint8), [x])
    if by_form:
        fused.keep_none(flat, flat, lambda now: parts_of(now.outs[0].reshape(-1)))
    return fused


def run_held(fused) -> bool:
    """A fused call whose copies are too long to make holding the GIL: its
    compiled claim (``fused._claim``), then -- the group holding the call, as
    a fused call whose peers were late -- its compiled phases without the GIL
    (``fused._copy``), and its end. False (nothing done) where the claim was
    refused: the ordinary path takes the call."""
    if fused._claim(fused.address) == fused_step.NOT_TAKEN:
        return False
    with fused.pg._lock:
        fused._hold(0)
        fused.running = True
    fused.end(fused._copy(fused.address, fused.x))
    return True


class FusedCopy(FusedCall):
    """A repeated single-copy call, laid out as ``parts``
    (:class:`~numcoll.algorithms.single_copy.Parts`), as one compiled start.
    ``x``: the bytes the compiled calls are given (the output, or the
    input where this rank has none); ``own``: this rank's own block as a
    ``(destination, source)`` pair the call copies first, or None;
    ``source``: an allgather's input, whose own chunk the compiled start
    copies into ``x`` (as :class:`FusedCall` takes it); ``ran``: the
    algorithm a start that completes says ran (the flight recorder's)."""

    __slots__ = ("single_copy", "parts", "where", "table", "pids", "large", "own", "tuning",
                 "key", "remake", "base", "kept", "_claim", "_copy", "_wait")

    def __init__(self, pg, call, parts, x, outs, own=None, source=None, ran="cma"):
        super().__init__(pg, call, x, fused_step.GATHER, -1, outs, publishes=source is not None,
                         source=source)
        rank = pg._rank
        self.single_copy = single_copy = pg._transport.single_copy
        # (the plan holds these arrays' addresses: these references keep them alive)
        self.parts, self.own = parts, own
        self.where, self.table = fused_plan(parts)
        self.pids = single_copy.pid_words
        plan = self.plan
        plan[fused_copy.WHERE:fused_copy.WHERE + 2] = self.where.ctypes.data, self.where.nbytes
        plan[fused_copy.COPIES:fused_copy.COPIES + 2] = self.table.ctypes.data, len(self.table)
        plan[fused_copy.PIDS] = self.pids.ctypes.data
        # More than a slot to copy (``large``): a claim, then the phases
        # without the GIL. (Only what runs is compiled: loading each costs
        # 5-15 ms the first time.)
        copied = sum(buf.itemsize * count for *_, buf, _, count in parts.copies)
        self.large = large = copied > pg._transport.arena.slot_nbytes
        self._wait = None  # (compiled the first time a start stops waiting: hold())
        if large:
            self._claim = fused_copy.entry(fused_copy.claim, x)
            self._copy = fused_copy.entry(fused_copy.copy, x)
            # This rank's own block is copied before the call, as the ordinary
            # path packs before its phases: rank 0 compares the phases' times
            # of both ways (with the copy in, the fused way's 14.6 ms against
            # the arena's 10.9 for a 64 MiB allgather kept a 13 ms call at 18).
            if plan[fused_step.OWN]:
                plan[fused_step.OWN] = 0
                self.own = (x[rank * source.nbytes:(rank + 1) * source.nbytes], source)
        else:
            self._start = fused_copy.entry(fused_copy.start, x)
            # The *done* wait outlasts the peers' copies, which take about as
            # long as this rank's: a start that gave up after the arena's
            # spin phase (5 us) would be finished by the group, through its
            # Python (2 ranks, forced cma, 1 MiB alltoall: 200-240 us a call,
            # 39-43 at 512 KiB, where the copies alone take 30-60).
            if self.spin_ns:
                self.spin_ns += copied * WAIT_NS_PER_BYTE
        # Rank 0 of a measured call says, call by call, which way it goes, for
        # calls keyed as the ordinary path keys them (the bytes it publishes).
        self.tuning = single_copy.tuning if rank == 0 and call.algorithm == "cma_measured" \
            else None
        self.key = measured_key(call.name, published_nbytes(parts))
        self.remake = self.base = self.kept = None  # (a plan by form's: keep_none())
        if self.lane is not None:  # (a start that completes copied: as the ordinary path says)
            self.lane.algorithm = ran

    def keep_none(self, copied, published, remake, kept=None) -> None:
        """Make this a plan by form (numcoll.fast.forms), which keeps no
        caller's array: no parts, nor an own block's pair (they hold the
        arrays: a run sets its own pair); ``remake(self)``
        makes them for the call's arrays now, if a promoted call needs them;
        and ``base``, the first bytes of ``copied`` and ``published``, the
        arrays its copy table's and its *where*'s addresses lie in, which
        :func:`numcoll.collectives.fused_copy.point` moves to each call's.
        ``kept``: a buffer of the plan's own that addresses lie in (a rooted
        call's on the root), kept alive here."""
        self.parts, self.own, self.remake, self.kept = None, None, remake, kept
        self.base = np.array([copied.ctypes.data, published.ctypes.data], np.int64)

    def _entries(self, x) -> tuple:
        return None, None, None  # (set in __init__: the start is this class's own)

    def run(self) -> bool:
        """The whole call, as :meth:`FusedCall.run`; False (nothing done) where
        the ordinary path takes it: copies are off on this group (that path
        says why), or rank 0 says the arena this time."""
        single_copy = self.single_copy
        if not single_copy.usable:
            return False
        tuning = self.tuning
        if tuning is not None and fused_say(tuning, self.key):
            return False  # (the arena, this time: the ordinary path says so to every rank)
        if self.own is not None:  # (local: no peer reads or writes either end)
            np.copyto(*self.own)
        if not self.large and tuning is None:
            return super().run()
        began, before = time.perf_counter(), self.work
        if not self.large:
            if not super().run():  # (timed: rank 0 keeps the copy's time)
                return False
        elif not run_held(self):
            return False
        work = self.work
        if tuning is not None and (work is None or work is before):  # (copied, not promoted)
            fused_learnt(tuning, self.key, time.perf_counter() - began)
        return True

    def hold(self, got: int) -> bool:
        """A start that stopped (``got``: its state, or DONE_HELD): the group
        holds it. One that stopped waiting for a peer goes on waiting, in
        compiled code without the GIL, as a call larger than a slot waits;
        what is left after that (a peer later still, a copy refused, rank 0
        saying the arena) is promoted and finished from there (:meth:`rest`).
        (A rooted call's peers wait for a root that makes its data first: each
        start of theirs was promoted, 100-200 us a call, before this.)"""
        with self.pg._lock:
            self._hold(got)
            self.running = True
        if self.pending and got in (WHERE_OPEN, DONE_OPEN):
            if self._wait is None:
                self._wait = fused_copy.entry(fused_copy.wait, self.x)
            got = self._wait(self.address, self.x)
        self.end(got if self.pending else -1)
        return True

    def rest(self, comm, work):
        """``run(comm, work)`` of the promoted call: the phases the start did
        not finish, step by step (or the arena's algorithm, where rank 0 said
        so or a copy was refused)."""
        self.moved()
        if self.pending:
            self.pending = False
            parts = self.parts if self.remake is None else self.remake(self)
            resume(comm, parts, STATES[self.words[fused_copy.STATE]], self.step,
                   self.call.algorithm == "cma_measured")
        return self.outs
