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

import contextlib
import copy
import functools
import logging
import signal
import threading
from typing import Any, Callable

import numpy as np
import torch

from pslink.errors import ConfigError, MembershipError, PslinkError, ShapeMismatchError
from pslink.torch.session import Session

__all__ = ["HostsUpdatedInterrupt", "State", "ObjectState", "TorchState", "run"]

log = logging.getLogger(__name__)

WORLD_KEY = "elastic/world"
COMMIT_KEY = "elastic/commit"
RESET_BARRIER = "elastic/reset"
SETTLE_LIMIT = 100  # barrier releases before giving up (each one follows a membership change)
RESET_LIMIT = 20  # failed resets or failures without a commit in between before the error is raised


class HostsUpdatedInterrupt(RuntimeError):
    """The job's workers changed: raised by :meth:`State.commit` on every worker at the same
    commit; :func:`run` catches it, settles the new world, syncs and calls ``train`` again."""


class State:
    """What an elastic job keeps across membership changes: :meth:`commit` saves it (and looks
    for changes), :meth:`restore` goes back to the last commit, :meth:`sync` gives every worker
    the root's copy. Subclasses say what to save; extra attributes come from ``kwargs``."""

    def __init__(self, **kwargs: Any):
        reserved = sorted(set(kwargs) & {"model", "optimizer", "commits"})
        if reserved:
            raise ConfigError(f"elastic state attributes {reserved} are reserved; pick other names")
        self._extras = list(kwargs)
        for name, value in kwargs.items():
            setattr(self, name, value)
        self._reset_callbacks: list[Callable[[], None]] = []
        self.commits = 0  # commits so far (synced too): the progress that picks the root
        self._synced = False  # has this worker's state ever come from a sync (or been the root)?
        self._world: _World | None = None

    # -- what Horovod's State offers ------------------------------------------------------------

    def register_reset_callbacks(self, callbacks) -> None:
        """Call these (no arguments) after every reset, once the state is synced and
        ``hvd.size()`` / ``hvd.rank()`` are those of the new world (e.g. to scale the learning
        rate or re-shard the data)."""
        if callable(callbacks):
            callbacks = [callbacks]
        callbacks = list(callbacks)
        if not all(callable(fn) for fn in callbacks):
            raise ConfigError("register_reset_callbacks takes callables (or a list of them)")
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        for callback in self._reset_callbacks:
            callback()

    def commit(self) -> None:
        """Save the state, then raise :class:`HostsUpdatedInterrupt` if the job's workers changed
        (every worker the same way, at the same commit). Cheap: one tiny push-pull."""
        self.commits += 1
        self.save()
        self.check_host_updates()

    def check_host_updates(self) -> None:
        """Raise :class:`HostsUpdatedInterrupt` if the workers changed since the last reset."""
        if self._world is not None and self._world.changed():
            raise HostsUpdatedInterrupt(f"the workers of job {self._world.session.agent.job!r} changed")

    def save(self) -> None:
        raise NotImplementedError

    def restore(self) -> None:
        raise NotImplementedError

    def sync(self, root_rank: int = 0) -> None:
        raise NotImplementedError

    # -- the extra attributes -------------------------------------------------------------------

    def _save_extras(self) -> dict:
        names = self._extras + ["commits"]
        return {name: copy.deepcopy(getattr(self, name)) for name in names}

    def _restore_extras(self, saved: dict) -> None:
        for name, value in saved.items():
            setattr(self, name, copy.deepcopy(value))


class ObjectState(State):
    """Only picklable attributes (``ObjectState(epoch=0, batch=0)``), as Horovod's ObjectState."""

    def __init__(self, **kwargs: Any):
        super().__init__(**kwargs)
        self.save()

    def save(self) -> None:
        self._saved_extras = self._save_extras()

    def restore(self) -> None:
        self._restore_extras(self._saved_extras)

    def sync(self, root_rank: int = 0) -> None:
        session = _session()
        extras = session.broadcast_object(self._save_extras() if session.rank == root_rank else None, root_rank,
                                          name=_sync_name(session, "extras"))
        self._restore_extras(extras)
        self._synced = True


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
        session = _session()
        root = session.rank == root_rank
        if self.model is not None:
            named = [(_sync_name(session, f"model/{name}"), tensor) for name, tensor in self.model.state_dict().items()]
            with torch.no_grad():
                session.broadcast_parameters(named, root_rank)
        if self.optimizer is not None:
            _abandon(self.optimizer)
            state = session.broadcast_object(self.optimizer.state_dict() if root else None, root_rank,
                                             name=_sync_name(session, "optimizer"))
            if not root:
                self.optimizer.load_state_dict(state)
        extras = session.broadcast_object(self._save_extras() if root else None, root_rank,
                                          name=_sync_name(session, "extras"))
        self._restore_extras(extras)
        self._synced = True


