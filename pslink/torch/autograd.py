"""Differentiable collectives, as Horovod's are (``horovod/torch/mpi_ops.py``'s autograd Functions).

A result computed from a tensor that requires grad carries a ``grad_fn`` whose backward is the
collective Horovod uses:

- allreduce (grouped too): the allreduce of the incoming gradients, same op and scale factors;
- allgather (grouped too): this rank's rows of the incoming gradients' average;
- broadcast: their average on the root rank, zeros elsewhere;
- alltoall: the alltoall of the gradients back, with the splits this rank received;
- reducescatter (grouped too): the gradients gathered, times the number of ranks for a sum and
  times the scale factors.

Backward calls are unnamed: every rank runs its backward in the same order, so the n-th unnamed
call is the same operation on each (as in Horovod).
"""

from __future__ import annotations

import torch

from pslink.core.worker.reduction import GATHERED, Average, Sum
from pslink.core.worker.session import Session
from pslink.errors import ConfigError
from pslink.torch import collectives


def _needs_grad(tensors) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def _wait(session: Session, work):
    return work.wait(session.timeout)


# -- allreduce ---------------------------------------------------------------------------------------

class _Allreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, session, name, op, compression, prescale, postscale):
        ctx.session, ctx.op, ctx.scale = session, op, (prescale, postscale)
        return collectives.allreduce(session, tensor, name, op, compression, prescale, postscale)

    @staticmethod
    def backward(ctx, grad):
        if ctx.op in GATHERED:
            raise ConfigError(f"allreduce with op={ctx.op.name.title()} has no gradient; use Average or Sum")
        reduced = collectives.allreduce(ctx.session, grad.contiguous(), None, ctx.op, prescale_factor=ctx.scale[0],
                                        postscale_factor=ctx.scale[1])
        return reduced, None, None, None, None, None, None


def allreduce(session: Session, tensor: torch.Tensor, name, op, compression, prescale: float,
              postscale: float) -> torch.Tensor:
    if _needs_grad([tensor]):
        return _Allreduce.apply(tensor, session, name, op, compression, prescale, postscale)
    return collectives.allreduce(session, tensor, name, op, compression, prescale, postscale)


class _GroupedAllreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, session, name, op, prescale, postscale, *tensors):
        ctx.session, ctx.op, ctx.scale = session, op, (prescale, postscale)
        work = collectives.grouped_allreduce_async(session, list(tensors), name, op, prescale, postscale)
        return tuple(_wait(session, work))

    @staticmethod
    def backward(ctx, *grads):
        if ctx.op in GATHERED:
            raise ConfigError(f"grouped_allreduce with op={ctx.op.name.title()} has no gradient; use Average or Sum")
        work = collectives.grouped_allreduce_async(ctx.session, [g.contiguous() for g in grads], None, ctx.op,
                                                   *ctx.scale)
        return (None, None, None, None, None, *_wait(ctx.session, work))


def grouped_allreduce(session: Session, tensors, name, op, prescale: float, postscale: float) -> list:
    tensors = collectives.tensor_list(tensors, "grouped_allreduce")
    if _needs_grad(tensors):
        return list(_GroupedAllreduce.apply(session, name, op, prescale, postscale, *tensors))
    work = collectives.grouped_allreduce_async(session, tensors, name, op, prescale, postscale)
    return _wait(session, work)


# -- allgather ---------------------------------------------------------------------------------------

def _my_rows(session: Session, rows: list[int], grads: list) -> list:
    """This rank's rows of each averaged gradient (``rows``: how many this rank gave each)."""
    counts = _wait(session, collectives.grouped_allgather_async(
        session, [torch.tensor([n], dtype=torch.int64) for n in rows]))
    offsets = [int(c[: session.rank].sum()) for c in counts]
    return [g.narrow(0, offset, n) for g, offset, n in zip(grads, offsets, rows)]


class _Allgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, session, name):
        ctx.session, ctx.rows = session, tensor.shape[0] if tensor.dim() else 1
        return _wait(session, collectives.allgather_async(session, tensor, name))

    @staticmethod
    def backward(ctx, grad):
        reduced = collectives.allreduce(ctx.session, grad.contiguous(), None, Average)
        return _my_rows(ctx.session, [ctx.rows], [reduced])[0], None, None


def allgather(session: Session, tensor: torch.Tensor, name) -> torch.Tensor:
    if _needs_grad([tensor]):
        return _Allgather.apply(tensor, session, name)
    return _wait(session, collectives.allgather_async(session, tensor, name))


