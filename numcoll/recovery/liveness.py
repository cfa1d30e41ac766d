"""Which ranks of a group are gone: what ``agree`` and ``shrink`` count on.

After a failure the group's transport is closed (the abort that makes every
survivor stop waiting closes it), so liveness cannot ask it to carry
anything. It is read from three places, none of which needs the dead rank:

- the store: every rank publishes its host key, pid and process start
  time (``ft/who/<rank>``) when the group is made; one that shuts the
  group down replaces it with ``ft/left/<rank>`` (the last rank to leave
  deletes those and the ``ft/left`` count: a group all of whose ranks left
  keeps nothing in the store). A rank with a ``left`` key has left;
- the operating system, for ranks on this host: a rank whose process no
  longer exists (or is a zombie, or is another process under a reused pid)
  is dead. This is what finds a SIGKILLed rank at once;
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

__all__ = ["Liveness", "identity", "process_alive", "WHO", "LEFT"]

WHO = "ft/who/{rank}"
LEFT = "ft/left/{rank}"
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
    group : the group (its ``_transport`` and ``transport_kind`` are read when
        needed: the transport does not exist yet when :meth:`publish` runs).
    """

    def __init__(self, store, rank: int, size: int, group):
        self._store, self._rank, self._size, self._group = store, rank, size, group
        self._who: dict[int, dict] = {}
        self._here = json.loads(identity())
        self.dead: set[int] = set()

    def publish(self) -> None:
        """Say who this rank is: before the transport connects (see the module docstring)."""
        self._store.set(WHO.format(rank=self._rank), json.dumps(self._here).encode())

    def leave(self, failed=(), also=()) -> None:
        """This rank leaves the group (it shuts it down); the last to leave
        takes every key back -- ``failed``: the ranks the survivors agreed
        are gone (they never leave), whose keys go too; ``also``: more keys."""
        store = self._store
        try:
            # Failed ranks that left before they were found gone counted themselves.
            silent = [r for r in failed if not store.check([LEFT.format(rank=r)])]
            store.set(LEFT.format(rank=self._rank), b"")
            store.delete_key(WHO.format(rank=self._rank))
            if store.add("ft/left", 1) == self._size - len(silent):
                for r in range(self._size):
                    store.delete_key(LEFT.format(rank=r))
                for r in failed:
                    store.delete_key(WHO.format(rank=r))
                for key in ("ft/left", *also):
                    store.delete_key(key)
        except Exception:  # noqa: BLE001 - a store gone with its host keeps nothing anyway
            pass

    def lost_by_transport(self) -> set[int]:
        """Peers whose connection the transport saw lost (not closed)."""
        mailbox = getattr(getattr(self._group, "_transport", None), "mailbox", None)
        gone = dict(getattr(mailbox, "gone", None) or {})
        return {p for p, why in gone.items() if _LOST in why}

    def check(self, ranks) -> set[int]:
        """Those of ``ranks`` found gone now (added to :attr:`dead`)."""
        lost = self.lost_by_transport()
        for q in ranks:
            if q == self._rank or q in self.dead:
                continue
            if q in lost or self._ended(q):
                self.dead.add(q)
        return self.dead

    def _ended(self, q: int) -> bool:
        """Whether rank ``q`` left or its process ended."""
        if self._store.check([LEFT.format(rank=q)]):
            return True
        who = self._who.get(q)
        if who is None:
            key = WHO.format(rank=q)
            if not self._store.check([key]):
                return False  # not published yet: its group is still being made
            who = self._who[q] = json.loads(self._store.get(key))
        if who["host"] != self._here["host"] or who["pid"] == self._here["pid"]:
            return False  # another host's, or a thread rank of this process
        return not process_alive(who)
