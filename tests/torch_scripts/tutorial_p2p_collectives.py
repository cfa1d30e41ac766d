"""Point-to-point and collectives, as in PyTorch's tutorial "Writing Distributed
Applications with PyTorch" (pytorch.org/tutorials/intermediate/dist_tuto.html):
blocking and non-blocking send/recv, all_reduce on a new_group, reduce, gather."""
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def run(rank, size):
    tensor = torch.zeros(1)
    if rank == 0:
        tensor += 1
        dist.send(tensor=tensor, dst=1)          # blocking
    elif rank == 1:
        dist.recv(tensor=tensor, src=0)
    assert tensor[0] == (1 if rank in (0, 1) else 0), tensor

    tensor = torch.zeros(1)
    req = None
    if rank == 0:
        tensor += 2
        req = dist.isend(tensor=tensor, dst=1)    # non-blocking
    elif rank == 1:
        req = dist.irecv(tensor=tensor, src=0)
    if req is not None:
        req.wait()
    assert tensor[0] == (2 if rank in (0, 1) else 0), tensor

    group = dist.new_group([0, 1])
    tensor = torch.ones(1)
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    assert tensor[0] == (2 if rank in (0, 1) else 1), tensor

    t = torch.tensor([rank + 1.0])
    dist.reduce(t, dst=0, op=dist.ReduceOp.MAX)
    if rank == 0:
        assert t[0] == size

    gathered = [torch.zeros(2) for _ in range(size)] if rank == 0 else None
    dist.gather(torch.full((2,), float(rank)), gathered, dst=0)
    if rank == 0:
        assert [int(g[0]) for g in gathered] == list(range(size))
    dist.barrier()


def init_process(rank, size, fn, port, backend="gloo"):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = port
    dist.init_process_group(backend, rank=rank, world_size=size)
    fn(rank, size)
    dist.destroy_process_group()


if __name__ == "__main__":
    size = 3
    mp.spawn(init_process, args=(size, run, sys.argv[1]), nprocs=size, join=True)
