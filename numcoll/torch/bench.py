"""numcoll's torch backend beside gloo, measured in one run (docs/performance/index.md).

::

    python -m numcoll.torch.bench                 # 2 and 4 ranks; allreduce and DDP
    python -m numcoll.torch.bench -n 2 --sizes 8,1M,16M --ddp-steps 10

Every rank process makes a gloo group and a numcoll group over the same
store, and times the two alternately, block by block, on the same tensors:

- ``dist.all_reduce(t)`` (float32, blocking, as a user writes it): the median
  over iterations of the slowest rank's time, and bus bandwidth
  (``2 (P-1)/P * bytes / time``, nccl-tests' definition);
- the step of unmodified DDP over a communication-bound model (``--layers``
  linear layers of ``--width`` x ``--width``, batch ``--batch``, SGD,
  ``gradient_as_bucket_view``): the median step time of the slowest rank, and
  the same step without DDP (no communication) for reference.

Ranks are processes on this host, each with one intra-op thread
(``OMP_NUM_THREADS=1``, as torchrun sets).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from datetime import timedelta

__all__ = ["main"]

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def _nbytes(text: str) -> int:
    text = text.strip().upper().rstrip("B")
    unit = text[-1] if text and text[-1] in _UNITS else ""
    return int(float(text[:len(text) - len(unit)]) * _UNITS[unit])


def _iters(nbytes: int) -> int:
    return 2000 if nbytes <= 64 << 10 else 60 if nbytes <= 4 << 20 else 20


def _time_allreduce(dist, tensor, group, iters: int) -> list[float]:
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        dist.all_reduce(tensor, group=group)
        times.append(time.perf_counter() - start)
    return times


def _rank_main(args) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    import numcoll.torch  # noqa: F401 - registers the backend

    rank, world = args.rank, args.world_size
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=rank,
                            world_size=world, timeout=timedelta(minutes=5))
    groups = {"gloo": dist.group.WORLD, "numcoll": dist.new_group(backend="numcoll")}
    result = {"allreduce": {}, "ddp": {}}
    for nbytes in args.sizes:
        tensor = torch.ones(max(1, nbytes // 4))
        iters = _iters(nbytes)
        per = {name: [] for name in groups}
        for _block in range(args.blocks):   # alternate, so both see the same machine
            for name, group in groups.items():
                _time_allreduce(dist, tensor, group, max(2, iters // 10))   # warm-up
                per[name] += _time_allreduce(dist, tensor, group, iters)
        result["allreduce"][nbytes] = per
    if args.ddp_steps:
        torch.manual_seed(0)
        models = {}
        for name, group in groups.items():
            model = nn.Sequential(*[nn.Linear(args.width, args.width)
                                    for _ in range(args.layers)])
            models[name] = (DDP(model, process_group=group,
                                gradient_as_bucket_view=args.bucket_view),
                            torch.optim.SGD(model.parameters(), lr=1e-4))
        # the same model without DDP: what a step costs without communication
        local = nn.Sequential(*[nn.Linear(args.width, args.width) for _ in range(args.layers)])
        models["local"] = (local, torch.optim.SGD(local.parameters(), lr=1e-4))
        groups = dict(groups, local=dist.group.WORLD)
        x = torch.randn(args.batch, args.width)
        per = {name: [] for name in groups}
        for _block in range(args.blocks):
            for name, (ddp, opt) in models.items():
                for step in range(args.ddp_steps + 2):
                    dist.barrier(group=groups[name])
                    start = time.perf_counter()
                    opt.zero_grad()
                    ddp(x).square().mean().backward()
                    opt.step()
                    if step >= 2:   # the first steps build buckets
                        per[name].append(time.perf_counter() - start)
        result["ddp"] = per
    print("RESULT " + json.dumps(result), flush=True)
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(world_size: int, args) -> dict:
    """Launch ``world_size`` ranks; per backend: allreduce medians and DDP step medians."""
    port = str(_free_port())
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "numcoll.torch.bench", "--port", port,
           "--world-size", str(world_size), "--sizes", ",".join(map(str, args.sizes)),
           "--ddp-steps", str(args.ddp_steps), "--layers", str(args.layers),
           "--width", str(args.width), "--batch", str(args.batch), "--blocks", str(args.blocks),
           "--bucket-view" if args.bucket_view else "--no-bucket-view"]
    procs = [subprocess.Popen(cmd + ["--rank", str(r)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in range(world_size)]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=1800)
        if p.returncode:
            raise RuntimeError(f"rank failed:\n{err[-3000:]}")
        outs.append(json.loads([ln for ln in out.splitlines()
                                if ln.startswith("RESULT ")][-1][7:]))
    report = {"allreduce": {}, "ddp": {}}
    for nbytes in args.sizes:
        row = {}
        for name in ("gloo", "numcoll"):
            # the slowest rank's time, iteration by iteration, then the median
            per_iter = zip(*(o["allreduce"][str(nbytes)][name] for o in outs))
            t = statistics.median(max(ts) for ts in per_iter)
            busbw = 2 * (world_size - 1) / world_size * nbytes / t / 1e9
            row[name] = {"time_us": t * 1e6, "busbw_GBs": busbw}
        report["allreduce"][nbytes] = row
    if args.ddp_steps:
        for name in ("gloo", "numcoll", "local"):
            steps = zip(*(o["ddp"][name] for o in outs))
            report["ddp"][name] = statistics.median(max(ts) for ts in steps) * 1e3
    return report


def _print(world_size: int, report: dict) -> None:
    print(f"\n{world_size} ranks: dist.all_reduce, float32, blocking (median of the slowest rank)")
    print(f"{'bytes':>10} {'gloo us':>10} {'numcoll us':>11} {'time ratio':>10} "
          f"{'gloo GB/s':>10} {'numcoll GB/s':>12} {'busbw ratio':>11}")
    for nbytes, row in report["allreduce"].items():
        g, n = row["gloo"], row["numcoll"]
        print(f"{nbytes:>10} {g['time_us']:>10.1f} {n['time_us']:>11.1f} "
              f"{n['time_us'] / g['time_us']:>10.2f} {g['busbw_GBs']:>10.3f} "
              f"{n['busbw_GBs']:>12.3f} {n['busbw_GBs'] / g['busbw_GBs']:>11.2f}")
    if report["ddp"]:
        g, n = report["ddp"]["gloo"], report["ddp"]["numcoll"]
        local = report["ddp"]["local"]
        print(f"DDP step: gloo {g:.1f} ms, numcoll {n:.1f} ms: {g / n:.2f}x faster "
              f"(the same step without DDP: {local:.1f} ms)")


def main(argv=None) -> None:
    """The command line: without ``--rank``, launch the ranks and print the tables."""
    p = argparse.ArgumentParser(prog="python -m numcoll.torch.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-n", "--world-sizes", default="2,4", help="comma-separated (default 2,4)")
    p.add_argument("--sizes", default="8,1M,16M", help="allreduce sizes in bytes")
    p.add_argument("--ddp-steps", type=int, default=10, help="timed DDP steps per block (0: none)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--bucket-view", action=argparse.BooleanOptionalAction, default=True,
                   help="DDP's gradient_as_bucket_view (default on)")
    p.add_argument("--blocks", type=int, default=3,
                   help="alternating blocks per backend (default 3)")
    p.add_argument("--json", action="store_true", help="print the reports as JSON too")
    p.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    p.add_argument("--world-size", type=int, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.sizes = [_nbytes(s) for s in str(args.sizes).split(",")]
    if args.rank is not None:
        _rank_main(args)
        return
    for world_size in (int(w) for w in args.world_sizes.split(",")):
        report = run(world_size, args)
        _print(world_size, report)
        if args.json:
            print(json.dumps({"world_size": world_size, **report}))


if __name__ == "__main__":
    main()
