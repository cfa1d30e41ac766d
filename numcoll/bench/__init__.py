"""nccl-tests-style benchmarks of numcoll's collectives on local ranks, with
torch.distributed's gloo backend alongside when torch is installed.

Command line: ``numcoll-bench`` or ``python -m numcoll.bench`` (``--help``).
From Python (a notebook, a script)::

    from numcoll import bench
    plan = bench.make_plan("allreduce", bench.SWEEPS["latency"].sizes, world_size=2)
    rows, info = bench.run_plan(plan)                    # numcoll, ranks as processes
    torch_rows, _ = bench.run_plan(plan, backend="torch")
    print(bench.format_table(bench.compare_rows(rows, torch_rows)))

``bench.run_plans([plan, ...])`` runs several plans in one launch (a progress
bar shows in a notebook or on a terminal). Or launch the rank function
yourself: ``nc.launch(bench.numcoll_rank, 2, args=(plan,))`` then
``bench.summarize(plan, [r["times"] for r in results])``.
``bench.timeline`` draws the flight recorder's records as a per-rank Gantt chart;
``bench.findings`` turns rows into sentences (crossovers, stragglers, noise);
``bench.saved`` keeps runs for ``numcoll-bench --save/--baseline``.

The regression gate (``python -m pytest benchmarks --quick --benchmark-compare``):
``bench.rows`` (what it times), ``bench.schedule`` (interleaved, quiet rounds on
rank processes kept between rounds), ``bench.gate`` (the limits, and saved runs
for ``notebooks/history.ipynb``). Faults: ``python -m numcoll.faults``
(``bench.faults``, ``bench.fault_table``).
"""

from .check import count_wrong, expected, fill
from .cli import main
from .report import compare_rows, format_table
from .runners import (
    DEFAULT_TIMEOUT_S,
    TorchUnavailableError,
    numcoll_issue,
    numcoll_rank,
    numcoll_step,
    rank_buffers,
    run_plan,
    run_plans,
    torch_available,
    torch_rank,
    torch_version,
)
from .sweep import (
    OPS,
    PLACEMENTS,
    SWEEPS,
    Case,
    Plan,
    algorithm_name,
    bus_factor,
    format_nbytes,
    make_plan,
    metadata,
    moves_data,
    parse_nbytes,
    sizes_between,
    summarize,
    write_json,
)

__all__ = [
    "main", "OPS", "PLACEMENTS", "SWEEPS", "fill", "expected", "count_wrong", "run_plans",
    "Case", "Plan", "algorithm_name", "bus_factor", "parse_nbytes", "format_nbytes",
    "sizes_between", "make_plan", "moves_data", "summarize", "compare_rows", "format_table",
    "metadata", "write_json", "rank_buffers", "numcoll_issue", "numcoll_step", "numcoll_rank",
    "torch_rank", "run_plan", "torch_available", "torch_version", "TorchUnavailableError",
    "DEFAULT_TIMEOUT_S",
]
