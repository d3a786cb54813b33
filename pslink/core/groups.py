"""Groups with delayed global sync (dSyncPS, ``../shared/papers/003``): the workers of a group
aggregate every step (BSP) among themselves, on the group's own job; every ``T`` local steps
the groups average their weights (the *global* sync) through the pool, a job whose members are
the groups' leaders (each group's rank 0). Groups far apart (another site, a slow link) train
together without a cluster-wide barrier per step.

::

    agent = pslink.connect(f"{job}.g{group}", group_rank, group_size, master)   # the group's BSP
    groups = GroupSync(agent, job, group, groups=2, every=5, max_groups=4)
    for batch in data:
        grads = ...;  agent.pushpull_many(names, grads, grads, average=True).wait()
        step(weights, grads)
        groups.step(weights)          # every 5th call: weights = the average over the groups

Joining. Groups come and go: the global job is elastic (ranks are group indices below
``max_groups``; the first ``groups`` start it). A group that joins does its first global sync at once (it starts from the
others' weights); the groups already there sync with it at their next step, whatever their
schedule (:class:`SyncSchedule`: dSyncPS's rule, the ``i``-th sync *deferred* to the next step if
it was due now and had not begun, the ``i+1``-th *advanced* to the next step if the ``i``-th is
done). A group that leaves (its leader's Agent closes or dies) is dropped from the global job by
pMaster, and the others' syncs go on without it.

The groups meet through the pool (:class:`~pslink.core.meeting.PoolMeeting`) or through shared
storage, a directory or any fsspec URL (:class:`~pslink.core.meeting.StoreMeeting`, ``store=``).

Each step the group's workers agree whether this step syncs (a one-value pushpull on the group's
job: the leader decides), so that they stay in lockstep; the averaged weights reach the group's
other workers the same way (the leader pushes them, the others zeros).
"""

from __future__ import annotations

import logging

import numpy as np

from pslink.core.agent.agent import Agent
from pslink.core.meeting import PoolMeeting, StoreMeeting
from pslink.errors import ConfigError

log = logging.getLogger("pslink.core.groups")
_FLAG = "__dsync/flag"  # the group's per-step decision: sync now (1) or not (0)


def parse_local_sync(sync: str) -> int:
    """``"local:T"`` -> T (the local steps between global syncs)."""
    kind, _, every = sync.partition(":")
    try:
        value = int(every)
    except ValueError:
        value = 0
    if kind != "local" or value < 1:
        raise ConfigError(f"sync {sync!r}: groups with delayed global sync are written 'local:T', T >= 1 local "
                          "steps between global syncs")
    return value


class SyncSchedule:
    """When a group syncs globally (pure): at the end of every ``every``-th local step, counted
    from its last sync; a group that joins pulls the next sync to the step under way."""

    def __init__(self, every: int):
        if every < 1:
            raise ConfigError(f"a global sync every {every} local steps: it must be at least 1")
        self.every = every
        self.done = 0  # global syncs done
        self.next = every  # the local step whose end syncs
        self.last: int | None = None  # the step that ended with the last sync

    def due(self, step: int) -> bool:
        return step >= self.next

    def synced(self, step: int) -> None:
        self.done += 1
        self.next = step + self.every
        self.last = step

    def joined(self, step: int) -> tuple[str, int]:
        """A group joined, seen at the end of local step ``step``: this step ends with a sync
        that includes it. dSyncPS's names for it: ("defer", i) when sync i was due at this step
        (it waits for the newcomer); ("advance", i) otherwise: sync i comes now instead of later
        in the period (right after sync i - 1, or in the middle)."""
        coming = self.done + 1
        what = ("defer", coming) if self.next == step else ("advance", coming)
        self.next = step
        return what


