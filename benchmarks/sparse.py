"""Sparse tables, side by side in one run: rows/s of table push and pull against the same bytes
through a dense key, and ps-lite's test_kv_app pattern on classic servers, on the service, and
on C++ ps-lite where it is built.

**tables**: an embedded service with one Aggregator process; one worker pushes (and pulls) ``n``
ids per request (10^4 and 10^6; ids drawn from 4n, so some repeat and are summed) of rows of
width 16 and 64 float32, against pushes and pulls of one dense key of ``n x width`` floats.
Variants alternate within each round; medians over ``--rounds`` rounds; ratios table / dense.

**kv_app**: ps-lite's tests/test_kv_app.cc, timed: 1 worker x 1 server, each Push is 10,000
keys of one float (keys spread over the key space), at most 10 pushes in flight, ``--repeat``
times; then as many Pulls; then as many serial PushPulls. Variants, alternating:

- ``classic``: ``pslink launch --pslite -s 1 -n 1``, the server running KVServerDefaultHandle;
- ``service``: ``--server-mode service``: no server; each request is one table request per
  shard (``PSLINK_PSLITE_SHARDS``, default DMLC_NUM_SERVER = 1) to one Aggregator;
- ``cpp``: C++ ps-lite (benchmarks/cpp/kv_many.cc compiled against ``--pslite-build``'s
  libpslite.a, as ../shared/tools/pslite_side_by_side.sh builds it); skipped, saying so, where
  it is not built.

    python benchmarks/sparse.py                       # both sections, 3 rounds
    python benchmarks/sparse.py --quick               # a smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
RESULT = "KV_MANY_RESULT "


# -- tables against dense keys ------------------------------------------------------------------------


def _timed(fn, reps: int) -> float:
    fn()  # warm: rows made, buffers touched
    started = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - started) / reps


def tables_section(sizes, widths, rounds: int) -> list[dict]:
    import pslink
    from pslink.core.service import Service

    results: dict = {}
    with Service(aggregators=1) as service:
        agent = pslink.connect("sparse-bench", 0, 1, master=service.address, sync="asp", timeout=600)
        try:
            for r in range(rounds):
                for n in sizes:
                    reps = 5 if n <= 10_000 else 1
                    for width in widths:
                        rng = np.random.default_rng(r)
                        ids = rng.integers(0, 4 * n, n).astype(np.int64)
                        rows = rng.standard_normal((n, width)).astype(np.float32)
                        table = agent.table(f"t{n}x{width}", width, shards=1)
                        dense_key = f"d{n}x{width}"
                        flat = rows.reshape(-1)
                        out = np.empty_like(flat)
                        if r == 0:
                            agent.init(dense_key, flat).wait()
                        variants = {
                            "table push": lambda: table.push(ids, rows).wait(),
                            "dense push": lambda: agent.push(dense_key, flat).wait(),
                            "table pull": lambda: table.pull(ids).wait(),
                            "dense pull": lambda: agent.pull(dense_key, out=out).wait(),
                        }
                        order = list(variants) if r % 2 == 0 else list(reversed(variants))
                        for name in order:
                            seconds = _timed(variants[name], reps)
                            results.setdefault((n, width, name), []).append(n / seconds)
                        print(f"  tables round {r + 1}: n={n} width={width} " + " ".join(
                            f"{name}={results[(n, width, name)][-1]:.3g} rows/s" for name in variants), file=sys.stderr)
        finally:
            agent.close()
    rows_out = []
    for n in sizes:
        for width in widths:
            med = {name: statistics.median(results[(n, width, name)]) for name in
                   ("table push", "dense push", "table pull", "dense pull")}
            rows_out.append({"ids": n, "width": width, **{k.replace(" ", "_") + "_rows_per_s": round(v) for k, v in med.items()},
                             "push_table_over_dense": round(med["table push"] / med["dense push"], 2),
                             "pull_table_over_dense": round(med["table pull"] / med["dense pull"], 2)})
    return rows_out


# -- test_kv_app's pattern --------------------------------------------------------------------------


def program(plan: dict) -> int:
    """The ps-lite program (scheduler, server and worker) of the pslink variants."""
    from pslink import pslite as ps

    if ps.is_server():
        server = ps.KVServer(0)
        server.set_request_handle(ps.KVServerDefaultHandle())
    ps.start()
    if ps.is_worker():
        kv = ps.KVWorker(0, 0)
        num, repeat, window = plan["num"], plan["repeat"], plan["window"]
        keys = (np.arange(num, dtype=np.uint64) * np.uint64(ps.kMaxKey // num))
        vals = (np.arange(num) % 1000).astype(np.float32)
        kv.wait(kv.push(keys, vals))  # first touch, untimed
        started = time.perf_counter()
        pending: list = []
        for _ in range(repeat):
            if len(pending) >= window:
                kv.wait(pending.pop(0))
            pending.append(kv.push(keys, vals))
        for ts in pending:
            kv.wait(ts)
        push = time.perf_counter() - started
        rets = np.empty(num, np.float32)
        started = time.perf_counter()
        for _ in range(repeat):
            kv.wait(kv.zpull(keys, rets))
        pull = time.perf_counter() - started
        outs = np.empty(num, np.float32)
        started = time.perf_counter()
        for _ in range(repeat):
            kv.wait(kv.zpushpull(keys, vals, outs))
        pushpull = time.perf_counter() - started
        error = float(np.abs(outs - vals * (2 * repeat + 1)).sum())
        print(RESULT + json.dumps({"push": push, "pull": pull, "pushpull": pushpull, "error": error}), flush=True)
    ps.finalize()
    return 0


def _parse(lines, what: str) -> dict:
    found = [line.split(RESULT, 1)[1] for line in lines if RESULT in line]
    if not found:
        raise RuntimeError(f"{what}: no result; output:\n" + "\n".join(lines[-20:]))
    result = json.loads(found[-1])
    if result["error"] > 1e-3:
        raise RuntimeError(f"{what}: wrong sums (error {result['error']})")
    return result


def run_pslink(mode: str, plan: dict) -> dict:
    from pslink.launch import PsliteLaunch

    class Capture:
        def __init__(self):
            self.lines: list[str] = []

        def write(self, text: str) -> int:
            self.lines.extend(text.splitlines())
            return len(text)

        def flush(self) -> None:
            pass

    capture = Capture()
    command = [sys.executable, os.path.abspath(__file__), "--program", json.dumps(plan)]
    code = PsliteLaunch(command, num_workers=1, num_servers=1, server_mode=mode, aggregators=1,
                        job=f"kv-many-{os.getpid()}-{time.monotonic_ns()}", prefix=False, output=capture).run()
    if code != 0:
        raise RuntimeError(f"pslink {mode}: exit status {code}:\n" + "\n".join(capture.lines[-20:]))
    return _parse(capture.lines, f"pslink {mode}")


def build_cpp(build_dir: str) -> str | None:
    """The C++ driver, compiled against ``build_dir``'s libpslite.a; None (and why) if it cannot be."""
    library = os.path.join(build_dir, "libpslite.a")
    cache = os.path.join(build_dir, "CMakeCache.txt")
    if not os.path.exists(library) or not os.path.exists(cache) or shutil.which("g++") is None:
        print(f"  C++ ps-lite: not built at {build_dir} (see ../shared/tools/pslite_side_by_side.sh); skipped",
              file=sys.stderr)
        return None
    source_dir = next((line.split("=", 1)[1].strip() for line in open(cache) if line.startswith("pslite_SOURCE_DIR")),
                      "/tmp/pslite/src")
    binary = os.path.join(tempfile.gettempdir(), "pslink-kv-many")
    source = os.path.join(HERE, "cpp", "kv_many.cc")
    if not os.path.exists(binary) or os.path.getmtime(binary) < os.path.getmtime(source):
        done = subprocess.run(["g++", "-O3", "-DNDEBUG", "-std=c++14", f"-I{source_dir}/include", source, library,
                               "-lzmq", "-lprotobuf", "-lpthread", "-o", binary], capture_output=True, text=True)
        if done.returncode != 0:
            print(f"  C++ ps-lite: compiling the driver failed; skipped:\n{done.stderr[-2000:]}", file=sys.stderr)
            return None
    return binary


