"""Groups over several hosts, in one process: the ``hier`` transport with
made-up host keys (ranks are threads; each "host" has its shm transport and
arena, and tcp joins them), so every collective runs its two-level algorithm
through a real ProcessGroup, at the layouts of the namespace tests and more.
The algorithms alone are in tests/test_twolevel.py; real hosts (network
namespaces) in tests/test_multihost.py."""

from datetime import timedelta

import numpy as np
import pytest

import numcoll as nc
import transports
from numcoll.collectives.choice import TWO_LEVEL_DEFAULT, choose
from numcoll.algorithms.levels import Topology
from numcoll.config import current
from transports.hier import HierTransport

from collective_checks import check_every_collective
from test_process_group import groups, on_ranks

pytestmark = [pytest.mark.timeout(180),
              pytest.mark.skipif("not __import__('transports').shm_available()")]


def hier_groups(layout, **opts):
    """One ProcessGroup per rank; ``layout[r]`` is rank r's made-up host."""
    opts.setdefault("timeout", timedelta(seconds=30))

    def factory(rank, size, store, options):
        return HierTransport(rank, size, store, options, host_key=f"host{layout[rank]}")

    return groups(len(layout), transport=factory, **opts)


def close(pgs):
    for pg in pgs:
        pg.shutdown()


LAYOUTS = {"2x2": [0, 0, 1, 1], "3x2": [0, 0, 1, 1, 2, 2], "2x3": [0, 0, 0, 1, 1, 1],
           "3+1": [0, 0, 0, 1], "interleaved": [0, 1, 0, 1]}


@pytest.fixture
def small_arena(monkeypatch):
    # 4 KiB slots: a 300,001-element allreduce takes hundreds of blocks.
    monkeypatch.setenv("NUMCOLL_ARENA_SLOT_NBYTES", "4096")


@pytest.mark.parametrize("layout", list(LAYOUTS), ids=list(LAYOUTS))
def test_every_collective_over_hosts_chooses_two_levels(layout, small_arena,
                                                       no_leaked_threads):
    pgs = hier_groups(LAYOUTS[layout])
    try:
        ran = on_ranks(pgs, lambda pg: check_every_collective(pg, expect=TWO_LEVEL_DEFAULT))
        assert ran[0]["alltoall"] == "pairwise"  # each byte crosses once already
        topology = pgs[0]._topology
        assert len(topology.hosts) == len(set(LAYOUTS[layout]))
    finally:
        close(pgs)


@pytest.mark.parametrize("algorithm", ["twolevel_lanes", "ring", "recursive_doubling"])
def test_algorithms_can_be_forced_on_a_group_over_hosts(algorithm, small_arena):
    pgs = hier_groups(LAYOUTS["2x3"])
    try:
        def body(pg):
            x = np.full(50_001, pg.rank() + 1.0, np.float32)
            work = pg.allreduce(x, nc.AllreduceOptions(algorithm=algorithm))
            work.wait()
            assert x[0] == x[-1] == 21.0
            return work.call.algorithm

        assert on_ranks(pgs, body) == [algorithm] * 6
    finally:
        close(pgs)


def test_every_two_level_family_runs_its_lanes_variant(small_arena):
    pgs = hier_groups(LAYOUTS["2x2"], algorithm=",".join(
        f"{f}:twolevel_lanes" for f in ("allreduce", "reduce", "broadcast", "allgather",
                                         "reduce_scatter")))
    try:
        on_ranks(pgs, lambda pg: check_every_collective(pg, counts=(1, 70_001),
                                                        expect=None))
        ran = on_ranks(pgs, lambda pg: check_every_collective(pg, counts=(5,)))
        assert ran[0]["allreduce"] == "twolevel_lanes" and ran[0]["barrier"] == "twolevel"
    finally:
        close(pgs)


def test_a_group_over_hosts_refuses_what_it_cannot_run():
    pgs = hier_groups(LAYOUTS["2x2"])
    try:
        with pytest.raises(ValueError, match="spans 2 hosts"):
            pgs[0].allreduce(np.ones(3), nc.AllreduceOptions(algorithm="shared"))
        with pytest.raises(ValueError, match="unknown algorithm 'twolevel'"):
            pgs[0].gather([[np.ones(1) for _ in range(4)]], [np.ones(1)],
                          nc.GatherOptions(algorithm="twolevel"))
        # A rejected call takes no sequence number: the group still works.
        on_ranks(pgs, lambda pg: pg.allreduce(np.ones(3)).wait())
    finally:
        close(pgs)


def test_a_group_on_one_host_keeps_shm_and_refuses_two_levels():
    from test_shared_arena import shm_groups

    pgs = shm_groups(2)
    try:
        assert pgs[0].transport_kind == "shm" and pgs[0].context.topology is None
        works = on_ranks(pgs, lambda pg: pg.allreduce(np.ones(1000)))
        assert {w.call.algorithm for w in works} == {"shared"}
        with pytest.raises(ValueError, match="needs a group that knows its hosts"):
            pgs[0].allreduce(np.ones(3), nc.AllreduceOptions(algorithm="twolevel"))
    finally:
        close(pgs)


