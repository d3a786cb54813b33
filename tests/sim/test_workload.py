"""Trace rows become jobs: workers, servers, a model from the mix, tasks and what they cost."""

from __future__ import annotations

import pytest

from pslink.sim.costmodel import CostModel
from pslink.sim.models import MODELS
from pslink.sim.trace import TraceJob
from pslink.sim.workload import WorkloadOptions, build_jobs, standalone_iteration

COSTS = CostModel(per_message=0.0, per_byte_worker={"sum": 1e-9, "sgd": 1e-9, "adam": 1e-9},
                  per_byte_round={"sum": 0.0, "sgd": 1e-9, "adam": 2e-9})
ROWS = [TraceJob(i, f"j{i}", 10.0 * i, gpus, 100.0) for i, gpus in enumerate([1, 2, 4, 1, 8, 16])]


def test_single_gpu_jobs_are_left_out_or_get_one_server():
    skipped = build_jobs(ROWS, COSTS, WorkloadOptions())
    assert [(j.name, j.workers, j.servers) for j in skipped] == [("j1", 2, 2), ("j2", 4, 4), ("j4", 8, 8),
                                                                 ("j5", 16, 16)]
    served = build_jobs(ROWS, COSTS, WorkloadOptions(single_gpu="ps", servers_per_worker=0.5))
    assert [(j.workers, j.servers) for j in served] == [(1, 1), (2, 1), (4, 2), (1, 1), (8, 4), (16, 8)]


def test_task_costs_follow_the_cost_model_and_the_models_optimizer():
    only = {"resnet50": 1.0}
    (job,) = build_jobs([ROWS[2]], COSTS, WorkloadOptions(mix=only, iteration_spread=0, contention=0))
    parts = MODELS["resnet50"].parts()
    assert job.parts == parts and job.contention == 1.0
    # 4 workers, SGD: bytes x (4 x 1e-9 + 1e-9)
    assert job.costs == pytest.approx([size * 5e-9 for _, _, size in parts])
    assert job.iteration == pytest.approx(MODELS["resnet50"].iteration)
    assert job.busy == pytest.approx(MODELS["resnet50"].nbytes * 5e-9 / job.iteration)
    (summing,) = build_jobs([ROWS[2]], COSTS, WorkloadOptions(mix=only, aggregation="sum", iteration_spread=0))
    assert summing.work == pytest.approx(MODELS["resnet50"].nbytes * 4e-9)


def test_a_job_gets_the_same_draws_whichever_selection_it_is_in():
    options = WorkloadOptions(seed=3)
    everything = {j.name: j for j in build_jobs(ROWS, COSTS, options)}
    alone = build_jobs([ROWS[4]], COSTS, options)[0]
    assert alone == everything["j4"]
    models = {j.model for seed in range(20) for j in build_jobs(ROWS, COSTS, WorkloadOptions(seed=seed))}
    assert models == set(MODELS)  # the mix is drawn from, not cycled through


def test_sharing_an_aggregator_never_makes_a_jobs_tasks_cheaper():
    rows = [TraceJob(i, f"j{i}", float(i), 4, 100.0) for i in range(400)]
    factors = [j.contention for j in build_jobs(rows, COSTS, WorkloadOptions(contention=0.1))]
    assert min(factors) >= 1.0 and max(factors) > 1.1  # a one-sided draw that does vary
    # exp(|N(0, 0.1)|): its median is exp(0.1 x 0.674) = 1.070 (0.674: the median of |N(0, 1)|)
    assert sorted(factors)[200] == pytest.approx(1.070, abs=0.01)


def test_a_server_that_cannot_keep_up_sets_the_standalone_iteration():
    # three parts spread by bytes over two servers, each to the one holding fewer bytes: the 300-byte
    # part (0.3 s) on one, then 200 (0.2 s) and 100 (0.1 s) on the other: 0.3 s per iteration each
    assert standalone_iteration(1.0, [0.3, 0.2, 0.1], [300, 200, 100], servers=2) == 1.0
    assert standalone_iteration(0.1, [0.3, 0.2, 0.1], [300, 200, 100], servers=2) == pytest.approx(0.3)
    assert standalone_iteration(0.1, [0.3, 0.2, 0.1], [300, 200, 100], servers=1) == pytest.approx(0.6)


def test_bad_options_are_refused():
    with pytest.raises(ValueError, match="single_gpu must be one of skip, ps"):
        WorkloadOptions(single_gpu="maybe")
    with pytest.raises(ValueError, match="unknown models"):
        WorkloadOptions(mix={"gpt": 1.0})
