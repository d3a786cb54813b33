"""Failover after kill -9 of an Aggregator process: the pause a replicated job sees.

A 2-worker BSP job (replication 1) holds ``--mbytes`` of parameters in 1 MiB tensors, updated on
the service by momentum SGD, on a service of 3 Aggregator processes. Each iteration a worker
"computes" for ``--compute`` seconds (a sleep, standing in for forward/backward) and push-pulls
every tensor. At iteration ``--at`` the driver sends SIGKILL to the Aggregator serving most of the
job: its state is gone with it. pMaster notices the closed connection, waits its grace period
(0.5 s by default: a restart of the same Aggregator within it is not a failure), promotes the
replicas and starts new replicas; the Agents ask where their parts went and resend.

The same job also runs without the kill, alternating with the killed runs round by round
(``--rounds``; the killed run first on even rounds), and each killed run is read against the clean
run of its round over the same iterations. Figures (lower is better):

- the longest iteration from the kill on over the median of the iterations before it, against
  the clean run's same ratio: the pause;
- the mean iteration from the kill on, against the clean run's: what failing over and making new
  replicas cost the job.

Printed as a check, not a ratio: issue 9's requirement, a pause (the longest iteration minus the
median before) under 2 s. The final weights of every run, killed or not, must be bit-identical (no
round lost or applied twice). Ends with one JSON line.

    python benchmarks/failover.py            # 32 MiB, 3 rounds
    python benchmarks/failover.py --quick    # 4 MiB, 2 rounds, a smoke run (under a minute)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal as signals
import statistics
import sys
import tempfile

from disturbed_job import alternate, median_before, run_workers, stall, train

from pslink.bench import figures

TENSOR = 1 << 18  # float32 elements: 1 MiB, one part each
SETTINGS = {"type": "sgd", "lr": 0.01, "momentum": 0.9}
TARGET_S = 2.0  # issue 9's requirement for the pause, printed as a check


def _worker(master, job, rank, keys, iterations, at, compute, signal, results):
    import pslink

    with pslink.connect(job, rank, 2, master=master, optimizer=SETTINGS, replication=1, timeout=120) as agent:
        durations, digest = train(agent, rank, keys, TENSOR, iterations, at, compute, signal)
        results.put((rank, durations, digest))


def run(keys: int, iterations: int, at: int | None, compute: float, log_dir: str) -> dict:
    from pslink.core.service import Service

    job = f"failover-{'killed' if at is not None else 'clean'}"
    victim = []
    with Service(aggregators=3, log_dir=log_dir, control={"profile_iterations": 0}) as service:

        def kill():
            counts: dict = {}
            for spec in service.master.state.jobs[job].keys.values():
                for part in spec.parts:
                    counts[part.aggregator] = counts.get(part.aggregator, 0) + 1
            victim.append(max(counts, key=counts.get))
            os.kill(service.provider.pid(victim[0]), signals.SIGKILL)

        outcome = run_workers(_worker, (service.address, job, keys, iterations, at, compute), at is not None, kill)
        failovers = service.master.failovers_done
    return {"durations": outcome[0][0], "digests": [outcome[r][1] for r in (0, 1)],
            "victim": victim[0] if victim else None, "failovers": failovers}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mbytes", type=int, default=32, help="parameters of the job, in MiB (1 MiB tensors)")
    parser.add_argument("--iterations", type=int, default=30)
    parser.add_argument("--at", type=int, default=15, help="the iteration during which the Aggregator is killed")
    parser.add_argument("--compute", type=float, default=0.1, help="seconds of simulated compute per iteration")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds of a killed and a clean run")
    parser.add_argument("--quick", action="store_true", help="4 MiB, 12 iterations, 2 rounds (a smoke run)")
    args = parser.parse_args(argv)
    if args.quick:
        args.mbytes, args.iterations, args.at, args.rounds = 4, 12, 6, 2
    if not 1 <= args.at < args.iterations:
        parser.error(f"--at must be between 1 and --iterations - 1 ({args.iterations - 1}), got {args.at}")
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    keys = max(1, args.mbytes)
    print(f"pslink failover benchmark on {platform.node()} ({os.cpu_count()} CPUs): {keys} tensors of 1 MiB "
          f"({keys} MiB + momentum), 2 workers, replication 1, {args.compute * 1e3:.0f} ms compute per iteration, "
          f"{args.rounds} rounds of a killed and a clean run (alternating)", flush=True)
    with tempfile.TemporaryDirectory(prefix="pslink-failover-") as logs:
        def one(killed: bool, index: int) -> dict:
            log_dir = os.path.join(logs, f"{index}-{'killed' if killed else 'clean'}")
            return run(keys, args.iterations, args.at if killed else None, args.compute, log_dir)

        pairs = alternate(args.rounds, one)
    rounds = []
    end = args.iterations
    for index, pair in enumerate(pairs):
        killed, clean = pair[True], pair[False]
        d, base = killed["durations"], clean["durations"]
        before, base_before = median_before(d, args.at), median_before(base, args.at)
        rounds.append({
            "victim": killed["victim"], "failovers": killed["failovers"], "before_ms": before * 1e3,
            "slowest_ms": max(d[args.at:]) * 1e3, "pause_s": max(d[args.at:]) - before,
            "noise_ms": (max(base[args.at:]) - base_before) * 1e3,
            "stall": stall(d, args.at, end), "clean_stall": stall(base, args.at, end),
            "mean_ms": statistics.mean(d[args.at:]) * 1e3, "clean_mean_ms": statistics.mean(base[args.at:]) * 1e3,
            "durations_ms": [x * 1e3 for x in d], "baseline_durations_ms": [x * 1e3 for x in base]})
        r = rounds[-1]
        print(f"round {index + 1}: killed {r['victim']} (SIGKILL) at iteration {args.at}, failovers done by pMaster: "
              f"{r['failovers']}; before {before * 1e3:.1f} ms, slowest from the kill on {r['slowest_ms']:.1f} ms: "
              f"pause {r['pause_s']:.3f} s; the clean run's same iterations {r['noise_ms']:.1f} ms over its median",
              flush=True)
    digests = [digest for pair in pairs for result in pair.values() for digest in result["digests"]]
    identical = len(set(digests)) == 1
    failed_over = all(r["failovers"] == 1 for r in rounds)
    anchor = "the job without the kill (same round, same iterations)"
    what = f"failover after kill -9 of an Aggregator, {keys} MiB + momentum, replication 1, 2 workers"
    figs = [
        figures.measured("failover", f"{what}: longest iteration from the kill on over the median before",
                         "x median", "lower", [r["stall"] for r in rounds], anchor, [r["clean_stall"] for r in rounds]),
        figures.measured("failover", f"{what}: mean iteration from the kill on", "ms", "lower",
                         [r["mean_ms"] for r in rounds], anchor, [r["clean_mean_ms"] for r in rounds]),
    ]
    for fig in figs:
        figures.emit(fig)
    pause, longest = statistics.median(r["pause_s"] for r in rounds), max(r["pause_s"] for r in rounds)
    # Issue 9's requirement, checked (not a ratio): training resumes within 2 s of the kill.
    print(f"issue 9's requirement, pause < {TARGET_S:.0f} s: {'met' if longest < TARGET_S else 'not met'} "
          f"(median over rounds {pause:.3f} s, longest {longest:.3f} s)")
    print(f"final weights bit-identical in every run, killed or not: {'yes' if identical else 'NO'}")
    first = rounds[0]

    def ms(xs):
        return [round(x, 2) for x in xs]

    print(json.dumps({
        "benchmark": "failover", "host": platform.node(), "tensors": keys, "mbytes": keys,
        "compute_s": args.compute, "rounds": len(rounds),
        "before_ms": round(statistics.median(r["before_ms"] for r in rounds), 2), "pause_s": round(pause, 3),
        "target_s": TARGET_S, "noise_ms": round(statistics.median(r["noise_ms"] for r in rounds), 2),
        "failovers": first["failovers"], "identical": identical, "durations_ms": ms(first["durations_ms"]),
        "baseline_durations_ms": ms(first["baseline_durations_ms"]),
        "per_round": [{k: (ms(v) if isinstance(v, list) else round(v, 4) if isinstance(v, float) else v)
                       for k, v in r.items()} for r in rounds],
        "figures": [fig.as_json() for fig in figs],
    }))
    return 0 if identical and failed_over else 1


if __name__ == "__main__":
    sys.exit(main())
