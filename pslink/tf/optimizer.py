"""Horovod's Keras ``DistributedOptimizer`` for Keras 3: a Keras optimizer whose steps use the
gradients reduced over the ranks (``horovod/_keras``'s ``create_distributed_optimizer``).

``DistributedOptimizer(optimizer)`` is a copy of ``optimizer`` (its class and configuration, so a
saved model names the plain optimizer) of a class that also derives from :class:`_Distributed`:

- ``apply`` (which ``apply_gradients`` and ``model.fit`` call) reduces the gradients first, as
  :mod:`pslink.tf.grads` describes, keyed by the variables' paths; variables registered with
  ``register_local_var`` (a ``PartialDistributedOptimizer``'s local layers) keep their own,
  divided by the number of ranks if ``scale_local_gradients``;
- ``_compute_gradients`` / ``compute_gradients`` (Horovod's: a loss and variables, an optional
  tape) return the reduced gradients; ``apply`` then does not reduce them again;
- ``backward_passes_per_step`` is Keras 3's ``gradient_accumulation_steps``: the variables
  change every N steps, with the gradients averaged over the passes (summed, unless
  ``average_aggregated_gradients``, as Horovod's); each pass's gradients are reduced as it
  comes (the same result as reducing their sum, at N times the traffic).
"""

from __future__ import annotations

import dataclasses

import keras
import tensorflow as tf

from pslink.core.worker.process_sets import ProcessSet
from pslink.core.worker.reduction import Average, ReduceOp, Sum, reduce_op
from pslink.errors import ConfigError
from pslink.tf import _internals, grads, groups
from pslink.tf.compression import Compression
from pslink.tf.tape import local_layer_variables, ref, scale_local
from pslink.tf.world import global_process_set, session_of


@dataclasses.dataclass(frozen=True)
class _Settings:
    reduction: grads.Reduction
    process_set: ProcessSet
    scale_local_gradients: bool
    passes: int
    average_passes: bool


class _State:
    """One optimizer's own: its local variables and the gradients it reduced already."""

    def __init__(self):
        self.local: dict = {}
        self.reduced: list | None = None


class _Distributed:
    """Mixed in before the wrapped optimizer's class (see the module)."""

    _pslink_settings: _Settings  # the class's (distributed_class sets it), so from_config keeps it

    def _pslink_state(self) -> _State:
        state = self.__dict__.get("_pslink_own")
        if state is None:
            # Past Keras' attribute tracking, which would take the local variables for its own.
            state = _State()
            object.__setattr__(self, "_pslink_own", state)
        return state

    def register_local_var(self, var) -> None:
        """Keep ``var``'s gradient on this rank (Horovod's): not reduced, divided by the number of
        ranks if ``scale_local_gradients``."""
        self._pslink_state().local[ref(var)] = var

    @tf.autograph.experimental.do_not_convert
    def _pslink_reduce(self, gradients: list, variables: list) -> list:
        settings, state = self._pslink_settings, self._pslink_state()
        session = session_of(settings.process_set)
        local = [ref(v) in state.local for v in variables]
        shared = [i for i, is_local in enumerate(local) if not is_local]
        reduced = grads.reduce_gradients(session, [gradients[i] for i in shared], [variables[i] for i in shared],
                                         settings.reduction)
        out = list(gradients)
        for i, value in zip(shared, reduced):
            out[i] = value
        if settings.scale_local_gradients:
            for i in (i for i, is_local in enumerate(local) if is_local and out[i] is not None):
                out[i] = scale_local(out[i], session.size)
        return out

    def _compute_gradients(self, loss, var_list, grad_loss=None, tape=None) -> list:
        """Horovod's: the gradients of ``loss`` (a tensor recorded by ``tape``, or a function
        called under it) for ``var_list``, reduced over the ranks, as (gradient, variable) pairs."""
        tape = tf.GradientTape() if tape is None else tape
        var_list = list(var_list)
        if callable(loss):
            with tape:
                loss = loss()
        gradients = self._pslink_reduce(list(tape.gradient(loss, var_list, output_gradients=grad_loss)), var_list)
        self._pslink_state().reduced = gradients
        return list(zip(gradients, var_list))

    def compute_gradients(self, loss, var_list, tape=None) -> list:
        return self._compute_gradients(loss, var_list, None, tape)

    @tf.autograph.experimental.do_not_convert
    def apply(self, grads, trainable_variables=None):
        gradients = list(grads)
        if trainable_variables is not None:
            variables = list(trainable_variables)
        elif self.built:
            variables = _internals.optimizer_trainable_variables(self)
        else:
            return super().apply(gradients, trainable_variables)  # Keras explains what is missing
        state, settings = self._pslink_state(), self._pslink_settings
        reduced, state.reduced = state.reduced, None
        if reduced is None or len(reduced) != len(gradients) or any(a is not b for a, b in zip(reduced, gradients)):
            gradients = self._pslink_reduce(gradients, variables)
        if settings.passes > 1 and not settings.average_passes:
            # Keras averages the passes it accumulates; Horovod's default applies their sum.
            gradients = [None if g is None else _times(g, settings.passes) for g in gradients]
        result = super().apply(gradients, trainable_variables)
        # sync="local:T": every T steps, the groups' average
        groups.end_group_step(session_of(settings.process_set).agent, variables)
        return result


