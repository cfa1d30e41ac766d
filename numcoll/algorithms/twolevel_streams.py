"""Two-level allgather and reduce-scatter: chunks that belong to ranks.

Both move *streams*: host g's stream is the chunks of its ranks, in rank
order (a list of buffer ranges). Lane j of a host (see
:mod:`.twolevel`) carries part j of K of every stream it moves, so the
bytes between hosts are split among the lanes, and a part travels straight
from the host that has it to the host that needs it (each host's cable
carries what it must and nothing twice). Messages are cut into pieces of at
most a block, and arena rounds take at most a block; both follow from the
chunks and the group's settings, so every host cuts them alike.
"""

from __future__ import annotations

import numpy as np

from .partition import chunk_bounds, segments
from .shared import _bytes, _combine, _copy_in, allgather_shared
from .twolevel import Levels, per_block

__all__ = ["allgather_twolevel", "allgather_twolevel_lanes", "reduce_scatter_twolevel",
           "reduce_scatter_twolevel_lanes"]


def _part(ranges, first: int, n: int) -> list[tuple[int, int]]:
    """The buffer ranges of elements ``first .. first + n`` of a stream."""
    out, pos = [], 0
    for start, count in ranges:
        lo, hi = max(first, pos), min(first + n, pos + count)
        if lo < hi:
            out.append((start + lo - pos, hi - lo))
        pos += count
        if pos >= first + n:
            break
    return out


def _pieces(ranges, per: int) -> list[tuple[int, int]]:
    """``ranges`` cut into messages of at most ``per`` elements."""
    return [piece for start, count in ranges for piece in segments(start, count, per)]


def _total(ranges) -> int:
    return sum(count for _, count in ranges)


class _Streams:
    """The streams of a call and their lanes' parts."""

    def __init__(self, lv: Levels, chunks):
        self.ranges = [[chunks[r] for r in ranks if chunks[r][1]] for ranks in lv.hosts]
        self.lanes = lv.lanes

    def part(self, host: int, lane: int) -> list[tuple[int, int]]:
        """The buffer ranges of lane ``lane``'s part of host ``host``'s stream."""
        ranges = self.ranges[host]
        first, n = chunk_bounds(_total(ranges), self.lanes)[lane]
        return _part(ranges, first, n)


