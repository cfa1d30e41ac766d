"""The same sweep over mpi4py (Open MPI or any MPI): the anchor numcoll is measured against.

:func:`run_plan_mpi` runs a :class:`~numcoll.bench.sweep.Plan` under
``mpirun -n N`` (ranks are processes of this host) and returns rows in the
format of :func:`~numcoll.bench.runners.run_plan`, so the CLI can print them
beside numcoll's (``--compare mpi4py``). Every rank times each iteration the
same way numcoll's and gloo's ranks do (:func:`~numcoll.bench.runners._time_case`:
warmup, a barrier, then issue + completion per iteration); the row's time is
the median over iterations of the slowest rank.

Command line (mpi4py and ``mpirun`` must be installed; ``pip install mpi4py``
builds against the system MPI, e.g. Debian's ``libopenmpi-dev openmpi-bin``)::

    python -m numcoll.bench.mpi --op allreduce --world-size 2 --sizes 8,1M,16M
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile

import numpy as np

from .report import format_table
from .sweep import OPS, Case, Plan, make_plan, moves_data, parse_nbytes, summarize

__all__ = ["mpi_available", "mpi_rank", "run_plan_mpi", "MpiUnavailableError", "main"]

#: Extra ``mpirun`` arguments: as root, and more ranks than cores, on a small box.
MPIRUN_ARGS = ("--allow-run-as-root", "--oversubscribe")


class MpiUnavailableError(RuntimeError):
    """mpi4py or ``mpirun`` cannot be found."""


def mpi_available() -> bool:
    """Whether mpi4py can be imported (not imported here) and ``mpirun`` is on PATH."""
    return importlib.util.find_spec("mpi4py") is not None and shutil.which("mpirun") is not None


def _mpi_step(MPI, comm, op: str, inp: np.ndarray, out: np.ndarray | None):
    """A callable running one ``op`` over this rank's buffers (blocking MPI calls)."""
    if op == "allreduce":
        return lambda: comm.Allreduce(MPI.IN_PLACE, inp, op=MPI.SUM)
    if op == "broadcast":
        return lambda: comm.Bcast(inp, root=0)
    if op == "reduce":
        if comm.Get_rank() == 0:
            return lambda: comm.Reduce(MPI.IN_PLACE, inp, op=MPI.SUM, root=0)
        return lambda: comm.Reduce(inp, None, op=MPI.SUM, root=0)
    if op == "allgather":
        return lambda: comm.Allgather(inp, out)
    if op == "reduce_scatter":
        return lambda: comm.Reduce_scatter_block(inp, out, op=MPI.SUM)
    if op == "alltoall":
        return lambda: comm.Alltoall(inp, out)
    root = comm.Get_rank() == 0
    if op == "gather":
        return lambda: comm.Gather(inp, out if root else None, root=0)
    if op == "scatter":
        return lambda: comm.Scatter(inp if root else None, out, root=0)
    if op == "barrier":
        return comm.Barrier
    raise ValueError(f"mpi4py anchor: unknown op {op!r}")


def mpi_rank(plan: Plan) -> list[np.ndarray] | None:
    """Run ``plan`` on this MPI rank (inside ``mpirun``); rank 0 returns every
    rank's per-iteration times (``[rank][case]``), the others None."""
    from mpi4py import MPI

    from .forms import mpi_step
    from .runners import _time_case, rank_buffers

    comm = MPI.COMM_WORLD
    if comm.Get_size() != plan.world_size:
        raise RuntimeError(f"plan is for {plan.world_size} ranks, mpirun started {comm.Get_size()}")
    times = []
    for case in plan.cases:
        inp, out = rank_buffers(plan, case, comm.Get_rank())
        # --persistent: MPI-4's persistent form where the library has it.
        step = mpi_step(MPI, comm, plan, inp, out) or _mpi_step(MPI, comm, plan.op, inp, out)
        times.append(_time_case(step, case, comm.Barrier, plan.sync_each_iter))
    gathered = comm.gather(times, root=0)
    return gathered if comm.Get_rank() == 0 else None


