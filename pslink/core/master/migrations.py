"""The life of a task's migration (AutoPS 3.2 and Appendix B), as a pure core: events in, actions
out, no I/O and no clock of its own. pMaster and the simulator drive the same object.

A move's steps, and who reports them:

1. ``request(Migrate)``: the control plane moved the task in its plan. One move per task runs at
   a time (a second waits behind it, ``follow_ups``); a task moved again before its move began
   goes straight from where it is to the new place. Moves wait behind the **throttle**: at most
   ``max_bytes`` of task state (weights, and as much again of optimizer state) are being copied
   at once, at least one move always, so a job's iteration carries a bounded copy.
2. :class:`Begin`: the target is told to expect the task (ASSIGN); ``target_ready(task, ok)``.
3. :class:`HandOver`: the source is told to hand it over when its current round closes (MIGRATE);
   ``handed_over(task, ok)``. :class:`Routed`: new lookups go to the target from here on, and a
   move whose round never closes is forced after a while (``deadline(task)`` ->
   ``HandOver(force=True)``).
4. ``copy_done(task)`` (TENSOR_COPY_DONE: the state is across, room for the next copy) and
   ``workers_done(task)`` (WORKER_DONE: every worker has pushed to the target): then
   :class:`Finished` (``why="done"``) and the next move of the task, if one waits.

When an Aggregator is lost (``aggregator_lost``), moves onto it are abandoned (the failover
places the task: on its source if that still serves it, ``stays``), and a move off it whose
source may have handed the task over goes on with a replica sending the copy
(:class:`CopyFromReplica`; ``resourced``, then ``copy_done`` or ``abandon``). A job that ends
takes its moves with it. Each ending says which Aggregators are no longer part of a move
(:class:`Settle`): releases that waited for them may go.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from pslink.core.master.actions import Migrate
from pslink.core.wire.protocol import DTYPES

DEFAULT_MAX_MIGRATION_BYTES = 16 << 20


@dataclasses.dataclass
class Move:
    """A migration under way."""

    task: tuple  # (job, key, part)
    source: str  # who sends the copy (a replica, once the source is lost: see CopyFromReplica)
    target: str
    reason: str
    bytes: int = 0  # task state it copies
    started: float = 0.0  # when it began (the driver's clock)
    assigned: bool = False  # the target expects the task: the source may hand it over from here on
    routed: bool = False  # the source took the order: lookups go to the target
    copied: bool = False
    workers: bool = False
    held_replica: bool = False  # the target held a replica of the part when the move began


@dataclasses.dataclass(frozen=True)
class Begin:
    """Tell ``move.target`` to expect the task (then report ``target_ready``)."""

    move: Move


@dataclasses.dataclass(frozen=True)
class HandOver:
    """Tell ``move.source`` to hand the task over at its round's end, or now (``force``)."""

    move: Move
    force: bool = False


@dataclasses.dataclass(frozen=True)
class Routed:
    """The source took the order: point lookups at the target; arm ``deadline(task)``."""

    move: Move


@dataclasses.dataclass(frozen=True)
class CopyFromReplica:
    """``lost`` was the source and may have handed the task over: a replica sends the copy."""

    move: Move
    lost: str


@dataclasses.dataclass(frozen=True)
class Finished:
    """A move is over. ``why``: ``done``; ``failed`` (it could not start or was refused: the plan
    goes back to the source); ``abandoned`` (an Aggregator of it is gone: the failover places
    the task); ``ended`` (its job ended)."""

    move: Move
    why: str


@dataclasses.dataclass(frozen=True)
class Dropped:
    """A move that never began is off. ``why``: ``ended`` (its job ended, or the task was moved
    back before it began); ``failed`` (an Aggregator of it is gone: the plan goes back to its
    source); ``preceded`` (the move of the task before it did not finish: the task is where that
    one left it)."""

    action: Migrate
    why: str


