"""A click-through-rate model (embeddings + MLP) on synthetic click data, its embedding table on
the parameter service: one line switches it (``--embedding service`` or ``local``).

    pslink launch -n 2 python examples/torch/ctr.py --embedding service
    pslink launch -n 2 python examples/torch/ctr.py --embedding local

The data are made on the fly (no download): each example has ``--fields`` categorical features,
each an id drawn from a Zipf law over ``--vocabulary`` ids of its field (a few ids are frequent,
most are rare, as in click logs), and is clicked with probability sigmoid(sum of a hidden weight
per id + a bias): a logistic model with one hidden number per id, which the embeddings must learn.
Every worker draws its own examples. The MLP is averaged with the Horovod API
(``hvd.DistributedOptimizer``); the embedding table is either ``pslink.torch.Embedding`` (rows on
the service, only the batch's rows travel, Adagrad on the service) or ``torch.nn.Embedding`` in
every worker (its whole gradient averaged every step, as a job without a parameter server does).
Prints the held-out AUC and the time per step; ``--alone`` trains each worker by itself, with no
communication at all (the speed limit, run side by side so that the workers share the CPUs alike).
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

import pslink.torch as hvd
from pslink.core.tables import initial_rows


class ClickData:
    """Synthetic clicks: ids per field from a Zipf law, labels from a hidden logistic model."""

    def __init__(self, fields: int, vocabulary: int, seed: int):
        self.fields, self.vocabulary = fields, vocabulary
        self.rng = np.random.default_rng(seed)
        every_id = np.arange(fields * vocabulary, dtype=np.uint64)
        # The hidden weight of each id: a function of the id only (the same on every worker).
        self.truth = initial_rows(every_id, 1, np.dtype(np.float64), ["normal", 0.0, 1.0], seed=12345)[:, 0]

    def batch(self, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        local = (self.rng.zipf(1.2, (size, self.fields)) - 1) % self.vocabulary
        ids = local + np.arange(self.fields) * self.vocabulary  # one id space, a range per field
        clicks = self.rng.random(size) < 1 / (1 + np.exp(-self.logit(ids)))
        return torch.from_numpy(ids.astype(np.int64)), torch.from_numpy(clicks.astype(np.float32))

    def logit(self, ids: np.ndarray) -> np.ndarray:
        """The hidden model's logit: what a perfect learner would score."""
        return self.truth[ids].sum(1) / np.sqrt(self.fields) - 0.5


class CTRModel(torch.nn.Module):
    def __init__(self, embedding: torch.nn.Module, fields: int, dim: int):
        super().__init__()
        self.embedding = embedding
        self.mlp = torch.nn.Sequential(torch.nn.Linear(fields * dim, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.embedding(ids).flatten(1)).squeeze(1)


def auc(labels: np.ndarray, scores: np.ndarray) -> float:
    """Area under the ROC curve: the chance a clicked example scores above an unclicked one."""
    order = np.argsort(scores, kind="stable")
    ranks = np.empty(len(scores))
    ranks[order] = np.arange(1, len(scores) + 1)
    positives = labels.astype(bool)
    n_pos, n_neg = positives.sum(), (~positives).sum()
    return float((ranks[positives].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--embedding", choices=["service", "local"], default="service")
    parser.add_argument("--alone", action="store_true",
                        help="no communication at all (local embedding, local optimizer): the speed limit")
    parser.add_argument("--fields", type=int, default=8)
    parser.add_argument("--vocabulary", type=int, default=20_000, help="ids per field")
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch's threads per worker (1: workers side by side do not fight over the cores)")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    hvd.init()
    rows = args.fields * args.vocabulary
    torch.manual_seed(0)
    if args.embedding == "service" and not args.alone:
        embedding = hvd.Embedding(rows, args.dim, init=("normal", 0.0, 0.01), optimizer={"name": "adagrad", "lr": args.lr})
    else:  # alone: sparse gradients, which torch's Adagrad applies to the touched rows only
        embedding = torch.nn.Embedding(rows, args.dim, sparse=args.alone)
        torch.nn.init.normal_(embedding.weight, 0.0, 0.01)
    model = CTRModel(embedding, args.fields, args.dim)
    optimizer = torch.optim.Adagrad(model.parameters(), lr=args.lr)
    if not args.alone:
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    data = ClickData(args.fields, args.vocabulary, seed=hvd.rank())
    loss_fn = torch.nn.BCEWithLogitsLoss()
    started = None
    for step in range(args.steps):
        if step == 20:  # the first steps create rows and warm the caches: time the rest
            started = time.perf_counter()
        ids, clicks = data.batch(args.batch)
        optimizer.zero_grad()
        loss = loss_fn(model(ids), clicks)
        loss.backward()
        optimizer.step()
    step_ms = (time.perf_counter() - started) / (args.steps - 20) * 1e3
    held_out = ClickData(args.fields, args.vocabulary, seed=10_000)
    ids, clicks = held_out.batch(20_000)
    with torch.no_grad():
        model.eval()
        scores = model(ids).numpy()
    result = auc(clicks.numpy(), scores)
    best = auc(clicks.numpy(), held_out.logit(ids.numpy()))  # the hidden model's own: the ceiling
    print(f"rank {hvd.rank()}: embedding {'alone' if args.alone else args.embedding}, {args.steps} steps, {step_ms:.2f} ms/step, "
          f"last loss {loss.item():.4f}, held-out AUC {result:.4f} (the hidden model's: {best:.4f})")
    hvd.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
