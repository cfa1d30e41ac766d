"""nccl-tests-style benchmarks of numcoll's collectives on local ranks, with
torch.distributed's gloo backend alongside when torch is installed.

Command line: ``numcoll-bench`` or ``python -m numcoll.bench`` (``--help``).
From Python (a notebook, a script)::

    from numcoll import bench
    plan = bench.make_plan("allreduce", bench.sizes_between(8, 64 << 20), world_size=2)
    rows, info = bench.run_plan(plan)                    # numcoll, ranks as processes
    torch_rows, _ = bench.run_plan(plan, backend="torch")
    print(bench.format_table(bench.compare_rows(rows, torch_rows)))

or launch the rank function yourself: ``nc.launch(bench.numcoll_rank, 2,
args=(plan,))`` then ``bench.summarize(plan, [r["times"] for r in results])``.
"""

from .cli import main
from .runners import (
    DEFAULT_TIMEOUT_S,
    TorchUnavailableError,
    numcoll_issue,
    numcoll_rank,
    rank_buffers,
    run_plan,
    torch_available,
    torch_rank,
    torch_version,
)
from .sweep import (
    OPS,
    Case,
    Plan,
    algorithm_name,
    bus_factor,
    compare_rows,
    format_nbytes,
    format_table,
    make_plan,
    metadata,
    parse_nbytes,
    sizes_between,
    summarize,
    write_json,
)

__all__ = [
    "main", "OPS", "Case", "Plan", "algorithm_name", "bus_factor", "parse_nbytes", "format_nbytes",
    "sizes_between", "make_plan", "summarize", "compare_rows", "format_table", "metadata",
    "write_json", "rank_buffers", "numcoll_issue", "numcoll_rank", "torch_rank", "run_plan",
    "torch_available", "torch_version", "TorchUnavailableError", "DEFAULT_TIMEOUT_S",
]
