"""The event-driven simulation: a cluster's jobs aggregating on static servers or on pslink.

Two policies over the same jobs (:class:`~pslink.sim.workload.SimJob`):

* **static** (the ps-lite baseline): a job holds its ``servers`` CPUs from submission to its end
  and runs at its standalone speed. Nothing to simulate but the sum of step functions.
* **pslink**: the live control plane, :class:`pslink.core.master.control.ControlPlane`, with its
  placement (:mod:`pslink.core.master.packing`), guard and scaling, driven by simulated time. The
  simulator plays the parts pMaster, the Aggregators and the Agents play around it: it starts an
  Aggregator ``startup`` seconds after an ``Allocate`` and then binds it; it reports each job's
  profiled iterations and task costs, later its iteration durations and the Aggregators' loads
  to the guard; it carries out migrations through the migration core pMaster runs
  (:mod:`pslink.core.master.migration_core`): moves are batched and throttled as live ones are; a
  batch is pre-copied while its job trains (its parts' state at ``copy_bandwidth``, then each
  round's sum until the target has them all), switched at the next round boundary, and its job
  delayed once by what the control plane's own model says a move costs
  (:mod:`pslink.core.master.move_cost`: the copy's CPU where it meets the job's communication,
  the switch, and any of the last forwarded round the workers' compute does not hide); a move
  ends once the workers came round to the new place (another iteration); releases of
  Aggregators a move still involves wait for it, as pMaster's do.

How fast a packed job runs follows the model placement itself uses (the paper's cyclic
execution, 3.3.1): on an Aggregator with cycle ``C`` a job of standalone iteration ``D`` runs
``floor(C / D)`` iterations a cycle, so its iteration there is ``C / floor(C / D)``; if the work
the Aggregator really has to do in a cycle (its tasks' costs, times each job's ``contention``
when it shares the Aggregator) exceeds ``C``, the cycle stretches to that work and every job on it
slows down accordingly. A job runs at the pace of its slowest Aggregator. Jobs make progress as
a fluid: each has standalone seconds of work left, done at rate ``D / d``; a job whose speed
changes gets a new end event (older ones are dropped by a token).

The clock is the event time; nothing here sleeps, reads a clock or does I/O.
"""

from __future__ import annotations

import collections
import dataclasses
import heapq
import itertools
from typing import Callable, Iterable

from pslink.core.master.actions import Allocate, Migrate, Release, batches_of_moves
from pslink.core.master.control import DEFAULT_HEADROOM, DEFAULT_PLACEMENT_SHARE, ControlPlane
from pslink.core.master.migration_core import (DEFAULT_MAX_MIGRATION_BYTES, Begin, Finished, HandOver, Migrated,
                                           Migrations, Settle)
from pslink.core.master.move_cost import (DEFAULT_COPY_BANDWIDTH, DEFAULT_COPY_LATENCY, DEFAULT_SWITCH_LATENCY,
                                          MoveCost, compute_gap)
from pslink.core.master.packing import LOSS_LIMIT, runs_per_cycle
from pslink.sim.hosts import HostPool
from pslink.sim.results import JobOutcome, SimResult, Timeline, outcome_of, relocation_kind, simulate_static
from pslink.sim.workload import SimJob

__all__ = ["JobOutcome", "PslinkSimulation", "ServiceOptions", "SimResult", "Timeline", "simulate_pslink",
           "simulate_static"]

ARRIVE, BIND, PROFILED, GUARD, END, TICK, COPIED, CAUGHT_UP = range(8)


