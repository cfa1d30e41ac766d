"""The overlap rule (:mod:`numcoll.memory.overlap`, issue 21) on this round's
forms: persistent requests and shared arrays.

A persistent request is made by the ordinary builders, so the rule is applied
once, at init: what it refuses fails there (taking no sequence number), and
what it handles (an input overlapping an output, read from a copy) stays
right at every start, since a request keeps its arrays (their memory cannot
move). On shared arrays the peers read a rank's input in place, so an
output overlapping that input elsewhere than torch's in-place forms is
written only once every rank has finished reading.

The fuzz of tests/test_overlap.py (random shifted, strided, reversed and 2-D
views of one buffer per rank, torch's own-chunk forms, the same view twice),
with the buffer in shared memory and/or the call made persistent and started
twice with new contents, compared with a reference computed from copies.
"""

from datetime import timedelta

import numpy as np
import pytest
from numpy.lib.stride_tricks import as_strided

import numcoll as nc
from numcoll.memory import shared

from test_overlap import COLLECTIVES, _fuzz
from test_process_group import groups, on_ranks

pytestmark = [pytest.mark.timeout(300),
              pytest.mark.skipif("not __import__('transports').shm_available()")]

TRIALS = 150
#: The collectives with a persistent form (and, but for broadcast, a shared-array path
#: that reads the peers' inputs in place).
PERSISTENT = ("allreduce", "broadcast", "reduce", "reduce_scatter_tensor",
              "allgather_into_tensor", "alltoall_base")


@pytest.fixture
def small_shared_path(monkeypatch):
    """Every array of the fuzz large enough to take the shared-array path, in many blocks."""
    monkeypatch.setenv("NUMCOLL_SHARED_ARRAYS_MIN_NBYTES", "64")
    monkeypatch.setenv("NUMCOLL_SHARED_ARRAYS_BLOCK_NBYTES", "256")


def _shared_region(pg, length):
    """This rank's buffer for the fuzz: one shared allocation (collective), reused
    by every trial."""
    region = shared.empty(pg.context.shared_memory, pg.rank(), (length,), np.float64)
    assert shared.locate(pg.context.shared_memory, region) is not None
    return region


def _init(pg, t, ins, outs):
    """The persistent request of trial ``t``."""
    name, root = t["name"], t["root"]
    if name == "allreduce":
        return pg.allreduce_init(ins)
    if name == "broadcast":
        return pg.broadcast_init(ins, nc.BroadcastOptions(root_rank=root))
    if name == "reduce":
        return pg.reduce_init(ins, nc.ReduceOptions(root_rank=root))
    if name == "reduce_scatter_tensor":
        return pg.reduce_scatter_tensor_init(outs[0], ins[0])
    if name == "allgather_into_tensor":
        return pg.allgather_into_tensor_init(outs[0], ins[0])
    if name == "alltoall_base":
        return pg.alltoall_base_init(outs[0], ins[0])
    raise AssertionError(name)


FORMS = [("shm", 2, True, False), ("shm", 3, True, False), ("inproc", 3, False, True),
         ("shm", 2, False, True), ("shm", 2, True, True), ("shm", 4, True, True)]


@pytest.mark.parametrize("transport,size,in_shared,persistent", FORMS,
                         ids=[f"{t}-{n}{'-shared' if s else ''}{'-persistent' if p else ''}"
                              for t, n, s, p in FORMS])
def test_fuzz_overlapping_views(transport, size, in_shared, persistent, small_shared_path):
    starts = 2 if persistent else 1  # a persistent request: started twice, new contents
    pgs = groups(size, transport=transport, timeout=timedelta(seconds=60))
    try:
        stats = _fuzz(pgs, TRIALS, seed=1900 + 10 * size + 2 * in_shared + persistent,
                      names=PERSISTENT if persistent else COLLECTIVES,
                      make=_init if persistent else None,
                      region=_shared_region if in_shared else None, starts=starts)
    finally:
        for pg in pgs:
            pg.shutdown()
    print(f"{transport} x{size} shared={in_shared} persistent={persistent}: {dict(stats)}")
    assert stats["wrong"] == 0, dict(stats)
    assert stats["right"] + starts * stats["refused"] == starts * TRIALS, dict(stats)
    assert stats["right, inputs overlapping outputs"] > starts * TRIALS // 10, dict(stats)
    if in_shared:  # the shared-array path ran with inputs overlapping outputs
        assert stats["right, overlapping, shared_arrays"] > starts * TRIALS // 20, dict(stats)


