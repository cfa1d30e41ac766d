"""Which ranks of a group are gone: what ``agree`` and ``shrink`` count on.

After a failure the group's transport is closed (the abort that makes every
survivor stop waiting closes it), so liveness cannot ask it to carry
anything. It is read from three places, none of which needs the dead rank:

- the store: a rank that leaves a failed group (``shutdown()`` after a
  failure or a revoke, or a rank the survivors excluded) writes
  ``ft/gone/<rank>``;
- the operating system, for ranks on this host: every rank publishes its
  host key, pid and process start time when the group is made
  (``ft/who/<rank>``); a rank whose process no longer exists (or is a
  zombie, or is another process under a reused pid) is dead. This is what
  finds a SIGKILLed rank at once;
- the transport's own failure detection, as it stood when it closed: a peer
  whose connection was *lost* (the shm helper saw its socket end without a
  goodbye; tcp saw a disconnect and ``peer_grace_s`` of silence) -- the
  only source for ranks on other hosts.

A rank found dead stays dead (the set only grows). A rank on another host
that dies after this rank's transport closed is learned from the votes of
survivors that saw it (see :mod:`.agreement`), or not at all: the agreement
then ends at its deadline.
"""

from __future__ import annotations

import json
import os

import transports

__all__ = ["Liveness", "identity", "process_alive", "WHO", "GONE"]

WHO = "ft/who/{rank}"
GONE = "ft/gone/{rank}"
#: Words of the transports' reasons that say a peer was lost, not closed.
_LOST = "lost"


def _start_time(pid: int) -> int | None:
    """The start time of process ``pid`` (clock ticks since boot), None if
    there is none; a zombie counts as none."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rfind(b")") + 2:].split()  # after the command name, which may hold spaces
    if fields[0] in (b"Z", b"X"):
        return None
    return int(fields[19])


def identity() -> bytes:
    """This process as liveness sees it: host key, pid and start time."""
    pid = os.getpid()
    return json.dumps({"host": transports.host_key(), "pid": pid,
                       "start": _start_time(pid)}).encode()


def process_alive(who: dict) -> bool:
    """Whether the process ``who`` (an :func:`identity`) still runs on this host."""
    start = _start_time(who["pid"])
    return start is not None and (who["start"] is None or start == who["start"])


class Liveness:
    """What this rank knows of which ranks of its group are gone.

    Parameters
    ----------
    store : the group's store (already prefixed for the group).
    rank, size : this rank and the group's size.
    transport : the group's transport (its mailbox's ``gone`` is read).
    processes : whether ranks are processes that publish who they are (thread
        ranks, on the inproc transport, share one: only the store tells).
    """

    def __init__(self, store, rank: int, size: int, transport, processes: bool = True):
        self._store, self._rank, self._size = store, rank, size
        self._transport, self._processes = transport, processes
        self._who: dict[int, dict | None] = {}
        self._here = None
        self.dead: set[int] = set()

    def publish(self) -> None:
        """Say who this rank is (once, when the group is made)."""
        if self._processes:
            self._store.set(WHO.format(rank=self._rank), identity())

    def leave(self) -> None:
        """This rank is gone from the group (it shut a failed group down)."""
        self._store.set(GONE.format(rank=self._rank), b"1")

    def lost_by_transport(self) -> set[int]:
        """Peers whose connection the transport saw lost (not closed)."""
        mailbox = getattr(self._transport, "mailbox", None)
        gone = dict(getattr(mailbox, "gone", None) or {})
        return {p for p, why in gone.items() if _LOST in why}

    def check(self, ranks) -> set[int]:
        """Those of ``ranks`` found gone now (added to :attr:`dead`)."""
        lost = self.lost_by_transport()
        for q in ranks:
            if q == self._rank or q in self.dead:
                continue
            if q in lost or self._process_ended(q) or \
                    self._store.check([GONE.format(rank=q)]):
                self.dead.add(q)
        return self.dead

    def _process_ended(self, q: int) -> bool:
        if not self._processes:
            return False
        who = self._who.get(q)
        if who is None:
            key = WHO.format(rank=q)
            if not self._store.check([key]):
                return False  # not published yet: its group is still being made
            who = self._who[q] = json.loads(self._store.get(key))
        if self._here is None:
            self._here = json.loads(identity())
        if who["host"] != self._here["host"] or who["pid"] == self._here["pid"]:
            return False
        return not process_alive(who)