@dataclasses.dataclass(frozen=True)
class Settle:
    """These Aggregators are part of fewer moves now (releases waiting for them may go)."""

    names: tuple


class Migrations:
    """Every move pMaster has under way or waiting. ``size_of(task)``: the bytes a move of it
    copies."""

    def __init__(self, size_of: Callable[[tuple], int], max_bytes: int = DEFAULT_MAX_MIGRATION_BYTES):
        self.size_of = size_of
        self.max_bytes = max_bytes
        self.running: dict[tuple, Move] = {}
        self.throttled: dict[tuple, Migrate] = {}  # waiting for room, in arrival order
        self.follow_ups: dict[tuple, Migrate] = {}  # the next move of a task still moving
        self.done = 0

    # -- views ------------------------------------------------------------------------------------

    def copying_bytes(self) -> int:
        # A move whose copy landed copies nothing more: it waits for the workers.
        return sum(m.bytes for m in self.running.values() if not m.copied)

    def moving(self, name: str) -> bool:
        """A move off or onto ``name`` runs or waits."""
        return any(name in (m.source, m.target) for m in self.running.values()) or any(
            name in (a.source, a.target) for a in (*self.throttled.values(), *self.follow_ups.values()))

    def moving_jobs(self) -> set[str]:
        return {task[0] for task in (*self.running, *self.throttled, *self.follow_ups)}

    def idle(self) -> bool:
        return not self.running and not self.throttled

    def status(self, now: float) -> list[dict]:
        """Running moves, then waiting ones (``queued``), as ``pslink service status`` shows them."""
        moving = [
            {"job": m.task[0], "key": m.task[1], "part": m.task[2], "source": m.source, "target": m.target,
             "seconds": round(now - m.started, 2), "copied": m.copied, "reason": m.reason, "queued": False,
             "bytes": m.bytes}
            for m in self.running.values()
        ]
        moving += [
            {"job": t[0], "key": t[1], "part": t[2], "source": a.source, "target": a.target, "seconds": 0.0,
             "copied": False, "reason": a.reason, "queued": True, "bytes": self.size_of(t)}
            for t, a in [*self.throttled.items(), *self.follow_ups.items()]
        ]
        return moving

    # -- events -----------------------------------------------------------------------------------

    def request(self, action: Migrate, now: float) -> list:
        """The plan moved ``action.task`` from ``action.source`` to ``action.target``."""
        task = action.task
        if task in self.running:
            self.follow_ups[task] = action  # one copy of a task in flight at a time
            return []
        waiting = self.throttled.get(task)
        if waiting is not None:
            # Moved again before its first move began: one move, from where it is to the new place.
            if waiting.source == action.target:
                del self.throttled[task]
                return [Dropped(waiting, "ended"), Settle((waiting.source, waiting.target))]
            self.throttled[task] = Migrate(task, waiting.source, action.target, action.reason)
            return [Settle((waiting.target,))]
        self.throttled[task] = action
        return self._start(now)

    def target_ready(self, task: tuple, ok: bool, now: float) -> list:
        move = self.running.get(task)
        if move is None:
            return []  # abandoned meanwhile
        if not ok:
            return self._end(task, "failed", now)
        move.assigned = True
        return [HandOver(move)]

    def handed_over(self, task: tuple, source: str, ok: bool, now: float) -> list:
        """``source`` answered the hand-over order (ignored if the move changed source since)."""
        move = self.running.get(task)
        if move is None or move.source != source:
            return []
        if not ok:
            return self._end(task, "failed", now)
        move.routed = True
        return [Routed(move)]

    def deadline(self, task: tuple) -> list:
        """No round of a routed move closed in time: have its source hand the task over now."""
        move = self.running.get(task)
        if move is None or move.copied:
            return []
        return [HandOver(move, force=True)]

    def copy_done(self, task: tuple, now: float) -> list:
        move = self.running.get(task)
        if move is None:
            return []
        move.copied = True
        return self._start(now) + self._maybe_done(move, now)

    def workers_done(self, task: tuple, now: float) -> list:
        move = self.running.get(task)
        if move is None:
            return []
        move.workers = True
        return self._maybe_done(move, now)

    def resourced(self, task: tuple, replica: str) -> None:
        """A replica sends the copy of a move whose source is lost: it is the move's source now."""
        move = self.running.get(task)
        if move is not None:
            move.source = replica

    def abandon(self, task: tuple, now: float, why: str = "failed") -> list:
        """The driver gives a move up (its source is gone and no replica could send the copy)."""
        return self._end(task, why, now) if task in self.running else []

    def aggregator_lost(self, name: str, now: float) -> tuple[dict[tuple, str], list]:
        """``name`` is gone: its moves will not end by themselves. Returns the tasks that were moving
        onto it with their copy not known to have landed, each with its source (which may still
        serve it: the failover offers it the task first), and the actions."""
        actions: list = []
        for task in [t for t, a in self.throttled.items() if name in (a.source, a.target)]:
            actions.append(Dropped(self.throttled.pop(task), "failed"))
        stays: dict[tuple, str] = {}
        resourced = False
        for task, move in [(t, m) for t, m in self.running.items() if name in (m.source, m.target)]:
            if move.source == name != move.target and move.assigned and not move.copied:
                # Workers may already queue at the target, for a copy that will never come.
                actions.append(CopyFromReplica(move, name))
                resourced = True
                continue
            if move.target == name and not move.copied:
                stays[task] = move.source
            actions += self._end(task, "abandoned", now)
        if resourced:
            actions.append(Settle((name,)))
        return stays, actions + self._start(now)

    def job_ended(self, job: str, now: float) -> list:
        actions: list = []
        for task in [t for t in self.throttled if t[0] == job]:
            action = self.throttled.pop(task)
            actions += [Dropped(action, "ended"), Settle((action.source, action.target))]
        for task in [t for t in self.follow_ups if t[0] == job]:
            del self.follow_ups[task]
        for task in [t for t in self.running if t[0] == job]:
            # Its workers will never reach the new place: do not hold up a release waiting for them.
            actions += self._end(task, "ended", now)
        return actions

    # -- inside -----------------------------------------------------------------------------------

    def _start(self, now: float) -> list:
        """Begin waiting moves, oldest first, while they fit (one at least when none runs)."""
        actions = []
        while self.throttled:
            task, action = next(iter(self.throttled.items()))
            size = self.size_of(task)
            if self.running and self.copying_bytes() + size > self.max_bytes:
                break
            del self.throttled[task]
            move = self.running[task] = Move(task, action.source, action.target, action.reason, bytes=size,
                                             started=now)
            actions.append(Begin(move))
        return actions

    def _maybe_done(self, move: Move, now: float) -> list:
        if move.copied and move.workers:
            self.done += 1
            return self._end(move.task, "done", now)
        return []

    def _end(self, task: tuple, why: str, now: float) -> list:
        move = self.running.pop(task)
        actions: list = [Finished(move, why)]
        follow = self.follow_ups.pop(task, None)
        names: list = [move.source, move.target]
        if follow is not None:
            if why == "done":
                actions += self.request(follow, now)  # before the settling below: its source waits for it
            else:
                actions.append(Dropped(follow, "preceded"))
            names += [follow.source, follow.target]
        actions += self._start(now)  # room for the next waiting moves (before the releases: they count)
        actions.append(Settle(tuple(dict.fromkeys(names))))
        return actions


def bytes_of(record, spec, part: int) -> int:
    """The state a move of ``spec``'s part copies: its weights, and as much again of optimizer
    state when the job has an optimizer."""
    start, end = spec.parts[part].span
    size = (end - start) * DTYPES[spec.dtype].itemsize
    return 2 * size if record.optimizer else size
