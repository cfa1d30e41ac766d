"""Small gather, scatter, alltoall and reduce_scatter calls that repeat,
planned as one compiled arena step each (a repeated allgather is
:func:`numcoll.fast.repeat.fused_allgather`'s, on the allreduce's step).

:func:`plan` turns a call that the ordinary builder checked (its
:class:`~numcoll.call.Call`) and the arrays it was given into a
:class:`FusedMove`: the moves of :mod:`numcoll.collectives.fused_moves` --
which bytes of the input go where in this rank's slot, which bytes of which
peer's slot go where in the output -- computed here once, exactly as the
``shared`` algorithm (:mod:`numcoll.algorithms.shared`) lays out its one
round. A call the ``shared`` algorithm would move in more than one round, or
whose arrays overlap other than in the documented in-place forms, is not
planned (None): it keeps the ordinary path.

Running it is :class:`~numcoll.fast.step.FusedCall`'s run -- the group's
lock, one compiled call, the lock again -- with the moves' kernel; a call
that does not finish in the spin and yield phases, or whose alltoall counts
disagree, is promoted and finished by the group as any fused call.
"""

from __future__ import annotations

import numpy as np

from transports.shm.arena import HEADER_NBYTES, SharedArena

from ..collectives import fused_moves, fused_step
from ..algorithms.shared import _place
from ..algorithms.shared_alltoall import (alltoall_head_nbytes, alltoall_header, header_words,
                                          nbytes_word, rounds_word)
from ..collectives.fused_moves import CHECK, INP, LOCAL, MOVES, OUT, PACK, REDUCE, UNPACK, WORD
from .step import _NOTHING, HAS_GIL, FusedCall, fusable_dtype

__all__ = ["FusedMove", "plan", "plain", "span"]


class FusedMove(FusedCall):
    """A :class:`FusedCall` whose step runs ``moves`` (rows of
    :mod:`~numcoll.collectives.fused_moves`) from ``inp`` to ``out`` (flat
    uint8 views), publishing ``nbytes``. ``typed``: the input, flat in its
    dtype, for a reduce_scatter (its slots are read typed); else None."""

    __slots__ = ("moves", "inp", "out", "typed_out")

    def __init__(self, pg, call, inp, out, moves, nbytes: int, outs: list, typed=None,
                 typed_out=None):
        op = fused_step.OPS[call.op] if typed is not None else fused_step.NO_REDUCE
        super().__init__(pg, call, typed, op, max(call.root, -1), outs, publishes=False)
        plan = self.plan
        plan[fused_step.NBYTES] = nbytes
        # (the plan holds these arrays' addresses: these references keep them alive)
        self.moves = table = np.array(moves, np.int64).reshape(-1, 5)
        self.inp, self.out = inp, out
        plan[MOVES:MOVES + 2] = table.ctypes.data, len(table)
        plan[INP:INP + 2] = inp.ctypes.data, inp.nbytes
        plan[OUT:OUT + 2] = out.ctypes.data, out.nbytes
        # What the group's fused path passes as "x": the output in the call's
        # dtype (read by a reduce_scatter's REDUCE rows).
        self.x = self.typed_out = out if typed_out is None else typed_out
        self._start = fused_moves.entry(fused_moves.step, self.x)
        self._finish = fused_moves.entry(fused_moves.finish, self.x)

    def _entries(self, x) -> tuple:
        # (set in __init__, once the plan says where the arrays lie; combine()
        # is this class's own)
        return None, None, None

    def combine(self, comm) -> None:
        got = fused_moves.unpack(self.region, self.plan, self.moves, self.out, self.typed_out,
                                 self.step)
        if got != -1:  # an alltoall peer's table disagrees: the ordinary path's error
            q = -3 - got
            base = (self.plan[fused_step.FIRST + (self.step & 1)] + HEADER_NBYTES
                    + q * self.plan[fused_step.STRIDE])
            for kind, peer, at, _, want in self.moves:
                if kind != CHECK or peer != q:
                    continue
                theirs = int(self.region[base + at:base + at + 8].view(np.int64)[0])
                if theirs != want:
                    if at == 8 * rounds_word(self.pg._size):
                        comm.size_mismatch(q, f"rank {q} needs {theirs} rounds, this rank "
                                              f"expects {int(want)}")
                    itemsize = self.call.dtype.itemsize  # (the words count bytes)
                    comm.size_mismatch(q, f"rank {q} sends this rank {theirs // itemsize} "
                                          f"elements, this rank expects {want // itemsize}")


