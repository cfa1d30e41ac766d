"""Mismatches that exchange no wrong byte but would go unnoticed, or end in a
timeout: each must be a CollectiveMismatchError naming both calls.

- A message that a finished collective never took (two ranks that both call
  ``broadcast(x, src=own rank)`` each send and neither receives) is proof that
  the ranks ran different calls: the next call on either side says so.
- Ranks whose settings decide different messages (a forced algorithm, the
  shared arena's thresholds, the segment size) fail at their first call with
  the mismatch message, not at their deadline.
- A failure while preparing a call, before anything left the rank, leaves a
  group whose ranks all failed alike usable.
"""

import os
import subprocess
import sys
import textwrap
import threading
import time
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest

import numcoll as nc
from numcoll.memory.host import HostArrays

from test_mismatch import run_on, run_pair
from test_process_group import groups, on_ranks

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parent.parent
DEADLINE_S = 20  # the groups' timeout: a detection must come far sooner


@pytest.mark.parametrize("transport", ["inproc", "tcp", "shm"])
def test_two_roots_of_one_broadcast_fail_by_their_next_call(transport):
    def body(pg):
        x = np.full(4, pg.rank(), np.float32)
        with pytest.raises(nc.CollectiveMismatchError) as info:
            pg.broadcast(x, root=pg.rank()).wait()   # each rank thinks it is the root
            pg.allreduce(np.ones(2)).wait()           # the next call, at the latest
        return str(info.value)

    results, errors, elapsed = run_pair([body, body], transport=transport)
    assert errors == [None, None], errors
    assert elapsed < DEADLINE_S / 2, elapsed
    for rank, msg in enumerate(results):
        assert msg.startswith("Detected mismatch between collectives on ranks."), msg
        assert f"broadcast(float32, 4 elements, root {rank}) #1" in msg, msg
        assert f"broadcast(float32, 4 elements, root {1 - rank}) #1" in msg, msg


def test_a_message_left_by_an_earlier_call_is_found_with_concurrent_calls():
    """With several calls in flight on several workers, a message of a call
    still running is not a leftover: only a finished call's are."""
    pgs = groups(2, timeout=timedelta(seconds=DEADLINE_S), threads=3)
    try:
        def body(pg):
            works = [pg.allreduce(np.full(64, k + pg.rank(), np.float64)) for k in range(200)]
            for w in works:
                w.wait()
            x = np.zeros(3)
            with pytest.raises(nc.CollectiveMismatchError, match="root 0.*root 1|root 1.*root 0"):
                pg.broadcast(x, root=pg.rank()).wait()
                pg.barrier().wait()
            return True
        assert on_ranks(pgs, body) == [True, True]
    finally:
        for pg in pgs:
            pg.shutdown()


def test_different_forced_algorithms_fail_naming_them():
    """Per call: rank 0 forces the ring, rank 1 recursive doubling."""
    def call(algorithm):
        return lambda pg: pg.allreduce(np.ones(8), nc.AllreduceOptions(algorithm=algorithm)).wait()

    results, errors, elapsed = run_pair([call("ring"), call("recursive_doubling")])
    assert elapsed < DEADLINE_S / 2, elapsed
    msgs = [str(e) for e in errors if isinstance(e, nc.CollectiveMismatchError)]
    assert msgs, errors
    assert any("via ring" in m and "via recursive_doubling" in m for m in msgs), msgs


