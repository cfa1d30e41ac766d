"""The per-rank timing loops (numcoll and torch.distributed gloo) and the
launcher that runs a :class:`~numcoll.bench.sweep.Plan` on local ranks.

Both backends are timed the same way, in every rank: buffers are allocated
once per size, ``warmup`` untimed iterations run, the ranks meet in a
barrier, then each of ``iters`` iterations is timed on its own with
``time.perf_counter``: one blocking call, as a user makes it (numcoll:
``nc.all_reduce(x)``, torch: ``dist.all_reduce(x)``; with an algorithm forced,
numcoll's ProcessGroup method with it in the options, then ``Work.wait()``).
Then, unless ``plan.check`` is off, the inputs are filled with rank-dependent
values and the collective runs once more to count wrong elements
(:mod:`numcoll.bench.check`). Every rank returns its per-iteration times and
wrong counts; :func:`~numcoll.bench.sweep.summarize` takes, per iteration, the
slowest rank, and reports the median over iterations (min, percentiles, max
and each rank's median kept).

The rank functions (:func:`numcoll_rank`, :func:`torch_rank`) run inside a
rank started by :func:`numcoll.launch`, so a notebook can launch them itself::

    results = nc.launch(numcoll_rank, 2, args=(plan,), mode="process")
    rows = summarize(plan, [r["times"] for r in results],
                     rank_wrong=[r["wrong"] for r in results])

:func:`run_plans` does that for several plans in one launch, with a progress bar.
"""

from __future__ import annotations

import importlib.util
import os
import time
from datetime import timedelta
from typing import Callable

import numpy as np

from .check import check_case
from .forms import algorithm, bind_to_core, numcoll_buffers, numcoll_form_step
from .progress import ProgressDisplay, Reporter
from .steps import blocks, numcoll_issue, numcoll_step, rank_buffers  # noqa: F401 - re-exported
from .sweep import Case, Plan, format_nbytes, summarize

__all__ = ["numcoll_rank", "torch_rank", "rank_buffers", "numcoll_issue", "numcoll_step",
           "run_plan", "run_plans", "torch_available", "torch_version", "TorchUnavailableError",
           "DEFAULT_TIMEOUT_S"]

#: Deadline of a whole sweep (and of each collective in it), in seconds.
DEFAULT_TIMEOUT_S = 900.0
#: Rank 0 reports its progress every this many timed iterations (see _time_case).
TICK_EVERY = 64


class TorchUnavailableError(RuntimeError):
    """``--compare torch`` was asked for but torch cannot be imported."""


def _time_case(step: Callable[[], object], case: Case, barrier: Callable[[], object],
               sync_each_iter: bool = False,
               tick: Callable[[float], None] | None = None) -> np.ndarray:
    """Per-iteration seconds of ``step`` (one complete collective: issue + wait);
    ``tick(fraction done)`` after each warmup iteration, every TICK_EVERY-th
    timed one, and at the end."""
    total = case.warmup + case.iters
    for k in range(case.warmup):
        step()
        if tick is not None:
            tick((k + 1) / total)
    # Ranks enter the timed loop together, so the first iteration does not
    # include another rank's warmup or allocation.
    barrier()
    clock = time.perf_counter
    times = np.empty(case.iters, dtype=np.float64)
    for i in range(case.iters):
        if sync_each_iter:
            barrier()
        start = clock()
        step()
        times[i] = clock() - start
        # Only rank 0 reports progress: each report delays it, and the
        # others wait for it in their next iteration, which an anchor's
        # ranks (no reporter) never do. Every TICK_EVERY-th iteration only,
        # so the median of a small call's iterations cannot see it.
        if tick is not None and not i % TICK_EVERY:
            tick((case.warmup + i + 1) / total)
    if tick is not None:
        tick(1.0)
    return times


def _run_cases(plan: Plan, rank: int, make_step, barrier: Callable[[], object],
               reporter: Reporter | None, first_case: int, label: str,
               buffers: Callable | None = None) -> dict:
    """Time every case of ``plan`` on this rank, then check it (see the module
    docstring). ``make_step(inp, out)`` -> a callable running one complete
    collective on those buffers; ``first_case``: the number of this plan's
    first case among all the cases of the launch (for the progress display);
    ``buffers(plan, case, rank)``: the buffers (default :func:`rank_buffers`)."""
    buffers = buffers or rank_buffers
    all_times, all_wrong = [], []
    for index, case in enumerate(plan.cases):
        tick = None
        if reporter is not None:
            number = first_case + index
            reporter.start_case(number, f"[{label} {plan.label}] {format_nbytes(case.nbytes)}")
            tick = lambda fraction, number=number: reporter.tick(number, fraction)  # noqa: E731
        inp, out = buffers(plan, case, rank)
        step = make_step(inp, out)
        all_times.append(_time_case(step, case, barrier, plan.sync_each_iter, tick))
        all_wrong.append(check_case(plan, case, rank, inp, out, step, barrier))
    return {"times": all_times, "wrong": all_wrong}


