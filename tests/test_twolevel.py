"""The two-level algorithms alone, against NumPy, at many host layouts: the
in-memory fake comm (numcoll.testing.run_ranks with ``hosts``) gives every
"host" an arena of its own and the comms their two levels. Tiny blocks and
tiny arena slots force the pipelined paths; uneven hosts (3+1), interleaved
ranks, one rank per host and one host are included."""

import numpy as np
import pytest

from numcoll.algorithms import CHOICES, TWO_LEVEL
from numcoll.memory.host import HostBuffer
from numcoll.testing import run_ranks

from test_algorithms import add, check_uneven_chunks, data

pytestmark = pytest.mark.timeout(120)

LAYOUTS = [
    [[0, 1], [2, 3]],                 # 2 x 2
    [[0, 1], [2, 3], [4, 5]],         # 3 hosts x 2
    [[0, 1, 2], [3, 4, 5]],           # 2 hosts x 3
    [[0, 1, 2], [3]],                 # 3 + 1
    [[0], [1, 2, 3]],                 # 1 + 3
    [[0, 2], [1, 3]],                 # ranks interleaved over hosts
    [[0, 3, 4], [1], [2, 5]],         # uneven and interleaved
    [[0], [1], [2]],                  # one rank per host
    [[0, 1, 2, 3]],                   # one host
    [[0, 1, 2, 3], [4, 5, 6, 7]],     # 2 x 4
]
IDS = ["x".join(str(len(h)) for h in layout) + ("i" if sorted(sum(layout, [])) !=
                                                  sum(layout, []) else "")
       for layout in LAYOUTS]
SEGMENT = 3
SLOT = 64  # bytes: 8 float64 per arena round


def run(layout, fn, segment=SEGMENT):
    size = sum(len(h) for h in layout)
    return run_ranks(size, fn, hosts=layout, arena_slot_nbytes=SLOT), size


NAMES = sorted(TWO_LEVEL)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("layout", LAYOUTS, ids=IDS)
def test_allreduce(name, layout):
    algorithm = CHOICES["allreduce"][name]
    size = sum(len(h) for h in layout)
    for count in (0, 1, 5, 2 * size + 3, 61):
        for segment in (SEGMENT, None):
            results, _ = run(layout, lambda comm: _allreduce(algorithm, comm, count, segment))
            expected = sum(data(r, count) for r in range(size))
            for got in results:
                np.testing.assert_array_equal(got, expected)


def _allreduce(algorithm, comm, count, segment):
    buf = data(comm.rank, count)
    algorithm(comm, HostBuffer(buf, add), segment)
    return buf


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("layout", LAYOUTS, ids=IDS)
def test_reduce_and_broadcast(name, layout):
    size = sum(len(h) for h in layout)
    reduce, broadcast = CHOICES["reduce"][name], CHOICES["broadcast"][name]
    count = 29
    for root in sorted({0, size // 2, size - 1}):
        def rank_fn(comm):
            buf = data(comm.rank, count)
            reduce(comm, HostBuffer(buf, add), root, SEGMENT)
            out = data(comm.rank, count) if comm.rank == root else np.zeros(count)
            broadcast(comm, HostBuffer(out), root, SEGMENT)
            return buf, out

        results, _ = run(layout, rank_fn)
        np.testing.assert_array_equal(results[root][0], sum(data(r, count) for r in range(size)))
        for r, (mine, out) in enumerate(results):
            np.testing.assert_array_equal(out, data(root, count))


@pytest.mark.parametrize("family", ["allgather", "reduce_scatter"])
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("layout", LAYOUTS, ids=IDS)
def test_allgather_and_reduce_scatter_with_uneven_chunks(family, name, layout):
    size = sum(len(h) for h in layout)
    for sizes in ([r % 3 * 5 for r in range(size)], [11] * size, [0] * size):
        check_uneven_chunks(family, CHOICES[family][name], sizes,
                            lambda rank_fn: run(layout, rank_fn)[0])


@pytest.mark.parametrize("layout", LAYOUTS, ids=IDS)
def test_barrier(layout):
    log = []
    size = sum(len(h) for h in layout)
    run_ranks(size, CHOICES["barrier"]["twolevel"], log, hosts=layout)
    leaders = len(layout)
    steps = (leaders - 1).bit_length()
    messages = [n for n in log if n == 0]
    # Two arena steps on every host with several ranks, and the leaders'
    # dissemination barrier: log2(H) empty messages each.
    assert len(messages) == 2 * sum(len(h) for h in layout if len(h) > 1) + leaders * steps


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("size_per_host", [2, 3])
def test_allreduce_crosses_between_hosts_once(name, size_per_host):
    """The cost in the docstring, counted: the messages of a 2-host allreduce
    carry S bytes each way in all, whatever the ranks per host (a flat ring:
    2 S (P-1)/P on each of the two links that cross)."""
    layout = [list(range(size_per_host)), list(range(size_per_host, 2 * size_per_host))]
    count = 8 * 6  # float64: S = 384 bytes, in blocks of 8
    sent = []

    def rank_fn(comm):
        original = comm.isend

        def counted(peer, step, buf):
            if comm.topology.host_of[peer] != comm.topology.host:
                sent.append((comm.topology.host, np.asarray(buf).nbytes))
            return original(peer, step, buf)

        comm.isend = counted
        return _allreduce(CHOICES["allreduce"][name], comm, count, None)

    results, _ = run(layout, rank_fn)
    for host in (0, 1):
        assert sum(n for h, n in sent if h == host) == count * 8
    for got in results:
        np.testing.assert_array_equal(got, sum(data(r, count) for r in range(2 * size_per_host)))


@pytest.mark.parametrize("name", NAMES)
def test_results_are_bitwise_identical_on_every_rank(name):
    rng = np.random.default_rng(5)
    layout = [[0, 1, 2], [3, 4], [5, 6, 7]]
    inputs = [(rng.standard_normal(300) * 10.0 ** rng.integers(-3, 4, 300)).astype(np.float32)
              for _ in range(8)]
    results, _ = run(layout, lambda comm: (CHOICES["allreduce"][name](
        comm, HostBuffer(b := inputs[comm.rank].copy(), add), 7), b)[1])
    for got in results[1:]:
        assert got.tobytes() == results[0].tobytes()


def test_every_collective_with_two_levels_has_both_variants():
    for family in ("allreduce", "reduce", "broadcast", "allgather", "reduce_scatter"):
        assert TWO_LEVEL <= set(CHOICES[family]), family
    assert "twolevel" in CHOICES["barrier"]
