"""Subgroups (new_subgroups, get_process_group_ranks, rank translation) and a
ring exchange with P2POp / batch_isend_irecv, as in torch's documentation."""
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def worker(rank, world_size, port):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = port
    dist.init_process_group("gloo", rank=rank, world_size=world_size)

    cur_subgroup, subgroups = dist.new_subgroups(group_size=2)
    ranks = dist.get_process_group_ranks(cur_subgroup)
    assert ranks == [rank - rank % 2, rank - rank % 2 + 1], ranks
    assert dist.get_group_rank(cur_subgroup, rank) == rank % 2
    assert dist.get_global_rank(cur_subgroup, 0) == ranks[0]
    tensor = torch.ones(1) * rank
    dist.all_reduce(tensor, group=cur_subgroup)
    assert tensor.item() == sum(ranks), tensor

    send_tensor = torch.arange(2, dtype=torch.float32) + 2 * rank
    recv_tensor = torch.randn(2, dtype=torch.float32)
    send_op = dist.P2POp(dist.isend, send_tensor, (rank + 1) % world_size)
    recv_op = dist.P2POp(dist.irecv, recv_tensor, (rank - 1 + world_size) % world_size)
    reqs = dist.batch_isend_irecv([send_op, recv_op])
    for req in reqs:
        req.wait()
    left = (rank - 1) % world_size
    assert recv_tensor.tolist() == [2.0 * left, 2.0 * left + 1], recv_tensor

    inputs = list(torch.arange(world_size, dtype=torch.int64) + 100 * rank)
    inputs = [t.reshape(1) for t in inputs]
    outputs = [torch.empty(1, dtype=torch.int64) for _ in range(world_size)]
    dist.all_to_all(outputs, inputs)
    assert [o.item() for o in outputs] == [100 * r + rank for r in range(world_size)]

    for subgroup in subgroups:
        dist.destroy_process_group(subgroup)
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(worker, args=(4, sys.argv[1]), nprocs=4, join=True)
