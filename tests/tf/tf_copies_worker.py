"""A worker reducing values of several shapes and dtypes through ParameterServiceStrategy; run
under ``pslink launch -n 2``.

    python tf_copies_worker.py OUTDIR

Each rank makes every rank's values (seeded by rank), so each can check the strategy's results
itself. In a ``tf.function`` (``ReplicaContext.all_reduce``: the graph path, values in buckets
pushed as they come and waited for later, sums received into reused buffers) and eagerly
(``strategy.reduce``: one request). The function runs STEPS times with new values; the results of
the first run are kept as tensors and saved only after the last one, so a result buffer reused
while TensorFlow still held it would show. Writes OUTDIR/copies_rank<r>.npz: ``graph<step>_<i>``,
``eager_<i>``, ``buckets`` (how many buckets the graph path made).
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import tensorflow as tf

import pslink.tf
from pslink.tf import strategy as strategy_module

# (shape, dtype, reduction): three 1.5 MB float32 tensors so the graph path makes several buckets,
# and small ones of other dtypes and ranks that share a bucket.
SPECS = [((384, 1024), "float32", "mean"), ((7,), "float32", "mean"), ((3, 5, 2), "float64", "mean"),
         ((1024, 384), "float32", "sum"), ((), "float32", "sum"), ((11,), "int32", "sum"),
         ((4, 4), "int64", "mean"), ((33,), "float16", "sum"), ((6,), "bfloat16", "mean"),
         ((512, 768), "float32", "mean")]
STEPS, WORKERS = 3, 2


def values(rank: int, step: int) -> list[np.ndarray]:
    rng = np.random.default_rng(1000 * step + rank)
    made = []
    for shape, dtype, _ in SPECS:
        if dtype.startswith("int"):
            made.append(rng.integers(-1000, 1000, shape).astype(dtype))
        else:
            made.append(rng.standard_normal(shape).astype("float32" if dtype == "bfloat16" else dtype))
    return made


def as_tensors(arrays: list[np.ndarray]) -> list[tf.Tensor]:
    return [tf.cast(a, tf.bfloat16) if spec[1] == "bfloat16" else tf.constant(a) for a, spec in zip(arrays, SPECS)]


def main(outdir: str) -> None:
    strategy = pslink.tf.ParameterServiceStrategy()
    rank = strategy.rank
    made_buckets = []
    original = strategy_module.buckets

    def counted(*args):
        made = original(*args)
        made_buckets.append(len(made))
        return made

    strategy_module.buckets = counted
    op = {"mean": tf.distribute.ReduceOp.MEAN, "sum": tf.distribute.ReduceOp.SUM}

    @tf.function
    def reduce_all(*inputs):
        def replica(*inputs):
            context = tf.distribute.get_replica_context()
            means = context.all_reduce(op["mean"], [t for t, s in zip(inputs, SPECS) if s[2] == "mean"])
            sums = context.all_reduce(op["sum"], [t for t, s in zip(inputs, SPECS) if s[2] == "sum"])
            means, sums = iter(means), iter(sums)
            return [next(means) if s[2] == "mean" else next(sums) for s in SPECS]
        return strategy.run(replica, args=inputs)

    saved = {}
    first = None
    for step in range(STEPS):
        results = reduce_all(*as_tensors(values(rank, step)))
        if step == 0:
            first = results  # kept as tensors until the end: later steps must not write into them
        else:
            saved.update({f"graph{step}_{i}": tf.cast(r, tf.float32).numpy() if SPECS[i][1] == "bfloat16" else
                          r.numpy() for i, r in enumerate(results)})
    saved.update({f"graph0_{i}": tf.cast(r, tf.float32).numpy() if SPECS[i][1] == "bfloat16" else r.numpy()
                  for i, r in enumerate(first)})
    for i, (tensor, spec) in enumerate(zip(as_tensors(values(rank, 0)), SPECS)):
        reduced = strategy.reduce(op[spec[2]], tensor, axis=None)
        saved[f"eager_{i}"] = tf.cast(reduced, tf.float32).numpy() if spec[1] == "bfloat16" else reduced.numpy()
    saved["buckets"] = np.array(made_buckets)
    np.savez(os.path.join(outdir, f"copies_rank{rank}.npz"), **saved)


if __name__ == "__main__":
    main(sys.argv[1])
