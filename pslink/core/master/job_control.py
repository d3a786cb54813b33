"""What the control plane keeps of each job: its phase, its parts and their costs, its profiled
(standalone) iteration and the window of recent iterations the performance guard judges."""

from __future__ import annotations

import collections
import dataclasses
import statistics

from pslink.core.master.move_cost import DEFAULT_STATE_FACTOR, MoveCost, compute_gap
from pslink.errors import ConfigError

PRIORITIES = ("normal", "high")
NOISE_SIGMAS = 2.0  # the guard's margin for chance: standard errors of the window's median
WORK_KEPT = 50  # own-work figures kept (the profile's, then the guard's recent ones)
WORK_CHANGE = 0.05  # a change of a job's own work by more than this share of its iteration is its own


def check_service_level(slo, priority) -> None:
    """A job's stated service level, refused with what was wrong."""
    if slo is not None and (isinstance(slo, bool) or not isinstance(slo, (int, float)) or not 0 < slo < 1):
        raise ConfigError(f"slo (the slowdown a job accepts from sharing, 0.1 = 10%) must be a number in (0, 1), "
                          f"got {slo!r}")
    if priority not in PRIORITIES:
        raise ConfigError(f"priority must be one of {PRIORITIES}, got {priority!r}")


@dataclasses.dataclass
class JobControl:
    job: str
    workers: int
    servers: int
    cluster: str
    slo: float = 0.1  # the slowdown it accepts from sharing (its own LossLimit)
    priority: str = "normal"  # "high": scaling never moves it to free an Aggregator
    arrived: float = 0.0
    phase: str = "profiling"  # profiling -> packed -> reverted
    temporaries: list[str] = dataclasses.field(default_factory=list)
    parts: dict[tuple, int] = dataclasses.field(default_factory=dict)  # task -> bytes
    costs: dict[tuple, float] = dataclasses.field(default_factory=dict)  # e_t, as profiled
    latest_costs: dict[tuple, float] = dataclasses.field(default_factory=dict)  # e_t since (reporting)
    standalone: float | None = None  # D_j
    profiled_iteration: float | None = None  # D_j as profiled (the guard may re-learn standalone)
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
    # The worker's own work per iteration (duration less the communication it waited for), as
    # its Agent reports it: the last guard_window of them, and their median when it was profiled
    # (None: not reported, as for DDP's hook; then iterations are judged whole).
    work: collections.deque = dataclasses.field(default_factory=lambda: collections.deque(maxlen=WORK_KEPT))
    work_baseline: float | None = None

    def add_work(self, work: list[float]) -> None:
        if self.phase != "profiling" and self.work_baseline is None:
            return  # not measured while it was profiled: nothing to compare with
        self.work.extend(w for w in work if w >= 0)

    def own_work_change(self, window: int) -> float | None:
        """How much the job's own work per iteration changed since its baseline (seconds, the
        median of its last ``window`` figures against the baseline's), if it changed by more than
        ``WORK_CHANGE`` of its standalone iteration, its iterations' noise and its work figures' own
        jitter; None otherwise or unknown."""
        if self.work_baseline is None or not self.standalone or len(self.work) < window:
            return None
        recent = list(self.work)[-window:]
        middle = statistics.median(recent)
        change = middle - self.work_baseline
        # The work figures' own spread, as it shows in a difference of two medians of ``window``
        # figures each: a worker sharing a busy host jitters, and a jitter is not a change.
        spread = 1.4826 * statistics.median(abs(w - middle) for w in recent)
        jitter = NOISE_SIGMAS * 1.2533 * spread * (2.0 / window) ** 0.5
        if abs(change) <= max(self.standalone * max(WORK_CHANGE, self.noise_margin()), jitter):
            return None
        return change

    def estimate_cost(self, nbytes: int, cost_per_byte: float) -> float:
        """e_t of a part before it was measured: its bytes times the cost of a byte (the job's own
        measured one when it has one, else ``cost_per_byte`` a worker)."""
        measured = [(self.costs[i], self.parts[i]) for i in self.costs if self.parts.get(i)]
        per_byte = (sum(c for c, _ in measured) / sum(b for _, b in measured)) if measured else (
            cost_per_byte * self.workers)
        return per_byte * nbytes

    def nic_rate(self, nbytes: int, profile_iterations: int, nic_bandwidth: float | None) -> float:
        """Bytes/s a part of ``nbytes`` puts through its Aggregator's NIC, each way (every worker
        pushes and pulls it once an iteration): once packed, at the fastest iteration measured (a
        slower re-learned standalone does not lower it); once profiled, at the median profiled
        one; before, unknown: the whole NIC is kept for it, so that nothing placed beside it can
        be slowed by what it really sends."""
        if self.standalone is not None:
            return nbytes * self.workers / min(self.standalone, self.profiled_iteration or self.standalone)
        if len(self.profiled) >= max(1, profile_iterations):
            return nbytes * self.workers / statistics.median(self.profiled)
        return nic_bandwidth or 0.0

    def iteration_estimate(self) -> float | None:
        """Its standalone iteration, else the median profiled so far (None before any)."""
        if self.standalone is not None:
            return self.standalone
        return statistics.median(self.profiled) if self.profiled else None

    def compute_gap(self) -> float:
        """What its workers compute between a round's replies and their next pushes: its reported
        own work, else half its iteration (:func:`~pslink.core.master.move_cost.compute_gap`)."""
        return compute_gap(self.iteration_estimate(), self.work_baseline)

    def batch_bytes(self, cost: MoveCost) -> int:
        """The most bytes of its parts one migration (batch) may switch at once: those whose last
        forwarded round lands while the workers compute (0 before its profile: the throttle's
        bound)."""
        if not self.standalone:
            return 0
        return cost.batch_bytes(self.compute_gap())

    def noise_margin(self) -> float:
        """How much slower than its profile the job's window may be by chance alone: its
        iterations' own spread (a robust relative deviation of the profiled ones) as it shows in
        the difference of two medians, the window's and the profile's, at two standard errors.
        A steady job has none; a noisy one is not judged too slow for its noise."""
        profiled, window = self.profiled, self.window
        if len(profiled) < 3 or not window:
            return 0.0
        middle = statistics.median(profiled)
        spread = 1.4826 * statistics.median(abs(d - middle) for d in profiled) / middle if middle > 0 else 0.0
        return NOISE_SIGMAS * 1.2533 * spread * (1.0 / len(window) + 1.0 / len(profiled)) ** 0.5

    def move_delay(self, cost: MoveCost) -> float:
        """What moving every part of the job adds to its time: the pre-copy of all its state (as
        one stream) and a switch a part. Parts of one migration switch together; which parts
        share a target is not known before placement, so each is charged a switch (at most as
        many switches as parts)."""
        iteration, gap = self.iteration_estimate(), self.compute_gap()
        round_bytes = sum(self.parts.values())
        precopy = cost.precopy_delay(round_bytes * DEFAULT_STATE_FACTOR, round_bytes, iteration, gap)
        return precopy + sum(cost.switch_stall(b, gap, iteration, b * DEFAULT_STATE_FACTOR)
                             for b in self.parts.values())

    def revert_pays(self, loss: float, now: float, cost: MoveCost) -> bool:
        """A revert moves every part to an Aggregator of its own: worth it when what the job
        loses at ``loss`` over the rest of its life (as long again as it has run, the best guess
        for heavy-tailed job lengths) is more than the moves delay it. A short job keeps its
        place: a revert would cost it more than the slowdown it ends."""
        return loss * (now - self.arrived) >= self.move_delay(cost)

    def pack_due(self, cost: MoveCost, placement_share: float) -> float:
        """When packing the job pays for its moves: a pack moves up to all of its parts
        (:meth:`move_delay`). That delay may take the share of its limit placement leaves over,
        of the time it has run so far: how long a job ran is the best guess of how long it still
        runs (job lengths are heavy-tailed: Philly's median multi-GPU job runs 76 minutes, its
        shortest tenth under 17 s). A job that ends sooner is never moved: its own Aggregators
        cost little over a short life."""
        budget = self.slo * (1.0 - placement_share)
        return self.arrived + (self.move_delay(cost) / budget if budget > 0 else 0.0)

    def slowdown(self) -> float | None:
        """Its recent iterations against its standalone one (None before both are known)."""
        current = self.current_iteration()
        return current / self.standalone - 1.0 if current and self.standalone else None

    def current_iteration(self) -> float | None:
        # The median: the loss must *stay* above the limit over the window (the paper), so one
        # slow iteration (a pause, a hiccup of the host) does not move a job.
        return statistics.median(self.window) if self.window else None
