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
   Pseudocode 1 (:mod:`pslink.core.master.packing`, each job within ``placement_share`` of its own
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
import statistics
from typing import Any, Callable

from pslink.core.master.actions import Allocate, Migrate
from pslink.core.master import spread
from pslink.core.master.packing import LOSS_LIMIT, NewAggregator, TaskDemand, runs_per_cycle
from pslink.core.master.job_control import JobControl, check_service_level
from pslink.core.master.nics import Nics
from pslink.core.master.guard import Guard
from pslink.core.master.move_cost import (DEFAULT_COPY_BANDWIDTH, DEFAULT_COPY_LATENCY, DEFAULT_SWITCH_LATENCY,
                                          MoveCost)
from pslink.core.master.pool_plan import PoolPlan
from pslink.core.master.scaling import Scaling

DEFAULT_COST_PER_BYTE = 5e-10  # CPU s an Aggregator spends per byte pushed, before any measurement (~2 GB/s)
PROVISIONAL_ITERATION = 1.0  # placeholder duration for a profiling job's tasks (its Aggregators are its own)
#: Share of a shared Aggregator's cycle packing leaves free: a job's costs are profiled alone, and
#: next to other jobs they grow (the trace-driven simulator's jobs: 7% at the median, 25% at p99).
DEFAULT_HEADROOM = 0.1
#: Share of a job's slowdown limit placement may use; the rest: its moves' stalls, the guard's delay, noise.
DEFAULT_PLACEMENT_SHARE = 0.8


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
        switch_latency: float = DEFAULT_SWITCH_LATENCY,
        nic_bandwidth: float | None = None,
        elastic: bool = True,
        replica_holders: Callable[[], set] = set,
        clock: Callable[[], float] | None = None,
    ):
        if not 0 < placement_share <= 1:
            raise ValueError(f"placement_share must be in (0, 1], got {placement_share}")
        self.loss_limit = loss_limit
        self.placement_share = placement_share
        # What a move costs its jobs: the control plane decides with it, the simulator charges it.
        # The copy's CPU a byte is an Aggregator's (a socket copy, as a pushed byte costs).
        self.move_cost = MoveCost(copy_bandwidth=copy_bandwidth, copy_latency=copy_latency,
                                  switch_latency=switch_latency, copy_cpu_per_byte=cost_per_byte)
        self.nics = Nics(nic_bandwidth)  # every host's NIC, shared by the clusters' plans
        self.guard_window = guard_window
        self.profile_iterations = profile_iterations
        self.scale_period = scale_period
        self.cost_per_byte = cost_per_byte
        self.clock = clock or (lambda: 0.0)
        # The pool as the plans see it, shared with scaling and the guard (each gets it here).
        self.pool = PoolPlan(loss_limit=loss_limit, headroom=headroom, nics=self.nics,
                             min_aggregators=min_aggregators, max_aggregators=max_aggregators,
                             max_cluster_size=max_cluster_size, elastic=elastic, replica_holders=replica_holders)
        self.jobs: dict[str, JobControl] = {}
        self._pending_scale_down = False
        self._last_scale = self.clock()
        # Jobs with tasks on the move (pMaster's migrations, running, queued, or waiting for a
        # new Aggregator): the guard does not judge them meanwhile. Set by whoever carries the
        # migrations out (pMaster, the simulator): its migration core is made
        # after this plane, which it asks how large a batch may be (batch_bytes).
        self.moving_jobs: Callable[[], set] = set
        self.scaling = Scaling(self.pool, self.jobs)
        self.guard = Guard(self.pool, self.scaling, guard_window=guard_window, max_reverts=max_reverts,
                           congested_load=congested_load, cost_inflation=cost_inflation, move_cost=self.move_cost,
                           clock=self.clock)

    # -- the pool ---------------------------------------------------------------------------------

    def aggregator_added(self, name: str) -> None:
        """An Aggregator nobody asked for joined (the initial pool, a restart, an operator)."""
        self.pool.add(name)

    def aggregator_host(self, name: str, host: str, spread: bool = True) -> None:
        """``name`` runs on ``host``: its tasks load that host's NIC (placement keeps every NIC
        within ``nic_bandwidth``) and, with ``spread``, jobs are spread over the pool's hosts.
        The simulator's Aggregator hosts are a pool of their own, with no workers on them to
        balance: it passes ``spread=False``."""
        if spread:
            self.pool.host_of[name] = host
        cluster = self.pool.cluster_of.get(name)
        if cluster is not None:
            self.pool.clusters[cluster].set_host(name, host)

    def aggregator_count(self) -> int:
        return self.pool.count()

    def bind(self, placeholder: str, name: str) -> list:
        """An allocated Aggregator registered as ``name``: the actions that waited for it."""
        cluster = self.pool.cluster_of.pop(placeholder)
        self.pool.clusters[cluster].rename(placeholder, name)
        self.pool.cluster_of[name] = cluster
        if name in self.pool.host_of:
            self.pool.clusters[cluster].set_host(name, self.pool.host_of[name])
        for table in (self.pool.reserved, self.pool.exclusive):
            if placeholder in table:
                table[name] = table.pop(placeholder)
        for job in self.jobs.values():
            job.temporaries = [name if t == placeholder else t for t in job.temporaries]
        actions = [self._rebind(a, placeholder, name) for a in self.pool.held.pop(placeholder, [])]
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
        cluster = self.pool.cluster_of.pop(name, None)
        if cluster is not None:
            self.pool.clusters[cluster].remove_aggregator(name)
        self.pool.reserved.pop(name, None)
        self.pool.exclusive.pop(name, None)
        self.pool.loads.pop(name, None)
        self.scaling.forget(name)
        self.pool.pinned.discard(name)
        for control in self.jobs.values():
            if name in control.temporaries:  # a job profiled on it declares its next parts elsewhere
                control.temporaries.remove(name)

    def task_recovered(self, ident: tuple, aggregator: str) -> None:
        """A part now lives on ``aggregator`` because its own Aggregator failed (a replica was
        promoted, or it started afresh there)."""
        control = self.jobs.get(ident[0])
        if control is None or ident not in control.parts:
            return
        for plan in self.pool.clusters.values():
            plan.unassign(ident)
        if aggregator not in self.pool.cluster_of:
            self.aggregator_added(aggregator)
        self.pool.clusters[self.pool.cluster_of[aggregator]].assign(self._demand(control, ident), aggregator)

    def jobs_waiting_to_move(self) -> set[str]:
        """Jobs with moves held until the Aggregator they go to is up."""
        return {a.task[0] for a in self.pool.held_moves()}

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
        cluster = max(self.pool.clusters, key=lambda c: len(self._idle(c)), default=None) or self.pool.new_cluster()
        control = self.jobs[job] = JobControl(job, workers, servers, cluster, slo=self.loss_limit if slo is None else slo,
                                              priority=priority, arrived=self.clock())
        if self.profile_iterations <= 0:
            control.phase = "packed"
            return []
        actions: list = []
        for name in self._profiling_places(cluster, servers):
            control.temporaries.append(name)
            self.pool.reserved[name] = job
        while self.pool.elastic and len(control.temporaries) < servers and self.aggregator_count() < self.pool.max_aggregators:
            allocation = self.pool.allocate(self.pool.cluster_for_new_aggregator(cluster), f"profile job {job} alone")
            control.temporaries.append(allocation.placeholder)
            self.pool.reserved[allocation.placeholder] = job
            actions.append(allocation)
        return actions

    def _profiling_places(self, cluster: str, servers: int) -> list[str]:
        """Idle Aggregators to profile a job on, one host after another; with NICs known, one per
        NIC (the job's own traffic is not known either)."""
        places = spread.across_hosts(self._idle(cluster), self.pool.host_of)
        return (spread.one_per_nic(places, self.pool.clusters[cluster]) if self.nics.limited else places)[:servers]

    def _idle(self, cluster: str) -> list[str]:
        plan = self.pool.clusters[cluster]
        idle = sorted(n for n, a in plan.aggregators.items()
                      if not a.tasks and n not in self.pool.reserved and n not in self.pool.exclusive
                      and not self.pool.is_placeholder(n))
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
            pool = control.temporaries or self.pool.candidates(control.job, control.cluster)
            on_host = spread.bytes_by_host(control.parts, self.pool.clusters.values(), self.pool.host_of)
            target = min(pool, key=lambda n: (on_host[self.pool.host_of.get(n, "")], self._bytes_on(n), n))
            self.pool.clusters[self.pool.cluster_of[target]].assign(self._demand(control, ident, provisional=True), target)
            return target, []
        target, actions = self._place_spread(control, self._demand(control, ident), self.pool.candidates(control.job, control.cluster),
                                             f"no room for a part of job {job}", spread.bytes_by_host(control.parts, self.pool.clusters.values(), self.pool.host_of))
        control.grown = True
        control.window.clear()  # iterations without the new key say nothing about the job now
        return target, actions

    def _place_spread(self, control: JobControl, demand: TaskDemand, candidates: list[str], reason: str,
                      on_host: collections.Counter) -> tuple[str, list]:
        """Pseudocode 1 for one task, trying the hosts that hold the fewest of the job's bytes
        first (``on_host``, updated); on one host simply :meth:`_place_one`."""
        live = [n for n in candidates if not self.pool.is_placeholder(n)]
        target = spread.choose(self.pool.clusters[control.cluster], demand, live, self.pool.host_of, on_host)
        actions: list = []
        if target is None:
            target, actions = self._place_one(control, demand, candidates, reason)
        on_host[self.pool.host_of.get(target, "")] += demand.nbytes
        return target, actions

    def _place_one(self, control: JobControl, demand: TaskDemand, candidates: list[str], reason: str) -> tuple[str, list]:
        """Pseudocode 1 for one task; without elasticity the least-full candidate takes what fits
        nowhere."""
        plan = self.pool.clusters[control.cluster]
        decision = plan.place(demand, candidates, allow_new=self.pool.elastic)
        if isinstance(decision, NewAggregator):
            self.pool.cluster_of[decision.placeholder] = control.cluster
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
            for plan in self.pool.clusters.values():
                plan.unassign(ident)
            if control is not None:
                control.parts.pop(ident, None)
                control.costs.pop(ident, None)

    def adopt_job(self, job: str, workers: int, servers: int | None, slo: float | None = None,
                  priority: str = "normal", cluster: str | None = None) -> JobControl:
        """A job that ran before a pMaster restart: it keeps its places and is profiled again."""
        control = self.jobs.get(job)
        if control is None:
            cluster = cluster or next(iter(self.pool.clusters), None) or self.pool.new_cluster()
            control = self.jobs[job] = JobControl(job, workers, max(1, servers or workers), cluster,
                                                  slo=self.loss_limit if slo is None else slo, priority=priority,
                                                  arrived=self.clock(), adopted=True)
        return control

    def adopt_part(self, job: str, workers: int, servers: int | None, key: Any, part: int, nbytes: int,
                   aggregator: str) -> None:
        """A part placed before a pMaster restart: keep it where it is, learn the job again."""
        if aggregator not in self.pool.cluster_of:
            self.aggregator_added(aggregator)
        control = self.adopt_job(job, workers, servers, cluster=self.pool.cluster_of[aggregator])
        ident = (job, key, part)
        control.parts[ident] = nbytes
        self.pool.clusters[self.pool.cluster_of[aggregator]].assign(self._demand(control, ident, provisional=True), aggregator)

    def _bytes_on(self, name: str) -> int:
        return self.pool.clusters[self.pool.cluster_of[name]].aggregators[name].nbytes

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

    def move_task(self, ident: tuple, target: str, reason: str = "requested") -> Migrate | None:
        """An operator's move (or a benchmark's): update the plan and say how to carry it out."""
        source = self.pool.where(ident)
        if source == target:
            return None
        source_plan = self.pool.clusters[self.pool.cluster_of[source]]
        demand = source_plan.unassign(ident)
        self.pool.clusters[self.pool.cluster_of[target]].assign(demand, target)
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
        self.pool.loads[name] = load

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
        return self.guard.judge(control, durations, moving=job in self.moving_jobs())

    def batch_bytes(self, job: str) -> int:
        """The most bytes one migration of the job's parts may copy (:meth:`JobControl.batch_bytes`)."""
        control = self.jobs.get(job)
        return control.batch_bytes(self.move_cost) if control is not None else 0

    def pack_due(self, job: str) -> float:
        """When packing the job pays for its moves (:meth:`JobControl.pack_due`)."""
        return self.jobs[job].pack_due(self.move_cost, self.placement_share)

    def _pack(self, control: JobControl) -> list:
        """Profiling is over: place every task of the job by Pseudocode 1, best-fit cluster."""
        control.standalone = control.profiled_iteration = statistics.median(control.profiled)
        control.work_baseline = statistics.median(control.work) if control.work else None
        control.phase = "packed"
        if control.adopted or not self.pool.elastic and not control.temporaries:
            self._record_demands(control)  # measured where it already runs: move nothing
            return []
        current = {i: self.pool.where(i) for i in control.parts}
        for ident in control.parts:
            self.pool.clusters[self.pool.cluster_of[current[ident]]].unassign(ident)
        for name in control.temporaries:
            self.pool.reserved.pop(name, None)
        demands = [self._demand(control, i) for i in control.parts]
        control.cluster = self._best_cluster(control, demands)
        actions = self._place_job(control, demands, current, "pack after profiling")
        control.temporaries = []
        return actions + self.scaling.release_empty(f"job {control.job} packed")

    def _record_demands(self, control: JobControl, provisional: bool = False) -> None:
        """The job's parts stay where they are, with their demands as now known."""
        for ident in control.parts:
            name = self.pool.where(ident)
            self.pool.clusters[self.pool.cluster_of[name]].assign(self._demand(control, ident, provisional), name)

    def _best_cluster(self, control: JobControl, demands: list[TaskDemand]) -> str:
        need = sum(d.cost for d in demands) / control.standalone
        fits = [(plan.free_capacity(), name) for name, plan in self.pool.clusters.items() if plan.free_capacity() >= need]
        return min(fits)[1] if fits else control.cluster

    def _place_job(self, control: JobControl, demands: list[TaskDemand], current: dict, reason: str,
                   candidates: list[str] | None = None) -> list:
        pool = candidates if candidates is not None else self.pool.candidates(control.job, control.cluster)
        actions: list = []
        ordered = sorted(demands, key=lambda d: (-d.cost, str(d.key), d.part))
        if spread.one_host([n for n in pool if not self.pool.is_placeholder(n)], self.pool.host_of):
            # One host (or none known): the whole job in one pass of Pseudocode 1, as task by task
            # (and its actions in the same order: an Allocate just before the first move to it).
            opened: dict[tuple, list] = {}

            def fits_nowhere(demand: TaskDemand, names: set) -> str:
                target, opened[demand.ident] = self._place_one(control, demand, sorted(names),
                                                               f"{reason}: job {control.job} needs room")
                return target

            targets = self.pool.clusters[control.cluster].place_many(ordered, pool, on_miss=fits_nowhere)
            for demand, target in zip(ordered, targets):
                actions += opened.get(demand.ident, [])
                if current.get(demand.ident) != target:
                    self.pool.emit(actions, Migrate(demand.ident, current[demand.ident], target, reason))
            return actions
        on_host: collections.Counter = collections.Counter()
        for demand in ordered:
            target, more = self._place_spread(control, demand, pool, f"{reason}: job {control.job} needs room",
                                              on_host)
            actions += more
            if target not in pool:
                pool = pool + [target]
            if current.get(demand.ident) != target:
                self.pool.emit(actions, Migrate(demand.ident, current[demand.ident], target, reason))
        return actions

    def job_ended(self, job: str) -> list:
        control = self.jobs.pop(job, None)
        if control is None:
            return []
        for plan in self.pool.clusters.values():
            plan.remove_job(job)
        for table in (self.pool.reserved, self.pool.exclusive):
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
        for plan in self.pool.clusters.values():
            for name, agg in plan.aggregators.items():
                if self.pool.is_placeholder(name):
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
            "clusters": {name: plan.describe() for name, plan in self.pool.clusters.items()},
            "jobs": jobs,
            "reserved": dict(self.pool.reserved),
            "exclusive": dict(self.pool.exclusive),
        }
