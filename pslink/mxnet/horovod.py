"""Horovod's MXNet API (``horovod.mxnet``) over the parameter service.

::

    import pslink.mxnet.horovod as hvd      # in place of: import horovod.mxnet as hvd

    hvd.init()
    trainer = hvd.DistributedTrainer(net.collect_params(), "sgd", {"learning_rate": 0.1 * hvd.size()})
    hvd.broadcast_parameters(net.collect_params(), root_rank=0)

Every operation is a push-pull of a named key of the job in mode ``sum`` (as in
:mod:`pslink.torch`): ``allreduce`` averages floats on the service (integer averages truncate),
``broadcast`` sends the root's bits and zeros from the others, ``allgather`` rows in rank order.
NDArrays go through host memory. ``DistributedTrainer`` is a gluon Trainer that sums each
gradient over the ranks before its update and divides by the number of ranks in the update's
scale, as Horovod's does; ``DistributedOptimizer`` wraps an ``mx.optimizer.Optimizer`` whose
``update`` averages the gradient first. Run the script with ``pslink launch -n N python train.py``.
"""

from __future__ import annotations

import itertools
from typing import Any

import mxnet as mx
import numpy as np

from pslink.core.worker import collectives, process_sets
from pslink.core.worker.collectives import (Adasum, Average, Max, Min, Product, Sum, Zeros, ccl_built,  # noqa: F401
                                     ddl_built, gloo_built, gloo_enabled, mpi_built, mpi_enabled,
                                     mpi_threads_supported, nccl_built, reduce_op, rocm_built)
from pslink.core.worker.connect import connect
from pslink.errors import ConfigError
from pslink.errors import PslinkError as HorovodInternalError  # noqa: F401  (a RuntimeError, as Horovod's)


__all__ = [
    "start_timeline", "stop_timeline",
    "Adasum", "Average", "Compression", "DistributedOptimizer", "ProcessSet", "add_process_set",
    "global_process_set", "remove_process_set", "DistributedTrainer", "HorovodInternalError", "Max", "Min",
    "Product", "Session", "Sum", "allgather", "allgather_object", "allreduce", "allreduce_", "alltoall", "barrier",
    "broadcast", "broadcast_", "broadcast_object", "broadcast_parameters", "ccl_built", "cross_rank", "cuda_built",
    "cross_size", "ddl_built", "gloo_built", "gloo_enabled", "grouped_allgather", "grouped_allreduce",
    "grouped_allreduce_", "grouped_reducescatter", "init", "is_initialized", "join", "local_rank", "local_size",
    "mpi_built",
    "mpi_enabled", "mpi_threads_supported", "nccl_built", "rank", "reducescatter", "rocm_built", "shutdown", "size",
]


