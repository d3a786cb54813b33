"""Four jobs on one shared Aggregator pool against the same four jobs on servers of their own (AutoPS 5.2.2).

Four 2-worker jobs, each of which would ask ps-lite for 2 parameter servers, train at once, in one
invocation, two ways:

- **pool**: one service; pMaster profiles each job alone on 2 Aggregators of its own, then packs
  the four onto as few Aggregators as keep each job within its slowdown limit (the AutoPS way);
- **dedicated** (the anchor, what AutoPS compares with): each job on a service of its own with 2
  Aggregators that nobody else uses and that are never packed (4 services, 8 Aggregators: a
  ps-lite deployment's 8 servers).

Each worker trains a numpy MLP on the CPU (forward and backward, real matrix products) standing in
for one of the shared data README's models (AlexNet, ResNet-50, VGG19, BERT-base), with a hundredth
of its parameters and compute in the order of the real models' (``pslink.bench.multijob.MODELS``),
and push-pulls its gradients every iteration (the service averages them, the worker steps). Every
worker holds an Agent on both services and a model replica for each; the variants take turns, the
four jobs together, the same number of iterations per job each time, in rounds (pool first on even
rounds, dedicated first on odd ones). Per phase:

- the CPU seconds (user + system) the servers' processes burned: every Aggregator of the variant
  (pMaster, off the data path, runs in this process for both variants and is not counted);
- the cores the servers reserve: the most Aggregator processes alive at once (a cluster gives each
  its core);
- each job's median iteration, read while all four jobs ran (its slowdown on the pool).

Figures: pool against dedicated for each (lower is better). The CPU reduction ratio AutoPS defines,
(servers - Aggregators) / servers, is printed from the measured cores; the paper's 25-75% is quoted
in words only. Both replicas' final weights must be bit-identical (same seeds, same batches).

The pool is packed once per invocation, from the iteration durations profiled then: its cores
vary over rounds only where pMaster's guard moved a job; another invocation may pack differently
(AutoPS's cyclic model lets jobs share an Aggregator only where their iteration durations are
close to whole multiples of each other).

On a small host (2 cores here) the 8 workers and the servers share the CPUs: an iteration takes
~50-500 ms instead of the compute alone (5-45 ms on an idle core), and both variants pay the same
contention. So the iteration figures show what sharing Aggregators costs a job here, not on a
cluster with cores of its own per server; the CPU seconds are the servers' work either way, and
the cores are what a cluster would reserve. Ends with one JSON line.

    python benchmarks/multijob.py            # 6 rounds of 18 s phases (~5 minutes)
    python benchmarks/multijob.py --quick    # 2 rounds of 4 s phases (under a minute)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import platform
import queue
import statistics
import sys
import tempfile
import time

from pslink.bench import figures
from pslink.bench.multijob import (
    DEDICATED,
    MODELS,
    POOL,
    SCALE,
    CpuMeter,
    common_window,
    durations_within,
    iteration_counts,
    median_ms,
    worker,
)

WORKERS = 2
SERVERS = 2  # each job's own, as it would ask ps-lite ("2s-2w" in the paper)
AGENT_TIMEOUT = 120.0  # seconds any one operation of a worker may wait
CHUNK_SECONDS = 3.0  # each warm-up run on the pool, between looks at pMaster's state
SETTLE_TIMEOUT = 300.0  # seconds the pool may take to profile and pack the four jobs


class Bench:
    """The services, the workers, and one phase at a time."""

    def __init__(self, logs: str, stack: contextlib.ExitStack):
        from pslink.core.service import Service

        self.jobs = {f"job-{name}": name for name in MODELS}
        self.begun = time.monotonic()
        self.pool = stack.enter_context(Service(aggregators=1, log_dir=os.path.join(logs, "pool")))
        # The job never leaves profiling there: it stays on the 2 Aggregators it got on arrival.
        self.own = {job: stack.enter_context(Service(aggregators=SERVERS, log_dir=os.path.join(logs, job),
                                                     control={"profile_iterations": 10**9}))
                    for job in self.jobs}
        self.meters = {POOL: CpuMeter(lambda: self._pids([self.pool])),
                       DEDICATED: CpuMeter(lambda: self._pids(list(self.own.values())))}
        context = mp.get_context("spawn")
        self.reports = context.Queue()
        self.commands = {}
        self.procs = []
        self.stopped = False
        stack.callback(self._reap)
        for index, (job, name) in enumerate(self.jobs.items()):
            addresses = {POOL: self.pool.address, DEDICATED: self.own[job].address}
            for rank in range(WORKERS):
                commands = self.commands[(job, rank)] = context.Queue()
                proc = context.Process(target=worker, args=(job, index, rank, name, addresses, commands, self.reports,
                                                            AGENT_TIMEOUT), daemon=True)
                proc.start()
                self.procs.append(proc)
        self._collect("ready", time.monotonic() + AGENT_TIMEOUT)
        self.speeds = {job: [] for job in self.jobs}  # for --png: (seconds, iterations per second)
        self.pool_sizes: list[tuple[float, int]] = []
        self.spans: list[tuple[float, float, str]] = []

    @staticmethod
    def _pids(services) -> list[int]:
        return [pid for s in services for name in s.provider.names() if (pid := s.provider.pid(name))]

    def _reap(self) -> None:
        if not self.stopped:
            for commands in self.commands.values():
                commands.put(("stop",))
        for proc in self.procs:
            proc.join(30)
            if proc.is_alive():
                proc.kill()
                proc.join(10)

    def _collect(self, kind: str, deadline: float, each=None) -> dict:
        """One ``kind`` report from every worker, by (job, rank); ``each()`` runs between looks."""
        got = {}
        while len(got) < len(self.commands):
            if time.monotonic() > deadline:
                missing = sorted(set(self.commands) - set(got))
                raise TimeoutError(f"no {kind!r} report from workers {missing} in time")
            try:
                what, job, rank, body = self.reports.get(timeout=0.25)
            except queue.Empty:
                what = None
            if what == "error":
                raise RuntimeError(f"worker {job} rank {rank} failed:\n{body}")
            if what == kind:
                got[(job, rank)] = body
            elif what is not None:
                raise RuntimeError(f"worker {job} rank {rank} sent {what!r} while {kind!r} was awaited")
            if each is not None:
                each()
            dead = [p.pid for p in self.procs if p.exitcode not in (None, 0)]
            if dead and what is None:  # nothing more will come from them; the queue was read dry
                raise RuntimeError(f"worker processes {dead} died while {kind!r} was awaited")
        return got

    def pool_size(self) -> int:
        return self.pool.master.state.control.aggregator_count()

    def run(self, variant: str, counts: dict[str, int], train: bool = True, seconds: float = CHUNK_SECONDS) -> dict:
        """Every job runs ``counts[job]`` iterations on ``variant``, the four together."""
        meter = self.meters[variant]
        sizes = []

        def look():
            meter.sample()
            sizes.append(self.pool_size())
            self.pool_sizes.append((time.monotonic() - self.begun, sizes[-1]))

        meter.start()
        start = time.monotonic()
        for (job, _), commands in self.commands.items():
            commands.put(("run", variant, counts[job], train))
        ran = self._collect("ran", start + 60 + 10 * seconds, look)
        look()
        end = time.monotonic()
        if variant == DEDICATED:
            self.spans.append((start - self.begun, end - self.begun, "dedicated"))
        spans = {}
        for (job, rank), (done_on, spans_of) in ran.items():
            assert done_on == variant, (job, rank, done_on, variant)
            if rank == 0:  # both ranks of a BSP job step together: rank 0's iterations are the job's
                spans[job] = spans_of
                self.speeds[job] += [(e - self.begun, 1.0 / (e - s)) for s, e in spans_of]
        window = common_window(spans)
        within = {job: durations_within(s, window) or [e - b for b, e in s] for job, s in spans.items()}
        return {"variant": variant, "cpu_seconds": meter.seconds, "cores": meter.most, "pool_size": max(sizes),
                "ms": {job: median_ms(d) for job, d in within.items()}, "read": {j: len(d) for j, d in within.items()},
                "all": {job: [e - s for s, e in sp] for job, sp in spans.items()}, "wall": end - start}

    def settled(self) -> bool:
        """Every job profiled and packed, and no task of theirs on the move."""
        control = self.pool.master.state.control
        return (all(j in control.jobs and control.jobs[j].phase != "profiling" for j in self.jobs)
                and self.pool.master.mover.core.idle())

    def placement(self) -> dict:
        for _ in range(5):  # pMaster's thread may change the dicts under the read
            try:
                return self.pool.master.state.control.describe()
            except RuntimeError:
                time.sleep(0.05)
        return {}

    def holders(self) -> dict[str, int]:
        """How many Aggregators hold each job's parts on its own service (2: both of its servers)."""
        out = {}
        for job, service in self.own.items():
            record = service.master.state.jobs[job]
            out[job] = len({part.aggregator for key in record.keys.values() for part in key.parts})
        return out

    def finish(self) -> dict:
        self.stopped = True
        for commands in self.commands.values():
            commands.put(("stop",))
        done = self._collect("done", time.monotonic() + AGENT_TIMEOUT)
        for proc in self.procs:
            proc.join(30)
        return done


