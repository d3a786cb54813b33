"""Horovod's smaller TensorFlow names, run by tf_worker.py's ``collectives`` scenario (two
workers): the run-time ops, in-place and TF1 broadcasts, the partial tape, SyncBatchNormalization,
the timeline, ``keras.load_model`` and ``BestModelCheckpoint``. Returns what test_tf_collectives
checks."""

from __future__ import annotations

import os

import keras
import numpy as np
import tensorflow as tf

import pslink.tf
import pslink.tf.keras as hvd
from pslink.core.observe import timeline
from pslink.errors import PslinkError


def run(rank: int, outdir: str) -> dict:
    report = {}
    report.update(runtime_ops(rank))
    report.update(broadcasts(rank))
    report.update(tapes(rank))
    report.update(sync_batch_norm(rank))
    report.update(timelines(rank, outdir))
    report.update(keras_extras(rank, outdir))
    return report


def runtime_ops(rank):
    only_zero = hvd.add_process_set([0])

    @tf.function
    def traced():
        return [pslink.tf.rank_op(), pslink.tf.size_op(), pslink.tf.local_rank_op(), pslink.tf.local_size_op(),
                pslink.tf.size_op(only_zero.process_set_id), pslink.tf.process_set_included_op(),
                pslink.tf.process_set_included_op(only_zero.process_set_id), pslink.tf.process_set_included_op(99)]

    report = {
        "ops_eager": [int(pslink.tf.rank_op()), int(pslink.tf.size_op())],
        "ops_traced": [int(v) for v in traced()],
        "homogeneous": pslink.tf.is_homogeneous(),
    }
    hvd.remove_process_set(only_zero)
    return report


def broadcasts(rank):
    v = tf.Variable([float(rank), 2.0 * rank])
    values = pslink.tf.broadcast_([v], root_rank=1)
    report = {"broadcast_": [v.numpy().tolist(), values[0].numpy().tolist()]}
    report["object_fn"] = pslink.tf.broadcast_object_fn(root_rank=1)({"rank": rank})
    try:
        pslink.tf.broadcast_global_variables(0)
    except RuntimeError as exc:
        report["global_eager"] = str(exc)
    with tf.Graph().as_default():  # TF1: a graph and a session
        w = tf.compat.v1.Variable(float(rank) + 10.0, name="w")
        op = pslink.tf.broadcast_global_variables(0)
        with tf.compat.v1.Session() as session:
            session.run(tf.compat.v1.global_variables_initializer())
            session.run(op)
            report["global_graph"] = float(session.run(w))
    with tf.Graph().as_default():
        u = tf.compat.v1.Variable(float(rank) + 20.0, name="u")
        hook = pslink.tf.BroadcastGlobalVariablesHook(1)
        with tf.compat.v1.train.MonitoredSession(hooks=[hook]) as session:
            report["global_hook"] = float(session.run(u))
    return report


def tapes(rank):
    shared, local = keras.layers.Dense(1, use_bias=False), keras.layers.Dense(1, use_bias=False)
    x = tf.constant([[1.0 + rank, 2.0]])
    shared.build((None, 2))
    local.build((None, 2))
    shared.kernel.assign([[1.0], [1.0]])
    local.kernel.assign([[1.0], [1.0]])

    def loss():
        return tf.reduce_sum(shared(x)) + tf.reduce_sum(local(x))

    with tf.GradientTape() as plain:
        value = loss()
    plain_grads = plain.gradient(value, [shared.kernel, local.kernel])
    with tf.GradientTape() as tape:
        value = loss()
    partial = pslink.tf.PartialDistributedGradientTape(tape, local_layers=local)
    grads = partial.gradient(value, [shared.kernel, local.kernel])
    with tf.GradientTape() as tape:
        value = tf.reduce_sum(shared(x))
    summed = pslink.tf.DistributedGradientTape(tape, op=pslink.tf.Sum, name="summed").gradient(value, shared.kernel)
    with tf.GradientTape() as tape:
        value = tf.reduce_sum(shared(x))
    predivided = pslink.tf.DistributedGradientTape(tape, gradient_predivide_factor=2.0, name="predivided").gradient(
        value, shared.kernel)
    report = {"partial": [g.numpy().ravel().tolist() for g in grads],
              "partial_plain": [g.numpy().ravel().tolist() for g in plain_grads],
              "tape_sum": summed.numpy().ravel().tolist(), "tape_predivided": predivided.numpy().ravel().tolist()}
    with tf.GradientTape() as tape:
        value = tf.reduce_sum(shared(x))
    report["tape_max"] = pslink.tf.DistributedGradientTape(tape, op=pslink.tf.Max, name="max").gradient(
        value, shared.kernel).numpy().ravel().tolist()  # Horovod's: the largest of the ranks' gradients
    return report


