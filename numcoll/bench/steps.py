"""One collective as a user calls it: the buffers each rank passes and the step that
runs it once. The timing loops (:mod:`numcoll.bench.runners`) and the other forms
(:mod:`numcoll.bench.forms`: persistent requests, shared arrays) are built on these."""

from __future__ import annotations

from typing import Callable

import numpy as np

from .sweep import Case, Plan

__all__ = ["rank_buffers", "numcoll_issue", "numcoll_step", "last_algorithm"]


def rank_buffers(plan: Plan, case: Case, rank: int = 0) -> tuple[np.ndarray, np.ndarray | None]:
    """(input, output) of rank ``rank`` for ``case``; output None for the ops that
    write into their input. In the in-place forms the input is a view of this
    rank's block of the output (allgather) or the output a view of this rank's
    block of the input (reduce_scatter).

    Buffers are written once (zeros: repeated SUMs neither overflow nor reach
    inf or denormals), which also maps every page before the timing starts.
    A barrier's input is empty.
    """
    n, dtype = plan.world_size, plan.numpy_dtype
    if not plan.moves_data:
        return np.empty(0, dtype), None

    def filled(count: int) -> np.ndarray:
        a = np.empty(count, dtype)
        a[...] = 0
        return a

    if plan.op in ("allreduce", "broadcast", "reduce"):
        return filled(case.count), None
    block = case.count // n
    if plan.op == "allgather":
        out = filled(case.count)
        return (out[rank * block:(rank + 1) * block] if plan.in_place else filled(block)), out
    if plan.op == "reduce_scatter":
        inp = filled(case.count)
        return inp, (inp[rank * block:(rank + 1) * block] if plan.in_place else filled(block))
    if plan.op == "alltoall":
        return filled(case.count), filled(case.count)
    if plan.op == "gather":  # the output is the root's (allocated everywhere, as MPI's anchor)
        return filled(block), filled(case.count)
    if plan.op == "scatter":  # the input is the root's
        return filled(case.count), filled(block)
    raise ValueError(f"rank_buffers: unknown op {plan.op!r}")


def blocks(buf, n: int) -> list:
    """``buf`` (a NumPy array or a torch tensor) as ``n`` equal views: the
    list form of gather's output and scatter's input."""
    block = buf.shape[0] // n
    return [buf[i * block:(i + 1) * block] for i in range(n)]


def numcoll_issue(pg, plan: Plan, inp: np.ndarray,
                  out: np.ndarray | None) -> Callable[[], object]:
    """A callable that issues ``plan.op`` on ``pg`` over the buffers from
    :func:`rank_buffers` and returns its Work (without waiting); the options
    carry ``plan.algorithm``."""
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
        opts = nc.AllgatherOptions(algorithm=alg)
        return lambda: pg.allgather_into_tensor(out, inp, opts)
    if plan.op == "reduce_scatter":
        opts = nc.ReduceScatterOptions(algorithm=alg)
        return lambda: pg.reduce_scatter_tensor(out, inp, opts)
    if plan.op == "alltoall":
        opts = nc.AllToAllOptions(algorithm=alg)
        return lambda: pg.alltoall_base(out, inp, opts=opts)
    root = pg.rank() == 0
    if plan.op == "gather":
        opts, outs = nc.GatherOptions(root_rank=0, algorithm=alg), [blocks(out, pg.size())]
        return lambda: pg.gather(outs if root else [], [inp], opts)
    if plan.op == "scatter":
        opts, ins = nc.ScatterOptions(root_rank=0, algorithm=alg), [blocks(inp, pg.size())]
        return lambda: pg.scatter([out], ins if root else [], opts)
    if plan.op == "barrier":
        opts = nc.BarrierOptions(algorithm=alg)
        return lambda: pg.barrier(opts)
    raise ValueError(f"numcoll_issue: unknown op {plan.op!r}")


def numcoll_step(plan: Plan, inp: np.ndarray, out: np.ndarray | None) -> Callable[[], object]:
    """A callable running one complete ``plan.op`` on this rank's default group,
    over the buffers from :func:`rank_buffers`, the way a user calls it: the
    module-level blocking function (``nc.all_reduce(inp)``), as the torch
    anchor calls ``dist.all_reduce(inp)``. Those take no algorithm, so with
    ``plan.algorithm`` set it is :func:`numcoll_issue` then ``Work.wait()``."""
    import numcoll as nc

    if plan.algorithm is not None:
        issue = numcoll_issue(nc.get_default_group(), plan, inp, out)
        return lambda: issue().wait()
    # The functions are looked up at each call, as the torch anchor's are.
    if plan.op == "allreduce":
        return lambda: nc.all_reduce(inp)
    if plan.op == "broadcast":
        return lambda: nc.broadcast(inp, src=0)
    if plan.op == "reduce":
        return lambda: nc.reduce(inp, dst=0)
    if plan.op == "allgather":
        return lambda: nc.all_gather_into_tensor(out, inp)
    if plan.op == "reduce_scatter":
        return lambda: nc.reduce_scatter_tensor(out, inp)
    if plan.op == "alltoall":
        return lambda: nc.all_to_all_single(out, inp)
    if plan.op == "gather":
        outs = blocks(out, nc.get_world_size()) if nc.get_rank() == 0 else None
        return lambda: nc.gather(inp, outs, dst=0)
    if plan.op == "scatter":
        ins = blocks(inp, nc.get_world_size()) if nc.get_rank() == 0 else None
        return lambda: nc.scatter(out, ins, src=0)
    if plan.op == "barrier":
        return lambda: nc.barrier()
    raise ValueError(f"numcoll_step: unknown op {plan.op!r}")


def last_algorithm(rank: int) -> str | None:
    """The algorithm of this rank's last collective other than a barrier, as the
    flight recorder saw it run (None when the recorder is off)."""
    import numcoll as nc

    entries = nc.flight_recorder.dump(rank)["entries"]
    for entry in reversed(entries):
        if not entry["profiling_name"].endswith("barrier"):
            return entry["algorithm"]
    return entries[-1]["algorithm"] if entries else None
