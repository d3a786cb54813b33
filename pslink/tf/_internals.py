"""Every use of TensorFlow's (and Keras') private API in pslink, and nothing else.

A ``tf.distribute`` strategy that reduces across processes cannot be built from public API alone:
TensorFlow's own strategies short-circuit the cross-device reduction when a process has one device,
send reductions to the host through a built-in op that never leaves the process, and under XLA
replace custom cross-device ops with collectives. So :class:`Extended` subclasses MirroredStrategy's
private ``MirroredExtended`` and overrides the few methods every reduction passes through. The
rest of the adapter uses public TensorFlow API and this module's functions; :data:`USED` lists the
private names this module relies on. (Keras: one private attribute, in
:func:`optimizer_trainable_variables`.)

``tests/tf/test_tf_internals.py`` checks each of those names and their signatures, and that
``Strategy.reduce``, ``ReplicaContext.all_reduce``, variable creation and Keras ``model.fit``
still reach the overrides, so a TensorFlow release that breaks this module fails loudly there
rather than training each worker alone.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Protocol

import tensorflow as tf

try:
    from tensorflow.python.distribute import cross_device_ops as _cross_device_ops
    from tensorflow.python.distribute import distribute_utils as _distribute_utils
    from tensorflow.python.distribute import input_util as _input_util
    from tensorflow.python.distribute import mirrored_strategy as _mirrored_strategy
    from tensorflow.python.ops import control_flow_util as _control_flow_util

    _MirroredExtended = _mirrored_strategy.MirroredExtended
except (ImportError, AttributeError) as _exc:  # pragma: no cover - depends on the TensorFlow release
    raise ImportError(
        f"pslink.tf relies on TensorFlow internals that TensorFlow {tf.__version__} lacks ({_exc}); "
        "it was tested with TensorFlow 2.17 (see docs/tf.md)"
    ) from None

# What TensorFlow must still offer, with the parameters relied on (checked by the test named
# above): owner, attribute, parameter names. Methods of MirroredExtended are listed with the
# arguments our overrides receive.
USED = {
    "MirroredExtended.__init__": (_MirroredExtended, "__init__",
                                  ["self", "container_strategy", "devices", "cross_device_ops"]),
    "MirroredExtended._reduce_to": (_MirroredExtended, "_reduce_to",
                                    ["self", "reduce_op", "value", "destinations", "options"]),
    "MirroredExtended._batch_reduce_to": (_MirroredExtended, "_batch_reduce_to",
                                          ["self", "reduce_op", "value_destination_pairs", "options"]),
    "MirroredExtended._use_merge_call": (_MirroredExtended, "_use_merge_call", ["self"]),
    "MirroredExtended._create_variable": (_MirroredExtended, "_create_variable",
                                          ["self", "next_creator", "kwargs"]),
    "MirroredExtended._gather_to_implementation": (_MirroredExtended, "_gather_to_implementation",
                                                   ["self", "value", "destinations", "axis", "options"]),
    "MirroredExtended._distribute_datasets_from_function": (
        _MirroredExtended, "_distribute_datasets_from_function", ["self", "dataset_fn", "options"]),
    "MirroredExtended._input_workers_with_options": (_MirroredExtended, "_input_workers_with_options",
                                                     ["self", "options"]),
    "MirroredExtended._local_results": (_MirroredExtended, "_local_results", ["self", "val"]),
    "MirroredExtended._container_strategy": (_MirroredExtended, "_container_strategy", ["self"]),
    "cross_device_ops.simple_broadcast": (_cross_device_ops, "simple_broadcast",
                                          ["value", "destinations", "always_mirrored", "canonicalize_devices"]),
    "distribute_utils.is_mirrored": (_distribute_utils, "is_mirrored", ["val"]),
    "input_util.get_distributed_datasets_from_function": (
        _input_util, "get_distributed_datasets_from_function",
        ["dataset_fn", "input_workers", "input_contexts", "strategy", "options"]),
    "control_flow_util.GraphOrParentsInXlaContext": (_control_flow_util, "GraphOrParentsInXlaContext", ["graph"]),
}


def missing_or_changed() -> list[str]:
    """What of :data:`USED` this TensorFlow no longer offers as expected (empty when all is well)."""
    problems = []
    for name, (owner, attribute, params) in USED.items():
        fn = getattr(owner, attribute, None)
        if fn is None:
            problems.append(f"{name} is gone")
            continue
        try:
            have = list(inspect.signature(fn).parameters)
        except (TypeError, ValueError) as exc:
            problems.append(f"{name}: no signature ({exc})")
            continue
        lacking = [p for p in params if p not in have]
        if lacking:
            problems.append(f"{name}{tuple(have)} lacks {lacking}")
    return problems


class Hooks(Protocol):
    """What :class:`Extended` asks of the strategy (all public TensorFlow API on that side)."""

    rank: int
    num_workers: int

    def cross_worker_reduce(self, reduce_op: tf.distribute.ReduceOp,
                            components: list[list[tf.Tensor]]) -> list[tf.Tensor]:
        """Reduce each value (given as its local replicas' tensors) over every worker."""

    def variable_created(self, variable: tf.Variable) -> None:
        """A variable was created under the strategy's scope."""

    def global_replicas(self) -> int:
        """Replicas of all workers together."""


def init_strategy(strategy: tf.distribute.MirroredStrategy, devices, hooks: Hooks) -> Extended:
    """Initialise ``strategy`` (a MirroredStrategy subclass) with an :class:`Extended`.

    MirroredStrategy.__init__ builds its own MirroredExtended; we skip it and hand our Extended to
    tf.distribute.Strategy.__init__, as MirroredStrategy.__init__ itself does."""
    extended = Extended(strategy, devices, hooks)
    tf.distribute.Strategy.__init__(strategy, extended)
    return extended


def in_xla_context() -> bool:
    """Whether ops built now are compiled by XLA (which cannot run a numpy_function)."""
    return _control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph())


