"""One arena step of a small data-moving collective, fused into one compiled call.

:mod:`.fused_step` fuses the one-step allreduce, reduce, broadcast, barrier
and allgather. This module does the same for the collectives that move blocks
between ranks in patterns of their own -- gather, scatter, alltoall -- and for
reduce_scatter, when the ordinary ``shared`` algorithm
(:mod:`numcoll.algorithms.shared`) would move the whole call in one step.

A call is described once, when it is planned, as a table of *moves*, one
row of five int64 each: ``(kind, rank, src, dst, nbytes)``:

- ``PACK``: ``nbytes`` of the input from byte ``src`` into this rank's slot
  at byte ``dst`` (before publishing);
- ``WORD``: the value ``src`` as an int64 into this rank's slot at ``dst``
  (alltoall's table of counts);
- ``LOCAL``: ``nbytes`` of the input from ``src`` into the output at ``dst``
  (this rank's own block; done before waiting, while the peers catch up);
- ``UNPACK``: ``nbytes`` of rank ``rank``'s slot from ``src`` into the
  output at ``dst`` (after every rank published);
- ``CHECK``: rank ``rank``'s slot must hold the int64 ``nbytes`` at ``src``
  (alltoall: what the peer sends this rank is what this rank expects); a
  mismatch returns ``-3 - rank`` before anything is unpacked, and the caller
  reports it on the ordinary path;
- ``REDUCE``: the reduction, in rank order, of every rank's slot from byte
  ``src`` on (``nbytes`` bytes) into the output from byte ``dst`` (reduce_scatter:
  this rank's share; combined as ``_combine`` of the ``shared`` algorithm
  does, so results are the same bits).

Every copy is the one the ``shared`` algorithm makes, into the same places
of the same slots, with the same header: a rank on this path and a rank on
the ordinary one meet at the same step and read each other's slots alike.
"""

from __future__ import annotations

import numpy as np
from numba import carray, njit, typeof, types

from transports.shm.arena import HEADER_NBYTES, _put, _wait
from transports.shm.ring import _memcpy, _monotonic_ns

from .fused_step import (CTRL_NBYTES, FIRST, NBYTES, NOT_TAKEN, NOW_SEQ, NOW_STEP, OP, RANK,
                         REGION, REGION_NBYTES, SIZE, SPIN, STAMP, STRIDE, YIELD, _accumulate,
                         _claim, _ended, _lane_close, _lane_open, _plan_at, _pointer,
                         _start_phases)

__all__ = ["PACK", "WORD", "LOCAL", "UNPACK", "CHECK", "REDUCE", "MOVES", "INP", "OUT", "step",
           "finish", "unpack", "entry", "point"]

PACK, WORD, LOCAL, UNPACK, CHECK, REDUCE = 0, 1, 2, 3, 4, 5

#: The plan's words (beside :mod:`.fused_step`'s) that say where the move
#: table (its address and rows) and the input and output bytes (address and
#: length each) lie, so that a call passes the plan's address and the typed
#: output only: every array more that Numba unboxes costs a call about 0.05 us
#: (and its dispatcher, typing them, 0.5 us).
MOVES, INP, OUT = 20, 22, 24


@njit(nogil=True, cache=True)
def _pack(region, plan, moves, x, out, step):
    """The moves before publishing: PACK, WORD and LOCAL rows."""
    mine = plan[FIRST + (step & 1)] + plan[RANK] * plan[STRIDE] + HEADER_NBYTES
    for i in range(moves.shape[0]):
        kind, src, dst, n = moves[i, 0], moves[i, 2], moves[i, 3], moves[i, 4]
        if kind == PACK:
            _memcpy(region, mine + dst, x, src, n)
        elif kind == WORD:
            region[mine + dst:mine + dst + 8].view(np.int64)[0] = src
        elif kind == LOCAL:
            _memcpy(out, dst, x, src, n)


@njit(nogil=True, cache=True)
def unpack(region, plan, moves, out, typed_out, step):
    """The moves after every rank published ``step``: CHECK rows first, then
    UNPACK and REDUCE rows. Returns -1, or ``-3 - q`` if rank ``q``'s slot
    fails a CHECK (nothing is written then). ``typed_out`` is the output in
    the call's dtype, for REDUCE rows."""
    base = plan[FIRST + (step & 1)] + HEADER_NBYTES
    stride = plan[STRIDE]
    for i in range(moves.shape[0]):
        if moves[i, 0] == CHECK:
            q, at = moves[i, 1], base + moves[i, 1] * stride + moves[i, 2]
            if region[at:at + 8].view(np.int64)[0] != moves[i, 4]:
                return -3 - q
    for i in range(moves.shape[0]):
        kind, q, src, dst, n = moves[i, 0], moves[i, 1], moves[i, 2], moves[i, 3], moves[i, 4]
        if kind == UNPACK:
            _memcpy(out, dst, region, base + q * stride + src, n)
        elif kind == REDUCE:
            _reduce(region, typed_out, plan, base + src, dst, n)
    return -1


