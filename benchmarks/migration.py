"""Live migration of a whole running job (AutoPS Table 3): the stall the job sees.

A 2-worker BSP job holds ~100 MB of parameters in 4 MiB tensors, updated on the service by
momentum SGD (so weights and momentum both move). Each iteration, a worker "computes" for
``--compute`` seconds (a sleep, standing in for forward/backward on an accelerator) and then
push-pulls every tensor. At iteration ``--at`` every task of the job is migrated from its two
Aggregators to two others; pMaster throttles the moves (``max_migration_bytes`` of task state
copying at a time), so they spread over several iterations. The window of the migration runs from
iteration ``--at`` to the iteration after the last task moved (the workers see where their parts
are). The same job also runs without the migration, alternating with the migrated runs round by
round (``--rounds``; the migrated run first on even rounds), and each migrated run is read against
the still run of its round over the same iterations. Figures (lower is better):

- the longest iteration of the window over the median of the iterations before it, against the
  still run's same ratio: the stall;
- the mean iteration of the window, against the still run's: what the copies cost the job.

Printed as a check, not a ratio: issue 7's requirement, a stall (the longest iteration minus the
median before) of at most 20 ms. The final weights of every run, migrated or not, must be
bit-identical. Ends with one JSON line.

    python benchmarks/migration.py            # ~100 MB, 3 rounds
    python benchmarks/migration.py --quick    # ~16 MB, 2 rounds, a smoke run (under a minute)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile

from disturbed_job import alternate, median_before, run_workers, stall, train

from pslink.bench import figures

TARGET_MS = 20  # issue 7's requirement for the stall, printed as a check
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
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds of a migrated and a still run")
    parser.add_argument("--max-migration-mib", type=int, default=None,
                        help="pMaster's max_migration_bytes, in MiB (default: pMaster's, 16 MiB)")
    parser.add_argument("--quick", action="store_true", help="16 MiB, 10 iterations, 2 rounds (a smoke run)")
    parser.add_argument("--png", help="also draw the last round's runs' speed per iteration, the migration shaded, "
                        "here")
    args = parser.parse_args(argv)
    if args.quick:
        args.mbytes, args.iterations, args.at, args.rounds = 16, 10, 5, 2
    if not 1 <= args.at < args.iterations - 1:
        parser.error(f"--at must be between 1 and --iterations - 2 ({args.iterations - 2}), got {args.at}")
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    keys = max(1, args.mbytes // 4)
    max_bytes = None if args.max_migration_mib is None else args.max_migration_mib << 20
    print(f"pslink migration benchmark on {platform.node()} ({os.cpu_count()} CPUs): {keys} tensors of 4 MiB "
          f"({keys * 4} MiB + momentum), 2 workers, {args.compute * 1e3:.0f} ms compute per iteration, "
          f"{args.rounds} rounds of a migrated and a still run (alternating)", flush=True)
    with tempfile.TemporaryDirectory(prefix="pslink-migration-") as logs:
        def one(migrated: bool, index: int) -> dict:
            log_dir = os.path.join(logs, f"{index}-{'moved' if migrated else 'still'}")
            return run(keys, args.iterations, args.at if migrated else None, args.compute, log_dir, max_bytes)

        pairs = alternate(args.rounds, one)
    rounds = []
    for index, pair in enumerate(pairs):
        moved, still = pair[True], pair[False]
        d, base = moved["durations"], still["durations"]
        # The whole migration: iteration --at to the one after the last task moved (all of the rest if
        # the workers never saw every part move); the still run is read over the same iterations.
        last = moved["last_moved"]
        end = len(d) if last is None else min(len(d), last + 2)
        before, base_before = median_before(d, args.at), median_before(base, args.at)
        rounds.append({
            "before_ms": before * 1e3, "during_ms": [x * 1e3 for x in d[args.at:end]],
            "after_ms": statistics.median(d[end:]) * 1e3 if d[end:] else None,
            "window": [args.at, end - 1], "iterations_taken": None if last is None else last - args.at + 1,
            "stall": stall(d, args.at, end), "still_stall": stall(base, args.at, end),
            "stall_ms": (max(d[args.at:end]) - before) * 1e3, "noise_ms": (max(base[args.at:end]) - base_before) * 1e3,
            "mean_ms": statistics.mean(d[args.at:end]) * 1e3, "still_mean_ms": statistics.mean(base[args.at:end]) * 1e3,
            "migrated": moved["migrations"], "places": moved["places"],
            "durations_ms": [x * 1e3 for x in d], "baseline_durations_ms": [x * 1e3 for x in base]})
        r = rounds[-1]
        print(f"round {index + 1}: migrated {r['migrated']} tasks to {r['places']} in "
              f"{r['iterations_taken'] if r['iterations_taken'] is not None else 'more than the'} iterations; "
              f"before {before * 1e3:.1f} ms, during {', '.join(f'{x:.1f}' for x in r['during_ms'])} ms "
              f"(iterations {args.at}-{end - 1}); stall {r['stall_ms']:.1f} ms over the median before, the still "
              f"run's same iterations {r['noise_ms']:.1f} ms over its own", flush=True)
    digests = [digest for pair in pairs for result in pair.values() for digest in result["digests"]]
    identical = len(set(digests)) == 1
    anchor = "the job not migrated (same round, same iterations)"
    what = f"live migration of {keys * 4} MiB + momentum, 2 workers"
    figs = [
        figures.measured("migration", f"{what}: longest iteration of the migration over the median before",
                         "x median", "lower", [r["stall"] for r in rounds], anchor, [r["still_stall"] for r in rounds]),
        figures.measured("migration", f"{what}: mean iteration during the migration", "ms", "lower",
                         [r["mean_ms"] for r in rounds], anchor, [r["still_mean_ms"] for r in rounds]),
    ]
    for fig in figs:
        figures.emit(fig)
    stall_ms = statistics.median(r["stall_ms"] for r in rounds)
    noise_ms = statistics.median(r["noise_ms"] for r in rounds)
    # Issue 7's requirement, checked (not a ratio): the stall a job sees, in ms over its own pace.
    print(f"issue 7's requirement, stall <= {TARGET_MS} ms: {'met' if stall_ms <= TARGET_MS else 'not met'} "
          f"(median over rounds {stall_ms:.1f} ms; the still runs' same figure {noise_ms:.1f} ms)")
    print(f"final weights bit-identical in every run, migrated or not: {'yes' if identical else 'NO'}")
    if args.png:
        from pslink.bench.pictures import timeline_png

        def speed(durations):
            clock, points = 0.0, []
            for duration in durations:
                clock += duration / 1e3
                points.append((clock, 1e3 / duration))
            return points

        r = rounds[-1]
        moved_points = speed(r["durations_ms"])
        first, end = r["window"][0], r["window"][1] + 1
        picture = timeline_png(
            args.png, f"live migration of {keys * 4} MiB: iteration speed, migrated vs not (stall "
            f"{r['stall_ms']:.1f} ms)", {"migrated": moved_points, "not migrated": speed(r["baseline_durations_ms"])},
            [(0.0, 4), (moved_points[-1][0], 4)],
            [(moved_points[first - 1][0], moved_points[end - 1][0], "migration")])
        print(f"timeline: {picture}")
    first = rounds[0]

    def ms(xs):
        return [round(x, 2) for x in xs]

    print(json.dumps({
        "benchmark": "migration", "host": platform.node(), "tensors": keys, "mbytes": keys * 4,
        "compute_s": args.compute, "rounds": len(rounds),
        "before_ms": round(statistics.median(r["before_ms"] for r in rounds), 2),
        "during_ms": ms(first["during_ms"]), "stall_ms": round(stall_ms, 2), "target_ms": TARGET_MS,
        "noise_ms": round(noise_ms, 2), "iterations_taken": first["iterations_taken"], "window": first["window"],
        "migrated": first["migrated"], "identical": identical, "durations_ms": ms(first["durations_ms"]),
        "baseline_durations_ms": ms(first["baseline_durations_ms"]),
        "per_round": [{k: (ms(v) if isinstance(v, list) and k.endswith("_ms") else
                           round(v, 4) if isinstance(v, float) else v) for k, v in r.items()} for r in rounds],
        "figures": [fig.as_json() for fig in figs],
    }))
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
