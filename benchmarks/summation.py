"""When does adding a push into the accumulator pay off on several threads?

numpy releases the GIL inside large ufunc loops, so the Aggregator's Summer splits big additions
across a thread pool. This measures, in one run, the Summer with 2 and 4 threads against
single-threaded ``np.add(acc, x, out=acc)`` (the anchor), for float32 arrays of 256 KiB to 64 MiB,
in ``--rounds`` rounds (each round starting with the next variant; each variant's best of several
additions per round). Figures: per size and thread count, the Summer's time against one thread's
(lower is better). The Summer's default threshold comes from these figures. Ends with a JSON line.

    python benchmarks/summation.py              # 6 sizes, 3 rounds
    python benchmarks/summation.py --quick      # 1, 16 and 64 MiB, 3 rounds: a few seconds
"""

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

from pslink.bench import figures
from pslink.core.aggregator.tasks import Summer

SIZES = (256 << 10, 1 << 20, 4 << 20, 16 << 20, 32 << 20, 64 << 20)
QUICK_SIZES = (1 << 20, 16 << 20, 64 << 20)
THREADS = (2, 4)


def best_of(fn, repeat):
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="rounds of every variant, alternating")
    parser.add_argument("--quick", action="store_true", help="3 sizes (1, 16, 64 MiB), 3 rounds")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    sizes = QUICK_SIZES if args.quick else SIZES
    rows, figs = [], []
    summers = {n: Summer(threads=n, threshold_bytes=0) for n in THREADS}
    try:
        for size in sizes:
            acc = np.ones(size // 4, np.float32)
            other = np.ones(size // 4, np.float32)
            repeat = max(5, int(2e8 // size))
            variants = {"single": lambda acc=acc, other=other: np.add(acc, other, out=acc)}
            variants.update({n: (lambda s=summer, acc=acc, other=other: s.add(acc, other))
                             for n, summer in summers.items()})
            times: dict = {name: [] for name in variants}
            names = list(variants)
            for index in range(args.rounds):
                # Each round starts with the next variant: a fixed order would charge one with the drift.
                for name in names[index % len(names):] + names[:index % len(names)]:
                    times[name].append(best_of(variants[name], repeat) * 1e3)
            row = {"bytes": size, "single_ms": round(statistics.median(times["single"]), 3)}
            for n in THREADS:
                fig = figures.measured("summation", f"adding {size >> 10} KiB of float32 in place, Summer with {n} "
                                       f"threads", "ms", "lower", times[n], "one thread (np.add)", times["single"])
                figs.append(fig)
                row[f"threads{n}_ms"] = round(fig.value, 3)
                row[f"speedup{n}"] = round(1 / fig.ratio, 2)  # the figure's ratio, turned over
            rows.append(row)
            print(f"{size >> 10:>7} KiB: 1 thread {row['single_ms']:.3f} ms, 2 threads x{row['speedup2']:.2f}, "
                  f"4 threads x{row['speedup4']:.2f} (speed-up: the figures' ratios turned over)", flush=True)
    finally:
        for summer in summers.values():
            summer.close()
    for fig in figs:
        figures.emit(fig)
    print(json.dumps({"benchmark": "summation", "cpus": os.cpu_count(), "rounds": args.rounds, "rows": rows,
                      "figures": [fig.as_json() for fig in figs]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
