"""A short multi-rank demo: ``python -m numcoll.bench.demo [--world-size 4] [--mode process]``.

Starts local ranks, runs each kind of collective once, checks every result
against the expected value and prints what happened, then times a few
allreduce sizes.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import numcoll as nc


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

    timings = []
    for nbytes in (8, 1 << 20, 16 << 20):
        a = np.ones(nbytes // 4, np.float32)
        nc.all_reduce(a)  # warm-up
        reps = 5
        t0 = time.perf_counter()
        for _ in range(reps):
            nc.all_reduce(a)
        timings.append((nbytes, (time.perf_counter() - t0) / reps))
    return lines, timings, nc.get_default_group().transport_kind


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--mode", choices=("process", "thread"), default="process")
    parser.add_argument("--transport", choices=("tcp", "ipc", "inproc"), default=None)
    ns = parser.parse_args(argv)
    print(f"numcoll {nc.__version__}: starting {ns.world_size} ranks as {ns.mode}es "
          f"(transport: {ns.transport or 'automatic'})")
    t0 = time.perf_counter()
    results = nc.launch(_collectives_tour, ns.world_size, mode=ns.mode, transport=ns.transport,
                        timeout=120)
    lines, timings, transport = results[0]
    print(f"  transport in use: {transport}")
    for line in lines:
        print("  " + line)
    print(f"  every rank agreed ({ns.world_size} ranks checked their results)")
    n = ns.world_size
    print("  allreduce float32 timings on rank 0:")
    for nbytes, seconds in timings:
        busbw = nbytes / seconds * 2 * (n - 1) / n / 1e9 if n > 1 else 0.0
        print(f"    {nbytes:>10,d} B  {seconds * 1e6:10.1f} us  busbw {busbw:6.2f} GB/s")
    print(f"done in {time.perf_counter() - t0:.1f}s")


if __name__ == "__main__":
    main()
