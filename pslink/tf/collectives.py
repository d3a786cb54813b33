"""Horovod's collectives on TensorFlow tensors: a tensor to host arrays, a Session call, the result
back as a tensor. Everything Horovod means (names, reductions, scale factors, the checks, join)
is the Session's (:mod:`pslink.core.worker.session`); this module only converts
(:mod:`pslink.tf.tensors`) and runs the call eagerly or as a graph op (:mod:`pslink.tf.graph`).

Each function takes the Session to use and returns tensors; none is differentiable by itself
(:mod:`pslink.tf.gradients` adds Horovod's gradients).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import tensorflow as tf

from pslink.core.worker import collectives as shared
from pslink.core.worker.reduction import ReduceOp
from pslink.core.worker.session import Session
from pslink.errors import ConfigError
from pslink.tf import graph, tensors
from pslink.tf.graph import Out


def tensor_list(values, what: str) -> list:
    """A grouped call's tensors: a non-empty list (or tuple), else an error naming ``what``."""
    if not isinstance(values, (list, tuple)) or not values:
        raise ConfigError(f"{what} takes a non-empty list of tensors, got {type(values).__name__}")
    return [tf.convert_to_tensor(v) for v in values]


def _what(kind: str, name: str | None) -> str:
    return f"{kind} {name!r}" if name else kind


def _rows_shape(shape: tf.TensorShape) -> tf.TensorShape:
    """The shape of rows gathered from every rank: any number of them, of ``shape``'s rows."""
    if shape.rank is None:
        return tf.TensorShape(None)
    return tf.TensorShape([None]).concatenate(shape[1:])


def _rows_needed(tensor: tf.Tensor, what: str) -> None:
    if tensor.shape.rank == 0:
        raise ConfigError(f"{what} needs a tensor of at least one dimension (its rows are split over the ranks), "
                          "got a scalar")


# -- allreduce -----------------------------------------------------------------------------------------

def allreduce(session: Session, tensor, name: str | None, op: ReduceOp, prescale: float = 1.0,
              postscale: float = 1.0) -> tf.Tensor:
    """``tensor`` reduced over the ranks by ``op`` (scale factors as Horovod applies them)."""
    tensor = tf.convert_to_tensor(tensor)
    carried = tensors.wire(tensor.dtype, "allreduce", reduced=True)
    name = graph.call_name("Allreduce", name, tensor)

    def call(array):
        out = tensors.empty(array.shape, array.dtype)
        return [session.allreduce(array, out, name, op, prescale, postscale).wait(session.timeout)]

    (result,) = graph.run(_what("allreduce", name), call, [tensors.to_wire(tensor, carried)],
                          [Out(carried, tensor.shape)], "allreduce")
    return tensors.from_wire(result, tensor.dtype)


def grouped_allreduce(session: Session, values, name: str | None, op: ReduceOp, prescale: float = 1.0,
                      postscale: float = 1.0) -> list[tf.Tensor]:
    """Each tensor reduced over the ranks, started together (``name.i`` each)."""
    values = tensor_list(values, "grouped_allreduce")
    carried = [tensors.wire(t.dtype, "grouped_allreduce", reduced=True) for t in values]
    name = graph.call_name("GroupedAllreduce", name, values[0], values[-1])

    def call(*arrays):
        outs = [tensors.empty(a.shape, a.dtype) for a in arrays]
        return session.grouped_allreduce(arrays, outs, name, op, prescale, postscale).wait(session.timeout)

    results = graph.run(_what("grouped_allreduce", name), call,
                        [tensors.to_wire(t, c) for t, c in zip(values, carried)],
                        [Out(c, t.shape) for t, c in zip(values, carried)], "grouped_allreduce")
    return [tensors.from_wire(r, t.dtype) for r, t in zip(results, values)]


# -- broadcast -----------------------------------------------------------------------------------------

def broadcast(session: Session, tensor, root_rank: int, name: str | None) -> tf.Tensor:
    """``root_rank``'s ``tensor`` on every rank, bit for bit."""
    tensor = tf.convert_to_tensor(tensor)
    carried = tensors.wire(tensor.dtype, "broadcast", reduced=False)
    name = graph.call_name("Broadcast", name, tensor)

    def call(array):
        out = tensors.empty(array.shape, array.dtype)
        return [session.broadcast(array, root_rank, out, name).wait(session.timeout)]

    (result,) = graph.run(_what("broadcast", name), call, [tensors.to_wire(tensor, carried)],
                          [Out(carried, tensor.shape)], "broadcast")
    return tensors.from_wire(result, tensor.dtype)


def broadcast_many(session: Session, named: Sequence[tuple[str, tf.Tensor]], root_rank: int, what: str,
                   name: str) -> list[tf.Tensor]:
    """``root_rank``'s values of several tensors, in one request (``named``: (key name, tensor)
    pairs, the names unique and the same on every rank)."""
    values = [tf.convert_to_tensor(t) for _, t in named]
    carried = [tensors.wire(t.dtype, what, reduced=False) for t in values]
    names = [n for n, _ in named]

    def call(*arrays):
        outs = [tensors.empty(a.shape, a.dtype) for a in arrays]
        session.broadcast_many(list(zip(names, arrays, outs)), root_rank, what, name).wait(session.timeout)
        return outs

    results = graph.run(what, call, [tensors.to_wire(t, c) for t, c in zip(values, carried)],
                        [Out(c, t.shape) for t, c in zip(values, carried)], "broadcast")
    return [tensors.from_wire(r, t.dtype) for r, t in zip(results, values)]


# -- allgather -----------------------------------------------------------------------------------------

