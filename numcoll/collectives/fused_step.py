"""One arena step of a small collective, fused into one compiled call.

A small allreduce, barrier, broadcast or allgather on the shared arena
(:mod:`transports.shm.arena`) is one step: publish this rank's bytes, wait for
every rank's, then combine or copy their slots. :mod:`.arena_step` runs that
step as two or three compiled calls with Python between them, and the group
around it adds its bookkeeping. Here the whole step -- publish, wait, reduce
or copy out, and the flight recorder's entry -- is one compiled function, so
a repeated call (:mod:`numcoll.fast`) costs one call into compiled code and
the few attribute reads that prove nothing changed.

What goes on the wire is exactly the arena step of the ordinary path (the
same header: sequence number, the call's stamp, the byte count), so a rank
on this path and a rank on the ordinary one meet at the same step, and a
rank that runs another call fails both with the usual mismatch error.

Results are those of :class:`.arena_step.ArenaStep` bit for bit: two ranks
combine ``op(mine, peer's)`` (equal on both for commutative ops), more ranks
combine the slots in rank order.

Calling convention
    Everything a call needs but its array is in one int64 *plan* (see the
    word indices below), the arena's memory included, as an address. The
    compiled functions take the plan's address, the array (a barrier: the
    int 0), the step and the sequence number, and :func:`entry` hands the
    caller the compiled overload's entry point for its array's type: calling
    it skips Numba's dispatcher, which would type every argument again on
    every call (an array costs it more than the whole step does). The caller
    owns what the addresses point to (:class:`numcoll.fast.step.FusedCall`
    keeps the plan and the arena's mapping alive) and never passes an array
    of another type (its repeat checks and the persistent request's guard see
    to that).

The flight recorder's entry (:class:`numcoll.diagnostics.flight_recorder.Lane`)
is a row of four int64: the sequence number, the start and end times (the
monotonic clock; the lane converts) and the state, written here: no Record
object per call. A step that does not complete within its wait returns with
the row still "started", and the caller continues (:func:`finish`, or the
arena's slow wait and the group's failure handling in Python).
"""

from __future__ import annotations

import numpy as np
from numba import carray, njit, typeof, types
from numba.extending import intrinsic, overload

from transports.shm.arena import HEADER_NBYTES, _put, _wait
from transports.shm.ring import _memcpy, _monotonic_ns

from ..kernels.cpu_loops import _maximum, _minimum

__all__ = ["OPS", "NO_REDUCE", "BROADCAST", "GATHER", "STARTED", "COMPLETED", "MOVED", "META",
           "SOURCE", "OWN", "GROUP", "HELD", "STEPS", "NOW_SEQ", "NOW_STEP", "ROWS", "GROUP_SEQ",
           "GROUP_BLOCKED", "GROUP_CLAIMED", "GROUP_WORDS", "NOT_TAKEN", "DONE_HELD", "start",
           "finish", "combine", "entry", "point_source"]

#: Reduction codes the fused step knows (others take the ordinary path).
OPS = {"SUM": 0, "PRODUCT": 1, "MIN": 2, "MAX": 3}
#: A step that moves no data (a barrier).
NO_REDUCE = -1
#: A step whose non-root ranks copy the root's slot (a broadcast; root in ``arg``).
BROADCAST = -2
#: A step that copies every rank's slot into its chunk of ``x`` (an allgather:
#: ``x`` is the output's bytes, what a rank publishes comes from ``SOURCE``).
GATHER = -3
#: States of a lane row (see the flight recorder's ``Lane``).
STARTED, COMPLETED, MOVED = 1, 2, 4

#: The plan's words: the control lines' bytes, rank, size, the two sets' first
#: header, the slot stride, the stamp's two words, the payload bytes, spin and
#: yield (ns), the op code, the root, the arena's address and bytes, the
#: plan's own length; then the lane's count and last row (META, META + 1), the
#: address of what this rank publishes if that is not ``x`` (SOURCE; 0: ``x``),
#: whether an allgather copies its own chunk from there into ``x`` (OWN; 0: it
#: is there already, torch's in-place form), words 20-25 for
#: :mod:`.fused_moves` (where its move table and arrays lie), the addresses
#: of the group's words (GROUP, see below), of its mailbox's count of held
#: messages (HELD) and of the arena's step count (STEPS), the sequence number
#: and step the last call claimed (NOW_SEQ, NOW_STEP), and the lane's rows of
#: four words from ROWS.
CTRL_NBYTES, RANK, SIZE, FIRST, STRIDE, STAMP, NBYTES, SPIN, YIELD, OP, ROOT, REGION, \
    REGION_NBYTES, WORDS = 0, 1, 2, 3, 5, 6, 8, 9, 10, 11, 12, 13, 14, 15
