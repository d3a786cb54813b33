"""Push, pull and pushpull throughput and latency, with raw loopback baselines from the same run.

One Aggregator process, worker processes with one Agent each. Every case runs a warm-up, then an
equal number of operations on every worker (BSP rounds must match), sized to take ``--seconds``.
Throughput is value bytes per second seen by one worker (what a training job experiences), as
ps-lite's benchmark reports it; latency is time per operation with one request in flight.

With 2 workers, pushpull runs as one 2-worker job (every round sums both workers); push and pull
run as two 1-worker jobs side by side (two clients loading one Aggregator), because a push-only
loop in one BSP job would let the faster worker run rounds ahead without bound.

``--many-keys``: 500 tensors of 1-64 KiB per step, a training step against DDP over gloo (see
:mod:`pslink.bench.many_keys`).

The anchor is the C++ ps-lite measured on this kind of machine (1 server, 1 worker, 4 in flight,
ZPushPull value MB/s): 75 / 819 / 1030 / 467 for 4K / 256K / 4M / 64M, and 138 us at 4 KiB with
1 in flight. The last line printed is JSON with every figure.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import sys
import time

import numpy as np

from pslink.bench import raw

ANCHOR_MBPS = {4 << 10: 75.0, 256 << 10: 819.0, 4 << 20: 1030.0, 64 << 20: 467.0}
ANCHOR_LATENCY_US = 138.0
TARGETS = {"pushpull_4M_MBps": 1030.0, "pushpull_64M_MBps": 900.0, "pushpull_4K_latency_us": 138.0}
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

    agents = {}
    try:
        for case_id, (op, size, inflight) in enumerate(plan):
            if op == "pushpull":
                job, job_rank, job_size = f"bench-pushpull-{workers}w", rank, workers
            else:
                job, job_rank, job_size = f"bench-{op}-{workers}w-{rank}", 0, 1
            agent = agents.get(job)
            if agent is None:
                agent = agents[job] = connect(job, job_rank, job_size, master=master,
                                              partition_bytes=partition, timeout=120.0)
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
        for agent in agents.values():
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
            case_id, rank, count, elapsed = results.get(timeout=900)
            measured.setdefault(case_id, []).append((count, elapsed))
            if progress is not None and len(measured[case_id]) == workers:
                progress(plan[case_id])
        for p in procs:
            p.join(60)
        if any(p.exitcode != 0 for p in procs):
            raise RuntimeError(f"benchmark workers failed: exit codes {[p.exitcode for p in procs]}")
    return measured


def rows_of(plan: list, measured: dict, workers: int, raw_stream: float) -> list[dict]:
    rows = []
    for case_id, (op, size, inflight) in enumerate(plan):
        per_worker = measured[case_id]
        mbps = float(np.mean([count * size / elapsed / 1e6 for count, elapsed in per_worker]))
        latency = float(np.mean([elapsed / count * 1e6 for count, elapsed in per_worker]))
        row = {"op": op, "size": size, "workers": workers, "inflight": inflight,
               "MBps": round(mbps, 1), "latency_us": round(latency, 1),
               "vs_raw_tcp": round(mbps / raw_stream, 3)}
        if op == "pushpull" and workers == 1 and inflight == 4 and size in ANCHOR_MBPS:
            row["vs_pslite"] = round(mbps / ANCHOR_MBPS[size], 2)
        if op == "pushpull" and workers == 1 and inflight == 1 and size == 4096:
            row["vs_pslite_latency"] = round(ANCHOR_LATENCY_US / latency, 2)
        rows.append(row)
    return rows


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
    parser.add_argument("--partition", default="4M", help="partition size (tensors larger are split)")
    parser.add_argument("--transport", choices=["tcp", "zmq"], default="tcp")
    parser.add_argument("--quick", action="store_true", help="4K and 4M only, 0.3 s per case (a smoke run)")
    args = parser.parse_args(argv)
    if args.quick:
        args.sizes, args.seconds = "4K,4M", 0.3
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    worker_counts = [int(w) for w in args.workers.split(",")]
    inflights = [int(i) for i in args.inflight.split(",")]
    ops = args.ops.split(",")
    plan = [(op, size, inflight) for size in sizes for inflight in inflights for op in ops]

    from rich.console import Console
    from rich.table import Table

    console = Console()
    console.print(f"[bold]pslink bench pushpull[/] on {platform.node()} ({os.cpu_count()} CPUs, Python "
                  f"{platform.python_version()}), transport {args.transport}, partition {args.partition}")
    raw_stream = raw.tcp_stream(max(1.0, args.seconds))
    raw_latency = float(np.mean(raw.socket_round_trips(4096, 5000))) * 1e6
    console.print(f"raw loopback TCP stream: {raw_stream:.0f} MB/s; raw 4 KiB ping-pong: {raw_latency:.1f} us")

    rows = []
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (TextColumn("{task.description:40s}"), BarColumn(), TextColumn("{task.completed}/{task.total} cases"),
               TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True) as bar:
        task = bar.add_task("starting", total=len(plan) * len(worker_counts))
        for workers in worker_counts:
            def advance(case, workers=workers):
                op, size, inflight = case
                bar.update(task, advance=1, description=f"{workers} worker(s): {op} {size_label(size)} x{inflight}")

            measured = run_pslink(plan, workers, args.seconds, parse_size(args.partition), args.transport, advance)
            rows += rows_of(plan, measured, workers, raw_stream)

    table = Table(title="pslink push/pull (value MB/s per worker; latency = time per op)")
    for column in ("op", "size", "workers", "in flight", "MB/s", "latency us", "x raw TCP", "x ps-lite"):
        table.add_column(column, justify="right")
    for row in rows:
        versus = row.get("vs_pslite") or row.get("vs_pslite_latency")
        table.add_row(row["op"], size_label(row["size"]), str(row["workers"]), str(row["inflight"]),
                      f"{row['MBps']:.0f}", f"{row['latency_us']:.1f}", f"{row['vs_raw_tcp']:.2f}",
                      f"{versus:.2f}" if versus else "")
    console.print(table)

    def pick(size, inflight, field):
        for row in rows:
            if (row["op"], row["size"], row["workers"], row["inflight"]) == ("pushpull", size, 1, inflight):
                return row[field]
        return None

    figures = {
        "pushpull_4M_MBps": pick(4 << 20, 4, "MBps"),
        "pushpull_64M_MBps": pick(64 << 20, 4, "MBps"),
        "pushpull_4K_latency_us": pick(4 << 10, 1, "latency_us"),
    }
    verdicts = {}
    for name, target in TARGETS.items():
        value = figures[name]
        if value is not None:
            met = value <= target if name.endswith("latency_us") else value >= target
            verdicts[name] = {"value": value, "target": target, "met": met}
            console.print(f"target {name}: {value} vs {target} -> {'[green]met[/]' if met else '[red]missed[/]'}")
    print(json.dumps({
        "benchmark": "pushpull", "host": platform.node(), "cpus": os.cpu_count(), "transport": args.transport,
        "partition": parse_size(args.partition), "seconds_per_case": args.seconds,
        "raw_tcp_stream_MBps": round(raw_stream, 1), "raw_ping_pong_4K_us": round(raw_latency, 1),
        "anchor_pslite": {"pushpull_MBps": {size_label(k): v for k, v in ANCHOR_MBPS.items()},
                          "latency_4K_us": ANCHOR_LATENCY_US},
        "targets": verdicts, "cases": rows,
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
