"""A TensorFlow worker whose model has an embedding (sparse gradients); run under ``pslink launch -n 2``.

    python tf_sparse_worker.py OUTDIR

Keras ``model.fit`` under ParameterServiceStrategy; the embedding's gradient reaches the strategy
as ``tf.IndexedSlices`` and is reduced as slices (the count of sparse reductions is saved). Rank 0
then trains the same model in one process on the combined batches. Writes OUTDIR/sparse_rank<r>.npz
and OUTDIR/sparse_reference.npz.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import pslink.tf  # noqa: E402
from pslink.tf import strategy as strategy_module  # noqa: E402

VOCAB, DIM, FIELDS, BATCH, STEPS, WORKERS = 40, 4, 3, 8, 6, 2


def build():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((FIELDS,), dtype="int64"), keras.layers.Embedding(VOCAB, DIM),
                              keras.layers.Flatten(), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    return model


def data(rank):
    rng = np.random.default_rng(rank)
    return rng.integers(0, VOCAB, (BATCH * STEPS, FIELDS)), rng.normal(size=(BATCH * STEPS, 1)).astype(np.float32)


def main(outdir):
    rank = int(os.environ["PSLINK_RANK"])
    sparse_reductions = []
    reduce_sparse = strategy_module.ParameterServiceStrategy._reduce_sparse

    def counted(self, reduce_op, replicas):
        sparse_reductions.append(1)
        return reduce_sparse(self, reduce_op, replicas)

    strategy_module.ParameterServiceStrategy._reduce_sparse = counted
    strategy = pslink.tf.ParameterServiceStrategy()
    with strategy.scope():
        model = build()
    x, y = data(rank)
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    np.savez(os.path.join(outdir, f"sparse_rank{rank}.npz"), *model.get_weights(),
             sparse=np.array(len(sparse_reductions)))
    if rank == 0:  # one process, both workers' s-th batches as one batch
        reference = build()
        shards = [data(r) for r in range(WORKERS)]
        cx = np.concatenate([s[0][i * BATCH:(i + 1) * BATCH] for i in range(STEPS) for s in shards])
        cy = np.concatenate([s[1][i * BATCH:(i + 1) * BATCH] for i in range(STEPS) for s in shards])
        reference.fit(cx, cy, batch_size=BATCH * WORKERS, epochs=1, shuffle=False, verbose=0)
        np.savez(os.path.join(outdir, "sparse_reference.npz"), *reference.get_weights())
    pslink.tf.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
