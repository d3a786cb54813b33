"""MXNet optimizers as plain data for the service's Aggregators (never pickled code).

``service_config(opt)`` maps an ``mx.optimizer.SGD`` (with or without momentum) or
``mx.optimizer.Adam`` onto the service's optimizers (``pslink.core.optim``; MXNet's NAG, AdaGrad,
AdaDelta, RMSProp, Signum, Ftrl, Adamax, FTML and Test onto ``pslink.core.optim.mxnet_rules``), with the settings
that make the service follow MXNet's update rules rather than PyTorch's:

- the service applies the round's **sum** of gradients times ``rescale_grad`` (``average``
  false), as MXNet's dist_sync servers do;
- SGD keeps ``lr * grad`` in its momentum buffer (``lr_in_momentum``) and clips the rescaled
  gradient before weight decay; Adam clips after weight decay and adds epsilon before the bias
  correction (``eps_after_bias_correction`` false).

``to_mxnet_state`` and ``to_service_state`` translate the per-key state both ways, so that
``save_optimizer_states`` writes the file MXNet's own updater writes (and reads it back): MXNet's
SGD momentum is the negated ``lr * grad`` buffer the service keeps; Adam's (mean, var) are the
service's moments, and its step count is MXNet's per-key update count.
"""

from __future__ import annotations

import mxnet as mx
import numpy as np

from pslink.mxnet.errors import KVStoreError

SUPPORTED = ("mx.optimizer.SGD (with or without momentum), Adam, NAG, AdaGrad, AdaDelta, RMSProp, "
             "Signum, Ftrl, Adamax, FTML, LAMB (keys of one part) and Test")

# MXNet's other optimizers on the service (pslink.core.optim.mxnet_rules): the service's type, its
# settings from the optimizer's attributes; and the state MXNet's updater keeps per key for every
# optimizer but SGD (the service's arrays, and whether MXNet holds them as a tuple).
_RULES = {
    mx.optimizer.NAG: ("nag", {"momentum": "momentum"}),
    mx.optimizer.AdaGrad: ("adagrad", {"eps": "float_stable_eps"}),
    mx.optimizer.AdaDelta: ("adadelta", {"rho": "rho", "eps": "epsilon"}),
    mx.optimizer.RMSProp: ("rmsprop", {"gamma1": "gamma1", "gamma2": "gamma2", "eps": "epsilon", "centered": "centered",
                                       "clip_weights": "clip_weights"}),
    mx.optimizer.Signum: ("signum", {"momentum": "momentum", "wd_lh": "wd_lh"}),
    mx.optimizer.Ftrl: ("ftrl", {"lamda1": "lamda1", "beta": "beta"}),
    mx.optimizer.Adamax: ("adamax", {"beta1": "beta1", "beta2": "beta2"}),
    mx.optimizer.FTML: ("ftml", {"beta1": "beta1", "beta2": "beta2", "eps": "epsilon"}),
    mx.optimizer.LAMB: ("lamb", {"beta1": "beta1", "beta2": "beta2", "eps": "epsilon", "lower_bound": "lower_bound",
                                 "upper_bound": "upper_bound", "bias_correction": "bias_correction"}),
    mx.optimizer.Test: ("test", {}),
}
_STATES = {
    mx.optimizer.NAG: (("momentum",), False), mx.optimizer.AdaGrad: (("history",), False),
    mx.optimizer.AdaDelta: (("acc_g", "acc_delta"), True), mx.optimizer.RMSProp: (("n",), True),  # centered: below
    mx.optimizer.Signum: (("momentum",), False), mx.optimizer.Ftrl: (("z", "n"), True), mx.optimizer.Test: ((), False),
    mx.optimizer.Adamax: (("mean", "norm"), True), mx.optimizer.FTML: (("d", "v", "z"), True),
    mx.optimizer.Adam: (("exp_avg", "exp_avg_sq"), True),  # MXNet's (mean, var)
    mx.optimizer.LAMB: (("mean", "var"), True),
}
# ... and the key's update count, which MXNet keeps in the optimizer and the service per key.
_STEPPED = (mx.optimizer.Adam, mx.optimizer.Adamax, mx.optimizer.FTML, mx.optimizer.LAMB)


def _state_layout(opt):
    if type(opt) is mx.optimizer.RMSProp and opt.centered:
        return ("n", "g", "delta"), True
    return _STATES.get(type(opt))


