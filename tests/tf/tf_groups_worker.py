"""A TensorFlow worker of a job trained as 2 groups of 2 (tests/tf/test_tf_groups.py), run as

    pslink launch -n 4 --sync local:2 --groups 2 python tf_groups_worker.py WAY OUTDIR

Keras ``model.fit`` under ParameterServiceStrategy (WAY ``strategy``) or with the Horovod API's
DistributedOptimizer (``optimizer``), plain SGD, every worker from one seed; the
weights after every step go to OUTDIR/rank<r>.npz. Rank 0 then trains the reference in one
process: two models (the groups), each stepping on its group's combined batch, averaged every 2
steps (OUTDIR/reference.npz).
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np
import tensorflow as tf
from tf_worker import BATCH, LR, build, data, loss_fn

import pslink.tf

WORKERS, GROUPS, EVERY = 4, 2, 2


class Steps(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.weights = []

    def on_train_batch_end(self, batch, logs=None):
        self.weights.append([w.copy() for w in self.model.get_weights()])


def batch_of(x, y, rank: int, step: int):
    rows = slice(step * BATCH, (step + 1) * BATCH)
    return x[rank::WORKERS][rows], y[rank::WORKERS][rows]


def reference(initial, x, y, steps: int) -> dict:
    models = [build() for _ in range(GROUPS)]
    optimizers = [keras.optimizers.SGD(LR) for _ in range(GROUPS)]
    per_example = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")
    for model in models:
        model.set_weights(initial)
    arrays = {}
    for step in range(steps):
        for group, (model, optimizer) in enumerate(zip(models, optimizers)):
            parts = [batch_of(x, y, rank, step) for rank in range(group * 2, group * 2 + 2)]
            bx, by = np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(per_example(by, model(bx, training=True)))
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
        if (step + 1) % EVERY == 0:
            average = [np.mean(ws, axis=0) for ws in zip(*(m.get_weights() for m in models))]
            for model in models:
                model.set_weights(average)
        for group, model in enumerate(models):
            arrays.update({f"g{group}_step{step}_{i}": w for i, w in enumerate(model.get_weights())})
    return arrays


def main(way: str, outdir: str) -> int:
    rank = int(os.environ["PSLINK_RANK"])
    x, y = data()
    keras.utils.set_random_seed(7)  # both groups start from one model
    if way == "strategy":
        strategy = pslink.tf.ParameterServiceStrategy()
        agent, workers = strategy.agent, strategy.num_workers
        with strategy.scope():
            model = build()
            model.compile(optimizer=keras.optimizers.SGD(LR), loss=loss_fn())
    else:
        import pslink.tf.keras as hvd

        hvd.init()
        agent, workers = pslink.tf.world.current_session().agent, hvd.size()
        model = build()
        model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(LR)), loss=loss_fn())
    assert (agent.world_rank, agent.world_size, workers) == (rank, WORKERS, 2), agent
    initial = model.get_weights()
    record = Steps()
    model.fit(x[rank::WORKERS], y[rank::WORKERS], batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
              callbacks=[record])
    np.savez(os.path.join(outdir, f"rank{rank}.npz"),
             **{f"step{s}_{i}": w for s, ws in enumerate(record.weights) for i, w in enumerate(ws)})
    if rank == 0:
        np.savez(os.path.join(outdir, "reference.npz"), **reference(initial, x, y, len(record.weights)))
    pslink.tf.shutdown()
    print(f"rank {rank} done after {len(record.weights)} steps", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
