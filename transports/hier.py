"""Transport ``hier``: one group over several hosts -- shared memory among
the ranks of each host, tcp between hosts.

A composite of two transports made through the registry, each used through
its public interface: an ``shm`` transport among the ranks of this host
(numbered 0..L-1 there; it brings the host's shared arena) and a ``tcp``
transport among all the ranks of the group.

Topology
    Every rank publishes its :func:`transports.host_key` (host name, network
    namespace and boot: what ranks that can share memory have in common) in
    the store and reads everyone's. ``hosts`` lists the group's ranks per
    host, hosts ordered by their lowest rank; ``local`` is this host's.
Routing
    A message to a rank of this host goes through the shm rings, to any other
    rank through tcp. Two exceptions need one matching engine for every
    peer, so they travel over tcp to local ranks too: receives from
    ``ANY_SOURCE`` (posted on tcp alone), and therefore every message whose
    tag has :data:`NET_TAG_BIT` set -- numcoll's point-to-point namespace
    (``numcoll.comm.p2p_tag``), the only tags a receive from any source uses.
    A receive from ``ANY_SOURCE`` with another tag would miss this host's
    messages, so it is refused (``ValueError``) where the host has other
    ranks. A peer's messages of one call always take the same path, so the
    transports' per-call stamp checks see all of them.
The arena
    ``arena`` is this host's shared arena (``None`` where this host has one
    rank, or arenas are off), addressed by *group* rank: ``view(step, r)``
    and ``nbytes(step, r)`` take a rank of this host. It is shared by this
    host's ranks only, so the group-wide ``shared`` algorithms must not run
    on it when the group spans hosts; numcoll's two-level algorithms run
    their host-local phases on it.
Errors
    What the shm transport raises names ranks as it numbers them (among this
    host's ranks); this transport translates ``peer`` and every "rank N" of
    the message to the group's ranks, so every error names group ranks.
"""

from __future__ import annotations

import re

from .base import ANY_SOURCE, Rendezvous, TransportError
from .endpoint import Prefixed, forget

__all__ = ["HierTransport", "HostArena", "NET_TAG_BIT", "hosts_from_keys"]

#: Messages whose tag has this bit travel over tcp, whatever the peer (see
#: the module docstring; numcoll's point-to-point tags set it).
NET_TAG_BIT = 1 << 63
#: Store key of a rank's host key.
HOST_KEY = "hier/host/{rank}"


def hosts_from_keys(keys: list[str]) -> tuple[tuple[int, ...], ...]:
    """Ranks per host from each rank's host key, hosts ordered by their lowest rank."""
    by_key: dict[str, list[int]] = {}
    for rank, key in enumerate(keys):
        by_key.setdefault(key, []).append(rank)
    return tuple(tuple(ranks) for ranks in by_key.values())


_RANK = re.compile(r"\brank (\d+)")


def _globalise(exc: TransportError, ranks: tuple[int, ...]) -> TransportError:
    """A copy of ``exc`` (raised by the shm transport, which numbers this
    host's ranks 0..L-1) naming group ranks, in ``peer`` and in its message.
    A copy, because a failed request raises the same exception on every wait."""
    new = exc.__class__.__new__(exc.__class__)
    new.__dict__.update(exc.__dict__)
    peer = exc.peer
    if isinstance(peer, int) and 0 <= peer < len(ranks):
        new.peer = ranks[peer]

    def group_rank(match: re.Match) -> str:
        local = int(match.group(1))
        return f"rank {ranks[local]}" if local < len(ranks) else match.group(0)

    new.args = (_RANK.sub(group_rank, str(exc)),)
    return new


class _LocalRequest:
    """A request of the shm transport, in group ranks."""

    __slots__ = ("_req", "_ranks")

    def __init__(self, req, ranks: tuple[int, ...]):
        self._req, self._ranks = req, ranks

    @property
    def source(self) -> int | None:
        source = self._req.source
        return None if source is None else self._ranks[source]

    def wait(self, deadline: float | None):
        try:
            return self._req.wait(deadline)
        except TransportError as exc:
            raise _globalise(exc, self._ranks) from None

    def done(self) -> bool:
        return self._req.done()


class HostArena:
    """This host's shared arena (:class:`transports.shm.arena.SharedArena`),
    addressed by group rank, its errors naming group ranks. Same methods."""

    def __init__(self, arena, ranks: tuple[int, ...]):
        self._arena = arena
        self._ranks = ranks
        self._index = {r: i for i, r in enumerate(ranks)}
        #: This host's ranks (group ranks); the arena's size is their number.
        self.ranks = ranks
        self.rank = ranks[arena.rank]
        self.size = len(ranks)
        self.slot_nbytes = arena.slot_nbytes

    @property
    def next_step(self) -> int:
        return self._arena.next_step

    def mine(self, step: int):
        return self._arena.mine(step)

    def put(self, payload, seq: int, stamp: bytes, nbytes: int | None = None) -> int:
        try:
            return self._arena.put(payload, seq, stamp, nbytes)
        except TransportError as exc:
            raise _globalise(exc, self._ranks) from None

    def step(self, payload, seq: int, stamp: bytes, deadline: float | None,
             call: int | None = None, nbytes: int | None = None) -> int:
        try:
            return self._arena.step(payload, seq, stamp, deadline, call, nbytes)
        except TransportError as exc:
            raise _globalise(exc, self._ranks) from None

    def wait(self, step: int, seq: int, stamp: bytes, deadline: float | None,
             call: int | None = None) -> None:
        try:
            self._arena.wait(step, seq, stamp, deadline, call)
        except TransportError as exc:
            raise _globalise(exc, self._ranks) from None

    def nbytes(self, step: int, rank: int) -> int:
        return self._arena.nbytes(step, self._index[rank])

    def view(self, step: int, rank: int, start: int = 0, nbytes: int | None = None):
        return self._arena.view(step, self._index[rank], start, nbytes)


