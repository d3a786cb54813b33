"""A DDP worker for tests/torch/test_torch_ddp.py, run by ``pslink launch -n 2``.

    python ddp_worker.py compare SCRATCH   # default gloo all-reduce vs the pslink hook, same data
    python ddp_worker.py mismatch SCRATCH  # ranks whose buckets differ
    python ddp_worker.py kill SCRATCH      # rank 1 dies by SIGKILL in the middle of training
"""

from __future__ import annotations

import copy
import gc
import os
import signal
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import pslink.torch


def _out(conn):
    """The ring a connection sends through (None: none, or no rings on this connection)."""
    return conn.rings.out if conn.rings is not None else None


STEPS = 6


def model(width: int = 64) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(32, width), torch.nn.ReLU(), torch.nn.Linear(width, width), torch.nn.ReLU(),
        torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, 10),
    )


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(16, 32, generator=generator), torch.randint(0, 10, (16,), generator=generator)


def train_step(ddp: DDP, optimizer, step: int, rank: int) -> list[torch.Tensor]:
    optimizer.zero_grad()
    x, y = batch(step, rank)
    torch.nn.functional.cross_entropy(ddp(x), y).backward()
    grads = [p.grad.detach().clone() for p in ddp.parameters()]
    optimizer.step()
    return grads


def compare(rank: int, scratch: str, width: int = 64, bucket_cap_mb: float = 0.02) -> None:
    """The same training twice from the same weights: DDP's own all-reduce, then the hook."""
    base = model(width)
    # Small buckets by default: several per iteration, and DDP rebuilds them after the first one.
    stock = DDP(copy.deepcopy(base), bucket_cap_mb=bucket_cap_mb)
    hooked = DDP(copy.deepcopy(base), bucket_cap_mb=bucket_cap_mb)
    state = pslink.torch.connect()
    hooked.register_comm_hook(state, pslink.torch.comm_hook)
    result = {"stock": [], "hooked": []}
    for name, ddp in (("stock", stock), ("hooked", hooked)):
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
        for step in range(STEPS):
            result[name].append(train_step(ddp, optimizer, step, rank))
        result[name + "_weights"] = [p.detach().clone() for p in ddp.parameters()]
    result["generations"] = dict(state._generations)
    # Whether the buckets crossed to the Aggregators through shared-memory rings (same host).
    result["rings"] = any(link.conn is not None and _out(link.conn) is not None
                          for link in state.agent._requests.links.values())
    torch.save(result, os.path.join(scratch, f"rank{rank}.pt"))
    print(f"rank {rank} done: buckets {sorted(state._generations.items())}")
    del stock, hooked
    state.close()


def compare_large(rank: int, scratch: str) -> None:
    """As ``compare``, with buckets of about 1 MB: large payloads, which cross between processes
    of one host through shared-memory rings."""
    compare(rank, scratch, width=512, bucket_cap_mb=1.0)


def mismatch(rank: int, scratch: str) -> None:
    """Rank 0 splits the gradients into small buckets, rank 1 keeps one: bucket 0 differs."""
    ddp = DDP(model(256), bucket_cap_mb=0.1 if rank == 0 else 25, find_unused_parameters=True)
    ddp.register_comm_hook(pslink.torch.connect(), pslink.torch.comm_hook)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05)
    try:
        train_step(ddp, optimizer, 0, rank)
    except RuntimeError as exc:
        print(f"backward failed: {str(exc).splitlines()[0]}")
    else:
        print("backward succeeded")
    del ddp


def kill(rank: int, scratch: str) -> None:
    ddp = DDP(model())
    ddp.register_comm_hook(pslink.torch.connect(), pslink.torch.comm_hook)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05)
    for step in range(1000):
        if step == 3 and rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        train_step(ddp, optimizer, step, rank)
        print(f"step {step}", flush=True)


def groups(rank: int, scratch: str) -> None:
    """4 workers as 2 groups of 2 (sync="local:T", groups=2): the weights after every step, flat
    (one job), with a global sync every step and every third step. Plain SGD, so that syncing
    every step is the flat job."""
    base = model()
    job = os.environ["PSLINK_JOB"]
    result = {}
    for name, options in (("flat", {}), ("every1", {"sync": "local:1", "groups": 2}),
                          ("every3", {"sync": "local:3", "groups": 2})):
        ddp = DDP(copy.deepcopy(base), bucket_cap_mb=0.02)
        state = pslink.torch.connect(job=f"{job}-{name}", **options)
        ddp.register_comm_hook(state, pslink.torch.comm_hook)
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
        result[name] = []
        for step in range(STEPS):
            train_step(ddp, optimizer, step, rank)
            result[name].append([p.detach().clone() for p in ddp.parameters()])
        result[name + "_job"] = state.agent.job
        del ddp
        state.close()
    torch.save(result, os.path.join(scratch, f"rank{rank}.pt"))


def main() -> None:
    case, scratch = sys.argv[1], sys.argv[2]
    rank, size = int(os.environ["PSLINK_RANK"]), int(os.environ["PSLINK_NUM_WORKERS"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{scratch}/store-{case}", rank=rank, world_size=size)
    try:
        {"compare": compare, "compare-large": compare_large, "mismatch": mismatch, "kill": kill,
         "groups": groups}[case](rank, scratch)
    finally:
        gc.collect()  # no DDP model may outlive the process group (ENVIRONMENT.md)
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
