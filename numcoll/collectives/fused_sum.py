"""A repeated single-copy allreduce's two phases as one compiled call.

The single-copy allreduce (:class:`numcoll.algorithms.single_copy_reduce.CmaAllreduce`)
is two single-copy calls in a row: a reduce-scatter -- *where* (this rank's
chunks for the peers), each peer's chunk of this rank's read and added into
it, *done* -- then an allgather -- *where* (the reduced chunk), every peer's
reduced chunk read, *done*. The ordinary path runs each phase's three steps
in compiled code already, but pays about 150 µs of Python a call around
them on 2 ranks, where a compiled loop of the whole call took 265 µs at
1 MiB and 682 at 4 MiB -- Open MPI's 251-261 and 605-682. :func:`copy` runs
both phases of a claimed call (:func:`.fused_copy.claim`) in one call
without the GIL, with the *where*s, the checks and the copy table made once
(:class:`numcoll.fast.sum.FusedAllreduce`).

It publishes exactly the bytes of the ordinary path, so ranks on either path
meet at the same steps; and it adds in the same order (this rank's part,
then the peers' in rank order: :func:`transports.shm.single_copy_steps.read_sum`),
so every rank ends with the same bits as there. A call that does not finish
returns where it stopped -- its phase, the state of that phase
(:data:`transports.shm.single_copy_steps.STATES`) and, in the first, how many
elements it summed -- and the group finishes it on the ordinary path from
there (:meth:`CmaAllreduce.resume`): a sum is never added twice.
"""

from __future__ import annotations

import numpy as np
from numba import carray, njit, typeof, types

from transports.shm.arena import HEADER_NBYTES, _put
from transports.shm.single_copy_steps import (ARENA, BEGIN, COPIES_OPEN, DONE, DONE_OPEN,
                                              WHERE_HEADER_NBYTES, WHERE_OPEN, _checked, _done,
                                              _exchange, _waited, read_sum)

from .fused_copy import COPIES, PIDS, STATE, WHERE
from .fused_step import (CTRL_NBYTES, FIRST, NOW_SEQ, NOW_STEP, RANK, REGION, REGION_NBYTES,
                         SIZE, SPIN, STAMP, STEPS, STRIDE, YIELD, _lane_close, _plan_at,
                         _pointer)

__all__ = ["EXTRA", "WHERE2", "COPIES2", "PHASE", "REDUCED", "SCRATCH", "PIECE", "CHUNK",
           "EXTRA_WORDS", "copy", "entry"]

#: The plan's word holding the address of the extra words below (a word the
#: fused step's plan leaves free).
EXTRA = 31
#: The extra words: the allgather's *where* (address, bytes) and copy table
#: (address, rows); the phase the last call reached (1, 2) and the elements
#: of this rank's chunk it summed; the scratch (address, bytes) and the
#: elements of a piece; this rank's chunk (first element, elements).
WHERE2, COPIES2, PHASE, REDUCED, SCRATCH, PIECE, CHUNK = 0, 2, 4, 5, 6, 8, 9
EXTRA_WORDS = 11
#: No deadline inside the calls: their waits end with the spin and yield phases.
_NO_DEADLINE = 1 << 62


