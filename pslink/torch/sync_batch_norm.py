"""Horovod's ``SyncBatchNorm``: batch normalization with the statistics of the whole job's batch.

In training each rank sums its inputs and their squares per channel and counts its elements;
one all-reduce (differentiable: pslink.torch.autograd) adds them over the ranks, so every rank
normalizes with the mean and variance of all ranks' samples together (ranks may hold batches of
different sizes) and backward carries each rank's share of the gradient through the statistics.
Unlike Horovod's (CUDA kernels only) it runs on CPU tensors too. In evaluation the running
statistics are used, as ``torch.nn.BatchNorm*`` does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.modules.batchnorm import _BatchNorm

from pslink.core.worker.reduction import Sum
from pslink.errors import ConfigError
from pslink.torch import autograd
from pslink.torch.collectives import Compression
from pslink.torch.world import current_session


class SyncBatchNorm(_BatchNorm):
    """``num_features`` channels of inputs shaped ``(N, C, ...)``; the arguments are
    ``torch.nn.BatchNorm2d``'s (``momentum=None``: a cumulative average). ``session``: the ranks
    to synchronize over (default: the process's, as ``pslink.torch.init()`` made it)."""

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1, affine: bool = True,
                 track_running_stats: bool = True, *, session=None):
        super().__init__(num_features, eps, momentum, affine, track_running_stats)
        self._pslink_session = session  # None: the process's (pslink.torch.init())

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ConfigError(f"SyncBatchNorm expected at least 2D input (N, C, ...), got {input.dim()}D input")
        if input.shape[1] != self.num_features:
            raise ConfigError(f"SyncBatchNorm of {self.num_features} features got input of shape "
                              f"{tuple(input.shape)}: its dimension 1 must be {self.num_features}")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        if self.training and self.track_running_stats:
            self.num_batches_tracked.add_(1)
        if not self.training and self.track_running_stats:
            return F.batch_norm(input, self.running_mean, self.running_var, self.weight, self.bias, False, 0.0,
                                self.eps)
        session = self._pslink_session
        if session is None:
            session = current_session()
        if session.size == 1:
            factor = self._momentum_factor()
            return F.batch_norm(input, self.running_mean, self.running_var, self.weight, self.bias, True, factor,
                                self.eps)
        return self._synchronized(session, input)

    def _momentum_factor(self) -> float:
        if self.momentum is None:  # a cumulative moving average
            return 1.0 / float(self.num_batches_tracked) if self.track_running_stats else 0.0
        return self.momentum

    def _synchronized(self, session, input: torch.Tensor) -> torch.Tensor:
        channels = self.num_features
        dims = [0, *range(2, input.dim())]
        stats_dtype = torch.promote_types(input.dtype, torch.float32)
        x = input.to(stats_dtype)
        count = x.new_full((1,), input.numel() // channels)
        local = torch.cat([x.sum(dims), (x * x).sum(dims), count])
        total = autograd.allreduce(session, local, None, Sum, Compression.none, 1.0, 1.0)
        n = total[2 * channels]
        if float(n.detach()) < 2:
            raise ConfigError(f"SyncBatchNorm: expected more than 1 value per channel when training, got "
                              f"{int(float(n.detach()))} over all ranks (input shape {tuple(input.shape)} on rank "
                              f"{session.rank})")
        mean = total[:channels] / n
        var = (total[channels: 2 * channels] / n - mean * mean).clamp_min(0.0)
        if self.training and self.track_running_stats:
            factor = self._momentum_factor()
            with torch.no_grad():
                unbiased = var * (n / (n - 1))
                self.running_mean.mul_(1.0 - factor).add_(mean.to(self.running_mean.dtype), alpha=factor)
                self.running_var.mul_(1.0 - factor).add_(unbiased.to(self.running_var.dtype), alpha=factor)
        shape = [1, channels] + [1] * (input.dim() - 2)
        out = (x - mean.view(shape)) * torch.rsqrt(var.view(shape) + self.eps)
        if self.affine:
            out = out * self.weight.view(shape) + self.bias.view(shape)
        return out.to(input.dtype)
