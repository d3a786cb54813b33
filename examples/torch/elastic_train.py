"""Elastic Horovod-style training on scikit-learn's digits: workers may come and go.

    pslink launch --min-np 2 --max-np 4 python examples/torch/elastic_train.py
    echo 3 > /tmp/np    # and, for a job that follows a discovery file:
    pslink launch --min-np 2 --max-np 4 --discovery /tmp/np python examples/torch/elastic_train.py

Written as for ``horovod.torch.elastic``; only the import line says pslink. ``state.commit()``
saves the model, the optimizer and the counters and looks for membership changes; when one
happened (a worker joined, left or died), every worker goes back to the last commit, the new
world is settled, the state is broadcast from the worker that got furthest, and ``train``
starts again where the commit left it, with ``hvd.rank()`` and ``hvd.size()`` of the new world.
"""

from __future__ import annotations

import argparse

import torch
from sklearn.datasets import load_digits
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import pslink.torch as hvd


def dataset() -> TensorDataset:
    x, y = load_digits(return_X_y=True)
    return TensorDataset(torch.tensor(x / 16.0, dtype=torch.float32), torch.tensor(y, dtype=torch.int64))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.05, help="per worker: scaled by the number of workers")
    parser.add_argument("--commit-every", type=int, default=5, help="batches between commits")
    args = parser.parse_args()

    hvd.init()
    data = dataset()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9),
                                         named_parameters=model.named_parameters())
    state = hvd.elastic.TorchState(model, optimizer, epoch=0, batch=0)

    def on_reset():
        # Called after every sync: the learning rate follows the number of workers.
        for group in optimizer.param_groups:
            group["lr"] = args.lr * hvd.size()
        if hvd.rank() == 0:
            print(f"world of {hvd.size()} worker(s); resuming at epoch {state.epoch}, batch {state.batch}",
                  flush=True)

    state.register_reset_callbacks([on_reset])

    @hvd.elastic.run
    def train(state) -> float:
        loss, mean = torch.tensor(0.0), float("nan")
        for state.epoch in range(state.epoch, args.epochs):
            # Re-shard every epoch (and after every reset: train starts again here).
            sampler = DistributedSampler(data, num_replicas=hvd.size(), rank=hvd.rank(), shuffle=True, seed=0)
            sampler.set_epoch(state.epoch)
            batches = list(DataLoader(data, batch_size=args.batch_size, sampler=sampler))
            for state.batch in range(state.batch, len(batches)):
                x, y = batches[state.batch]
                optimizer.zero_grad()
                loss = torch.nn.functional.cross_entropy(model(x), y)
                loss.backward()
                optimizer.step()
                if state.batch % args.commit_every == 0:
                    state.commit()
            state.batch = 0
            mean = hvd.allreduce(loss.detach(), name="epoch_loss").item()
            if hvd.rank() == 0:
                print(f"epoch {state.epoch}: loss {mean:.4f} over {hvd.size()} worker(s)", flush=True)
            state.commit()
        return mean

    final = train(state)
    if hvd.rank() == 0:
        print(f"done: loss {final:.4f}")


if __name__ == "__main__":
    main()
