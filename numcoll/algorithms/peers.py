"""Algorithms over the peers' device memory: ranks on one host that can
address each other's buffers (threads of one process, or processes through
CUDA IPC) reduce and copy straight from them, as NCCL's intra-node transport
does. Messages carry only where the buffers are and when they are ready; the
data never leaves the device.

They are written against the buffer's peer verbs (``peer_export``,
``peer_views``, ``reduce_peers``, ``copy_from_peers``, ``copy_peer_ranges``,
``settle``: see
:class:`numcoll.cuda.buffer.DeviceBuffer`) and the Comm's messages, like every
algorithm here; device buffers offer them, and :mod:`numcoll.collectives.choice`
chooses these only for device arrays.
"""

from __future__ import annotations

import struct

from ..errors import NumcollError
from .allgather import allgather_ring
from .allreduce import allreduce_ring
from .alltoall import alltoall_pairwise
from .broadcast import broadcast_binomial
from .partition import chunk_bounds
from .reduce import reduce_ring
from .reduce_scatter import reduce_scatter_ring
from .rooted import gather_direct, scatter_direct

__all__ = ["allreduce_ipc", "broadcast_ipc", "allgather_ipc", "reduce_scatter_ipc",
           "reduce_ipc", "gather_ipc", "scatter_ipc", "alltoall_ipc"]

# Steps far above any other algorithm's, so that the staged fallback (the
# ring, steps 0 .. 2P-3) never shares a tag with them. Each dissemination
# round takes a step: at most 64 of them.
_EXCHANGE_STEP = 1 << 20
_AGREE_STEP = _EXCHANGE_STEP + 1
_REDUCED_STEP = _AGREE_STEP + 64
_COPIED_STEP = _REDUCED_STEP + 64

# What the agreement after the exchange settles on, the highest any rank saw:
# every rank reads its peers; every rank stages; every rank raises (the ranks'
# sizes disagree, which only the exchange shows).
_READY, _STAGE, _MISMATCH = 0, 1, 2
# alltoall: where the block for the receiver lies in the sender's buffer (start, count).
_PLACE = struct.Struct("<qq")


def allreduce_ipc(comm, buf, segment_count: int | None = None) -> None:
    """Reduce-scatter then allgather by direct loads from the peers' device memory.

    1. every rank waits for its buffer to be ready on the device and sends
       every other rank where it is (the CUDA IPC handle of its allocation and
       its offset, or its address between threads of one process); every rank
       opens the peers' memory and the ranks agree whether all of them could
       (if one could not -- GPUs without peer access, memory CUDA will not
       share -- they all run the staged ring instead, :func:`allreduce_ring`);
    2. rank r reduces chunk r of every peer's buffer into chunk r of its own
       (P - 1 kernel launches, reading the peers' memory), then a barrier;
    3. rank r copies chunk q from rank q's buffer, for every q != r (device to
       device), then a barrier, so that no rank changes its buffer while a peer
       may still read it.

    Why safe: in step 2 rank r writes only chunk r of its own buffer, and the
    peers read only their own chunks of it; in step 3 it writes only chunks
    q != r of its own buffer, and the peers read only chunk r of it. Every rank
    synchronises its stream before it signals, so what a peer reads after a
    message is complete. Each chunk is reduced by one rank and copied by the
    others: every rank gets the same bits.

    Cost: messages of a few hundred bytes to each of P - 1 peers, and three
    dissemination rounds (3 ceil(log2 P) steps of at most 1 byte); on the device,
    each rank reads (P - 1) S/P bytes from peers to reduce and (P - 1) S/P
    bytes to copy. Host work per call does not depend on S.
    Source: the direct-load intra-node schedule of NCCL (``p2p`` transport);
    barriers: Hensgen, Finkel & Manber (IJPP 1988).
    """
    size, rank = comm.size, comm.rank
    if size == 1 or buf.count == 0:
        return
    peers = _open_all(comm, buf, "allreduce")
    if peers is None:
        _staged(comm, "ring")
        allreduce_ring(comm, buf, segment_count or buf.count)
        return
    chunks = chunk_bounds(buf.count, size)
    buf.reduce_peers(peers, *chunks[rank])
    _barrier(comm, _REDUCED_STEP)
    buf.copy_from_peers(peers, [(0, 0) if q == rank else chunks[q] for q in range(size)])
    _barrier(comm, _COPIED_STEP)


