"""A small allreduce as one step of the shared arena.

An allreduce whose message fits one arena slot is one step of
:func:`numcoll.algorithms.shared.allreduce_shared`: publish the array, wait
for every rank's, reduce their slots into it. :class:`ArenaStep` runs that
step with nothing around it -- no work buffer, no round generator, no
checked views: the plan keeps the arena's slots as typed arrays (made once,
at its first run) and the reduction kernel's unchecked entry point, and the
step is two compiled calls of the arena (publish; wait, spinning without the
GIL first) and one kernel call per peer. It serves the ordinary
``allreduce`` (:mod:`.reductions`) and the persistent one
(:mod:`.persistent`), whose ``start()`` publishes and ``wait()`` finishes.

Results are those of ``allreduce_shared`` bit for bit: two ranks combine
``op(mine, peer's)`` (equal on both for commutative ops), more ranks
combine the slots in rank order.
"""

from __future__ import annotations

import numpy as np

from ..memory.reduction import Reduction

__all__ = ["ArenaStep"]


class ArenaStep:
    """The plan of a one-step allreduce of ``dtype`` arrays of ``nbytes``
    with the reduction ``red`` (see the module docstring)."""

    __slots__ = ("kernel", "finish", "rank", "size", "nbytes", "dtype", "slots")

    def __init__(self, red: Reduction, rank: int, size: int, nbytes: int, dtype: np.dtype):
        # The kernel's entry point without its argument checks: its operands
        # are a flat C-contiguous array of its dtype and the arena's
        # 64-byte-aligned slots, as long (the stamp fixes every rank's count).
        self.kernel = red.kernel.unchecked or red.kernel
        self.finish = red.host_steps.finish if red.divisor is not None else None  # AVG
        self.rank, self.size, self.nbytes, self.dtype = rank, size, nbytes, dtype
        self.slots = None  # [set][rank]: the arena's slots as typed arrays

    @staticmethod
    def plan(ctx, algorithm: str, red: Reduction, first: np.ndarray, count: int):
        """The step for ``count`` arrays like ``first`` reduced by ``red``, if one
        step does it: the ``shared`` algorithm, one host array that travels as
        it is (no float16 widening, no premul factor) and fits a slot; else None."""
        if algorithm != "shared" or count != 1 or ctx.size == 1 or red.widen \
                or red.factor is not None or type(first) is not np.ndarray \
                or first.nbytes > ctx.cfg.arena_slot_nbytes:
            return None
        return ArenaStep(red, ctx.rank, ctx.size, first.nbytes, first.dtype)

    def publish(self, comm, flat: np.ndarray) -> int:
        """Publish ``flat`` (never blocks); the step, for :meth:`complete`."""
        return comm.shared_publish(flat.view(np.uint8))

    def complete(self, comm, step: int, flat: np.ndarray, waited: bool = False) -> None:
        """Wait for every rank's ``step`` (unless ``waited``), then reduce their
        slots into ``flat``."""
        if not waited:
            comm.shared_wait(step)
        slots = self.slots
        if slots is None:
            slots = self.slots = [[s[:self.nbytes].view(self.dtype) for s in both]
                                  for both in comm.shared_slots()]
        theirs, kernel = slots[step & 1], self.kernel
        if self.size == 2:
            kernel(flat, theirs[1 - self.rank])
        else:
            if self.rank:
                np.copyto(flat, theirs[0])
            for q in range(1, self.size):
                kernel(flat, theirs[q])
        if self.finish is not None:
            self.finish(flat)

    def run(self, comm, flat: np.ndarray) -> None:
        """The whole step (publish and wait: one compiled call)."""
        self.complete(comm, comm.shared_step(flat.view(np.uint8)), flat, waited=True)