def optimizer_trainable_variables(optimizer) -> list:
    """The variables a Keras optimizer steps when ``apply`` is given none (Keras keeps them private)."""
    return list(optimizer._trainable_variables)


class Extended(_MirroredExtended):
    """MirroredExtended whose reductions go to every worker through ``hooks``."""

    def __init__(self, container_strategy, devices, hooks: Hooks):
        super().__init__(container_strategy, devices=devices)
        self._pslink_hooks = hooks

    def _use_merge_call(self):
        # Without merge_call (XLA on GPUs) MirroredStrategy all-reduces with in-process
        # collectives that never reach the other workers; with it, every all-reduce comes to
        # _batch_reduce_to, where a numpy_function under XLA fails with a clear message.
        return True

    def _create_variable(self, next_creator, **kwargs):
        variable = super()._create_variable(next_creator, **kwargs)
        self._pslink_hooks.variable_created(variable)
        return variable

    def _reduce_to(self, reduce_op, value, destinations, options):
        if _distribute_utils.is_mirrored(value) and reduce_op == tf.distribute.ReduceOp.MEAN:
            return value  # the same on every replica of every worker
        if isinstance(value, tf.Variable) and value.synchronization == tf.VariableSynchronization.ON_READ:
            # Reading a sync-on-read variable (a Keras metric) stays local: workers read them at
            # different times, so a cross-worker read could wait forever. See MetricAverageCallback.
            return super()._reduce_to(reduce_op, value, destinations, options)
        flat = tf.nest.flatten(value, expand_composites=False)
        reduced = self._reduce_pairs(reduce_op, [(v, destinations) for v in flat])
        return tf.nest.pack_sequence_as(value, reduced)

    def _batch_reduce_to(self, reduce_op, value_destination_pairs, options):
        return self._reduce_pairs(reduce_op, list(value_destination_pairs))

    def _reduce_pairs(self, reduce_op, pairs: Sequence[tuple]) -> list:
        if not pairs:
            return []
        components = [self._components(value) for value, _ in pairs]
        reduced = self._pslink_hooks.cross_worker_reduce(reduce_op, components)
        return [_cross_device_ops.simple_broadcast(r, d) for r, (_, d) in zip(reduced, pairs)]

    def _components(self, value) -> list:
        if isinstance(value, tf.distribute.DistributedValues):
            return list(self._local_results(value))
        # A plain value stands for the same value on every local replica (MirroredStrategy's rule).
        return [value] * len(self.worker_devices)

    def _gather_to_implementation(self, value, destinations, axis, options):
        raise NotImplementedError(
            "ParameterServiceStrategy does not gather across workers (strategy.gather and "
            "ReplicaContext.all_gather); reduce with strategy.reduce or all_reduce instead"
        )

    def _distribute_datasets_from_function(self, dataset_fn, options):
        # Unlike MirroredStrategy, tell the input function which worker it feeds, so that it can
        # shard: ctx.num_input_pipelines == workers, ctx.input_pipeline_id == rank.
        hooks = self._pslink_hooks
        input_workers = self._input_workers_with_options(options)
        context = tf.distribute.InputContext(
            num_input_pipelines=hooks.num_workers,
            input_pipeline_id=hooks.rank,
            num_replicas_in_sync=hooks.global_replicas(),
        )
        return _input_util.get_distributed_datasets_from_function(
            dataset_fn, input_workers, [context] * input_workers.num_workers,
            self._container_strategy(), options,
        )
