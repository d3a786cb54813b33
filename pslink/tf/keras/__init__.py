"""Horovod's ``horovod.tensorflow.keras`` (and ``horovod.keras``) over the parameter service, for
Keras 3 on TensorFlow::

    import pslink.tf.keras as hvd

    hvd.init()
    optimizer = hvd.DistributedOptimizer(keras.optimizers.SGD(0.01 * hvd.size()))
    model.compile(optimizer=optimizer, loss="sparse_categorical_crossentropy")
    model.fit(x_shard, y_shard, callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                                           hvd.callbacks.MetricAverageCallback()])

Use these without ``ParameterServiceStrategy`` (which reduces gradients itself). The module
offers Horovod's Keras names (``allreduce``, ``allgather``, ``broadcast`` and ``reducescatter``
with Horovod's Keras signatures: a value in, a tensor out) and, beyond them, the rest of
``pslink.tf``'s collectives.
"""

from __future__ import annotations

import tensorflow as tf

# Horovod's build reports, as every adapter offers them
from pslink.core.worker.horovod import (
    ccl_built,
    ddl_built,
    gloo_built,
    gloo_enabled,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    rocm_built,
)
from pslink.core.worker.process_sets import ProcessSet
from pslink.core.worker.reduction import (
    Adasum,
    Average,
    Max,
    Min,
    Product,
    ReduceOp,
    Sum,
)
from pslink.errors import (
    PslinkError as HorovodInternalError,  # a RuntimeError, as Horovod's
)
from pslink.tf import horovod as _tf
from pslink.tf.compression import Compression
from pslink.tf.horovod import (
    add_process_set,
    allgather_object,
    alltoall,
    barrier,
    broadcast_object,
    broadcast_variables,
    cross_rank,
    cross_size,
    cuda_built,
    grouped_allgather,
    grouped_allreduce,
    grouped_reducescatter,
    init,
    is_homogeneous,
    is_initialized,
    join,
    local_rank,
    local_size,
    rank,
    remove_process_set,
    shutdown,
    size,
    start_timeline,
    stop_timeline,
)
from pslink.tf.keras import callbacks, elastic
from pslink.tf.optimizer import (
    DistributedOptimizer,
    PartialDistributedOptimizer,
    load_model,
)
from pslink.tf.world import global_process_set


def allreduce(value, name: str | None = None, average: bool | None = None, prescale_factor: float = 1.0,
              postscale_factor: float = 1.0, op: ReduceOp | None = None, compression=Compression.none,
              process_set: ProcessSet = global_process_set) -> tf.Tensor:
    """``value`` (a tensor, array or number) reduced over the ranks (Horovod's Keras signature;
    ``process_set`` is pslink's addition)."""
    return _tf.allreduce(tf.convert_to_tensor(value), average=average, compression=compression, op=op,
                         prescale_factor=prescale_factor, postscale_factor=postscale_factor, name=name,
                         process_set=process_set)


def allgather(value, name: str | None = None, process_set: ProcessSet = global_process_set) -> tf.Tensor:
    """Every rank's ``value`` concatenated along the first dimension, in rank order."""
    return _tf.allgather(tf.convert_to_tensor(value), name=name, process_set=process_set)


def broadcast(value, root_rank: int, name: str | None = None,
              process_set: ProcessSet = global_process_set) -> tf.Tensor:
    """``root_rank``'s ``value`` on every rank."""
    return _tf.broadcast(tf.convert_to_tensor(value), root_rank, name=name, process_set=process_set)


def reducescatter(value, name: str | None = None, op: ReduceOp = Average,
                  process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0) -> tf.Tensor:
    """``value`` reduced over the ranks, this rank's share of its rows."""
    return _tf.reducescatter(tf.convert_to_tensor(value), op=op, name=name, process_set=process_set,
                             prescale_factor=prescale_factor, postscale_factor=postscale_factor)


def broadcast_global_variables(root_rank: int):
    """Horovod's: TF1 only (a graph's global variables); eagerly it raises Horovod's error,
    naming ``broadcast_variables``."""
    return _tf.broadcast_global_variables(root_rank)


__all__ = [
    "Adasum",
    "Average",
    "Compression",
    "DistributedOptimizer",
    "HorovodInternalError",
    "Max",
    "Min",
    "PartialDistributedOptimizer",
    "ProcessSet",
    "Product",
    "ReduceOp",
    "Sum",
    "add_process_set",
    "allgather",
    "allgather_object",
    "allreduce",
    "alltoall",
    "barrier",
    "broadcast",
    "broadcast_global_variables",
    "broadcast_object",
    "broadcast_variables",
    "callbacks",
    "ccl_built",
    "cross_rank",
    "cross_size",
    "cuda_built",
    "ddl_built",
    "elastic",
    "global_process_set",
    "gloo_built",
    "gloo_enabled",
    "grouped_allgather",
    "grouped_allreduce",
    "grouped_reducescatter",
    "init",
    "is_homogeneous",
    "is_initialized",
    "join",
    "load_model",
    "local_rank",
    "local_size",
    "mpi_built",
    "mpi_enabled",
    "mpi_threads_supported",
    "nccl_built",
    "rank",
    "reducescatter",
    "remove_process_set",
    "rocm_built",
    "shutdown",
    "size",
    "start_timeline",
    "stop_timeline",
]
