"""Persistent collectives: MPI-4's ``MPI_Allreduce_init`` and its kin, made Pythonic.

::

    req = pg.allreduce_init(x)          # or nc.all_reduce_init(x)
    for step in range(n):
        x[...] = compute()              # contents may change between starts
        req.start()                     # a Work, numbered like any collective
        req.wait()

A persistent request is made by the ordinary builders (:mod:`.reductions`,
:mod:`.movement`, :mod:`.p2p`), once: every argument check, the algorithm,
the reduction plan, the segment size and the call's stamp (its fingerprint)
are worked out at init, and :meth:`PersistentRequest.start` hands the same
``(call, run)`` to the group's ``submit`` again and again. A start takes the
next sequence number like any collective, its record goes to the flight
recorder, and its messages (or arena steps) carry the stamp, so a rank
running something else fails with the usual mismatch error.

What a request holds fixed
    The arrays it was made with: their identity, shape and layout (and, for
    foreign objects such as torch tensors, their memory). A start checks
    that in a few attribute reads (:class:`Guard`) and raises ``ValueError``
    naming the op and what changed, before anything is numbered: never a
    result written to memory the array no longer owns. Contents may change
    freely between a :meth:`~PersistentRequest.wait` and the next start, not
    while a start is in flight (as with MPI).
Small allreduces on the shared arena (:class:`HeldAllreduce`)
    A message that fits one arena slot runs as one step: ``start()``
    publishes the array -- copied into this rank's slot, announced with a
    release store (one compiled call) -- on the caller's thread when the
    group has nothing else in flight, and ``wait()`` waits for the peers'
    steps (spinning without the GIL first) and reduces their slots into the
    array in place, straight from shared memory, in rank order. Nothing is
    looked up, checked or allocated per start but the group's bookkeeping
    (the number, the Work, the flight-recorder record).
"""

from __future__ import annotations

import inspect
import sys
from typing import Callable, NamedTuple

import numpy as np

from ..call import Call
from ..memory.arrays import as_array
from ..options import AllreduceOptions, ReduceOptions
from . import exchange, movement, p2p, reductions
from .arena_step import ArenaStep
from .context import GroupContext

__all__ = ["PersistentRequest", "Plan", "Guard", "HeldAllreduce", "InitMethods",
           "first_half", "allreduce", "broadcast", "reduce", "allgather_into_tensor",
           "reduce_scatter_tensor", "alltoall_base", "barrier"]

_ALLREDUCE_DEFAULTS = AllreduceOptions()


class Plan(NamedTuple):
    """What a persistent request runs: the ordinary builder's ``(call, run)``;
    ``publish(comm)``, the eager first half of an arena call (None: none);
    ``guard``, the arrays it was made with."""

    call: Call
    run: Callable
    publish: Callable | None
    guard: "Guard"


class Guard:
    """The arrays a request was made with, and how to tell that one changed.

    NumPy arrays: the same object with the same shape and strides (an
    ndarray's memory cannot move while the request holds a view of it:
    ``resize`` refuses, ``data`` is read-only). Other objects (torch tensors,
    anything NumPy views): their memory address too, read again at each
    start (``resize_()`` or ``set_()`` on a tensor moves it).
    """

    __slots__ = ("op_name", "_arrays", "_others")

    def __init__(self, op_name: str, objects):
        self.op_name = op_name
        self._arrays: list[tuple] = []
        self._others: list[tuple] = []
        for obj in objects:
            if obj is None:
                continue
            if type(obj) is np.ndarray:
                self._arrays.append((obj, obj.shape, obj.strides))
            else:
                self._others.append((obj, _where(obj)))

    def check(self) -> None:
        """``ValueError`` if an array changed its shape, layout or memory."""
        for obj, shape, strides in self._arrays:
            if obj.shape != shape or obj.strides != strides:
                self._changed(f"shape {shape} and strides {strides}",
                              f"shape {obj.shape} and strides {obj.strides}")
        for obj, where in self._others:
            now = _where(obj)
            if now != where:
                self._changed(_describe(where), _describe(now))

    def _changed(self, then: str, now: str):
        raise ValueError(f"{self.op_name}: an array of this persistent request changed since "
                         f"it was made (it had {then}, it has {now}); a request keeps the "
                         "arrays it was made with, their shape, layout and memory: make a new "
                         "request for other arrays")


