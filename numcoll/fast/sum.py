"""A repeated single-copy allreduce, run as one compiled call.

A large allreduce that repeats (the same array, SUM) and that the ordinary
path runs single-copy (``cma``, forced, or ``cma_measured``, the automatic
choice from ``single_copy_allreduce_min_nbytes``) was replayed: the ordinary
run without the argument checks, still about 150 µs of Python a call on 2
ranks around the reduce-scatter and the allgather (a trace: 50-80 µs before
the first step, 35-65 between the phases), against a compiled floor at Open
MPI's time (265 µs at 1 MiB, 682 at 4 MiB).

:class:`FusedAllreduce` plans such a call once from the algorithm's own
:class:`~numcoll.algorithms.single_copy_reduce.CmaAllreduce` -- both
phases' *where*s, the checks, the allgather's copy table, the scratch -- and
runs it as :class:`~numcoll.fast.copy.FusedCopy` runs a call larger than a
slot: a compiled claim, then, the group holding the call, both phases in
one compiled call without the GIL (:mod:`numcoll.collectives.fused_sum`). A
call that stops is promoted and finished by the algorithm from the phase and
state it reached (:meth:`CmaAllreduce.resume`), with the ordinary path's
errors. Rank 0 of a measured call says, call by call, whether it copies or
goes through the arena, as for the data movers.
"""

from __future__ import annotations

import time

import numpy as np

from transports.shm.single_copy_steps import STATES

from ..algorithms.single_copy import READ, fused_plan
from ..algorithms.single_copy_reduce import CmaAllreduce
from ..algorithms.single_copy_say import fused_learnt, fused_say, measured_key
from ..collectives import fused_copy, fused_step, fused_sum
from .copy import _copies_here, run_held
from .moves import plain
from .step import FusedCall

__all__ = ["FusedAllreduce", "fused_allreduce"]


def fused_allreduce(pg, call, x, run) -> FusedAllreduce | None:
    """The :class:`FusedAllreduce` of ``call``, an allreduce of ``x`` with SUM
    that the ordinary builder checked and runs single-copy (``run``: its
    run, whose remake holds the plan), if one compiled call can run it: a
    C-contiguous, writable NumPy array reduced in place whose kernel is a
    plain sum (:attr:`numcoll.memory.host.HostBuffer.plain_sum`), at least an
    element a rank. Else None."""
    remake = getattr(run, "remake", None)
    if call.name != "allreduce" or call.op != "SUM" or call.custom_op or remake is None \
            or not _copies_here(pg, call) or not plain(None, x) or x.size < pg._size:
        return None
    red, seg = remake[1][1], remake[1][3]
    if red.divisor is not None or red.factor is not None:
        return None
    buf, in_place = red.host_steps.work_buffer([x])
    if not in_place or not getattr(buf, "plain_sum", False):
        return None
    sum_ = CmaAllreduce(pg._rank, pg._size, buf, seg, pg._transport.single_copy.tuning)
    if not sum_.summed:
        return None
    return FusedAllreduce(pg, call, x, sum_)


class FusedAllreduce(FusedCall):
    """A repeated allreduce laid out as ``sum_`` (its
    :class:`~numcoll.algorithms.single_copy_reduce.CmaAllreduce`) over the
    array ``x``, as one compiled claim and one compiled call."""

    __slots__ = ("single_copy", "sum", "where", "checks", "where2", "table2", "pids", "extra",
                 "tuning", "key", "_claim", "_copy")

    def __init__(self, pg, call, x, sum_: CmaAllreduce):
        flat = x.reshape(-1)
        super().__init__(pg, call, flat, fused_step.NO_REDUCE, -1, [x], publishes=False)
        self.single_copy = single_copy = pg._transport.single_copy
        # (the plan holds these arrays' addresses: these references keep them alive)
        self.sum = sum_
        self.where, _ = fused_plan(sum_.reduce_scatter)
        itemsize, rank = flat.itemsize, pg._rank
        self.checks = np.array([(READ, q, rank, 0, sum_.n * itemsize) for q in sum_.others],
                               np.int64).reshape(-1, 5)
        self.where2, self.table2 = fused_plan(sum_.allgather)
        self.pids = single_copy.pid_words
        self.extra = extra = np.zeros(fused_sum.EXTRA_WORDS, np.int64)
        extra[fused_sum.WHERE2:fused_sum.WHERE2 + 2] = self.where2.ctypes.data, self.where2.nbytes
        extra[fused_sum.COPIES2:fused_sum.COPIES2 + 2] = self.table2.ctypes.data, len(self.table2)
        scratch = sum_.scratch
        extra[fused_sum.SCRATCH:fused_sum.SCRATCH + 2] = scratch.ctypes.data, scratch.nbytes
        extra[fused_sum.PIECE] = sum_.piece
        extra[fused_sum.CHUNK:fused_sum.CHUNK + 2] = sum_.first, sum_.n
        plan = self.plan
        plan[fused_copy.WHERE:fused_copy.WHERE + 2] = self.where.ctypes.data, self.where.nbytes
        plan[fused_copy.COPIES:fused_copy.COPIES + 2] = self.checks.ctypes.data, len(self.checks)
        plan[fused_copy.PIDS] = self.pids.ctypes.data
        plan[fused_sum.EXTRA] = extra.ctypes.data
        self._claim = fused_copy.entry(fused_copy.claim, flat)
        self._copy = fused_sum.entry(flat)
        # Rank 0 of a measured call says, call by call, which way it goes, for
        # calls keyed as the ordinary path keys them (the bytes it publishes).
        self.tuning = single_copy.tuning if rank == 0 and call.algorithm == "cma_measured" \
            else None
        self.key = measured_key(call.name, sum(v.nbytes for v in sum_.reduce_scatter.ranges
                                               if v is not None))
        if self.lane is not None:  # (a call that completes copied: as the ordinary path says)
            self.lane.algorithm = "cma"

    def _entries(self, x) -> tuple:
        return None, None, None  # (set in __init__: the calls are this class's own)

    def run(self) -> bool:
        """The whole call, as :meth:`FusedCall.run`; False (nothing done) where
        the ordinary path takes it: copies are off on this group (that path
        says why), or rank 0 says the arena this time."""
        if not self.single_copy.usable:
            return False
        tuning = self.tuning
        if tuning is not None and fused_say(tuning, self.key):
            return False  # (the arena, this time: the ordinary path says so to every rank)
        began, before = time.perf_counter(), self.work
        if not run_held(self):
            return False
        work = self.work
        if tuning is not None and (work is None or work is before):  # (copied, not promoted)
            fused_learnt(tuning, self.key, time.perf_counter() - began)
        return True

    def rest(self, comm, work):
        """``run(comm, work)`` of the promoted call: the phases the compiled
        call did not finish, from where it stopped."""
        self.moved()
        if self.pending:
            self.pending = False
            extra, sum_ = self.extra, self.sum
            phase = int(extra[fused_sum.PHASE])
            sum_.reduced = int(extra[fused_sum.REDUCED]) if phase == 1 else sum_.n
            sum_.resume(comm, phase, STATES[self.words[fused_copy.STATE]],
                        self.step + (0 if phase == 1 else 2),
                        self.call.algorithm == "cma_measured")
        return self.outs
