"""Asynchronous collectives (async_op=True, then work.wait()), gradients and
bfloat16 tensors reduced in place, all_gather / reduce_scatter — the shape of a
hand-written data-parallel step."""
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def worker(rank, world_size, port):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = port
    dist.init_process_group(backend="gloo", init_method="env://", rank=rank,
                            world_size=world_size)
    weights = torch.arange(4.0) if rank == 0 else torch.zeros(4)
    work = dist.broadcast(weights, src=0, async_op=True)
    work.wait()
    assert weights.tolist() == [0.0, 1.0, 2.0, 3.0], weights

    model = torch.nn.Linear(3, 2)
    loss = model(torch.ones(1, 3) * (rank + 1)).sum()
    loss.backward()
    for p in model.parameters():           # average gradients, in place
        dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
        p.grad /= world_size
    grad = model.weight.grad
    assert torch.allclose(grad, torch.full_like(grad, 1.5)), grad

    param = torch.nn.Parameter(torch.ones(3))   # requires_grad, used in place
    dist.all_reduce(param, op=dist.ReduceOp.SUM)
    assert param.detach().tolist() == [2.0, 2.0, 2.0]

    half = torch.full((5,), 0.5 * (rank + 1), dtype=torch.bfloat16)
    pending = dist.all_reduce(half, async_op=True)
    pending.wait()
    assert half.dtype == torch.bfloat16 and half.float().tolist() == [1.5] * 5, half

    outs = [torch.empty(2, dtype=torch.int64) for _ in range(world_size)]
    dist.all_gather(outs, torch.tensor([rank, rank * 10]))
    assert [o.tolist() for o in outs] == [[0, 0], [1, 10]]

    out = torch.empty(2)
    dist.reduce_scatter(out, [torch.full((2,), float(r + rank)) for r in range(world_size)])
    assert out.tolist() == [2.0 * rank + 1] * 2, out
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(worker, args=(2, sys.argv[1]), nprocs=2, join=True)
