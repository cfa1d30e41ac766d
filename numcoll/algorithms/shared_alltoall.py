"""The arena's all-to-all (:func:`alltoall_shared`), whose ranks agree after
its first round whether to read the blocks single-copy instead.

Ranks may send each other different amounts (``all_to_all_single``'s split
sizes), and rank r knows only row r and column r of the size matrix, so no
rule on a rank's own sizes can choose the way for every rank alike. The
choice is made inside the protocol: round 0's header carries, besides the
counts, where each of the rank's blocks lies and whether it lets them be
read; after round 0 every rank has read every header, and every rank
decides alike.

The header is laid out as a single-copy *where*
(:mod:`.single_copy`: a magic word, the entries, rank 0's say, then an
(address, bytes) pair per rank) with three words after it, so that a
repeated call whose rank offers its blocks whole can run as one compiled
start (:class:`numcoll.fast.copy.FusedCopy`, :func:`alltoall_resume`): where
every rank offered its blocks whole (the magic :data:`READ_WHOLE`), the
compiled single-copy phases -- *where*, the reads, *done* -- are exactly
this algorithm's round 0, reads and *done* step.
"""

from __future__ import annotations

import numpy as np

from .shared import _bytes, _copy_in, _place, round_elements
from .verdict import done_step, verdict

__all__ = ["alltoall_shared", "alltoall_head_nbytes", "alltoall_header", "alltoall_round_zero",
           "alltoall_resume", "header_words", "rounds_word", "address_word", "nbytes_word",
           "READ_WHOLE", "IN_ROUNDS"]

#: A header's magic word: this rank offers every block to be read whole
#: (its data starts a round late), or its data goes through the rounds
#: from round 0 (it may still offer the rest of its blocks, after round 0).
READ_WHOLE = int.from_bytes(b"nca2awho", "little")
IN_ROUNDS = int.from_bytes(b"nca2arnd", "little")
#: Words before the entries (magic, entries, rank 0's say, spare: a *where*'s).
_LEAD = 4


