"""Horovod's row collectives for TensorFlow tensors: ``reducescatter``, ``alltoall`` and the grouped
gathers, on :func:`~pslink.tf.ops.allreduce` and :func:`~pslink.tf.ops.allgather` (as
``pslink.torch`` and ``pslink.mxnet.horovod`` build them, with the split rules of
:mod:`pslink.core.worker.collectives`). Each works eagerly and inside a ``tf.function``: the shares are
computed with TensorFlow ops, so the first dimension may be unknown while tracing. Eagerly, a
bad argument is refused at the call with a message naming it; traced, TensorFlow's assertions
name it when the function runs.
"""

from __future__ import annotations

import tensorflow as tf

from pslink.core.worker import collectives
from pslink.core.worker.collectives import Average, Sum
from pslink.errors import ConfigError
from pslink.tf.ops import allgather, allreduce, tensor_list
from pslink.tf.process_sets import exchange_of


def _rows_of(tensor, what: str) -> tf.Tensor:
    if tensor.shape.rank == 0:
        raise ConfigError(f"{what} needs a tensor of at least one dimension (its rows are split), got a scalar")
    return tf.shape(tensor, out_type=tf.int64)[0]


@tf.autograph.experimental.do_not_convert
def reducescatter(tensor, op=Average, name: str | None = None, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0, process_set=None) -> tf.Tensor:
    """``tensor`` (one shape on every worker) averaged (``op=hvd.Sum``: summed) over the workers,
    this worker's share of its first dimension returned: the first ``rows % size`` workers get
    one row more, as Horovod splits it."""
    if op not in (Average, Sum):
        raise ConfigError(f"reducescatter takes op=Average or op=Sum, got {op!r}")
    tensor = tf.convert_to_tensor(tensor)
    _rows_of(tensor, "reducescatter")
    reduced = allreduce(tensor, name=None if name is None else f"reducescatter.{name}", op=op,
                        prescale_factor=prescale_factor, postscale_factor=postscale_factor, process_set=process_set)
    exchange = exchange_of(process_set)
    size, rank = exchange.num_workers, exchange.rank
    rows = tf.shape(reduced, out_type=tf.int64)[0]
    base, extra = rows // size, rows % size
    start = rank * base + tf.minimum(tf.constant(rank, tf.int64), extra)
    return reduced[start:start + base + tf.cast(rank < extra, tf.int64)]


def grouped_reducescatter(tensors, op=Average, name: str | None = None, prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0, process_set=None) -> list[tf.Tensor]:
    """:func:`reducescatter` of each of ``tensors`` (``name.i`` each, when ``name`` is given)."""
    tensor_list(tensors, "grouped_reducescatter")
    return [reducescatter(t, op, None if name is None else f"{name}.{i}", prescale_factor, postscale_factor,
                          process_set) for i, t in enumerate(tensors)]


def grouped_allgather(tensors, name: str | None = None, process_set=None) -> list[tf.Tensor]:
    """:func:`~pslink.tf.ops.allgather` of each of ``tensors`` (``name.i`` each, when given)."""
    tensor_list(tensors, "grouped_allgather")
    return [allgather(t, None if name is None else f"{name}.{i}", process_set) for i, t in enumerate(tensors)]


@tf.autograph.experimental.do_not_convert
def alltoall(tensor, splits=None, name: str | None = None, process_set=None) -> tuple[tf.Tensor, tf.Tensor]:
    """Worker ``i`` gets ``splits[i]`` rows of every worker's ``tensor`` (equal shares of the first
    dimension when ``splits`` is None), concatenated in rank order. Returns them and how many rows
    came from each worker (int32), as Horovod's TensorFlow ``alltoall`` does."""
    tensor = tf.convert_to_tensor(tensor)
    rows = _rows_of(tensor, "alltoall")
    exchange = exchange_of(process_set)
    size, rank = exchange.num_workers, exchange.rank
    label = name or "alltoall"
    if splits is None:
        if tf.executing_eagerly():
            collectives.alltoall_splits(label, int(rows), size, None)  # refused now, naming the rows
        else:
            tf.debugging.assert_equal(rows % size, tf.constant(0, tf.int64), message=(
                f"alltoall {label!r}: the rows do not split evenly over {size} ranks; pass splits"))
        splits = tf.fill([size], rows // size)
    else:
        splits = tf.cast(tf.reshape(tf.convert_to_tensor(splits), [-1]), tf.int64)
        if tf.executing_eagerly():
            collectives.alltoall_splits(label, int(rows), size, splits.numpy().tolist())
        else:
            tf.debugging.assert_equal(tf.reduce_sum(splits), rows, message=(
                f"alltoall {label!r}: splits must add up to the tensor's rows"))
    everything = allgather(tensor, None if name is None else f"alltoall.{name}.rows", process_set)
    table = allgather(tf.reshape(splits, [1, size]), None if name is None else f"alltoall.{name}.splits", process_set)
    # Rank s's rows start where the ranks before it end; ours among them after those s sends lower ranks.
    starts = tf.cumsum(tf.reduce_sum(table, axis=1), exclusive=True) + tf.reduce_sum(table[:, :rank], axis=1)
    counts = table[:, rank]
    received = tf.concat([everything[starts[s]:starts[s] + counts[s]] for s in range(size)], axis=0)
    return received, tf.cast(counts, tf.int32)
