"""Horovod's MXNet API (``horovod.mxnet``) over the parameter service.

::

    import pslink.mxnet.horovod as hvd      # in place of: import horovod.mxnet as hvd

    hvd.init()
    trainer = hvd.DistributedTrainer(net.collect_params(), "sgd", {"learning_rate": 0.1 * hvd.size()})
    hvd.broadcast_parameters(net.collect_params(), root_rank=0)

Run the script with ``pslink launch -n N python train.py`` (as with ``horovodrun``). ``init()``
joins the job that the launcher's environment names; everything else works on the Session it
made (:mod:`pslink.core.worker.session`, where what Horovod means is written once for every
framework: names, reductions and scale factors, the checks at the call, join, process sets).
This module converts NDArrays (:mod:`pslink.mxnet.collectives`) and wraps MXNet's Trainer and
Optimizer (:mod:`pslink.mxnet.distributed`).
"""

from __future__ import annotations

import types
from typing import Any

import mxnet as mx

from pslink.core.worker.horovod import HorovodAPI
from pslink.core.worker.horovod import (  # noqa: F401  (Horovod's build reports, re-exported)
    ccl_built,
    ddl_built,
    gloo_built,
    gloo_enabled,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    rocm_built,
)
from pslink.core.worker.process_sets import ProcessSet
from pslink.core.worker.reduction import Adasum, Average, Max, Min, Product, ReduceOp, Sum, reduce_op
from pslink.core.worker.session import Session
from pslink.errors import ConfigError
from pslink.errors import PslinkError as HorovodInternalError  # (a RuntimeError, as Horovod's)
from pslink.mxnet import collectives
from pslink.mxnet.distributed import Compression, DistributedOptimizer, DistributedTrainer
from pslink.mxnet.world import current_session, global_process_set, holder

__all__ = [
    "Adasum", "Average", "Compression", "DistributedOptimizer", "DistributedTrainer", "Horovod",
    "HorovodInternalError", "Max", "Min", "ProcessSet", "Product", "ReduceOp", "Session", "Sum",
    "add_process_set", "allgather", "allgather_object", "allreduce", "allreduce_", "alltoall", "barrier",
    "broadcast", "broadcast_", "broadcast_object", "broadcast_parameters", "ccl_built", "cross_rank", "cross_size",
    "cuda_built", "ddl_built", "gloo_built", "gloo_enabled", "global_process_set", "grouped_allgather",
    "grouped_allreduce", "grouped_allreduce_", "grouped_reducescatter", "init", "is_homogeneous", "is_initialized",
    "join", "local_rank", "local_size", "mpi_built", "mpi_enabled", "mpi_threads_supported", "nccl_built", "rank",
    "reducescatter", "remove_process_set", "rocm_built", "shutdown", "size", "start_timeline", "stop_timeline",
]


def init(comm=None, process_sets=None, *, job: str | None = None, rank: int | None = None,
         num_workers: int | None = None, master: str | None = None, **options: Any) -> None:
    """Join the job (job, rank, num_workers and master from ``pslink launch``'s environment, or as
    arguments, as :func:`pslink.connect` names them). Calling it again while initialized does
    nothing, as in Horovod; after :func:`shutdown` it joins again. ``process_sets``: sets to add
    at once (ProcessSets or rank lists), as Horovod's ``init(process_sets=...)``."""
    holder.start(comm, process_sets, job, rank, num_workers, master, **options)


shutdown = holder.shutdown
is_initialized = holder.is_initialized


def _broadcast_after_init(session: Session, param: mx.gluon.Parameter, root_rank: int, name: str) -> None:
    """Make ``param`` (its shape not known yet: deferred initialization) broadcast root_rank's
    values as soon as MXNet initializes it, in the first forward pass (Horovod's way)."""
    init_impl = param._init_impl

    def init_then_broadcast(self, *args, **kwargs):
        init_impl(*args, **kwargs)
        arrays = self.list_data()
        collectives.broadcast(session, arrays[0], root_rank, name, inplace=True)
        for other in arrays[1:]:
            arrays[0].copyto(other)

    param._init_impl = types.MethodType(init_then_broadcast, param)


