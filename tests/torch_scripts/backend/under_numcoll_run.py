"""An unmodified torch.distributed script, as run under ``numcoll run -n N``
(torchrun's environment): ``python under_numcoll_run.py BACKEND``."""

import sys

import torch
import torch.distributed as dist

backend = sys.argv[1]
if "numcoll" in backend:
    import numcoll.torch  # noqa: F401 - registers the backend

dist.init_process_group(backend)
rank, world = dist.get_rank(), dist.get_world_size()
t = torch.full((3,), rank + 1.0)
dist.all_reduce(t)
objs = [None] * world
dist.all_gather_object(objs, {"rank": rank})
dist.barrier()
print(f"{dist.get_backend()} rank {rank}/{world}: {t.tolist()} {objs}", flush=True)
dist.destroy_process_group()
