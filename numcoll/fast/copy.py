"""Single-copy allgathers that repeat, run as one compiled start.

A repeated ``all_gather_into_tensor(out, inp)`` that the ordinary path runs
single-copy (``cma``, forced) pays that path's Python on every call -- the
checks, the plan, the group's Work and Comm, the *where* and the copy table
built anew: 35-50 µs on 2 ranks where the copies of a 1 MiB call take 30,
and a footprint that pushes the buffers' lines out of the caches (2 ranks,
1 MiB, in place: the ordinary path's copy phase took 84-106 µs, the same
copy in a compiled loop 29; ``benchmarks/single_copy_floor.py``).

:class:`FusedCopy` plans such a call once -- the *where* this rank
publishes (the peers read its input where it lies), the copy table, the
pids -- and runs it as :class:`~numcoll.fast.step.FusedCall` runs a fused
arena step: one compiled start (:mod:`numcoll.collectives.fused_copy`),
without the group's lock, a Work or a Comm. A start that does not finish
(a late peer, a copy it cannot make, a refusal) is promoted and finished by
the group from the phase it reached
(:func:`numcoll.algorithms.single_copy.allgather_cma_resume`), with the
ordinary path's errors.

A part larger than an arena slot is copied without the GIL: a compiled
claim, then -- the group holding the call, as it holds a fused call whose
peers were late -- the phases in a second compiled call that lets go of the
GIL and waits the arena's spin and yield phases (a slot's copy is the most
any fused step makes holding it).

``cma_measured`` (the automatic choice from ``single_copy_min_nbytes``) is
planned only for such parts: there rank 0 says, call by call, whether the
call copies or goes through the arena (it asks first: an arena call takes
the ordinary path, whose *where* carries the say, and the peers' starts stop
there and finish through the arena). For parts within a slot that costs more
than it saves -- tried, with the choice forced at 64 KiB while rank 0 said
the arena: 245 µs a call against the ordinary path's 50-60 -- and the
automatic choice never takes single copy there anyway.
"""

from __future__ import annotations

import time

import numpy as np

from transports.shm.arena import SharedArena
from transports.shm.single_copy_steps import STATES

from ..algorithms.single_copy import allgather_cma_resume, allgather_plan
from ..algorithms.single_copy_say import fused_learnt, fused_say, measured_key
from ..collectives import fused_copy, fused_step
from ..memory.host import HostBuffer
from ..memory.overlap import shares_memory
from .step import HAS_GIL, FusedCall

__all__ = ["FusedCopy", "fused_copy_allgather"]


def fused_copy_allgather(pg, call, out, inp) -> FusedCopy | None:
    """The :class:`FusedCopy` of ``call``, an ``allgather_into_tensor`` of
    ``inp`` into ``out`` that the ordinary builder checked and ran with the
    ``cma`` algorithm, or ``cma_measured`` on parts larger than a slot, if a
    fused start can run it: two C-contiguous NumPy arrays of one dtype,
    ``inp`` either the output's own chunk (torch's in-place form) or apart
    from the output, on a group that reads single-copy. Else None. (Ranks
    that are threads of one process get one too: a start within a slot
    looks once, holding the GIL the others need, and the group finishes the
    call.)"""
    transport = pg._transport
    if call.name != "allgather_into_tensor" or call.algorithm not in ("cma", "cma_measured") \
            or not HAS_GIL or pg._size < 2 or pg._closed \
            or type(getattr(transport, "arena", None)) is not SharedArena \
            or getattr(transport, "single_copy", None) is None \
            or type(out) is not np.ndarray or type(inp) is not np.ndarray \
            or not (out.flags.c_contiguous and inp.flags.c_contiguous and out.flags.writeable) \
            or out.dtype != inp.dtype or inp.size == 0 or out.size != inp.size * pg._size \
            or call.algorithm == "cma_measured" and inp.nbytes <= transport.arena.slot_nbytes:
        return None
    flat, source = out.reshape(-1).view(np.uint8), inp.reshape(-1).view(np.uint8)
    own = flat[pg._rank * source.nbytes:(pg._rank + 1) * source.nbytes]
    in_place = source.ctypes.data == own.ctypes.data
    if not in_place and shares_memory(source, flat):
        return None  # (the ordinary path copies such an input first)
    return FusedCopy(pg, call, out, flat, source)


