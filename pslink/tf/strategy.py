"""``ParameterServiceStrategy``: a tf.distribute strategy whose workers meet at the parameter service.

::

    strategy = pslink.tf.ParameterServiceStrategy()   # under `pslink launch -n 2 python train.py`
    with strategy.scope():
        model = build_model()
        model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    model.fit(x_of_this_worker, y_of_this_worker, batch_size=32)

Within a worker process it is MirroredStrategy (one replica per local device); across workers
every reduction (the optimizer's gradient all-reduce, ``strategy.reduce``, ``all_reduce`` in a
custom loop, aggregated variable updates) is summed by the service. Semantics, as Horovod users
expect them:

- Each worker feeds its own data; a batch size is per worker. ``num_replicas_in_sync`` counts
  the replicas of all workers, so that Keras and ``tf.nn.compute_average_loss`` scale the loss
  by it and the summed gradient is the mean over the combined batch of all workers.
- Variables created under the scope start from rank 0's values: before and after each
  ``strategy.run`` (in a ``tf.function``: when it is traced) the variables created since the
  last time are checked (names, shapes, dtypes equal on every worker, else ShapeMismatchError
  naming the variable and both shapes) and broadcast from rank 0.
- Metrics (sync-on-read variables) stay per worker; average them with
  ``pslink.tf.keras.callbacks.MetricAverageCallback``.
- ``distribute_datasets_from_function`` passes ``num_input_pipelines`` = workers and
  ``input_pipeline_id`` = rank, so the input function can shard.
- XLA (``jit_compile=True``) and ``strategy.gather`` are not supported: clear errors.
"""

from __future__ import annotations

import hashlib
import sys
import threading
import weakref
from collections.abc import Sequence

import numpy as np
import tensorflow as tf

from pslink.core.agent import Agent
from pslink.core.worker.buckets import bucket_share
from pslink.core.worker.collectives import service_key
from pslink.core.worker.groups import GroupAgent
from pslink.core.worker.session import Session
from pslink.errors import PslinkError
from pslink.tf import _internals, collectives, graph, tensors, variables
from pslink.tf.graph import Out
from pslink.tf.groups import end_group_step
from pslink.tf.world import holder

WHAT = "ParameterServiceStrategy"


