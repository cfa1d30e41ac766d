"""Repeated single-copy all_to_all_single, gather, scatter and broadcast as
one compiled start (numcoll.fast.copy): results right call after call, with
the root anywhere and in torch's in-place forms, ranks as processes and as
threads, within and beyond a slot; a start that stops (a late peer) finished
by the group; rank 0 saying the arena; what keeps the ordinary path."""

from datetime import timedelta

import numpy as np
import pytest

import numcoll as nc

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif("not __import__('transports').shm_available()")]

N = 3001  # float64 elements a block: odd, so the root's share splits unevenly
COLLECTIVES = ["alltoall", "gather", "scatter", "broadcast"]
ALL = COLLECTIVES + ["allgather"]


@pytest.fixture(autouse=True)
def small_slots(monkeypatch):
    # Slots of 32 KiB: a block (24 KiB) fits one, as a start holding the GIL needs.
    monkeypatch.setenv("NUMCOLL_ARENA_SLOT_NBYTES", "32768")


def block(sender, receiver, call, n=N):
    return (np.arange(n) % 89 + 1000 * sender + 100 * receiver + call + 0.5).astype(np.float64)


def fused_copies(pg) -> int:
    from numcoll.fast.copy import FusedCopy

    return sum(isinstance(s.fused, FusedCopy) for s in pg.repeats._seen.values())


class Arrays:
    """The arrays of one repeated call of collective ``name`` on this rank
    (made once, so that the group recognises the repeat): ``in_place``, the
    root's block of the list is its own ``tensor`` (gather, scatter), every
    rank's input its block of the output (allgather)."""

    def __init__(self, name, root, in_place=False, n=N):
        pg = nc.get_default_group()
        r, size = pg.rank(), pg.size()
        self.r, self.size, self.n, self.name, self.root = r, size, n, name, root
        self.flat = np.zeros(size * n)
        self.whole = self.flat.reshape(size, n)
        self.blocks = list(self.whole) if r == root else None
        self.mine = self.blocks[r] if in_place and r == root else \
            self.whole[r] if in_place and name == "allgather" else np.zeros(n)
        self.inp = np.zeros(size * n)

    def call(self, c):
        """Call ``name`` once with values of call ``c`` and check the result."""
        name, r, size, root, n = self.name, self.r, self.size, self.root, self.n
        if name == "alltoall":
            self.inp[:] = np.concatenate([block(r, q, c, n) for q in range(size)])
            nc.all_to_all_single(self.flat, self.inp)
            got, want = self.whole, np.stack([block(q, r, c, n) for q in range(size)])
        elif name == "allgather":
            self.mine[:] = block(r, r, c, n)
            nc.all_gather_into_tensor(self.flat, self.mine)
            got, want = self.whole, np.stack([block(q, q, c, n) for q in range(size)])
        elif name == "gather":
            self.mine[:] = block(r, root, c, n)
            nc.gather(self.mine, self.blocks, dst=root)
            got, want = (self.whole, np.stack([block(q, root, c, n) for q in range(size)])) \
                if r == root else (self.mine, block(r, root, c, n))
        elif name == "scatter":
            if r == root:
                self.whole[:] = np.stack([block(root, q, c, n) for q in range(size)])
            nc.scatter(self.mine, self.blocks, src=root)
            got, want = self.mine, block(root, r, c, n)
        else:
            self.mine[:] = block(r, r, c, n)
            nc.broadcast(self.mine, src=root)
            got, want = self.mine, block(root, root, c, n)
        assert np.array_equal(got, want), f"{name} (root {root}) call {c} on rank {r}"


def repeated(name, calls, root=1, in_place=False, before=None):
    """``calls`` calls of collective ``name`` on the same arrays, new values
    each call, each checked; ``before(i)`` runs before call i. The number of
    fused single-copy plans this rank made."""
    arrays = Arrays(name, root, in_place)
    for i in range(calls):
        if before is not None:
            before(i)
        arrays.call(i)
    return fused_copies(nc.get_default_group())


