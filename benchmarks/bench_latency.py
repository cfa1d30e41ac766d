"""Collectives between two ranks that are processes, over ``shm`` (its shared arena), for
pytest-benchmark: 8-byte barrier, broadcast and allreduce, and a 1 MiB allreduce.

Run with ``python -m pytest benchmarks/bench_latency.py``. This is the small-message
end of ``numcoll-bench --sweep latency`` as a regression suite: the same call
(:func:`numcoll.bench.numcoll_step`: ``nc.barrier()``, ``nc.broadcast(x, src=0)``,
the module-level blocking functions on the default group) between this process
and one spawned peer, so both ranks poll at once as real ranks do (the
ProcessGroups of ``bench_collectives.py`` share one process and its GIL).

This process is rank 1 and times; the peer is rank 0, the broadcast root.
Before each benchmark rank 1 tells the peer which collective to run and how
many times (an int64 broadcast from rank 1, untimed), so the benchmark uses
``benchmark.pedantic`` with a fixed number of rounds: 2000 (100 warmup), or
50 (5 warmup) in quick mode. A broadcast round is preceded by an untimed
barrier (pedantic's ``setup``): the root's sends complete without waiting for
the receiver, so without it the root could run ahead and the receiver would
time messages already there; with it, a round is the time from leaving the
barrier to holding the root's data. A barrier round needs no such sync.
"""

import multiprocessing
import os
import shutil
import tempfile
from datetime import timedelta

import numpy as np
import pytest

import numcoll as nc
from numcoll.bench import OPS, make_plan, moves_data, numcoll_step, rank_buffers
from numcoll.bench.sweep import algorithm_name

pytestmark = pytest.mark.timeout(300)

QUICK = os.environ.get("NUMCOLL_BENCH_QUICK", "0") not in ("", "0")
ROUNDS, WARMUP_ROUNDS = (50, 5) if QUICK else (2000, 100)
TRANSPORT = "shm"
#: Deadline of the peer's start, of every collective and of the peer's exit, in seconds.
WAIT_S = 60.0
#: (op, untimed barrier before each round, bytes): the 8-byte latency of the arena,
#: and one bandwidth-bound allreduce (a round of a whole 1 MiB slot).
CASES = [("barrier", False, 0), ("broadcast", True, 8), ("allreduce", False, 8),
         ("allreduce", False, 1 << 20)]


def _plan(op: str, nbytes: int):
    return make_plan(op, [nbytes] if moves_data(op) else [], world_size=2)


def _serve(store_path: str) -> None:
    """Rank 0, in the spawned peer: run what rank 1 announces until it says stop
    (a count of 0)."""
    nc.init_process_group(store=nc.FileStore(store_path, 2), rank=0, world_size=2,
                          transport=TRANSPORT, timeout=timedelta(seconds=WAIT_S))
    try:
        control = np.zeros(4, np.int64)
        while True:
            nc.broadcast(control, src=1)
            op_index, count, sync, nbytes = (int(v) for v in control)
            if count == 0:
                return
            plan = _plan(OPS[op_index], nbytes)
            step = numcoll_step(plan, *rank_buffers(plan, plan.cases[0], 0))
            for _ in range(count):
                if sync:
                    nc.barrier()
                step()
    finally:
        nc.destroy_process_group()


class _Lockstep:
    """Rank 1's end: announces each benchmark's collectives to the peer and
    counts its own, so the two ranks always run the same number whatever
    pytest-benchmark does (``--benchmark-disable`` makes one call, profiling
    one more than the rounds): calls beyond the announcement announce one
    more, and :meth:`finish` runs those announced but not made."""

    def __init__(self):
        self._control = np.zeros(4, np.int64)
        self._op_index, self._sync, self._nbytes, self._step = 0, False, 0, None
        self._left, self._ready = 0, False

    def start(self, op: str, sync: bool, nbytes: int, count: int) -> None:
        plan = _plan(op, nbytes)
        self._op_index, self._sync, self._nbytes = OPS.index(op), sync, nbytes
        self._step = numcoll_step(plan, *rank_buffers(plan, plan.cases[0], 1))
        self._announce(count)

    def _announce(self, count: int) -> None:
        self._control[:] = (self._op_index, count, self._sync, self._nbytes)
        nc.broadcast(self._control, src=1)
        self._left = count

    def setup(self) -> None:
        """Untimed, before each round: the barrier that lines the ranks up."""
        if self._left == 0:
            self._announce(1)
        if self._sync:
            nc.barrier()
        self._ready = True

    def round(self) -> None:
        """Timed: one collective."""
        if not self._ready:  # called without setup (pytest-benchmark's profiling run)
            self.setup()
        self._ready = False
        self._left -= 1
        self._step()

    def finish(self) -> None:
        while self._left:
            self.setup()
            self.round()

    def stop(self) -> None:
        self._announce(0)


@pytest.fixture(scope="module")
def lockstep():
    """This process as rank 1 of a default group over ``shm``, the spawned peer as rank 0."""
    root = tempfile.mkdtemp(prefix="numcoll-bench-latency-")
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
    op, _, nbytes = case
    return op if not nbytes else f"{op}-{nbytes >> 20}MiB" if nbytes >= 1 << 20 else f"{op}-{nbytes}B"


@pytest.mark.slow
@pytest.mark.parametrize("op, sync, nbytes", CASES, ids=[_case_id(c) for c in CASES])
def test_process_ranks(benchmark, lockstep, op, sync, nbytes):
    plan = _plan(op, nbytes)
    benchmark.group = f"2 process ranks over {TRANSPORT}, {plan.cases[0].nbytes} B"
    benchmark.extra_info.update(op=op, world_size=2, transport=TRANSPORT, ranks="processes",
                                nbytes=plan.cases[0].nbytes, call="module-level blocking",
                                algorithm=algorithm_name(plan, plan.cases[0],
                                                         nc.get_default_group().context.cfg),
                                sync_each_round=sync, timed_rank=1)
    lockstep.start(op, sync, nbytes, WARMUP_ROUNDS + ROUNDS)
    try:
        benchmark.pedantic(lockstep.round, setup=lockstep.setup, rounds=ROUNDS,
                           warmup_rounds=WARMUP_ROUNDS)
    finally:
        lockstep.finish()  # the peer runs what was announced, or the next start would mismatch
