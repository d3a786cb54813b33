"""Where model aggregation tasks go: AutoPS's assignment scheme (Pseudocode 1), pure, no I/O.

Terms (the paper's Table 1). Every Aggregator n runs in cycles of length ``C_n``: the longest
profiled iteration duration ``D_j`` among the jobs it serves. Within one cycle a job with a shorter
iteration runs ``floor(C_n / D_j)`` iterations, so its effective iteration duration on n is
``d_j = C_n / floor(C_n / D_j)`` and its loss is ``(d_j - D_j) / d_j`` (J1 with D=6 next to J2 with
D=12: C=12, J1 runs twice, d=6, no loss; a D=5 job next to J2: runs twice, d=6, loss 17%). A task t
costs ``e_t`` seconds of Aggregator CPU per iteration of its job; n's work per cycle is
``W_n = sum_j floor(C_n / D_j) * sum(e_t for t of j on n)`` and its free slots are
``F_n = C_n - W_n``.

Placing task t of job k (:meth:`Placement.place`): for each Aggregator, the cycle it would have
(``max(C_n, D_k)``), the loss of every job there under that cycle (any at or above LossLimit
disqualifies n), and the free slots left after t's own runs. Among the qualified, the best fit: the
one left with the fewest free slots. If none qualifies, a new Aggregator.

Service levels (issue 29). A job's limit is on its **slowdown**, ``d_j / D_j - 1`` (what a user
sees: 10% means 10% longer), not the paper's ``(d - D) / d`` (a 10% "loss" is an 11.1% slowdown);
each task carries its job's own limit (:attr:`TaskDemand.limit`, else the plan's ``loss_limit``), and
placing a task checks every job on the Aggregator against its own. An Aggregator shared by several
jobs keeps ``headroom`` of its cycle free: jobs were profiled alone, and packed next to others
their tasks cost more (caches, memory bandwidth), which a full cycle cannot absorb.

Two corrections to the pseudocode as printed, both from the paper's own definitions (Appendix C):
the effective duration is ``C / floor(C / D)`` (line 4 prints a max of a duration and a count),
and a task needs room for all ``floor(C / D_k)`` of its runs per cycle, not one (line 17).

The live pMaster and the simulator both use this class. Evaluation is vectorised with numpy over
Aggregators and cached per (Aggregator, job), so placing 10,000 tasks on 500 Aggregators takes
well under a second.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from typing import Any, Callable, Iterable

import numpy as np

from pslink.core.master.nics import UNKNOWN, Nics

LOSS_LIMIT = 0.1
_EPS = 1e-9  # cycles are ratios of measured floats: 0.3 / 0.1 must count as 3 runs


def runs_per_cycle(cycle: float, iteration: float) -> int:
    """Iterations of a job with duration ``iteration`` that fit in one ``cycle`` (at least 1)."""
    if iteration <= 0 or cycle <= iteration:
        return 1
    return max(1, int(math.floor(cycle / iteration + _EPS)))


def effective_iteration(cycle: float, iteration: float) -> float:
    """d_j: the job's iteration duration when its tasks run on an Aggregator with this cycle."""
    if cycle <= iteration:
        return iteration
    return cycle / runs_per_cycle(cycle, iteration)


def performance_loss(cycle: float, iteration: float) -> float:
    """L_j = (d_j - D_j) / d_j."""
    d = effective_iteration(cycle, iteration)
    return (d - iteration) / d if d > 0 else 0.0


def slowdown(cycle: float, iteration: float) -> float:
    """d_j / D_j - 1: how much longer the job's iterations take on an Aggregator with this cycle."""
    return effective_iteration(cycle, iteration) / iteration - 1.0 if iteration > 0 else 0.0


def _nic_room(hosts: np.ndarray, host_free: np.ndarray, own_room: np.ndarray) -> np.ndarray:
    """Room on the NIC of each slot's host (bytes/s). An Aggregator whose host is not known yet
    will get a host of its own if need be: a whole NIC, less what it holds already."""
    room = own_room.copy()
    known = hosts >= 0
    room[known] = host_free[hosts[known]]
    return room


