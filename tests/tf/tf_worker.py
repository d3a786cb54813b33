"""A TensorFlow worker for the tests in this directory; run it under ``pslink launch -n 2``.

    python tf_worker.py SCENARIO OUTDIR

Scenarios (each writes OUTDIR/<name>_rank<r>.npz: the weights after every epoch, the losses):
  all        fit, loop and optimizer below, one after another in the same two processes; rank 0
             then trains single-process references on the combined batches (<name>_reference.npz)
  fit        Keras model.fit under ParameterServiceStrategy
  loop       a custom loop: strategy.run, optimizer.apply_gradients, strategy.reduce
  optimizer  no strategy: pslink.tf.keras.DistributedOptimizer with BroadcastGlobalVariablesCallback
             and MetricAverageCallback
  tape       no strategy: a Horovod-style loop with pslink.tf.DistributedGradientTape, after
             pslink.tf.broadcast_variables inside a tf.function
  wider      ParameterServiceStrategy, but rank 1's hidden layer is wider (must fail, naming it)
  deeper     ParameterServiceStrategy, but rank 1 has an extra layer (must fail, naming it)
  wrapper    DistributedOptimizer without the broadcast callback, rank 1's hidden layer wider
             (must fail when the gradients meet, naming the variable)
  collectives  Horovod's allgather (eager and in a tf.function, uneven rows), broadcast_object,
             allgather_object, barrier, allreduce with op=Sum; writes collectives_rank<r>.json

Every worker starts from its own random weights (seeded by rank), so equal weights afterwards
show that rank 0's were broadcast. Worker r trains on rows r, r+2, r+4, ... of a slice of
scikit-learn's digits; the reference sees, at step s, worker 0's and worker 1's s-th batches as
one batch.
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np
import tensorflow as tf
import tf_extras
from sklearn.datasets import load_digits

import pslink.tf
import pslink.tf.keras as hvd
from pslink.errors import PslinkError

BATCH = 32  # per worker
WORKERS = 2
SAMPLES = 1280  # 20 steps per epoch and worker
EPOCHS = 3
LR = 0.1


def data():
    digits = load_digits()
    x = (digits.data[:SAMPLES] / 16.0).astype(np.float32)
    y = digits.target[:SAMPLES].astype(np.int64)
    return x, y


def shard(x, y, rank):
    return x[rank::WORKERS], y[rank::WORKERS]


def combined(x, y):
    """Batch s of the result is worker 0's batch s followed by worker 1's."""
    shards = [shard(x, y, r) for r in range(WORKERS)]
    steps = len(shards[0][0]) // BATCH
    xs, ys = [], []
    for s in range(steps):
        for sx, sy in shards:
            xs.append(sx[s * BATCH:(s + 1) * BATCH])
            ys.append(sy[s * BATCH:(s + 1) * BATCH])
    return np.concatenate(xs), np.concatenate(ys)


def build(hidden=32, extra=False):
    layers = [keras.Input((64,)), keras.layers.Dense(hidden, activation="relu")]
    if extra:
        layers.append(keras.layers.Dense(hidden, activation="relu"))
    layers.append(keras.layers.Dense(10))
    return keras.Sequential(layers)


def loss_fn():
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


class Record(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.weights = []

    def on_epoch_end(self, epoch, logs=None):
        self.weights.append([w.copy() for w in self.model.get_weights()])


def save(outdir, name, initial, weights, losses, **extra):
    arrays = {f"initial_{i}": w for i, w in enumerate(initial)}
    for epoch, ws in enumerate(weights):
        arrays.update({f"epoch{epoch}_{i}": w for i, w in enumerate(ws)})
    np.savez(os.path.join(outdir, f"{name}.npz"), losses=np.array(losses, np.float64), **arrays, **extra)


def accuracy(model, x, y):
    return float(np.mean(np.argmax(model.predict(x, verbose=0), axis=1) == y))


# -- distributed scenarios ---------------------------------------------------------------------

def run_fit(strategy, rank, outdir, x, y):
    keras.utils.set_random_seed(100 + rank)
    with strategy.scope():
        model = build()
        model.compile(optimizer=keras.optimizers.SGD(LR, momentum=0.9), loss=loss_fn())
    initial = model.get_weights()
    record = Record()
    sx, sy = shard(x, y, rank)
    history = model.fit(sx, sy, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0, callbacks=[record])
    save(outdir, f"fit_rank{rank}", initial, record.weights, history.history["loss"],
         accuracy=accuracy(model, x, y))
    return initial


def run_loop(strategy, rank, outdir, x, y):
    keras.utils.set_random_seed(200 + rank)
    with strategy.scope():
        model = build()
        optimizer = keras.optimizers.SGD(LR, momentum=0.9)
    initial = model.get_weights()
    per_example = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")

    @tf.function
    def step(inputs):
        def replica_step(batch_x, batch_y):
            with tf.GradientTape() as tape:
                logits = model(batch_x, training=True)
                # divides by the local batch times num_replicas_in_sync (all workers' replicas)
                loss = tf.nn.compute_average_loss(per_example(batch_y, logits))
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            return loss

        losses = strategy.run(replica_step, args=inputs)
        return strategy.reduce(tf.distribute.ReduceOp.SUM, losses, axis=None)

    sx, sy = shard(x, y, rank)
    dataset = strategy.experimental_distribute_dataset(tf.data.Dataset.from_tensor_slices((sx, sy)).batch(BATCH))
    weights, losses = [], []
    for _ in range(EPOCHS):
        total = [float(step(batch)) for batch in dataset]  # the mean loss over both workers' batches
        losses.append(np.mean(total))
        weights.append([w.copy() for w in model.get_weights()])
    save(outdir, f"loop_rank{rank}", initial, weights, losses)
    return initial


def run_optimizer(rank, outdir, x, y):
    hvd.init()  # as Horovod's, once per process (the strategy above made the session already)
    keras.utils.set_random_seed(300 + rank)
    model = build()
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(LR, momentum=0.9)), loss=loss_fn(),
                  metrics=["accuracy"])
    initial = model.get_weights()
    record = Record()
    sx, sy = shard(x, y, rank)
    callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0), hvd.callbacks.MetricAverageCallback(), record]
    history = model.fit(sx, sy, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0, callbacks=callbacks)
    save(outdir, f"optimizer_rank{rank}", initial, record.weights, history.history["loss"],
         accuracy=accuracy(model, x, y))
    return initial


def run_tape(rank, outdir, x, y):
    hvd.init()
    keras.utils.set_random_seed(400 + rank)
    model = build()
    optimizer = keras.optimizers.SGD(LR, momentum=0.9)
    initial = model.get_weights()
    per_example = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")

    @tf.function
    def broadcast_model():
        pslink.tf.broadcast_variables(model.variables, root_rank=0)

    @tf.function
    def step(batch_x, batch_y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(per_example(batch_y, model(batch_x, training=True)))
        tape = pslink.tf.DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return pslink.tf.allreduce(loss, name="loss")  # the mean over both workers

    broadcast_model()
    sx, sy = shard(x, y, rank)
    dataset = tf.data.Dataset.from_tensor_slices((sx, sy)).batch(BATCH)
    weights, losses = [], []
    for _ in range(EPOCHS):
        losses.append(np.mean([float(step(bx, by)) for bx, by in dataset]))
        weights.append([w.copy() for w in model.get_weights()])
    save(outdir, f"tape_rank{rank}", initial, weights, losses)
    return initial


def run_different_models(scenario, rank, x, y):
    """Train models that differ between the workers; print the error each worker gets and exit 0,
    so that the launch waits for both (a worker that hung would time the test out)."""
    try:
        if scenario == "wrapper":
            hvd.init()
            model = build(hidden=40 if rank == 1 else 32)
            model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(LR)), loss=loss_fn())
        else:
            strategy = pslink.tf.ParameterServiceStrategy()
            with strategy.scope():
                model = build(hidden=40 if scenario == "wider" and rank == 1 else 32,
                              extra=scenario == "deeper" and rank == 1)
                model.compile(optimizer=keras.optimizers.SGD(LR), loss=loss_fn())
        sx, sy = shard(x, y, rank)
        model.fit(sx, sy, batch_size=BATCH, epochs=1, verbose=0)
    except (PslinkError, tf.errors.OpError) as exc:  # reported for the test to read
        # Inside a tf.function the error comes wrapped by TensorFlow; show pslink's own line.
        lines = [line.strip() for line in str(exc).splitlines() if "Error" in line] or [str(exc)]
        print(f"failed with {type(exc).__name__}: {lines[-1]}", flush=True)
        return 0
    print("training finished although the models differ", flush=True)
    return 0


def run_collectives(rank, outdir):
    """Each collective once; rank r brings r + 1 rows to the gathers."""
    hvd.init()
    rows = tf.fill([rank + 1, 2], float(rank))
    eager = hvd.allgather(rows, name="rows")

    @tf.function(input_signature=[tf.TensorSpec([None, 2], tf.float32)])
    def traced(value):
        return hvd.allgather(value)  # unnamed: keyed by signature and order, as in Horovod

    report = {
        "eager": eager.numpy().tolist(),
        "traced": traced(rows).numpy().tolist(),
        "bools": hvd.allgather(tf.constant([rank == 1])).numpy().tolist(),
        "object": hvd.broadcast_object({"from": rank, "text": "x" * (10 * rank)} if rank == 1 else None,
                                       root_rank=1),
        "objects": hvd.allgather_object(("rank", rank, list(range(rank)))),
        "sum": float(hvd.allreduce(tf.constant(rank + 1.0), op=hvd.Sum, name="total")),
        "mean": float(hvd.allreduce(tf.constant(rank + 1.0), name="mean")),
        "min": hvd.allreduce(tf.constant([rank + 1.0, -rank]), op=hvd.Min, name="min").numpy().tolist(),
        "max": hvd.allreduce(tf.constant([rank + 1.0, -rank]), op=hvd.Max).numpy().tolist(),  # unnamed
        "product": hvd.allreduce(tf.constant([rank + 2, 3]), op=hvd.Product, name="product").numpy().tolist(),
        "grouped": [t.numpy().tolist() for t in hvd.grouped_allreduce([tf.constant(rank + 1.0), tf.ones([2]) * rank],
                                                                     op=hvd.Sum, name="group")],
        "cross": [hvd.cross_rank(), hvd.cross_size()],
    }
    report.update(row_collectives(rank))
    report.update(uneven_join(rank))
    report.update(process_sets(rank))
    report.update(horovod_tf_optimizer(rank))
    report.update(differentiable(rank))
    report.update(lr_callbacks())
    report.update(tf_extras.run(rank, outdir))
    report.update(graph_errors(rank))
    hvd.barrier()
    try:
        hvd.broadcast_object("x", root_rank=WORKERS)
    except PslinkError as exc:
        report["bad_root"] = str(exc)
    with open(os.path.join(outdir, f"collectives_rank{rank}.json"), "w") as f:
        set_agent = report.pop("set_agent")
        hvd.shutdown()
        report["set_closed_at_shutdown"] = set_agent.closed
        json.dump(report, f)
    print(f"rank {rank} done", flush=True)
    return 0


def graph_errors(rank):
    """Horovod's TensorFlow errors when the ranks' calls disagree, eagerly and inside a
    tf.function (where TensorFlow keeps only an error code: FailedPrecondition, as Horovod's)."""
    out = {}

    @tf.function
    def traced(value):
        return hvd.allreduce(value, name="traced.mismatch")

    for what, call in (("eager_shapes", lambda: hvd.allreduce(tf.ones([2 + rank]), name="eager.mismatch")),
                       ("eager_root", lambda: hvd.broadcast(tf.ones([2]), root_rank=rank, name="eager.root")),
                       ("traced_shapes", lambda: traced(tf.ones([2 + rank])))):
        try:
            call()
            out[what] = "no error"
        except tf.errors.OpError as exc:
            out[what] = [type(exc).__name__, isinstance(exc, tf.errors.FailedPreconditionError),
                         isinstance(exc, PslinkError)]
    return out


def lr_callbacks():
    """Horovod's learning-rate warmup and schedule callbacks: the rate each batch trains with."""
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    seen = []
    record = keras.callbacks.LambdaCallback(
        on_train_batch_begin=lambda batch, logs: seen.append(round(float(model.optimizer.learning_rate.numpy()), 6)))
    history = model.fit(np.ones((8, 2), np.float32), np.ones((8, 1), np.float32), batch_size=4, epochs=3, verbose=0,
                        callbacks=[hvd.callbacks.LearningRateWarmupCallback(0.2, warmup_epochs=2),
                                   hvd.callbacks.LearningRateScheduleCallback(0.2, 0.5, start_epoch=2), record])
    return {"lr_seen": seen, "lr_logged": [round(v, 6) for v in history.history["lr"]]}


def differentiable(rank):
    """Gradients through allreduce, allgather and broadcast (Horovod registers one for each)."""
    x = tf.Variable([1.0, 2.0])
    with tf.GradientTape(persistent=True) as tape:
        total = tf.reduce_sum(hvd.allreduce(x * (rank + 1.0), op=hvd.Sum, name="d.sum"))
        mean = tf.reduce_sum(hvd.allreduce(x, name="d.mean"))
        gathered = tf.reduce_sum(hvd.allgather(x * (rank + 1.0), name="d.gather") * tf.constant([1.0, 2.0, 3.0, 4.0]))
        broadcast = tf.reduce_sum(hvd.broadcast(x * (rank + 1.0), root_rank=0, name="d.bcast"))
    return {f"d_{what}": tape.gradient(value, x).numpy().tolist()
            for what, value in (("sum", total), ("mean", mean), ("gather", gathered), ("bcast", broadcast))}


def horovod_tf_optimizer(rank):
    """horovod.tensorflow's DistributedOptimizer: a Keras optimizer's, a TF1 one refused."""
    x = tf.Variable([1.0, 1.0])
    optimizer = pslink.tf.DistributedOptimizer(keras.optimizers.SGD(0.5), name="tfopt")
    optimizer.apply_gradients([(tf.constant([1.0, 2.0]) * (rank + 1), x)])  # the average: 1.5 x [1, 2]
    out = {"tf_optimizer": x.numpy().tolist()}
    try:
        pslink.tf.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.1))
    except PslinkError as exc:
        out["tf1_optimizer"] = str(exc)
    return out