def _algorithm(monkeypatch, algorithm="cma"):
    monkeypatch.setenv("NUMCOLL_ALGORITHM", ",".join(
        f"{op}:{algorithm}" for op in ALL))


def each_repeated(names, calls):
    """:func:`repeated` of each collective of ``names`` in turn, the group's
    plans forgotten before each (as in a launch of its own; one launch for
    them all saves a process start each): the fused plans of each."""
    pg = nc.get_default_group()
    plans = []
    for name in names:
        pg.repeats.clear()
        plans.append(repeated(name, calls))
    return plans


@pytest.mark.parametrize("size,mode", [(2, "process"), (3, "process"), (2, "thread")])
def test_repeated_calls_run_fused_and_right(monkeypatch, size, mode):
    _algorithm(monkeypatch)
    got = nc.launch(each_repeated, size, (COLLECTIVES, 25), mode=mode, transport="shm",
                    timeout=timedelta(seconds=60))
    assert got == [[1] * len(COLLECTIVES)] * size


@pytest.mark.parametrize("name", ["gather", "scatter"])
@pytest.mark.parametrize("root", [0, 1])
def test_the_roots_in_place_forms(monkeypatch, name, root):
    _algorithm(monkeypatch)
    got = nc.launch(repeated, 3, (name, 25, root, True), transport="shm",
                    timeout=timedelta(seconds=60))
    assert got == [1] * 3


@pytest.mark.parametrize("algorithm", ["cma", "cma_measured"])
@pytest.mark.parametrize("mode", ["process", "thread"])
def test_calls_larger_than_a_slot_copy_without_the_gil(monkeypatch, algorithm, mode):
    _algorithm(monkeypatch, algorithm)
    monkeypatch.setenv("NUMCOLL_ARENA_SLOT_NBYTES", "8192")
    got = nc.launch(each_repeated, 2, (COLLECTIVES, 25), mode=mode, transport="shm",
                    timeout=timedelta(seconds=60))
    assert got == [[1] * len(COLLECTIVES)] * 2


def measured_within_a_slot(name, calls):
    """The number of fused single-copy plans this rank made, and how many
    times of its fused starts it gave rank 0's say."""
    from numcoll.fast import copy

    learnt = []
    kept = copy.fused_learnt
    copy.fused_learnt = lambda *args: (learnt.append(args), kept(*args))
    # (each call after a barrier: a start whose peer is later than its wait
    # is finished by the group, untimed, and this test's checks between calls
    # take longer on one rank than the other)
    return repeated(name, calls, before=lambda i: nc.barrier()), len(learnt)


@pytest.mark.slow
@pytest.mark.parametrize("name", ALL)
def test_the_measured_choice_within_a_slot_runs_fused_and_rank_0_times_it(monkeypatch, name):
    _algorithm(monkeypatch, "cma_measured")
    monkeypatch.setenv("NUMCOLL_ARENA_SLOT_NBYTES", str(1 << 20))
    got = nc.launch(measured_within_a_slot, 2, (name, 40), transport="shm",
                    timeout=timedelta(seconds=60))
    assert [fused for fused, _ in got] == [1, 1]
    assert got[0][1] >= 1 and got[1][1] == 0  # (rank 0 alone times them)


def spin_budget(name):
    """A fused start within a slot: its wait for the peers, the wait of a
    fused arena step (the arena's spin phase; where this process may run on
    fewer CPUs than the group has ranks, yielding polls), and the bytes this
    rank copies."""
    from numcoll.fast.copy import FusedCopy
    from numcoll.fast.step import CROWDED_WAIT_NS

    repeated(name, 3)
    pg = nc.get_default_group()
    (fused,) = [s.fused for s in pg.repeats._seen.values() if isinstance(s.fused, FusedCopy)]
    copied = sum(buf.itemsize * count for *_, buf, _, count in fused.parts.copies)
    return fused.large, fused.spin_ns, pg._transport.arena.layout()[4] or CROWDED_WAIT_NS, \
        copied


