"""One experiment: trace rows -> jobs -> the static baseline and pslink over them -> figures.

No I/O: the CLI (:mod:`pslink.sim.cli`) reads the trace and the cost model and writes the results.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

from pslink.sim.costmodel import CostModel
from pslink.sim.engine import ServiceOptions, SimResult, simulate_pslink, simulate_static
from pslink.sim.metrics import summarize
from pslink.sim.trace import TraceJob
from pslink.sim.workload import SimJob, WorkloadOptions, build_jobs


@dataclasses.dataclass
class Outcome:
    jobs: list[SimJob]
    static: SimResult
    pslink: SimResult
    summary: dict


def cost_per_byte(cost_model: CostModel, options: WorkloadOptions) -> float:
    """What the control plane assumes a byte costs per worker before it measured a job (only
    while a job is profiled alone on its own Aggregators: it spreads by bytes, not by this)."""
    optimizer = "sum" if options.aggregation == "sum" else "sgd"
    return cost_model.per_byte_worker[optimizer]


def run(rows: Sequence[TraceJob], cost_model: CostModel, workload: WorkloadOptions = WorkloadOptions(),
        service: ServiceOptions = ServiceOptions(), limit: int | None = None,
        on_progress: Callable[[int, int], None] | None = None, check: bool = False) -> Outcome:
    jobs = build_jobs(rows, cost_model, workload)
    if limit is not None:
        jobs = jobs[:limit]
    static = simulate_static(jobs)
    pslink = simulate_pslink(jobs, service, cost_per_byte(cost_model, workload), on_progress, check)
    return Outcome(jobs, static, pslink, summarize(pslink, static))
