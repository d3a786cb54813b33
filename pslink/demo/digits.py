"""Data-parallel training of a small MLP on scikit-learn's digits, through the parameter service.

Every worker trains on its own shard of the training set; after each minibatch the gradients
are averaged across workers by the service (``sum`` mode, the optimizer steps locally) or the
service applies momentum SGD itself and hands back weights (``optimizer`` mode). Run one worker
per process, e.g. ``examples/numpy/train_digits.py``, or everything at once with ``pslink demo``.

The data set (1,797 8x8 images of handwritten digits, UCI ML repository) ships inside
scikit-learn, so this runs offline.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

from pslink.core.agent import Agent
from pslink.core.worker.connect import connect
from pslink.errors import ConfigError, PslinkError

LEARNING_RATE = 0.1
MOMENTUM = 0.9


def load_data(seed: int = 0):
    """(x_train, y_train, x_test, y_test): 80/20 split of the digits, pixels scaled to [0, 1]."""
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise ConfigError(
            "the digits demo needs scikit-learn (its data set ships with it): pip install 'pslink[demo]'"
        ) from None
    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    order = np.random.default_rng(seed).permutation(len(x))
    cut = int(0.8 * len(x))
    return x[order[:cut]], y[order[:cut]], x[order[cut:]], y[order[cut:]]


class MLP:
    """64 -> hidden (ReLU) -> 10 (softmax), with hand-written backpropagation."""

    def __init__(self, hidden: int = 64, seed: int = 0):
        rng = np.random.default_rng(seed)
        self.params = {
            "w1": (rng.standard_normal((64, hidden)) * np.sqrt(2.0 / 64)).astype(np.float32),
            "b1": np.zeros(hidden, np.float32),
            "w2": (rng.standard_normal((hidden, 10)) * np.sqrt(1.0 / hidden)).astype(np.float32),
            "b2": np.zeros(10, np.float32),
        }

    def logits(self, x: np.ndarray) -> np.ndarray:
        p = self.params
        return np.maximum(x @ p["w1"] + p["b1"], 0.0) @ p["w2"] + p["b2"]

    def loss_and_grads(self, x: np.ndarray, y: np.ndarray) -> tuple[float, dict]:
        p = self.params
        pre = x @ p["w1"] + p["b1"]
        hidden = np.maximum(pre, 0.0)
        logits = hidden @ p["w2"] + p["b2"]
        logits -= logits.max(axis=1, keepdims=True)
        probs = np.exp(logits)
        probs /= probs.sum(axis=1, keepdims=True)
        loss = float(-np.log(probs[np.arange(len(y)), y] + 1e-12).mean())
        dlogits = probs
        dlogits[np.arange(len(y)), y] -= 1.0
        dlogits /= len(y)
        dhidden = (dlogits @ p["w2"].T) * (pre > 0)
        grads = {
            "w1": x.T @ dhidden,
            "b1": dhidden.sum(axis=0),
            "w2": hidden.T @ dlogits,
            "b2": dlogits.sum(axis=0),
        }
        return loss, {k: v.astype(np.float32) for k, v in grads.items()}

    def accuracy(self, x: np.ndarray, y: np.ndarray) -> float:
        return float((self.logits(x).argmax(axis=1) == y).mean())


def train(agent: Agent, epochs: int = 15, batch_size: int = 32, hidden: int = 64,
          progress: bool = True, seed: int = 0, groups=None, shard: tuple[int, int] | None = None) -> dict:
    """Train with ``agent``'s job; returns the test accuracy and a checksum of the weights
    (equal on every worker, since all apply the same averaged updates). With ``groups`` (a
    :class:`~pslink.core.worker.groups.GroupSync`; ``agent`` is then the group's own job) the weights
    are averaged over the groups every T steps; ``shard``: (this worker's index, workers) over
    the whole data set (default: the agent's rank and workers)."""
    x_train, y_train, x_test, y_test = load_data(seed)
    model = MLP(hidden, seed + agent.rank)  # rank 0's initial weights win, below
    names = list(model.params)
    params = [model.params[n] for n in names]
    agent.init_many(names, params).wait()
    agent.pull_many(names, outs=params).wait()  # every worker now starts from rank 0's weights

    index, count = shard or (agent.rank, agent.num_workers)
    shard = np.arange(index, len(x_train), count)
    steps = (len(x_train) // count) // batch_size  # equal on all workers: BSP rounds
    server_side = agent.mode == "optimizer"
    velocity = {n: np.zeros_like(model.params[n]) for n in names}
    rng = np.random.default_rng(seed + 1000 + agent.rank)
    bar = _progress(progress and agent.rank == 0, epochs * steps)
    loss = float("nan")
    history = []  # (seconds, test accuracy) at the end of each epoch
    started = time.perf_counter()
    with bar:
        task = bar.add_task("training", total=epochs * steps, loss=loss, acc=0.0)
        for epoch in range(epochs):
            rng.shuffle(shard)
            for step in range(steps):
                batch = shard[step * batch_size : (step + 1) * batch_size]
                loss, grads = model.loss_and_grads(x_train[batch], y_train[batch])
                grad_list = [grads[n] for n in names]
                if server_side:
                    # The Aggregators apply momentum SGD; what comes back are the new weights.
                    agent.pushpull_many(names, grad_list, outs=params).wait()
                else:
                    agent.pushpull_many(names, grad_list, outs=grad_list, average=True).wait()
                    for n, g in zip(names, grad_list):
                        velocity[n] *= MOMENTUM
                        velocity[n] += g
                        model.params[n] -= LEARNING_RATE * velocity[n]
                if groups is not None:
                    groups.step(model.params)
                bar.update(task, advance=1, loss=loss)
            accuracy = model.accuracy(x_test, y_test)
            history.append((time.perf_counter() - started, accuracy))
            bar.update(task, acc=accuracy, description=f"epoch {epoch + 1}/{epochs}")
    checksum = float(sum(float(np.abs(model.params[n]).sum()) for n in names))
    return {
        "rank": agent.rank,
        "accuracy": model.accuracy(x_test, y_test),
        "loss": loss,
        "checksum": checksum,
        "seconds": time.perf_counter() - started,
        "rounds": epochs * steps,
        "history": history,
        "host_role": agent.host_role,
    }


class _NoBar:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def add_task(self, *args, **kwargs):
        return 0

    def update(self, *args, **kwargs):
        pass


def _progress(show: bool, total: int):
    if not show:
        return _NoBar()
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("loss {task.fields[loss]:.3f}  test acc {task.fields[acc]:.1%}"),
        TimeElapsedColumn(),
    )


def optimizer_settings() -> dict:
    return {"type": "sgd", "lr": LEARNING_RATE, "momentum": MOMENTUM}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="One worker of the digits demo (pslink settings from PSLINK_* too).")
    parser.add_argument("--job", default=None, help="job name (PSLINK_JOB)")
    parser.add_argument("--rank", type=int, default=None, help="this worker's rank (PSLINK_RANK)")
    parser.add_argument("--num-workers", type=int, default=None, help="workers in the job (PSLINK_NUM_WORKERS)")
    parser.add_argument("--master", default=None, help="pMaster address (PSLINK_MASTER)")
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--mode", choices=["sum", "optimizer"], default="sum",
                        help="sum: average gradients, step locally; optimizer: the service steps")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--result", default=None, help="write the result as JSON to this file ({rank}: the rank)")
    args = parser.parse_args(argv)
    options = {"optimizer": optimizer_settings()} if args.mode == "optimizer" else {}
    try:
        with connect(args.job, args.rank, args.num_workers, args.master, **options) as agent:
            result = train(agent, epochs=args.epochs, progress=not args.no_progress)
    except PslinkError as exc:  # it names what to fix: no traceback from inside pslink
        print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        return 1
    if args.result:
        with open(args.result.replace("{rank}", str(result["rank"])), "w") as f:
            json.dump(result, f)
    print(f"rank {result['rank']}: test accuracy {result['accuracy']:.1%} after {result['rounds']} rounds "
          f"({result['seconds']:.1f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
