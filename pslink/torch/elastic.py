"""Elastic training in Horovod's style: ``pslink.torch.elastic.run`` and ``TorchState``.

::

    import pslink.torch as hvd
    hvd.init()
    optimizer = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    state = hvd.elastic.TorchState(model, optimizer, epoch=0, batch=0)

    @hvd.elastic.run
    def train(state):
        for state.epoch in range(state.epoch, epochs):
            for state.batch in range(state.batch, batches):
                ...one step...
                if state.batch % 10 == 0:
                    state.commit()
            state.batch = 0

    train(state)

Membership itself lives in the core: pMaster keeps a membership epoch per job, rounds stop
waiting for a worker that left or died, and a worker that registers while the job runs comes
in as a late member. This module adds what a training loop needs on top:

- **Noticing a change, all at once.** ``commit()`` saves the state, then push-pulls a tiny
  vector in which every worker writes the newest membership epoch it has seen (replies carry
  it). Every worker gets the same sum, so all of them decide together, at the same commit,
  whether the world changed; if so ``HostsUpdatedInterrupt`` unwinds ``train``.
- **Settling the new world.** Every worker enters one barrier, again and again, until two
  releases in a row name the same members and epoch. The barrier waits for every member, so
  between two releases nobody pushes anything: a late worker ``join_all()``\\ s into every key
  there, and enters the next round of each with everybody else.
- **Agreeing and syncing.** One push-pull of ``elastic/world`` (a row per possible rank) says
  who is really there, a generation number (the highest seen, plus one) and the root: the
  member with the most commits, the lowest rank among equals (a newcomer never is the root
  while a trained worker remains). ``Session.set_world`` renumbers ``hvd.rank()`` and
  ``hvd.size()``; the root's model, optimizer state and counters are broadcast on keys named
  by the generation (fresh keys: every member is in them from their first round). If the
  membership changed meanwhile (the root died before its values went out, say), everybody
  restores the last commit and settles again.
- **Failures.** A collective that fails (a :class:`~pslink.errors.PslinkError` other than a
  configuration or shape error) makes the worker drop its gradients in flight, restore the last
  commit and, if the job has other members, register again as a newcomer (pMaster takes the rank
  out and back in at once: ``Session.reconnect``), so that their rounds stop waiting for it;
  then it settles with them.

Reset callbacks run after every sync (also the first), when ``hvd.size()`` is the new size.
"""

from __future__ import annotations

import copy
from typing import Any, Callable

import torch

from pslink.core.worker.elastic import HostsUpdatedInterrupt, ObjectState, State, run_elastic, sync_name
from pslink.torch import collectives
from pslink.torch.world import current_session

__all__ = ["HostsUpdatedInterrupt", "State", "ObjectState", "TorchState", "run"]


class TorchState(State):
    """A model, its optimizer and any picklable attributes (``epoch``, ``batch``, ...).

    ``save`` copies the model's ``state_dict`` (parameters and buffers), the optimizer's
    ``state_dict`` (momentum, Adam moments, learning rates) and the attributes; ``restore``
    puts them back; ``sync`` broadcasts the root's."""

    def __init__(self, model: torch.nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None,
                 **kwargs: Any):
        super().__init__(**kwargs)
        self.model = model
        self.optimizer = optimizer
        self.save()

    def save(self) -> None:
        self._saved_model = None if self.model is None else {
            name: tensor.detach().clone() for name, tensor in self.model.state_dict().items()}
        self._saved_optimizer = None if self.optimizer is None else copy.deepcopy(self.optimizer.state_dict())
        self._saved_extras = self._save_extras()

    def restore(self) -> None:
        if self.model is not None:
            self.model.load_state_dict(self._saved_model)
        if self.optimizer is not None:
            _abandon(self.optimizer)
            self.optimizer.load_state_dict(copy.deepcopy(self._saved_optimizer))
        self._restore_extras(self._saved_extras)

    def sync(self, root_rank: int = 0) -> None:
        """Give every worker ``root_rank``'s model, optimizer state and attributes."""
        session = self._elastic_session() if self._world is not None else current_session()
        root = session.rank == root_rank
        if self.model is not None:
            named = [(sync_name(session, f"model/{name}"), tensor) for name, tensor in self.model.state_dict().items()]
            with torch.no_grad():
                collectives.broadcast_parameters(session, named, root_rank, what=sync_name(session, "model"))
        if self.optimizer is not None:
            _abandon(self.optimizer)
            state = session.broadcast_object(self.optimizer.state_dict() if root else None, root_rank,
                                             name=sync_name(session, "optimizer"))
            if not root:
                self.optimizer.load_state_dict(state)
        extras = session.broadcast_object(self._save_extras() if root else None, root_rank,
                                          name=sync_name(session, "extras"))
        self._restore_extras(extras)
        self._synced = True


def _abandon(optimizer) -> None:
    """Forget a DistributedOptimizer's gradients in flight (their round was given up)."""
    sync = getattr(optimizer, "_pslink", None)
    if sync is not None:
        sync.abandon()


def run(func: Callable) -> Callable:
    """Decorate ``train(state, ...)``: the first call and every membership change sync the
    state; a failure restores the last commit. See the module's notes."""
    return run_elastic(func, current_session, "pslink.torch.elastic (TorchState, ObjectState)")
