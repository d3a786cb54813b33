"""The control plane's scaling decisions (AutoPS 3.3.2): releasing empty Aggregators, draining
the least-loaded into the others when a job ends, and an operator adding or removing
Aggregators. Pure, like the rest of the control plane: it reads and changes the pool's plan
(:class:`~pslink.core.master.pool_plan.PoolPlan`, which the control plane shares with it) and
answers with actions.

Scaling never releases or drains Aggregators that hold replicas (the plan counts only tasks;
``replica_holders``), nor those an operator joined (``pinned``), nor below ``min_aggregators``.
A removal takes the Aggregator out of the plan at once and moves its tasks to the others with
room, else to one new Aggregator; its Release waits until any new Aggregator its tasks go to is
up. The last Aggregator of an elastic pool may go too: a new one takes its place first.
"""

from __future__ import annotations

from pslink.core.master.actions import Allocate, Migrate, Release
from pslink.core.master.job_control import JobControl
from pslink.core.master.packing import Placement
from pslink.core.master.pool_plan import PoolPlan
from pslink.errors import ConfigError, ServiceError


class Scaling:
    """Scaling decisions over one control plane's ``pool``; ``jobs`` are the plane's jobs (their
    priorities, and the Aggregators they are profiled on)."""

    def __init__(self, pool: PoolPlan, jobs: dict[str, JobControl]):
        self.pool = pool
        self.jobs = jobs
        # A removed Aggregator's Release waits until every new Aggregator its tasks go to is up
        # (the moves to them are held until then, and it must not go before they start).
        self._release_waits: dict[str, tuple[set, Release]] = {}

    # -- scaling down -----------------------------------------------------------------------------------

    def release_empty(self, reason: str, keep=()) -> list:
        """Release Aggregators that hold nothing (after migrations that emptied them finished).
        ``keep``: those that hold what the plan does not count (replicas)."""
        actions = []
        if not self.pool.elastic:
            return actions
        keep = set(keep) | self.pool.replica_holders() | self.pool.pinned
        # Tasks still to move off an Aggregator (waiting for their new one to start) keep it.
        leaving = {a.source for a in self.pool.held_moves()}
        for cluster, plan in self.pool.clusters.items():
            for name in sorted(plan.aggregators):
                if self.pool.count() <= self.pool.min_aggregators:
                    return actions
                if (plan.aggregators[name].tasks or name in self.pool.reserved or self.pool.is_placeholder(name)
                        or name in leaving or name in keep):
                    continue
                plan.remove_aggregator(name)
                self.pool.cluster_of.pop(name, None)
                self.pool.exclusive.pop(name, None)
                actions.append(Release(name, reason))
        return actions

    def scale_down(self, reason: str) -> list:
        actions = self.release_empty(reason)
        for cluster, plan in self.pool.clusters.items():
            actions += self._drain(plan, reason)
        return actions + self.release_empty(reason)

    def _drain(self, plan: Placement, reason: str) -> list:
        """Move everything off the least-loaded Aggregators while others have room (3.3.2)."""
        actions: list = []
        holders = self.pool.replica_holders() if self.pool.elastic else set()
        while self.pool.elastic and self.pool.count() > self.pool.min_aggregators:
            busy = [p for n, p in plan.aggregators.items() if p.tasks and n not in self.pool.exclusive
                    and n not in self.pool.reserved and not self.pool.is_placeholder(n)]
            # A high-priority job's tasks are not moved to free a CPU (each move stalls it).
            high = {j for j, c in self.jobs.items() if c.priority == "high"}
            drainable = [p for p in busy if p.name not in holders and p.name not in self.pool.pinned
                         and not high.intersection(p.jobs)]
            if len(busy) < 2 or not drainable:
                return actions
            lightest = min(drainable, key=lambda p: (p.work / p.cycle if p.cycle else 0.0, p.name))
            targets = [p.name for p in busy if p is not lightest]
            moves = plan.try_move_all(lightest.name, targets)
            if moves is None:
                return actions
            actions += [Migrate(ident, lightest.name, target, f"drain {lightest.name}: {reason}")
                        for ident, target in moves.items()]
            plan.remove_aggregator(lightest.name)
            self.pool.cluster_of.pop(lightest.name, None)
            actions.append(Release(lightest.name, f"drained: {reason}"))
        return actions

    def refill(self, reason: str) -> list[Allocate]:
        """Start Aggregators until the pool is back at ``min_aggregators`` (one died: the operator
        asked for that many). Those already starting count."""
        if not self.pool.elastic:
            return []
        missing = self.pool.min_aggregators - self.pool.count()
        return [self.pool.allocate(self.pool.cluster_for_new_aggregator(), reason) for _ in range(max(0, missing))]

    # -- operators changing the pool -------------------------------------------------------------------

    def add_aggregators(self, count: int) -> list[Allocate]:
        """An operator adds ``count`` Aggregators. Scaling down keeps them: ``min_aggregators``
        rises to the pool's new size."""
        if not isinstance(count, int) or count < 1:
            raise ConfigError(f"the number of Aggregators to add must be >= 1, got {count!r}")
        if self.pool.count() + count > self.pool.max_aggregators:
            raise ConfigError(f"adding {count} Aggregator(s) to the {self.pool.count()} there are would pass "
                              f"max_aggregators={self.pool.max_aggregators}")
        actions = [self.pool.allocate(self.pool.cluster_for_new_aggregator(), "added by an operator") for _ in range(count)]
        self.pool.min_aggregators = max(self.pool.min_aggregators, self.pool.count())
        return actions

    def remove_aggregator(self, name: str) -> tuple[list, dict[tuple, str]]:
        """An operator removes ``name``: it takes no new task, every task on it moves (to the
        others with room, else to a new Aggregator), then it is released. Returns the actions to
        carry out now (Migrate, Allocate, Release; moves to a new Aggregator and a Release that
        must follow them are held until it is up) and every move, task -> where it goes."""
        if name in self.pool.draining:
            raise ServiceError(f"aggregator {name} is already being removed")
        cluster = self.pool.cluster_of.get(name)
        if cluster is None or self.pool.is_placeholder(name):
            known = sorted(n for n in self.pool.cluster_of if not self.pool.is_placeholder(n))
            raise ServiceError(f"aggregator {name!r} is not in the pool (it has: {', '.join(known) or 'none'})")
        if self.pool.count() <= 1 and not self.pool.elastic:
            raise ServiceError(f"aggregator {name} is the last one in the pool and pMaster has no provider to start "
                               "another: its jobs would have nowhere to go; add one first")
        plan = self.pool.clusters[cluster]
        jobs = {ident[0] for ident in plan.aggregators[name].tasks}
        # Another job's profiling or reverted Aggregators stay its own.
        targets = [n for n in plan.aggregators if n != name
                   and all(self.pool.reserved.get(n, j) == j and self.pool.exclusive.get(n, j) == j for j in jobs)]
        if jobs and not targets and not self.pool.elastic:
            raise ServiceError(f"no other Aggregator of {cluster} may take the tasks of {name} and none can be "
                               "started (pMaster has no provider); add one first")
        self.pool.draining.add(name)
        self.pool.reserved.pop(name, None)
        self.pool.exclusive.pop(name, None)
        for control in self.jobs.values():
            if name in control.temporaries:
                control.temporaries.remove(name)
        actions: list = []
        reason = f"removing {name}"
        replacement = None
        if self.pool.count() <= 1:
            # The last one of an elastic pool: a new one takes its place (and its tasks) first.
            allocation = self.pool.allocate(cluster, f"{reason}, the last Aggregator of the pool")
            actions.append(allocation)
            replacement = allocation.placeholder
            targets = [replacement]
        moves = plan.try_move_all(name, targets)
        if moves is None:
            moves = self._move_off(plan, cluster, name, targets, actions, reason)
        for ident, target in moves.items():
            self.pool.emit(actions, Migrate(ident, name, target, reason))
        plan.remove_aggregator(name)
        self.pool.cluster_of.pop(name, None)
        self.pool.loads.pop(name, None)
        release = Release(name, "removed by an operator")
        waits = {t for t in moves.values() if self.pool.is_placeholder(t)} | ({replacement} if replacement else set())
        # Moves off it decided before (a revert's, to an Aggregator still starting) must start first too.
        waits |= {p for p, held in self.pool.held.items() for a in held if isinstance(a, Migrate) and a.source == name}
        if waits:
            self._release_waits[name] = (waits, release)
        else:
            actions.append(release)
        # The operator asked for a smaller pool: scaling must not start another in its place.
        self.pool.min_aggregators = max(1, min(self.pool.min_aggregators, self.pool.count()))
        return actions, moves

    def _move_off(self, plan: Placement, cluster: str, name: str, targets: list[str], actions: list,
                  reason: str) -> dict[tuple, str]:
        """The others lack room for all of ``name``'s tasks: each goes to the best fit among them,
        else to one new Aggregator, else (none can be started, or it fits nowhere) to the one
        with the most room left: the operator asked for the removal."""
        pool = list(targets)
        new = None
        moves: dict[tuple, str] = {}
        for task in sorted(plan.aggregators[name].tasks.values(), key=lambda t: (-t.cost, str(t.key), t.part)):
            plan.unassign(task.ident)
            target = plan.choose(task, pool)
            if target is None and new is None and self.pool.elastic and self.pool.count() < self.pool.max_aggregators:
                allocation = self.pool.allocate(cluster, f"{reason}: its tasks need room")
                actions.append(allocation)
                new = allocation.placeholder
                pool.append(new)
                target = new
            if target is None:
                _, left = plan.evaluate(task, pool)
                target = max(pool, key=lambda n: (left[plan.aggregators[n].index], n))
            plan.assign(task, target)
            moves[task.ident] = target
        return moves

    def undrain(self, name: str) -> None:
        """A removal failed part way (a move did not start): ``name`` stays in the pool, with the
        tasks it still has (pMaster moves the plan of the failed one back)."""
        if name in self.pool.draining:
            self.pool.draining.discard(name)
            self._release_waits.pop(name, None)
            self.pool.add(name)

    def released(self, name: str) -> None:
        self.pool.draining.discard(name)
        self.pool.pinned.discard(name)
        self.pool.host_of.pop(name, None)

    def forget(self, name: str) -> None:
        """``name`` is gone (failed over): no removal of it goes on."""
        self.pool.draining.discard(name)
        self._release_waits.pop(name, None)

    def placeholder_bound(self, placeholder: str) -> list:
        """A new Aggregator is up: removals that waited for it (their tasks move there) may go."""
        actions = []
        for leaving, (waits, release) in list(self._release_waits.items()):
            waits.discard(placeholder)
            if not waits:
                del self._release_waits[leaving]
                actions.append(release)
        return actions

