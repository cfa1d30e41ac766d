"""Every collective on new arrays each call, beside Open MPI's, in the same processes.

    mpirun --allow-run-as-root -n 2 --bind-to none python benchmarks/new_arrays.py
    mpirun --allow-run-as-root -n 4 --bind-to none --oversubscribe \\
        python benchmarks/new_arrays.py --sizes 8,64K --calls 300

Most code allocates a collective's arrays each call (``out =
np.empty(...)``, a fresh list for a gather). numcoll runs such calls through
a plan per *form* (:mod:`numcoll.fast.forms`); this times, for each
collective and size, three ways of the same call, every one allocating its
arrays inside the timed call:

``ordinary``
    numcoll with the group's plans by form forgotten before each call (not
    timed): the full path -- builder, checks, the group's submit, Work;
``by form``
    numcoll as a user runs it: through the form's plan;
``Open MPI``
    the same collective in mpi4py on new arrays (``Allgather`` for both
    allgather forms, ``Alltoall`` for both alltoall forms).

numcoll's default group meets through a file store inside ``mpirun``'s ranks
(bound to a CPU each, as ``numcoll-bench`` binds them); ``--rounds`` rounds
alternate the three, ``--calls`` calls each, every call timed on its own. A
call's figure is the slower rank's time; the table gives the median over all
calls, in microseconds, and by form over Open MPI (below 1: numcoll faster).
Sizes are of one rank's whole input (a rank's share is its part of it).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import numpy as np

#: The collectives timed, in the table's order.
CALLS = ("allreduce", "broadcast", "reduce", "all_gather_into_tensor", "all_gather",
         "reduce_scatter_tensor", "all_to_all_single", "all_to_all", "gather", "scatter")


def _size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20}
    return int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)


def calls_for(name: str, nbytes: int, nc, comm, MPI) -> tuple:
    """``(numcoll_call, mpi_call)``: each makes its arrays and runs ``name``
    once on ``nbytes`` (float32) of this rank's input."""
    r, n = comm.Get_rank(), comm.Get_size()
    count = max(n, nbytes // 4 // n * n)  # (a whole share for every rank)
    share = count // n
    f32 = np.float32

    def empty(k):
        return np.empty(k, f32)

    def ranks_list(k):
        return [empty(k) for _ in range(n)]

    numcoll = {
        "allreduce": lambda: nc.all_reduce(empty(count)),
        "broadcast": lambda: nc.broadcast(empty(count), src=0),
        "reduce": lambda: nc.reduce(empty(count), dst=0),
        "all_gather_into_tensor": lambda: nc.all_gather_into_tensor(empty(count * n),
                                                                    empty(count)),
        "all_gather": lambda: nc.all_gather(ranks_list(count), empty(count)),
        "reduce_scatter_tensor": lambda: nc.reduce_scatter_tensor(empty(share), empty(count)),
        "all_to_all_single": lambda: nc.all_to_all_single(empty(count), empty(count)),
        "all_to_all": lambda: nc.all_to_all(ranks_list(share), ranks_list(share)),
        "gather": lambda: nc.gather(empty(count), ranks_list(count) if r == 0 else None,
                                    dst=0),
        "scatter": lambda: nc.scatter(empty(count), ranks_list(count) if r == 0 else None,
                                      src=0),
    }[name]
    mpi = {
        "allreduce": lambda: comm.Allreduce(MPI.IN_PLACE, empty(count)),
        "broadcast": lambda: comm.Bcast(empty(count), root=0),
        "reduce": lambda: comm.Reduce(MPI.IN_PLACE if r == 0 else empty(count),
                                      empty(count) if r == 0 else None, root=0),
        "all_gather_into_tensor": lambda: comm.Allgather(empty(count), empty(count * n)),
        "reduce_scatter_tensor": lambda: comm.Reduce_scatter_block(empty(count), empty(share)),
        "all_to_all_single": lambda: comm.Alltoall(empty(count), empty(count)),
        "gather": lambda: comm.Gather(empty(count), empty(count * n) if r == 0 else None,
                                      root=0),
        "scatter": lambda: comm.Scatter(empty(count * n) if r == 0 else None, empty(count),
                                        root=0),
    }
    mpi["all_gather"], mpi["all_to_all"] = mpi["all_gather_into_tensor"], \
        mpi["all_to_all_single"]
    return numcoll, mpi[name]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="8,64K", help="bytes of a rank's input (K, M)")
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--only", default=",".join(CALLS), help="collectives, comma-separated")
    args = parser.parse_args(argv)
    names = args.only.split(",")
    unknown = sorted(set(names) - set(CALLS))
    if unknown:
        parser.error(f"unknown collectives {unknown}; known: {', '.join(CALLS)}")

    from mpi4py import MPI

    import numcoll as nc
    from numcoll.bench.forms import bind_to_core

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    store = comm.bcast(tempfile.mktemp(prefix="numcoll-store-") if rank == 0 else None)
    nc.init_process_group(init_method=f"file://{store}", rank=rank,
                          world_size=comm.Get_size())
    rows = []
    try:
        bind_to_core()  # after numcoll's threads started, as numcoll-bench binds
        forms = nc.get_default_group().repeats.forms
        clock = time.perf_counter
        for nbytes in map(_size, args.sizes.split(",")):
            for name in names:
                numcoll, mpi = calls_for(name, nbytes, nc, comm, MPI)
                ways = {"ordinary": (numcoll, forms.clear), "by form": (numcoll, None),
                        "Open MPI": (mpi, None)}
                times = {way: [] for way in ways}
                for _ in range(args.rounds):
                    for way, (call, before) in ways.items():
                        for _ in range(3):  # (a form is planned by its second array)
                            call()
                        each = np.empty(args.calls)
                        comm.Barrier()
                        for i in range(args.calls):
                            if before is not None:
                                before()
                            t0 = clock()
                            call()
                            each[i] = clock() - t0
                        times[way].append(each)
                rows.append((name, nbytes, {way: np.concatenate(t) for way, t in times.items()}))
    finally:
        nc.destroy_process_group()
    every = comm.gather(rows, root=0)
    if rank == 0:
        if os.path.exists(store):
            os.unlink(store)
        print(f"# {comm.Get_size()} ranks, {args.rounds} rounds of {args.calls} calls, new "
              "arrays each call; microseconds, median call (the slower rank's)")
        print(f"{'call':24s} {'bytes':>8s} {'ordinary':>9s} {'by form':>9s} {'Open MPI':>9s}"
              f" {'form/MPI':>9s}")
        for i, (name, nbytes, _) in enumerate(rows):
            med = {way: float(np.median(np.max([ranks[i][2][way] for ranks in every],
                                               axis=0))) * 1e6
                   for way in ("ordinary", "by form", "Open MPI")}
            print(f"{name:24s} {nbytes:8d} {med['ordinary']:9.2f} {med['by form']:9.2f} "
                  f"{med['Open MPI']:9.2f} {med['by form'] / med['Open MPI']:9.2f}")


if __name__ == "__main__":
    main()
