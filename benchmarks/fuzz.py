"""Hostile input while a job trains: what 100,000 malformed frames, ring attacks and connection churn
cost the service and a job beside them.

``pslink service up --aggregators 2`` runs in a subprocess (its log to a file). A 1-worker job
(a spawned process) push-pulls 4 tensors of 256 KiB every iteration after 20 ms of "compute" (a
sleep) and checks every answer exactly (one worker in sum mode: the answer is what it pushed). It
runs ``--calm`` iterations undisturbed, then this process attacks pMaster and both Aggregators
(``pslink.bench.hostile``): ``--frames`` malformed frames in all (garbage, truncated and huge
declared sizes, bad headers, forged tokens and fields), ``--rings`` shrunk and lying rings (and
one well-made) on each listener's local socket, and ``--churn`` connect-and-close cycles per listener,
while the job goes on. Reported: every process alive, the job's worst iteration under attack
against its calm median (target: at most 100 ms more), RSS growth per process (target < 50 MB),
log bytes written, and whether every answer was exact. Ends with one JSON line.

    python benchmarks/fuzz.py            # 100,000 frames
    python benchmarks/fuzz.py --quick    # 5,000 frames, a smoke run
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import psutil

TENSOR = 1 << 16  # float32 elements: 256 KiB
KEYS = 4
COMPUTE = 0.02
TARGET_DELAY_MS = 100
TARGET_RSS_MB = 50


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _job(master: str, calm: int, attacked, results) -> None:
    import numpy as np

    import pslink

    durations, exact, it = [], True, 0
    with pslink.connect("fuzz-job", 0, 1, master=master, timeout=60) as agent:
        agent.init_many(range(KEYS), [np.zeros(TENSOR, np.float32) for _ in range(KEYS)]).wait()
        bank = [np.random.default_rng(b).standard_normal(TENSOR).astype(np.float32) for b in range(7)]
        outs = [np.empty(TENSOR, np.float32) for _ in range(KEYS)]
        while it < calm or not attacked.is_set() or len(durations) < calm + 10:
            if it == calm:
                results.put(("calm", None))  # the driver attacks from here
            grads = [bank[(it + k) % 7] for k in range(KEYS)]
            start = time.perf_counter()
            time.sleep(COMPUTE)
            agent.pushpull_many(range(KEYS), grads, outs=outs).wait()
            durations.append(time.perf_counter() - start)
            exact = exact and all(np.array_equal(o, g) for o, g in zip(outs, grads))
            it += 1
            if it > 100_000:
                break
    results.put(("done", (durations, exact)))


def _processes(service: subprocess.Popen) -> dict[str, psutil.Process]:
    procs = {"pmaster": psutil.Process(service.pid)}
    for child in procs["pmaster"].children(recursive=True):
        procs[f"aggregator pid {child.pid}"] = child
    return procs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--frames", type=int, default=100_000)
    parser.add_argument("--rings", type=int, default=100, help="ring attacks of each kind per listener")
    parser.add_argument("--churn", type=int, default=10_000, help="connect-and-close cycles per listener")
    parser.add_argument("--calm", type=int, default=60, help="iterations before the attack")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.frames, args.rings, args.churn, args.calm = 5_000, 5, 1_000, 20
    from pslink.bench import hostile
    from pslink.core.service.client import ControlClient

    port = _free_port()
    master = f"tcp://127.0.0.1:{port}"
    work = tempfile.mkdtemp(prefix="pslink-fuzz-")
    log_path = os.path.join(work, "service.log")
    log = open(log_path, "wb")
    service = subprocess.Popen([sys.executable, "-m", "pslink.cli", "service", "up", "--port", str(port),
                                "--aggregators", "2", "--state", os.path.join(work, "state")],
                               stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    context = mp.get_context("spawn")
    attacked, results = context.Event(), context.Queue()
    job = None
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with ControlClient(master, timeout=2) as client:
                    status = client.status()
                if len([a for a in status["aggregators"] if a["alive"]]) == 2:
                    break
            except Exception:
                pass
            if time.monotonic() > deadline or service.poll() is not None:
                raise RuntimeError(f"the service did not come up; see {log_path}")
            time.sleep(0.1)
        listeners = {"pmaster": master, **{a["name"]: a["address"] for a in status["aggregators"]}}
        procs = _processes(service)
        job = context.Process(target=_job, args=(master, args.calm, attacked, results))
        job.start()
        kind, _ = results.get(timeout=300)
        assert kind == "calm"
        rss_before = {name: p.memory_info().rss for name, p in procs.items()}
        log_before = os.path.getsize(log_path)
        started = time.monotonic()
        per_listener = args.frames // len(listeners)
        ring_outcomes: dict[str, int] = {}
        for seed, (name, address) in enumerate(listeners.items()):
            hostile.send_frames(address, hostile.frames(seed, per_listener))
            # Shrunk and lying rings (refused), and once a well-made one (kept: served as pslink's own).
            for mode in [{}, {"lie": True}] * args.rings + [{"seal": True}]:
                outcome = hostile.shrunk_ring(address, timeout=1.0, **mode)
                label = f"{'/'.join(mode) or 'shrunk'}: {outcome}"
                ring_outcomes[label] = ring_outcomes.get(label, 0) + 1
            hostile.churn(address, args.churn)
        attack_s = time.monotonic() - started
        rss_peak = {name: p.memory_info().rss for name, p in procs.items()}  # connections may still be closing
        attacked.set()
        kind, (durations, exact) = results.get(timeout=300)
        job.join(30)
        time.sleep(1.0)  # the listeners close what the churn left open
        rss_after = {name: p.memory_info().rss for name, p in procs.items()}
        alive = {name: p.is_running() and p.status() != psutil.STATUS_ZOMBIE for name, p in procs.items()}
        log_bytes = os.path.getsize(log_path) - log_before
    finally:
        if job is not None and job.is_alive():
            job.kill()
        service.terminate()
        try:
            service.wait(30)
        except subprocess.TimeoutExpired:
            service.kill()
            service.wait(10)
        log.close()
    calm_ms = [d * 1e3 for d in durations[: args.calm]]
    attack_ms = [d * 1e3 for d in durations[args.calm:]]
    median = statistics.median(calm_ms)
    worst = max(attack_ms)
    grown = {name: round((rss_after[name] - rss_before[name]) / 2**20, 1) for name in rss_before}
    peak = {name: round((rss_peak[name] - rss_before[name]) / 2**20, 1) for name in rss_before}
    print(f"attack: {args.frames} frames, {args.rings} x 3 ring attacks and {args.churn} connections per listener "
          f"({len(listeners)} listeners) in {attack_s:.1f} s; ring outcomes {ring_outcomes}")
    print(f"processes alive: {all(alive.values())} ({alive})")
    print(f"job: calm median {median:.1f} ms (max {max(calm_ms):.1f}), under attack median "
          f"{statistics.median(attack_ms):.1f} ms, worst {worst:.1f} ms = calm median + {worst - median:.1f} ms "
          f"(target <= +{TARGET_DELAY_MS} ms: {'met' if worst - median <= TARGET_DELAY_MS else 'NOT met'})")
    print(f"RSS growth MB: {grown} (target < {TARGET_RSS_MB}: "
          f"{'met' if all(v < TARGET_RSS_MB for v in grown.values()) else 'NOT met'}); right after the attack {peak}")
    print(f"log bytes written during the attack: {log_bytes}; every answer exact: {exact}")
    print(json.dumps({"benchmark": "fuzz", "frames": args.frames, "rings": args.rings, "churn": args.churn,
                      "attack_s": round(attack_s, 1), "alive": all(alive.values()), "calm_median_ms": round(median, 1),
                      "calm_max_ms": round(max(calm_ms), 1), "attack_median_ms": round(statistics.median(attack_ms), 1),
                      "attack_worst_ms": round(worst, 1), "delay_ms": round(worst - median, 1),
                      "rss_growth_mb": grown, "rss_growth_right_after_mb": peak, "log_bytes": log_bytes, "exact": exact,
                      "ring_outcomes": ring_outcomes}))
    return 0 if all(alive.values()) and exact else 1


if __name__ == "__main__":
    sys.exit(main())
