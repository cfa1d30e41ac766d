"""The object collectives, as torch.distributed's documentation shows them
(all_gather_object, broadcast_object_list, gather_object, scatter_object_list,
send_object_list / recv_object_list)."""
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def worker(rank, world_size, port):
    os.environ["MASTER_ADDR"] = "localhost"
    os.environ["MASTER_PORT"] = port
    dist.init_process_group("gloo", rank=rank, world_size=world_size)

    gather_objects = ["foo", 12, {1: 2}]
    output = [None for _ in gather_objects]
    dist.all_gather_object(output, gather_objects[dist.get_rank()])
    assert output == ["foo", 12, {1: 2}], output

    if dist.get_rank() == 0:
        objects = ["foo", 12, {1: 2}]
    else:
        objects = [None, None, None]
    dist.broadcast_object_list(objects, src=0)
    assert objects == ["foo", 12, {1: 2}], objects

    out = [None] * world_size if rank == 0 else None
    dist.gather_object({"rank": rank, "t": torch.arange(rank + 1)}, out, dst=0)
    if rank == 0:
        assert [o["rank"] for o in out] == [0, 1, 2]
        assert out[2]["t"].tolist() == [0, 1, 2]

    scattered = [None]
    inputs = [f"to{r}" for r in range(world_size)] if rank == 1 else None
    dist.scatter_object_list(scattered, inputs, src=1)
    assert scattered == [f"to{rank}"], scattered

    if rank == 0:
        dist.send_object_list(["hello", 2.5], dst=2)
    elif rank == 2:
        got = [None, None]
        dist.recv_object_list(got, src=0)
        assert got == ["hello", 2.5], got
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(worker, args=(3, sys.argv[1]), nprocs=3, join=True)
