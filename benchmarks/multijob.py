"""Four jobs share the Aggregator pool (AutoPS 5.2.2): how many CPUs, and at what speed.

Four 2-worker jobs, each of which would ask ps-lite for 2 parameter servers (8 in all), run
together against one live service. Their models are the four of the shared data README, scaled
to this machine: parameters divided by 250 and spread over fewer tensors, iterations made of
simulated compute (a sleep, standing in for the accelerator) in proportion to each model's
FLOPs per sample. After each job's profiling on its own 2 Aggregators, pMaster packs them:

- CPU reduction ratio, as the paper defines it: (servers requested - Aggregators used) / requested
- each job's speed with the others versus standalone (the same job alone on its own service)

Paper: 25-75% reduction, loss up to 9%. Target here: >= 50% reduction with <= 5% loss per job.
Ends with one JSON line.

    python benchmarks/multijob.py            # the measured run (~3 minutes)
    python benchmarks/multijob.py --quick    # a smoke run
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import tempfile
import time

import numpy as np

SCALE = 250
#: name: (parameters, tensors, simulated compute per iteration in seconds). Parameters and
#: tensor counts from the data README (AlexNet 61.1 M / 16, VGG19 143.7 M / 38, ResNet-50
#: 25.6 M / 161, BERT-base 109.5 M / 199), scaled down; compute in proportion to FLOPs per sample.
MODELS = {
    "alexnet": (61_100_000, 8, 0.05),
    "resnet50": (25_600_000, 16, 0.20),
    "vgg19": (143_700_000, 10, 0.80),
    "bert": (109_500_000, 16, 0.80),
}


def _tensor_sizes(params: int, tensors: int) -> list[int]:
    """A few large tensors and many small ones, as in the real models."""
    weights = np.geomspace(1, 50, tensors)
    sizes = np.maximum(64, (weights / weights.sum() * params / SCALE).astype(int))
    return [int(s) for s in sizes]


def _worker(master, job, rank, model, stop_round, report):
    import pslink

    params, tensors, compute = MODELS[model]
    sizes = _tensor_sizes(params, tensors)
    with pslink.connect(job, rank, 2, master=master, servers=2, timeout=120) as agent:
        grads = [np.full(n, 0.001 * (rank + 1), np.float32) for n in sizes]
        outs = [np.empty_like(g) for g in grads]
        agent.init_many(range(len(sizes)), [np.zeros(n, np.float32) for n in sizes]).wait()
        round_ = 0
        # Both workers of a BSP job must stop after the same round, or one waits for the other.
        while round_ < stop_round.value:
            start = time.perf_counter()
            time.sleep(compute)
            agent.pushpull_many(range(len(sizes)), grads, outs=outs, average=True).wait()
            round_ += 1
            if rank == 0:
                report.put((job, time.time(), time.perf_counter() - start, round_))


def _measure(jobs: dict[str, str], seconds: float, warmup_until, log_dir: str) -> dict:
    """Run ``jobs`` (job -> model) together; after ``warmup_until(service)`` is true, collect each
    job's iteration durations for ``seconds``. Returns durations and Aggregator counts."""
    from pslink.core.service import Service

    context = mp.get_context("spawn")
    report = context.Queue()
    stop_rounds = {job: context.Value("q", 1 << 62) for job in jobs}
    latest = dict.fromkeys(jobs, 0)
    # For --png: when each job's iterations ended and how fast, and the pool's size, from the start.
    speeds: dict[str, list] = {job: [] for job in jobs}
    pool: list = []
    begun = time.time()

    def note(items):
        for job, when, duration, round_ in items:
            latest[job] = round_
            speeds[job].append((when - begun, 1.0 / duration))
        pool.append((time.time() - begun, service.master.state.control.aggregator_count()))
        return items

    with Service(aggregators=1, log_dir=log_dir) as service:
        procs = [context.Process(target=_worker, args=(service.address, job, rank, model, stop_rounds[job], report))
                 for job, model in jobs.items() for rank in range(2)]
        for p in procs:
            p.start()
        deadline = time.time() + 600
        while not warmup_until(service):
            assert time.time() < deadline, "the jobs never settled"
            note(_drain(report))
            time.sleep(0.2)
        settled = time.time()
        peak = service.master.state.control.aggregator_count()
        durations: dict[str, list[float]] = {job: [] for job in jobs}
        counts = []
        while time.time() < settled + seconds:
            for job, when, duration, round_ in note(_drain(report, timeout=0.2)):
                if when >= settled:
                    durations[job].append(duration)
            counts.append(service.master.state.control.aggregator_count())
        for job, value in stop_rounds.items():
            value.value = latest[job] + 2  # a round both workers will still reach
        for p in procs:
            p.join(120)
            if p.is_alive():
                p.kill()
                p.join()
        describe = service.master.state.control.describe()
    return {"durations": durations, "aggregators": max(counts), "peak_before": peak, "control": describe,
            "speeds": speeds, "pool": pool, "settled": settled - begun, "seconds": seconds}


