"""The notes a group's ranks leave in its store when they abort.

A rank that aborts (or times out waiting for a peer) publishes which rank
caused the failure and why, so that its peers' errors
(:meth:`numcoll.comm.Comm._translate`) name the rank that caused it rather
than the neighbour that passed it on.
"""

from __future__ import annotations

import json
import threading

__all__ = ["AbortNotes", "abort_note", "read_note", "note_mismatch"]

# How long a rank waits for its note to reach the store (or a peer's to be
# read) before going on: the store write or read goes on in the background,
# and a dead store must not slow the abort or the error it explains.
_NOTE_WAIT_S = 0.25


def abort_note(culprit: int, reason: str, mismatch: str | None = None) -> bytes:
    """What an aborting rank publishes in the store: the rank that caused the
    failure (itself, or the peer it lost) and why, for its peers' errors;
    where the cause is a mismatch of calls, the mismatch's own message too."""
    note = {"culprit": culprit, "reason": reason}
    if mismatch:
        note["mismatch"] = mismatch
    return json.dumps(note).encode()


class AbortNotes:
    """The group's notes in its store: what a rank that aborts (or times out
    waiting for a peer) says, so that its peers' errors name the rank that
    caused a failure rather than the neighbour that passed it on. Every
    store access is bounded (:data:`_NOTE_WAIT_S`)."""

    def __init__(self, store, rank: int):
        self._store, self._rank = store, rank

    def publish(self, culprit: int, reason: str, mismatch: str | None = None) -> None:
        """This rank aborts (or is stuck) because of rank ``culprit`` (with
        ``mismatch``, the message of the mismatch of calls that caused it)."""
        note = abort_note(culprit, reason, mismatch)

        def write():
            try:
                self._store.set(f"abort/{self._rank}", note)
            except Exception:  # noqa: BLE001 - best effort: peers still see the close
                pass

        _bounded(write, f"numcoll-r{self._rank}-abort", _NOTE_WAIT_S)

    def read(self, peer: int) -> bytes | None:
        """What ``peer`` published, if it did (bounded)."""
        key = f"abort/{peer}"
        found: list = []

        def look():
            try:
                if self._store.check([key]):
                    found.append(self._store.get(key))
            except Exception:  # noqa: BLE001 - only an explanation; never mask the error
                pass

        _bounded(look, f"numcoll-r{self._rank}-why", _NOTE_WAIT_S * 2)
        return found[0] if found else None


def _bounded(fn, name: str, wait_s: float) -> None:
    """Run ``fn`` on a daemon thread, waiting at most ``wait_s`` for it."""
    thread = threading.Thread(target=fn, name=name, daemon=True)
    thread.start()
    thread.join(wait_s)


def read_note(note: bytes | str | None) -> tuple[int | None, str | None]:
    if note is None:
        return None, None
    try:
        data = json.loads(note)
        return int(data["culprit"]), str(data["reason"])
    except (ValueError, KeyError, TypeError):
        text = note.decode(errors="replace") if isinstance(note, bytes) else str(note)
        return None, text


def note_mismatch(note: bytes | str | None) -> str | None:
    """The mismatch of calls that a peer's abort note says caused the failure."""
    try:
        mismatch = None if note is None else json.loads(note).get("mismatch")
    except (ValueError, AttributeError, TypeError):
        return None
    return mismatch if isinstance(mismatch, str) and mismatch else None