def _where(obj) -> tuple:
    """(address, shape, strides) of ``obj``'s memory as NumPy sees it."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(obj, torch.Tensor):
        return obj.data_ptr(), tuple(obj.shape), tuple(obj.stride())
    arr = as_array(obj, "persistent request")
    return arr.__array_interface__["data"][0], arr.shape, arr.strides


def _describe(where: tuple) -> str:
    return f"memory at {where[0]:#x}, shape {where[1]}, strides {where[2]}"


class PersistentRequest:
    """A collective made once and started any number of times.

    Made by ``ProcessGroup.allreduce_init`` and its twins, or the module
    functions ``numcoll.all_reduce_init`` & co. Every rank of the group
    starts it in the same order relative to its other collectives (a start
    takes the next sequence number, as any collective call does).
    """

    __slots__ = ("op_name", "_submit", "_plan", "_work")

    def __init__(self, submit: Callable, plan: Plan):
        self.op_name = plan.guard.op_name
        self._submit = submit
        self._plan = plan
        self._work = None

    def start(self):
        """Start the collective; returns its :class:`~numcoll.Work`.

        Raises ``RuntimeError`` while the previous start has not completed
        (wait for it first: one request runs one call at a time) and
        ``ValueError`` when an array changed (see :class:`Guard`); neither
        takes a sequence number. The arrays must not be written until the
        start completes.
        """
        work = self._work
        if work is not None and not work.future._completed:
            raise RuntimeError(f"{self.op_name}: start() called while the previous start() is "
                               "still in flight; wait() for it first")
        plan = self._plan
        plan.guard.check()
        work = self._work = self._submit(plan.call, plan.run, publish=plan.publish)
        return work

    def wait(self, timeout=None) -> bool:
        """Wait for the last start to complete and raise its error, as
        :meth:`Work.wait <numcoll.Work.wait>` does (``timeout`` bounds this
        wait only). Returns True; at once when it has completed already."""
        work = self._work
        if work is None:
            raise RuntimeError(f"{self.op_name}: wait() before the first start()")
        return work.wait(timeout)

    def is_completed(self) -> bool:
        """Whether the last start has completed (True before the first)."""
        work = self._work
        return work is None or work.future._completed

    @property
    def work(self):
        """The :class:`~numcoll.Work` of the last start (None before the first)."""
        return self._work

    def result(self):
        """The last start's value (its output arrays), waiting for it."""
        return self.wait() and self._work.result()

    def __repr__(self) -> str:
        return f"<numcoll.PersistentRequest {self._plan.call!r}>"


class HeldAllreduce:
    """A persistent allreduce that is one arena step (:class:`.arena_step.ArenaStep`):
    :meth:`publish` is the held start's first half, :meth:`run` the rest --
    or the whole, when the group queued the start behind other calls."""

    __slots__ = ("step", "flat", "outs", "published")

    def __init__(self, step: ArenaStep, flat: np.ndarray, outs: list):
        self.step, self.flat, self.outs = step, flat, outs
        self.published = -1  # the step published by the held start, not yet completed

    def publish(self, comm) -> None:
        self.published = self.step.publish(comm, self.flat)

    def run(self, comm, work):
        step = self.published
        if step < 0:  # queued behind other calls: nothing published yet
            step = self.step.publish(comm, self.flat)
        self.published = -1
        self.step.complete(comm, step, self.flat)
        return self.outs


# -- the builders: each returns a Plan --------------------------------------------
def allreduce(ctx: GroupContext, arrays, opts: AllreduceOptions | None = None, *,
              op=None) -> Plan:
    """Arguments as ``ProcessGroup.allreduce``; on a group with a shared arena,
    a message that fits a slot runs as one step (:class:`HeldAllreduce`)."""
    name = "allreduce_init"
    call, run = reductions.allreduce(ctx, arrays, opts, op)
    objects = arrays if isinstance(arrays, (list, tuple)) else [arrays]
    fast = _held_allreduce(ctx, call, objects, opts or _ALLREDUCE_DEFAULTS, op)
    if fast is not None:
        return Plan(call, fast.run, fast.publish, Guard(name, objects))
    return Plan(call, run, None, Guard(name, objects))


def _held_allreduce(ctx, call, objects, opts, op) -> HeldAllreduce | None:
    """The one-step run for an allreduce of one contiguous NumPy array that
    fits an arena slot (see :meth:`ArenaStep.plan`), or None."""
    arr = objects[0] if len(objects) == 1 else None
    if type(arr) is not np.ndarray or not arr.flags.c_contiguous:
        return None
    red = ctx.reduction(opts.reduce_op if op is None else op, arr.dtype, "allreduce", False)
    step = ArenaStep.plan(ctx, call.algorithm, red, arr, 1)
    return None if step is None else HeldAllreduce(step, arr.reshape(-1), list(objects))


