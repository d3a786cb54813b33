"""Horovod's TensorFlow API over the parameter service: allreduce, broadcasts, the gradient tape.

::

    import pslink.tf as hvd

    hvd.init()
    with tf.GradientTape() as tape:
        loss = loss_fn(model(x), y)
    tape = hvd.DistributedGradientTape(tape)
    grads = tape.gradient(loss, model.trainable_variables)   # averaged over the workers
    optimizer.apply_gradients(zip(grads, model.trainable_variables))
    if first_step:
        hvd.broadcast_variables(model.variables + optimizer.variables, root_rank=0)

Each works eagerly and inside a ``tf.function``. Gradients are keyed by variable name, so two
workers whose variables differ in shape get a ShapeMismatchError naming the variable and both
shapes; ``broadcast_variables`` checks all the variables (names, shapes, dtypes) first.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Self

import tensorflow as tf

from pslink.core.worker import collectives
from pslink.core.worker.collectives import Average
from pslink.errors import ConfigError
from pslink.tf import context
from pslink.tf.exchange import Exchange, SiteKeys, describe, service_key, unique_names, variable_name
from pslink.tf.process_sets import exchange_of

class _FP16Compressor:
    """Send floating-point tensors as float16, halving the bytes on the wire."""

    @staticmethod
    def compress(tensor):
        if tensor.dtype.is_floating and tensor.dtype != tf.float16:
            return tf.cast(tensor, tf.float16), tensor.dtype
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor if ctx is None else tf.cast(tensor, ctx)


class Compression:
    """Horovod's compression choices: ``Compression.none`` and ``Compression.fp16``."""

    none = collectives.NoneCompressor
    fp16 = _FP16Compressor


def scaled(tensor: tf.Tensor, factor: float) -> tf.Tensor:
    """``tensor`` times ``factor`` in its own dtype (an integer tensor through float64, rounded
    back, as Horovod scales integers)."""
    if factor == 1.0:
        return tensor
    if tensor.dtype.is_integer:
        return tf.cast(tf.round(tf.cast(tensor, tf.float64) * factor), tensor.dtype)
    return tensor * tf.cast(factor, tensor.dtype)


_unnamed_allreduce = SiteKeys("tf.allreduce")
_unnamed_broadcast = SiteKeys("tf.broadcast")
_unnamed_allgather = SiteKeys("tf.allgather")


@tf.autograph.experimental.do_not_convert
def allreduce(tensor, average: bool | None = None, name: str | None = None, op=None, compression=Compression.none,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0, process_set=None) -> tf.Tensor:
    """The mean (``op=hvd.Sum`` or ``average=False``: the sum; ``Min``, ``Max``, ``Product``) of
    ``tensor`` over every worker; ``compression=hvd.Compression.fp16`` sends it as float16;
    ``prescale_factor`` multiplies it before, ``postscale_factor`` the result after.

    ``name`` keys it on the service; without one, calls are told apart by dtype, shape and their
    order within the traced function, so make unnamed calls in the same order on every worker.
    ``process_set``: among its workers only (:mod:`pslink.tf.process_sets`)."""
    tensor = scaled(tf.convert_to_tensor(tensor), prescale_factor)
    if compression is not Compression.none:
        sent, ctx = compression.compress(tensor)
        return scaled(compression.decompress(allreduce(sent, average, name, op, process_set=process_set), ctx),
                      postscale_factor)
    return scaled(_allreduce(tensor, average, name, op, process_set), postscale_factor)


def _allreduce(tensor: tf.Tensor, average: bool | None, name: str | None, op, process_set) -> tf.Tensor:
    op = collectives.reduce_op(op, average, elementwise=True)
    if op in collectives.ELEMENTWISE:
        # Every worker's tensor as a row, in rank order; each reduces them alike (the service sums).
        rows = allgather(tf.expand_dims(tensor, 0), None if name is None else f"{name}.{op.value}", process_set)
        return {collectives.Min: tf.reduce_min, collectives.Max: tf.reduce_max,
                collectives.Product: tf.reduce_prod}[op](rows, axis=0)
    key = service_key("tf.allreduce", name) if name else _unnamed_allreduce.keys([tensor])[0]
    exchange, what = exchange_of(process_set), f"allreduce {name or ''}".strip()

    def reduce(value, on):
        return exchange.sum([on], [value], average=op is Average, what=what)[0]

    # As Horovod's: the gradient of an all-reduce is the all-reduce (the same op) of the gradients.
    return _differentiable(tensor, lambda x: reduce(x, key), lambda dy: reduce(dy, f"{key}/grad"))


