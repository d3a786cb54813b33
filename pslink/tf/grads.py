"""Gradients of variables reduced over the ranks, as Horovod's ``DistributedGradientTape`` and
Keras ``DistributedOptimizer`` reduce them (``horovod/tensorflow/__init__.py``'s
``_make_allreduce_grads_fn``): each gradient allreduced with the tape's or optimizer's
reduction, ``gradient_predivide_factor`` split into a prescale of ``1 / f`` and a postscale of
``f``, compression around the trip, ``tf.IndexedSlices`` gathered (values and indices) unless
``sparse_as_dense``. One rank alone reduces nothing (Horovod's ``_allreduce_cond``).

The dense gradients of one list of variables are one request: they travel under keys named by
their variables (``tf.grad/<variable>/...``, so that a rank whose model differs gets an error
naming the variable: :func:`pslink.tf.variables.check_once` compares the lists first), and the
request is announced to the Session as an optimizer step (``register_stepper`` / ``step``): a
rank that called ``join()`` then pushes zeros under the same keys (its last shapes), so the
averages still divide by every rank, as in Horovod. A reduction the keys cannot carry (Min,
Max, Product, Adasum, or gradients without a static shape) goes through the Session's grouped
allreduce instead.
"""

from __future__ import annotations

import dataclasses
import weakref

import numpy as np
import tensorflow as tf

from pslink.core.worker.collectives import service_key
from pslink.core.worker.horovod import NoneCompressor
from pslink.core.worker.reduction import Average, ReduceOp, Sum
from pslink.core.worker.session import Session
from pslink.errors import ConfigError, PslinkError
from pslink.tf import collectives, graph, tensors, variables
from pslink.tf.graph import Out


@dataclasses.dataclass(frozen=True)
class Reduction:
    """How a tape or optimizer reduces its gradients (Horovod's arguments)."""

    op: ReduceOp = Average
    compression: object = NoneCompressor
    predivide: float = 1.0
    sparse_as_dense: bool = False
    prefix: str = ""  # pslink's: tells apart the keys of two tapes or optimizers over the same variables
    what: str = "gradient allreduce"

    def __post_init__(self):
        if not isinstance(self.op, ReduceOp):
            raise ConfigError(f"{self.what}: op must be Average, Sum, Min, Max, Product or Adasum, got {self.op!r}")
        if not self.predivide > 0:
            raise ConfigError(f"{self.what}: gradient_predivide_factor must be > 0, got {self.predivide!r}")
        if self.predivide != 1.0 and self.op is not Average:
            raise ConfigError("gradient_predivide_factor not supported with op != Average")  # Horovod's words


def check_groups(groups, num_groups: int) -> None:
    """Horovod's checks of ``groups`` / ``num_groups`` (pslink fuses a list's gradients into one
    request anyway: the grouping changes nothing else)."""
    if num_groups and groups is None:
        groups = num_groups
    if groups is not None and not (isinstance(groups, list) or (isinstance(groups, int) and groups > 0)):
        raise ConfigError("groups should be a non-negative integer or a list of list of tf.Variable.")


def reduce_gradients(session: Session, grads, sources, how: Reduction) -> list:
    """``grads`` (of ``sources``, None for none) reduced over the ranks of ``session``."""
    grads, sources = list(grads), list(sources)
    if len(grads) != len(sources):
        raise ConfigError(f"{how.what}: {len(grads)} gradients for {len(sources)} variables")
    if session.size == 1:
        return grads
    present = [i for i, g in enumerate(grads) if g is not None]
    if not present:
        return grads
    if how.sparse_as_dense:
        grads = [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g for g in grads]
    names = variables.unique_names([variables.source_name(s, i) for i, s in enumerate(sources)])
    variables.check_once(session, [variables.describe(how.prefix + names[i], sources[i]) for i in present],
                         "gradients", how.what)
    sparse = [i for i in present if isinstance(grads[i], tf.IndexedSlices)]
    dense = [i for i in present if i not in sparse]
    out = list(grads)
    for i in sparse:
        out[i] = _gather_slices(session, grads[i], how)
    if dense:
        reduced = _reduce_dense(session, [tf.convert_to_tensor(grads[i]) for i in dense],
                                [how.prefix + names[i] for i in dense], how)
        for i, value in zip(dense, reduced):
            out[i] = value
    return out


