"""The per-rank timing loops (numcoll and torch.distributed gloo) and the
launcher that runs a :class:`~numcoll.bench.sweep.Plan` on local ranks.

Both backends are timed the same way, in every rank: buffers are allocated
once per size, ``warmup`` untimed iterations run, the ranks meet in a
barrier, then each of ``iters`` iterations is timed on its own with
``time.perf_counter`` (issue + wait). Every rank returns its per-iteration
times; :func:`~numcoll.bench.sweep.summarize` takes, per iteration, the
slowest rank, and reports the median over iterations.

The rank functions (:func:`numcoll_rank`, :func:`torch_rank`) run inside a
rank started by :func:`numcoll.launch`, so a notebook can launch them itself::

    results = nc.launch(numcoll_rank, 2, args=(plan,), mode="process")
    rows = summarize(plan, [r["times"] for r in results])
"""

from __future__ import annotations

import importlib.util
import os
import sys
import time
from datetime import timedelta
from typing import Callable

import numpy as np

from .sweep import Case, Plan, format_nbytes, summarize

__all__ = ["numcoll_rank", "torch_rank", "rank_buffers", "numcoll_issue", "run_plan",
           "torch_available", "torch_version", "TorchUnavailableError", "DEFAULT_TIMEOUT_S"]

#: Deadline of a whole sweep (and of each collective in it), in seconds.
DEFAULT_TIMEOUT_S = 900.0


class TorchUnavailableError(RuntimeError):
    """``--compare torch`` was asked for but torch cannot be imported."""


def _time_case(step: Callable[[], object], case: Case, barrier: Callable[[], object],
               sync_each_iter: bool = False) -> np.ndarray:
    """Per-iteration seconds of ``step`` (one complete collective: issue + wait)."""
    for _ in range(case.warmup):
        step()
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
    return times


def _progress(plan: Plan, label: str, rank: int, index: int, case: Case) -> None:
    if plan.progress and rank == 0:
        print(f"[{label} {plan.op}] {format_nbytes(case.nbytes)} ({index + 1}/{len(plan.cases)})",
              file=sys.stderr, flush=True)


def rank_buffers(plan: Plan, case: Case) -> tuple[np.ndarray, np.ndarray | None]:
    """(input, output) of one rank for ``case``; output None for in-place ops.

    Buffers are written once (zeros: repeated SUMs neither overflow nor reach
    inf or denormals), which also maps every page before the timing starts.
    """
    n, dtype = plan.world_size, plan.numpy_dtype

    def filled(count: int) -> np.ndarray:
        a = np.empty(count, dtype)
        a[...] = 0
        return a

    if plan.op in ("allreduce", "broadcast", "reduce"):
        return filled(case.count), None
    if plan.op == "allgather":
        return filled(case.count // n), filled(case.count)
    if plan.op == "reduce_scatter":
        return filled(case.count), filled(case.count // n)
    return filled(case.count), filled(case.count)  # alltoall


# -- numcoll -----------------------------------------------------------------------------
def numcoll_issue(pg, plan: Plan, inp: np.ndarray,
                  out: np.ndarray | None) -> Callable[[], object]:
    """A callable that issues ``plan.op`` on ``pg`` over the buffers from
    :func:`rank_buffers` and returns its Work (without waiting)."""
    import numcoll as nc

    alg = plan.algorithm
    if plan.op == "allreduce":
        opts = nc.AllreduceOptions(algorithm=alg)
        return lambda: pg.allreduce(inp, opts)
    if plan.op == "broadcast":
        opts = nc.BroadcastOptions(root_rank=0, algorithm=alg)
        return lambda: pg.broadcast(inp, opts)
    if plan.op == "reduce":
        opts = nc.ReduceOptions(root_rank=0, algorithm=alg)
        return lambda: pg.reduce(inp, opts)
    if plan.op == "allgather":
        return lambda: pg.allgather_into_tensor(out, inp)
    if plan.op == "reduce_scatter":
        return lambda: pg.reduce_scatter_tensor(out, inp)
    return lambda: pg.alltoall_base(out, inp)


def numcoll_rank(plan: Plan) -> dict:
    """Run ``plan`` on this rank's default numcoll group (inside :func:`numcoll.launch`).

    Returns ``{"times": [per-iteration seconds, one array per case],
    "transport": the group's transport}``.
    """
    import numcoll as nc

    pg = nc.get_default_group()
    rank = pg.rank()
    all_times = []
    for index, case in enumerate(plan.cases):
        _progress(plan, "numcoll", rank, index, case)
        issue = numcoll_issue(pg, plan, *rank_buffers(plan, case))
        all_times.append(_time_case(lambda: issue().wait(), case, lambda: pg.barrier().wait(),
                                    plan.sync_each_iter))
    return {"times": all_times, "transport": pg.transport_kind}


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
    return lambda: dist.all_to_all_single(out, inp)


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


def torch_rank(plan: Plan, timeout_s: float = DEFAULT_TIMEOUT_S) -> dict:
    """Run ``plan`` on torch.distributed with backend "gloo" (inside
    :func:`numcoll.launch` in process mode; one intra-op thread per rank).

    Returns ``{"times": [...], "transport": "gloo-tcp", "torch_version": ...}``.
    """
    import numcoll as nc

    try:
        import torch
        import torch.distributed as dist
    except ImportError as exc:
        raise TorchUnavailableError(f"torch cannot be imported: {exc}") from exc
    torch.set_num_threads(1)  # fair on a small box: numcoll's kernels are single-threaded too
    store = _torch_init(dist, timedelta(seconds=timeout_s))
    rank = dist.get_rank()
    all_times = []
    try:
        for index, case in enumerate(plan.cases):
            _progress(plan, "torch-gloo", rank, index, case)
            inp, out = rank_buffers(plan, case)
            step = _torch_step(dist, plan, _torch_tensor(torch, inp, plan.dtype),
                               _torch_tensor(torch, out, plan.dtype))
            all_times.append(_time_case(step, case, dist.barrier, plan.sync_each_iter))
    finally:
        dist.destroy_process_group()
        # Rank 0 hosts the torch store: keep it until every rank has left gloo.
        nc.barrier()
        del store
    return {"times": all_times, "transport": "gloo-tcp", "torch_version": torch.__version__}


# -- launching ---------------------------------------------------------------------------
def run_plan(plan: Plan, *, backend: str = "numcoll", mode: str = "process",
             transport: str | None = None,
             timeout_s: float = DEFAULT_TIMEOUT_S) -> tuple[list[dict], dict]:
    """Run ``plan`` on ``plan.world_size`` local ranks; return (rows, info).

    backend "numcoll" runs in ``mode`` over ``transport``; backend "torch"
    always runs in processes (gloo's default group is one per process).
    ``info`` has the transport used (and torch's version).
    """
    from ..launch import launch

    if backend == "numcoll":
        results = launch(numcoll_rank, plan.world_size, args=(plan,), mode=mode,
                         transport=transport, timeout=timeout_s)
    elif backend == "torch":
        if not torch_available():
            raise TorchUnavailableError(
                "--compare torch needs PyTorch, which is not importable in this environment "
                "(install it, e.g. pip install torch)")
        results = launch(torch_rank, plan.world_size, args=(plan, timeout_s), mode="process",
                         timeout=timeout_s)
    else:
        raise ValueError(f"unknown backend {backend!r}; choose 'numcoll' or 'torch'")
    rows = summarize(plan, [r["times"] for r in results], backend=backend)
    info = {k: v for k, v in results[0].items() if k != "times"}
    return rows, info
