"""Which algorithm runs a collective: by message size and world size, unless
forced per call (``opts.algorithm``), per group (``Options.algorithm``) or by
``NUMCOLL_ALGORITHM``."""

from __future__ import annotations

from ..algorithms import CHOICES
from ..config import Config, forced_algorithm

__all__ = ["choose", "segment_count"]


def choose(cfg: Config, collective: str, requested: str | None, nbytes: int, size: int):
    """The algorithm function for ``collective`` on ``nbytes`` bytes over ``size`` ranks."""
    options = CHOICES[collective]
    name = requested or forced_algorithm(cfg, collective)
    if name is None:
        name = _automatic(cfg, collective, nbytes, size)
    try:
        return options[name]
    except KeyError:
        raise ValueError(f"{collective}: unknown algorithm {name!r}; choose one of "
                         f"{sorted(options)}") from None


def _automatic(cfg: Config, collective: str, nbytes: int, size: int) -> str:
    if collective == "allreduce":
        return "recursive_doubling" if nbytes <= cfg.allreduce_small_nbytes else "ring"
    if collective == "broadcast":
        return "binomial" if nbytes <= cfg.broadcast_small_nbytes else "chain"
    if collective == "reduce":
        return "binomial" if nbytes <= cfg.allreduce_small_nbytes else "ring"
    raise KeyError(collective)


def segment_count(cfg: Config, itemsize: int) -> int:
    """Elements per segment for arrays of ``itemsize`` bytes."""
    return max(1, cfg.segment_nbytes // max(1, itemsize))
