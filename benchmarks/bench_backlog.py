"""A backlog of async calls: the time per call must not grow with the backlog.

Each rank (2 processes, the default transport and its shared arena) issues
``N`` small async ``nc.all_reduce`` calls back to back, then waits for all of
them; the row's figure is the wall time of the whole backlog divided by ``N``.
Before issue 23 every arena call walked the calls in flight to find its turn,
so a 20,000-call backlog cost ~5x per call what a 100-call one did; with
:class:`numcoll.work.ArenaOrder`'s tickets it is O(1) per call.

``test_backlog`` times N = 100 and N = 10,000 (one pytest-benchmark row each,
whose rounds are seconds per call); ``test_backlog_stays_linear`` runs both
again, interleaved, and fails when the 10,000-call backlog costs more than
1.5x per call what the 100-call one does (issue 23's target). Every result
is checked against the sum the ranks expect.

Run with ``python -m pytest benchmarks/bench_backlog.py``.
"""

from __future__ import annotations

import statistics
import time

import numpy as np
import pytest

import numcoll as nc
from numcoll.bench.gate import ReplayClock

pytestmark = pytest.mark.timeout(600)

WORLD_SIZE = 2
SMALL, LARGE = 100, 10_000
#: The target of issue 23: per-call time of the large backlog over the small one.
MAX_PER_CALL_RATIO = 1.5
#: Backlogs timed per row; the row's rounds are their per-call times.
ROUNDS = 3
#: The rows' timer: replays the per-call times the ranks measured, so
#: pytest-benchmark's table and saved data are seconds per call, not the
#: launch's wall time.
CLOCK = ReplayClock()


def _backlogs(sizes: list[int]) -> list[float]:
    """On one rank: per-call seconds of each backlog in ``sizes``, results checked."""
    rank, world = nc.get_rank(), nc.get_world_size()
    expected = world * (world - 1) / 2
    per_call = []
    for n in [SMALL] + sizes:  # the first backlog warms up (compiles, maps the arena)
        arrays = [np.full(2, rank, dtype=np.float32) for _ in range(n)]
        nc.barrier()
        start = time.perf_counter()
        works = [nc.all_reduce(a, async_op=True) for a in arrays]
        for w in works:
            w.wait()
        per_call.append((time.perf_counter() - start) / n)
        wrong = sum(1 for a in arrays if not (a == expected).all())
        if wrong:
            raise AssertionError(f"{wrong} of {n} backlog results are wrong on rank {rank}")
        del works, arrays  # freed here, not inside the next backlog's timing
    return per_call[1:]


def _per_call_s(sizes: list[int]) -> list[float]:
    """The slower rank's per-call seconds of each backlog (process ranks)."""
    results = nc.launch(_backlogs, WORLD_SIZE, args=(sizes,), timeout=300)
    return [max(r[i] for r in results) for i in range(len(sizes))]


@pytest.mark.benchmark(timer=CLOCK)
@pytest.mark.parametrize("n", [SMALL, LARGE], ids=lambda n: f"{n}calls")
def test_backlog(benchmark, n):
    per_call = _per_call_s([n] * ROUNDS)
    CLOCK.load(per_call)
    benchmark.pedantic(lambda: None, rounds=ROUNDS)
    benchmark.extra_info.update(op="allreduce", world_size=WORLD_SIZE, nbytes=8, backlog=n,
                                per_call_us=[round(t * 1e6, 1) for t in per_call])


def test_backlog_stays_linear():
    """10,000 calls in flight cost at most 1.5x per call what 100 do."""
    # Interleave the sizes inside one launch (same processes, same load), and
    # take the median of three small backlogs against the large one so one
    # slow 100-call window can't fail the row.
    per_call = _per_call_s([SMALL, LARGE, SMALL, SMALL])
    small = statistics.median([per_call[0], per_call[2], per_call[3]])
    ratio = per_call[1] / small
    print(f"backlog per call: {SMALL} calls {small * 1e6:.1f} us, "
          f"{LARGE} calls {per_call[1] * 1e6:.1f} us, ratio {ratio:.2f}")
    assert ratio <= MAX_PER_CALL_RATIO, (
        f"a {LARGE}-call backlog costs {ratio:.2f}x per call what a {SMALL}-call one does "
        f"({per_call[1] * 1e6:.1f} vs {small * 1e6:.1f} us; limit {MAX_PER_CALL_RATIO}x)")