META, SOURCE, OWN, GROUP, HELD, STEPS, NOW_SEQ, NOW_STEP, ROWS = \
    16, 18, 19, 26, 27, 28, 29, 30, 32

#: The group's words (``ProcessGroup._fast_words``): its next sequence
#: number; whether a fused call may not run now (something in flight or held,
#: the group poisoned or closed), kept by the group under its lock; and
#: whether a fused call was claimed here and not yet handed to the group
#: (set by the claim, cleared when the call ended within its start or when
#: the group holds it: :func:`numcoll.fast.step.settle`).
GROUP_SEQ, GROUP_BLOCKED, GROUP_CLAIMED = 0, 1, 2
#: How many words the group keeps.
GROUP_WORDS = 3
#: What a start returns besides ``_wait``'s answers (-1 done, a rank, -2 - a
#: rank) and a move's check (-3 - a rank): the group's words say no fused call
#: may run now (nothing was claimed or published); or the call completed but a
#: message of a call not yet taken is held (the group must look at it).
NOT_TAKEN, DONE_HELD = -(1 << 40), -(1 << 40) - 1


#: What a barrier publishes: nothing. A barrier's compiled functions are
#: passed the int 0 in place of an array (Numba's entry point converts an int
#: in less time than it unboxes an array: 0.035 us of a 0.65 us barrier); its
#: start publishes this (a constant, read-only), its finish and combine take
#: :func:`_bytes_of` the int.
_NO_BYTES = np.empty(0, np.uint8)


def _bytes_of(x):
    """``x``, or for an int (a barrier's placeholder) a new empty byte array."""


@overload(_bytes_of, inline="always")
def _bytes_of_typed(x):
    if isinstance(x, types.Integer):
        return lambda x: np.empty(0, np.uint8)
    return lambda x: x


@intrinsic
def _pointer(typingctx, address, dtype):
    """The integer ``address`` as a pointer to ``dtype`` (for ``carray``)."""
    pointer = types.CPointer(dtype.dtype)

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], context.get_value_type(pointer))

    return pointer(address, dtype), codegen


@njit(nogil=True, cache=True, inline="always")
def _plan_at(address):
    """The plan whose address the caller passed (its length is its word WORDS)."""
    words = carray(_pointer(address, np.int64), (ROWS,))
    return carray(_pointer(address, np.int64), (words[WORDS],))


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


@njit(nogil=True, cache=True, inline="always")
def _slot(region, plan, x, step, q):
    """Rank ``q``'s payload of ``step``, typed as ``x``."""
    at = plan[FIRST + (step & 1)] + q * plan[STRIDE] + HEADER_NBYTES
    return region[at:at + x.size * x.itemsize].view(x.dtype)


@njit(nogil=True, cache=True)
def _combine(region, plan, x, step):
    """Reduce (or copy) the step's slots into ``x``, as the plan's op says."""
    n, op, rank, size = x.size, plan[OP], plan[RANK], plan[SIZE]
    if op == NO_REDUCE:
        return
    if op == GATHER:  # (x: bytes, one chunk of plan[NBYTES] per rank)
        chunk = plan[NBYTES]
        for q in range(size):
            if q == rank:  # copied by start(), before it waited, or in place
                continue
            at = plan[FIRST + (step & 1)] + q * plan[STRIDE] + HEADER_NBYTES
            _memcpy(x, q * chunk, region, at, chunk)  # (a slice copy stays a byte loop)
        return
    if op == BROADCAST:
        if rank != plan[ROOT]:
            s = _slot(region, plan, x, step, plan[ROOT])
            for i in range(n):
                x[i] = s[i]
        return
    if size == 2:
        _accumulate(x, _slot(region, plan, x, step, 1 - rank), n, op)
        return
    if rank != 0:
        s = _slot(region, plan, x, step, 0)
        for i in range(n):
            x[i] = s[i]
    for q in range(1, size):
        _accumulate(x, _slot(region, plan, x, step, q), n, op)


@njit(nogil=True, cache=True)
def _wait_and_combine(region, plan, x, step, seq, spin_until_ns, yield_until_ns):
    """Wait for every rank's ``step`` (as ``arena._wait``), then combine and
    close the lane row. Returns ``_wait``'s answer (-1: done)."""
    ctrl = region[:plan[CTRL_NBYTES]].view(np.int64)
    got = _wait(ctrl, plan[SIZE], step, seq, plan[STAMP], plan[STAMP + 1], spin_until_ns,
                yield_until_ns)
    if got == -1:
        _combine(region, plan, x, step)
        _lane_close(plan)
    return got


