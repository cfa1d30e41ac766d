"""Create and destroy sub-groups on one store, many times: what stays behind.

    python benchmarks/group_churn.py --cycles 10000 [--transport inproc]

Two thread ranks share one store; each cycle makes ``nc.new_group``, runs one
allreduce on it and destroys it. Prints the store's keys and the process's
resident memory after a warm-up and at the end: a destroyed group must leave
no key behind, and the memory must not grow with the number of cycles. The
warm-up fills the flight recorder's ring (``NUMCOLL_FR_BUFFER_SIZE`` records,
two per cycle here), whose bounded size is memory the process keeps by design.
"""

from __future__ import annotations

import argparse
import gc
import time

import numpy as np

import numcoll as nc
from numcoll.api import world as _world


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def churn(cycles: int, warmup: int = 1500) -> dict:
    """On each rank: ``cycles`` create/use/destroy rounds; rank 0 returns what it saw."""
    store = _world._world().store
    x = np.ones(2)

    def rounds(n):
        for _ in range(n):
            g = nc.new_group([0, 1])
            nc.all_reduce(x, group=g)
            nc.destroy_process_group(g)

    rounds(warmup)
    nc.barrier()
    gc.collect()
    keys_before, rss_before = store.num_keys(), _rss_bytes()
    started = time.perf_counter()
    rounds(cycles)
    nc.barrier()
    gc.collect()
    return {"cycles": cycles, "seconds": time.perf_counter() - started,
            "keys_before": keys_before, "keys_after": store.num_keys(),
            "rss_growth_bytes": _rss_bytes() - rss_before}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cycles", type=int, default=10_000)
    parser.add_argument("--transport", default="inproc")
    args = parser.parse_args()
    result = nc.launch(churn, 2, args=(args.cycles,), mode="thread", transport=args.transport,
                       timeout=3600)[0]
    print(f"{result['cycles']} cycles in {result['seconds']:.1f} s: store keys "
          f"{result['keys_before']} -> {result['keys_after']}, resident memory "
          f"{result['rss_growth_bytes'] / 2**20:+.2f} MiB")


if __name__ == "__main__":
    main()
