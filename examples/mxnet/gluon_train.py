"""Train a Gluon MLP on scikit-learn's digits with ``kvstore='pslink'``, one worker per process.

    pslink launch -n 2 python examples/mxnet/gluon_train.py

``pslink launch`` starts a parameter service and two workers; each trains on its half of every
combined minibatch, and the service's Aggregators apply momentum SGD (``update_on_kvstore``, the
default) or sum the gradients for each worker's own optimizer (``--update-on-kvstore false``).
``--kvstore pslink_async`` runs asynchronous rounds (as ``dist_async``). Without ``pslink launch``,
``--kvstore local`` trains alone with MXNet's local kvstore on the combined minibatch: the weights
it ends with are those the two workers end with.

The data set (1,797 8x8 images of handwritten digits, UCI ML repository) ships inside
scikit-learn, so this runs offline.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import mxnet as mx
import numpy as np
from mxnet import autograd, gluon

import pslink.mxnet  # noqa: F401  (registers kvstore='pslink' and 'pslink_async')


def load_digits(seed: int = 0):
    """(x_train, y_train, x_test, y_test): an 80/20 split, pixels scaled to [0, 1]."""
    from sklearn.datasets import load_digits as digits

    x, y = digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    y = y.astype(np.float32)
    order = np.random.default_rng(seed).permutation(len(x))
    cut = int(0.8 * len(x))
    return x[order[:cut]], y[order[:cut]], x[order[cut:]], y[order[cut:]]


def build_net(hidden: int, seed: int) -> gluon.nn.HybridSequential:
    """64 -> hidden (ReLU) -> 10, with weights drawn from numpy (the same in every process)."""
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Dense(hidden, activation="relu", in_units=64), gluon.nn.Dense(10, in_units=hidden))
    net.initialize(mx.init.Zero())
    rng = np.random.default_rng(seed)
    for param in net.collect_params().values():
        if param.name.endswith("weight"):
            fan_in = param.shape[1]
            param.set_data(mx.nd.array(rng.standard_normal(param.shape) * np.sqrt(2.0 / fan_in)))
    return net


def make_trainer(net, args):
    """The Trainer, its kvstore given by name (as users write it) or as an instance."""
    if args.optimizer == "sgd":
        optimizer_params = {"learning_rate": args.lr, "momentum": args.momentum, "wd": args.wd}
    else:
        optimizer_params = {"learning_rate": args.lr, "wd": args.wd}
    # MXNet's 'local' name creates no store for one device: pass the instance to use it.
    kvstore = mx.kv.create(args.kvstore) if args.instance or args.kvstore == "local" else args.kvstore
    update_on_kvstore = {"auto": None, "true": True, "false": False}[args.update_on_kvstore]
    # MXNet's 2-bit compression: the Trainer hands it to the store (set_gradient_compression).
    compression = {"type": "2bit", "threshold": args.compression} if args.compression else None
    return gluon.Trainer(net.collect_params(), args.optimizer, optimizer_params, kvstore=kvstore,
                         update_on_kvstore=update_on_kvstore, compression_params=compression)


def accuracy(net, x, y) -> float:
    return float((net(mx.nd.array(x)).argmax(axis=1).asnumpy() == y).mean())


class NoBar:
    """What progress_bar gives the workers that do not show one."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def add_task(self, *args, **kwargs):
        return 0

    def update(self, *args, **kwargs):
        pass


def progress_bar(show: bool):
    if not show:
        return NoBar()
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
    )

    return Progress(
        TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
        TextColumn("loss {task.fields[loss]:.3f}  test acc {task.fields[acc]:.1%}"), TimeElapsedColumn(),
    )


