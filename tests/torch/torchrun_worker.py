"""A worker for tests/torch/test_torchrun.py: DDP on the ``pslink`` backend under torchrun.

    torchrun ... torchrun_worker.py fail SCRATCH  # rank 1 of the first attempt dies at step 2

Each attempt resumes from the checkpoint the last one left (torchrun's contract: it restarts every
worker of the group, with a new group) and writes what it saw to SCRATCH/attempt{N}-rank{R}.pt.
"""

from __future__ import annotations

import datetime
import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import pslink.torch  # noqa: F401 - registers the backend

STEPS = 4


def main() -> None:
    mode, scratch = sys.argv[1], sys.argv[2]
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    dist.init_process_group("pslink", timeout=datetime.timedelta(seconds=30))
    rank, size = dist.get_rank(), dist.get_world_size()
    checkpoint = os.path.join(scratch, "checkpoint.pt")
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    start = 0
    if os.path.exists(checkpoint):
        saved = torch.load(checkpoint)
        model.load_state_dict(saved["model"])
        start = saved["step"]
    net = DDP(model)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    step = start
    while step < start + STEPS:
        if mode == "fail" and attempt == 0 and rank == 1 and step == 2:
            os._exit(3)  # a crash: torchrun restarts the group
        g = torch.Generator().manual_seed(step * 10 + rank)
        optimizer.zero_grad()
        net(torch.randn(8, 4, generator=g)).pow(2).sum().backward()
        optimizer.step()
        step += 1
        if rank == 0:
            torch.save({"model": model.state_dict(), "step": step}, checkpoint + ".tmp")
            os.replace(checkpoint + ".tmp", checkpoint)
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)
    torch.save({"attempt": attempt, "size": size, "job": dist.group.WORLD.agent.job, "sum": total.item(),
                "weight": model.weight.detach().clone()},
               os.path.join(scratch, f"attempt{attempt}-rank{rank}.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
