"""``DistributedOptimizer``: push-pull each gradient by parameter name as soon as backward has
produced it, and let ``step()`` wait for the averages before the wrapped optimizer steps."""

from __future__ import annotations

import contextlib
import warnings

import torch

from pslink.core.collectives import service_key
from pslink.errors import ConfigError, PslinkError
from pslink.torch.session import Average, Compression, ReduceOp, Session, Work, reduce_op
from pslink.torch.tensors import StagingPool, explain_mismatch

_HINT = "do all ranks build the same model?"


class _GradientSync:
    """The per-optimizer machinery, kept apart from the optimizer's own attributes."""

    def __init__(self, optimizer: torch.optim.Optimizer, session: Session, named_parameters, compression,
                 backward_passes_per_step: int, op: ReduceOp, gradient_predivide_factor: float,
                 sparse_as_dense: bool = False):
        if isinstance(backward_passes_per_step, bool) or not isinstance(backward_passes_per_step, int) \
                or backward_passes_per_step < 1:
            raise ConfigError(f"backward_passes_per_step must be an int >= 1, got {backward_passes_per_step!r}")
        if gradient_predivide_factor != 1.0 and op is not Average:
            raise ConfigError("gradient_predivide_factor needs op=Average")
        if not gradient_predivide_factor > 0:
            raise ConfigError(f"gradient_predivide_factor must be > 0, got {gradient_predivide_factor!r}")
        self.session = session
        self.compression = compression
        self.passes = backward_passes_per_step
        self.average = op is Average
        self.predivide = float(gradient_predivide_factor)
        self.names = _parameter_names(optimizer, named_parameters)
        self.params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
        self.delay = {p: self.passes for p in self.params}
        self.works: dict[torch.Tensor, tuple[Work, torch.Tensor]] = {}
        self.sparse_as_dense = sparse_as_dense
        self.sparse: set[torch.Tensor] = set()  # params whose sparse gradient is gathered at synchronize()
        self.staging = StagingPool()
        self.skip = False
        self.synchronized = False
        self.index = len(session.optimizers)
        session.optimizers.append(optimizer)
        self.hooks = [p.register_post_accumulate_grad_hook(self._on_gradient) for p in self.params]

    def _on_gradient(self, param: torch.Tensor) -> None:
        """On the autograd thread, once ``param.grad`` holds this backward pass's gradient."""
        if param not in self.delay:
            return
        left = self.delay[param] - 1
        if left < 0:
            raise RuntimeError(
                f"the gradient of {self.names[param]!r} was computed more than backward_passes_per_step="
                f"{self.passes} times before step(); raise backward_passes_per_step or call step() "
                "(or synchronize()) after each backward"
            )
        self.delay[param] = left
        if left == 0:
            if param.grad.is_sparse and not self.sparse_as_dense:
                self.sparse.add(param)  # gathered in synchronize(), in parameter order on every rank
            else:
                self.works[param] = self.push(param, param.grad)

    def push(self, param: torch.Tensor, grad: torch.Tensor) -> tuple[Work, torch.Tensor]:
        """Start averaging ``grad`` (param's gradient, or zeros while joined) over the ranks."""
        name = self.names[param]
        key = service_key("grad", name)
        what = f"the gradient of parameter {name!r} (key {key!r}, shape {tuple(grad.shape)})"
        if grad.is_sparse:
            grad = grad.to_dense()
            param.grad = grad
        grad = grad.detach()
        if self.predivide != 1.0:
            grad.mul_(1.0 / self.predivide)
        compressed, ctx = self.compression.compress(grad)
        view = self.staging.view(key, compressed, what)
        try:
            handle = self.session.agent.pushpull(key, view.array, out=view.array, average=self.average)
        except PslinkError as exc:
            raise explain_mismatch(exc, what, _HINT) from None
        predivide = self.predivide

        def finish() -> torch.Tensor:
            result = self.compression.decompress(compressed, ctx)
            if result.data_ptr() != grad.data_ptr():
                grad.copy_(result)
            if predivide != 1.0:
                grad.mul_(predivide)
            return grad

        return Work(handle, [view], finish, what, _HINT), grad

    def synchronize(self) -> None:
        """Push what backward did not (unused parameters, fewer passes than configured), then
        wait for every average; ``param.grad`` holds it afterwards."""
        for param in self.params:
            if param not in self.works and param not in self.sparse:
                if param.grad is None:
                    param.grad = torch.zeros_like(param)
                self.works[param] = self.push(param, param.grad)
        join = self.session.join_round_async(self.index)
        try:
            for work, _ in self.works.values():
                work.wait(self.session.timeout)
            join.wait(self.session.timeout)
            for param in [p for p in self.params if p in self.sparse]:
                param.grad = self._gather_sparse(param, param.grad)
        finally:
            self.works.clear()
            self.sparse.clear()
            self.delay = {p: self.passes for p in self.params}
        self.synchronized = True

    def _gather_sparse(self, param: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        """A sparse gradient (an ``nn.Embedding(sparse=True)``'s) over the ranks, as Horovod's
        sparse all-reduce: every rank's indices and values gathered (never densified), the
        values averaged (``op=Average``); the wrapped optimizer (SparseAdam, Adagrad, SGD)
        takes it as it is."""
        name = self.names[param]
        mine = grad.coalesce()
        what = f"sparse gradient of {name!r}"
        try:
            indices = self.session.allgather(mine.indices().t().contiguous(), f"sparse.{name}.indices")
            values = self.session.allgather(mine.values(), f"sparse.{name}.values")
        except PslinkError as exc:
            raise explain_mismatch(exc, what, _HINT) from None
        if self.average:
            values = values / self.session.size
        return torch.sparse_coo_tensor(indices.t(), values, grad.shape)

    def contribute_zeros(self) -> None:
        """While this rank is joined: one step's worth of zero gradients, as the others step."""
        pending = [self.push(param, torch.zeros_like(param))[0] for param in self.params]
        for work in pending:
            work.wait(self.session.timeout)

    def abandon(self) -> None:
        """Forget the gradients in flight (elastic recovery: the round they were in was given
        up, and the state goes back to its last commit); the next backward starts afresh."""
        self.works.clear()
        self.sparse.clear()
        self.delay = {p: self.passes for p in self.params}
        self.synchronized = False

    def remove_hooks(self) -> None:
        for hook in self.hooks:
            hook.remove()
        self.hooks = []


def _parameter_names(optimizer: torch.optim.Optimizer, named_parameters) -> dict:
    """param -> name. Without ``named_parameters`` the names are positions in the param groups
    (as in Horovod): pass ``model.named_parameters()`` to key gradients by name."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if named_parameters is None:
        warnings.warn("DistributedOptimizer without named_parameters keys gradients by their position in the "
                      "optimizer's param groups; pass named_parameters=model.named_parameters() to key them by "
                      "name", stacklevel=4)
        return {p: f"noname.{g}.{i}" for g, group in enumerate(optimizer.param_groups)
                for i, p in enumerate(group["params"])}
    named = list(named_parameters)
    if any(not (isinstance(item, tuple) and len(item) == 2) for item in named):
        raise ConfigError("named_parameters must be (name, parameter) pairs, as model.named_parameters() gives")
    names = {}
    seen: dict[str, int] = {}
    for name, param in named:
        seen[name] = seen.get(name, 0) + 1
        names.setdefault(param, name)
    repeated = sorted(n for n, count in seen.items() if count > 1)
    if repeated:
        raise ConfigError(f"named_parameters has repeated names: {repeated}")
    unnamed = [i for i, p in enumerate(params) if p not in names]
    if unnamed:
        raise ConfigError(
            f"named_parameters is given but {len(unnamed)} of the optimizer's {len(params)} parameters are "
            f"not in it (positions {unnamed[:10]}); pass model.named_parameters() of the model being optimized"
        )
    return {p: names[p] for p in params}


def _distributed_class(base: type) -> type:
    """``base`` (the wrapped optimizer's class) with its gradients averaged over the ranks before
    each step: a subclass, so the result still is, say, an SGD (Horovod's promise)."""

    def __init__(self, params, session: Session, named_parameters, compression, backward_passes_per_step, op,
                 gradient_predivide_factor, sparse_as_dense):
        base.__init__(self, params)
        self._pslink = _GradientSync(self, session, named_parameters, compression, backward_passes_per_step, op,
                                     gradient_predivide_factor, sparse_as_dense)

    def synchronize(self) -> None:
        """Wait until every gradient holds its average over the ranks."""
        self._pslink.synchronize()

    @contextlib.contextmanager
    def skip_synchronize(self):
        """``step()`` inside skips synchronizing (after an explicit ``synchronize()``)."""
        self._pslink.skip = True
        try:
            yield
        finally:
            self._pslink.skip = False

    def step(self, closure=None):
        sync = self._pslink
        if not sync.skip and not (sync.synchronized and not sync.works):
            sync.synchronize()
        sync.synchronized = False
        return base.step(self, closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._pslink.works:
            raise RuntimeError(
                "optimizer.zero_grad() was called after loss.backward() but before optimizer.step() or "
                "optimizer.synchronize(): the gradients are still being averaged"
            )
        base.zero_grad(self, set_to_none)

    return type(base.__name__, (base,), {"__init__": __init__, "synchronize": synchronize,
                                         "skip_synchronize": skip_synchronize, "step": step, "zero_grad": zero_grad,
                                         "__module__": base.__module__, "__qualname__": base.__qualname__})


def DistributedOptimizer(optimizer: torch.optim.Optimizer, named_parameters=None, compression=Compression.none,
                         backward_passes_per_step: int = 1, op: ReduceOp = Average,
                         gradient_predivide_factor: float = 1.0, num_groups: int = 0, groups=None,
                         sparse_as_dense: bool = False, *, session: Session | None = None) -> torch.optim.Optimizer:
    """Wrap ``optimizer`` so that gradients are averaged (``op=Average``) or summed over the ranks.

    Each gradient is push-pulled under its parameter's name as soon as backward produced it;
    ``step()`` waits for them, then steps. ``backward_passes_per_step`` accumulates that many
    backward passes locally first. A sparse gradient (``nn.Embedding(sparse=True)``) is gathered
    from every rank at ``step()`` as Horovod's sparse all-reduce does (``sparse_as_dense``: sent
    dense instead). ``num_groups`` and ``groups`` are accepted for Horovod compatibility: every
    gradient is its own key. The result is an instance of a subclass of the optimizer's class.
    """
    if session is None:
        from pslink.torch.horovod import current_session

        session = current_session()
    op = reduce_op(op)
    cls = _distributed_class(optimizer.__class__)
    return cls(optimizer.param_groups, session, named_parameters, compression, backward_passes_per_step, op,
               gradient_predivide_factor, sparse_as_dense)