def process_sets(rank):
    """A set of rank 1 alone and one of both: collectives count their workers only."""
    alone = hvd.add_process_set([1])
    both = hvd.add_process_set(hvd.ProcessSet([0, 1]))
    out = {"set_ids": [alone.process_set_id, both.process_set_id], "set_ranks": [alone.rank(), both.rank()]}
    try:
        hvd.add_process_set([1])
    except PslinkError as exc:
        out["set_again"] = str(exc)
    x = tf.constant([rank + 1.0])
    out["set_both"] = hvd.allreduce(x, op=hvd.Sum, name="ps", process_set=both).numpy().tolist()
    out["set_rows"] = hvd.allgather(tf.fill([rank + 1], rank), name="ps_rows", process_set=both).numpy().tolist()
    if alone.included():
        out["set_alone"] = hvd.allreduce(x, op=hvd.Sum, name="ps", process_set=alone).numpy().tolist()
    else:
        try:
            hvd.allreduce(x, process_set=alone)
        except PslinkError as exc:
            out["set_alone"] = str(exc)
    out["set_removed"] = [hvd.remove_process_set(alone), hvd.remove_process_set(alone)]
    out["set_world"] = hvd.allreduce(x, op=hvd.Sum, name="after_sets").numpy().tolist()
    out["set_agent"] = both.session.agent  # shutdown() closes it (popped before the report is written)
    return out


