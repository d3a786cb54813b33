"""How fast is Pseudocode 1? Place 10,000 tasks on 500 Aggregators (issue 7: <= 1 s).

200 jobs of 50 tasks, iteration durations drawn from 50-800 ms, task costs 0.5-4 ms of CPU per
iteration: roughly the shape of a busy cluster. Prints the time, the Aggregators used and a JSON
line.

    python benchmarks/placement.py [--tasks 10000] [--aggregators 500]
"""

import argparse
import json
import sys
import time

import numpy as np

from pslink.core.master.placement import Placement, TaskDemand


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", type=int, default=10_000)
    parser.add_argument("--aggregators", type=int, default=500)
    parser.add_argument("--tasks-per-job", type=int, default=50)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args(argv)
    rng = np.random.default_rng(0)
    jobs = args.tasks // args.tasks_per_job
    iterations = rng.choice([0.05, 0.1, 0.2, 0.4, 0.8], size=jobs)
    tasks = [TaskDemand(f"job-{j}", t, 0, float(iterations[j]), float(rng.uniform(0.0005, 0.004)))
             for j in range(jobs) for t in range(args.tasks_per_job)]
    times, used = [], 0
    for _ in range(args.repeat):
        plan = Placement()
        for n in range(args.aggregators):
            plan.add_aggregator(f"agg-{n}")
        start = time.perf_counter()
        for task in tasks:
            plan.place(task)
        times.append(time.perf_counter() - start)
        used = sum(1 for p in plan.aggregators.values() if p.tasks)
    best, median = min(times), float(np.median(times))
    print(f"{len(tasks)} tasks on {args.aggregators} Aggregators: best {best:.3f} s, median {median:.3f} s "
          f"over {args.repeat} runs; {used} Aggregators used (target <= 1 s: {'met' if median <= 1 else 'missed'})")
    print(json.dumps({"benchmark": "placement", "tasks": len(tasks), "aggregators": args.aggregators,
                      "best_s": round(best, 4), "median_s": round(median, 4), "used": used, "target_s": 1.0,
                      "met": median <= 1.0}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
