"""What a simulated run leaves: each job's outcome, the CPU timeline, the counters; and the static
baseline (ps-lite: every job holds its own servers for its whole life), which is nothing but those.
Pure, no I/O."""

from __future__ import annotations

import collections
import dataclasses
from typing import Iterable

import numpy as np

from pslink.sim.workload import SimJob


@dataclasses.dataclass
class JobOutcome:
    name: str
    model: str
    workers: int
    servers: int
    submit: float
    duration: float
    iteration: float
    busy: float  # CPUs its aggregation keeps busy at standalone speed
    end: float | None = None
    packed_at: float | None = None
    migrations: int = 0  # batches moved: a decision's parts of it between two Aggregators, one copy
    parts_moved: int = 0
    relocations: int = 0  # decisions that moved some of its parts
    reverts: int = 0
    slo: float | None = None  # the slowdown it accepted (pslink: its own or the service's limit)
    network_slowed: bool = False  # a NIC it used carried more than its bandwidth at some point

    @property
    def slowdown(self) -> float:
        """How much longer it ran than alone on its own servers (0.05: 5% longer)."""
        if self.end is None or self.duration <= 0:
            return 0.0
        return max(0.0, (self.end - self.submit) / self.duration - 1.0)


class Timeline:
    """Step functions of time: CPUs allocated, CPUs requested, CPUs busy aggregating."""

    def __init__(self):
        self.times: list[float] = []
        self.allocated: list[float] = []
        self.requested: list[float] = []
        self.busy: list[float] = []

    def record(self, t: float, allocated: float, requested: float, busy: float) -> None:
        if self.times and self.times[-1] == t:  # several events at one instant: the last state holds
            self.allocated[-1], self.requested[-1], self.busy[-1] = allocated, requested, busy
            return
        if self.times and self.allocated[-1] == allocated and self.requested[-1] == requested \
                and self.busy[-1] == busy:
            return
        self.times.append(t)
        self.allocated.append(allocated)
        self.requested.append(requested)
        self.busy.append(busy)

    def arrays(self) -> dict[str, np.ndarray]:
        return {"times": np.array(self.times), "allocated": np.array(self.allocated),
                "requested": np.array(self.requested), "busy": np.array(self.busy)}


@dataclasses.dataclass
class SimResult:
    policy: str
    timeline: Timeline
    jobs: list[JobOutcome]
    counters: dict[str, float]


def relocation_kind(reason: str) -> str:
    """What decided a move, from the reason the control plane gave it."""
    for prefix, kind in (("pack", "pack"), ("aggregator", "guard"), ("revert", "revert"), ("drain", "drain"),
                         ("removing", "removal")):
        if reason.startswith(prefix):
            return kind
    return "other"


def outcome_of(job: SimJob) -> JobOutcome:
    return JobOutcome(job.name, job.model, job.workers, job.servers, job.submit, job.duration, job.iteration,
                      job.busy)


def simulate_static(jobs: Iterable[SimJob]) -> SimResult:
    """The ps-lite baseline: every job holds its servers for its whole life."""
    jobs = list(jobs)
    deltas: dict[float, list[float]] = collections.defaultdict(lambda: [0.0, 0.0])
    outcomes = []
    for job in jobs:
        end = job.submit + job.duration
        for t, sign in ((job.submit, 1), (end, -1)):
            deltas[t][0] += sign * job.servers
            deltas[t][1] += sign * job.busy
        outcome = outcome_of(job)
        outcome.end = end
        outcomes.append(outcome)
    timeline = Timeline()
    servers = busy = 0.0
    for t in sorted(deltas):
        servers += deltas[t][0]
        busy += deltas[t][1]
        timeline.record(t, servers, servers, max(0.0, busy))
    return SimResult("static", timeline, outcomes, {"jobs": len(jobs)})
