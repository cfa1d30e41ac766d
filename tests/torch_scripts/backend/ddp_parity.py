"""Unmodified DDP on the numcoll backend against gloo, in one run: the same model,
data and steps under each, in every configuration below; prints one JSON line
of the largest parameter difference per configuration (and gloo's and
numcoll's step counts, to show both trained).

    python ddp_parity.py RANK WORLD_SIZE PORT
"""

import json
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd
from torch.nn.parallel import DistributedDataParallel as DDP

import numcoll.torch  # noqa: F401 - registers the backend

STEPS = 4


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(32, 64)
        self.fc2 = nn.Linear(64, 64)
        self.fc3 = nn.Linear(64, 8)
        self.branch = nn.Linear(64, 8)   # used only in some steps (find_unused_parameters)

    def forward(self, x, use_branch=True):
        h = F.relu(self.fc2(F.relu(self.fc1(x))))
        out = self.fc3(h)
        return out + self.branch(h) if use_branch else out


CONFIGS = {
    "buckets": dict(),
    "find_unused": dict(find_unused_parameters=True, unused=True),
    "bucket_view": dict(gradient_as_bucket_view=True),
    "no_sync": dict(no_sync=True),
    "hook_allreduce": dict(hook="allreduce"),
    "hook_fp16": dict(hook="fp16"),
    # PowerSGD launches its second allreduce from the first one's callback: with
    # several buckets the ranks can launch them in different orders (gloo then
    # aborts on a size mismatch), so it gets one bucket, as torch's own tests do.
    "hook_powersgd": dict(hook="powersgd", bucket_cap_mb=25),
}
# (DDP itself refuses bf16_compress_hook unless CUDA and NCCL are there, whatever the backend.)


def train(group, cfg, rank, world):
    torch.manual_seed(0)
    model = Net()
    ddp = DDP(model, process_group=group,
              bucket_cap_mb=cfg.get("bucket_cap_mb", 0.01),   # ~10 KB: several buckets
              find_unused_parameters=cfg.get("find_unused_parameters", False),
              gradient_as_bucket_view=cfg.get("gradient_as_bucket_view", False))
    hook = cfg.get("hook")
    if hook == "allreduce":
        ddp.register_comm_hook(group, default_hooks.allreduce_hook)
    elif hook == "fp16":
        ddp.register_comm_hook(group, default_hooks.fp16_compress_hook)
    elif hook == "powersgd":
        state = powersgd.PowerSGDState(process_group=group, matrix_approximation_rank=2,
                                       start_powerSGD_iter=2, random_seed=0)
        ddp.register_comm_hook(state, powersgd.powerSGD_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    for step in range(STEPS):
        gen = torch.Generator().manual_seed(1000 * step + rank)
        x, y = torch.randn(16, 32, generator=gen), torch.randn(16, 8, generator=gen)
        use_branch = not cfg.get("unused") or (step + rank) % 2 == 0
        opt.zero_grad()
        if cfg.get("no_sync"):
            with ddp.no_sync():
                F.mse_loss(ddp(x[:8], use_branch), y[:8]).backward()
            F.mse_loss(ddp(x[8:], use_branch), y[8:]).backward()
        else:
            F.mse_loss(ddp(x, use_branch), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def main():
    rank, world, port = map(int, sys.argv[1:4])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=60))
    numcoll_group = dist.new_group(backend="numcoll")
    assert dist.get_backend(numcoll_group) == "numcoll"
    diffs = {}
    for name, cfg in CONFIGS.items():
        gloo = train(dist.group.WORLD, cfg, rank, world)
        ours = train(numcoll_group, cfg, rank, world)
        start = [p.detach() for p in (torch.manual_seed(0), Net())[1].parameters()]
        moved = max((a - b).abs().max().item() for a, b in zip(gloo, start))
        diffs[name] = {"max_diff": max((a - b).abs().max().item() for a, b in zip(gloo, ours)),
                       "moved": moved}
    # every rank must hold the same parameters: compare through the numcoll group
    probe = torch.cat([p.flatten() for p in ours])
    gathered = [torch.empty_like(probe) for _ in range(world)]
    dist.all_gather(gathered, probe, group=numcoll_group)
    diffs["ranks_agree"] = all(torch.equal(g, gathered[0]) for g in gathered)
    print(json.dumps(diffs), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
