"""The two other forms a sweep can time: persistent requests and shared arrays.

``numcoll-bench --persistent`` (``Plan.persistent``): numcoll's iteration is
``req.start(); req.wait()`` on a request made once per size with the
module-level ``*_init`` functions (``nc.all_reduce_init(x)`` ...; with
``--algorithm``, the ProcessGroup's ``*_init`` with the algorithm in its
options). MPI's anchor uses MPI-4's persistent collectives
(``comm.Allreduce_init`` ...) where the MPI library has them and its
blocking call where it does not (Open MPI 4.1 has none: :func:`mpi_step`
says which ran); torch has none, so gloo's iteration stays the blocking call.

``numcoll-bench --shared-arrays`` (``Plan.shared_arrays``): numcoll's
buffers are made with ``nc.empty_shared`` -- the array every rank reads
from the others (allreduce's, broadcast's and reduce's array, the input of
allgather, reduce_scatter and alltoall; the output of an in-place
allgather, whose input is a view of it) -- so the collectives read the
peers' arrays in place. The anchors' buffers are ordinary arrays (MPI reads
its peers' buffers in place anyway, through CMA, where the kernel allows it).
"""

from __future__ import annotations

import os
from typing import Callable

import numpy as np

from .steps import numcoll_step, rank_buffers
from .sweep import Case, Plan, algorithm_name

__all__ = ["numcoll_buffers", "numcoll_form_step", "algorithm", "mpi_step", "mpi_persistent",
           "describe", "bind_to_core"]


def describe(plan: Plan) -> str:
    """``persistent``, ``shared arrays``, ``persistent, shared arrays`` or ``""``."""
    return ", ".join(word for word, on in (("persistent", plan.persistent),
                                           ("shared arrays", plan.shared_arrays)) if on)


def numcoll_buffers(plan: Plan, case: Case, rank: int) -> tuple[np.ndarray, np.ndarray | None]:
    """:func:`~numcoll.bench.steps.rank_buffers`, in shared memory where
    ``plan.shared_arrays`` asks for it (collective: every rank calls it)."""
    if not plan.shared_arrays or not plan.moves_data:
        return rank_buffers(plan, case, rank)
    import numcoll as nc

    n, dtype = plan.world_size, plan.numpy_dtype
    if plan.op in ("allreduce", "broadcast", "reduce"):
        return nc.zeros_shared(case.count, dtype), None
    block = case.count // n
    if plan.op == "allgather":
        if plan.in_place:
            out = nc.zeros_shared(case.count, dtype)
            return out[rank * block:(rank + 1) * block], out
        return nc.zeros_shared(block, dtype), np.zeros(case.count, dtype)
    inp = nc.zeros_shared(case.count, dtype)
    if plan.op == "reduce_scatter":
        return inp, (inp[rank * block:(rank + 1) * block] if plan.in_place
                     else np.zeros(block, dtype))
    if plan.op == "alltoall":
        return inp, np.zeros(case.count, dtype)
    raise ValueError(f"numcoll_buffers: unknown op {plan.op!r}")


def algorithm(plan: Plan, case: Case, context) -> str:
    """The algorithm that runs ``case`` on the group whose context is
    ``context`` (:class:`~numcoll.collectives.context.GroupContext`):
    ``shared_arrays`` where ``plan.shared_arrays`` takes that path (see
    :func:`numcoll.collectives.shared_arrays.applies`), else
    :func:`~numcoll.bench.sweep.algorithm_name`'s."""
    from ..collectives.shared_arrays import applies
    from ..dtypes import is_half

    nbytes = case.nbytes // plan.world_size if plan.op == "allgather" else case.nbytes
    if plan.shared_arrays and not is_half(plan.numpy_dtype) and \
            applies(context.cfg, plan.world_size, plan.op, nbytes, plan.algorithm):
        return "shared_arrays"
    return algorithm_name(plan, case, context=context)


def numcoll_form_step(plan: Plan, inp: np.ndarray, out: np.ndarray | None) -> Callable[[], object]:
    """One iteration in ``plan``'s form: ``start(); wait()`` of a request made
    here (``plan.persistent``), else the blocking call of :func:`numcoll_step`."""
    if not plan.persistent:
        return numcoll_step(plan, inp, out)
    req = _request(plan, inp, out)

    def step():
        req.start()
        req.wait()

    return step


