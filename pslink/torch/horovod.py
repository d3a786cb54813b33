"""Horovod's ``horovod.torch`` functions (and BytePS's ``push_pull``) over the parameter service.

``import pslink.torch as hvd`` in place of ``import horovod.torch as hvd``; run the script with
``pslink launch -n N python train.py`` (as with ``horovodrun``). ``init()`` joins the job that
the launcher's environment names; everything else works on the session it made.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from pslink.core.worker import collectives
from pslink.core.worker.collectives import (  # noqa: F401  (Horovod's build reports, re-exported)
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
from pslink.core.worker.connect import connect
from pslink.errors import ConfigError, PeerError
from pslink.torch.optimizer import DistributedOptimizer as _wrap_optimizer
from pslink.torch import autograd
from pslink.torch.process_sets import ProcessSet, global_process_set
from pslink.torch.session import Average, Compression, ReduceOp, Session, Work, WorkGroup, reduce_op, tensor_list

ENV_LOCAL_RANK = "PSLINK_LOCAL_RANK"
ENV_LOCAL_SIZE = "PSLINK_LOCAL_SIZE"

_holder = collectives.SessionHolder("pslink.torch")


def init(comm=None, *, job: str | None = None, rank: int | None = None, num_workers: int | None = None,
         master: str | None = None, **options: Any) -> None:
    """Join the job (job, rank, num_workers and master from ``pslink launch``'s environment, or as
    arguments, as :func:`pslink.connect` names them). Calling it again while initialized does
    nothing, as in Horovod."""
    if _holder.session is not None:
        return
    if comm is not None:
        raise ConfigError("pslink.torch.init: MPI communicators and process sets are not supported; call init()")
    if options.get("mode", "sum") != "sum" or "optimizer" in options:
        raise ConfigError("pslink.torch reduces on the service in mode 'sum'; the optimizer steps locally")
    options["mode"] = "sum"
    try:
        agent = connect(job, rank, num_workers, master, **options)
    except PeerError as exc:
        raise PeerError(f"pslink.torch.init: no parameter service reachable: {exc.message}. Run the script "
                        "under `pslink launch -n N`, or start `pslink service up` and set PSLINK_MASTER",
                        **exc.details) from None
    except ConfigError as exc:
        raise ConfigError(f"pslink.torch.init: {exc.message}. Run the script under `pslink launch -n N "
                          "python script.py`, which sets PSLINK_JOB, PSLINK_RANK and PSLINK_NUM_WORKERS") from None

    def connect_again(token: bytes, rejoin: bool = False):
        """The same registration, with the job's token (elastic recovery: a new Agent)."""
        return connect(job, rank, num_workers, master, **dict(options, token=token, rejoin=rejoin))

    _holder.session = Session(agent, _env_int(ENV_LOCAL_RANK), _env_int(ENV_LOCAL_SIZE), connect=connect_again)


def _env_int(name: str) -> int | None:
    raw = os.environ.get(name)
    if not raw:
        return None
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not an integer") from None


def shutdown() -> None:
    """Leave the job and release the session (``init()`` may be called again)."""
    _holder.shutdown()


def _session_of(process_set) -> Session:
    """The Session a collective of ``process_set`` runs on."""
    world = current_session()
    return world.process_sets.session_for(world, process_set)


def add_process_set(process_set) -> ProcessSet:
    """Make a process set of these ranks (a list, or a ProcessSet): every rank calls it, in the
    same order for every set; the ranks in it then reduce among themselves."""
    world = current_session()
    return world.process_sets.add(world, process_set)


def remove_process_set(process_set: ProcessSet) -> bool:
    """Forget a process set (its ranks leave its job); False if it was not added."""
    return current_session().process_sets.remove(process_set)


def current_session() -> Session:
    return _holder.current()


def is_initialized() -> bool:
    return _holder.session is not None


def rank() -> int:
    return current_session().rank


def size() -> int:
    return current_session().size


def local_rank() -> int:
    return current_session().local_rank