def _differentiable(tensor: tf.Tensor, forward, backward) -> tf.Tensor:
    """``forward(tensor)``, whose gradient (in a GradientTape) is ``backward(upstream)``, as Horovod
    registers a gradient for each of its ops. Integer tensors have none."""
    if not tensor.dtype.is_floating:
        return forward(tensor)

    @tf.custom_gradient
    def op(x):
        return forward(x), backward

    return op(tensor)


def grouped_allreduce(tensors, average: bool | None = None, name: str | None = None, op=None,
                      compression=Compression.none, prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0, process_set=None) -> list[tf.Tensor]:
    """:func:`allreduce` of each of ``tensors`` (``name.i`` each, when ``name`` is given)."""
    tensor_list(tensors, "grouped_allreduce")
    return [allreduce(t, average, None if name is None else f"{name}.{i}", op, compression, prescale_factor,
                      postscale_factor, process_set) for i, t in enumerate(tensors)]


def tensor_list(tensors, what: str) -> None:
    """A grouped call's tensors: a non-empty list (or tuple), else an error naming ``what``."""
    if not isinstance(tensors, (list, tuple)) or not tensors:
        raise ConfigError(f"{what} takes a non-empty list of tensors, got {type(tensors).__name__}")


@tf.autograph.experimental.do_not_convert
def allgather(tensor, name: str | None = None, process_set=None) -> tf.Tensor:
    """Every worker's ``tensor`` concatenated along the first dimension, in rank order; workers may
    bring different numbers of rows (the other dimensions must agree)."""
    tensor = tf.convert_to_tensor(tensor)
    key = service_key("tf.allgather", name) if name else _unnamed_allgather.keys([tensor])[0]
    exchange, what = exchange_of(process_set), f"allgather {name or ''}".strip()

    def backward(dy):  # as Horovod's: the gradients summed over the workers, this worker's rows
        summed = exchange.sum([f"{key}/grad"], [dy], what=what)[0]
        rows = exchange.allgather(tf.shape(tensor, out_type=tf.int64)[:1], f"{key}/grad.rows", what)
        start = tf.reduce_sum(rows[: exchange.rank])
        return summed[start:start + rows[exchange.rank]]

    return _differentiable(tensor, lambda x: exchange.allgather(x, key, what=what), backward)


def broadcast_object(obj=None, root_rank: int = 0, name: str | None = None, process_set=None):
    """``root_rank``'s ``obj`` (any picklable object) on every worker (eagerly)."""
    name = name or "broadcast_object"
    return exchange_of(process_set).broadcast_object(obj, root_rank, f"tf/{name}", what=f"broadcast_object {name!r}")


def allgather_object(obj, name: str | None = None, process_set=None) -> list:
    """Every worker's ``obj`` (any picklable object), as a list in rank order (eagerly)."""
    name = name or "allgather_object"
    return exchange_of(process_set).allgather_object(obj, f"tf/{name}", what=f"allgather_object {name!r}")


def join(device: int = -1) -> int:
    """This worker ran out of data: it mirrors the others' gradient reductions with zeros until
    every worker called ``join()`` (eagerly); returns the worker that joined last."""
    return context.exchange().join()


def barrier(process_set=None) -> None:
    """Block until every worker of the job (of ``process_set``) has called ``barrier()``."""
    agent = exchange_of(process_set).agent
    agent.barrier("tf/barrier", timeout=agent.timeout)


@tf.autograph.experimental.do_not_convert
def broadcast(tensor, root_rank: int = 0, name: str | None = None, process_set=None) -> tf.Tensor:
    """``root_rank``'s value of ``tensor``, on every worker."""
    tensor = tf.convert_to_tensor(tensor)
    key = service_key("tf.broadcast", name) if name else _unnamed_broadcast.keys([tensor])[0]
    exchange, what = exchange_of(process_set), f"broadcast {name or ''}".strip()

    def backward(dy):  # as Horovod's: the gradients summed over the workers, to the root alone
        summed = exchange.sum([f"{key}/grad"], [dy], what=what)[0]
        return summed if exchange.rank == root_rank else tf.zeros_like(summed)

    return _differentiable(tensor, lambda x: exchange.broadcast([key], [x], root_rank, what=what)[0], backward)