def _times(grad, factor: int):
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(grad.values * tf.cast(factor, grad.values.dtype), grad.indices, grad.dense_shape)
    return grad * tf.cast(factor, grad.dtype)


def distributed_class(base: type, settings: _Settings) -> type:
    """``base`` (a Keras optimizer class) whose steps reduce their gradients first."""
    return type(base.__name__, (_Distributed, base), {
        "_pslink_settings": settings,
        "__module__": base.__module__,  # a saved model names the plain optimizer
    })


def DistributedOptimizer(optimizer, name: str | None = None, device_dense: str = "", device_sparse: str = "",
                         compression=Compression.none, sparse_as_dense: bool = False,
                         gradient_predivide_factor: float = 1.0, op: ReduceOp = Average,
                         backward_passes_per_step: int = 1, average_aggregated_gradients: bool = False,
                         num_groups: int = 0, groups=None, process_set: ProcessSet = global_process_set,
                         scale_local_gradients: bool = True) -> keras.optimizers.Optimizer:
    """A copy of ``optimizer`` (same class and configuration) whose steps use the gradients
    reduced over the ranks (of ``process_set``): averaged, or summed with ``op=Sum``. ``name``
    prefixes the keys, to tell apart two optimizers over the same variables. Wrap before
    training: the copy starts without state. See the module for the rest."""
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise ConfigError(f"DistributedOptimizer wraps a keras.optimizers.Optimizer, got {type(optimizer).__name__}")
    op = reduce_op(op)
    if op not in (Average, Sum):
        raise ConfigError("op currently only supports Average and Sum")  # Horovod's words
    grads.check_groups(groups, num_groups)
    if isinstance(backward_passes_per_step, bool) or not isinstance(backward_passes_per_step, int) \
            or backward_passes_per_step < 1:
        raise ConfigError(f"backward_passes_per_step must be an int >= 1, got {backward_passes_per_step!r}")
    base = type(optimizer)
    while issubclass(base, _Distributed):  # wrapping a wrapped one: one reduction, the newer settings
        base = base.__mro__[2]
    config = optimizer.get_config()
    if backward_passes_per_step > 1:
        given = config.get("gradient_accumulation_steps")
        if given not in (None, backward_passes_per_step):
            raise ConfigError(f"DistributedOptimizer: backward_passes_per_step={backward_passes_per_step} and the "
                              f"optimizer's gradient_accumulation_steps={given} disagree; give one of them")
        config["gradient_accumulation_steps"] = backward_passes_per_step
    what = f"DistributedOptimizer({base.__name__})"
    reduction = grads.Reduction(op, compression, float(gradient_predivide_factor), bool(sparse_as_dense),
                                f"{name}/" if name else "", what)
    settings = _Settings(reduction, process_set, bool(scale_local_gradients), backward_passes_per_step,
                         bool(average_aggregated_gradients))
    return distributed_class(base, settings).from_config(config)


def PartialDistributedOptimizer(optimizer, name: str | None = None, device_dense: str = "",
                                device_sparse: str = "", compression=Compression.none, sparse_as_dense: bool = False,
                                gradient_predivide_factor: float = 1.0, op: ReduceOp = Average, groups=None,
                                process_set: ProcessSet = global_process_set, local_layers=None,
                                scale_local_gradients: bool = True) -> keras.optimizers.Optimizer:
    """A :func:`DistributedOptimizer` that keeps the gradients of ``local_layers`` (Keras layers,
    one or a list) on each rank, as Horovod's."""
    wrapped = DistributedOptimizer(optimizer, name, device_dense, device_sparse, compression, sparse_as_dense,
                                   gradient_predivide_factor, op, groups=groups, process_set=process_set,
                                   scale_local_gradients=scale_local_gradients)
    for variable in local_layer_variables(local_layers):
        wrapped.register_local_var(variable)
    return wrapped


def load_model(filepath, custom_optimizers=None, custom_objects=None, compression=Compression.none,
               legacy_opts: bool = False) -> keras.Model:
    """Horovod's ``hvd.keras.load_model``: a saved Keras model whose optimizer, with the state it
    was saved with, reduces its gradients over the ranks (as :func:`DistributedOptimizer`).
    ``custom_optimizers``: optimizer classes of your own the file names; ``custom_objects`` as
    ``keras.models.load_model``'s."""
    if legacy_opts:
        raise ConfigError("load_model: legacy_opts=True needs Keras 2's tf.keras.optimizers.legacy, which Keras 3 "
                          "does not have")
    objects = {cls.__name__: cls for cls in custom_optimizers or []}
    objects.update(custom_objects or {})
    model = keras.models.load_model(filepath, custom_objects=objects or None)
    optimizer = getattr(model, "optimizer", None)
    if isinstance(optimizer, keras.optimizers.Optimizer) and not isinstance(optimizer, _Distributed):
        # The loaded instance keeps its variables (step count, moments); only its class changes.
        settings = _Settings(grads.Reduction(Average, compression, what=f"DistributedOptimizer({type(optimizer).__name__})"),
                             global_process_set, True, 1, False)
        optimizer.__class__ = distributed_class(type(optimizer), settings)
    return model
