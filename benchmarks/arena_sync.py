"""The arena's synchronisation pattern against a dissemination barrier, with no
numcoll Python in the way: which keeps P ranks in step faster?

    python benchmarks/arena_sync.py              # 2, 4 and 8 ranks, 3 runs each
    python benchmarks/arena_sync.py -n 4 --runs 5

A fused small call is one arena step (:mod:`numcoll.collectives.fused_step`):
every rank announces its step on a cache line of its own and then polls all P
announcements at once -- *flat*: one round, P - 1 lines read per rank. A
dissemination barrier (Hensgen, Finkel & Manber, 1988) takes ceil(log2 P)
rounds; in round j rank r announces and waits for rank (r - 2^j) mod P only.
Both loops here are compiled (Numba), run in rank processes over one shared
memory block, and wait as the arena waits: a busy spin of the transport's
spin phase (5 us; none when ranks outnumber CPUs), then ``sched_yield``.
Each run times ``--steps`` barriers of each kind back to back (kinds
interleaved between runs) and reports the time per barrier on rank 0; the
table gives the median and the least of ``--runs`` runs.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
from numba import njit

import numcoll as nc
from transports.shm.ring import (_cpu_relax, _load_acquire, _monotonic_ns, _sched_yield,
                                 _store_release)

#: int64 words per cache line: every announcement on a line of its own.
LINE = 8
#: Most rounds a dissemination barrier of the ranks measured here takes.
ROUNDS = 8


@njit(nogil=True, cache=True, inline="always")
def _wait_for(words, at, value, spin_ns):
    spin_until = _monotonic_ns() + spin_ns
    while _load_acquire(words, at) < value:
        if _monotonic_ns() < spin_until:
            _cpu_relax()
        else:
            _sched_yield()


@njit(nogil=True, cache=True)
def flat(words, rank, size, first, steps, spin_ns):
    """``steps`` arena-style barriers: announce, then wait for all P."""
    for k in range(first, first + steps):
        _store_release(words, rank * LINE, k)
        for q in range(size):
            _wait_for(words, q * LINE, k, spin_ns)


@njit(nogil=True, cache=True)
def dissemination(words, rank, size, first, steps, spin_ns):
    """``steps`` dissemination barriers (announcement lines after the flat ones)."""
    base = size * LINE
    for k in range(first, first + steps):
        j, dist = 0, 1
        while dist < size:
            _store_release(words, base + (j * size + rank) * LINE, k)
            _wait_for(words, base + (j * size + (rank - dist) % size) * LINE, k, spin_ns)
            j += 1
            dist *= 2


def _body(steps: int, runs: int) -> dict:
    import os
    from multiprocessing import resource_tracker, shared_memory

    from numcoll.bench.forms import bind_to_core

    rank, size = nc.get_rank(), nc.get_world_size()
    bound = bind_to_core() is not None
    spin_ns = 5000 if bound else 0  # as the shm transport: no spin with more ranks than CPUs
    nbytes = (1 + ROUNDS) * size * LINE * 8
    names = [None]
    if rank == 0:
        block = shared_memory.SharedMemory(create=True, size=nbytes)
        names[0] = block.name
    nc.broadcast_object_list(names, src=0)
    if rank != 0:
        block = shared_memory.SharedMemory(name=names[0])
        # (Python 3.11 registers an attached block too, and would unlink it at exit)
        resource_tracker.unregister(block._name, "shared_memory")
    try:
        words = np.ndarray(nbytes // 8, np.int64, buffer=block.buf)
        if rank == 0:
            words[:] = 0
        nc.barrier()
        kinds = {"flat (the arena's step)": flat, "dissemination": dissemination}
        first = {name: 1 for name in kinds}
        for name, fn in kinds.items():  # compiled before timing, in step on every rank
            fn(words, rank, size, first[name], 10, spin_ns)
            first[name] += 10
        times: dict[str, list] = {name: [] for name in kinds}
        for run in range(runs):
            order = list(kinds) if run % 2 == 0 else list(reversed(kinds))
            for name in order:
                nc.barrier()
                t0 = time.perf_counter()
                kinds[name](words, rank, size, first[name], steps, spin_ns)
                times[name].append((time.perf_counter() - t0) / steps * 1e6)
                first[name] += steps
        nc.barrier()
        del words
        return {"times": times, "bound": bound, "pid": os.getpid()}
    finally:
        block.close()
        if rank == 0:
            block.unlink()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-n", "--world-size", type=int, action="append",
                        help="ranks (repeatable; default 2, 4 and 8)")
    parser.add_argument("--steps", type=int, default=20000)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args(argv)
    import os
    print(f"# barriers per run: {args.steps}, runs: {args.runs}, CPUs: "
          f"{len(os.sched_getaffinity(0))}; load {os.getloadavg()[0]:.1f}")
    print(f"{'ranks':>5s}  {'kind':28s} {'median us':>10s} {'min us':>8s}")
    for size in args.world_size or [2, 4, 8]:
        got = nc.launch(_body, size, args=(args.steps, args.runs), mode="process",
                        timeout=600)[0]
        for name, values in got["times"].items():
            print(f"{size:5d}  {name:28s} {statistics.median(values):10.2f} {min(values):8.2f}"
                  + ("" if got["bound"] else "  (ranks share CPUs: no spin)"))


if __name__ == "__main__":
    main()