def _abandon(optimizer) -> None:
    """Forget a DistributedOptimizer's gradients in flight (their round was given up)."""
    sync = getattr(optimizer, "_pslink", None)
    if sync is not None:
        sync.abandon()


def _session() -> Session:
    from pslink.torch.horovod import current_session

    return current_session()


def _sync_name(session: Session, what: str) -> str:
    # Keys of one generation: every member of the new world is in them from their first round.
    return f"elastic.g{session.generation}/{what}"


class _World:
    """One worker's view of the job's workers, as agreed at the last reset."""

    def __init__(self, session: Session):
        self.session = session
        self.ranks: list[int] = []
        self.epoch = -1
        self.checked_agent = None  # the Agent whose registration was checked (see _check_fresh)

    @property
    def agent(self):
        return self.session.agent

    def changed(self) -> bool:
        """One push-pull, the same answer on every member: did anyone see a newer epoch, or is
        anyone missing?"""
        vector = np.zeros(self.session.capacity, np.int64)
        vector[self.agent.rank] = max(self.agent.epoch, self.epoch) + 1
        seen = self.session.round("elastic commit")(COMMIT_KEY, vector, vector)
        present = [int(r) for r in np.flatnonzero(seen)]
        return present != self.ranks or int(seen.max()) - 1 > self.epoch

    def reset(self, state: State) -> None:
        """Settle the members, agree on the world, sync the state from the root, save it."""
        failures = 0
        for _ in range(SETTLE_LIMIT):
            try:
                self._check_fresh()
                ranks, epoch = self._settle()
                agreed = self._agree(ranks, state)
                if agreed is None:
                    continue  # someone settled with us is not there any more
                generation, root = agreed
                before = getattr(self.session, "generation", 0)
                self.session.set_world(ranks, generation)
                self.ranks, self.epoch = ranks, epoch
                state.sync(root)
                if self.changed():
                    # The membership moved under the sync (the root may have died before its values
                    # went out): go back to the last commit and settle again, all of us.
                    log.info("pslink elastic: the workers changed during the sync; settling again")
                    state.restore()
                    continue
                state.save()
                log.info("pslink elastic: rank %d of %d (service ranks %s, generation %d, root %d)",
                         self.session.rank, self.session.size, ranks, generation, root)
                if self.session.rank == 0:
                    self._delete_generations_before(generation, before)
                return
            except PslinkError as exc:
                failures += 1
                if not recoverable(exc) or failures > RESET_LIMIT:
                    raise
                self.recover(state, exc)
        raise MembershipError(f"the workers of job {self.agent.job!r} kept changing: no reset completed in "
                              f"{SETTLE_LIMIT} attempts")

    def _delete_generations_before(self, generation: int, last: int) -> None:
        """Delete the keys of the generations before ``generation`` (every member agreed on it, so
        none uses them any more): each generation's state sync and unnamed collectives made a
        model's worth of keys of their own, which would otherwise stay on the service for the
        job's life. Cleanup: a failure is logged, training goes on."""
        stale = [f"elastic.g{g}/" for g in range(min(last, generation - 1), generation)] + \
                [f".noname.g{g}." for g in range(min(last, generation - 1), generation)]
        try:
            keys = [spec["key"] for spec in self.agent.job_keys()
                    if isinstance(spec["key"], str) and any(s in spec["key"] for s in stale)]
            if keys:
                self.agent.delete(keys)
                log.info("pslink elastic: deleted %d key(s) of generation(s) before %d", len(keys), generation)
        except PslinkError as exc:
            log.warning("pslink elastic: could not delete the keys of earlier generations: %s", exc.message)

    def recover(self, state: State, error: PslinkError) -> None:
        """After a failed collective: back to the last commit; if others remain, come back as a
        newcomer (out of the job and in again, in one step) so that their rounds stop waiting
        for us."""
        log.warning("pslink elastic: %s; restoring the last commit", error)
        state.restore()
        for optimizer in self.session.optimizers:
            _abandon(optimizer)
        agent = self.agent
        removed = isinstance(error, MembershipError) or agent.closed
        others = [r for r in (self.ranks or []) if r != agent.rank]
        if removed or others:
            self.session.reconnect()
            self.checked_agent = self.session.agent

    def _check_fresh(self) -> None:
        """A new process that registered under the rank of one that died moments ago (pMaster
        has not removed it yet) is taken for that worker, at its rounds: register again, which
        makes it a newcomer and ends the old one's part in the rounds (one step at pMaster: see
        ``Session.reconnect``). Only a running job has keys, and no initial worker can see any:
        the first reset's barrier waits for all of them."""
        agent = self.agent
        if self.checked_agent is agent:
            return
        self.checked_agent = agent
        if agent.late:
            return
        if agent.job_keys():  # the job's keys: not empty once it trains
            log.info("pslink elastic: rank %d takes over from a worker that left; registering anew", agent.rank)
            self.session.reconnect()
            self.checked_agent = self.session.agent

    def _settle(self) -> tuple[list[int], int]:
        """Barriers until two releases in a row agree: nobody pushes between releases, so late
        workers join every key there."""
        previous = None
        for _ in range(SETTLE_LIMIT):
            body = self.agent.barrier(RESET_BARRIER, timeout=self.session.timeout)
            current = (sorted(int(r) for r in body["ranks"]), int(body["epoch"]))
            if current == previous:
                return current
            if self.agent.late:
                self.agent.join_all(self.session.timeout)
            previous = current
        raise MembershipError(f"the workers of job {self.agent.job!r} kept changing for {SETTLE_LIMIT} barriers")

    def _agree(self, ranks: list[int], state: State) -> tuple[int, int] | None:
        """(generation, root's rank in the new world), or None if not every member took part."""
        session = self.session
        rows = np.zeros((session.capacity, 3), np.int64)
        rows[self.agent.rank] = [1, state.commits + 1 if state._synced else 0, session.generation]
        rows = session.round("elastic reset")(WORLD_KEY, rows, rows)
        present = [int(r) for r in np.flatnonzero(rows[:, 0])]
        if present != ranks:
            log.info("pslink elastic: settled on %s but %s took part; settling again", ranks, present)
            return None
        progress = rows[:, 1]
        root = min(r for r in present if progress[r] == progress.max())
        return int(rows[:, 2].max()) + 1, ranks.index(root)


