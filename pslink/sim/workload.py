"""From trace rows to simulated training jobs: workers, servers, a model, tasks and their costs.

A trace row says when a job was submitted, how many GPUs it used and how long it ran. Each GPU is
one worker (one process per GPU, as Horovod, DDP and MXNet's launcher run them). The job asks
for ``servers_per_worker`` servers per worker (ps-lite and MXNet users launch as many servers as
workers; the paper's jobs are "2s-2w", "4s-4w"). Its model is drawn from the mix; its iteration
is the model's one-GPU iteration times a per-job factor (batch sizes, GPU kinds and input
pipelines differ between jobs: lognormal, ``iteration_spread``). Its tasks are the model's tensors
split into partitions as the Agents split them; a task's CPU cost per iteration comes from the
cost model. While the job runs packed with other jobs, its tasks cost ``contention`` times what
its profiling measured: a per-job draw ``exp(|N(0, sigma)|)``, never below 1, because co-located
jobs compete for caches and memory bandwidth and sharing never makes aggregation cheaper (a
two-sided draw would hand half the jobs a free speed-up for being packed). This is what the
performance guard has to catch.

Single-GPU jobs (93% of Philly's) have no gradients to exchange: with ``single_gpu="skip"`` they
are left out, as they would use no parameter server at all; ``"ps"`` gives them one server each.

Draws come from a generator seeded by (seed, the job's row in the trace), so a job gets the same
model and factors whichever window or ``--jobs`` limit selects it. Pure: no I/O.
"""

from __future__ import annotations

import dataclasses
import heapq
from typing import Iterable, Sequence

import numpy as np

from pslink.core.master.move_cost import DEFAULT_STATE_FACTOR
from pslink.core.partition import DEFAULT_PARTITION_BYTES
from pslink.sim.costmodel import CostModel
from pslink.sim.models import MODELS, Model
from pslink.sim.trace import TraceJob

SINGLE_GPU = ("skip", "ps")
#: A part's state over its bytes, by what its servers run: the weights, and a slot each for
#: momentum SGD's velocity and Adam's two moments. A migration copies all of it.
STATE_FACTORS = {"sum": 1.0, "sgd": 2.0, "adam": 3.0}
AGGREGATIONS = ("optimizer", "sum")


@dataclasses.dataclass(frozen=True)
class SimJob:
    name: str
    submit: float  # seconds
    duration: float  # seconds it runs at its standalone speed (the trace's duration)
    workers: int
    servers: int
    model: str
    iteration: float  # D: its standalone iteration duration, seconds
    parts: tuple[tuple[int, int, int], ...]  # (key, part, bytes)
    costs: tuple[float, ...]  # e_t of each part, CPU seconds per iteration, as profiled
    contention: float = 1.0  # packed with other jobs, its tasks cost this many times e_t
    slo: float | None = None  # the slowdown it accepts from sharing (None: the service's loss limit)
    state_factor: float = DEFAULT_STATE_FACTOR  # a part's state (weights, optimizer slots) over its bytes

    def __post_init__(self):
        if len(self.parts) != len(self.costs):
            raise ValueError(f"job {self.name}: {len(self.parts)} parts but {len(self.costs)} costs")
        if not (self.iteration > 0 and self.duration >= 0 and self.workers >= 1 and self.servers >= 1):
            raise ValueError(f"job {self.name}: bad iteration, duration, workers or servers")

    @property
    def work(self) -> float:
        """CPU seconds of aggregation per iteration."""
        return sum(self.costs)

    @property
    def busy(self) -> float:
        """CPUs its aggregation keeps busy while it runs at its standalone speed."""
        return self.work / self.iteration


