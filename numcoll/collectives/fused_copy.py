"""A repeated single-copy call's three phases as one compiled start.

The single-copy algorithms (:mod:`numcoll.algorithms.single_copy`) take two
arena steps around their copies: *where* (every rank publishes the address
and length of what a peer reads), the ``process_vm_readv`` copies, and
*done*. :func:`transports.shm.single_copy_steps.exchange` already runs the
three in one compiled call, but a call still pays the ordinary path around
it: the checks, the plan, the group's Work and Comm, the *where* and the
copy table built anew -- 35-50 µs of Python on 2 ranks, and the lines of the
buffers it pushes out of the caches. :func:`start` is the whole call for a
repeat of the same arrays (:class:`numcoll.fast.copy.FusedCopy`), on the
plan of :mod:`.fused_step`: claim the group's next number and the *where*
step, copy this rank's own part into the output (out of place), run the
three phases with the *where* and the copy table made once, claim the *done*
step once it is published, close the flight recorder's row.

It publishes exactly the bytes of the ordinary path, so ranks on either path
meet at the same steps. A start that does not finish -- a peer later than the
spin phase, a peer's *where* not what this rank expects, a copy refused, a
refusal published -- returns where it stopped (its index in
:data:`transports.shm.single_copy_steps.STATES`, above 0), keeping its
claim, and the group finishes the call from that phase on the ordinary path
(:meth:`numcoll.fast.copy.FusedCopy.rest`).
"""

from __future__ import annotations

import numpy as np
from numba import carray, njit, typeof, types

from transports.shm.ring import _memcpy
from transports.shm.single_copy_steps import BEGIN, DONE, DONE_OPEN, _exchange

from .fused_step import (CTRL_NBYTES, FIRST, NBYTES, NOT_TAKEN, NOW_SEQ, NOW_STEP, OWN, RANK,
                         REGION, REGION_NBYTES, SIZE, SOURCE, SPIN, STAMP, STEPS, STRIDE, YIELD,
                         _claim, _ended, _lane_close, _lane_open, _plan_at, _pointer)

__all__ = ["WHERE", "COPIES", "PIDS", "STATE", "start", "claim", "copy", "wait", "entry",
           "point"]

#: The plan's words (:mod:`.fused_step`'s, with words 20-25, which a move's
#: plan uses, for these): the *where* to publish (address, bytes), the copy
#: table (address, rows of ``(kind, peer, entry, local address, nbytes)``),
#: the ranks' pids (address), and where the last start stopped (its state).
WHERE, COPIES, PIDS, STATE = 20, 22, 24, 25
#: No deadline inside the calls: their waits end with the spin (and yield) phases.
_NO_DEADLINE = 1 << 62


@njit(nogil=True, cache=True, inline="always")
def _phases(plan, x, spin_ns, polls_ns, begin):
    """This rank's own part into ``x`` (OWN), then the *where* step, the
    copies and the *done* step of the call the plan claimed, each wait
    ``spin_ns`` busy then ``polls_ns`` yielding at most; the *done* step
    claimed once published. ``begin``: BEGIN, or the state of an earlier
    call whose wait this one goes on with (WHERE_OPEN, DONE_OPEN). The
    state it ended in (DONE or where it stopped), also kept in the plan's
    STATE word."""
    step, seq = plan[NOW_STEP], plan[NOW_SEQ]
    rank, size, nbytes = plan[RANK], plan[SIZE], plan[NBYTES]
    region = carray(_pointer(plan[REGION], np.uint8), (plan[REGION_NBYTES],))
    where = carray(_pointer(plan[WHERE], np.uint8), (plan[WHERE + 1],))
    copies = carray(_pointer(plan[COPIES], np.int64), (plan[COPIES + 1], 5))
    pids = carray(_pointer(plan[PIDS], np.int64), (size,))
    if plan[OWN] and begin == BEGIN:
        _memcpy(x, rank * nbytes, carray(_pointer(plan[SOURCE], np.uint8), (nbytes,)), 0,
                nbytes)
    state = _exchange(region, region[:plan[CTRL_NBYTES]].view(np.int64), rank, size, step,
                      plan[FIRST:FIRST + 2], plan[STRIDE], seq, plan[STAMP], plan[STAMP + 1],
                      where, copies, pids, spin_ns, polls_ns, _NO_DEADLINE, begin)
    if state == DONE or state == DONE_OPEN:  # the *done* step is published: claimed too
        carray(_pointer(plan[STEPS], np.int64), (1,))[0] = step + 2
    plan[STATE] = state
    return state


