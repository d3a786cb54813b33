"""Horovod-style training on scikit-learn's digits, through pslink.

Written as for ``horovod.torch``; only the import line says pslink. Each worker trains on its
shard; gradients are averaged per parameter name as backward produces them.

    pslink launch -n 2 python examples/torch/train_horovod.py

Every rank starts from different random weights on purpose: ``broadcast_parameters`` makes them
rank 0's. With equal shards the run computes what one process would on the combined batches
(tests/torch/test_torch_examples.py checks exactly that). The data set ships with scikit-learn.
"""

from __future__ import annotations

import argparse

import torch
from rich.progress import Progress
from sklearn.datasets import load_digits
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import pslink.torch as hvd


def datasets() -> tuple[TensorDataset, TensorDataset]:
    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x / 16.0, dtype=torch.float32)
    y = torch.tensor(y, dtype=torch.int64)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    cut = int(0.8 * len(x))
    return TensorDataset(x[order[:cut]], y[order[:cut]]), TensorDataset(x[order[cut:]], y[order[cut:]])


def loader(dataset: TensorDataset, rank: int, size: int, batch_size: int, epoch: int) -> DataLoader:
    """This rank's batches of one epoch (DistributedSampler pads every rank to the same count)."""
    sampler = DistributedSampler(dataset, num_replicas=size, rank=rank, shuffle=True, seed=0)
    sampler.set_epoch(epoch)
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler)


def build_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))


def build_optimizer(model: torch.nn.Module, lr: float) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=32, help="per worker")
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--save", help="write the final weights (state_dict) here, from rank 0")
    return parser.parse_args(argv)


def main() -> None:
    args = parse_args()
    hvd.init()
    torch.set_num_threads(1)
    train, test = datasets()

    model = build_model(seed=hvd.rank())
    optimizer = build_optimizer(model, args.lr)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())

    steps = len(loader(train, hvd.rank(), hvd.size(), args.batch_size, 0))
    with Progress(disable=hvd.rank() != 0) as progress:
        task = progress.add_task("training", total=args.epochs * steps)
        for epoch in range(args.epochs):
            for x, y in loader(train, hvd.rank(), hvd.size(), args.batch_size, epoch):
                optimizer.zero_grad()
                loss = torch.nn.functional.cross_entropy(model(x), y)
                loss.backward()
                optimizer.step()
                progress.update(task, advance=1, description=f"epoch {epoch + 1} loss {loss.item():.3f}")

    with torch.no_grad():
        x, y = test.tensors
        accuracy = (model(x).argmax(1) == y).float().mean()
    accuracy = hvd.allreduce(accuracy, name="accuracy")
    if hvd.rank() == 0:
        print(f"test accuracy {accuracy.item():.3f} (averaged over {hvd.size()} workers)")
        if args.save:
            torch.save(model.state_dict(), args.save)


if __name__ == "__main__":
    main()
