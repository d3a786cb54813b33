"""Embeddings whose table lives on the parameter service: :class:`Embedding` and :class:`EmbeddingBag`.

Drop-in for ``torch.nn.Embedding`` / ``EmbeddingBag`` when the table is too big for a worker, or
should be shared by every worker without an all-reduce of its gradient::

    emb = pslink.torch.Embedding(10_000_000, 64, optimizer={"name": "adagrad", "lr": 0.05})

The forward pass pulls only the rows its batch uses (each distinct id once, one message per
shard) into a small leaf tensor and looks the batch up in it; the backward pass pushes that
tensor's gradient (each distinct id once, the batch's repeats already summed by autograd), and
the table's row optimizer steps the rows on the service, averaged over the job's workers. The
next forward waits for that push and reads the updated rows: under BSP (the default) the round
of every worker's push, as a dense model's parameters would be after an all-reduce and a step.
The module has no ``torch.nn.Parameter``: the local optimizer and DDP never see the table, and
its gradient is never densified. Rows are created on first touch from ``init`` (by default
N(0, 1), as ``nn.Embedding``), the same on every worker and every shard.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from pslink.core.agent import Agent
from pslink.errors import ConfigError

_TORCH_TO_WIRE = {torch.float32: "float32", torch.float64: "float64", torch.float16: "float16"}


def _agent_for(agent) -> Agent:
    """The Agent given (an Agent, a DDP hook's state, a Horovod session), else the one this
    process already uses: ``hvd.init()``'s, the ``pslink`` process group's, or ``connect()``'s."""
    if agent is not None:
        found = agent if isinstance(agent, Agent) else getattr(agent, "agent", None)
        if not isinstance(found, Agent):
            raise ConfigError(f"agent must be a pslink Agent, a DDP hook state or a Horovod session, got {agent!r}")
        return found
    from pslink.torch.ddp import _backend_agent, connect
    from pslink.torch.world import holder

    if holder.session is not None:
        return holder.session.agent
    return _backend_agent() or connect().agent


class _ServiceTable(torch.nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int, *, name: str, agent, shards: int, init: Any,
                 seed: int, optimizer: Any, capacity: int | None, evict: str, ttl: float | None, dtype: torch.dtype):
        super().__init__()
        if not isinstance(num_embeddings, int) or num_embeddings <= 0:
            raise ConfigError(f"{type(self).__name__} {name!r}: num_embeddings must be a positive int, "
                              f"got {num_embeddings!r}")
        if dtype not in _TORCH_TO_WIRE:
            raise ConfigError(f"{type(self).__name__} {name!r}: dtype {dtype} is not one of {list(_TORCH_TO_WIRE)}")
        self.num_embeddings, self.embedding_dim, self.dtype = num_embeddings, embedding_dim, dtype
        self.table = _agent_for(agent).table(name, embedding_dim, _TORCH_TO_WIRE[dtype], shards=shards, init=init,
                                             seed=seed, optimizer=optimizer, capacity=capacity, evict=evict, ttl=ttl)
        self._push = None  # the last backward's push: the next forward reads the rows after it

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, table={self.table.name!r} on the service"

    def _rows(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the batch's distinct rows as a leaf tensor, each id's index into them)."""
        flat = ids.detach().reshape(-1).to("cpu", torch.int64).numpy()
        if flat.size and (flat.min() < 0 or flat.max() >= self.num_embeddings):
            bad = int(flat.min() if flat.min() < 0 else flat.max())
            raise IndexError(f"{type(self).__name__} {self.table.name!r}: index {bad} is out of range "
                             f"[0, {self.num_embeddings})")
        unique, inverse = np.unique(flat, return_inverse=True)
        self.wait()
        weight = torch.from_numpy(self.table.pull(unique).wait()).to(ids.device)
        if torch.is_grad_enabled() and self.training:
            weight.requires_grad_(True)
            weight.register_hook(lambda grad: self._pushed(unique, grad))
        return weight, torch.from_numpy(inverse.reshape(ids.shape)).to(ids.device)

    def _pushed(self, unique: np.ndarray, grad: torch.Tensor) -> None:
        self.wait()  # a second backward through one forward pushes a second round after the first
        self._push = self.table.push(unique, grad.detach().to("cpu", self.dtype).contiguous().numpy())

    def wait(self) -> None:
        """Wait until the last backward's push reached the service (the next forward does)."""
        push, self._push = self._push, None
        if push is not None:
            push.wait()


class Embedding(_ServiceTable):
    """``torch.nn.Embedding`` with its table on the service (see the module's docstring).
    ``optimizer`` is the table's row optimizer: "sgd", "adagrad", "adam" (lazy moments) or a
    map with its settings (``{"name": "sgd", "lr": 0.1}``). ``padding_idx`` reads as zeros
    and is never updated, as in torch."""

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx: int | None = None, *,
                 name: str = "embedding", agent=None, shards: int = 4, init: Any = ("normal", 0.0, 1.0), seed: int = 0,
                 optimizer: Any = "sgd", capacity: int | None = None, evict: str = "lru", ttl: float | None = None,
                 dtype: torch.dtype = torch.float32):
        super().__init__(num_embeddings, embedding_dim, name=name, agent=agent, shards=shards, init=list(init)
                         if not isinstance(init, str) else init, seed=seed, optimizer=optimizer, capacity=capacity,
                         evict=evict, ttl=ttl, dtype=dtype)
        if padding_idx is not None and not -num_embeddings <= padding_idx < num_embeddings:
            raise ConfigError(f"Embedding {name!r}: padding_idx {padding_idx} is out of range")
        self.padding_idx = padding_idx % num_embeddings if padding_idx is not None else None

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        weight, index = self._rows(input)
        out = F.embedding(index, weight)
        if self.padding_idx is not None:
            out = out * (input != self.padding_idx).unsqueeze(-1).to(out.dtype)  # zeros, and no gradient
        return out


class EmbeddingBag(_ServiceTable):
    """``torch.nn.EmbeddingBag`` (``mode`` "sum", "mean" or "max", ``offsets``,
    ``per_sample_weights``) with its table on the service."""

    def __init__(self, num_embeddings: int, embedding_dim: int, mode: str = "mean", *, name: str = "embedding_bag",
                 agent=None, shards: int = 4, init: Any = ("normal", 0.0, 1.0), seed: int = 0, optimizer: Any = "sgd",
                 capacity: int | None = None, evict: str = "lru", ttl: float | None = None,
                 include_last_offset: bool = False, dtype: torch.dtype = torch.float32):
        if mode not in ("sum", "mean", "max"):
            raise ConfigError(f"EmbeddingBag {name!r}: mode {mode!r} must be sum, mean or max")
        super().__init__(num_embeddings, embedding_dim, name=name, agent=agent, shards=shards, init=list(init)
                         if not isinstance(init, str) else init, seed=seed, optimizer=optimizer, capacity=capacity,
                         evict=evict, ttl=ttl, dtype=dtype)
        self.mode, self.include_last_offset = mode, include_last_offset

    def forward(self, input: torch.Tensor, offsets: torch.Tensor | None = None,
                per_sample_weights: torch.Tensor | None = None) -> torch.Tensor:
        weight, index = self._rows(input)
        return F.embedding_bag(index, weight, offsets, mode=self.mode, per_sample_weights=per_sample_weights,
                               include_last_offset=self.include_last_offset)