def reduce_scatter_ipc(comm, buf, chunks, segment_count: int | None = None) -> None:
    """Rank r reduces chunk r (``chunks[r]``, sizes may differ) straight from
    every peer's device buffer: step 2 of :func:`allreduce_ipc`, then a barrier
    so that no rank reuses its buffer while a peer may still read it.

    Cost: messages of a few hundred bytes to each of P - 1 peers, two
    dissemination rounds; on the device, each rank reads its share from each
    of the P - 1 peers. Source: as :func:`allreduce_ipc`.
    """
    size, rank = comm.size, comm.rank
    if size == 1 or buf.count == 0:
        return
    peers = _open_all(comm, buf, "reduce_scatter")
    if peers is None:
        _staged(comm, "ring")
        reduce_scatter_ring(comm, buf, chunks, segment_count or buf.count)
        return
    buf.reduce_peers(peers, *chunks[rank])
    _barrier(comm, _COPIED_STEP)


def allgather_ipc(comm, buf, chunks, segment_count: int | None = None) -> None:
    """Rank r copies chunk q straight from rank q's device buffer, for every
    q != r (``buf``'s chunk ``comm.rank`` holds this rank's input on entry);
    then a barrier so that no rank changes its buffer while a peer reads it.
    Every rank reads only its peers' own chunks, which their owners never write.

    Cost: messages of a few hundred bytes to each of P - 1 peers, two
    dissemination rounds; on the device, each rank reads S (P-1)/P bytes.
    Source: as :func:`allreduce_ipc`.
    """
    size, rank = comm.size, comm.rank
    if size == 1 or buf.count == 0:
        return
    peers = _open_all(comm, buf, "allgather")
    if peers is None:
        _staged(comm, "ring")
        allgather_ring(comm, buf, chunks, segment_count or buf.count)
        return
    buf.copy_from_peers(peers, [(0, 0) if q == rank else chunks[q] for q in range(size)])
    _barrier(comm, _COPIED_STEP)


def _open_all(comm, buf, op: str):
    """Every rank's buffer as seen from here, exchanged through messages; None
    if some rank (any, all agree) cannot reach its peers' memory."""
    size, rank = comm.size, comm.rank
    mine = buf.peer_export()
    receives = {peer: comm.irecv(peer, _EXCHANGE_STEP) for peer in range(size) if peer != rank}
    sends = [comm.isend(peer, _EXCHANGE_STEP, mine) for peer in receives]
    described = [None] * size
    for peer, pending in receives.items():
        described[peer] = bytes(comm.wait(pending))
    comm.wait_all(sends)
    peers, why = buf.peer_views(described, op)
    return None if _any(comm, _AGREE_STEP, why is not None) else peers