@njit(nogil=True, cache=True, inline="always")
def _lane_open(plan, seq):
    """Open the flight recorder's next lane row for ``seq`` (started now);
    returns the time it wrote (the monotonic clock, ns)."""
    nrows = (plan.size - ROWS) // 4
    i = plan[META] % nrows
    plan[META] += 1
    plan[META + 1] = i
    at = ROWS + 4 * i
    now = _monotonic_ns()
    plan[at] = seq
    plan[at + 1] = now
    plan[at + 2] = 0
    plan[at + 3] = STARTED
    return now


@njit(nogil=True, cache=True, inline="always")
def _lane_close(plan):
    """Close the lane row :func:`_lane_open` opened last: completed, now."""
    at = ROWS + 4 * plan[META + 1]
    plan[at + 2] = _monotonic_ns()
    plan[at + 3] = COMPLETED


@njit(nogil=True, cache=True, inline="always")
def _held(plan):
    """How many messages of calls not yet taken the group's mailbox holds."""
    return carray(_pointer(plan[HELD], np.int64), (1,))[0]


@njit(nogil=True, cache=True, inline="always")
def _claim(plan):
    """Take the group's next sequence number and the arena's next step for
    this call (into NOW_SEQ and NOW_STEP), unless the group's words say no
    fused call may run now (or one claimed is not yet handed over) or its
    mailbox holds a message of a call not yet taken.

    The caller holds the GIL from here to its return (its start is compiled
    without ``nogil``), so no other thread of this process sees the words
    half-changed, and the group changes them only with the GIL and under its
    lock (:func:`numcoll.fast.step.update_blocked`): a check and claim no
    other Python thread can come between, without taking the group's lock."""
    group = carray(_pointer(plan[GROUP], np.int64), (GROUP_WORDS,))
    if group[GROUP_BLOCKED] != 0 or group[GROUP_CLAIMED] != 0 or _held(plan) != 0:
        return False
    steps = carray(_pointer(plan[STEPS], np.int64), (1,))
    seq, step = group[GROUP_SEQ], steps[0]
    group[GROUP_SEQ] = seq + 1
    group[GROUP_CLAIMED] = 1
    steps[0] = step + 1
    plan[NOW_SEQ] = seq
    plan[NOW_STEP] = step
    return True


@njit(nogil=True, cache=True, inline="always")
def _start_phases(plan, now, wait_ns):
    """Until when a start busy-polls, and until when it polls at all:
    ``wait_ns`` of busy polling; where the group's spin phase is 0 (more
    ranks than CPUs), ``wait_ns`` of polling with ``sched_yield``, so that the
    ranks sharing this CPU run meanwhile."""
    until = now + wait_ns
    return (until, until) if plan[SPIN] > 0 else (now, until)


@njit(nogil=True, cache=True, inline="always")
def _ended(plan, got):
    """A start's answer once it waited: DONE_HELD for a completed call while
    a message of a call not yet taken is held (the group checks it), else
    ``got``. A call that ended here (-1) lets go of its claim; any other
    answer keeps it until the group holds the call."""
    if got == -1:
        if _held(plan) != 0:
            return DONE_HELD
        carray(_pointer(plan[GROUP], np.int64), (GROUP_WORDS,))[GROUP_CLAIMED] = 0
    return got


