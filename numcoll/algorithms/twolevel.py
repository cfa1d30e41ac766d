"""Two-level algorithms: groups over several hosts, with several ranks on a host.

The cable between hosts, not memory, is what such a group waits for. A flat
ring crosses it 2(P-1)/P times per byte of an allreduce per direction (1.5
times for 2 hosts of 2 ranks, 1.67 for 2 of 3); combining a host's ranks
through shared memory first crosses it once per host. Every algorithm here
has three phases, on the comm's two levels (:class:`.levels.SubComm` objects:
this host's ranks, with its shared arena, and one rank per host):

1. *combine within the host* through the arena (one synchronisation per
   round of at most a slot's bytes);
2. *exchange between hosts*, by messages, among *lanes*: lane j is the j-th
   rank of every host. With ``spread=False`` (``twolevel``) there is one
   lane, a leader per host; with ``spread=True`` (``twolevel_lanes``) there
   are as many as the smallest host has ranks, each lane carrying 1/K of the
   bytes and doing 1/K of the reduction (a host with fewer ranks makes the
   whole group use fewer lanes);
3. *spread within the host* through the arena.

The buffer is cut into blocks of at most a slot (and at most the segment
count, so tests force many blocks), and the phases are pipelined: while the
bytes of block b are on the cable, the host combines block b+1 and spreads
block b-1. Every rank of a host runs the same arena steps in the same order
(non-lane ranks included), which the arena's step counts check; hosts may
run different numbers of steps, since arenas are per host. Block and piece
sizes follow from the group's settings alone, so both ends of every message
agree on its size.

Each combined element is computed by exactly one rank, in a fixed order, so
every rank ends with bitwise the same result. Costs: S bytes, H hosts,
L ranks on the host, K lanes.

Prior art: the hierarchical (two-level, "SMP-aware") collectives of MPICH
and Open MPI's ``han``; NCCL's tree/ring across nodes with NVLink within.
"""

from __future__ import annotations

from collections import deque

from .barrier import barrier_dissemination
from .levels import SubComm
from .partition import chunk_bounds, segments
from .shared import _bytes, _combine, _copy_in

__all__ = ["allreduce_twolevel", "allreduce_twolevel_lanes", "reduce_twolevel",
           "reduce_twolevel_lanes", "broadcast_twolevel", "broadcast_twolevel_lanes",
           "barrier_twolevel", "Levels", "per_block"]

#: Blocks in flight between hosts: a chain posts its receives this many
#: blocks ahead, and an allreduce finishes block b's exchange only when block
#: b + _WINDOW - 1's has started, so the cable has blocks queued while a rank
#: of the host is slow to publish the next one (2 cores, busy machine: a
#: window of 1 idled the cable for milliseconds at a time).
_WINDOW = 4


class Levels:
    """One rank's two levels for one call: ``local`` (this host's ranks, with
    the arena), the lanes and, on a lane's rank, ``across`` (its lane: one
    rank per host, numbered by host).

    ``lead``: a rank that leads its host (lane 0 there), e.g. a root, so the
    root is the rank that exchanges with the other hosts.
    """

    __slots__ = ("hosts", "host", "local", "lanes", "order", "lane", "across")

    def __init__(self, comm, spread: bool, lead: int | None = None):
        top = comm.topology
        self.hosts, self.host = top.hosts, top.host
        self.local = SubComm(comm, top.local)
        self.lanes = top.lanes if spread else 1
        #: Each host's ranks in lane order (``lead`` first on its host).
        self.order = [sorted(h, key=lambda r: r != lead) for h in top.hosts]
        place = self.order[self.host].index(comm.rank)
        self.lane = place if place < self.lanes else None
        self.across = (SubComm(comm, [o[place] for o in self.order])
                       if self.lane is not None else None)

    def lane_rank(self, j: int) -> int:
        """Lane j's rank on this host, as ``local`` numbers it."""
        return self.local.ranks.index(self.order[self.host][j])

    @property
    def shared(self) -> bool:
        """Whether this host has an arena step to run (more than one rank)."""
        return self.local.size > 1


