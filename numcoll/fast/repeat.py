"""Blocking small calls that repeat: recognised, and run as one fused step.

Code that never heard of persistent requests calls ``nc.all_reduce(x)`` on
the same small array thousands of times. :class:`Repeats` remembers the last
few such calls of a group (after the ordinary builder checked them and made
their :class:`~numcoll.call.Call`, and the same array came twice) and, when
the next call passes the very
same array -- the same object, shape, strides and dtype, still writable --
with the same op, under the same settings and default deadline, runs it as
the :class:`~numcoll.fast.step.FusedCall` it planned the first time.

Anything else takes the ordinary path with its full checks, never a stale
plan: another array object (even an equal one), a reshaped or re-strided
array, another dtype or op, an array made read-only. A new default timeout
empties the tables (:meth:`Repeats.clear`, from ``ProcessGroup.set_timeout``:
every plan holds its deadline), and a group's configuration is fixed once it
is up, so no call checks either. An ndarray's memory cannot move under a view
the plan holds (``resize`` refuses), so the object's identity pins its memory.

A call the single-copy algorithms run is planned as one compiled start of
its own (:mod:`numcoll.fast.copy`). A call that no fused step or start takes
(larger than a slot, several rounds) is kept instead, on the same terms, as
a :class:`~numcoll.fast.replay.Replay` when its builder can remake its run:
the ordinary submit without the argument checks, the arrays held weakly.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict

import numpy as np

from transports.shm.arena import SharedArena

from ..collectives import fused_step
from ..memory.host import HostBuffer
from . import moves
from .copy import (fused_copy_allgather, fused_copy_alltoall, fused_copy_broadcast,
                   fused_copy_move, fused_copy_rooted, reads_whole)
from .forms import Forms
from .replay import Replay, described
from .step import HAS_GIL, FusedCall, fusable_dtype
from .sum import fused_allreduce

__all__ = ["Repeats", "fusable", "fused_call", "fused_allgather", "rooted_sides"]

#: Calls remembered per group (the oldest is forgotten first).
KEPT = 8
#: Replays remembered per group: more, as a step of a training loop may
#: repeat a dozen large calls, and a replay holds no array (a table cycled
#: through by more calls than it keeps would replay none of them).
REPLAYS_KEPT = 32


class _Seen:
    """One remembered call: what must be unchanged, and its plan."""

    __slots__ = ("x", "op", "shape", "strides", "dtype", "fused", "form")

    def __init__(self, x, op, fused):
        self.x, self.op, self.fused = x, op, fused
        if x is not None:
            self.shape, self.strides, self.dtype = x.shape, x.strides, x.dtype
        # an allgather's input (its ``op``): what must be unchanged of it
        self.form = _form(op) if type(op) is np.ndarray else None


def _form(a) -> tuple:
    return a.shape, a.strides, a.dtype


def fused_call(pg, call, x) -> FusedCall | None:
    """The :class:`FusedCall` of ``call`` (as the ordinary builder made it) on
    array ``x`` (None: a barrier), if one arena step does it: an allreduce or
    reduce with a reduction the fused step knows, a broadcast of one round
    (a ``NUMCOLL_SEGMENT_*`` setting may force several), a barrier. Else None."""
    name, rank = call.name, pg._rank
    if name == "barrier":
        return FusedCall(pg, call, None, fused_step.NO_REDUCE, -1, []) \
            if fusable(pg, call, None) else None
    if x is None or not fusable(pg, call, x):
        return None
    flat, outs, publishes = x.reshape(-1), [x], True
    if name in ("allreduce", "reduce"):
        op = fused_step.OPS.get(call.op) if not call.custom_op else None
        if op is None or name == "reduce" and not _one_round(pg, x):
            return None
        if name == "reduce" and rank != call.root:
            op = fused_step.NO_REDUCE
    elif name == "broadcast" and _one_round(pg, x):
        op, publishes = fused_step.BROADCAST, rank == call.root
    else:
        return None
    return FusedCall(pg, call, flat, op, call.root, outs, publishes)


def fused_allgather(pg, call, out, inp) -> FusedCall | None:
    """The :class:`FusedCall` of ``call``, an ``allgather_into_tensor`` of
    ``inp`` into ``out`` (as the ordinary builder checked and made it), if
    one arena step does it: both C-contiguous NumPy arrays, ``inp`` within a
    slot and one round. Any dtype: the step copies bytes. Else None."""
    if call.name != "allgather_into_tensor" or not fusable(pg, call, None) \
            or type(out) is not np.ndarray or type(inp) is not np.ndarray \
            or not (out.flags.c_contiguous and inp.flags.c_contiguous and out.flags.writeable) \
            or out.dtype != inp.dtype or inp.size == 0 or out.size != inp.size * pg._size \
            or inp.nbytes > pg._transport.arena.slot_nbytes or not _one_round(pg, inp):
        return None
    return FusedCall(pg, call, out.reshape(-1).view(np.uint8), fused_step.GATHER, -1, [out],
                     source=inp.reshape(-1))


#: The data-moving calls planned by form too (numcoll.fast.forms), as move() names them:
#: those of two arrays, and the rooted ones of an array and the root's list.
_BY_FORM = ("reduce_scatter_tensor", "alltoall_base")
_ROOTED = ("gather", "scatter")


def _moved_by_step(pg, call, inp, out, run):
    """The fused arena step of ``call`` (:func:`numcoll.fast.moves.plan`), or
    None: also where its ordinary ``run``, an alltoall, has its blocks read
    whole in a later round (a repeat's plan is then a fused copy)."""
    if call.name in ("alltoall_base", "alltoall") and type(inp) is np.ndarray \
            and inp.flags.c_contiguous:
        flat = inp.reshape(-1)
        n = flat.size // pg._size
        if reads_whole(pg, HostBuffer(flat), [(q * n, n) for q in range(pg._size)],
                       getattr(run, "rest_nbytes", None)):
            return None
    return moves.plan(pg, call, inp, out)


def fused_all_gather(pg, call, inp) -> FusedCall | None:
    """The :class:`FusedCall` of ``call``, an ``all_gather(outs, inp)`` (torch's
    list form, as the ordinary builder checked and made it), gathering into a
    buffer of its own (the caller copies each rank's row out), if one arena
    step does it: ``inp`` a C-contiguous NumPy array within a slot and one
    round. Else None."""
    if call.name != "allgather" or not fusable(pg, call, None) or type(inp) is not np.ndarray \
            or not inp.flags.c_contiguous or inp.size == 0 \
            or inp.nbytes > pg._transport.arena.slot_nbytes or not _one_round(pg, inp):
        return None
    rows = np.empty(pg._size * inp.nbytes, np.uint8)
    return FusedCall(pg, call, rows, fused_step.GATHER, -1, [], source=inp.reshape(-1))


def fused_all_to_all(pg, call, inp, run) -> FusedCall | None:
    """The :class:`~numcoll.fast.moves.FusedMove` of ``call``, an
    ``all_to_all(outs, inps)`` (torch's list form, as the ordinary builder
    checked and made it, ``run`` its run) of arrays like ``inp``, over an
    input and an output buffer of its own (the caller packs and unpacks
    the lists), if one arena step does it. Else None."""
    if type(inp) is not np.ndarray or inp.size == 0:
        return None
    own = np.empty((2, pg._size * inp.size), inp.dtype)
    return _moved_by_step(pg, call, own[0], own[1], run)


def fused_rooted(pg, call, tensor, root_side: bool) -> FusedCall | None:
    """The :class:`~numcoll.fast.moves.FusedMove` of ``call``, a ``gather``
    or ``scatter`` of ``tensor`` (as the ordinary builder checked and made
    it), moving the root's list (``root_side``: this rank is the root)
    through a buffer of its own, if one arena step does it; or, where the
    call reads single-copy, its :func:`~numcoll.fast.copy.fused_copy_rooted`
    over the same buffer. Else None."""
    if type(tensor) is not np.ndarray or not tensor.flags.c_contiguous or tensor.size == 0:
        return None
    own = np.empty((pg._size, tensor.size), tensor.dtype) if root_side else None
    return (moves.plan(pg, call, tensor, own) if call.name == "gather"
            else moves.plan(pg, call, own, tensor)) or fused_copy_rooted(pg, call, tensor, own)


def rooted_sides(name: str, tensor, blocks) -> tuple:
    """A gather's or a scatter's (``name``) flat input and output for a plan
    of its own (:func:`numcoll.fast.moves.plan`): ``tensor``, and the root's
    ``blocks`` where they lie back to back in one array (None off the root);
    and whether such a plan can take them."""
    whole = moves.span(blocks) if blocks else None
    inp, out = (tensor, whole) if name == "gather" else (whole, tensor)
    return inp, out, not blocks or whole is not None


def _one_round(pg, x) -> bool:
    """Whether the arena algorithms move ``x`` in one round (the segment setting
    may force more)."""
    seg = pg.context.segment(x.itemsize)
    return seg is None or x.size <= seg


def fusable(pg, call, x) -> bool:
    """Whether ``call`` (as the ordinary builder made it) on array ``x`` (None:
    no array) can run as a fused step on ``pg``."""
    # (a SharedArena: the group's own arena, not the hier transport's host arena)
    if call.algorithm != "shared" or pg._size < 2 or pg._closed or not HAS_GIL \
            or type(pg._transport.arena) is not SharedArena:
        return False
    if x is None:
        return True
    return (type(x) is np.ndarray and x.flags.c_contiguous and x.flags.writeable
            and fusable_dtype(x.dtype) and x.nbytes <= pg._transport.arena.slot_nbytes
            and x.size > 0)


class Repeats:
    """The recent calls of group ``pg`` that can run fused, or be replayed."""

    __slots__ = ("pg", "_seen", "_once", "default_barrier", "_replays", "roots", "forms")

    def __init__(self, pg):
        self.pg = pg
        self._seen: dict = {}
        # Calls no fused step takes, run again without their checks (as
        # _seen, by key): numcoll.fast.replay. (Ordered: the oldest is
        # dropped with one popitem, which another thread's insert cannot
        # interrupt as it could an iterator.)
        self._replays: OrderedDict = OrderedDict()
        # Arrays seen once, by weak reference: a plan is made for an array seen
        # twice alive, not for each of the fresh arrays that code which
        # allocates one per call passes (they may even reuse an address).
        self._once: dict = {}
        #: The default barrier's fused call (``nc.barrier()``), once it has one:
        #: the API runs it with no key to build or look up.
        self.default_barrier = None
        # Global ranks (as a module function's src/dst) translated to this
        # group's ranks, by the API's repeat paths (the group's ranks are fixed)
        self.roots: dict = {}
        #: Single-array calls planned by form, for a new array each call.
        self.forms = Forms(pg)

    def allreduce(self, x, op) -> bool:
        """Run ``allreduce(x, op)`` fused if it repeats a call seen before; False
        (nothing done) if it does not, or the fused path cannot take it now."""
        # (_repeat, inlined: the hot path. Keyed by the id alone, see learn();
        # a dtype is most often the very object planned, and ``is`` is cheaper)
        seen = self._seen.get(id(x))
        if seen is None or seen.x is not x or seen.op is not op or x.shape != seen.shape \
                or x.strides != seen.strides \
                or x.dtype is not seen.dtype and x.dtype != seen.dtype \
                or not x.flags.writeable:
            return bool(self._replays) and self._replayed(id(x), (x,), op) \
                or bool(self.forms) and self._formed(id(x), "allreduce", -1, x, op)
        fused = seen.fused  # (FusedCall.run, inlined: a frame is 0.04 us of 1.3)
        start = fused._start
        if start is None:  # (a single-copy allreduce: its own run, numcoll.fast.sum)
            return fused.run()
        got = start(fused.address, fused.x, fused.spin_ns)
        return got == -1 or got != fused_step.NOT_TAKEN and fused.hold(got)

    def reduce(self, x, op, root: int) -> bool:
        """:meth:`allreduce` for ``reduce(x, op)`` into group rank ``root``."""
        return self._repeat((id(x), "reduce", root), x, op)

    def broadcast(self, x, root: int) -> bool:
        """:meth:`allreduce` for ``broadcast(x)`` from group rank ``root``."""
        return self._repeat((id(x), "broadcast", root), x, None)

    def allgather(self, out, inp) -> bool:
        """:meth:`allreduce` for ``all_gather_into_tensor(out, inp)``: both
        arrays as they were (``inp`` the same object, shape, strides, dtype)."""
        key = (id(out), id(inp), "allgather")
        seen = self._seen.get(key)
        # (both arrays checked here, once, without building their forms as
        # tuples: 0.98 -> 0.81 us of a repeated allgather's Python)
        if seen is None or seen.x is not out or seen.op is not inp \
                or out.shape != seen.shape or out.strides != seen.strides \
                or out.dtype != seen.dtype or not out.flags.writeable:
            return self._replayed(key, (out, inp)) \
                or bool(self.forms) and self._formed_allgather(key, out, inp)
        shape, strides, dtype = seen.form
        if inp.shape != shape or inp.strides != strides or inp.dtype != dtype:
            return self._replayed(key, (out, inp))
        return seen.fused.run()

    def barrier(self, timeout) -> bool:
        """Run a barrier with ``timeout`` (a timedelta; the default barrier is
        :attr:`default_barrier`) fused if one ran before."""
        seen = self._seen.get((timeout, "barrier"))
        return seen is not None and seen.fused.run()

    def _repeat(self, key, x, op) -> bool:
        """The fused plan under ``key`` (``(id(x), name, root)``) on ``x`` with
        ``op`` if it holds; else the replay under ``key``, or its form's plan."""
        seen = self._seen.get(key)
        if seen is None or seen.x is not x or seen.op is not op or x.shape != seen.shape \
                or x.strides != seen.strides or x.dtype != seen.dtype \
                or not x.flags.writeable:
            return self._replayed(key, (x,), op) \
                or bool(self.forms) and self._formed(key, key[1], key[2], x, op)
        return seen.fused.run()

    def _formed(self, key, name: str, root: int, x, op) -> bool:
        """Run ``name`` of ``x`` through its form's plan (:mod:`.forms`) if it
        may take it. An array that comes back a second time gets a plan of its
        own, under ``key``, as :meth:`learn` makes it: the faster path (2 ranks,
        two arrays of one form called in turn: 1.9 us a call by form, 1.05-1.3
        each by its own plan), which a form's plan would otherwise keep it from."""
        call = self.forms.run(name, root, x, op)
        if call is None:
            return False
        if self._twice(key, x):
            fused = fused_call(self.pg, call, x) or fused_copy_broadcast(self.pg, call, x)
            if fused is not None:
                self._keep(key, x, op, fused)
        return True

    def _formed_allgather(self, key, out, inp) -> bool:
        """:meth:`_formed` for ``all_gather_into_tensor(out, inp)``."""
        call = self.forms.run_allgather(out, inp)
        if call is None:
            return False
        if self._twice(key, out, inp):
            fused = fused_allgather(self.pg, call, out, inp) \
                or fused_copy_allgather(self.pg, call, out, inp)
            if fused is not None:
                self._keep(key, out, inp, fused)
        return True

    def _formed_move(self, name: str, extra, key, arrays: tuple) -> bool:
        """:meth:`_formed` for :meth:`move`'s ``name`` in ``_BY_FORM`` (the
        caller's ``arrays``: output, input) or ``_ROOTED`` (``arrays``: the
        tensor, then the root's list); ``key``: theirs. Arrays that come back
        get their own plan, as :meth:`learn_move` makes it."""
        rooted = name in _ROOTED
        call = self.forms.run_rooted(name, extra, arrays[0], arrays[1:]) if rooted \
            else self.forms.run_move(name, extra, *arrays)
        if call is None:
            return False
        if self._twice(key, *arrays):
            inp, out, fuse = rooted_sides(name, arrays[0], arrays[1:]) if rooted \
                else (arrays[1], arrays[0], True)
            self._plan_move(key, arrays, call, inp, out, None, fuse)
        return True

    def _replayed(self, key, arrays: tuple, op=None) -> bool:
        """Run the replay under ``key`` on ``arrays`` if it was made for them."""
        replay = self._replays.get(key)
        return replay is not None and replay.run(arrays, op)

    def move(self, name: str, extra, arrays: tuple) -> bool:
        """Run the data-moving collective ``name`` (``extra``: its root, or its
        op) on ``arrays`` (every array the caller passed, in order) fused, if
        it repeats a call seen before with the very same, unchanged arrays."""
        # (the key holds every array's id, so the lengths agree; the checks are
        # made array by array, without building described()'s tuples: a gather's
        # root passes three arrays on two ranks, and nc.gather went from 4.6-6.1
        # to 3.7-4.9 us: docs/performance/small-calls.md)
        key = (name, extra, *map(id, arrays))
        seen = self._seen.get(key)
        if seen is None:
            return self._replayed(key, arrays) or bool(self.forms) \
                and (name in _BY_FORM or name in _ROOTED) \
                and self._formed_move(name, extra, key, arrays)
        for a, b, (shape, strides, dtype, writeable) in zip(arrays, seen.x, seen.shape):
            if a is not b or a.shape != shape or a.strides != strides or a.dtype != dtype \
                    or a.flags.writeable is not writeable:
                return self._replayed(key, arrays)
        return seen.fused.run()

    def learn_move(self, name: str, extra, arrays: tuple, call, inp, out, run=None,
                   fuse: bool = True) -> None:
        """Remember the call ``call`` on ``arrays`` (as :meth:`move` is given
        them) that the ordinary path is about to run with ``run``: fused, if
        it can run fused (``fuse``: its flat input and output are ``inp`` and
        ``out``, see :func:`numcoll.fast.moves.plan`), else as a replay if
        ``run`` can be remade."""
        if not arrays or any(type(a) is not np.ndarray for a in arrays):
            return
        key = (name, extra, *map(id, arrays))
        seen = self._seen.get(key)
        if seen is not None and all(a is b for a, b in zip(arrays, seen.x)) \
                and described(arrays) == seen.shape:
            return  # planned for these very arrays, which its run declined this time
        if not self._twice(key, *arrays):
            if name in _ROOTED:
                tensor, blocks = arrays[0], arrays[1:]
                self.forms.learn_rooted(name, extra, tensor, blocks,
                                        lambda: fused_rooted(self.pg, call, tensor, bool(blocks)))
            elif fuse and name in _BY_FORM:
                self.forms.learn_move(name, extra, out, inp,
                                      lambda: _moved_by_step(self.pg, call, inp, out, run))
            return
        self._plan_move(key, arrays, call, inp, out, run, fuse)

    def _plan_move(self, key, arrays: tuple, call, inp, out, run, fuse: bool) -> None:
        """The plan :meth:`learn_move` keeps for ``arrays``, seen twice."""
        # (an alltoall whose blocks are read whole first: moves.plan would send
        # them in round 0, through the arena)
        fused = (fused_copy_alltoall(self.pg, call, inp, out, getattr(run, "rest_nbytes", None))
                 or moves.plan(self.pg, call, inp, out)
                 or fused_copy_move(self.pg, call, inp, out)) if fuse else None
        if fused is not None:
            self._keep(key, None, None, fused)
            seen = self._seen[key]
            seen.x, seen.shape = arrays, described(arrays)
        else:
            self._keep_replay(key, arrays, None, call, run)

    def learn(self, x, op, call, run=None) -> None:
        """Remember the call ``call`` (allreduce, reduce or broadcast of ``x``
        with the op object ``op``; None for a broadcast) that the ordinary path
        is about to run with ``run``: fused if it can run fused, else as a
        replay if ``run`` can be remade."""
        # (an allreduce's key is the array's id alone: the hot path's lookup,
        # allreduce(), hashes no tuple -- 0.05 us. The others' keys are tuples.)
        key = id(x) if call.name == "allreduce" else (id(x), call.name, call.root)
        seen = self._seen.get(key)
        if seen is not None and seen.x is x and seen.op is op \
                and _form(x) == (seen.shape, seen.strides, seen.dtype):
            return  # planned for this very call, which its run declined this time
        if self._twice(key, x):
            fused = fused_call(self.pg, call, x) or fused_copy_broadcast(self.pg, call, x) \
                or fused_allreduce(self.pg, call, x, run)
            if fused is not None:
                self._keep(key, x, op, fused)
            else:
                self._keep_replay(key, (x,), op, call, run)
        else:
            self.forms.learn(call.name, call.root, x, op, lambda: fused_call(self.pg, call, x)
                             or fused_copy_broadcast(self.pg, call, x, by_form=True))

    def learn_allgather(self, out, inp, call, run=None) -> None:
        """:meth:`learn` for an ``all_gather_into_tensor(out, inp)`` (``call``)."""
        key = (id(out), id(inp), "allgather")
        seen = self._seen.get(key)
        if seen is not None and seen.x is out and seen.op is inp and out.shape == seen.shape \
                and out.strides == seen.strides and out.dtype == seen.dtype \
                and _form(inp) == seen.form:
            return  # planned for these very arrays, which its run declined this time
        if type(inp) is np.ndarray and self._twice(key, out, inp):
            fused = fused_allgather(self.pg, call, out, inp) \
                or fused_copy_allgather(self.pg, call, out, inp)
            if fused is not None:
                self._keep(key, out, inp, fused)
            else:
                self._keep_replay(key, (out, inp), None, call, run)
        else:
            self.forms.learn_allgather(out, inp, lambda: fused_allgather(self.pg, call, out, inp)
                                       or fused_copy_allgather(self.pg, call, out, inp, True))

    def all_gather(self, outs, inp) -> bool:
        """Run ``all_gather(outs, inp)`` (torch's list form) through its form's
        plan (:mod:`.forms`) if it may take it."""
        return bool(self.forms) and self.forms.run_all_gather(outs, inp) is not None

    def learn_all_gather(self, outs, inp, call) -> None:
        """:meth:`learn` for an ``all_gather(outs, inp)`` (``call``)."""
        self.forms.learn_all_gather(outs, inp, lambda: fused_all_gather(self.pg, call, inp))

    def all_to_all(self, outs, inps) -> bool:
        """Run ``all_to_all(outs, inps)`` (torch's list form) through its
        form's plan (:mod:`.forms`) if it may take it."""
        return bool(self.forms) and self.forms.run_all_to_all(outs, inps) is not None

    def learn_all_to_all(self, outs, inps, call, run) -> None:
        """:meth:`learn` for an ``all_to_all(outs, inps)`` (``call``, ``run``)."""
        if inps:
            inp = inps[0]
            self.forms.learn_all_to_all(outs, inps,
                                        lambda: fused_all_to_all(self.pg, call, inp, run))

    def _twice(self, key, *arrays) -> bool:
        """Whether ``arrays`` (under ``key``) were seen before, every one of
        them alive; else remember them (by weak reference, only until they
        are seen again). Every array, not only the first: a fresh input
        each call beside a kept output may reuse the freed one's address,
        hence its key, and a plan made for it would serve no later call
        (2 ranks, an 8-byte allgather of a new view into one output took
        90-160 us a call, planning every other call, against 25 unplanned)."""
        # (no generator expressions: this runs on every call by form, 0.3 us each)
        once = self._once.get(key)
        if once is not None and len(once) == len(arrays):
            for ref, a in zip(once, arrays):
                if ref() is not a:
                    break
            else:
                del self._once[key]
                return True
        for a in arrays:
            if type(a) is not np.ndarray:
                return False
        if len(self._once) >= 4 * REPLAYS_KEPT:
            self._once.clear()
        self._once[key] = (weakref.ref(arrays[0]),) if len(arrays) == 1 else \
            tuple([weakref.ref(a) for a in arrays])
        return False

    def learn_barrier(self, timeout, call) -> None:
        """Remember a barrier (``timeout``: as passed), whose ordinary ``call`` is about to run."""
        fused = fused_call(self.pg, call, None)
        if fused is not None:
            self._keep((timeout, "barrier"), None, None, fused)
            if timeout is None:
                self.default_barrier = fused

    def _keep(self, key, x, op, fused) -> None:
        seen = self._seen
        seen.pop(key, None)
        if len(seen) >= KEPT and seen.pop(next(iter(seen))).fused is self.default_barrier:
            self.default_barrier = None
        seen[key] = _Seen(x, op, fused)

    def _keep_replay(self, key, arrays: tuple, op, call, run) -> None:
        """Keep ``call`` as a replay of ``arrays`` if its ``run`` can be remade."""
        remake = getattr(run, "remake", None)
        if remake is None:
            return
        replays = self._replays
        replays.pop(key, None)
        if len(replays) >= REPLAYS_KEPT:
            replays.popitem(last=False)
        replays[key] = Replay(self.pg, call, remake, arrays, op)

    def clear(self) -> None:
        """Forget every call (the group is shutting down, or its default
        timeout changed: every plan holds the deadline it was made with)."""
        self._seen.clear()
        self._replays.clear()
        self._once.clear()
        self.forms.clear()
        self.default_barrier = None