@pytest.mark.slow
@pytest.mark.parametrize("name", ALL)
def test_a_start_within_a_slot_waits_as_long_as_the_peers_copy(monkeypatch, name):
    # (a start that gave up after the arena's 5 us spin phase would be
    # finished through the group's Python: 2 ranks, a 1 MiB alltoall took
    # 200-240 us a call where 512 KiB took 40)
    from numcoll.fast.copy import WAIT_NS_PER_BYTE

    _algorithm(monkeypatch)
    for large, spin_ns, step_wait_ns, copied in nc.launch(
            spin_budget, 2, (name,), transport="shm", timeout=timedelta(seconds=60)):
        assert not large and copied > 0
        assert spin_ns == step_wait_ns + copied * WAIT_NS_PER_BYTE
    # Threads of one process wait for nothing: their peers need the GIL.
    for _, spin_ns, *_ in nc.launch(spin_budget, 2, (name,), mode="thread", transport="shm",
                                    timeout=timedelta(seconds=60)):
        assert spin_ns == 0


def late_peer(name, calls):
    import time

    pg = nc.get_default_group()

    def before(i):
        if pg.rank() == 1 and i % 3 == 2:
            time.sleep(0.005)  # rank 0's start stops at the where step

    return repeated(name, calls, before=before), pg._transport.single_copy.failed


@pytest.mark.slow
@pytest.mark.parametrize("name", COLLECTIVES)
def test_a_late_peer_leaves_the_call_to_the_group(monkeypatch, name):
    _algorithm(monkeypatch)
    assert nc.launch(late_peer, 2, (name, 20), transport="shm",
                     timeout=timedelta(seconds=60)) == [(1, None)] * 2


def a_peer_a_little_late(name, calls):
    """Rank 1 comes to every call about 0.3 ms after rank 0 (as a root that
    makes its data first): the number of this rank's fused plans, and of its
    calls the group finished (promoted)."""
    import time

    from numcoll.fast import copy

    promoted = []
    rest = copy.FusedCopy.rest
    copy.FusedCopy.rest = lambda self, comm, work: (promoted.append(1), rest(self, comm, work))[1]
    pg = nc.get_default_group()

    def before(i):
        nc.barrier()
        if pg.rank() == 1:
            until = time.perf_counter() + 3e-4
            while time.perf_counter() < until:
                pass

    return repeated(name, calls, before=before), len(promoted)


@pytest.mark.slow
@pytest.mark.parametrize("name", COLLECTIVES)
def test_a_peer_a_little_late_is_waited_for_in_compiled_code(monkeypatch, name):
    # (before, every such call was promoted and finished through the group's
    # Python; now the start goes on waiting, without the GIL, within the
    # arena's yield phase of 2 ms)
    _algorithm(monkeypatch)
    got = nc.launch(a_peer_a_little_late, 2, (name, 30), transport="shm",
                    timeout=timedelta(seconds=60))
    assert [fused for fused, _ in got] == [1, 1]
    assert got[0][1] < 10, got  # (of 28 fused calls: a loaded machine may deschedule a rank)


def says_arena_every_other_call(name, calls):
    """Rank 0 says the arena on every other fused call: that call takes the
    ordinary path, which says so in its where, and the peers' starts stop
    there and finish through the arena."""
    from numcoll.algorithms import single_copy
    from numcoll.diagnostics import flight_recorder
    from numcoll.fast import copy

    said = []

    def fused_say(tuning, key):
        said.append(key)
        return len(said) % 2 == 0

    copy.fused_say = fused_say
    single_copy._say = lambda tuning, key: True  # (the ordinary path's say: the arena)
    pg = nc.get_default_group()
    fused = repeated(name, calls)
    entries = [e for e in flight_recorder.dump(pg.rank())["entries"]
               if e["pg_id"] == pg._pg_id]
    return fused, [e["algorithm"] for e in entries[-6:]], len(said)


