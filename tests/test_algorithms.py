"""Every algorithm of numcoll.algorithms.CHOICES against NumPy, alone: an in-memory
fake comm (numcoll.testing) stands for the transport, so world sizes 1..33
run in milliseconds. Tiny segments force the pipelined paths; counts that do
not divide by the world size, and empty chunks, are included."""

import numpy as np
import pytest

from numcoll.algorithms import CHOICES, DEVICE_PEERS, TWO_LEVEL
from numcoll.algorithms.partition import chunk_bounds
from numcoll.memory.host import HostBuffer

from numcoll.testing import run_ranks

pytestmark = pytest.mark.timeout(120)

WORLD_SIZES = list(range(1, 34))
SEGMENT = 3  # elements: every chunk of more than 3 elements travels in pieces


def ranks(name, size, rank_fn):
    """run_ranks; the two-level algorithms' ranks on hosts of up to 3 (the
    last host may have fewer: uneven hosts), as their topology needs."""
    hosts = ([list(range(h, min(h + 3, size))) for h in range(0, size, 3)]
             if name in TWO_LEVEL else None)
    return run_ranks(size, rank_fn, hosts=hosts)


def data(rank, count):
    return (np.arange(count, dtype=np.int64) * 7 + rank * 1000 + 1).astype(np.float64)


def add(acc, x):
    np.add(acc, x, out=acc)


def counts(size):
    return sorted({0, 1, size - 1 if size > 1 else 2, 2 * size + 3})


@pytest.mark.parametrize("name", sorted(set(CHOICES["allreduce"]) - DEVICE_PEERS))
@pytest.mark.parametrize("size", WORLD_SIZES)
def test_allreduce(name, size):
    algorithm = CHOICES["allreduce"][name]
    for count in counts(size):
        def rank_fn(comm):
            buf = data(comm.rank, count)
            algorithm(comm, HostBuffer(buf, add), SEGMENT)
            return buf

        expected = sum(data(r, count) for r in range(size))
        for got in ranks(name, size, rank_fn):
            np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("name", sorted(set(CHOICES["reduce"]) - DEVICE_PEERS))
