"""Surviving a dead rank on thread ranks: revoke, agree, shrink, and the module
API's shrink_group. A rank "dies" by aborting and shutting its group down
(the process-rank tests, with SIGKILL, are in test_fault_tolerance_procs.py)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

import numcoll as nc
from collective_checks import check_every_collective
from numcoll import HashStore, ProcessGroup

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("no_leaked_threads")]

DEADLINE_S = 20.0


def per_rank(fn, size: int, *args):
    """``fn(rank, *args)`` on ``size`` threads; every rank's value or exception."""
    out: list = [None] * size

    def run(r):
        try:
            out[r] = fn(r, *args)
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            out[r] = exc

    threads = [threading.Thread(target=run, args=(r,), name=f"test-rank{r}") for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(DEADLINE_S)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    return out


def die(pg):
    """What a rank that leaves for good does, seen from its peers."""
    pg.abort("this rank is going away")
    pg.shutdown()
    return "gone"


def group(store, rank, size, transport):
    return ProcessGroup(store, rank, size, ProcessGroup.Options(
        transport=transport, timeout=__import__("datetime").timedelta(seconds=DEADLINE_S)))


def two_hosts(rank, size, store, options):
    """The hier transport with ranks 0, 1 on one made-up host and the rest on another."""
    from transports.hier import HierTransport

    return HierTransport(rank, size, store, options, host_key=f"host{int(rank >= 2)}")


@pytest.mark.parametrize("transport", ["inproc", "shm", "tcp", "hier", two_hosts])
def test_survivors_shrink_and_go_on(transport):
    store, size, dead = HashStore(), 4, 2

    def rank(r):
        pg = group(store, r, size, transport)
        x = np.ones(8, np.float32)
        pg.allreduce(x).wait()
        if r == dead:
            return die(pg)
        time.sleep(0.2)  # the survivors call after the death: at once, not at the deadline
        start = time.monotonic()
        with pytest.raises(nc.NumcollError) as failure:
            pg.allreduce(np.ones(8, np.float32)).wait()
        assert time.monotonic() - start < DEADLINE_S / 4
        new = pg.shrink(timeout=DEADLINE_S)
        try:
            check_every_collective(new, counts=(1, 1000, 70_001))
            y = np.full(1000, new.rank() + 1, np.float32)
            new.allreduce(y).wait()
            return str(failure.value), new.rank(), new.size(), new.old_ranks(), float(y[0]), \
                new.transport_kind
        finally:
            new.shutdown()

    out = per_rank(rank, size)
    assert out[dead] == "gone"
    for r in (0, 1, 3):
        assert not isinstance(out[r], BaseException), out[r]
        error, new_rank, new_size, old, total, kind = out[r]
        assert new_size == 3 and old == [0, 1, 3] and new_rank == old.index(r)
        assert total == 1 + 2 + 3
        assert kind == getattr(transport, "__name__", transport)
    # The survivor that saw the death first says which rank and what to do.
    errors = [out[r][0] for r in (0, 1, 3)]
    assert any("rank 2" in e and "nc.shrink_group()" in e for e in errors), errors


def test_agree_gives_every_survivor_the_same_answer():
    store, size = HashStore(), 5

    def rank(r):
        with group(store, r, size, "inproc") as pg:
            healthy = pg.agree(r != 1)
            bits = pg.agree(0b1111 if r else 0b1011)
            if r == 4:
                return die(pg)
            with pytest.raises(nc.NumcollError):
                pg.allreduce(np.ones(4)).wait()
            after = pg.agree(True)
            return healthy, bits, after

    out = per_rank(rank, size)
    for r in range(4):
        assert out[r] == ((False, []), (0b1011, []), (True, [4])), out[r]


def test_agree_flag_must_be_an_int():
    with group(HashStore(), 0, 1, "inproc") as pg:
        with pytest.raises(TypeError, match="flag must be an int or bool"):
            pg.agree(1.5)
        assert pg.agree(6) == (6, [])


def test_revoke_fails_pending_and_later_calls_everywhere():
    store, size = HashStore(), 3
    revoked = threading.Event()

    def rank(r):
        pg = group(store, r, size, "inproc")
        try:
            if r == 0:
                time.sleep(0.2)  # the others are waiting in an allreduce that needs rank 0
                pg.revoke("a test")
                revoked.set()
                with pytest.raises(nc.GroupRevokedError):
                    pg.allreduce(np.ones(4)).wait()
                return "revoked"
            start = time.monotonic()
            with pytest.raises(nc.GroupRevokedError) as pending:
                pg.allreduce(np.ones(4)).wait()
            waited = time.monotonic() - start
            revoked.wait(DEADLINE_S)
            with pytest.raises(nc.GroupRevokedError) as later:
                pg.broadcast(np.ones(4), root=0).wait()
            return waited, str(pending.value), str(later.value)
        finally:
            pg.shutdown()

    out = per_rank(rank, size)
    assert out[0] == "revoked"
    for r in (1, 2):
        assert not isinstance(out[r], BaseException), out[r]
        waited, pending, later = out[r]
        assert waited < 5.0  # at once, not at the 20 s deadline
        assert "revoked" in pending and "shrink_group()" in pending
        assert "revoked" in later


def test_a_poisoned_group_says_how_to_go_on():
    store, size = HashStore(), 2

    def rank(r):
        pg = group(store, r, size, "inproc")
        if r == 1:
            return die(pg)
        with pytest.raises(nc.PeerError):
            pg.allreduce(np.ones(4)).wait()
        try:
            with pytest.raises(nc.GroupPoisonedError, match=r"shrink_group\(\)"):
                pg.allreduce(np.ones(4)).wait()
            new = pg.shrink()
            assert (new.size(), new.old_ranks()) == (1, [0])
            new.shutdown()
        finally:
            pg.shutdown()

    out = per_rank(rank, size)
    assert out == [None, "gone"]


def test_shrink_group_replaces_the_default_group():
    def fn():
        rank = nc.get_rank()
        if rank == 1:
            nc.get_default_group().abort("leaving")
            nc.destroy_process_group()
            return None
        with pytest.raises(nc.NumcollError):
            nc.all_reduce(np.ones(4))
        old = nc.get_default_group()
        new = nc.shrink_group(timeout=DEADLINE_S)
        assert nc.get_default_group() is new is not old
        x = np.ones(4)
        nc.all_reduce(x)
        ok, failed = nc.agree(True)
        return nc.get_rank(), nc.get_world_size(), new.old_ranks(), float(x[0]), ok, failed

    out = nc.launch(fn, 3, mode="thread", timeout=DEADLINE_S * 2)
    assert out[1] is None
    assert out[0] == (0, 2, [0, 2], 2.0, True, [])
    assert out[2] == (1, 2, [0, 2], 2.0, True, [])


def test_shrink_group_of_a_sub_group_keeps_global_ranks():
    def fn():
        sub = nc.new_group([1, 2, 3])
        if nc.get_rank() == 0:
            return None
        if nc.get_rank() == 2:
            sub.abort("leaving")
            sub.shutdown()
            return None
        with pytest.raises(nc.NumcollError):
            nc.all_reduce(np.ones(4), group=sub)
        new = nc.shrink_group(sub, timeout=DEADLINE_S)
        return nc.get_process_group_ranks(new), new.old_ranks(), nc.get_world_size()

    out = nc.launch(fn, 4, mode="thread", timeout=DEADLINE_S * 2)
    assert out[1] == out[3] == ([1, 3], [0, 2], 4)


def test_a_shrunk_group_leaves_no_keys_of_its_own():
    """What stays in the store after a death, a shrink and the new group's
    end: the groups' generation counters and the abort notes that explain
    the failure -- nothing of the agreement, the revoke or liveness."""
    store, size = HashStore(), 4

    def rank(r):
        pg = group(store, r, size, "shm")
        if r == 3:
            return die(pg)
        with pytest.raises(nc.NumcollError):
            pg.allreduce(np.ones(4)).wait()
        new = pg.shrink(timeout=DEADLINE_S)
        new.shutdown()

    assert per_rank(rank, size) == [None, None, None, "gone"]
    keys = sorted(store._data)  # a HashStore's keys (it has no public listing)
    left = [k for k in keys if not k.endswith("/joined") and "/abort/" not in k]
    assert left == [], keys


class _Suspects:
    """A liveness that finds the given ranks gone (a false suspicion, here)."""

    def __init__(self, gone):
        self.dead = set(gone)

    def check(self, ranks):
        return self.dead


@pytest.mark.parametrize("trial", range(20))
def test_agreement_is_one_decision_even_when_a_live_rank_is_suspected(trial):
    """Rank 0 wrongly believes rank 2 gone: whichever proposal the store takes
    first, every rank ends with it -- rank 2 either counted alive everywhere,
    or excluded everywhere (and told so)."""
    from numcoll.recovery import ExcludedError, agree_in_store

    store, size = HashStore(), 4
    flags = [0b111, 0b110, 0b011, 0b111]

    def rank(r):
        time.sleep(0.001 * ((r * 7 + trial) % 4))  # vary who proposes first
        liveness = _Suspects({2} if r == 0 else set())
        try:
            return agree_in_store(store, r, size, flags[r], liveness,
                                  time.monotonic() + DEADLINE_S, 0.001, "agree")
        except ExcludedError as exc:
            return exc

    out = per_rank(rank, size)
    answers = {tuple(map(tuple, [[o[0]], o[1]])) for o in out if not isinstance(o, BaseException)}
    assert len(answers) == 1, out
    (flag,), failed = answers.pop()
    if failed == (2,):
        assert isinstance(out[2], ExcludedError) and flag == 0b110
    else:
        assert failed == () and flag == 0b010 and not isinstance(out[2], BaseException)
    assert store.num_keys() == 1  # the votes are gone; the decision goes with the group
