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

The groups meet through the pool (:class:`~pslink.core.worker.meeting.PoolMeeting`) or through shared
storage, a directory or any fsspec URL (:class:`~pslink.core.worker.meeting.StoreMeeting`, ``store=``).

Each step the group's workers agree whether this step syncs (a one-value pushpull on the group's
job: the leader decides), so that they stay in lockstep; the averaged weights reach the group's
other workers the same way (the leader pushes them, the others zeros).
"""

from __future__ import annotations

import logging

import numpy as np

from pslink.core.agent.agent import Agent
from pslink.core.worker.meeting import PoolMeeting, StoreMeeting

from pslink.errors import ConfigError

log = logging.getLogger("pslink.core.worker.groups")
_FLAG = "__dsync/flag"  # the group's per-step round: [sync now (1) or not (0), newcomers, the leader's step]
_TOLD = "__dsync/told"  # with the weights at a sync: [the rank that may move + 1, each group's workers]


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
    :class:`~pslink.core.worker.meeting.StoreMeeting`).

    Moving between groups (dSyncPS's load balancing): with ``connect`` (``group -> Agent``, a new
    Agent of that group's job, elastic, at a rank of this worker's that no founder has) and
    ``choice`` (a :class:`~pslink.core.worker.group_choice.GroupChoice`), at each global sync one worker
    of each group (its highest rank, never the leader) scores the groups by load x RTT (the RTT to
    ``sites[group]``, each group's service address; default: all on one service) and moves to a
    group 20% better: it leaves its group, comes into the other one as a late member
    (:meth:`enter`: that group's weights and step count), and :attr:`agent` is then the new one.
    A worker started late into a running group calls :meth:`enter` before it trains."""

    def __init__(self, agent, job: str, group: int, groups: int, every: int, max_groups: int | None = None,
                 timeout: float | None = None, master: str | None = None, store: str | None = None,
                 connect=None, choice=None, sites: dict | None = None):
        if agent.mode != "sum":
            raise ConfigError(f"groups with delayed global sync average the workers' weights: group job "
                              f"{agent.job!r} must run in sum mode (the workers step), not {agent.mode!r}")
        max_groups = groups if max_groups is None else max_groups
        if not 0 < groups <= max_groups or not 0 <= group < max_groups:
            raise ConfigError(f"group {group} of {groups} starting groups (at most {max_groups}): out of range")
        if choice is not None and connect is None:
            raise ConfigError(f"job {job!r}: moving between groups (choice=) needs connect=, a function giving this "
                              "worker's Agent of another group's job")
        self.agent, self.job, self.group, self.max_groups = agent, job, group, max_groups
        self.connect, self.choice, self.sites = connect, choice, dict(sites or {})
        self.schedule = SyncSchedule(every)
        self.steps = 0
        self.moves: list[tuple] = []  # (what, sync or group, step): joins' effects and this worker's moves
        self.timeout = timeout
        self.leads = agent.rank == 0
        self.meeting = None  # where the leaders average the groups' weights (leaders only)
        self.members: list[int] = []
        self.synced_with: set[int] = set()  # groups that took part in a sync with this one (leaders)
        self.sizes: dict[int, int] = {}  # each group's workers, as the last sync told
        self._flag = np.zeros(3, np.float32)  # [sync now, newcomers, the leader's step]
        self._told = np.zeros(1 + max_groups, np.float32)  # at a sync: [rank that may move + 1, sizes...]
        self._declared = False
        self._entered = not agent.late or self.leads
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
        if not self._entered:
            raise ConfigError(f"rank {self.agent.rank} of {self.agent.job!r} came into its running group late: "
                              "call enter(weights) before its first step")
        self.steps += 1
        flag = self._round(self._decide())
        sync, welcome = bool(flag[0]), flag[1] > 0
        while flag[1] > 0:  # newcomers come into every key while the group waits here (see enter)
            flag = self._round(self._flag_value(sync))
        if not (sync or welcome):
            return False
        items = _items(arrays)
        self._sync(items, average=sync)
        if sync:
            self.schedule.synced(self.steps)
            self._consider_moving(items)
        return sync

    def enter(self, arrays) -> int:
        """A worker that came into its group while the group trained (a late Agent: it moved
        here, or started late): wait until the group lets it in, then take the group's weights into
        ``arrays`` and its step count. Returns the group's step. Nothing for a founder.

        The group notices a newcomer in its per-step round (the newcomer adds 1), then repeats
        that round until one has no newcomer; meanwhile, the group waiting on it, the newcomer
        comes into every key of the job, each at the round the group's next step will use."""
        if self._entered:
            return self.steps
        self._flag[:] = (0.0, 1.0, 0.0)
        first = self._round(self._flag)
        self.steps = int(first[2])
        known = set(self.agent.join_all(self.timeout))
        self._entered = True
        flag = first
        while flag[1] > 0:
            self._flag[:] = 0.0
            flag = self._round(self._flag)
        items = _items(arrays)
        self._declared = all(f"__dsync/{name}" in known for name, _ in items) and _TOLD in known
        self._sync(items, average=False)
        if first[0]:
            self.schedule.synced(self.steps)
        log.info("rank %d of %r: came into group %d at its step %d", self.agent.rank, self.agent.job, self.group,
                 self.steps)
        return self.steps

    def _decide(self) -> np.ndarray:
        """The leader decides (its schedule, and groups that joined since it last looked)."""
        if not self.leads:
            return self._flag_value(False)
        members = self.meeting.members()
        # A group that synced with this one already is no newcomer, though this leader may not
        # have listed it before: a founder slow to announce itself (its store file written after
        # this leader first looked) was taken for a join, and this group's syncs went a step
        # ahead of the others' (found by the suite on a loaded machine).
        joined = sorted(set(members) - set(self.members) - self.synced_with)
        if joined and self.schedule.done:  # (before the first sync, every group there starts together)
            what = self.schedule.joined(self.steps)
            self.moves.append((*what, self.steps))
            log.info("group %d: group(s) %s joined: global sync %d %sed to step %d", self.group, joined,
                     what[1], what[0], self.steps)
        self.members = members
        return self._flag_value(self.schedule.due(self.steps))

    def _flag_value(self, sync: bool) -> np.ndarray:
        self._flag[:] = (1.0 if sync else 0.0, 0.0, float(self.steps)) if self.leads else 0.0
        return self._flag

    def _round(self, value: np.ndarray) -> np.ndarray:
        """The group's one-value round (the leader's decision and step, and how many newcomers)."""
        self.agent.pushpull(_FLAG, value, value).wait(self.timeout)
        return value

    def _sync(self, items: list[tuple[str, np.ndarray]], average: bool) -> None:
        """The leader's weights (averaged with the other groups' first, at a global sync) to every
        worker of the group, with what the leader knows of the groups' sizes."""
        names = [name for name, _ in items]
        arrays = [array for _, array in items]
        local = [f"__dsync/{name}" for name in names] + [_TOLD]
        told = self._told
        if not self._declared:
            self.agent.init_many(local, [np.zeros_like(a) for a in arrays] + [told]).wait(self.timeout)
            self._declared = True
        told[:] = 0.0
        if self.leads:
            if average:  # the average over the groups there now
                ranks = self.agent.membership()["ranks"]
                sizes = self.meeting.average(names, arrays, len(ranks))
                self.synced_with.update(sizes)
                told[0] = 1 + max(ranks) if len(ranks) > 1 else 0  # one worker a sync may move (never the leader)
                for group, size in sizes.items():
                    told[1 + group] = size
        else:
            for array in arrays:
                array.fill(0)
        self.agent.pushpull_many(local, arrays + [told], arrays + [told]).wait(self.timeout)  # the leader's, to all
        if told[1:].any():
            self.sizes = {group: int(n) for group, n in enumerate(told[1:]) if n > 0}

    def _consider_moving(self, items: list) -> None:
        """At a sync, the worker the leader named: to another group, if load x RTT says so."""
        if self.choice is None or self.leads or self._told[0] != self.agent.rank + 1 or len(self.sizes) < 2:
            return
        rtts = self._rtts()
        target = self.choice.better(self.group, self.sizes, rtts)
        if target is None:
            return
        log.info("rank %d of %r: moves to group %d (workers per group %s, RTTs %s)", self.agent.rank,
                 self.agent.job, target, self.sizes, {g: round(r, 6) for g, r in rtts.items()})
        self.moves.append(("moved", target, self.steps))
        self.agent.close()
        self.agent = self.connect(target)
        if self.agent.rank == 0:
            raise ConfigError(f"a worker moving into group {target} got rank 0 of {self.agent.job!r}: rank 0 is the "
                              "group's leader (its founder); connect= must give a moving worker a rank of its own")
        self.group, self._declared, self._entered = target, False, not self.agent.late
        self.agent.init(_FLAG, self._flag).wait(self.timeout)
        self.enter(items)

    def _rtts(self) -> dict[int, float]:
        """RTT to each group's service, measured once per distinct address (all alike on one)."""
        from pslink.core.worker.group_choice import probe_rtt

        addresses = {group: self.sites.get(group, self.agent.master_address) for group in self.sizes}
        if len(set(addresses.values())) < 2:
            return {group: 1.0 for group in addresses}
        measured = {address: probe_rtt(address, timeout=self.timeout or 10.0, transports=self.agent.transports)
                    for address in set(addresses.values())}
        return {group: measured[address] for group, address in addresses.items()}


