"""The optimizer interface (:class:`Optimizer`) and the rules PyTorch documents: SGD and Adam.

The update rules follow PyTorch's documented algorithms (``torch.optim.SGD`` and
``torch.optim.Adam``), so a job that moves its optimizer onto the service trains as it did
locally; MXNet's other optimizers are in :mod:`pslink.core.optim.mxnet_rules`.

Two keys say which gradient the optimizer sees: ``average`` (default true: the sum of the round's
pushes divided by the number of workers that pushed) and ``rescale_grad`` (a further factor,
default 1, as MXNet's optimizers have).

Optional settings, off by default, reproduce MXNet's update rules where they differ from
PyTorch's (the MXNet adapter sends them; see docs/mxnet.md):

- ``clip_gradient`` (both): clip every element of the scaled gradient to ``[-c, c]``; SGD clips
  before adding weight decay, Adam after, as MXNet's ``sgd_update`` and ``adam_update`` do.
- ``lr_in_momentum`` (SGD): the momentum buffer accumulates ``lr * grad`` and the weights move by
  the buffer (MXNet's ``sgd_mom_update``); the same as PyTorch's rule while ``lr`` is constant,
  different once it changes.
- ``eps_after_bias_correction`` (Adam, default true): PyTorch's
  ``sqrt(v) / sqrt(1 - beta2**t) + eps``; false gives MXNet's ``(sqrt(v) + eps) / sqrt(1 - beta2**t)``.
"""

from __future__ import annotations

import abc
import math
from typing import Any

import numpy as np

from pslink.errors import ConfigError

_COMMON = {"type", "average", "rescale_grad", "clip_gradient", "per_key", "multi_precision"}


