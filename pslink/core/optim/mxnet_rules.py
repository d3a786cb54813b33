"""More server-side optimizers, following MXNet 1.9's update rules (``mx.optimizer``): NAG,
AdaGrad, AdaDelta, RMSProp (plain and centered), Signum, FTRL, Adamax, FTML, LAMB and MXNet's ``test`` optimizer.

Each steps a part in place from the round's gradient already scaled (sum x ``rescale_grad``, the
MXNet adapter sends ``average`` false), with ``clip_gradient`` and weight decay ``wd`` where MXNet
applies them; the state each keeps is what MXNet's updater keeps (same names in
:mod:`pslink.mxnet.optimizer`), so state files move between the two. Checked against MXNet's own
updater on the same inputs (``tests/mxnet/test_mxnet_optimizers.py``).
"""

from __future__ import annotations

import numpy as np

from pslink.core.optim.rules import Optimizer, flag_setting, number_setting


def _zeros(state: dict, name: str, weights: np.ndarray) -> np.ndarray:
    """``state[name]``, made as zeros like ``weights`` on the first step (not a fresh array every
    step, as ``setdefault`` would allocate)."""
    array = state.get(name)
    if array is None:
        array = state[name] = np.zeros_like(weights)
    return array


class _MXNetRule(Optimizer):
    """Reads ``lr`` and ``wd`` (MXNet's names) besides each rule's own settings."""

    wd_setting = "wd"

    def __init__(self, config: dict):
        super().__init__(config)
        self.lr = number_setting(config, "lr", 0.01)
        self.wd = number_setting(config, "wd", 0.0)


class NAG(_MXNetRule):
    """Nesterov momentum as MXNet's ``nag_mom_update``: the buffer holds ``-lr``-scaled momentum,
    and is refreshed with the weight decay of the weights already updated (MXNet's kernel does so)."""

    name = "nag"
    allowed = frozenset({"lr", "wd", "momentum"})

    def __init__(self, config: dict):
        super().__init__(config)
        self.momentum = number_setting(config, "momentum", 0.0, high=1.0, closed_high=False)

    def state_layout(self):
        return (("momentum",) if self.momentum else ()), ()

    def step(self, weights, grad, state):
        self._clip(grad)
        if not self.momentum:
            weights -= self.lr * (grad + self.wd * weights)
            return
        mom = _zeros(state, "momentum", weights)
        ahead = self.momentum * mom - self.lr * (grad + self.wd * weights)
        weights += self.momentum * ahead - self.lr * (grad + self.wd * weights)
        mom *= self.momentum
        mom -= self.lr * (grad + self.wd * weights)


class AdaGrad(_MXNetRule):
    name = "adagrad"
    allowed = frozenset({"lr", "wd", "eps"})

    def __init__(self, config: dict):
        super().__init__(config)
        self.eps = number_setting(config, "eps", 1e-7)

    def state_layout(self):
        return ("history",), ()

    def step(self, weights, grad, state):
        self._clip(grad)
        history = _zeros(state, "history", weights)
        history += grad * grad
        weights += (grad / np.sqrt(history + self.eps) + weights * self.wd) * -self.lr


class AdaDelta(_MXNetRule):
    name = "adadelta"
    allowed = frozenset({"lr", "wd", "rho", "eps"})  # lr is accepted and unused, as in MXNet

    def __init__(self, config: dict):
        super().__init__(config)
        self.rho = number_setting(config, "rho", 0.9, high=1.0)
        self.eps = number_setting(config, "eps", 1e-5)

    def state_layout(self):
        return ("acc_g", "acc_delta"), ()

    def step(self, weights, grad, state):
        self._clip(grad)
        acc_g = _zeros(state, "acc_g", weights)
        acc_delta = _zeros(state, "acc_delta", weights)
        acc_g *= self.rho
        acc_g += (1.0 - self.rho) * grad * grad
        delta = np.sqrt(acc_delta + self.eps) / np.sqrt(acc_g + self.eps) * grad
        acc_delta *= self.rho
        acc_delta += (1.0 - self.rho) * delta * delta
        weights -= delta + self.wd * weights


