"""The control plane's scaling decisions (AutoPS 3.3.2): releasing empty Aggregators, draining
the least-loaded into the others when a job ends, and an operator adding or removing
Aggregators. Pure, like the rest of the control plane: it reads and changes the
:class:`~pslink.core.master.control.ControlPlane`'s pool and answers with actions.

Scaling never releases or drains Aggregators that hold replicas (the plan counts only tasks;
``replica_holders``), nor those an operator joined (``pinned``), nor below ``min_aggregators``.
A removal takes the Aggregator out of the plan at once and moves its tasks to the others with
room, else to one new Aggregator; its Release waits until any new Aggregator its tasks go to is
up. The last Aggregator of an elastic pool may go too: a new one takes its place first.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pslink.core.master.actions import Allocate, Migrate, Release
from pslink.core.master.placement import Placement
from pslink.errors import ConfigError, ServiceError

if TYPE_CHECKING:
    from pslink.core.master.control import ControlPlane


class Scaling:
    """Scaling decisions over one control plane's pool."""

    def __init__(self, plane: "ControlPlane"):
        self.plane = plane
        # A removed Aggregator's Release waits until every new Aggregator its tasks go to is up
        # (the moves to them are held until then, and it must not go before they start).
        self._release_waits: dict[str, tuple[set, Release]] = {}

    # -- scaling down -----------------------------------------------------------------------------------

    def release_empty(self, reason: str, keep=()) -> list:
        """Release Aggregators that hold nothing (after migrations that emptied them finished).
        ``keep``: those that hold what the plan does not count (replicas)."""
        actions = []
        if not self.plane.elastic:
            return actions
        keep = set(keep) | self.plane.replica_holders() | self.plane.pinned
        # Tasks still to move off an Aggregator (waiting for their new one to start) keep it.
        leaving = {a.source for held in self.plane._held.values() for a in held if isinstance(a, Migrate)}
        for cluster, plan in self.plane.clusters.items():
            for name in sorted(plan.aggregators):
                if self.plane.aggregator_count() <= self.plane.min_aggregators:
                    return actions
                if (plan.aggregators[name].tasks or name in self.plane.reserved or self.plane.is_placeholder(name)
                        or name in leaving or name in keep):
                    continue
                plan.remove_aggregator(name)
                self.plane.cluster_of.pop(name, None)
                self.plane.exclusive.pop(name, None)
                actions.append(Release(name, reason))
        return actions

    def scale_down(self, reason: str) -> list:
        actions = self.release_empty(reason)
        for cluster, plan in self.plane.clusters.items():
            actions += self._drain(plan, reason)
        return actions + self.release_empty(reason)

    def _drain(self, plan: Placement, reason: str) -> list:
        """Move everything off the least-loaded Aggregators while others have room (3.3.2)."""
        actions: list = []
        holders = self.plane.replica_holders() if self.plane.elastic else set()
        while self.plane.elastic and self.plane.aggregator_count() > self.plane.min_aggregators:
            busy = [p for n, p in plan.aggregators.items() if p.tasks and n not in self.plane.exclusive
                    and n not in self.plane.reserved and not self.plane.is_placeholder(n)]
            # A high-priority job's tasks are not moved to free a CPU (each move stalls it).
            high = {j for j, c in self.plane.jobs.items() if c.priority == "high"}
            drainable = [p for p in busy if p.name not in holders and p.name not in self.plane.pinned
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
            self.plane.cluster_of.pop(lightest.name, None)
            actions.append(Release(lightest.name, f"drained: {reason}"))
        return actions

    def refill(self, reason: str) -> list[Allocate]:
        """Start Aggregators until the pool is back at ``min_aggregators`` (one died: the operator
        asked for that many). Those already starting count."""
        if not self.plane.elastic:
            return []
        missing = self.plane.min_aggregators - self.plane.aggregator_count()
        return [self.plane._allocate(self.plane._cluster_for_new_aggregator(), reason) for _ in range(max(0, missing))]

    # -- operators changing the pool -------------------------------------------------------------------

    def add_aggregators(self, count: int) -> list[Allocate]:
        """An operator adds ``count`` Aggregators. Scaling down keeps them: ``min_aggregators``
        rises to the pool's new size."""
        if not isinstance(count, int) or count < 1:
            raise ConfigError(f"the number of Aggregators to add must be >= 1, got {count!r}")
        if self.plane.aggregator_count() + count > self.plane.max_aggregators:
            raise ConfigError(f"adding {count} Aggregator(s) to the {self.plane.aggregator_count()} there are would pass "
                              f"max_aggregators={self.plane.max_aggregators}")
        actions = [self.plane._allocate(self.plane._cluster_for_new_aggregator(), "added by an operator") for _ in range(count)]
        self.plane.min_aggregators = max(self.plane.min_aggregators, self.plane.aggregator_count())
        return actions

    def remove_aggregator(self, name: str) -> tuple[list, dict[tuple, str]]:
        """An operator removes ``name``: it takes no new task, every task on it moves (to the
        others with room, else to a new Aggregator), then it is released. Returns the actions to
        carry out now (Migrate, Allocate, Release; moves to a new Aggregator and a Release that
        must follow them are held until it is up) and every move, task -> where it goes."""
        if name in self.plane.draining:
            raise ServiceError(f"aggregator {name} is already being removed")
        cluster = self.plane.cluster_of.get(name)
        if cluster is None or self.plane.is_placeholder(name):
            known = sorted(n for n in self.plane.cluster_of if not self.plane.is_placeholder(n))
            raise ServiceError(f"aggregator {name!r} is not in the pool (it has: {', '.join(known) or 'none'})")
        if self.plane.aggregator_count() <= 1 and not self.plane.elastic:
            raise ServiceError(f"aggregator {name} is the last one in the pool and pMaster has no provider to start "
                               "another: its jobs would have nowhere to go; add one first")
        plan = self.plane.clusters[cluster]
        jobs = {ident[0] for ident in plan.aggregators[name].tasks}
        # Another job's profiling or reverted Aggregators stay its own.
        targets = [n for n in plan.aggregators if n != name
                   and all(self.plane.reserved.get(n, j) == j and self.plane.exclusive.get(n, j) == j for j in jobs)]
        if jobs and not targets and not self.plane.elastic:
            raise ServiceError(f"no other Aggregator of {cluster} may take the tasks of {name} and none can be "
                               "started (pMaster has no provider); add one first")
        self.plane.draining.add(name)
        self.plane.reserved.pop(name, None)
        self.plane.exclusive.pop(name, None)
        for control in self.plane.jobs.values():
            if name in control.temporaries:
                control.temporaries.remove(name)
        actions: list = []
        reason = f"removing {name}"
        replacement = None
        if self.plane.aggregator_count() <= 1:
            # The last one of an elastic pool: a new one takes its place (and its tasks) first.
            allocation = self.plane._allocate(cluster, f"{reason}, the last Aggregator of the pool")
            actions.append(allocation)
            replacement = allocation.placeholder
            targets = [replacement]
        moves = plan.try_move_all(name, targets)
        if moves is None:
            moves = self._move_off(plan, cluster, name, targets, actions, reason)
        for ident, target in moves.items():
            self.plane._emit(actions, Migrate(ident, name, target, reason))
        plan.remove_aggregator(name)
        self.plane.cluster_of.pop(name, None)
        self.plane.loads.pop(name, None)
        release = Release(name, "removed by an operator")
        waits = {t for t in moves.values() if self.plane.is_placeholder(t)} | ({replacement} if replacement else set())
        # Moves off it decided before (a revert's, to an Aggregator still starting) must start first too.
        waits |= {p for p, held in self.plane._held.items() for a in held if isinstance(a, Migrate) and a.source == name}
        if waits:
            self._release_waits[name] = (waits, release)
        else:
            actions.append(release)
        # The operator asked for a smaller pool: scaling must not start another in its place.
        self.plane.min_aggregators = max(1, min(self.plane.min_aggregators, self.plane.aggregator_count()))
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
            if target is None and new is None and self.plane.elastic and self.plane.aggregator_count() < self.plane.max_aggregators:
                allocation = self.plane._allocate(cluster, f"{reason}: its tasks need room")
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
        if name in self.plane.draining:
            self.plane.draining.discard(name)
            self._release_waits.pop(name, None)
            self.plane.aggregator_added(name)

    def released(self, name: str) -> None:
        self.plane.draining.discard(name)
        self.plane.pinned.discard(name)
        self.plane.host_of.pop(name, None)

    def forget(self, name: str) -> None:
        """``name`` is gone (failed over): no removal of it goes on."""
        self.plane.draining.discard(name)
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

