"""Horovod's ``horovod.torch`` functions (and BytePS's ``push_pull``) over the parameter service.

``import pslink.torch as hvd`` in place of ``import horovod.torch as hvd``; run the script with
``pslink launch -n N python train.py`` (as with ``horovodrun``). ``init()`` joins the job that
the launcher's environment names; everything else works on the Session it made
(:mod:`pslink.core.worker.session`, where what Horovod means is written once for every
framework). This module converts tensors (:mod:`pslink.torch.collectives`) and makes the
collectives differentiable (:mod:`pslink.torch.autograd`).
"""

from __future__ import annotations

from typing import Any

import torch

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
from pslink.core.worker.reduction import Average, ReduceOp, reduce_op
from pslink.errors import ConfigError
from pslink.torch import autograd, collectives, local_sync
from pslink.torch.collectives import Compression, Work
from pslink.torch.optimizer import DistributedOptimizer as _wrap_optimizer
from pslink.torch.world import current_session, global_process_set, holder


def init(comm=None, process_sets=None, *, job: str | None = None, rank: int | None = None,
         num_workers: int | None = None, master: str | None = None, **options: Any) -> None:
    """Join the job (job, rank, num_workers and master from ``pslink launch``'s environment, or as
    arguments, as :func:`pslink.connect` names them). Calling it again while initialized does
    nothing, as in Horovod; after :func:`shutdown` it joins again. ``process_sets``: sets to add
    at once (a list of ProcessSets or of rank lists), as Horovod's ``init(process_sets=...)``."""
    session, made = holder.start(comm, process_sets, job, rank, num_workers, master, **options)
    if made:
        local_sync.watch(session.agent)  # sync="local:T": each optimizer step ends with the groups' sync


shutdown = holder.shutdown
is_initialized = holder.is_initialized


