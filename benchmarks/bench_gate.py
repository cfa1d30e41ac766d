"""The regression gate: numcoll's default paths, timed in interleaved rounds.

``python -m pytest benchmarks --quick --benchmark-autosave`` saves a baseline;
``python -m pytest benchmarks --quick --benchmark-compare`` runs these rows
again and fails the ones that regressed (limits: :mod:`numcoll.bench.gate`;
how they are timed: :mod:`numcoll.bench.schedule`; the rows:
:func:`numcoll.bench.rows.default_rows`).

* every collective (allreduce, broadcast, reduce, allgather, reduce_scatter,
  alltoall, barrier) on 2 and 4 ranks that are processes, with the transport
  and algorithm numcoll chooses (``shm`` and its shared arena on Linux),
  called as users call it (``nc.all_reduce(x)``), at 8 B and 1 MiB (16 MiB too
  without ``--quick``);
* a Reducer step (24 gradients, 4 buckets) on 2 and 4 ranks;
* the reduction kernel (float32, float16) and the pack kernels in this process;
* persistent collectives and shared arrays (issue 19): ``nc.all_reduce_init``
  started and waited for, ``nc.all_reduce`` on an ``nc.zeros_shared`` array;
* device rows, where a CUDA GPU is (skipped, with the reason, elsewhere):
  allreduce on device arrays at 2 ranks, as chosen (``ipc``) and staged;
* references, never judged: a memcpy, NumPy's add, a Python loop and a socket
  ping-pong with a rank process, which tell how fast the machine is right now.

Each row records in ``extra_info`` what it ran (op, world size, bytes, the
transport and the algorithm the flight recorder saw), the ``NUMCOLL_*``
settings and versions, and under ``"gate"`` its figures: best round, median
round, noise, every round, the load average, and against a baseline its ratio
and limit.
"""

import os

import pytest

from numcoll.bench.rows import default_rows

pytestmark = pytest.mark.timeout(600)

QUICK = os.environ.get("NUMCOLL_BENCH_QUICK", "0") not in ("", "0")
ROWS = default_rows(quick=QUICK)


@pytest.mark.gate
@pytest.mark.parametrize("row", ROWS, ids=[row.id for row in ROWS])
def test_row(benchmark, gate, row):
    gate.report(benchmark, row)
