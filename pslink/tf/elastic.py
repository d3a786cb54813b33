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

Run it with ``pslink launch --min-np A --max-np B``. The machinery is the one PyTorch's elastic
jobs use (:mod:`pslink.core.worker.elastic`, described in :mod:`pslink.torch.elastic`): at a commit every
worker learns at once whether the workers changed; then they settle, agree on the new world (ranks
renumbered, ``hvd.rank()`` and ``hvd.size()`` follow), and the worker with the most commits
gives its variables, its optimizer's state and the attributes to the others; a worker that joins
gets them before its first step. A failed collective restores the last commit.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from pslink.core.worker.elastic import HostsUpdatedInterrupt, ObjectState, State, run_elastic, sync_name
from pslink.errors import ConfigError
from pslink.tf import context

__all__ = ["HostsUpdatedInterrupt", "ObjectState", "State", "TensorFlowKerasState", "TensorFlowState", "run"]


class TensorFlowState(State):
    """Some variables (``tf.Variable`` or Keras variables) and any picklable attributes:
    ``save`` copies their values, ``restore`` assigns them back, ``sync`` gives every worker the
    root's (after checking that every worker has the same variables). ``session`` is Horovod's
    TF1 argument: graph-mode sessions are not supported here."""

    def __init__(self, variables=None, session=None, **kwargs: Any):
        if session is not None:
            raise ConfigError("TensorFlowState: TF1 sessions are not supported; use eager TensorFlow 2")
        if variables is None:
            raise ConfigError("TensorFlowState needs the variables to keep (TF2 has no global variables)")
        super().__init__(**kwargs)
        self.variables = list(variables)
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
        exchange = self._elastic_session()
        root = exchange.rank == root_rank
        exchange.broadcast_variables(self._tracked(), root_rank, scope=sync_name(exchange, "vars"),
                                     what="elastic state sync", prefix=sync_name(exchange, "tf.var"))
        extras = exchange.broadcast_object(self._save_extras() if root else None, root_rank,
                                           name=sync_name(exchange, "extras"))
        self._restore_extras(extras)
        self._synced = True


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
        variables = list(self.model.weights)
        optimizer = self.optimizer
        if optimizer is not None:
            if not optimizer.built:
                optimizer.build(self.model.trainable_variables)
            variables += list(optimizer.variables)
        return variables


def _session():
    return context.exchange()


def run(func: Callable) -> Callable:
    """Decorate ``train(state, ...)``: the first call and every membership change sync the
    state; a failure restores the last commit. See the module's notes."""
    return run_elastic(func, _session, "pslink.tf.elastic (TensorFlowKerasState, TensorFlowState, ObjectState)")
