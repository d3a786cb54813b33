"""Horovod's ``SyncBatchNormalization``: Keras batch normalization with the whole job's batch
statistics.

In training each rank's mean and mean of squares per channel are averaged over the ranks (one
allreduce, differentiable: its gradient is the allreduce of the gradients), so every rank
normalizes with the statistics of all ranks' samples together; as Horovod's, it assumes every
rank brings a batch of the same size. Inference uses the moving statistics.
"""

from __future__ import annotations

import keras
import tensorflow as tf

from pslink.core.worker.reduction import Average
from pslink.errors import ConfigError
from pslink.tf import gradients
from pslink.tf.world import current_session


class SyncBatchNormalization(keras.layers.BatchNormalization):
    """``keras.layers.BatchNormalization``'s arguments; ``fused=True`` is refused (Horovod's rule)."""

    def __init__(self, fused: bool | None = False, **kwargs):
        if fused in (True, None):
            raise ConfigError("SyncBatchNormalization does not support fused=True.")  # Horovod's words
        if kwargs.get("synchronized"):
            raise ConfigError("SyncBatchNormalization synchronizes through pslink; leave Keras' synchronized= off")
        if not kwargs.get("name"):
            kwargs["name"] = None  # Keras numbers its layers: sync_batch_normalization, ..._1, ...
        super().__init__(**kwargs)

    def _moments(self, inputs, mask):
        mean, variance = super()._moments(inputs, mask)
        session = current_session()
        if session.size == 1:
            return mean, variance
        # Var[X] = E[X^2] - E[X]^2, each expectation the ranks' average (equal batches).
        stacked = tf.stack([mean, variance + tf.math.square(mean)])
        group_mean, group_mean_of_square = tf.unstack(gradients.allreduce(session, stacked, None, Average, 1.0, 1.0))
        return group_mean, group_mean_of_square - tf.math.square(group_mean)