# Without nogil, as fused_step.start: the claim and the spin phase hold the GIL.
@njit(cache=True)
def start(plan_address, x, spin_ns):
    """Claim the group's next number and step (NOT_TAKEN if it may not:
    :func:`.fused_step._claim`), open the lane row, then the call's phases
    (:func:`_phases`), each wait ``spin_ns`` at most (where the group does
    not spin, ``spin_ns`` of yielding polls). Returns -1 done (or DONE_HELD:
    done, a message of a call not yet taken held); else the state it stopped
    in (the caller finishes the call from there)."""
    plan = _plan_at(plan_address)
    if not _claim(plan):
        return NOT_TAKEN
    _lane_open(plan, plan[NOW_SEQ])
    spin, polls = (spin_ns, 0) if plan[SPIN] > 0 else (0, spin_ns)
    if _phases(plan, x, spin, polls, BEGIN) != DONE:
        return plan[STATE]
    _lane_close(plan)
    return _ended(plan, -1)


@njit(cache=True)
def claim(plan_address):
    """Only the claim and the lane row of a call whose copies are too long
    to make holding the GIL (:func:`copy`, next, makes them): 0, or
    NOT_TAKEN."""
    plan = _plan_at(plan_address)
    if not _claim(plan):
        return NOT_TAKEN
    _lane_open(plan, plan[NOW_SEQ])
    return 0


@njit(nogil=True, cache=True, inline="always")
def _held(plan, x, begin):
    """:func:`_phases` from ``begin`` for a call the group holds, each wait
    the plan's spin and yield phases: -1 done (the lane row closed), else
    the state it stopped in."""
    if _phases(plan, x, plan[SPIN], plan[YIELD], begin) != DONE:
        return plan[STATE]
    _lane_close(plan)
    return -1


@njit(nogil=True, cache=True)
def copy(plan_address, x):
    """The phases of a call :func:`claim` claimed (and the group now holds),
    without the GIL, each wait the plan's spin and yield phases. Returns -1
    done (the lane row closed), else the state it stopped in."""
    return _held(_plan_at(plan_address), x, BEGIN)


@njit(nogil=True, cache=True)
def wait(plan_address, x):
    """The rest of a :func:`start` that stopped waiting for a peer (its
    STATE: WHERE_OPEN or DONE_OPEN) and that the group now holds: the same
    wait, gone on with without the GIL, each the plan's spin and yield
    phases, then what follows it. Returns -1 done (the lane row closed),
    else the state it stopped in."""
    plan = _plan_at(plan_address)
    return _held(plan, x, plan[STATE])


@njit(cache=True)
def point(plan_address, x, source, base):
    """Point a planned call at ``x`` and ``source``, this call's arrays (a
    plan by form, numcoll.fast.forms), where every address the plan copies
    to or from (its copy table) lies in the array whose first byte was
    ``base[0]``, and every address it publishes (its *where*) in the one
    whose first byte was ``base[1]`` -- a broadcast's array (``source`` is
    ``x``), an allgather's output and input: each moves by as much as ``x``,
    or ``source``, lies from there, and ``base`` becomes their first bytes."""
    moved, published = x.ctypes.data - base[0], source.ctypes.data - base[1]
    plan = _plan_at(plan_address)
    if published:
        where = carray(_pointer(plan[WHERE], np.int64), (plan[WHERE + 1] // 8,))
        for i in range(4, where.size - 1, 2):
            if where[i + 1] != 0:  # (a range of no bytes publishes no address)
                where[i] += published
        base[1] += published
    if moved:
        table = carray(_pointer(plan[COPIES], np.int64), (plan[COPIES + 1], 5))
        for r in range(table.shape[0]):
            table[r, 3] += moved
        base[0] += moved


def entry(function, x):
    """The compiled :func:`start`, :func:`claim`, :func:`copy` or :func:`wait` for outputs
    of ``x``'s type, as its bare entry point (called without the
    dispatcher's typing of the arguments, as :func:`.fused_step.entry`)."""
    i64 = types.int64
    return function.compile({start: (i64, typeof(x), i64), claim: (i64,),
                             copy: (i64, typeof(x)), wait: (i64, typeof(x))}[function])