def uneven_join(rank):
    """Rank 1 has one batch, rank 0 three: rank 1 joins and mirrors rank 0's steps with zeros."""
    x = tf.Variable([1.0, 1.0])

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(x * tf.constant([1.0, 2.0]) * (rank + 1.0))  # gradient (rank + 1) * [1, 2]
        (grad,) = pslink.tf.DistributedGradientTape(tape, name="uneven").gradient(loss, [x])
        x.assign_sub(0.5 * grad)

    for _ in range(3 if rank == 0 else 1):
        step()
    return {"join_last": int(hvd.join()), "join_weights": x.numpy().tolist()}


def row_collectives(rank):
    """reducescatter, alltoall, the grouped gathers and fp16 compression, eagerly and traced."""
    base = tf.reshape(tf.range(10, dtype=tf.float32), [5, 2])
    splits = [1, 2] if rank == 0 else [2, 1]
    sent = tf.constant([[10 * rank], [10 * rank + 1], [10 * rank + 2]], tf.int32)

    @tf.function(input_signature=[tf.TensorSpec([None, 2], tf.float32)])
    def traced_scatter(value):
        return hvd.reducescatter(value, op=hvd.Sum)

    @tf.function(input_signature=[tf.TensorSpec([None, 1], tf.int32), tf.TensorSpec([2], tf.int32)])
    def traced_alltoall(value, counts):
        return hvd.alltoall(value, counts)

    received, counts = hvd.alltoall(sent, splits=splits, name="a2a")
    equal = hvd.alltoall(tf.constant([[rank], [rank]]), name="a2a.equal")  # no splits: the rows alone
    traced_received, traced_counts = traced_alltoall(sent, tf.constant(splits))
    x = tf.Variable([1.0, 2.0])
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(x * (rank + 1.0))
    grads = pslink.tf.DistributedGradientTape(tape, compression=hvd.Compression.fp16).gradient(loss, [x])
    compressed = hvd.allreduce(tf.constant([0.25 * (rank + 1)]), op=hvd.Sum, name="fp16",
                               compression=hvd.Compression.fp16)
    out = {
        "scatter_sum": hvd.reducescatter(base * (rank + 1), op=hvd.Sum, name="rs").numpy().tolist(),
        "scatter_mean": hvd.reducescatter(base * (rank + 1)).numpy().tolist(),
        "scatter_traced": traced_scatter(base * (rank + 1)).numpy().tolist(),
        "scatter_int": hvd.reducescatter(tf.constant([[1], [2], [3]]) * (rank + 1), op=hvd.Sum, name="rsi",
                                         prescale_factor=2.0).numpy().tolist(),
        "grouped_scatter": [t.numpy().tolist() for t in hvd.grouped_reducescatter([base, base[:2]], op=hvd.Sum)],
        "alltoall": [received.numpy().tolist(), counts.numpy().tolist(), counts.dtype.name],
        "alltoall_equal": equal.numpy().tolist(),
        "alltoall_traced": [traced_received.numpy().tolist(), traced_counts.numpy().tolist()],
        "grouped_gather": [t.numpy().tolist() for t in hvd.grouped_allgather(
            [tf.fill([rank + 1], rank), tf.constant([[rank]])], name="gg")],
        "fp16": [compressed.numpy().tolist(), compressed.dtype.name],
        "tape_fp16": [grads[0].numpy().tolist(), grads[0].dtype.name],
    }
    for what, call in (("uneven", lambda: hvd.alltoall(tf.ones([3, 1]), name="uneven")),
                       ("bad_splits", lambda: hvd.alltoall(tf.ones([3, 1]), splits=[1, 1], name="bad")),
                       ("scalar", lambda: hvd.reducescatter(tf.constant(1.0)))):
        try:
            call()
            out[what] = "no error"
        except PslinkError as exc:
            out[what] = str(exc)
    return out


