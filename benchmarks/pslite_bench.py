"""ps-lite's benchmark on pslink.pslite: zpush, zpull, zpushpull with 4 requests in flight.

Mirrors ps-lite's KV benchmark: one server and one worker, each request one key whose value is
4 KiB, 256 KiB, 4 MiB or 64 MiB of float32, 4 requests in flight (one key each), throughput as
value MB/s seen by the worker; each size and op in a deployment of its own, as ps-lite's
benchmark takes one length and one mode per run. The deployment is a real one, started as ``pslink launch --pslite
-s 1 -n 1`` starts it (a scheduler, a server and a worker process running this file), in
either server mode:

- ``classic``: the server process runs ``KVServerDefaultHandle`` (``store[key] += value``; pulls
  answer from the store), as a ps-lite program's server would;
- ``service``: no server process; an embedded parameter service with one Aggregator serves the
  worker (an ASP job in sum mode, the same semantics).

The anchor is C++ ps-lite, 1 server x 1 worker, measured on this kind of machine (value MB/s):
zpush 82 / 1832 / 2097 / 899, zpull 79 / 1281 / 2052 / 901, zpushpull 75 / 819 / 1030 / 467 for
4K / 256K / 4M / 64M. The target is at or above each. The last line printed is JSON::

    python benchmarks/pslite_bench.py                  # both modes, every size, 1 s per case
    python benchmarks/pslite_bench.py --quick          # a smoke run: small sizes, 0.2 s per case
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import sys
import threading
import time
from collections import deque

import numpy as np

ANCHOR_MBPS = {
    "zpush": {4 << 10: 82.0, 256 << 10: 1832.0, 4 << 20: 2097.0, 64 << 20: 899.0},
    "zpull": {4 << 10: 79.0, 256 << 10: 1281.0, 4 << 20: 2052.0, 64 << 20: 901.0},
    "zpushpull": {4 << 10: 75.0, 256 << 10: 819.0, 4 << 20: 1030.0, 64 << 20: 467.0},
}
OPS = ("zpush", "zpull", "zpushpull")
UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
RESULT = "PSLITE_BENCH_RESULT "


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


# -- the ps-lite program (runs as scheduler, server and worker) ---------------------------------------


def _run_ops(kv, op: str, keys, vals, outs, inflight: int, count: int) -> float:
    pending: deque = deque()
    start = time.perf_counter()
    for i in range(count):
        if len(pending) >= inflight:
            kv.wait(pending.popleft())
        j = i % inflight
        if op == "zpush":
            pending.append(kv.zpush(keys[j], vals[j]))
        elif op == "zpull":
            pending.append(kv.zpull(keys[j], outs[j]))
        else:
            pending.append(kv.zpushpull(keys[j], vals[j], outs[j]))
    while pending:
        kv.wait(pending.popleft())
    return time.perf_counter() - start


def program(plan: dict) -> int:
    from pslink import pslite as ps

    if ps.is_server():
        server = ps.KVServer(0)
        server.set_request_handle(ps.KVServerDefaultHandle())
    ps.start()
    if ps.is_worker():
        kv = ps.KVWorker(0, 0)
        inflight, seconds = plan["inflight"], plan["seconds"]
        results = []
        for s, size in enumerate(plan["sizes"]):
            numel = size // 4
            keys = [np.array([s * 64 + j], np.uint64) for j in range(inflight)]
            rng = np.random.default_rng(s)
            vals = [rng.standard_normal(numel).astype(np.float32) for _ in range(inflight)]
            outs = [np.empty(numel, np.float32) for _ in range(inflight)]
            for j in range(inflight):  # ps-lite's benchmark pushes once before timing, too
                kv.wait(kv.zpush(keys[j], vals[j]))
            for op in plan["ops"]:
                # Warm up (connections, buffer pools, page faults), then size the timed run.
                warm = _run_ops(kv, op, keys, vals, outs, inflight, 3 * inflight)
                per_op = warm / (3 * inflight)
                count = max(5 * inflight, int(seconds / max(per_op, 1e-6)))
                elapsed = _run_ops(kv, op, keys, vals, outs, inflight, count)
                results.append({"op": op, "size": size, "count": count, "seconds": elapsed,
                                "MBps": count * size / elapsed / 1e6})
        print(RESULT + json.dumps(results), flush=True)
    ps.finalize()
    return 0


# -- the driver ---------------------------------------------------------------------------------------


class _Capture(io.TextIOBase):
    """Collects the deployment's output (and echoes it when asked)."""

    def __init__(self, echo: bool):
        self.echo = echo
        self.lines: list[str] = []
        self.lock = threading.Lock()

    def write(self, text: str) -> int:
        with self.lock:
            self.lines.extend(line for line in text.splitlines() if line)
        if self.echo and not text.startswith(RESULT):
            sys.stdout.write(text)
        return len(text)

    def flush(self) -> None:
        sys.stdout.flush()


