"""``DistributedOptimizer``: a Keras optimizer that averages gradients over the workers first."""

from __future__ import annotations

import keras
import tensorflow as tf

from pslink.errors import ConfigError
from pslink.tf import _internals, context
from pslink.tf.groups import end_group_step
from pslink.tf.ops import allreduce_gradients


class _Distributed:
    """Mixed in before the wrapped optimizer's class: ``apply`` (which ``apply_gradients`` and
    ``model.fit`` call) averages the gradients over the workers, keyed by variable path."""

    _pslink_average = True
    _pslink_prefix = ""

    @tf.autograph.experimental.do_not_convert
    def apply(self, grads, trainable_variables=None):
        grads = list(grads)
        if trainable_variables is not None:
            variables = list(trainable_variables)
        elif self.built:
            variables = _internals.optimizer_trainable_variables(self)
        else:
            return super().apply(grads, trainable_variables)  # Keras explains what is missing
        grads = allreduce_gradients(grads, variables, self._pslink_average, self._pslink_prefix,
                                    what=f"DistributedOptimizer({type(self).__name__})")
        result = super().apply(grads, trainable_variables)
        end_group_step(context.exchange().agent, variables)  # sync="local:T": every T steps, the groups' average
        return result


def DistributedOptimizer(optimizer: keras.optimizers.Optimizer, average: bool = True,
                         name: str | None = None) -> keras.optimizers.Optimizer:
    """A copy of ``optimizer`` (same class and configuration) whose steps use gradients averaged
    over every worker (``average=False``: summed). ``name`` prefixes the keys, to tell apart two
    optimizers over the same variables. Wrap before training: the copy starts without state."""
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise ConfigError(f"DistributedOptimizer wraps a keras.optimizers.Optimizer, got {type(optimizer).__name__}")
    return distributed_class(type(optimizer), average, name).from_config(optimizer.get_config())


def distributed_class(base: type, average: bool = True, name: str | None = None) -> type:
    """``base`` (a Keras optimizer class) with its gradients averaged over the workers first."""
    return type(base.__name__, (_Distributed, base), {
        "_pslink_average": bool(average),
        "_pslink_prefix": f"{name}/" if name else "",
        "__module__": base.__module__,  # a saved model names the plain optimizer
    })


def load_model(filepath, custom_optimizers=None, custom_objects=None, compression=None,
               legacy_opts: bool = False) -> keras.Model:
    """Horovod's ``hvd.keras.load_model``: a saved Keras model whose optimizer, with the state it
    was saved with, averages its gradients over the workers (as :func:`DistributedOptimizer`).
    ``custom_optimizers``: optimizer classes of your own the file names; ``custom_objects`` as
    ``keras.models.load_model``'s."""
    from pslink.tf.ops import Compression

    if compression not in (None, Compression.none):
        raise ConfigError("load_model: compression is not offered for Keras optimizers here; use "
                          "DistributedGradientTape(tape, compression=...)")
    if legacy_opts:
        raise ConfigError("load_model: legacy_opts=True needs Keras 2's tf.keras.optimizers.legacy, which Keras 3 "
                          "does not have")
    objects = {cls.__name__: cls for cls in custom_optimizers or []}
    objects.update(custom_objects or {})
    model = keras.models.load_model(filepath, custom_objects=objects or None)
    optimizer = getattr(model, "optimizer", None)
    if isinstance(optimizer, keras.optimizers.Optimizer) and not isinstance(optimizer, _Distributed):
        # The loaded instance keeps its variables (step count, moments); only its class changes.
        optimizer.__class__ = distributed_class(type(optimizer))
    return model