class GroupSync:
    """A group's part in the global sync. ``agent``: this worker's Agent of its group's own job
    (sum mode: the workers keep the weights); ``job`` names the whole job (the global one is
    ``<job>.global``); ``group``: this group's index; ``groups``: how many the job starts with
    (their first sync waits for each), ``max_groups`` how many it may have (default ``groups``;
    groups ``groups`` and up join while it runs); ``master``: the pMaster
    of the global job, when the groups use services of their own (one per site: each group's
    rounds stay on its site, only the global syncs cross); default the group's. ``store``: a
    directory or fsspec URL the groups meet in instead of the pool (dSyncPS's shared storage:
    :class:`~pslink.core.meeting.StoreMeeting`)."""

    def __init__(self, agent, job: str, group: int, groups: int, every: int, max_groups: int | None = None,
                 timeout: float | None = None, master: str | None = None, store: str | None = None):
        if agent.mode != "sum":
            raise ConfigError(f"groups with delayed global sync average the workers' weights: group job "
                              f"{agent.job!r} must run in sum mode (the workers step), not {agent.mode!r}")
        max_groups = groups if max_groups is None else max_groups
        if not 0 < groups <= max_groups or not 0 <= group < max_groups:
            raise ConfigError(f"group {group} of {groups} starting groups (at most {max_groups}): out of range")
        self.agent, self.job, self.group, self.max_groups = agent, job, group, max_groups
        self.schedule = SyncSchedule(every)
        self.steps = 0
        self.moves: list[tuple[str, int, int]] = []  # (what, sync, step): the joins' effects, for tests and logs
        self.timeout = timeout
        self.leads = agent.rank == 0
        self.meeting = None  # where the leaders average the groups' weights (leaders only)
        self.members: list[int] = []
        self._flag = np.zeros(1, np.float32)
        self._declared = False
        agent.init(_FLAG, self._flag).wait(timeout)
        if self.leads:
            self.meeting = (StoreMeeting(store, job, group, groups, timeout) if store is not None else
                            PoolMeeting(agent, job, group, groups, max_groups, master, timeout))
            self.members = self.meeting.members()
            if self.meeting.late:  # others are under way (dSyncPS's Bonjour): sync with them at once
                self.schedule.next = 1

    @property
    def syncs(self) -> int:
        return self.schedule.done

    def close(self) -> None:
        if self.meeting is not None:
            self.meeting.close()

    def step(self, arrays) -> bool:
        """After each local step (every worker of the group, with its weights: a dict or (name,
        array) pairs, or a function giving them, called only when this step syncs): True when
        this step ended with a global sync (the arrays then hold the average over the groups)."""
        self.steps += 1
        if self._decide():
            arrays = arrays() if callable(arrays) else arrays
            self._sync(list(arrays.items()) if isinstance(arrays, dict) else list(arrays))
            self.schedule.synced(self.steps)
            return True
        return False

    def _decide(self) -> bool:
        """The leader decides (its schedule, and groups that joined since it last looked); the
        group learns it in a one-value round."""
        flag = 0.0
        if self.leads:
            members = self.meeting.members()
            joined = sorted(set(members) - set(self.members))
            if joined and self.schedule.done:  # (before the first sync, every group there starts together)
                what = self.schedule.joined(self.steps)
                self.moves.append((*what, self.steps))
                log.info("group %d: group(s) %s joined: global sync %d %sed to step %d", self.group, joined,
                         what[1], what[0], self.steps)
            self.members = members
            flag = 1.0 if self.schedule.due(self.steps) else 0.0
        self._flag[0] = flag
        self.agent.pushpull(_FLAG, self._flag, self._flag).wait(self.timeout)
        return bool(self._flag[0])

    def _sync(self, items: list[tuple[str, np.ndarray]]) -> None:
        names = [name for name, _ in items]
        arrays = [array for _, array in items]
        local = [f"__dsync/{name}" for name in names]
        if not self._declared:
            self.agent.init_many(local, [np.zeros_like(a) for a in arrays]).wait(self.timeout)
            self._declared = True
        if self.leads:  # the average over the groups there now
            self.meeting.average(names, arrays)
        else:
            for array in arrays:
                array.fill(0)
        self.agent.pushpull_many(local, arrays, arrays).wait(self.timeout)  # the leader's, to everyone


def whole_job(agent) -> tuple[str, int]:
    """(job, number of workers) of the whole job ``agent`` works for: a group's Agent's
    (:class:`GroupAgent`) is not its group's."""
    return getattr(agent, "world_job", agent.job), getattr(agent, "world_size", agent.num_workers)


class GroupAgent(Agent):
    """What ``pslink.connect(job, rank, num_workers, sync="local:T", groups=N)`` returns: the
    Agent of a worker of its group's own BSP job ``<job>.g<group>`` (groups of consecutive
    ranks; ``rank`` and ``num_workers`` are the group's, so an adapter's collectives run within
    the group), whose weights are averaged with the other groups' every T local steps: the
    adapters call :meth:`end_step` after each optimizer step. ``world_rank`` / ``world_size``:
    the worker's place in the whole job (shard the data by them)."""

    def __init__(self, job: str, rank: int, num_workers: int, master: str, *, every: int, groups: int,
                 store: str | None = None, **options):
        if options.get("mode", "sum") != "sum" or options.get("optimizer") is not None:
            raise ConfigError(f"job {job!r}: groups with delayed global sync average the workers' weights, so the "
                              "workers step (mode 'sum'); an optimizer on the Aggregators is not for them")
        if options.get("max_workers") not in (None, num_workers):
            raise ConfigError(f"job {job!r}: groups with delayed global sync take a fixed number of workers "
                              "(max_workers); groups join as jobs of their own (pslink.core.groups.GroupSync)")
        options.pop("max_workers", None)
        size = num_workers // groups
        group, group_rank = divmod(rank, size)
        super().__init__(f"{job}.g{group}", group_rank, size, master, **dict(options, mode="sum"))
        self.world_job, self.world_rank, self.world_size, self.group = job, rank, num_workers, group
        try:
            self.group_sync = GroupSync(self, job, group, groups, every, timeout=self.timeout, store=store)
        except BaseException:
            super().close()
            raise

    def end_step(self, arrays) -> bool:
        """After each local step, with the weights (the same names on every worker; or a function
        giving them, called only when this step syncs): True when this step ended with a global
        sync (the arrays then hold the groups' average)."""
        return self.group_sync.step(arrays)

    def close(self, leave: bool = True) -> None:
        if not self.closed:
            self.group_sync.close()
        super().close(leave)
