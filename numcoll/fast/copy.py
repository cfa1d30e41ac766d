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

Not for ``cma_measured`` (the automatic choice): there rank 0 says, call by
call, whether the call copies or goes through the arena, and an arena call
on the ordinary path -- where, then the arena's steps, with its Python --
leaves every fused peer's start waiting past its spin phase and promoted:
measured with the choice forced at 64 KiB while rank 0 said the arena, 245
µs a call against the ordinary path's 50-60. (The automatic choice takes it only for
parts larger than a slot, which no fused start takes.)
"""

from __future__ import annotations

import numpy as np

from transports.shm.arena import SharedArena
from transports.shm.single_copy_steps import STATES

from ..algorithms.single_copy import allgather_cma_resume, allgather_plan
from ..collectives import fused_copy, fused_step
from ..memory.host import HostBuffer
from ..memory.overlap import shares_memory
from .step import HAS_GIL, FusedCall

__all__ = ["FusedCopy", "fused_copy_allgather"]


def fused_copy_allgather(pg, call, out, inp) -> FusedCopy | None:
    """The :class:`FusedCopy` of ``call``, an ``allgather_into_tensor`` of
    ``inp`` into ``out`` that the ordinary builder checked and ran with the
    ``cma`` algorithm (forced), if a fused start can run it: two C-contiguous
    NumPy arrays of one dtype, ``inp`` either the output's own chunk (torch's
    in-place form) or apart from the output, and within an arena slot (the
    start holds the GIL throughout, as a fused arena step does for a slot's
    copy; larger calls' copies take the ordinary path, which lets go of it),
    on a group that reads single-copy. Else None. (Ranks that are threads of
    one process get one too: its start looks once, holding the GIL the
    others need, and the group finishes the call.)"""
    transport = pg._transport
    if call.name != "allgather_into_tensor" or call.algorithm != "cma" \
            or not HAS_GIL or pg._size < 2 or pg._closed \
            or type(getattr(transport, "arena", None)) is not SharedArena \
            or getattr(transport, "single_copy", None) is None \
            or type(out) is not np.ndarray or type(inp) is not np.ndarray \
            or not (out.flags.c_contiguous and inp.flags.c_contiguous and out.flags.writeable) \
            or out.dtype != inp.dtype or inp.size == 0 or out.size != inp.size * pg._size \
            or inp.nbytes > transport.arena.slot_nbytes:
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

    __slots__ = ("single_copy", "where", "table", "pids", "segment", "typed")

    def __init__(self, pg, call, out, flat, source):
        super().__init__(pg, call, flat, fused_step.GATHER, -1, [out], source=source)
        rank, size, nbytes = pg._rank, pg._size, source.nbytes
        self.single_copy = single_copy = pg._transport.single_copy
        # (the plan holds these arrays' addresses: these references keep them alive)
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
        self._start = fused_copy.entry(flat)

    def _entries(self, x) -> tuple:
        return None, None, None  # (set in __init__: the start is this class's own)

    def run(self) -> bool:
        """The whole call, as :meth:`FusedCall.run`; False (nothing done) where
        copies are off on this group: the ordinary path takes it (and says why)."""
        single_copy = self.single_copy
        if single_copy.refused is not None or single_copy.failed is not None:
            return False
        return super().run()

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
        not finish, step by step (or the arena's allgather, where a copy was
        refused)."""
        self.moved()
        if self.pending:
            self.pending = False
            n = self.typed.size // self.size
            chunks = [(q * n, n) for q in range(self.size)]
            allgather_cma_resume(comm, HostBuffer(self.typed), chunks, self.segment,
                                 STATES[self.words[fused_copy.STATE]], self.step, False)
        return self.outs
