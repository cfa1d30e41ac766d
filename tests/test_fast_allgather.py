"""A repeated small all_gather_into_tensor runs as one fused arena step
(numcoll.fast), with the results, fallbacks and errors of the ordinary path."""

from __future__ import annotations

from datetime import timedelta

import ml_dtypes
import numpy as np
import pytest

import numcoll as nc

from test_fast_path import close, fused_runs
from test_process_group import groups, on_ranks

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif("not __import__('transports').shm_available()")]


def chunk(rank, i, n, dtype):
    return ((np.arange(n) % 5) + 7 * rank + i).astype(dtype)


@pytest.mark.parametrize("size", [2, 3, 5])
@pytest.mark.parametrize("dtype", [np.float32, np.int64, np.float16, ml_dtypes.bfloat16,
                                   np.bool_, np.complex64])
def test_a_repeated_all_gather_into_tensor_runs_fused_and_agrees(size, dtype):
    pgs = groups(size, transport="shm", timeout=timedelta(seconds=30))
    n, calls = 3, 5
    try:
        def body(pg):
            inp = np.zeros(n, dtype)
            out = np.zeros((size, n), dtype)
            got = []
            for i in range(calls):
                inp[...] = chunk(pg.rank(), i, n, dtype)
                assert nc.all_gather_into_tensor(out, inp, group=pg) is None
                got.append(out.copy())
            return got, fused_runs(pg), pg.sequence_number()

        for got, fused, seq in on_ranks(pgs, body):
            for i in range(calls):
                expected = np.stack([chunk(r, i, n, dtype) for r in range(size)])
                np.testing.assert_array_equal(got[i], expected)
            assert seq == calls
            assert fused == calls - 2  # seen, learnt, then fused
    finally:
        close(pgs)


def test_the_in_place_form_and_any_change_fall_back_or_agree():
    """torch's in-place form (the input is this rank's chunk of the output)
    runs fused; another input object, a reshaped output, another dtype take
    the ordinary path with its result; the unchanged call after them is fused."""
    pgs = groups(2, transport="shm", timeout=timedelta(seconds=30))
    try:
        def body(pg):
            r = pg.rank()
            out = np.zeros(4, np.float32)
            mine = out[2 * r:2 * r + 2]
            log = []

            def call(o, i, expect, fused):
                before = fused_runs(pg)
                nc.all_gather_into_tensor(o, i, group=pg)
                np.testing.assert_array_equal(o.reshape(-1), expect)
                log.append(fused_runs(pg) - before == int(fused))

            both = np.array([1, 1, 2, 2], np.float32)
            for fused in (False, False, True, True):
                out[...] = 0
                mine[...] = r + 1
                call(out, mine, both, fused)
            other = np.full(2, r + 1, np.float32)  # another input object
            call(out, other, both, False)
            out.shape = (2, 2)  # the same output, reshaped in place
            call(out, mine.copy(), both, False)
            out.shape = (4,)
            ints = np.full(2, r + 1, np.int32)  # another dtype
            got = np.zeros(4, np.int32)
            nc.all_gather_into_tensor(got, ints, group=pg)
            np.testing.assert_array_equal(got, [1, 1, 2, 2])
            out[...] = 0
            mine[...] = r + 1
            call(out, mine, both, True)
            return log, pg.sequence_number()

        for log, seq in on_ranks(pgs, body):
            assert all(log), [i for i, ok in enumerate(log) if not ok]
            assert seq == 8
    finally:
        close(pgs)


def test_a_fused_allgather_against_an_allreduce_is_a_mismatch():
    pgs = groups(2, transport="shm", timeout=timedelta(seconds=20))
    try:
        def body(pg):
            inp, out = np.ones(2, np.float32), np.zeros(4, np.float32)
            for _ in range(3):
                nc.all_gather_into_tensor(out, inp, group=pg)
            if pg.rank() == 0:
                nc.all_gather_into_tensor(out, inp, group=pg)  # fused: 8 bytes published
            else:
                nc.all_reduce(np.ones(2, np.float32), group=pg)  # 8 bytes too

        with pytest.raises(nc.CollectiveMismatchError, match="Detected mismatch"):
            on_ranks(pgs, body)
    finally:
        close(pgs)