@dataclasses.dataclass(frozen=True)
class ServiceOptions:
    """How the simulated service behaves; the control-plane settings are ControlPlane's own."""

    startup: float = 2.0  # seconds from an Allocate until the Aggregator serves
    copy_bandwidth: float = DEFAULT_COPY_BANDWIDTH  # bytes per second a migration's copy crosses at (0: no time)
    copy_latency: float = DEFAULT_COPY_LATENCY  # seconds each message of a copy costs besides its bytes
    switch_latency: float = DEFAULT_SWITCH_LATENCY  # seconds a move's switch at a round boundary costs its job
    max_migration_bytes: int = DEFAULT_MAX_MIGRATION_BYTES  # pMaster's throttle
    timed_moves: bool = True  # False: a move ends in the instant it starts (tests of placement alone)
    loss_limit: float = LOSS_LIMIT
    guard_window: int = 100
    profile_iterations: int = 20
    scale_period: float = 0.0
    max_cluster_size: int = 64
    max_reverts: int = 2
    headroom: float = DEFAULT_HEADROOM  # of a shared Aggregator's cycle, packing leaves free
    placement_share: float = DEFAULT_PLACEMENT_SHARE  # of a job's limit, its placement may use
    host_cpus: int = 16  # Aggregators run on hosts of this many CPUs (0: no hosts, no network)
    nic_gbit: float = 25.0  # each host's NIC, Gbit/s each way

    def __post_init__(self):
        if min(self.startup, self.scale_period) < 0:
            raise ValueError("startup and scale_period must be >= 0")
        MoveCost(self.copy_bandwidth, self.copy_latency, self.switch_latency)  # refuses a bad one, naming it
        if self.profile_iterations < 1 or self.guard_window < 1:
            raise ValueError("profile_iterations and guard_window must be >= 1")
        if self.host_cpus < 0 or not self.nic_gbit > 0:
            raise ValueError("host_cpus must be >= 0 and nic_gbit > 0")

    def control_plane(self, clock: Callable[[], float], cost_per_byte: float) -> ControlPlane:
        # The pool may shrink to nothing and grow without bound: a cluster-wide service has no
        # floor of its own, and the trace decides how many CPUs it needs.
        return ControlPlane(loss_limit=self.loss_limit, guard_window=self.guard_window,
                            profile_iterations=self.profile_iterations, min_aggregators=0,
                            max_aggregators=1 << 30, max_cluster_size=self.max_cluster_size,
                            scale_period=self.scale_period, max_reverts=self.max_reverts,
                            cost_per_byte=cost_per_byte, elastic=True, clock=clock, headroom=self.headroom,
                            placement_share=self.placement_share,
                            # what a move costs: the control plane decides with it, the simulator
                            # charges it (ControlPlane.move_cost)
                            copy_bandwidth=self.copy_bandwidth if self.timed_moves else 0.0,
                            copy_latency=self.copy_latency if self.timed_moves else 0.0,
                            switch_latency=self.switch_latency if self.timed_moves else 0.0,
                            nic_bandwidth=self.nic_bandwidth if self.host_cpus else None)

    @property
    def nic_bandwidth(self) -> float:
        return self.nic_gbit * 1e9 / 8


class _Run:
    """A running job: where it is in its life and how fast it goes."""

    __slots__ = ("job", "outcome", "phase", "remaining", "rate", "since", "effective", "end_token",
                 "guard_token", "guard_pending", "cost_of")

    def __init__(self, job: SimJob, now: float):
        self.job = job
        self.outcome = outcome_of(job)
        self.phase = "profiling"
        self.remaining = job.duration  # standalone seconds of training left
        self.rate = 1.0  # standalone seconds done per second
        self.since = now
        self.effective = job.iteration  # d: its iteration now
        self.end_token = 0
        self.guard_token = 0
        self.guard_pending = False  # a GUARD event will report its iterations
        self.cost_of = {(key, part): cost for (key, part, _), cost in zip(job.parts, job.costs)}


