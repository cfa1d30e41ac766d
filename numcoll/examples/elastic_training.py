"""Data-parallel training that carries on when a rank dies.

The loop of :mod:`numcoll.examples.data_parallel` (a NumPy MLP, gradients
averaged by ``nc.Reducer``), made to survive the loss of a rank: when a step
fails because a peer died, every survivor calls ``nc.shrink_group()`` (the
default group becomes the survivors', renumbered), builds a new Reducer on
it, re-shards the data among the survivors and runs the step again. The
weights were never updated with the failed step's partial gradients, so the
survivors still hold identical weights, and since the shards still cover the
whole batch, training goes on exactly as full-batch training would::

    numcoll run --keep-going -n 4 -m numcoll.examples.elastic_training --kill-rank 2 --kill-step 5

(``--kill-rank R --kill-step S``: rank R SIGKILLs itself in the middle of
step S's backward pass, its bucket allreduces in flight.) Each survivor
prints its final numbering, its loss curve's ends, and how far its weights
are from single-process full-batch training.
"""

from __future__ import annotations

import argparse
import os
import signal
import time

import numpy as np

import numcoll as nc
from numcoll.examples.data_parallel import init_params, loss_and_grads, make_data, train_single

__all__ = ["train_elastic", "main"]


def _shard(n_samples: int):
    rank, world = nc.get_rank(), nc.get_world_size()
    if n_samples % world:
        raise ValueError(f"n_samples ({n_samples}) must divide evenly among {world} ranks")
    return slice(rank * n_samples // world, (rank + 1) * n_samples // world)


def train_elastic(steps: int, sizes: list[int], n_samples: int, lr: float = 0.05,
                  kill_rank: int = -1, kill_step: int = -1):
    """Train on the default group, shrinking it when a rank dies.

    Returns ``(params, losses, shrinks, original_rank)``: ``losses`` are the
    full batch's (averaged over the survivors' shards), one per step.
    """
    original = nc.get_rank()
    x_all, y_all = make_data(n_samples, sizes)
    params = init_params(sizes)
    losses, shrinks, step = [], 0, 0
    while step < steps:
        shard = _shard(n_samples)
        x, y = x_all[shard], y_all[shard]
        reducer = nc.Reducer([np.zeros_like(p) for p in params], bucket_cap_mb=0.01,
                             first_bucket_mb=0.01)
        try:
            while step < steps:
                dying = original == kill_rank and step == kill_step

                def on_ready(i, reducer=reducer, dying=dying):
                    reducer.mark_ready(i)
                    if dying and i == 1:  # halfway through backward: buckets in flight
                        os.kill(os.getpid(), signal.SIGKILL)

                loss = loss_and_grads(params, x, y, reducer.grads, on_ready)
                reducer.finalize()
                total = np.array([loss], np.float64)
                nc.all_reduce(total)
                for p, g in zip(params, reducer.grads):
                    p -= lr * g
                losses.append(float(total[0]) / nc.get_world_size())
                step += 1
        except nc.NumcollError as exc:
            print(f"step {step}: {type(exc).__name__}: {exc}", flush=True)
            start = time.perf_counter()
            nc.shrink_group()
            shrinks += 1
            print(f"step {step}: shrunk to {nc.get_world_size()} ranks in "
                  f"{(time.perf_counter() - start) * 1e3:.0f} ms; this rank is now "
                  f"{nc.get_rank()}", flush=True)
    return params, losses, shrinks, original


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--sizes", default="16,64,64,4", help="layer widths, input first")
    parser.add_argument("--samples", type=int, default=96,
                        help="global batch (divisible by every world size it runs at)")
    parser.add_argument("--kill-rank", type=int, default=-1)
    parser.add_argument("--kill-step", type=int, default=-1)
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    nc.init_process_group()
    try:
        params, losses, shrinks, original = train_elastic(
            args.steps, sizes, args.samples, kill_rank=args.kill_rank,
            kill_step=args.kill_step)
        reference = train_single(args.steps, sizes, args.samples)
        worst = max(float(np.max(np.abs(p - q))) for p, q in zip(params, reference))
        print(f"done: rank {nc.get_rank()} of {nc.get_world_size()} "
              f"(rank {original} before the shrink); "
              f"shrinks {shrinks}; loss {losses[0]:.5f} -> {losses[-1]:.5f}; "
              f"falling {all(b < a for a, b in zip(losses, losses[1:]))}; "
              f"largest difference from full-batch training {worst:.2e}", flush=True)
    finally:
        nc.destroy_process_group()


if __name__ == "__main__":
    main()
