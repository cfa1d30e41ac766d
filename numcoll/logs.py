"""The ``numcoll`` logger.

numcoll logs through the standard :mod:`logging` module, under the logger
named ``numcoll`` (children: ``numcoll.rendezvous``, ``numcoll.launcher.run`` ...). A
library should not configure logging, so by default the logger only has a
handler when the environment asks for one:

- ``NUMCOLL_LOG_LEVEL=DEBUG|INFO|WARNING|ERROR`` (like ``TORCH_CPP_LOG_LEVEL``)
  sets the level and attaches a stderr handler whose lines carry the time,
  the process id and the rank (when known);
- ``NUMCOLL_DEBUG=1`` is shorthand for ``NUMCOLL_LOG_LEVEL=DEBUG``.

Without either, records at WARNING and above still reach stderr through
Python's last-resort handler, and an application that configures
:mod:`logging` itself sees every record it enables.
"""

from __future__ import annotations

import logging
import os
import warnings

__all__ = ["get_logger", "configure", "set_rank"]

_ROOT = "numcoll"
_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
_handler: logging.Handler | None = None
_rank: int | None = None


class _RankFilter(logging.Filter):
    """Adds ``rank`` to every record, so one format serves all ranks' lines."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.rank = "?" if _rank is None else _rank
        return True


def set_rank(rank: int | None) -> None:
    """Name this process's rank in later log lines (set by init_process_group)."""
    global _rank
    _rank = rank


def _level_from_env() -> str | None:
    level = os.environ.get("NUMCOLL_LOG_LEVEL", "").strip().upper()
    if level:
        if level not in _LEVELS:
            # Not an error: a typo in a logging knob must not stop the program.
            warnings.warn(f"NUMCOLL_LOG_LEVEL={level!r} ignored: use one of "
                          f"{', '.join(_LEVELS)}", stacklevel=3)
            return None
        return level
    if os.environ.get("NUMCOLL_DEBUG", "").strip().lower() in ("1", "true", "yes", "on"):
        return "DEBUG"
    return None


def configure(level: str | int | None = None) -> logging.Logger:
    """Attach numcoll's stderr handler to the ``numcoll`` logger at ``level``
    (default: from ``NUMCOLL_LOG_LEVEL`` / ``NUMCOLL_DEBUG``; nothing is
    attached when neither is set). Calling it again only changes the level."""
    global _handler
    logger = logging.getLogger(_ROOT)
    level = level if level is not None else _level_from_env()
    if level is None:
        return logger
    logger.setLevel(level)
    if _handler is None:
        _handler = logging.StreamHandler()
        _handler.addFilter(_RankFilter())
        _handler.setFormatter(logging.Formatter(
            "%(asctime)s numcoll[pid %(process)d rank %(rank)s] %(levelname)s "
            "%(name)s: %(message)s"))
        logger.addHandler(_handler)
    return logger


def get_logger(name: str = "") -> logging.Logger:
    """The ``numcoll`` logger, or its child ``numcoll.<name>``."""
    return logging.getLogger(f"{_ROOT}.{name}" if name else _ROOT)


configure()