@njit(nogil=True, cache=True)
def _reduce(region, out, plan, at, dst, nbytes):
    """``out``'s ``nbytes`` from byte ``dst`` := the rank-order reduction of
    every rank's slot from byte ``at`` of rank 0's (``out`` already holds
    this rank's own part), as the ``shared`` algorithm's ``_combine``: two
    ranks combine the peer's part into their own; with more, rank 0 starts
    from its own, the others from rank 0's slot, then ranks 1.. are combined
    in order. The slots are read as contiguous arrays of ``out``'s dtype (so
    the loops vectorise)."""
    size, rank, op, stride = plan[SIZE], plan[RANK], plan[OP], plan[STRIDE]
    first = dst // out.itemsize
    n = nbytes // out.itemsize
    mine = out[first:first + n]
    if size == 2:
        q = at + (1 - rank) * stride
        _accumulate(mine, region[q:q + nbytes].view(out.dtype), n, op)
        return
    if rank != 0:
        s = region[at:at + nbytes].view(out.dtype)
        for i in range(n):
            mine[i] = s[i]
    for q in range(1, size):
        _accumulate(mine, region[at + q * stride:at + q * stride + nbytes].view(out.dtype),
                    n, op)


@njit(nogil=True, cache=True)
def _wait_and_unpack(region, plan, moves, out, typed_out, step, seq, spin_until, yield_until):
    """Wait for every rank's part of ``step`` until ``yield_until``, then
    unpack and close the lane row: -1 done; else ``_wait``'s answer or
    :func:`unpack`'s mismatch."""
    ctrl = region[:plan[CTRL_NBYTES]].view(np.int64)
    got = _wait(ctrl, plan[SIZE], step, seq, plan[STAMP], plan[STAMP + 1], spin_until,
                yield_until)
    if got == -1:
        got = unpack(region, plan, moves, out, typed_out, step)
        if got == -1:
            _lane_close(plan)
    return got


@njit(nogil=True, cache=True, inline="always")
def _arrays(plan_address):
    """The plan at ``plan_address`` and the region, move table, input and
    output bytes whose addresses it holds."""
    plan = _plan_at(plan_address)
    region = carray(_pointer(plan[REGION], np.uint8), (plan[REGION_NBYTES],))
    moves = carray(_pointer(plan[MOVES], np.int64), (plan[MOVES + 1], 5))
    x = carray(_pointer(plan[INP], np.uint8), (plan[INP + 1],))
    out = carray(_pointer(plan[OUT], np.uint8), (plan[OUT + 1],))
    return plan, region, moves, x, out


# (Without nogil, as fused_step.start: its claim counts on holding the GIL.)
@njit(cache=True)
def step(plan_address, typed_out, spin_ns):
    """A call's start: claim the group's next number and step (NOT_TAKEN if
    it may not: :func:`.fused_step._claim`), pack, publish, wait ``spin_ns``
    at most for the others and, if they are all there, unpack and close the
    lane row. Returns -1 done (or DONE_HELD: done, a message of a call not
    yet taken held); else the step is published but not finished
    (:func:`finish`, or the caller's slow wait and then :func:`unpack`, takes
    over), or :func:`unpack`'s mismatch. ``typed_out``: the output in the
    call's dtype (read by REDUCE rows); everything else is where the plan
    says."""
    plan, region, moves, x, out = _arrays(plan_address)
    if not _claim(plan):
        return NOT_TAKEN
    step, seq = plan[NOW_STEP], plan[NOW_SEQ]
    now = _lane_open(plan, seq)
    _pack(region, plan, moves, x, out, step)
    ctrl = region[:plan[CTRL_NBYTES]].view(np.int64)
    rank = plan[RANK]
    _put(region, ctrl, rank, step, plan[FIRST + (step & 1)] + rank * plan[STRIDE], seq,
         plan[STAMP], plan[STAMP + 1], x, 0, plan[NBYTES])
    spin_until, yield_until = _start_phases(plan, now, spin_ns)
    return _ended(plan, _wait_and_unpack(region, plan, moves, out, typed_out, step, seq,
                                         spin_until, yield_until))


@njit(nogil=True, cache=True)
def finish(plan_address, typed_out, step, seq):
    """The rest of a :func:`step` that returned before every rank was there:
    wait with the plan's spin and yield phases from now, then unpack."""
    plan, region, moves, x, out = _arrays(plan_address)
    spin_until = _monotonic_ns() + plan[SPIN]
    return _wait_and_unpack(region, plan, moves, out, typed_out, step, seq, spin_until,
                            spin_until + plan[YIELD])


@njit(nogil=True, cache=True)
def point(plan_address, inp, out):
    """Point a planned call at ``inp`` and ``out``, this call's arrays (of the
    sizes it was planned for: a plan by form, numcoll.fast.forms). -1, the
    plan untouched, if they overlap; else 0."""
    plan = _plan_at(plan_address)
    at, to = inp.ctypes.data, out.ctypes.data
    if at < to + out.nbytes and to < at + inp.nbytes:
        return -1
    plan[INP] = at
    plan[OUT] = to
    return 0


def entry(function, typed_out):
    """The compiled :func:`step` or :func:`finish` for outputs of
    ``typed_out``'s type, as its bare entry point (called without the
    dispatcher's typing of the arguments, as :func:`.fused_step.entry`)."""
    i64 = types.int64
    rest = (i64,) if function is step else (i64, i64)
    return function.compile((i64, typeof(typed_out)) + rest)
