"""Horovod's collectives on MXNet NDArrays: NDArrays to host arrays, a Session's collective, and
the result back into NDArrays. Everything Horovod means is the Session's
(:mod:`pslink.core.worker.session`); this module only converts.

An NDArray is read once into host memory (``asnumpy()``, which also waits for MXNet's engine to
finish writing it): that private copy is what the Session sends from and receives into. A new
result is handed to MXNet as it is (``mx.nd.from_numpy(..., zero_copy=True)``: no copy, then moved
to the NDArray's context if that is not the CPU); an in-place result is copied into the NDArray
once. A rank that only receives (a broadcast's non-root) reads nothing. Horovod's MXNet
collectives return when done, so each function here waits; :class:`Work` lets a caller start
several before waiting (DistributedOptimizer's grouped updates).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mxnet as mx
import numpy as np

from pslink.core.worker.pending import Pending, PendingGroup
from pslink.core.worker.reduction import ReduceOp
from pslink.core.worker.session import Session
from pslink.errors import ConfigError


class Work:
    """A collective in flight: ``wait()`` gives its NDArray result(s)."""

    __slots__ = ("_finish", "_pending")

    def __init__(self, pending: Pending | PendingGroup, finish: Callable[[Any], Any]):
        self._pending = pending
        self._finish = finish

    def wait(self, timeout: float | None) -> Any:
        return self._finish(self._pending.wait(timeout))


# -- conversion ------------------------------------------------------------------------------------

def ndarray(tensor, what: str) -> mx.nd.NDArray:
    if not isinstance(tensor, mx.nd.NDArray):
        raise ConfigError(f"{what} takes an mx.nd.NDArray, got {type(tensor).__name__}")
    if tensor.stype != "default":
        raise ConfigError(f"{what} takes dense NDArrays, got a {tensor.stype} one (Horovod's MXNet ops are dense)")
    return tensor


def ndarrays(tensors, what: str) -> list[mx.nd.NDArray]:
    if not isinstance(tensors, (list, tuple)) or not tensors:
        raise ConfigError(f"{what} takes a non-empty list of NDArrays, got {type(tensors).__name__}")
    return [ndarray(t, what) for t in tensors]


def host(tensor: mx.nd.NDArray) -> np.ndarray:
    """``tensor``'s values in a host array of our own (one copy, once MXNet has written them)."""
    return tensor.asnumpy()


def empty_host(tensor: mx.nd.NDArray) -> np.ndarray:
    """A host array of ``tensor``'s shape and dtype whose values do not matter (it only receives)."""
    return np.empty(tensor.shape, tensor.dtype)


def to_ndarray(array: np.ndarray, like: mx.nd.NDArray) -> mx.nd.NDArray:
    """A host array the session filled (and nobody else holds), as an NDArray in ``like``'s
    context: MXNet takes its memory without a copy where it can (a CPU context, a dtype DLPack
    carries), else it is copied once."""
    try:
        result = mx.nd.from_numpy(np.ascontiguousarray(array), zero_copy=True)
    except ValueError:  # a dtype MXNet cannot take over (int8, int16)
        return mx.nd.array(array, ctx=like.context, dtype=array.dtype)
    return result if like.context == result.context else result.as_in_context(like.context)


def copy_into(array: np.ndarray, tensor: mx.nd.NDArray) -> mx.nd.NDArray:
    """Write a host array the session filled into ``tensor`` (in place, one copy); returns ``tensor``."""
    try:
        mx.nd.from_numpy(np.ascontiguousarray(array), zero_copy=True).copyto(tensor)
    except ValueError:  # a dtype MXNet cannot take over (int8, int16)
        tensor[:] = array
    return tensor


# -- allreduce ------------------------------------------------------------------------------------

def allreduce_start(session: Session, tensor: mx.nd.NDArray, name: str | None, op: ReduceOp, prescale: float,
                    postscale: float, inplace: bool) -> Work:
    """``tensor`` reduced over the session's ranks: into ``tensor`` (``inplace``) or a new NDArray."""
    tensor = ndarray(tensor, "allreduce")
    array = host(tensor)
    pending = session.allreduce(array, array, name, op, prescale, postscale)
    return Work(pending, lambda out: copy_into(out, tensor) if inplace else to_ndarray(out, tensor))


def allreduce(session: Session, tensor, name, op, prescale, postscale, inplace: bool = False) -> mx.nd.NDArray:
    return allreduce_start(session, tensor, name, op, prescale, postscale, inplace).wait(session.timeout)