def run_mode(mode: str, plan: dict, echo: bool) -> list[dict]:
    """Every value size and op in a deployment of its own, as ps-lite's benchmark takes one
    length and one mode (push, pull or both) per run.

    One job through several would be measured against itself: the parameter service profiles a
    job's speed while it runs alone, and its performance guard reads a later, slower iteration as
    interference (the 256 KiB phase after the 4 KiB one looked 3-5x slower than the job profiled,
    as did 4 KiB zpushpull after zpush, and each was spread over more Aggregators; see
    docs/benchmarks.md)."""
    results = []
    for size in plan["sizes"]:
        for op in plan["ops"]:
            results += _run_deployment(mode, dict(plan, sizes=[size], ops=[op]), echo)
    return results


def _run_deployment(mode: str, plan: dict, echo: bool) -> list[dict]:
    from pslink.launch import PsliteLaunch

    capture = _Capture(echo)
    command = [sys.executable, os.path.abspath(__file__), "--program", json.dumps(plan)]
    code = PsliteLaunch(command, num_workers=1, num_servers=1, server_mode=mode, aggregators=1,
                        job=f"pslite-bench-{os.getpid()}-{mode}-{plan['sizes'][0]}-{plan['ops'][0]}", prefix=False,
                        output=capture).run()
    found = [line[len(RESULT):] for line in capture.lines if line.startswith(RESULT)]
    if code != 0 or not found:
        tail = "\n".join(capture.lines[-20:])
        raise RuntimeError(f"{mode} mode: the deployment exited with status {code}\n{tail}")
    return json.loads(found[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="4K,256K,4M,64M", help="value sizes in bytes (comma separated)")
    parser.add_argument("--ops", default=",".join(OPS))
    parser.add_argument("--modes", default="classic,service", help="server modes to run")
    parser.add_argument("--inflight", type=int, default=4, help="requests in flight")
    parser.add_argument("--seconds", type=float, default=1.0, help="timed duration of each case")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 4K and 256K, 0.2 s per case")
    parser.add_argument("--echo", action="store_true", help="show the deployment's own output")
    parser.add_argument("--program", help=argparse.SUPPRESS)  # set when this file runs as a node
    args = parser.parse_args(argv)
    if args.program is not None:
        return program(json.loads(args.program))
    if args.quick:
        args.sizes, args.seconds = "4K,256K", 0.2
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    ops = [op for op in args.ops.split(",") if op]
    modes = [m for m in args.modes.split(",") if m]
    for op in ops:
        if op not in OPS:
            parser.error(f"unknown op {op!r}; use {', '.join(OPS)}")
    plan = {"sizes": sizes, "ops": ops, "inflight": args.inflight, "seconds": args.seconds}

    print(f"pslink pslite bench on {platform.node()} ({os.cpu_count()} CPUs, Python {platform.python_version()}): "
          f"1 server x 1 worker, {args.inflight} in flight, {args.seconds:g} s per case")
    rows = []
    for mode in modes:
        for result in run_mode(mode, plan, args.echo):
            anchor = ANCHOR_MBPS[result["op"]].get(result["size"])
            row = {"mode": mode, "op": result["op"], "size": result["size"], "MBps": round(result["MBps"], 1),
                   "latency_us": round(result["seconds"] / result["count"] * 1e6, 1), "ops": result["count"]}
            if anchor:
                row["anchor_MBps"] = anchor
                row["vs_pslite"] = round(result["MBps"] / anchor, 2)
                row["met"] = result["MBps"] >= anchor
            rows.append(row)

    print(f"{'mode':8} {'op':10} {'size':>5} {'MB/s':>8} {'ps-lite':>8} {'ratio':>6}  target")
    for row in rows:
        anchor = row.get("anchor_MBps")
        print(f"{row['mode']:8} {row['op']:10} {size_label(row['size']):>5} {row['MBps']:8.1f} "
              f"{anchor if anchor else '':>8} {row.get('vs_pslite', ''):>6}  "
              f"{'' if anchor is None else ('met' if row['met'] else 'missed')}")
    judged = [r for r in rows if "met" in r]
    print(json.dumps({
        "benchmark": "pslite", "host": platform.node(), "cpus": os.cpu_count(), "servers": 1, "workers": 1,
        "inflight": args.inflight, "seconds_per_case": args.seconds, "modes": modes,
        "anchor_pslite_MBps": {op: {size_label(k): v for k, v in sizes_.items()} for op, sizes_ in ANCHOR_MBPS.items()},
        "targets_met": sum(r["met"] for r in judged), "targets_judged": len(judged), "cases": rows,
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
