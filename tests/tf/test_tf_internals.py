"""The TensorFlow private API that pslink.tf relies on, and that TensorFlow still routes through it.

ParameterServiceStrategy overrides private methods of MirroredStrategy's implementation
(pslink/tf/_internals.py). If a TensorFlow release renames them or stops calling them, each worker
would silently train alone; these tests fail loudly instead. They run in this process: the
process's Session is one over a stand-in Agent, worker 0 of 2, whose peer makes the same calls
with the same values (so a sum is twice the value and a mean the value itself, a gather has the
same rows twice, and the peer pushes zeros where worker 0 broadcasts).
"""

from __future__ import annotations

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow", reason="TensorFlow is not installed (CI installs it: pip install '.[tf]')")

import keras

import pslink.tf
from pslink.core.worker.collectives import service_key
from pslink.core.worker.session import Session
from pslink.errors import ShapeMismatchError
from pslink.tf import _internals
from pslink.tf.keras import DistributedOptimizer
from pslink.tf.variables import _difference, unique_names
from pslink.tf.world import holder


class _Done:
    """An Agent handle that is answered already."""

    def __init__(self, result):
        self.result = result

    def done(self) -> bool:
        return True

    def wait(self, timeout=None):
        return self.result

    def exception(self):
        return None

    def add_done_callback(self, fn, drive: bool = True) -> None:
        fn(self)


class LoopbackAgent:
    """Worker 0 of a two-worker job; the other worker is imagined (it makes the same calls with the
    same values), and the calls made are recorded."""

    def __init__(self):
        self.job, self.rank, self.num_workers = "loopback", 0, 2
        self.mode, self.sync, self.timeout = "sum", "bsp", 30.0
        self.settings: dict = {}  # the job's settings as pMaster gave them (none set)
        self.master_address, self.transports = "", None
        self.closed = False
        self.calls: list[tuple[list, list]] = []

    def pushpull_many(self, keys, arrays, outs=None, average=False):
        keys, arrays = list(keys), [np.asarray(a) for a in arrays]
        outs = list(outs) if outs is not None else [np.empty_like(a) for a in arrays]
        self.calls.append((keys, [a.shape for a in arrays]))
        for key, array, out in zip(keys, arrays, outs):
            out[...] = array
            if key.startswith("hvd/board") or "/shapes/" in key:
                out[1] = array[0]  # the peer's row of the board or of a gather's shapes: ours
            elif key.startswith("allgather/"):
                half = array.size // 2
                out.reshape(-1)[half:] = array.reshape(-1)[:half]  # the peer's rows: ours again
            elif not key.startswith("broadcast/") and not average:
                out[...] = array * 2  # a sum: the peer pushes what we push (it pushes zeros to broadcasts)
        return _Done(outs)

    def pushpull(self, key, array, out=None, average=False):
        return _Done(self.pushpull_many([key], [array], None if out is None else [out], average).wait()[0])

    def cancel(self, handle, error) -> None:
        raise AssertionError(f"a call was failed: {error}")

    def close(self, leave: bool = True) -> None:
        self.closed = True

    def keys_sent(self, prefix: str) -> list[list]:
        return [keys for keys, _ in self.calls if keys[0].startswith(prefix)]

    def checked(self, scope: str) -> bool:
        return any(f"tf.check.{scope}." in key for keys, _ in self.calls for key in keys)


@pytest.fixture
def agent():
    pslink.tf.shutdown()
    fake = LoopbackAgent()
    holder.session = Session(fake)  # the process's session: what init() would have made
    yield fake
    pslink.tf.shutdown()


@pytest.fixture
def strategy(agent):
    return pslink.tf.ParameterServiceStrategy()


def test_the_private_api_pslink_uses_is_still_there():
    problems = _internals.missing_or_changed()
    assert not problems, (
        f"TensorFlow {tf.__version__} changed private API that pslink/tf/_internals.py relies on "
        f"(tested with 2.17): {problems}"
    )