# -- numcoll -----------------------------------------------------------------------------
def numcoll_rank(plan: Plan, reporter: Reporter | None = None, first_case: int = 0) -> dict:
    """Run ``plan`` on this rank's default numcoll group (inside :func:`numcoll.launch`).

    Returns ``{"times": [per-iteration seconds, one array per case],
    "wrong": [wrong elements per case, None if unchecked],
    "algorithms": [the algorithm that ran each case],
    "transport": the group's transport}``. ``reporter``: rank 0 reports its
    progress there (see :mod:`numcoll.bench.progress`).
    """
    import numcoll as nc

    pg = nc.get_default_group()
    result = _run_cases(plan, pg.rank(), lambda inp, out: numcoll_form_step(plan, inp, out),
                        nc.barrier, reporter if pg.rank() == 0 else None, first_case, "numcoll",
                        numcoll_buffers)
    # The group's own configuration says what ran (e.g. whether it has a shared arena).
    algorithms = [algorithm(plan, case, pg.context) for case in plan.cases]
    return {**result, "algorithms": algorithms, "transport": pg.transport_kind}


def _numcoll_session(plans: list[Plan], reporter: Reporter | None,
                     bind: bool = False) -> list[dict]:
    if bind:
        bind_to_core()
    firsts = _first_cases(plans)
    return [numcoll_rank(plan, reporter, first) for plan, first in zip(plans, firsts)]


def _first_cases(plans: list[Plan]) -> list[int]:
    firsts, total = [], 0
    for plan in plans:
        firsts.append(total)
        total += len(plan.cases)
    return firsts


# -- torch.distributed gloo -------------------------------------------------------------
def torch_available() -> bool:
    """Whether torch can be found (without importing it)."""
    return importlib.util.find_spec("torch") is not None


def torch_version() -> str | None:
    """torch's installed version, read from its metadata (torch is not imported)."""
    from importlib import metadata

    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return None


def _torch_tensor(torch, arr: np.ndarray, dtype_name: str):
    """A torch view of ``arr`` (no copy), so both backends use the same memory layout."""
    if arr is None:
        return None
    if dtype_name == "bfloat16":  # torch.from_numpy does not know ml_dtypes' bfloat16
        return torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(arr)


def _torch_step(dist, plan: Plan, inp, out):
    if plan.op == "allreduce":
        return lambda: dist.all_reduce(inp)
    if plan.op == "broadcast":
        return lambda: dist.broadcast(inp, src=0)
    if plan.op == "reduce":
        return lambda: dist.reduce(inp, dst=0)
    if plan.op == "allgather":
        # torch 2.13 renamed the *_into_tensor / *_tensor forms (same collective).
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        return lambda: gather(out, inp)
    if plan.op == "reduce_scatter":
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        return lambda: scatter(out, inp)
    if plan.op == "alltoall":
        return lambda: dist.all_to_all_single(out, inp)
    root = dist.get_rank() == 0
    if plan.op == "gather":
        outs = blocks(out, dist.get_world_size()) if root else None
        return lambda: dist.gather(inp, outs, dst=0)
    if plan.op == "scatter":
        ins = blocks(inp, dist.get_world_size()) if root else None
        return lambda: dist.scatter(out, ins, src=0)
    if plan.op == "barrier":
        return dist.barrier
    raise ValueError(f"torch anchor: unknown op {plan.op!r}")


def _torch_init(torch_dist, timeout: timedelta) -> None:
    """init_process_group("gloo") on a torch TCPStore that rank 0 opens on a
    port the OS picks; the port reaches the other ranks through numcoll's
    default group (so no port is guessed and none can be taken meanwhile)."""
    import numcoll as nc

    rank, size = nc.get_rank(), nc.get_world_size()
    # gloo binds to the address the hostname resolves to unless told otherwise;
    # the ranks are all local, so loopback is the right interface.
    if "GLOO_SOCKET_IFNAME" not in os.environ and os.path.exists("/sys/class/net/lo"):
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    store = None
    port = np.zeros(1, np.int64)
    if rank == 0:
        store = torch_dist.TCPStore("127.0.0.1", 0, size, is_master=True, timeout=timeout,
                                    wait_for_workers=False)
        port[0] = store.port
    nc.broadcast(port, src=0)
    if rank != 0:
        store = torch_dist.TCPStore("127.0.0.1", int(port[0]), size, is_master=False,
                                    timeout=timeout)
    torch_dist.init_process_group("gloo", store=store, rank=rank, world_size=size,
                                  timeout=timeout)
    return store