class FusedCopy(FusedCall):
    """A repeated single-copy allgather of ``source`` (this rank's part, flat
    bytes) into ``out`` (``flat``: its bytes) as one compiled start."""

    __slots__ = ("single_copy", "where", "table", "pids", "segment", "typed", "large",
                 "own", "tuning", "key", "_claim", "_copy")

    def __init__(self, pg, call, out, flat, source):
        super().__init__(pg, call, flat, fused_step.GATHER, -1, [out], source=source)
        rank, size, nbytes = pg._rank, pg._size, source.nbytes
        self.single_copy = single_copy = pg._transport.single_copy
        # (the plan holds these arrays' addresses: these references keep them alive)
        # The peers read this rank's input where it lies, not the chunk of the
        # output the start has just copied it into, whose lines sit modified
        # in this core's cache (forced cma, 2 ranks, out of place: 64 KiB
        # 0.92-0.95x MPI's busbw against 0.56x, 256 KiB 1.04-1.11x against 0.59x).
        self.where, self.table = allgather_plan(flat.ctypes.data, source.ctypes.data, nbytes,
                                                rank, size)
        self.pids = single_copy.pid_words
        plan = self.plan
        plan[fused_copy.WHERE:fused_copy.WHERE + 2] = self.where.ctypes.data, self.where.nbytes
        plan[fused_copy.COPIES:fused_copy.COPIES + 2] = self.table.ctypes.data, len(self.table)
        plan[fused_copy.PIDS] = self.pids.ctypes.data
        # What the promoted path runs on: the output in its dtype, as the
        # ordinary path's allgather does (the same chunks and rounds).
        self.typed = out.reshape(-1)
        self.segment = pg.context.segment(out.itemsize)
        # Larger than a slot: a claim, then the phases without the GIL. (Only
        # what runs is compiled: loading each costs 5-15 ms the first time.)
        self.large = nbytes > pg._transport.arena.slot_nbytes
        self.own = None
        if self.large:
            self._claim = fused_copy.entry(fused_copy.claim, flat)
            self._copy = fused_copy.entry(fused_copy.copy, flat)
            # This rank's own part is copied before the call, as the ordinary
            # path packs it before its phases: rank 0 compares the phases'
            # times of both ways (with the copy in, the fused way's 14.6 ms
            # against the arena's 10.9 at 64 MiB kept a 13 ms call at 18).
            if plan[fused_step.OWN]:
                plan[fused_step.OWN] = 0
                self.own = (flat[rank * nbytes:(rank + 1) * nbytes], source)
        else:
            self._start = fused_copy.entry(fused_copy.start, flat)
        # Rank 0 of a measured call says, call by call, which way it goes.
        self.tuning = single_copy.tuning if rank == 0 and call.algorithm == "cma_measured" \
            else None
        self.key = measured_key(call.name, nbytes)
        if self.lane is not None:  # (a start that completes copied: as the ordinary path says)
            self.lane.algorithm = "cma"

    def _entries(self, x) -> tuple:
        return None, None, None  # (set in __init__: the start is this class's own)

    def run(self) -> bool:
        """The whole call, as :meth:`FusedCall.run`; False (nothing done) where
        the ordinary path takes it: copies are off on this group (that path
        says why), or rank 0 says the arena this time."""
        single_copy = self.single_copy
        if single_copy.refused is not None or single_copy.failed is not None:
            return False
        if not self.large:
            return super().run()
        tuning = self.tuning
        if tuning is not None and fused_say(tuning, self.key):
            return False  # (the arena, this time: the ordinary path says so to every rank)
        if self.own is not None:
            np.copyto(*self.own)
        began = time.perf_counter()
        if self._claim(self.address) == fused_step.NOT_TAKEN:
            return False
        with self.pg._lock:  # (held, as a fused call whose peers were late)
            self._hold(0)
            self.running = True
        got = self._copy(self.address, self.x)
        self.end(got)
        if tuning is not None and got == -1:
            fused_learnt(tuning, self.key, time.perf_counter() - began)
        return True

    def hold(self, got: int) -> bool:
        """A start that stopped (``got``: its state, or DONE_HELD): the group
        holds it, promotes it and finishes it from there (:meth:`rest`)."""
        with self.pg._lock:
            self._hold(got)
            self.running = True
        self.end(-2 if self.pending else -1)
        return True

    def rest(self, comm, work):
        """``run(comm, work)`` of the promoted call: the phases the start did
        not finish, step by step (or the arena's allgather, where rank 0 said
        so or a copy was refused)."""
        self.moved()
        if self.pending:
            self.pending = False
            n = self.typed.size // self.size
            chunks = [(q * n, n) for q in range(self.size)]
            allgather_cma_resume(comm, HostBuffer(self.typed), chunks, self.segment,
                                 STATES[self.words[fused_copy.STATE]], self.step,
                                 self.call.algorithm == "cma_measured")
        return self.outs