def _items(arrays) -> list[tuple[str, np.ndarray]]:
    arrays = arrays() if callable(arrays) else arrays
    return list(arrays.items()) if isinstance(arrays, dict) else list(arrays)


def whole_job(agent) -> tuple[str, int]:
    """(job, number of workers) of the whole job ``agent`` works for: a group's Agent's
    (:class:`GroupAgent`) is not its group's."""
    return getattr(agent, "world_job", agent.job), getattr(agent, "world_size", agent.num_workers)


def label_groups(job: str, rank: int, num_workers: int, master: str, label: str, options: dict) -> tuple:
    """Groups by label: every worker's label, gathered in a short job ``<job>.groups`` of the
    whole job's workers. Returns ``(group, rank in it, its size, number of groups)``: the groups
    numbered in the order of their lowest rank, ranks within a group in the job's rank order."""
    from pslink.core.worker.collectives import gather_rows

    timeout = options.get("timeout")
    meeting = Agent(f"{job}.groups", rank, num_workers, master, **dict(options, mode="sum"))
    try:
        def pushpull(key, array, out):
            meeting.pushpull(key, array, out).wait(timeout)
            return out

        gathered, lengths = gather_rows(pushpull, "labels", np.frombuffer(label.encode(), np.uint8), rank,
                                        num_workers)
    finally:
        meeting.close()
    bounds = np.concatenate([[0], np.cumsum(lengths)])
    labels = [gathered[bounds[r]:bounds[r + 1]].tobytes().decode() for r in range(num_workers)]
    order = list(dict.fromkeys(labels))  # by each label's lowest rank
    members = [r for r in range(num_workers) if labels[r] == label]
    log.info("job %r: rank %d is in group %d (%r) with ranks %s; groups %s", job, rank, order.index(label), label,
             members, order)
    return order.index(label), members.index(rank), len(members), len(order)


