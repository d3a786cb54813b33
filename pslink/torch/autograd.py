"""Differentiable collectives, as Horovod's ``allreduce``, ``allgather`` and ``broadcast`` are.

A result computed from a tensor that requires grad carries a ``grad_fn`` whose backward is the
collective Horovod uses: an allreduce's gradient is the allreduce (same op and scale factors) of
the incoming gradients; an allgather's is this rank's rows of their average; a broadcast's is
their average on the root rank and zeros elsewhere. Backward calls are unnamed: every rank runs
its backward in the same order, so the n-th unnamed call is the same operation on each (as in
Horovod).
"""

from __future__ import annotations

from typing import Any

import torch

from pslink.core.worker.collectives import ELEMENTWISE, Average
from pslink.errors import ConfigError


class _Allreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, session, name, op, compression, prescale, postscale):
        ctx.session, ctx.op, ctx.scale = session, op, (prescale, postscale)
        return session.allreduce(tensor, name, op, compression, prescale, postscale)

    @staticmethod
    def backward(ctx, grad):
        if ctx.op in ELEMENTWISE:
            raise ConfigError(f"allreduce with op={ctx.op.name.title()} has no gradient here; use Average or Sum")
        reduced = ctx.session.allreduce(grad.contiguous(), None, ctx.op, prescale_factor=ctx.scale[0],
                                        postscale_factor=ctx.scale[1])
        return reduced, None, None, None, None, None, None


class _Allgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, session, name):
        ctx.session, ctx.rows = session, tensor.shape[0] if tensor.dim() else 1
        return session.allgather(tensor, name)

    @staticmethod
    def backward(ctx, grad):
        session = ctx.session
        reduced = session.allreduce(grad.contiguous(), None, Average)
        rows = session.allgather(torch.tensor([ctx.rows]))
        offset = int(rows[: session.rank].sum()) if session.rank else 0
        return reduced.narrow(0, offset, ctx.rows), None, None


class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, session, root_rank, name):
        ctx.session, ctx.root = session, root_rank
        return session.broadcast(tensor, root_rank, name)

    @staticmethod
    def backward(ctx, grad):
        reduced = ctx.session.allreduce(grad.contiguous(), None, Average)
        if ctx.session.rank != ctx.root:
            reduced.zero_()
        return reduced, None, None, None


def allreduce(session, tensor: torch.Tensor, name: str | None, op, compression, prescale: float,
              postscale: float) -> torch.Tensor:
    if tensor.requires_grad and torch.is_grad_enabled():
        return _Allreduce.apply(tensor, session, name, op, compression, prescale, postscale)
    return session.allreduce(tensor, name, op, compression, prescale, postscale)


def allgather(session, tensor: torch.Tensor, name: str | None) -> torch.Tensor:
    if tensor.requires_grad and torch.is_grad_enabled():
        return _Allgather.apply(tensor, session, name)
    return session.allgather(tensor, name)


def broadcast(session, tensor: torch.Tensor, root_rank: int, name: str | None) -> Any:
    if tensor.requires_grad and torch.is_grad_enabled():
        return _Broadcast.apply(tensor, session, root_rank, name)
    return session.broadcast(tensor, root_rank, name)
