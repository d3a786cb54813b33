"""Horovod's ``hvd.keras`` over the parameter service, for Keras 3 on TensorFlow::

    import pslink.tf.keras as hvd

    hvd.init()
    optimizer = hvd.DistributedOptimizer(keras.optimizers.SGD(0.01 * hvd.size()))
    model.compile(optimizer=optimizer, loss="sparse_categorical_crossentropy")
    model.fit(x_shard, y_shard, callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                                           hvd.callbacks.MetricAverageCallback()])

Use these without ``ParameterServiceStrategy`` (which reduces gradients itself).
"""

from pslink.core.worker.collectives import (
    Adasum,
    Average,
    Max,
    Min,
    Product,
    Sum,
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
from pslink.tf.context import (
    cross_rank,
    cross_size,
    cuda_built,
    init,
    is_initialized,
    local_rank,
    local_size,
    rank,
    shutdown,
    size,
)
from pslink.tf.keras import callbacks, elastic
from pslink.tf.keras.optimizer import DistributedOptimizer, load_model
from pslink.tf.functions import broadcast_global_variables, start_timeline, stop_timeline
from pslink.errors import PslinkError as HorovodInternalError  # a RuntimeError, as Horovod's
from pslink.tf.ops import (Compression, allgather, allgather_object, allreduce, barrier, broadcast,
                           broadcast_object, broadcast_variables, grouped_allreduce, join)
from pslink.tf.rows import alltoall, grouped_allgather, grouped_reducescatter, reducescatter
from pslink.tf.process_sets import ProcessSet, add_process_set, global_process_set, remove_process_set

__all__ = [
    "elastic",
    "broadcast_global_variables",
    "load_model",
    "start_timeline",
    "stop_timeline",
    "Adasum",
    "Average",
    "DistributedOptimizer",
    "HorovodInternalError",
    "Max",
    "Min",
    "Product",
    "Sum",
    "allgather",
    "allgather_object",
    "allreduce",
    "barrier",
    "broadcast",
    "broadcast_object",
    "broadcast_variables",
    "grouped_allreduce",
    "join",
    "ProcessSet",
    "add_process_set",
    "global_process_set",
    "remove_process_set",
    "grouped_allgather",
    "grouped_reducescatter",
    "reducescatter",
    "alltoall",
    "Compression",
    "callbacks",
    "ccl_built",
    "cross_rank",
    "cross_size",
    "cuda_built",
    "ddl_built",
    "gloo_built",
    "gloo_enabled",
    "init",
    "is_initialized",
    "local_rank",
    "local_size",
    "mpi_built",
    "mpi_enabled",
    "mpi_threads_supported",
    "nccl_built",
    "rank",
    "rocm_built",
    "shutdown",
    "size",
]
