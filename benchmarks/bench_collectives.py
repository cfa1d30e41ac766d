"""Collectives on N ProcessGroups of one process, for pytest-benchmark.

Run with ``python -m pytest benchmarks/bench_collectives.py`` (add
``-k "ipc and allreduce"`` to narrow it, ``--benchmark-json out.json`` to keep
the numbers). ``NUMCOLL_BENCH_MAX_NBYTES`` caps the size (default 16 MiB), so
CI can run the suite tiny, e.g. ``NUMCOLL_BENCH_MAX_NBYTES=4096``.

The N ranks are N ProcessGroups built over one HashStore in this process (over
the inproc, ipc or tcp transport). One benchmarked round issues the
collective on every group (calls return at once: the groups' worker threads
run it) and then waits for every Work, so a round is one complete collective.
All ranks share this process's cores and GIL, so these numbers track
regressions; for numbers comparable with torch's gloo use ``numcoll-bench``
(ranks as processes).

Sizes follow nccl-tests (see :mod:`numcoll.bench`): ``nbytes`` is the
per-rank buffer (allgather: the output; reduce_scatter: the input). Each case
records ``op``, ``algorithm``, ``world_size``, ``transport``, ``nbytes``,
``count``, ``dtype`` in ``extra_info`` and, when timings were taken (not with
``--benchmark-disable``), ``algbw_gbps`` and ``busbw_gbps`` from the median;
the table shows busbw after each name (see ``conftest.py``).

Quick mode (``--quick`` or ``NUMCOLL_BENCH_QUICK=1``): 8 B and 1 MiB, the
inproc and ipc transports, 2 ranks.
"""

import os
import threading
from datetime import timedelta

import pytest

import numcoll as nc
from numcoll.bench import (
    algorithm_name,
    bus_factor,
    format_nbytes,
    make_plan,
    numcoll_issue,
    rank_buffers,
)

pytestmark = pytest.mark.timeout(300)

QUICK = os.environ.get("NUMCOLL_BENCH_QUICK", "0") not in ("", "0")
MAX_NBYTES = int(os.environ.get("NUMCOLL_BENCH_MAX_NBYTES",
                                str(1 << 20 if QUICK else 16 << 20)), 0)
SIZES_NBYTES = sorted({n for n in ((8, 1 << 20) if QUICK else (8, 64 << 10, 1 << 20, 16 << 20))
                       if n <= MAX_NBYTES} | {MAX_NBYTES})
OPS = [  # (op, forced algorithm)
    ("allreduce", "ring"),
    ("allreduce", "recursive_doubling"),
    ("allgather", None),
    ("reduce_scatter", None),
    ("broadcast", "chain"),
    ("broadcast", "binomial"),
]
TRANSPORTS = ["inproc", "ipc"] if QUICK else ["inproc", "ipc", "tcp"]
WORLD_SIZES = [2] if QUICK else [2, 4]
DTYPE = "float32"
#: Deadline of every collective and of group construction, in seconds.
TIMEOUT_S = 120


def _size_id(nbytes: int) -> str:
    return format_nbytes(nbytes).replace(" ", "")  # "64KiB": easy to select with -k


def _make_groups(transport: str, world_size: int) -> list[nc.ProcessGroup]:
    """world_size groups over one store, built concurrently (each constructor
    waits for its peers' addresses)."""
    store = nc.HashStore(timeout=TIMEOUT_S)
    groups, errors = [None] * world_size, []

    def make(rank):
        try:
            options = nc.ProcessGroup.Options(transport=transport,
                                              timeout=timedelta(seconds=TIMEOUT_S))
            groups[rank] = nc.ProcessGroup(store, rank, world_size, options)
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors.append(exc)

    threads = [threading.Thread(target=make, args=(r,)) for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT_S)
    if errors or any(g is None for g in groups):
        for g in groups:
            if g is not None:
                g.shutdown()
        raise RuntimeError(f"could not build {world_size} {transport} groups: {errors}")
    return groups


@pytest.fixture(scope="module")
def group_pool():
    """Groups per (transport, world_size), built on first use and shut down
    when the module's benchmarks are done."""
    pool: dict[tuple[str, int], list[nc.ProcessGroup]] = {}

    def get(transport: str, world_size: int) -> list[nc.ProcessGroup]:
        key = (transport, world_size)
        if key not in pool:
            pool[key] = _make_groups(transport, world_size)
        return pool[key]

    yield get
    for groups in pool.values():
        for g in groups:
            g.shutdown()


def _record_bandwidth(benchmark, nbytes: int, factor: float) -> None:
    stats = getattr(benchmark, "stats", None)  # None with --benchmark-disable
    median_s = getattr(getattr(stats, "stats", None), "median", None)
    if median_s:
        algbw = nbytes / median_s / 1e9
        benchmark.extra_info.update(algbw_gbps=algbw, busbw_gbps=algbw * factor)


@pytest.mark.parametrize("nbytes", SIZES_NBYTES, ids=_size_id)
@pytest.mark.parametrize("world_size", WORLD_SIZES, ids=lambda n: f"n{n}")
@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("op, algorithm", OPS, ids=[f"{op}-{alg}" if alg else op
                                                    for op, alg in OPS])
def test_collective(benchmark, group_pool, op, algorithm, transport, world_size, nbytes):
    groups = group_pool(transport, world_size)
    plan = make_plan(op, [nbytes], world_size=world_size, dtype=DTYPE, algorithm=algorithm)
    case = plan.cases[0]
    issues = [numcoll_issue(pg, plan, *rank_buffers(plan, case, pg.rank())) for pg in groups]

    def one_round():
        works = [issue() for issue in issues]
        for work in works:
            work.wait()

    benchmark.group = f"{op} n={world_size} {format_nbytes(case.nbytes)}"
    benchmark.extra_info.update(op=op, algorithm=algorithm_name(plan, case),
                                world_size=world_size, transport=transport,
                                nbytes=case.nbytes, count=case.count, dtype=DTYPE,
                                round_nbytes=case.nbytes,
                                bus_factor=bus_factor(op, world_size))
    one_round()  # first use of a size: kernels compiled, buffers touched
    benchmark(one_round)
    _record_bandwidth(benchmark, case.nbytes, bus_factor(op, world_size))