def grouped_allreduce_start(session: Session, tensors, name: str | None, op: ReduceOp, prescale: float,
                            postscale: float, inplace: bool) -> Work:
    """Each of ``tensors`` reduced, started together (``name.i`` each)."""
    tensors = ndarrays(tensors, "grouped_allreduce")
    arrays = [host(t) for t in tensors]
    pending = session.grouped_allreduce(arrays, arrays, name, op, prescale, postscale)

    def finish(outs):
        return [copy_into(o, t) if inplace else to_ndarray(o, t) for o, t in zip(outs, tensors)]

    return Work(pending, finish)


def grouped_allreduce(session: Session, tensors, name, op, prescale, postscale, inplace: bool = False) -> list:
    return grouped_allreduce_start(session, tensors, name, op, prescale, postscale, inplace).wait(session.timeout)


# -- broadcast ------------------------------------------------------------------------------------

def broadcast(session: Session, tensor, root_rank: int, name: str | None, inplace: bool = False) -> mx.nd.NDArray:
    """root_rank's ``tensor`` on every rank: into ``tensor`` (``inplace``) or a new NDArray."""
    tensor = ndarray(tensor, "broadcast")
    root = session.check_root(root_rank, "broadcast") == session.rank  # (a set's root is a rank of the job)
    array = host(tensor) if root else empty_host(tensor)
    out = session.broadcast(array, root_rank, array, name).wait(session.timeout)
    if inplace:
        return tensor if root else copy_into(out, tensor)
    return to_ndarray(out, tensor)


def broadcast_named(session: Session, named: list[tuple[str, mx.nd.NDArray]], root_rank: int, what: str) -> None:
    """Overwrite each NDArray of ``named`` (name, NDArray) with root_rank's, in one request keyed
    by name."""
    items = [(n, ndarray(t, f"{what}: {n!r}")) for n, t in named]
    names = [n for n, _ in items]
    if len(set(names)) != len(names):
        repeated = sorted({n for n in names if names.count(n) > 1})
        raise ConfigError(f"{what}: names must be unique, these repeat: {repeated}")
    if not items:
        return
    root = session.check_root(root_rank, what) == session.rank
    arrays = [host(t) if root else empty_host(t) for _, t in items]
    session.broadcast_many([(n, a, a) for (n, _), a in zip(items, arrays)], root_rank, what,
                           what).wait(session.timeout)
    if not root:
        for (_, tensor), array in zip(items, arrays):
            copy_into(array, tensor)


# -- allgather, reducescatter, alltoall -----------------------------------------------------------

def allgather(session: Session, tensor, name: str | None) -> mx.nd.NDArray:
    """Every rank's ``tensor`` concatenated along the first dimension, in rank order."""
    tensor = ndarray(tensor, "allgather")
    gathered, _ = session.allgather(host(tensor), name).wait(session.timeout)
    return to_ndarray(gathered, tensor)


def grouped_allgather(session: Session, tensors, name: str | None) -> list[mx.nd.NDArray]:
    tensors = ndarrays(tensors, "grouped_allgather")
    results = session.grouped_allgather([host(t) for t in tensors], name).wait(session.timeout)
    return [to_ndarray(gathered, t) for (gathered, _), t in zip(results, tensors)]


def reducescatter(session: Session, tensor, name: str | None, op: ReduceOp, prescale: float,
                  postscale: float) -> mx.nd.NDArray:
    """``tensor`` reduced over the ranks; this rank's share of its first dimension."""
    tensor = ndarray(tensor, "reducescatter")
    share = session.reducescatter(host(tensor), name, op, prescale, postscale).wait(session.timeout)
    return to_ndarray(share, tensor)


def grouped_reducescatter(session: Session, tensors, name: str | None, op: ReduceOp, prescale: float,
                          postscale: float) -> list[mx.nd.NDArray]:
    tensors = ndarrays(tensors, "grouped_reducescatter")
    shares = session.grouped_reducescatter([host(t) for t in tensors], name, op, prescale,
                                           postscale).wait(session.timeout)
    return [to_ndarray(s, t) for s, t in zip(shares, tensors)]


def alltoall(session: Session, tensor, splits, name: str | None) -> tuple[mx.nd.NDArray, mx.nd.NDArray]:
    """Rank i gets ``splits[i]`` rows of every rank's ``tensor``: (the rows received, how many
    came from each rank, int32 on the CPU, as Horovod returns them)."""
    tensor = ndarray(tensor, "alltoall")
    if isinstance(splits, mx.nd.NDArray):
        if not np.issubdtype(splits.dtype, np.integer):
            raise ConfigError(f"alltoall: splits must be integers, got an NDArray of {np.dtype(splits.dtype).name}")
        splits = splits.asnumpy().tolist()
    received, received_splits = session.alltoall(host(tensor), splits, name).wait(session.timeout)
    return to_ndarray(received, tensor), mx.nd.from_numpy(received_splits, zero_copy=True)
