"""Elastic training for TensorFlow in Horovod's style: ``pslink.tf.elastic.run`` with
``TensorFlowKerasState`` (a Keras model and its optimizer) or ``TensorFlowState`` (variables)::

    import pslink.tf as hvd
    hvd.init()
    state = hvd.elastic.TensorFlowKerasState(model, optimizer, epoch=0, batch=0)

    @hvd.elastic.run
    def train(state):
        for state.epoch in range(state.epoch, epochs):
            for state.batch in range(state.batch, batches):
                ...one step with hvd.DistributedGradientTape...
                state.commit()
            state.batch = 0

    train(state)

Run it with ``pslink launch --min-np A --max-np B``. The machinery is the one every adapter's
elastic jobs use (:mod:`pslink.core.worker.elastic`, described in :mod:`pslink.torch.elastic`),
driving the process's Session: at a commit every rank learns at once whether the workers
changed; then they settle, agree on the new world (ranks renumbered, ``hvd.rank()`` and
``hvd.size()`` follow), and the rank with the most commits gives its variables, its
optimizer's state and the attributes to the others; a worker that joins gets them before its
first step. A failed collective restores the last commit (inside a ``tf.function`` TensorFlow
keeps only the failure's text: ``run`` finds pslink's error behind it, :func:`pslink.tf.errors.original`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np
import tensorflow as tf

from pslink.core.worker.elastic import (
    HostsUpdatedInterrupt,
    ObjectState,
    State,
    run_elastic,
    sync_name,
)
from pslink.errors import ConfigError
from pslink.tf import collectives, errors, variables
from pslink.tf.world import current_session

__all__ = ["HostsUpdatedInterrupt", "ObjectState", "State", "TensorFlowKerasState", "TensorFlowState", "run"]


class TensorFlowState(State):
    """Some variables (``tf.Variable`` or Keras variables; default: TF1's global variables) and any
    picklable attributes: ``save`` copies their values, ``restore`` assigns them back, ``sync``
    gives every rank the root's (after checking that every rank has the same variables).
    ``session`` is Horovod's TF1 argument: graph-mode sessions are not supported here."""

    def __init__(self, variables=None, session=None, **kwargs: Any):
        if session is not None:
            raise ConfigError("TensorFlowState: TF1 sessions are not supported; use eager TensorFlow 2")
        super().__init__(**kwargs)
        self.variables = list(variables) if variables is not None else tf.compat.v1.global_variables()
        self.save()

    def _tracked(self) -> list:
        return self.variables

    def save(self) -> None:
        self._saved_values = [np.array(v.numpy(), copy=True) for v in self._tracked()]
        self._saved_extras = self._save_extras()

    def restore(self) -> None:
        for variable, value in zip(self._tracked(), self._saved_values):
            variable.assign(value)
        self._restore_extras(self._saved_extras)

    def sync(self, root_rank: int = 0) -> None:
        """Give every rank ``root_rank``'s variables and attributes."""
        session = self._elastic_session() if self._world is not None else current_session()
        root = session.rank == root_rank
        tracked = self._tracked()
        if tracked:
            entries = variables.describe_variables(tracked)
            variables.check_same(session, entries, sync_name(session, "vars"), "elastic state sync")
            named = [(sync_name(session, f"var/{name}"), tf.convert_to_tensor(v))
                     for (name, _, _), v in zip(entries, tracked)]
            values = collectives.broadcast_many(session, named, root_rank, "elastic state sync",
                                                sync_name(session, "vars"))
            for variable, value in zip(tracked, values):
                variable.assign(value)
        extras = session.broadcast_object(self._save_extras() if root else None, root_rank,
                                          name=sync_name(session, "extras"))
        self._restore_extras(extras)
        self._synced = True
        if self._world is None:
            # Called by hand, as Horovod's: restore() goes back to the synced state. (In an
            # elastic run the reset saves it, once it knows the sync held.)
            self.save()


class TensorFlowKerasState(TensorFlowState):
    """A built Keras model, its optimizer (``model.optimizer`` by default) and any picklable
    attributes (``epoch``, ``batch``, ...). The optimizer is built for the model's trainable
    variables if it was not yet, so that a newcomer receives the others' slots (momentum, ...)."""

    def __init__(self, model, optimizer=None, backend=None, **kwargs: Any):
        if not model.built:
            raise ConfigError("Model must be built first. Run `model.build(input_shape)`.")  # Horovod's words
        self.model = model
        self.optimizer = optimizer if optimizer is not None else getattr(model, "optimizer", None)
        super().__init__(variables=[], **kwargs)

    def _tracked(self) -> list:
        tracked = list(self.model.weights)
        optimizer = self.optimizer
        if optimizer is not None:
            if not optimizer.built:
                optimizer.build(self.model.trainable_variables)
            tracked += list(optimizer.variables)
        return tracked


def run(func: Callable) -> Callable:
    """Decorate ``train(state, ...)``: the first call and every membership change sync the
    state; a failure restores the last commit. See the module's notes."""

    @functools.wraps(func)
    def unwrapped(state, *args, **kwargs):
        try:
            return func(state, *args, **kwargs)
        except tf.errors.OpError as exc:
            behind = errors.original(exc)
            if behind is None:
                raise
            raise behind from exc

    return run_elastic(unwrapped, current_session, "pslink.tf.elastic (TensorFlowKerasState, TensorFlowState, "
                                                   "ObjectState)")