def broadcast(ctx: GroupContext, arrays, opts=None, *, root=None) -> Plan:
    """Arguments as ``ProcessGroup.broadcast``."""
    call, run = movement.broadcast(ctx, arrays, opts, root)
    return Plan(call, run, None, Guard("broadcast_init", _objects(arrays)))


def reduce(ctx: GroupContext, arrays, opts: ReduceOptions | None = None, *, op=None,
           root=None) -> Plan:
    """Arguments as ``ProcessGroup.reduce``."""
    call, run = reductions.reduce(ctx, arrays, opts, op, root)
    return Plan(call, run, None, Guard("reduce_init", _objects(arrays)))


def allgather_into_tensor(ctx: GroupContext, output, input, opts=None) -> Plan:
    """Arguments as ``ProcessGroup.allgather_into_tensor``."""
    call, run = movement.allgather_into_tensor_coalesced(ctx, output, input, opts,
                                                         name="allgather_into_tensor")
    return Plan(call, run, None, Guard("allgather_into_tensor_init", [output, input]))


def reduce_scatter_tensor(ctx: GroupContext, output, input, opts=None) -> Plan:
    """Arguments as ``ProcessGroup.reduce_scatter_tensor``."""
    call, run = reductions.reduce_scatter_tensor_coalesced(ctx, output, input, opts,
                                                           name="reduce_scatter_tensor")
    return Plan(call, run, None, Guard("reduce_scatter_tensor_init", [output, input]))


def alltoall_base(ctx: GroupContext, output, input, output_split_sizes=None,
                  input_split_sizes=None, opts=None) -> Plan:
    """Arguments as ``ProcessGroup.alltoall_base``."""
    call, run = exchange.alltoall_base(ctx, output, input, output_split_sizes,
                                       input_split_sizes, opts)
    return Plan(call, run, None, Guard("alltoall_base_init", [output, input]))


def barrier(ctx: GroupContext, opts=None) -> Plan:
    """Arguments as ``ProcessGroup.barrier``."""
    call, run = p2p.barrier(ctx, opts)
    return Plan(call, run, None, Guard("barrier_init", []))


def _objects(arrays) -> list:
    return list(arrays) if isinstance(arrays, (list, tuple)) else [arrays]


def first_half(publish: Callable, comm, run: Callable) -> Callable:
    """Run ``publish(comm)`` (a held start's first half, on the caller's
    thread); return what is left to run: ``run``, or, if ``publish``
    failed, a run that raises its error (delivered through the Work)."""
    try:
        publish(comm)
    except BaseException as exc:  # noqa: BLE001 - delivered through the Work
        error = exc  # ``exc`` itself is unbound when the except clause ends

        def failed(comm, work):
            raise error

        return failed
    return run


def _group_method(builder: Callable, name: str) -> Callable:
    """``ProcessGroup.<name>``: the persistent twin of a collective method,
    taking its parameters (``builder``'s without the context)."""

    def method(self, *args, **kwargs):
        return self._make_request(builder(self.context, *args, **kwargs))

    signature = inspect.signature(builder)
    params = list(signature.parameters.values())
    self_param = inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)
    method.__signature__ = signature.replace(parameters=[self_param, *params[1:]],
                                             return_annotation="PersistentRequest")
    method.__name__ = method.__qualname__ = name
    method.__doc__ = (f"A persistent :meth:`{name[:-5]}` (MPI's ``MPI_*_init``): every check "
                      "and plan made now, once; ``req.start()`` returns a Work, ``req.wait()`` "
                      f"waits (:class:`~numcoll.PersistentRequest`). {builder.__doc__}")
    return method


class InitMethods:
    """The persistent collectives of :class:`~numcoll.ProcessGroup` (which
    inherits them; they use only its ``submit`` and ``context``): the same
    parameters as the collective they make persistent, and a
    :class:`PersistentRequest` back."""

    __slots__ = ()

    def _make_request(self, plan: Plan) -> PersistentRequest:
        """The request that runs ``plan`` (a group may offer a faster one)."""
        return PersistentRequest(self.submit, plan)

    allreduce_init = _group_method(allreduce, "allreduce_init")
    broadcast_init = _group_method(broadcast, "broadcast_init")
    reduce_init = _group_method(reduce, "reduce_init")
    allgather_into_tensor_init = _group_method(allgather_into_tensor,
                                               "allgather_into_tensor_init")
    reduce_scatter_tensor_init = _group_method(reduce_scatter_tensor,
                                               "reduce_scatter_tensor_init")
    alltoall_base_init = _group_method(alltoall_base, "alltoall_base_init")
    barrier_init = _group_method(barrier, "barrier_init")
