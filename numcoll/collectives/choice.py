"""Which algorithm runs a collective: by message size and world size, unless
forced per call (``opts.algorithm``), per group (``Options.algorithm``) or by
``NUMCOLL_ALGORITHM``. Every collective goes through :func:`choose`, at the
call, so an unknown name is a ``ValueError`` before anything is queued."""

from __future__ import annotations

from typing import Callable, NamedTuple

from ..algorithms import CHOICES, SHARED
from ..config import Config, forced_algorithm

__all__ = ["Choice", "choose", "check_forced", "segment_count"]


class Choice(NamedTuple):
    """The algorithm chosen for a call: its name (for the flight recorder and
    messages) and the function that runs it."""

    name: str
    run: Callable


def choose(cfg: Config, collective: str, requested: str | None, nbytes: int,
           size: int, shared: bool = True) -> Choice:
    """The algorithm for ``collective`` (a key of :data:`numcoll.algorithms.CHOICES`)
    on ``nbytes`` bytes over ``size`` ranks. ``shared=False``: not one of the
    shared arena's (for a collective run inside another call, whose arena
    turn was not taken)."""
    options = CHOICES[collective]
    if requested is not None and not isinstance(requested, str):
        raise TypeError(f"{collective}: algorithm must be a str, got {type(requested).__name__}")
    name = requested or forced_algorithm(cfg, collective)
    if name is None:
        name = _automatic(cfg, collective, nbytes, size, shared)
    try:
        choice = Choice(name, options[name])
    except KeyError:
        raise ValueError(f"{collective}: unknown algorithm {name!r}; choose one of "
                         f"{sorted(options)}") from None
    if name in SHARED and not cfg.arena_slot_nbytes and size > 1:
        raise ValueError(f"{collective}: algorithm {name!r} needs ranks that share memory "
                         "(the shm transport, with arena_slot_nbytes > 0); this group has "
                         "no shared arena")
    return choice


def check_forced(cfg: Config) -> None:
    """``ValueError`` unless every ``collective:algorithm`` forced by
    ``cfg.algorithm`` names a known collective family and one of its algorithms."""
    for item in filter(None, (s.strip() for s in cfg.algorithm.split(","))):
        collective, _, name = (part.strip() for part in item.partition(":"))
        if collective not in CHOICES:
            raise ValueError(f"algorithm {item!r}: unknown collective {collective!r}; choose "
                             f"one of {sorted(CHOICES)}")
        if name not in CHOICES[collective]:
            raise ValueError(f"algorithm {item!r}: unknown algorithm {name!r} for "
                             f"{collective}; choose one of {sorted(CHOICES[collective])}")


def _automatic(cfg: Config, collective: str, nbytes: int, size: int, shared: bool) -> str:
    on_arena = _shared(cfg, collective, nbytes, size) if shared else None
    if on_arena is not None:
        return on_arena
    if collective == "allreduce":
        return "recursive_doubling" if nbytes <= cfg.allreduce_small_nbytes else "ring"
    if collective == "broadcast":
        return "binomial" if nbytes <= cfg.broadcast_small_nbytes else "chain"
    if collective == "reduce":
        return "binomial" if nbytes <= cfg.allreduce_small_nbytes else "ring"
    # One algorithm each, besides the shared one: the table's other entry.
    (only,) = (name for name in CHOICES[collective] if name not in SHARED)
    return only


def _shared(cfg: Config, collective: str, nbytes: int, size: int) -> str | None:
    """The shared-arena algorithm for this call, if the group has an arena
    and one applies (the thresholds: see :mod:`numcoll.config`)."""
    if not cfg.arena_slot_nbytes or size == 1 or nbytes > cfg.shared_max_nbytes:
        return None
    if collective == "allreduce":
        return "shared_split" if size > 2 and nbytes >= cfg.shared_split_nbytes else "shared"
    if collective in ("reduce_scatter", "scatter", "alltoall") and \
            cfg.arena_slot_nbytes < 16 * size + 8 * (size + 8):
        return None  # a round holds an element for every rank (and alltoall's table)
    return "shared" if "shared" in CHOICES[collective] else None


def segment_count(cfg: Config, itemsize: int) -> int:
    """Elements per segment for arrays of ``itemsize`` bytes."""
    return max(1, cfg.segment_nbytes // max(1, itemsize))