class Session:
    """One worker's Horovod collectives over an Agent in mode ``sum`` (the module functions use
    the one :func:`init` made; tests may hold several)."""

    def __init__(self, agent):
        if agent.mode != "sum":
            raise ConfigError(f"pslink.mxnet.horovod needs an Agent in mode 'sum', this one is in mode {agent.mode!r}")
        self.agent = agent
        self.rank, self.size = agent.rank, agent.num_workers
        self._unnamed = {kind: itertools.count() for kind in ("allreduce", "broadcast", "allgather", "reducescatter",
                                                              "alltoall")}
        self._zeros = Zeros()
        self.trainers: list = []  # this rank's DistributedTrainers, in creation order (join mirrors them)
        self.process_sets = process_sets.ProcessSets(ProcessSet, Session)  # Horovod's, added from this session
        self._joined_seen = np.zeros(self.size, np.int64)

    def close(self) -> None:
        self.process_sets.close()
        self._zeros.clear()
        self.agent.close()

    def _name(self, kind: str, name: str | None) -> str:
        if name is None:
            return f"{kind}.noname.{next(self._unnamed[kind])}"  # the n-th unnamed call on every rank
        if not isinstance(name, str) or not name:
            raise ConfigError(f"a {kind} name must be a non-empty string, got {name!r}")
        return name

    def _pushpull(self, key: str, array: np.ndarray, out: np.ndarray, average: bool = False) -> np.ndarray:
        return self.agent.pushpull(key, array, out=out, average=average).wait()

    def allreduce_(self, tensor: mx.nd.NDArray, average: bool | None = None, name: str | None = None,
                   op=None, prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> mx.nd.NDArray:
        """``tensor`` averaged (or summed; Min, Max, Product) over the ranks, in place; returns it."""
        op = reduce_op(op, average, elementwise=True)
        name = self._name("allreduce", name)
        if op in collectives.ELEMENTWISE:
            tensor[:] = self.reduce_elementwise(_scale_nd(tensor, prescale_factor), op, name)
            if postscale_factor != 1.0:
                tensor[:] = _scale_nd(tensor, postscale_factor)
            return tensor
        host = np.ascontiguousarray(tensor.asnumpy())
        if prescale_factor != 1.0:
            host = _scaled(host, prescale_factor)
        floating = host.dtype.kind == "f"
        out = np.empty_like(host)
        self._pushpull(collectives.service_key("mx.allreduce", name), host, out, op is Average and floating)
        if op is Average and not floating:
            out = np.trunc(out / self.size).astype(out.dtype)
        if postscale_factor != 1.0:
            out = _scaled(out, postscale_factor)
        tensor[:] = out
        return tensor

    def allreduce(self, tensor: mx.nd.NDArray, average: bool | None = None, name: str | None = None, op=None,
                  prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> mx.nd.NDArray:
        return self.allreduce_(tensor.copy(), average, name, op, prescale_factor, postscale_factor)

    def broadcast_(self, tensor: mx.nd.NDArray, root_rank: int, name: str | None = None) -> mx.nd.NDArray:
        """root_rank's ``tensor`` on every rank, in place, bit for bit."""
        collectives.check_root(root_rank, self.size, "broadcast")
        name = self._name("broadcast", name)
        host = np.ascontiguousarray(tensor.asnumpy())
        if host.size:
            bits = collectives.bits_of(host)
            (push,) = collectives.broadcast_pushes([bits], self.rank, root_rank, self._zeros)
            self._pushpull(collectives.service_key("mx.broadcast", name), push, bits)
            tensor[:] = host
        return tensor

    def broadcast(self, tensor: mx.nd.NDArray, root_rank: int, name: str | None = None) -> mx.nd.NDArray:
        return self.broadcast_(tensor.copy(), root_rank, name)

    def allgather(self, tensor: mx.nd.NDArray, name: str | None = None) -> mx.nd.NDArray:
        """Every rank's ``tensor`` concatenated along the first dimension, in rank order."""
        name = self._name("allgather", name)
        host = np.ascontiguousarray(tensor.asnumpy())
        gathered, _ = collectives.gather_rows(self._round, f"mx.{name}", host, self.rank, self.size)
        return mx.nd.array(gathered, ctx=tensor.context, dtype=tensor.dtype)

    def reducescatter(self, tensor: mx.nd.NDArray, op=Average, name: str | None = None,
                      prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> mx.nd.NDArray:
        """Horovod's reducescatter: ``tensor`` (one shape on every rank) averaged or summed over
        the ranks, this rank's share of its first dimension returned (the first ``rows % size``
        ranks get one row more)."""
        if op not in (Average, Sum):
            raise ConfigError(f"reducescatter takes op=Average or Sum, got {op!r}")
        if not tensor.shape:
            raise ConfigError("reducescatter needs a tensor of at least one dimension (its rows are scattered)")
        name = self._name("reducescatter", name)
        reduced = self.allreduce(tensor, None, f"reducescatter.{name}", op, prescale_factor, postscale_factor)
        start, rows = collectives.scatter_share(tensor.shape[0], self.size, self.rank)
        return reduced[start : start + rows].copy()

    def alltoall(self, tensor: mx.nd.NDArray, splits=None, name: str | None = None):
        """Horovod's alltoall: rank i gets ``splits[i]`` rows of every rank's ``tensor`` (equal
        shares of the first dimension when ``splits`` is None), concatenated in rank order; with
        ``splits`` given also how many rows came from each rank (int32)."""
        if not tensor.shape:
            raise ConfigError("alltoall needs a tensor of at least one dimension (its rows are sent)")
        name = self._name("alltoall", name)
        given = splits is not None
        if isinstance(splits, mx.nd.NDArray):
            splits = splits.asnumpy().tolist()
        splits = collectives.alltoall_splits(name, tensor.shape[0], self.size, splits)
        everything = self.allgather(tensor, f"alltoall.{name}.rows").asnumpy()
        table = self.allgather(mx.nd.array([splits], dtype="int64"), f"alltoall.{name}.splits").asnumpy().tolist()
        pieces = [everything[start : start + rows] for start, rows in collectives.alltoall_pieces(table, self.rank)]
        received = mx.nd.array(np.concatenate(pieces), ctx=tensor.context, dtype=tensor.dtype)
        if given:
            return received, mx.nd.array([sent[self.rank] for sent in table], dtype="int32")
        return received

    def _round(self, key: str, array: np.ndarray, out: np.ndarray) -> np.ndarray:
        return self._pushpull(key, array, out)

    def broadcast_object(self, obj: Any = None, root_rank: int = 0, name: str | None = None) -> Any:
        collectives.check_root(root_rank, self.size, "broadcast_object")
        return collectives.broadcast_object(self._round, f"mx.{name or 'broadcast_object'}", obj, self.rank,
                                            root_rank)

    def broadcast_parameters(self, params, root_rank: int = 0) -> None:
        """Overwrite ``params`` (a gluon ParameterDict or a dict of NDArrays, as Module's
        ``get_params()`` gives) with root_rank's, in place, by name."""
        if hasattr(params, "items"):
            named = sorted(params.items(), key=lambda item: item[0])
        else:
            raise ConfigError(f"broadcast_parameters takes a ParameterDict or a dict of NDArrays, got "
                              f"{type(params).__name__}")
        for name, value in named:
            if isinstance(value, mx.gluon.Parameter):
                arrays = value.list_data()
                self.broadcast_(arrays[0], root_rank, f"parameter.{name}")
                for other in arrays[1:]:
                    arrays[0].copyto(other)
            else:
                self.broadcast_(value, root_rank, f"parameter.{name}")

    def allgather_object(self, obj: Any, name: str | None = None) -> list:
        return collectives.allgather_object(self._round, f"mx.{name or 'allgather_object'}", obj, self.rank,
                                            self.size)

    def reduce_elementwise(self, tensor: mx.nd.NDArray, op, name: str | None) -> mx.nd.NDArray:
        """Min, Max or Product: every rank's tensor gathered in rank order, reduced alike on each."""
        rows = self.allgather(tensor.reshape((1, -1)), None if name is None else f"{name}.{op.value}").asnumpy()
        reduce = {collectives.Min: np.min, collectives.Max: np.max, collectives.Product: np.prod}[op]
        return mx.nd.array(reduce(rows, axis=0).reshape(tensor.shape), ctx=tensor.context, dtype=tensor.dtype)

    def barrier(self) -> None:
        self.agent.barrier("mx/barrier", timeout=self.agent.timeout)

    # -- join: uneven data (as pslink.torch's Session.join) -------------------------------------

    def join_round(self, trainer_index: int | None):
        """This rank's part of one join round (:func:`pslink.core.worker.collectives.join_vector`),
        started: (handle, vector)."""
        vector = collectives.join_vector(self.size, self.rank, trainer_index)
        return self.agent.pushpull("mx.join", vector, out=vector), vector

    def join(self) -> int:
        """Declare that this rank ran out of data, and block until every rank did. Until then it
        mirrors the others' ``DistributedTrainer`` steps with zero gradients (averages are still
        over every rank, as in Horovod); its own weights are not stepped. Returns the rank that
        joined last (the highest, if several joined together)."""
        def round_():
            handle, vector = self.join_round(None)
            handle.wait()
            return vector

        def mirror(index: int) -> None:
            if not 0 <= index < len(self.trainers):
                raise ConfigError(f"join: the other ranks stepped DistributedTrainer #{index}, but rank {self.rank} "
                                  f"has {len(self.trainers)}: every rank must create the same ones")
            self.trainers[index].contribute_zeros()

        last, self._joined_seen = collectives.join(round_, self.size, self.rank, self._joined_seen, mirror)
        return last


def _scale_nd(tensor: mx.nd.NDArray, factor: float) -> mx.nd.NDArray:
    return tensor if factor == 1.0 else mx.nd.array(_scaled(tensor.asnumpy(), factor), ctx=tensor.context,
                                                    dtype=tensor.dtype)


def _scaled(array: np.ndarray, factor: float) -> np.ndarray:
    """``array * factor`` in its own dtype (integers truncated toward zero, as Horovod scales)."""
    if array.dtype.kind == "f":
        return (array * factor).astype(array.dtype)
    return np.trunc(array.astype(np.float64) * factor).astype(array.dtype)


# -- the module's session ----------------------------------------------------------------------------

_holder = collectives.SessionHolder("pslink.mxnet.horovod")


def init(comm=None, *, job: str | None = None, rank: int | None = None, num_workers: int | None = None,
         master: str | None = None, **options: Any) -> None:
    """Join the job (from ``pslink launch``'s environment, or as arguments); again: nothing."""
    if _holder.session is not None:
        return
    if comm is not None:
        raise ConfigError("pslink.mxnet.horovod.init: MPI communicators are not supported; call init()")
    options["mode"] = "sum"
    _holder.session = Session(connect(job, rank, num_workers, master, **options))


def shutdown() -> None:
    _holder.shutdown()


def current_session() -> Session:
    return _holder.current()


class ProcessSet(process_sets.ProcessSet):
    __doc__ = process_sets.ProcessSet.__doc__
    current = staticmethod(current_session)


global_process_set = ProcessSet()


def add_process_set(process_set) -> ProcessSet:
    """Add a set of ranks (a ProcessSet or a list of ranks); every rank adds every set, in the
    same order. Its collectives (``process_set=``) count only its ranks."""
    world = current_session()
    return world.process_sets.add(world, process_set)


def remove_process_set(process_set: ProcessSet) -> bool:
    return current_session().process_sets.remove(process_set)


def _session_of(process_set) -> Session:
    """The Session a collective of ``process_set`` runs on (the job's for None or the global set)."""
    world = current_session()
    return world.process_sets.session_for(world, process_set)


def is_initialized() -> bool:
    return _holder.session is not None


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Horovod's: record this worker's requests to a Chrome trace at ``file_path`` from now on
    (rank 0 writes ``file_path``, rank R ``file_path.rankR``); ``mark_cycles`` marks iterations."""
    current_session().agent.start_timeline(file_path, mark_cycles)


def stop_timeline() -> None:
    current_session().agent.stop_timeline()


def rank() -> int:
    return current_session().rank


def size() -> int:
    return current_session().size


def local_rank() -> int:
    return current_session().rank


def local_size() -> int:
    return current_session().size


def cross_rank() -> int:
    return collectives.cross_rank(rank(), local_size())


def cross_size() -> int:
    return collectives.cross_size(size(), local_size())


def allreduce(tensor, average=None, name=None, priority=0, prescale_factor=1.0, postscale_factor=1.0, op=None, *,
              process_set=None):
    """A new NDArray: ``tensor`` averaged (default) or summed over every rank (``priority`` unused)."""
    return _session_of(process_set).allreduce(tensor, average, name, op, prescale_factor, postscale_factor)


def allreduce_(tensor, average=None, name=None, priority=0, prescale_factor=1.0, postscale_factor=1.0, op=None, *,
               process_set=None):
    return _session_of(process_set).allreduce_(tensor, average, name, op, prescale_factor, postscale_factor)


def grouped_allreduce(tensors, average=None, name=None, priority=0, prescale_factor=1.0, postscale_factor=1.0,
                      op=None, *, process_set=None):
    return [allreduce(t, average, None if name is None else f"{name}.{i}", priority, prescale_factor,
                      postscale_factor, op, process_set=process_set) for i, t in enumerate(tensors)]


def grouped_allreduce_(tensors, average=None, name=None, priority=0, prescale_factor=1.0, postscale_factor=1.0,
                       op=None, *, process_set=None):
    return [allreduce_(t, average, None if name is None else f"{name}.{i}", priority, prescale_factor,
                       postscale_factor, op, process_set=process_set) for i, t in enumerate(tensors)]


def allgather(tensor, name=None, priority=0, *, process_set=None):
    return _session_of(process_set).allgather(tensor, name)


def grouped_allgather(tensors, name=None, priority=0, *, process_set=None):
    return [allgather(t, None if name is None else f"{name}.{i}", priority, process_set=process_set)
            for i, t in enumerate(tensors)]


def reducescatter(tensor, op=Average, name=None, priority=0, prescale_factor=1.0, postscale_factor=1.0, *,
                  process_set=None):
    return _session_of(process_set).reducescatter(tensor, op, name, prescale_factor, postscale_factor)


def grouped_reducescatter(tensors, op=Average, name=None, priority=0, prescale_factor=1.0, postscale_factor=1.0, *,
                          process_set=None):
    return [reducescatter(t, op, None if name is None else f"{name}.{i}", priority, prescale_factor,
                          postscale_factor, process_set=process_set) for i, t in enumerate(tensors)]


def alltoall(tensor, splits=None, name=None, priority=0, *, process_set=None):
    return _session_of(process_set).alltoall(tensor, splits, name)


def broadcast(tensor, root_rank, name=None, priority=0, *, process_set=None):
    return _session_of(process_set).broadcast(tensor, root_rank, name)


def broadcast_(tensor, root_rank, name=None, priority=0, *, process_set=None):
    return _session_of(process_set).broadcast_(tensor, root_rank, name)


def broadcast_object(obj=None, root_rank=0, name=None, *, process_set=None):
    return _session_of(process_set).broadcast_object(obj, root_rank, name)


def broadcast_parameters(params, root_rank=0, prefix=None, *, process_set=None):
    _session_of(process_set).broadcast_parameters(params, root_rank)


def allgather_object(obj, name=None, *, process_set=None):
    return _session_of(process_set).allgather_object(obj, name)


def barrier(*, process_set=None):
    _session_of(process_set).barrier()


def join(device: int = -1) -> int:
    """This rank is out of data: mirror the others' DistributedTrainer steps with zero gradients
    until every rank joined; returns the rank that joined last."""
    return current_session().join()


def cuda_built() -> bool:
    return False  # pslink moves NDArrays through host memory


# -- training ----------------------------------------------------------------------------------------


class _FP16Compressor:
    """Send floating-point NDArrays as float16, halving the bytes on the wire."""

    @staticmethod
    def compress(tensor):
        if np.issubdtype(tensor.dtype, np.floating) and tensor.dtype != np.float16:
            return tensor.astype("float16"), tensor.dtype
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor if ctx is None else tensor.astype(ctx)


class Compression:
    """Horovod's compression choices for ``DistributedTrainer``: ``none`` and ``fp16``."""

    none = collectives.NoneCompressor
    fp16 = _FP16Compressor


class DistributedOptimizer(mx.optimizer.Optimizer):
    """``optimizer`` (for ``Module.fit(optimizer=..., kvstore=None)``) whose ``update`` first sums
    the gradient over the ranks, its ``rescale_grad`` divided by the number of ranks: the average,
    as Horovod's does it."""

    def __init__(self, optimizer: mx.optimizer.Optimizer, gradient_predivide_factor: float = 1.0,
                 num_groups: int = 0, session: Session | None = None):
        self._optimizer = optimizer
        self._predivide = float(gradient_predivide_factor)
        self._session = session or current_session()
        self._optimizer.rescale_grad *= self._predivide / self._session.size

    def __getattr__(self, item):
        return getattr(self._optimizer, item)

    def create_state_multi_precision(self, index, weight):
        return self._optimizer.create_state_multi_precision(index, weight)

    def _sum(self, index, grad) -> None:
        indices, grads = (index, grad) if isinstance(index, (list, tuple)) else ([index], [grad])
        for i, g in zip(indices, grads):
            self._session.allreduce_(g, op=Sum, name=f"optimizer.{i}", prescale_factor=1.0 / self._predivide)

    def update(self, index, weight, grad, state):
        self._sum(index, grad)
        self._optimizer.update(index, weight, grad, state)

    def update_multi_precision(self, index, weight, grad, state):
        self._sum(index, grad)
        self._optimizer.update_multi_precision(index, weight, grad, state)

    def set_learning_rate(self, lr):
        self._optimizer.set_learning_rate(lr)

    def set_lr_mult(self, args_lr_mult):
        self._optimizer.set_lr_mult(args_lr_mult)

    def set_wd_mult(self, args_wd_mult):
        self._optimizer.set_wd_mult(args_wd_mult)


class DistributedTrainer(mx.gluon.Trainer):
    """A gluon Trainer whose gradients are summed over the ranks before each update, the update's
    scale divided by the number of ranks (Horovod's ``DistributedTrainer``)."""

    def __init__(self, params, optimizer, optimizer_params=None, compression=Compression.none,
                 gradient_predivide_factor: float = 1.0, prefix=None, num_groups: int = 0,
                 session: Session | None = None):
        compression = Compression.none if compression is None else compression
        if not (hasattr(compression, "compress") and hasattr(compression, "decompress")):
            raise ConfigError(f"DistributedTrainer: compression is hvd.Compression.none or hvd.Compression.fp16, "
                              f"got {compression!r}")
        self._compression = compression
        self._session = session or current_session()
        self._index = len(self._session.trainers)
        self._session.trainers.append(self)
        super().__init__(params, optimizer, optimizer_params=optimizer_params, kvstore=None)
        self._predivide = float(gradient_predivide_factor)
        self._scale /= self._session.size  # gradients are summed: the average, as Horovod scales it
        self._prefix = prefix or ""

    def _allreduce_grads(self):
        join, vector = self._session.join_round(self._index)  # in flight with the gradients
        for i, param in enumerate(self._params):
            if param.grad_req == "null":
                continue
            grads = param.list_grad()
            self._reduce(i, param, grads[0])
            for other in grads[1:]:
                grads[0].copyto(other)
        join.wait()
        self._session._joined_seen = vector[: self._session.size].copy()

    def _reduce(self, i: int, param, grad: mx.nd.NDArray) -> None:
        sent, ctx = self._compression.compress(grad)
        self._session.allreduce_(sent, op=Sum, name=f"{self._prefix}grad.{i}.{param.name}",
                                 prescale_factor=1.0 / self._predivide, postscale_factor=self._predivide)
        if sent is not grad:
            grad[:] = self._compression.decompress(sent, ctx)

    def contribute_zeros(self) -> None:
        """While this rank is joined: one step's worth of zero gradients, as the others step."""
        for i, param in enumerate(self._params):
            if param.grad_req != "null":
                grad = param.list_grad()[0]
                self._reduce(i, param, mx.nd.zeros(grad.shape, ctx=grad.context, dtype=grad.dtype))