def _gather_slices(session: Session, grad: tf.IndexedSlices, how: Reduction) -> tf.IndexedSlices:
    """Horovod's allreduce of slices: every rank's values and indices gathered."""
    if how.op not in (Average, Sum):
        raise NotImplementedError("Only Sum and Average ops are supported with tf.IndexedSlices")  # Horovod's words
    if how.predivide != 1.0:
        raise NotImplementedError("Pre/postscale_factor are not supported with tf.IndexedSlices")
    values = collectives.allgather(session, grad.values, None)
    indices = collectives.allgather(session, grad.indices, None)
    if how.op is Average:
        values = values / tf.cast(session.size, values.dtype)
    return tf.IndexedSlices(values, indices, grad.dense_shape)


def _reduce_dense(session: Session, grads: list, names: list[str], how: Reduction) -> list:
    packed = [how.compression.compress(g) for g in grads]
    values = [tensor for tensor, _ in packed]
    carried = [tensors.wire(v.dtype, how.what, reduced=True) for v in values]
    keyed = how.op in (Average, Sum) and all(v.shape.is_fully_defined() for v in values) \
        and (how.op is Sum or all(c.is_floating for c in carried))
    if keyed:
        if how.predivide != 1.0:
            values = [v * tf.cast(1.0 / how.predivide, v.dtype) for v in values]
        keys = tuple(service_key("tf.grad", name, how.op.value, c.name, variables.shape_text(v.shape))
                     for name, v, c in zip(names, values, carried))
        stepper = _stepper(session, keys, [v.shape.as_list() for v in values], [c.as_numpy_dtype for c in carried],
                           average=how.op is Average, what=how.what)
        results = graph.run(how.what, stepper.reduce, [tensors.to_wire(v, c) for v, c in zip(values, carried)],
                            [Out(c, v.shape) for v, c in zip(values, carried)], "gradients")
        results = [tensors.from_wire(r, v.dtype) for r, v in zip(results, values)]
        if how.predivide != 1.0:
            results = [r * tf.cast(how.predivide, r.dtype) for r in results]
    else:
        prescale, postscale = (1.0 / how.predivide, how.predivide) if how.op is Average else (1.0, 1.0)
        results = collectives.grouped_allreduce(session, values, None, how.op, prescale, postscale)
    return [how.compression.decompress(r, ctx) for r, (_, ctx) in zip(results, packed)]


# -- one request per list of variables, announced as an optimizer step ------------------------------------

_steppers: weakref.WeakKeyDictionary[Session, dict] = weakref.WeakKeyDictionary()


class _Stepper:
    """The request that reduces one list of gradients (its keys, shapes and dtypes), registered
    with the Session as an optimizer (in the order first met: the same on every rank)."""

    def __init__(self, session: Session, keys: tuple, shapes: list, dtypes: list, average: bool, what: str):
        self.session, self.keys, self.shapes, self.dtypes = session, list(keys), shapes, dtypes
        self.average, self.what = average, what
        self.index = session.register_stepper(self.contribute_zeros)

    def reduce(self, *arrays) -> list[np.ndarray]:
        """Reduce ``arrays`` (this step's gradients) over the ranks; the results."""
        session = self.session
        outs = [tensors.empty(a.shape, a.dtype) for a in arrays]
        step = session.step(self.index)  # a rank in join() learns from it to push zeros with us
        try:
            handle = session.agent.pushpull_many(self.keys, list(arrays), outs=outs, average=self.average)
        except PslinkError as exc:
            raise type(exc)(f"{self.what}: {exc.message}", **exc.details) from None
        handle.wait(session.timeout)
        step.wait(session.timeout)
        return outs

    def contribute_zeros(self) -> None:
        """While this rank is joined: one step's worth of zero gradients, as the others step."""
        zeros = [np.zeros(shape, dtype) for shape, dtype in zip(self.shapes, self.dtypes)]
        outs = [np.empty_like(z) for z in zeros]
        self.session.agent.pushpull_many(self.keys, zeros, outs=outs, average=self.average).wait(self.session.timeout)


def _stepper(session: Session, keys: tuple, shapes: list, dtypes: list, average: bool, what: str) -> _Stepper:
    known = _steppers.setdefault(session, {})
    stepper = known.get(keys)
    if stepper is None:
        stepper = known[keys] = _Stepper(session, keys, shapes, dtypes, average, what)
    return stepper
