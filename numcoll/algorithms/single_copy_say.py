"""Rank 0's say for the ``cma_measured`` algorithms: single copy or the arena,
call by call, from its recent times of both (:mod:`.single_copy`).

Rank 0 alone keeps times, per kind of call (:func:`measured_key`), and says
in its *where* which way the call goes; every rank reads that one say, so
the ranks cannot part.
"""

from __future__ import annotations

__all__ = ["measured_key", "fused_say", "fused_learnt"]

#: Rank 0's times kept per kind of call and way (the least of them counts),
#: and how rarely it tries the slower way (see _say). A way whose one time so
#: far is _SUSPECT times the other's is tried once more before the two are
#: compared: one time can be a peer's one-off delay (a first call that loaded
#: compiled code took 3 ms, and alone it kept that way off for a thousand
#: calls), while trying every way twice would cost a short run of large calls
#: (a benchmark's 5 of 64 MiB) a slow call more.
_KEPT, _EXPLORE, _SUSPECT = 4, 16, 4
#: Warm-up calls of each way (copy, arena), whose times are not kept: a
#: group's first single-copy call loads compiled code, and its second plans
#: the repeat's fused start (:mod:`numcoll.fast.copy`, 15-30 ms of loading
#: compiled code on the rank that plans it, which the others wait for).
_WARM_UPS = (2, 1)


def measured_key(op_name: str, nbytes: int) -> tuple:
    """The kind of a call whose ranks publish ``nbytes`` to read in all, as
    rank 0 keeps its times (one per power of two)."""
    return op_name, nbytes.bit_length()


class _Times:
    """Rank 0's last times (seconds) of one kind of call, each way (the
    first :data:`_WARM_UPS` of each way are not kept), and how many it said."""

    __slots__ = ("copy", "arena", "warm", "calls")

    def __init__(self):
        self.copy, self.arena, self.warm, self.calls = [], [], [0, 0], 0


def _times(tuning: dict, key) -> _Times:
    """Rank 0's :class:`_Times` of calls of kind ``key`` (new the first time)."""
    times = tuning.get(key)
    if times is None:
        times = tuning[key] = _Times()
    return times


def _say(tuning: dict, key) -> bool:
    """Rank 0's say for the next call of kind ``key``: True for the arena.
    Each way is tried until it has a time (after its warm-ups), a way whose
    one time is :data:`_SUSPECT` times the other's once more; then the way
    whose least recent time (of :data:`_KEPT`) is lower, except every
    ``_EXPLORE * slower / faster`` calls the other, so that a change of the
    machine's state (the VM's vCPUs moved apart, the arena's copies at a
    quarter of their speed) is seen within a few dozen calls while the slower
    way costs at most 1/_EXPLORE of the time."""
    times = _times(tuning, key)
    times.calls += 1
    if not times.copy:
        return False
    if not times.arena:
        return True
    copy, arena = min(times.copy), min(times.arena)
    if len(times.copy) == 1 and copy > _SUSPECT * arena:
        return False
    if len(times.arena) == 1 and arena > _SUSPECT * copy:
        return True
    faster, slower = (arena, copy) if arena < copy else (copy, arena)
    explore = times.calls % max(_EXPLORE, int(_EXPLORE * slower / max(faster, 1e-9))) == 0
    return (arena < copy) != explore


def fused_say(tuning: dict, key) -> bool:
    """Rank 0's say (:func:`_say`) for a fused single-copy start
    (:mod:`numcoll.fast.copy`): True, the arena, sends the call down the
    ordinary path, which asks again -- so that say is not counted, and the
    ordinary path's is the same."""
    said = _say(tuning, key)
    if said:
        _times(tuning, key).calls -= 1
    return said


def fused_learnt(tuning: dict, key, seconds: float) -> None:
    """Keep a fused single-copy start's time (it copied): :func:`_learnt`."""
    _learnt(tuning, key, False, seconds)


def _learnt(tuning: dict, key, arena: bool, seconds: float) -> None:
    """Keep a call's time, the way rank 0 said."""
    times = _times(tuning, key)
    if times.warm[arena] < _WARM_UPS[arena]:
        times.warm[arena] += 1
        return
    kept = times.arena if arena else times.copy
    kept.append(seconds)
    del kept[:-_KEPT]