def test_choose_kind_picks_hier_only_where_hosts_share_ranks():
    a, b = "hostA/netns1/boot9", "hostB/netns2/boot9"
    assert transports.choose_kind(f"{a}:1", [f"{a}:1", f"{a}:1"]) == "inproc"
    assert transports.choose_kind(f"{a}:1", [f"{a}:1", f"{a}:2"]) == "shm"
    assert transports.choose_kind(f"{a}:1", [f"{a}:1", f"{b}:2"]) == "tcp"
    assert transports.choose_kind(f"{a}:1", [f"{a}:1", f"{a}:3", f"{b}:2"]) == "hier"
    assert transports.choose_kind(f"{a}:1", [f"{a}:1", f"{b}:2", f"{b}:3"]) == "hier"


def test_automatic_choice_by_topology():
    cfg = current()
    over_hosts = Topology([[0, 1], [2, 3]], 0, cfg.arena_slot_nbytes)
    one_per_host = Topology([[0], [1]], 0, cfg.arena_slot_nbytes)
    no_arenas = Topology([[0, 1], [2, 3]], 0, 0)
    for family in ("allreduce", "reduce", "broadcast", "allgather", "reduce_scatter",
                   "barrier"):
        assert choose(cfg, family, None, 1 << 20, 4, topology=over_hosts).name == \
            (TWO_LEVEL_DEFAULT if family != "barrier" else "twolevel")
        assert choose(cfg, family, None, 1 << 20, 2, topology=one_per_host).name not in \
            ("twolevel", "twolevel_lanes", "shared")
        assert choose(cfg, family, None, 8, 4, topology=no_arenas).name not in \
            ("twolevel", "twolevel_lanes", "shared")
        # Inside another call (the sparse allreduce), no arena algorithm.
        assert choose(cfg, family, None, 8, 4, shared=False, topology=over_hosts).name \
            not in ("twolevel", "twolevel_lanes", "shared")
    assert choose(cfg, "alltoall", None, 1 << 20, 4, topology=over_hosts).name == "pairwise"
    assert choose(cfg, "gather", None, 1 << 20, 4, topology=over_hosts).name == "direct"
    with pytest.raises(ValueError, match="no arenas"):
        choose(cfg, "allreduce", "twolevel", 8, 4, topology=no_arenas)


def test_hier_transport_names_group_ranks_in_its_errors():
    """A local peer's failure, raised by the host's shm transport in its own
    numbering, reaches the caller naming the group rank."""
    pgs = hier_groups([0, 1, 0, 1])  # host 0: ranks 0 and 2
    try:
        transport = pgs[0]._transport
        assert transport.hosts == ((0, 2), (1, 3)) and transport.local == (0, 2)
        pending = transport.irecv(2, 77)
        pgs[2]._transport.close()
        with pytest.raises(transports.PeerClosed) as info:
            pending.wait(__import__("time").monotonic() + 10)
        assert info.value.peer == 2
        assert "rank 2 closed" in str(info.value), info.value  # rank 1 of this host's
        with pytest.raises(ValueError, match="bit 63"):
            transport.irecv(transports.ANY_SOURCE, 5)
    finally:
        close(pgs)


def test_a_dead_local_peer_is_named_by_every_rank(no_leaked_threads):
    """Rank 3 (host 1, not its leader) aborts in the middle of allreduces:
    its host's leader sees it leave the arena, the other host's ranks learn
    it through the leaders' notes; every rank names rank 3, well within the
    timeout."""
    pgs = hier_groups(LAYOUTS["2x2"], timeout=timedelta(seconds=20))
    try:
        def body(pg):
            x = np.ones(100_000, np.float32)
            pg.allreduce(x).wait()
            if pg.rank() == 3:
                pg.abort("rank 3 leaves on purpose")
                return None
            start = __import__("time").monotonic()
            with pytest.raises(nc.NumcollError) as info:
                for _ in range(1000):
                    pg.allreduce(x).wait()
            return __import__("time").monotonic() - start, str(info.value)

        results = on_ranks(pgs, body)
        for rank, (seconds, message) in enumerate(results[:3]):
            assert seconds < 5, (rank, seconds, message)
            assert "rank 3" in message, (rank, message)
    finally:
        close(pgs)


def test_two_roots_of_one_broadcast_are_found_over_hosts():
    """Host 0 broadcasts from rank 0, host 1 from rank 2: the leaders each send
    their block across and neither receives, so each holds a message of a
    finished call (in the tcp mailbox; the hier transport shows both of its
    mailboxes as one): by the next call at the latest, the leaders fail with
    the mismatch, naming both calls, and no rank waits for its deadline."""
    pgs = hier_groups(LAYOUTS["2x2"], timeout=timedelta(seconds=20))
    try:
        def body(pg):
            root = 0 if pg.rank() < 2 else 2
            start = __import__("time").monotonic()
            with pytest.raises(nc.NumcollError) as info:
                pg.broadcast(np.full(4, pg.rank(), np.float32), root=root).wait()
                pg.allreduce(np.ones(2)).wait()
            return __import__("time").monotonic() - start, info.value

        results = on_ranks(pgs, body)
        for rank, (seconds, error) in enumerate(results):
            assert seconds < 10, (rank, seconds, error)
        for rank in (0, 2):
            error = results[rank][1]
            assert isinstance(error, nc.CollectiveMismatchError), (rank, error)
            assert "root 0) #1" in str(error) and "root 2) #1" in str(error), error
    finally:
        close(pgs)