@pytest.mark.parametrize("size", WORLD_SIZES)
def test_reduce(name, size):
    algorithm = CHOICES["reduce"][name]
    count = 2 * size + 3
    for root in {0, size // 2, size - 1}:
        def rank_fn(comm):
            buf = data(comm.rank, count)
            algorithm(comm, HostBuffer(buf, add), root, SEGMENT)
            return buf

        results = ranks(name, size, rank_fn)
        np.testing.assert_array_equal(results[root], sum(data(r, count) for r in range(size)))
        if name == "shared":  # only reads the others' buffers (the builder relies on it)
            for r in range(size):
                if r != root:
                    np.testing.assert_array_equal(results[r], data(r, count))


@pytest.mark.parametrize("name", sorted(set(CHOICES["broadcast"]) - DEVICE_PEERS))
@pytest.mark.parametrize("size", WORLD_SIZES)
def test_broadcast(name, size):
    algorithm = CHOICES["broadcast"][name]
    count = size + 5
    for root in {0, size // 2, size - 1}:
        def rank_fn(comm):
            buf = data(comm.rank, count) if comm.rank == root else np.zeros(count)
            algorithm(comm, HostBuffer(buf), root, SEGMENT)
            return buf

        for got in ranks(name, size, rank_fn):
            np.testing.assert_array_equal(got, data(root, count))


@pytest.mark.parametrize("family, name", [(f, n) for f in ("allgather", "reduce_scatter")
                                          for n in sorted(set(CHOICES[f]) - DEVICE_PEERS)])
@pytest.mark.parametrize("size", WORLD_SIZES)
def test_ring_halves_with_uneven_chunks(family, name, size):
    # chunks of different sizes, some empty: rank r owns r % 3 * 2 elements
    check_uneven_chunks(family, CHOICES[family][name], [r % 3 * 2 for r in range(size)],
                        lambda rank_fn: ranks(name, size, rank_fn))


def check_uneven_chunks(family, algorithm, sizes, run):
    """``algorithm`` of ``family`` (allgather or reduce_scatter) with rank r
    owning ``sizes[r]`` elements, run by ``run(rank_fn)``, against NumPy."""
    chunks, total = chunk_list(sizes), sum(sizes)

    def rank_fn(comm):
        if family == "allgather":
            buf = np.zeros(total)
            s, n = chunks[comm.rank]
            buf[s:s + n] = data(comm.rank, n)
            algorithm(comm, HostBuffer(buf), chunks, SEGMENT)
            return buf
        buf = data(comm.rank, total)
        algorithm(comm, HostBuffer(buf, add), chunks, SEGMENT)
        s, n = chunks[comm.rank]
        return buf[s:s + n]

    results = run(rank_fn)
    if family == "allgather":
        expected = np.concatenate([data(r, n) for r, n in enumerate(sizes)])
        for got in results:
            np.testing.assert_array_equal(got, expected)
    else:
        whole = sum(data(r, total) for r in range(len(sizes)))
        for r, got in enumerate(results):
            s, n = chunks[r]
            np.testing.assert_array_equal(got, whole[s:s + n])


@pytest.mark.parametrize("name", sorted(set(CHOICES["gather"]) - DEVICE_PEERS))
@pytest.mark.parametrize("size", WORLD_SIZES)
def test_gather_and_scatter(name, size):
    count = 4
    root = size // 2
    gather, scatter = CHOICES["gather"][name], CHOICES["scatter"][name]

    def rank_fn(comm):
        send = data(comm.rank, count)
        targets = [np.zeros(count) for _ in range(size)]
        gather(comm, HostBuffer(send), [HostBuffer(t) for t in targets], root, SEGMENT)
        if comm.rank == root:
            targets[root][:] = send
        out = np.zeros(count)
        sources = [data(q + 100, count) for q in range(size)]
        scatter(comm, [HostBuffer(s) for s in sources], HostBuffer(out), root, SEGMENT)
        if comm.rank == root:
            out[:] = sources[root]
        return targets, out

    results = run_ranks(size, rank_fn)
    for q in range(size):
        np.testing.assert_array_equal(results[root][0][q], data(q, count))
        np.testing.assert_array_equal(results[q][1], data(q + 100, count))


@pytest.mark.parametrize("name", sorted(set(CHOICES["alltoall"]) - DEVICE_PEERS))
@pytest.mark.parametrize("size", WORLD_SIZES)
def test_alltoall_with_uneven_splits(name, size):
    algorithm = CHOICES["alltoall"][name]

    def n(src, dst):  # how much src sends dst
        return (src + 2 * dst) % 4

    def block(src, dst):
        return data(src * 100 + dst, n(src, dst))

    def rank_fn(comm):
        r = comm.rank
        send_chunks = chunk_list([n(r, q) for q in range(size)])
        recv_chunks = chunk_list([n(q, r) for q in range(size)])
        send = np.concatenate([block(r, q) for q in range(size)])
        recv = np.zeros(sum(n(q, r) for q in range(size)))
        algorithm(comm, HostBuffer(send), send_chunks, HostBuffer(recv), recv_chunks, SEGMENT)
        s, k = send_chunks[r]
        t, _ = recv_chunks[r]
        recv[t:t + k] = send[s:s + k]  # the collective copies its own share
        return recv

    for r, got in enumerate(run_ranks(size, rank_fn)):
        np.testing.assert_array_equal(got, np.concatenate([block(q, r) for q in range(size)]))


def chunk_list(sizes):
    out, start = [], 0
    for n in sizes:
        out.append((start, n))
        start += n
    return out


@pytest.mark.parametrize("size", WORLD_SIZES)
def test_barrier_sends_log_p_empty_messages(size):
    log = []
    run_ranks(size, lambda comm: CHOICES["barrier"]["dissemination"](comm), log)
    steps = (size - 1).bit_length()
    assert len(log) == size * steps and set(log) <= {0}


@pytest.mark.parametrize("size", WORLD_SIZES)
def test_shared_barrier_is_one_empty_step(size):
    log = []
    run_ranks(size, lambda comm: CHOICES["barrier"]["shared"](comm), log)
    assert log == ([0] * size if size > 1 else [])


@pytest.mark.parametrize("size", [2, 3, 7])
def test_shared_allreduce_synchronises_once_per_round(size):
    """The docstring's cost, counted: one arena step per round of at most a
    slot's bytes (here 64 bytes: 8 float64)."""
    count = 8 * 5 + 3  # six rounds
    log = []
    results = run_ranks(size, lambda comm: CHOICES["allreduce"]["shared"](
        comm, HostBuffer(data(comm.rank, count), add)) or comm.arena.next_step, log,
        arena_slot_nbytes=64)
    assert results == [6] * size
    assert len(log) == size * 6


@pytest.mark.parametrize("size", [2, 3, 7])
def test_split_allreduce_pipelines_rounds_one_step_each(size):
    """shared_split's cost, counted: R rounds of P chunk places (as many
    float64 as fit a 64-byte slot) take R + 1 steps -- each step carries one
    round's reduced chunk and the next round's inputs -- and every step
    publishes the round's places."""
    count = 8 * 5 + 3
    cap = 64 // (size * 8)
    rounds = -(-count // (cap * size))
    log = []
    results = run_ranks(size, lambda comm: (CHOICES["allreduce"]["shared_split"](
        comm, b := HostBuffer(data(comm.rank, count), add)), comm.arena.next_step, b.array),
        log, arena_slot_nbytes=64)
    assert [steps for _, steps, _ in results] == [rounds + 1] * size
    assert log == [cap * size * 8] * (size * (rounds + 1))
    expected = sum(data(r, count) for r in range(size))
    for _, _, got in results:
        np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("size", [2, 5])
def test_shared_allreduce_is_bitwise_identical_on_every_rank(size):
    """Float sums in rank order on every rank: no rank's result differs in the last bit."""
    rng = np.random.default_rng(3)
    inputs = [(rng.standard_normal(1000) * 10.0 ** rng.integers(-3, 4, 1000)).astype(np.float32)
              for _ in range(size)]
    for name in ("shared", "shared_split"):
        results = run_ranks(size, lambda comm: (CHOICES["allreduce"][name](
            comm, HostBuffer(b := inputs[comm.rank].copy(), add), 100), b)[1])
        for got in results[1:]:
            assert got.tobytes() == results[0].tobytes()


@pytest.mark.parametrize("size", [2, 5, 8])
def test_ring_allreduce_moves_2_s_p_minus_1_over_p_bytes(size):
    """The docstring's cost, measured: each rank sends 2 S (P-1)/P bytes."""
    count = 8 * size
    log = []
    run_ranks(size, lambda comm: CHOICES["allreduce"]["ring"](
        comm, HostBuffer(data(comm.rank, count), add), count), log)
    assert sum(log) == size * 2 * (count * 8) * (size - 1) // size


def test_every_family_is_tested_here():
    tested = {"allreduce", "reduce", "broadcast", "allgather", "reduce_scatter", "gather",
              "scatter", "alltoall", "barrier"}
    assert set(CHOICES) == tested, "a new algorithm family needs its test here"


def test_chunk_bounds_cover_the_count():
    for count in range(0, 40):
        for parts in range(1, 9):
            bounds = chunk_bounds(count, parts)
            assert sum(n for _, n in bounds) == count
            assert max(n for _, n in bounds) - min(n for _, n in bounds) <= 1