class RMSProp(_MXNetRule):
    """RMSProp as MXNet's ``rmsprop_update`` (Tieleman & Hinton's) or, with ``centered``, its
    ``rmspropalex_update`` (Graves's, with momentum ``gamma2``); weight decay is added before the
    clip in both."""

    name = "rmsprop"
    allowed = frozenset({"lr", "wd", "gamma1", "gamma2", "eps", "centered", "clip_weights"})

    def __init__(self, config: dict):
        super().__init__(config)
        self.gamma1 = number_setting(config, "gamma1", 0.9, high=1.0)
        self.gamma2 = number_setting(config, "gamma2", 0.9, high=1.0)
        self.eps = number_setting(config, "eps", 1e-8)
        self.centered = flag_setting(config, "centered", False)
        clip = config.get("clip_weights")
        self.clip_weights = None if clip is None else number_setting(config, "clip_weights", 0.0)

    def state_layout(self):
        return (("n", "g", "delta") if self.centered else ("n",)), ()

    def step(self, weights, grad, state):
        grad += self.wd * weights
        self._clip(grad)
        n = _zeros(state, "n", weights)
        n *= self.gamma1
        n += (1.0 - self.gamma1) * grad * grad
        if self.centered:
            mean = _zeros(state, "g", weights)
            mean *= self.gamma1
            mean += (1.0 - self.gamma1) * grad
            delta = _zeros(state, "delta", weights)
            delta *= self.gamma2
            delta -= self.lr * grad / np.sqrt(n - mean * mean + self.eps)
            weights += delta
        else:
            weights -= self.lr * grad / np.sqrt(n + self.eps)
        if self.clip_weights:
            np.clip(weights, -self.clip_weights, self.clip_weights, out=weights)


class Signum(_MXNetRule):
    name = "signum"
    allowed = frozenset({"lr", "wd", "momentum", "wd_lh"})

    def __init__(self, config: dict):
        super().__init__(config)
        self.momentum = number_setting(config, "momentum", 0.9, high=1.0, closed_high=False)
        self.wd_lh = number_setting(config, "wd_lh", 0.0)

    def state_layout(self):
        return (("momentum",) if self.momentum else ()), ()

    def step(self, weights, grad, state):
        self._clip(grad)
        if self.momentum:  # signum_update: weight decay in the momentum, wd_lh decoupled
            grad += self.wd * weights
            mom = _zeros(state, "momentum", weights)
            mom *= self.momentum
            mom -= (1.0 - self.momentum) * grad
            weights *= 1.0 - self.lr * self.wd_lh
            weights += self.lr * np.sign(mom)
        else:  # signsgd_update: the sign of the gradient alone, weight decay decoupled
            weights *= 1.0 - self.lr * (self.wd + self.wd_lh)
            weights -= self.lr * np.sign(grad)


class FTRL(_MXNetRule):
    name = "ftrl"
    allowed = frozenset({"lr", "wd", "lamda1", "beta"})

    def __init__(self, config: dict):
        super().__init__(config)
        self.lamda1 = number_setting(config, "lamda1", 0.01)
        self.beta = number_setting(config, "beta", 1.0)

    def state_layout(self):
        return ("z", "n"), ()

    def step(self, weights, grad, state):
        self._clip(grad)
        z = _zeros(state, "z", weights)
        n = _zeros(state, "n", weights)
        z += grad - (np.sqrt(n + grad * grad) - np.sqrt(n)) * weights / self.lr
        n += grad * grad
        weights[...] = (np.sign(z) * self.lamda1 - z) / ((self.beta + np.sqrt(n)) / self.lr + self.wd) * (
            np.abs(z) > self.lamda1)


class Adamax(_MXNetRule):
    """Adam with the infinity norm (MXNet's ``Adamax``): weight decay added before the clip, the
    learning rate bias-corrected by the step count of the key."""

    name = "adamax"
    allowed = frozenset({"lr", "wd", "beta1", "beta2"})

    def __init__(self, config: dict):
        super().__init__(config)
        self.beta1 = number_setting(config, "beta1", 0.9, high=1.0, closed_high=False)
        self.beta2 = number_setting(config, "beta2", 0.999, high=1.0)

    def state_layout(self):
        return ("mean", "norm"), ("step",)

    def step(self, weights, grad, state):
        grad += self.wd * weights
        self._clip(grad)
        state["step"] = t = state.get("step", 0) + 1
        mean, norm = _zeros(state, "mean", weights), _zeros(state, "norm", weights)
        mean *= self.beta1
        mean += (1.0 - self.beta1) * grad
        np.maximum(self.beta2 * norm, np.abs(grad), out=norm)
        weights -= self.lr / (1.0 - self.beta1**t) * mean / norm


