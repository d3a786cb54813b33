"""Live migration of a whole running job (AutoPS Table 3): the stall the job sees.

A 2-worker BSP job holds ~100 MB of parameters in 4 MiB tensors, updated on the service by
momentum SGD (so weights and momentum both move). Each iteration, a worker "computes" for
``--compute`` seconds (a sleep, standing in for forward/backward on an accelerator) and then
push-pulls every tensor. At iteration ``--at`` every task of the job is migrated from its two
Aggregators to two others; pMaster throttles the moves (``max_migration_bytes`` of task state
copying at a time), so they spread over several iterations. The job-visible stall is the slowest
iteration over the whole migration -- from iteration ``--at`` to the iteration after the last task
moved (the workers see where their parts are) -- minus the median iteration before it (target:
<= 20 ms; the paper measured 13.6-43.8 ms on RDMA); the number of iterations the migration took is
reported with it. The same job runs again without the migration, and the final weights of both runs must
be bit-identical. Ends with one JSON line.

    python benchmarks/migration.py            # ~100 MB, the measured run
    python benchmarks/migration.py --quick    # ~16 MB, a smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile

from disturbed_job import median_before, run_workers, train

TENSOR = 1 << 20  # float32 elements: 4 MiB, one task each
SETTINGS = {"type": "sgd", "lr": 0.01, "momentum": 0.9}


def _worker(master, job, rank, keys, iterations, at, compute, signal, results):
    import pslink

    with pslink.connect(job, rank, 2, master=master, optimizer=SETTINGS, servers=2, timeout=120) as agent:
        def places():
            return [p[3] for k in range(keys) for p in agent.key_info(k)["parts"]]

        sources, last_moved = set(), []

        def moved(it):
            if it == 0:
                sources.update(places())  # where the keys were placed (they exist once trained once)
            if signal is not None and it >= at and not last_moved and not sources & set(places()):
                last_moved.append(it)  # every part of this worker's keys is on its new Aggregator now

        durations, digest = train(agent, rank, keys, TENSOR, iterations, at, compute, signal, moved)
        results.put((rank, durations, digest, places(), last_moved[0] if last_moved else None))


def run(keys: int, iterations: int, at: int | None, compute: float, log_dir: str, max_bytes: int | None = None) -> dict:
    from pslink.core.service import Service

    job = f"migration-{'moved' if at is not None else 'still'}"
    # 4 Aggregators; the job asks for 2 and stays on them (profiling never ends here), so the only
    # move is the one this benchmark makes.
    with Service(aggregators=4, log_dir=log_dir, control={"profile_iterations": 10**9},
                 master_options={"max_migration_bytes": max_bytes}) as service:

        def migrate():
            master = service.master
            tasks = master.tasks_of(job)
            sources = {master.state.jobs[job].keys[t[1]].parts[t[2]].aggregator for t in tasks}
            targets = [n for n in service.provider.names() if n not in sources]
            for i, target in enumerate(targets):
                master.migrate(tasks[i::len(targets)], target, "benchmark")

        outcome = run_workers(_worker, (service.address, job, keys, iterations, at, compute), at is not None, migrate)
        migrated = service.master.migrations_done
    moved = [outcome[r][3] for r in (0, 1)]
    return {"durations": outcome[0][0], "digests": [outcome[r][1] for r in (0, 1)],
            "last_moved": None if None in moved else max(moved),
            "places": sorted(set(outcome[0][2])), "migrations": migrated}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mbytes", type=int, default=104, help="parameters of the job, in MiB (4 MiB tensors)")
    parser.add_argument("--iterations", type=int, default=40)
    parser.add_argument("--at", type=int, default=20, help="the iteration during which the job is migrated")
    parser.add_argument("--compute", type=float, default=0.3, help="seconds of simulated compute per iteration")
    parser.add_argument("--max-migration-mib", type=int, default=None,
                        help="pMaster's max_migration_bytes, in MiB (default: pMaster's, 16 MiB)")
    parser.add_argument("--quick", action="store_true", help="16 MiB, 10 iterations (a smoke run)")
    parser.add_argument("--png", help="also draw both runs' speed per iteration, the migration shaded, here")
    args = parser.parse_args(argv)
    if args.quick:
        args.mbytes, args.iterations, args.at = 16, 10, 5
    keys = max(1, args.mbytes // 4)
    with tempfile.TemporaryDirectory(prefix="pslink-migration-") as logs:
        max_bytes = None if args.max_migration_mib is None else args.max_migration_mib << 20
        moved = run(keys, args.iterations, args.at, args.compute, os.path.join(logs, "a"), max_bytes)
        still = run(keys, args.iterations, None, args.compute, os.path.join(logs, "b"))
    d = moved["durations"]
    before = median_before(d, args.at)
    # The whole migration: iteration --at to the one after the last task moved (all of the rest if
    # the workers never saw every part move).
    last = moved["last_moved"]
    end = len(d) if last is None else min(len(d), last + 2)
    taken = None if last is None else last - args.at + 1
    during = d[args.at:end]
    stall = max(during) - before
    baseline_before = median_before(still["durations"], args.at)
    # The same window in the run without a migration: how much the host alone moves the figure.
    noise = max(still["durations"][args.at:end]) - baseline_before
    identical = moved["digests"][0] == still["digests"][0] and len(set(moved["digests"] + still["digests"])) == 1
    print(f"pslink migration benchmark on {platform.node()} ({os.cpu_count()} CPUs): {keys} tensors of 4 MiB "
          f"({keys * 4} MiB + momentum), 2 workers, {args.compute * 1e3:.0f} ms compute per iteration")
    print(f"iterations before: median {before * 1e3:.1f} ms; during migration: "
          f"{', '.join(f'{x * 1e3:.1f}' for x in during)} ms; after: "
          f"{statistics.median(d[end:]) * 1e3 if d[end:] else float('nan'):.1f} ms")
    print(f"the migration took {taken if taken is not None else 'more than the'} iterations "
          f"({args.at} to {last if last is not None else 'the end'}); window measured: iterations {args.at}-{end - 1}")
    print(f"job-visible stall: {stall * 1e3:.1f} ms (target <= 20 ms); tasks migrated: {moved['migrations']} "
          f"to {moved['places']}")
    print(f"noise floor: the same window of the run without migration: {noise * 1e3:.1f} ms over its median "
          f"{baseline_before * 1e3:.1f} ms")
    print(f"final weights bit-identical to the run without migration: {'yes' if identical else 'NO'}")
    if args.png:
        from pslink.bench.pictures import timeline_png

        def speed(durations):
            clock, points = 0.0, []
            for duration in durations:
                clock += duration
                points.append((clock, 1.0 / duration))
            return points

        moved_points = speed(d)
        picture = timeline_png(
            args.png, f"live migration of {keys * 4} MiB: iteration speed, migrated vs not (stall "
            f"{stall * 1e3:.1f} ms)", {"migrated": moved_points, "not migrated": speed(still["durations"])},
            [(0.0, 4), (moved_points[-1][0], 4)],
            [(moved_points[args.at - 1][0] if args.at else 0.0, moved_points[end - 1][0], "migration")])
        print(f"timeline: {picture}")
    print(json.dumps({
        "benchmark": "migration", "host": platform.node(), "tensors": keys, "mbytes": keys * 4,
        "compute_s": args.compute, "before_ms": round(before * 1e3, 2),
        "during_ms": [round(x * 1e3, 2) for x in during], "stall_ms": round(stall * 1e3, 2), "target_ms": 20,
        "noise_ms": round(noise * 1e3, 2), "iterations_taken": taken, "window": [args.at, end - 1],
        "migrated": moved["migrations"], "identical": identical, "durations_ms": [round(x * 1e3, 2) for x in d],
        "baseline_durations_ms": [round(x * 1e3, 2) for x in still["durations"]],
    }))
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
