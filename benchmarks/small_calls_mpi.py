"""The barrier and the 8-byte allreduce beside Open MPI's, to the hundredth of a
microsecond, in the same processes.

    mpirun --allow-run-as-root -n 2 --bind-to none python benchmarks/small_calls_mpi.py
    mpirun --allow-run-as-root -n 2 --bind-to none python benchmarks/small_calls_mpi.py --rounds 16

``numcoll-bench --compare mpi4py --paired`` does the same for every collective
but prints tenths of a microsecond, which is a third of an Open MPI barrier.
Here numcoll's default group meets through a file store inside ``mpirun``'s
ranks (bound to a CPU each, as ``numcoll-bench`` binds them), both libraries
warm up, then ``--rounds`` rounds alternate the four calls, ``--calls`` each,
every call timed on its own; a call's figure is the slower rank's time, and
the table gives the median over all calls, and each rank's median.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import numpy as np


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=8)
    args = parser.parse_args(argv)

    from mpi4py import MPI

    import numcoll as nc
    from numcoll.bench.forms import bind_to_core

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    store = comm.bcast(tempfile.mktemp(prefix="numcoll-store-") if rank == 0 else None)
    nc.init_process_group(init_method=f"file://{store}", rank=rank,
                          world_size=comm.Get_size())
    try:
        bind_to_core()  # after numcoll's threads started, as numcoll-bench binds
        x, y = np.ones(2, np.float32), np.ones(2, np.float32)
        calls = {"Open MPI barrier": comm.Barrier, "numcoll barrier": nc.barrier,
                 "Open MPI allreduce 8 B": lambda: comm.Allreduce(MPI.IN_PLACE, y, op=MPI.SUM),
                 "numcoll allreduce 8 B": lambda: nc.all_reduce(x)}
        times = {name: [] for name in calls}
        clock = time.perf_counter
        for _ in range(args.rounds):
            for name, call in calls.items():
                each = np.empty(args.calls)
                for _ in range(3):  # (numcoll plans a repeated call from its third)
                    call()
                comm.Barrier()
                for i in range(args.calls):
                    t0 = clock()
                    call()
                    each[i] = clock() - t0
                times[name].append(each)
    finally:
        nc.destroy_process_group()
    every = comm.gather({name: np.concatenate(t) for name, t in times.items()}, root=0)
    if rank == 0:
        if os.path.exists(store):
            os.unlink(store)
        print(f"# {comm.Get_size()} ranks, {args.rounds} rounds of {args.calls} calls; "
              "microseconds, median call")
        print(f"{'call':26s} {'slower rank':>11s}  each rank")
        for name in calls:
            slower = np.max([ranks[name] for ranks in every], axis=0)
            each_rank = " ".join(f"{np.median(ranks[name]) * 1e6:.2f}" for ranks in every)
            print(f"{name:26s} {np.median(slower) * 1e6:11.2f}  {each_rank}")


if __name__ == "__main__":
    main()