class _Mailboxes:
    """What numcoll asks of a transport's mailbox (``held_calls``,
    ``oldest_call``, ``oldest_held``: messages held that no receive took yet),
    over both of this transport's, the shm one's peers in group ranks."""

    __slots__ = ("_net", "_shm", "_local")

    def __init__(self, net, shm, local: tuple[int, ...]):
        self._net, self._shm, self._local = net, shm, local

    @property
    def held_calls(self) -> int:
        return self._net.held_calls + self._shm.held_calls

    @property
    def oldest_call(self) -> int:
        return min(self._net.oldest_call, self._shm.oldest_call)

    @property
    def gone(self) -> dict[int, str]:
        """Why peers left (group ranks: both transports' word on them)."""
        merged = {self._local[p]: why for p, why in self._shm.gone.items()}
        merged.update(self._net.gone)
        return merged

    def oldest_held(self) -> tuple[int, int, bytes] | None:
        net = self._net.oldest_held() if self._net.held_calls else None
        shm = self._shm.oldest_held() if self._shm.held_calls else None
        if shm is not None:
            shm = (shm[0], self._local[shm[1]], shm[2])
        found = [f for f in (net, shm) if f is not None]
        return min(found, key=lambda f: f[0]) if found else None


class HierTransport:
    """Shared memory among this host's ranks, tcp to the others (see the module docstring).

    Parameters
    ----------
    rank, size : int
        This rank and the group size.
    store : Rendezvous
        Already prefixed for the group.
    options : transports.TransportOptions
        Passed on to both transports (``host`` is what tcp binds to;
        ``arena_slot_nbytes`` sizes this host's arena).
    host_key : str, optional
        This rank's host key (default :func:`transports.host_key`): ranks
        with equal keys must be able to share memory. Tests pass made-up keys
        to run several "hosts" in one.
    """

    def __init__(self, rank: int, size: int, store: Rendezvous, options=None, *,
                 host_key: str | None = None):
        from . import TransportOptions, create
        from . import host_key as this_host

        options = options if options is not None else TransportOptions()
        if not 0 <= rank < size:
            raise ValueError(f"invalid rank {rank} for group size {size}")
        self.rank, self.size = rank, size
        store.set(HOST_KEY.format(rank=rank), (host_key or this_host()).encode())
        keys = [store.get(HOST_KEY.format(rank=r)).decode() for r in range(size)]
        #: The group's ranks per host, hosts ordered by their lowest rank.
        self.hosts = hosts_from_keys(keys)
        #: This host's index in ``hosts``, and its ranks.
        self.host = next(i for i, h in enumerate(self.hosts) if rank in h)
        self.local = self.hosts[self.host]
        # Messages to the other ranks of this host go through shared memory
        # (those to this rank itself through tcp, as any-source receives may
        # take them there).
        self._local_index = {r: i for i, r in enumerate(self.local) if r != rank}
        self._net = create("tcp", rank, size, Prefixed(store, "hier/net/"), options)
        # Every peer published its tcp address after reading every host key,
        # and this rank has read every address: its key can go.
        forget(store, HOST_KEY.format(rank=rank))
        try:
            self._shm = create("shm", self.local.index(rank), len(self.local),
                               Prefixed(store, f"hier/host{self.host}/"), options)
        except BaseException:
            self._net.close()
            raise
        arena = self._shm.arena
        #: This host's shared arena in group ranks (None: one rank here, or arenas off).
        self.arena = None if arena is None else HostArena(arena, self.local)
        #: No shared arrays: their memory would be this host's, not the group's.
        self.shared_memory = None
        self.in_process = False     # its ranks are processes (on several hosts)
        #: No single-copy reads: the group's ranks span hosts.
        self.single_copy = None
        #: Both transports' mailboxes as one, in group ranks (what numcoll
        #: checks for messages of a finished call).
        self.mailbox = _Mailboxes(self._net.mailbox, self._shm.mailbox, self.local)

    def isend(self, peer: int, tag: int, buf, stamp: bytes = b""):
        local = self._local_index.get(peer)
        if local is None or tag & NET_TAG_BIT:
            return self._net.isend(peer, tag, buf, stamp)
        try:
            return _LocalRequest(self._shm.isend(local, tag, buf, stamp), self.local)
        except TransportError as exc:
            raise _globalise(exc, self.local) from None

    def irecv(self, peer: int, tag: int, buf=None, stamp: bytes = b"",
              whole_call: bool = False):
        if peer == ANY_SOURCE and not tag & NET_TAG_BIT and len(self.local) > 1:
            raise ValueError(f"recv on rank {self.rank}: the hier transport takes a message "
                             "from any source only with a tag that has bit 63 set (such "
                             f"messages travel over tcp from every peer), got tag {tag}")
        local = self._local_index.get(peer)  # None for ANY_SOURCE too
        if local is None or tag & NET_TAG_BIT:
            return self._net.irecv(peer, tag, buf, stamp, whole_call)
        try:
            return _LocalRequest(self._shm.irecv(local, tag, buf, stamp, whole_call),
                                 self.local)
        except TransportError as exc:
            raise _globalise(exc, self.local) from None

    def close(self) -> None:
        """Close both transports (idempotent)."""
        try:
            self._shm.close()
        finally:
            self._net.close()

    def __repr__(self) -> str:
        return (f"<HierTransport rank {self.rank}/{self.size}, host {self.host} of "
                f"{len(self.hosts)}: {list(self.local)}>")