@pytest.mark.slow
@pytest.mark.parametrize("name", ALL)
def test_rank_0_saying_the_arena_sends_every_rank_there(monkeypatch, name):
    _algorithm(monkeypatch, "cma_measured")
    monkeypatch.setenv("NUMCOLL_ARENA_SLOT_NBYTES", "8192")
    got = nc.launch(says_arena_every_other_call, 2, (name, 12), transport="shm",
                    timeout=timedelta(seconds=60))
    # (one plan: a call its run declined does not plan the same arrays again)
    assert got[0] == (1, ["cma", "shared"] * 3, 10)  # rank 0 alone asks, from call 3
    assert got[1][:2] == (1, ["cma", "shared"] * 3)


def split_sizes_on_one_rank(calls):
    """Rank 1 passes its (equal) split sizes, so its calls take the ordinary
    path while rank 0's run fused: both publish the same bytes."""
    pg = nc.get_default_group()
    r = pg.rank()
    out, inp = np.zeros(2 * N), np.zeros(2 * N)
    for i in range(calls):
        inp[:] = np.concatenate([block(r, q, i) for q in range(2)])
        splits = [N, N] if r == 1 else None
        nc.all_to_all_single(out, inp, splits, splits)
        assert np.array_equal(out, np.concatenate([block(q, r, i) for q in range(2)]))
    return fused_copies(pg)


@pytest.mark.slow
def test_a_fused_rank_meets_a_rank_on_the_ordinary_path(monkeypatch):
    _algorithm(monkeypatch)
    assert nc.launch(split_sizes_on_one_rank, 2, (20,), transport="shm",
                     timeout=timedelta(seconds=60)) == [1, 0]


def wrong_block_size(calls):
    pg = nc.get_default_group()
    r = pg.rank()
    out, inp = np.zeros(2 * N), np.zeros(2 * N)
    for _ in range(calls):
        nc.all_to_all_single(out, inp)
    try:
        if r == 0:
            nc.all_to_all_single(out, inp)
        else:
            nc.all_to_all_single(out, inp, [N - 1, N + 1], [N - 1, N + 1])
    except nc.PeerError as exc:
        return fused_copies(pg), str(exc)
    return fused_copies(pg), None


@pytest.mark.slow
def test_a_peer_sending_another_size_gets_the_ordinary_error(monkeypatch):
    _algorithm(monkeypatch)
    got = nc.launch(wrong_block_size, 2, (5,), transport="shm", timeout=timedelta(seconds=60),
                    group_timeout=timedelta(seconds=10))
    assert got[0][0] == got[1][0] == 1
    for rank, (_, text) in enumerate(got):
        assert text is not None and f"on rank {rank}: message from rank {1 - rank} has the " \
            "wrong size" in text, text


def random_calls(seed, calls):
    """``calls`` random collectives (the same sequence on every rank: one
    seed), each repeated 1-4 times on arrays kept per kind of call -- within
    and beyond a slot, the root anywhere, in place or apart -- each checked.
    The number of fused single-copy plans this rank made."""
    rng = np.random.default_rng(seed)
    size = nc.get_world_size()
    kept = {}
    for i in range(calls):
        key = (str(rng.choice(ALL)), int(rng.integers(size)), bool(rng.integers(2)),
               int(rng.choice([N // 3, N, 3 * N])))
        if key not in kept:
            kept[key] = Arrays(*key)
        for repeat in range(int(rng.integers(1, 5))):
            kept[key].call(10 * i + repeat)
    return fused_copies(nc.get_default_group())


@pytest.mark.parametrize("size", [2, 3])
def test_random_repeated_calls_are_right(monkeypatch, size):
    _algorithm(monkeypatch)
    got = nc.launch(random_calls, size, (1234 + size, 60), transport="shm",
                    timeout=timedelta(seconds=90))
    assert min(got) >= 5, got  # (at most 8 plans are kept a group)
