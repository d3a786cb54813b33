"""Host-local reduce across hosts: two hosts of two workers, flat against host-local, one run.

    sudo python benchmarks/hierarchy.py                      # 10 Gbit/s links, 3 repeats
    sudo python benchmarks/hierarchy.py --rate 1gbit --quick
    sudo python benchmarks/hierarchy.py --dsync --slow 20mbit  # groups with delayed global sync

Hosts A and B (network namespaces, links shaped with ``tc ... tbf`` in both directions) run two
workers each (ranks 0, 1 on A, 2, 3 on B, numbered as ``pslink launch`` numbers them); pMaster
and its Aggregators are on host M. Each run trains ``--steps`` steps of a model of ``--keys``
tensors (``--mib`` MiB in all) with pushpull (the DDP hook's and Horovod's allreduce path):

- **flat**: every worker pushes to the pool (``PSLINK_HOST_REDUCE=0``);
- **host-local**: each host's workers sum on the host, its leader pushes for both.

Alternating the variants ``--repeats`` times (one run of each per round, the order reversed every
other round), it measures per step: the bytes on the wire (what hosts A and B's links carried,
both directions, read from their interfaces' counters), the pool's CPU seconds (the Aggregator
processes on M, from /proc; they run with ``PSLINK_AGGREGATOR_SPIN_MS=0``, so that their CPU is
their work, not polling), both counted over the timed steps only (not the pool's start-up for the
job), and the step time (median over the workers' steps). Reported as figures
(``pslink.bench.figures``): host-local against flat for each, with the spread of the rounds' own
ratios (the goal: pool CPU and wire bytes at most 0.55x flat). The last line is JSON. Needs root
(namespaces); without it, it says why and exits.

``--dsync``: two sites, A and B, each with its own service, the link between them (B's) slow
(``--slow``). The digits demo (2 workers per site) runs flat (all 4 on A's service: B's workers
cross the slow link every step) and as 2 groups (each on its site's service, averaging their
weights every ``--every`` steps through A's), alternating: a figure of the groups' time to the flat
run's final accuracy against the flat run's time, over the rounds where the groups reached it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

from pslink.bench import figures as fig  # noqa: E402
from pslink.bench import netns  # noqa: E402

PYTHON = sys.executable
PSLINK = [PYTHON, "-m", "pslink.cli"]
PORT = 7770
HOSTS = "AABB"  # the ranks' hosts


def role_worker(args) -> None:
    """One worker: ``--steps`` pushpulls of the whole model; prints its step times as JSON."""
    import numpy as np

    import pslink

    values = args.mib * (1 << 20) // 4 // args.keys
    keys = [f"w{k}" for k in range(args.keys)]
    grads = [np.full(values, args.rank + 1, np.float32) for _ in keys]
    with pslink.connect(args.job, args.rank, 4, args.master) as agent:
        agent.init_many(keys, [np.zeros(values, np.float32) for _ in keys]).wait()
        times = []
        for step in range(args.warmup + args.steps):
            if step == args.warmup:  # the timed steps begin: the parent reads the counters
                agent.barrier("warm")
                if args.rank == 0:
                    print("timed", flush=True)
                    sys.stdin.readline()
                agent.barrier("timed")
            started = time.perf_counter()
            agent.pushpull_many(keys, grads, grads, average=True).wait()
            times.append(time.perf_counter() - started)
            for g in grads:
                g.fill(args.rank + 1)
        agent.barrier("steps")
        if args.rank == 0:  # and they end
            print("steps done", flush=True)
            sys.stdin.readline()
        agent.barrier("done")
    print(json.dumps({"times": times[args.warmup:], "host": type(agent._sender.host).__name__}), flush=True)


def role_digits(args) -> None:
    """One worker of the digits demo, flat or in a group (``--group``); prints its result."""
    import pslink
    from pslink.core.worker.groups import GroupSync
    from pslink.demo.digits import train

    grouped = args.group is not None
    job = f"{args.job}.g{args.group}" if grouped else args.job
    rank = args.rank % 2 if grouped else args.rank
    with pslink.connect(job, rank, 2 if grouped else 4, args.master) as agent:
        groups = GroupSync(agent, args.job, args.group, 2, args.every, master=args.global_master) if grouped else None
        try:
            result = train(agent, epochs=args.epochs, hidden=args.hidden, progress=False, groups=groups,
                           shard=(args.rank, 4))
        finally:
            if groups is not None:
                groups.close()
    result["syncs"] = groups.syncs if groups is not None else None
    print(json.dumps(result), flush=True)


def run_dsync(args) -> dict:
    """Two sites, A and B, a slow link between them (B's, shaped to ``--slow``): a flat job of
    4 workers (2 per site) on A's service, against 2 groups of 2 (each on its own site's service,
    the global sync every ``--every`` steps through A's), alternating; seconds and accuracy."""
    figures: dict = {"flat": [], "groups": []}
    with netns.VirtualHosts(["A", "B"]) as hosts:
        hosts.shape("B", args.slow)
        masters = {host: f"tcp://{hosts.address(host)}:{PORT}" for host in "AB"}
        services = []
        for host in "AB":
            services.append(_start(hosts, host, [*PSLINK, "service", "up", "--host", hosts.address(host), "--port",
                                                 str(PORT), "--aggregators", "1", "--allow-first-join"]))
            netns.wait_service(hosts, host, masters[host], 1, services[-1])
        try:
            for index in range(args.repeats):
                for variant in ("flat", "groups") if index % 2 == 0 else ("groups", "flat"):
                    procs = []
                    epochs = args.epochs if variant == "flat" else 2 * args.epochs  # time to the flat accuracy
                    for rank, host in enumerate(HOSTS):
                        argv = [PYTHON, __file__, "--role", "digits", "--job", f"digits-{variant}-{index}", "--rank",
                                str(rank), "--epochs", str(epochs), "--hidden", str(args.hidden)]
                        if variant == "flat":
                            argv += ["--master", masters["A"]]
                        else:
                            argv += ["--master", masters[host], "--group", str(rank // 2), "--every",
                                     str(args.every), "--global-master", masters["A"]]
                        procs.append(_start(hosts, host, argv))
                    outs = [netns.finish(proc, 900, f"digits {variant} rank {rank}") for rank, proc in enumerate(procs)]
                    results = [json.loads([ln for ln in out.splitlines() if ln.startswith("{")][-1]) for out in outs]
                    figures[variant].append({"seconds": max(r["seconds"] for r in results),
                                             "accuracy": min(r["accuracy"] for r in results),
                                             "history": results[0]["history"], "syncs": results[0]["syncs"]})
                    print(variant, {k: v for k, v in figures[variant][-1].items() if k != "history"}, flush=True)
        finally:
            for host, service in zip("AB", services):
                _stop(hosts, host, service)
    # Each groups run against the flat run of its round: the time its rank 0 first reached the flat
    # run's final accuracy (None: not within twice the epochs).
    reached = []
    for flat, grouped in zip(figures["flat"], figures["groups"]):
        grouped["to_flat_accuracy"] = next((t for t, a in grouped["history"] if a >= flat["accuracy"]), None)
        if grouped["to_flat_accuracy"] is not None:
            reached.append((grouped["to_flat_accuracy"], flat["seconds"]))
    what = (f"2 groups of 2 workers over a {args.slow} link, global sync every {args.every} steps: seconds to the "
            "flat run's final accuracy")
    if reached:
        figure = fig.measured("hierarchy", what, "s", "lower", [g for g, _ in reached],
                              "the flat job of 4 workers across the link (its whole run)", [f for _, f in reached])
    else:
        figure = fig.unanchored("hierarchy", f"2 groups of 2 workers over a {args.slow} link: seconds of the whole "
                                "run", "s", "lower", [g["seconds"] for g in figures["groups"]],
                                missing="the groups never reached the flat run's accuracy within twice its epochs: "
                                        "no time to compare with the flat run's")
    return {"slow_link": args.slow, "every": args.every, "epochs": args.epochs, "runs": figures,
            "reached": f"{len(reached)} of {len(figures['groups'])}",
            "groups_time_to_flat_accuracy_over_flat": figure.ratio, "figures": [figure]}


def _start(hosts, host, argv, env=None) -> subprocess.Popen:
    return netns.start_on(hosts, host, argv, cwd=ROOT, env=env)


def _stop(hosts, host, service) -> None:
    """Stop a service and its Aggregators: killing pMaster's process alone leaves its Aggregators
    holding the output pipe until they notice it gone (a minute)."""
    service.terminate()
    try:
        service.communicate(timeout=20)
    except subprocess.TimeoutExpired:
        hosts.kill(host)
        service.communicate(timeout=20)


def wire_bytes(hosts) -> int:
    """What hosts A and B's links carried so far, both directions."""
    total = 0
    for host in "AB":
        out = hosts.run(host, ["cat", "/sys/class/net/eth0/statistics/rx_bytes",
                               "/sys/class/net/eth0/statistics/tx_bytes"], timeout=10, capture_output=True, text=True)
        total += sum(int(line) for line in out.stdout.split())
    return total


def aggregator_cpu(hosts) -> dict[int, float]:
    """CPU seconds each Aggregator process on M used so far."""
    seen = {}
    tick = os.sysconf("SC_CLK_TCK")
    for pid in hosts.pids("M"):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"pslink.core.aggregator" not in f.read():
                    continue
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            seen[pid] = (int(fields[11]) + int(fields[12])) / tick  # utime, stime
        except (FileNotFoundError, ProcessLookupError):
            continue
    return seen


def measure(hosts, args, variant: str, index: int) -> dict:
    """One run of ``variant``: the counters are read when the timed steps begin and end (rank 0
    waits for the go on its stdin each time), so the pool's start-up is not counted."""
    master = f"tcp://{hosts.address('M')}:{PORT}"
    job = f"{variant}-{index}"
    procs = []
    for rank, host in enumerate(HOSTS):
        env = {"PSLINK_LOCAL_RANK": str(rank % 2), "PSLINK_LOCAL_SIZE": "2",
               "PSLINK_HOST_REDUCE": "1" if variant == "host-local" else "0"}
        argv = [PYTHON, __file__, "--role", "worker", "--job", job, "--rank", str(rank), "--master", master,
                "--keys", str(args.keys), "--mib", str(args.mib), "--steps", str(args.steps), "--warmup",
                str(args.warmup)]
        procs.append(netns.start_on(hosts, host, argv, cwd=ROOT, env=env, stdin=subprocess.PIPE))
    counters = []
    for marker in ("timed", "steps done"):
        for line in procs[0].stdout:
            if line.strip() == marker:
                break
        else:
            raise SystemExit(f"{variant} rank 0 ended before {marker!r}:\n{netns.finish(procs[0], 60, 'rank 0')}")
        counters.append((wire_bytes(hosts), aggregator_cpu(hosts), time.perf_counter()))
        procs[0].stdin.write("go\n")
        procs[0].stdin.flush()
    outs = [netns.finish(proc, 600, f"{variant} rank {rank}") for rank, proc in enumerate(procs)]
    results = [json.loads([line for line in out.splitlines() if line.startswith("{")][-1]) for out in outs]
    expected = {"flat": {"NoneType"}, "host-local": {"HostLeader", "HostFollower"}}[variant]
    if {r["host"] for r in results} != expected:
        raise SystemExit(f"{variant}: the workers' host-local parts were {[r['host'] for r in results]}")
    (wire0, cpu0, _), (wire1, cpu1, _) = counters
    pool = sum(cpu - cpu0.get(pid, 0.0) for pid, cpu in cpu1.items())
    return {"wire_MB": (wire1 - wire0) / args.steps / 1e6, "pool_cpu_ms": pool / args.steps * 1e3,
            "step_ms": statistics.median(t for r in results for t in r["times"]) * 1e3}


MEASURES = {"wire_MB": ("bytes on the worker hosts' links per step", "MB/step"),
            "pool_cpu_ms": ("the pool's CPU per step", "CPU ms/step"),
            "step_ms": ("step time", "ms/step")}


def run(args) -> dict:
    figures: dict = {"flat": [], "host-local": []}
    with netns.VirtualHosts(["M", "A", "B"]) as hosts:
        for host in "AB":
            hosts.shape(host, args.rate)
        service = _start(hosts, "M", [*PSLINK, "service", "up", "--host", hosts.address("M"), "--port", str(PORT),
                                      "--aggregators", str(args.aggregators), "--allow-first-join"],
                         env={"PSLINK_AGGREGATOR_SPIN_MS": "0"})  # their CPU is then their work
        netns.wait_service(hosts, "M", f"tcp://{hosts.address('M')}:{PORT}", args.aggregators, service)
        try:
            for index in range(args.repeats):
                for variant in ("flat", "host-local") if index % 2 == 0 else ("host-local", "flat"):
                    figures[variant].append(measure(hosts, args, variant, index))
                    print(f"round {index + 1}/{args.repeats} {variant}", figures[variant][-1], flush=True)
        finally:
            _stop(hosts, "M", service)
    summary = {v: {k: statistics.median(r[k] for r in rows) for k in rows[0]} for v, rows in figures.items()}
    setting = f"2 hosts x 2 workers, {args.rate} links, {args.mib} MiB in {args.keys} tensors"
    anchor = "flat: every worker pushes to the pool (PSLINK_HOST_REDUCE=0)"
    made = {}
    for key, (what, unit) in MEASURES.items():
        ours, flat = [r[key] for r in figures["host-local"]], [r[key] for r in figures["flat"]]
        what = f"host-local reduce, {setting}: {what}"
        if all(flat):
            made[key] = fig.measured("hierarchy", what, unit, "lower", ours, anchor, flat)
        else:  # the pool's CPU is read in clock ticks: a short run can read none
            made[key] = fig.unanchored("hierarchy", what, unit, "lower", ours,
                                       missing=f"flat read 0 {unit} in a round (/proc counts clock ticks): run more "
                                               "--steps")
    return {"rate": args.rate, "model_MiB": args.mib, "keys": args.keys, "steps": args.steps, "runs": figures,
            "median": summary, "host_local_over_flat": {k: f.ratio for k, f in made.items()},
            "figures": list(made.values())}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--role", choices=["worker", "digits"], help=argparse.SUPPRESS)
    parser.add_argument("--group", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--global-master", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--dsync", action="store_true",
                        help="instead: two sites over a slow link, flat against groups with delayed global sync")
    parser.add_argument("--slow", default="20mbit", help="--dsync: the link between the sites")
    parser.add_argument("--every", type=int, default=5, help="--dsync: local steps between global syncs")
    parser.add_argument("--epochs", type=int, default=8, help="--dsync: epochs of the digits demo")
    parser.add_argument("--hidden", type=int, default=256, help="--dsync: the demo's hidden layer")
    parser.add_argument("--job", help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--master", help=argparse.SUPPRESS)
    parser.add_argument("--rate", default="10gbit", help="each worker host's link (tc tbf rate)")
    parser.add_argument("--aggregators", type=int, default=2)
    parser.add_argument("--keys", type=int, default=16)
    parser.add_argument("--mib", type=int, default=16, help="the model's size")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3, help="rounds: runs of each variant, alternating")
    parser.add_argument("--quick", action="store_true", help="2 rounds, 10 steps, a 4 MiB model (--dsync: 2 epochs)")
    args = parser.parse_args(argv)
    if args.role == "worker":
        role_worker(args)
        return 0
    if args.role == "digits":
        role_digits(args)
        return 0
    if args.quick:
        args.repeats, args.steps, args.mib, args.epochs = 2, 10, 4, 2
    if args.repeats < 1 or args.steps < 1:
        parser.error(f"--repeats and --steps must be at least 1 (got {args.repeats}, {args.steps})")
    reason = netns.unavailable()
    if reason:
        print(f"skipped: {reason}")
        return 0
    result = run_dsync(args) if args.dsync else run(args)
    if args.dsync:
        print(f"the groups reached the flat run's accuracy in {result['reached']} rounds")
    for figure in result["figures"]:
        fig.emit(figure)
    result = {"benchmark": "hierarchy", "quick": args.quick, "dsync": args.dsync, **result,
              "figures": [f.as_json() for f in result["figures"]]}
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
