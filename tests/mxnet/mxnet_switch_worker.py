"""A worker that sets the optimizer after init and pushes, as MXNet's nightly dist_sync test does.

``train(kv, rank, between)`` is the one training: dense float32 and float16 keys and a row-sparse
key are initialized, summed for ``SUM_ROUNDS`` rounds (the store's value is each round's sum),
then ``set_optimizer`` (``OPTIMIZERS[name]``, multi_precision) makes those sums the weights that
the next ``STEP_ROUNDS`` rounds step. ``between(step)`` runs before each step (the test migrates and
fails Aggregators there). Run as a script (``python mxnet_switch_worker.py STORE OUT NAME``), it trains
on ``mx.kv.create(STORE)`` (MXNet's own ``dist_sync`` under the DMLC_* environment, see
mxnet_native.py) and writes the rank's results to ``OUT/<rank>.npz``.
"""

from __future__ import annotations

import sys

import mxnet as mx
import numpy as np

DENSE = {"w32": ((40, 10), "float32"), "w16": ((40, 10), "float16")}
SPARSE, SPARSE_SHAPE = "emb", (12, 5)
SUM_ROUNDS, STEP_ROUNDS = 3, 8


def gradient(rank: int, step: int, shape, dtype) -> np.ndarray:
    return np.random.default_rng(1000 * rank + step).normal(size=shape).astype(dtype)


def sparse_rows(rank: int, step: int, summing: bool) -> np.ndarray:
    """The rows a rank touches in a step: a few, different per rank and step, some shared. While
    the store sums, every row: MXNet's server then keeps only the round's rows (the others
    read as zeros), and its SGD with momentum refuses a weight with rows missing."""
    if summing:
        return np.arange(SPARSE_SHAPE[0])
    return np.unique(np.random.default_rng(77 + 1000 * rank + step).integers(0, SPARSE_SHAPE[0], size=4))


# "test" is the nightly test's own optimizer (weight += rescale_grad * grad, its state a copy of
# the weights): the same arithmetic in MXNet's ndarrays and in numpy, so the same bits. SGD with
# momentum and weight decay: MXNet's fused kernel rounds a few operations otherwise than numpy.
OPTIMIZERS = {
    "test": dict(rescale_grad=0.5),
    "sgd": dict(learning_rate=0.1, momentum=0.9, wd=1e-3, rescale_grad=0.5),
}


def optimizer(name: str):
    return mx.optimizer.create(name, multi_precision=True, **OPTIMIZERS[name])


def train(kv, rank: int, optimizer_name: str, between=None) -> dict:
    for key, (shape, dtype) in DENSE.items():
        kv.init(key, mx.nd.array(np.linspace(-1, 1, np.prod(shape)).reshape(shape), dtype=dtype))
    kv.init(SPARSE, mx.nd.ones(SPARSE_SHAPE).tostype("row_sparse"))
    results = {}
    all_rows = mx.nd.arange(0, SPARSE_SHAPE[0])

    def round_(step: int, tag: str) -> None:
        for key, (shape, dtype) in DENSE.items():
            if tag == "sum" and dtype == "float16":
                # Summed before a multi_precision optimizer, MXNet's server keeps the float32 sum
                # (before its rounding to float16) as the master copy; the nightly test pushes its
                # float16 keys only after set_optimizer, as here (docs/mxnet.md).
                continue
            kv.push(key, mx.nd.array(gradient(rank, step, shape, dtype), dtype=dtype))
            out = mx.nd.zeros(shape, dtype=dtype)
            kv.pull(key, out=out)
            results[f"{tag}{step}-{key}"] = out.asnumpy()
        rows = sparse_rows(rank, step, tag == "sum")
        grad = np.zeros(SPARSE_SHAPE, np.float32)
        grad[rows] = gradient(rank, step, (len(rows), SPARSE_SHAPE[1]), "float32")
        kv.push(SPARSE, mx.nd.array(grad).tostype("row_sparse"))
        out = mx.nd.zeros(SPARSE_SHAPE).tostype("row_sparse")
        kv.row_sparse_pull(SPARSE, out=out, row_ids=all_rows)
        results[f"{tag}{step}-{SPARSE}"] = out.asnumpy()

    for step in range(SUM_ROUNDS):
        round_(step, "sum")
    kv.set_optimizer(optimizer(optimizer_name))
    for step in range(STEP_ROUNDS):
        if between is not None:
            between(step)
        round_(step, "step")
    return results


def main() -> None:
    store, out, name = sys.argv[1:4]
    kv = mx.kv.create(store)
    results = train(kv, kv.rank, name)
    np.savez(f"{out}/{kv.rank}.npz", **results)


if __name__ == "__main__":
    main()
