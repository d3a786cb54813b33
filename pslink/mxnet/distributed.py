"""Horovod's MXNet training wrappers over a Session: ``DistributedTrainer`` (a gluon Trainer) and
``DistributedOptimizer`` (an ``mx.optimizer.Optimizer`` for ``Module.fit``), and ``Compression``.

Both average as Horovod's CPU build does: the gradients are summed over the ranks (each
multiplied by ``1 / gradient_predivide_factor`` first) and the wrapped optimizer's scale is
multiplied by ``gradient_predivide_factor / size``. A rank outside the ``process_set`` (or a set
of one) steps on its own gradients, as in Horovod.

Join (uneven data): the Trainer's gradients of one step travel in one request of its own keys,
and the step is announced on the Session's board (``session.step``); a rank in ``join()`` then
pushes zeros for the same keys (``contribute_zeros``). The Optimizer's ``update`` reduces one
parameter at a time, with no step around it that a joined rank could mirror, so its gradients
go through the Session's allreduce, whose every call the board shows a joined rank (it mirrors
each with zeros), as Horovod's join mirrors every allreduce.
"""

from __future__ import annotations

import warnings
from collections import OrderedDict

import mxnet as mx
import numpy as np

from pslink.core.worker.collectives import service_key
from pslink.core.worker.horovod import NoneCompressor
from pslink.core.worker.reduction import Sum, check_factor, scale
from pslink.core.worker.session import Session, reworded
from pslink.errors import ConfigError, PslinkError
from pslink.mxnet import collectives
from pslink.mxnet.world import current_session, global_process_set, member_session


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

    none = NoneCompressor
    fp16 = _FP16Compressor


def _predivide(factor) -> float:
    factor = check_factor(factor, "gradient_predivide_factor")
    if not factor > 0:
        raise ConfigError(f"gradient_predivide_factor must be > 0, got {factor!r}")
    return factor


def _split(items: list, groups: int) -> list[list]:
    """``items`` in ``groups`` consecutive parts of nearly equal length (Horovod's split_list)."""
    if isinstance(groups, bool) or not isinstance(groups, int) or groups < 0:
        raise ConfigError(f"num_groups must be an int >= 0, got {groups!r}")
    if groups <= 1 or len(items) <= 1:
        return [items] if items else []
    size, extra = divmod(len(items), min(groups, len(items)))
    parts, start = [], 0
    for i in range(min(groups, len(items))):
        end = start + size + (1 if i < extra else 0)
        parts.append(items[start:end])
        start = end
    return parts


