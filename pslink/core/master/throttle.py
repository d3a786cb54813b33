"""pMaster's migration throttle (a mixin of :class:`pslink.core.master.Master`).

A migration's copy (TENSOR_COPY) lands in one round boundary of its job: the source hands the
task's state over when the round closes, and the round after waits for it. Moving a whole job's
state at once stalls that one iteration by the time it takes to copy all of it. So pMaster lets at
most ``max_migration_bytes`` of task state (weights, plus as much again of optimizer state in
optimizer mode) be in flight at a time -- at least one task always -- and queues the other moves;
the next queued one starts as soon as room frees: a running migration's copy landed
(TENSOR_COPY_DONE), or it ended otherwise (failed, abandoned, or its job ended). Spread over rounds, each iteration carries a bounded copy.

A queued move is in flight for everyone else: its source and target are not released, status
lists it (``"queued": True``), and the control plane already placed the task on its target.
"""

from __future__ import annotations

import logging

from pslink.core.master.control import Migrate
from pslink.core.wire.protocol import DTYPES
from pslink.core.master.recovery import holdings
from pslink.errors import ServiceError

log = logging.getLogger("pslink.core.master.master")

DEFAULT_MAX_MIGRATION_BYTES = 16 << 20


class MasterThrottle:
    """Requires of its host: ``state``, ``migrations``, ``_queued_moves``, ``_aggregator_peers``,
    ``_start_migration``, ``_migration_over``, ``_removal_failed``, ``_resource_copy`` and
    ``_release_after``/``_release``."""

    def _init_throttle(self, max_migration_bytes: int | None) -> None:
        self.max_migration_bytes = DEFAULT_MAX_MIGRATION_BYTES if max_migration_bytes is None else max_migration_bytes
        self._throttled: dict[tuple, Migrate] = {}  # task -> its move, waiting for room (in arrival order)
        self.state.control.moving_jobs = self._moving_jobs

    def _migration_bytes(self, task: tuple) -> int:
        """The task state a move of ``task`` copies (0 for a task pMaster does not know)."""
        job, key, part = task
        record = self.state.jobs.get(job)
        spec = record.keys.get(key) if record is not None else None
        if spec is None or part >= len(spec.parts):
            return 0
        start, end = spec.parts[part].span
        size = (end - start) * DTYPES[spec.dtype].itemsize
        return 2 * size if record.optimizer else size

    def _copying_bytes(self) -> int:
        # A move whose copy landed (TENSOR_COPY_DONE) copies nothing more: it waits for the workers.
        return sum(e.get("bytes", 0) for e in self.migrations.values() if not e["copied"])

    def _migrate(self, action: Migrate) -> None:
        if action.task in self.migrations:
            # Still moving (onto this move's source): one copy of a task in flight at a time.
            self._queued_moves[action.task] = action
            return
        waiting = self._throttled.get(action.task)
        if waiting is not None:
            # Moved again before its first move began: one move, from where it is to the new place.
            if waiting.source == action.target:
                del self._throttled[action.task]
                self._moves_settled([waiting.source, waiting.target])
            else:
                self._throttled[action.task] = Migrate(action.task, waiting.source, action.target, action.reason)
                self._moves_settled([waiting.target])
            return
        self._throttled[action.task] = action
        self._start_throttled()

    def _start_throttled(self) -> None:
        """Start queued moves, oldest first, while they fit (one at least when none runs)."""
        while self._throttled:
            task, action = next(iter(self._throttled.items()))
            size = self._migration_bytes(task)
            if self.migrations and self._copying_bytes() + size > self.max_migration_bytes:
                return
            del self._throttled[task]
            self._start_migration(action, size)

    def _moving(self, name: str) -> bool:
        """A migration off or onto ``name`` runs or waits (queued behind the throttle or another move)."""
        return any(name in (e["source"], e["target"]) for e in self.migrations.values()) or \
            any(name in (a.source, a.target) for a in self._throttled.values()) or \
            any(name in (a.source, a.target) for a in self._queued_moves.values())

    def _moving_jobs(self) -> set[str]:
        """Jobs with a task moving: migrating, queued, or waiting for its new Aggregator to start
        (the control plane's guard leaves them be until their moves are over)."""
        tasks = [*self.migrations, *self._throttled, *self._queued_moves]
        return {task[0] for task in tasks} | self.state.control.jobs_waiting_to_move()

    def _moves_settled(self, names) -> None:
        """Moves involving ``names`` ended: release those waiting for it; sources may be idle now."""
        for name in dict.fromkeys(names):
            waiting = self._release_after.get(name)
            if waiting is not None and not self._moving(name) and not self._replicas_moving(name):
                del self._release_after[name]
                self._release(waiting)
        if not self.migrations and not self._throttled:
            # Sources that kept tasks until their migrations were under way may be empty now.
            # Judged once this turn is over, not now: a failover abandons the moves onto a lost
            # target before it re-homes their tasks (back on their source, or on a replica).
            self.reactor.post(self._release_idle)

    def _release_idle(self) -> None:
        if not self.migrations and not self._throttled:
            # Whatever pMaster's jobs place on an Aggregator keeps it, also where the plan does not
            # count it (yet): a part a failover gave back to its source. Replica holders the
            # control plane keeps by itself (ControlPlane.replica_holders).
            holding = {name for name, count in holdings(self.state.jobs).items() if count}
            self.state.outbox += self.state.control.release_idle("emptied by migrations", keep=holding)
            self._carry_out()

    def _drop_throttled(self, job: str | None = None, aggregator: str | None = None) -> list[Migrate]:
        """Take queued moves of ``job``, or off or onto ``aggregator``, out of the queue."""
        dropped = [a for t, a in self._throttled.items()
                   if t[0] == job or aggregator in (a.source, a.target)]
        for action in dropped:
            del self._throttled[action.task]
        return dropped

    def _abandon_moves_of(self, name: str) -> dict[tuple, str]:
        """Aggregator ``name`` is gone: migrations off or onto it will not end by themselves.
        Returns the tasks that were moving onto it and whose copy was not known to have landed,
        each with its source: that may still be serving the task (a move waits for the round
        under way to close), so the failover offers it the task before promoting a replica.
        A move off it that may have handed its task over (its target was told to expect the
        copy) goes on instead, with a replica sending the copy (``_resource_copy``)."""
        for action in self._drop_throttled(aggregator=name):
            self._start_migration(action, 0)  # fails at once (not connected): the plan goes back
        stays = {}
        resourced = False
        for task, entry in [(t, e) for t, e in self.migrations.items() if name in (e["source"], e["target"])]:
            if entry["source"] == name != entry["target"] and entry["assigned"] and not entry["copied"]:
                # Workers may already queue at the target, for a copy that will never come.
                self._resource_copy(name, task, entry)
                resourced = True
                continue
            log.warning("pMaster: abandoning the migration of %s: %s is gone", task, name)
            if entry["target"] == name and not entry["copied"]:
                stays[task] = entry["source"]
                # A removal draining the source fails: it keeps the task (and the pool, it).
                self._removal_failed(entry["source"], task, name, ServiceError(f"{name} is gone"))
            self._migration_over(task, failed=True)
        if resourced:
            self._moves_settled([name])  # as for an abandoned move: a release waiting for it goes on
        self._start_throttled()
        return stays

    def _migration_status(self, now: float) -> list[dict]:
        moving = [
            {"job": t[0], "key": t[1], "part": t[2], "source": e["source"], "target": e["target"],
             "seconds": round(now - e["started"], 2), "copied": e["copied"], "reason": e["reason"],
             "queued": False, "bytes": e.get("bytes", 0)}
            for t, e in self.migrations.items()
        ]
        moving += [
            {"job": t[0], "key": t[1], "part": t[2], "source": a.source, "target": a.target, "seconds": 0.0,
             "copied": False, "reason": a.reason, "queued": True, "bytes": self._migration_bytes(t)}
            for t, a in [*self._throttled.items(), *self._queued_moves.items()]
        ]
        return moving
