"""``DistributedOptimizer``: push-pull each gradient by parameter name (small ones fused into
buckets: pslink.torch.fusion) as soon as backward has produced it, and let ``step()`` wait for the
averages before the wrapped optimizer steps."""

from __future__ import annotations

import contextlib
import warnings

import torch

from pslink.core.worker.collectives import service_key
from pslink.core.worker.reduction import Average, ReduceOp, Sum, reduce_op
from pslink.core.worker.session import Session
from pslink.errors import ConfigError, PslinkError
from pslink.torch import collectives
from pslink.torch.collectives import Compression
from pslink.torch.fusion import Bucket, plan
from pslink.torch.tensors import HostView, StagingPool, explain_mismatch

_HINT = "do all ranks build the same model?"


class _GradientWork:
    """A gradient's push-pull in flight: ``wait()`` leaves the average in the gradient."""

    __slots__ = ("handle", "view", "finish", "what")

    def __init__(self, handle, view: HostView, finish, what: str):
        self.handle, self.view, self.finish, self.what = handle, view, finish, what

    def wait(self, timeout: float | None = None) -> torch.Tensor:
        try:
            self.handle.wait(timeout)
        except PslinkError as exc:
            raise explain_mismatch(exc, self.what, _HINT) from None
        self.view.finish()
        return self.finish()


