"""Single-copy reads (CMA, ``process_vm_readv``) end to end: the ``cma``
algorithms of allgather, broadcast, gather, scatter and alltoall on shm
groups (ranks as threads, and as processes) at 1..4 ranks against NumPy;
the choice (by size, forced, refused); what the ranks agree at set-up; the
fallback when the kernel refuses a read (EPERM simulated), at set-up and in
the middle of a call; ranks that disagree; nothing left behind. The
algorithms alone, at 1..33 ranks over the fake comm, are in
tests/test_algorithms.py (every name of ``CHOICES``)."""

import errno
import os
from datetime import timedelta

import numpy as np
import pytest

import numcoll as nc
from numcoll.collectives.choice import choose
from numcoll.config import Config, current
from transports.shm import single_copy

import benchmark_scripts
from shm_leftovers import numcoll_entries
from test_process_group import groups, on_ranks

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif("not __import__('transports').shm_available()")]

#: A pid no process has (above any pid_max): a copy from it fails (ESRCH).
NO_SUCH_PID = 1 << 30
N = 3001  # float64 elements per rank: odd, not a multiple of anything
W = 301  # alltoall_base: elements per row


@pytest.fixture(autouse=True)
def small_threshold(monkeypatch):
    # Single-copy from 1 KiB, so small arrays exercise it (and slots of 4 KiB:
    # single copy is never chosen where one fused arena step moves the call).
    monkeypatch.setenv("NUMCOLL_ARENA_SLOT_NBYTES", "4096")
    monkeypatch.setenv("NUMCOLL_SINGLE_COPY_MIN_NBYTES", "1024")
    monkeypatch.setenv("NUMCOLL_SINGLE_COPY_BROADCAST_MIN_NBYTES", "1024")
    monkeypatch.setenv("NUMCOLL_SINGLE_COPY_ALLTOALL_MIN_NBYTES", "1024")
    monkeypatch.setenv("NUMCOLL_SINGLE_COPY_ALLTOALL_REST_MIN_NBYTES", "1024")
    monkeypatch.setenv("NUMCOLL_SINGLE_COPY_CROWDED_MIN_NBYTES", "1024")
    monkeypatch.setenv("NUMCOLL_SINGLE_COPY_ROOTED_MIN_NBYTES", "1024")
    monkeypatch.setenv("NUMCOLL_SINGLE_COPY_ALLREDUCE_MIN_NBYTES", "1024")


def shm_groups(size):
    return groups(size, transport="shm", timeout=timedelta(seconds=30))


def close(pgs):
    for pg in pgs:
        pg.shutdown()


def inputs(rank, n, dtype=np.float64):
    return (np.arange(n) % 97 + 1000 * rank + 0.25).astype(dtype)


def algorithms(pg, last):
    from numcoll.diagnostics import flight_recorder

    entries = [e for e in flight_recorder.dump(pg.rank())["entries"] if e["pg_id"] == pg._pg_id]
    return [e["algorithm"] for e in entries[-last:]]


#: What every_collective's calls ran, automatically, on groups whose ranks
#: read each other: single copy, but the alltoall with split sizes, through
#: the arena with the rest of its blocks read single-copy (4 KiB slots).
MOVED = ["cma"] * 6 + ["shared+cma", "cma"]