class PslinkSimulation:
    """The pslink policy: jobs, simulated time and one live ControlPlane."""

    def __init__(self, jobs: Iterable[SimJob], options: ServiceOptions = ServiceOptions(),
                 cost_per_byte: float = 5e-10, on_progress: Callable[[int, int], None] | None = None,
                 check: bool = False):
        self.jobs = sorted(jobs, key=lambda j: j.submit)
        self.options = options
        self.now = 0.0
        self.control = options.control_plane(lambda: self.now, cost_per_byte)
        self.cost_per_byte = cost_per_byte
        self.on_progress = on_progress
        self.check = check  # after every event, compare the pool with the control plane's (tests)
        self.timeline = Timeline()
        self.counters: collections.Counter = collections.Counter()
        self._queue: list = []
        self._serial = itertools.count()
        self._names = itertools.count(1)
        self.runs: dict[str, _Run] = {}
        self.outcomes: list[JobOutcome] = []
        self.aggregators = 0  # allocated and not released, starting ones included
        self.requested = 0  # servers the running jobs asked for
        self.busy = 0.0  # CPUs the Aggregators spend aggregating
        # What the simulator last saw of each Aggregator of the plan
        self._seen: dict[str, int] = {}  # plan version
        self._speeds: dict[str, dict[str, float]] = {}  # job -> its iteration there
        self._loads: dict[str, float] = {}  # share of the Aggregator's CPU in use
        self._places: dict[str, set[str]] = collections.defaultdict(set)  # job -> Aggregators
        self._dirty: set[str] = set()  # jobs whose speed must be looked at again
        # The migrations, as pMaster carries them out; the guard leaves moving jobs be, as live.
        self.migrations = Migrations(self._move_size, options.max_migration_bytes, batch_bytes=self.control.batch_bytes)
        self._batch_copies: dict[int, tuple[float, float]] = {}  # a batch under way -> when it switched, its delay
        self.control.moving_jobs = lambda: self.migrations.moving_jobs() | self.control.jobs_waiting_to_move()
        self._held: dict[str, Release] = {}  # releases waiting for the moves that involve them
        self.hosts = HostPool(options.host_cpus, options.nic_bandwidth) if options.host_cpus else None
        self._recheck: set[str] = set()  # jobs the guard acted on: still too slow after it?
        self._arrivals_left = 0
        self._handlers = {ARRIVE: self._arrive, BIND: self._bind, PROFILED: self._profiled, GUARD: self._guard,
                          END: self._end, TICK: self._tick, COPIED: self._copied, CAUGHT_UP: self._caught_up}

    # -- the loop ----------------------------------------------------------------------------------

    def _push(self, when: float, kind: int, payload) -> None:
        heapq.heappush(self._queue, (when, next(self._serial), kind, payload))

    def run(self) -> SimResult:
        for job in self.jobs:
            self._push(job.submit, ARRIVE, job)
        self._arrivals_left = len(self.jobs)
        if self.options.scale_period > 0 and self.jobs:
            self._push(self.jobs[0].submit + self.options.scale_period, TICK, None)
        while self._queue:
            when, _, kind, payload = heapq.heappop(self._queue)
            self.now = when
            if not self._handlers[kind](payload):
                continue  # a stale event: nothing changed
            self.counters["events"] += 1
            self._refresh()
            self.timeline.record(self.now, self.aggregators, self.requested, max(0.0, self.busy))
            if self.check:
                assert self.aggregators == self.control.aggregator_count() + len(self._held), (
                    f"t={self.now}: the simulator counts {self.aggregators} Aggregators, the control plane "
                    f"{self.control.aggregator_count()} and {len(self._held)} waiting for their moves")
        self.outcomes.sort(key=lambda o: (o.submit, o.name))
        if self.hosts is not None:
            self.counters["hosts at peak"] = self.hosts.peak_hosts
            self.counters["NIC peak load"] = self.hosts.peak_load
        return SimResult("pslink", self.timeline, self.outcomes, dict(self.counters))

    # -- events ------------------------------------------------------------------------------------

    def _arrive(self, job: SimJob) -> bool:
        self._arrivals_left -= 1
        run = self.runs[job.name] = _Run(job, self.now)
        run.outcome.slo = job.slo if job.slo is not None else self.options.loss_limit
        self.requested += job.servers
        actions = self.control.job_arrived(job.name, job.workers, job.servers, slo=job.slo)
        for key, part, nbytes in job.parts:
            actions += self.control.place_part(job.name, key, part, nbytes)[1]
        self._apply(actions)
        self._schedule_end(run)
        self._push(self.now + self.options.profile_iterations * job.iteration, PROFILED, job.name)
        return True

    def _profiled(self, name: str) -> bool:
        run = self.runs.get(name)
        if run is None:
            return False  # it ended while being profiled
        job = run.job
        self.control.costs_measured(name, {(name, key, part): cost for (key, part, _), cost in zip(job.parts, job.costs)})
        actions = self.control.iterations_reported(name, [job.iteration] * self.options.profile_iterations)
        if self.control.jobs[name].phase == "profiling":
            # Not packed yet: its moves would cost more than it has run so far. Its Agents keep
            # reporting; the report after the pack is due packs it.
            self._push(max(self.now, self.control.pack_due(name)), PROFILED, name)
            return True
        run.phase = "packed"
        run.outcome.packed_at = self.now
        self._dirty.add(name)
        self._apply(actions)
        return True

    def _guard(self, payload: tuple[str, int]) -> bool:
        name, token = payload
        run = self.runs.get(name)
        if run is None or token != run.guard_token:
            return False
        run.guard_pending = False
        # What pMaster would have heard by now: the Aggregators' loads and the tasks' costs there.
        latest = {}
        for place in self._places.get(name, ()):
            agg = self._plan(place)
            factor = run.job.contention if len(agg.jobs) > 1 else 1.0
            latest.update({ident: run.cost_of[ident[1:]] * factor for ident in agg.tasks if ident[0] == name})
        self.control.costs_measured(name, latest)
        control = self.control.jobs.get(name)
        unjudged = name in self.control.moving_jobs() or (control is not None and control.settling)
        actions = self.control.iterations_reported(name, [run.effective] * self.options.guard_window)
        if unjudged:
            # Measured while its parts moved, or partly (the report after): the guard skips such a
            # window. Live, its Agents keep reporting and a later window is judged; here that
            # window must be simulated too, or a job the moves left slow, at a speed that no
            # longer changes, is never judged again (pre-copies on a slow link made moves last
            # long enough for it: a BERT job left 98% slower for its last 40 hours at 1 Gbit/s).
            self._recheck.add(name)
        if actions:
            self.counters["guard actions"] += 1
            # Its Agents keep reporting: if what the guard did leaves it as slow (tasks moved to an
            # Aggregator as busy), the next window must reach the guard even though its speed did
            # not change. Without actions the control plane has nothing left to try (its reverts
            # are spent) until something changes the job's speed.
            self._recheck.add(name)
        self._apply(actions)
        return True

    def _end(self, payload: tuple[str, int]) -> bool:
        name, token = payload
        run = self.runs.get(name)
        if run is None or token != run.end_token:
            return False
        del self.runs[name]
        run.outcome.end = self.now
        control = self.control.jobs.get(name)
        run.outcome.reverts = control.reverts if control is not None else 0
        self.counters["reverts"] += run.outcome.reverts
        self.outcomes.append(run.outcome)
        self.requested -= run.job.servers
        self._carry(self.migrations.job_ended(name, self.now))
        self._apply(self.control.job_ended(name))
        self._places.pop(name, None)
        if self.on_progress is not None:
            self.on_progress(len(self.outcomes), len(self.jobs))
        return True

    def _bind(self, placeholder: str) -> bool:
        name = f"agg-{next(self._names)}"
        follow = self.control.bind(placeholder, name)
        for table in (self._seen, self._speeds, self._loads):
            if placeholder in table:
                table[name] = table.pop(placeholder)
        self.control.pool.loads.pop(placeholder, None)
        self.control.load_measured(name, self._loads.get(name, 0.0))
        for job in self._speeds.get(name, ()):
            places = self._places[job]
            places.discard(placeholder)
            places.add(name)
        if self.hosts is not None:
            plan = self._plan(name)
            host = self.hosts.place(name, plan.rate, self.control.nics.load_of)
            self.control.aggregator_host(name, host, spread=False)  # no workers on these hosts to spread for
            self._network_changed(self.hosts.measured(name, self._real_rate(plan)))
        self._apply(follow)
        # Tasks that waited for it have moved: the places they left may be empty now.
        self._apply(self.control.release_idle("emptied by migrations"))
        return True

    def _tick(self, _) -> bool:
        self._apply(self.control.tick())
        if self.runs or self._arrivals_left:
            self._push(self.now + self.options.scale_period, TICK, None)
        return True

    # -- actions -------------------------------------------------------------------------------------

    def _apply(self, actions: list) -> None:
        for group in batches_of_moves(actions):
            action = group[0]
            if isinstance(action, Migrate):
                self._carry(self.migrations.request_many(group, self.now))  # one decision's: batches of them
            elif isinstance(action, Allocate):
                self.aggregators += 1
                self.counters["allocations"] += 1
                self._push(self.now + self.options.startup, BIND, action.placeholder)
            elif isinstance(action, Release):
                self._forget(action.aggregator)  # out of the plan: it serves no job's rounds from now on
                if self.migrations.moving(action.aggregator):
                    self._held[action.aggregator] = action  # its CPU is held until the moves off it are over
                else:
                    self._release(action)
        self._count_relocations(actions)

    def _count_relocations(self, actions: list) -> None:
        """One decision that moves parts of a job (a pack, the guard's moves, a revert, a drain)
        is one relocation of that job, whatever number of parts it moves; its migrations (batches)
        and parts moved are counted when they arrive."""
        decisions = {(a.task[0], a.reason) for a in actions if isinstance(a, Migrate)}
        for job, reason in decisions:
            self.counters[f"relocations: {relocation_kind(reason)}"] += 1
            run = self.runs.get(job)
            if run is not None:
                run.outcome.relocations += 1

    def _release(self, action: Release) -> None:
        if self.hosts is not None:
            self._network_changed(self.hosts.release(action.aggregator))
        self.aggregators -= 1
        self.counters["releases"] += 1

    # -- migrations, as pMaster carries them out ---------------------------------------------------

    def _move_size(self, task: tuple) -> int:
        control = self.control.jobs.get(task[0])
        return control.parts.get(task, 0) if control is not None else 0

    def _round(self, job: str) -> float:
        """How long until the job's workers come round again (one iteration), for timed moves."""
        run = self.runs.get(job)
        return run.effective if run is not None and self.options.timed_moves else 0.0

    def _batch_cost(self, job: str, round_bytes: int) -> tuple[float, float]:
        """A batch of ``round_bytes`` of the job's parts, begun now: how long until its switch is
        over (the pre-copy, the round boundary after it, the switch), and what it delays the job
        (the control plane's model, :attr:`ControlPlane.move_cost`, on the job's real state, its
        iteration now and its compute). Also counts the copy's CPU, the source's and the target's."""
        run = self.runs.get(job)
        cost: MoveCost = self.control.move_cost
        if run is None or not self.options.timed_moves:
            return 0.0, 0.0
        iteration, gap = run.effective, compute_gap(run.job.iteration)
        state = round_bytes * run.job.state_factor
        sent = state + cost.rounds_behind(state, round_bytes, iteration) * round_bytes
        self.counters["migration CPU seconds"] += 2 * sent * cost.copy_cpu_per_byte
        switch = cost.switch_stall(round_bytes, gap, iteration, state)
        return (cost.precopy_seconds(state, round_bytes, iteration) + self._round(job) + switch,
                cost.precopy_delay(state, round_bytes, iteration, gap) + switch)

    def _carry(self, actions: list) -> None:
        for action in actions:
            if isinstance(action, Begin):  # the target expects the task at once
                self._carry(self.migrations.target_ready(action.move.task, True, self.now))
            elif isinstance(action, HandOver):  # the source pre-copies it, then switches at a round boundary
                move = action.move
                self._carry(self.migrations.handed_over(move.task, move.source, True, self.now))
                # A batch's parts are copied as one stream and switch together: it delays the job once.
                switched = self._batch_copies.get(move.batch)
                delay = 0.0
                if switched is None:
                    batch = self.migrations.batch(move.batch)
                    seconds, delay = self._batch_cost(move.task[0], batch.bytes if batch is not None else move.bytes)
                    switched = self._batch_copies[move.batch] = (self.now + seconds, delay)
                self._push(switched[0], COPIED, (move.task, delay))
            elif isinstance(action, Finished):
                if self.migrations.batch(action.move.batch) is None:
                    self._batch_copies.pop(action.move.batch, None)
                if action.why == "done":
                    self.counters["parts moved"] += 1
                    self.counters["migrated bytes"] += action.move.bytes
                    run = self.runs.get(action.move.task[0])
                    if run is not None:
                        run.outcome.parts_moved += 1
            elif isinstance(action, Migrated):
                self.counters["migrations"] += 1
                run = self.runs.get(action.batch.job)
                if run is not None:
                    run.outcome.migrations += 1
            elif isinstance(action, Settle):
                for name in action.names:
                    held = self._held.get(name)
                    if held is not None and not self.migrations.moving(name):
                        del self._held[name]
                        self._release(held)
                if self.migrations.idle():
                    self._apply(self.control.release_idle("emptied by migrations"))

    def _copied(self, payload: tuple) -> bool:
        """A move's switch is over: the job pays its batch's delay (once); then its workers come
        round."""
        task, delay = payload
        run = self.runs.get(task[0])
        if run is not None and delay > 0:
            self._advance(run)
            run.remaining += delay * run.rate
            self._schedule_end(run)
        self._carry(self.migrations.copy_done(task, self.now))
        self._push(self.now + self._round(task[0]), CAUGHT_UP, task)
        return True

    def _caught_up(self, task: tuple) -> bool:
        self._carry(self.migrations.workers_done(task, self.now))
        return True

    def _forget(self, name: str) -> None:
        if self.hosts is not None:
            self._network_changed(self.hosts.measured(name, 0.0))  # it serves nothing from now on
        self._seen.pop(name, None)
        self.busy -= self._loads.pop(name, 0.0)
        for job in self._speeds.pop(name, {}):
            self._places.get(job, set()).discard(name)
            self._dirty.add(job)

    def _plan(self, name: str):
        return self.control.pool.clusters[self.control.pool.cluster_of[name]].aggregators[name]

    # -- speeds --------------------------------------------------------------------------------------

    def _refresh(self) -> None:
        """Look at every Aggregator whose plan changed; re-time the jobs on it."""
        dirty, self._dirty = self._dirty, set()
        for plan in self.control.pool.clusters.values():
            for name in sorted(plan.take_changed()):  # sorted: the same order in every process
                agg = plan.aggregators[name]
                if self._seen.get(name) != agg.version:
                    self._seen[name] = agg.version
                    dirty |= self._evaluate(name, agg)
        dirty |= self._dirty  # the network's verdicts on the way
        self._dirty = set()
        if self.hosts is not None:
            self.hosts.settle()
        for job in sorted(dirty):  # sets of names iterate in a per-process hash order: sort for repeatability
            run = self.runs.get(job)
            if run is None:
                continue
            places = self._places.get(job, ())
            networks = {p: self._network(p) for p in places}
            if any(n > 1.0 for n in networks.values()):
                run.outcome.network_slowed = True
            effective = max([run.job.iteration] + [self._speeds[p][job] * n for p, n in networks.items()])
            if abs(effective - run.effective) > 1e-12 * effective:
                self._set_speed(run, effective)
        recheck, self._recheck = self._recheck, set()
        for job in sorted(recheck):
            run = self.runs.get(job)
            if run is not None:
                self._watch(run)

    def _evaluate(self, name: str, agg) -> set[str]:
        """The iteration each packed job gets on this Aggregator, and its load; returns the jobs
        that were or are on it."""
        before = self._speeds.get(name, {})
        speeds: dict[str, float] = {}
        load = 0.0
        cycle = agg.cycle
        if agg.jobs and cycle > 0:
            shared = len(agg.jobs) > 1
            work = 0.0
            for job, share in agg.jobs.items():
                run = self.runs.get(job)
                if run is None:
                    continue
                if run.phase == "profiling":
                    # Alone on its own Aggregators (its plan entries are provisional): its real
                    # costs over its real iteration.
                    load += sum(run.cost_of[i[1:]] for i in agg.tasks if i[0] == job) / run.job.iteration
                    speeds[job] = run.job.iteration  # at its own speed, unless the network holds it up
                    continue
                work += runs_per_cycle(cycle, share.iteration) * share.work * (run.job.contention if shared else 1.0)
            stretch = max(1.0, work / cycle)
            for job, share in agg.jobs.items():
                run = self.runs.get(job)
                if run is not None and run.phase != "profiling":
                    speeds[job] = cycle / runs_per_cycle(cycle, share.iteration) * stretch
            load = min(1.0, load + work / cycle)
        for job in before.keys() - speeds.keys():
            self._places.get(job, set()).discard(name)
        for job in speeds:
            self._places[job].add(name)
        self._speeds[name] = speeds
        self.busy += load - self._loads.get(name, 0.0)
        self._loads[name] = load
        self.control.load_measured(name, load)  # Aggregators report their load (here: at once)
        if self.hosts is not None and not self.control.pool.is_placeholder(name):
            self._network_changed(self.hosts.measured(name, self._real_rate(agg)))
        return before.keys() | speeds.keys()

    # -- the network (hosts.py) ------------------------------------------------------------------------

    def _real_rate(self, agg) -> float:
        """Bytes/s the Aggregator's tasks really receive: each worker pushes each task once an
        iteration of its job (at its standalone speed: an upper bound)."""
        rate = 0.0
        for ident, task in agg.tasks.items():
            run = self.runs.get(ident[0])
            if run is not None:
                rate += task.nbytes * run.job.workers / run.job.iteration
        return rate

    def _network(self, name: str) -> float:
        return self.hosts.factor(name) if self.hosts is not None else 1.0

    def _network_changed(self, names: set[str]) -> None:
        for name in names:
            self._dirty.update(self._speeds.get(name, ()))

    def _advance(self, run: _Run) -> None:
        run.remaining = max(0.0, run.remaining - (self.now - run.since) * run.rate)
        run.since = self.now

    def _schedule_end(self, run: _Run) -> None:
        run.end_token += 1
        self._push(self.now + run.remaining / run.rate, END, (run.job.name, run.end_token))

    def _set_speed(self, run: _Run, effective: float) -> None:
        self._advance(run)
        run.effective = effective
        run.rate = run.job.iteration / effective
        self._schedule_end(run)
        self._watch(run)

    def _watch(self, run: _Run) -> None:
        """Report a window of iterations to the guard when the control plane would act on it.

        pMaster hears every job's iterations all the time, but acts only when a window's median
        loses more than the loss limit against the job's standalone duration (the control
        plane's own figure, which a revert may re-learn). Only such windows are simulated as
        GUARD events: a job that is slow gets one a window after it became slow, and keeps it
        while its speed changes (the window it judges spans those changes); a job that is fast
        again has it cancelled. Reporting every window of every job would cost millions of
        events for answers known in advance."""
        control = self.control.jobs.get(run.job.name)
        standalone = control.standalone if control is not None else None
        slow = standalone is not None and run.effective / standalone - 1.0 > control.slo
        if slow and not run.guard_pending:
            run.guard_token += 1
            run.guard_pending = True
            self._push(self.now + self.options.guard_window * run.effective, GUARD, (run.job.name, run.guard_token))
        elif not slow and run.guard_pending:
            run.guard_token += 1  # the pending report would find nothing to do
            run.guard_pending = False


def simulate_pslink(jobs: Iterable[SimJob], options: ServiceOptions = ServiceOptions(), cost_per_byte: float = 5e-10,
                    on_progress: Callable[[int, int], None] | None = None, check: bool = False) -> SimResult:
    return PslinkSimulation(jobs, options, cost_per_byte, on_progress, check).run()
