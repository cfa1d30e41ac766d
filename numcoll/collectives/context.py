"""What a collective needs of its group, passed explicitly.

Every collective in this package is a *builder*: ``build(ctx, <the call's
arguments>) -> (Call, run)``. It checks the arguments, works out (or takes
from ``ctx.plans``) the algorithm, segment size and reduction plan, builds
the :class:`~numcoll.call.Call`, and returns it with ``run(comm, work)``, the
closure the group runs when the call's turn comes. A builder whose run can
be made again for the same arrays without their checks marks it:
``run.remake = (function, planned)``, ``planned`` holding every check's result
and no array, ``function(planned, *arrays)`` making the same run (a repeat
of a large call then skips the builder: :mod:`numcoll.fast.replay`; an
attribute set in the builder, not a helper here, so that a small call's path
enters no more files). A builder reads nothing but its arguments and this
context, and never calls the group: the
:class:`~numcoll.ProcessGroup` (or the module API) hands ``(call, run)`` to
``ProcessGroup.submit``. So a call flows one way: group -> builder, then
group -> executor -> ``run`` -> algorithm -> comm -> transport.

The plan cache
--------------
Most of a small call's cost is working out what a repeated call already
worked out. ``ctx.plans`` keeps those plans -- one bounded, least-recently-used
table for every collective of the group, keyed by everything a plan depends
on (collective, dtypes, shapes, op, root, options). A hit costs two dict
operations, both in C (``plans.get``; ``plans.move_to_end``)::

    plan = ctx.plans.get(key)
    if plan is None:
        plan = ctx.keep(key, <build the plan>)
    else:
        ctx.plans.move_to_end(key)

(:func:`cached` wraps that for builders off the hot path.) Builders put
hashable stand-ins in a key (an op's ``_key``, not the op, whose ``__hash__``
is Python code); an option of the wrong type that cannot be hashed is refused
by :func:`check_options` with the option's own message.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable

from .. import config as _config
from ..algorithms.levels import Topology
from ..memory.reduction import Reduction
from .checks import timeout_seconds
from .choice import NO_SINGLE_COPY, Choice, choose, segment_count

__all__ = ["GroupContext", "cached", "check_options"]


class GroupContext:
    """A group as its collectives see it: ``rank``, ``size``, ``cfg`` (the
    :class:`numcoll.config.Config` in force), ``timeout_s`` (the default
    deadline), ``settings`` (the configuration's fingerprint, which every
    :class:`~numcoll.call.Call` stamps) and the plan cache ``plans``. Owned by
    one ProcessGroup."""

    __slots__ = ("rank", "size", "cfg", "timeout_s", "plans", "plans_kept", "_reductions",
                 "settings", "shared_memory", "topology", "in_process", "_device_peers",
                 "single_copy")

    def __init__(self, rank: int, size: int, cfg: _config.Config, timeout_s: float):
        self.rank, self.size, self.cfg, self.timeout_s = rank, size, cfg, timeout_s
        #: What every Call of this group stamps: ranks whose settings differ fail
        #: at their first call (:func:`numcoll.config.fingerprint`).
        self.settings = _config.fingerprint(cfg)
        #: The transport's ``shared_memory`` (:mod:`numcoll.memory.shared`), where
        #: the group also has a shared arena; else None (see :meth:`attach`).
        self.shared_memory = None
        #: Whether the ranks are threads of this process (the transport says).
        self.in_process = False
        self._device_peers = ""   # not asked yet: see device_peers()
        #: Which ranks share a host (:class:`numcoll.algorithms.levels.Topology`),
        #: on groups whose transport knows it (``hier``); else None.
        self.topology = None
        #: The transport's ``single_copy`` (reading the peers' memory where it
        #: lies), where the group also has a shared arena; else None.
        self.single_copy = None
        self.plans: OrderedDict = OrderedDict()
        self.plans_kept = cfg.call_plans_kept
        self._reductions: dict = {}  # (op, dtype, on device) -> Reduction

    def keep(self, key, plan):
        """Keep ``plan`` under ``key`` (evicting the least recently used plan
        beyond ``plans_kept``) and return it."""
        plans = self.plans
        plans[key] = plan
        if len(plans) > self.plans_kept:
            plans.popitem(last=False)
        return plan

    def set_timeout(self, timeout_s: float) -> None:
        """A new default deadline: plans hold calls stamped with the old one."""
        self.timeout_s = timeout_s
        self.plans.clear()

    def attach(self, transport):
        """What this group's ``transport`` offers the collectives: with ``hosts``
        (the hier transport: its arena is each host's) the group's
        :class:`~numcoll.algorithms.levels.Topology`, for the two-level
        algorithms (the group-wide shared ones go, where it spans hosts);
        without, and without a shared arena, no shared algorithms (and no
        shared arrays: their collectives synchronise on the arena). Returns
        the topology, or None."""
        self.in_process = bool(getattr(transport, "in_process", False))
        hosts = getattr(transport, "hosts", None)
        if hosts is not None:
            self.topology = Topology(hosts, self.rank, self.cfg.arena_slot_nbytes)
            self.plans.clear()
        elif transport.arena is None:
            if self.cfg.arena_slot_nbytes:
                self.disable_arena()  # no shared memory between these ranks
        else:
            self.shared_memory = transport.shared_memory
            self.single_copy = transport.single_copy
        return self.topology

    def disable_arena(self) -> None:
        """This group's transport has no shared arena: no shared algorithms."""
        self.cfg = _config.replace(self.cfg, arena_slot_nbytes=0)
        self.settings = _config.fingerprint(self.cfg)
        self.plans.clear()

    # -- what plans are made of ------------------------------------------------------
    def timeout_for(self, opts, op_name: str) -> float:
        """The deadline in seconds for a call with options ``opts`` (the group's
        default unless ``opts.timeout`` is set; it must be a positive timedelta)."""
        t = getattr(opts, "timeout", None)
        return self.timeout_s if t is None else timeout_seconds(t, op_name)

    def reduction(self, op, dtype, name: str, on_device: bool) -> Reduction:
        """The (op, dtype) plan: checks and a compiled kernel, made once per group."""
        key = (op, dtype, on_device)
        red = self._reductions.get(key)
        if red is None:
            red = self._reductions[key] = Reduction(op, dtype, self.size, self.cfg.half_wire,
                                                    name, device=on_device)
        return red

    def choose(self, collective: str, requested, nbytes: int, shared: bool = True,
               device: bool = False, uneven: bool = False) -> Choice:
        """The algorithm for ``collective`` on ``nbytes`` bytes (see :func:`choose`);
        ``device``: the arrays are CUDA arrays; ``uneven``: an ``all_to_all_single``."""
        single_copy = self.single_copy
        return choose(self.cfg, collective, requested, nbytes, self.size, shared, self.topology,
                      self.device_peers() if device else "host arrays",
                      NO_SINGLE_COPY if single_copy is None else single_copy.refused, uneven)

    def device_peers(self) -> str | None:
        """None if the ranks can address each other's device memory (threads of
        one process, or processes with CUDA IPC), else why not. Asked only for
        device arrays (numba.cuda is loaded then), once per group."""
        why = self._device_peers
        if why == "":
            if self.cfg.cuda_ipc == "off":
                why = "NUMCOLL_CUDA_IPC=off"
            elif self.in_process:
                why = None
            else:
                from ..cuda.ipc import supported  # lazy: loads numba.cuda

                why = supported()
            self._device_peers = why
        return why

    def segment(self, itemsize: int) -> int:
        """Elements per segment for arrays of ``itemsize`` bytes."""
        return segment_count(self.cfg, itemsize)


def check_options(opts, op_name: str) -> None:
    """``TypeError`` naming the option, for options no plan key can hold."""
    algorithm, timeout = opts.algorithm, opts.timeout
    if algorithm is not None and not isinstance(algorithm, str):
        raise TypeError(f"{op_name}: algorithm must be a str, got {type(algorithm).__name__}")
    if timeout is not None:
        timeout_seconds(timeout, op_name)


def cached(ctx: GroupContext, key: tuple, opts, op_name: str, build: Callable, *args):
    """``ctx``'s plan for ``key`` (which holds ``opts``'s algorithm and
    timeout), built with ``build(*args)`` on a miss."""
    try:
        plan = ctx.plans.get(key)
    except TypeError:  # an unhashable option
        check_options(opts, op_name)
        raise
    if plan is None:
        return ctx.keep(key, build(*args))
    ctx.plans.move_to_end(key)
    return plan
