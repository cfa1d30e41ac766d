"""The arena's alltoall with the rest of its blocks read single-copy
(``alltoall_shared(..., rest_nbytes=...)``, the automatic choice where ranks
may read each other): every rank decides from round 0's headers, so ranks
whose own buffers differ cannot part; results right at 2..9 ranks with
uneven splits; a read refused in the rest is finished by the arena's rounds,
on every rank; a rank that offers no reads keeps every rank in the arena.
Over the fake comm (ranks as threads, an in-memory arena); the shm groups and
processes are in tests/test_single_copy.py."""

import numpy as np
import pytest

from numcoll.memory.host import HostBuffer
from numcoll.algorithms.shared_alltoall import alltoall_head_nbytes, alltoall_shared
from numcoll.testing import run_ranks

pytestmark = pytest.mark.timeout(120)

SLOT = 4096


def counts(size: int, seed: int) -> np.ndarray:
    """Elements rank r sends rank q: uneven, some zero, some many rounds."""
    rng = np.random.default_rng(seed)
    got = rng.integers(0, 1500, (size, size))
    got[rng.random((size, size)) < 0.2] = 0
    return got


def block(src: int, dst: int, n: int) -> np.ndarray:
    return (np.arange(n) % 251 + 1000.0 * src + dst + 0.5).astype(np.float64)


def run(size: int, sent: np.ndarray, rest=lambda rank: 0, refuse_after=None):
    """The alltoall of ``sent`` on ``size`` fake ranks, rank r passing
    ``rest(r)`` as its ``rest_nbytes``; each rank's (output, what it says ran,
    its refusal). ``refuse_after``: rank size-1's reads refused after that many."""

    def rank_fn(comm):
        r = comm.rank
        if refuse_after is not None and r == size - 1:
            comm.refuse_reads_after(refuse_after)
        send = np.concatenate([block(r, q, sent[r, q]) for q in range(size)])
        recv = np.full(int(sent[:, r].sum()), -1.0)
        send_chunks = [(int(sent[r, :q].sum()), int(sent[r, q])) for q in range(size)]
        recv_chunks = [(int(sent[:q, r].sum()), int(sent[q, r])) for q in range(size)]
        alltoall_shared(comm, HostBuffer(send), send_chunks, HostBuffer(recv), recv_chunks,
                        None, rest(r))
        own_at, own_n = recv_chunks[r]
        recv[own_at:own_at + own_n] = block(r, r, own_n)  # (the caller's part)
        return recv, comm.ran, comm.single_copy_refused

    return run_ranks(size, rank_fn, arena_slot_nbytes=SLOT)


def want(size: int, sent: np.ndarray, r: int) -> np.ndarray:
    return np.concatenate([block(q, r, sent[q, r]) for q in range(size)])


def per_peer(size: int) -> int:
    """Elements of a block a round moves (float64), as alltoall_shared lays it out."""
    return (SLOT - alltoall_head_nbytes(size)) // ((size - 1) * 8)


@pytest.mark.parametrize("size", [2, 3, 4, 5, 9])
def test_the_rest_is_read_where_every_rank_offers_it(size):
    sent = counts(size, size)
    sent[0, size - 1] = 1400  # (several rounds: more than a round's 504 on 2 ranks)
    got = run(size, sent)
    for r, (recv, ran, refused) in enumerate(got):
        assert np.array_equal(recv, want(size, sent, r))
        assert ran == "shared+cma" and refused is None


@pytest.mark.parametrize("size", [2, 4])
def test_one_rank_that_offers_no_reads_keeps_every_rank_in_the_arena(size):
    """Forced "shared" on one rank (no offer in its header), or its reads
    refused on the group: every rank goes through the arena's rounds."""
    sent = counts(size, 7)
    got = run(size, sent, rest=lambda rank: None if rank == 1 else 0)
    for r, (recv, ran, _) in enumerate(got):
        assert np.array_equal(recv, want(size, sent, r))
        assert ran is None  # (the call's own algorithm: "shared")


def test_the_largest_rest_against_the_largest_threshold_decides_alike():
    """Rank 0 sends 1500 elements to rank 1, rank 1 sends 10 back: the rest
    after round 0 (all of rank 0's block: it needs more than one round, so
    its data starts a round late) against each rank's threshold, the largest
    of them counting -- the same answer on both ranks."""
    sent = np.array([[5, 1500], [10, 5]])
    rest_nbytes = 1500 * 8
    for thresholds, way in (((rest_nbytes, 0), "shared+cma"), ((0, rest_nbytes + 8), None)):
        got = run(2, sent, rest=lambda rank: thresholds[rank])
        for r, (recv, ran, _) in enumerate(got):
            assert np.array_equal(recv, want(2, sent, r))
            assert ran == way


@pytest.mark.parametrize("size, after", [(2, 0), (3, 0), (3, 1), (5, 0), (5, 3)])
def test_a_read_refused_in_the_rest_is_finished_by_the_arena(size, after):
    """Refused at its first read of the rest, or a later one: the *done* step
    tells every rank, each marks its reads refused, and the arena's rounds
    bring the whole rest again. Results right everywhere."""
    sent = counts(size, 11)
    sent[size - 1, :] = np.maximum(sent[size - 1, :], 1200)  # (the last rank reads every rest)
    sent[:, size - 1] = np.maximum(sent[:, size - 1], 1200)
    got = run(size, sent, refuse_after=after)
    for r, (recv, ran, refused) in enumerate(got):
        assert np.array_equal(recv, want(size, sent, r))
        assert ran is None and refused == "EPERM (simulated)"