def sync_batch_norm(rank):
    """Each worker's 4 rows of the 8: its output rows equal Keras' BatchNormalization on all 8."""
    everything = np.arange(24, dtype=np.float32).reshape(8, 3) ** 1.5
    mine = everything[4 * rank: 4 * rank + 4]
    layer = pslink.tf.SyncBatchNormalization(momentum=0.5)
    reference = keras.layers.BatchNormalization(momentum=0.5)
    x = tf.constant(mine)
    with tf.GradientTape() as tape:
        tape.watch(x)
        out = layer(x, training=True)
        weighted = tf.reduce_sum(out * tf.constant(np.arange(12, dtype=np.float32).reshape(4, 3)))
    dx = tape.gradient(weighted, x)
    all_x = tf.constant(everything)
    with tf.GradientTape() as tape:
        tape.watch(all_x)
        expected = reference(all_x, training=True)
        weights = np.concatenate([np.arange(12, dtype=np.float32).reshape(4, 3)] * 2)
        total = tf.reduce_sum(expected * weights)
    dx_expected = tape.gradient(total, all_x)[4 * rank: 4 * rank + 4]
    report = {
        "syncbn_out": float(tf.reduce_max(tf.abs(out - expected[4 * rank: 4 * rank + 4]))),
        "syncbn_dx": float(tf.reduce_max(tf.abs(dx - dx_expected))),
        "syncbn_moving": float(tf.reduce_max(tf.abs(layer.moving_mean - reference.moving_mean))),
    }
    try:
        pslink.tf.SyncBatchNormalization(fused=True)
    except PslinkError as exc:
        report["syncbn_fused"] = str(exc)
    return report


def timelines(rank, outdir):
    path = os.path.join(outdir, "hvd_timeline.json")
    hvd.allreduce(tf.ones([2]), name="not.traced")
    hvd.start_timeline(path, mark_cycles=True)
    hvd.allreduce(tf.ones([2]), name="traced.by.timeline")
    hvd.stop_timeline()
    written = path if rank == 0 else os.path.join(outdir, "hvd_timeline.rank1.json")
    lanes = [e["args"]["name"] for e in timeline.read(written) if e.get("ph") == "M"]
    return {"timeline_lanes": lanes}


def keras_extras(rank, outdir):
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1, kernel_initializer="ones")])
    model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9), loss="mse")
    x = np.full((4, 2), rank + 1.0, np.float32)
    y = np.zeros((4, 1), np.float32)
    model.fit(x, y, batch_size=4, epochs=1, verbose=0)  # one local step: a state to keep
    path = os.path.join(outdir, f"model_rank{rank}.keras")
    model.save(path)
    loaded = hvd.load_model(path)
    report = {"loaded_class": [type(loaded.optimizer).__name__,
                               isinstance(loaded.optimizer, keras.optimizers.SGD)],
              "loaded_iterations": int(loaded.optimizer.iterations.numpy())}
    hvd.broadcast_variables(list(loaded.weights) + list(loaded.optimizer.variables), root_rank=0)
    loaded.fit(x, y, batch_size=4, epochs=1, verbose=0)  # the gradients are averaged: the same step on both
    report["loaded_weights"] = [w.numpy().ravel().tolist() for w in loaded.weights]
    report["loaded_iterations_after"] = int(loaded.optimizer.iterations.numpy())
    checkpoint = hvd.callbacks.BestModelCheckpoint(monitor="loss")
    try:
        model.fit(x, y, epochs=1, verbose=0, callbacks=[checkpoint])
    except PslinkError as exc:
        report["best_unset"] = str(exc)
    checkpoint.filepath = os.path.join(outdir, f"best_rank{rank}.keras")
    model.fit(x, y, epochs=2, verbose=0, callbacks=[checkpoint])
    report["best_saved"] = os.path.exists(checkpoint.filepath)
    report.update(elastic_fit(rank, x, y))
    return report


def elastic_fit(rank, x, y):
    """model.fit under hvd.elastic.run with Horovod's state callbacks; each worker starts from its
    own random weights: the state's sync gives both rank 0's."""
    keras.utils.set_random_seed(rank)
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.05)), loss="mse")
    state = hvd.elastic.KerasState(model, batch=0, epoch=0)
    commits = []

    @hvd.elastic.run
    def train(state):
        callbacks = [hvd.elastic.CommitStateCallback(state, batches_per_commit=2),
                     hvd.elastic.UpdateBatchStateCallback(state), hvd.elastic.UpdateEpochStateCallback(state),
                     keras.callbacks.LambdaCallback(on_epoch_end=lambda epoch, logs: commits.append(state.commits))]
        model.fit(x, y, batch_size=1, epochs=3 - state.epoch, verbose=0, callbacks=callbacks)

    train(state)
    return {"elastic_fit": [state.epoch, state.batch, commits],
            "elastic_weights": [w.numpy().ravel().tolist() for w in model.weights]}
