"""How fast is Pseudocode 1? Place 10,000 tasks on 500 Aggregators (issue 29: <= 0.1 s).

200 jobs of 50 tasks, iteration durations drawn from 50-800 ms, task costs 0.5-4 ms of CPU per
iteration: roughly the shape of a busy cluster. Two ways, alternated, the same decisions: a job
at a time (``Placement.place_many``, as the control plane packs a job; the target) and a task at
a time (``Placement.place``, issue 7's measure: <= 1 s). Prints the median of ``--repeat`` runs
of each, the Aggregators used and a JSON line.

    python benchmarks/placement.py [--tasks 10000] [--aggregators 500] [--repeat 5]
"""

import argparse
import json
import sys
import time

import numpy as np

from pslink.core.master.packing import Placement, TaskDemand


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", type=int, default=10_000)
    parser.add_argument("--aggregators", type=int, default=500)
    parser.add_argument("--tasks-per-job", type=int, default=50)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args(argv)
    rng = np.random.default_rng(0)
    jobs = args.tasks // args.tasks_per_job
    iterations = rng.choice([0.05, 0.1, 0.2, 0.4, 0.8], size=jobs)
    tasks = [TaskDemand(f"job-{j}", t, 0, float(iterations[j]), float(rng.uniform(0.0005, 0.004)))
             for j in range(jobs) for t in range(args.tasks_per_job)]
    by_job = [tasks[j * args.tasks_per_job:(j + 1) * args.tasks_per_job] for j in range(jobs)]

    def one_by_one(plan):
        for task in tasks:
            plan.place(task)

    def a_job_at_a_time(plan):
        for job_tasks in by_job:
            plan.place_many(job_tasks)

    times: dict[str, list[float]] = {"job": [], "task": []}
    where: dict[str, dict] = {}
    for _ in range(args.repeat):
        for variant, run in (("job", a_job_at_a_time), ("task", one_by_one)):
            plan = Placement()
            for n in range(args.aggregators):
                plan.add_aggregator(f"agg-{n}")
            start = time.perf_counter()
            run(plan)
            times[variant].append(time.perf_counter() - start)
            where[variant] = dict(plan.where)
    if where["job"] != where["task"]:
        raise SystemExit("the two ways placed tasks differently: a bug in Placement.place_many")
    used = len(set(where["job"].values()))
    median = {v: float(np.median(t)) for v, t in times.items()}
    print(f"{len(tasks)} tasks on {args.aggregators} Aggregators, median of {args.repeat}: a job at a time "
          f"{median['job']:.3f} s (target <= 0.1 s: {'met' if median['job'] <= 0.1 else 'missed'}), a task at a "
          f"time {median['task']:.3f} s; same decisions; {used} Aggregators used")
    print(json.dumps({"benchmark": "placement", "tasks": len(tasks), "aggregators": args.aggregators,
                      "median_job_s": round(median["job"], 4), "median_task_s": round(median["task"], 4),
                      "runs_job_s": [round(t, 4) for t in times["job"]],
                      "runs_task_s": [round(t, 4) for t in times["task"]], "used": used, "target_s": 0.1,
                      "met": median["job"] <= 0.1}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
