"""Horovod's ``hvd.keras`` over the parameter service, for Keras 3 on TensorFlow::

    import pslink.tf.keras as hvd

    hvd.init()
    optimizer = hvd.DistributedOptimizer(keras.optimizers.SGD(0.01 * hvd.size()))
    model.compile(optimizer=optimizer, loss="sparse_categorical_crossentropy")
    model.fit(x_shard, y_shard, callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                                           hvd.callbacks.MetricAverageCallback()])

Use these without ``ParameterServiceStrategy`` (which reduces gradients itself).
"""

from pslink.tf.context import init, local_rank, local_size, rank, shutdown, size
from pslink.tf.keras import callbacks
from pslink.tf.keras.optimizer import DistributedOptimizer
from pslink.tf.ops import allreduce, broadcast, broadcast_variables

__all__ = [
    "DistributedOptimizer",
    "allreduce",
    "broadcast",
    "broadcast_variables",
    "callbacks",
    "init",
    "local_rank",
    "local_size",
    "rank",
    "shutdown",
    "size",
]
