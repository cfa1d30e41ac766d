"""Allreduce across hosts, on the cable: bytes per direction and time, for
numcoll's two-level and flat ring algorithms and torch's gloo, side by side.

``python -m numcoll.bench.cable`` (root, iproute2; ``--help``) makes hosts
out of Linux network namespaces (:mod:`numcoll.testing.netns`), each host's
cable a veth pair to one bridge, optionally limited with a token bucket
(``tc qdisc ... tbf``, ``--rate 1gbit``, both directions of every cable).
Each rank runs numcoll and, where torch is installed, torch.distributed's
gloo in the same process, and the methods take turns every iteration, in
rotating order (so a busy machine slows them alike). Per iteration and method: a barrier, host
0's cable counters (its ``eth0``'s, as /sys/class/net/eth0/statistics), a
barrier, the allreduce timed on every rank, a barrier, the counters again.
The time is from the first rank's start to the last rank's end; the table
gives the median (and the fastest) over iterations, and the bytes host 0
sent and received per allreduce in units of the payload.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from datetime import timedelta

__all__ = ["measure", "main"]

METHODS = ("twolevel", "twolevel_lanes", "ring", "gloo")


def _counters() -> tuple[int, int]:
    base = "/sys/class/net/eth0/statistics/"
    with open(base + "tx_bytes") as tx, open(base + "rx_bytes") as rx:
        return int(tx.read()), int(rx.read())


def worker(nbytes: int, iterations: int, methods: list[str]) -> None:
    """One rank (under torchrun's variables): run the methods in turn, and
    on rank 0 print one JSON line of every rank's records."""
    import numpy as np

    import numcoll as nc

    nc.init_process_group(timeout=timedelta(seconds=300))
    pg = nc.get_default_group()
    rank, size = pg.rank(), pg.size()
    x = np.ones(nbytes // 4, np.float32)
    runs = {}
    for method in methods:
        if method == "gloo":
            import torch
            import torch.distributed as dist

            dist.init_process_group(
                "gloo", init_method=f"tcp://{os.environ['MASTER_ADDR']}:"
                f"{os.environ['GLOO_PORT']}", rank=rank, world_size=size,
                timeout=timedelta(seconds=300))
            t = torch.ones(nbytes // 4, dtype=torch.float32)
            runs[method] = lambda t=t, dist=dist: dist.all_reduce(t)
        else:
            opts = nc.AllreduceOptions(algorithm=method)
            runs[method] = lambda opts=opts: pg.allreduce(x, opts).wait()
    for run in runs.values():  # warm: connections made, kernels compiled
        run()
        run()
    records: dict[str, list] = {m: [] for m in methods}
    order = list(runs.items())
    for i in range(iterations):
        # Each method follows each other in turn: none always runs right
        # after gloo's, or first.
        for method, run in order[i % len(order):] + order[:i % len(order)]:
            pg.barrier().wait()
            before = _counters() if rank == 0 else (0, 0)
            pg.barrier().wait()  # nobody sends before that read
            start = time.time()
            run()
            end = time.time()
            pg.barrier().wait()
            after = _counters() if rank == 0 else (0, 0)
            records[method].append((start, end, after[0] - before[0], after[1] - before[1]))
    gathered = [None] * size
    nc.all_gather_object(gathered, records)
    if rank == 0:
        print("RESULT " + json.dumps({"transport": pg.transport_kind, "ranks": gathered}),
              flush=True)
    if "gloo" in runs:
        import torch.distributed as dist

        dist.destroy_process_group()
    nc.destroy_process_group()


def _summarise(ranks: list[dict], nbytes: int) -> dict:
    out = {}
    for method in ranks[0]:
        per_iteration = list(zip(*(r[method] for r in ranks)))
        times = [max(e for _, e, _, _ in it) - min(s for s, _, _, _ in it)
                 for it in per_iteration]
        tx = [it[0][2] / nbytes for it in per_iteration]  # rank 0 read the counters
        rx = [it[0][3] / nbytes for it in per_iteration]
        out[method] = {"median_ms": statistics.median(times) * 1e3,
                       "min_ms": min(times) * 1e3, "tx": statistics.median(tx),
                       "rx": statistics.median(rx)}
    return out


def measure(layout: list[int], nbytes: int = 16 << 20, iterations: int = 10,
            methods=METHODS, rate: str | None = "1gbit", port: int = 29700) -> dict:
    """Run the methods on ranks placed on hosts ``layout`` (rank r on host
    ``layout[r]``; rank 0 on host 0); their summaries, by method."""
    from ..testing.netns import Hosts

    n = len(layout)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with Hosts(max(layout) + 1) as hosts:
        if rate:
            for h in range(max(layout) + 1):
                hosts.limit(h, rate)
        procs = []
        for r, h in enumerate(layout):
            local = [q for q in range(n) if layout[q] == h]
            env = dict(os.environ, PYTHONPATH=os.pathsep.join(
                [root, *filter(None, [os.environ.get("PYTHONPATH")])]),
                RANK=str(r), WORLD_SIZE=str(n), LOCAL_RANK=str(local.index(r)),
                LOCAL_WORLD_SIZE=str(len(local)), MASTER_ADDR=hosts.addrs[0],
                MASTER_PORT=str(port), GLOO_PORT=str(port + 1), GLOO_SOCKET_IFNAME="eth0")
            procs.append(hosts.popen(h, [sys.executable, "-m", "numcoll.bench.cable",
                                         "--worker", "--nbytes", str(nbytes),
                                         "--iterations", str(iterations),
                                         "--methods", ",".join(methods)], env))
        outputs = []
        try:
            for p in procs:
                outputs.append(p.communicate(timeout=600))
        finally:
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, 9)
                    p.wait()
        for r, (p, (out, err)) in enumerate(zip(procs, outputs)):
            if p.returncode != 0:
                raise RuntimeError(f"rank {r} failed ({p.returncode}):\n{out}\n{err}")
        line = next(x for x in outputs[0][0].splitlines() if x.startswith("RESULT "))
        result = json.loads(line[len("RESULT "):])
    return {"transport": result["transport"], **_summarise(result["ranks"], nbytes)}


def _layout(text: str) -> list[int]:
    """"2x3" (2 hosts of 3 ranks) or "3+1" (ranks per host) as rank -> host."""
    if "x" in text:
        hosts, per = (int(v) for v in text.split("x"))
        counts = [per] * hosts
    else:
        counts = [int(v) for v in text.split("+")]
    return [h for h, c in enumerate(counts) for _ in range(c)]


def _torch_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("torch") is not None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m numcoll.bench.cable",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--layouts", default="2x2,2x3",
                        help="host layouts: 2x3 = 2 hosts of 3 ranks, 3+1 = ranks per host")
    parser.add_argument("--nbytes", type=lambda v: int(v, 0), default=16 << 20)
    parser.add_argument("--iterations", type=int, default=10)
    parser.add_argument("--rate", default="1gbit",
                        help="tc tbf rate of every cable, both ways; 'none' for no limit")
    parser.add_argument("--methods", default=None,
                        help=f"comma-separated, of {', '.join(METHODS)} (gloo needs torch)")
    parser.add_argument("--json", default=None, help="write the summaries here")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    methods = (args.methods.split(",") if args.methods else
               [m for m in METHODS if m != "gloo" or _torch_installed()])
    if args.worker:
        worker(args.nbytes, args.iterations, methods)
        return 0
    rate = None if args.rate == "none" else args.rate
    summaries = {}
    print(f"allreduce of {args.nbytes / 2**20:g} MiB float32, {args.iterations} iterations, "
          f"cable {'unlimited' if rate is None else rate}; bytes: host 0's cable per "
          "allreduce / payload")
    print(f"{'layout':8} {'method':15} {'median ms':>10} {'min ms':>8} {'vs ring':>8} "
          f"{'vs gloo':>8} {'sent':>6} {'recv':>6}")
    for i, text in enumerate(args.layouts.split(",")):
        try:
            found = measure(_layout(text), args.nbytes, args.iterations, methods, rate,
                            port=29700 + 10 * i)
        except subprocess.CalledProcessError as exc:
            print(f"{text}: cannot limit the cable here (tc tbf): {exc.stderr}")
            return 1
        summaries[text] = found
        for method in methods:
            row = found[method]
            ring = found.get("ring", {}).get("median_ms")
            gloo = found.get("gloo", {}).get("median_ms")
            vs = [f"{row['median_ms'] / ref:8.2f}" if ref else f"{'-':>8}" for ref in (ring, gloo)]
            print(f"{text:8} {method:15} {row['median_ms']:10.1f} {row['min_ms']:8.1f} "
                  f"{vs[0]} {vs[1]} {row['tx']:6.3f} {row['rx']:6.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summaries, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
