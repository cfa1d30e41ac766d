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

__all__ = ["OPS", "NO_REDUCE", "BROADCAST", "STARTED", "COMPLETED", "MOVED",
           "publish", "finish", "step", "combine"]

#: Reduction codes the fused step knows (others take the ordinary path).
OPS = {"SUM": 0, "PRODUCT": 1, "MIN": 2, "MAX": 3}
#: A step that moves no data (a barrier).
NO_REDUCE = -1
#: A step whose non-root ranks copy the root's slot (a broadcast; root in ``arg``).
BROADCAST = -2
#: States of a lane row (see the flight recorder's ``Lane``).
STARTED, COMPLETED, MOVED = 1, 2, 4


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
        return
    if rank != 0:
        s = slots[0]
        for i in range(n):
            x[i] = s[i]
    for q in range(1, size):
        s = slots[q]
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
def _lane_open(lane, meta, seq):
    i = meta[0] % lane.shape[0]
    meta[0] += 1
    meta[1] = i
    row = lane[i]
    row[0] = seq
    row[1] = _monotonic_ns()
    row[2] = 0
    row[3] = STARTED
    return i


@njit(nogil=True, cache=True)
def publish(region, ctrl, rank, step, header, seq, stamp0, stamp1, payload, nbytes, lane, meta):
    """This rank's part of ``step`` (its header and ``nbytes`` of ``payload``),
    its lane row opened (started). Never blocks."""
    _lane_open(lane, meta, seq)
    _put(region, ctrl, rank, step, header, seq, stamp0, stamp1, payload, nbytes, nbytes)


@njit(nogil=True, cache=True)
def finish(region, ctrl, rank, size, step, first_header, stride, seq, stamp0, stamp1,
           spin_until_ns, yield_until_ns, x, slots, op, root, lane, meta):
    """Wait for every rank's ``step`` (as ``arena._wait``), then :func:`combine`
    and close the lane row. Returns ``_wait``'s answer: -1 done; else the
    step is not finished (the caller's slow wait takes over, then combines)."""
    got = _wait(region, ctrl, size, step, first_header, stride, seq, stamp0, stamp1,
                spin_until_ns, yield_until_ns)
    if got == -1:
        combine(x, slots, rank, size, op, root)
        row = lane[meta[1]]
        row[2] = _monotonic_ns()
        row[3] = COMPLETED
    return got


@njit(nogil=True, cache=True)
def step(region, ctrl, rank, size, step, first_header, stride, seq, stamp0, stamp1,
         payload, nbytes, spin_ns, yield_ns, x, slots, op, root, lane, meta):
    """:func:`publish` then :func:`finish`: a whole blocking call in one."""
    _lane_open(lane, meta, seq)
    now = lane[meta[1], 1]
    _put(region, ctrl, rank, step, first_header + rank * stride, seq, stamp0, stamp1,
         payload, nbytes, nbytes)
    return finish(region, ctrl, rank, size, step, first_header, stride, seq, stamp0, stamp1,
                  now + spin_ns, now + spin_ns + yield_ns, x, slots, op, root, lane, meta)