@tf.autograph.experimental.do_not_convert
def broadcast_variables(variables: Sequence, root_rank: int = 0) -> None:
    """Assign ``root_rank``'s values to ``variables`` on every worker.

    First checks that every worker passes the same variables (names, shapes, dtypes, order): if
    not, every worker gets a ShapeMismatchError naming the first that differs and both shapes.
    Takes tf.Variables and Keras variables."""
    context.exchange().broadcast_variables(list(variables), root_rank, scope="broadcast",
                                           what="broadcast_variables")


@tf.autograph.experimental.do_not_convert
def allreduce_gradients(grads: Sequence, variables: Sequence, average: bool = True, prefix: str = "",
                        what: str = "gradient all-reduce", exchange: Exchange | None = None) -> list:
    """Average (or sum) ``grads`` over the workers (of ``exchange``: by default the process's),
    keyed by their variables' names; None stays None."""
    grads, variables = list(grads), list(variables)
    if len(grads) != len(variables):
        raise ConfigError(f"{what}: {len(grads)} gradients for {len(variables)} variables")
    exchange = exchange or context.exchange()
    if exchange.num_workers == 1:
        return grads
    names = unique_names([_source_name(v, i) for i, v in enumerate(variables)])
    # Gradients of differently shaped variables would meet under one key; check the variables
    # first (once per list), so that every worker gets an error naming the variable, at once.
    exchange.check_once([describe(f"{prefix}{n}", v) for n, v in zip(names, variables)], "gradients", what)
    present = [i for i, g in enumerate(grads) if g is not None]
    keys = [service_key("tf.grad", f"{prefix}{names[i]}") for i in present]
    reduced = exchange.sum(keys, [grads[i] for i in present], average=average, what=what,
                           stepper=exchange.stepper(tuple(keys)))
    out = list(grads)
    for i, value in zip(present, reduced):
        out[i] = value
    return out


def _source_name(source, index: int) -> str:
    if isinstance(source, tf.Variable) or hasattr(source, "path"):
        return variable_name(source)
    if not tf.executing_eagerly() and hasattr(source, "name"):
        return source.name
    return f"source{index}"


def DistributedOptimizer(optimizer, name: str | None = None, use_locking: bool = False, device_dense: str = "",
                         device_sparse: str = "", compression=Compression.none, sparse_as_dense: bool = False,
                         backward_passes_per_step: int = 1, op=Average):
    """Horovod's ``horovod.tensorflow.DistributedOptimizer`` for a Keras optimizer: the Keras
    wrapper (:func:`pslink.tf.keras.DistributedOptimizer`), averaging (``op=hvd.Sum``: summing)
    the gradients over the workers. TF1's ``tf.compat.v1.train`` optimizers are refused, naming
    what to use instead; so are options this wrapper does not carry out."""
    import keras

    from pslink.tf.keras.optimizer import DistributedOptimizer as keras_distributed

    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise ConfigError(f"pslink.tf.DistributedOptimizer wraps Keras optimizers, got {type(optimizer).__name__}; "
                          "TF1's tf.compat.v1.train optimizers are not offered: take the gradients with "
                          "pslink.tf.DistributedGradientTape and apply them with the optimizer")
    op = collectives.reduce_op(op)  # Average or Sum: it refuses the others, naming them
    if compression is not Compression.none or backward_passes_per_step != 1:
        raise ConfigError("pslink.tf.DistributedOptimizer: compression and backward_passes_per_step are not "
                          "offered for Keras optimizers; use DistributedGradientTape(tape, compression=...)")
    return keras_distributed(optimizer, average=op is Average, name=name)