@dataclasses.dataclass(frozen=True)
class TaskDemand:
    """A task to place: its job's profiled iteration D (s), its CPU cost e (s per iteration) and
    the slowdown its job accepts from packing (None: the plan's ``loss_limit``)."""

    job: str
    key: Any
    part: int
    iteration: float
    cost: float
    nbytes: int = 0
    limit: float | None = None
    rate: float = 0.0  # bytes/s its Aggregator's NIC carries for it, each way (:mod:`.nics`)

    def __post_init__(self):
        if not self.iteration > 0 or not self.cost >= 0:
            raise ValueError(f"task {self.ident}: iteration must be > 0 and cost >= 0, got "
                             f"{self.iteration} and {self.cost}")

    @property
    def ident(self) -> tuple:
        return (self.job, self.key, self.part)


@dataclasses.dataclass
class _JobShare:
    iteration: float
    limit: float  # the slowdown the job accepts
    work: float = 0.0  # sum of e_t of this job's tasks on the Aggregator
    tasks: int = 0


class AggregatorPlan:
    """One Aggregator as placement sees it."""

    __slots__ = ("name", "index", "jobs", "tasks", "cycle", "work", "version", "nbytes", "rate")

    def __init__(self, name: str, index: int):
        self.name = name
        self.index = index
        self.jobs: dict[str, _JobShare] = {}
        self.tasks: dict[tuple, TaskDemand] = {}
        self.cycle = 0.0
        self.work = 0.0
        self.version = 0
        self.nbytes = 0  # bytes of its tasks: profiling spreads a job by them, once per part
        self.rate = 0.0  # bytes/s its tasks put on its host's NIC

    @property
    def free(self) -> float:
        return self.cycle - self.work

    def work_at(self, cycle: float) -> float:
        return sum(runs_per_cycle(cycle, s.iteration) * s.work for s in self.jobs.values())

    def fits_at(self, cycle: float) -> bool:
        """Every job here within its own limit if the cycle were ``cycle``."""
        return all(slowdown(cycle, s.iteration) < s.limit for s in self.jobs.values())

    def describe(self) -> dict:
        return {
            "cycle": self.cycle,
            "work": self.work,
            "free": self.free,
            "tasks": len(self.tasks),
            "jobs": {j: {"iteration": s.iteration, "work": s.work, "tasks": s.tasks,
                         "runs": runs_per_cycle(self.cycle, s.iteration), "limit": s.limit}
                     for j, s in self.jobs.items()},
        }


@dataclasses.dataclass(frozen=True)
class NewAggregator:
    """A placement decision that needs an Aggregator which does not exist yet (``placeholder``
    is its name in the plan until :meth:`Placement.rename` gives it its real one)."""

    placeholder: str


