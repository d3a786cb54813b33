"""The control plane's decisions (AutoPS 3.3): profiling, packing, the performance guard, scaling.

Pure and clock-driven: feed it events (a job arrives, a part is declared, iterations are
reported, costs are measured, Aggregators come and go, jobs end, time passes) and it answers with
actions (:class:`Allocate`, :class:`Release`, :class:`Migrate`). pMaster carries them out; the
trace-driven simulator feeds the very same object with simulated time.

A job's life (paper 3.3.1-3.3.2):

1. **Profiling.** On arrival it gets ``servers`` Aggregators of its own (idle ones first, else new
   ones), as many as it would ask ps-lite for, and runs alone there; its parts are spread over them
   by bytes. Agents report iteration durations, Aggregators report each task's CPU time per
   iteration.
2. **Packing.** After ``profile_iterations`` iterations its standalone iteration duration ``D`` is
   the median measured; once its moves pay (:meth:`JobControl.pack_due`) every task is placed by
   Pseudocode 1 (:mod:`pslink.core.master.placement`, each job within ``placement_share`` of its own
   slowdown limit, its ``slo``, shared Aggregators keeping ``headroom`` free, NICs within
   ``nic_bandwidth``) in the best-fit cluster; moved parts migrate; empty Aggregators go.
3. **Guard** (:mod:`pslink.core.master.guard`): a packed job slower than ``D`` by more than its
   limit over a window is relieved (tasks off congested Aggregators, once), else reverted onto
   a new Aggregator of its own (the paper's Appendix D and Figure 10).
4. **Exit.** Its tasks go; empty Aggregators are released (down to ``min_aggregators``), then the
   least-loaded ones are drained into the others while that needs no new Aggregator. With a
   ``scale_period``, releases and drains happen once per period while allocation stays on demand
   (the paper's hybrid scaling).

Aggregators are grouped in clusters of at most ``max_cluster_size``, each with its own placement
state; a job is packed into the best-fit cluster (enough free CPU, the least of it).

Hosts. pMaster tells the control plane each Aggregator's host (``host_of``). Over several hosts
a job's parts are spread: each part goes, among the Aggregators that qualify, to the host holding
the fewest of the job's bytes so far, so that no NIC carries a whole job (with Aggregators on the
worker hosts, as BytePS co-locates servers, each NIC carries what a ring all-reduce would).
Aggregators an operator joined by hand (``pinned``) are never released or drained by scaling.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import statistics
from typing import Any, Callable

from pslink.core.master.actions import Allocate, Migrate
from pslink.core.master import spread
from pslink.core.master.placement import LOSS_LIMIT, NewAggregator, Placement, TaskDemand, runs_per_cycle
from pslink.core.master.job_control import JobControl, check_service_level
from pslink.core.master.nics import Nics
from pslink.core.master.guard import Guard
from pslink.core.master.scaling import Scaling

DEFAULT_COST_PER_BYTE = 5e-10  # CPU s an Aggregator spends per byte pushed, before any measurement (~2 GB/s)
PROVISIONAL_ITERATION = 1.0  # placeholder duration for a profiling job's tasks (its Aggregators are its own)
#: Share of a shared Aggregator's cycle packing leaves free: a job's costs are profiled alone, and
#: next to other jobs they grow (the trace-driven simulator's jobs: 7% at the median, 25% at p99).
DEFAULT_HEADROOM = 0.1
#: Share of a job's slowdown limit placement may use; the rest: its moves' stalls, the guard's delay, noise.
DEFAULT_PLACEMENT_SHARE = 0.8
DEFAULT_COPY_BANDWIDTH = 1e9  # bytes per second a migration's copy is expected to cross at
DEFAULT_COPY_LATENCY = 0.002  # seconds a migration's copy costs besides its bytes


class ControlPlane:
    """Placement and scaling decisions for a pool of Aggregators, in clusters."""

    def __init__(
        self,
        *,
        loss_limit: float = LOSS_LIMIT,
        guard_window: int = 100,
        profile_iterations: int = 20,
        min_aggregators: int = 1,
        max_aggregators: int = 1024,
        max_cluster_size: int = 64,
        scale_period: float = 0.0,
        max_reverts: int = 2,
        cost_per_byte: float = DEFAULT_COST_PER_BYTE,
        congested_load: float = 0.95,
        cost_inflation: float = 3.0,
        headroom: float = DEFAULT_HEADROOM,
        placement_share: float = DEFAULT_PLACEMENT_SHARE,
        copy_bandwidth: float = DEFAULT_COPY_BANDWIDTH,
        copy_latency: float = DEFAULT_COPY_LATENCY,
        nic_bandwidth: float | None = None,
        elastic: bool = True,
        clock: Callable[[], float] | None = None,
    ):
        if not 0 < placement_share <= 1:
            raise ValueError(f"placement_share must be in (0, 1], got {placement_share}")
        self.loss_limit = loss_limit
        self.headroom = headroom
        self.placement_share = placement_share
        self.copy_bandwidth = copy_bandwidth
        self.copy_latency = copy_latency
        self.nics = Nics(nic_bandwidth)  # every host's NIC, shared by the clusters' plans
        self.guard_window = guard_window
        self.profile_iterations = profile_iterations
        self.min_aggregators = min_aggregators
        self.max_aggregators = max_aggregators
        self.max_cluster_size = max_cluster_size
        self.scale_period = scale_period
        self.max_reverts = max_reverts
        self.cost_per_byte = cost_per_byte
        self.congested_load = congested_load
        self.cost_inflation = cost_inflation
        # Without a provider nothing can be started or stopped: place within the pool as it is.
        self.elastic = elastic
        self.clock = clock or (lambda: 0.0)
        self.clusters: dict[str, Placement] = {}
        self.cluster_of: dict[str, str] = {}  # Aggregator (or placeholder) -> cluster
        self.jobs: dict[str, JobControl] = {}
        self.loads: dict[str, float] = {}  # Aggregator -> CPU load 0..1, as measured
        self.reserved: dict[str, str] = {}  # Aggregator -> job it is a profiling temporary for
        self.exclusive: dict[str, str] = {}  # Aggregator -> reverted job it belongs to
        self._held: dict[str, list] = collections.defaultdict(list)  # placeholder -> actions
        # Aggregators an operator is removing: out of the plan, released once their tasks moved.
        self.draining: set[str] = set()
        self._pending_scale_down = False
        self._last_scale = self.clock()
        self._serial = itertools.count(1)
        self.host_of: dict[str, str] = {}  # Aggregator -> its host's identity (pMaster fills it in)
        self.pinned: set[str] = set()  # joined by an operator: scaling keeps them
        # Aggregators holding replicas: the plan counts only tasks, pMaster knows the replicas.
        # Scaling never releases or drains them, or the replicas would go with them.
        self.replica_holders: Callable[[], set] = set
        # Jobs with tasks on the move (pMaster's migrations, running, queued, or waiting for a
        # new Aggregator): the guard does not judge them meanwhile. The simulator's moves take
        # no time: none.
        self.moving_jobs: Callable[[], set] = set
        self.scaling = Scaling(self)
        self.guard = Guard(self)

    # -- the pool ---------------------------------------------------------------------------------

    def _new_cluster(self) -> str:
        name = f"cluster-{len(self.clusters)}"
        # Its own placeholder names: _allocate's "<new-N>" may still be starting when a plan opens
        # an Aggregator, and so may another cluster's (the simulator hit both).
        self.clusters[name] = Placement(self.loss_limit, placeholder_prefix=f"<new-{name}-", headroom=self.headroom,
                                        nics=self.nics)
        return name

    def _cluster_for_new_aggregator(self, preferred: str | None = None) -> str:
        if preferred is not None and len(self.clusters[preferred].aggregators) < self.max_cluster_size:
            return preferred
        for name, plan in self.clusters.items():
            if len(plan.aggregators) < self.max_cluster_size:
                return name
        return self._new_cluster()

    def aggregator_added(self, name: str) -> None:
        """An Aggregator nobody asked for joined (the initial pool, a restart, an operator)."""
        if name in self.cluster_of:
            return
        cluster = self._cluster_for_new_aggregator()
        self.clusters[cluster].add_aggregator(name)
        self.cluster_of[name] = cluster
        if name in self.host_of:
            self.clusters[cluster].set_host(name, self.host_of[name])

    def aggregator_host(self, name: str, host: str, spread: bool = True) -> None:
        """``name`` runs on ``host``: its tasks load that host's NIC (placement keeps every NIC
        within ``nic_bandwidth``) and, with ``spread``, jobs are spread over the pool's hosts.
        The simulator's Aggregator hosts are a pool of their own, with no workers on them to
        balance: it passes ``spread=False``."""
        if spread:
            self.host_of[name] = host
        cluster = self.cluster_of.get(name)
        if cluster is not None:
            self.clusters[cluster].set_host(name, host)

    def aggregator_count(self) -> int:
        return len(self.cluster_of)

    def _allocate(self, cluster: str, reason: str) -> Allocate:
        plan = self.clusters[cluster]
        placeholder = f"<new-{next(self._serial)}>"
        plan.add_aggregator(placeholder)
        self.cluster_of[placeholder] = cluster
        return Allocate(cluster, placeholder, reason)

    def bind(self, placeholder: str, name: str) -> list:
        """An allocated Aggregator registered as ``name``: the actions that waited for it."""
        cluster = self.cluster_of.pop(placeholder)
        self.clusters[cluster].rename(placeholder, name)
        self.cluster_of[name] = cluster
        if name in self.host_of:
            self.clusters[cluster].set_host(name, self.host_of[name])
        for table in (self.reserved, self.exclusive):
            if placeholder in table:
                table[name] = table.pop(placeholder)
        for job in self.jobs.values():
            job.temporaries = [name if t == placeholder else t for t in job.temporaries]
        actions = [self._rebind(a, placeholder, name) for a in self._held.pop(placeholder, [])]
        # After the moves above: pMaster lets a removed Aggregator go once they finished.
        return actions + self.scaling.placeholder_bound(placeholder)

    @staticmethod
    def _rebind(action, placeholder: str, name: str):
        if isinstance(action, Migrate):
            return dataclasses.replace(
                action,
                source=name if action.source == placeholder else action.source,
                target=name if action.target == placeholder else action.target,
            )
        return action

    def aggregator_lost(self, name: str) -> None:
        """An Aggregator went away: forget it (its tasks' recovery is the failure path's job)."""
        cluster = self.cluster_of.pop(name, None)
        if cluster is not None:
            self.clusters[cluster].remove_aggregator(name)
        self.reserved.pop(name, None)
        self.exclusive.pop(name, None)
        self.loads.pop(name, None)
        self.scaling.forget(name)
        self.pinned.discard(name)
        for control in self.jobs.values():
            if name in control.temporaries:  # a job profiled on it declares its next parts elsewhere
                control.temporaries.remove(name)

    def task_recovered(self, ident: tuple, aggregator: str) -> None:
        """A part now lives on ``aggregator`` because its own Aggregator failed (a replica was
        promoted, or it started afresh there)."""
        control = self.jobs.get(ident[0])
        if control is None or ident not in control.parts:
            return
        for plan in self.clusters.values():
            plan.unassign(ident)
        if aggregator not in self.cluster_of:
            self.aggregator_added(aggregator)
        self.clusters[self.cluster_of[aggregator]].assign(self._demand(control, ident), aggregator)

    def jobs_waiting_to_move(self) -> set[str]:
        """Jobs with moves held until the Aggregator they go to is up."""
        return {a.task[0] for held in self._held.values() for a in held if isinstance(a, Migrate)}

    def is_placeholder(self, name: str) -> bool:
        return name.startswith("<new-")

    def _emit(self, actions: list, action) -> None:
        """Hold actions that target an Aggregator still being started."""
        targets = [getattr(action, "target", None), getattr(action, "source", None)]
        waiting = next((t for t in targets if t and self.is_placeholder(t)), None)
        if waiting is not None:
            self._held[waiting].append(action)
        else:
            actions.append(action)

    # -- jobs ---------------------------------------------------------------------------------------

    def job_arrived(self, job: str, workers: int, servers: int | None = None, slo: float | None = None,
                    priority: str = "normal") -> list:
        """A new job: reserve its profiling Aggregators (idle ones first). ``slo``: the slowdown
        it accepts from sharing (default ``loss_limit``); ``priority`` "high": scaling never
        moves its tasks to free an Aggregator."""
        if job in self.jobs:
            return []
        check_service_level(slo, priority)
        servers = max(1, servers if servers is not None else workers)
        cluster = max(self.clusters, key=lambda c: len(self._idle(c)), default=None) or self._new_cluster()
        control = self.jobs[job] = JobControl(job, workers, servers, cluster, slo=self.loss_limit if slo is None else slo,
                                              priority=priority, arrived=self.clock())
        if self.profile_iterations <= 0:
            control.phase = "packed"
            return []
        actions: list = []
        for name in self._profiling_places(cluster, servers):
            control.temporaries.append(name)
            self.reserved[name] = job
        while self.elastic and len(control.temporaries) < servers and self.aggregator_count() < self.max_aggregators:
            allocation = self._allocate(self._cluster_for_new_aggregator(cluster), f"profile job {job} alone")
            control.temporaries.append(allocation.placeholder)
            self.reserved[allocation.placeholder] = job
            actions.append(allocation)
        return actions

    def _profiling_places(self, cluster: str, servers: int) -> list[str]:
        """Idle Aggregators to profile a job on, one host after another; with NICs known, one per
        NIC (the job's own traffic is not known either)."""
        places = spread.across_hosts(self._idle(cluster), self.host_of)
        return (spread.one_per_nic(places, self.clusters[cluster]) if self.nics.limited else places)[:servers]

    def _idle(self, cluster: str) -> list[str]:
        plan = self.clusters[cluster]
        idle = sorted(n for n, a in plan.aggregators.items()
                      if not a.tasks and n not in self.reserved and n not in self.exclusive
                      and not self.is_placeholder(n))
        if self.nics.limited:
            # A job not profiled yet sends what no one knows (its iteration is not measured): it
            # is given NICs that carry nothing else, and keeps them whole until it is measured
            # (:meth:`JobControl.nic_rate`). Otherwise new Aggregators are started.
            idle = [n for n in idle if plan.host_load(n) <= 0.0]
        return idle

    def place_part(self, job: str, key: Any, part: int, nbytes: int) -> tuple[str, list]:
        """Where a newly declared part goes (an Aggregator or a placeholder), plus actions."""
        control = self.jobs[job]
        ident = (job, key, part)
        control.parts[ident] = nbytes
        if control.phase == "profiling":
            # Alone on its own Aggregators while profiling (or, with none to spare, with the
            # others): spread by bytes, over hosts first.
            pool = control.temporaries or self._candidates(control)
            on_host = spread.bytes_by_host(control.parts, self.clusters.values(), self.host_of)
            target = min(pool, key=lambda n: (on_host[self.host_of.get(n, "")], self._bytes_on(n), n))
            self.clusters[self.cluster_of[target]].assign(self._demand(control, ident, provisional=True), target)
            return target, []
        target, actions = self._place_spread(control, self._demand(control, ident), self._candidates(control),
                                             f"no room for a part of job {job}", spread.bytes_by_host(control.parts, self.clusters.values(), self.host_of))
        control.grown = True
        control.window.clear()  # iterations without the new key say nothing about the job now
        return target, actions

    def _place_spread(self, control: JobControl, demand: TaskDemand, candidates: list[str], reason: str,
                      on_host: collections.Counter) -> tuple[str, list]:
        """Pseudocode 1 for one task, trying the hosts that hold the fewest of the job's bytes
        first (``on_host``, updated); on one host simply :meth:`_place_one`."""
        live = [n for n in candidates if not self.is_placeholder(n)]
        target = spread.choose(self.clusters[control.cluster], demand, live, self.host_of, on_host)
        actions: list = []
        if target is None:
            target, actions = self._place_one(control, demand, candidates, reason)
        on_host[self.host_of.get(target, "")] += demand.nbytes
        return target, actions

    def _place_one(self, control: JobControl, demand: TaskDemand, candidates: list[str], reason: str) -> tuple[str, list]:
        """Pseudocode 1 for one task; without elasticity the least-full candidate takes what fits
        nowhere."""
        plan = self.clusters[control.cluster]
        decision = plan.place(demand, candidates, allow_new=self.elastic)
        if isinstance(decision, NewAggregator):
            self.cluster_of[decision.placeholder] = control.cluster
            return decision.placeholder, [Allocate(control.cluster, decision.placeholder, reason)]
        if decision is None:
            _, left = plan.evaluate(demand, candidates)
            names = [n for n in candidates if n in plan.aggregators]
            decision = max(names, key=lambda n: (left[plan.aggregators[n].index], n))
            plan.assign(demand, decision)
        return decision, []

    def forget_parts(self, job: str, key: Any, parts: int) -> None:
        control = self.jobs.get(job)
        for part in range(parts):
            ident = (job, key, part)
            for plan in self.clusters.values():
                plan.unassign(ident)
            if control is not None:
                control.parts.pop(ident, None)
                control.costs.pop(ident, None)

    def adopt_job(self, job: str, workers: int, servers: int | None, slo: float | None = None,
                  priority: str = "normal", cluster: str | None = None) -> JobControl:
        """A job that ran before a pMaster restart: it keeps its places and is profiled again."""
        control = self.jobs.get(job)
        if control is None:
            cluster = cluster or next(iter(self.clusters), None) or self._new_cluster()
            control = self.jobs[job] = JobControl(job, workers, max(1, servers or workers), cluster,
                                                  slo=self.loss_limit if slo is None else slo, priority=priority,
                                                  arrived=self.clock(), adopted=True)
        return control

    def adopt_part(self, job: str, workers: int, servers: int | None, key: Any, part: int, nbytes: int,
                   aggregator: str) -> None:
        """A part placed before a pMaster restart: keep it where it is, learn the job again."""
        if aggregator not in self.cluster_of:
            self.aggregator_added(aggregator)
        control = self.adopt_job(job, workers, servers, cluster=self.cluster_of[aggregator])
        ident = (job, key, part)
        control.parts[ident] = nbytes
        self.clusters[self.cluster_of[aggregator]].assign(self._demand(control, ident, provisional=True), aggregator)

    def _bytes_on(self, name: str) -> int:
        return self.clusters[self.cluster_of[name]].aggregators[name].nbytes

    def _demand(self, control: JobControl, ident: tuple, provisional: bool = False) -> TaskDemand:
        known = not provisional and control.standalone is not None
        iteration = control.standalone if known else PROVISIONAL_ITERATION
        cost = control.costs.get(ident)
        if cost is None:
            cost = control.estimate_cost(control.parts[ident], self.cost_per_byte)
        nbytes = control.parts[ident]
        rate = control.nic_rate(nbytes, self.profile_iterations, self.nics.bandwidth)
        return TaskDemand(control.job, ident[1], ident[2], iteration, cost, nbytes, control.slo * self.placement_share,
                          rate)

    def _candidates(self, control: JobControl) -> list[str]:
        plan = self.clusters[control.cluster]
        return [n for n in plan.aggregators
                if self.reserved.get(n, control.job) == control.job
                and self.exclusive.get(n, control.job) == control.job]

    def move_task(self, ident: tuple, target: str, reason: str = "requested") -> Migrate | None:
        """An operator's move (or a benchmark's): update the plan and say how to carry it out."""
        source = self._where(ident)
        if source == target:
            return None
        source_plan = self.clusters[self.cluster_of[source]]
        demand = source_plan.unassign(ident)
        self.clusters[self.cluster_of[target]].assign(demand, target)
        return Migrate(ident, source, target, reason)

    def costs_measured(self, job: str, costs: dict[tuple, float]) -> None:
        """Aggregators' per-task CPU seconds per iteration (e_t). Placement uses what was
        measured while the job was profiled: later figures include whatever slows the
        Aggregator down (congestion), which must not make a task look too big to move."""
        control = self.jobs.get(job)
        if control is None:
            return
        measured = {i: c for i, c in costs.items() if i in control.parts}
        control.latest_costs.update(measured)
        if control.phase == "profiling" or control.adopted:
            control.costs.update(measured)
        else:
            for ident, cost in measured.items():  # parts declared after packing: first figure only
                control.costs.setdefault(ident, cost)

    def load_measured(self, name: str, load: float) -> None:
        self.loads[name] = load

    def iterations_reported(self, job: str, durations: list[float], work: list[float] | None = None) -> list:
        """Iteration durations measured by a job's Agents (and, where the Agent measures it, the
        worker's own work in each: the duration less the communication it waited for):
        profiling, then the guard."""
        control = self.jobs.get(job)
        if control is None or not durations:
            return []
        control.iterations += len(durations)
        control.add_work(work or [])
        if control.phase == "profiling":
            measured = len(control.profiled) >= self.profile_iterations
            control.profiled.extend(durations)
            if len(control.profiled) >= self.profile_iterations and self.pack_due(job) <= self.clock():
                return self._pack(control)
            if not measured and len(control.profiled) >= self.profile_iterations and self.nics.limited:
                # Measured, not packed yet (its moves would not pay): its NICs carry what it sends.
                self._record_demands(control, provisional=True)
            return []
        return self.guard.judge(control, durations)

    def batch_bytes(self, job: str) -> int:
        """The most bytes one migration of the job's parts may copy (:meth:`JobControl.batch_bytes`)."""
        control = self.jobs.get(job)
        return control.batch_bytes(self.copy_bandwidth) if control is not None else 0

    def pack_due(self, job: str) -> float:
        """When packing the job pays for its moves (:meth:`JobControl.pack_due`)."""
        return self.jobs[job].pack_due(self.copy_latency, self.copy_bandwidth, self.placement_share)

    def _pack(self, control: JobControl) -> list:
        """Profiling is over: place every task of the job by Pseudocode 1, best-fit cluster."""
        control.standalone = control.profiled_iteration = statistics.median(control.profiled)
        control.work_baseline = statistics.median(control.work) if control.work else None
        control.phase = "packed"
        if control.adopted or not self.elastic and not control.temporaries:
            self._record_demands(control)  # measured where it already runs: move nothing
            return []
        current = {i: self._where(i) for i in control.parts}
        for ident in control.parts:
            self.clusters[self.cluster_of[current[ident]]].unassign(ident)
        for name in control.temporaries:
            self.reserved.pop(name, None)
        demands = [self._demand(control, i) for i in control.parts]
        control.cluster = self._best_cluster(control, demands)
        actions = self._place_job(control, demands, current, "pack after profiling")
        control.temporaries = []
        return actions + self.scaling.release_empty(f"job {control.job} packed")

    def _record_demands(self, control: JobControl, provisional: bool = False) -> None:
        """The job's parts stay where they are, with their demands as now known."""
        for ident in control.parts:
            name = self._where(ident)
            self.clusters[self.cluster_of[name]].assign(self._demand(control, ident, provisional), name)

    def _where(self, ident: tuple) -> str:
        for plan in self.clusters.values():
            name = plan.where.get(ident)
            if name is not None:
                return name
        raise KeyError(ident)

    def _best_cluster(self, control: JobControl, demands: list[TaskDemand]) -> str:
        need = sum(d.cost for d in demands) / control.standalone
        fits = [(plan.free_capacity(), name) for name, plan in self.clusters.items() if plan.free_capacity() >= need]
        return min(fits)[1] if fits else control.cluster

    def _place_job(self, control: JobControl, demands: list[TaskDemand], current: dict, reason: str,
                   candidates: list[str] | None = None) -> list:
        pool = candidates if candidates is not None else self._candidates(control)
        actions: list = []
        ordered = sorted(demands, key=lambda d: (-d.cost, str(d.key), d.part))
        if spread.one_host([n for n in pool if not self.is_placeholder(n)], self.host_of):
            # One host (or none known): the whole job in one pass of Pseudocode 1, as task by task
            # (and its actions in the same order: an Allocate just before the first move to it).
            opened: dict[tuple, list] = {}

            def fits_nowhere(demand: TaskDemand, names: set) -> str:
                target, opened[demand.ident] = self._place_one(control, demand, sorted(names),
                                                               f"{reason}: job {control.job} needs room")
                return target

            targets = self.clusters[control.cluster].place_many(ordered, pool, on_miss=fits_nowhere)
            for demand, target in zip(ordered, targets):
                actions += opened.get(demand.ident, [])
                if current.get(demand.ident) != target:
                    self._emit(actions, Migrate(demand.ident, current[demand.ident], target, reason))
            return actions
        on_host: collections.Counter = collections.Counter()
        for demand in ordered:
            target, more = self._place_spread(control, demand, pool, f"{reason}: job {control.job} needs room",
                                              on_host)
            actions += more
            if target not in pool:
                pool = pool + [target]
            if current.get(demand.ident) != target:
                self._emit(actions, Migrate(demand.ident, current[demand.ident], target, reason))
        return actions

    def job_ended(self, job: str) -> list:
        control = self.jobs.pop(job, None)
        if control is None:
            return []
        for plan in self.clusters.values():
            plan.remove_job(job)
        for table in (self.reserved, self.exclusive):
            for name in [n for n, j in table.items() if j == job]:
                del table[name]
        if self.scale_period > 0:
            self._pending_scale_down = True
            return []
        return self.scaling.scale_down(f"job {job} ended")

    def tick(self) -> list:
        """Time passed: the periodic half of hybrid scaling."""
        now = self.clock()
        if self.scale_period <= 0 or now - self._last_scale < self.scale_period:
            return []
        self._last_scale = now
        if not self._pending_scale_down:
            return []
        self._pending_scale_down = False
        return self.scaling.scale_down("periodic scaling")

    # -- scaling and operators (Scaling) ---------------------------------------------------------------

    def release_idle(self, reason: str = "idle", keep=()) -> list:
        """Release Aggregators that hold nothing; ``keep``: those that hold what the plan does not
        count (replicas)."""
        return self.scaling.release_empty(reason, keep)

    def add_aggregators(self, count: int) -> list[Allocate]:
        return self.scaling.add_aggregators(count)

    def remove_aggregator(self, name: str) -> tuple[list, dict[tuple, str]]:
        return self.scaling.remove_aggregator(name)

    def undrain(self, name: str) -> None:
        self.scaling.undrain(name)

    def released(self, name: str) -> None:
        """pMaster let ``name`` go."""
        self.scaling.released(name)

    # -- cyclic execution ------------------------------------------------------------------------------------

    def schedules(self) -> dict[str, tuple[int, float, list]]:
        """Per Aggregator: (plan version, cycle, [[job, key, part, runs, cost], ...]) for the tasks
        of jobs past profiling (a profiling job has no measured iteration to fit a cycle to)."""
        out = {}
        for plan in self.clusters.values():
            for name, agg in plan.aggregators.items():
                if self.is_placeholder(name):
                    continue
                entries = []
                for ident, task in agg.tasks.items():
                    control = self.jobs.get(ident[0])
                    if control is None or control.standalone is None:
                        continue
                    entries.append([ident[0], ident[1], ident[2], runs_per_cycle(agg.cycle, task.iteration), task.cost])
                out[name] = (agg.version, agg.cycle, entries)
        return out

    # -- reporting -----------------------------------------------------------------------------------------

    def describe(self) -> dict:
        jobs = {}
        for name, c in self.jobs.items():
            current = c.current_iteration()
            jobs[name] = {
                "phase": c.phase, "cluster": c.cluster, "standalone": c.standalone, "current": current,
                "loss": c.slowdown(), "slo": c.slo, "priority": c.priority,
                "iterations": c.iterations, "reverts": c.reverts,
            }
        return {
            "clusters": {name: plan.describe() for name, plan in self.clusters.items()},
            "jobs": jobs,
            "reserved": dict(self.reserved),
            "exclusive": dict(self.exclusive),
        }
