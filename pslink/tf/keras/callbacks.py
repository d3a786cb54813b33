"""Keras callbacks of Horovod's ``hvd.keras.callbacks``, over the parameter service."""

from __future__ import annotations

import numbers

import keras
import numpy as np
import tensorflow as tf

from pslink.tf import context
from pslink.tf.exchange import service_key
from pslink.tf.ops import broadcast_variables


class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):
    """At the start of training, give every worker ``root_rank``'s model and optimizer variables
    (after checking that every worker has the same ones; if not, a ShapeMismatchError names the
    first variable that differs and both shapes). Needed without ParameterServiceStrategy."""

    def __init__(self, root_rank: int = 0):
        super().__init__()
        self.root_rank = root_rank
        self.broadcast_done = False

    def on_train_begin(self, logs=None):
        if self.broadcast_done:
            return
        variables = list(self.model.weights)
        optimizer = getattr(self.model, "optimizer", None)
        if optimizer is not None and optimizer.built:
            variables += list(optimizer.variables)
        broadcast_variables(variables, self.root_rank)
        self.broadcast_done = True


class MetricAverageCallback(keras.callbacks.Callback):
    """At the end of each epoch, replace the numeric values in ``logs`` (loss, metrics,
    validation) by their mean over the workers, before Keras prints or records them. Put it
    before callbacks that read the logs (it runs before Keras' own progress bar and History)."""

    def on_epoch_end(self, epoch, logs=None):
        if not logs:
            return
        names = sorted(k for k, v in logs.items() if _is_number(v))
        if not names:
            return
        exchange = context.exchange()
        if exchange.num_workers == 1:
            return
        exchange.check_once([(n, "()", "float64") for n in names], "metrics", "MetricAverageCallback")
        values = np.array([float(logs[n]) for n in names], np.float64)
        key = service_key("tf.metrics", len(names))
        mean = exchange.sum([key], [tf.constant(values)], average=True, what="MetricAverageCallback")[0].numpy()
        for name, value in zip(names, mean):
            logs[name] = float(value)


def _is_number(value) -> bool:
    if isinstance(value, numbers.Number) and not isinstance(value, bool):
        return True
    shape = getattr(value, "shape", None)
    return shape is not None and tuple(shape) == () and np.issubdtype(np.asarray(value).dtype, np.number)


__all__ = ["BroadcastGlobalVariablesCallback", "MetricAverageCallback"]