# -- the cases of issue 21, on shared arrays and persistent requests -----------------------
def _issue_21_cases(rank, init, make):
    """``reduce_scatter_tensor(y[4:8], y)`` and ``(y[2:6], y)`` on 2 ranks, ``y``
    from ``make(8)``, ``y = arange(8) + 10 * rank``: the reference is
    ``[18, 20, 22, 24]`` on rank 1 for the first and the shares of the sum."""
    got = []
    for lo in (4, 2):
        y = make(8)
        req = init(y[lo:lo + 4], y)
        for start in range(3):
            y[...] = np.arange(8) + 10 * rank + start
            req.start()
            req.wait()
            got.append((lo, start, y[lo:lo + 4].copy(), req.work.call.algorithm))
    return got


def _check_issue_21(results):
    for rank, got in enumerate(results):
        for lo, start, out, algorithm in got:
            total = sum(np.arange(8) + 10 * q + start for q in range(2))
            np.testing.assert_array_equal(out, total[rank * 4:(rank + 1) * 4],
                                          err_msg=f"rank {rank}, y[{lo}:{lo + 4}], start {start}")
            assert algorithm == "shared_arrays"


def test_issue_21_reduce_scatter_into_its_input_on_shared_arrays(small_shared_path):
    pgs = groups(2, transport="shm", timeout=timedelta(seconds=30))
    try:
        _check_issue_21(on_ranks(pgs, lambda pg: _issue_21_cases(
            pg.rank(), pg.reduce_scatter_tensor_init,
            lambda n: shared.empty(pg.context.shared_memory, pg.rank(), (n,), np.float64))))
    finally:
        for pg in pgs:
            pg.shutdown()


def _issue_21_in_processes():
    return _issue_21_cases(nc.get_rank(), nc.reduce_scatter_tensor_init,
                           lambda n: nc.empty_shared((n,), np.float64))


@pytest.mark.slow
def test_issue_21_on_shared_arrays_in_processes(small_shared_path):
    _check_issue_21(nc.launch(_issue_21_in_processes, 2, mode="process", timeout=120,
                              group_timeout=timedelta(seconds=30)))


def test_persistent_requests_refuse_at_init_and_take_no_number():
    pgs = groups(2, transport="inproc", timeout=timedelta(seconds=30))
    try:
        def body(pg):
            x = np.zeros(8)
            folded = as_strided(np.zeros(1), shape=(4,), strides=(0,))
            cases = [
                (lambda: pg.allreduce_init([x[:4], x[2:6]]), "outputs 0 and 1"),
                (lambda: pg.allgather_into_tensor_init(folded, np.zeros(2)), "written-to"),
                (lambda: pg.reduce_scatter_tensor_init(folded[:2], np.zeros(4)),
                 "written-to"),
            ]
            for make, words in cases:
                with pytest.raises(ValueError, match=words):
                    make()
            assert pg.sequence_number() == 0
            # What the rule handles stays right at every start: the alltoall's output is
            # its input (read from a copy).
            y = np.zeros(4)
            req = pg.alltoall_base_init(y, y)
            for start in range(3):
                y[...] = np.arange(4) + 10 * pg.rank() + start
                req.start()
                req.wait()
                mine = pg.rank() * 2
                expected = np.concatenate([np.arange(4)[mine:mine + 2] + 10 * q + start
                                           for q in range(2)])
                np.testing.assert_array_equal(y, expected)
            return pg.sequence_number()

        assert on_ranks(pgs, body) == [3, 3]
    finally:
        for pg in pgs:
            pg.shutdown()