def _drain(queue, timeout: float = 0.0) -> list:
    items = []
    try:
        items.append(queue.get(timeout=timeout) if timeout else queue.get_nowait())
        while True:
            items.append(queue.get_nowait())
    except Exception:
        pass
    return items


def _packed(jobs):
    def check(service):
        control = service.master.state.control
        return (all(j in control.jobs and control.jobs[j].phase != "profiling" for j in jobs)
                and service.master.mover.core.idle())
    return check


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=25.0, help="measurement window after packing")
    parser.add_argument("--quick", action="store_true", help="short windows (a smoke run)")
    parser.add_argument("--png", help="also draw the shared run's timeline (Aggregators, each job's speed) here")
    args = parser.parse_args(argv)
    if args.quick:
        args.seconds = 6.0
    jobs = {f"job-{model}": model for model in MODELS}
    requested = 2 * len(jobs)
    with tempfile.TemporaryDirectory(prefix="pslink-multijob-") as logs:
        alone = {}
        for job, model in jobs.items():
            single = _measure({job: model}, args.seconds / 2, _packed([job]), os.path.join(logs, job))
            alone[job] = statistics.median(single["durations"][job])
        shared = _measure(jobs, args.seconds, _packed(list(jobs)), os.path.join(logs, "shared"))
    used = shared["aggregators"]
    reduction = (requested - used) / requested
    rows = []
    for job in jobs:
        together = statistics.median(shared["durations"][job])
        loss = (together - alone[job]) / together
        rows.append({"job": job, "alone_ms": round(alone[job] * 1e3, 1), "together_ms": round(together * 1e3, 1),
                     "loss": round(loss, 4), "iterations": len(shared["durations"][job])})
    print(f"pslink multi-job benchmark on {platform.node()} ({os.cpu_count()} CPUs): {len(jobs)} jobs x 2 workers, "
          f"{requested} parameter servers requested")
    for r in rows:
        print(f"  {r['job']:14s} alone {r['alone_ms']:7.1f} ms   together {r['together_ms']:7.1f} ms   "
              f"loss {r['loss']:+.1%}   ({r['iterations']} iterations measured)")
    worst = max(r["loss"] for r in rows)
    print(f"Aggregators used: {used} (during profiling: {shared['peak_before']}); CPU reduction ratio "
          f"{reduction:.1%} (target >= 50%); worst loss {worst:+.1%} (target <= 5%)")
    if args.png:
        from pslink.bench.pictures import timeline_png

        picture = timeline_png(args.png, f"{len(jobs)} jobs sharing the pool: speed and Aggregators "
                               f"(reduction {reduction:.0%}, worst loss {worst:+.1%})", shared["speeds"], shared["pool"],
                               [(shared["settled"], shared["settled"] + shared["seconds"], "measured")])
        print(f"timeline: {picture}")
    print(json.dumps({"benchmark": "multijob", "host": platform.node(), "jobs": rows, "requested": requested,
                      "aggregators": used, "reduction": round(reduction, 4), "worst_loss": round(worst, 4),
                      "targets": {"reduction": 0.5, "loss": 0.05},
                      "met": reduction >= 0.5 and worst <= 0.05, "placement": shared["control"]["clusters"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
