"""Rank 0's say for the ``cma_measured`` algorithms: single copy or the arena,
call by call, from its recent times of both (:mod:`.single_copy`).

Rank 0 alone keeps times, per kind of call (:func:`measured_key`), and says
in its *where* which way the call goes; every rank reads that one say, so
the ranks cannot part.
"""

from __future__ import annotations

__all__ = ["measured_key"]

#: Rank 0's times kept per kind of call and way (the least of them counts),
#: how many each way needs before the two are compared (one time can be a
#: peer's one-off delay: a first call that loaded compiled code took 3 ms, and
#: alone it would have kept that way off for a thousand calls), and how rarely
#: it tries the slower way (see _say).
_KEPT, _TRIED, _EXPLORE = 4, 2, 16


def measured_key(op_name: str, nbytes: int) -> tuple:
    """The kind of a call whose ranks publish ``nbytes`` to read in all, as
    rank 0 keeps its times (one per power of two)."""
    return op_name, nbytes.bit_length()


class _Times:
    """Rank 0's last times (seconds) of one kind of call, each way (the
    first of each way is a warm-up, not kept), and how many it said."""

    __slots__ = ("copy", "arena", "warm", "calls")

    def __init__(self):
        self.copy, self.arena, self.warm, self.calls = [], [], [False, False], 0


def _times(tuning: dict, key) -> _Times:
    """Rank 0's :class:`_Times` of calls of kind ``key`` (new the first time)."""
    times = tuning.get(key)
    if times is None:
        times = tuning[key] = _Times()
    return times


def _say(tuning: dict, key) -> bool:
    """Rank 0's say for the next call of kind ``key``: True for the arena.
    Each way is tried until it has :data:`_TRIED` times (after its warm-up);
    then the way whose least recent time (of :data:`_KEPT`) is lower, except
    every ``_EXPLORE * slower / faster`` calls the other, so that a change of the machine's state (the
    VM's vCPUs moved apart, the arena's copies at a quarter of their speed)
    is seen within a few dozen calls while the slower way costs at most
    1/_EXPLORE of the time."""
    times = _times(tuning, key)
    times.calls += 1
    if len(times.copy) < _TRIED:
        return False
    if len(times.arena) < _TRIED:
        return True
    copy, arena = min(times.copy), min(times.arena)
    faster, slower = (arena, copy) if arena < copy else (copy, arena)
    explore = times.calls % max(_EXPLORE, int(_EXPLORE * slower / max(faster, 1e-9))) == 0
    return (arena < copy) != explore


def _learnt(tuning: dict, key, arena: bool, seconds: float) -> None:
    """Keep a call's time, the way rank 0 said."""
    times = _times(tuning, key)
    if not times.warm[arena]:
        times.warm[arena] = True
        return
    kept = times.arena if arena else times.copy
    kept.append(seconds)
    del kept[:-_KEPT]