class ParameterServiceStrategy(tf.distribute.MirroredStrategy):
    """MirroredStrategy inside each worker process; the parameter service between workers.

    The strategy uses the process's Session (``pslink.tf.init()``'s; made from ``options`` and the
    ``PSLINK_*`` variables if there is none yet, as ``init`` makes it): the callbacks and the
    Horovod API share it. ``devices``: the local devices (default: all). Fails at once, naming
    the address, if the service is unreachable.
    """

    def __init__(self, *, devices=None, **options):
        self._session: Session = holder.init(**options)
        self._keys = SiteKeys("tf.reduce")
        self._new_variables: list = []  # created under the scope, not checked yet
        self._waiting: list = []  # checked, but their initial values did not exist yet
        self._sent_by_graph: dict[int, object] = {}  # those broadcast by a traced function, by id
        self._model_variables: list = []  # every one made under the scope: a group's sync averages them
        self._variables_lock = threading.Lock()
        _internals.init_strategy(self, devices, self)

    def __repr__(self) -> str:
        return (f"<ParameterServiceStrategy job={self.agent.job!r} rank={self.rank}/{self.num_workers} "
                f"local_replicas={self.local_replicas}>")

    # -- what the strategy tells its users -------------------------------------------------------

    @property
    def rank(self) -> int:
        """This worker's rank in the job."""
        return self._session.rank

    @property
    def num_workers(self) -> int:
        return self._session.size

    @property
    def local_replicas(self) -> int:
        return len(self.extended.worker_devices)

    @property
    def num_replicas_in_sync(self) -> int:
        """Replicas of every worker together (each worker: one per local device)."""
        return self.local_replicas * self.num_workers

    @property
    def agent(self) -> Agent:
        return self._session.agent

    def run(self, fn, args=(), kwargs=None, options=None):
        """``MirroredStrategy.run``, with the variables created since the last call synchronised
        (from rank 0) before and after. In a ``tf.function`` this happens while tracing."""
        # Not marked do_not_convert (that would stop AutoGraph converting ``fn`` too); named
        # explicitly rather than through super(), which AutoGraph's conversion of this method
        # would not see.
        self.sync_variables()
        result = tf.distribute.MirroredStrategy.run(self, fn, args=args, kwargs=kwargs, options=options)
        self.sync_variables()
        if isinstance(self.agent, GroupAgent):  # sync="local:T": the step ends with the groups' sync
            self._end_group_step()
        return result

    def _end_group_step(self) -> None:
        with self._variables_lock:
            trainable = [v for v in self._model_variables if v.trainable]
        end_group_step(self.agent, trainable)

    @tf.autograph.experimental.do_not_convert
    def sync_variables(self) -> None:
        """Check and broadcast (from rank 0) the variables created under the scope since the last
        call; with none, nothing happens. Every worker must call it at the same points of the
        program, which ``run`` does.

        New variables are checked at once (names, shapes, dtypes, on every worker alike). Their
        values go at once, unless a ``tf.function`` being traced made them: their initial values
        exist only later. TensorFlow then traces the function a second time before running it,
        and they go then; where it cannot (initial values computed from the function's inputs),
        ops added now send them when the function first runs."""
        with self._variables_lock:
            fresh, self._new_variables = self._new_variables, []
            waiting = [v for v in self._waiting if id(v) not in self._sent_by_graph]
            self._waiting = []
        if self.num_workers == 1 or not (fresh or waiting):
            return
        with self.scope():
            with tf.init_scope():  # eagerly, also while a tf.function is being traced
                if fresh:
                    variables.check_same(self._session, variables.describe_variables(fresh), "strategy", WHAT)
                candidates = waiting + fresh
                initialized = [_initialized(v) for v in candidates]
                ready = [v for v, yes in zip(candidates, initialized) if yes]
                if ready:
                    self._assign_from_root(ready)
            pending = [v for v, yes in zip(candidates, initialized) if not yes]
            if pending:
                with self._variables_lock:
                    self._waiting.extend(pending)
                if not tf.executing_eagerly():
                    self._assign_on_first_run(pending)

    def _assign_on_first_run(self, waiting: list) -> None:
        """Ops, in the function being traced, that broadcast ``waiting`` (variables) when it first runs.

        "First" across every trace holding such ops (TensorFlow may run a second trace of the
        function from the second call on): every worker runs the same traces equally often."""
        ids = [id(v) for v in waiting]

        def first_run():
            with self._variables_lock:
                return np.bool_(not all(i in self._sent_by_graph for i in ids))

        def mark_sent():
            with self._variables_lock:
                self._sent_by_graph.update(zip(ids, waiting))
            return np.bool_(True)

        def assign():
            with tf.control_dependencies(self._assign_from_root(waiting)):
                return tf.numpy_function(mark_sent, [], tf.bool, stateful=True, name="pslink_sent")

        def build():
            pending = tf.numpy_function(first_run, [], tf.bool, stateful=True, name="pslink_first_run")
            return tf.cond(tf.reshape(pending, []), assign, lambda: tf.constant(False))

        graph.ordered(build)

    def _assign_from_root(self, candidates: list) -> list:
        """Assign rank 0's values to ``candidates`` (checked already); the assign ops."""
        entries = variables.describe_variables(candidates)
        named = [(service_key("tf.var", name, dtype, shape), tf.convert_to_tensor(v))
                 for (name, shape, dtype), v in zip(entries, candidates)]
        values = collectives.broadcast_many(self._session, named, 0, WHAT, f"{WHAT}.variables")
        return [v.assign(value) for v, value in zip(candidates, values)]

    # -- hooks called by _internals.Extended -----------------------------------------------------

    def variable_created(self, variable) -> None:
        if variable.synchronization == tf.VariableSynchronization.ON_READ:
            return  # per-replica accumulators (metrics): local by design
        with self._variables_lock:
            self._new_variables.append(variable)
            self._model_variables.append(variable)

    def global_replicas(self) -> int:
        return self.num_replicas_in_sync

    def cross_worker_reduce(self, reduce_op, components: list[list]) -> list:
        """Sum each value's local replicas, then over the workers through the service. Sparse
        gradients (``tf.IndexedSlices``: an embedding's) stay sparse: every worker's rows and
        indices are gathered, as MultiWorkerMirroredStrategy does, never a dense table's worth."""
        sparse = [i for i, c in enumerate(components) if any(isinstance(t, tf.IndexedSlices) for t in c)]
        if not sparse:
            return self._reduce_dense(reduce_op, components)
        dense = self._reduce_dense(reduce_op, [c for i, c in enumerate(components) if i not in sparse])
        gathered = [self._reduce_sparse(reduce_op, components[i]) for i in sparse]
        results = iter(dense)
        slices = dict(zip(sparse, gathered))
        return [slices[i] if i in slices else next(results) for i in range(len(components))]

    def _reduce_sparse(self, reduce_op, replicas: list) -> tf.IndexedSlices:
        parts = [t if isinstance(t, tf.IndexedSlices) else _as_slices(tf.convert_to_tensor(t)) for t in replicas]
        values = tf.concat([p.values for p in parts], 0) if len(parts) > 1 else parts[0].values
        indices = tf.concat([tf.cast(p.indices, tf.int64) for p in parts], 0) if len(parts) > 1 else parts[0].indices
        if self.num_workers > 1:
            keys = self._keys.keys([values, indices])
            values = collectives.allgather(self._session, values, keys[0])
            indices = collectives.allgather(self._session, indices, keys[1])
        if reduce_op == tf.distribute.ReduceOp.MEAN:
            values = _divide(values, self.num_replicas_in_sync)
        return tf.IndexedSlices(values, indices, parts[0].dense_shape)

    def _reduce_dense(self, reduce_op, components: list[list]) -> list[tf.Tensor]:
        if not components:
            return []
        local = [c[0] if len(c) == 1 else tf.add_n([tf.convert_to_tensor(t) for t in c]) for c in components]
        local = [tf.convert_to_tensor(t) for t in local]
        if self.num_workers == 1:
            totals = local
        else:
            totals = self._sum(self._keys.keys(local), local)
        if reduce_op == tf.distribute.ReduceOp.MEAN:
            totals = [_divide(t, self.num_replicas_in_sync) for t in totals]
        return totals


    def _sum(self, keys: list[str], values: list[tf.Tensor]) -> list[tf.Tensor]:
        """Each value summed over the workers under the strategy's own keys (no Horovod call: a
        strategy's reductions are sums, named by where they are made). A key gets the runtime
        shape appended when the static shape is not fully known, so a value whose shape changes
        from step to step never meets a differently shaped round.

        Eagerly: one request. In a graph: the values in buckets (:func:`buckets`), each pushed
        as soon as its values exist and waited for only later, so that the exchange of the
        gradients backward produces first overlaps the backward of the layers before them; the
        results are received into buffers reused from step to step (:class:`OutPool`)."""
        carried = [tensors.wire(v.dtype, f"{WHAT} reduction", reduced=True) for v in values]
        dynamic = [not v.shape.is_fully_defined() for v in values]
        wired = [tensors.to_wire(v, c) for v, c in zip(values, carried)]
        outputs = [Out(c, v.shape) for v, c in zip(values, carried)]
        if graph.eager():
            def call(*arrays):
                return self._start(keys, dynamic, arrays, [tensors.empty(a.shape, a.dtype) for a in arrays])()

            sums = graph.run(f"{WHAT} reduction", call, wired, outputs, "reduce")
        else:
            # Only pushpull_many is asked of the agent otherwise: a stand-in without a fusion
            # threshold gets buckets of a third of the reduction.
            fusion_bytes = getattr(self.agent, "fusion_bytes", 0)
            calls, made = [], buckets([v.shape.num_elements() or 0 for v in values], [c.size for c in carried],
                                      fusion_bytes)
            for members in made:
                pool = OutPool()

                def start(*arrays, members=members, pool=pool):
                    return self._start([keys[i] for i in members], [dynamic[i] for i in members], arrays,
                                       pool.take(arrays))

                calls.append((start, [wired[i] for i in members], [outputs[i] for i in members]))
            results = graph.run_in_flight(f"{WHAT} reduction", calls, "reduce")
            sums = [None] * len(values)
            for members, outs in zip(made, results):
                for i, out in zip(members, outs):
                    sums[i] = out
        return [tensors.from_wire(s, v.dtype) for s, v in zip(sums, values)]

    def _start(self, keys: list[str], dynamic: list[bool], arrays, outs: list[np.ndarray]):
        """Push-pull ``arrays`` into ``outs`` now; a function that waits for the sums."""
        session = self._session
        final = [service_key(k, a.shape) if d else k for k, a, d in zip(keys, arrays, dynamic)]
        try:
            handle = session.agent.pushpull_many(final, list(arrays), outs=outs)
        except PslinkError as exc:
            raise self._named(exc) from None

        def finish(arrays=arrays):  # holds the inputs (views of TensorFlow's buffers) until done
            try:
                handle.wait(session.timeout)
            except PslinkError as exc:
                raise self._named(exc) from None
            return outs

        return finish

    def _named(self, exc: PslinkError) -> PslinkError:
        session = self._session
        return type(exc)(f"{WHAT} reduction (rank {session.rank} of {session.size}): {exc.message}", **exc.details)