def _plan_to_json(plan: Plan) -> str:
    return json.dumps(dataclasses.asdict(plan))


def _plan_from_json(text: str) -> Plan:
    raw = json.loads(text)
    raw["cases"] = tuple(Case(**c) for c in raw["cases"])
    return Plan(**raw)


def run_plan_mpi(plan: Plan, *, timeout_s: float = 900.0,
                 mpirun: str = "mpirun") -> tuple[list[dict], dict]:
    """Run ``plan`` under ``mpirun -n world_size``; return (rows, info) like
    :func:`~numcoll.bench.runners.run_plan` (``backend`` "mpi4py")."""
    if plan.moves_data and plan.dtype in ("float16", "bfloat16"):
        raise ValueError(f"MPI has no SUM for {plan.dtype}: compare with float32")
    if importlib.util.find_spec("mpi4py") is None or shutil.which(mpirun) is None:
        raise MpiUnavailableError(
            "--compare mpi4py needs mpi4py and mpirun (e.g. apt-get install libopenmpi-dev "
            "openmpi-bin; pip install mpi4py)")
    with tempfile.TemporaryDirectory(prefix="numcoll-bench-mpi-") as tmp:
        plan_path, out_path = os.path.join(tmp, "plan.json"), os.path.join(tmp, "times.json")
        with open(plan_path, "w") as f:
            f.write(_plan_to_json(plan))
        env = dict(os.environ)
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
        cmd = [mpirun, *MPIRUN_ARGS, "-n", str(plan.world_size), "-x", "PYTHONPATH",
               sys.executable, "-m", "numcoll.bench.mpi", "--worker", plan_path, out_path]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
        if proc.returncode != 0 or not os.path.exists(out_path):
            raise RuntimeError(f"mpirun failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
        with open(out_path) as f:
            result = json.load(f)
    rank_times = [[np.asarray(t) for t in per_rank] for per_rank in result["times"]]
    rows = summarize(plan, rank_times, backend="mpi4py")
    for row in rows:
        row["algorithm"] = "mpi"
    return rows, {"transport": "mpi", "mpi_version": result["version"],
                  "mpi_persistent": result.get("persistent", False)}


def _worker(plan_path: str, out_path: str) -> None:
    from mpi4py import MPI

    from .forms import mpi_persistent

    with open(plan_path) as f:
        plan = _plan_from_json(f.read())
    gathered = mpi_rank(plan)
    if gathered is not None:
        with open(out_path, "w") as f:
            json.dump({"times": [[t.tolist() for t in per_rank] for per_rank in gathered],
                       "version": MPI.Get_library_version().splitlines()[0].strip(),
                       "persistent": plan.persistent and mpi_persistent(MPI)}, f)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m numcoll.bench.mpi",
                                description="The numcoll-bench sweep over mpi4py (mpirun).")
    p.add_argument("--op", choices=OPS, default="allreduce")
    p.add_argument("--world-size", "-n", type=int, default=2)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--sizes", default=None, help="comma-separated sizes (default 8,1M,16M; "
                   "barrier takes none)")
    p.add_argument("--iters", type=int, default=None)
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--worker", nargs=2, metavar=("PLAN", "OUT"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        _worker(*args.worker)
        return 0
    if not moves_data(args.op) and args.sizes is not None:
        p.error(f"{args.op} moves no data: --sizes does not apply")
    text = (args.sizes or "8,1M,16M") if moves_data(args.op) else ""
    plan = make_plan(args.op, [parse_nbytes(s) for s in text.split(",") if s.strip()],
                     world_size=args.world_size, dtype=args.dtype, iters=args.iters,
                     warmup=args.warmup)
    rows, info = run_plan_mpi(plan)
    print(format_table(rows, title=f"# mpi4py {args.op}, {args.world_size} ranks "
                                   f"({info['mpi_version']})"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