def every_collective(pg, algorithm=None):
    """Each moving collective, and allreduce, once, checked against NumPy;
    the number of calls."""
    r, size, n = pg.rank(), pg.size(), N
    a = inputs(r, n)  # (sums of quarters: exact in any order)
    pg.allreduce([a], nc.AllreduceOptions(algorithm=algorithm)).wait()
    assert np.array_equal(a, sum(inputs(q, n) for q in range(size)))
    x = inputs(r, n)
    out = np.zeros(n * size)
    pg.allgather_into_tensor(out, x, nc.AllgatherOptions(algorithm=algorithm)).wait()
    assert np.array_equal(out, np.concatenate([inputs(q, n) for q in range(size)]))
    lists = [[np.zeros(n) for _ in range(size)]]
    pg.allgather(lists, [x], nc.AllgatherOptions(algorithm=algorithm)).wait()
    for q in range(size):
        assert np.array_equal(lists[0][q], inputs(q, n))
    b = inputs(r, n)
    pg.broadcast([b], nc.BroadcastOptions(root_rank=size - 1, algorithm=algorithm)).wait()
    assert np.array_equal(b, inputs(size - 1, n))
    root = size // 2
    targets = [[np.zeros(n) for _ in range(size)]] if r == root else []
    pg.gather(targets, [x], nc.GatherOptions(root_rank=root, algorithm=algorithm)).wait()
    if r == root:
        for q in range(size):
            assert np.array_equal(targets[0][q], inputs(q, n))
    got = np.zeros(n)
    sources = [[inputs(100 + q, n) for q in range(size)]] if r == root else []
    pg.scatter([got], sources, nc.ScatterOptions(root_rank=root, algorithm=algorithm)).wait()
    assert np.array_equal(got, inputs(100 + r, n))
    # Uneven splits: rank r sends rank q (r + 2q) % 3 + 1 rows of W.
    rows = lambda src, dst: (src + 2 * dst) % 3 + 1  # noqa: E731
    send = np.concatenate([inputs(10 * r + q, W * rows(r, q)) for q in range(size)])
    recv = np.zeros(sum(W * rows(q, r) for q in range(size)))
    pg.alltoall_base(recv.reshape(-1, W), send.reshape(-1, W),
                     [rows(q, r) for q in range(size)], [rows(r, q) for q in range(size)],
                     nc.AllToAllOptions(algorithm=algorithm)).wait()
    assert np.array_equal(recv, np.concatenate([inputs(10 * q + r, W * rows(q, r))
                                                for q in range(size)]))
    outs = [np.zeros(n) for _ in range(size)]
    pg.alltoall(outs, [inputs(10 * r + q, n) for q in range(size)],
                nc.AllToAllOptions(algorithm=algorithm)).wait()
    for q in range(size):
        assert np.array_equal(outs[q], inputs(10 * q + r, n))
    return 8


@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_every_moving_collective_reads_single_copy(size):
    pgs = shm_groups(size)
    try:
        def body(pg):
            calls = every_collective(pg)
            assert pg._transport.single_copy is None or pg._transport.single_copy.refused is None
            return algorithms(pg, calls)

        for got in on_ranks(pgs, body):
            assert got == (MOVED if size > 1 else got)
    finally:
        close(pgs)


def test_below_the_general_threshold_three_read_single_copy_unmeasured(monkeypatch):
    """Broadcast, scatter and allgather from thresholds of their own up to the
    general one: ``cma`` (rank 0 keeps no times of them), right results;
    gather the arena's; from the general threshold, measured."""
    monkeypatch.setenv("NUMCOLL_SINGLE_COPY_MIN_NBYTES", str(64 << 10))
    monkeypatch.setenv("NUMCOLL_SINGLE_COPY_ROOTED_MIN_NBYTES", "0")
    for name in ("BROADCAST", "SCATTER", "ALLGATHER"):
        monkeypatch.setenv(f"NUMCOLL_SINGLE_COPY_{name}_MIN_NBYTES", "1024")
    pgs = shm_groups(2)
    try:
        def body(pg):
            r, n, root = pg.rank(), N, 1
            x, out = inputs(r, n), np.zeros(2 * n)
            pg.allgather_into_tensor(out, x).wait()
            assert np.array_equal(out, np.concatenate([inputs(0, n), inputs(1, n)]))
            pg.broadcast([x], nc.BroadcastOptions(root_rank=root)).wait()
            assert np.array_equal(x, inputs(root, n))
            got, sources = np.zeros(n), [[inputs(100 + q, n) for q in range(2)]]
            pg.scatter([got], sources if r == root else [],
                       nc.ScatterOptions(root_rank=root)).wait()
            assert np.array_equal(got, inputs(100 + r, n))
            targets = [[np.zeros(n) for _ in range(2)]] if r == root else []
            pg.gather(targets, [x], nc.GatherOptions(root_rank=root)).wait()
            tuning = pg._transport.single_copy.tuning
            below = algorithms(pg, 4), len(tuning)
            big = np.zeros(10 * n)  # (80 KB a rank: measured)
            pg.allgather_into_tensor(np.zeros(20 * n), big).wait()
            return below, len(tuning) if r == 0 else 1

        assert on_ranks(pgs, body) == [((["cma", "cma", "cma", "shared"], 0), 1)] * 2
    finally:
        close(pgs)


def test_processes_read_each_other_single_copy():
    def body():
        pg = nc.get_default_group()
        calls = every_collective(pg)
        return pg._transport.single_copy.refused, algorithms(pg, calls)

    for refused, got in nc.launch(body, 3, mode="process", transport="shm",
                                  timeout=timedelta(seconds=60)):
        assert refused is None
        assert got == MOVED