def _rounds(total: int, per: int) -> int:
    return -(-total // per)


def _pack(slot, buf, ranges) -> int:
    """Copy ``ranges`` of ``buf`` back to back into the arena slot; the bytes."""
    at = 0
    for start, count in ranges:
        nbytes = count * buf.itemsize
        np.copyto(slot[at:at + nbytes], _bytes(buf.send_view(start, count)))
        at += nbytes
    return at


def _allgather(comm, buf, chunks, segment_count, spread: bool) -> None:
    lv = Levels(comm, spread)
    streams = _Streams(lv, chunks)
    per = per_block(comm, buf.itemsize, segment_count)
    others = [(lv.host + k) % len(lv.hosts) for k in range(1, len(lv.hosts))]
    across, local = lv.across, lv.local
    # Every lane's parts of the other hosts' streams, in the order they arrive
    # and are spread: host by host.
    remote = [[r for g in others for r in streams.part(g, j)] for j in range(lv.lanes)]
    # Posted first: they land in place, in ranges the local phase never touches.
    recvs = []
    if across is not None:
        recvs = [(count, across.irecv(g, 0, buf.recv_view(start, count)))
                 for g in others for start, count in _pieces(streams.part(g, lv.lane), per)]
    if lv.shared:
        allgather_shared(local, buf, [chunks[r] for r in local.ranks], per)
    sends = []
    if across is not None:
        mine = _pieces(streams.part(lv.host, lv.lane), per)
        sends = [across.isend(g, 0, buf.send_view(start, count))
                 for g in others for start, count in mine]
    arrived = _Arrivals(across, recvs)
    if lv.shared:
        for k in range(max(_rounds(_total(r), per) for r in remote)):
            nbytes = 0
            if lv.lane is not None:
                arrived.until((k + 1) * per)
                nbytes = _pack(local.next_slot(), buf, _part(remote[lv.lane], k * per, per))
            step = local.shared_step(None, nbytes)
            for j in range(lv.lanes):
                if j != lv.lane:
                    _copy_ranges(lv, buf, step, j, _part(remote[j], k * per, per))
    arrived.until(None)
    if across is not None:
        across.wait_all(sends)


class _Arrivals:
    """Waits for posted receives in order, as far as a stream position."""

    def __init__(self, across, recvs):
        self._across, self._recvs, self._next, self._covered = across, recvs, 0, 0

    def until(self, position: int | None) -> None:
        """Wait until the first ``position`` elements have arrived (None: all)."""
        while self._next < len(self._recvs) and (position is None or self._covered < position):
            count, pending = self._recvs[self._next]
            self._across.wait(pending)
            self._covered += count
            self._next += 1


def _copy_ranges(lv: Levels, buf, step: int, lane: int, ranges, within=None) -> None:
    """Copy ``ranges`` (published back to back by lane ``lane`` at ``step``)
    into ``buf``; with ``within`` (start, count), only what falls inside it."""
    at = 0
    source = lv.lane_rank(lane)
    for start, count in ranges:
        lo, hi = start, start + count
        if within is not None:
            lo, hi = max(lo, within[0]), min(hi, within[0] + within[1])
        if lo < hi:
            _copy_in(buf, lo, hi - lo, lv.local.shared_view(
                step, source, at + (lo - start) * buf.itemsize, (hi - lo) * buf.itemsize))
        at += count * buf.itemsize


def allgather_twolevel(comm, buf, chunks, segment_count: int | None = None) -> None:
    """Allgather over hosts: an arena allgather on each host, then each host's
    leader sends its host's stream to every other host's leader, which
    publishes what arrives in its arena as it arrives.
    Cost: host h's cable carries (H-1) S_h out and S - S_h in (S_h: its
    ranks' bytes) -- what allgather must move, each byte once per host;
    1 synchronisation per round of the arena allgather and per block spread.
    """
    _allgather(comm, buf, chunks, segment_count, False)


def allgather_twolevel_lanes(comm, buf, chunks, segment_count: int | None = None) -> None:
    """:func:`allgather_twolevel` with K lanes: each rank of a host sends and
    receives part j of K of every stream, and publishes what it received."""
    _allgather(comm, buf, chunks, segment_count, True)


def _reduce_scatter(comm, buf, chunks, segment_count, spread: bool) -> None:
    lv = Levels(comm, spread)
    streams = _Streams(lv, chunks)
    per = per_block(comm, buf.itemsize, segment_count)
    hosts = len(lv.hosts)
    others = [(lv.host + k) % hosts for k in range(1, hosts)]
    across, local, lane = lv.across, lv.local, lv.lane
    # 1. Combine the host's inputs in rounds over every stream, the other
    # hosts' first, so their parts can leave while this host's is combined.
    order = others + [lv.host]
    queue = [r for g in order for r in streams.ranges[g]]
    offsets, at = {}, 0
    for g in order:
        offsets[g] = at
        at += _total(streams.ranges[g])
    mine = []  # this lane's parts, as (first, n) of the queue
    outgoing = []  # (end in the queue, host, start, count) of the pieces this lane sends
    if lane is not None:
        for g in order:
            first, n = chunk_bounds(_total(streams.ranges[g]), lv.lanes)[lane]
            mine.append((offsets[g] + first, n))
            if g != lv.host:
                pos = offsets[g] + first
                for start, count in _pieces(_part(queue, pos, n), per):
                    pos += count
                    outgoing.append((pos, g, start, count))
    # Posted first: the other hosts' partials of this lane's part of our stream.
    own = _pieces(streams.part(lv.host, lane), per) if lane is not None else []
    incoming = ([[across.irecv(g, 0) for _ in own] for g in others]
                if across is not None else [])
    sends, sent = [], 0
    rounds = _rounds(_total(queue), per) if lv.shared else 0
    for k in range(rounds):
        ranges = _part(queue, k * per, per)
        step = local.shared_step(None, _pack(local.next_slot(), buf, ranges))
        for first, n in mine:
            lo, hi = max(first, k * per), min(first + n, (k + 1) * per)
            slot_at = (lo - k * per) * buf.itemsize
            for start, count in _part(queue, lo, max(0, hi - lo)):
                _combine(local, buf, step, start, count, slot_at)
                slot_at += count * buf.itemsize
        while sent < len(outgoing) and outgoing[sent][0] <= (k + 1) * per:
            sent = _send(across, buf, outgoing, sent, sends)
    while sent < len(outgoing):  # no arena on this host: all combined already
        sent = _send(across, buf, outgoing, sent, sends)
    # 2. Reduce the other hosts' partials into ours, piece by piece, in host
    # order (lazily: 3. publishes a round once its pieces are reduced).
    reduced = _Reduced(across, buf, own, incoming)
    # 3. Each lane publishes its reduced part; every rank copies its chunk's.
    if lv.shared:
        parts = [streams.part(lv.host, j) for j in range(lv.lanes)]
        for k in range(max(_rounds(_total(p), per) for p in parts)):
            nbytes = 0
            if lane is not None:
                reduced.until((k + 1) * per)
                nbytes = _pack(local.next_slot(), buf, _part(parts[lane], k * per, per))
            step = local.shared_step(None, nbytes)
            for j in range(lv.lanes):
                if j != lane:
                    _copy_ranges(lv, buf, step, j, _part(parts[j], k * per, per),
                                 within=chunks[comm.rank])
    reduced.until(None)
    if across is not None:
        across.wait_all(sends)


def _send(across, buf, outgoing, i: int, sends: list) -> int:
    _, host, start, count = outgoing[i]
    sends.append(across.isend(host, 0, buf.send_view(start, count)))
    return i + 1


class _Reduced:
    """Reduces the other hosts' partials into this lane's pieces, in order."""

    def __init__(self, across, buf, pieces, incoming):
        self._across, self._buf, self._pieces, self._incoming = across, buf, pieces, incoming
        self._next = self._covered = 0

    def until(self, position: int | None) -> None:
        """Reduce pieces until the first ``position`` elements are done (None: all)."""
        while self._next < len(self._pieces) and (position is None or
                                                  self._covered < position):
            start, count = self._pieces[self._next]
            for recvs in self._incoming:
                self._buf.reduce_from(start, count, self._across.wait(recvs[self._next]))
            self._covered += count
            self._next += 1


def reduce_scatter_twolevel(comm, buf, chunks, segment_count: int | None = None) -> None:
    """Reduce-scatter over hosts: each host combines every stream in its
    arena into its leader, the leader sends each other host its partial of
    that host's stream and reduces the partials of its own stream it gets
    (in host order), then publishes it; each rank copies its chunk.
    Cost: host h's cable carries S - S_h out and (H-1) S_h in; 1
    synchronisation per round of the combine and of the spread; the
    partials leave as soon as their rounds are combined.
    """
    _reduce_scatter(comm, buf, chunks, segment_count, False)


def reduce_scatter_twolevel_lanes(comm, buf, chunks, segment_count: int | None = None) -> None:
    """:func:`reduce_scatter_twolevel` with K lanes: each rank of a host
    combines, sends and reduces part j of K of every stream."""
    _reduce_scatter(comm, buf, chunks, segment_count, True)