def recoverable(error: BaseException) -> bool:
    """Errors a reset can cure: not the program's own mistakes."""
    return isinstance(error, PslinkError) and not isinstance(error, (ConfigError, ShapeMismatchError))


@contextlib.contextmanager
def _exit_on_sigterm():
    """``pslink launch`` removes a worker with SIGTERM: exit through Python (atexit leaves the
    job at once, so the others need not wait for a heartbeat timeout)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def terminate(signum, frame):
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def run(func: Callable) -> Callable:
    """Decorate ``train(state, ...)``: the first call and every membership change sync the
    state; a failure restores the last commit. See the module's notes."""

    @functools.wraps(func)
    def wrapper(state: State, *args, **kwargs):
        if not isinstance(state, State):
            raise ConfigError(f"{func.__name__}: the first argument must be a pslink.torch.elastic State "
                              f"(TorchState, ObjectState), got {type(state).__name__}")
        session = _session()
        if state._world is None or state._world.session is not session:
            state._world = _World(session)
        world = state._world
        failures = 0
        with _exit_on_sigterm():
            while True:
                commits = state.commits
                world.reset(state)
                state.on_reset()
                try:
                    return func(state, *args, **kwargs)
                except HostsUpdatedInterrupt:
                    log.info("pslink elastic: the workers changed; resetting")
                    failures = 0
                except PslinkError as exc:
                    failures = 0 if state.commits > commits else failures + 1
                    if not recoverable(exc) or failures > RESET_LIMIT:
                        raise
                    world.recover(state, exc)

    return wrapper
