"""Elastic training in Horovod's style, the part every adapter shares: :class:`State`,
:class:`World` (noticing a change of the job's workers, settling, agreeing, syncing) and
:func:`run_elastic`. The adapters add their states (``pslink.torch.elastic.TorchState``,
``pslink.tf.elastic.TensorFlowKerasState``) and their ``run``; the design is described in
:mod:`pslink.torch.elastic`.

A World drives a *session*: the adapter's collectives over one Agent, offering ``agent``,
``rank``, ``size``, ``timeout``, ``capacity`` (the most workers the job may have),
``generation``, ``round(what)`` (a synchronous push-pull), ``set_world(ranks, generation)``
(renumber the ranks), ``reconnect()`` (register this rank anew), ``broadcast_object(obj,
root_rank, name=...)`` and ``abandon()`` (forget what is in flight).
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

from pslink.errors import ConfigError, MembershipError, PslinkError, ShapeMismatchError

log = logging.getLogger("pslink.elastic")

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
        self._world: World | None = None

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

    def _elastic_session(self):
        """The session of the :func:`run_elastic` this state is in."""
        if self._world is None:
            raise ConfigError("this elastic state is not in an elastic run yet: call the function decorated with "
                              "hvd.elastic.run")
        return self._world.session

    def on_reset(self) -> None:
        for callback in self._reset_callbacks:
            callback()

    def commit(self) -> None:
        """Save the state, then raise :class:`HostsUpdatedInterrupt` if the job's workers changed
        (every worker the same way, at the same commit). Cheap: one tiny push-pull.

        If a worker was lost since the last commit, the steps since then are not saved: their
        rounds may have closed without it (a sum short of its share), so every worker goes back
        to the last commit and the new world does them again. Workers that only joined leave
        those steps whole (a newcomer takes part in rounds from the next reset), so they are
        saved first."""
        change = self._interrupt_if_lost()
        self.commits += 1
        self.save()
        if change is not None:
            raise HostsUpdatedInterrupt(f"the workers of job {self._world.session.agent.job!r} changed")

    def check_host_updates(self) -> None:
        """Raise :class:`HostsUpdatedInterrupt` if the workers changed since the last reset (after
        going back to the last commit if one was lost: see :meth:`commit`)."""
        if self._interrupt_if_lost() is not None:
            raise HostsUpdatedInterrupt(f"the workers of job {self._world.session.agent.job!r} changed")

    def _interrupt_if_lost(self) -> str | None:
        """The world's change since the last reset; if a worker was lost, back to the last commit
        and :class:`HostsUpdatedInterrupt` (the rule :meth:`commit` explains)."""
        change = self._world.change() if self._world is not None else None
        if change == "lost":
            self.restore()
            raise HostsUpdatedInterrupt(f"a worker of job {self._world.session.agent.job!r} was lost; back to "
                                        "the last commit")
        return change

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
        session = self._elastic_session()
        extras = session.broadcast_object(self._save_extras() if session.rank == root_rank else None, root_rank,
                                          name=sync_name(session, "extras"))
        self._restore_extras(extras)
        self._synced = True


def capacity(agent, size: int) -> int:
    """The most workers a job may have (its ``max_workers``, else as many as it has or had): sizes
    the keys whose shape would otherwise follow the number of workers (the join vector, unnamed
    gathers), so that they keep their shape when that number changes."""
    return max(int(agent.settings.get("max_workers") or 0), agent.num_workers, size)


def sync_name(session, what: str) -> str:
    # Keys of one generation: every member of the new world is in them from their first round.
    return f"elastic.g{session.generation}/{what}"


class World:
    """One worker's view of the job's workers, as agreed at the last reset."""

    def __init__(self, session):
        self.session = session
        self.ranks: list[int] = []
        self.epoch = -1
        self.checked_agent = None  # the Agent whose registration was checked (see _check_fresh)

    @property
    def agent(self):
        return self.session.agent

    def change(self) -> str | None:
        """One push-pull, the same answer on every member: "lost" if a worker of this world is
        missing, "joined" if someone saw a newer membership (a worker registered) or an
        unexpected rank took part, None if nothing changed."""
        vector = np.zeros(self.session.capacity, np.int64)
        vector[self.agent.rank] = max(self.agent.epoch, self.epoch) + 1
        seen = self.session.round("elastic commit")(COMMIT_KEY, vector, vector)
        present = [int(r) for r in np.flatnonzero(seen)]
        if any(r not in present for r in self.ranks):
            return "lost"
        return "joined" if present != self.ranks or int(seen.max()) - 1 > self.epoch else None

    def changed(self) -> bool:
        return self.change() is not None

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
        self.session.abandon()
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
        # The job's keys are not empty once it trains; this process's own use of them shows that it
        # took part already (an elastic run started after other collectives): it is no newcomer.
        if not agent.late and not agent.keys_known and agent.job_keys():
            log.info("pslink elastic: rank %d takes over from a worker that left; registering anew", agent.rank)
            self.session.reconnect()
            agent = self.session.agent
        # Only once checked: a check that failed (pMaster out of reach) is made again at the next
        # reset, else the process would go on as the dead worker, whose rounds the others wait in.
        self.checked_agent = agent

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
def exit_on_sigterm():
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


def reconnector(agent) -> Callable[..., Any]:
    """How to register ``agent``'s rank again: the same job, service and settings."""
    from pslink.core.worker.connect import connect

    options = dict(mode=agent.mode, timeout=agent.timeout)
    max_workers = agent.settings.get("max_workers")
    if max_workers:
        options["max_workers"] = max_workers

    def connect_again(token: bytes, rejoin: bool = False):
        return connect(agent.job, agent.rank, agent.num_workers, agent.master_address, token=token, rejoin=rejoin,
                       **options)

    return connect_again


def register_again(old, connect: Callable[..., Any] | None = None):
    """Register ``old``'s rank again with a new Agent (``connect(token, rejoin=True)``, by default
    :func:`reconnector`'s), which comes into the running job as a late worker; close ``old``.

    The new Agent registers with ``rejoin``: pMaster takes the rank out of the job (the rounds
    and barriers stop waiting for the old Agent) and adds it back as a newcomer in one step.
    Leaving first and registering after would leave a moment in which the others see a job
    without this rank: they could settle a world without it and create the keys of that world's
    sync, which would then wait for this rank (a member again from their first round) while it
    waits for them in the settle barrier, until the timeout."""
    connect = connect or reconnector(old)
    try:
        new = connect(old.token, rejoin=True)
    except BaseException:
        try:
            old.close()  # as before a failed registration: out of the job, so nobody waits for it
        except PslinkError:
            pass
        raise
    try:
        old.close(leave=False)  # the new Agent holds the rank now: leaving would take it out
    except PslinkError:
        pass
    return new


def run_elastic(func: Callable, current_session: Callable[[], Any], what: str) -> Callable:
    """Decorate ``train(state, ...)``: the first call and every membership change sync the
    state; a failure restores the last commit. ``current_session()`` is the adapter's session
    (see the module's notes); ``what`` names the adapter's states in errors."""

    @functools.wraps(func)
    def wrapper(state: State, *args, **kwargs):
        if not isinstance(state, State):
            raise ConfigError(f"{func.__name__}: the first argument must be a {what} elastic State, got "
                              f"{type(state).__name__}")
        session = current_session()
        if state._world is None or state._world.session is not session:
            state._world = World(session)
        world = state._world
        failures = 0
        with exit_on_sigterm():
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