class DistributedGradientTape:
    """A ``tf.GradientTape`` whose ``gradient`` returns gradients averaged over every worker.

    Wrap a tape after recording (``tape = DistributedGradientTape(tape)``) or before
    (``with DistributedGradientTape(tf.GradientTape()) as tape:``). Everything but ``gradient``
    is the wrapped tape's. Horovod's arguments: ``op`` (Average or Sum), ``compression``,
    ``gradient_predivide_factor`` (divides before the sum, multiplies after), ``process_set``
    (among its workers only); ``device_*``, ``sparse_as_dense`` (sparse gradients travel dense
    here either way), ``num_groups`` and ``groups`` (the requests are fused anyway) change
    nothing. :meth:`register_local_source` keeps a variable's gradient local (divided by the
    number of workers, as Horovod's ``scale_local_gradients``). pslink's own keywords: ``name``
    prefixes the keys (to tell apart two tapes over the same variables); ``average=False`` is
    ``op=Sum``."""

    def __init__(self, tape: tf.GradientTape, device_dense: str = "", device_sparse: str = "",
                 compression=Compression.none, sparse_as_dense: bool = False, op=None,
                 gradient_predivide_factor: float = 1.0, num_groups: int = 0, groups=None, process_set=None,
                 scale_local_gradients: bool = True, *, average: bool | None = None, name: str | None = None):
        if isinstance(tape, DistributedGradientTape):
            tape = tape._tape
        if not isinstance(tape, tf.GradientTape):
            raise ConfigError(f"DistributedGradientTape wraps a tf.GradientTape, got {type(tape).__name__}")
        op = collectives.reduce_op(op, average)  # Average or Sum: it refuses the others, naming them
        if not gradient_predivide_factor > 0:
            raise ConfigError(f"gradient_predivide_factor must be > 0, got {gradient_predivide_factor!r}")
        if gradient_predivide_factor != 1.0 and op is not Average:
            raise ConfigError("gradient_predivide_factor needs op=Average")
        self._tape = tape
        self._average = op is Average
        self._predivide = float(gradient_predivide_factor)
        self._prefix = f"{name}/" if name else ""
        self._compression = compression
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
        """Keep ``source``'s gradient on this worker: not reduced (divided by the number of
        workers if ``scale_local_gradients``)."""
        self._local_sources[_ref(source)] = source  # held: an id stays this variable's

    @tf.autograph.experimental.do_not_convert
    def gradient(self, target, sources, output_gradients=None,
                 unconnected_gradients=tf.UnconnectedGradients.NONE):
        grads = self._tape.gradient(target, sources, output_gradients=output_gradients,
                                    unconnected_gradients=unconnected_gradients)
        flat_sources, flat_grads = tf.nest.flatten(sources), tf.nest.flatten(grads)
        local = [_ref(s) in self._local_sources for s in flat_sources]
        shared = [i for i, is_local in enumerate(local) if not is_local]
        packed = [None if flat_grads[i] is None
                  else self._compression.compress(scaled(flat_grads[i], 1 / self._predivide)) for i in shared]
        reduced = allreduce_gradients([None if p is None else p[0] for p in packed], [flat_sources[i] for i in shared],
                                      self._average, self._prefix, what="DistributedGradientTape.gradient",
                                      exchange=exchange_of(self.process_set))
        out = list(flat_grads)
        for i, r, p in zip(shared, reduced, packed):
            out[i] = None if p is None else scaled(self._compression.decompress(r, p[1]), self._predivide)
        if self.scale_local_gradients and any(local):
            workers = exchange_of(self.process_set).num_workers
            for i in (i for i, is_local in enumerate(local) if is_local and out[i] is not None):
                grad = out[i]
                out[i] = (tf.IndexedSlices(grad.values / workers, grad.indices, grad.dense_shape)
                          if isinstance(grad, tf.IndexedSlices) else grad / workers)
        return tf.nest.pack_sequence_as(grads, out)


def _ref(source):
    """A hashable handle of a variable: tf's ``ref()``; a Keras 3 variable has none (its id)."""
    return source.ref() if hasattr(source, "ref") else id(source)


def PartialDistributedGradientTape(gradtape: tf.GradientTape, device_dense: str = "", device_sparse: str = "",
                                   compression=Compression.none, sparse_as_dense: bool = False, op=None,
                                   gradient_predivide_factor: float = 1.0, num_groups: int = 0, groups=None,
                                   process_set=None, local_layers=None,
                                   scale_local_gradients: bool = True) -> DistributedGradientTape:
    """A :class:`DistributedGradientTape` that keeps the gradients of ``local_layers`` (Keras
    layers, one or a list) on each worker, as Horovod's."""
    import keras

    if local_layers is None:
        local_layers = []
    elif isinstance(local_layers, keras.layers.Layer):
        local_layers = [local_layers]
    elif not all(isinstance(layer, keras.layers.Layer) for layer in local_layers):
        raise ConfigError("All local layers must be of tf.keras.layers.Layer type.")  # Horovod's words
    tape = DistributedGradientTape(gradtape, device_dense, device_sparse, compression, sparse_as_dense, op,
                                   gradient_predivide_factor, num_groups, groups, process_set, scale_local_gradients)
    for variable in (v for layer in local_layers for v in layer.trainable_weights):
        tape.register_local_source(variable)
    return tape
