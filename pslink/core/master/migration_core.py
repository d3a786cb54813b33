"""The life of a task's migration (AutoPS 3.2 and Appendix B), as a pure core: events in, actions
out, no I/O and no clock of its own. pMaster and the simulator drive the same object.

A move's steps, and who reports them:

1. ``request(Migrate)``: the control plane moved the task in its plan. One move per task runs at
   a time (a second waits behind it, ``follow_ups``); a task moved again before its move began
   goes straight from where it is to the new place. Moves wait behind the **throttle**: at most
   ``max_bytes`` of task state (weights, and as much again of optimizer state) are being copied
   at once, at least one move always, so a job's iteration carries a bounded copy.
   ``request_many(actions)``: one decision's moves (a pack, the guard's, a drain). Those of one job
   onto one Aggregator form **batches** of up to the job's batch bound each (``batch_bytes(job)``,
   at least ``max_bytes``; one task at least): a batch is one migration, admitted by the throttle
   whole, begun together (the driver tells the target of all its tasks at once, then each source
   of them), handed over at the same round's end, its copy one stall of the job's round (a pack
   used to move a 161-tensor model as 161 migrations, each a stall and two control messages of
   its own). The bound is the copy the job's own compute hides (the control plane's
   :meth:`~pslink.core.master.control.ControlPlane.batch_bytes`): a job that iterates in 0.3 s
   moves its model in one hand-over, a job of 20 ms iterations in 16 MiB steps. Events stay per
   task.
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
    batch: int = 0  # the migration it is part of (see Batch)


@dataclasses.dataclass
class Batch:
    """One migration: moves of one job's tasks onto one Aggregator that one decision asked for,
    admitted, begun and counted together (``source``: the first task's; others may come from
    other Aggregators)."""

    ident: int
    job: str
    source: str
    target: str
    reason: str
    bytes: int = 0  # task state its moves copy, all together
    left: int = 0  # its moves still running
    moved: int = 0  # its moves that finished done


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
class Migrated:
    """A batch is over and moved some of its tasks (``batch.moved`` of them): one migration."""

    batch: Batch


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

    def __init__(self, size_of: Callable[[tuple], int], max_bytes: int = DEFAULT_MAX_MIGRATION_BYTES,
                 batch_bytes: Callable[[str], int] | None = None):
        self.size_of = size_of
        self.max_bytes = max_bytes
        self.batch_bytes = batch_bytes  # job -> the most bytes one of its batches may copy (above max_bytes)
        self.running: dict[tuple, Move] = {}
        self.throttled: dict[tuple, Migrate] = {}  # waiting for room, in arrival order
        self.follow_ups: dict[tuple, Migrate] = {}  # the next move of a task still moving
        self.batch_of: dict[tuple, int] = {}  # a throttled task's batch
        self.waiting: dict[int, dict[tuple, None]] = {}  # batches waiting for room, oldest first: their tasks
        self.batches: dict[int, Batch] = {}  # batches under way
        self._next_batch = 1
        self._copying = 0  # bytes of running moves whose copy has not landed (a batch runs hundreds)
        self.done = 0  # moves (tasks) finished
        self.migrated = 0  # batches finished (migrations)

    # -- views ------------------------------------------------------------------------------------

    def copying_bytes(self) -> int:
        # A move whose copy landed copies nothing more: it waits for the workers.
        return self._copying

    def moving(self, name: str) -> bool:
        """A move off or onto ``name`` runs or waits."""
        return any(name in (m.source, m.target) for m in self.running.values()) or any(
            name in (a.source, a.target) for a in (*self.throttled.values(), *self.follow_ups.values()))

    def moving_jobs(self) -> set[str]:
        return {task[0] for task in (*self.running, *self.throttled, *self.follow_ups)}

    def incoming(self) -> dict[tuple, str]:
        """The parts moving now, and their targets (who serve them next, so hold no replica of them)."""
        return {task: move.target for task, move in self.running.items()}

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
        return self.request_many([action], now)

    def request_many(self, actions: list[Migrate], now: float) -> list:
        """One decision's moves: those of one job onto the same Aggregator are a batch."""
        out: list = []
        batches: dict[tuple, tuple[int, int]] = {}  # (job, target, reason) -> its last batch, bytes
        for action in actions:
            task = action.task
            if task in self.running:
                self.follow_ups[task] = action  # one copy of a task in flight at a time
                continue
            waiting = self.throttled.get(task)
            if waiting is not None:
                # Moved again before its first move began: one move, from where it is to the new place.
                self._unthrottle(task)
                if waiting.source == action.target:
                    out += [Dropped(waiting, "ended"), Settle((waiting.source, waiting.target))]
                    continue
                action = Migrate(task, waiting.source, action.target, action.reason)
                out.append(Settle((waiting.target,)))
            group = (task[0], action.target, action.reason)
            size = self.size_of(task)
            ident, nbytes = batches.get(group, (0, 0))
            limit = max(self.max_bytes, self.batch_bytes(task[0])) if self.batch_bytes is not None else self.max_bytes
            if not ident or nbytes + size > limit:  # a batch copies what the job's round can carry at once
                ident, nbytes = self._next_batch, 0
                self._next_batch += 1
                self.waiting[ident] = {}
            batches[group] = (ident, nbytes + size)
            self.throttled[task] = action
            self.batch_of[task] = ident
            self.waiting[ident][task] = None
        return out + self._start(now)

    def resume(self, source: str, entries: list[tuple[tuple, str, bool]], now: float) -> list:
        """Moves ``source`` had begun handing over when pMaster restarted (its registration says
        so; the store had not kept them): each ``(task, target, landed)`` runs again from its
        hand-over, routed. A copy that landed is done; the others end with the source's
        TENSOR_COPY_DONE, or are forced at ``deadline``. The workers count as at the target
        already (a report sent to the old pMaster is lost; the source's forwarding address
        sends a straggler on)."""
        out: list = []
        groups: dict[tuple, list] = {}
        for task, target, landed in entries:
            if task not in self.running and task not in self.throttled:
                groups.setdefault((task[0], target), []).append((task, landed))
        for (job, target), items in groups.items():
            batch = self.batches[self._next_batch] = Batch(self._next_batch, job, source, target, "resumed",
                                                           left=len(items))
            self._next_batch += 1
            for task, landed in items:
                size = self.size_of(task)
                batch.bytes += size
                move = self.running[task] = Move(task, source, target, "resumed", bytes=size, started=now,
                                                 assigned=True, routed=True, copied=landed, workers=True,
                                                 batch=batch.ident)
                self._copying += 0 if landed else size
                out.append(Routed(move))
                out += self._maybe_done(move, now)
        return out

    def batch(self, ident: int) -> Batch | None:
        """The batch under way ``ident`` (None once it is over)."""
        return self.batches.get(ident)

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
        if not move.copied:
            move.copied = True
            self._copying -= move.bytes
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
            actions.append(Dropped(self._unthrottle(task), "failed"))
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
            action = self._unthrottle(task)
            actions += [Dropped(action, "ended"), Settle((action.source, action.target))]
        for task in [t for t in self.follow_ups if t[0] == job]:
            del self.follow_ups[task]
        for task in [t for t in self.running if t[0] == job]:
            # Its workers will never reach the new place: do not hold up a release waiting for them.
            actions += self._end(task, "ended", now)
        return actions

    # -- inside -----------------------------------------------------------------------------------

    def _unthrottle(self, task: tuple) -> Migrate:
        """Take a waiting task out of the throttle (and its batch)."""
        ident = self.batch_of.pop(task)
        members = self.waiting[ident]
        del members[task]
        if not members:
            del self.waiting[ident]
        return self.throttled.pop(task)

    def _start(self, now: float) -> list:
        """Begin waiting batches, oldest first, while they fit (one at least when none runs)."""
        actions = []
        while self.waiting:
            ident, members = next(iter(self.waiting.items()))
            sizes = {task: self.size_of(task) for task in members}
            if self.running and self.copying_bytes() + sum(sizes.values()) > self.max_bytes:
                break
            del self.waiting[ident]
            first = self.throttled[next(iter(members))]
            batch = self.batches[ident] = Batch(ident, first.task[0], first.source, first.target, first.reason,
                                                bytes=sum(sizes.values()), left=len(members))
            for task, size in sizes.items():
                del self.batch_of[task]
                action = self.throttled.pop(task)
                move = self.running[task] = Move(task, action.source, action.target, action.reason, bytes=size,
                                                 started=now, batch=batch.ident)
                self._copying += size
                actions.append(Begin(move))
        return actions

    def _maybe_done(self, move: Move, now: float) -> list:
        if move.copied and move.workers:
            self.done += 1
            return self._end(move.task, "done", now)
        return []

    def _end(self, task: tuple, why: str, now: float) -> list:
        move = self.running.pop(task)
        if not move.copied:
            self._copying -= move.bytes
        actions: list = [Finished(move, why)]
        batch = self.batches[move.batch]
        batch.left -= 1
        batch.moved += why == "done"
        if not batch.left:
            del self.batches[move.batch]
            if batch.moved:
                self.migrated += 1
                actions.append(Migrated(batch))
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
