"""Horovod's collectives on torch tensors: tensors to host arrays, a Session's collective, and
the result back into tensors. Everything Horovod means is the Session's
(:mod:`pslink.core.worker.session`); this module only converts.

A contiguous CPU tensor of a dtype the service carries is handed over as a numpy view of its
own memory (:class:`~pslink.torch.tensors.HostView`): the service's answer lands in the tensor,
with no copy. CUDA, bfloat16, bool and non-contiguous tensors go through a host buffer, copied
back when the operation is synchronized. Each function returns a :class:`Work` (Horovod's
handle: ``poll`` is ``done()``, ``synchronize`` is ``wait()``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from pslink.core.worker.horovod import NoneCompressor
from pslink.core.worker.pending import Pending, PendingGroup
from pslink.core.worker.reduction import Average, ReduceOp, Sum
from pslink.core.worker.session import Session
from pslink.errors import ConfigError
from pslink.torch.tensors import RESULTS, HostView, travels_as_is, wire_dtype


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

    none = NoneCompressor
    fp16 = _FP16Compressor


class Work:
    """An operation in flight (what the ``*_async`` functions return): ``wait()`` gives its
    result (Horovod's ``synchronize``), ``done()`` says whether ``wait()`` would return at once
    (``poll``). Calling it waits too (Horovod's sparse allreduce handle is a function)."""

    __slots__ = ("_pending", "_finish", "_result", "_finished")

    def __init__(self, pending: Pending | PendingGroup, finish: Callable[[Any], Any]):
        self._pending = pending
        self._finish = finish
        self._result = None
        self._finished = False

    def done(self) -> bool:
        return self._finished or self._pending.done()

    def wait(self, timeout: float | None = None) -> Any:
        if not self._finished:
            self._result = self._finish(self._pending.wait(timeout))
            self._finished = True
        return self._result

    __call__ = wait

    @classmethod
    def finished(cls, result: Any, what: str) -> "Work":
        return cls(Pending.finished(what, result), lambda value: value)

    def __repr__(self) -> str:
        return f"<pslink.torch.Work {self._pending.what} {'done' if self.done() else 'in flight'}>"


def tensor_list(tensors, what: str) -> list[torch.Tensor]:
    if not isinstance(tensors, (list, tuple)) or not tensors or not all(isinstance(t, torch.Tensor) for t in tensors):
        raise ConfigError(f"{what} takes a non-empty list of tensors, got {type(tensors).__name__}")
    return list(tensors)


def _tensor(tensor, what: str) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor):
        raise ConfigError(f"{what} takes a torch.Tensor, got {type(tensor).__name__}")
    return tensor


def _host(array: np.ndarray, like: torch.Tensor) -> torch.Tensor:
    """A host array the session made, as a tensor of ``like``'s dtype and device (no copy for a
    CPU tensor of a wire dtype)."""
    return torch.from_numpy(array).to(device=like.device, dtype=like.dtype)


# -- allreduce ----------------------------------------------------------------------------------------

def allreduce_async_(session: Session, tensor: torch.Tensor, name: str | None = None, op: ReduceOp = Average,
                     prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> Work:
    """``tensor`` reduced over the ranks, in place; the Work's result is ``tensor``."""
    tensor = _tensor(tensor, "allreduce")
    view = HostView(tensor.detach(), "allreduce")
    pending = session.allreduce(view.array, view.array, name, op, prescale_factor, postscale_factor)
    return Work(pending, lambda _: _finished(view, tensor))


def _finished(view: HostView, tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` holding the result its view received."""
    view.finish()
    return tensor


def allreduce_async(session: Session, tensor: torch.Tensor, name: str | None = None, op: ReduceOp = Average,
                    prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> Work:
    """``tensor`` reduced over the ranks into a new tensor (``tensor`` is left as it is)."""
    tensor = _tensor(tensor, "allreduce")
    source = HostView(tensor.detach(), "allreduce")
    result = RESULTS.empty_like(tensor)
    out = HostView(result, "allreduce", fill=False)
    pending = session.allreduce(source.array, out.array, name, op, prescale_factor, postscale_factor)
    return Work(pending, lambda _: out.finish())


def allreduce(session: Session, tensor: torch.Tensor, name: str | None = None, op: ReduceOp = Average,
              compression=Compression.none, prescale_factor: float = 1.0, postscale_factor: float = 1.0):
    """A new tensor: ``tensor`` reduced over the ranks (``compression`` on the wire)."""
    if compression is NoneCompressor and tensor.__class__ is torch.Tensor and not tensor.requires_grad \
            and travels_as_is(tensor):
        # The common case, a plain CPU tensor waited for at once: the session reads from the
        # tensor's memory and writes into the result's (the general path below does the same
        # through views and a Work, which a small tensor's latency notices). The result's memory
        # is one a dropped result left, when there is one: fresh pages cost more than the copy.
        result = RESULTS.empty_like(tensor)
        session.allreduce(tensor.numpy(), result.numpy(), name, op, prescale_factor,
                          postscale_factor).wait(session.timeout)
        return result
    compressed, ctx = compression.compress(tensor.detach())
    reduced = allreduce_async(session, compressed, name, op, prescale_factor, postscale_factor).wait(session.timeout)
    return compression.decompress(reduced, ctx)


def grouped_allreduce_async_(session: Session, tensors, name: str | None = None, op: ReduceOp = Average,
                             prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> Work:
    """Each of ``tensors`` reduced in place, started together; ``name.i`` each."""
    tensors = tensor_list(tensors, "grouped_allreduce")
    views = [HostView(t.detach(), "grouped_allreduce") for t in tensors]
    arrays = [v.array for v in views]
    pending = session.grouped_allreduce(arrays, arrays, name, op, prescale_factor, postscale_factor)
    return Work(pending, lambda _: [_finished(v, t) for v, t in zip(views, tensors)])


def grouped_allreduce_async(session: Session, tensors, name: str | None = None, op: ReduceOp = Average,
                            prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> Work:
    """Each of ``tensors`` reduced into a new tensor, started together."""
    tensors = tensor_list(tensors, "grouped_allreduce")
    sources = [HostView(t.detach(), "grouped_allreduce") for t in tensors]
    results = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in tensors]
    outs = [HostView(r, "grouped_allreduce", fill=False) for r in results]
    pending = session.grouped_allreduce([s.array for s in sources], [o.array for o in outs], name, op,
                                        prescale_factor, postscale_factor)
    return Work(pending, lambda _: [o.finish() for o in outs])


# -- broadcast -----------------------------------------------------------------------------------------

def broadcast_async_(session: Session, tensor: torch.Tensor, root_rank: int, name: str | None = None) -> Work:
    """Overwrite ``tensor`` with ``root_rank``'s, in place."""
    tensor = _tensor(tensor, "broadcast")
    view = HostView(tensor.detach(), "broadcast")
    pending = session.broadcast(view.array, root_rank, view.array, name)
    return Work(pending, lambda _: _finished(view, tensor))


def broadcast_async(session: Session, tensor: torch.Tensor, root_rank: int, name: str | None = None) -> Work:
    """``root_rank``'s ``tensor`` in a new tensor."""
    tensor = _tensor(tensor, "broadcast")
    result = tensor.detach().clone(memory_format=torch.contiguous_format)
    return broadcast_async_(session, result, root_rank, name)


def broadcast_parameters(session: Session, params, root_rank: int, what: str = "broadcast_parameters") -> None:
    """Overwrite ``params`` (a state_dict, named_parameters() or (name, tensor) pairs) with
    ``root_rank``'s, in place, in one request keyed by name."""
    named = named_tensors(params, what)
    views = [(name, HostView(t.detach(), f"{what}: {name!r}")) for name, t in named]
    session.broadcast_many([(n, v.array, v.array) for n, v in views], root_rank, what, what).wait(session.timeout)
    for _, view in views:
        view.finish()


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


# -- allgather, reducescatter, alltoall --------------------------------------------------------------

def allgather_async(session: Session, tensor: torch.Tensor, name: str | None = None) -> Work:
    """Every rank's ``tensor`` concatenated along the first dimension, in rank order."""
    tensor = _tensor(tensor, "allgather")
    source = tensor.detach().reshape(1) if tensor.dim() == 0 else tensor.detach()
    view = HostView(source, "allgather")
    pending = session.allgather(view.array, name)
    return Work(pending, lambda result: _host(result[0], tensor))


def grouped_allgather_async(session: Session, tensors, name: str | None = None) -> Work:
    tensors = tensor_list(tensors, "grouped_allgather")
    views = [HostView(t.detach().reshape(1) if t.dim() == 0 else t.detach(), "grouped_allgather") for t in tensors]
    pending = session.grouped_allgather([v.array for v in views], name)
    return Work(pending, lambda results: [_host(r[0], t) for r, t in zip(results, tensors)])


def reducescatter_async(session: Session, tensor: torch.Tensor, name: str | None = None, op: ReduceOp = Average,
                        prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> Work:
    """``tensor`` reduced over the ranks; this rank's share of its first dimension."""
    tensor = _tensor(tensor, "reducescatter")
    view = HostView(tensor.detach(), "reducescatter")
    pending = session.reducescatter(view.array, name, op, prescale_factor, postscale_factor)
    return Work(pending, lambda share: _host(share, tensor))


def grouped_reducescatter_async(session: Session, tensors, name: str | None = None, op: ReduceOp = Average,
                                prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> Work:
    tensors = tensor_list(tensors, "grouped_reducescatter")
    views = [HostView(t.detach(), "grouped_reducescatter") for t in tensors]
    pending = session.grouped_reducescatter([v.array for v in views], name, op, prescale_factor, postscale_factor)
    return Work(pending, lambda shares: [_host(s, t) for s, t in zip(shares, tensors)])


def alltoall_async(session: Session, tensor: torch.Tensor, splits=None, name: str | None = None) -> Work:
    """Rank i gets ``splits[i]`` rows of every rank's ``tensor``; the Work's result is (the
    rows received, how many came from each rank)."""
    tensor = _tensor(tensor, "alltoall")
    if isinstance(splits, torch.Tensor):
        if splits.dtype.is_floating_point:
            raise ConfigError(f"alltoall: splits must be integers, got a {splits.dtype} tensor")
        splits = splits.tolist()
    view = HostView(tensor.detach(), "alltoall")
    pending = session.alltoall(view.array, splits, name)
    return Work(pending, lambda result: (_host(result[0], tensor), torch.from_numpy(result[1])))


def sparse_allreduce_async(session: Session, tensor: torch.Tensor, name: str | None = None,
                           op: ReduceOp = Average) -> Work:
    """Horovod's sparse allreduce: every rank's indices and values of the sparse ``tensor``
    gathered (never densified), the values averaged for ``op=Average``: a sparse tensor whose
    duplicate indices sum on use (``coalesce()``)."""
    if not tensor.is_sparse:
        raise ConfigError(f"sparse_allreduce takes a sparse tensor, got a {tensor.layout} one")
    if op not in (Average, Sum):
        raise ConfigError(f"sparse_allreduce takes op=Average or Sum, got {op!r}")
    name = session.name("sparse_allreduce", name)
    mine = tensor.coalesce()
    indices = allgather_async(session, mine.indices().t().contiguous(), f"{name}.indices")
    values = allgather_async(session, mine.values(), f"{name}.values")
    group = PendingGroup([indices._pending, values._pending], f"sparse_allreduce {name!r}")
    size = session.size

    def finish(_):
        gathered_values = values.wait()
        if op is Average:
            gathered_values = gathered_values / size
        return torch.sparse_coo_tensor(indices.wait().t(), gathered_values, tensor.shape)

    return Work(group, finish)


# -- objects -----------------------------------------------------------------------------------------

def broadcast_optimizer_state(session: Session, optimizer: torch.optim.Optimizer, root_rank: int) -> None:
    """Give every rank ``root_rank``'s optimizer state and hyperparameters (its state_dict).

    An optimizer that has not stepped yet has no state to give: as Horovod does, every rank
    first makes it, with zero gradients for the parameters that require one and one step of the
    wrapped optimizer itself (not the distributed one, whose step would reduce)."""
    if not optimizer.state_dict()["state"]:
        for group in optimizer.param_groups:
            for param in group["params"]:
                if param.requires_grad:
                    param.grad = torch.zeros_like(param)
        own_step = getattr(optimizer, "_pslink_base_step", None)
        own_step() if own_step is not None else optimizer.step()
    state = session.broadcast_object(optimizer.state_dict() if session.rank == root_rank else None, root_rank,
                                     name="optimizer_state")
    if session.rank != root_rank:
        optimizer.load_state_dict(state)


def cast_check(tensor: torch.Tensor, what: str) -> None:
    """ConfigError naming ``what`` for a dtype pslink cannot carry (checked before anything is sent)."""
    wire_dtype(tensor.dtype, what)