def broadcast_ipc(comm, buf, root: int, segment_count: int | None = None) -> None:
    """Every rank copies the root's buffer straight from the root's device memory.

    The root waits for its buffer to be ready and sends where it is; every
    other rank opens it, the ranks agree that all could (else they all run
    :func:`broadcast_binomial`), every other rank copies the whole buffer
    (device to device), and a barrier keeps the root's buffer unchanged until
    every copy is done.

    Cost: P - 1 messages of a few hundred bytes from the root, two
    dissemination rounds; on the device, P - 1 reads of S bytes from the
    root's memory. Host work per call does not depend on S.
    Source: NCCL's intra-node direct reads (``p2p`` transport).
    """
    size, rank = comm.size, comm.rank
    if size == 1 or buf.count == 0:
        return
    described = [None] * size
    if rank == root:
        mine = buf.peer_export()
        comm.wait_all([comm.isend(peer, _EXCHANGE_STEP, mine)
                       for peer in range(size) if peer != root])
    else:
        described[root] = bytes(comm.wait(comm.irecv(root, _EXCHANGE_STEP)))
    peers, why = buf.peer_views(described, "broadcast")
    if _any(comm, _AGREE_STEP, why is not None):
        _staged(comm, "binomial")
        broadcast_binomial(comm, buf, root, segment_count)
        return
    if rank != root:
        buf.copy_from_peers(peers, [(0, buf.count) if q == root else (0, 0)
                                    for q in range(size)])
    _barrier(comm, _COPIED_STEP)


def reduce_ipc(comm, buf, root: int, segment_count: int | None = None) -> None:
    """The root reduces every peer's whole buffer into its own, straight from
    the peers' device memory.

    Every other rank waits for its buffer to be ready and sends the root where
    it is; the root opens the peers' memory and the ranks agree whether it
    could (else they all run the staged :func:`reduce_ring`); the root reduces
    the peers' buffers into its own in rank order (P - 1 kernel launches), and
    a barrier keeps every peer's buffer unchanged until the root has read it.

    Why one reader: on one GPU the ranks share its memory bandwidth, and the
    root's (P - 1) S bytes are the least any schedule reads for one result; a
    reduce-scatter first (as :func:`allreduce_ipc`) would add (P - 1) S/P bytes
    of copies and a barrier.

    Cost: P - 1 messages of a few hundred bytes to the root, two dissemination
    rounds; on the device, the root reads (P - 1) S bytes from peers. Host work
    per call does not depend on S. Source: NCCL's intra-node direct reads.
    """
    size, rank = comm.size, comm.rank
    if size == 1 or buf.count == 0:
        return
    described = _to_root(comm, buf, root)
    peers, why = buf.peer_views(described, "reduce") if rank == root else ([], None)
    if _any(comm, _AGREE_STEP, why is not None):
        _staged(comm, "ring")
        reduce_ring(comm, buf, root, segment_count or buf.count)
        return
    if rank == root:
        buf.reduce_peers(peers, 0, buf.count)
    _barrier(comm, _COPIED_STEP)


def gather_ipc(comm, send_buf, recv_bufs, root: int, segment_count: int | None = None) -> None:
    """The root copies every peer's ``send_buf`` straight from the peer's device
    memory into ``recv_bufs[peer]`` (its own is copied by the caller).

    As :func:`reduce_ipc`: the peers send the root where their buffers are,
    the ranks agree (else :func:`gather_direct`, staged), the root queues
    P - 1 device-to-device copies and waits for them once, and a barrier keeps
    the peers' buffers unchanged until then. A peer whose buffer holds another
    size than the root expects makes every rank raise.

    Cost: P - 1 messages of a few hundred bytes to the root, two dissemination
    rounds; on the device, the root reads S (P - 1)/P bytes.
    Source: NCCL's intra-node direct reads.
    """
    size, rank = comm.size, comm.rank
    if size == 1 or send_buf.count == 0:
        return
    described = _to_root(comm, send_buf, root)
    peers, level = [], _READY
    if rank == root:
        peers, why = send_buf.peer_views(described, "gather")
        level = _STAGE if why is not None else _READY
        level = max(level, _sizes(peers, {q: recv_bufs[q].count for q in range(size)
                                          if q != root}))
    level = _agree(comm, _AGREE_STEP, level)
    _raise_on_mismatch("gather", level, rank, root, peers,
                       {q: recv_bufs[q].count for q in range(size) if q != root}
                       if rank == root else {})
    if level == _STAGE:
        _staged(comm, "direct")
        gather_direct(comm, send_buf, recv_bufs, root, segment_count or send_buf.count)
        return
    if rank == root:
        for q in range(size):
            if q != root:
                recv_bufs[q].copy_peer_ranges(peers, [(q, 0, 0, recv_bufs[q].count)],
                                              wait=False)
        send_buf.settle()
    _barrier(comm, _COPIED_STEP)