@dataclasses.dataclass(frozen=True)
class WorkloadOptions:
    mix: dict[str, float] = dataclasses.field(
        default_factory=lambda: {"alexnet": 0.25, "vgg19": 0.25, "resnet50": 0.25, "bert-base": 0.25})
    seed: int = 0
    iteration_spread: float = 0.2  # sigma of the lognormal factor on a model's iteration
    contention: float = 0.1  # sigma of the half-normal log-factor (>= 1) on costs once packed
    single_gpu: str = "skip"
    servers_per_worker: float = 1.0
    aggregation: str = "optimizer"  # the servers run the optimizer (ps-lite, MXNet) or only sum
    partition_bytes: int = DEFAULT_PARTITION_BYTES
    # Service-level classes: slowdown limit -> share of jobs (None: every job the service's limit).
    slo_classes: dict[float, float] | None = None

    def __post_init__(self):
        if self.slo_classes is not None and (not self.slo_classes or any(
                not 0 < slo < 1 or share <= 0 for slo, share in self.slo_classes.items())):
            raise ValueError(f"slo classes must map limits in (0, 1) to shares > 0, got {self.slo_classes}")
        if self.single_gpu not in SINGLE_GPU:
            raise ValueError(f"single_gpu must be one of {', '.join(SINGLE_GPU)}, got {self.single_gpu!r}")
        if self.aggregation not in AGGREGATIONS:
            raise ValueError(f"aggregation must be one of {', '.join(AGGREGATIONS)}, got {self.aggregation!r}")
        if self.iteration_spread < 0 or self.contention < 0 or self.servers_per_worker <= 0:
            raise ValueError("iteration_spread and contention must be >= 0, servers_per_worker > 0")
        unknown = [m for m in self.mix if m not in MODELS]
        if unknown or not self.mix:
            raise ValueError(f"the model mix names unknown models {unknown} (known: {', '.join(MODELS)})")


def standalone_iteration(compute: float, costs: Sequence[float], nbytes: Sequence[int], servers: int) -> float:
    """A job's iteration alone on its own ``servers``: its compute, unless a server cannot keep
    up. Parts are spread by bytes, each to the server holding the fewest so far (ps-lite's
    servers and pslink's profiling Aggregators both balance bytes)."""
    heap = [(0, index, 0.0) for index in range(servers)]
    busiest = 0.0
    for cost, size in zip(costs, nbytes):
        held, index, load = heapq.heappop(heap)
        load += cost
        busiest = max(busiest, load)
        heapq.heappush(heap, (held + size, index, load))
    return max(compute, busiest)


def build_jobs(trace: Iterable[TraceJob], cost_model: CostModel, options: WorkloadOptions) -> list[SimJob]:
    names = list(options.mix)
    weights = np.array([options.mix[n] for n in names], float)
    weights /= weights.sum()
    cost_cache: dict[tuple[str, int], tuple[float, ...]] = {}
    classes = sorted(options.slo_classes.items()) if options.slo_classes else []
    class_weights = np.array([share for _, share in classes], float)
    jobs = []
    for row in trace:
        if row.gpus <= 1 and options.single_gpu == "skip":
            continue
        rng = np.random.default_rng([options.seed, row.index])
        model: Model = MODELS[names[int(rng.choice(len(names), p=weights))]]
        spread = float(rng.lognormal(0.0, options.iteration_spread)) if options.iteration_spread else 1.0
        contention = float(np.exp(abs(rng.normal(0.0, options.contention)))) if options.contention else 1.0
        workers = max(1, row.gpus)
        servers = max(1, round(workers * options.servers_per_worker))
        parts = model.parts(options.partition_bytes)
        optimizer = model.optimizer if options.aggregation == "optimizer" else "sum"
        costs = cost_cache.get((model.name, workers))
        if costs is None:
            costs = cost_cache[(model.name, workers)] = tuple(
                cost_model.task_cost(size, workers, optimizer) for _, _, size in parts)
        iteration = standalone_iteration(model.iteration * spread, costs, [p[2] for p in parts], servers)
        # Drawn last: the draws above stay what they were without classes.
        slo = classes[int(rng.choice(len(classes), p=class_weights / class_weights.sum()))][0] if classes else None
        jobs.append(SimJob(row.job, row.submit, row.duration, workers, servers, model.name, iteration, parts, costs,
                           contention, slo, STATE_FACTORS[optimizer]))
    return jobs