def plan(pg, call, inp, out) -> FusedMove | None:
    """The fused step of ``call`` (gather, scatter, alltoall_base, alltoall or
    reduce_scatter_tensor, as the ordinary builder made it) over this rank's
    ``inp`` and ``out`` (NumPy arrays; None where this rank passes none: a
    gather's non-root output, a scatter's non-root input), if one step of
    the ``shared`` algorithm moves it; else None."""
    if call.algorithm != "shared" or pg._size < 2 or pg._closed or \
            not plain(inp, out):
        return None
    if type(pg._transport.arena) is not SharedArena or not HAS_GIL:  # (not a hier host arena)
        return None
    itemsize = (inp if inp is not None else out).itemsize
    slot, seg = pg._transport.arena.slot_nbytes, pg.context.segment(itemsize)

    def per_round(parts: int, reserved: int = 0) -> int:  # as shared._per_round
        return max(1, min((slot - reserved) // (parts * itemsize), seg))

    x = _NOTHING if inp is None else inp.reshape(-1).view(np.uint8)
    y = _NOTHING if out is None else out.reshape(-1).view(np.uint8)
    if inp is not None and out is not None and np.may_share_memory(x, y):
        return _in_place(pg, call, inp, out, x, y, per_round)
    return _planned(pg, call, inp, out, x, y, per_round, own=False)


def span(blocks) -> np.ndarray | None:
    """One flat array over ``blocks`` (gather's output list, scatter's input
    list) when they lie back to back, in order, in one C-contiguous array
    (``list(x.reshape(n, -1))``, as most code makes them); else None."""
    b0 = blocks[0] if blocks else None
    base = getattr(b0, "base", None)
    if type(b0) is not np.ndarray or type(base) is not np.ndarray or \
            not base.flags.c_contiguous:
        return None
    n, at = b0.nbytes, b0.ctypes.data - base.ctypes.data
    for i, b in enumerate(blocks):
        if type(b) is not np.ndarray or not b.flags.c_contiguous or b.dtype != b0.dtype \
                or b.nbytes != n or b.ctypes.data != b0.ctypes.data + i * n:
            return None
    if at < 0 or at % b0.itemsize or at + n * len(blocks) > base.nbytes:
        return None
    return base.reshape(-1).view(np.uint8)[at:at + n * len(blocks)].view(b0.dtype)


def plain(inp, out) -> bool:
    """Whether a fused plan can take this rank's ``inp`` and ``out`` (None
    where it passes none): C-contiguous, non-empty NumPy arrays, ``out``
    writable."""
    return _plain(inp) and _plain(out) and (out is None or out.flags.writeable)


def _plain(a) -> bool:
    return a is None or (type(a) is np.ndarray and a.flags.c_contiguous and a.size > 0)


def _in_place(pg, call, inp, out, x, y, per_round):
    """torch's in-place forms (the input is this rank's block of the output,
    or the output this rank's share of the input); any other overlap: None."""
    size, rank, name = pg._size, pg._rank, call.name
    if name == "gather":
        block, whole, mine = x.size, y, x
    elif name in ("reduce_scatter_tensor", "scatter"):
        block, whole, mine = y.size, x, y
    else:
        return None
    if whole.size != block * size or mine.ctypes.data != whole.ctypes.data + rank * block:
        return None
    if name in ("gather", "scatter") and rank != call.root:
        return None
    return _planned(pg, call, inp, out, x, y, per_round, own=True)


def _planned(pg, call, inp, out, x, y, per_round, own: bool):
    size, rank, name, root = pg._size, pg._rank, call.name, call.root
    itemsize = (inp if inp is not None else out).itemsize
    others = [q for q in range(size) if q != rank]
    if name == "gather":
        b = x.size
        if b // itemsize > per_round(1):
            return None
        if rank != root:
            return FusedMove(pg, call, x, _NOTHING, [(PACK, rank, 0, 0, b)], b, [])
        moves = ([] if own else [(LOCAL, rank, 0, root * b, b)])
        moves += [(UNPACK, q, 0, q * b, b) for q in others]
        return FusedMove(pg, call, x, y, moves, 0, [out])
    if name == "scatter":
        b = y.size
        peer = per_round(size - 1)
        if b // itemsize > peer:
            return None
        stride = peer * itemsize
        if rank != root:
            return FusedMove(pg, call, _NOTHING, y,
                             [(UNPACK, root, _place(rank, root) * stride, 0, b)], 0, [out])
        moves = [(PACK, rank, q * b, _place(q, rank) * stride, b) for q in others]
        moves += [] if own else [(LOCAL, rank, root * b, 0, b)]
        return FusedMove(pg, call, x, y, moves, (size - 2) * stride + b, [out])
    if name in ("alltoall_base", "alltoall"):  # (the list form's: over buffers of its own)
        b = x.size // size
        head = alltoall_head_nbytes(size)
        peer = per_round(size - 1, head)
        if x.size != y.size or b % itemsize or not 0 < b // itemsize <= peer:
            return None
        stride, count = peer * itemsize, b // itemsize
        # (alltoall_header's words, every one written, as a peer's compiled
        # start reads them: no block offered to be read, so data in round 0,
        # one round -- a fused step makes its one round)
        chunks = [(q * count, count) for q in range(size)]
        words = alltoall_header(rank, size, chunks, chunks, itemsize, peer, [0] * (size + 1))
        rounds = 8 * rounds_word(size)
        moves = [(WORD, rank, int(w), 8 * i, 8)
                 for i, w in enumerate(words[:header_words(size)])]
        moves += [(PACK, rank, q * b, head + _place(q, rank) * stride, b) for q in others]
        moves += [(LOCAL, rank, rank * b, rank * b, b)]
        moves += [(CHECK, q, rounds, 0, 1) for q in others]
        moves += [(CHECK, q, 8 * nbytes_word(rank), 0, b) for q in others]
        moves += [(UNPACK, q, head + _place(rank, q) * stride, q * b, b) for q in others]
        return FusedMove(pg, call, x, y, moves, head + (size - 1) * stride, [out])
    if name == "reduce_scatter_tensor":
        b = y.size
        if call.custom_op or call.op not in fused_step.OPS or not fusable_dtype(inp.dtype) \
                or b // itemsize > per_round(size):
            return None
        moves = [(PACK, rank, 0, 0, x.size)] + ([] if own else [(LOCAL, rank, rank * b, 0, b)])
        moves += [(REDUCE, rank, rank * b, 0, b)]
        return FusedMove(pg, call, x, y, moves, x.size, [out], typed=inp.reshape(-1),
                         typed_out=out.reshape(-1))
    return None
