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

__all__ = ["mpi_available", "mpi_rank", "paired_rank", "run_plan_mpi", "run_plans_paired",
           "MpiUnavailableError", "main"]

#: Extra ``mpirun`` arguments: as root, and more ranks than cores, on a small box.
MPIRUN_ARGS = ("--allow-run-as-root", "--oversubscribe")
#: Paired runs (:func:`run_plans_paired`) split each case's iterations into
#: this many rounds per backend, alternated (each round ceil(iters / 4)).
PAIRED_ROUNDS = 4
#: ... under ``mpirun`` with these arguments besides MPIRUN_ARGS: each rank
#: binds its main thread itself (see :func:`paired_rank`).
PAIRED_MPIRUN_ARGS = ("--bind-to", "none")


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


def paired_rank(plan: Plan, store_path: str) -> dict | None:
    """Run ``plan`` for numcoll *and* MPI on this MPI rank (inside ``mpirun``),
    case by case, in :data:`PAIRED_ROUNDS` alternating rounds each, so both
    are timed in the same processes under the same conditions (see
    :func:`run_plans_paired`). numcoll's default group meets through a file
    store at ``store_path``. Rank 0 returns ``{"numcoll": [rank][case] times,
    "mpi": the same, "wrong": [rank][case], "algorithms": [case],
    "transport": numcoll's}``, the others None."""
    from mpi4py import MPI

    import numcoll as nc

    from .check import check_case
    from .forms import algorithm, bind_to_core, mpi_step, numcoll_buffers, numcoll_form_step
    from .runners import _time_case, rank_buffers

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    if comm.Get_size() != plan.world_size:
        raise RuntimeError(f"plan is for {plan.world_size} ranks, mpirun started {comm.Get_size()}")
    nc.init_process_group(init_method=f"file://{store_path}", rank=rank,
                          world_size=plan.world_size)
    # mpirun started this process unbound (PAIRED_MPIRUN_ARGS): bind its main
    # thread only, now that numcoll's I/O threads run, as numcoll's own
    # bench binds its ranks -- bound with the whole process to one core,
    # numcoll's helper threads share the main thread's (2 ranks, a barrier:
    # 2.3-2.7 us a call where it took 1.6-2.5 us unbound).
    bind_to_core()
    try:
        pg = nc.get_default_group()
        ours, theirs, wrong, algorithms = [], [], [], []
        for case in plan.cases:
            n_inp, n_out = numcoll_buffers(plan, case, rank)
            n_step = numcoll_form_step(plan, n_inp, n_out)
            m_inp, m_out = rank_buffers(plan, case, rank)
            m_step = mpi_step(MPI, comm, plan, m_inp, m_out) or \
                _mpi_step(MPI, comm, plan.op, m_inp, m_out)
            part = dataclasses.replace(case, iters=max(1, -(-case.iters // PAIRED_ROUNDS)))
            n_times, m_times = [], []
            for _ in range(PAIRED_ROUNDS):
                n_times.append(_time_case(n_step, part, nc.barrier, plan.sync_each_iter))
                m_times.append(_time_case(m_step, part, comm.Barrier, plan.sync_each_iter))
            ours.append(np.concatenate(n_times))
            theirs.append(np.concatenate(m_times))
            wrong.append(check_case(plan, case, rank, n_inp, n_out, n_step, nc.barrier))
            algorithms.append(algorithm(plan, case, pg.context))
        transport = pg.transport_kind
    finally:
        nc.destroy_process_group()
    gathered = comm.gather((ours, theirs, wrong), root=0)
    if rank != 0:
        return None
    return {"numcoll": [g[0] for g in gathered], "mpi": [g[1] for g in gathered],
            "wrong": [g[2] for g in gathered], "algorithms": algorithms,
            "transport": transport}


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
    result = _mpirun(plan, timeout_s, mpirun, paired=False)
    rank_times = [[np.asarray(t) for t in per_rank] for per_rank in result["times"]]
    return _mpi_rows(plan, rank_times), _mpi_info(result)


def run_plans_paired(plans: list[Plan], *, timeout_s: float = 900.0,
                     mpirun: str = "mpirun") -> list[tuple[list[dict], dict, list[dict], dict]]:
    """Each plan for numcoll and MPI in the same ``mpirun`` processes
    (``numcoll-bench --compare mpi4py --paired``): per case, numcoll's and
    MPI's iterations in :data:`PAIRED_ROUNDS` alternating rounds.

    Why: on a shared VM the time a line takes between two cores is a
    property of where the hypervisor put the virtual CPUs, and it changes
    between launches (the two vCPUs of the development VM: 0.03, 0.07 or
    0.3 us a round trip, launch after launch). Two separate launches can then
    time two different machines; one launch with the rounds interleaved
    times both on the same one. Returns, per plan, (numcoll's rows, numcoll's
    info, MPI's rows, MPI's info) as :func:`~numcoll.bench.runners.run_plan`
    and :func:`run_plan_mpi` return them."""
    runs = []
    for plan in plans:
        result = _mpirun(plan, timeout_s, mpirun, paired=True)
        ours = [[np.asarray(t) for t in per_rank] for per_rank in result["numcoll"]]
        theirs = [[np.asarray(t) for t in per_rank] for per_rank in result["mpi"]]
        rows = summarize(plan, ours, backend="numcoll", rank_wrong=result["wrong"],
                         algorithms=result["algorithms"])
        runs.append((rows, {"transport": result["transport"]}, _mpi_rows(plan, theirs),
                     _mpi_info(result)))
    return runs


def _mpi_rows(plan: Plan, rank_times) -> list[dict]:
    rows = summarize(plan, rank_times, backend="mpi4py")
    for row in rows:
        row["algorithm"] = "mpi"
    return rows


def _mpi_info(result: dict) -> dict:
    return {"transport": "mpi", "mpi_version": result["version"],
            "mpi_persistent": result.get("persistent", False)}


def _mpirun(plan: Plan, timeout_s: float, mpirun: str, paired: bool) -> dict:
    """Run the worker for ``plan`` under ``mpirun``; what rank 0 wrote."""
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
        cmd = [mpirun, *MPIRUN_ARGS, *(PAIRED_MPIRUN_ARGS if paired else ()),
               "-n", str(plan.world_size), "-x", "PYTHONPATH",
               sys.executable, "-m", "numcoll.bench.mpi",
               "--paired-worker" if paired else "--worker", plan_path, out_path]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
        if proc.returncode != 0 or not os.path.exists(out_path):
            raise RuntimeError(f"mpirun failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
        with open(out_path) as f:
            return json.load(f)


def _worker(plan_path: str, out_path: str, paired: bool = False) -> None:
    from mpi4py import MPI

    from .forms import mpi_persistent

    with open(plan_path) as f:
        plan = _plan_from_json(f.read())
    result = None
    if paired:
        store = os.path.join(os.path.dirname(plan_path), "numcoll-store")
        got = paired_rank(plan, store)
        if got is not None:
            result = {"numcoll": [[t.tolist() for t in r] for r in got["numcoll"]],
                      "mpi": [[t.tolist() for t in r] for r in got["mpi"]],
                      "wrong": got["wrong"], "algorithms": got["algorithms"],
                      "transport": got["transport"]}
    else:
        gathered = mpi_rank(plan)
        if gathered is not None:
            result = {"times": [[t.tolist() for t in per_rank] for per_rank in gathered]}
    if result is not None:
        result.update(version=MPI.Get_library_version().splitlines()[0].strip(),
                      persistent=plan.persistent and mpi_persistent(MPI))
        with open(out_path, "w") as f:
            json.dump(result, f)


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
    p.add_argument("--paired-worker", nargs=2, metavar=("PLAN", "OUT"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker or args.paired_worker:
        _worker(*(args.worker or args.paired_worker), paired=bool(args.paired_worker))
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