def local_size() -> int:
    return current_session().local_size


def cross_rank() -> int:
    session = current_session()
    return collectives.cross_rank(session.rank, session.local_size)


def cross_size() -> int:
    session = current_session()
    return collectives.cross_size(session.size, session.local_size)


def cuda_built() -> bool:
    return torch.cuda.is_available()


# -- allreduce and push_pull ---------------------------------------------------------------------


def allreduce(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
              compression=Compression.none, op: ReduceOp | None = None, prescale_factor: float = 1.0,
              postscale_factor: float = 1.0, process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """A new tensor: ``tensor`` averaged (default) or summed over all ranks (differentiable)."""
    return autograd.allreduce(_session_of(process_set), tensor, name, reduce_op(op, average, elementwise=True),
                              compression, prescale_factor, postscale_factor)


def allreduce_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
               op: ReduceOp | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
               process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Average (or sum) ``tensor`` over all ranks in place; returns it."""
    return synchronize(allreduce_async_(tensor, average, name, op, prescale_factor, postscale_factor,
                                        process_set=process_set))


def allreduce_async(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                    op: ReduceOp | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                    process_set: ProcessSet = global_process_set) -> Work:
    """Start :func:`allreduce`; ``synchronize(handle)`` returns the new tensor."""
    return _session_of(process_set).allreduce_async(tensor, name, reduce_op(op, average, elementwise=True),
                                                    prescale_factor, postscale_factor)


def allreduce_async_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                     op: ReduceOp | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                     process_set: ProcessSet = global_process_set) -> Work:
    """Start :func:`allreduce_`; ``synchronize(handle)`` returns ``tensor``."""
    return _session_of(process_set).allreduce_async_(tensor, name, reduce_op(op, average, elementwise=True),
                                                     prescale_factor, postscale_factor)


def push_pull(tensor: torch.Tensor, average: bool = True, name: str | None = None, version: int = 0,
              priority: int = 0, compression=Compression.none) -> torch.Tensor:
    """BytePS's name for :func:`allreduce` (``version`` and ``priority`` are accepted and unused)."""
    return allreduce(tensor, average=average, name=name, compression=compression)


def push_pull_async(tensor: torch.Tensor, average: bool = True, name: str | None = None, version: int = 0,
                    priority: int = 0) -> Work:
    return allreduce_async(tensor, average=average, name=name)


def push_pull_inplace(tensor: torch.Tensor, average: bool = True, name: str | None = None, version: int = 0,
                      priority: int = 0) -> torch.Tensor:
    return allreduce_(tensor, average=average, name=name)


def push_pull_async_inplace(tensor: torch.Tensor, average: bool = True, name: str | None = None, version: int = 0,
                            priority: int = 0) -> Work:
    return allreduce_async_(tensor, average=average, name=name)


def grouped_allreduce(tensors, average: bool | None = None, name: str | None = None, compression=Compression.none,
                      op: ReduceOp | None = None, prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0,
                      process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    """New tensors: each of ``tensors`` reduced over all ranks, as one group."""
    if compression is not Compression.none:
        return [allreduce(t, average, None if name is None else f"{name}.{i}", compression, op, prescale_factor,
                          postscale_factor, process_set=process_set) for i, t in enumerate(tensors)]
    return synchronize(grouped_allreduce_async(tensors, average, name, op, prescale_factor, postscale_factor,
                                               process_set=process_set))


def grouped_allreduce_(tensors, average: bool | None = None, name: str | None = None, op: ReduceOp | None = None,
                       prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                       process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    """Each of ``tensors`` reduced over all ranks in place, as one group; returns them."""
    return synchronize(grouped_allreduce_async_(tensors, average, name, op, prescale_factor, postscale_factor,
                                                process_set=process_set))


def grouped_allreduce_async(tensors, average: bool | None = None, name: str | None = None,
                            op: ReduceOp | None = None, prescale_factor: float = 1.0,
                            postscale_factor: float = 1.0, process_set: ProcessSet = global_process_set) -> WorkGroup:
    """Start :func:`grouped_allreduce`; ``synchronize(handle)`` returns the new tensors."""
    copies = [t.detach().clone() for t in tensor_list(tensors, "grouped_allreduce")]
    return grouped_allreduce_async_(copies, average, name, op, prescale_factor, postscale_factor,
                                    process_set=process_set)


def grouped_allreduce_async_(tensors, average: bool | None = None, name: str | None = None,
                             op: ReduceOp | None = None, prescale_factor: float = 1.0,
                             postscale_factor: float = 1.0, process_set: ProcessSet = global_process_set) -> WorkGroup:
    """Start :func:`grouped_allreduce_`; ``synchronize(handle)`` returns ``tensors``."""
    return _session_of(process_set).grouped_allreduce_async_(tensors, name,
                                                             reduce_op(op, average, elementwise=True),
                                                             prescale_factor, postscale_factor)


def synchronize(handle: Work | WorkGroup) -> Any:
    """Wait for an ``*_async`` operation; returns its output tensor (a list, for a group)."""
    if not isinstance(handle, (Work, WorkGroup)):
        raise ConfigError(f"synchronize() takes what an *_async function returned, got {handle!r}")
    return handle.wait(current_session().timeout)


def poll(handle: Work) -> bool:
    """Whether ``synchronize(handle)`` would return at once."""
    return handle.done()


# -- broadcast, allgather ------------------------------------------------------------------------


def broadcast(tensor: torch.Tensor, root_rank: int, name: str | None = None,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """A new tensor holding root_rank's ``tensor`` (differentiable)."""
    return autograd.broadcast(_session_of(process_set), tensor, root_rank, name)


def broadcast_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
               process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Overwrite ``tensor`` with root_rank's, in place; returns it."""
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set=process_set))


def broadcast_async(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                    process_set: ProcessSet = global_process_set) -> Work:
    return _session_of(process_set).broadcast_async(tensor, root_rank, name)


def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> Work:
    return _session_of(process_set).broadcast_async_(tensor, root_rank, name)


def broadcast_parameters(params, root_rank: int) -> None:
    """Overwrite ``params`` (``model.state_dict()`` or ``model.named_parameters()``) with
    root_rank's, in place, keyed by name."""
    current_session().broadcast_parameters(params, root_rank)


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int) -> None:
    """Give every rank root_rank's optimizer state and hyperparameters."""
    current_session().broadcast_optimizer_state(optimizer, root_rank)


def broadcast_object(obj: Any = None, root_rank: int = 0, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> Any:
    """root_rank's ``obj`` (any picklable object) on every rank."""
    return _session_of(process_set).broadcast_object(obj, root_rank, name)


def allgather(tensor: torch.Tensor, name: str | None = None,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Every rank's ``tensor`` concatenated along the first dimension, in rank order (differentiable)."""
    return autograd.allgather(_session_of(process_set), tensor, name)


def allgather_async(tensor: torch.Tensor, name: str | None = None,
                    process_set: ProcessSet = global_process_set) -> Work:
    """Start :func:`allgather`; ``synchronize(handle)`` returns the gathered tensor."""
    return _session_of(process_set).allgather_async(tensor, name)


def grouped_allgather(tensors, name: str | None = None,
                      process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    """:func:`allgather` of each of ``tensors``, as one group."""
    return synchronize(grouped_allgather_async(tensors, name, process_set=process_set))


def grouped_allgather_async(tensors, name: str | None = None,
                            process_set: ProcessSet = global_process_set) -> WorkGroup:
    return _session_of(process_set).grouped_allgather_async(tensors, name)


def sparse_allreduce_async(tensor: torch.Tensor, name: str | None = None, op: ReduceOp | None = None,
                           process_set: ProcessSet = global_process_set) -> Work:
    """Start Horovod's sparse allreduce of a sparse ``tensor``; ``synchronize`` returns it."""
    result = _session_of(process_set).sparse_allreduce(tensor, name, reduce_op(op))
    return Work.finished(result, f"sparse_allreduce {name!r}")


def reducescatter(tensor: torch.Tensor, op: ReduceOp | None = None, name: str | None = None,
                  process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0) -> torch.Tensor:
    """``tensor`` reduced over all ranks (Average or Sum), this rank's share of its rows;
    ``prescale_factor`` multiplies ``tensor`` before, ``postscale_factor`` the share after."""
    return _session_of(process_set).reducescatter(tensor, name, reduce_op(op), prescale_factor, postscale_factor)


def reducescatter_async(tensor: torch.Tensor, op: ReduceOp | None = None, name: str | None = None,
                        process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                        postscale_factor: float = 1.0) -> Work:
    result = reducescatter(tensor, op, name, process_set, prescale_factor, postscale_factor)
    return Work.finished(result, f"reducescatter {name!r}")


def grouped_reducescatter(tensors, op: ReduceOp | None = None, name: str | None = None,
                          process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0) -> list:
    """:func:`reducescatter` of each tensor of ``tensors`` (their requests travel together);
    ``name`` is the group's, each tensor's is ``name.i``."""
    return _session_of(process_set).grouped_reducescatter(tensors, name, reduce_op(op), prescale_factor,
                                                          postscale_factor)


def grouped_reducescatter_async(tensors, op: ReduceOp | None = None, name: str | None = None,
                                process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                                postscale_factor: float = 1.0) -> Work:
    result = grouped_reducescatter(tensors, op, name, process_set, prescale_factor, postscale_factor)
    return Work.finished(result, f"grouped_reducescatter {name!r}")


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Horovod's: record this worker's requests to a Chrome trace at ``file_path`` from now on
    (rank 0 writes ``file_path``, rank R ``file_path.rankR``; see docs/visibility.md);
    ``mark_cycles`` marks where each iteration starts."""
    current_session().agent.start_timeline(file_path, mark_cycles)


def stop_timeline() -> None:
    """Stop recording the timeline and close its file."""
    current_session().agent.stop_timeline()


def alltoall(tensor: torch.Tensor, splits=None, name: str | None = None, process_set: ProcessSet = global_process_set):
    """Rank i gets ``splits[i]`` rows of every rank's ``tensor`` (even shares by default), in
    rank order; with ``splits``, also how many rows came from each rank (as Horovod returns)."""
    return _session_of(process_set).alltoall(tensor, splits, name)


def alltoall_async(tensor: torch.Tensor, splits=None, name: str | None = None,
                   process_set: ProcessSet = global_process_set) -> Work:
    result = alltoall(tensor, splits, name, process_set=process_set)
    return Work.finished(result, f"alltoall {name!r}")


def allgather_object(obj: Any, name: str | None = None, process_set: ProcessSet = global_process_set) -> list:
    """Every rank's ``obj``, as a list in rank order."""
    return _session_of(process_set).allgather_object(obj, name)


def join(device: int = -1) -> int:
    """This rank is out of data: mirror the others' optimizer steps with zero gradients until
    every rank joined; returns the rank that joined last."""
    return current_session().join()


def barrier(process_set: ProcessSet = global_process_set) -> None:
    _session_of(process_set).barrier()


def DistributedOptimizer(optimizer: torch.optim.Optimizer, named_parameters=None, compression=Compression.none,
                         backward_passes_per_step: int = 1, op: ReduceOp = Average,
                         gradient_predivide_factor: float = 1.0, num_groups: int = 0, groups=None,
                         sparse_as_dense: bool = False,
                         process_set: ProcessSet = global_process_set) -> torch.optim.Optimizer:
    """Wrap ``optimizer`` so that ``step()`` uses gradients averaged over all ranks (of
    ``process_set``; see :func:`pslink.torch.optimizer.DistributedOptimizer`)."""
    return _wrap_optimizer(optimizer, named_parameters, compression, backward_passes_per_step, op,
                           gradient_predivide_factor, num_groups, groups, sparse_as_dense,
                           session=_session_of(process_set))
