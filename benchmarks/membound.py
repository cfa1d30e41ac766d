"""The memory-bandwidth bound of an allreduce on this machine, and how close numcoll gets.

::

    python benchmarks/membound.py              # 2 ranks, 64K,1M,16M,64M
    python benchmarks/membound.py -n 4 --sizes 1M,16M

Ranks are processes (``nc.launch``), one per CPU where they fit (as
``numcoll-bench`` binds them). In interleaved rounds every rank times, on the
same sizes: ``nc.all_reduce`` of a plain array (the arena path), of a shared
array (``nc.zeros_shared``: the peers' arrays read in place), and -- every rank
at once, as during a collective -- a ``np.copyto`` and an ``np.add(a, b,
out=a)`` of one share (S/P bytes). An allreduce must at least reduce P-1
shares into its own and copy P-1 reduced shares from the others, so

    bound time = (P-1) * (add(S/P) + copy(S/P)) * max(1, P / CPUs)

(ranks that outnumber the CPUs take turns), and each path's busbw is printed
with its fraction of the bound's (busbw = 2(P-1)/P * S / time, as numcoll-bench's).
Figures are medians over rounds; the machine's other load counts against all
of them alike.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

import numcoll as nc
from numcoll.bench.sweep import parse_nbytes

ROUNDS = 15


def _body(sizes: list[int]) -> dict:
    rank, size = nc.get_rank(), nc.get_world_size()
    cpus = sorted(os.sched_getaffinity(0))
    if size <= len(cpus):
        os.sched_setaffinity(0, {cpus[rank]})
    out = {}
    for nbytes in sizes:
        count = nbytes // 4
        plain = np.ones(count, np.float32)
        shared = nc.zeros_shared(count, np.float32)
        shared[...] = 1
        a, b = np.ones(count // size, np.float32), np.ones(count // size, np.float32)
        iters = max(3, min(200, (256 << 20) // max(nbytes, 1)))
        steps = {"plain": lambda: nc.all_reduce(plain), "shared": lambda: nc.all_reduce(shared),
                 "copy": lambda: np.copyto(a, b), "add": lambda: np.add(a, b, out=a)}
        times = {k: [] for k in steps}
        for _ in range(ROUNDS):
            for name, step in steps.items():
                nc.barrier()
                t0 = time.perf_counter()
                for _ in range(iters):
                    step()
                times[name].append((time.perf_counter() - t0) / iters)
        out[nbytes] = {k: float(np.median(v)) for k, v in times.items()}
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-n", "--world-size", type=int, default=2)
    parser.add_argument("--sizes", default="64K,1M,16M,64M")
    args = parser.parse_args(argv)
    sizes, n = [parse_nbytes(s) for s in args.sizes.split(",")], args.world_size
    ranks = nc.launch(_body, n, args=(sizes,), mode="process", timeout=1800)
    turns = max(1.0, n / len(os.sched_getaffinity(0)))
    print(f"# allreduce float32, {n} ranks as processes, {len(os.sched_getaffinity(0))} CPUs; "
          "busbw GB/s (fraction of the bound)")
    print(f"{'size(B)':>10} {'bound':>8} {'plain':>14} {'shared':>14} "
          f"{'copy S/P us':>12} {'add S/P us':>11}")
    for nbytes in sizes:
        # The slowest rank's median, as numcoll-bench reports the slowest rank.
        t = {k: max(r[nbytes][k] for r in ranks) for k in ranks[0][nbytes]}
        bound = (n - 1) * (t["add"] + t["copy"]) * turns
        factor = 2 * (n - 1) / n * nbytes / 1e9
        cols = [f"{factor / t[k]:6.2f} ({bound / t[k]:.2f})" for k in ("plain", "shared")]
        print(f"{nbytes:>10} {factor / bound:8.2f} {cols[0]:>14} {cols[1]:>14} "
              f"{t['copy'] * 1e6:12.1f} {t['add'] * 1e6:11.1f}")


if __name__ == "__main__":
    main()
