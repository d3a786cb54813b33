"""The control plane's view of the pool: :class:`PoolPlan`.

Which Aggregators there are (and placeholders for those still starting), in which cluster, each
cluster with its placement plan (:class:`~pslink.core.master.packing.Placement`); what an
Aggregator is kept for (a job's profiling, a reverted job of its own, an operator's removal, an
operator's join); and the actions held until an Aggregator they name is up. Pure, like the rest
of the control plane. The plane's deciders share this one object: the
:class:`~pslink.core.master.control.ControlPlane` (profiling, packing), its
:class:`~pslink.core.master.scaling.Scaling` and its :class:`~pslink.core.master.guard.Guard`;
each gets it in its constructor, so none of them reaches into another's internals.
"""

from __future__ import annotations

import collections
import itertools
from typing import Callable

from pslink.core.master.actions import Allocate, Migrate
from pslink.core.master.nics import Nics
from pslink.core.master.packing import Placement


class PoolPlan:
    """The pool in clusters of at most ``max_cluster_size`` Aggregators, each cluster placing by
    ``loss_limit`` and keeping ``headroom`` free on shared Aggregators, every cluster's plan
    sharing ``nics``. ``elastic``: a provider can start and stop Aggregators (else the pool is
    what registers). ``replica_holders()``: the Aggregators holding replicas, which the plans do
    not count (pMaster knows them)."""

    def __init__(self, *, loss_limit: float, headroom: float, nics: Nics, min_aggregators: int,
                 max_aggregators: int, max_cluster_size: int, elastic: bool,
                 replica_holders: Callable[[], set] = set):
        self.loss_limit = loss_limit
        self.headroom = headroom
        self.nics = nics
        self.min_aggregators = min_aggregators
        self.max_aggregators = max_aggregators
        self.max_cluster_size = max_cluster_size
        # Without a provider nothing can be started or stopped: place within the pool as it is.
        self.elastic = elastic
        # Scaling never releases or drains Aggregators holding replicas, or the replicas would go with them.
        self.replica_holders = replica_holders
        self.clusters: dict[str, Placement] = {}
        self.cluster_of: dict[str, str] = {}  # Aggregator (or placeholder) -> cluster
        self.loads: dict[str, float] = {}  # Aggregator -> CPU load 0..1, as measured
        self.reserved: dict[str, str] = {}  # Aggregator -> job it is a profiling temporary for
        self.exclusive: dict[str, str] = {}  # Aggregator -> reverted job it belongs to
        self.held: dict[str, list] = collections.defaultdict(list)  # placeholder -> actions waiting for it
        # Aggregators an operator is removing: out of the plan, released once their tasks moved.
        self.draining: set[str] = set()
        self.host_of: dict[str, str] = {}  # Aggregator -> its host's identity (pMaster fills it in)
        self.pinned: set[str] = set()  # joined by an operator: scaling keeps them
        self._serial = itertools.count(1)

    def count(self) -> int:
        """Aggregators in the plan, those still starting included."""
        return len(self.cluster_of)

    @staticmethod
    def is_placeholder(name: str) -> bool:
        return name.startswith("<new-")

    def new_cluster(self) -> str:
        name = f"cluster-{len(self.clusters)}"
        # Its own placeholder names: allocate's "<new-N>" may still be starting when a plan opens
        # an Aggregator, and so may another cluster's (the simulator hit both).
        self.clusters[name] = Placement(self.loss_limit, placeholder_prefix=f"<new-{name}-", headroom=self.headroom,
                                        nics=self.nics)
        return name

    def cluster_for_new_aggregator(self, preferred: str | None = None) -> str:
        if preferred is not None and len(self.clusters[preferred].aggregators) < self.max_cluster_size:
            return preferred
        for name, plan in self.clusters.items():
            if len(plan.aggregators) < self.max_cluster_size:
                return name
        return self.new_cluster()

    def add(self, name: str) -> None:
        """``name`` joins the plan (a cluster with room takes it), unless it is in already."""
        if name in self.cluster_of:
            return
        cluster = self.cluster_for_new_aggregator()
        self.clusters[cluster].add_aggregator(name)
        self.cluster_of[name] = cluster
        if name in self.host_of:
            self.clusters[cluster].set_host(name, self.host_of[name])

    def allocate(self, cluster: str, reason: str) -> Allocate:
        """A new Aggregator for ``cluster``: a placeholder in its plan until it registers."""
        plan = self.clusters[cluster]
        placeholder = f"<new-{next(self._serial)}>"
        plan.add_aggregator(placeholder)
        self.cluster_of[placeholder] = cluster
        return Allocate(cluster, placeholder, reason)

    def emit(self, actions: list, action) -> None:
        """Append ``action`` to ``actions``, or hold it while an Aggregator it names is starting."""
        targets = [getattr(action, "target", None), getattr(action, "source", None)]
        waiting = next((t for t in targets if t and self.is_placeholder(t)), None)
        if waiting is not None:
            self.held[waiting].append(action)
        else:
            actions.append(action)

    def held_moves(self) -> list[Migrate]:
        """Moves held until the Aggregator they go to (or come from) is up."""
        return [a for held in self.held.values() for a in held if isinstance(a, Migrate)]

    def where(self, ident: tuple) -> str:
        """The Aggregator a task is placed on (KeyError if none)."""
        for plan in self.clusters.values():
            name = plan.where.get(ident)
            if name is not None:
                return name
        raise KeyError(ident)

    def candidates(self, job: str, cluster: str) -> list[str]:
        """The Aggregators of ``cluster`` that ``job`` may use: not another job's profiling
        temporaries, nor another reverted job's own."""
        return [n for n in self.clusters[cluster].aggregators
                if self.reserved.get(n, job) == job and self.exclusive.get(n, job) == job]
