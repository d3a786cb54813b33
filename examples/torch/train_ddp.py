"""Stock PyTorch DDP training on scikit-learn's digits, gradients averaged by pslink.

The only pslink line is the one marked below: delete it and this is a plain DDP script whose
gradients go through gloo's all-reduce instead.

    pslink launch -n 2 python examples/torch/train_ddp.py             # embedded service
    pslink launch -n 2 --service tcp://HOST:7770 python examples/torch/train_ddp.py

Under torchrun, point it at a running service: ``PSLINK_JOB=digits PSLINK_MASTER=tcp://HOST:7770
torchrun --nproc-per-node 2 examples/torch/train_ddp.py``. The data set (1,797 8x8 images of
handwritten digits) ships with scikit-learn, so this runs offline.
"""

from __future__ import annotations

import argparse
import gc
import os
import tempfile

import torch
import torch.distributed as dist
from rich.progress import Progress
from sklearn.datasets import load_digits
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import pslink.torch


def setup() -> tuple[int, int]:
    """Join the process group: torchrun's variables if set, else those of ``pslink launch``
    (a file store named after the job, which is unique per launch)."""
    if "MASTER_ADDR" in os.environ:
        dist.init_process_group("gloo")
    else:
        rank, size = int(os.environ["PSLINK_RANK"]), int(os.environ["PSLINK_NUM_WORKERS"])
        store = os.path.join(tempfile.gettempdir(), f"{os.environ['PSLINK_JOB']}.store")
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=size)
    return dist.get_rank(), dist.get_world_size()


def datasets() -> tuple[TensorDataset, TensorDataset]:
    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x / 16.0, dtype=torch.float32)
    y = torch.tensor(y, dtype=torch.int64)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    cut = int(0.8 * len(x))
    return TensorDataset(x[order[:cut]], y[order[:cut]]), TensorDataset(x[order[cut:]], y[order[cut:]])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=32, help="per worker")
    parser.add_argument("--lr", type=float, default=0.1)
    args = parser.parse_args()

    torch.set_num_threads(1)
    rank, size = setup()
    train, test = datasets()
    sampler = DistributedSampler(train, num_replicas=size, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(train, batch_size=args.batch_size, sampler=sampler)

    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10)))
    model.register_comm_hook(pslink.torch.connect(), pslink.torch.comm_hook)  # the pslink line
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)

    with Progress(disable=rank != 0) as progress:
        task = progress.add_task("training", total=args.epochs * len(loader))
        for epoch in range(args.epochs):
            sampler.set_epoch(epoch)
            for x, y in loader:
                optimizer.zero_grad()
                loss = torch.nn.functional.cross_entropy(model(x), y)
                loss.backward()
                optimizer.step()
                progress.update(task, advance=1, description=f"epoch {epoch + 1} loss {loss.item():.3f}")

    with torch.no_grad():
        x, y = test.tensors
        accuracy = (model(x).argmax(1) == y).float().mean().item()
    print(f"rank {rank}: test accuracy {accuracy:.3f}")
    del model
    gc.collect()  # DDP must be gone before its process group
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