def per_block(comm, itemsize: int, segment_count: int | None) -> int:
    """Elements per block: what one arena slot holds, at most ``segment_count``
    -- from the group's settings only, so equal on every host."""
    fits = comm.topology.slot_nbytes // itemsize
    if fits < 1:
        raise ValueError(f"the shared arena's {comm.topology.slot_nbytes}-byte slot cannot "
                         f"hold an element of {itemsize} bytes")
    return fits if segment_count is None else max(1, min(fits, segment_count))


# -- allreduce -----------------------------------------------------------------------
def _combine_block(lv: Levels, buf, start: int, count: int, shares) -> None:
    """Phase 1 of a block: every rank of the host publishes it; each lane
    combines its share (in rank order) into its buffer."""
    if not lv.shared:
        return
    step = lv.local.shared_step(_bytes(buf.send_view(start, count)))
    if lv.lane is not None:
        first, n = shares[lv.lane]
        if n:
            _combine(lv.local, buf, step, start + first, n, first * buf.itemsize)


def _spread_block(lv: Levels, buf, start: int, shares) -> None:
    """Phase 3 of a block: each lane publishes its share; every rank copies
    the shares of the other lanes."""
    if not lv.shared:
        return
    payload = None
    if lv.lane is not None:
        first, n = shares[lv.lane]
        payload = _bytes(buf.send_view(start + first, n)) if n else None
    step = lv.local.shared_step(payload)
    for j, (first, n) in enumerate(shares):
        if j != lv.lane and n:
            _copy_in(buf, start + first, n,
                     lv.local.shared_view(step, lv.lane_rank(j), 0, n * buf.itemsize))


def _exchange(across, buf, start: int, n: int, step: int):
    """Two hosts: swap the share, then reduce the other's into ours (one
    round; op(a, b) == op(b, a), so both hosts hold the same bits)."""
    if not n:
        yield
        return
    other = 1 - across.rank
    theirs = across.irecv(other, step)
    sent = across.isend(other, step, buf.send_view(start, n))
    yield
    data = across.wait(theirs)
    across.wait(sent)  # zero-copy: our bytes are gone before the region changes
    buf.reduce_from(start, n, data)


def _reduce_scatter_allgather(across, buf, start: int, n: int, step: int):
    """H hosts: host h reduces piece h of the share (its own partial, then
    the others' in host order h+1, h+2, ...), then every host sends its
    reduced piece to every other. Two rounds; each host sends and receives
    2 n (H-1)/H elements, as a ring would, in 2 steps instead of 2(H-1)."""
    size, me = across.size, across.rank
    pieces = chunk_bounds(n, size)
    others = [(me + k) % size for k in range(1, size)]
    mine, count = pieces[me]
    recvs = [across.irecv(g, 2 * step) for g in others] if count else []
    sends = [across.isend(g, 2 * step, buf.send_view(start + pieces[g][0], pieces[g][1]))
             for g in others if pieces[g][1]]
    yield
    for pending in recvs:
        buf.reduce_from(start + mine, count, across.wait(pending))
    gathers = [(start + pieces[g][0], pieces[g][1],
                across.irecv(g, 2 * step + 1, buf.recv_view(start + pieces[g][0], pieces[g][1])))
               for g in others if pieces[g][1]]
    if count:
        sends += [across.isend(g, 2 * step + 1, buf.send_view(start + mine, count))
                  for g in others]
    yield
    for first, k, pending in gathers:
        across.wait(pending)
        buf.recv_done(first, k)
    across.wait_all(sends)


