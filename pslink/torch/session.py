"""Collective operations of one worker over the parameter service: the engine under the
Horovod-compatible module (``import pslink.torch as hvd``).

Every operation is one or two push-pulls of a named key in ``sum`` mode, as
:mod:`pslink.core.worker.collectives` (shared with the TensorFlow adapter) describes; this module turns
tensors into host arrays and back. None of it needs ``torch.distributed``. Keys come from names,
so ranks need not create tensors in the same order, only use each name in the same sequence of
calls (as with Horovod).
"""

from __future__ import annotations

import itertools
from typing import Any, Callable

import numpy as np
import torch

from pslink.core.worker import collectives, elastic
from pslink.torch import local_sync
from pslink.torch.process_sets import ProcessSets
from pslink.core.agent import Agent
from pslink.core.worker.collectives import Adasum, Average, ReduceOp, Sum, Zeros, reduce_op
from pslink.errors import ConfigError, PslinkError
from pslink.torch.tensors import HostView, StagingPool, explain_mismatch, wire_dtype

__all__ = ["ReduceOp", "Average", "Sum", "Adasum", "Compression", "Session", "Work"]


JOIN_KEY = "join"


class _FP16Compressor:
    """Send floating-point tensors as float16, halving the bytes on the wire."""

    @staticmethod
    def compress(tensor: torch.Tensor):
        if tensor.dtype.is_floating_point and tensor.dtype != torch.float16:
            return tensor.to(torch.float16), tensor.dtype
        return tensor, None

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx):
        return tensor if ctx is None else tensor.to(ctx)


class Compression:
    """Horovod's gradient compression choices: ``Compression.none`` and ``Compression.fp16``."""

    none = collectives.NoneCompressor
    fp16 = _FP16Compressor


class Work:
    """An operation in flight (what ``allreduce_async`` and friends return): ``wait()`` gives
    its result, ``done()`` says whether ``wait()`` would return at once."""

    __slots__ = ("_handle", "_views", "_finish", "_what", "_hint", "_result", "_finished")

    def __init__(self, handle, views: list[HostView], finish: Callable[[], Any], what: str, hint: str):
        self._handle = handle
        self._views = views
        self._finish = finish
        self._what = what
        self._hint = hint
        self._finished = False
        self._result = None

    def done(self) -> bool:
        return self._finished or self._handle.done()

    def wait(self, timeout: float | None = None) -> Any:
        if not self._finished:
            try:
                self._handle.wait(timeout)
            except PslinkError as exc:
                raise explain_mismatch(exc, self._what, self._hint) from None
            for view in self._views:
                view.finish()
            self._result = self._finish()
            self._finished = True
        return self._result

    @classmethod
    def finished(cls, result: Any, what: str) -> "Work":
        """An operation already carried out (its result at hand): ``wait()`` returns it."""
        return cls(_Done(), [], lambda: result, what, "")

    def __repr__(self) -> str:
        return f"<pslink.torch.Work {self._what} {'done' if self.done() else 'in flight'}>"


# Collectives that may be called without a name (the n-th such call on every rank is one operation).
UNNAMED_KINDS = ("allreduce", "broadcast", "allgather", "reducescatter", "alltoall", "sparse_allreduce")