class _GradientSync:
    """The per-optimizer machinery, kept apart from the optimizer's own attributes."""

    def __init__(self, optimizer: torch.optim.Optimizer, session: Session, named_parameters, compression,
                 backward_passes_per_step: int, op: ReduceOp, gradient_predivide_factor: float,
                 sparse_as_dense: bool = False, groups=None, num_groups: int = 0):
        if isinstance(backward_passes_per_step, bool) or not isinstance(backward_passes_per_step, int) \
                or backward_passes_per_step < 1:
            raise ConfigError(f"backward_passes_per_step must be an int >= 1, got {backward_passes_per_step!r}")
        if op not in (Average, Sum):
            raise ConfigError(f"DistributedOptimizer reduces gradients with op=Average or Sum, got "
                              f"op={op.name.title()} (Adasum is not offered for gradients)")
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
        # Keyed by id(param): a tensor's __hash__ is a Python call, and the hooks run 2 per parameter a step.
        self._param_ids = [id(p) for p in self.params]
        self.delay = dict.fromkeys(self._param_ids, self.passes)
        self.works: dict[torch.Tensor, tuple[_GradientWork, torch.Tensor]] = {}
        # Two optimizers may hold parameters of the same names (a GAN's two nets): the second and
        # later ones key their gradients apart (their numbers are the same on every rank).
        index = len(session.steppers)
        self.prefix = "grad" if index == 0 else service_key("grad", f"optimizer{index}")
        self.buckets = plan(self.params, self.names, session.agent.fusion_bytes, groups, num_groups, self.prefix)
        self.bucket_of = {id(p): b for b in self.buckets for p in b.params}
        for bucket in self.buckets:
            bucket.attach()
        self.bucket_works: list[tuple[_GradientWork, Bucket]] = []
        self.sparse_as_dense = sparse_as_dense
        self.sparse: set[torch.Tensor] = set()  # params whose sparse gradient is gathered at synchronize()
        # params whose sparse gradient went dense (sparse_as_dense): sparse again for the step, as
        # Horovod gives them back (an optimizer such as SparseAdam takes sparse gradients only)
        self.densified: set[torch.Tensor] = set()
        self.staging = StagingPool()
        self.skip = False
        self.synchronized = False
        self.hooks = [p.register_post_accumulate_grad_hook(self._on_gradient) for p in self.params]
        self.index = session.register_stepper(self.contribute_zeros, self.abandon)
        if self.index != index:
            raise ConfigError("DistributedOptimizers of one session are numbered in the order they are made: make "
                              "them one at a time, in the same order on every rank")

    def _on_gradient(self, param: torch.Tensor) -> None:
        """On the autograd thread, once ``param.grad`` holds this backward pass's gradient."""
        ident = id(param)
        left = self.delay.get(ident)
        if left is None:
            return
        left -= 1
        if left < 0:
            raise RuntimeError(
                f"the gradient of {self.names[param]!r} was computed more than backward_passes_per_step="
                f"{self.passes} times before step(); raise backward_passes_per_step or call step() "
                "(or synchronize()) after each backward"
            )
        self.delay[ident] = left
        if left == 0:
            grad = param.grad  # (read once: each read of .grad is a call into torch)
            bucket = self.bucket_of.get(ident)
            if grad.is_sparse and not self.sparse_as_dense:
                self.sparse.add(param)  # gathered in synchronize(), in parameter order on every rank
                if bucket is not None:
                    self.fill(bucket, param, None)  # zeros in its bucket's place, on every rank alike
            elif bucket is not None:
                if grad.is_sparse:
                    self.densified.add(param)
                    grad = grad.to_dense()
                self.fill(bucket, param, grad)
            else:
                self.works[param] = self.push(param, grad)

    def fill(self, bucket: Bucket, param: torch.Tensor, grad: torch.Tensor | None) -> None:
        """Into ``param``'s bucket, which is push-pulled once it is full."""
        if bucket.fill(param, grad):
            self.bucket_works.append((self.start(bucket.key, bucket.describe(), bucket.flat)[0], bucket))

    def push(self, param: torch.Tensor, grad: torch.Tensor) -> tuple[_GradientWork, torch.Tensor]:
        """Start averaging ``grad`` (param's gradient, or zeros while joined) over the ranks."""
        name = self.names[param]
        key = service_key(self.prefix, name)
        if grad.is_sparse:
            self.densified.add(param)
            grad = grad.to_dense()
            param.grad = grad
        return self.start(key, f"the gradient of parameter {name!r} (key {key!r}, shape {tuple(grad.shape)})", grad)

    def start(self, key: str, what: str, grad: torch.Tensor) -> tuple[_GradientWork, torch.Tensor]:
        """Push-pull ``grad`` under ``key``; the Work leaves the average in ``grad``."""
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

        return _GradientWork(handle, view, finish, what), grad

    def synchronize(self) -> None:
        """Push what backward did not (unused parameters, fewer passes than configured), then
        wait for every average; ``param.grad`` holds it afterwards."""
        for param in self.params:
            bucket = self.bucket_of.get(id(param))
            if bucket is not None:
                if id(param) in bucket.waiting:
                    self.fill(bucket, param, param.grad)  # None (unused): zeros
            elif param not in self.works and param not in self.sparse:
                if param.grad is None:
                    param.grad = torch.zeros_like(param)
                self.works[param] = self.push(param, param.grad)
        step = self.session.step(self.index)  # a joined rank learns from it to push zeros with us
        try:
            for work, _ in self.works.values():
                work.wait(self.session.timeout)
            for work, bucket in self.bucket_works:
                work.wait(self.session.timeout)
                bucket.scatter(self.sparse)
            step.wait(self.session.timeout)
            for param in [p for p in self.params if p in self.sparse]:
                param.grad = self._gather_sparse(param, param.grad)
            for param in self.densified:
                param.grad = param.grad.to_sparse()  # a bucket points it back at zero_grad()
        finally:
            self.forget()
        self.synchronized = True

    def busy(self) -> bool:
        """Gradients of this backward are being averaged (or wait in a bucket that is not full)."""
        return bool(self.works or self.bucket_works) or any(len(b.waiting) < len(b.params) for b in self.buckets)

    def forget(self) -> None:
        """Nothing in flight: the next backward starts afresh."""
        self.works.clear()
        self.sparse.clear()
        self.densified.clear()
        self.bucket_works.clear()
        for bucket in self.buckets:
            bucket.reset()
        self.delay = dict.fromkeys(self._param_ids, self.passes)

    def _gather_sparse(self, param: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        """A sparse gradient (an ``nn.Embedding(sparse=True)``'s) over the ranks, as Horovod's
        sparse all-reduce (:meth:`Session.sparse_allreduce`): never densified; the wrapped
        optimizer (SparseAdam, Adagrad, SGD) takes it as it is."""
        name = self.names[param]
        try:
            work = collectives.sparse_allreduce_async(self.session, grad, f"sparse.{name}",
                                                      Average if self.average else Sum)
            return work.wait(self.session.timeout)
        except PslinkError as exc:
            raise explain_mismatch(exc, f"sparse gradient of {name!r}", _HINT) from None

    def contribute_zeros(self) -> None:
        """While this rank is joined: one step's worth of zero gradients, as the others step."""
        pending = [self.push(param, torch.zeros_like(param))[0] for param in self.params
                   if id(param) not in self.bucket_of]
        for bucket in self.buckets:
            bucket.flat.zero_()
            pending.append(self.start(bucket.key, bucket.describe(), bucket.flat)[0])
        for work in pending:
            work.wait(self.session.timeout)

    def abandon(self) -> None:
        """Forget the gradients in flight (elastic recovery: the round they were in was given
        up, and the state goes back to its last commit); the next backward starts afresh."""
        self.forget()
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
                 gradient_predivide_factor, sparse_as_dense, groups=None, num_groups=0):
        base.__init__(self, params)
        self._pslink = _GradientSync(self, session, named_parameters, compression, backward_passes_per_step, op,
                                     gradient_predivide_factor, sparse_as_dense, groups, num_groups)
        self._parameter_names = self._pslink.names  # Horovod's attribute: parameter -> name

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
        if sync.synchronized and not sync.skip and not sync.busy():
            warnings.warn("optimizer.step() called without optimizer.skip_synchronize() context after "
                          "optimizer.synchronize(). This can cause training slowdown. You may want to consider "
                          "using optimizer.skip_synchronize() context if you use optimizer.synchronize() in your "
                          "code.", stacklevel=2)  # Horovod's words
        if not sync.skip and not (sync.synchronized and not sync.busy()):
            sync.synchronize()
        sync.synchronized = False
        return base.step(self, closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._pslink.busy():
            raise RuntimeError(
                "optimizer.zero_grad() was called after loss.backward() but before optimizer.step() or "
                "optimizer.synchronize(): the gradients are still being averaged"
            )
        buckets = self._pslink.buckets
        if not buckets:
            base.zero_grad(self, set_to_none)
            return
        # Bucketed gradients are zeroed in place, set_to_none or not: they stay views of their
        # bucket and backward adds into them (pslink.torch.fusion says why). The rest as asked.
        bucketed = self._pslink.bucket_of
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is not None and id(param) not in bucketed:
                    if set_to_none:
                        param.grad = None
                    else:
                        param.grad.detach_()
                        param.grad.zero_()
        for bucket in buckets:
            bucket.zero()

    def _pslink_base_step(self, closure=None):
        """The wrapped optimizer's own step, without reducing (broadcast_optimizer_state makes
        the state with it, as Horovod does)."""
        return base.step(self, closure)

    return type(base.__name__, (base,), {"__init__": __init__, "synchronize": synchronize,
                                         "skip_synchronize": skip_synchronize, "step": step, "zero_grad": zero_grad,
                                         "_pslink_base_step": _pslink_base_step,
                                         "__module__": base.__module__, "__qualname__": base.__qualname__})


def _local_class(base: type) -> type:
    """``base`` with the distributed optimizer's methods, reducing nothing (a rank outside the
    optimizer's process set)."""

    def synchronize(self) -> None:
        """Nothing to wait for: this rank reduces no gradients."""

    @contextlib.contextmanager
    def skip_synchronize(self):
        yield

    return type(base.__name__, (base,), {"synchronize": synchronize, "skip_synchronize": skip_synchronize,
                                         "_pslink_base_step": base.step, "__module__": base.__module__,
                                         "__qualname__": base.__qualname__})


def DistributedOptimizer(session: Session | None, optimizer: torch.optim.Optimizer, named_parameters=None,
                         compression=Compression.none, backward_passes_per_step: int = 1, op: ReduceOp = Average,
                         gradient_predivide_factor: float = 1.0, num_groups: int = 0, groups=None,
                         sparse_as_dense: bool = False) -> torch.optim.Optimizer:
    """Wrap ``optimizer`` so that gradients are averaged (``op=Average``) or summed over the ranks.

    Each gradient is push-pulled under its parameter's name as soon as backward produced it, the
    small ones fused into buckets (pslink.torch.fusion: by the fusion threshold,
    ``PSLINK_FUSION_BYTES``; or as Horovod's ``groups`` / ``num_groups`` say); ``step()`` waits
    for them, then steps. ``backward_passes_per_step`` accumulates that many backward passes
    locally first. A sparse gradient (``nn.Embedding(sparse=True)``) is gathered from every rank
    at ``step()`` as Horovod's sparse all-reduce does (``sparse_as_dense``: sent dense instead).
    The result is an instance of a subclass of the optimizer's class. ``session`` None: this rank
    is not in the process set the optimizer reduces over; as in Horovod, it steps on its own
    gradients (``synchronize()`` does nothing).
    """
    op = reduce_op(op)
    if session is None:
        return _local_class(optimizer.__class__)(optimizer.param_groups)
    cls = _distributed_class(optimizer.__class__)
    return cls(optimizer.param_groups, session, named_parameters, compression, backward_passes_per_step, op,
               gradient_predivide_factor, sparse_as_dense, groups, num_groups)
