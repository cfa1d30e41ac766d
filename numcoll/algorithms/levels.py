"""A group's hosts, and some of a call's ranks as a comm of their own: what
the two-level algorithms (:mod:`.twolevel`, :mod:`.twolevel_streams`) run on.

:class:`Topology` is built once per group (``numcoll.process_group``, from
the ``hier`` transport's ``hosts``) and reaches the algorithms as
``comm.topology``; :class:`SubComm` wraps a :class:`numcoll.comm.Comm` for
one phase of one call (this host's ranks, or one rank per host).
"""

from __future__ import annotations

__all__ = ["Topology", "SubComm"]


class Topology:
    """Which ranks of a group share a host, as one rank sees it.

    ``hosts``: the group's ranks per host (hosts ordered by their lowest
    rank); ``host``: this rank's host (an index of ``hosts``); ``local``:
    its ranks; ``lanes``: the fewest ranks any host has (so many ranks of
    every host can each carry a share of the traffic between hosts);
    ``slot_nbytes``: the bytes one step of a host's shared arena carries (the
    group's setting, equal on every host; 0: no arenas).
    """

    __slots__ = ("hosts", "host", "local", "lanes", "slot_nbytes", "host_of")

    def __init__(self, hosts, rank: int, slot_nbytes: int):
        self.hosts = tuple(tuple(h) for h in hosts)
        self.host_of = {r: i for i, h in enumerate(self.hosts) for r in h}
        self.host = self.host_of[rank]
        self.local = self.hosts[self.host]
        self.lanes = min(len(h) for h in self.hosts)
        self.slot_nbytes = slot_nbytes

    @property
    def two_level(self) -> bool:
        """Whether two-level algorithms pay off: several hosts, one of them
        with several ranks, and arenas to combine them in."""
        return (len(self.hosts) > 1 and max(len(h) for h in self.hosts) > 1
                and self.slot_nbytes > 0)

    def __repr__(self) -> str:
        return f"Topology(hosts={self.hosts}, host={self.host})"


class SubComm:
    """The group ranks ``ranks`` of a call's comm ``parent`` as a comm of their
    own, numbered 0..len(ranks)-1 in that order: what a two-level algorithm
    runs a phase on (this host's ranks, or one rank per host), with the verbs
    of a :class:`numcoll.comm.Comm`.

    Messages and arena reads go through the parent to its (group) ranks, so
    tags keep the call's sequence number and every error names group ranks.
    ``step_base`` is added to every step, to keep phases apart. The arena
    verbs are meaningful on this host's ranks only (the parent's arena is
    its host's).
    """

    __slots__ = ("parent", "ranks", "rank", "size", "_base")

    def __init__(self, parent, ranks, step_base: int = 0):
        self.parent = parent
        self.ranks = tuple(ranks)
        self.rank = self.ranks.index(parent.rank)
        self.size = len(self.ranks)
        self._base = step_base

    def isend(self, peer: int, step: int, buf):
        return self.parent.isend(self.ranks[peer], self._base + step, buf)

    def irecv(self, peer: int, step: int, buf=None):
        return self.parent.irecv(self.ranks[peer], self._base + step, buf)

    def wait(self, pending):
        return self.parent.wait(pending)

    def wait_all(self, pendings) -> None:
        self.parent.wait_all(pendings)

    def sendrecv(self, send_peer: int, recv_peer: int, step: int, send_buf, recv_buf=None):
        return self.parent.sendrecv(self.ranks[send_peer], self.ranks[recv_peer],
                                    self._base + step, send_buf, recv_buf)

    @property
    def arena_slot_nbytes(self) -> int:
        return self.parent.arena_slot_nbytes

    def next_slot(self):
        return self.parent.next_slot()

    def shared_step(self, payload=None, nbytes: int | None = None) -> int:
        return self.parent.shared_step(payload, nbytes)

    def shared_publish(self, payload=None, nbytes: int | None = None) -> int:
        return self.parent.shared_publish(payload, nbytes)

    def shared_wait(self, step: int) -> None:
        self.parent.shared_wait(step)

    def shared_view(self, step: int, peer: int, start: int, nbytes: int):
        return self.parent.shared_view(step, self.ranks[peer], start, nbytes)

    def size_mismatch(self, peer: int, detail: str):
        self.parent.size_mismatch(self.ranks[peer], detail)
