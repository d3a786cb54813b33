"""What seeing the service costs: metrics and the stall inspector on vs off, and the timeline.

    python benchmarks/visibility.py            # the measured run (a few minutes)
    python benchmarks/visibility.py --quick    # a smoke run

Two services run side by side for the whole run, so the host carries both alike: "off" (no HTTP
endpoint, PSLINK_STALL_SECONDS=0 for its Aggregators) and "on" (metrics on, scraped every second
by a thread here: 15 times Prometheus' default rate; the stall inspector at its default 10 s).
Measured, alternating off / on / timeline (each round starting with the next), each a fresh set of
worker processes:

- pushpull latency of 4 KiB, one worker, one request in flight (the per-message cost);
- the DDP step of benchmarks/torch_ddp.py (2 workers, the pslink hook) against each service, and
  against "off" with PSLINK_TIMELINE writing every step of both ranks (the timeline's worst case).

Reported: medians and the ratios on / off and timeline / off (targets: within noise, and the
timeline under 5%), with each round's own ratio to show the spread. Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import threading
import time
import urllib.request

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def _latency_worker(master: str, job: str, seconds: float, results) -> None:
    import pslink

    with pslink.connect(job, 0, 1, master=master, timeout=60) as agent:
        value, out = np.ones(1024, np.float32), np.empty(1024, np.float32)
        agent.init("k", value).wait()
        for _ in range(200):  # warm up
            agent.pushpull("k", value, out=out).wait()
        count, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            for _ in range(100):
                agent.pushpull("k", value, out=out).wait()
            count += 100
        results.put((time.perf_counter() - start) / count)


def latency(master: str, job: str, seconds: float) -> float:
    context = mp.get_context("spawn")
    results = context.Queue()
    proc = context.Process(target=_latency_worker, args=(master, job, seconds, results))
    proc.start()
    try:
        return results.get(timeout=120 + seconds)
    finally:
        proc.join(30)


def scraper(http: str, stop: threading.Event, scrapes: list) -> None:
    while not stop.wait(1.0):
        with urllib.request.urlopen(f"{http}/metrics", timeout=10) as answer:
            scrapes.append(len(answer.read()))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: 2 rounds, short runs, a small model")
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds of every variant")
    parser.add_argument("--seconds", type=float, default=3.0, help="seconds of each latency run")
    parser.add_argument("--hidden", type=int, default=2048, help="DDP model width (benchmarks/torch_ddp.py's H)")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.seconds, args.hidden, args.steps = 2, 1.0, 512, 5

    from pslink.core.service import Service

    import importlib.util

    import torch_ddp as ddp_bench  # benchmarks/torch_ddp.py: its DDP worker and launcher

    torch_ddp = ddp_bench if importlib.util.find_spec("torch") is not None else None
    ddp_args = argparse.Namespace(hidden=args.hidden, batch_size=32, steps=args.steps, warmup=3, quick=args.quick)

    os.environ["PSLINK_STALL_SECONDS"] = "0"  # the "off" service's Aggregators inherit it
    off = Service(aggregators=2).start()
    os.environ["PSLINK_STALL_SECONDS"] = "10"
    on = Service(aggregators=2, master_options={"metrics_port": 0}).start()
    os.environ.pop("PSLINK_STALL_SECONDS")
    stop, scrapes = threading.Event(), []
    thread = threading.Thread(target=scraper, args=(on.master.observing.http_address, stop, scrapes), daemon=True)
    thread.start()
    lat = {"off": [], "on": []}
    step = {"off": [], "on": [], "timeline": []}
    timeline_bytes = []
    try:
        for index in range(args.rounds):
            # Each round starts with another variant: a fixed order would charge one with the drift.
            for name, service in (("off", off), ("on", on))[::1 if index % 2 == 0 else -1]:
                lat[name].append(latency(service.address, f"lat-{name}-{index}", args.seconds))
            if torch_ddp is None:
                continue
            with tempfile.TemporaryDirectory(prefix="pslink-vis-") as scratch:
                order = ("off", "on", "timeline")
                for name in order[index % 3:] + order[:index % 3]:
                    service = on if name == "on" else off
                    if name == "timeline":
                        os.environ["PSLINK_TIMELINE"] = os.path.join(scratch, "trace.json")
                    try:
                        results = torch_ddp.run_variant("pslink", ddp_args, service.address, f"{name}{index}")
                    finally:
                        os.environ.pop("PSLINK_TIMELINE", None)
                    step[name].append(statistics.mean(statistics.median(r["times"]) for r in results))
                timeline_bytes.append(sum(os.path.getsize(os.path.join(scratch, f)) for f in os.listdir(scratch)
                                          if f.startswith("trace")))
            print(f"round {index + 1}/{args.rounds}: 4K pushpull off {lat['off'][-1] * 1e6:.1f} us, on "
                  f"{lat['on'][-1] * 1e6:.1f} us" + (
                      f"; DDP step off {step['off'][-1] * 1e3:.1f} ms, on {step['on'][-1] * 1e3:.1f} ms, timeline "
                      f"{step['timeline'][-1] * 1e3:.1f} ms" if step["off"] else ""), flush=True)
    finally:
        stop.set()
        thread.join(5)
        on.stop()
        off.stop()

    def ratio(a, b):
        return statistics.median(a) / statistics.median(b)

    figures = {"benchmark": "visibility", "rounds": args.rounds, "scrapes": len(scrapes),
               "metrics_bytes": scrapes[-1] if scrapes else 0,
               "latency_us": {k: round(statistics.median(v) * 1e6, 2) for k, v in lat.items()},
               "latency_on_over_off": round(ratio(lat["on"], lat["off"]), 4),
               "latency_pairs": [round(a / b, 3) for a, b in zip(lat["on"], lat["off"])]}
    print(f"\n4 KiB pushpull latency: off {figures['latency_us']['off']} us, on {figures['latency_us']['on']} us: "
          f"on / off {figures['latency_on_over_off']:.3f} (rounds: {figures['latency_pairs']}); "
          f"{len(scrapes)} scrapes of {figures['metrics_bytes']} bytes")
    if step["off"]:
        figures.update({
            "ddp_hidden": args.hidden, "ddp_step_ms": {k: round(statistics.median(v) * 1e3, 2) for k, v in step.items()},
            "ddp_on_over_off": round(ratio(step["on"], step["off"]), 4),
            "ddp_timeline_over_off": round(ratio(step["timeline"], step["off"]), 4),
            "ddp_on_pairs": [round(a / b, 3) for a, b in zip(step["on"], step["off"])],
            "ddp_timeline_pairs": [round(a / b, 3) for a, b in zip(step["timeline"], step["off"])],
            "timeline_bytes_per_run": int(statistics.median(timeline_bytes)),
        })
        print(f"DDP step: off {figures['ddp_step_ms']['off']} ms, on {figures['ddp_step_ms']['on']} ms "
              f"(on / off {figures['ddp_on_over_off']:.3f}, rounds {figures['ddp_on_pairs']}), timeline "
              f"{figures['ddp_step_ms']['timeline']} ms (timeline / off {figures['ddp_timeline_over_off']:.3f}, "
              f"target < 1.05; rounds {figures['ddp_timeline_pairs']}); a timeline of every step of both ranks: "
              f"{figures['timeline_bytes_per_run'] / 1e3:.0f} KB per run")
    else:
        print("DDP: skipped (torch is not installed)")
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