def test_the_strategy_is_a_mirrored_strategy_counting_every_workers_replicas(strategy):
    assert isinstance(strategy, tf.distribute.MirroredStrategy)
    assert isinstance(strategy.extended, _internals.Extended)
    assert strategy.num_replicas_in_sync == 2 * len(strategy.extended.worker_devices)
    assert (strategy.rank, strategy.num_workers) == (0, 2)


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "tf.function"])
def test_strategy_reduce_goes_through_the_service(strategy, agent, traced):
    def reduce_all():
        floats = strategy.run(lambda: tf.constant([1.0, 2.0]))
        ints = strategy.run(lambda: tf.constant(3))  # MirroredStrategy would reduce int32 in-process
        return (strategy.reduce(tf.distribute.ReduceOp.SUM, floats, axis=None),
                strategy.reduce(tf.distribute.ReduceOp.MEAN, floats, axis=None),
                strategy.reduce(tf.distribute.ReduceOp.SUM, ints, axis=None),
                strategy.reduce(tf.distribute.ReduceOp.SUM, floats, axis=0))

    total, mean, count, along_axis = tf.function(reduce_all)() if traced else reduce_all()
    np.testing.assert_array_equal(total.numpy(), [2.0, 4.0])
    np.testing.assert_array_equal(mean.numpy(), [1.0, 2.0])
    assert int(count.numpy()) == 6
    assert float(along_axis.numpy()) == 6.0
    assert len(agent.keys_sent("tf.reduce/")) == 4, agent.calls


def test_all_reduce_in_a_replica_context_goes_through_the_service(strategy, agent):
    @tf.function
    def step():
        return strategy.run(lambda: tf.distribute.get_replica_context().all_reduce("SUM", tf.constant([1.0, 5.0])))

    np.testing.assert_array_equal(strategy.experimental_local_results(step())[0].numpy(), [2.0, 10.0])
    assert agent.keys_sent("tf.reduce/")


def test_updates_of_aggregated_variables_go_through_the_service(strategy, agent):
    with strategy.scope():
        counter = tf.Variable(0.0, aggregation=tf.VariableAggregation.SUM)

    @tf.function
    def step():
        strategy.run(lambda: counter.assign_add(1.0))

    step()
    assert float(counter.numpy()) == 2.0  # this worker's 1 and the other's
    assert agent.keys_sent("tf.reduce/")


def test_keras_fit_sums_gradients_through_the_service(strategy, agent):
    x = np.arange(24, dtype=np.float32).reshape(8, 3) / 24
    y = np.arange(16, dtype=np.float32).reshape(8, 2) / 16
    keras.utils.set_random_seed(1)
    with strategy.scope():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    plain = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    plain.set_weights(model.get_weights())
    plain.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")

    model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    plain.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)

    gradient_sums = [shapes for keys, shapes in agent.calls if keys[0].startswith("tf.reduce/")]
    assert gradient_sums == [[(3, 2), (2,)]] * 2, agent.calls  # one all-reduce per step
    assert agent.checked("strategy"), "the variables were not checked"
    assert agent.keys_sent("broadcast/tf.var/"), "the variables were not broadcast"
    # Keras scaled each worker's loss by 1/num_replicas_in_sync; the service summed two equal
    # halves: the step is the plain one.
    for ours, theirs in zip(model.get_weights(), plain.get_weights()):
        np.testing.assert_allclose(ours, theirs, rtol=1e-6)


def test_variables_made_while_tracing_are_broadcast_on_the_first_run_only(strategy, agent):
    with strategy.scope():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
        optimizer = keras.optimizers.SGD(0.1, momentum=0.9)  # its slots appear in the first trace

    @tf.function
    def step(x):
        def replica(x):
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(model(x))
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
        strategy.run(replica, args=(x,))

    for _ in range(3):
        step(tf.ones((2, 3)))
    broadcasts = [keys for keys in agent.keys_sent("broadcast/tf.var/")]
    momentum = [keys for keys in broadcasts if any("momentum" in k for k in keys)]
    assert len(momentum) == 1, broadcasts


def test_a_variable_made_from_the_functions_input_is_broadcast_when_it_first_runs(strategy, agent):
    # TensorFlow cannot lift such an initial value out of the function: it exists only once the
    # function runs, so the broadcast runs inside it, the first time only.
    made = []

    @tf.function
    def step(x):
        def replica(x):
            if not made:
                made.append(tf.Variable(x * 2.0, name="from_input"))
            return made[0].assign_add(x)
        return strategy.run(replica, args=(x,))

    for _ in range(3):
        step(tf.ones(3))
    assert [[key.split("/root0/")[0] for key in keys] for keys in agent.keys_sent("broadcast/tf.var/")] == [
        ["broadcast/tf.var/from_input/float32/(3,)"]]
    np.testing.assert_array_equal(made[0].numpy(), [5.0, 5.0, 5.0])