def train(args) -> dict:
    x_train, y_train, x_test, y_test = load_digits(args.seed)
    net = build_net(args.hidden, args.seed)
    trainer = make_trainer(net, args)
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    # The Trainer makes its store at the first step; until then rank and size come from what
    # `pslink launch` sets (alone: rank 0 of 1).
    rank = int(os.environ.get("PSLINK_RANK", 0)) if args.kvstore != "local" else 0
    workers = int(os.environ.get("PSLINK_NUM_WORKERS", 1)) if args.kvstore != "local" else 1
    combined = args.batch_size * workers
    steps = len(x_train) // combined
    first_loss = last_loss = None
    started = time.perf_counter()
    with progress_bar(args.progress and rank == 0) as bar:
        task = bar.add_task("training", total=args.epochs * steps, loss=float("nan"), acc=0.0)
        for epoch in range(args.epochs):
            # Every worker draws the same order; each takes its slice of every combined batch.
            order = np.random.default_rng(args.seed + 1 + epoch).permutation(len(x_train))
            for step in range(steps):
                mine = slice(rank * args.batch_size, (rank + 1) * args.batch_size)
                batch = order[step * combined : (step + 1) * combined][mine]
                x, y = mx.nd.array(x_train[batch]), mx.nd.array(y_train[batch])
                with autograd.record():
                    loss = loss_fn(net(x), y)
                loss.backward()
                # dist_sync sums the workers' gradients: normalize by the combined batch.
                trainer.step(combined)
                last_loss = float(loss.mean().asscalar())
                first_loss = last_loss if first_loss is None else first_loss
                bar.update(task, advance=1, loss=last_loss)
            bar.update(task, acc=accuracy(net, x_test, y_test), description=f"epoch {epoch + 1}/{args.epochs}")
    if args.save_states:
        trainer.save_states(args.save_states.format(rank=rank))
    kv = trainer._kvstore  # what the Trainer made of --kvstore, reported below
    result = {
        "rank": rank,
        "workers": workers,
        "kvstore": kv.type if kv is not None else None,
        "update_on_kvstore": bool(trainer._update_on_kvstore),
        "first_loss": first_loss,
        "last_loss": last_loss,
        "train_accuracy": accuracy(net, x_train, y_train),
        "test_accuracy": accuracy(net, x_test, y_test),
        "steps": args.epochs * steps,
        "seconds": time.perf_counter() - started,
    }
    agent = getattr(kv, "agent", None)  # a pslink store: what its pushes put on the wire
    if agent is not None:
        result["push_bytes_per_step"] = agent.payload_bytes / result["steps"]
    if args.save:
        weights = {f"p{i}": p.data().asnumpy() for i, p in enumerate(net.collect_params().values())}
        np.savez(args.save.format(rank=rank), **weights)
    return result


def parse(argv=None):
    parser = argparse.ArgumentParser(description="Gluon on the digits through the pslink kvstore.")
    parser.add_argument("--kvstore", default="pslink", help="pslink, pslink_async, or local (alone)")
    parser.add_argument("--instance", action="store_true", help="pass mx.kv.create(NAME), not the name")
    parser.add_argument("--update-on-kvstore", choices=["auto", "true", "false"], default="auto")
    parser.add_argument("--optimizer", choices=["sgd", "adam"], default="sgd")
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--wd", type=float, default=0.0)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=32, help="per worker")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--compression", type=float, default=0.0,
                        help="MXNet's 2-bit gradient compression with this threshold (0: off)")
    parser.add_argument("--no-progress", dest="progress", action="store_false")
    parser.add_argument("--save", default=None, help="write the final weights to this .npz file ({rank} is replaced)")
    parser.add_argument("--save-states", default=None,
                        help="write the Trainer's states (optimizer) to this file ({rank} is replaced)")
    parser.add_argument("--result", default=None, help="write the result as JSON to this file ({rank} is replaced)")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse(argv)
    result = train(args)
    if args.result:
        with open(args.result.format(rank=result["rank"]), "w") as f:
            json.dump(result, f)
    print(
        f"rank {result['rank']}: {result['kvstore']}, update_on_kvstore={result['update_on_kvstore']}, "
        f"{result['steps']} steps, loss {result['first_loss']:.3f} -> {result['last_loss']:.3f}, "
        f"train accuracy {result['train_accuracy']:.1%}, test accuracy {result['test_accuracy']:.1%} "
        f"({result['seconds']:.1f} s)",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
