"""Persistent collectives and shared arrays between two ranks that are processes,
over ``shm``, for pytest-benchmark: the allreduce of ``numcoll-bench --persistent``
and ``--shared-arrays``, each beside the ordinary blocking call on the same sizes.

Run with ``python -m pytest benchmarks/bench_persistent.py``. Rows (2000 rounds, 100
warmup; 50 and 5 in quick mode):

* 8 B: ``nc.all_reduce(x)`` (blocking) against ``req.start(); req.wait()`` of
  ``nc.all_reduce_init(x)`` (persistent: one arena step, published at start);
* 1 MiB and 16 MiB: a plain array against a shared one (``nc.empty_shared``:
  the ranks read each other's arrays in place), and the persistent request on
  the shared array.

The calls are :mod:`numcoll.bench.forms`' (the same as ``numcoll-bench``'s).
This process is rank 1 and times; a spawned peer is rank 0. Before each
benchmark rank 1 tells the peer which case to run and how many times (an
int64 broadcast, untimed); each rank makes its buffers and request then
(allocating a shared array is collective), so ``benchmark.pedantic`` runs a
fixed number of rounds.
"""

import multiprocessing
import os
import shutil
import tempfile
from datetime import timedelta

import numpy as np
import pytest

import numcoll as nc
from numcoll.bench import bus_factor, make_plan
from numcoll.bench.forms import algorithm, numcoll_buffers, numcoll_form_step

pytestmark = pytest.mark.timeout(600)

QUICK = os.environ.get("NUMCOLL_BENCH_QUICK", "0") not in ("", "0")
ROUNDS, WARMUP_ROUNDS = (50, 5) if QUICK else (2000, 100)
LARGE_ROUNDS = (5, 1) if QUICK else (100, 10)
TRANSPORT = "shm"
WAIT_S = 120.0
#: (bytes, persistent, shared arrays)
CASES = [(8, False, False), (8, True, False),
         (1 << 20, False, False), (1 << 20, False, True), (1 << 20, True, True),
         (16 << 20, False, False), (16 << 20, False, True)]
if QUICK:
    CASES = [c for c in CASES if c[0] != 16 << 20]


def _plan(case_index: int):
    nbytes, persistent, shared = CASES[case_index]
    return make_plan("allreduce", [nbytes], world_size=2, persistent=persistent,
                     shared_arrays=shared, check=False)


def _step(case_index: int, rank: int):
    plan = _plan(case_index)
    inp, out = numcoll_buffers(plan, plan.cases[0], rank)
    inp[...] = rank + 1
    return numcoll_form_step(plan, inp, out)


def _serve(store_path: str) -> None:
    """Rank 0, in the spawned peer: run what rank 1 announces until a count of 0."""
    nc.init_process_group(store=nc.FileStore(store_path, 2), rank=0, world_size=2,
                          transport=TRANSPORT, timeout=timedelta(seconds=WAIT_S))
    try:
        control = np.zeros(2, np.int64)
        step, current = None, -1
        while True:
            nc.broadcast(control, src=1)
            case_index, count = (int(v) for v in control)
            if count == 0:
                return
            if case_index != current:
                step, current = _step(case_index, 0), case_index
            for _ in range(count):
                step()
    finally:
        nc.destroy_process_group()


class _Lockstep:
    """Rank 1's end: announces each benchmark's calls, counts its own, and runs
    whatever was announced but not made (pytest-benchmark's profiling run and
    ``--benchmark-disable`` make other numbers of calls)."""

    def __init__(self):
        self._control = np.zeros(2, np.int64)
        self._case, self._step, self._left = -1, None, 0

    def start(self, case_index: int, count: int) -> None:
        self._announce(case_index, count)
        if case_index != self._case:
            self._step, self._case = _step(case_index, 1), case_index

    def _announce(self, case_index: int, count: int) -> None:
        self._control[:] = (case_index, count)
        nc.broadcast(self._control, src=1)
        self._left = count

    def round(self) -> None:
        if self._left == 0:
            self._announce(self._case, 1)
        self._left -= 1
        self._step()

    def finish(self) -> None:
        while self._left:
            self.round()

    def stop(self) -> None:
        self._announce(0, 0)


@pytest.fixture(scope="module")
def lockstep():
    root = tempfile.mkdtemp(prefix="numcoll-bench-persistent-")
    store_path = os.path.join(root, "store")
    child = multiprocessing.get_context("spawn").Process(target=_serve, args=(store_path,),
                                                         daemon=True)
    child.start()
    try:
        nc.init_process_group(store=nc.FileStore(store_path, 2), rank=1, world_size=2,
                              transport=TRANSPORT, timeout=timedelta(seconds=WAIT_S))
        try:
            ends = _Lockstep()
            yield ends
            ends.stop()
        finally:
            nc.destroy_process_group()
        child.join(WAIT_S)
    finally:
        if child.is_alive():
            child.terminate()
            child.join(WAIT_S)
        shutil.rmtree(root, ignore_errors=True)


def _case_id(case) -> str:
    nbytes, persistent, shared = case
    size = f"{nbytes >> 20}MiB" if nbytes >= 1 << 20 else f"{nbytes}B"
    form = "-".join(w for w, on in (("persistent", persistent), ("shared", shared)) if on)
    return f"allreduce-{size}-{form or 'blocking'}"


@pytest.mark.slow
@pytest.mark.parametrize("case_index", range(len(CASES)), ids=[_case_id(c) for c in CASES])
def test_process_ranks(benchmark, lockstep, case_index):
    plan = _plan(case_index)
    case = plan.cases[0]
    rounds, warmup = (ROUNDS, WARMUP_ROUNDS) if case.nbytes < 1 << 20 else LARGE_ROUNDS
    benchmark.group = f"2 process ranks over {TRANSPORT}, allreduce {case.nbytes} B"
    benchmark.extra_info.update(
        op="allreduce", world_size=2, transport=TRANSPORT, ranks="processes",
        nbytes=case.nbytes, persistent=plan.persistent, shared_arrays=plan.shared_arrays,
        algorithm=algorithm(plan, case, nc.get_default_group().context), timed_rank=1,
        round_nbytes=case.nbytes, bus_factor=bus_factor("allreduce", 2))
    lockstep.start(case_index, warmup + rounds)
    try:
        benchmark.pedantic(lockstep.round, rounds=rounds, warmup_rounds=warmup)
    finally:
        lockstep.finish()
