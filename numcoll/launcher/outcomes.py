"""What ``nc.launch`` reports: its errors, the ranks' outcomes, and what a
stuck rank is doing (its caller's line and, from the flight recorder, what its
collectives wait for)."""

from __future__ import annotations

import os
import sys
import threading
import time
from datetime import timedelta
from typing import Any

from ..diagnostics import flight_recorder
from ..errors import CollectiveTimeoutError, GroupPoisonedError, NumcollError, PeerError

__all__ = ["RankFailedError", "LaunchError", "LaunchTimeoutError"]


class RankFailedError(NumcollError):
    """A rank's function raised (or its process died). ``rank`` names it;
    ``__cause__`` is the original exception when it could be brought back;
    ``results`` holds the return values of the ranks that finished (None
    elsewhere) and ``failures`` maps every failed rank to its message."""

    def __init__(self, message: str, rank: int, results: list | None = None,
                 failures: dict[int, str] | None = None):
        super().__init__(message)
        self.rank = rank
        self.results = results if results is not None else []
        self.failures = failures if failures is not None else {}


class LaunchError(NumcollError):
    """The ranks could not start (their function could not be loaded there)."""


class LaunchTimeoutError(NumcollError, TimeoutError):
    """``launch``'s overall deadline passed. ``ranks`` lists the ranks still
    running then; ``blocked`` maps each to what it was blocked on, if known;
    ``results`` holds the return values of the ranks that finished."""

    def __init__(self, message: str, ranks: list[int], blocked: dict[int, str],
                 results: list | None = None):
        super().__init__(message)
        self.ranks = ranks
        self.blocked = blocked
        self.results = results if results is not None else []


# -- outcome bookkeeping ---------------------------------------------------------------
class _Outcomes:
    def __init__(self, world_size: int):
        self.results: list[Any] = [None] * world_size
        #: (when, rank, exception or None, text, stopped by the launcher)
        self.failures: list[tuple[float, int, BaseException | None, str, bool]] = []
        self.lock = threading.Lock()

    def fail(self, rank: int, exc: BaseException | None, text: str,
             stopped: bool = False) -> None:
        with self.lock:
            self.failures.append((time.monotonic(), rank, exc, text, stopped))

    def raise_first(self) -> None:
        if not self.failures:
            return
        # A rank's own error, or its death, explains the run; the errors of
        # the ranks it left behind (its peer is gone, the group is poisoned, a
        # wait for it timed out) come next, and last the ranks the launcher
        # stopped (they raised nothing: they were still running).
        def weight(f):
            consequence = isinstance(f[2], (PeerError, GroupPoisonedError,
                                            CollectiveTimeoutError))
            return (2 if f[4] else 1 if consequence else 0), f[0]

        _, rank, exc, text, _ = min(self.failures, key=weight)
        ordered = sorted(self.failures, key=lambda f: f[0])
        failed = {f[1]: f[3] for f in ordered}
        stopped = {f[1]: f[3] for f in ordered if f[4]}
        # A wait that timed out names the rank it waited for: if the launcher
        # had to stop that rank, it is the one that stalled.
        culprit = getattr(exc, "peer", None)
        lead = culprit if culprit in stopped and culprit != rank else rank
        others = sorted(set(failed) - {lead})
        also = f" (ranks {others} failed too)" if others else ""
        head, _, rest = text.partition("\n")
        what = "stalled" if lead != rank else "failed"
        notes = "".join(f"\n  rank {r}: {t}" for r, t in stopped.items() if r != rank)
        message = f"rank {lead} {what}{also}: {head}{notes}" + (f"\n{rest}" if rest else "")
        results = [None if r in failed else v for r, v in enumerate(self.results)]
        raise RankFailedError(message, lead, results, failed) from exc


# Tracebacks name them as users import them: ``numcoll.LaunchError: ...``.
for _cls in (RankFailedError, LaunchError, LaunchTimeoutError):
    _cls.__module__ = "numcoll"
del _cls


def _finished(outcomes: _Outcomes, stuck: list[int]) -> list:
    failed = {f[1] for f in outcomes.failures} | set(stuck)
    return [None if r in failed else v for r, v in enumerate(outcomes.results)]


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _timeout_message(timeout: timedelta, stuck: list[int], blocked: dict[int, str],
                     note: str = "") -> str:
    lines = [f"Timed out waiting {round(timeout.total_seconds() * 1000)}ms for launch: "
             f"ranks {stuck} still running{note}"]
    lines += [f"  rank {r}: {blocked.get(r, 'unknown')}" for r in stuck]
    return "\n".join(lines)


# -- what a rank is blocked on ---------------------------------------------------------
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_PACKAGE_DIRS = tuple(os.path.join(_ROOT, pkg) + os.sep for pkg in ("numcoll", "transports"))
_LIBRARY_DIRS = _PACKAGE_DIRS + (os.path.dirname(threading.__file__) + os.sep,)


def _stack(frame):
    """Frames from outermost to innermost."""
    frames = []
    while frame is not None:
        frames.append(frame)
        frame = frame.f_back
    return frames[::-1]


def _blocked_on(rank_ident: int, rank: int) -> str:
    """Describe what rank ``rank`` (its main thread is ``rank_ident``) is doing:
    the user's line and the numcoll call it is in (from that thread's stack),
    and what its collectives in progress wait for (the flight recorder keeps
    each one's peer while it waits). Best effort."""
    try:
        parts = []
        stack = _stack(sys._current_frames().get(rank_ident))
        user = [f for f in stack if not f.f_code.co_filename.startswith(_LIBRARY_DIRS)]
        if user:
            f = user[-1]
            where = f"{f.f_code.co_name} ({os.path.basename(f.f_code.co_filename)}:{f.f_lineno})"
            after = stack[stack.index(f) + 1:]
            call = next((g for g in after if g.f_code.co_filename.startswith(_PACKAGE_DIRS)), None)
            parts.append(f"in numcoll's {call.f_code.co_name}() called from {where}"
                         if call is not None else f"running {where}")
        recorder = flight_recorder.recorder()
        if recorder is not None:
            parts.extend(recorder.waiting(rank))
        return "; ".join(parts) or "no numcoll call in progress"
    except Exception as exc:  # noqa: BLE001 - a diagnosis must never raise
        return f"unknown ({_describe(exc)})"