class GroupAgent(Agent):
    """What ``pslink.connect(job, rank, num_workers, sync="local:T", groups=N)`` returns: the
    Agent of a worker of its group's own BSP job ``<job>.g<group>`` (groups of consecutive
    ranks; ``rank`` and ``num_workers`` are the group's, so an adapter's collectives run within
    the group), whose weights are averaged with the other groups' every T local steps: the
    adapters call :meth:`end_step` after each optimizer step. ``world_rank`` / ``world_size``:
    the worker's place in the whole job (shard the data by them). ``groups``: how many groups of
    consecutive ranks, or this worker's label (:func:`label_groups`: groups of any size)."""

    def __init__(self, job: str, rank: int, num_workers: int, master: str, *, every: int, groups: int | str,
                 store: str | None = None, **options):
        if options.get("mode", "sum") != "sum" or options.get("optimizer") is not None:
            raise ConfigError(f"job {job!r}: groups with delayed global sync average the workers' weights, so the "
                              "workers step (mode 'sum'); an optimizer on the Aggregators is not for them")
        if options.get("max_workers") not in (None, num_workers):
            raise ConfigError(f"job {job!r}: groups with delayed global sync take a fixed number of workers "
                              "(max_workers); groups join as jobs of their own (pslink.core.worker.groups.GroupSync)")
        options.pop("max_workers", None)
        if isinstance(groups, str):
            group, group_rank, size, groups = label_groups(job, rank, num_workers, master, groups, options)
        else:
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
