"""The performance guard (AutoPS 3.3.2, Appendix D): judging a packed job's iterations against its
standalone ones and its own limit, and relieving it when it is too slow. Pure, like the rest of
the control plane: it reads and changes the pool's plan
(:class:`~pslink.core.master.pool_plan.PoolPlan`, which the control plane shares with it) and
answers with actions.

A job is judged on the median of its last ``guard_window`` iterations, against its slowdown
limit (its SLO) plus a margin for its own noise (:meth:`JobControl.noise_margin`). Too slow: tasks on a congested Aggregator move to others with room, once;
failing that, or still too slow after that move, the job is reverted onto a new Aggregator of
its own (at most ``max_reverts`` times), once the revert pays for its moves (a short job keeps
its place: :meth:`JobControl.revert_pays`). While its tasks move, and in the report right after, it
is not judged: each window is measured on one placement, the one it is judged for. A job whose
own work per iteration changed (its Agents report it) is re-profiled: its standalone iteration
moves by that change, and the guard judges the placement against that, from the same window on.
"""

from __future__ import annotations

from typing import Callable

from pslink.core.master.actions import Allocate, Migrate
from pslink.core.master.job_control import JobControl
from pslink.core.master.move_cost import MoveCost
from pslink.core.master.packing import NewAggregator, Placement
from pslink.core.master.pool_plan import PoolPlan
from pslink.core.master.scaling import Scaling


class Guard:
    """The performance guard over one control plane's jobs: it judges a job on windows of
    ``guard_window`` iterations, relieves it off Aggregators loaded past ``congested_load`` (or
    costing it ``cost_inflation`` times its profile), and reverts it at most ``max_reverts``
    times, once a revert pays for its moves (``move_cost``). It moves
    tasks in ``pool``'s plan and has ``scaling`` release what a revert emptied."""

    def __init__(self, pool: PoolPlan, scaling: Scaling, *, guard_window: int, max_reverts: int,
                 congested_load: float, cost_inflation: float, move_cost: MoveCost, clock: Callable[[], float]):
        self.pool, self.scaling = pool, scaling
        self.guard_window = guard_window
        self.max_reverts = max_reverts
        self.congested_load = congested_load
        self.cost_inflation = cost_inflation
        self.move_cost = move_cost
        self.clock = clock

    def judge(self, control: JobControl, durations: list[float], moving: bool) -> list:
        """A packed job's new iterations: the actions the guard takes (none if it is fast enough).
        ``moving``: its tasks are on the move."""
        if moving:
            # Its tasks are moving (an operator's removal, a drain, the guard's own moves, a pack):
            # these iterations measure neither the placement it had nor the one it gets, and
            # they include the moves' copies. The guard judges the new placement on its own
            # iterations (as after its own moves), not on a window filled before or during them.
            control.window.clear()
            control.settling = True
            return []
        if control.settling:
            control.settling = False  # the first report since: measured partly during the moves
            return []
        control.window.extend(durations)
        while len(control.window) > self.guard_window:
            control.window.popleft()
        if len(control.window) < self.guard_window or control.standalone is None:
            return []
        current = control.current_iteration()
        change = control.own_work_change(self.guard_window)
        if change is not None:
            # The worker's own work per iteration changed (a bigger batch, another phase of the
            # job): its iterations changed by that much whatever its placement, so that is its
            # standalone speed now (re-profiled, not reverted or moved for what it did itself).
            # This window is judged against it at once: only a slowdown beyond the job's own
            # change is the guard's business. (Judging only the next window let a job whose work
            # kept changing escape the guard: CI saw a CPU-starved Aggregator, which also slowed
            # the worker beside it, never relieved in 40 s, re-profiled every window.)
            control.standalone = max(control.standalone + change, 1e-9)
            control.work_baseline += change
        if control.grown:
            # Its iterations now include keys it declared after its profile: however much slower
            # they are, the job did that, not its neighbours (the guard would otherwise revert
            # or spread a job for its own growth). Judged from here on against this window.
            control.grown = False
            control.standalone = current
            control.window.clear()
            return []
        loss = current / control.standalone - 1.0  # its slowdown
        if loss <= control.slo + control.noise_margin():
            return []
        control.window.clear()  # judge the next placement on its own iterations
        return self.act(control, loss, current)

    def congested(self, control: JobControl, plan: Placement) -> list[str]:
        """The job's Aggregators that are the likely cause: busy (their measured load) or slow
        for it (its tasks there cost several times what they cost when profiled)."""
        out = []
        for name in sorted({plan.where[i] for i in control.parts if i in plan.where}):
            tasks = [i for i in control.parts if plan.where.get(i) == name]
            before = sum(control.costs.get(i, 0.0) for i in tasks)
            now = sum(control.latest_costs.get(i, 0.0) for i in tasks)
            if self.pool.loads.get(name, 0.0) >= self.congested_load or (before > 0 and now >= self.cost_inflation * before):
                out.append(name)
        return out

    def act(self, control: JobControl, loss: float, current: float) -> list:
        """The job runs too slowly on its packed placement: relieve it (Appendix D, Figure 10)."""
        plan = self.pool.clusters[control.cluster]
        congested = self.congested(control, plan)
        actions: list = []
        if congested and not control.relieved:
            others = [n for n in self.pool.candidates(control.job, control.cluster) if n not in congested]
            for name in congested:
                for ident in [i for i in control.parts if plan.where.get(i) == name]:
                    demand = plan.unassign(ident)
                    target = plan.choose(demand, others)
                    if target is None:
                        plan.assign(demand, name)
                        break
                    plan.assign(demand, target)
                    actions.append(Migrate(ident, name, target, f"aggregator {name} congested"))
            if actions:
                control.relieved = True
                return actions
        if control.reverts >= self.max_reverts or not self.pool.elastic:
            return []
        if control.exclusive and not congested:
            # Alone on Aggregators of its own and not held up by them: this is how fast it runs
            # alone now (the host changed), so that is its standalone speed from here on.
            control.standalone = current
            return []
        if not control.revert_pays(loss, self.clock(), self.move_cost):
            return []  # judged again with the next window, when it has run longer
        control.reverts += 1
        control.relieved = False
        control.phase = "reverted"
        control.exclusive = True
        current = {i: plan.where[i] for i in control.parts if i in plan.where}
        demands = [plan.unassign(i) for i in current]
        # The job's own new Aggregator joins its cluster even past the size limit: a job is
        # served from one cluster.
        allocation = self.pool.allocate(control.cluster, f"revert job {control.job}: {loss:.0%} slower than alone")
        self.pool.exclusive[allocation.placeholder] = control.job
        actions = [allocation]
        new = [allocation.placeholder]
        decisions = plan.place_all(demands, new)
        for ident, decision in decisions.items():
            target = decision.placeholder if isinstance(decision, NewAggregator) else decision
            if isinstance(decision, NewAggregator):
                self.pool.cluster_of[target] = control.cluster
                self.pool.exclusive[target] = control.job
                actions.append(Allocate(control.cluster, target, f"revert job {control.job}"))
            self.pool.emit(actions, Migrate(ident, current[ident], target, f"revert job {control.job}"))
        return actions + self.scaling.release_empty(f"job {control.job} reverted")
