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
from typing import Any, Iterable

import numpy as np

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


@dataclasses.dataclass(frozen=True)
class TaskDemand:
    """A task to place: its job's profiled iteration D (s) and its CPU cost e (s per iteration)."""

    job: str
    key: Any
    part: int
    iteration: float
    cost: float
    nbytes: int = 0

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
    work: float = 0.0  # sum of e_t of this job's tasks on the Aggregator
    tasks: int = 0


class AggregatorPlan:
    """One Aggregator as placement sees it."""

    __slots__ = ("name", "index", "jobs", "tasks", "cycle", "work", "version", "nbytes")

    def __init__(self, name: str, index: int):
        self.name = name
        self.index = index
        self.jobs: dict[str, _JobShare] = {}
        self.tasks: dict[tuple, TaskDemand] = {}
        self.cycle = 0.0
        self.work = 0.0
        self.version = 0
        self.nbytes = 0  # bytes of its tasks: profiling spreads a job by them, once per part

    @property
    def free(self) -> float:
        return self.cycle - self.work

    def work_at(self, cycle: float) -> float:
        return sum(runs_per_cycle(cycle, s.iteration) * s.work for s in self.jobs.values())

    def max_loss_at(self, cycle: float) -> float:
        return max((performance_loss(cycle, s.iteration) for s in self.jobs.values()), default=0.0)

    def describe(self) -> dict:
        return {
            "cycle": self.cycle,
            "work": self.work,
            "free": self.free,
            "tasks": len(self.tasks),
            "jobs": {j: {"iteration": s.iteration, "work": s.work, "tasks": s.tasks,
                         "runs": runs_per_cycle(self.cycle, s.iteration)} for j, s in self.jobs.items()},
        }


@dataclasses.dataclass(frozen=True)
class NewAggregator:
    """A placement decision that needs an Aggregator which does not exist yet (``placeholder``
    is its name in the plan until :meth:`Placement.rename` gives it its real one)."""

    placeholder: str


class Placement:
    """The assignment state of one Aggregator cluster, and Pseudocode 1 over it."""

    def __init__(self, loss_limit: float = LOSS_LIMIT, placeholder_prefix: str = "<new-"):
        if not 0 < loss_limit < 1:
            raise ValueError(f"loss_limit must be in (0, 1), got {loss_limit}")
        self.loss_limit = loss_limit
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
            self._version[index] = 0
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
        return tasks

    def rename(self, old: str, new: str) -> None:
        plan = self.aggregators.pop(old)
        plan.name = new
        self.aggregators[new] = plan
        for ident in plan.tasks:
            self.where[ident] = new

    def names(self) -> list[str]:
        return list(self.aggregators)

    # -- evaluating and placing -------------------------------------------------------------------

    def evaluate(self, task: TaskDemand, candidates: Iterable[str] | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(qualified, free slots left after placing ``task``) for every Aggregator slot."""
        cycle, work, alive = self._cycle, self._work, self._alive
        D, e = task.iteration, task.cost
        if candidates is not None:
            allowed = np.zeros(len(self._slots), dtype=bool)
            for name in candidates:
                plan = self.aggregators.get(name)
                if plan is not None:
                    allowed[plan.index] = True
            alive = alive & allowed
        keeps = cycle >= D - _EPS  # the cycle stays as it is: only job k's own loss can change
        runs = np.maximum(1.0, np.floor(cycle / D + _EPS))
        effective = np.maximum(cycle / runs, D)  # an empty Aggregator (cycle 0) would take D
        loss = (effective - D) / effective
        left = cycle - work - runs * e
        qualified = alive & keeps & (loss < self.loss_limit) & (left >= -_EPS)
        empty = alive & (cycle == 0)  # an empty Aggregator takes the job's cycle: no loss
        left[empty] = D - e
        qualified[empty] = e <= D + _EPS
        grows = alive & ~keeps & ~empty  # the cycle would grow to D: every job there re-checked
        if grows.any():
            stale = grows & ((self._grow_cycle != D) | (self._grow_version != self._version))
            for index in np.flatnonzero(stale):
                plan = self._slots[index]
                self._grow_cycle[index] = D
                self._grow_version[index] = plan.version
                self._grow_ok[index] = plan.max_loss_at(D) < self.loss_limit
                self._grow_work[index] = plan.work_at(D)
            left[grows] = D - self._grow_work[grows] - e
            qualified[grows] = self._grow_ok[grows] & (left[grows] >= -_EPS)
        return qualified, left

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
        share = plan.jobs.get(task.job)
        if share is None:
            share = plan.jobs[task.job] = _JobShare(task.iteration)
        share.iteration = task.iteration
        share.work += task.cost
        share.tasks += 1
        plan.nbytes += task.nbytes
        plan.tasks[task.ident] = task
        self.where[task.ident] = name
        self._refresh(plan)

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
        if share.tasks == 0:
            del plan.jobs[task.job]
        self._refresh(plan)
        return task

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
        chosen: dict[tuple, str | NewAggregator | None] = {}
        pool = None if candidates is None else set(candidates)
        for task in sorted(tasks, key=lambda t: (-t.cost, str(t.key), t.part)):
            decision = self.place(task, pool, allow_new)
            if isinstance(decision, NewAggregator) and pool is not None:
                pool.add(decision.placeholder)
            chosen[task.ident] = decision
        return chosen

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
