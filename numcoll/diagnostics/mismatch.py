"""Mismatches between ranks, in words: two calls that disagree, the settings
that must agree, and messages of finished calls that no call took.

:class:`Finished` finds the mismatches nobody would otherwise learn of: a
message held for a collective this rank has finished proves that its sender
ran another call. :func:`both_calls` and :func:`settings_hint` word the
``CollectiveMismatchError`` of :meth:`numcoll.comm.Comm._translate` too.
"""

from __future__ import annotations

from transports.mailbox import NONE_HELD

from ..call import SEQ_MASK, Call, describe_stamp, stamp_call, stamp_settings
from ..config import AGREED
from ..errors import CollectiveMismatchError, GroupPoisonedError

__all__ = ["AGREE", "Finished", "both_calls", "leftover_error", "settings_hint"]

AGREE = ("Every rank must call the same collectives, in the same order, with the same dtype, "
         "element count, op and root")


def both_calls(call: Call, seq: int | None, stamp: bytes, their_seq: int | None):
    """This rank's call and the other rank's (from its stamp), in words; with the
    algorithm and settings where those are all that differ."""
    mine, theirs = call.summary(seq), describe_stamp(stamp, their_seq, detail=False)
    if mine == theirs:
        mine, theirs = call.summary(seq, detail=True), describe_stamp(stamp, their_seq)
    return mine, theirs


def settings_hint(stamp: bytes, theirs: bytes) -> str:
    """What to do when two stamps differ in their settings fingerprint, or
    name different algorithms for one call under the same settings."""
    a, b = stamp_settings(stamp), stamp_settings(theirs)
    if a is None or b is None:
        return ""
    if a == b:
        mine, other = stamp_call(stamp), stamp_call(theirs)
        # (all but the algorithm alike: the stamp's fifth byte, call.py's _STAMP)
        if mine[1] != other[1] and stamp[:4] + stamp[5:] == theirs[:4] + theirs[5:]:
            return (". Under the same settings the ranks chose different algorithms for "
                    "this call: some passed an algorithm for it (opts.algorithm) and "
                    "others did not, or another; pass the same on every rank")
        return ""
    names = ", ".join(f"NUMCOLL_{name.upper()}" for name in AGREED)
    return (f". The ranks' settings differ (fingerprints {a:04x} and {b:04x}): every rank "
            f"must use the same {names} (and ProcessGroup.Options(algorithm=...))")


def leftover_error(rank: int, peer: int, seq: int, stamp: bytes,
                   mine: Call | None) -> CollectiveMismatchError:
    """The error for a message of call ``seq`` from ``peer`` that no call on this
    rank took though this rank finished its call ``seq`` (``mine``, if known):
    the two ranks ran different calls without noticing (both roots of a
    broadcast, say, each sending and neither receiving)."""
    if mine is not None:
        ours, theirs = both_calls(mine, seq, stamp, seq)
        hint = settings_hint(mine.stamp, stamp)
    else:
        ours, theirs, hint = f"collective #{seq}", describe_stamp(stamp, seq), ""
    return CollectiveMismatchError(
        f"Detected mismatch between collectives on ranks. Rank {rank} ran {ours}, but rank "
        f"{peer} ran {theirs}: rank {peer} sent rank {rank} a message of that call which no "
        f"call on rank {rank} received, so the two calls did not exchange what they should "
        f"have (their results are not valid). {AGREE}{hint}", peer=peer)


class _NoMailbox:
    """The mailbox of a transport that has none (one of the caller's own): it holds nothing."""

    held_calls = 0
    oldest_call = NONE_HELD

    @staticmethod
    def oldest_held():
        return None


_NO_MAILBOX = _NoMailbox()


class Finished:
    """Tells a message that arrived early from one that no call will ever take:
    a message held for a collective this rank has finished proves that its
    sender ran another call (two roots of one broadcast each send, neither
    receives, and both go on). The group asks :meth:`check` only while the
    mailbox holds a stamped message of a call no later than its own
    (``mailbox.held_calls``, ``mailbox.oldest_call``: attributes, so the check
    costs nothing otherwise), passing ``below``, the lowest number of a
    collective it has not finished; its flight recorder names this rank's side
    of a finished call."""

    __slots__ = ("mailbox", "rank", "_recorder", "_pg_id")

    def __init__(self, mailbox, rank: int, recorder=None, pg_id: int = -1):
        # A transport without a mailbox (one of the caller's own) holds nothing.
        self.mailbox = mailbox if mailbox is not None else _NO_MAILBOX
        self.rank, self._recorder, self._pg_id = rank, recorder, pg_id

    def check(self, seq: int, call: Call, finished: bool, below: int) -> None:
        """Raise :class:`CollectiveMismatchError` if the mailbox holds a message
        of a finished collective (one numbered under ``below``, or ``seq``
        itself once ``finished``)."""
        error = self._unclaimed(seq, call, finished, below)
        if error is not None:
            raise error

    def explain(self, seq: int, call: Call, exc: BaseException, below: int) -> BaseException:
        """``exc``, or the mismatch that explains it (a peer that found it first
        and left, say), caused by it."""
        if not self.mailbox.held_calls or isinstance(exc, (CollectiveMismatchError,
                                                          GroupPoisonedError)):
            return exc
        error = self._unclaimed(seq, call, False, below)
        if error is None:
            return exc
        error.__cause__ = exc
        return error

    def _unclaimed(self, seq, call, finished, below) -> CollectiveMismatchError | None:
        # In this order: a message still held after its call had finished (it
        # may have been held for a call in flight a moment ago, and been taken).
        found = self.mailbox.oldest_held()
        if found is None:
            return None
        key, peer, stamp = found
        if not (finished and seq > 0 and key == seq & SEQ_MASK):
            if key >= below & SEQ_MASK:  # (point-to-point tags are above every collective's)
                return None
            seq = below - (below & SEQ_MASK) + key
            rec = self._recorder.find(self._pg_id, seq) if self._recorder is not None else None
            call = rec.call if rec is not None else None
        return leftover_error(self.rank, peer, seq, stamp, call)