class Session:
    """One worker's collectives, over a connected :class:`~pslink.core.agent.Agent` in mode
    ``sum``. The module-level functions of :mod:`pslink.torch` use the session ``init()`` made;
    tests and libraries may hold several."""

    def __init__(self, agent: Agent, local_rank: int | None = None, local_size: int | None = None,
                 connect: Callable[[bytes], Agent] | None = None):
        if agent.mode != "sum":
            raise ConfigError(f"pslink.torch needs an Agent in mode 'sum', this one is in mode {agent.mode!r}")
        self.agent = agent
        local_sync.watch(agent)  # sync="local:T": each optimizer step ends with the groups' sync
        # ``connect(token, rejoin=...)`` makes a new Agent for this rank of the same job (elastic
        # recovery; ``rejoin``: the Agent option of that name).
        self._connect = connect
        self.timeout = agent.timeout
        self._staging = StagingPool()
        self._zeros = Zeros()
        self.optimizers: list = []  # DistributedOptimizers, in creation order (see join)
        self._reducing: set[str] = set()  # names of allreduces in flight: one at a time per name (Horovod's rule)
        self.process_sets = ProcessSets()  # Horovod's process sets added from this session
        members = (agent.settings.get("membership") or {}).get("ranks") or list(range(agent.num_workers))
        self.set_world(sorted(set(members) | {agent.rank}), 0)
        # On one machine (pslink launch) local rank and size follow the world when it changes.
        self._local_follows = local_rank in (None, self.rank) and local_size in (None, self.size)
        self.local_rank = self.rank if local_rank is None else local_rank
        self.local_size = self.size if local_size is None else local_size

    @property
    def capacity(self) -> int:
        """The most workers the job may have (:func:`pslink.core.worker.elastic.capacity`)."""
        return elastic.capacity(self.agent, self.size)

    def set_world(self, ranks: list[int], generation: int) -> None:
        """Take ``ranks`` (the job's service ranks, every member agreeing) as the world: ``rank``
        becomes this worker's position among them and ``size`` their number, as Horovod renumbers
        ranks after a reset. ``generation`` (agreed too) keeps unnamed operations of different
        worlds on different keys, since a newcomer's counters start from zero."""
        if self.agent.rank not in ranks:
            raise ConfigError(f"rank {self.agent.rank} of job {self.agent.job!r} is not in the world {ranks}")
        self.ranks = list(ranks)
        self.rank = self.ranks.index(self.agent.rank)
        self.size = len(self.ranks)
        self.generation = generation
        self._unnamed = {kind: itertools.count() for kind in UNNAMED_KINDS}
        self._joined_seen = np.zeros(self.size, np.int64)  # who had joined at the last join round
        if getattr(self, "_local_follows", False):
            self.local_rank, self.local_size = self.rank, self.size

    def reconnect(self) -> Agent:
        """Register this rank again with a new Agent, which comes into the running job as a late
        worker, and close the old one (:func:`pslink.core.worker.elastic.register_again`). Returns the
        new Agent."""
        self.agent = elastic.register_again(self.agent, self._connect)
        if self.agent.mode != "sum":
            raise ConfigError(f"pslink.torch needs an Agent in mode 'sum', the new one is in mode {self.agent.mode!r}")
        self.timeout = self.agent.timeout
        self._staging.clear()
        return self.agent

    def abandon(self) -> None:
        """Forget the DistributedOptimizers' gradients in flight (elastic recovery: their round
        was given up)."""
        for optimizer in self.optimizers:
            optimizer._pslink.abandon()

    def close(self) -> None:
        self.process_sets.close()
        self._staging.clear()
        self._zeros.clear()
        self.agent.close()

    # -- names and keys ---------------------------------------------------------------------------

    def _name(self, kind: str, name: str | None) -> str:
        if name is None:
            # As Horovod does: the n-th unnamed call on every rank is the same operation.
            if self.generation:
                return f"{kind}.noname.g{self.generation}.{next(self._unnamed[kind])}"
            return f"{kind}.noname.{next(self._unnamed[kind])}"
        if not isinstance(name, str) or not name:
            raise ConfigError(f"a {kind} name must be a non-empty string, got {name!r}")
        return name

    def _group_names(self, kind: str, name: str | None, count: int) -> list:
        """A group's names: ``name.i`` each, or None each (unnamed: matched by position)."""
        if name is None:
            return [None] * count
        name = self._name(kind, name)
        return [f"{name}.{i}" for i in range(count)]

    def _wait(self, work: Work) -> Any:
        return work.wait(self.timeout)

    # -- allreduce --------------------------------------------------------------------------------

    def allreduce_async_(self, tensor: torch.Tensor, name: str | None = None, op: ReduceOp = Average,
                         prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> Work:
        """Reduce ``tensor`` over all ranks in place (average, sum, min, max or product); returns a
        :class:`Work`."""
        name = self._name("allreduce", name)
        op = reduce_op(op, elementwise=True)
        key = collectives.service_key("allreduce", name)
        what = f"allreduce {name!r} (key {key!r}, shape {tuple(tensor.shape)} {tensor.dtype})"
        result, tensor = tensor, tensor.detach()  # same memory, outside autograd
        if prescale_factor != 1.0:
            _scale(tensor, prescale_factor)
        if op in collectives.ELEMENTWISE:
            # Every rank's tensor as a row, in rank order; each rank reduces them alike.
            rows = self.allgather(tensor.reshape(1, -1), name)
            reduce = {collectives.Min: torch.amin, collectives.Max: torch.amax, collectives.Product: torch.prod}[op]
            tensor.copy_(reduce(rows, dim=0).view_as(tensor))
            if postscale_factor != 1.0:
                _scale(tensor, postscale_factor)
            return Work.finished(result, what)
        if name in self._reducing:
            raise ConfigError(f"allreduce {name!r} is already in flight on rank {self.rank}: synchronize it before "
                              "reducing under its name again, or give each tensor a name of its own")
        view = self._staging.view(key, tensor, what)
        # The service averages floats; integers are summed here and divided below.
        average = op is Average and view.array.dtype.kind == "f"
        hint = "do all ranks pass tensors of the same shape under this name?"
        handle = self._submit([key], [view.array], [view.array], average, what, hint)
        self._reducing.add(name)
        handle.add_done_callback(lambda _: self._reducing.discard(name))

        def finish():
            if op is Average and not average:
                tensor.copy_(torch.div(tensor, self.size, rounding_mode="trunc"))
            if postscale_factor != 1.0:
                _scale(tensor, postscale_factor)
            return result

        return Work(handle, [view], finish, what, hint)

    def allreduce_async(self, tensor: torch.Tensor, name: str | None = None, op: ReduceOp = Average,
                        prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> Work:
        """Like :meth:`allreduce_async_`, into a new tensor (``tensor`` is left as it is)."""
        return self.allreduce_async_(tensor.detach().clone(), name, op, prescale_factor, postscale_factor)

    def allreduce(self, tensor: torch.Tensor, name: str | None = None, op: ReduceOp = Average,
                  compression=Compression.none, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0) -> torch.Tensor:
        """A new tensor: ``tensor`` averaged (or summed) over all ranks."""
        compressed, ctx = compression.compress(tensor.detach())
        if compressed is tensor or compressed.data_ptr() == tensor.data_ptr():
            compressed = compressed.clone()
        reduced = self._wait(self.allreduce_async_(compressed, name, op, prescale_factor, postscale_factor))
        return compression.decompress(reduced, ctx)

    def grouped_allreduce_async_(self, tensors, name: str | None = None, op: ReduceOp = Average,
                                 prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> "WorkGroup":
        """Horovod's grouped allreduce: every tensor of ``tensors`` reduced in place, started
        together (their small requests travel fused); ``name`` is the group's, each tensor's is
        ``name.i``. Returns a :class:`WorkGroup`."""
        tensors = tensor_list(tensors, "grouped_allreduce")
        names = self._group_names("allreduce", name, len(tensors))
        return WorkGroup([self.allreduce_async_(t, n, op, prescale_factor, postscale_factor)
                          for t, n in zip(tensors, names)])

    # -- broadcast --------------------------------------------------------------------------------

    def _check_root(self, root_rank: int, what: str) -> None:
        collectives.check_root(root_rank, self.size, what)

    def broadcast_async_(self, tensor: torch.Tensor, root_rank: int, name: str | None = None) -> Work:
        """Overwrite ``tensor`` on every rank with root_rank's, in place; returns a :class:`Work`."""
        self._check_root(root_rank, "broadcast")
        name = self._name("broadcast", name)
        return self._broadcast_many([(name, tensor)], root_rank, f"broadcast {name!r}")

    def broadcast_async(self, tensor: torch.Tensor, root_rank: int, name: str | None = None) -> Work:
        return self.broadcast_async_(tensor.detach().clone(), root_rank, name)

    def broadcast(self, tensor: torch.Tensor, root_rank: int, name: str | None = None) -> torch.Tensor:
        """A new tensor holding root_rank's ``tensor``."""
        return self._wait(self.broadcast_async(tensor, root_rank, name))

    def _broadcast_many(self, named: list[tuple[str, torch.Tensor]], root_rank: int, what: str) -> Work:
        """One batched push-pull: the root pushes its tensors, the others zeros; all get the sum."""
        keys, pushes, views = [], [], []
        for name, tensor in named:
            if tensor.numel() == 0:
                continue
            key = collectives.service_key("broadcast", name)
            view = self._staging.view(key, tensor, f"{what}: {name!r}")
            keys.append(key)
            views.append(view)
        bits = [collectives.bits_of(v.array) for v in views]
        pushes = collectives.broadcast_pushes(bits, self.rank, root_rank, self._zeros)
        if not keys:
            return Work.finished(None, what)
        hint = "do all ranks hold the same model?"
        handle = self._submit(keys, pushes, bits, False, what, hint)
        result = named[0][1] if len(named) == 1 else None
        return Work(handle, views, lambda: result, what, hint)

    def broadcast_parameters(self, params, root_rank: int) -> None:
        """Overwrite ``params`` (a ``state_dict()``, ``named_parameters()`` or (name, tensor)
        pairs) on every rank with root_rank's, in place; keyed by name."""
        self._check_root(root_rank, "broadcast_parameters")
        named = named_tensors(params, "broadcast_parameters")
        self._wait(self._broadcast_many(named, root_rank, "broadcast_parameters"))

    def broadcast_object(self, obj: Any = None, root_rank: int = 0, name: str | None = None) -> Any:
        """root_rank's ``obj`` on every rank (pickled on the root, unpickled on the others)."""
        self._check_root(root_rank, "broadcast_object")
        name = name or "broadcast_object"
        return collectives.broadcast_object(self.round(f"broadcast_object {name!r}"), name, obj, self.rank, root_rank)

    def broadcast_optimizer_state(self, optimizer: torch.optim.Optimizer, root_rank: int) -> None:
        """Give every rank root_rank's optimizer state and hyperparameters (its state_dict)."""
        state = self.broadcast_object(optimizer.state_dict() if self.rank == root_rank else None, root_rank,
                                      name="optimizer_state")
        if self.rank != root_rank:
            optimizer.load_state_dict(state)

    def round(self, what: str) -> collectives.PushPull:
        """One synchronous push-pull round for the shared collectives, its errors naming ``what``."""
        hint = "do all ranks make the same calls?"

        def pushpull(key: str, array: np.ndarray, out: np.ndarray) -> np.ndarray:
            return self._wait(Work(self._submit([key], [array], [out], False, what, hint), [], lambda: out, what, hint))

        return pushpull

    def _submit(self, keys: list, arrays: list, outs: list, average: bool, what: str, hint: str):
        """Push-pull ``keys``; an error found before sending (a shape the service already knows
        otherwise) is reworded for ``what``, as errors found later are by :class:`Work`."""
        try:
            if len(keys) == 1:
                return self.agent.pushpull(keys[0], arrays[0], out=outs[0], average=average)
            return self.agent.pushpull_many(keys, arrays, outs=outs, average=average)
        except PslinkError as exc:
            raise explain_mismatch(exc, what, hint) from None

    # -- allgather --------------------------------------------------------------------------------

    def allgather(self, tensor: torch.Tensor, name: str | None = None) -> torch.Tensor:
        """Every rank's ``tensor`` concatenated along the first dimension, in rank order (ranks may
        contribute different numbers of rows; the other dimensions must agree)."""
        name = self._name("allgather", name)
        source = tensor.detach().reshape(1) if tensor.dim() == 0 else tensor.detach()
        wire = wire_dtype(source.dtype, f"allgather {name!r}")
        host = source.to(device="cpu", dtype=wire).contiguous().numpy()
        gathered, _ = collectives.gather_rows(self.round(f"allgather {name!r}"), name, host, self.rank, self.size,
                                              self.capacity)
        return torch.from_numpy(gathered).to(device=tensor.device, dtype=tensor.dtype)

    def allgather_async(self, tensor: torch.Tensor, name: str | None = None) -> Work:
        """:meth:`allgather`, as Horovod's ``allgather_async`` (the rows are gathered now: a
        gather is rounds of the service's own; ``synchronize`` returns them)."""
        gathered = self.allgather(tensor, name)
        return Work.finished(gathered, f"allgather {name!r}")

    def grouped_allgather_async(self, tensors, name: str | None = None) -> "WorkGroup":
        tensors = tensor_list(tensors, "grouped_allgather")
        names = self._group_names("allgather", name, len(tensors))
        return WorkGroup([self.allgather_async(t, n) for t, n in zip(tensors, names)])

    def sparse_allreduce(self, tensor: torch.Tensor, name: str | None = None, op: ReduceOp = Average) -> torch.Tensor:
        """Horovod's sparse allreduce: every rank's indices and values of the sparse ``tensor``
        gathered (never densified), the values averaged for ``op=Average``; a sparse tensor
        whose duplicate indices sum on use (``coalesce()``)."""
        if not tensor.is_sparse:
            raise ConfigError(f"sparse_allreduce takes a sparse tensor, got a {tensor.layout} one")
        if op not in (Average, Sum):
            raise ConfigError(f"sparse_allreduce takes op=Average or Sum, got {op!r}")
        name = self._name("sparse_allreduce", name)
        mine = tensor.coalesce()
        indices = self.allgather(mine.indices().t().contiguous(), f"{name}.indices")
        values = self.allgather(mine.values(), f"{name}.values")
        if op is Average:
            values = values / self.size
        return torch.sparse_coo_tensor(indices.t(), values, tensor.shape)

    def reducescatter(self, tensor: torch.Tensor, name: str | None = None, op: ReduceOp = Average,
                      prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> torch.Tensor:
        """Horovod's reducescatter: ``tensor`` (the same shape on every rank) reduced over the
        ranks, this rank's share of its first dimension returned (the first ``rows % size``
        ranks get one row more, as Horovod splits). The sum is made on the service; each rank
        takes its rows of it."""
        return self.grouped_reducescatter([tensor], name, op, prescale_factor, postscale_factor,
                                          grouped=False)[0]

    def grouped_reducescatter(self, tensors, name: str | None = None, op: ReduceOp = Average,
                              prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                              grouped: bool = True) -> list:
        """:meth:`reducescatter` of each of ``tensors``, started together (``name.i`` each)."""
        what = "grouped_reducescatter" if grouped else "reducescatter"
        tensors = tensor_list(tensors, what) if grouped else tensors
        if op not in (Average, Sum):
            raise ConfigError(f"{what} takes op=Average or Sum, got {op!r}")
        if any(t.dim() == 0 for t in tensors):
            raise ConfigError(f"{what} needs tensors of at least one dimension (their rows are scattered)")
        names = self._group_names("reducescatter", name, len(tensors)) if grouped else [name]
        names = [self._name("reducescatter", n) for n in names]
        works = [self.allreduce_async(t.detach(), f"reducescatter.{n}", op, prescale_factor, postscale_factor)
                 for t, n in zip(tensors, names)]
        return [self._wait(work).narrow(0, *collectives.scatter_share(t.shape[0], self.size, self.rank)).clone()
                for work, t in zip(works, tensors)]

    def alltoall(self, tensor: torch.Tensor, splits=None, name: str | None = None):
        """Horovod's alltoall: rank i gets ``splits[i]`` rows of every rank's ``tensor`` (equal
        shares of the first dimension when ``splits`` is None), concatenated in rank order.
        Returns the tensor, and with ``splits`` given also how many rows came from each rank."""
        if tensor.dim() == 0:
            raise ConfigError("alltoall needs a tensor of at least one dimension (its rows are sent)")
        name = self._name("alltoall", name)
        given = splits is not None
        splits = collectives.alltoall_splits(name, tensor.shape[0], self.size,
                                             splits.tolist() if isinstance(splits, torch.Tensor) else splits)
        everything = self.allgather(tensor, f"alltoall.{name}.rows")
        table = self.allgather(torch.tensor([splits], dtype=torch.int64), f"alltoall.{name}.splits").tolist()
        pieces = [everything.narrow(0, start, rows) for start, rows in collectives.alltoall_pieces(table, self.rank)]
        received = torch.cat(pieces) if pieces else tensor.new_empty((0, *tensor.shape[1:]))
        if given:
            return received, torch.tensor([sent[self.rank] for sent in table], dtype=torch.int32)
        return received

    def allgather_object(self, obj: Any, name: str | None = None) -> list:
        """Every rank's ``obj``, as a list in rank order."""
        name = self._name("allgather", name)
        return collectives.allgather_object(self.round(f"allgather {name!r}"), name, obj, self.rank, self.size,
                                            self.capacity)

    # -- join and barrier -------------------------------------------------------------------------

    def join_round_async(self, optimizer_index: int | None) -> Work:
        """This rank's part of one join round: a vector of who has joined (a 1 in the slots of
        joined ranks) plus, in the last slot, ``optimizer_index + 1`` from every rank that is
        stepping that optimizer (so a joined rank learns which gradients to mirror). The vector
        has a slot per possible rank (the job's capacity): its shape survives a change of size."""
        vector = collectives.join_vector(self.capacity, self.rank, optimizer_index)
        handle = self._submit([JOIN_KEY], [vector], [vector], False, "join", "do all ranks make the same calls?")

        def finish():
            self._joined_seen = vector[: self.size].copy()
            return vector

        return Work(handle, [], finish, "join", "")

    def join(self) -> int:
        """Declare that this rank ran out of data, and block until every rank did.

        Until then this rank mirrors the others' ``DistributedOptimizer`` steps, pushing zero
        gradients (averages are still over all ranks, as in Horovod); its own weights are not
        stepped. Returns the rank that joined last (the highest, if several joined together).
        Other collectives the remaining ranks call in the meantime are not mirrored.
        """
        def mirror(index: int) -> None:
            if not 0 <= index < len(self.optimizers):
                raise ConfigError(
                    f"join: the other ranks stepped optimizer #{index}, but rank {self.rank} has "
                    f"{len(self.optimizers)} DistributedOptimizer(s): every rank must create the same ones"
                )
            self.optimizers[index]._pslink.contribute_zeros()

        last, self._joined_seen = collectives.join(lambda: self._wait(self.join_round_async(None)), self.size,
                                                   self.rank, self._joined_seen, mirror)
        return last

    def barrier(self, name: str = "barrier") -> None:
        self.agent.barrier(f"torch/{name}", timeout=self.timeout)


class WorkGroup:
    """Operations started together (Horovod's ``grouped_*``): ``wait()`` gives their results, a
    list in the order of the tensors given."""

    __slots__ = ("works",)

    def __init__(self, works: list[Work]):
        self.works = works

    def done(self) -> bool:
        return all(work.done() for work in self.works)

    def wait(self, timeout: float | None = None) -> list:
        return [work.wait(timeout) for work in self.works]

    def __repr__(self) -> str:
        return f"<pslink.torch.WorkGroup of {len(self.works)}>"


def tensor_list(tensors, what: str) -> list[torch.Tensor]:
    if not isinstance(tensors, (list, tuple)) or not tensors or \
            not all(isinstance(t, torch.Tensor) for t in tensors):
        raise ConfigError(f"{what} takes a non-empty list of tensors, got {type(tensors).__name__}")
    return list(tensors)


def _scale(tensor: torch.Tensor, factor: float) -> None:
    """``tensor *= factor`` in place; an integer tensor keeps its dtype, the product truncated
    toward zero (as Horovod scales integer buffers)."""
    if tensor.is_floating_point() or tensor.is_complex():
        tensor.mul_(factor)
    else:
        tensor.copy_((tensor.double() * factor).to(tensor.dtype))


class _Done:
    """A handle for an operation that had nothing to send."""

    @staticmethod
    def done() -> bool:
        return True

    @staticmethod
    def wait(timeout=None):
        return None


def named_tensors(params, what: str) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs from a state_dict, named_parameters() or a list of tensors (those
    are named by position, the only thing that identifies them)."""
    items = params.items() if isinstance(params, dict) else list(params)
    named = []
    for i, item in enumerate(items):
        name, tensor = item if isinstance(item, tuple) else (f"{what}.noname.{i}", item)
        if not isinstance(tensor, torch.Tensor):
            raise ConfigError(f"{what}: entry {name!r} is a {type(tensor).__name__}, not a tensor")
        named.append((str(name), tensor))
    names = [n for n, _ in named]
    if len(set(names)) != len(names):
        duplicates = sorted({n for n in names if names.count(n) > 1})
        raise ConfigError(f"{what}: names must be unique, these repeat: {duplicates}")
    return named


