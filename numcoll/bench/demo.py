"""A short multi-rank demo: ``python -m numcoll.demo [--world-size 4] [--mode process]
[--transport shm]``.

Starts local ranks, runs each kind of collective once, checks every result
against the expected value and prints what happened, then times allreduce at
8 B, 1 MiB and 16 MiB warm: after a few untimed calls, each timed call is the
slowest rank's, and the figure is the median over the calls (as
``numcoll-bench`` times them).
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

import numcoll as nc

from .cli import add_rank_arguments, check_rank_arguments
from .runners import numcoll_rank
from .sweep import format_nbytes, make_plan, summarize

#: Timed sizes and the calls timed at each (after WARMUP untimed ones).
TIMED = ((8, 200), (1 << 20, 40), (16 << 20, 10))
WARMUP = 5


def _collectives_tour() -> list[str]:
    rank, size = nc.get_rank(), nc.get_world_size()
    lines = []

    def check(what: str, ok: bool, detail: str) -> None:
        if not ok:
            raise AssertionError(f"rank {rank}: {what} gave a wrong result: {detail}")
        lines.append(f"{what:<24} ok  {detail}")

    x = np.full(5, rank + 1, dtype=np.float32)
    nc.all_reduce(x)
    check("all_reduce(SUM)", np.all(x == size * (size + 1) / 2), f"-> {x[0]:g} everywhere")

    h = np.full(3, 0.1 * (rank + 1), dtype=np.float16)
    nc.all_reduce(h, op=nc.ReduceOp.MAX)
    check("all_reduce(MAX, fp16)", np.all(h == np.float16(0.1 * size)), f"-> {h[0]}")

    b = np.arange(4, dtype=np.int64) * (rank == 0)
    nc.broadcast(b, src=0)
    check("broadcast", np.array_equal(b, np.arange(4)), f"-> {b.tolist()}")

    parts = [np.empty(2, np.int32) for _ in range(size)]
    nc.all_gather(parts, np.full(2, rank, np.int32))
    check("all_gather", all(np.all(p == r) for r, p in enumerate(parts)),
          f"-> {[int(p[0]) for p in parts]}")

    out = np.empty(3, np.float64)
    nc.reduce_scatter_tensor(out, np.arange(3 * size, dtype=np.float64))
    expect = np.arange(3 * rank, 3 * rank + 3) * size
    check("reduce_scatter_tensor", np.array_equal(out, expect), f"-> {out.tolist()}")

    recv = np.empty(size, np.int32)
    nc.all_to_all_single(recv, np.full(size, rank, np.int32))
    check("all_to_all_single", np.array_equal(recv, np.arange(size)), f"-> {recv.tolist()}")

    nc.barrier()
    lines.append(f"{'barrier':<24} ok")
    timings = [numcoll_rank(plan) for plan in _timing_plans(size)]
    return lines, timings, nc.get_default_group().transport_kind


def _timing_plans(world_size: int) -> list:
    """One plan per timed size (each with its own number of calls)."""
    return [make_plan("allreduce", [nbytes], world_size=world_size, iters=iters,
                      warmup=WARMUP) for nbytes, iters in TIMED]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m numcoll.demo",
                                     description=__doc__.splitlines()[0])
    add_rank_arguments(parser, world_size=4)
    return parser


def main(argv=None) -> int:
    """Entry point of ``numcoll-demo`` / ``python -m numcoll.demo``."""
    parser = build_parser()
    ns = parser.parse_args(argv)
    check_rank_arguments(parser, ns)
    print(f"numcoll {nc.__version__}: starting {ns.world_size} ranks as {ns.mode}es "
          f"(transport: {ns.transport or 'automatic'})")
    t0 = time.perf_counter()
    results = nc.launch(_collectives_tour, ns.world_size, mode=ns.mode, transport=ns.transport,
                        timeout=300)
    lines, _, transport = results[0]
    print(f"  transport in use: {transport}")
    for line in lines:
        print("  " + line)
    print(f"  every rank agreed ({ns.world_size} ranks checked their results)")
    print(f"  allreduce float32, warm: median over the calls of the slowest rank's time "
          f"({WARMUP} untimed calls first)")
    wrong = 0
    for i, plan in enumerate(_timing_plans(ns.world_size)):
        row = summarize(plan, [r[1][i]["times"] for r in results],
                        rank_wrong=[r[1][i]["wrong"] for r in results],
                        algorithms=results[0][1][i]["algorithms"])[0]
        wrong += row["wrong"] or 0
        busbw = f"busbw {row['busbw_gbps']:6.2f} GB/s" if ns.world_size > 1 else ""
        print(f"    {format_nbytes(row['size']):>7}  {row['time_us']:10.1f} us  "
              f"(min {row['time_us_min']:.1f}, {plan.cases[0].iters} calls)  {busbw}  "
              f"{row['algorithm']}")
    if wrong:
        print(f"numcoll demo: {wrong} wrong result elements in the timed allreduces",
              file=sys.stderr)
        return 1
    print(f"done in {time.perf_counter() - t0:.1f}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
