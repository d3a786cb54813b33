"""Live migration across two hosts (issue 54): the stall the job sees while its state crosses a
shaped link, at 1 Gbit/s and at 10 Gbit/s.

Three hosts on one machine (network namespaces, :mod:`pslink.bench.netns`), each link shaped
with ``tc ... tbf`` to the rate in both directions, as a NIC: host A runs pMaster (in this
process) and two Aggregators, host B one Aggregator (``pslink aggregator``, joined once the job's
parts are placed on A, so that they all start on A), host W the job's two workers. The job (2
workers, ``--mbytes`` in 4 MiB tensors, momentum SGD on the service) is never profiled; at
iteration ``--at`` the operator moves every task from A's Aggregators to B's
(``service.master.migrate``): every byte of its state (weights and momentum) crosses A's link.
The workers sit on a host of their own, so their traffic is the same before and after the move
(pushes out of W, sums into W, from A or from B): only the copy is new on the links.

Size and compute: the copy of ``--mbytes`` (2 x 16 MiB with momentum: 0.27 s of a 1 Gbit/s link
alone) must take far longer than the stall allowed (noise + 10 ms), while the job's own traffic
(each iteration: 2 workers x 16 MiB out of W and the same back from A or B, 0.27 s of each
direction at 1 Gbit/s) leaves the links idle most of an iteration (``--compute`` 0.4 s: at
1 Gbit/s each direction of A's link is busy with the job about a third of an iteration). A
100 MB job would move ~1.7 s of state at 1 Gbit/s, but its own traffic would then fill the link
(1.7 s of pulls an iteration) unless it computed for several seconds an iteration, which would
not fit the time budget.

Per rate, the migrated runs alternate with still runs (B joined, no move) round by round
(``--rounds``), each read against the still run of its round over the same iterations (when the
moves ran is read from pMaster's status, as in ``benchmarks/migration.py``): the stall, the
noise, issue 54's check ``stall <= noise + 10 ms`` each round, how long the copy took (first move
begun to last move done) beside it, and the weights bit for bit. Needs root (namespaces):
without it, it says why and exits 0. Ends with one JSON line.

    sudo python benchmarks/migration_hosts.py                 # 16 MiB, 3 rounds, 1 and 10 Gbit/s (~5 min)
    sudo python benchmarks/migration_hosts.py --quick         # 8 MiB, 1 round (~1 min)
    sudo python benchmarks/migration_hosts.py --png docs/img/migration-hosts.png   # -1gbit.png, -10gbit.png
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time

from disturbed_job import alternate, run_workers
from migration_job import outcome_of, picture, read, rounded, summary, worker

from pslink.bench import figures, netns
from pslink.bench.migration_runs import MoveWatch

MARGIN_MS = 10.0  # issue 54, across hosts: stall <= the same round's noise + 10 ms
NEVER = 10**9  # profile_iterations that never end: the job stays where it was placed
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(hosts, migrated: bool, index: int, args, keys: int, log_dir: str) -> dict:
    from pslink.core.service import Service
    from pslink.core.service.client import ControlClient

    job = f"hosts-{'moved' if migrated else 'still'}-{index}"
    asked: list[float] = []
    with hosts.enter("A"):
        # Made in A's namespace: pMaster's sockets and thread, and its Aggregators' processes.
        service = Service(listen=f"tcp://{hosts.address('A')}:0", aggregators=2, log_dir=log_dir,
                          control={"profile_iterations": NEVER}).start(timeout=60)
    joined = None
    try:
        def connect():
            with hosts.enter("A"):
                return ControlClient(service.address, timeout=10)

        def migrate():
            master = service.master
            target = [n for n in master.state.aggregators if n not in service.provider.names()]
            asked.append(time.time())
            master.migrate(master.tasks_of(job), target[0], "benchmark: across hosts")

        with MoveWatch(connect) as watch:
            def placed():
                return len(service.master.tasks_of(job)) >= keys

            def join_b():
                nonlocal joined
                with open(os.path.join(log_dir, "agg-B.log"), "w") as log:  # the child keeps its own copy
                    joined = hosts.popen("B", [sys.executable, "-m", "pslink.cli", "aggregator", "--master",
                                               service.address], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=log)
                names = set(service.master.state.aggregators)
                watch.wait(lambda: len(set(service.master.state.aggregators) - names) >= 1
                           and all(service.master.aggregator_alive(n) for n in service.master.state.aggregators),
                           "the Aggregator on host B", 60)

            def prepare():
                # B joins once the job's parts are on A (B idle earlier would take half of them).
                watch.wait(placed, f"the parts of {job}", 120)
                join_b()

            with hosts.enter("W"):
                outcome = run_workers(worker, (service.address, job, keys, args.iterations, args.at, args.compute,
                                               {"servers": 2}), True, _Prepared(prepare, migrate if migrated else None))
    finally:
        service.stop()
        if joined is not None:
            try:
                joined.wait(20)
            except subprocess.TimeoutExpired:
                joined.kill()
                joined.wait(10)
    result = outcome_of(outcome)
    result["moves"] = watch.span(after=asked[0]) if asked else None
    return result


class _Prepared:
    """The disturbance run_workers calls at iteration ``at`` (``disturb``; None: nothing), with
    ``prepare`` run on a thread of its own from the start, while the job's first iterations run,
    and done (or its error raised) before."""

    def __init__(self, prepare, disturb):
        self.error = None
        self.disturb = disturb

        def go():
            try:
                prepare()
            except BaseException as exc:  # noqa: BLE001 - raised at iteration ``at``, where the driver waits anyway
                self.error = exc

        self.thread = threading.Thread(target=go, daemon=True)
        self.thread.start()

    def __call__(self):
        self.thread.join(180)
        if self.thread.is_alive():
            raise TimeoutError("preparing the move (B's Aggregator joining) did not end within 180 s")
        if self.error is not None:
            raise self.error
        if self.disturb is not None:
            self.disturb()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rates", default="1gbit,10gbit", help="link rates, comma-separated (tc's words)")
    parser.add_argument("--mbytes", type=int, default=16, help="parameters of the job, in MiB (4 MiB tensors)")
    parser.add_argument("--iterations", type=int, default=24)
    parser.add_argument("--at", type=int, default=12, help="the iteration during which the job is moved")
    parser.add_argument("--compute", type=float, default=0.4, help="seconds of simulated compute per iteration")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds of a migrated and a still run")
    parser.add_argument("--quick", action="store_true", help="8 MiB, 16 iterations, 1 round (a smoke run)")
    parser.add_argument("--png", help="also draw each rate's last round: PATH-<rate>.png")
    args = parser.parse_args(argv)
    if args.quick:
        args.mbytes, args.iterations, args.at, args.rounds = 8, 16, 9, 1
    if not 7 <= args.at < args.iterations - 1:
        parser.error(f"--at must be between 7 (B joins during the first iterations) and --iterations - 2 "
                     f"({args.iterations - 2}), got {args.at}")
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    rates = [r.strip() for r in args.rates.split(",") if r.strip()]
    for rate in rates:
        try:
            netns.burst_for(rate)
        except ValueError as exc:
            parser.error(str(exc))
    why = netns.unavailable()
    if why:
        print(f"migration_hosts: skipped: {why}", flush=True)
        return 0
    # multiprocessing's resource tracker, started here, outside the hosts: started by the first
    # worker spawned in host W, it would be killed with W's processes when the hosts go.
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()
    keys = max(1, args.mbytes // 4)
    print(f"pslink migration across hosts on {platform.node()} ({os.cpu_count()} CPUs): {keys} tensors of 4 MiB "
          f"({keys * 4} MiB + momentum), 2 workers on host W, from 2 Aggregators on host A to 1 on host B, links "
          f"{', '.join(rates)}, {args.compute * 1e3:.0f} ms compute per iteration, {args.rounds} rounds each",
          flush=True)
    what = f"live migration of {keys * 4} MiB + momentum across hosts, 2 workers"
    anchor = "the job not migrated (same round, same iterations)"
    report, figs, ok = {}, [], True
    with tempfile.TemporaryDirectory(prefix="pslink-migration-hosts-") as logs:
        for rate in rates:
            with netns.VirtualHosts(["A", "B", "W"]) as hosts:
                for host in ("A", "B", "W"):
                    hosts.shape(host, rate)

                def one(migrated: bool, index: int, rate=rate, hosts=hosts) -> dict:
                    log_dir = os.path.join(logs, f"{rate}-{index}-{'moved' if migrated else 'still'}")
                    os.makedirs(log_dir, exist_ok=True)
                    return run(hosts, migrated, index, args, keys, log_dir)

                pairs = alternate(args.rounds, one)
            label = f"{rate}"
            rounds = [read(label, i, pair[True], pair[False], pair[True]["moves"], MARGIN_MS)
                      for i, pair in enumerate(pairs)]
            identical = len({d for pair in pairs for result in pair.values() for d in result["digests"]}) == 1
            summary(label, rounds, identical, MARGIN_MS)
            measured = [r for r in rounds if r["moved"]]
            ok = ok and identical and len(measured) == len(rounds)
            if measured:
                figs += [
                    figures.measured("migration_hosts", f"{what}, {rate} links: longest iteration of the migration "
                                     "over the median before", "x median", "lower", [r["stall"] for r in measured],
                                     anchor, [r["still_stall"] for r in measured]),
                    figures.measured("migration_hosts", f"{what}, {rate} links: mean iteration during the migration",
                                     "ms", "lower", [r["mean_ms"] for r in measured], anchor,
                                     [r["still_mean_ms"] for r in measured]),
                ]
            report[rate] = {"identical": identical, "per_round": [rounded(r) for r in rounds]}
            if measured:
                report[rate].update(
                    stall_ms=round(statistics.median(r["stall_ms"] for r in measured), 2),
                    noise_ms=round(statistics.median(r["noise_ms"] for r in measured), 2),
                    copy_ms=round(statistics.median(r["migration_ms"] for r in measured), 1),
                    met_each_round=len(measured) == len(rounds) and all(r["met"] for r in measured))
            if args.png:
                stem, ext = os.path.splitext(args.png)
                last = rounds[-1]
                title = (f"{what}, {rate}: iteration times (stall {last['stall_ms']:.1f} ms, noise "
                         f"{last['noise_ms']:.1f} ms, copy {last['migration_ms']:.0f} ms)" if last["moved"]
                         else f"{rate}: no move")
                path = f"{stem}-{rate}{ext or '.png'}"
                print(f"timeline: {picture(path, title, last)}", flush=True)
    for fig in figs:
        figures.emit(fig)
    print(json.dumps({"benchmark": "migration_hosts", "host": platform.node(), "tensors": keys, "mbytes": keys * 4,
                      "compute_s": args.compute, "rounds": args.rounds, "margin_ms": MARGIN_MS, "rates": report,
                      "figures": [fig.as_json() for fig in figs]}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