def number_setting(config: dict, name: str, default: float, low: float = 0.0, high: float = math.inf, closed_high=True) -> float:
    value = config.get(name, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(f"optimizer {config.get('type')!r}: {name} must be a finite number, got {value!r}")
    if value < low or (value > high if closed_high else value >= high):
        bound = f"[{low}, {high}]" if closed_high else f"[{low}, {high})"
        raise ConfigError(f"optimizer {config.get('type')!r}: {name}={value} is outside {bound}")
    return float(value)


def flag_setting(config: dict, name: str, default: bool) -> bool:
    value = config.get(name, default)
    if not isinstance(value, bool):
        raise ConfigError(f"optimizer {config.get('type')!r}: {name} must be true or false, got {value!r}")
    return value


class Optimizer(abc.ABC):
    """Steps one tensor part in place; per-part state lives in the dict the caller keeps."""

    name = "optimizer"
    allowed: frozenset[str] = frozenset()
    whole_tensor = False  # True: its step needs the whole key at once (norms over it: LAMB)

    def __init__(self, config: dict):
        unknown = set(config) - _COMMON - self.allowed
        if unknown:
            raise ConfigError(
                f"optimizer {self.name!r}: unknown setting(s) {sorted(unknown)}; allowed: "
                f"{sorted(self.allowed | _COMMON)}"
            )
        average = config.get("average", True)
        if not isinstance(average, bool):
            raise ConfigError(f"optimizer {self.name!r}: average must be true or false, got {average!r}")
        self.average = average
        self.rescale_grad = number_setting(config, "rescale_grad", 1.0, low=-math.inf)
        clip = config.get("clip_gradient")
        self.clip_gradient = None if clip is None else number_setting(config, "clip_gradient", 0.0)
        if self.clip_gradient == 0.0:
            raise ConfigError(f"optimizer {self.name!r}: clip_gradient must be > 0 (or absent: no clipping)")
        # MXNet's multi_precision: float16 weights are stepped through a float32 master copy
        self.multi_precision = flag_setting(config, "multi_precision", False)
        self.config = dict(config)
        self._per_key = self._read_per_key(config.get("per_key", []))
        self._for_keys: dict = {}

    # Where a key's own learning rate and weight decay go (MXNet's lr_mult and wd_mult): the
    # setting (and attribute) each optimizer keeps its weight decay in.
    wd_setting = "weight_decay"

    def _read_per_key(self, entries) -> dict:
        """``per_key``: [[key, lr_mult, wd_mult], ...], the keys whose learning rate and weight
        decay are the job's times their own factors."""
        if not isinstance(entries, list):
            raise ConfigError(f"optimizer {self.name!r}: per_key must be a list of [key, lr_mult, wd_mult]")
        per_key = {}
        for entry in entries:
            if not (isinstance(entry, (list, tuple)) and len(entry) == 3 and isinstance(entry[0], (int, str))
                    and not isinstance(entry[0], bool)):
                raise ConfigError(f"optimizer {self.name!r}: per_key entry {entry!r} is not [key, lr_mult, wd_mult]")
            factors = {"lr_mult": entry[1], "wd_mult": entry[2], "type": self.name}
            per_key[entry[0]] = (number_setting(factors, "lr_mult", 1.0), number_setting(factors, "wd_mult", 1.0))
        return per_key

    def for_key(self, key) -> "Optimizer":
        """The optimizer that steps ``key``: this one, or one with the key's own learning rate and
        weight decay (made once per key)."""
        factors = self._per_key.get(key)
        if factors is None:
            return self
        own = self._for_keys.get(key)
        if own is None:
            config = {name: value for name, value in self.config.items() if name != "per_key"}
            config["lr"] = self.lr * factors[0]
            config[self.wd_setting] = getattr(self, self.wd_setting) * factors[1]
            own = self._for_keys[key] = type(self)(config)
        return own

    def _clip(self, grad: np.ndarray) -> None:
        if self.clip_gradient is not None:
            np.clip(grad, -self.clip_gradient, self.clip_gradient, out=grad)

    def grad_scale(self, contributors: int) -> float:
        """The factor that turns a round's sum of pushes into the gradient to apply."""
        if self.average and contributors > 0:
            return self.rescale_grad / contributors
        return self.rescale_grad

    def state_layout(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """The names of this optimizer's per-part state: (arrays of the part's size, numbers)."""
        return (), ()

    def check_state(self, arrays: list[str], scalars: dict, what: str) -> None:
        """Raise ConfigError unless a state to install is empty or complete, with the right names
        and numbers (``what`` names the key part in the message)."""
        array_names, scalar_names = self.state_layout()
        given = set(arrays) | set(scalars)
        if not given:
            return  # an empty state: the next step starts afresh
        wanted = set(array_names) | set(scalar_names)
        if given != wanted or len(arrays) != len(set(arrays)) or set(arrays) != set(array_names):
            raise ConfigError(
                f"{what}: optimizer {self.name!r} keeps state {sorted(wanted) or 'none'} (arrays "
                f"{list(array_names)}, numbers {list(scalar_names)}); got arrays {list(arrays)}, numbers {sorted(scalars)}"
            )
        for name, value in scalars.items():
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ConfigError(f"{what}: optimizer state {name!r} must be a non-negative int, got {value!r}")

    @abc.abstractmethod
    def step(self, weights: np.ndarray, grad: np.ndarray, state: dict) -> None:
        """Update ``weights`` in place from ``grad`` (already scaled). ``grad`` may be clobbered."""

    def to_wire(self) -> dict[str, Any]:
        return dict(self.config)


class SGD(Optimizer):
    """SGD with optional momentum, dampening, Nesterov and weight decay (torch.optim.SGD)."""

    name = "sgd"
    allowed = frozenset({"lr", "momentum", "dampening", "weight_decay", "nesterov", "lr_in_momentum"})

    def __init__(self, config: dict):
        super().__init__(config)
        if "lr" not in config:
            raise ConfigError("optimizer 'sgd': lr is required")
        self.lr = number_setting(config, "lr", 0.0)
        self.momentum = number_setting(config, "momentum", 0.0)
        self.dampening = number_setting(config, "dampening", 0.0, high=1.0)
        self.weight_decay = number_setting(config, "weight_decay", 0.0)
        self.nesterov = bool(config.get("nesterov", False))
        self.lr_in_momentum = flag_setting(config, "lr_in_momentum", False)
        if self.nesterov and (self.momentum <= 0 or self.dampening != 0):
            raise ConfigError("optimizer 'sgd': nesterov needs momentum > 0 and dampening = 0")

    def state_layout(self):
        return (("momentum_buffer",) if self.momentum else ()), ()

    def step(self, weights, grad, state):
        self._clip(grad)
        if self.weight_decay:
            grad += self.weight_decay * weights
        if self.lr_in_momentum:
            # The buffer then holds lr * grad terms, so the weights move by it unscaled.
            grad *= self.lr
        # ``grad`` is the round's sum, the optimizer's to overwrite: it holds each product the
        # step needs instead of a temporary (a fresh 4 MiB array costs page faults whenever the
        # heap has just given its free memory to something else, as to a migration's copy).
        # Each value is computed with the same operations in the same order as before.
        if self.momentum:
            buf = state.get("momentum_buffer")
            if buf is None:
                buf = state["momentum_buffer"] = grad.copy()
            else:
                buf *= self.momentum
                if self.dampening:
                    grad *= 1.0 - self.dampening
                buf += grad
            if self.nesterov:
                grad += self.momentum * buf  # dampening is 0 here, so grad is still the gradient
                step = grad
            else:
                step = buf
        else:
            step = grad
        if self.lr_in_momentum:
            weights -= step
        else:
            np.multiply(step, self.lr, out=grad)  # grad is free now (or step itself)
            weights -= grad


class Adam(Optimizer):
    """Adam with bias correction and L2 weight decay (torch.optim.Adam, amsgrad off)."""

    name = "adam"
    allowed = frozenset({"lr", "beta1", "beta2", "eps", "weight_decay", "eps_after_bias_correction"})

    def __init__(self, config: dict):
        super().__init__(config)
        self.lr = number_setting(config, "lr", 1e-3)
        self.beta1 = number_setting(config, "beta1", 0.9, high=1.0, closed_high=False)
        self.beta2 = number_setting(config, "beta2", 0.999, high=1.0, closed_high=False)
        self.eps = number_setting(config, "eps", 1e-8)
        self.weight_decay = number_setting(config, "weight_decay", 0.0)
        self.eps_after_bias_correction = flag_setting(config, "eps_after_bias_correction", True)

    def state_layout(self):
        return ("exp_avg", "exp_avg_sq"), ("step",)

    def step(self, weights, grad, state):
        if self.weight_decay:
            grad += self.weight_decay * weights
        self._clip(grad)
        if "exp_avg" not in state:
            state["step"] = 0
            state["exp_avg"] = np.zeros_like(weights)
            state["exp_avg_sq"] = np.zeros_like(weights)
        state["step"] += 1
        t = state["step"]
        m, v = state["exp_avg"], state["exp_avg_sq"]
        m *= self.beta1
        m += (1.0 - self.beta1) * grad
        v *= self.beta2
        v += (1.0 - self.beta2) * (grad * grad)
        bias1 = 1.0 - self.beta1**t
        bias2 = 1.0 - self.beta2**t
        # torch: denom = sqrt(v) / sqrt(bias2) + eps; w -= (lr / bias1) * m / denom
        # MXNet: denom = (sqrt(v) + eps) / sqrt(bias2)
        denom = np.sqrt(v)
        if self.eps_after_bias_correction:
            denom /= math.sqrt(bias2)
            denom += self.eps
        else:
            denom += self.eps
            denom /= math.sqrt(bias2)
        weights -= (self.lr / bias1) * (m / denom)


def step_through_float32(optimizer: Optimizer, weights: np.ndarray, grad: np.ndarray, scale: float,
                         state: dict) -> None:
    """MXNet's ``multi_precision`` step of float16 ``weights``: the gradient in float32 (scaled
    there), the optimizer stepping a float32 master copy kept in ``state["weight32"]`` (made from
    the weights at the first step) with float32 state, and the weights the master copy rounded."""
    master = state.pop("weight32", None)
    if master is None:
        master = weights.astype(np.float32)
    grad32 = grad.astype(np.float32)
    if scale != 1.0:
        grad32 *= np.float32(scale)
    try:
        optimizer.step(master, grad32, state)
    finally:
        state["weight32"] = master
    np.copyto(weights, master, casting="unsafe")

