"""Counting and logging what a rank or a store refuses: connections that fail
their handshake, frames that fail their checks, peers that are not who they say.

A refusal is never fatal and never silent. Every one is counted; the first
``burst`` of each interval are logged in full; the rest are summed per
(reason, peer address) and written as one summary line per pair when the
interval ends -- by a timer, so a flood that stops is still reported -- and
when the log is closed (a transport's or store's shutdown). An attacker who
opens 2,000 connections costs a few lines, not 2,000, and a lone refusal is
never held back until the next one comes.

One flusher thread serves every log of the process that has refusals waiting
to be summarised; it starts with the first such log and exits when none is
left, so a transport that never refuses more than a burst (nearly all of
them) costs no thread, and nothing is left running after a clean shutdown.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter

__all__ = ["RefusalLog"]

#: Refusals logged in full per interval before the rest are only summed.
DEFAULT_BURST = 5
DEFAULT_INTERVAL_S = 10.0


class RefusalLog:
    """Rate-limited, counted warnings about refusals.

    Parameters
    ----------
    who : str
        What is refusing, e.g. ``"numcoll transport rank 0"``: every line starts with it.
    logger : logging.Logger or str
        Where the lines go.
    burst, interval_s :
        At most ``burst`` full lines per ``interval_s`` seconds; the rest are summarised.

    ``count`` is every refusal since creation; ``counts`` the same per reason
    (tests and diagnostics read them). Never raises.
    """

    def __init__(self, who: str, logger: logging.Logger | str = "numcoll.transport",
                 burst: int = DEFAULT_BURST, interval_s: float = DEFAULT_INTERVAL_S):
        self.who = who
        self._log = logging.getLogger(logger) if isinstance(logger, str) else logger
        self._burst, self.interval_s = burst, interval_s
        self._lock = threading.Lock()
        self._window_end = 0.0
        self._logged = 0
        self._pending: Counter = Counter()  # (reason, peer) -> refusals not logged yet
        self.count = 0
        self.counts: Counter = Counter()
        self._closed = False

    def refuse(self, reason: str, peer: str = "", detail: str = "") -> None:
        """Count one refusal. ``reason`` is a short fixed phrase (it keys the
        summary: "bad handshake", "wrong token", ...); ``peer`` the address or
        process it came from; ``detail`` what only the full line shows."""
        now = time.monotonic()
        with self._lock:
            self.count += 1
            self.counts[reason] += 1
            if now >= self._window_end:
                self._window_end, self._logged = now + self.interval_s, 0
            held = self._logged >= self._burst
            if held:
                first_held = not self._pending and not self._closed
                self._pending[(reason, peer)] += 1
            else:
                self._logged += 1
        if held:
            if first_held:  # nothing else held back: the timer must come for this one
                _flusher.add(self)
            return
        who = f" from {peer}" if peer else ""
        self._emit(f"{self.who}: refused{who}: {reason}" + (f" ({detail})" if detail else ""))

    # A dropped frame is a refusal of a message rather than a connection.
    drop = refuse

    def flush(self) -> None:
        """Write one summary line per (reason, peer) counted but not yet logged."""
        with self._lock:
            pending, self._pending = self._pending, Counter()
        for (reason, peer), n in sorted(pending.items(), key=lambda kv: -kv[1]):
            who = f" from {peer}" if peer else ""
            self._emit(f"{self.who}: refused {n} more{who}: {reason} (not logged one by one)")

    def close(self) -> None:
        """Flush, and stop taking part in the timed flushes. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        _flusher.discard(self)
        self.flush()

    def _emit(self, line: str) -> None:
        try:
            self._log.warning("%s", line)
        except Exception:  # noqa: BLE001 - logging must never fail the refusal
            pass


class _Flusher:
    """The one thread that flushes, on their interval, the refusal logs
    that hold refusals back; a log leaves its care once a flush finds nothing."""

    def __init__(self):
        self._cond = threading.Condition()
        self._logs: set[RefusalLog] = set()
        self._thread: threading.Thread | None = None

    def add(self, log: RefusalLog) -> None:
        with self._cond:
            self._logs.add(log)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="numcoll-refusal-log",
                                                daemon=True)
                self._thread.start()

    def discard(self, log: RefusalLog) -> None:
        with self._cond:
            self._logs.discard(log)
            self._cond.notify_all()

    def _run(self) -> None:
        while True:
            with self._cond:
                if not self._logs:
                    self._thread = None
                    return
                interval = min(log.interval_s for log in self._logs)
                self._cond.wait(interval)
                logs = list(self._logs)
            for log in logs:
                log.flush()
            with self._cond:
                # A log that held nothing back since its flush leaves; one that
                # holds something back later comes again through add().
                self._logs.difference_update([log for log in logs if not log._pending])


_flusher = _Flusher()