def allgather(session: Session, tensor, name: str | None) -> tf.Tensor:
    """Every rank's ``tensor`` concatenated along the first dimension, in rank order."""
    tensor = tf.convert_to_tensor(tensor)
    carried = tensors.wire(tensor.dtype, "allgather", reduced=False)
    name = graph.call_name("Allgather", name, tensor)

    def call(array):
        gathered, _ = session.allgather(array, name).wait(session.timeout)
        return [gathered]

    shape = tf.TensorShape([None]) if tensor.shape.rank == 0 else _rows_shape(tensor.shape)
    (result,) = graph.run(_what("allgather", name), call, [tensors.to_wire(tensor, carried)], [Out(carried, shape)],
                          "allgather")
    return tensors.from_wire(result, tensor.dtype)


def grouped_allgather(session: Session, values, name: str | None) -> list[tf.Tensor]:
    """:func:`allgather` of each tensor, started together (``name.i`` each)."""
    values = tensor_list(values, "grouped_allgather")
    carried = [tensors.wire(t.dtype, "grouped_allgather", reduced=False) for t in values]
    name = graph.call_name("GroupedAllgather", name, values[0], values[-1])

    def call(*arrays):
        return [gathered for gathered, _ in session.grouped_allgather(arrays, name).wait(session.timeout)]

    results = graph.run(_what("grouped_allgather", name), call,
                        [tensors.to_wire(t, c) for t, c in zip(values, carried)],
                        [Out(c, tf.TensorShape([None]) if t.shape.rank == 0 else _rows_shape(t.shape))
                         for t, c in zip(values, carried)], "grouped_allgather")
    return [tensors.from_wire(r, t.dtype) for r, t in zip(results, values)]


# -- reducescatter -------------------------------------------------------------------------------------

def _share_shape(session: Session, shape: tf.TensorShape) -> tf.TensorShape:
    """This rank's share of rows (known when the rows are)."""
    if shape.rank is None:
        return shape
    rows = shape[0]
    share = None if rows is None else shared.scatter_share(rows, session.size, session.rank)[1]
    return tf.TensorShape([share]).concatenate(shape[1:])


def reducescatter(session: Session, tensor, name: str | None, op: ReduceOp, prescale: float = 1.0,
                  postscale: float = 1.0) -> tf.Tensor:
    """``tensor`` reduced over the ranks, this rank's share of its rows."""
    tensor = tf.convert_to_tensor(tensor)
    _rows_needed(tensor, "reducescatter")
    carried = tensors.wire(tensor.dtype, "reducescatter", reduced=True)
    name = graph.call_name("Reducescatter", name, tensor)

    def call(array):
        return [session.reducescatter(array, name, op, prescale, postscale).wait(session.timeout)]

    (result,) = graph.run(_what("reducescatter", name), call, [tensors.to_wire(tensor, carried)],
                          [Out(carried, _share_shape(session, tensor.shape))], "reducescatter")
    return tensors.from_wire(result, tensor.dtype)


def grouped_reducescatter(session: Session, values, name: str | None, op: ReduceOp, prescale: float = 1.0,
                          postscale: float = 1.0) -> list[tf.Tensor]:
    """:func:`reducescatter` of each tensor, started together (``name.i`` each)."""
    values = tensor_list(values, "grouped_reducescatter")
    for t in values:
        _rows_needed(t, "grouped_reducescatter")
    carried = [tensors.wire(t.dtype, "grouped_reducescatter", reduced=True) for t in values]
    name = graph.call_name("GroupedReducescatter", name, values[0], values[-1])

    def call(*arrays):
        return session.grouped_reducescatter(arrays, name, op, prescale, postscale).wait(session.timeout)

    results = graph.run(_what("grouped_reducescatter", name), call,
                        [tensors.to_wire(t, c) for t, c in zip(values, carried)],
                        [Out(c, _share_shape(session, t.shape)) for t, c in zip(values, carried)],
                        "grouped_reducescatter")
    return [tensors.from_wire(r, t.dtype) for r, t in zip(results, values)]


# -- alltoall ------------------------------------------------------------------------------------------

def alltoall(session: Session, tensor, splits, name: str | None) -> tuple[tf.Tensor, tf.Tensor]:
    """Rank i gets ``splits[i]`` rows of every rank's ``tensor`` (equal shares if None), in rank
    order; returns them and the rows received from each rank (int32)."""
    tensor = tf.convert_to_tensor(tensor)
    _rows_needed(tensor, "alltoall")
    carried = tensors.wire(tensor.dtype, "alltoall", reduced=False)
    inputs = [tensors.to_wire(tensor, carried)]
    if splits is not None:
        splits = tf.convert_to_tensor(splits)
        if not splits.dtype.is_integer:
            raise ConfigError(f"alltoall: splits must be integers, got {splits.dtype.name}")
        inputs.append(tf.reshape(splits, [-1]))
    name = graph.call_name("Alltoall", name, tensor)

    def call(array, counts=None):
        received, received_splits = session.alltoall(
            array, None if counts is None else counts.tolist(), name).wait(session.timeout)
        return [received, received_splits]

    received, received_splits = graph.run(_what("alltoall", name), call, inputs,
                                          [Out(carried, _rows_shape(tensor.shape)),
                                           Out(tf.int32, tf.TensorShape([session.size]))], "alltoall")
    return tensors.from_wire(received, tensor.dtype), received_splits


# -- join ----------------------------------------------------------------------------------------------

def join(session: Session) -> tf.Tensor:
    """This rank is out of data (:meth:`Session.join`); the rank that joined last, an int32 scalar."""
    def call():
        return [np.array(session.join(), np.int32)]

    (last,) = graph.run("join", call, [], [Out(tf.int32, tf.TensorShape([]))], "join")
    return last
