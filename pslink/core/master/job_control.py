"""What the control plane keeps of each job: its phase, its parts and their costs, its profiled
(standalone) iteration and the window of recent iterations the performance guard judges."""

from __future__ import annotations

import collections
import dataclasses
import statistics


@dataclasses.dataclass
class JobControl:
    job: str
    workers: int
    servers: int
    cluster: str
    phase: str = "profiling"  # profiling -> packed -> reverted
    temporaries: list[str] = dataclasses.field(default_factory=list)
    parts: dict[tuple, int] = dataclasses.field(default_factory=dict)  # task -> bytes
    costs: dict[tuple, float] = dataclasses.field(default_factory=dict)  # e_t, as profiled
    latest_costs: dict[tuple, float] = dataclasses.field(default_factory=dict)  # e_t since (reporting)
    standalone: float | None = None  # D_j
    profiled: list[float] = dataclasses.field(default_factory=list)
    window: collections.deque = dataclasses.field(default_factory=collections.deque)
    iterations: int = 0
    reverts: int = 0
    exclusive: bool = False
    # The guard moved its tasks off congested Aggregators since it was last placed. Packing fills
    # Aggregators to their cycle, so the ones that take those tasks are as full: moving again
    # would only push the congestion around (the trace-driven simulator saw jobs moved thousands
    # of times). A job still too slow after one move is reverted instead.
    relieved: bool = False
    adopted: bool = False  # placed before a pMaster restart: re-profile, do not move
    # Keys declared after its profile: the job itself got heavier, so its standalone speed is
    # stale. The next full window sets it again instead of being judged against the old one.
    grown: bool = False
    # Its tasks were moving when it last reported: its next report still holds iterations
    # measured during the moves (an Agent reports what it measured since its last report).
    settling: bool = False

    def current_iteration(self) -> float | None:
        # The median: the loss must *stay* above the limit over the window (the paper), so one
        # slow iteration (a pause, a hiccup of the host) does not move a job.
        return statistics.median(self.window) if self.window else None
