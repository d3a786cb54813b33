"""What an Aggregator's task does when requests cannot be served: poisoned for good (its key was
aborted: a part lost without a replica, a job ended), a few rounds failed (a rank's refused
request), or a peer gone (its requests forgotten). Pure functions over a :class:`Task`; the core
(:class:`~pslink.core.aggregator.core.AggregatorCore`) calls them and sends what they return."""

from __future__ import annotations

from typing import Any, Iterable

from pslink.core.aggregator.tasks import Reply, Task, moved_error
from pslink.errors import FencedError, KeyStateError, PslinkError

MAX_FAILED_ROUNDS = 16  # rounds a refused request failed, remembered per task to fail their late requests


def not_here(name: str, ident: tuple, moved: tuple | None, replica: bool) -> PslinkError:
    """The error for a request of a part this Aggregator does not serve: where it moved to, or
    ask pMaster again (it holds a replica only), or not here at all."""
    job, key, part = ident
    if moved is not None:
        return moved_error(key, part, moved)
    if replica:
        # pMaster placed the part here and its PROMOTE (or the ASSIGN that promotes) is on its
        # way, or the Agent's placement is old: it asks pMaster again (lost control messages and
        # a pMaster restarted mid-failover send Agents here early).
        return FencedError(f"aggregator {name} holds only a replica of part {part} of key {key!r} of job {job!r}, "
                           "not promoted; ask pMaster where the part is", job=job, key=key)
    return KeyStateError(f"aggregator {name} does not hold part {part} of key {key!r} of job {job!r}", job=job, key=key)


def fail_waiters(task: Task, error: PslinkError) -> list[Reply]:
    """Fail every request the task holds and drop its open rounds."""
    # A task still waiting for its copy holds requests too (a copy that will never come).
    waiting = task.before_init + task.waiting_copy + [req for reqs in task.pulls.values() for req in reqs]
    task.before_init, task.waiting_copy, task.pulls = [], [], {}
    task.rounds.clear()
    return [Reply(req.origin, req.id, error=error) for req in waiting]


def poison(task: Task, error: PslinkError) -> list[Reply]:
    """Every waiting request and every later one gets ``error`` (the first one given stays)."""
    if task.poisoned is None:
        task.poisoned = error
    return fail_waiters(task, task.poisoned)


def fail_rounds(task: Task, error: PslinkError, through: int) -> list[Reply] | None:
    """A rank's request for round ``through`` was refused (it used the key with another shape or
    dtype): the rounds still open, up to that one, fail for every rank, and the key goes on from
    the next. Nothing of the refused request stays in the key's state. Returns the replies, or
    None when no round waited for the rank (asp, the part not served here, or those rounds closed
    already without it)."""
    if task.job.sync == "asp" or task.incoming or task.moved_to is not None or task.poisoned is not None:
        return None
    first = task.closed + 1
    last = max([through, *task.rounds, *task.pulls])
    if last < first:
        return None
    for r in range(first, last + 1):
        task.failed_rounds[r] = error
    for old in sorted(task.failed_rounds)[:-MAX_FAILED_ROUNDS]:
        del task.failed_rounds[old]
    acked = [req for r in range(first, last + 1) for req in task.acks.pop(r, [])]
    replies = fail_waiters(task, error) + [Reply(req.origin, req.id, error=error) for req in acked]
    task.closed = last
    task.missed = {r: m for r, m in task.missed.items() if r < first}
    return replies


def forget_origin(tasks: Iterable[Task], origin: Any) -> None:
    """Forget requests from a peer that went away (nobody is left to answer)."""
    for task in tasks:
        task.before_init = [r for r in task.before_init if r.origin is not origin]
        for r in list(task.pulls):
            kept = [q for q in task.pulls[r] if q.origin is not origin]
            if kept:
                task.pulls[r] = kept
            else:
                del task.pulls[r]


def fence(tasks: dict, parts: list, name: str, why: str = "was failed over while away") -> tuple[set, list[Reply]]:
    """pMaster placed ``parts`` ([job, key, part], ...) elsewhere while this Aggregator was away
    (frozen, or cut off): drop them. Returns their idents (requests for them are refused from now
    on, so that their Agents ask pMaster) and the answers to what waited on them."""
    idents, replies = set(), []
    for job, key, part in parts:
        ident = (job, key, part)
        idents.add(ident)
        task = tasks.pop(ident, None)
        if task is not None:
            replies += fail_waiters(task, FencedError(
                f"aggregator {name} {why}; {task.name} is served elsewhere now: ask pMaster", agg=name))
    return idents, replies


def replicas_ordered(job_id: str, specs: list[dict]) -> list[tuple]:
    """The parts (job, key, part) an ASSIGN's ``specs`` make this Aggregator a replica of (drops aside)."""
    return [(job_id, spec.get("key"), spec.get("part")) for spec in specs
            if spec.get("replica") and not spec.get("drop")]


def end_moves_given_up(tasks: dict, job_id: str, specs: list[dict], name: str) -> list[Reply]:
    """pMaster gives this Aggregator a replica of a part it waits for a copy of (an ASSIGN's
    ``specs``): that move is over, for pMaster never makes a move's target the part's replica
    (its source died before it handed the part over, and the failover placed the part
    elsewhere). The waiting task goes, so that the replica takes its place (kept beside it, the
    replica was ignored and never got a round: found by the chaos run with control faults),
    and what waited on it is told to ask pMaster."""
    given_up = [ident for ident in replicas_ordered(job_id, specs) if ident in tasks and tasks[ident].incoming]
    return fence(tasks, given_up, name, why="waited for a move's copy that was given up")[1]

