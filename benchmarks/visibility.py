"""What seeing the service costs: metrics and the stall inspector on vs off, and the timeline.

    python benchmarks/visibility.py            # the measured run (a few minutes)
    python benchmarks/visibility.py --quick    # a smoke run: 2 rounds, a small model (under a minute)

Two services run side by side for the whole run, so the host carries both alike: "off" (no HTTP
endpoint, PSLINK_STALL_SECONDS=0 for its Aggregators) and "on" (metrics on, scraped every second
by a thread here: 15 times Prometheus' default rate; the stall inspector at its default 10 s).
Measured, alternating off / on / timeline (each round starting with the next), each a fresh set of
worker processes:

- pushpull latency of 4 KiB, one worker, one request in flight (the per-message cost);
- the DDP step of benchmarks/torch_ddp.py (2 workers, the pslink hook) against each service, and
  against "off" with PSLINK_TIMELINE writing every step of both ranks (the timeline's worst case).

Figures (lower is better): the latency on against off, the DDP step on against off (not in the
quick form), and the DDP step with the timeline against off, each paired round by round. Issue 21's requirement (the
timeline under 5%) is printed as a check on the measured figure. Ends with one JSON line.
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

from pslink.bench import figures

TIMELINE_REQUIRED = 0.05  # issue 21's requirement: the timeline costs a DDP step under 5%, printed as a check


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
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: 2 rounds, short runs, a small model, no DDP step on the 'on' service")
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds of every variant")
    parser.add_argument("--seconds", type=float, default=3.0, help="seconds of each latency run")
    parser.add_argument("--hidden", type=int, default=2048, help="DDP model width (benchmarks/torch_ddp.py's H)")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.seconds, args.hidden, args.steps = 2, 1.0, 512, 5

    import importlib.util

    import torch_ddp as ddp_bench  # benchmarks/torch_ddp.py: its DDP worker and launcher

    from pslink.core.service import Service

    torch_ddp = ddp_bench if importlib.util.find_spec("torch") is not None else None
    ddp_args = argparse.Namespace(hidden=args.hidden, batch_size=32, steps=args.steps, warmup=2 if args.quick else 3,
                                  quick=args.quick, bucket_view=False)

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
                # The quick form leaves out the DDP step on "on" (the latency figure covers that service):
                # each DDP run starts two torch processes, and three a round took a minute on 2 cores.
                order = ("off", "timeline") if args.quick else ("off", "on", "timeline")
                for name in order[index % len(order):] + order[:index % len(order)]:
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
                      "; DDP step " + ", ".join(f"{name} {times[-1] * 1e3:.1f} ms" for name, times in step.items()
                                                 if times) if step["off"] else ""), flush=True)
    finally:
        stop.set()
        thread.join(5)
        on.stop()
        off.stop()

    def ms(xs):
        return [x * 1e3 for x in xs]

    figs = [figures.measured("visibility", "4 KiB pushpull latency, 1 worker, metrics scraped every second and the "
                             "stall inspector on", "us", "lower", [x * 1e6 for x in lat["on"]],
                             "the same, both off (the other service of this run)", [x * 1e6 for x in lat["off"]])]
    if step["off"]:
        what = f"DDP step, benchmarks/torch_ddp.py's MLP (H={args.hidden}), 2 workers, the pslink hook"
        if step["on"]:
            figs.append(figures.measured("visibility", f"{what}, metrics scraped every second and the stall inspector "
                                         "on", "ms", "lower", ms(step["on"]), "the same, both off", ms(step["off"])))
        figs.append(figures.measured("visibility", f"{what}, PSLINK_TIMELINE writing every step of both ranks", "ms",
                                     "lower", ms(step["timeline"]), "the same, no timeline", ms(step["off"])))
    print()
    for fig in figs:
        figures.emit(fig)
    lat_fig = figs[0]
    summary = {"benchmark": "visibility", "rounds": args.rounds, "scrapes": len(scrapes),
               "metrics_bytes": scrapes[-1] if scrapes else 0,
               "latency_us": {k: round(statistics.median(v) * 1e6, 2) for k, v in lat.items()},
               "latency_on_over_off": round(lat_fig.ratio, 4),
               "latency_pairs": [round(a / b, 3) for a, b in zip(lat_fig.values, lat_fig.anchor_values)]}
    print(f"{len(scrapes)} scrapes of {summary['metrics_bytes']} bytes")
    if step["off"]:
        timeline_fig = figs[-1]
        summary.update({
            "ddp_hidden": args.hidden,
            "ddp_step_ms": {k: round(statistics.median(v) * 1e3, 2) for k, v in step.items() if v},
            "ddp_timeline_over_off": round(timeline_fig.ratio, 4),
            "ddp_timeline_pairs": [round(a / b, 3) for a, b in zip(timeline_fig.values, timeline_fig.anchor_values)],
            "timeline_bytes_per_run": int(statistics.median(timeline_bytes)),
        })
        if step["on"]:
            on_fig = figs[1]
            summary.update({"ddp_on_over_off": round(on_fig.ratio, 4),
                            "ddp_on_pairs": [round(a / b, 3) for a, b in zip(on_fig.values, on_fig.anchor_values)]})
        # Issue 21's requirement, checked on the measured figure (the limit is no anchor).
        print(f"issue 21's requirement, the timeline within {TIMELINE_REQUIRED:.0%} of the DDP step: "
              f"{'met' if timeline_fig.ratio < 1 + TIMELINE_REQUIRED else 'not met'}; a timeline of every step of both "
              f"ranks: {summary['timeline_bytes_per_run'] / 1e3:.0f} KB per run")
    else:
        print("DDP: skipped (torch is not installed)")
    summary["figures"] = [fig.as_json() for fig in figs]
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