def warm_up(bench: Bench, seconds: float, quick: bool) -> dict[str, int]:
    """Both variants' first iterations (connections, first placements) off the record; then the
    pool until pMaster has profiled and packed every job. Returns each job's iterations per
    phase, sized from the packed pool's pace."""
    probe = dict.fromkeys(bench.jobs, 3)
    bench.run(DEDICATED, probe, train=False)
    last = bench.run(POOL, probe, train=False)
    deadline = time.monotonic() + SETTLE_TIMEOUT
    while not bench.settled():
        if time.monotonic() > deadline:
            raise TimeoutError(f"the pool did not profile and pack the jobs in {SETTLE_TIMEOUT:.0f} s: "
                               f"{json.dumps(bench.placement(), default=str)[:2000]}")
        counts = iteration_counts({j: statistics.median(d) for j, d in last["all"].items()}, CHUNK_SECONDS, 3)
        last = bench.run(POOL, counts, train=False, seconds=CHUNK_SECONDS)
    print(f"pool settled after {time.monotonic() - bench.begun:.0f} s: {bench.pool_size()} Aggregators", flush=True)
    # One more on the packed pool: its pace sizes the phases (and the first report after the
    # moves, which the guard does not judge, is behind).
    counts = iteration_counts({j: statistics.median(d) for j, d in last["all"].items()}, CHUNK_SECONDS, 3)
    last = bench.run(POOL, counts, train=False, seconds=CHUNK_SECONDS)
    return iteration_counts({j: statistics.median(d) for j, d in last["all"].items()}, seconds, 4 if quick else 6)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=6, help="rounds of a pool and a dedicated phase")
    parser.add_argument("--seconds", type=float, default=18.0, help="about how long each phase runs")
    parser.add_argument("--quick", action="store_true", help="2 rounds of 4 s phases (a smoke run)")
    parser.add_argument("--png", help="also draw each job's speed and the pool's Aggregators over the run here")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.seconds = 2, 4.0
    if args.rounds < 1 or args.seconds <= 0:
        parser.error(f"--rounds must be at least 1 and --seconds positive, got {args.rounds} and {args.seconds}")
    # One BLAS thread per process: 8 workers already fill the cores, and a job's compute must not
    # depend on how many threads BLAS picked (spawned workers and Aggregators inherit this).
    for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[name] = "1"
    requested = SERVERS * len(MODELS)
    print(f"pslink multi-job benchmark on {platform.node()} ({os.cpu_count()} CPUs): {len(MODELS)} jobs x "
          f"{WORKERS} workers (numpy MLPs: {', '.join(f'{n} {m.parameters * 4 / 1e6:.1f} MB' for n, m in MODELS.items())}"
          f"; 1/{SCALE} of the real models' parameters), pool vs {requested} dedicated Aggregators, "
          f"{args.rounds} rounds", flush=True)
    phases = {POOL: [], DEDICATED: []}
    with tempfile.TemporaryDirectory(prefix="pslink-multijob-") as logs, contextlib.ExitStack() as stack:
        bench = Bench(logs, stack)
        counts = warm_up(bench, args.seconds, args.quick)
        print(f"each phase: {', '.join(f'{job} {n}' for job, n in counts.items())} iterations", flush=True)
        for index in range(args.rounds):
            for variant in (POOL, DEDICATED) if index % 2 == 0 else (DEDICATED, POOL):
                result = bench.run(variant, counts, seconds=args.seconds)
                phases[variant].append(result)
                print(f"round {index + 1} {variant:9s}: servers {result['cpu_seconds']:.2f} CPU s on "
                      f"{result['cores']} processes in {result['wall']:.1f} s; "
                      + ", ".join(f"{job} {ms:.0f} ms" for job, ms in result["ms"].items()), flush=True)
        placement, holders = bench.placement(), bench.holders()
        done = bench.finish()
    pool, own = phases[POOL], phases[DEDICATED]
    anchor = f"{len(MODELS)} jobs x {SERVERS} dedicated Aggregators"
    figs = [
        figures.measured("multijob", f"{len(MODELS)} jobs: servers' CPU seconds per phase (same iterations)", "CPU s",
                         "lower", [p["cpu_seconds"] for p in pool], anchor, [p["cpu_seconds"] for p in own]),
        figures.measured("multijob", f"{len(MODELS)} jobs: server cores reserved (Aggregator processes)", "cores",
                         "lower",
                         [p["cores"] for p in pool], anchor, [p["cores"] for p in own]),
    ]
    for job in bench.jobs:
        figs.append(figures.measured("multijob", f"{job} iteration, {len(MODELS)} jobs running", "ms", "lower",
                                     [p["ms"][job] for p in pool], f"{job} on {SERVERS} dedicated Aggregators",
                                     [p["ms"][job] for p in own]))
    for fig in figs:
        figures.emit(fig)
    cores = figs[1]
    reduction = 1.0 - cores.ratio
    print(f"CPU reduction ratio as AutoPS defines it, (servers - Aggregators) / servers: {reduction:.0%} "
          f"({cores.anchor_value:.0f} dedicated servers, {cores.value:.0f} pool Aggregators, medians over rounds)")
    print("AutoPS reported a 25-75% reduction with up to 9% speed lost (RDMA testbed, MXNet 2s-2w jobs, "
          "paper 5.2.2): quoted, not measured here; no ratio is taken against it.")
    rows = []
    for job, fig in zip(bench.jobs, figs[2:]):
        rows.append({"job": job, "dedicated_ms": round(fig.anchor_value, 1), "pool_ms": round(fig.value, 1),
                     "slowdown": round(fig.ratio - 1.0, 4), "loss": round(1.0 - 1.0 / fig.ratio, 4),
                     "iterations": counts[job]})
    shared = {name: sorted(agg["jobs"]) for cluster in (placement.get("clusters") or {}).values()
              for name, agg in cluster.items()}
    print("the pool at the end: " + "; ".join(f"{name} serves {', '.join(jobs) or 'nobody'}"
                                              for name, jobs in sorted(shared.items())))
    print("each job's slowdown on the pool: " + ", ".join(f"{r['job']} {r['slowdown']:+.1%}" for r in rows))
    digests = {}
    for (job, rank), body in done.items():
        for variant, (trained, digest) in body.items():
            digests.setdefault(job, set()).add((trained, digest))
    identical = all(len(d) == 1 for d in digests.values())
    print("dedicated servers holding each job's parts: " + ", ".join(f"{j} {n}" for j, n in holders.items()))
    print(f"final weights bit-identical between pool and dedicated (and between ranks): {'yes' if identical else 'NO'}")
    if args.png:
        from pslink.bench.pictures import timeline_png

        picture = timeline_png(args.png, f"{len(MODELS)} jobs: pool and dedicated phases (shaded), pool's Aggregators",
                               bench.speeds, bench.pool_sizes, bench.spans)
        print(f"timeline: {picture}")
    print(json.dumps({"benchmark": "multijob", "host": platform.node(), "jobs": rows, "requested": requested,
                      "aggregators": cores.value, "reduction": round(reduction, 4),
                      "worst_loss": max(r["loss"] for r in rows),
                      "cpu_seconds": {POOL: [p["cpu_seconds"] for p in pool], DEDICATED: [p["cpu_seconds"] for p in own]},
                      "weights_identical": identical, "placement": placement.get("clusters"),
                      "dedicated_holders": holders,
                      "figures": [f.as_json() for f in figs]}, default=str))
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