def test_groups_with_different_settings_fail_at_their_first_call():
    """Per group: rank 0's group forces the ring for every allreduce."""
    store = nc.HashStore(timeout=30)
    pgs = [None, None]

    def make(r):
        opts = nc.ProcessGroup.Options(transport="inproc", timeout=timedelta(seconds=DEADLINE_S),
                                       algorithm="allreduce:ring" if r == 0 else None)
        pgs[r] = nc.ProcessGroup(store, r, 2, opts)

    threads = [threading.Thread(target=make, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    # The algorithm forced is the same here (a barrier): only the settings differ.
    _, errors, elapsed = run_on(pgs, [lambda pg: pg.barrier().wait()] * 2)
    assert elapsed < DEADLINE_S / 2
    msgs = [str(e) for e in errors if isinstance(e, nc.CollectiveMismatchError)]
    assert msgs, errors
    assert "The ranks' settings differ" in msgs[0] and "NUMCOLL_ALGORITHM" in msgs[0], msgs


_RANK = textwrap.dedent("""
    import sys, time
    import numpy as np
    import numcoll as nc
    from datetime import timedelta
    nc.init_process_group(timeout=timedelta(seconds={deadline}), transport="{transport}")
    start = time.monotonic()
    try:
        nc.all_reduce(np.ones({count}, np.float32))
        print("ok", round(time.monotonic() - start, 2))
    except Exception as exc:
        print(type(exc).__name__, round(time.monotonic() - start, 2), exc)
    sys.stdout.flush()
    nc.destroy_process_group()
""")


@pytest.mark.slow
@pytest.mark.parametrize("transport,variable,values,count", [
    ("shm", "NUMCOLL_SHARED_MAX_NBYTES", ("64", "1048576"), 4096),
    ("shm", "NUMCOLL_SHARED_SPLIT_NBYTES", ("1024", "1048576"), 4096),
    ("tcp", "NUMCOLL_SEGMENT_NBYTES", ("1024", "4096"), 4096),
], ids=["shared_max", "shared_split", "segment"])
def test_processes_with_different_settings_fail_with_the_mismatch(transport, variable, values,
                                                                 count, free_port):
    """Environment set differently per process: on main these waited for
    their deadline (a rank on the arena, the other sending ring messages)."""
    world_size = 3 if variable == "NUMCOLL_SHARED_SPLIT_NBYTES" else 2
    procs = []
    for r in range(world_size):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(world_size),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port),
                   PYTHONPATH=os.pathsep.join(
                       [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))
        env[variable] = values[min(r, 1)]
        code = _RANK.format(deadline=DEADLINE_S, count=count, transport=transport)
        procs.append(subprocess.Popen([sys.executable, "-c", code], env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=60)
        outs.append(out.strip() or err.strip()[-2000:])
    assert any(o.startswith("CollectiveMismatchError") for o in outs), outs
    for o in outs:
        assert not o.startswith("CollectiveTimeoutError"), outs
        assert float(o.split()[1]) < DEADLINE_S / 2, outs


@pytest.fixture
def free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- failures before anything left the rank -----------------------------------------------
def test_a_failure_before_anything_left_the_rank_leaves_the_group_usable(monkeypatch):
    pgs = groups(2, timeout=timedelta(seconds=DEADLINE_S))
    try:
        def body(pg):
            # the list form packs its inputs into a new buffer first thing
            inputs = [np.full(3, pg.rank() + 1.0) for _ in range(2)]
            with pytest.raises(MemoryError):
                pg.reduce_scatter([np.zeros(3)], [inputs]).wait()
            x = np.full(4, pg.rank() + 1.0)
            pg.allreduce(x).wait()  # every rank failed alike: the group goes on
            return x

        real = HostArrays.empty

        def empty(n, dtype):
            if n == 6:
                raise MemoryError(f"cannot allocate {n} elements")
            return real(n, dtype)

        monkeypatch.setattr(HostArrays, "empty", staticmethod(empty))
        results = on_ranks(pgs, body)
    finally:
        for pg in pgs:
            pg.shutdown()
    assert all(np.array_equal(x, np.full(4, 3.0)) for x in results)


def test_a_failure_on_one_rank_alone_is_named_as_the_mismatch_it_makes(monkeypatch):
    """Only rank 0 fails while preparing; rank 1 ran the call and waits for rank
    0. Rank 0's next call finds rank 1's message, which no call took, and says
    so -- at once if it has arrived, else when the ranks' waits end (whichever
    deadline passes first, the other rank learns it at once)."""
    deadline_s = 3
    pgs = groups(2, timeout=timedelta(seconds=deadline_s))
    real = HostArrays.empty

    def empty(n, dtype):
        # rank 0's caller (named below) or one of its group's workers
        name = threading.current_thread().name
        if n == 6 and (name == "rank-0" or name.startswith("numcoll-r0-")):
            raise MemoryError(f"cannot allocate {n} elements")
        return real(n, dtype)

    monkeypatch.setattr(HostArrays, "empty", staticmethod(empty))
    errors = [[], []]

    def body(pg):
        inputs = [np.full(3, pg.rank() + 1.0) for _ in range(2)]
        for call in (lambda: pg.reduce_scatter([np.zeros(3)], [inputs]).wait(),
                     lambda: pg.allreduce(np.ones(4)).wait()):
            try:
                call()
            except Exception as exc:  # noqa: BLE001
                errors[pg.rank()].append(exc)

    start = time.monotonic()
    threads = [threading.Thread(target=body, args=(pg,), name=f"rank-{pg.rank()}")
               for pg in pgs]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    finally:
        for pg in pgs:
            pg.shutdown()
    assert time.monotonic() - start < 3 * deadline_s
    rank0, rank1 = errors
    assert isinstance(rank0[0], MemoryError), rank0
    assert isinstance(rank0[1], nc.CollectiveMismatchError), rank0
    assert "reduce_scatter" in str(rank0[1]), rank0
    assert rank1 and all(isinstance(e, nc.NumcollError) for e in rank1), rank1


def test_the_stamp_carries_and_renders_the_algorithm_and_the_settings():
    from numcoll import config
    from numcoll.algorithms import CHOICES
    from numcoll.call import ALGORITHMS, Call, describe_stamp, stamp_settings

    names = {name for table in CHOICES.values() for name in table} | {"gather_release",
                                                                     "allgather_coalesce"}
    assert names <= set(ALGORITHMS), names - set(ALGORITHMS)
    call = Call("reduce", 1.0, np.dtype(np.float64), 3, op="SUM", root=5, algorithm="ring",
                settings=0x3FA2)
    assert len(call.stamp) == 16  # what the shared arena's slot header holds
    assert describe_stamp(call.stamp, 7) == "reduce(float64, 3 elements, SUM, root 5) #7 " \
                                            "via ring, settings 3fa2"
    assert describe_stamp(call.stamp, 7, detail=False) == call.summary(7)
    assert call.summary(7, detail=True) == describe_stamp(call.stamp, 7)
    assert stamp_settings(call.stamp) == 0x3FA2
    big = Call("allreduce", 1.0, np.dtype(np.int8), (1 << 40) + 3, op="SUM")
    assert "1099511627779 elements" in describe_stamp(big.stamp)
    # every setting that decides the messages changes the fingerprint
    base = config.current()
    changed = {"algorithm": "allreduce:ring", "half_wire": "native", "sparse_dense_ratio": 2.0,
               "cuda_ipc": "off", "single_copy": 0}
    for name in config.AGREED:
        value = changed.get(name, getattr(base, name) * 2 or 4096)
        assert config.fingerprint(config.replace(base, **{name: value})) != \
            config.fingerprint(base), name
    assert config.fingerprint(config.replace(base, cuda_threads=32)) == config.fingerprint(base)