# Without nogil: start() waits the spin phase at most (microseconds; in a
# group with more ranks than CPUs, CROWDED_WAIT_NS of yielding polls), and
# letting go of the GIL for that long would risk waiting to get it back
# behind another thread (a switch interval) for nothing. finish() may wait
# the whole yield phase, and lets go.
@njit(cache=True)
def start(plan_address, x, spin_ns):
    """Claim the group's next number and step (:func:`_claim`; NOT_TAKEN if
    it may not), open the lane row, publish this rank's part of the step (its
    header and, per the plan, ``x``'s bytes), then wait for the others for
    ``spin_ns`` at most (0: look once; :func:`_start_phases`) and, if they
    are all there, combine.
    Returns ``_wait``'s answer: -1 done; DONE_HELD (done, see :func:`_ended`);
    else :func:`finish` (or the caller's slow wait) takes over."""
    plan = _plan_at(plan_address)
    if not _claim(plan):
        return NOT_TAKEN
    step, seq = plan[NOW_STEP], plan[NOW_SEQ]
    region = carray(_pointer(plan[REGION], np.uint8), (plan[REGION_NBYTES],))
    now = _lane_open(plan, seq)
    rank = plan[RANK]
    payload = x.view(np.uint8) if plan[SOURCE] == 0 else \
        carray(_pointer(plan[SOURCE], np.uint8), (plan[NBYTES],))
    _put(region, region[:plan[CTRL_NBYTES]].view(np.int64), rank, step,
         plan[FIRST + (step & 1)] + rank * plan[STRIDE], seq, plan[STAMP], plan[STAMP + 1],
         payload, plan[NBYTES], plan[NBYTES])
    if plan[OP] == GATHER and plan[OWN]:  # this rank's chunk, while the others catch up
        _memcpy(x, rank * plan[NBYTES], payload, 0, plan[NBYTES])
    spin_until, yield_until = _start_phases(plan, now, spin_ns)
    return _ended(plan, _wait_and_combine(region, plan, x, step, seq, spin_until, yield_until))


@njit(cache=True)
def barrier(plan_address, x, spin_ns):
    """:func:`start` of a barrier (nothing published, nothing combined: the
    plan's op NO_REDUCE, ``x`` the int 0 or an empty array): the same claim,
    lane row, header and wait, without the payload's and the combining's
    branches."""
    plan = _plan_at(plan_address)
    if not _claim(plan):
        return NOT_TAKEN
    step, seq = plan[NOW_STEP], plan[NOW_SEQ]
    region = carray(_pointer(plan[REGION], np.uint8), (plan[REGION_NBYTES],))
    ctrl = region[:plan[CTRL_NBYTES]].view(np.int64)
    now = _lane_open(plan, seq)
    rank, s0, s1 = plan[RANK], plan[STAMP], plan[STAMP + 1]
    _put(region, ctrl, rank, step, plan[FIRST + (step & 1)] + rank * plan[STRIDE], seq, s0, s1,
         _NO_BYTES, 0, 0)
    spin_until, yield_until = _start_phases(plan, now, spin_ns)
    got = _wait(ctrl, plan[SIZE], step, seq, s0, s1, spin_until, yield_until)
    if got == -1:
        _lane_close(plan)
    return _ended(plan, got)


@njit(nogil=True, cache=True)
def finish(plan_address, x, step, seq):
    """The rest of a :func:`start` that returned before every rank was there:
    wait with the plan's spin and yield phases from now, then combine."""
    plan = _plan_at(plan_address)
    region = carray(_pointer(plan[REGION], np.uint8), (plan[REGION_NBYTES],))
    spin_until = _monotonic_ns() + plan[SPIN]
    return _wait_and_combine(region, plan, _bytes_of(x), step, seq, spin_until,
                             spin_until + plan[YIELD])


@njit(nogil=True, cache=True)
def combine(plan_address, x, step):
    """Only the combining of ``step`` (after the caller's own wait for it)."""
    plan = _plan_at(plan_address)
    _combine(carray(_pointer(plan[REGION], np.uint8), (plan[REGION_NBYTES],)), plan,
             _bytes_of(x), step)


@njit(nogil=True, cache=True)
def point_source(plan_address, x, source):
    """Point an allgather's plan (``x``: its output's bytes) at ``source``,
    this call's input: SOURCE its address, OWN whether it is not the output's
    own chunk (torch's in-place form: nothing to copy). -1, the plan
    untouched, if ``source`` overlaps ``x`` other than as that chunk; else 0.
    (Compiled: ``ndarray.ctypes.data`` takes 1.7 us in Python, this call 0.5.)"""
    plan = _plan_at(plan_address)
    at, nbytes, first = source.ctypes.data, source.nbytes, x.ctypes.data
    own = first + plan[RANK] * nbytes
    if at != own and at < first + x.nbytes and first < at + nbytes:
        return -1
    plan[SOURCE] = at
    plan[OWN] = at != own
    return 0


def entry(function, x):
    """The compiled ``function`` (:func:`start`, :func:`barrier`, :func:`finish`
    or :func:`combine`) for arrays of ``x``'s type (an int: a barrier's, which
    passes 0 for its array), as its bare entry point:
    compiled (or loaded from Numba's cache) now, called without the
    dispatcher's typing of the arguments."""
    i64 = types.int64
    rest = {start: (i64,), barrier: (i64,), finish: (i64, i64), combine: (i64,)}[function]
    return function.compile((i64, typeof(x)) + rest)
