"""Horovod's smaller TensorFlow names: ops that read the job when they run, the in-place and TF1
broadcasts, ``broadcast_object_fn``, and the timeline.

``rank_op()`` and friends are evaluated when the graph runs, not when it is traced (Horovod's
promise: a graph built in one place may run in another); eagerly they are constants.
``broadcast_global_variables`` and ``BroadcastGlobalVariablesHook`` are TF1's (graph mode, a
``tf.compat.v1`` session); eagerly the former raises Horovod's own error, naming
``broadcast_variables``.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import tensorflow as tf

from pslink.core.worker import collectives
from pslink.errors import ConfigError
from pslink.tf import context
from pslink.tf.ops import broadcast_object
from pslink.tf.process_sets import _sets, exchange_of

# Horovod's codes for process_set_included_op (horovod/common/basics.py)
PROCESS_SET_ERROR_INIT = -1
PROCESS_SET_ERROR_UNKNOWN_SET = -3


def _int_op(read: Callable[[], int], name: str | None) -> tf.Tensor:
    """An int32 scalar that ``read()`` gives when the op runs (eagerly: now)."""
    if tf.executing_eagerly():
        return tf.constant(read(), tf.int32, name=name)
    value = tf.numpy_function(lambda: np.int32(read()), [], tf.int32, stateful=True, name=name or "pslink_int")
    value.set_shape([])
    return value


def _process_set(process_set_id: int):
    """The added process set of this id (0: the whole job, None); ConfigError if none has it."""
    if process_set_id == 0:
        return None
    found = _sets(context.exchange()).added.get(process_set_id)
    if found is None:
        raise ConfigError(f"no process set has id {process_set_id!r} (add_process_set gives the ids)")
    return found


def rank_op(name: str | None = None) -> tf.Tensor:
    """This worker's rank, read when the op runs."""
    return _int_op(context.rank, name)


def local_rank_op(name: str | None = None) -> tf.Tensor:
    return _int_op(context.local_rank, name)


def local_size_op(name: str | None = None) -> tf.Tensor:
    return _int_op(context.local_size, name)


def size_op(process_set_id: int = 0, name: str | None = None) -> tf.Tensor:
    """The number of workers (of the process set with this id), read when the op runs."""

    def read() -> int:
        process_set = _process_set(process_set_id)
        return context.size() if process_set is None else process_set.size()

    return _int_op(read, name)


def process_set_included_op(process_set_id: int = 0, name: str | None = None) -> tf.Tensor:
    """1 if this worker is in the process set, 0 if not; Horovod's error codes for a job not
    initialized (-1) or a set not known (-3)."""

    def read() -> int:
        if not context.is_initialized():
            return PROCESS_SET_ERROR_INIT
        try:
            process_set = _process_set(process_set_id)
        except ConfigError:
            return PROCESS_SET_ERROR_UNKNOWN_SET
        return 1 if process_set is None or process_set.included() else 0

    return _int_op(read, name)


def is_homogeneous() -> bool:
    """Every machine runs as many of the job's workers (``pslink launch --nnodes`` starts the same
    number on each: ``PSLINK_LOCAL_SIZE`` of them)."""
    return collectives.is_homogeneous(context.size(), context.local_size())


def broadcast_(variables: Sequence, root_rank: int, name: str | None = None, process_set=None) -> list:
    """Horovod's in-place broadcast: ``root_rank``'s values (of ``process_set``'s workers)
    assigned to ``variables``, after checking that every worker passes the same ones; returns
    their new values. Variables are keyed by their names (``name`` is Horovod's signature)."""
    variables = list(variables)
    exchange_of(process_set).broadcast_variables(variables, root_rank, scope="broadcast_", what="broadcast_")
    return [tf.convert_to_tensor(v) for v in variables]


def broadcast_object_fn(root_rank: int = 0, session=None, name: str | None = None, process_set=None) -> Callable:
    """A function that broadcasts an object from ``root_rank`` (Horovod's, for TF1 sessions;
    ``session`` is not needed here)."""
    name = name or "broadcast_object_fn"
    return lambda obj: broadcast_object(obj, root_rank, name, process_set)


def _global_variables() -> list:
    return tf.compat.v1.global_variables()


def broadcast_global_variables(root_rank: int):
    """TF1: an op that assigns ``root_rank``'s values to every global variable of the graph."""
    if tf.executing_eagerly():
        raise RuntimeError("hvd.broadcast_global_variables() does not support eager execution. Please use "
                           "`hvd.broadcast_variables(<model/optimizer variables>)` instead.")  # Horovod's words
    exchange = context.exchange()
    variables = _global_variables()
    exchange._check_root(root_rank, "broadcast_global_variables")
    if not variables or exchange.num_workers == 1:
        return tf.no_op(name="broadcast_global_variables")
    from pslink.tf.exchange import describe_variables

    entries = describe_variables(variables)
    exchange.check_same_variables(entries, "global", "broadcast_global_variables")
    return tf.group(*exchange.assign_from_root(variables, entries, root_rank, "broadcast_global_variables"))


class BroadcastGlobalVariablesHook(tf.compat.v1.train.SessionRunHook):
    """TF1: a ``SessionRunHook`` that broadcasts every global variable from ``root_rank`` once the
    session is created (``tf.compat.v1.train.MonitoredTrainingSession(hooks=[...])``)."""

    def __init__(self, root_rank: int, device: str = ""):
        super().__init__()
        self.root_rank = root_rank
        self.bcast_op = None
        self.device = device

    def begin(self) -> None:
        if self.bcast_op is None or self.bcast_op.graph != tf.compat.v1.get_default_graph():
            with tf.device(self.device):
                self.bcast_op = broadcast_global_variables(self.root_rank)

    def after_create_session(self, session, coord) -> None:
        session.run(self.bcast_op)


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Horovod's: record this worker's requests to a Chrome trace at ``file_path`` from now on
    (rank 0 writes ``file_path``, rank R ``file_path.rankR``); ``mark_cycles`` marks iterations."""
    if not context.is_initialized():
        raise ConfigError("pslink.tf has not been initialized; call pslink.tf.init() first")
    context.exchange().agent.start_timeline(file_path, mark_cycles)


def stop_timeline() -> None:
    if not context.is_initialized():
        raise ConfigError("pslink.tf has not been initialized; call pslink.tf.init() first")
    context.exchange().agent.stop_timeline()
