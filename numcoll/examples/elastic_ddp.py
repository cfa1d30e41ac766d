"""torch DistributedDataParallel that carries on when a rank dies, on numcoll's backend.

Every rank trains a small model with DDP over the ``numcoll`` backend; rank
``--kill-rank`` SIGKILLs itself at step ``--kill-step`` just before its
backward pass, while the others' gradient allreduces are on their way. The
survivors' backward fails; each calls ``numcoll.torch.shrink_group()``,
wraps the model in a new DDP on the survivors' group (which broadcasts rank
0's weights again), re-shards the data and runs the step again::

    numcoll run --keep-going -n 3 -m numcoll.examples.elastic_ddp --kill-rank 2 --kill-step 3
"""

from __future__ import annotations

import argparse
import os
import signal

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import numcoll.torch

__all__ = ["main"]


def _data(samples: int):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(samples, 8, generator=g)
    y = x @ torch.randn(8, 1, generator=g) + 0.1
    return x, y


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--samples", type=int, default=96)
    p.add_argument("--kill-rank", type=int, default=-1)
    p.add_argument("--kill-step", type=int, default=-1)
    args = p.parse_args(argv)
    dist.init_process_group("numcoll")
    original = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    x_all, y_all = _data(args.samples)
    pg = dist.group.WORLD
    ddp = DistributedDataParallel(model, process_group=pg)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses, step, shrinks = [], 0, 0
    while step < args.steps:
        rank, size = pg.rank(), pg.size()
        shard = slice(rank * args.samples // size, (rank + 1) * args.samples // size)
        try:
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(ddp(x_all[shard]), y_all[shard])
            if original == args.kill_rank and step == args.kill_step:
                os.kill(os.getpid(), signal.SIGKILL)
            loss.backward()
            total = loss.detach().clone()
            dist.all_reduce(total, group=pg)
            opt.step()
            losses.append(total.item() / size)
            step += 1
        except RuntimeError as exc:
            print(f"step {step}: {type(exc).__name__}: {exc}", flush=True)
            pg = numcoll.torch.shrink_group(pg)
            shrinks += 1
            ddp = DistributedDataParallel(model, process_group=pg)
    print(f"done: rank {pg.rank()} of {pg.size()} (rank {original} before the shrink); "
          f"shrinks {shrinks}; loss {losses[0]:.5f} -> {losses[-1]:.5f}; "
          f"falling {losses[-1] < losses[0]}", flush=True)
    pg.shutdown()
    if shrinks == 0:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