def scatter_ipc(comm, send_bufs, recv_buf, root: int, segment_count: int | None = None) -> None:
    """Rank q copies its block straight from the root's ``send_bufs[q]`` in the
    root's device memory (the root's own is copied by the caller).

    The root waits for its buffers to be ready and sends each rank where its
    block is; the ranks agree that all could open theirs (else
    :func:`scatter_direct`, staged); every other rank copies its block (device
    to device, all at once), and a barrier keeps the root's buffers unchanged
    until every copy is done.

    Cost: P - 1 messages of a few hundred bytes from the root, two
    dissemination rounds; on the device, each rank reads S/P bytes from the root.
    Source: NCCL's intra-node direct reads.
    """
    size, rank = comm.size, comm.rank
    if size == 1 or recv_buf.count == 0:
        return
    described = [None] * size
    if rank == root:
        comm.wait_all([comm.isend(q, _EXCHANGE_STEP, send_bufs[q].peer_export())
                       for q in range(size) if q != root])
    else:
        described[root] = bytes(comm.wait(comm.irecv(root, _EXCHANGE_STEP)))
    peers, why = recv_buf.peer_views(described, "scatter")
    expect = {} if rank == root else {root: recv_buf.count}
    level = max(_STAGE if why is not None else _READY, _sizes(peers, expect))
    level = _agree(comm, _AGREE_STEP, level)
    _raise_on_mismatch("scatter", level, rank, root, peers, expect)
    if level == _STAGE:
        _staged(comm, "direct")
        scatter_direct(comm, send_bufs, recv_buf, root, segment_count or recv_buf.count)
        return
    if rank != root:
        recv_buf.copy_peer_ranges(peers, [(root, 0, 0, recv_buf.count)])
    _barrier(comm, _COPIED_STEP)


def alltoall_ipc(comm, send_buf, send_chunks, recv_buf, recv_chunks,
                 segment_count: int | None = None) -> None:
    """Rank r copies its block from every peer q straight from q's ``send_buf``
    (q's ``send_chunks[r]``) into ``recv_chunks[q]`` of its own ``recv_buf``
    (its own block is copied by the caller).

    Every rank waits for its buffer to be ready and sends each peer where its
    buffer is and where the block for that peer lies in it (alltoall_base's
    splits differ per rank); the ranks agree that all could open their peers'
    memory and that every block has the size its receiver expects (else all
    run :func:`alltoall_pairwise`, staged, or all raise); every rank queues its
    P - 1 copies and waits once; a barrier keeps every ``send_buf`` unchanged
    until every rank has read it. No rank writes a buffer that a peer reads.

    Cost: messages of a few hundred bytes to each of P - 1 peers, two
    dissemination rounds; on the device, each rank reads what it receives,
    S (P - 1)/P bytes. Host work per call does not depend on S.
    Source: NCCL's intra-node direct reads.
    """
    size, rank = comm.size, comm.rank
    if size == 1:
        return
    mine = send_buf.peer_export()
    receives = {q: comm.irecv(q, _EXCHANGE_STEP) for q in range(size) if q != rank}
    sends = [comm.isend(q, _EXCHANGE_STEP, _PLACE.pack(*send_chunks[q]) + mine)
             for q in receives]
    described, places = [None] * size, {}
    for q, pending in receives.items():
        got = bytes(comm.wait(pending))
        places[q], described[q] = _PLACE.unpack_from(got), got[_PLACE.size:]
    comm.wait_all(sends)
    peers, why = recv_buf.peer_views(described, "alltoall")
    expect = {q: recv_chunks[q][1] for q in receives}
    sent = {q: places[q][1] for q in receives}
    level = _STAGE if why is not None else _READY
    if sent != expect:
        level = _MISMATCH
    level = _agree(comm, _AGREE_STEP, level)
    if level == _MISMATCH:
        wrong = {q: (sent[q], expect[q]) for q in receives if sent[q] != expect[q]}
        raise NumcollError(
            "alltoall: the ranks' block sizes do not agree: " + (
                ", ".join(f"rank {q} sends rank {rank} {n} elements, it expects {m}"
                          for q, (n, m) in wrong.items())
                or f"rank {rank}'s blocks match; another rank's do not (its error says which)"))
    if level == _STAGE:
        _staged(comm, "pairwise")
        alltoall_pairwise(comm, send_buf, send_chunks, recv_buf, recv_chunks,
                          segment_count or max(1, recv_buf.count))
        return
    recv_buf.copy_peer_ranges(peers, [(q, places[q][0], *recv_chunks[q]) for q in receives])
    _barrier(comm, _COPIED_STEP)