# -- single-process references -------------------------------------------------------------------

def reference_fit(outdir, initial, x, y, name):
    model = build()
    model.set_weights(initial)
    model.compile(optimizer=keras.optimizers.SGD(LR, momentum=0.9), loss=loss_fn())
    record = Record()
    cx, cy = combined(x, y)
    history = model.fit(cx, cy, batch_size=BATCH * WORKERS, epochs=EPOCHS, shuffle=False, verbose=0,
                        callbacks=[record])
    save(outdir, f"{name}_reference", initial, record.weights, history.history["loss"])


def reference_loop(outdir, initial, x, y, name):
    model = build()
    model.set_weights(initial)
    optimizer = keras.optimizers.SGD(LR, momentum=0.9)
    per_example = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")

    @tf.function
    def step(batch_x, batch_y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(per_example(batch_y, model(batch_x, training=True)))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    cx, cy = combined(x, y)
    dataset = tf.data.Dataset.from_tensor_slices((cx, cy)).batch(BATCH * WORKERS)
    weights, losses = [], []
    for _ in range(EPOCHS):
        losses.append(np.mean([float(step(bx, by)) for bx, by in dataset]))
        weights.append([w.copy() for w in model.get_weights()])
    save(outdir, f"{name}_reference", initial, weights, losses)


def main(argv):
    scenario, outdir = argv[1], argv[2]
    rank = int(os.environ["PSLINK_RANK"])
    if scenario == "collectives":
        return run_collectives(rank, outdir)
    x, y = data()
    if scenario in ("wider", "deeper", "wrapper"):
        return run_different_models(scenario, rank, x, y)
    initials = {}
    if scenario in ("all", "fit", "loop"):
        strategy = pslink.tf.ParameterServiceStrategy()
        if scenario in ("all", "fit"):
            initials["fit"] = run_fit(strategy, rank, outdir, x, y)
        if scenario in ("all", "loop"):
            initials["loop"] = run_loop(strategy, rank, outdir, x, y)
    if scenario in ("all", "optimizer"):
        initials["optimizer"] = run_optimizer(rank, outdir, x, y)
    if scenario in ("all", "tape"):
        initials["tape"] = run_tape(rank, outdir, x, y)
    if rank == 0:
        if "fit" in initials:
            reference_fit(outdir, initials["fit"], x, y, "fit")
        if "loop" in initials:
            reference_loop(outdir, initials["loop"], x, y, "loop")
        if "tape" in initials:
            reference_loop(outdir, initials["tape"], x, y, "tape")
        if "optimizer" in initials:
            reference_fit(outdir, initials["optimizer"], x, y, "optimizer")
    pslink.tf.shutdown()
    print(f"rank {rank} done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