def torch_rank(plan: Plan, timeout_s: float = DEFAULT_TIMEOUT_S,
               reporter: Reporter | None = None) -> dict:
    """Run ``plan`` on torch.distributed with backend "gloo" (inside
    :func:`numcoll.launch` in process mode; one intra-op thread per rank).

    Returns ``{"times": [...], "wrong": [...], "transport": "gloo-tcp",
    "torch_version": ...}``.
    """
    return _torch_session([plan], timeout_s, reporter)[0]


def _torch_session(plans: list[Plan], timeout_s: float,
                   reporter: Reporter | None) -> list[dict]:
    import numcoll as nc

    try:
        import torch
        import torch.distributed as dist
    except ImportError as exc:
        raise TorchUnavailableError(f"torch cannot be imported: {exc}") from exc
    torch.set_num_threads(1)  # fair on a small box: numcoll's kernels are single-threaded too
    store = _torch_init(dist, timedelta(seconds=timeout_s))
    rank = dist.get_rank()
    info = {"transport": "gloo-tcp", "torch_version": torch.__version__}
    results = []
    try:
        for plan, first in zip(plans, _first_cases(plans)):
            def make_step(inp, out, plan=plan):
                return _torch_step(dist, plan, _torch_tensor(torch, inp, plan.dtype),
                                   _torch_tensor(torch, out, plan.dtype))

            result = _run_cases(plan, rank, make_step, dist.barrier,
                                reporter if rank == 0 else None, first, "torch-gloo")
            results.append({**result, **info})
    finally:
        dist.destroy_process_group()
        # Rank 0 hosts the torch store: keep it until every rank has left gloo.
        nc.barrier()
        del store
    return results


# -- launching ---------------------------------------------------------------------------
def run_plans(plans: list[Plan], *, backend: str = "numcoll", mode: str = "process",
              transport: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S,
              progress: str | bool = "auto") -> tuple[list[list[dict]], dict]:
    """Run every plan, one after the other, in one launch of local ranks (the
    plans' world sizes must agree); return (rows of each plan, info).

    backend "numcoll" runs in ``mode`` over ``transport``; backend "torch"
    always runs in processes (gloo's default group is one per process).
    ``info`` has the transport used (and torch's version). ``progress``:
    "auto" (a bar in a notebook or on a terminal, one line per size otherwise),
    "bar", "lines", or False.
    """
    from ..launcher.local import launch

    plans = list(plans)
    sizes = {plan.world_size for plan in plans}
    if len(sizes) != 1:
        raise ValueError(f"run_plans: the plans must share one world size, got {sorted(sizes)}")
    world_size = sizes.pop()
    if backend == "torch" and not torch_available():
        raise TorchUnavailableError(
            "--compare torch needs PyTorch, which is not importable in this environment "
            "(install it, e.g. pip install torch)")
    if backend not in ("numcoll", "torch"):
        raise ValueError(f"unknown backend {backend!r}; choose 'numcoll' or 'torch'")
    with ProgressDisplay(sum(len(p.cases) for p in plans), progress) as reporter:
        if backend == "numcoll":
            per_rank = launch(_numcoll_session, world_size,
                              args=(plans, reporter, mode == "process"), mode=mode,
                              transport=transport, timeout=timeout_s)
        else:
            per_rank = launch(_torch_session, world_size, args=(plans, timeout_s, reporter),
                              mode="process", timeout=timeout_s)
    rows = [summarize(plan, [r[i]["times"] for r in per_rank], backend=backend,
                      rank_wrong=[r[i]["wrong"] for r in per_rank],
                      algorithms=per_rank[0][i].get("algorithms"))
            for i, plan in enumerate(plans)]
    info = {k: v for k, v in per_rank[0][0].items() if k not in ("times", "wrong", "algorithms")}
    return rows, info


def run_plan(plan: Plan, **kwargs) -> tuple[list[dict], dict]:
    """:func:`run_plans` for one plan: (rows, info)."""
    rows, info = run_plans([plan], **kwargs)
    return rows[0], info