def alltoall_head_nbytes(size: int) -> int:
    """Bytes of the header that starts each rank's slot in
    :func:`alltoall_shared` (64-byte aligned): :data:`READ_WHOLE` or
    :data:`IN_ROUNDS`, ``size``, two zero words, then per rank where this
    rank's block for it lies (0 where it offers no reads) and its bytes;
    then the rounds this rank needs, from what size it lets the rest be read
    single-copy plus one (0: it does not), and whether its data starts a
    round late."""
    return -(-8 * header_words(size) // 64) * 64


def header_words(size: int) -> int:
    """The header's words that carry something (before its padding)."""
    return rounds_word(size) + 3


def rounds_word(size: int) -> int:
    """The header's word holding the rounds a rank needs (then its offer and
    its lateness)."""
    return _LEAD + 2 * size


def address_word(q: int) -> int:
    """The header's word holding where the block for rank ``q`` lies (0
    where the rank offers no reads)."""
    return _LEAD + 2 * q


def nbytes_word(q: int) -> int:
    """The header's word holding the bytes of the block for rank ``q``."""
    return address_word(q) + 1


def alltoall_round_zero(slot_nbytes: int, rank: int, size: int, send_buf, send_chunks,
                        recv_chunks, segment_count: int | None,
                        rest_nbytes: int | None) -> tuple[int, list, np.ndarray]:
    """What :func:`alltoall_shared` lays out before its first round, for a
    slot of ``slot_nbytes``: the elements of a block a round moves, this
    rank's offer (:func:`_offer`; ``rest_nbytes`` None: none) and its header
    (:func:`alltoall_header`). (One source for the algorithm and a repeated
    call's compiled start, :func:`numcoll.fast.copy.fused_copy_alltoall`.)"""
    itemsize = send_buf.itemsize
    per_peer = round_elements(slot_nbytes, itemsize, segment_count, size - 1,
                              alltoall_head_nbytes(size))
    offer = _offer(send_buf, send_chunks, size, rest_nbytes)
    return per_peer, offer, alltoall_header(rank, size, send_chunks, recv_chunks, itemsize,
                                            per_peer, offer)


def alltoall_header(rank: int, size: int, send_chunks, recv_chunks, itemsize: int,
                    per_peer: int, offer: list) -> np.ndarray:
    """This rank's header (int64 words, :func:`alltoall_head_nbytes` bytes)
    for blocks ``send_chunks``/``recv_chunks`` (elements), ``per_peer``
    elements of a block a round, ``offer`` as :func:`_offer` makes it.

    Its data starts a round late -- round 0 carries the header alone, so a
    block can be read whole -- where it offers reads and its largest block
    is at least its threshold (a threshold of 0: where it needs more than
    one round)."""
    others = [q for q in range(size) if q != rank]
    longest = max([send_chunks[q][1] for q in others] + [recv_chunks[q][1] for q in others])
    mine = -(-longest // per_peer)
    largest = max(send_chunks[q][1] for q in others) * itemsize
    late = int(bool(offer[size]) and largest > 0
               and (mine > 1 if offer[size] == 1 else largest >= offer[size] - 1))
    words = np.zeros(alltoall_head_nbytes(size) // 8, np.int64)
    words[0], words[1] = (READ_WHOLE if late else IN_ROUNDS), size
    words[address_word(0):address_word(size):2] = offer[:size]
    words[nbytes_word(0):nbytes_word(size):2] = [n * itemsize for _, n in send_chunks]
    at = rounds_word(size)
    words[at:at + 3] = mine + late, offer[size], late
    return words


def alltoall_shared(comm, send_buf, send_chunks, recv_buf, recv_chunks,
                    segment_count: int | None = None, rest_nbytes: int | None = None,
                    published: int | None = None) -> None:
    """All-to-all through the shared arena: per round every rank publishes a
    piece of its block for every other rank (at most (C - H)/(P-1) bytes each,
    at a fixed stride, at :func:`.shared._place`) and copies its own piece out
    of every other rank's slot (this rank's own block is copied by the caller).

    Ranks send each other different amounts, so each slot starts with a
    header of H bytes (:func:`alltoall_head_nbytes`): the rounds this rank
    needs and what it sends to each rank. Round 0 agrees on the number of
    rounds (the most any rank needs), and a block of another size than the
    receiver expects fails as a wrong-size message. Cost per round: one
    synchronisation; each rank copies P-1 pieces in and P-1 out.

    ``rest_nbytes`` (the automatic choice, on a group whose ranks may read
    each other's memory): the header also says where each of this rank's
    blocks lies and from what size it lets them be read, and a rank whose
    largest block is that large (0: one that needs more than one round)
    sends no data in round 0 (its pieces start a round late). After round 0
    every rank has read every rank's header, so every rank decides alike
    whether what is left of every block is read single-copy
    (:func:`_rest_agreed`, :func:`_rest_by_reads`), whatever each rank's own
    buffers hold. Where they do not read, the rounds go on, each rank's
    pieces in its own rounds (a late rank's a round later); where a read was
    refused, every rank runs the whole call again through the rounds.

    ``published``: the step at which a compiled start already published
    this rank's round 0 (its header, as :func:`alltoall_header` makes it:
    :func:`alltoall_resume`); the call goes on from there.
    """
    size, rank, itemsize = comm.size, comm.rank, send_buf.itemsize
    if size == 1:
        return
    head = alltoall_head_nbytes(size)
    if rest_nbytes is not None and not comm.single_copy_usable():
        rest_nbytes = None  # (reads refused on the group: it offers none)
    per_peer, offer, header = alltoall_round_zero(comm.arena_slot_nbytes, rank, size, send_buf,
                                                  send_chunks, recv_chunks, segment_count,
                                                  rest_nbytes)
    stride = per_peer * itemsize
    others = [q for q in range(size) if q != rank]
    at = rounds_word(size)
    rounds, late = int(header[at]), int(header[at + 2])
    lates = {}  # every peer's lateness (its pieces start that round), by rank
    headers = {}  # every peer's round-0 header, by rank
    j = 0
    while j == 0 or j < rounds:
        if j == 0 and published is not None:
            step = published
            comm.shared_wait(step)
        else:
            slot = comm.next_slot()
            slot[:head].view(np.int64)[:] = header
            if j >= late:
                offset = (j - late) * per_peer
                for q in others:
                    first, n = send_chunks[q]
                    k = max(0, min(per_peer, n - offset))
                    if k:
                        put = head + _place(q, rank) * stride
                        np.copyto(slot[put:put + k * itemsize],
                                  _bytes(send_buf.send_view(first + offset, k)))
            step = comm.shared_step(None, head + (size - 1) * stride)
        for p in others:
            first, n = recv_chunks[p]
            if j == 0:
                theirs = headers[p] = comm.shared_view(step, p, 0, head).view(np.int64)
                rounds = max(rounds, int(theirs[at]))
                lates[p] = int(theirs[at + 2])
                if theirs[nbytes_word(rank)] != n * itemsize:
                    comm.size_mismatch(p, f"rank {p} sends this rank "
                                          f"{int(theirs[nbytes_word(rank)]) // itemsize} "
                                          f"elements, this rank expects {n}")
            if j < lates[p]:
                continue
            offset = (j - lates[p]) * per_peer
            k = max(0, min(per_peer, n - offset))
            if k:
                _copy_in(recv_buf, first + offset, k,
                         comm.shared_view(step, p, head + _place(rank, p) * stride,
                                          k * itemsize))
        j += 1
        # (round 0's headers are read before the next step: valid until then)
        if j == 1 and rounds > 1 and offer[size] \
                and _rest_agreed(comm, headers, lates, send_chunks, offer, late, per_peer,
                                 itemsize):
            if not _rest_by_reads(comm, recv_buf, recv_chunks, headers, lates, per_peer):
                # (refused on some rank: every rank learnt it in the same step)
                alltoall_shared(comm, send_buf, send_chunks, recv_buf, recv_chunks,
                                segment_count)
            return


def alltoall_resume(comm, send_buf, send_chunks, recv_buf, recv_chunks,
                    segment_count: int | None, rest_nbytes: int, state: str, step: int) -> None:
    """The rest of a call of :func:`alltoall_shared` whose round 0, reads
    and *done* step a compiled start ran as a single-copy call's phases, as
    far as ``state`` (:meth:`numcoll.comm.Comm.single_copy_exchange`'s
    states; round 0 at step ``step``): from its *done* step (``"verdict"``:
    its reads were made, and every rank's verdict decides), else from round
    0's headers, as :func:`alltoall_shared` goes on from them."""
    if state in ("done", "verdict"):
        if state == "done" or _done_seen(comm, step + 1):
            for p in range(comm.size):
                if p != comm.rank:
                    recv_buf.recv_done(*recv_chunks[p])
            comm.ran_instead("shared+cma")
        else:  # (a read refused on some rank: the whole call through the rounds)
            alltoall_shared(comm, send_buf, send_chunks, recv_buf, recv_chunks, segment_count)
        return
    alltoall_shared(comm, send_buf, send_chunks, recv_buf, recv_chunks, segment_count,
                    rest_nbytes, published=step)


def _done_seen(comm, step: int) -> bool:
    comm.shared_wait(step)
    return verdict(comm, step, None)


def _offer(send_buf, send_chunks, size: int, rest_nbytes: int | None) -> list:
    """This rank's offer, as its header carries it: where each of its blocks
    lies (its own addresses), then ``rest_nbytes + 1``; all 0 where it offers
    no reads (``rest_nbytes`` None: not the automatic choice, or reads
    refused on the group; buffers that are not host arrays)."""
    none = [0] * (size + 1)
    if rest_nbytes is None:
        return none
    words = []
    for first, n in send_chunks:
        view = send_buf.send_view(first, n)
        if not isinstance(view, np.ndarray):
            return none
        words.append(view.__array_interface__["data"][0] if n else 0)
    return words + [rest_nbytes + 1]


def _rest_agreed(comm, headers: dict, lates: dict, send_chunks, offer: list, late: int,
                 per_peer: int, itemsize: int) -> bool:
    """Whether what is left of every block after round 0 is read
    single-copy, from round 0's headers (``headers`` and ``lates``: every
    peer's; this rank's ``send_chunks``, ``offer`` and ``late``): every rank
    offers it, and the largest block's rest (a late rank's whole block) is at
    least the largest threshold offered. Every rank reads the same words:
    the same answer."""
    size, rank = comm.size, comm.rank
    at = rounds_word(size)
    offers = [offer[size]] + [int(theirs[at + 1]) for theirs in headers.values()]
    if not min(offers):
        return False
    largest = max(n - (0 if late else per_peer)
                  for q, (_, n) in enumerate(send_chunks) if q != rank)
    for p, theirs in headers.items():
        sent = (0 if lates[p] else per_peer)
        largest = max(largest, max(int(theirs[nbytes_word(q)]) // itemsize - sent
                                   for q in range(size) if q != p))
    return largest * itemsize >= max(1, max(offers) - 1)


def _rest_by_reads(comm, recv_buf, recv_chunks, headers: dict, lates: dict,
                   per_peer: int) -> bool:
    """What is left of every block this rank receives after round 0 (all of a
    late sender's), read where its sender keeps it
    (:meth:`~numcoll.comm.Comm.read_peer`; every sender's buffers stay as
    they are until the *done* step that follows: :func:`.verdict.done_step`).
    True where every rank's reads succeeded; False where one was refused
    (every rank learns it in the same step)."""
    rank, itemsize = comm.rank, recv_buf.itemsize
    refused, read = None, []
    for p, theirs in headers.items():
        first, n = recv_chunks[p]
        start = 0 if lates[p] else min(n, per_peer)
        if n > start and refused is None:
            view = recv_buf.recv_view(first + start, n - start)
            refused = comm.read_peer(p, int(theirs[address_word(rank)]) + start * itemsize,
                                     _bytes(view))
            read.append((first + start, n - start))
    if not done_step(comm, refused):
        return False
    for at, n in read:
        recv_buf.recv_done(at, n)
    comm.ran_instead("shared+cma")
    return True
