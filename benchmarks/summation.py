"""When does adding a push into the accumulator pay off on several threads?

numpy releases the GIL inside large ufunc loops, so the Aggregator's Summer splits big additions
across a thread pool. This measures, in one run, single-threaded ``np.add(acc, x, out=acc)``
against the Summer with 2 and 4 threads, for float32 arrays of 256 KiB to 64 MiB, and prints
the speed-ups and a JSON line. The Summer's default threshold comes from these figures.

    python benchmarks/summation.py
"""

import json
import os
import sys
import time

import numpy as np

from pslink.core.aggregator.tasks import Summer


def best_of(fn, repeat):
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> int:
    rows = []
    summers = {n: Summer(threads=n, threshold_bytes=0) for n in (2, 4)}
    for size in (256 << 10, 1 << 20, 4 << 20, 16 << 20, 32 << 20, 64 << 20):
        acc = np.ones(size // 4, np.float32)
        other = np.ones(size // 4, np.float32)
        repeat = max(5, int(2e8 // size))
        single = best_of(lambda: np.add(acc, other, out=acc), repeat)
        row = {"bytes": size, "single_ms": round(single * 1e3, 3)}
        for n, summer in summers.items():
            threaded = best_of(lambda: summer.add(acc, other), repeat)
            row[f"threads{n}_ms"] = round(threaded * 1e3, 3)
            row[f"speedup{n}"] = round(single / threaded, 2)
        rows.append(row)
        print(f"{size >> 10:>7} KiB: 1 thread {row['single_ms']:.3f} ms, 2 threads x{row['speedup2']:.2f}, "
              f"4 threads x{row['speedup4']:.2f}")
    for summer in summers.values():
        summer.close()
    print(json.dumps({"benchmark": "summation", "cpus": os.cpu_count(), "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