class Horovod(HorovodAPI):
    """Horovod's API (``horovod.torch``'s functions) over the Session ``current()`` gives: the
    world, objects, join and barrier of :class:`~pslink.core.worker.horovod.HorovodAPI`, and the
    collectives of this framework's tensors. The module's functions are the methods of one of
    these, bound to the session ``init()`` made; a test or a library may hold its own over any
    Session."""

    def cuda_built(self) -> bool:
        return torch.cuda.is_available()

    # -- allreduce and push_pull ---------------------------------------------------------------------

    def allreduce(self, tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                  compression=Compression.none, op: ReduceOp | None = None, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0, process_set: ProcessSet = global_process_set) -> torch.Tensor:
        """A new tensor: ``tensor`` averaged (default) or summed over all ranks (differentiable)."""
        return autograd.allreduce(self._session_of(process_set), tensor, name, reduce_op(op, average), compression,
                                  prescale_factor, postscale_factor)

    def allreduce_(self, tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                   op: ReduceOp | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                   process_set: ProcessSet = global_process_set) -> torch.Tensor:
        """Average (or sum) ``tensor`` over all ranks in place; returns it."""
        return self.synchronize(self.allreduce_async_(tensor, average, name, op, prescale_factor, postscale_factor,
                                            process_set=process_set))

    def allreduce_async(self, tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                        op: ReduceOp | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                        process_set: ProcessSet = global_process_set) -> Work:
        """Start :func:`allreduce`; ``synchronize(handle)`` returns the new tensor."""
        return collectives.allreduce_async(self._session_of(process_set), tensor, name, reduce_op(op, average),
                                           prescale_factor, postscale_factor)

    def allreduce_async_(self, tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                         op: ReduceOp | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                         process_set: ProcessSet = global_process_set) -> Work:
        """Start :func:`allreduce_`; ``synchronize(handle)`` returns ``tensor``."""
        return collectives.allreduce_async_(self._session_of(process_set), tensor, name, reduce_op(op, average),
                                            prescale_factor, postscale_factor)

    def push_pull(self, tensor: torch.Tensor, average: bool = True, name: str | None = None, version: int = 0,
                  priority: int = 0, compression=Compression.none) -> torch.Tensor:
        """BytePS's name for :func:`allreduce` (``version`` and ``priority`` are accepted and unused)."""
        return self.allreduce(tensor, average=average, name=name, compression=compression)

    def push_pull_async(self, tensor: torch.Tensor, average: bool = True, name: str | None = None, version: int = 0,
                        priority: int = 0) -> Work:
        return self.allreduce_async(tensor, average=average, name=name)

    def push_pull_inplace(self, tensor: torch.Tensor, average: bool = True, name: str | None = None, version: int = 0,
                          priority: int = 0) -> torch.Tensor:
        return self.allreduce_(tensor, average=average, name=name)

    def push_pull_async_inplace(self, tensor: torch.Tensor, average: bool = True, name: str | None = None,
                                version: int = 0,
                                priority: int = 0) -> Work:
        return self.allreduce_async_(tensor, average=average, name=name)

    def grouped_allreduce(self, tensors, average: bool | None = None, name: str | None = None,
                          compression=Compression.none,
                          op: ReduceOp | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                          process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
        """New tensors: each of ``tensors`` reduced over all ranks, as one group (differentiable)."""
        tensors = collectives.tensor_list(tensors, "grouped_allreduce")
        compressed = [compression.compress(t) for t in tensors]
        reduced = autograd.grouped_allreduce(self._session_of(process_set), [c for c, _ in compressed], name,
                                             reduce_op(op, average), prescale_factor, postscale_factor)
        return [compression.decompress(r, ctx) for r, (_, ctx) in zip(reduced, compressed)]

    def grouped_allreduce_(self, tensors, average: bool | None = None, name: str | None = None,
                           op: ReduceOp | None = None,
                           prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                           process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
        """Each of ``tensors`` reduced over all ranks in place, as one group; returns them."""
        return self.synchronize(self.grouped_allreduce_async_(tensors, average, name, op, prescale_factor,
                                                              postscale_factor,
                                                    process_set=process_set))

    def grouped_allreduce_async(self, tensors, average: bool | None = None, name: str | None = None,
                                op: ReduceOp | None = None, prescale_factor: float = 1.0,
                                postscale_factor: float = 1.0, process_set: ProcessSet = global_process_set) -> Work:
        """Start :func:`grouped_allreduce`; ``synchronize(handle)`` returns the new tensors."""
        return collectives.grouped_allreduce_async(self._session_of(process_set), tensors, name, reduce_op(op, average),
                                                   prescale_factor, postscale_factor)

    def grouped_allreduce_async_(self, tensors, average: bool | None = None, name: str | None = None,
                                 op: ReduceOp | None = None, prescale_factor: float = 1.0,
                                 postscale_factor: float = 1.0, process_set: ProcessSet = global_process_set) -> Work:
        """Start :func:`grouped_allreduce_`; ``synchronize(handle)`` returns ``tensors``."""
        return collectives.grouped_allreduce_async_(self._session_of(process_set), tensors, name,
                                                    reduce_op(op, average),
                                                    prescale_factor, postscale_factor)

    def synchronize(self, handle: Work) -> Any:
        """Wait for an ``*_async`` operation; returns its output tensor (a list, for a group)."""
        if not isinstance(handle, Work):
            raise ConfigError(f"synchronize() takes what an *_async function returned, got {handle!r}")
        return handle.wait(self._current().timeout)

    def poll(self, handle: Work) -> bool:
        """Whether ``synchronize(handle)`` would return at once."""
        if not isinstance(handle, Work):
            raise ConfigError(f"poll() takes what an *_async function returned, got {handle!r}")
        return handle.done()

    # -- broadcast, allgather ------------------------------------------------------------------------

    def broadcast(self, tensor: torch.Tensor, root_rank: int, name: str | None = None,
                  process_set: ProcessSet = global_process_set) -> torch.Tensor:
        """A new tensor holding root_rank's ``tensor`` (differentiable)."""
        return autograd.broadcast(self._session_of(process_set), tensor, root_rank, name)

    def broadcast_(self, tensor: torch.Tensor, root_rank: int, name: str | None = None,
                   process_set: ProcessSet = global_process_set) -> torch.Tensor:
        """Overwrite ``tensor`` with root_rank's, in place; returns it."""
        return self.synchronize(self.broadcast_async_(tensor, root_rank, name, process_set=process_set))

    def broadcast_async(self, tensor: torch.Tensor, root_rank: int, name: str | None = None,
                        process_set: ProcessSet = global_process_set) -> Work:
        return collectives.broadcast_async(self._session_of(process_set), tensor, root_rank, name)

    def broadcast_async_(self, tensor: torch.Tensor, root_rank: int, name: str | None = None,
                         process_set: ProcessSet = global_process_set) -> Work:
        return collectives.broadcast_async_(self._session_of(process_set), tensor, root_rank, name)

    def broadcast_parameters(self, params, root_rank: int, process_set: ProcessSet = global_process_set) -> None:
        """Overwrite ``params`` (``model.state_dict()`` or ``model.named_parameters()``) with
        root_rank's, in place, keyed by name."""
        with torch.no_grad():
            collectives.broadcast_parameters(self._session_of(process_set), params, root_rank)

    def broadcast_optimizer_state(self, optimizer: torch.optim.Optimizer, root_rank: int, model=None,
                                  process_set: ProcessSet = global_process_set) -> None:
        """Give every rank root_rank's optimizer state and hyperparameters."""
        collectives.broadcast_optimizer_state(self._session_of(process_set), optimizer, root_rank)

    def allgather(self, tensor: torch.Tensor, name: str | None = None,
                  process_set: ProcessSet = global_process_set) -> torch.Tensor:
        """Every rank's ``tensor`` concatenated along the first dimension, in rank order (differentiable)."""
        return autograd.allgather(self._session_of(process_set), tensor, name)

    def allgather_async(self, tensor: torch.Tensor, name: str | None = None,
                        process_set: ProcessSet = global_process_set) -> Work:
        """Start :func:`allgather`; ``synchronize(handle)`` returns the gathered tensor."""
        return collectives.allgather_async(self._session_of(process_set), tensor, name)

    def grouped_allgather(self, tensors, name: str | None = None,
                          process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
        """:func:`allgather` of each of ``tensors``, as one group (differentiable)."""
        return autograd.grouped_allgather(self._session_of(process_set), tensors, name)

    def grouped_allgather_async(self, tensors, name: str | None = None,
                                process_set: ProcessSet = global_process_set) -> Work:
        return collectives.grouped_allgather_async(self._session_of(process_set), tensors, name)

    def sparse_allreduce_async(self, tensor: torch.Tensor, name: str | None = None, op: ReduceOp | None = None,
                               process_set: ProcessSet = global_process_set) -> Work:
        """Start Horovod's sparse allreduce of a sparse ``tensor``; ``synchronize(handle)`` or
        ``handle()`` returns it."""
        return collectives.sparse_allreduce_async(self._session_of(process_set), tensor, name, reduce_op(op))

    def reducescatter(self, tensor: torch.Tensor, op: ReduceOp | None = None, name: str | None = None,
                      process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0, compression=Compression.none) -> torch.Tensor:
        """``tensor`` reduced over all ranks (Average or Sum), this rank's share of its rows;
        ``prescale_factor`` multiplies ``tensor`` before, ``postscale_factor`` the share after
        (differentiable)."""
        compressed, ctx = compression.compress(tensor)
        share = autograd.reducescatter(self._session_of(process_set), compressed, name, reduce_op(op), prescale_factor,
                                       postscale_factor)
        return compression.decompress(share, ctx)

    def reducescatter_async(self, tensor: torch.Tensor, op: ReduceOp | None = None, name: str | None = None,
                            process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                            postscale_factor: float = 1.0) -> Work:
        return collectives.reducescatter_async(self._session_of(process_set), tensor, name, reduce_op(op),
                                               prescale_factor,
                                               postscale_factor)

    def grouped_reducescatter(self, tensors, op: ReduceOp | None = None, name: str | None = None,
                              process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                              postscale_factor: float = 1.0, compression=Compression.none) -> list:
        """:func:`reducescatter` of each tensor of ``tensors`` (their requests travel together);
        ``name`` is the group's, each tensor's is ``name.i`` (differentiable)."""
        tensors = collectives.tensor_list(tensors, "grouped_reducescatter")
        compressed = [compression.compress(t) for t in tensors]
        shares = autograd.grouped_reducescatter(self._session_of(process_set), [c for c, _ in compressed], name,
                                                reduce_op(op), prescale_factor, postscale_factor)
        return [compression.decompress(s, ctx) for s, (_, ctx) in zip(shares, compressed)]

    def grouped_reducescatter_async(self, tensors, op: ReduceOp | None = None, name: str | None = None,
                                    process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                                    postscale_factor: float = 1.0) -> Work:
        return collectives.grouped_reducescatter_async(self._session_of(process_set), tensors, name, reduce_op(op),
                                                       prescale_factor, postscale_factor)

    def alltoall(self, tensor: torch.Tensor, splits=None, name: str | None = None,
                 process_set: ProcessSet = global_process_set):
        """Rank i gets ``splits[i]`` rows of every rank's ``tensor`` (even shares by default), in
        rank order; with ``splits``, also how many rows came from each rank, as Horovod returns
        (differentiable)."""
        received, received_splits = autograd.alltoall(self._session_of(process_set), tensor, splits, name)
        return received if splits is None else (received, received_splits)

    def alltoall_async(self, tensor: torch.Tensor, splits=None, name: str | None = None,
                       process_set: ProcessSet = global_process_set) -> Work:
        """Start :func:`alltoall`; ``synchronize(handle)`` returns (received, received splits)."""
        return collectives.alltoall_async(self._session_of(process_set), tensor, splits, name)

    def DistributedOptimizer(self, optimizer: torch.optim.Optimizer, named_parameters=None,
                             compression=Compression.none,
                             backward_passes_per_step: int = 1, op: ReduceOp = Average,
                             gradient_predivide_factor: float = 1.0, num_groups: int = 0, groups=None,
                             sparse_as_dense: bool = False,
                             process_set: ProcessSet = global_process_set) -> torch.optim.Optimizer:
        """Wrap ``optimizer`` so that ``step()`` uses gradients averaged over all ranks (of
        ``process_set``; see :func:`pslink.torch.optimizer.DistributedOptimizer`)."""
        # A rank outside the process set steps on its own gradients, as in Horovod.
        outside = process_set is not None and process_set.ranks is not None and not process_set.included()
        session = None if outside else self._session_of(process_set)
        return _wrap_optimizer(session, optimizer, named_parameters, compression,
                               backward_passes_per_step, op, gradient_predivide_factor, num_groups, groups,
                               sparse_as_dense)


# The module's functions: the API over the session init() made.
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
allreduce = _api.allreduce
allreduce_ = _api.allreduce_
allreduce_async = _api.allreduce_async
allreduce_async_ = _api.allreduce_async_
push_pull = _api.push_pull
push_pull_async = _api.push_pull_async
push_pull_inplace = _api.push_pull_inplace
push_pull_async_inplace = _api.push_pull_async_inplace
grouped_allreduce = _api.grouped_allreduce
grouped_allreduce_ = _api.grouped_allreduce_
grouped_allreduce_async = _api.grouped_allreduce_async
grouped_allreduce_async_ = _api.grouped_allreduce_async_
synchronize = _api.synchronize
poll = _api.poll
broadcast = _api.broadcast
broadcast_ = _api.broadcast_
broadcast_async = _api.broadcast_async
broadcast_async_ = _api.broadcast_async_
broadcast_parameters = _api.broadcast_parameters
broadcast_optimizer_state = _api.broadcast_optimizer_state
broadcast_object = _api.broadcast_object
allgather = _api.allgather
allgather_async = _api.allgather_async
grouped_allgather = _api.grouped_allgather
grouped_allgather_async = _api.grouped_allgather_async
sparse_allreduce_async = _api.sparse_allreduce_async
reducescatter = _api.reducescatter
reducescatter_async = _api.reducescatter_async
grouped_reducescatter = _api.grouped_reducescatter
grouped_reducescatter_async = _api.grouped_reducescatter_async
alltoall = _api.alltoall
alltoall_async = _api.alltoall_async
allgather_object = _api.allgather_object
start_timeline = _api.start_timeline
stop_timeline = _api.stop_timeline
join = _api.join
barrier = _api.barrier
DistributedOptimizer = _api.DistributedOptimizer