def _request(plan: Plan, inp, out):
    import numcoll as nc

    if plan.algorithm is not None:
        pg, alg = nc.get_default_group(), plan.algorithm
        if plan.op == "allreduce":
            return pg.allreduce_init(inp, nc.AllreduceOptions(algorithm=alg))
        if plan.op == "broadcast":
            return pg.broadcast_init(inp, nc.BroadcastOptions(root_rank=0, algorithm=alg))
        if plan.op == "reduce":
            return pg.reduce_init(inp, nc.ReduceOptions(root_rank=0, algorithm=alg))
        if plan.op == "allgather":
            return pg.allgather_into_tensor_init(out, inp, nc.AllgatherOptions(algorithm=alg))
        if plan.op == "reduce_scatter":
            return pg.reduce_scatter_tensor_init(out, inp,
                                                 nc.ReduceScatterOptions(algorithm=alg))
        if plan.op == "alltoall":
            return pg.alltoall_base_init(out, inp, opts=nc.AllToAllOptions(algorithm=alg))
        if plan.op == "barrier":
            return pg.barrier_init(nc.BarrierOptions(algorithm=alg))
    if plan.op == "allreduce":
        return nc.all_reduce_init(inp)
    if plan.op == "broadcast":
        return nc.broadcast_init(inp, src=0)
    if plan.op == "reduce":
        return nc.reduce_init(inp, dst=0)
    if plan.op == "allgather":
        return nc.all_gather_into_tensor_init(out, inp)
    if plan.op == "reduce_scatter":
        return nc.reduce_scatter_tensor_init(out, inp)
    if plan.op == "alltoall":
        return nc.all_to_all_single_init(out, inp)
    if plan.op == "barrier":
        return nc.barrier_init()
    raise ValueError(f"numcoll-bench --persistent: unknown op {plan.op!r}")


def mpi_step(MPI, comm, plan: Plan, inp, out) -> Callable[[], object] | None:
    """MPI's persistent form of ``plan.op`` (``Start(); Wait()`` of a request
    made here) when ``plan.persistent`` and the MPI library has MPI-4's
    persistent collectives; None otherwise (the caller times the blocking call)."""
    if not plan.persistent or not mpi_persistent(MPI):
        return None
    op = plan.op
    try:
        if op == "allreduce":
            req = comm.Allreduce_init(MPI.IN_PLACE, inp, op=MPI.SUM)
        elif op == "broadcast":
            req = comm.Bcast_init(inp, root=0)
        elif op == "reduce":
            req = (comm.Reduce_init(MPI.IN_PLACE, inp, op=MPI.SUM, root=0)
                   if comm.Get_rank() == 0 else comm.Reduce_init(inp, None, op=MPI.SUM, root=0))
        elif op == "allgather":
            req = comm.Allgather_init(inp, out)
        elif op == "reduce_scatter":
            req = comm.Reduce_scatter_block_init(inp, out, op=MPI.SUM)
        elif op == "alltoall":
            req = comm.Alltoall_init(inp, out)
        elif op == "barrier":
            req = comm.Barrier_init()
        else:
            return None
    except (NotImplementedError, AttributeError, MPI.Exception):
        return None  # an MPI-4 library that still lacks one

    def step():
        req.Start()
        req.Wait()

    return step


def mpi_persistent(MPI) -> bool:
    """Whether the MPI library implements MPI-4 (whose persistent collectives
    mpi4py's ``*_init`` call; Open MPI 4.1 implements MPI 3.1)."""
    return MPI.Get_version() >= (4, 0)


def bind_to_core() -> int | None:
    """Bind this rank's process to one CPU of those it may use -- the rank-th
    -- when there is one per rank (returns it; None otherwise), as ``mpirun``
    binds MPI's ranks (``--bind-to core`` for two ranks or fewer per host: it
    reports no binding when ranks outnumber cores). Measured beside MPI on the
    shared 2-core VM, an unbound pair of ranks often shares one core while
    another job holds the other, and every step then waits for a context
    switch: 8-byte allreduces took 7-40 us where bound ones took 7 us."""
    import numcoll as nc

    rank, size = nc.get_rank(), nc.get_world_size()
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return None
    if size > len(cpus):
        return None
    os.sched_setaffinity(0, {cpus[rank]})
    return cpus[rank]
