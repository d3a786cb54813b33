"""Keras callbacks of Horovod's ``hvd.keras.callbacks``, over the parameter service."""

from __future__ import annotations

import numbers

import keras
import numpy as np

from pslink.errors import ConfigError
from pslink.tf import horovod, variables
from pslink.tf.tape import ref
from pslink.tf.world import current_session


class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):
    """At the start of training, give every rank ``root_rank``'s model and optimizer variables
    (after checking that every rank has the same ones; if not, a ShapeMismatchError names the
    first variable that differs and both shapes), but ``local_variables``. Needed without
    ParameterServiceStrategy. ``device`` (Horovod's) changes nothing."""

    def __init__(self, root_rank: int = 0, device: str = "", local_variables=None):
        super().__init__()
        self.root_rank = root_rank
        self.device = device
        self.local_variables = {ref(v) for v in local_variables or ()}
        self.broadcast_done = False

    def on_train_begin(self, logs=None):
        if self.broadcast_done:
            return
        shared = list(self.model.weights)
        optimizer = getattr(self.model, "optimizer", None)
        if optimizer is not None and optimizer.built:
            shared += list(optimizer.variables)
        horovod.broadcast_variables([v for v in shared if ref(v) not in self.local_variables], self.root_rank)
        self.broadcast_done = True


class MetricAverageCallback(keras.callbacks.Callback):
    """At the end of each epoch, replace the numeric values in ``logs`` (loss, metrics,
    validation) by their mean over the ranks, before Keras prints or records them. Put it
    before callbacks that read the logs (it runs before Keras' own progress bar and History).
    ``device`` (Horovod's) changes nothing."""

    def __init__(self, device: str = ""):
        super().__init__()
        self.device = device

    def on_epoch_end(self, epoch, logs=None):
        if not logs:
            return
        names = sorted(k for k, v in logs.items() if _is_number(v))
        if not names:
            return
        session = current_session()
        if session.size == 1:
            return
        variables.check_once(session, [(n, "()", "float64") for n in names], "metrics", "MetricAverageCallback")
        values = np.array([float(logs[n]) for n in names], np.float64)
        mean = session.allreduce(values, name="MetricAverageCallback").wait(session.timeout)
        for name, value in zip(names, mean):
            logs[name] = float(value)


class LearningRateScheduleCallback(keras.callbacks.Callback):
    """Horovod's: from ``start_epoch`` until ``end_epoch`` (None: the end), the optimizer's
    learning rate is ``initial_lr * multiplier(epoch)``, set at each epoch's first batch
    (``staircase``), or at every batch with a fractional epoch (``staircase=False``; ``multiplier``
    must then be callable). A number as ``multiplier`` is a constant factor. The rate goes into the
    epoch's logs as ``lr``. ``momentum_correction`` is accepted and not applied: Keras 3 compiles an
    optimizer's momentum into its step as a constant."""

    def __init__(self, initial_lr: float, multiplier, start_epoch: int = 0, end_epoch: int | None = None,
                 staircase: bool = True, momentum_correction: bool = True, steps_per_epoch: int | None = None):
        super().__init__()
        if initial_lr is None:
            raise ConfigError("LearningRateScheduleCallback needs initial_lr (the rate the multiplier scales)")
        self.initial_lr, self.start_epoch, self.end_epoch = float(initial_lr), start_epoch, end_epoch
        self.staircase = staircase or not callable(multiplier)
        self.multiplier = multiplier if callable(multiplier) else (lambda epoch: multiplier)
        self.momentum_correction = momentum_correction
        self.steps_per_epoch = steps_per_epoch
        self.current_epoch = 0

    def on_train_begin(self, logs=None):
        if self.steps_per_epoch is None:
            self.steps_per_epoch = (self.params or {}).get("steps")
        if not self.staircase and not self.steps_per_epoch:
            raise ConfigError(f"{type(self).__name__}: steps_per_epoch is needed (Keras does not know it here)")

    def on_epoch_begin(self, epoch, logs=None):
        self.current_epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        epoch = self.current_epoch
        if epoch < self.start_epoch or self.end_epoch is not None and epoch >= self.end_epoch:
            return
        if self.staircase:
            if batch == 0:
                self._set(epoch)
        else:
            self._set(epoch + batch / self.steps_per_epoch)

    def _set(self, epoch: float) -> None:
        self.model.optimizer.learning_rate.assign(self.initial_lr * self.multiplier(epoch))

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            logs["lr"] = float(self.model.optimizer.learning_rate.numpy())


class LearningRateWarmupCallback(LearningRateScheduleCallback):
    """Horovod's warmup (Goyal et al., 2017): over ``warmup_epochs`` the learning rate rises from
    ``initial_lr / size`` to ``initial_lr`` (the rate scaled for ``size`` workers), batch by batch;
    ``verbose`` says when it is done."""

    def __init__(self, initial_lr: float, warmup_epochs: int = 5, momentum_correction: bool = True,
                 steps_per_epoch: int | None = None, verbose: int = 0):
        def multiplier(epoch: float) -> float:
            size = current_session().size
            # epoch + one step: each epoch ends on a round number of the ramp, as Horovod's does
            return (1.0 + (epoch + 1.0 / self.steps_per_epoch) * (size - 1) / warmup_epochs) / size

        super().__init__(initial_lr, multiplier, start_epoch=0, end_epoch=warmup_epochs, staircase=False,
                         momentum_correction=momentum_correction, steps_per_epoch=steps_per_epoch)
        self.verbose = verbose

    def on_epoch_end(self, epoch, logs=None):
        super().on_epoch_end(epoch, logs)
        if self.verbose and epoch == self.end_epoch - 1:
            print(f"\nEpoch {epoch + 1}: finished gradual learning rate warmup to "
                  f"{float(self.model.optimizer.learning_rate.numpy()):g}.")


class BestModelCheckpoint(keras.callbacks.ModelCheckpoint):
    """Horovod's: a ``ModelCheckpoint`` that keeps the best model only (``save_best_only``), whose
    ``filepath`` may be given later (``callback.filepath = ...``, before ``fit``)."""

    def __init__(self, monitor: str = "val_loss", verbose: int = 0, save_weights_only: bool = False,
                 mode: str = "auto", save_freq="epoch", filepath: str | None = None):
        # Keras checks the path's suffix when the callback is made; a stand-in passes that check.
        stand_in = "best.weights.h5" if save_weights_only else "best.keras"
        super().__init__(filepath=filepath or stand_in, monitor=monitor, verbose=verbose, save_best_only=True,
                         save_weights_only=save_weights_only, mode=mode, save_freq=save_freq)
        if filepath is None:
            self.filepath = None

    def on_train_begin(self, logs=None):
        if not self.filepath:
            raise ConfigError("BestModelCheckpoint has no filepath: set callback.filepath (a .keras file, or "
                              ".weights.h5 with save_weights_only=True) before fit")
        return super().on_train_begin(logs)


def _is_number(value) -> bool:
    if isinstance(value, numbers.Number) and not isinstance(value, bool):
        return True
    shape = getattr(value, "shape", None)
    return shape is not None and tuple(shape) == () and np.issubdtype(np.asarray(value).dtype, np.number)


__all__ = ["BestModelCheckpoint", "BroadcastGlobalVariablesCallback", "LearningRateScheduleCallback", "LearningRateWarmupCallback",
           "MetricAverageCallback"]
