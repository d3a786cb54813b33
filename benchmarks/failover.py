"""Failover after kill -9 of an Aggregator process: the pause a replicated job sees.

A 2-worker BSP job (replication 1) holds ``--mbytes`` of parameters in 1 MiB tensors, updated on
the service by momentum SGD, on a service of 3 Aggregator processes. Each iteration a worker
"computes" for ``--compute`` seconds (a sleep, standing in for forward/backward) and push-pulls
every tensor. At iteration ``--at`` the driver sends SIGKILL to the Aggregator serving most of the
job: its state is gone with it. pMaster notices the closed connection, waits its grace period
(0.5 s by default: a restart of the same Aggregator within it is not a failure), promotes the
replicas and starts new replicas; the Agents ask where their parts went and resend.

The pause is the longest iteration from the kill on, minus the median iteration before it
(target: training resumes within 2 s). The same job runs again without the kill: the final weights
of both runs must be bit-identical (no round lost or applied twice). Ends with one JSON line.

    python benchmarks/failover.py            # 32 MiB, the measured run
    python benchmarks/failover.py --quick    # 4 MiB, a smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal as signals
import sys
import tempfile

from disturbed_job import median_before, run_workers, train

TENSOR = 1 << 18  # float32 elements: 1 MiB, one part each
SETTINGS = {"type": "sgd", "lr": 0.01, "momentum": 0.9}
TARGET_S = 2.0


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
    parser.add_argument("--quick", action="store_true", help="4 MiB, 12 iterations (a smoke run)")
    args = parser.parse_args(argv)
    if args.quick:
        args.mbytes, args.iterations, args.at = 4, 12, 6
    keys = max(1, args.mbytes)
    with tempfile.TemporaryDirectory(prefix="pslink-failover-") as logs:
        killed = run(keys, args.iterations, args.at, args.compute, os.path.join(logs, "a"))
        clean = run(keys, args.iterations, None, args.compute, os.path.join(logs, "b"))
    d = killed["durations"]
    before = median_before(d, args.at)
    pause = max(d[args.at:]) - before
    clean_before = median_before(clean["durations"], args.at)
    noise = max(clean["durations"][args.at:]) - clean_before  # the host alone, same window
    identical = len(set(killed["digests"] + clean["digests"])) == 1
    print(f"pslink failover benchmark on {platform.node()} ({os.cpu_count()} CPUs): {keys} tensors of 1 MiB "
          f"({keys} MiB + momentum), 2 workers, replication 1, {args.compute * 1e3:.0f} ms compute per iteration")
    print(f"killed {killed['victim']} (SIGKILL) at iteration {args.at}; failovers done by pMaster: "
          f"{killed['failovers']}")
    print(f"iterations before: median {before * 1e3:.1f} ms; slowest from the kill on: {max(d[args.at:]) * 1e3:.1f} ms")
    print(f"pause: {pause:.3f} s (target < {TARGET_S:.0f} s; ratio to target {pause / TARGET_S:.2f})")
    print(f"noise floor: the slowest iteration of the same window without a kill is {noise * 1e3:.1f} ms over its "
          f"median {clean_before * 1e3:.1f} ms")
    print(f"final weights bit-identical to the run without the kill: {'yes' if identical else 'NO'}")
    print(json.dumps({
        "benchmark": "failover", "host": platform.node(), "tensors": keys, "mbytes": keys,
        "compute_s": args.compute, "before_ms": round(before * 1e3, 2), "pause_s": round(pause, 3),
        "target_s": TARGET_S, "noise_ms": round(noise * 1e3, 2), "failovers": killed["failovers"],
        "identical": identical, "durations_ms": [round(x * 1e3, 2) for x in d],
        "baseline_durations_ms": [round(x * 1e3, 2) for x in clean["durations"]],
    }))
    return 0 if identical and killed["failovers"] == 1 else 1


if __name__ == "__main__":
    sys.exit(main())
