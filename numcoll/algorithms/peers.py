"""Algorithms over the peers' device memory: ranks on one host that can
address each other's buffers (threads of one process, or processes through
CUDA IPC) reduce and copy straight from them, as NCCL's intra-node transport
does. Messages carry only where the buffers are and when they are ready; the
data never leaves the device.

They are written against the buffer's peer verbs (``peer_export``,
``peer_views``, ``reduce_peers``, ``copy_from_peers``: see
:class:`numcoll.cuda.buffer.DeviceBuffer`) and the Comm's messages, like every
algorithm here; device buffers offer them, and :mod:`numcoll.collectives.choice`
chooses these only for device arrays.
"""

from __future__ import annotations

from .allgather import allgather_ring
from .allreduce import allreduce_ring
from .broadcast import broadcast_binomial
from .partition import chunk_bounds
from .reduce_scatter import reduce_scatter_ring

__all__ = ["allreduce_ipc", "broadcast_ipc", "allgather_ipc", "reduce_scatter_ipc"]

# Steps far above any other algorithm's, so that the staged fallback (the
# ring, steps 0 .. 2P-3) never shares a tag with them. Each dissemination
# round takes a step: at most 64 of them.
_EXCHANGE_STEP = 1 << 20
_AGREE_STEP = _EXCHANGE_STEP + 1
_REDUCED_STEP = _AGREE_STEP + 64
_COPIED_STEP = _REDUCED_STEP + 64


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
        broadcast_binomial(comm, buf, root, segment_count)
        return
    if rank != root:
        buf.copy_from_peers(peers, [(0, buf.count) if q == root else (0, 0)
                                    for q in range(size)])
    _barrier(comm, _COPIED_STEP)


def _any(comm, first_step: int, mine: bool) -> bool:
    """Whether ``mine`` is true on any rank: a dissemination barrier whose
    messages carry what the sender has heard so far (OR is idempotent, so
    hearing a rank twice does no harm); every rank gets the same answer."""
    size, rank = comm.size, comm.rank
    distance, step, heard = 1, first_step, mine
    while distance < size:
        got = comm.sendrecv((rank + distance) % size, (rank - distance) % size, step,
                            b"\x01" if heard else b"\x00")
        heard = heard or bytes(got) == b"\x01"
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