class Horovod(HorovodAPI):
    """Horovod's API (``horovod.mxnet``'s functions) over the Session ``current()`` gives: the
    world, objects, join and barrier of :class:`~pslink.core.worker.horovod.HorovodAPI`, and the
    collectives of this framework's tensors. The module's functions are the methods of one of
    these, bound to the session ``init()`` made; a test or a library may hold its own over any
    Session. ``priority`` is accepted everywhere
    Horovod takes it, and unused (requests go out in the order of the calls)."""

    # -- the world ----------------------------------------------------------------------------------

    def cuda_built(self) -> bool:
        """Whether this MXNet has CUDA (GPU NDArrays then travel through host memory)."""
        return mx.runtime.Features().is_enabled("CUDA")

    # -- allreduce -----------------------------------------------------------------------------------

    def allreduce(self, tensor, average: bool | None = None, name: str | None = None, priority: int = 0,
                  prescale_factor: float = 1.0, postscale_factor: float = 1.0, process_set=global_process_set,
                  op: ReduceOp | None = None) -> mx.nd.NDArray:
        """A new NDArray: ``tensor`` averaged (default) or reduced by ``op`` over the ranks."""
        return collectives.allreduce(self._session_of(process_set), tensor, name, reduce_op(op, average),
                                     prescale_factor, postscale_factor)

    def allreduce_(self, tensor, average: bool | None = None, name: str | None = None, priority: int = 0,
                   prescale_factor: float = 1.0, postscale_factor: float = 1.0, process_set=global_process_set,
                   op: ReduceOp | None = None) -> mx.nd.NDArray:
        """``tensor`` averaged (or reduced by ``op``) over the ranks in place; returns it."""
        return collectives.allreduce(self._session_of(process_set), tensor, name, reduce_op(op, average),
                                     prescale_factor, postscale_factor, inplace=True)

    def grouped_allreduce(self, tensors, average: bool | None = None, name: str | None = None, priority: int = 0,
                          prescale_factor: float = 1.0, postscale_factor: float = 1.0, process_set=global_process_set,
                          op: ReduceOp | None = None) -> list[mx.nd.NDArray]:
        """New NDArrays: each of ``tensors`` reduced over the ranks, started together."""
        return collectives.grouped_allreduce(self._session_of(process_set), tensors, name, reduce_op(op, average),
                                             prescale_factor, postscale_factor)

    def grouped_allreduce_(self, tensors, average: bool | None = None, name: str | None = None, priority: int = 0,
                           prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                           process_set=global_process_set, op: ReduceOp | None = None) -> list[mx.nd.NDArray]:
        """Each of ``tensors`` reduced over the ranks in place, started together; returns them."""
        return collectives.grouped_allreduce(self._session_of(process_set), tensors, name, reduce_op(op, average),
                                             prescale_factor, postscale_factor, inplace=True)

    # -- broadcast -----------------------------------------------------------------------------------

    def broadcast(self, tensor, root_rank: int, name: str | None = None, priority: int = 0,
                  process_set=global_process_set) -> mx.nd.NDArray:
        """A new NDArray holding root_rank's ``tensor``, bit for bit."""
        return collectives.broadcast(self._session_of(process_set), tensor, root_rank, name)

    def broadcast_(self, tensor, root_rank: int, name: str | None = None, priority: int = 0,
                   process_set=global_process_set) -> mx.nd.NDArray:
        """Overwrite ``tensor`` with root_rank's, in place; returns it."""
        return collectives.broadcast(self._session_of(process_set), tensor, root_rank, name, inplace=True)

    def broadcast_parameters(self, params, root_rank: int = 0, prefix: str | None = None,
                             process_set=global_process_set) -> None:
        """Overwrite ``params`` (a gluon ParameterDict, or a dict of NDArrays as Module's
        ``get_params()`` gives) with root_rank's, in place, keyed by ``prefix`` + name. A
        parameter whose initialization is deferred (its shape known at the first forward pass)
        is broadcast right after MXNet initializes it, as in Horovod."""
        session = self._session_of(process_set)
        if prefix is not None and not isinstance(prefix, str):
            raise ConfigError(f"broadcast_parameters: prefix must be a string, got {prefix!r}")
        if not isinstance(params, (dict, mx.gluon.ParameterDict)):
            raise ConfigError(f"broadcast_parameters takes a ParameterDict or a dict of NDArrays, got "
                              f"{type(params).__name__}")
        if session.size == 1:
            return
        named, copies = [], []
        for name, value in sorted(params.items(), key=lambda item: str(item[0])):
            key = f"{prefix or ''}{name}"
            if isinstance(value, mx.gluon.Parameter):
                try:
                    arrays = value.list_data()
                except mx.gluon.parameter.DeferredInitializationError:
                    _broadcast_after_init(session, value, root_rank, key)
                    continue
                named.append((key, arrays[0]))
                copies.append(arrays)
            else:
                named.append((key, value))
        collectives.broadcast_named(session, named, root_rank, "broadcast_parameters")
        for arrays in copies:
            for other in arrays[1:]:
                arrays[0].copyto(other)

    # -- allgather, reducescatter, alltoall ---------------------------------------------------------

    def allgather(self, tensor, name: str | None = None, priority: int = 0,
                  process_set=global_process_set) -> mx.nd.NDArray:
        """Every rank's ``tensor`` concatenated along the first dimension, in rank order."""
        return collectives.allgather(self._session_of(process_set), tensor, name)

    def grouped_allgather(self, tensors, name: str | None = None, priority: int = 0,
                          process_set=global_process_set) -> list[mx.nd.NDArray]:
        """:meth:`allgather` of each of ``tensors``, started together."""
        return collectives.grouped_allgather(self._session_of(process_set), tensors, name)

    def reducescatter(self, tensor, op: ReduceOp | None = Average, name: str | None = None, priority: int = 0,
                      process_set=global_process_set, prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0) -> mx.nd.NDArray:
        """``tensor`` reduced over the ranks (Average or Sum), this rank's share of its rows."""
        return collectives.reducescatter(self._session_of(process_set), tensor, name, reduce_op(op), prescale_factor,
                                         postscale_factor)

    def grouped_reducescatter(self, tensors, op: ReduceOp | None = Average, name: str | None = None,
                              priority: int = 0, process_set=global_process_set, prescale_factor: float = 1.0,
                              postscale_factor: float = 1.0) -> list[mx.nd.NDArray]:
        """:meth:`reducescatter` of each of ``tensors``, started together (``name.i`` each)."""
        return collectives.grouped_reducescatter(self._session_of(process_set), tensors, name, reduce_op(op),
                                                 prescale_factor, postscale_factor)

    def alltoall(self, tensor, splits=None, name: str | None = None, priority: int = 0,
                 process_set=global_process_set):
        """Rank i gets ``splits[i]`` rows of every rank's ``tensor`` (even shares by default), in
        rank order; with ``splits``, also how many rows came from each rank, as Horovod returns."""
        received, received_splits = collectives.alltoall(self._session_of(process_set), tensor, splits, name)
        return received if splits is None else (received, received_splits)

    # -- barrier and join ---------------------------------------------------------------------------

    # -- training -----------------------------------------------------------------------------------

    def DistributedTrainer(self, params, optimizer, optimizer_params=None, compression=Compression.none,
                           gradient_predivide_factor: float = 1.0, prefix: str | None = None, num_groups: int = 0,
                           process_set=global_process_set) -> DistributedTrainer:
        """A gluon Trainer averaging gradients over the ranks (:class:`DistributedTrainer`) on this Session."""
        return DistributedTrainer(params, optimizer, optimizer_params, compression, gradient_predivide_factor, prefix,
                                  num_groups, process_set, session=self._current())

    def DistributedOptimizer(self, optimizer: mx.optimizer.Optimizer, gradient_predivide_factor: float = 1.0,
                             num_groups: int = 0, process_set=global_process_set) -> DistributedOptimizer:
        """``optimizer`` averaging each gradient over the ranks first (:class:`DistributedOptimizer`) on this Session."""
        return DistributedOptimizer(optimizer, gradient_predivide_factor, num_groups, process_set,
                                    session=self._current())


# The module's functions: the API over the session init() made. (DistributedTrainer and
# DistributedOptimizer are the classes themselves, as in Horovod: they find that session too.)
_api = Horovod(current_session)
add_process_set = _api.add_process_set
remove_process_set = _api.remove_process_set
rank = _api.rank
size = _api.size
local_rank = _api.local_rank
local_size = _api.local_size
cross_rank = _api.cross_rank
cross_size = _api.cross_size
is_homogeneous = _api.is_homogeneous
cuda_built = _api.cuda_built
start_timeline = _api.start_timeline
stop_timeline = _api.stop_timeline
allreduce = _api.allreduce
allreduce_ = _api.allreduce_
grouped_allreduce = _api.grouped_allreduce
grouped_allreduce_ = _api.grouped_allreduce_
broadcast = _api.broadcast
broadcast_ = _api.broadcast_
broadcast_parameters = _api.broadcast_parameters
broadcast_object = _api.broadcast_object
allgather = _api.allgather
grouped_allgather = _api.grouped_allgather
allgather_object = _api.allgather_object
reducescatter = _api.reducescatter
grouped_reducescatter = _api.grouped_reducescatter
alltoall = _api.alltoall
barrier = _api.barrier
join = _api.join