class _GroupedAllgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, session, name, *tensors):
        ctx.session, ctx.rows = session, [t.shape[0] if t.dim() else 1 for t in tensors]
        return tuple(_wait(session, collectives.grouped_allgather_async(session, list(tensors), name)))

    @staticmethod
    def backward(ctx, *grads):
        work = collectives.grouped_allreduce_async(ctx.session, [g.contiguous() for g in grads], None, Average)
        return (None, None, *_my_rows(ctx.session, ctx.rows, _wait(ctx.session, work)))


def grouped_allgather(session: Session, tensors, name) -> list:
    tensors = collectives.tensor_list(tensors, "grouped_allgather")
    if _needs_grad(tensors):
        return list(_GroupedAllgather.apply(session, name, *tensors))
    return _wait(session, collectives.grouped_allgather_async(session, tensors, name))


# -- broadcast ---------------------------------------------------------------------------------------

class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, session, root_rank, name):
        # The root as the session's own rank (a process set's root is given as a world rank).
        ctx.session, ctx.root = session, session.check_root(root_rank, "broadcast")
        return _wait(session, collectives.broadcast_async(session, tensor, root_rank, name))

    @staticmethod
    def backward(ctx, grad):
        reduced = collectives.allreduce(ctx.session, grad.contiguous(), None, Average)
        if ctx.session.rank != ctx.root:
            reduced.zero_()
        return reduced, None, None, None


def broadcast(session: Session, tensor: torch.Tensor, root_rank: int, name) -> torch.Tensor:
    if _needs_grad([tensor]):
        return _Broadcast.apply(tensor, session, root_rank, name)
    return _wait(session, collectives.broadcast_async(session, tensor, root_rank, name))


# -- alltoall ----------------------------------------------------------------------------------------

class _Alltoall(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, session, splits, name):
        received, received_splits = _wait(session, collectives.alltoall_async(session, tensor, splits, name))
        ctx.session, ctx.received_splits = session, received_splits
        ctx.mark_non_differentiable(received_splits)
        return received, received_splits

    @staticmethod
    def backward(ctx, grad, _splits_grad):
        back, _ = _wait(ctx.session, collectives.alltoall_async(ctx.session, grad.contiguous(), ctx.received_splits))
        return back, None, None, None


def alltoall(session: Session, tensor: torch.Tensor, splits, name) -> tuple[torch.Tensor, torch.Tensor]:
    if _needs_grad([tensor]):
        return _Alltoall.apply(tensor, session, splits, name)
    return _wait(session, collectives.alltoall_async(session, tensor, splits, name))


# -- reducescatter -----------------------------------------------------------------------------------

def _scatter_grad(session: Session, op, prescale: float, postscale: float, grad: torch.Tensor) -> torch.Tensor:
    if op is Sum:
        grad = grad * session.size
    if prescale != 1.0:
        grad = grad * prescale
    if postscale != 1.0:
        grad = grad * postscale
    return grad.contiguous()


class _Reducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, session, name, op, prescale, postscale):
        ctx.session, ctx.op, ctx.scale = session, op, (prescale, postscale)
        return _wait(session, collectives.reducescatter_async(session, tensor, name, op, prescale, postscale))

    @staticmethod
    def backward(ctx, grad):
        grad = _scatter_grad(ctx.session, ctx.op, *ctx.scale, grad)
        return _wait(ctx.session, collectives.allgather_async(ctx.session, grad)), None, None, None, None, None


def reducescatter(session: Session, tensor: torch.Tensor, name, op, prescale: float, postscale: float):
    if _needs_grad([tensor]):
        return _Reducescatter.apply(tensor, session, name, op, prescale, postscale)
    return _wait(session, collectives.reducescatter_async(session, tensor, name, op, prescale, postscale))


class _GroupedReducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, session, name, op, prescale, postscale, *tensors):
        ctx.session, ctx.op, ctx.scale = session, op, (prescale, postscale)
        work = collectives.grouped_reducescatter_async(session, list(tensors), name, op, prescale, postscale)
        return tuple(_wait(session, work))

    @staticmethod
    def backward(ctx, *grads):
        grads = [_scatter_grad(ctx.session, ctx.op, *ctx.scale, g) for g in grads]
        return (None, None, None, None, None,
                *_wait(ctx.session, collectives.grouped_allgather_async(ctx.session, grads)))


def grouped_reducescatter(session: Session, tensors, name, op, prescale: float, postscale: float) -> list:
    tensors = collectives.tensor_list(tensors, "grouped_reducescatter")
    if _needs_grad(tensors):
        return list(_GroupedReducescatter.apply(session, name, op, prescale, postscale, *tensors))
    work = collectives.grouped_reducescatter_async(session, tensors, name, op, prescale, postscale)
    return _wait(session, work)