def _plain(value):
    return value if value is None or isinstance(value, bool) else float(value)


def service_config(opt, keys=()) -> dict:
    """The plain-data description of ``opt`` at its current learning rate; ``keys`` whose learning
    rate or weight decay is their own (``lr_mult``, ``wd_mult``, a Parameter's multipliers) get
    their factors in ``per_key``."""
    kind = type(opt)
    common: dict = {"average": False, "rescale_grad": float(opt.rescale_grad)}
    if opt.multi_precision:
        common["multi_precision"] = True  # float16 keys: a float32 master copy on the service
    per_key = [[key, *factors] for key in keys if (factors := _factors(opt, key)) != (1.0, 1.0)]
    if per_key:
        common["per_key"] = per_key
    # MXNet clips only for a positive clip_gradient (None, 0 or negative: no clipping).
    if opt.clip_gradient is not None and opt.clip_gradient > 0:
        common["clip_gradient"] = float(opt.clip_gradient)
    if kind is mx.optimizer.SGD:
        return {
            "type": "sgd",
            "lr": float(opt.learning_rate),
            "momentum": float(opt.momentum),
            "weight_decay": float(opt.wd),
            "lr_in_momentum": True,
            **common,
        }
    if kind is mx.optimizer.Adam:
        return {
            "type": "adam",
            "lr": float(opt.learning_rate),
            "beta1": float(opt.beta1),
            "beta2": float(opt.beta2),
            "eps": float(opt.epsilon),
            "weight_decay": float(opt.wd),
            "eps_after_bias_correction": False,
            **common,
        }
    settings = _RULES.get(kind)
    if settings is not None:
        common.update(lr=float(opt.learning_rate), wd=float(opt.wd))
        return {"type": settings[0], **{ours: _plain(getattr(opt, theirs)) for ours, theirs in settings[1].items()},
                **common}
    raise KVStoreError(
        f"pslink kvstore: the service cannot apply optimizer {kind.__module__}.{kind.__name__}; it "
        f"applies {SUPPORTED}. Use one of those, or keep the update on the worker with "
        "gluon.Trainer(..., update_on_kvstore=False)"
    )


def _factors(opt, key) -> tuple[float, float]:
    """``key``'s learning rate and weight decay over the optimizer's (MXNet's ``_get_lr`` and
    ``_get_wd`` apply lr_mult and wd_mult; a zero base leaves the factor 1, it multiplies 0)."""
    lr, wd = opt.learning_rate, opt.wd
    return (float(opt._get_lr(key) / lr) if lr else 1.0, float(opt._get_wd(key) / wd) if wd else 1.0)


def check_key(opt, key, dtype) -> None:
    """Refuse what the service cannot do for ``key`` (nothing so far: a float16 key with
    multi_precision is stepped through a float32 master copy, as MXNet's updater does)."""


def to_mxnet_state(opt, state: dict):
    """The service's state of one key (``Agent.optimizer_state``) as MXNet's updater keeps it."""
    if not state:
        return None
    layout = _state_layout(opt)
    if layout is not None:
        arrays = [mx.nd.array(state[name], dtype=state[name].dtype) for name in layout[0]]
        return tuple(arrays) if layout[1] else arrays[0]
    return mx.nd.array(-state["momentum_buffer"], dtype=state["momentum_buffer"].dtype)  # SGD's, negated


def to_service_state(opt, key, mx_state) -> dict:
    """One key's state from MXNet's updater (a file from ``save_optimizer_states``) for the service."""
    if mx_state is None:
        return {}
    layout = _state_layout(opt)
    if layout is not None:
        names, as_tuple = layout
        arrays = list(mx_state) if as_tuple else [mx_state]
        if len(arrays) != len(names) or not all(isinstance(a, mx.nd.NDArray) for a in arrays):
            raise KVStoreError(f"pslink kvstore: the state of key {key!r} is not {type(opt).__name__}'s "
                               f"({', '.join(names)})", key=key)
        state = {name: np.ascontiguousarray(a.asnumpy()) for name, a in zip(names, arrays)}
        if type(opt) in _STEPPED:
            state["step"] = int(opt._index_update_count.get(key, 0))
        return state
    if isinstance(mx_state, (tuple, list)):  # SGD's
        raise KVStoreError(f"pslink kvstore: the state of key {key!r} holds a float32 master copy "
                           "(multi_precision), which the service does not keep", key=key)
    return {"momentum_buffer": -mx_state.asnumpy()}