def run_cpp(binary: str, plan: dict, timeout: float = 300.0) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, DMLC_NUM_SERVER="1", DMLC_NUM_WORKER="1", DMLC_PS_ROOT_URI="127.0.0.1",
               DMLC_PS_ROOT_PORT=str(port))
    args = [binary, str(plan["num"]), str(plan["repeat"]), str(plan["window"])]
    procs = {role: subprocess.Popen(args, env=dict(env, DMLC_ROLE=role), stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True)
             for role in ("scheduler", "server", "worker")}
    try:
        out, _ = procs["worker"].communicate(timeout=timeout)
        for role in ("scheduler", "server"):
            procs[role].communicate(timeout=30)
    finally:
        for proc in procs.values():  # by pid: nothing of this run is left behind
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
    return _parse(out.splitlines(), "C++ ps-lite")


def kv_app_section(plan: dict, rounds: int, build_dir: str) -> dict:
    binary = build_cpp(build_dir)
    variants = {"classic": lambda: run_pslink("classic", plan), "service": lambda: run_pslink("service", plan)}
    if binary is not None:
        variants["cpp"] = lambda: run_cpp(binary, plan)
    runs: dict = {}
    for r in range(rounds):
        order = list(variants) if r % 2 == 0 else list(reversed(variants))
        for name in order:
            result = variants[name]()
            for op in ("push", "pull", "pushpull"):
                runs.setdefault((name, op), []).append(plan["repeat"] * plan["num"] / result[op])
        print(f"  kv_app round {r + 1}: " + " ".join(
            f"{name}: push {runs[(name, 'push')][-1]:.3g} pull {runs[(name, 'pull')][-1]:.3g} "
            f"pushpull {runs[(name, 'pushpull')][-1]:.3g} keys/s;" for name in variants), file=sys.stderr)
    out: dict = {"keys_per_push": plan["num"], "repeat": plan["repeat"], "window": plan["window"], "variants": {}}
    for name in variants:
        out["variants"][name] = {op: round(statistics.median(runs[(name, op)])) for op in ("push", "pull", "pushpull")}
    ratios = {}
    for op in ("push", "pull", "pushpull"):
        service = out["variants"]["service"][op]
        ratios[f"service/classic {op}"] = round(service / out["variants"]["classic"][op], 2)
        if "cpp" in variants:
            ratios[f"service/cpp {op}"] = round(service / out["variants"]["cpp"][op], 2)
            ratios[f"classic/cpp {op}"] = round(out["variants"]["classic"][op] / out["variants"]["cpp"][op], 2)
    out["ratios"] = ratios
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--program", help=argparse.SUPPRESS)
    parser.add_argument("--sections", default="tables,kv_app")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--sizes", default="10000,1000000", help="ids per table request")
    parser.add_argument("--widths", default="16,64")
    parser.add_argument("--repeat", type=int, default=50, help="kv_app: pushes (and pulls, pushpulls) timed")
    parser.add_argument("--pslite-build", default=os.environ.get("PSLITE_BUILD", "/tmp/pslite/build"))
    parser.add_argument("--quick", action="store_true", help="a smoke run: small sizes, 1 round")
    args = parser.parse_args(argv)
    if args.program:
        return program(json.loads(args.program))
    if args.quick:
        args.rounds, args.sizes, args.widths, args.repeat = 1, "1000", "16", 5
    sections = args.sections.split(",")
    report = {"benchmark": "sparse", "host": platform.node(), "cpus": os.cpu_count(),
              "command": " ".join([os.path.basename(sys.executable)] + sys.argv)}
    print(f"sparse tables on {platform.node()} ({os.cpu_count()} CPUs, Python {platform.python_version()}), "
          f"{args.rounds} round(s)", file=sys.stderr)
    if "tables" in sections:
        report["tables"] = tables_section([int(s) for s in args.sizes.split(",")],
                                          [int(w) for w in args.widths.split(",")], args.rounds)
        for row in report["tables"]:
            print(f"{row['ids']:>8} ids x {row['width']:>3}: push table {row['table_push_rows_per_s']:>10} rows/s, "
                  f"dense {row['dense_push_rows_per_s']:>10} ({row['push_table_over_dense']}x); pull table "
                  f"{row['table_pull_rows_per_s']:>10}, dense {row['dense_pull_rows_per_s']:>10} "
                  f"({row['pull_table_over_dense']}x)")
    if "kv_app" in sections:
        plan = {"num": 1000 if args.quick else 10_000, "repeat": args.repeat, "window": 10}
        report["kv_app"] = kv_app_section(plan, args.rounds, args.pslite_build)
        for name, ops in report["kv_app"]["variants"].items():
            print(f"kv_app {name:>8}: " + ", ".join(f"{op} {v} keys/s" for op, v in ops.items()))
        print("kv_app ratios: " + ", ".join(f"{k} {v}" for k, v in report["kv_app"]["ratios"].items()))
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