def buckets(sizes: Sequence[int], itemsizes: Sequence[int], fusion_bytes: int) -> list[list[int]]:
    """The values of one reduction (``sizes`` elements of ``itemsizes`` bytes each, in the order
    given: a Keras optimizer's, the variables' order) as buckets of indices, the bucket of the
    last values first (backward produces the gradients of the last layers first), each bucket's
    indices in the order given (a reduction that is one bucket is one request, as before). A
    bucket is closed once it holds :func:`~pslink.core.worker.buckets.bucket_share` (a third of
    the total, at most the Agent's fusion threshold when it has one), the same rule as
    pslink.torch.fusion's. Every worker makes the same buckets."""
    nbytes = [n * b for n, b in zip(sizes, itemsizes)]
    share = bucket_share(fusion_bytes, sum(nbytes))
    made, current, held = [], [], 0
    for i in reversed(range(len(sizes))):
        current.append(i)
        held += nbytes[i]
        if held >= share:
            made.append(sorted(current))
            current, held = [], 0
    if current:
        made.append(sorted(current))
    return made


class OutPool:
    """The arrays a bucket's sums are received into, reused once TensorFlow let go of them.

    TensorFlow takes a ``tf.numpy_function``'s aligned result without copying it and holds the
    array until the tensor is freed. A fresh array each step would cost its pages' first touch
    when the Agent writes into it (``benchmarks/copy_costs.py``: 0.105 ms/MB at 64 MiB, against
    0.046 for a copy into pages already touched), so an array nobody holds any more (its
    reference count says so) is used again. At most :data:`KEPT` sets are kept; beyond them (TensorFlow holding results
    longer) fresh arrays are made."""

    KEPT = 3

    def __init__(self):
        self._sets: list[list[np.ndarray]] = []
        self._lock = threading.Lock()

    def take(self, like: Sequence[np.ndarray]) -> list[np.ndarray]:
        shapes = [(a.shape, a.dtype) for a in like]
        with self._lock:
            for outs in self._sets:
                # Referenced only by the set, the loop variable and getrefcount's argument:
                # TensorFlow let go (an array still in flight is held by its finish function too).
                if [(o.shape, o.dtype) for o in outs] == shapes and all(sys.getrefcount(o) == 3 for o in outs):
                    return outs
            outs = [tensors.empty(a.shape, a.dtype) for a in like]
            if len(self._sets) < self.KEPT:
                self._sets.append(outs)
            return outs


