"""The single-copy allreduce's reduce-scatter in one compiled call
(``transports.shm.single_copy_steps.read_sum``): it reads the peers' pieces
and adds them where a Python loop did, with the same bits; it stops at a read
that fails, and the step-by-step loop goes on from that piece; it is taken
only where the reduction is a plain sum."""

import ctypes
import mmap
import os
from datetime import timedelta

import numpy as np
import pytest

import numcoll as nc
from numcoll.kernels.cpu import compile_op
from transports.shm import single_copy_steps

from test_process_group import groups, on_ranks

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif("not __import__('transports').shm_available()")]

#: A pid no process has (above any pid_max): a copy from it fails (ESRCH).
NO_SUCH_PID = 1 << 30


def _readable_self() -> bool:
    """Whether this process may read itself with process_vm_readv."""
    here, there = np.zeros(8, np.uint8), np.arange(8, dtype=np.uint8)
    got = single_copy_steps.read_sum(np.array([os.getpid()], np.int64), np.zeros(1, np.int64),
                                     np.array([there.ctypes.data], np.int64), here,
                                     np.zeros(8, np.uint8), 8, 0)
    return got == 8 and np.array_equal(here, there)


def test_read_sum_adds_every_peer_piece_by_piece_in_order():
    """Two "peers" (this process, two arrays): every element is the sum in
    peer order, from ``start`` on; the elements before ``start`` untouched."""
    if not _readable_self():
        pytest.skip("this process may not read itself (process_vm_readv)")
    rng = np.random.default_rng(3)
    a, b = (rng.standard_normal(1001).astype(np.float32) for _ in range(2))
    mine = rng.standard_normal(1001).astype(np.float32)
    want = mine.copy()
    want[100:] = (want[100:] + a[100:]) + b[100:]  # (float32 throughout: the order's bits)
    got = single_copy_steps.read_sum(
        np.full(2, os.getpid(), np.int64), np.array([0, 1], np.int64),
        np.array([a.ctypes.data, b.ctypes.data], np.int64), mine,
        np.zeros(2 * 64, np.float32), 64, 100)
    assert got == 1001
    assert np.array_equal(mine, want)


def test_read_sum_stops_at_a_read_that_fails_and_says_where():
    """A peer's range that ends in a page nobody may read (PROT_NONE): the
    pieces before it are summed, the one it falls in and after it are not,
    and the answer is that piece's first element."""
    if not _readable_self():
        pytest.skip("this process may not read itself (process_vm_readv)")
    page = mmap.PAGESIZE
    region = mmap.mmap(-1, 2 * page)
    theirs = np.frombuffer(region, np.float64)
    theirs[:] = 1.0
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.mprotect(ctypes.c_void_p(theirs.ctypes.data + page), page, 0) == 0
    try:
        n, piece = 2 * page // 8, page // 8 // 2  # (the second page starts the third piece)
        mine = np.zeros(n)
        got = single_copy_steps.read_sum(np.array([os.getpid()], np.int64),
                                         np.zeros(1, np.int64),
                                         np.array([theirs.ctypes.data], np.int64), mine,
                                         np.zeros(piece), piece, 0)
        assert got == 2 * piece
        assert (mine[:got] == 1.0).all() and (mine[got:] == 0.0).all()
    finally:
        libc.mprotect(ctypes.c_void_p(theirs.ctypes.data + page), page, 3)  # (read, write)
        del theirs
        region.close()


def test_only_a_plain_sum_is_summed_in_compiled_code():
    """SUM and AVG (before its division) of ints, floats and complex; not
    MIN, not 16-bit floats (widened elsewhere), not bool."""
    assert compile_op(nc.ReduceOp.SUM, np.float32).plain_sum
    assert compile_op(nc.ReduceOp.AVG, np.float64).plain_sum
    assert compile_op(nc.ReduceOp.SUM, np.int32).plain_sum
    assert compile_op(nc.ReduceOp.SUM, np.complex64).plain_sum
    assert not compile_op(nc.ReduceOp.MIN, np.float32).plain_sum
    assert not compile_op(nc.ReduceOp.PRODUCT, np.float32).plain_sum
    assert not compile_op(nc.ReduceOp.SUM, np.float16).plain_sum
    assert not compile_op(nc.ReduceOp.SUM, np.bool_).plain_sum


def _allreduce_calls(monkeypatch, op, dtype, pid_words=None):
    """A forced-``cma`` allreduce of random values on 3 shm ranks, 2-element
    pieces: each rank's result, and how many of its pieces the compiled call
    summed (None: not called)."""
    from numcoll.algorithms import single_copy_reduce

    monkeypatch.setenv("NUMCOLL_ARENA_SLOT_NBYTES", "4096")
    monkeypatch.setattr(single_copy_reduce, "_PIECE_NBYTES", 2 * np.dtype(dtype).itemsize)
    summed = []
    real = single_copy_steps.read_sum

    def counted(*args):
        got = real(*args)
        summed.append(got)
        return got

    monkeypatch.setattr(single_copy_steps, "read_sum", counted)
    pgs = groups(3, transport="shm", timeout=timedelta(seconds=30))
    try:
        def body(pg):
            if pid_words is not None:
                pg._transport.single_copy._pid_words[:] = pid_words
            x = np.random.default_rng(pg.rank()).standard_normal(301).astype(dtype)
            pg.allreduce([x], nc.AllreduceOptions(reduce_op=op, algorithm="cma")).wait()
            return x

        return on_ranks(pgs, body), summed
    finally:
        for pg in pgs:
            pg.shutdown()


def _want(op, dtype):
    """The single-copy allreduce's bits: each chunk reduced by its owner, its
    own part first, then the peers' in rank order."""
    from numcoll.algorithms.partition import chunk_bounds

    xs = [np.random.default_rng(q).standard_normal(301).astype(dtype) for q in range(3)]
    want = np.empty(301, dtype)
    for r, (first, n) in enumerate(chunk_bounds(301, 3)):
        acc = xs[r][first:first + n].copy()
        for q in range(3):
            if q != r:
                x = xs[q][first:first + n]
                acc = np.minimum(acc, x) if op == nc.ReduceOp.MIN else acc + x
        want[first:first + n] = acc
    return want


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_the_allreduce_sums_in_compiled_code_with_the_same_bits(monkeypatch, dtype):
    results, summed = _allreduce_calls(monkeypatch, nc.ReduceOp.SUM, dtype)
    for x in results:
        assert np.array_equal(x, _want(nc.ReduceOp.SUM, dtype))
    assert sorted(summed) == [100, 100, 101]  # (every rank's whole chunk: 101 + 100 + 100)


def test_a_compiled_read_that_fails_is_made_again_step_by_step(monkeypatch):
    """The compiled reads fail (no such pid): the step-by-step loop reads
    every piece with the real pid, results right, nothing refused."""
    results, summed = _allreduce_calls(monkeypatch, nc.ReduceOp.SUM, np.float32,
                                       pid_words=NO_SUCH_PID)
    for x in results:
        assert np.array_equal(x, _want(nc.ReduceOp.SUM, np.float32))
    assert summed == [0, 0, 0]


def test_other_reductions_keep_the_step_by_step_loop(monkeypatch):
    results, summed = _allreduce_calls(monkeypatch, nc.ReduceOp.MIN, np.float32)
    for x in results:
        assert np.array_equal(x, _want(nc.ReduceOp.MIN, np.float32))
    assert summed == []
