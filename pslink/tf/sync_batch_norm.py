"""Horovod's ``SyncBatchNormalization``: Keras batch normalization with the whole job's batch
statistics.

In training each worker's mean and mean of squares per channel are averaged over the workers
(one all-reduce, differentiable: its gradient is the all-reduce of the gradients), so every
worker normalizes with the statistics of all workers' samples together; as Horovod's, it
assumes every worker brings a batch of the same size. Inference uses the moving statistics.
"""

from __future__ import annotations

import keras
import tensorflow as tf

from pslink.errors import ConfigError
from pslink.tf import context
from pslink.tf.ops import allreduce


class SyncBatchNormalization(keras.layers.BatchNormalization):
    """``keras.layers.BatchNormalization``'s arguments; ``fused=True`` is refused (Horovod's rule)."""

    def __init__(self, fused: bool | None = False, **kwargs):
        if fused in (True, None):
            raise ConfigError("SyncBatchNormalization does not support fused=True.")  # Horovod's words
        if kwargs.get("synchronized"):
            raise ConfigError("SyncBatchNormalization synchronizes through pslink; leave Keras' synchronized= off")
        kwargs.setdefault("name", None)
        super().__init__(**kwargs)

    def _moments(self, inputs, mask):
        mean, variance = super()._moments(inputs, mask)
        if context.size() == 1:
            return mean, variance
        # Var[X] = E[X^2] - E[X]^2, each expectation the workers' average (equal batches).
        stacked = tf.stack([mean, variance + tf.math.square(mean)])
        group_mean, group_mean_of_square = tf.unstack(allreduce(stacked))
        return group_mean, group_mean_of_square - tf.math.square(group_mean)
