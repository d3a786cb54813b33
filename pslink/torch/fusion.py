"""Tensor fusion for ``DistributedOptimizer``: small gradients averaged together, one key a bucket.

A model with hundreds of small parameters (biases, norms) would make as many requests per step,
and each costs the worker, the wire and the shared Aggregators a fixed price whatever its size.
Horovod copies such tensors into a fusion buffer and reduces the buffer; DDP does the same with
its buckets. Here the buckets are fixed when the optimizer is made, the same on every rank: the
parameters in reverse order (the order backward produces their gradients), a bucket closed when
the next one would take it past the fusion threshold (``PSLINK_FUSION_BYTES``, the Agent's,
16 MiB by default) or has another dtype or device, or once it holds a third of the model (but
at least ``pslink.core.worker.buckets.LEAST_SHARE``): a bucket is sent once its last gradient is final, so only the last
one's exchange waits after backward, and a model smaller than the threshold in one bucket would
wait for all of it (measured, 500 tensors of 8 MiB in all: 3 buckets a step 1-1.3 ms shorter
than 1). Horovod's ``groups`` (explicit lists of parameters) and ``num_groups`` (that many
equal groups) choose the buckets instead. Each parameter's ``.grad`` is a view of its place in its
bucket (as DDP's ``gradient_as_bucket_view``): backward accumulates into the bucket and the
averages land where the optimizer reads them. ``optimizer.zero_grad()`` zeroes the buckets in
place, with ``set_to_none`` too (the one place this differs from Horovod, whose gradients go to
None): letting backward write fresh gradients and copying each into its bucket cost a copy, an
allocation and a ``.grad`` assignment per gradient, about 1 ms a step for 500 of them (measured;
docs/benchmarks.md). A gradient that is not its bucket place (``.grad`` replaced, say by
``model.zero_grad()``) is copied there once final, and ``.grad`` made the view again after the
exchange. The bucket is push-pulled, under a key named by its parameters' names, once backward
has finished its last gradient.
"""

from __future__ import annotations

import hashlib

import torch

from pslink.core.worker.buckets import bucket_share
from pslink.core.worker.collectives import service_key
from pslink.errors import ConfigError


class Bucket:
    """Some parameters' gradients side by side in one flat tensor."""

    def __init__(self, params: list[torch.Tensor], names: list[str], prefix: str = "grad"):
        self.params, self.names = params, names
        self.index = {id(param): i for i, param in enumerate(params)}  # ids: a tensor's hash is slow
        self.flat = torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device)
        # Each parameter's place in the bucket, shaped like it: the averages are copied out of these.
        self.views = list(torch.split(self.flat, [p.numel() for p in params]))
        self.views = [view.view_as(param) for view, param in zip(self.views, params)]
        digest = hashlib.sha1("\n".join(names).encode()).hexdigest()[:16]
        self.key = service_key(prefix, f"fused.{len(names)}.{digest}")
        self._all = frozenset(id(p) for p in params)
        self.waiting = set(self._all)
        self.stale = False  # some .grad is not its bucket place: scatter() points it back

    def describe(self) -> str:
        shown = ", ".join(repr(n) for n in self.names[:4]) + (", ..." if len(self.names) > 4 else "")
        return (f"the gradient of parameters {shown} fused ({len(self.names)} parameters, key {self.key!r}, "
                f"shape ({self.flat.numel()},))")

    def attach(self) -> None:
        """Make each parameter's ``.grad`` its place in the bucket (what it holds is kept), so
        backward accumulates straight into the bucket and the averages land where the optimizer
        reads them: no copy in, no copy out (DDP's ``gradient_as_bucket_view``)."""
        for param, view in zip(self.params, self.views):
            grad = param.grad
            if grad is view:
                continue
            if grad is None:
                view.zero_()
            else:
                view.copy_(grad.to_dense() if grad.is_sparse else grad)
            param.grad = view

    def zero(self) -> None:
        """Zero the gradients, keeping them in the bucket (``optimizer.zero_grad()``)."""
        self.flat.zero_()
        for param, view in zip(self.params, self.views):
            if param.grad is not view:
                param.grad = view

    def fill(self, param: torch.Tensor, grad: torch.Tensor | None) -> bool:
        """``param``'s gradient is final (None: zeros, for one unused or gathered sparse apart);
        True once every parameter's is. A gradient that is not its bucket place (``.grad`` was
        replaced, say by ``model.zero_grad()``) is copied there."""
        ident = id(param)
        view = self.views[self.index[ident]]
        if grad is not view:
            self.stale = True
            if grad is None:
                view.zero_()
            else:
                view.copy_(grad)
        waiting = self.waiting
        waiting.discard(ident)
        return not waiting

    def scatter(self, sparse: set) -> None:
        """The averages are in the bucket: each dense parameter's ``.grad`` is its place there
        (nothing to do when every gradient was: the usual step)."""
        if not self.stale:
            return
        for param, view in zip(self.params, self.views):
            if param not in sparse and param.grad is not view:
                param.grad = view

    def reset(self) -> None:
        self.waiting = set(self._all)
        self.stale = False


def plan(params: list[torch.Tensor], names: dict, threshold: int, groups=None, num_groups: int = 0,
         prefix: str = "grad") -> list[Bucket]:
    """The buckets (of two parameters or more; any other parameter is a key of its own), keyed
    under ``prefix``."""
    if groups is not None:
        if isinstance(groups, int) and not isinstance(groups, bool):
            num_groups, groups = groups, None
        elif not isinstance(groups, (list, tuple)) or not all(isinstance(g, (list, tuple)) for g in groups):
            raise ConfigError("groups must be a number of groups or a list of lists of parameters")
    if isinstance(num_groups, bool) or not isinstance(num_groups, int) or num_groups < 0:
        raise ConfigError(f"num_groups must be an int >= 0, got {num_groups!r}")
    if groups is not None:
        known = set(params)
        chosen: list[list[torch.Tensor]] = []
        seen: set = set()
        for group in groups:
            members = [p for p in group if p in known and p not in seen]
            if len(members) != len(group):
                raise ConfigError("groups name a parameter twice, or one the optimizer does not hold")
            seen.update(members)
            chosen.append(members)
    elif num_groups:
        size = -(-len(params) // num_groups)
        chosen = [params[i : i + size] for i in range(0, len(params), size)]
    elif threshold:
        share = bucket_share(threshold, sum(p.numel() * p.element_size() for p in params))
        chosen, current, nbytes = [], [], 0
        for param in reversed(params):  # backward yields the last layers' gradients first
            size = param.numel() * param.element_size()
            if current and (nbytes + size > threshold or param.dtype != current[0].dtype
                            or param.device != current[0].device):
                chosen.append(current)
                current, nbytes = [], 0
            if size < threshold:
                current.append(param)
                nbytes += size
                if nbytes >= share:
                    chosen.append(current)
                    current, nbytes = [], 0
        if current:
            chosen.append(current)
    else:
        return []
    buckets = []
    for members in chosen:
        if len(members) < 2:
            continue
        if len({(p.dtype, p.device) for p in members}) > 1:
            raise ConfigError(f"a group mixes dtypes or devices ({', '.join(names[p] for p in members[:4])}); "
                              "each group must hold parameters of one dtype on one device")
        buckets.append(Bucket(members, [names[p] for p in members], prefix))
    return buckets
