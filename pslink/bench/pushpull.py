"""Push, pull and pushpull throughput and latency, against raw loopback TCP measured in the same run.

One Aggregator process, worker processes with one Agent each. Every case runs a warm-up, then an
equal number of operations on every worker (BSP rounds must match), sized to take ``--seconds``.
Throughput is value bytes per second seen by one worker (what a training job experiences), as
ps-lite's benchmark reports it; latency is time per operation with one request in flight.

With 2 workers, pushpull runs as one 2-worker job (every round sums both workers); push and pull
run as two 1-worker jobs side by side (two clients loading one Aggregator), because a push-only
loop in one BSP job would let the faster worker run rounds ahead without bound.

The anchor is raw loopback TCP between two processes (:mod:`pslink.bench.raw`, no pslink code):
one socket stream's MB/s for throughput, a blocking ping-pong of the same size for latency (sizes
under 1 MiB with 1 in flight). It is measured once per pass (every case with one worker count),
before the pass on even rounds and after it on odd ones, the worker counts' order reversed on odd
rounds too; each figure pairs a case's value with its pass's raw figure, round by round. The C++
ps-lite comparison is ``benchmarks/pslite_bench.py --pslite PATH``.

``--many-keys``: 500 tensors of 1-64 KiB per step, a training step against DDP over gloo (see
:mod:`pslink.bench.many_keys`).

The last line printed is JSON with every case (medians over the rounds) and every figure.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import time

import numpy as np

from pslink.bench import figures, raw

RAW_STREAM = "raw loopback TCP stream (Python sockets, 2 processes)"
RAW_PING = "raw loopback TCP ping-pong of the same size"
PING_MAX = 1 << 20  # latency figures (and raw ping-pongs) for sizes below this, 1 in flight
UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text: str) -> int:
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    if text and text[-1] in UNITS:
        return int(float(text[:-1]) * UNITS[text[-1]])
    return int(text)


def size_label(size: int) -> str:
    for unit, scale in (("M", 1 << 20), ("K", 1 << 10)):
        if size >= scale and size % scale == 0:
            return f"{size // scale}{unit}"
    return str(size)


# -- pslink cases --------------------------------------------------------------------------------------


def run_ops(agent, op: str, keys, arrays, outs, inflight: int, count: int) -> float:
    """``count`` operations with ``inflight`` of them outstanding, key j carrying every j-th one;
    returns the seconds they took."""
    from collections import deque

    handles: deque = deque()
    start = time.perf_counter()
    for i in range(count):
        if len(handles) >= inflight:
            handles.popleft().wait()
        j = i % inflight
        if op == "push":
            handles.append(agent.push(keys[j], arrays[j]))
        elif op == "pull":
            handles.append(agent.pull(keys[j], out=outs[j]))
        else:
            handles.append(agent.pushpull(keys[j], arrays[j], out=outs[j]))
    while handles:
        handles.popleft().wait()
    return time.perf_counter() - start


def _worker(master: str, rank: int, workers: int, plan: list, seconds: float, partition: int,
            barrier, counts, results) -> None:
    from pslink.core.worker.connect import connect

    for case_id, (op, size, inflight) in enumerate(plan):
        # Each case is a job of its own, ended before the next: through one job, pMaster would
        # profile the first case and read a later case's longer rounds as interference, and its
        # guard would move the job in the middle of the run (a 256 KiB case measured at a tenth of
        # its speed; benchmarks/pslite_bench.py found the same).
        if op == "pushpull":
            job, job_rank, job_size = f"bench-pushpull-{workers}w-{case_id}", rank, workers
        else:
            job, job_rank, job_size = f"bench-{op}-{workers}w-{rank}-{case_id}", 0, 1
        agent = connect(job, job_rank, job_size, master=master, partition_bytes=partition, timeout=120.0)
        try:
            keys = [f"{op}-{size}-{inflight}-{i}" for i in range(inflight)]
            rng = np.random.default_rng(rank)
            arrays = [rng.standard_normal(size // 4).astype(np.float32) for _ in keys]
            outs = [np.empty_like(a) for a in arrays]
            agent.init_many(keys, arrays).wait()
            # Warm up (connections, buffer pools, page faults), then size the timed run on rank 0.
            warm = run_ops(agent, op, keys, arrays, outs, inflight, 3 * inflight)
            if rank == 0:
                per_op = warm / (3 * inflight)
                extra = max(0, int(0.3 / per_op) - 3 * inflight)
                counts[case_id] = max(5 * inflight, int(seconds / per_op))
                counts[len(plan) + case_id] = extra
            barrier.wait()
            run_ops(agent, op, keys, arrays, outs, inflight, counts[len(plan) + case_id])
            barrier.wait()
            count = counts[case_id]
            elapsed = run_ops(agent, op, keys, arrays, outs, inflight, count)
            results.put((case_id, rank, count, elapsed))
            barrier.wait()
        finally:
            agent.close()


def run_pslink(plan: list, workers: int, seconds: float, partition: int, transport: str, progress=None) -> dict:
    """Run every case of ``plan`` with ``workers`` processes; ``progress(case)`` after each."""
    from pslink.core.service import Service

    listen = "tcp://127.0.0.1:0" if transport == "tcp" else "zmq+tcp://127.0.0.1:0"
    context = mp.get_context("spawn")
    barrier = context.Barrier(workers, timeout=600)
    counts = context.Array("l", 2 * len(plan))
    results = context.Queue()
    with Service(listen, aggregators=1) as service:
        procs = [
            context.Process(target=_worker, args=(service.address, rank, workers, plan, seconds, partition,
                                                   barrier, counts, results))
            for rank in range(workers)
        ]
        for p in procs:
            p.start()
        measured: dict = {}
        for _ in range(len(plan) * workers):
            case_id, _rank, count, elapsed = results.get(timeout=900)
            measured.setdefault(case_id, []).append((count, elapsed))
            if progress is not None and len(measured[case_id]) == workers:
                progress(plan[case_id])
        for p in procs:
            p.join(60)
        if any(p.exitcode != 0 for p in procs):
            raise RuntimeError(f"benchmark workers failed: exit codes {[p.exitcode for p in procs]}")
    return measured


def measure_raw(sizes: list[int], seconds: float) -> dict:
    """The anchor, once: one stream's MB/s, and a ping-pong's microseconds per size below PING_MAX."""
    out = {"stream": raw.tcp_stream(seconds)}
    for size in sizes:
        if size < PING_MAX:
            trips = 2000 if size <= 64 << 10 else 300
            out[size] = statistics.median(raw.socket_round_trips(size, trips)) * 1e6
    return out


def case_figures(plan: list, worker_counts: list, rounds: list) -> tuple[dict, dict]:
    """Figures per case: throughput against the raw stream, and latency (1 in flight, sizes below
    PING_MAX) against the raw ping-pong, each paired with its own pass's raw figure; and every
    case's median latency. ``rounds`` is a list of ``{workers: (measured, raw or None)}``."""
    figs, latency = {}, {}
    no_raw = "raw loopback TCP not run (--no-raw)"
    for workers in worker_counts:
        for case_id, (op, size, inflight) in enumerate(plan):
            mbps, lat, stream, ping = [], [], [], []
            for done in rounds:
                measured, anchor = done[workers]
                per_worker = measured[case_id]
                mbps.append(float(np.mean([count * size / elapsed / 1e6 for count, elapsed in per_worker])))
                lat.append(float(np.mean([elapsed / count * 1e6 for count, elapsed in per_worker])))
                if anchor is not None:
                    stream.append(anchor["stream"])
                    ping.append(anchor.get(size))
            what = f"{op} {size_label(size)}, {workers} worker(s), {inflight} in flight"
            key = (op, size, workers, inflight)
            latency[key] = statistics.median(lat)
            if stream:
                figs[key, "MB/s"] = figures.measured("pushpull", what, "MB/s", "higher", mbps, RAW_STREAM, stream)
            else:
                figs[key, "MB/s"] = figures.unanchored("pushpull", what, "MB/s", "higher", mbps, no_raw)
            if inflight == 1 and size < PING_MAX:
                what += ", latency"
                if stream:
                    figs[key, "us"] = figures.measured("pushpull", what, "us", "lower", lat, RAW_PING, ping)
                else:
                    figs[key, "us"] = figures.unanchored("pushpull", what, "us", "lower", lat, no_raw)
    return figs, latency


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--many-keys" in argv:  # 500 small tensors per step against DDP over gloo: pslink.bench.many_keys
        from pslink.bench import many_keys

        return many_keys.main([a for a in argv if a != "--many-keys"])
    parser = argparse.ArgumentParser(prog="pslink bench pushpull", description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="4K,256K,4M,64M", help="value sizes (comma separated)")
    parser.add_argument("--workers", default="1,2", help="worker counts to run")
    parser.add_argument("--inflight", default="1,4", help="requests in flight per worker")
    parser.add_argument("--ops", default="push,pull,pushpull")
    parser.add_argument("--seconds", type=float, default=1.0, help="timed duration of each case")
    parser.add_argument("--rounds", type=int, default=3, help="passes over every case and worker count")
    parser.add_argument("--partition", default="4M", help="partition size (tensors larger are split)")
    parser.add_argument("--transport", choices=["tcp", "zmq"], default="tcp")
    parser.add_argument("--no-raw", action="store_true",
                        help="skip the raw TCP anchor (a caller that measures its own: benchmarks/tls.py)")
    parser.add_argument("--quick", action="store_true",
                        help="a smoke run: pushpull at 4K and 4M, 0.3 s per case, 2 rounds")
    args = parser.parse_args(argv)
    if args.quick:
        args.sizes, args.ops, args.seconds, args.rounds = "4K,4M", "pushpull", 0.3, 2
    if args.rounds < 1 or args.seconds <= 0:
        parser.error("--rounds must be at least 1 and --seconds above 0")
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    worker_counts = [int(w) for w in args.workers.split(",")]
    inflights = [int(i) for i in args.inflight.split(",")]
    ops = args.ops.split(",")
    for op in ops:
        if op not in ("push", "pull", "pushpull"):
            parser.error(f"unknown op {op!r}; use push, pull, pushpull")
    plan = [(op, size, inflight) for size in sizes for inflight in inflights for op in ops]
    ping_sizes = sorted({size for op, size, inflight in plan if inflight == 1})
    raw_seconds = min(1.0, max(0.3, args.seconds))

    from rich.console import Console
    from rich.table import Table

    console = Console()
    console.print(f"[bold]pslink bench pushpull[/] on {platform.node()} ({os.cpu_count()} CPUs, Python "
                  f"{platform.python_version()}), transport {args.transport}, partition {args.partition}, "
                  f"{args.rounds} round(s)" + ("" if args.no_raw else "; raw loopback TCP measured every pass"))

    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    rounds: list[dict] = []
    columns = (TextColumn("{task.description:40s}"), BarColumn(), TextColumn("{task.completed}/{task.total} cases"),
               TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True) as bar:
        task = bar.add_task("starting", total=len(plan) * len(worker_counts) * args.rounds)
        for r in range(args.rounds):
            done: dict = {}
            for workers in (worker_counts if r % 2 == 0 else worker_counts[::-1]):
                def advance(case, workers=workers, r=r):
                    op, size, inflight = case
                    bar.update(task, advance=1, description=f"round {r + 1}, {workers} worker(s): {op} "
                                                            f"{size_label(size)} x{inflight}")

                anchor = None
                if not args.no_raw and r % 2 == 0:
                    bar.update(task, description=f"round {r + 1}: raw loopback TCP")
                    anchor = measure_raw(ping_sizes, raw_seconds)
                measured = run_pslink(plan, workers, args.seconds, parse_size(args.partition), args.transport,
                                      advance)
                if not args.no_raw and r % 2 == 1:
                    bar.update(task, description=f"round {r + 1}: raw loopback TCP")
                    anchor = measure_raw(ping_sizes, raw_seconds)
                done[workers] = (measured, anchor)
                if anchor is not None:
                    console.print(f"round {r + 1}, {workers} worker(s): raw loopback TCP stream "
                                  f"{anchor['stream']:.0f} MB/s" + "".join(
                                      f", {size_label(s)} ping-pong {anchor[s]:.1f} us" for s in ping_sizes
                                      if s in anchor))
            rounds.append(done)

    figs, latency = case_figures(plan, worker_counts, rounds)
    rows = []
    for workers in worker_counts:
        for op, size, inflight in plan:
            key = (op, size, workers, inflight)
            through, lat = figs[key, "MB/s"], figs.get((key, "us"))
            row = {"op": op, "size": size, "workers": workers, "inflight": inflight,
                   "MBps": round(through.value, 1), "latency_us": round(latency[key], 1)}
            if through.ratio is not None:
                row["vs_raw_tcp"] = round(through.ratio, 3)
            if lat is not None and lat.ratio is not None:
                row["latency_vs_raw"] = round(lat.ratio, 2)
            rows.append(row)

    table = Table(title=f"pslink push/pull (value MB/s per worker; latency = time per op; medians of "
                        f"{args.rounds} round(s))")
    for column in ("op", "size", "workers", "in flight", "MB/s", "latency us", "x raw stream", "x raw ping-pong"):
        table.add_column(column, justify="right")
    for row in rows:
        table.add_row(row["op"], size_label(row["size"]), str(row["workers"]), str(row["inflight"]),
                      f"{row['MBps']:.0f}", f"{row['latency_us']:.1f}",
                      f"{row['vs_raw_tcp']:.2f}" if "vs_raw_tcp" in row else "",
                      f"{row['latency_vs_raw']:.2f}" if "latency_vs_raw" in row else "")
    console.print(table)
    console.print("x raw stream: pslink's MB/s over one raw socket stream's (higher is better); x raw ping-pong: "
                  "pslink's time per op over a raw round trip of the same size (lower is better)")
    emitted = list(figs.values())
    for fig in emitted:
        figures.emit(fig, words=False)

    def raw_median(field):
        got = [done[w][1][field] for done in rounds for w in done if done[w][1] is not None and field in done[w][1]]
        return round(statistics.median(got), 1) if got else None

    print(json.dumps({
        "benchmark": "pushpull", "host": platform.node(), "cpus": os.cpu_count(), "transport": args.transport,
        "partition": parse_size(args.partition), "seconds_per_case": args.seconds, "rounds": args.rounds,
        "raw_tcp_stream_MBps": raw_median("stream"), "raw_ping_pong_4K_us": raw_median(4096),
        "cases": rows, "figures": [fig.as_json() for fig in emitted],
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