class FTML(_MXNetRule):
    """Follow the Moving Leader (MXNet's ``ftml_update``): weight decay added before the clip."""

    name = "ftml"
    allowed = frozenset({"lr", "wd", "beta1", "beta2", "eps"})

    def __init__(self, config: dict):
        super().__init__(config)
        self.beta1 = number_setting(config, "beta1", 0.6, high=1.0, closed_high=False)
        self.beta2 = number_setting(config, "beta2", 0.999, high=1.0, closed_high=False)
        self.eps = number_setting(config, "eps", 1e-8)

    def state_layout(self):
        return ("d", "v", "z"), ("step",)

    def step(self, weights, grad, state):
        grad += self.wd * weights
        self._clip(grad)
        state["step"] = t = state.get("step", 0) + 1
        d, v, z = (_zeros(state, name, weights) for name in ("d", "v", "z"))
        v *= self.beta2
        v += (1.0 - self.beta2) * grad * grad
        d_t = (1.0 - self.beta1**t) / self.lr * (np.sqrt(v / (1.0 - self.beta2**t)) + self.eps)
        z *= self.beta1
        z += (1.0 - self.beta1) * grad - (d_t - self.beta1 * d) * weights
        d[...] = d_t
        np.divide(-z, d_t, out=weights)


class LAMB(_MXNetRule):
    """Layer-wise adaptive moments (MXNet's ``lamb_update_phase1`` and ``phase2``): Adam's
    direction plus weight decay, scaled by the trust ratio ``||w|| / ||g||`` of the **whole**
    key (``||w||`` clipped to ``[lower_bound, upper_bound]`` where given; 1 when either norm is
    0). A key split into several parts cannot be stepped part by part (``whole_tensor``: the
    Aggregator refuses it, naming the partition size to raise)."""

    name = "lamb"
    allowed = frozenset({"lr", "wd", "beta1", "beta2", "eps", "lower_bound", "upper_bound", "bias_correction"})
    whole_tensor = True

    def __init__(self, config: dict):
        super().__init__(config)
        self.beta1 = number_setting(config, "beta1", 0.9, high=1.0, closed_high=False)
        self.beta2 = number_setting(config, "beta2", 0.999, high=1.0, closed_high=False)
        self.eps = number_setting(config, "eps", 1e-6)
        bounds = [config.get(name) for name in ("lower_bound", "upper_bound")]
        self.lower_bound, self.upper_bound = [None if b is None else number_setting(config, name, 0.0)
                                              for b, name in zip(bounds, ("lower_bound", "upper_bound"))]
        self.bias_correction = flag_setting(config, "bias_correction", True)

    def state_layout(self):
        return ("mean", "var"), ("step",)

    def step(self, weights, grad, state):
        self._clip(grad)
        state["step"] = t = state.get("step", 0) + 1
        mean, var = _zeros(state, "mean", weights), _zeros(state, "var", weights)
        mean *= self.beta1
        mean += (1.0 - self.beta1) * grad
        var *= self.beta2
        var += (1.0 - self.beta2) * grad * grad
        if self.bias_correction:
            g = (mean / (1.0 - self.beta1**t)) / (np.sqrt(var / (1.0 - self.beta2**t)) + self.eps)
        else:
            g = mean / (np.sqrt(var) + self.eps)
        g += self.wd * weights
        r1, r2 = float(np.linalg.norm(weights)), float(np.linalg.norm(g))
        if self.lower_bound is not None and self.lower_bound > 0:
            r1 = max(r1, self.lower_bound)
        if self.upper_bound is not None and self.upper_bound > 0:
            r1 = min(r1, self.upper_bound)
        ratio = 1.0 if r1 == 0.0 or r2 == 0.0 else r1 / r2
        weights -= np.asarray(self.lr * ratio, weights.dtype) * g


class Test(_MXNetRule):
    """MXNet's ``test`` optimizer: ``weight += rescale_grad * grad``."""

    name = "test"
    allowed = frozenset({"lr", "wd"})

    def step(self, weights, grad, state):
        weights += grad


MXNET_RULES: dict[str, type[Optimizer]] = {cls.name: cls for cls in (NAG, AdaGrad, AdaDelta, RMSProp, Signum, FTRL,
                                                                      Adamax, FTML, LAMB, Test)}
