"""Server-side optimizers for ``optimizer`` mode: the Aggregator keeps the weights and steps them.

A job sends its optimizer as plain data (type and hyperparameters), never as code::

    {"type": "sgd", "lr": 0.1, "momentum": 0.9, "weight_decay": 0.0, "nesterov": False}
    {"type": "adam", "lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8}

and :func:`make_optimizer` builds the rule it names: PyTorch's SGD and Adam
(:mod:`pslink.core.optim.rules`, with the interface every rule has) or one of MXNet's others
(:mod:`pslink.core.optim.mxnet_rules`, built on that interface).
"""

from __future__ import annotations

from pslink.core.optim.mxnet_rules import MXNET_RULES
from pslink.core.optim.rules import SGD, Adam, Optimizer
from pslink.errors import ConfigError

OPTIMIZERS: dict[str, type[Optimizer]] = {"sgd": SGD, "adam": Adam, **MXNET_RULES}


def make_optimizer(config: dict | None) -> Optimizer | None:
    """Build an optimizer from its plain-data description (None stays None)."""
    if config is None:
        return None
    if not isinstance(config, dict):
        raise ConfigError(f"an optimizer is described by a dict, got {type(config).__name__}")
    kind = config.get("type")
    cls = OPTIMIZERS.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise ConfigError(f"unknown optimizer type {kind!r}; available: {', '.join(OPTIMIZERS)}")
    return cls(config)
