"""Differentiable collectives, with the gradients Horovod registers for its TensorFlow ops
(``horovod/tensorflow/mpi_ops.py``):

- allreduce (grouped too): the allreduce of the incoming gradients, with the same reduction and
  scale factors;
- allgather (grouped too): the incoming gradients averaged over the ranks, this rank's rows;
- broadcast: the incoming gradients averaged, on the root rank; zeros elsewhere;
- alltoall: the alltoall of the incoming gradients back, with the splits this rank received;
- reducescatter (grouped too): the incoming gradients times the number of ranks for a sum and
  times the scale factors, gathered from every rank.

Each works eagerly (a GradientTape) and in graphs (``tf.gradients``, a tape in a ``tf.function``).
Gradient calls have no name: every rank computes its gradients in the same order, so they are
the same calls on each (numbered by the Session eagerly, named after the gradient tensors in a
graph), as in Horovod. Only floating-point tensors are differentiable (TensorFlow's rule).
"""

from __future__ import annotations

import tensorflow as tf

from pslink.core.worker.reduction import Average, ReduceOp, Sum
from pslink.core.worker.session import Session
from pslink.tf import collectives


def _differentiable(values) -> bool:
    return any(v.dtype.is_floating or v.dtype.is_complex for v in values)


def _upstream(grads, outputs) -> list:
    """The incoming gradients, zeros for outputs nothing depended on."""
    return [tf.zeros_like(y) if g is None else g for g, y in zip(grads, outputs)]


def _my_rows(session: Session, grad, rows):
    """This rank's rows of ``grad`` (every rank's rows, in rank order; ``rows``: this rank's count)."""
    counts = collectives.allgather(session, tf.reshape(rows, [1]), None)
    start = tf.reduce_sum(counts[: session.rank])
    return grad[start:start + counts[session.rank]]


# -- allreduce ------------------------------------------------------------------------------------------

def allreduce(session: Session, tensor, name, op: ReduceOp, prescale: float, postscale: float) -> tf.Tensor:
    tensor = tf.convert_to_tensor(tensor)
    if not _differentiable([tensor]):
        return collectives.allreduce(session, tensor, name, op, prescale, postscale)

    @tf.custom_gradient
    def reduced(x):
        def grad(dy):
            return collectives.allreduce(session, dy, None, op, prescale, postscale)

        return collectives.allreduce(session, x, name, op, prescale, postscale), grad

    return reduced(tensor)


def grouped_allreduce(session: Session, values, name, op: ReduceOp, prescale: float, postscale: float) -> list:
    values = collectives.tensor_list(values, "grouped_allreduce")
    if not _differentiable(values):
        return collectives.grouped_allreduce(session, values, name, op, prescale, postscale)

    @tf.custom_gradient
    def reduced(*xs):
        ys = collectives.grouped_allreduce(session, list(xs), name, op, prescale, postscale)

        def grad(*dys):
            return collectives.grouped_allreduce(session, _upstream(dys, ys), None, op, prescale, postscale)

        return ys, grad

    return list(reduced(*values))


# -- allgather ------------------------------------------------------------------------------------------

def allgather(session: Session, tensor, name) -> tf.Tensor:
    tensor = tf.convert_to_tensor(tensor)
    if not _differentiable([tensor]):
        return collectives.allgather(session, tensor, name)

    @tf.custom_gradient
    def gathered(x):
        def grad(dy):
            averaged = collectives.allreduce(session, dy, None, Average)
            return _my_rows(session, averaged, tf.shape(x, out_type=tf.int64)[0])

        return collectives.allgather(session, x, name), grad

    return gathered(tensor)


def grouped_allgather(session: Session, values, name) -> list:
    values = collectives.tensor_list(values, "grouped_allgather")
    if not _differentiable(values):
        return collectives.grouped_allgather(session, values, name)

    @tf.custom_gradient
    def gathered(*xs):
        ys = collectives.grouped_allgather(session, list(xs), name)

        def grad(*dys):
            # One allreduce each, as Horovod's (the gradients may differ in dtype).
            averaged = [collectives.allreduce(session, dy, None, Average) for dy in _upstream(dys, ys)]
            return [_my_rows(session, g, tf.shape(x, out_type=tf.int64)[0]) for g, x in zip(averaged, xs)]

        return ys, grad

    return list(gathered(*values))


# -- broadcast ------------------------------------------------------------------------------------------

def broadcast(session: Session, tensor, root_rank: int, name) -> tf.Tensor:
    tensor = tf.convert_to_tensor(tensor)
    if not _differentiable([tensor]):
        return collectives.broadcast(session, tensor, root_rank, name)

    @tf.custom_gradient
    def broadcasted(x):
        def grad(dy):
            averaged = collectives.allreduce(session, dy, None, Average)
            return averaged if session.rank == root_rank else averaged * 0

        return collectives.broadcast(session, x, root_rank, name), grad

    return broadcasted(tensor)


# -- alltoall -------------------------------------------------------------------------------------------

def alltoall(session: Session, tensor, splits, name) -> tuple[tf.Tensor, tf.Tensor]:
    tensor = tf.convert_to_tensor(tensor)
    if not _differentiable([tensor]):
        return collectives.alltoall(session, tensor, splits, name)

    @tf.custom_gradient
    def exchanged(x):
        received, received_splits = collectives.alltoall(session, x, splits, name)

        def grad(d_received, d_splits=None):
            back, _ = collectives.alltoall(session, _upstream([d_received], [received])[0], received_splits, None)
            return back

        return (received, received_splits), grad

    received, received_splits = exchanged(tensor)
    return received, tf.stop_gradient(received_splits)


# -- reducescatter --------------------------------------------------------------------------------------

def _scatter_grad(session: Session, op: ReduceOp, prescale: float, postscale: float, grad):
    if op is Sum:
        grad = grad * tf.cast(session.size, grad.dtype)
    if prescale != 1.0:
        grad = grad * tf.cast(prescale, grad.dtype)
    if postscale != 1.0:
        grad = grad * tf.cast(postscale, grad.dtype)
    return grad


def reducescatter(session: Session, tensor, name, op: ReduceOp, prescale: float, postscale: float) -> tf.Tensor:
    tensor = tf.convert_to_tensor(tensor)
    if not _differentiable([tensor]):
        return collectives.reducescatter(session, tensor, name, op, prescale, postscale)

    @tf.custom_gradient
    def scattered(x):
        share = collectives.reducescatter(session, x, name, op, prescale, postscale)

        def grad(dy):
            return collectives.allgather(session, _scatter_grad(session, op, prescale, postscale, dy), None)

        return share, grad

    return scattered(tensor)


def grouped_reducescatter(session: Session, values, name, op: ReduceOp, prescale: float, postscale: float) -> list:
    values = collectives.tensor_list(values, "grouped_reducescatter")
    if not _differentiable(values):
        return collectives.grouped_reducescatter(session, values, name, op, prescale, postscale)

    @tf.custom_gradient
    def scattered(*xs):
        shares = collectives.grouped_reducescatter(session, list(xs), name, op, prescale, postscale)

        def grad(*dys):
            # One allgather each, as Horovod's (the gradients may differ in dtype).
            return [collectives.allgather(session, _scatter_grad(session, op, prescale, postscale, dy), None)
                    for dy in _upstream(dys, shares)]

        return shares, grad

    return list(scattered(*values))