def _allreduce(comm, buf, segment_count, spread: bool) -> None:
    lv = Levels(comm, spread)
    hosts = len(lv.hosts)
    cross = _exchange if hosts == 2 else _reduce_scatter_allgather
    # Stages of an exchange after the one that posts it (one per yield): a
    # block's middle stages run as soon as they can, its last one _WINDOW - 1
    # blocks later, then the block is spread.
    stages = 0 if hosts == 1 else 1 if hosts == 2 else 2
    lag = 0 if hosts == 1 else max(stages, _WINDOW - 1)
    blocks = segments(0, buf.count, per_block(comm, buf.itemsize, segment_count))
    running: deque = deque()  # (block, start, shares, exchange or None), oldest first
    for b in range(len(blocks) + lag):
        if b < len(blocks):
            start, count = blocks[b]
            shares = chunk_bounds(count, lv.lanes)
            _combine_block(lv, buf, start, count, shares)
            exchange = None
            if lv.across is not None and stages:
                first, n = shares[lv.lane]
                exchange = cross(lv.across, buf, start + first, n, b)
                next(exchange)  # its sends go out before any older block is waited for
            running.append((b, start, shares, exchange))
        for k, _, _, exchange in running:
            if exchange is not None and 0 < b - k < stages:
                next(exchange)  # a middle stage: as soon as it can run
        if running and running[0][0] <= b - lag:
            _, start, shares, exchange = running.popleft()
            if exchange is not None:
                next(exchange, None)  # the last stage: the bytes are in
            _spread_block(lv, buf, start, shares)


def allreduce_twolevel(comm, buf, segment_count: int | None = None) -> None:
    """Allreduce over hosts through one leader per host (see the module docstring).

    Per block: the host's ranks publish it in the arena and the leader
    combines all L slots; the leaders allreduce it (2 hosts: one exchange;
    more: reduce-scatter then allgather, each host reducing 1/H); the leader
    publishes the result and every rank copies it. The cable carries
    2 S (H-1)/H per direction (S for two hosts), whatever L; 2 arena
    synchronisations per block; pipelined across blocks.
    """
    _allreduce(comm, buf, segment_count, False)


def allreduce_twolevel_lanes(comm, buf, segment_count: int | None = None) -> None:
    """:func:`allreduce_twolevel` with every rank of a host carrying 1/K of
    each block across (K lanes) and combining 1/K of it: K parallel streams
    and reductions; the same bytes on the cable."""
    _allreduce(comm, buf, segment_count, True)


# -- reduce and broadcast: chains of hosts ---------------------------------------
def _chain(lv: Levels, first_host: int) -> tuple[int | None, int | None]:
    """The hosts before and after this one on the chain that starts at
    ``first_host`` and visits the hosts in order."""
    hosts = len(lv.hosts)
    pos = (lv.host - first_host) % hosts
    before = (lv.host - 1) % hosts if pos > 0 else None
    after = (lv.host + 1) % hosts if pos < hosts - 1 else None
    return before, after


def _reduce(comm, buf, root: int, segment_count, spread: bool) -> None:
    lv = Levels(comm, spread, lead=root)
    root_host = comm.topology.host_of[root]
    # The chain ends at the root's host: it starts right after it.
    before, after = _chain(lv, (root_host + 1) % len(lv.hosts))
    blocks = segments(0, buf.count, per_block(comm, buf.itemsize, segment_count))
    shares_of = [chunk_bounds(count, lv.lanes) for _, count in blocks]
    across = lv.across
    posted: dict[int, object] = {}
    sends = []

    def post(b):
        if across is not None and before is not None and b < len(blocks) \
                and shares_of[b][lv.lane][1]:
            posted[b] = across.irecv(before, b)

    for b in range(_WINDOW):
        post(b)
    for b, (start, count) in enumerate(blocks):
        shares = shares_of[b]
        _combine_block(lv, buf, start, count, shares)
        if across is not None:
            first, n = shares[lv.lane]
            if b in posted:
                buf.reduce_from(start + first, n, across.wait(posted.pop(b)))
            if after is not None and n:
                sends.append(across.isend(after, b, buf.send_view(start + first, n)))
            post(b + _WINDOW)
        if lv.host == root_host and lv.shared and lv.lanes > 1:
            _gather_block(lv, buf, start, shares, root)
    if across is not None:
        across.wait_all(sends)


def _gather_block(lv: Levels, buf, start: int, shares, root: int) -> None:
    """The root's host, a block: each lane publishes its reduced share; the
    root (lane 0) copies the others'."""
    payload = None
    if lv.lane is not None:
        first, n = shares[lv.lane]
        payload = _bytes(buf.send_view(start + first, n)) if n else None
    step = lv.local.shared_step(payload)
    if lv.local.ranks[lv.local.rank] != root:
        return
    for j, (first, n) in enumerate(shares[1:], 1):
        if n:
            _copy_in(buf, start + first, n,
                     lv.local.shared_view(step, lv.lane_rank(j), 0, n * buf.itemsize))