class SiteKeys:
    """Keys for the strategy's reductions, which have no name.

    A reduction is named by its signature (dtypes and static shapes of the tensors reduced
    together) and by how many reductions of that signature came before it in the function being
    traced: deterministic on every worker running the same program, stable across retracing, and
    distinct for two reductions of one step, which TensorFlow may run in either order."""

    def __init__(self, prefix: str):
        self.prefix = prefix
        self._counts: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def keys(self, values: Sequence[tf.Tensor]) -> list[str]:
        signature = ";".join(f"{t.dtype.name}{variables.shape_text(t.shape)}" for t in values)
        digest = hashlib.sha1(signature.encode()).hexdigest()[:12]
        occurrence = 0
        if not tf.executing_eagerly():
            counts = self._counts.setdefault(tf.compat.v1.get_default_graph(), {})
            occurrence = counts.get(digest, 0)
            counts[digest] = occurrence + 1
        return [service_key(self.prefix, f"{digest}.{occurrence}", i) for i in range(len(values))]


def _initialized(variable) -> bool:
    try:
        return bool(variable.is_initialized())
    except (tf.errors.OpError, ValueError, TypeError):
        return False


def _as_slices(tensor: tf.Tensor) -> tf.IndexedSlices:
    """A dense replica's value beside sparse ones: every row of it, as slices."""
    rows = tf.shape(tensor, out_type=tf.int64)[0]
    return tf.IndexedSlices(tensor, tf.range(rows), tf.shape(tensor, out_type=tf.int64))


def _divide(tensor: tf.Tensor, n: int) -> tf.Tensor:
    if tensor.dtype.is_floating or tensor.dtype.is_complex:
        return tensor / tf.cast(n, tensor.dtype)
    return tensor // tf.cast(n, tensor.dtype)  # MEAN of integers keeps the dtype, rounding down