def _to_root(comm, buf, root: int) -> list:
    """Every rank's :meth:`peer_export` at the root (None elsewhere, and for the
    root's own)."""
    described = [None] * comm.size
    if comm.rank == root:
        receives = {q: comm.irecv(q, _EXCHANGE_STEP) for q in range(comm.size) if q != root}
        for q, pending in receives.items():
            described[q] = bytes(comm.wait(pending))
    else:
        comm.wait(comm.isend(root, _EXCHANGE_STEP, buf.peer_export()))
    return described


def _sizes(peers: list, expect: dict) -> int:
    """_MISMATCH if a peer's buffer (``peers[q]``; None: empty) holds another
    number of elements than ``expect[q]``, else _READY."""
    if not peers:       # the views failed: nothing to compare (the ranks stage)
        return _READY
    return _MISMATCH if any((0 if peers[q] is None else peers[q].size) != n
                            for q, n in expect.items()) else _READY


def _raise_on_mismatch(op: str, level: int, rank: int, root: int, peers, expect) -> None:
    if level != _MISMATCH:
        return
    wrong = [f"rank {q} has {0 if peers[q] is None else peers[q].size} elements, "
             f"rank {rank} expects {n}" for q, n in expect.items()
             if (0 if peers[q] is None else peers[q].size) != n] if peers else []
    raise NumcollError(f"{op}: the ranks' sizes do not agree with the root's (rank {root}): "
                       + ("; ".join(wrong) or "another rank's error says which"))


def _staged(comm, algorithm: str) -> None:
    """Every rank agreed to stage this call through host memory: the flight
    recorder (and the bench's algorithm column) says what runs instead."""
    comm.ran_instead(f"{algorithm} (staged: ipc unavailable)")


def _any(comm, first_step: int, mine: bool) -> bool:
    """Whether ``mine`` is true on any rank (every rank gets the same answer)."""
    return _agree(comm, first_step, _STAGE if mine else _READY) != _READY


def _agree(comm, first_step: int, mine: int) -> int:
    """The highest of every rank's ``mine`` (0..255): a dissemination barrier
    whose messages carry the highest the sender has heard so far (max is
    idempotent, so hearing a rank twice does no harm); every rank gets the
    same answer."""
    size, rank = comm.size, comm.rank
    distance, step, heard = 1, first_step, mine
    while distance < size:
        got = comm.sendrecv((rank + distance) % size, (rank - distance) % size, step,
                            bytes((heard,)))
        heard = max(heard, bytes(got)[0])
        distance <<= 1
        step += 1
    return heard


def _barrier(comm, first_step: int) -> None:
    """A dissemination barrier on steps ``first_step``, ``first_step + 1``, ..."""
    size, rank = comm.size, comm.rank
    distance, step = 1, first_step
    while distance < size:
        comm.sendrecv((rank + distance) % size, (rank - distance) % size, step, b"")
        distance <<= 1
        step += 1