@njit(nogil=True, cache=True)
def _reduce_scatter(region, ctrl, rank, size, step, firsts, stride, seq, s0, s1, where, checks,
                    pids, mine, scratch, piece, extra, spin_ns, yield_ns):
    """The first phase: publish ``where`` (this rank's chunks for the peers),
    check every peer's (``checks``: rows as a copy table's, one per peer,
    chunk ``rank`` of the right length), read and add every peer's chunk
    ``rank`` into ``mine`` (its REDUCED word: how far), publish *done*. The
    state it ended in."""
    first = firsts[step & 1]
    _put(region, ctrl, rank, step, first + rank * stride, seq, s0, s1, where, where.size,
         where.size)
    if not _waited(ctrl, size, step, seq, s0, s1, spin_ns, yield_ns, _NO_DEADLINE):
        return WHERE_OPEN
    if not _checked(region, first, stride, where[:8].view(np.int64)[0], checks):
        return COPIES_OPEN
    said = first + HEADER_NBYTES + 16  # rank 0's say: copy, or the arena
    if region[said:said + 8].view(np.int64)[0] != 0:
        return ARENA
    peers = np.empty(size - 1, np.int64)
    addresses = np.empty(size - 1, np.int64)
    k = 0
    for q in range(size):
        if q != rank:
            at = first + q * stride + HEADER_NBYTES + WHERE_HEADER_NBYTES + 16 * rank
            peers[k], addresses[k] = q, region[at:at + 8].view(np.int64)[0]
            k += 1
    extra[REDUCED] = read_sum(pids, peers, addresses, mine, scratch, piece, 0)
    if extra[REDUCED] < mine.size:
        return COPIES_OPEN
    return _done(region, ctrl, rank, size, step + 1, firsts, stride, seq, s0, s1, spin_ns,
                 yield_ns, _NO_DEADLINE, True)


@njit(nogil=True, cache=True)
def copy(plan_address, x):
    """Both phases of a call :func:`.fused_copy.claim` claimed (and the group
    now holds), without the GIL, each wait the plan's spin and yield phases.
    Returns -1 done (the lane row closed), else the state the phase in the
    extra PHASE word stopped in (also in the plan's STATE word)."""
    plan = _plan_at(plan_address)
    extra = carray(_pointer(plan[EXTRA], np.int64), (EXTRA_WORDS,))
    steps = carray(_pointer(plan[STEPS], np.int64), (1,))
    step, seq = plan[NOW_STEP], plan[NOW_SEQ]
    rank, size, spin_ns, yield_ns = plan[RANK], plan[SIZE], plan[SPIN], plan[YIELD]
    region = carray(_pointer(plan[REGION], np.uint8), (plan[REGION_NBYTES],))
    ctrl = region[:plan[CTRL_NBYTES]].view(np.int64)
    firsts, stride, s0, s1 = plan[FIRST:FIRST + 2], plan[STRIDE], plan[STAMP], plan[STAMP + 1]
    pids = carray(_pointer(plan[PIDS], np.int64), (size,))
    mine = x[extra[CHUNK]:extra[CHUNK] + extra[CHUNK + 1]]
    scratch = carray(_pointer(extra[SCRATCH], np.uint8), (extra[SCRATCH + 1],)).view(x.dtype)
    extra[PHASE], extra[REDUCED] = 1, 0
    state = _reduce_scatter(
        region, ctrl, rank, size, step, firsts, stride, seq, s0, s1,
        carray(_pointer(plan[WHERE], np.uint8), (plan[WHERE + 1],)),
        carray(_pointer(plan[COPIES], np.int64), (plan[COPIES + 1], 5)), pids, mine, scratch,
        extra[PIECE], extra, spin_ns, yield_ns)
    if state == DONE or state == DONE_OPEN:  # the *done* step is published: claimed too
        steps[0] = step + 2
    if state != DONE:
        plan[STATE] = state
        return state
    extra[PHASE] = 2
    steps[0] = step + 3  # (the allgather's *where*, published next)
    state = _exchange(region, ctrl, rank, size, step + 2, firsts, stride, seq, s0, s1,
                      carray(_pointer(extra[WHERE2], np.uint8), (extra[WHERE2 + 1],)),
                      carray(_pointer(extra[COPIES2], np.int64), (extra[COPIES2 + 1], 5)),
                      pids, spin_ns, yield_ns, _NO_DEADLINE, BEGIN)
    if state == DONE or state == DONE_OPEN:
        steps[0] = step + 4
    if state != DONE:
        plan[STATE] = state
        return state
    plan[STATE] = DONE
    _lane_close(plan)
    return -1


def entry(x):
    """The compiled :func:`copy` for arrays of ``x``'s type, as its bare entry
    point (called without the dispatcher's typing of the arguments, as
    :func:`.fused_step.entry`)."""
    return copy.compile((types.int64, typeof(x)))
