"""One arena step of a small collective, fused into one compiled call.

A small allreduce, barrier or broadcast on the shared arena
(:mod:`transports.shm.arena`) is one step: publish this rank's bytes, wait for
every rank's, then combine or copy their slots. :mod:`.arena_step` runs that
step as two or three compiled calls with Python between them, and the group
around it adds its bookkeeping. Here the whole step -- publish, wait, reduce
or copy out, and the flight recorder's entry -- is one compiled function, so
a repeated call (:mod:`.fast_lane`) costs one Numba dispatch and the few
attribute reads that prove nothing changed.

What goes on the wire is exactly the arena step of the ordinary path (the
same header: sequence number, the call's stamp, the byte count), so a rank
on this path and a rank on the ordinary one meet at the same step, and a
rank that runs another call fails both with the usual mismatch error.

Results are those of :class:`.arena_step.ArenaStep` bit for bit: two ranks
combine ``op(mine, peer's)`` (equal on both for commutative ops), more ranks
combine the slots in rank order.

The flight recorder's entry (:class:`numcoll.diagnostics.flight_recorder.Lane`)
is a row of four int64: the sequence number, the start and end times (the
monotonic clock; the lane converts) and the state, written here: no Record
object per call. A step that does not complete within the spin and yield
phases returns with the row still "started", and the caller continues in
Python (the arena's slow wait, the group's failure handling).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from transports.shm.arena import _put, _wait
from transports.shm.ring import _monotonic_ns

from ..kernels.cpu_loops import _maximum, _minimum

__all__ = ["OPS", "NO_REDUCE", "BROADCAST", "STARTED", "COMPLETED", "MOVED", "META", "ROWS",
           "publish", "finish", "complete", "step", "combine"]

#: Reduction codes the fused step knows (others take the ordinary path).
OPS = {"SUM": 0, "PRODUCT": 1, "MIN": 2, "MAX": 3}
#: A step that moves no data (a barrier).
NO_REDUCE = -1
#: A step whose non-root ranks copy the root's slot (a broadcast; root in ``arg``).
BROADCAST = -2
#: States of a lane row (see the flight recorder's ``Lane``).
STARTED, COMPLETED, MOVED = 1, 2, 4


@njit(nogil=True, cache=True, inline="always")
def _accumulate(x, s, n, op):
    """x[:n] = op(x[:n], s[:n]); op 0 SUM, 1 PRODUCT, 2 MIN, else MAX."""
    if op == 0:
        for i in range(n):
            x[i] = x[i] + s[i]
    elif op == 1:
        for i in range(n):
            x[i] = x[i] * s[i]
    elif op == 2:
        for i in range(n):
            x[i] = _minimum(x[i], s[i])
    else:
        for i in range(n):
            x[i] = _maximum(x[i], s[i])


@njit(nogil=True, cache=True)
def combine(x, slots, rank, size, op, root):
    """Reduce (or copy) the step's slots (``slots[q]``: rank q's, typed) into ``x``."""
    n = x.size
    if op == NO_REDUCE:
        return
    if op == BROADCAST:
        if rank != root:
            s = slots[root]
            for i in range(n):
                x[i] = s[i]
        return
    if size == 2:
        s = slots[1 - rank]
        _accumulate(x, s, n, op)
        return
    if rank != 0:
        s = slots[0]
        for i in range(n):
            x[i] = s[i]
    for q in range(1, size):
        s = slots[q]
        _accumulate(x, s, n, op)


#: The fused step's plan: one int64 array (few arguments make a cheap dispatch).
#: Words: the control lines' bytes, rank, size, the two sets' first header,
#: the slot stride, the stamp's two words, the payload bytes, spin and yield
#: (ns), the op code, the root; then the lane's count and last row (META,
#: META + 1) and its rows of four words from ROWS.
CTRL_NBYTES, RANK, SIZE, FIRST, STRIDE, STAMP, NBYTES, SPIN, YIELD, OP, ROOT = \
    0, 1, 2, 3, 5, 6, 8, 9, 10, 11, 12
META, ROWS = 16, 32


@njit(nogil=True, cache=True)
def _lane_open(plan, seq):
    nrows = (plan.size - ROWS) // 4
    i = plan[META] % nrows
    plan[META] += 1
    plan[META + 1] = i
    at = ROWS + 4 * i
    plan[at] = seq
    plan[at + 1] = _monotonic_ns()
    plan[at + 2] = 0
    plan[at + 3] = STARTED
    return plan[at + 1]


@njit(nogil=True, cache=True)
def _put_mine(region, plan, x, step, seq):
    ctrl = region[:plan[CTRL_NBYTES]].view(np.int64)
    rank = plan[RANK]
    header = plan[FIRST + (step & 1)] + rank * plan[STRIDE]
    _put(region, ctrl, rank, step, header, seq, plan[STAMP], plan[STAMP + 1],
         x.view(np.uint8), plan[NBYTES], plan[NBYTES])


@njit(nogil=True, cache=True)
def publish(region, plan, x, step, seq):
    """This rank's part of ``step`` (its header and, per the plan, ``x``'s
    bytes), its lane row opened (started). Never blocks."""
    _lane_open(plan, seq)
    _put_mine(region, plan, x, step, seq)


@njit(nogil=True, cache=True)
def finish(region, plan, x, slots, step, seq, spin_until_ns, yield_until_ns):
    """Wait for every rank's ``step`` (as ``arena._wait``), then :func:`combine`
    ``slots[step % 2]`` into ``x`` and close the lane row. Returns ``_wait``'s
    answer: -1 done; else the step is not finished (the caller's slow wait
    takes over, then combines)."""
    ctrl = region[:plan[CTRL_NBYTES]].view(np.int64)
    got = _wait(region, ctrl, plan[SIZE], step, plan[FIRST + (step & 1)], plan[STRIDE], seq,
                plan[STAMP], plan[STAMP + 1], spin_until_ns, yield_until_ns)
    if got == -1:
        combine(x, slots[step & 1], plan[RANK], plan[SIZE], plan[OP], plan[ROOT])
        at = ROWS + 4 * plan[META + 1]
        plan[at + 2] = _monotonic_ns()
        plan[at + 3] = COMPLETED
    return got


@njit(nogil=True, cache=True)
def complete(region, plan, x, slots, step, seq):
    """:func:`finish` with the plan's spin and yield phases from now (the
    second half of a persistent start)."""
    spin_until = _monotonic_ns() + plan[SPIN]
    return finish(region, plan, x, slots, step, seq, spin_until, spin_until + plan[YIELD])


@njit(nogil=True, cache=True)
def step(region, plan, x, slots, step, seq):
    """:func:`publish` then :func:`finish`: a whole blocking call in one."""
    now = _lane_open(plan, seq)
    _put_mine(region, plan, x, step, seq)
    spin_until = now + plan[SPIN]
    return finish(region, plan, x, slots, step, seq, spin_until, spin_until + plan[YIELD])