def test_the_choice_by_size_forced_and_refused(monkeypatch):
    # (chosen, it is cma_measured: single copy or the arena, as rank 0 measured them)
    cfg = current()  # NUMCOLL_SINGLE_COPY_MIN_NBYTES=1024 (the fixture)
    assert choose(cfg, "allgather", None, 16384, 2, single_copy_refused=None).name \
        == "cma_measured"
    assert choose(cfg, "allgather", None, 512, 2, single_copy_refused=None).name == "shared"
    # Alltoall keeps its own threshold (an alltoall without split sizes: its
    # ranks hold as much, by torch's rules); with split sizes, the arena's at
    # every size (its ranks' buffers may differ: a threshold between them
    # would part them), its ranks agreeing after the first round whether the
    # rest is read single-copy.
    defaults = current(single_copy_min_nbytes=4 << 20, single_copy_alltoall_min_nbytes=8 << 20,
                       arena_slot_nbytes=1 << 20, single_copy_alltoall_rest_min_nbytes=1 << 20)
    assert choose(defaults, "allgather", None, 6 << 20, 2, single_copy_refused=None).name \
        == "cma_measured"
    chosen = choose(defaults, "alltoall", None, 6 << 20, 2, single_copy_refused=None)
    assert chosen.name == "shared" and chosen.run.keywords == {"rest_nbytes": 1 << 20}
    assert choose(defaults, "alltoall", None, 8 << 20, 2, single_copy_refused=None).name \
        == "cma_measured"
    for nbytes in (6 << 20, 8 << 20, 1 << 30):
        chosen = choose(defaults, "alltoall", None, nbytes, 2, single_copy_refused=None,
                        uneven=True)
        assert chosen.name == "shared" and chosen.run.keywords == {"rest_nbytes": 1 << 20}
    # (forced, or where the ranks cannot read each other: the arena alone)
    assert not hasattr(choose(defaults, "alltoall", "shared", 1 << 30, 2,
                              single_copy_refused=None, uneven=True).run, "keywords")
    assert not hasattr(choose(defaults, "alltoall", None, 1 << 30, 2,
                              single_copy_refused="no", uneven=True).run, "keywords")
    # Within a fused arena step's reach too (slots of 4 KiB, the fixture: an
    # allgather of a slot a rank, a broadcast of a slot), as a repeated
    # measured call within a slot is a compiled start of its own.
    for name, fused in (("allgather", 2 * 4096), ("broadcast", 4096)):
        assert choose(cfg, name, None, fused, 2, single_copy_refused=None).name \
            == "cma_measured"
    # The defaults: measured from 512 KiB (a rank's block for gather), 2 ranks;
    # below it, broadcast, scatter and allgather read single-copy unmeasured
    # from 64 KiB (a rank's buffer; allgather's whole output), the arena below.
    plain = Config()
    for name in ("allgather", "broadcast", "scatter", "gather"):
        assert choose(plain, name, None, 512 << 10, 2, single_copy_refused=None).name \
            == "cma_measured"
        for nbytes, chosen in (((512 << 10) - 64, "cma"), (64 << 10, "cma"),
                               ((64 << 10) - 64, "shared")):
            assert choose(plain, name, None, nbytes, 2, single_copy_refused=None).name \
                == (chosen if name != "gather" else "shared"), (name, nbytes)
        # (not where the ranks cannot read each other, nor with single copy off)
        assert choose(plain, name, None, 64 << 10, 2, single_copy_refused="no").name == "shared"
        assert choose(current(single_copy=0), name, None, 64 << 10, 2,
                      single_copy_refused=None).name == "shared"
    # A crowded group counts as it counts the general threshold: scatter's list
    # against twice it; broadcast and allgather from the crowded one, measured.
    many = (os.cpu_count() or 1) + 2
    share = -(-2 * (64 << 10) // many)
    for nbytes, chosen in ((share, "cma"), (share - 64, "shared")):
        assert choose(plain, "scatter", None, nbytes, many, single_copy_refused=None).name \
            == chosen
    for name in ("allgather", "broadcast"):
        assert choose(plain, name, None, (1 << 20) - 64, many, single_copy_refused=None).name \
            == "shared"
    # An uncrowded group of more ranks: an allgather's output counts so that a
    # peer's chunk is as large as on 2 ranks (broadcast and scatter a rank's).
    from numcoll.collectives import choice

    with monkeypatch.context() as patched:
        patched.setattr(choice.os, "cpu_count", lambda: 64)
        for name, least in (("allgather", 4 * (64 << 10) // 2), ("broadcast", 64 << 10),
                            ("scatter", 64 << 10)):
            for nbytes, chosen in ((least, "cma"), (least - 64, "shared")):
                assert choose(plain, name, None, nbytes, 4, single_copy_refused=None).name \
                    == chosen, (name, nbytes)
    # ... a threshold of its own above the general one: measured from the general.
    own = current(single_copy_broadcast_min_nbytes=1 << 30, single_copy_min_nbytes=1 << 20)
    assert choose(own, "broadcast", None, (1 << 20) - 64, 2, single_copy_refused=None).name \
        == "shared"
    assert choose(own, "broadcast", None, 1 << 20, 2, single_copy_refused=None).name \
        == "cma_measured"
    assert choose(plain, "broadcast", None, 512 << 10, (os.cpu_count() or 1) + 1,
                  single_copy_refused=None).name == "shared"
    # Gather: the rooted threshold (not broadcast, which has its own, nor scatter).
    rooted = current(single_copy_rooted_min_nbytes=1 << 30)
    assert choose(rooted, "gather", None, 1 << 20, 2, single_copy_refused=None).name == "shared"
    assert choose(rooted, "broadcast", None, 1 << 20, 2, single_copy_refused=None).name == "cma_measured"
    assert choose(rooted, "scatter", None, 1 << 20, 2, single_copy_refused=None).name == "cma_measured"
    # More ranks than CPUs: the crowded threshold.
    crowded = current(single_copy_crowded_min_nbytes=1 << 30)
    many = (os.cpu_count() or 1) + 1
    assert choose(crowded, "allgather", None, 1 << 20, many, single_copy_refused=None).name \
        == "shared"
    assert choose(crowded, "allgather", None, 1 << 30, many, single_copy_refused=None).name \
        == "cma_measured"
    # ... but for alltoall, scatter and gather, whose single copy wins there too.
    least = crowded.single_copy_min_nbytes
    for name in ("alltoall", "scatter", "gather"):
        assert choose(crowded, name, None, 1 << 20, many, single_copy_refused=None).name \
            == "cma_measured"
        assert choose(crowded, name, None, least // (2 * many), many,
                      single_copy_refused=None).name == "shared"
    # (a crowded scatter or gather counts the root's whole list, against twice
    # the threshold: a share of a quarter of it is enough on 8 ranks, not on 4)
    crowds = (max(many, 8), min(max(many, 4), 7))
    for name in ("scatter", "gather"):
        assert choose(crowded, name, None, least // 4, crowds[0],
                      single_copy_refused=None).name == "cma_measured"
        assert choose(crowded, name, None, least // 4, crowds[1],
                      single_copy_refused=None).name == "shared"
    assert choose(crowded, "alltoall", None, least // 2, many, single_copy_refused=None).name \
        == "shared"
    assert choose(crowded, "broadcast", None, 1 << 20, many, single_copy_refused=None).name \
        == "shared"
    # ... and for allreduce, whose threshold is divided by the ranks there (the
    # arena's one-step allreduce reads every rank's buffer on every rank)
    most = crowded.single_copy_allreduce_min_nbytes
    for nbytes, name in ((-(-most // many), "cma_measured"), (most // many - 64, "shared")):
        assert choose(crowded, "allreduce", None, nbytes, many,
                      single_copy_refused=None).name == name
    assert choose(crowded, "allreduce", None, most - 64, 2, single_copy_refused=None).name \
        != "cma_measured"
    # Allreduce reads single-copy (a reduce-scatter and an allgather by reads)
    # from its own threshold, the other reductions never; a group whose ranks
    # cannot read each other takes the arena, and forcing cma there says why.
    reductions = current(single_copy_min_nbytes=4 << 20, arena_slot_nbytes=1 << 20,
                         single_copy_allreduce_min_nbytes=8 << 20)
    for nbytes, name in ((4 << 20, "shared_split"), (8 << 20, "cma_measured")):
        assert choose(reductions, "allreduce", None, nbytes, 2,
                      single_copy_refused=None).name == name
    assert choose(reductions, "allreduce", None, 8 << 20, 2).name == "shared_split"
    for name in ("reduce", "reduce_scatter"):
        assert choose(cfg, name, None, 8 << 20, 2, single_copy_refused=None).name == "shared"
    assert choose(cfg, "broadcast", None, 1 << 20, 2, single_copy_refused="no").name == "shared"
    with pytest.raises(ValueError, match="which this group cannot: EPERM here"):
        choose(cfg, "alltoall", "cma", 1 << 20, 2, single_copy_refused="EPERM here")
    with pytest.raises(ValueError, match="offers no single-copy"):
        choose(cfg, "gather", "cma", 1 << 20, 2)
    off = current(single_copy=0)
    assert choose(off, "scatter", None, 1 << 20, 2, single_copy_refused=None).name == "shared"
    with pytest.raises(ValueError, match="NUMCOLL_SINGLE_COPY"):
        choose(off, "scatter", "cma", 1 << 20, 2, single_copy_refused=None)
    # Refusable per group: NUMCOLL_SINGLE_COPY=0 (or Options(algorithm=...)).
    monkeypatch.setenv("NUMCOLL_SINGLE_COPY", "0")
    pgs = shm_groups(2)
    try:
        def body(pg):
            every_collective(pg)
            with pytest.raises(ValueError, match="reads the peers' buffers"):
                pg.broadcast([np.zeros(N)], nc.BroadcastOptions(algorithm="cma"))
            return algorithms(pg, 7)

        for got in on_ranks(pgs, body):
            assert "cma" not in got
    finally:
        close(pgs)


def _refuse_every_read(monkeypatch):
    monkeypatch.setattr(single_copy, "_process_vm_readv",
                        lambda pid, local, remote, nbytes: -errno.EPERM)


def test_refused_at_set_up_every_rank_agrees_and_takes_the_arena(monkeypatch):
    _refuse_every_read(monkeypatch)
    pgs = shm_groups(3)
    try:
        def body(pg):
            refused = pg._transport.single_copy.refused
            every_collective(pg)
            with pytest.raises(ValueError, match="EPERM"):
                pg.allgather_into_tensor(np.zeros(2 * N * 3), np.zeros(2 * N),
                                         nc.AllgatherOptions(algorithm="cma"))
            return refused, algorithms(pg, 7)

        results = on_ranks(pgs, body)
        reasons = {refused for refused, _ in results}
        assert len(reasons) == 1, reasons  # the same reason on every rank
        (reason,) = reasons
        assert "process_vm_readv failed with EPERM" in reason
        for _, got in results:
            assert "cma" not in got and "shared" in got
    finally:
        close(pgs)


@pytest.mark.parametrize("refuse_first_only", [False, True])
@pytest.mark.parametrize("syscall", ["_process_vm_readv", "_process_vm_writev"])
def test_a_copy_refused_in_a_call_finishes_through_the_arena(monkeypatch, syscall,
                                                             refuse_first_only):
    """A refused read, or write (the rooted collectives' root, or a gather's
    sender, writes its part of a copy into the peer), fails no call: each
    falls back to the arena, results right; later calls skip single copy."""
    pgs = shm_groups(3)
    try:
        real = getattr(single_copy, syscall)
        refusals = []

        def flaky(pid, local, remote, nbytes):
            if refuse_first_only and refusals:
                return real(pid, local, remote, nbytes)
            refusals.append(nbytes)
            return -errno.EPERM

        monkeypatch.setattr(single_copy, syscall, flaky)

        def body(pg):
            # (the compiled copies fail too -- no such pid -- and leave them to the
            # step-by-step path, whose syscalls are the ones refused)
            pg._transport.single_copy._pid_words[:] = NO_SUCH_PID
            every_collective(pg, algorithm="cma")  # each call falls back, results right
            assert pg._transport.single_copy.refused is None  # the choice stays as agreed
            return pg._transport.single_copy.failed

        reasons = set(on_ranks(pgs, body))
        assert len(reasons) == 1
        reason = reasons.pop()
        assert "EPERM" in reason and syscall.lstrip("_") in reason
        assert refusals
    finally:
        close(pgs)


@pytest.mark.parametrize("where", ["copies", "steps"])
def test_every_phase_the_compiled_call_leaves_is_finished_step_by_step(monkeypatch, where):
    """The compiled call (where, copies, done) stops where a copy fails (no
    such pid: the step-by-step path makes it again, with the real pid) or a
    peer is not there within the spin and yield phases (none here): every
    call finishes right from there, and nothing counts as refused."""
    from transports.shm import single_copy_steps

    pgs = shm_groups(3)
    states = []

    def counted(*args):
        got = real(*args)
        states.append(got[0])
        return got

    real = single_copy_steps.exchange
    monkeypatch.setattr(single_copy_steps, "exchange", counted)
    try:
        def body(pg):
            if where == "copies":
                pg._transport.single_copy._pid_words[:] = NO_SUCH_PID
            else:
                pg._transport.arena._spin_ns = pg._transport.arena._yield_ns = 0
            for _ in range(3):
                every_collective(pg, algorithm="cma")
            return pg._transport.single_copy.failed

        assert on_ranks(pgs, body) == [None] * 3
    finally:
        close(pgs)
    if where == "copies":  # (a rank whose peers were late stopped at the where step)
        assert "copies" in states and "done" not in states
    else:
        assert "where" in states


def test_rank_0_says_copy_or_arena_and_every_rank_follows(monkeypatch):
    """``cma_measured`` (the automatic choice): rank 0 says in its *where*,
    call by call, whether the call copies or goes through the arena; every
    rank follows it (results right either way, in step), the flight recorder
    says which way each call went, and a forced ``cma`` never asks."""
    from numcoll.algorithms import single_copy as algorithms_single_copy

    said = []

    def say(tuning, key):  # arena, copy, arena, ...
        said.append(key)
        return len(said) % 2 == 1

    monkeypatch.setattr(algorithms_single_copy, "_say", say)
    pgs = shm_groups(3)
    try:
        def body(pg):
            calls = every_collective(pg) + every_collective(pg)
            ways = algorithms(pg, calls)
            every_collective(pg, algorithm="cma")
            return ways, algorithms(pg, 8)

        got = on_ranks(pgs, body)
    finally:
        close(pgs)
    # (the alltoall with split sizes is not measured: the arena's, its rest
    # read single-copy)
    ways = ["shared_split", "cma", "shared", "cma", "shared", "cma", "shared+cma", "shared",
            "cma", "shared", "cma", "shared", "cma", "shared", "shared+cma", "cma"]
    assert got == [(ways, ["cma"] * 8)] * 3
    assert len(said) == 14  # rank 0 alone, once a call, never for the forced cma
    # (what rank 0 publishes: its allreduce's chunks 1 and 2, its allgather's block)
    assert said[0] == ("allreduce", (8 * 2 * (N // 3)).bit_length())
    assert said[1] == ("allgather_into_tensor", (8 * N).bit_length())


@pytest.mark.parametrize("threshold, way", [(16000, "shared"), (4000, "shared+cma")])
def test_an_uneven_alltoall_across_its_threshold_agrees(monkeypatch, threshold, way):
    """Ranks that send each other different amounts, their buffers either
    side of the alltoall threshold (rank 0 sends 24000 B, rank 1 12000; with
    a threshold on each rank's own buffer they chose differently and the
    call failed), agree after the first round whether the rest is read
    single-copy: from the largest block's rest (all of rank 0's 1500 float64,
    12000 B: it needs more than a round, so its data starts a round late)
    against the rest threshold, the same on both. Results right either way."""
    monkeypatch.setenv("NUMCOLL_SINGLE_COPY_ALLTOALL_MIN_NBYTES", "16000")
    monkeypatch.setenv("NUMCOLL_SINGLE_COPY_ALLTOALL_REST_MIN_NBYTES", str(threshold))
    m = 1500

    def body(pg):
        mine = m if pg.rank() == 0 else m // 2
        send = np.full((2 * mine, 1), float(pg.rank()))
        recv = np.zeros((m + m // 2, 1))
        pg.alltoall_base(recv, send, [m, m // 2], [mine, mine]).wait()
        return recv[:, 0].tolist(), algorithms(pg, 1)

    pgs = shm_groups(2)
    try:
        got = on_ranks(pgs, body)
    finally:
        close(pgs)
    assert got == [([0.0] * m + [1.0] * (m // 2), [way])] * 2


def test_rank_0_takes_the_faster_way_and_looks_at_the_other_now_and_then():
    from numcoll.algorithms.single_copy_say import _EXPLORE, _learnt, _say

    tuning, key = {}, ("allgather", 23)

    def calls(n, copy_s, arena_s):
        ways = []
        for _ in range(n):
            arena = _say(tuning, key)
            ways.append(arena)
            _learnt(tuning, key, arena, arena_s if arena else copy_s)
        return ways

    # Each way first until it has a time (warm-ups not counted: two of single
    # copy, one of the arena).
    assert calls(5, 1.0, 2.0) == [False, False, False, True, True]
    # Single copy twice as fast: the arena every 2 * _EXPLORE calls.
    ways = calls(8 * _EXPLORE, 1.0, 2.0)
    assert sum(ways) == 4
    # The arena turns 4x faster: seen at its next look (within 2 * _EXPLORE
    # calls), then kept, single copy looked at every 4 * _EXPLORE calls.
    ways = calls(8 * _EXPLORE, 1.0, 0.25)
    switched = ways.index(True)
    assert switched <= 2 * _EXPLORE and ways[switched:].count(False) <= 2
    # (its slow old times are forgotten: only the last few count)
    assert calls(1, 1.0, 0.25) == [True]


def test_one_slow_time_does_not_keep_a_way_off():
    """A way's first kept time may be a peer's one-off delay (compiled code
    loaded, 3 ms): one far above the other way's is taken again before the
    two ways are compared."""
    from numcoll.algorithms.single_copy_say import _learnt, _say

    tuning, key = {}, ("allgather", 17)
    times = {False: [1.0, 1.0, 3e-3, 1e-5], True: [1.0, 5e-5, 5e-5]}  # warm-ups first
    ways = []
    for _ in range(7):
        arena = _say(tuning, key)
        ways.append(arena)
        _learnt(tuning, key, arena, times[arena].pop(0))
    # copy's 3 ms (60x the arena's) tried again: 10 us; then the arena's lone
    # time, now 5x single copy's, once more too
    assert ways == [False, False, False, True, True, False, True]
    assert [_say(tuning, key) for _ in range(8)] == [False] * 8  # single copy: 10 us


def test_yama_scopes(monkeypatch):
    calls = []

    class FakeLibc:
        def prctl(self, option, arg, *rest):
            calls.append((option, arg))
            return 0

    monkeypatch.setattr(single_copy, "_LIBC", FakeLibc())
    monkeypatch.setattr(single_copy, "ptrace_scope", lambda: 1)
    # Scope 1, two ranks: exactly the one peer may read this process.
    assert single_copy.SingleCopy(0, 2, {1: 4242})._allow_peers() is None
    assert calls == [(single_copy.PR_SET_PTRACER, 4242)]
    # Scope 1 names one reader: a group of three cannot.
    why = single_copy.SingleCopy(0, 3, {1: 4242, 2: 4343})._allow_peers()
    assert "ptrace_scope is 1" in why and "2 peers" in why
    assert len(calls) == 1  # never PR_SET_PTRACER_ANY, nor a partial grant
    for scope in (2, 3):
        monkeypatch.setattr(single_copy, "ptrace_scope", lambda scope=scope: scope)
        assert f"ptrace_scope is {scope}" in single_copy.SingleCopy(0, 2, {1: 4242})._allow_peers()
    monkeypatch.setattr(single_copy, "ptrace_scope", lambda: None)
    assert "pid namespace" in single_copy.SingleCopy(0, 2, {1: 0})._allow_peers()


def test_ranks_that_disagree_on_the_algorithm_fail_on_both():
    pgs = shm_groups(2)
    try:
        def body(pg):
            algorithm = "cma" if pg.rank() == 0 else "shared"
            work = pg.allgather_into_tensor(np.zeros(2 * N), np.zeros(N),
                                            nc.AllgatherOptions(algorithm=algorithm,
                                                                timeout=timedelta(seconds=10)))
            with pytest.raises(nc.CollectiveMismatchError):
                work.wait()
            return True

        assert on_ranks(pgs, body) == [True, True]
    finally:
        close(pgs)


def _fds() -> set:
    return set(os.listdir("/proc/self/fd"))


def test_nothing_left_behind(no_leaked_threads):
    shm_before, fds_before = numcoll_entries(), _fds()
    for _ in range(3):
        pgs = shm_groups(2)
        try:
            on_ranks(pgs, every_collective)
        finally:
            close(pgs)
    assert numcoll_entries() - shm_before == set()
    assert _fds() - fds_before == set()


@pytest.mark.parametrize("size", [2, 3, 5])
def test_algorithms_alone_fall_back_when_one_rank_is_refused(size):
    from numcoll.algorithms import CHOICES
    from numcoll.memory.host import HostBuffer
    from numcoll.testing import run_ranks

    count = 11
    chunks = [(r * count, count) for r in range(size)]

    def rank_fn(comm):
        if comm.rank == size - 1:
            comm.single_copy_refused = "EPERM (simulated)"
        buf = np.zeros(count * size)
        buf[comm.rank * count:(comm.rank + 1) * count] = inputs(comm.rank, count)
        CHOICES["allgather"]["cma"](comm, HostBuffer(buf), chunks, 4)
        b = inputs(comm.rank, count)
        CHOICES["broadcast"]["cma"](comm, HostBuffer(b), 0, 4)
        return buf, b, comm.single_copy_refused

    for buf, b, refused in run_ranks(size, rank_fn):
        assert np.array_equal(buf, np.concatenate([inputs(q, count) for q in range(size)]))
        assert np.array_equal(b, inputs(0, count))
        assert refused == "EPERM (simulated)"  # every rank learnt it in the same call


@pytest.mark.slow
def test_the_single_copy_floor_benchmark_copies_whole_halves(capsys):
    """benchmarks/single_copy_floor.py (a fused single-copy step's floor):
    every call's half arrives whole (it raises otherwise), and each size gets
    a figure per amount touched."""
    bench = benchmark_scripts.load("single_copy_floor")
    if bench.first_two_cpus() is None:
        pytest.skip("needs two CPUs")
    code = bench.main(["--sizes", "4K,64K", "--touch", "0,16K", "--runs", "1"])
    out = capsys.readouterr().out
    if code == 2:
        pytest.skip(f"this machine cannot run it: {out.strip()}")
    assert code == 0
    (row,) = [line for line in out.splitlines() if line.startswith("round trip")]
    cells = [c.split() for c in row.split("|")[1:]]
    assert [c[0] for c in cells] == ["none", "4", "64"]
    for cell in cells:
        figures = [float(v) for v in cell[-3::2]]
        assert len(figures) == 2 and all(f > 0 for f in figures)


def test_the_single_copy_floor_benchmark_gives_up_on_a_refused_read():
    """A read the kernel refuses ends the floor's loop at once and tells the
    peer (a negative step word), instead of leaving it to spin."""
    import time

    bench = benchmark_scripts.load("single_copy_floor")
    flags = np.zeros(512, np.int64)
    here, there = np.zeros(64, np.uint8), np.zeros(64, np.uint8)
    bench._calls(flags, 0, os.getpid(), here.ctypes.data, there.ctypes.data, 64,
                 np.zeros(0, np.uint8), 0, 0, 0)  # (compiled before the clock starts)
    flags[8] = 1 << 40  # the peer (rank 1) is always there
    began = time.monotonic_ns()
    deadline_ns = began + 60 * 10 ** 9
    made = bench._calls(flags, 0, NO_SUCH_PID, here.ctypes.data, there.ctypes.data, 64,
                        np.zeros(0, np.uint8), 0, 5, deadline_ns)
    assert made == 0 and flags[0] == -1
    flags[:] = 0
    flags[8] = -1  # a peer that gave up: this side stops waiting at once
    assert bench._calls(flags, 0, os.getpid(), here.ctypes.data, there.ctypes.data, 64,
                        np.zeros(0, np.uint8), 0, 5, deadline_ns) == 0
    assert time.monotonic_ns() - began < 10 * 10 ** 9  # (not the deadline's 60 s)


@pytest.mark.parametrize("size", [2, 3, 5])
@pytest.mark.parametrize("when", ["first read", "a later piece", "second half"])
def test_an_allreduce_refused_anywhere_is_finished_through_the_arena(monkeypatch, size, when):
    """Refused at its first read, or after some pieces were read and reduced
    into the rank's own chunk, the arena's all-to-all brings every rank what
    it had not reduced yet; refused in its allgather, the arena's allgather
    finishes it from the reduced chunks. Results right either way, and every
    rank learns the refusal in the same call."""
    from numcoll.algorithms import CHOICES, single_copy_reduce
    from numcoll.memory.host import HostBuffer
    from numcoll.testing import run_ranks

    monkeypatch.setattr(single_copy_reduce, "_PIECE_NBYTES", 16)  # two float64 a piece
    count = 41
    n = count // size  # (the last rank's chunk: no extra element)
    first_half = (size - 1) * -(-n // 2)
    after = {"first read": 0, "a later piece": size - 1, "second half": first_half}[when]

    def rank_fn(comm):
        if comm.rank == size - 1:
            comm.refuse_reads_after(after)
        x = inputs(comm.rank, count)
        CHOICES["allreduce"]["cma"](comm, HostBuffer(x, lambda acc, y: np.add(acc, y, out=acc)),
                                    4)
        return x, comm.single_copy_refused

    want = sum(inputs(q, count) for q in range(size))
    for x, refused in run_ranks(size, rank_fn):
        assert np.array_equal(x, want)
        assert refused == "EPERM (simulated)"


def test_split_sizes_on_one_rank_only_agree_at_every_size(monkeypatch):
    """Rank 0 passes split sizes (its own block of another length), rank 1
    none: every all_to_all_single takes the arena's alltoall, whose ranks
    agree after round 0 whether to read the blocks single-copy, so the two
    cannot part, whatever the threshold: below it through the rounds, from
    it read whole."""
    m, k = 1500, 700  # float64: rank 0 keeps k for itself, each sends the other m

    def body(pg):
        mine = k if pg.rank() == 0 else m
        send = np.full((mine + m, 1), float(pg.rank()))
        recv = np.zeros((mine + m, 1))
        splits = [k, m] if pg.rank() == 0 else None
        pg.alltoall_base(recv, send, splits, splits,
                         nc.AllToAllOptions(timeout=timedelta(seconds=10))).wait()
        return recv[:, 0].tolist()

    want = [[0.0] * k + [1.0] * m, [0.0] * m + [1.0] * m]
    for threshold in (1, 8 * m, 8 * m + 1, 1 << 30):
        monkeypatch.setenv("NUMCOLL_SINGLE_COPY_ALLTOALL_REST_MIN_NBYTES", str(threshold))
        pgs = shm_groups(2)
        try:
            assert on_ranks(pgs, body) == want
        finally:
            close(pgs)
