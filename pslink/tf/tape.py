"""Horovod's ``DistributedGradientTape`` and ``PartialDistributedGradientTape``.

::

    with tf.GradientTape() as tape:
        loss = loss_fn(model(x), y)
    tape = hvd.DistributedGradientTape(tape)
    grads = tape.gradient(loss, model.trainable_variables)   # averaged over the ranks

The gradients are reduced as :mod:`pslink.tf.grads` describes; a source registered with
``register_local_source`` (or a local layer's variable) keeps its own gradient, divided by the
number of ranks if ``scale_local_gradients`` (Horovod's rule).
"""

from __future__ import annotations

from typing import Self

import tensorflow as tf

from pslink.core.worker.horovod import NoneCompressor
from pslink.core.worker.reduction import Average, reduce_op
from pslink.errors import ConfigError
from pslink.tf import grads as reducing
from pslink.tf.world import global_process_set, session_of


def ref(source):
    """A hashable handle of a variable: TensorFlow's ``ref()``; a Keras 3 variable has none (its id)."""
    return source.ref() if hasattr(source, "ref") else id(source)


class DistributedGradientTape:
    """A ``tf.GradientTape`` whose ``gradient`` returns gradients reduced over the ranks.

    Wrap a tape after recording (``tape = DistributedGradientTape(tape)``) or before
    (``with DistributedGradientTape(tf.GradientTape()) as tape:``); everything but ``gradient``
    is the wrapped tape's. Horovod's arguments: ``compression``, ``sparse_as_dense``, ``op``,
    ``gradient_predivide_factor``, ``groups`` / ``num_groups`` (the gradients travel in one
    request anyway), ``process_set``, ``scale_local_gradients``; ``device_*`` change nothing
    (tensors go through the host). pslink's own keywords: ``name`` prefixes the keys (to tell
    apart two tapes over the same variables); ``average=False`` is ``op=Sum``."""

    def __init__(self, gradtape: tf.GradientTape, device_dense: str = "", device_sparse: str = "",
                 compression=NoneCompressor, sparse_as_dense: bool = False, op=None,
                 gradient_predivide_factor: float = 1.0, num_groups: int = 0, groups=None,
                 process_set=global_process_set, scale_local_gradients: bool = True, *,
                 average: bool | None = None, name: str | None = None):
        if isinstance(gradtape, DistributedGradientTape):
            gradtape = gradtape._tape
        if not isinstance(gradtape, tf.GradientTape):
            raise ConfigError(f"DistributedGradientTape wraps a tf.GradientTape, got {type(gradtape).__name__}")
        reducing.check_groups(groups, num_groups)
        self._tape = gradtape
        self._reduction = reducing.Reduction(reduce_op(op, average), compression, float(gradient_predivide_factor),
                                             bool(sparse_as_dense), f"{name}/" if name else "",
                                             "DistributedGradientTape.gradient")
        self.process_set = process_set
        self.scale_local_gradients = scale_local_gradients
        self._local_sources: dict = {}

    def __enter__(self) -> Self:
        self._tape.__enter__()
        return self

    def __exit__(self, *exc):
        return self._tape.__exit__(*exc)

    def __getattr__(self, attribute):
        return getattr(self._tape, attribute)

    def register_local_source(self, source) -> None:
        """Keep ``source``'s gradient on this rank: not reduced (divided by the number of ranks if
        ``scale_local_gradients``)."""
        self._local_sources[ref(source)] = source  # held: an id stays this variable's

    def _is_local(self, source) -> bool:
        return ref(source) in self._local_sources

    @tf.autograph.experimental.do_not_convert
    def gradient(self, target, sources, output_gradients=None, use_generic_names: bool = False,
                 unconnected_gradients=tf.UnconnectedGradients.NONE):
        """The wrapped tape's gradients, reduced over the ranks of the process set."""
        grads = self._tape.gradient(target, sources, output_gradients=output_gradients,
                                    unconnected_gradients=unconnected_gradients)
        flat_sources, flat_grads = tf.nest.flatten(sources), tf.nest.flatten(grads)
        session = session_of(self.process_set)
        local = [self._is_local(s) for s in flat_sources]
        shared = [i for i, is_local in enumerate(local) if not is_local]
        reduced = reducing.reduce_gradients(session, [flat_grads[i] for i in shared],
                                            [flat_sources[i] for i in shared], self._reduction)
        out = list(flat_grads)
        for i, value in zip(shared, reduced):
            out[i] = value
        if self.scale_local_gradients and any(local):
            for i in (i for i, is_local in enumerate(local) if is_local and out[i] is not None):
                out[i] = scale_local(out[i], session.size)
        return tf.nest.pack_sequence_as(grads, out)

    def get_local_and_global_gradients(self, target, sources, output_gradients=None,
                                       use_generic_names: bool = False) -> tuple[list, list]:
        """(source, gradient) pairs of the local sources and of the others (Horovod's)."""
        gradients = self.gradient(target, sources, output_gradients, use_generic_names)
        local, shared = [], []
        for source, grad in zip(tf.nest.flatten(sources), tf.nest.flatten(gradients)):
            (local if self._is_local(source) else shared).append((source, grad))
        return local, shared


def scale_local(grad, size: int):
    """A local source's gradient divided by the number of ranks (Horovod's ``scale_local_gradients``)."""
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(grad.values / tf.cast(size, grad.values.dtype), grad.indices, grad.dense_shape)
    return grad / tf.cast(size, grad.dtype)


def PartialDistributedGradientTape(gradtape: tf.GradientTape, device_dense: str = "", device_sparse: str = "",
                                   compression=NoneCompressor, sparse_as_dense: bool = False, op=Average,
                                   gradient_predivide_factor: float = 1.0, num_groups: int = 0, groups=None,
                                   process_set=global_process_set, local_layers=None,
                                   scale_local_gradients: bool = True) -> DistributedGradientTape:
    """A :class:`DistributedGradientTape` that keeps the gradients of ``local_layers`` (Keras
    layers, one or a list) on each rank, as Horovod's."""
    tape = DistributedGradientTape(gradtape, device_dense, device_sparse, compression, sparse_as_dense, op,
                                   gradient_predivide_factor, num_groups, groups, process_set, scale_local_gradients)
    for variable in local_layer_variables(local_layers):
        tape.register_local_source(variable)
    return tape


def local_layer_variables(local_layers) -> list:
    """The trainable variables of ``local_layers`` (None, a Keras layer or a list of them)."""
    import keras

    if local_layers is None:
        local_layers = []
    elif isinstance(local_layers, keras.layers.Layer):
        local_layers = [local_layers]
    elif not all(isinstance(layer, keras.layers.Layer) for layer in local_layers):
        raise ConfigError("All local layers must be of tf.keras.layers.Layer type.")  # Horovod's words
    return [v for layer in local_layers for v in layer.trainable_weights]