def test_xla_is_refused_with_a_clear_error(strategy):
    @tf.function(jit_compile=True)
    def step():
        return strategy.run(lambda: tf.distribute.get_replica_context().all_reduce("SUM", tf.constant(1.0)))

    # Raised while AutoGraph converts step(), which re-raises it as its own StagingError.
    with pytest.raises(Exception, match="pslink cannot run inside an XLA-compiled function"):
        step()


def test_gather_is_refused_with_a_clear_error(strategy):
    values = strategy.run(lambda: tf.constant([1.0]))
    with pytest.raises(NotImplementedError, match="does not gather across workers"):
        strategy.gather(values, axis=0)


def test_the_input_function_learns_which_worker_it_feeds(strategy):
    seen = []

    def dataset_fn(context):
        seen.append(context)
        return tf.data.Dataset.range(8).batch(context.get_per_replica_batch_size(8))

    strategy.distribute_datasets_from_function(dataset_fn)
    assert seen, "the input function was not called"
    assert (seen[0].num_input_pipelines, seen[0].input_pipeline_id) == (2, 0)
    assert seen[0].get_per_replica_batch_size(8) == 8 // strategy.num_replicas_in_sync


def test_metric_reads_stay_on_the_worker(strategy, agent):
    with strategy.scope():
        metric = keras.metrics.Mean()
    metric.update_state([1.0, 3.0])
    assert float(metric.result()) == 2.0
    assert not agent.keys_sent("tf.reduce/"), agent.calls


def test_distributed_optimizer_keeps_the_class_and_averages_by_variable(agent):
    optimizer = DistributedOptimizer(keras.optimizers.SGD(0.5, momentum=0.5))
    assert isinstance(optimizer, keras.optimizers.SGD)
    assert optimizer.get_config()["momentum"] == 0.5
    variable = keras.Variable(np.ones(3, np.float32), name="w")
    optimizer.apply([tf.constant([1.0, 2.0, 3.0])], [variable])
    np.testing.assert_allclose(variable.numpy(), [0.5, 0.0, -0.5])  # the mean of two equal grads
    assert agent.checked("gradients")
    assert agent.keys_sent("tf.grad/") == [[service_key("tf.grad", variable.path, "average", "float32", "(3,)")]]
    # Without variables, a built optimizer steps those it was built with (a private Keras list).
    optimizer.apply([tf.constant([1.0, 1.0, 1.0])])
    assert len(agent.keys_sent("tf.grad/")) == 2


def test_gradient_tape_and_allreduce_work_eagerly(agent):
    weights = tf.Variable([1.0, 2.0], name="weights")
    with pslink.tf.DistributedGradientTape(tf.GradientTape()) as tape:
        loss = tf.reduce_sum(weights * weights)
    (grad,) = tape.gradient(loss, [weights])
    np.testing.assert_array_equal(grad.numpy(), [2.0, 4.0])  # the mean of two equal gradients
    assert agent.keys_sent("tf.grad/") == [["tf.grad/weights/average/float32/(2,)"]]
    assert agent.keys_sent("hvd/board"), "the reduction was not announced (join could not mirror it)"
    assert float(pslink.tf.allreduce(tf.constant(3.0), average=False, name="total")) == 6.0
    assert agent.keys_sent("allreduce/total/")


def test_keys_and_names_stay_within_the_service_limits():
    long = service_key("tf.var", "x" * 400)
    assert len(long) <= 256 and long.startswith("tf.var/xxx")
    assert service_key("tf.var", "x" * 400) == long and service_key("tf.var", "x" * 401) != long
    assert unique_names(["a", "b", "a", "a"]) == ["a", "b", "a#2", "a#3"]


def test_a_worker_with_more_variables_is_named_with_the_first_it_has_extra():
    base = [("dense/kernel", "(4, 2)", "float32")]
    error = _difference([base, base + [("dense_1/kernel", "(2, 2)", "float32")]], "check")
    assert isinstance(error, ShapeMismatchError)
    assert "rank 1 has 2 variables, rank 0 has 1" in str(error)
    assert "'dense_1/kernel' (2, 2) float32" in str(error)