class DistributedOptimizer(mx.optimizer.Optimizer):
    """``optimizer`` (for ``Module.fit(optimizer=..., kvstore=None)``) whose ``update`` first sums
    the gradient over the ranks of ``process_set``, its ``rescale_grad`` multiplied by
    ``gradient_predivide_factor / size``: the average, as Horovod's does it. ``session``: the
    world Session (default: the one ``hvd.init()`` made)."""

    def __init__(self, optimizer: mx.optimizer.Optimizer, gradient_predivide_factor: float = 1.0,
                 num_groups: int = 0, process_set=global_process_set, *, session: Session | None = None):
        # (no super().__init__: every attribute not set here is the wrapped optimizer's, as in Horovod)
        world = session if session is not None else current_session()
        self._optimizer = optimizer
        self._predivide = _predivide(gradient_predivide_factor)
        _split([], num_groups)  # checks num_groups
        self._num_groups = num_groups
        self._session = member_session(world, process_set)
        members = self._session.size if self._session is not None else len(process_set.ranks)
        self._optimizer.rescale_grad *= self._predivide / members

    def __getattr__(self, item):
        return getattr(self._optimizer, item)

    def create_state(self, index, weight):
        return self._optimizer.create_state(index, weight)

    def create_state_multi_precision(self, index, weight):
        return self._optimizer.create_state_multi_precision(index, weight)

    def _sum(self, index, grad) -> None:
        session = self._session
        if session is None or session.size == 1:
            return
        prescale = 1.0 / self._predivide
        if not isinstance(index, (list, tuple)):
            collectives.allreduce(session, grad, f"DistributedOptimizer.{index}", Sum, prescale, 1.0, inplace=True)
            return
        works = []
        if self._num_groups > 0:
            pairs = list(zip(index, grad))
            for part in _split(pairs, self._num_groups):
                name = f"DistributedOptimizer.{part[0][0]}:{part[-1][0]}"
                works.append(collectives.grouped_allreduce_start(session, [g for _, g in part], name, Sum, prescale,
                                                                 1.0, inplace=True))
        else:
            works = [collectives.allreduce_start(session, g, f"DistributedOptimizer.{i}", Sum, prescale, 1.0,
                                                 inplace=True) for i, g in zip(index, grad)]
        for work in works:
            work.wait(session.timeout)

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
    """A gluon Trainer whose gradients are summed over the ranks of ``process_set`` before each
    update, the update's scale multiplied by ``gradient_predivide_factor / size`` (Horovod's
    ``DistributedTrainer``). ``prefix`` tells several Trainers' gradients apart, as in Horovod;
    ``num_groups`` > 0 sends them in that many requests (default: one). ``session``: the world
    Session (default: the one ``hvd.init()`` made)."""

    def __init__(self, params, optimizer, optimizer_params=None, compression=Compression.none,
                 gradient_predivide_factor: float = 1.0, prefix: str | None = None, num_groups: int = 0,
                 process_set=global_process_set, *, session: Session | None = None):
        compression = Compression.none if compression is None else compression
        if not (hasattr(compression, "compress") and hasattr(compression, "decompress")):
            raise ConfigError(f"DistributedTrainer: compression is hvd.Compression.none or hvd.Compression.fp16, "
                              f"got {compression!r}")
        if prefix is not None and not isinstance(prefix, str):
            raise ConfigError(f"DistributedTrainer: prefix must be a string, got {prefix!r}")
        predivide = _predivide(gradient_predivide_factor)
        _split([], num_groups)  # checks num_groups
        world = session if session is not None else current_session()
        if isinstance(optimizer, DistributedOptimizer):
            optimizer = optimizer._optimizer
            warnings.warn("DistributedTrainer does not take DistributedOptimizer as its optimizer. We have unwrapped "
                          "it for you.")  # Horovod's words
        # The same parameter order on every rank (Horovod sorts a list, keeps a dict's order).
        if isinstance(params, dict):
            params = OrderedDict(params)
        elif isinstance(params, (list, tuple)):
            params = sorted(params, key=lambda p: p.name)
        self._session = member_session(world, process_set)
        super().__init__(params, optimizer, optimizer_params=optimizer_params, kvstore=None)
        self._compression = compression
        self._predivide = predivide
        self._prefix = prefix or ""
        self._num_groups = num_groups
        members = self._session.size if self._session is not None else len(process_set.ranks)
        self._scale *= predivide / members  # gradients are summed: the average, as Horovod scales it
        self._stepper = None
        if self._session is not None:
            self._stepper = self._session.register_stepper(self.contribute_zeros)
            # (nothing stays in flight between steps, so elastic recovery has nothing to abandon)

    def _keys(self) -> list[tuple[str, mx.gluon.Parameter]]:
        """(service key, parameter) of each parameter with a gradient: this Trainer's own keys."""
        return [(service_key("mx.grad", f"trainer{self._stepper}", f"{self._prefix}{i}"), param)
                for i, param in enumerate(self._params) if param.grad_req != "null"]

    def _allreduce_grads(self):
        session = self._session
        if session is None or session.size == 1:
            return
        keyed = self._keys()
        sent = [self._compression.compress(param.list_grad()[0]) for _, param in keyed]
        arrays = [collectives.host(compressed) for compressed, _ in sent]
        if self._predivide != 1.0:
            for array in arrays:
                scale(array, 1.0 / self._predivide)
        handles = self._push([key for key, _ in keyed], arrays)
        step = session.step(self._stepper)  # a joined rank learns from it to push zeros with us
        for handle, what in handles:
            try:
                handle.wait(session.timeout)
            except PslinkError as exc:
                raise reworded(exc, what) from None
        step.wait(session.timeout)
        for (_, param), (compressed, ctx), array in zip(keyed, sent, arrays):
            grads = param.list_grad()
            if compressed is grads[0]:  # sent as it is: the sum goes straight into the gradient
                collectives.copy_into(array, grads[0])
            else:
                self._compression.decompress(collectives.to_ndarray(array, compressed), ctx).copyto(grads[0])
            for other in grads[1:]:
                grads[0].copyto(other)

    def _push(self, keys: list[str], arrays: list[np.ndarray]) -> list:
        """Push-pull ``arrays`` (received in place) under ``keys``, in ``num_groups`` requests (one
        by default): [(handle, what it carries)]."""
        agent = self._session.agent
        handles = []
        for part in _split(list(zip(keys, arrays)), self._num_groups):
            what = (f"DistributedTrainer: the gradients {part[0][0]!r} .. {part[-1][0]!r} (do all ranks build the "
                    "same model and create the same Trainers in the same order?)")
            try:
                handle = agent.pushpull_many([k for k, _ in part], [a for _, a in part], outs=[a for _, a in part])
            except PslinkError as exc:
                raise reworded(exc, what) from None
            handles.append((handle, what))
        return handles

    def contribute_zeros(self) -> None:
        """While this rank is joined: one step's worth of zero gradients, as the others step."""
        keyed = self._keys()
        zeros = []
        for _, param in keyed:
            grad = param.list_grad()[0]
            compressed, _ = self._compression.compress(mx.nd.zeros(grad.shape, ctx=mx.cpu(), dtype=grad.dtype))
            zeros.append(collectives.host(compressed))  # the shape and dtype the others send
        for handle, what in self._push([key for key, _ in keyed], zeros):
            try:
                handle.wait(self._session.timeout)
            except PslinkError as exc:
                raise reworded(exc, what) from None