def reduce_twolevel(comm, buf, root: int, segment_count: int | None = None) -> None:
    """Reduce over hosts: each host combines a block in its arena into its
    leader (the root leads its own host), and the blocks travel a chain of
    hosts that ends at the root's, each host adding its part.
    Cost: every host's cable carries S in and S out at most (the root's host
    only in, the first only out); 1 synchronisation per block (2 on the
    root's host with lanes); the chain is pipelined by blocks.
    """
    _reduce(comm, buf, root, segment_count, False)


def reduce_twolevel_lanes(comm, buf, root: int, segment_count: int | None = None) -> None:
    """:func:`reduce_twolevel` with K lanes: each rank of a host combines and
    forwards 1/K of every block; the root's host gathers the lanes' shares."""
    _reduce(comm, buf, root, segment_count, True)


def _broadcast(comm, buf, root: int, segment_count, spread: bool) -> None:
    lv = Levels(comm, spread, lead=root)
    root_host = comm.topology.host_of[root]
    before, after = _chain(lv, root_host)
    blocks = segments(0, buf.count, per_block(comm, buf.itemsize, segment_count))
    shares_of = [chunk_bounds(count, lv.lanes) for _, count in blocks]
    across, itemsize = lv.across, buf.itemsize
    posted: dict[int, object] = {}
    sends = []

    def post(b):
        if across is not None and before is not None and b < len(blocks):
            first, n = shares_of[b][lv.lane]
            if n:
                posted[b] = (across.irecv(before, b, buf.recv_view(blocks[b][0] + first, n)))

    for b in range(_WINDOW):
        post(b)
    for b, (start, count) in enumerate(blocks):
        shares = shares_of[b]
        if lv.host == root_host and lv.shared:
            # The root publishes the block; its host's ranks copy it.
            if comm.rank == root:
                lv.local.shared_step(_bytes(buf.send_view(start, count)))
            else:
                step = lv.local.shared_step(None)
                _copy_in(buf, start, count, lv.local.shared_view(
                    step, lv.local.ranks.index(root), 0, count * itemsize))
        if across is not None:
            first, n = shares[lv.lane]
            if b in posted:
                across.wait(posted.pop(b))
                buf.recv_done(start + first, n)
            if after is not None and n:
                sends.append(across.isend(after, b, buf.send_view(start + first, n)))
            post(b + _WINDOW)
        if lv.host != root_host:
            _spread_block(lv, buf, start, shares)
    if across is not None:
        across.wait_all(sends)


def broadcast_twolevel(comm, buf, root: int, segment_count: int | None = None) -> None:
    """Broadcast over hosts: the root publishes each block in its host's
    arena, its host's leader (the root) sends it down a chain of hosts, and
    each host's leader publishes it in its arena as it passes.
    Cost: each host's cable carries S in and S out at most; 1 synchronisation
    per block on every host; pipelined by blocks.
    """
    _broadcast(comm, buf, root, segment_count, False)


def broadcast_twolevel_lanes(comm, buf, root: int, segment_count: int | None = None) -> None:
    """:func:`broadcast_twolevel` with K lanes: each rank of a host forwards
    1/K of every block, and the host's ranks copy the lanes' shares."""
    _broadcast(comm, buf, root, segment_count, True)


def barrier_twolevel(comm) -> None:
    """Barrier over hosts: an arena step (the host's ranks have arrived), a
    dissemination barrier among the hosts' leaders, an arena step (release).
    Cost: 2 synchronisations and ceil(log2 H) steps of empty messages."""
    lv = Levels(comm, False)
    if lv.shared:
        lv.local.shared_step(None)
    if lv.across is not None and len(lv.hosts) > 1:
        barrier_dissemination(lv.across)
    if lv.shared:
        lv.local.shared_step(None)
