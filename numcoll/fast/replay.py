"""Large blocking calls that repeat: the ordinary path, without the checks.

A call that no fused step takes -- larger than an arena slot, or moved in
several rounds, or by the single-copy algorithms -- pays the module API's
argument checks and plan lookups on every call: 15-25 µs with the
interpreter's working set in cache, 40-60 µs after a 16 MiB copy has
evicted it. When the same arrays come again, unchanged, those checks would
find what they found the time before. So a builder that allows it hands,
with its ``(call, run)``, a *remake* (``run.remake``, see
:mod:`numcoll.collectives.context`): a function and what the checks
found (the algorithm, the in-place form, the overlap), which make the same
``run`` for the same arrays without checking them again. :class:`Replay`
keeps the call and the remake with *weak* references to the arrays and what
must be unchanged about them, and runs a repeat as ``pg.submit(call,
remake(planned, *arrays), blocking=True)``: the group's ordinary submit,
with its sequence number, flight-recorder record, Work, mismatch stamp and
errors.

A replay never keeps an array alive (the remake holds no array: an array
dropped by its caller is freed, and its entry can never match again), and
it is never used for an array it was not made for: the very same objects
(``is``, through the weak references), each with the shape, strides, dtype
and writability it had, and the same op object. A new default timeout
forgets every replay (:meth:`numcoll.fast.repeat.Repeats.clear`), and a
group's configuration is fixed once it is up. Anything else takes the full
checks.
"""

from __future__ import annotations

import weakref

__all__ = ["Replay", "described"]


def described(arrays: tuple) -> tuple:
    """What must be unchanged about ``arrays`` for a plan made on them to hold
    (a fused one, :mod:`numcoll.fast.repeat`, or a replay)."""
    return tuple((a.shape, a.strides, a.dtype, a.flags.writeable) for a in arrays)


class Replay:
    """One large call of group ``pg`` to run again without its checks: its
    ``call``, the ``remake`` its builder gave, and -- held weakly -- the
    ``arrays`` it was made for, with ``op`` (an object compared by identity,
    or None)."""

    __slots__ = ("pg", "call", "remake", "refs", "layout", "op")

    def __init__(self, pg, call, remake, arrays: tuple, op):
        self.pg, self.call, self.remake, self.op = pg, call, remake, op
        self.refs = tuple(weakref.ref(a) for a in arrays)
        self.layout = described(arrays)

    def run(self, arrays: tuple, op=None) -> bool:
        """Run the call on ``arrays`` (blocking; raises its error) if they are
        the arrays it was made for, unchanged, with ``op``; else False."""
        if op is not self.op or len(arrays) != len(self.refs):
            return False
        for a, ref, (shape, strides, dtype, writeable) in zip(arrays, self.refs, self.layout):
            if ref() is not a or a.shape != shape or a.strides != strides or a.dtype != dtype \
                    or a.flags.writeable is not writeable:
                return False
        remake, planned = self.remake
        self.pg.submit(self.call, remake(planned, *arrays), True)
        return True