class Placement:
    """The assignment state of one Aggregator cluster, and Pseudocode 1 over it."""

    def __init__(self, loss_limit: float = LOSS_LIMIT, placeholder_prefix: str = "<new-", headroom: float = 0.0,
                 nics: Nics | None = None):
        if not 0 < loss_limit < 1:
            raise ValueError(f"loss_limit must be in (0, 1), got {loss_limit}")
        if not 0 <= headroom < 1:
            raise ValueError(f"headroom must be in [0, 1), got {headroom}")
        self.loss_limit = loss_limit
        self.headroom = headroom
        self.nics = nics if nics is not None else Nics()
        # Names of Aggregators this plan opens (``<prefix>N>``): unique among every plan and
        # allocator whose placeholders can be pending at once, or two would share one name.
        self.placeholder_prefix = placeholder_prefix
        self.aggregators: dict[str, AggregatorPlan] = {}
        self.where: dict[tuple, str] = {}  # task ident -> Aggregator name
        self._slots: list[AggregatorPlan | None] = []
        self._cycle = np.zeros(0)
        self._work = np.zeros(0)
        self._alive = np.zeros(0, dtype=bool)
        self._version = np.zeros(0, dtype=np.int64)
        self._jobs_on = np.zeros(0, dtype=np.int64)  # jobs each Aggregator serves
        # Aggregators whose plan changed since whoever watches the plan last took them
        # (:meth:`take_changed`): the simulator re-times their jobs without scanning the pool.
        self.changed: set[str] = set()
        self._host = np.zeros(0, dtype=np.int64)  # each Aggregator's host in self.nics (UNKNOWN: not yet)
        self._rate = np.zeros(0)  # bytes/s each Aggregator's tasks send (plan.rate, for numpy)
        self._slots_of: dict[str, set[int]] = {}  # job -> the slots holding its tasks
        # What each Aggregator would look like with its cycle grown to _grow_cycle (valid while
        # its version is _grow_version): consecutive tasks of one job ask the same question.
        self._grow_cycle = np.zeros(0)
        self._grow_version = np.zeros(0, dtype=np.int64)
        self._grow_ok = np.zeros(0, dtype=bool)
        self._grow_work = np.zeros(0)
        self._placeholders = 0
        # Slots of removed Aggregators, lowest first: reused, so that the arrays every evaluation
        # scans stay as long as the pool is, not as long as every Aggregator it ever had.
        self._free: list[int] = []

    # -- the pool ---------------------------------------------------------------------------------

    def add_aggregator(self, name: str) -> AggregatorPlan:
        if name in self.aggregators:
            raise ValueError(f"aggregator {name!r} is already in the plan")
        if self._free:
            index = heapq.heappop(self._free)
            plan = self._slots[index] = AggregatorPlan(name, index)
            self.aggregators[name] = plan
            self._cycle[index] = self._work[index] = self._grow_work[index] = 0.0
            self._alive[index] = True
            self._version[index] = self._jobs_on[index] = 0
            self._host[index] = UNKNOWN
            self._rate[index] = 0.0
            self._grow_cycle[index] = -1.0
            self._grow_version[index] = -1
            self._grow_ok[index] = False
            return plan
        index = len(self._slots)
        plan = AggregatorPlan(name, index)
        self._slots.append(plan)
        self.aggregators[name] = plan
        self._cycle = np.append(self._cycle, 0.0)
        self._work = np.append(self._work, 0.0)
        self._alive = np.append(self._alive, True)
        self._version = np.append(self._version, 0)
        self._jobs_on = np.append(self._jobs_on, 0)
        self._host = np.append(self._host, UNKNOWN)
        self._rate = np.append(self._rate, 0.0)
        self._grow_cycle = np.append(self._grow_cycle, -1.0)
        self._grow_version = np.append(self._grow_version, -1)
        self._grow_ok = np.append(self._grow_ok, False)
        self._grow_work = np.append(self._grow_work, 0.0)
        return plan

    def remove_aggregator(self, name: str) -> list[TaskDemand]:
        """Take an Aggregator out; returns the tasks it held (to be placed elsewhere)."""
        plan = self.aggregators.pop(name)
        self._slots[plan.index] = None
        self._alive[plan.index] = False
        heapq.heappush(self._free, plan.index)
        tasks = list(plan.tasks.values())
        for task in tasks:
            del self.where[task.ident]
        for job in plan.jobs:
            self._left_slot(job, plan.index)
        self.nics.add(int(self._host[plan.index]), -plan.rate)
        self.changed.discard(name)
        return tasks

    def nic_of(self, name: str) -> int:
        """The index of ``name``'s host in :attr:`nics` (``UNKNOWN`` while its host is not known)."""
        return int(self._host[self.aggregators[name].index])

    def host_load(self, name: str) -> float:
        """Bytes/s placed on the NIC of ``name``'s host (0 while its host is not known)."""
        host = self.nic_of(name)
        return float(self.nics.load[host]) if host != UNKNOWN else 0.0

    def take_changed(self) -> set[str]:
        changed, self.changed = self.changed, set()
        return changed

    def set_host(self, name: str, host: str) -> None:
        """``name`` runs on ``host``: what its tasks send now loads that host's NIC."""
        plan = self.aggregators[name]
        self.nics.add(int(self._host[plan.index]), -plan.rate)
        self._host[plan.index] = self.nics.host_index(host)
        self.nics.add(int(self._host[plan.index]), plan.rate)

    def rename(self, old: str, new: str) -> None:
        plan = self.aggregators.pop(old)
        plan.name = new
        self.aggregators[new] = plan
        if old in self.changed:
            self.changed.discard(old)
            self.changed.add(new)
        for ident in plan.tasks:
            self.where[ident] = new

    def names(self) -> list[str]:
        return list(self.aggregators)

    # -- evaluating and placing -------------------------------------------------------------------

    def evaluate(self, task: TaskDemand, candidates: Iterable[str] | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(qualified, free slots left after placing ``task``) for every Aggregator slot."""
        base, free, runs = self._room(task.job, task.iteration, self._limit(task), candidates)
        left = free - runs * task.cost
        qualified = base & (left >= -_EPS)
        if self.nics.limited and task.rate:
            qualified &= _nic_room(*self._nic_state(slice(None))) >= task.rate * (1 - _EPS)
        return qualified, left

    def _limit(self, task: TaskDemand) -> float:
        return self.loss_limit if task.limit is None else task.limit

    def _room(self, job: str, iteration: float, limit: float,
              candidates: Iterable[str] | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """For a task of ``job`` (iteration D, accepting ``limit``), per slot: whether it may go
        there whatever it costs (every job within its limit under the cycle it would have), the
        free slots there once the job's cycle applies (the cycle less the work, less the headroom
        of a shared Aggregator), and the job's runs per cycle there."""
        cycle, work, alive = self._cycle, self._work, self._alive
        D = iteration
        if candidates is not None:
            allowed = np.zeros(len(self._slots), dtype=bool)
            for name in candidates:
                plan = self.aggregators.get(name)
                if plan is not None:
                    allowed[plan.index] = True
            alive = alive & allowed
        keeps = cycle >= D - _EPS  # the cycle stays as it is: only job k's own slowdown can change
        runs = np.maximum(1.0, np.floor(cycle / D + _EPS))
        effective = np.maximum(cycle / runs, D)  # an empty Aggregator (cycle 0) would take D
        qualified = alive & keeps & (effective / D - 1.0 < limit)
        # Shared once the task is there: another job is there already.
        others = self._jobs_on.copy()
        mine = self._slots_of.get(job)
        if mine:
            others[list(mine)] -= 1
        shared = others > 0
        free = np.where(shared, cycle * (1.0 - self.headroom), cycle) - work
        empty = alive & (cycle == 0)  # an empty Aggregator takes the job's cycle: no slowdown
        free[empty], runs[empty], qualified[empty] = D, 1.0, True
        grows = alive & ~keeps & ~empty  # the cycle would grow to D: every job there re-checked
        if grows.any():
            stale = grows & ((self._grow_cycle != D) | (self._grow_version != self._version))
            for index in np.flatnonzero(stale):
                plan = self._slots[index]
                self._grow_cycle[index] = D
                self._grow_version[index] = plan.version
                self._grow_ok[index] = plan.fits_at(D)
                self._grow_work[index] = plan.work_at(D)
            free[grows] = D * (1.0 - self.headroom) - self._grow_work[grows]  # shared: others are there
            runs[grows] = 1.0
            qualified[grows] = self._grow_ok[grows]
        return qualified, free, runs

    def choose(self, task: TaskDemand, candidates: Iterable[str] | None = None) -> str | None:
        """The best-fit qualified Aggregator for ``task``, or None if none qualifies."""
        if not self.aggregators:
            return None
        qualified, left = self.evaluate(task, candidates)
        if not qualified.any():
            return None
        best = np.flatnonzero(qualified)[np.argmin(left[qualified])]
        return self._slots[best].name

    def assign(self, task: TaskDemand, name: str) -> None:
        """Record ``task`` on Aggregator ``name`` (whatever chose it)."""
        if task.ident in self.where:
            self.unassign(task.ident)
        plan = self.aggregators[name]
        self._record(task, plan)
        self._refresh(plan)

    def _record(self, task: TaskDemand, plan: AggregatorPlan) -> None:
        """``task`` is on ``plan``'s Aggregator (the caller refreshes the plan)."""
        share = plan.jobs.get(task.job)
        if share is None:
            share = plan.jobs[task.job] = _JobShare(task.iteration, self._limit(task))
            self._slots_of.setdefault(task.job, set()).add(plan.index)
        share.iteration, share.limit = task.iteration, self._limit(task)
        share.work += task.cost
        share.tasks += 1
        plan.nbytes += task.nbytes
        plan.rate += task.rate
        self._rate[plan.index] = plan.rate
        self.nics.add(int(self._host[plan.index]), task.rate)
        plan.tasks[task.ident] = task
        self.where[task.ident] = plan.name

    def unassign(self, ident: tuple) -> TaskDemand | None:
        name = self.where.pop(ident, None)
        if name is None:
            return None
        plan = self.aggregators[name]
        task = plan.tasks.pop(ident)
        share = plan.jobs[task.job]
        share.work -= task.cost
        share.tasks -= 1
        plan.nbytes -= task.nbytes
        plan.rate -= task.rate
        self._rate[plan.index] = plan.rate
        self.nics.add(int(self._host[plan.index]), -task.rate)
        if share.tasks == 0:
            del plan.jobs[task.job]
            self._left_slot(task.job, plan.index)
        self._refresh(plan)
        return task

    def _left_slot(self, job: str, index: int) -> None:
        slots = self._slots_of.get(job)
        if slots is not None:
            slots.discard(index)
            if not slots:
                del self._slots_of[job]

    def remove_job(self, job: str) -> list[str]:
        """Forget a job's tasks; returns the Aggregators left empty by it."""
        # Only the Aggregators that serve the job are looked at: a job's end must not cost a
        # scan of every task of every other job (the simulator ends 82,247 of them).
        touched = [p for p in self.aggregators.values() if job in p.jobs]
        for plan in touched:
            for ident in [i for i in plan.tasks if i[0] == job]:
                self.unassign(ident)
        return sorted(p.name for p in touched if not p.tasks)

    def _refresh(self, plan: AggregatorPlan) -> None:
        plan.cycle = max((s.iteration for s in plan.jobs.values()), default=0.0)
        plan.work = plan.work_at(plan.cycle)
        plan.version += 1
        self._cycle[plan.index] = plan.cycle
        self._work[plan.index] = plan.work
        self._version[plan.index] = plan.version
        self._jobs_on[plan.index] = len(plan.jobs)
        self.changed.add(plan.name)

    def place(self, task: TaskDemand, candidates: Iterable[str] | None = None, allow_new: bool = True) -> str | NewAggregator | None:
        """Pseudocode 1 for one task: assign it to the best-fit qualified Aggregator, else to a
        new one (a :class:`NewAggregator` placeholder, already in the plan), else None."""
        name = self.choose(task, candidates)
        if name is not None:
            self.assign(task, name)
            return name
        if not allow_new:
            return None
        self._placeholders += 1
        placeholder = f"{self.placeholder_prefix}{self._placeholders}>"
        self.add_aggregator(placeholder)
        self.assign(task, placeholder)
        return NewAggregator(placeholder)

    def place_all(self, tasks: Iterable[TaskDemand], candidates: Iterable[str] | None = None,
                  allow_new: bool = True) -> dict[tuple, str | NewAggregator | None]:
        """Place several tasks in turn, largest cost first (as bin packing does best). New
        Aggregators opened on the way become candidates for the tasks after them."""
        ordered = sorted(tasks, key=lambda t: (-t.cost, str(t.key), t.part))
        return dict(zip((t.ident for t in ordered), self.place_many(ordered, candidates, allow_new)))

    def place_many(self, tasks: list[TaskDemand], candidates: Iterable[str] | None = None, allow_new: bool = True,
                   on_miss: Callable[[TaskDemand, set | None], str | NewAggregator | None] | None = None,
                   ) -> list[str | NewAggregator | None]:
        """:meth:`place` on each task in the order given, with the same decisions, but each run
        of consecutive tasks of one job evaluated once (what packing a job costs is then one
        vectorised step per task instead of a full evaluation: issue 29's 10,000 tasks in
        <= 0.1 s). Within a run nothing but the chosen Aggregator's free slots changes: the
        first task of job k on n sets n's cycle to ``max(C_n, D_k)``, which the evaluation
        already assumed, and every later one adds ``floor(C / D_k) * e_t`` to its work.

        A task that fits nowhere goes to ``on_miss(task, pool)`` (default: :meth:`place`, which
        opens a new Aggregator when ``allow_new``); a name it returns joins the candidates."""
        pool = None if candidates is None else set(candidates)
        miss = on_miss or (lambda task, names: self.place(task, names, allow_new))
        decisions: list[str | NewAggregator | None] = []
        start = 0
        while start < len(tasks):
            first = tasks[start]
            end = start + 1
            while (end < len(tasks) and tasks[end].job == first.job and tasks[end].iteration == first.iteration
                   and tasks[end].limit == first.limit):
                end += 1
            run = tasks[start:end]
            if any(t.ident in self.where for t in run):  # re-placing a placed task: its own cost counts
                for task in run:
                    decisions.append(self._decide(task, pool, miss))
            else:
                self._place_run(run, pool, miss, decisions)
            start = end
        return decisions

    def _decide(self, task: TaskDemand, pool: set | None, miss) -> str | NewAggregator | None:
        name = self.choose(task, pool)
        if name is not None:
            self.assign(task, name)
            return name
        return self._missed(task, pool, miss)

    @staticmethod
    def _missed(task: TaskDemand, pool: set | None, miss) -> str | NewAggregator | None:
        """``miss``'s decision for a task that fits nowhere; where it went joins the candidates."""
        decision = miss(task, pool)
        if decision is not None and pool is not None:
            pool.add(decision.placeholder if isinstance(decision, NewAggregator) else decision)
        return decision

    def _room_for_job(self, first: TaskDemand, pool: set | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """:meth:`_room` for a run of one job's tasks, kept to the slots that qualify."""
        qualified, free, runs = self._room(first.job, first.iteration, self._limit(first), pool)
        where = np.flatnonzero(qualified)
        return where, free[where], runs[where]

    def _place_run(self, run: list[TaskDemand], pool: set | None, miss, decisions: list) -> None:
        where, free, runs = self._room_for_job(run[0], pool)
        limited = self.nics.limited
        hosts, host_free, own_room = self._nic_state(where)
        pending: dict[int, list[TaskDemand]] = {}
        left = np.empty_like(free)
        for task in run:
            np.multiply(runs, task.cost, out=left)
            np.subtract(free, left, out=left)
            left[left < -_EPS] = np.inf
            if limited and task.rate:  # and its host's NIC must have room for it
                left[_nic_room(hosts, host_free, own_room) < task.rate * (1 - _EPS)] = np.inf
            best = int(left.argmin()) if len(left) else -1
            if best >= 0 and left[best] != np.inf:
                free[best] -= runs[best] * task.cost
                if hosts[best] >= 0:
                    host_free[hosts[best]] -= task.rate
                else:
                    own_room[best] -= task.rate
                pending.setdefault(int(where[best]), []).append(task)
                decisions.append(self._slots[int(where[best])].name)
                continue
            self._assign_many(pending)  # what was decided so far, then the miss as place() would
            pending = {}
            decisions.append(self._missed(task, pool, miss))
            where, free, runs = self._room_for_job(run[0], pool)
            hosts, host_free, own_room = self._nic_state(where)
            left = np.empty_like(free)
        self._assign_many(pending)

    def _nic_state(self, slots) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The slots' hosts, every host's NIC room, and the room of those whose host is not known
        yet (:func:`_nic_room`)."""
        bandwidth = self.nics.bandwidth if self.nics.limited else np.inf
        return self._host[slots], self.nics.free(), bandwidth - self._rate[slots]

    def _assign_many(self, pending: dict[int, list[TaskDemand]]) -> None:
        """:meth:`assign` for tasks decided together: each Aggregator refreshed once."""
        for index, tasks in pending.items():
            plan = self._slots[index]
            for task in tasks:
                self._record(task, plan)
            self._refresh(plan)

    def try_move_all(self, name: str, targets: Iterable[str] | None = None) -> dict[tuple, str] | None:
        """Could every task of ``name`` move to the other Aggregators (no new ones)? Returns the
        moves and applies them to the plan if so; otherwise leaves the plan untouched (None)."""
        plan = self.aggregators[name]
        others = [n for n in (targets if targets is not None else self.aggregators) if n != name]
        tasks = sorted(plan.tasks.values(), key=lambda t: -t.cost)
        moved: dict[tuple, str] = {}
        for task in tasks:
            self.unassign(task.ident)
            target = self.choose(task, others)
            if target is None:
                for ident, where in moved.items():  # undo
                    self.unassign(ident)
                for t in tasks:
                    self.assign(t, name)
                return None
            self.assign(task, target)
            moved[task.ident] = target
        return moved

    # -- reporting ----------------------------------------------------------------------------------

    def loss_of(self, job: str) -> float:
        """The job's worst loss over the Aggregators holding its tasks."""
        return max((performance_loss(p.cycle, p.jobs[job].iteration) for p in self.aggregators.values()
                    if job in p.jobs), default=0.0)

    def free_capacity(self) -> float:
        """Free slots summed over the cluster, as a fraction of one Aggregator (cluster choice)."""
        return sum(max(0.0, p.free) / p.cycle if p.cycle else 1.0 for p in self.aggregators.values())

    def describe(self) -> dict:
        return {name: plan.describe() for name, plan in self.aggregators.items()}
