"""Small calls on a new array each time, run as one fused step planned per form.

:class:`~numcoll.fast.repeat.Repeats` plans a call for the very array it was
made for. Code like ``nc.all_reduce(np.array([loss]))`` or a reduction of a
freshly computed array passes a new array every call, and paid the whole
ordinary path for each: the group's Work, future, record and queue (2 ranks,
8 bytes: 22 us a call against 2.3 for the same array repeated).

The arena's step for an allreduce, a reduce or a broadcast takes its array
as an argument (:func:`numcoll.collectives.fused_step.start`): its plan
holds no address of it. So :class:`Forms` plans such a call once per *form*
-- the collective, its root, the op object, the array's shape, strides and
dtype -- when a second array of that form comes by, and runs any later
array of that form through it. An array of the planned form passes the
ordinary builder's checks exactly as the first did (they look at the form,
not at the values), so the plan is what the builder would make again. What
is checked per call: a NumPy array (not a subclass), C-contiguous, writable
and aligned, of the same shape, dtype and op, and, where the group has shared
arrays, small enough that it cannot be one (the ordinary path reads shared
arrays in place: a plan made for a plain array must not take one). Anything
else takes the ordinary path. A plan is used by one call at a time (its lock:
another thread's call of the same form takes the ordinary path), and it
holds no caller's array between calls.

A broadcast that reads the root's buffer single-copy has a plan by form
too: the compiled start of a repeated one (:class:`~numcoll.fast.copy.FusedCopy`),
whose every address lies in the one array, pointed at each call's array
first (:func:`numcoll.collectives.fused_copy.point`); and so does an
allgather read single-copy whose copies fit a slot (its copies' addresses
lie in the output, those it publishes in the input), and a gather or a
scatter (on the root they lie in the plan's own buffer, elsewhere in ``tensor``).

An ``all_gather_into_tensor(out, inp)`` is planned by form too: the form of
both arrays. Its step copies ``inp`` from an address in its plan (the
output is its argument), so a run first points the plan at this call's
``inp``, and at whether ``inp`` is ``out``'s own chunk (torch's in-place
form: nothing to copy). An ``inp`` that overlaps ``out`` otherwise takes the
ordinary path, which reads it before it writes.

A ``reduce_scatter_tensor(out, inp)`` or an ``all_to_all_single(out, inp)``
without split sizes is planned by the form of both arrays too, if they do
not overlap: its plan (:class:`~numcoll.fast.moves.FusedMove`) holds both
addresses, which a run points at this call's arrays first.

An ``all_gather(outs, inp)`` (torch's list form) is planned by the form of
``inp``, every array of ``outs`` of its shape and dtype: the plan gathers
into a buffer of its own, then each array of ``outs`` gets its rank's row.
A list whose arrays may overlap each other takes the ordinary path (which
raises).

An ``all_to_all(outs, inps)`` (torch's list form) is planned by the form
of ``inps[0]``, every array of both lists of its shape and dtype: the plan
moves both lists through buffers of its own (the inputs copied in first, so
they may overlap anything; outputs that may overlap each other take the
ordinary path).

A ``gather(tensor, gather_list, dst)`` or a ``scatter(tensor, scatter_list,
src)`` is planned by the form of ``tensor`` and its root, every array of the
root's list of ``tensor``'s shape and dtype. The root's plan moves the list's
arrays through a buffer of its own (a gather's root copies each rank's row
out of it after the step, a scatter's root copies the list into it before);
``tensor`` is pointed at each call. On the root, an array of the list that
may overlap ``tensor`` (other than being it: torch's in-place form) or, for a
gather, another array of the list takes the ordinary path.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import numpy as np

from ..collectives import fused_copy, fused_moves, fused_step
from .copy import FusedCopy
from .moves import FusedMove
from .step import _NOTHING, FusedCall

__all__ = ["Forms"]

#: Forms planned per group (the oldest is forgotten first), and forms seen once
#: remembered (the table is emptied when full: they are only candidates).
KEPT = 8
SEEN_KEPT = 64
#: The "op" of an all_gather's plan: its outputs are a list, its plan gathers
#: into a buffer of its own.
_LIST = object()
#: The "op" of a gather's or a scatter's plan: on the root, its list moves
#: through a buffer of its own.
_ROOTED = object()
#: The "op" of an all_to_all's plan: both lists move through buffers of its own.
_EXCHANGE = object()
_LISTS = (list, tuple)
_NO_BYTES = np.empty(0, np.uint8)


def _alike(arrays, like, size: int, written: bool = False) -> bool:
    """Whether ``arrays`` are ``size`` NumPy arrays of ``like``'s shape and
    dtype; ``written`` (a call's outputs): writable too, and not overlapping
    each other (may: the ordinary path decides exactly, and raises)."""
    if len(arrays) != size:
        return False
    shape, dtype = like.shape, like.dtype
    for i, a in enumerate(arrays):
        if type(a) is not np.ndarray or a.shape != shape or a.dtype != dtype:
            return False
        if written:
            if not a.flags.writeable:
                return False
            for other in arrays[:i]:
                if np.may_share_memory(a, other):
                    return False
    return True


class _Planned:
    """One form's plan: the fused call, the op it was made with (by identity),
    the dtype, whether an array of its size may be a shared array, its lock
    and an empty array of its type that the plan holds between calls."""

    __slots__ = ("fused", "op", "dtype", "shareable", "lock", "spare", "rows", "own", "copies")

    def __init__(self, fused: FusedCall, op, dtype, shareable: bool, shape: tuple):
        self.fused, self.op, self.dtype, self.shareable = fused, op, dtype, shareable
        #: Read single-copy (a FusedCopy, pointed at each call's arrays).
        self.copies = type(fused) is FusedCopy
        #: The plan's own buffer, its bytes (an all_gather's; a gather's or a
        #: scatter's on the root), and the same by rank, each row in ``dtype``
        #: and ``shape`` (the arrays it is copied to or from: a reshape per
        #: row and call took 0.25 us); else None.
        self.own = fused.x if op is _LIST else None
        if op is _ROOTED:  # (a gather's root gathers into it, a scatter's sends from it)
            own = fused.kept if self.copies else \
                fused.out if fused.call.name == "gather" else fused.inp
            self.own = own if own is not None and own.size else None
        size, shape = fused.pg._size, shape or (1,)  # (a 0-d array's row: one element)
        self.rows = None if self.own is None else self.own.view(dtype).reshape(size, *shape)
        if op is _EXCHANGE:  # (its input's rows, its output's)
            self.rows = tuple(a.view(dtype).reshape(size, *shape) for a in (fused.inp, fused.out))
        self.lock = threading.Lock()
        self.spare = np.empty(0, fused.x.dtype)  # (not a view: it would keep x's memory)
        self.put_back()

    def put_back(self) -> None:
        """Between calls, the plan holds its placeholders, no caller's array:
        nor a promoted run's Work, whose future holds the call's arrays."""
        fused = self.fused
        fused.outs, fused.work = [], None
        if self.copies:  # (a rooted call's own block: a pair of the call's arrays)
            fused.own = None
        if self.op is not _LIST:  # (an all_gather's x is its own buffer, kept)
            fused.x = self.spare
        if fused.source is not None:  # (an allgather's input)
            fused.source = self.spare
        if type(fused) is FusedMove and self.op is not _EXCHANGE:
            # (its input's and output's bytes, its typed output; an all_to_all's
            # are its own buffers, kept)
            fused.inp = fused.out = _NO_BYTES
            fused.typed_out = self.spare

    def release(self) -> None:
        """After a call: :meth:`put_back`, then let go of the lock."""
        self.put_back()
        self.lock.release()


class Forms:
    """The forms of group ``pg``'s single-array calls, planned once seen twice."""

    __slots__ = ("pg", "_planned", "_seen", "_refused")

    def __init__(self, pg):
        self.pg = pg
        # (ordered: the oldest is dropped with one popitem, which another
        # thread's insert cannot interrupt as it could an iterator)
        self._planned: OrderedDict = OrderedDict()
        self._seen: set = set()
        # Forms whose plan() gave None (no fused step takes them): not asked again.
        self._refused: set = set()

    def __bool__(self) -> bool:
        return bool(self._planned)

    def run(self, name: str, root: int, x, op):
        """Run ``name`` (``allreduce``, ``reduce``, ``broadcast``) of ``x`` with
        ``op`` (None for a broadcast) from or to group rank ``root`` (-1: none)
        through its form's plan, if there is one and ``x`` may take it. Returns
        the plan's :class:`~numcoll.call.Call` once the call completed; None
        (nothing done) if ``x`` may not take a plan, or the fused path cannot
        take it now."""
        # (keyed by the dtype's number, not the dtype, which hashes slowly: the
        # dtype is compared below; a C-contiguous array of the planned shape
        # has its strides)
        planned = self._planned.get((name, root, x.shape, x.dtype.num, id(op))) \
            if type(x) is np.ndarray else None
        if planned is None or planned.op is not op \
                or x.dtype is not planned.dtype and x.dtype != planned.dtype:
            return None
        flags = x.flags
        if not (flags.c_contiguous and flags.writeable and flags.aligned) \
                or planned.shareable and self.pg.context.shared_memory is not None:
            return None
        if not planned.lock.acquire(False):
            return None
        fused = planned.fused
        try:
            flat = x if x.ndim == 1 else x.reshape(-1)
            if planned.copies:  # (its addresses, moved to x; its start takes bytes)
                flat = flat.view(np.uint8)
                fused_copy.point(fused.address, flat, flat, fused.base)
            fused.x, fused.outs = flat, [x]
            ran = fused.run()
        finally:
            planned.release()
        return fused.call if ran else None

    def run_allgather(self, out, inp):
        """:meth:`run` for ``all_gather_into_tensor(out, inp)``: through the
        plan of the arrays' form, if there is one and they may take it."""
        if type(out) is not np.ndarray or type(inp) is not np.ndarray:
            return None
        planned = self._taken(("allgather", out.shape, inp.shape, inp.dtype.num), out, inp)
        if planned is None:
            return None
        fused = planned.fused
        try:
            x = (out if out.ndim == 1 else out.reshape(-1)).view(np.uint8)
            if fused_step.point_source(fused.address, x, inp) != 0:
                return None  # (overlapping, not the own chunk: the ordinary path's error)
            if planned.copies:  # (read single-copy: its addresses, moved to these arrays)
                fused_copy.point(fused.address, x, inp, fused.base)
            fused.x, fused.outs, fused.source = x, [out], inp
            ran = fused.run()
        finally:
            planned.release()
        return fused.call if ran else None

    def run_all_gather(self, outs, inp):
        """:meth:`run` for ``all_gather(outs, inp)``: through the plan of
        ``inp``'s form, if there is one and ``outs`` and ``inp`` may take it;
        then each array of ``outs`` gets its rank's row."""
        if type(inp) is not np.ndarray:
            return None
        planned = self._planned.get(("all_gather", inp.shape, inp.dtype.num))
        if planned is None or inp.dtype != planned.dtype \
                or not (inp.flags.c_contiguous and inp.flags.aligned) \
                or planned.shareable and self.pg.context.shared_memory is not None \
                or not _alike(outs, inp, self.pg._size, written=True):
            return None
        if not planned.lock.acquire(False):
            return None
        fused = planned.fused
        try:
            fused_step.point_source(fused.address, fused.x, inp)  # (its own buffer: 0)
            fused.source = inp
            ran = fused.run()
            if ran:  # (before the lock is let go: another call of the form would gather into it)
                for out, row in zip(outs, planned.rows):
                    out[...] = row
        finally:
            planned.release()
        return fused.call if ran else None

    def run_move(self, name: str, op, out, inp):
        """:meth:`run` for ``reduce_scatter_tensor(out, inp, op)`` or
        ``all_to_all_single(out, inp)`` (``name`` "alltoall_base", ``op``
        None): through the plan of the arrays' form, if they may take it."""
        if type(out) is not np.ndarray or type(inp) is not np.ndarray:
            return None
        planned = self._taken((name, out.shape, inp.shape, inp.dtype.num, id(op)), out, inp, op)
        if planned is None:
            return None
        fused = planned.fused
        try:
            if fused_moves.point(fused.address, inp, out) != 0:
                return None  # (overlapping: the ordinary path's forms and checks)
            flat = out if out.ndim == 1 else out.reshape(-1)
            fused.inp, fused.out, fused.outs = inp, flat.view(np.uint8), [out]
            # (a reduce_scatter reads its output typed; an alltoall's is its bytes)
            fused.x = fused.typed_out = flat if planned.spare.dtype == flat.dtype \
                else fused.out
            ran = fused.run()
        finally:
            planned.release()
        return fused.call if ran else None

    def run_all_to_all(self, outs, inps):
        """:meth:`run` for ``all_to_all(outs, inps)``: through the plan of the
        form of ``inps[0]``, if every array of both lists may take it: the
        inputs copied into the plan's buffer, the step, the outputs copied
        out of its other buffer."""
        inp = inps[0] if type(inps) in _LISTS and inps else None
        if type(inp) is not np.ndarray or type(outs) not in _LISTS:
            return None
        planned = self._planned.get(("all_to_all", inp.shape, inp.dtype.num))
        if planned is None or inp.dtype != planned.dtype \
                or planned.shareable and self.pg.context.shared_memory is not None \
                or not self._fit_lists(outs, inps, len(planned.rows[0])):
            return None
        if not planned.lock.acquire(False):
            return None
        fused = planned.fused
        into, out_of = planned.rows
        try:
            for row, a in zip(into, inps):  # (every input first: an output may be one)
                row[...] = a
            ran = fused.run()
            if ran:  # (before the lock is let go: another call of the form would use them)
                for out, row in zip(outs, out_of):
                    out[...] = row
        finally:
            planned.release()
        return fused.call if ran else None

    @staticmethod
    def _fit_lists(outs, inps, size: int) -> bool:
        """Whether an all_to_all's lists fit a plan of ``inps[0]``'s form:
        ``size`` arrays each like it, the outputs written (inputs are copied
        first, so they may overlap anything)."""
        return _alike(inps, inps[0], size) and _alike(outs, inps[0], size, written=True)

    def run_rooted(self, name: str, root: int, tensor, blocks):
        """:meth:`run` for ``gather(tensor, blocks, root)`` or ``scatter(tensor,
        blocks, root)`` (``name``; ``blocks`` the root's list, empty elsewhere):
        through the plan of ``tensor``'s form, if the arrays may take it."""
        if type(tensor) is not np.ndarray:
            return None
        planned = self._planned.get((name, root, tensor.shape, tensor.dtype.num))
        gather = name == "gather"
        if planned is None or tensor.dtype != planned.dtype:
            return None
        flags = tensor.flags
        if not (flags.c_contiguous and flags.aligned) or not (gather or flags.writeable) \
                or planned.shareable and self.pg.context.shared_memory is not None:
            return None
        rows = planned.rows
        if rows is None:
            if blocks:  # (a list off the root: the ordinary path's error)
                return None
        elif not self._fit(gather, tensor, blocks, root, len(rows)):
            return None
        if not planned.lock.acquire(False):
            return None
        fused = planned.fused
        # (read single-copy: the root's own block is the call's own pair, no row)
        skip = root if planned.copies else -1
        try:
            flat = (tensor if tensor.ndim == 1 else tensor.reshape(-1)).view(np.uint8)
            if not gather and rows is not None:
                for q, (row, block) in enumerate(zip(rows, blocks)):
                    if q != skip:
                        row[...] = block
            if planned.copies:
                self._point_rooted_copy(fused, gather, root, tensor, flat, blocks)
            else:
                own = _NOTHING if rows is None else planned.own
                inp, out = (flat, own) if gather else (own, flat)
                fused_moves.point(fused.address, inp, out)  # (the own buffer overlaps nothing)
                fused.inp, fused.out, fused.x = inp, out, out
                fused.typed_out = out
            fused.outs = [tensor]
            ran = fused.run()
            if ran and gather and rows is not None:  # (before another call gathers into it)
                for q, (block, row) in enumerate(zip(blocks, rows)):
                    if q != skip:
                        block[...] = row
        finally:
            planned.release()
        return fused.call if ran else None

    @staticmethod
    def _point_rooted_copy(fused: FusedCopy, gather: bool, root: int, tensor, flat, blocks):
        """Point a rooted plan read single-copy
        (:func:`~numcoll.fast.copy.fused_copy_rooted`) at this call's arrays:
        off the root, at ``tensor`` (``flat``, its bytes), where its addresses
        lie; on the root, whose lie in its own buffer, the root's own block
        becomes the pair the call copies, unless ``tensor`` is it."""
        if not blocks:
            fused_copy.point(fused.address, flat, flat, fused.base)
        elif blocks[root] is not tensor:
            fused.own = (blocks[root], tensor) if gather else (tensor, blocks[root])
        fused.x = flat

    @staticmethod
    def _fit(gather: bool, tensor, blocks, root: int, size: int) -> bool:
        """Whether the root's (group rank ``root``'s) ``blocks`` fit a plan of
        ``tensor``'s form: ``size`` NumPy arrays of its shape and dtype
        (writable, for a gather), none overlapping ``tensor`` but the root's
        own entry being ``tensor`` (torch's in-place form), nor, for a
        gather, each other (may: the ordinary path decides exactly)."""
        if not _alike(blocks, tensor, size, written=gather):
            return False
        for i, block in enumerate(blocks):
            if not (i == root and block is tensor) and np.may_share_memory(block, tensor):
                return False
        return True

    def _taken(self, key: tuple, out, inp, op=None):
        """The plan of ``key`` for a call on NumPy arrays ``out`` and ``inp``,
        its lock taken, if they may take it: of its dtype and ``op`` (the
        object), C-contiguous and aligned, ``out`` writable, neither possibly
        a shared array. Else None."""
        planned = self._planned.get(key)
        if planned is None or planned.op is not op or out.dtype != planned.dtype \
                or inp.dtype != planned.dtype:
            return None
        flags, in_flags = out.flags, inp.flags
        if not (flags.c_contiguous and flags.writeable and flags.aligned
                and in_flags.c_contiguous and in_flags.aligned) \
                or planned.shareable and self.pg.context.shared_memory is not None:
            return None
        return planned if planned.lock.acquire(False) else None

    def learn(self, name: str, root: int, x, op, plan) -> None:
        """Note the form of ``x`` in a call ``name`` with ``op`` and ``root``
        that the ordinary path is about to run; the second time a form comes
        by, keep ``plan()`` (a :class:`FusedCall` for ``x``, or None: no
        fused step takes it) as its plan (in place of one for a dtype of the
        same number, of another byte order)."""
        if type(x) is not np.ndarray or not (x.flags.writeable and x.flags.aligned):
            return
        self._learn((name, root, x.shape, x.dtype.num, id(op)), x, (x.strides, x.dtype), plan,
                    op)

    def learn_allgather(self, out, inp, plan) -> None:
        """:meth:`learn` for ``all_gather_into_tensor(out, inp)``; ``plan()``:
        a :class:`FusedCall` for these arrays, or None."""
        if type(out) is not np.ndarray or type(inp) is not np.ndarray \
                or not (out.flags.writeable and out.flags.aligned and inp.flags.aligned) \
                or out.dtype != inp.dtype:
            return
        self._learn(("allgather", out.shape, inp.shape, inp.dtype.num), out,
                    (out.strides, inp.strides, inp.dtype), plan, None, inp.nbytes)

    def learn_move(self, name: str, op, out, inp, plan) -> None:
        """:meth:`learn` for :meth:`run_move`'s calls; ``plan()``: a
        :class:`~numcoll.fast.moves.FusedMove` for these arrays, or None."""
        if type(out) is not np.ndarray or type(inp) is not np.ndarray \
                or not (out.flags.writeable and out.flags.aligned and inp.flags.aligned) \
                or out.dtype != inp.dtype or np.may_share_memory(out, inp):
            return
        self._learn((name, out.shape, inp.shape, inp.dtype.num, id(op)), out,
                    (out.strides, inp.strides, inp.dtype), plan, op,
                    max(out.nbytes, inp.nbytes))

    def learn_all_gather(self, outs, inp, plan) -> None:
        """:meth:`learn` for ``all_gather(outs, inp)``; ``plan()``: a
        :class:`FusedCall` gathering ``inp`` into a buffer of its own, or None."""
        if type(inp) is not np.ndarray or not inp.flags.aligned \
                or not _alike(outs, inp, len(outs)):
            return
        self._learn(("all_gather", inp.shape, inp.dtype.num), inp, (inp.strides, inp.dtype),
                    plan, _LIST)

    def learn_all_to_all(self, outs, inps, plan) -> None:
        """:meth:`learn` for ``all_to_all(outs, inps)``; ``plan()``: a
        :class:`~numcoll.fast.moves.FusedMove` over buffers of its own, or None."""
        inp = inps[0]
        if type(inp) is not np.ndarray or not self._fit_lists(outs, inps, len(inps)):
            return
        self._learn(("all_to_all", inp.shape, inp.dtype.num), inp, (inp.strides, inp.dtype),
                    plan, _EXCHANGE)

    def learn_rooted(self, name: str, root: int, tensor, blocks, plan) -> None:
        """:meth:`learn` for ``gather`` or ``scatter`` (``name``) of ``tensor``
        with the root's list ``blocks`` (empty elsewhere); ``plan()``: a
        :class:`~numcoll.fast.moves.FusedMove` moving the root's list through
        a buffer of its own, or None."""
        if type(tensor) is not np.ndarray or not tensor.flags.aligned \
                or name == "scatter" and not tensor.flags.writeable:
            return
        if blocks and not self._fit(name == "gather", tensor, blocks, root, len(blocks)):
            return
        self._learn((name, root, tensor.shape, tensor.dtype.num), tensor,
                    (tensor.strides, tensor.dtype, len(blocks)), plan, _ROOTED)

    def _learn(self, key: tuple, x, form: tuple, plan, op, nbytes: int | None = None) -> None:
        """Plan ``key`` (of array ``x``: its dtype, whether it is C-contiguous;
        ``form``: the rest that must match to count as the same form; ``op``:
        the op object) the second time its form comes by. ``nbytes``: what
        decides whether the call's arrays could be shared arrays (default: ``x``'s)."""
        planned = self._planned.get(key)
        if planned is not None and planned.dtype == x.dtype and x.flags.c_contiguous:
            return  # (planned; its run declined this time, or the op differs)
        form = (*key, *form)
        if form in self._refused:
            return
        if form not in self._seen:
            if len(self._seen) >= SEEN_KEPT:
                self._seen.clear()
            self._seen.add(form)
            return
        self._seen.discard(form)
        fused = plan()
        if type(fused) is not FusedCall and type(fused) is not FusedMove \
                and not (type(fused) is FusedCopy and fused.remake is not None):
            # (none, or a single-copy plan made for its arrays alone, which
            # holds addresses a form's run does not repoint: the form keeps
            # the ordinary path)
            if len(self._refused) >= SEEN_KEPT:
                self._refused.clear()
            self._refused.add(form)
            return
        if len(self._planned) >= KEPT and key not in self._planned:
            self._planned.popitem(last=False)
        cfg = self.pg.context.cfg
        self._planned[key] = _Planned(fused, op, x.dtype, (x.nbytes if nbytes is None else nbytes)
                                      >= cfg.shared_arrays_min_nbytes, x.shape)

    def plans(self) -> list:
        """The fused calls planned (for tests and diagnostics)."""
        return [p.fused for p in self._planned.values()]

    def clear(self) -> None:
        """Forget every form (see :meth:`numcoll.fast.repeat.Repeats.clear`)."""
        self._planned.clear()
        self._seen.clear()
        self._refused.clear()
