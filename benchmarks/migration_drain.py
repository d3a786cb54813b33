"""A drain of an Aggregator holding several jobs' parts (issue 54): no job's iteration slower than its SLO.

``--jobs`` jobs (4) train at once on a service of as many Aggregators, one worker each, each
holding ``--mbytes`` of parameters in 4 MiB tensors (momentum SGD on the service) and declaring
its SLO (``pslink.connect(..., slo=...)``: the slowdown it accepts from sharing; ``--slos``).
Each is profiled alone on an Aggregator of its own (``--profile`` iterations), then packed by the
control plane, which puts jobs together on shared Aggregators. Once every job is packed and no
move is under way (read from the status an operator sees), at job 0's iteration ``--at``, the
operator removes the Aggregator holding parts of the most jobs (``pslink service remove``): the
control plane drains it, moving every part it serves to the others while the jobs train, then
releases it. The same jobs also run without the drain, alternating round by round (the drained
run first on even rounds); each drained run is read against the still run of its round.

Per round and job: its iterations from the one during which the drain's first move began to the
one after its last move ended (the job's own clock), each as a slowdown over the median of the
job's 6 iterations before; the worst of them against the job's SLO (slower or not), and the still
run's same figure over the same iterations (what the host's noise does alone). Figure (lower is
better): the worst job's longest iteration of the drain over its median before, against the still
run's. Ends with one JSON line.

    python benchmarks/migration_drain.py            # 4 jobs of 16 MiB, 3 rounds (~4 min)
    python benchmarks/migration_drain.py --quick    # 4 jobs of 8 MiB, 1 round (~1 min)
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import sys
import tempfile
import threading
import time

from disturbed_job import alternate, train

from pslink.bench import figures
from pslink.bench.migration_runs import MoveWatch, Window, median_before, slowdowns

TENSOR = 1 << 20  # float32 elements: 4 MiB, one task each
SETTINGS = {"type": "sgd", "lr": 0.01, "momentum": 0.9}


def _worker(master, job, keys, iterations, at, compute, slo, signal, results):
    import pslink

    with pslink.connect(job, 0, 1, master=master, optimizer=SETTINGS, servers=1, slo=slo, timeout=120) as agent:
        starts: list[float] = []
        durations, digest = train(agent, 0, keys, TENSOR, iterations, at, compute, signal, starts=starts)
        results.put((job, durations, digest, starts))


def _holders(service, jobs: list[str]) -> dict[str, set]:
    """Aggregator -> the jobs with parts on it."""
    out: dict[str, set] = {}
    for job in jobs:
        for spec in service.master.state.jobs[job].keys.values():
            for part in spec.parts:
                out.setdefault(part.aggregator, set()).add(job)
    return out


def run(drained: bool, index: int, args, keys: int, slos: list[float], log_dir: str) -> dict:
    from pslink.core.service import Service
    from pslink.core.service.client import ControlClient

    jobs = [f"drain-{'moved' if drained else 'still'}-{index}-{j}" for j in range(len(slos))]
    context = mp.get_context("spawn")
    signal = context.Queue() if drained else None
    results = context.Queue()
    removal: dict = {}
    with Service(aggregators=len(slos), log_dir=log_dir, control={"profile_iterations": args.profile}) as service:
        with MoveWatch(lambda: ControlClient(service.address, timeout=10)) as watch:
            procs = [context.Process(target=_worker, args=(service.address, job, keys, args.iterations, args.at,
                                                           args.compute, slo, signal if j == 0 else None, results))
                     for j, (job, slo) in enumerate(zip(jobs, slos))]
            for p in procs:
                p.start()
            if signal is not None:
                signal.get(timeout=600)
                watch.wait(lambda: all(watch.phase(j) not in (None, "profiling") for j in jobs), "every job's pack",
                           120)
                packed = time.time()
                watch.wait(lambda: watch.idle_since(packed), "the end of the packs' moves", 120)
                holders = _holders(service, jobs)
                victim = max(sorted(holders), key=lambda name: len(holders[name]))
                removal.update(victim=victim, jobs=sorted(holders[victim]), asked=time.time())

                def remove():
                    try:
                        with ControlClient(service.address, timeout=120) as client:
                            removal["answer"] = client.remove_aggregator(victim)
                    except Exception as exc:  # noqa: BLE001 - printed with the round, which then fails
                        removal["error"] = exc

                thread = threading.Thread(target=remove, daemon=True)
                thread.start()
            outcome = {}
            for _ in jobs:
                job, durations, digest, starts = results.get(timeout=900)
                outcome[job] = {"durations": durations, "digest": digest, "starts": starts}
            for p in procs:
                p.join(60)
            if signal is not None:
                thread.join(150)
        moves = watch.span(after=removal["asked"]) if drained else None
    if "error" in removal:
        print(f"  removing {removal['victim']} failed: {removal['error']}", flush=True)
    return {"jobs": [outcome[j] for j in jobs], "moves": moves, "victim": removal.get("victim"),
            "victim_jobs": [jobs.index(j) for j in removal.get("jobs", [])]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--slos", default="0.1,0.15,0.2,0.25",
                        help="each job's SLO (the slowdown it accepts), comma-separated: one job each")
    parser.add_argument("--mbytes", type=int, default=16, help="parameters of each job, in MiB (4 MiB tensors)")
    parser.add_argument("--iterations", type=int, default=40)
    parser.add_argument("--at", type=int, default=20, help="job 0's iteration from which the drain may begin")
    parser.add_argument("--profile", type=int, default=6, help="iterations each job is profiled before its pack")
    parser.add_argument("--compute", type=float, default=0.3, help="seconds of simulated compute per iteration")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds of a drained and a still run")
    parser.add_argument("--quick", action="store_true", help="8 MiB jobs, 26 iterations, 1 round (a smoke run)")
    args = parser.parse_args(argv)
    if args.quick:
        args.mbytes, args.iterations, args.at, args.profile, args.rounds = 8, 26, 12, 4, 1
    try:
        slos = [float(x) for x in args.slos.split(",")]
    except ValueError:
        parser.error(f"--slos must be numbers separated by commas, got {args.slos!r}")
    if not slos or not all(0 < s < 1 for s in slos):
        parser.error(f"each SLO must be in (0, 1), got {args.slos!r}")
    if not 1 <= args.profile < args.at < args.iterations - 1:
        parser.error(f"need 1 <= --profile < --at < --iterations - 1, got {args.profile}, {args.at}, {args.iterations}")
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    keys = max(1, args.mbytes // 4)
    print(f"pslink drain benchmark on {platform.node()} ({os.cpu_count()} CPUs): {len(slos)} jobs of {keys * 4} MiB "
          f"+ momentum, 1 worker each, SLOs {', '.join(f'{s:.0%}' for s in slos)}, {args.compute * 1e3:.0f} ms "
          f"compute per iteration, {args.rounds} rounds of a drained and a still run (alternating)", flush=True)
    with tempfile.TemporaryDirectory(prefix="pslink-migration-drain-") as logs:
        def one(drained: bool, index: int) -> dict:
            return run(drained, index, args, keys, slos, os.path.join(logs, f"{index}-{int(drained)}"))

        pairs = alternate(args.rounds, one)
    rounds, ok = [], True
    for index, pair in enumerate(pairs):
        moved, still = pair[True], pair[False]
        if moved["moves"] is None:
            print(f"round {index + 1}: removing {moved['victim']} moved nothing (nothing to measure)", flush=True)
            ok = False
            continue
        per_job = []
        for j, slo in enumerate(slos):
            d, base = moved["jobs"][j]["durations"], still["jobs"][j]["durations"]
            window = Window.of(moved["jobs"][j]["starts"], moved["moves"], len(d))
            worst, noise = max(slowdowns(d, window)), max(slowdowns(base, window))
            per_job.append({"job": j, "slo": slo, "held_parts": j in moved["victim_jobs"],
                            "window": [window.start, window.end - 1],
                            "during_ms": [round(x * 1e3, 1) for x in d[window.start:window.end]],
                            "before_ms": round(median_before(d, window.start) * 1e3, 1),
                            "worst_slowdown": round(worst, 4), "still_worst_slowdown": round(noise, 4),
                            "slower_than_slo": worst > slo, "still_slower_than_slo": noise > slo,
                            "stall": max(d[window.start:window.end]) / median_before(d, window.start),
                            "still_stall": max(base[window.start:window.end]) / median_before(base, window.start)})
        m = moved["moves"]
        print(f"round {index + 1}: removed {moved['victim']} (parts of jobs {moved['victim_jobs']}); the drain's "
              f"{m.moves} move(s) took {m.seconds * 1e3:.0f} ms", flush=True)
        for r in per_job:
            print(f"  job {r['job']} (SLO {r['slo']:.0%}{', had parts there' if r['held_parts'] else ''}): before "
                  f"{r['before_ms']:.0f} ms, during {', '.join(f'{x:.0f}' for x in r['during_ms'])} ms (iterations "
                  f"{r['window'][0]}-{r['window'][1]}): worst {r['worst_slowdown']:+.1%} "
                  f"({'SLOWER than its SLO' if r['slower_than_slo'] else 'within its SLO'}); still run "
                  f"{r['still_worst_slowdown']:+.1%}", flush=True)
        rounds.append({"victim": moved["victim"], "victim_jobs": moved["victim_jobs"], "moves": m.moves,
                       "drain_ms": round(m.seconds * 1e3, 1), "jobs": per_job})
    digests_ok = all(len({pair[v]["jobs"][j]["digest"] for pair in pairs for v in (True, False)}) == 1
                     for j in range(len(slos)))
    violated = [r["job"] for rnd in rounds for r in rnd["jobs"] if r["slower_than_slo"]]
    still_violated = [r["job"] for rnd in rounds for r in rnd["jobs"] if r["still_slower_than_slo"]]
    print(f"issue 54's requirement, no job's iteration slower than its SLO during the drain: "
          f"{'met' if rounds and not violated else 'NOT met'} ({len(violated)} job-round(s) slower; the still runs: "
          f"{len(still_violated)})", flush=True)
    print(f"final weights bit-identical, each job drained or not: {'yes' if digests_ok else 'NO'}", flush=True)
    figs = []
    if rounds:
        worst = [max(r["stall"] for r in rnd["jobs"]) for rnd in rounds]
        still_worst = [max(r["still_stall"] for r in rnd["jobs"]) for rnd in rounds]
        figs.append(figures.measured(
            "migration_drain", f"drain of an Aggregator holding {len(slos)} jobs' parts: the worst job's longest "
            "iteration of the drain over its median before", "x median", "lower", worst,
            "the jobs not drained (same round, same iterations)", still_worst))
    for fig in figs:
        figures.emit(fig)
    print(json.dumps({"benchmark": "migration_drain", "host": platform.node(), "jobs": len(slos), "mbytes": keys * 4,
                      "compute_s": args.compute, "slos": slos, "rounds": rounds, "identical": digests_ok,
                      "met": bool(rounds) and not violated, "figures": [f.as_json() for f in figs]}))
    return 0 if ok and digests_ok else 1


if __name__ == "__main__":
    sys.exit(main())
