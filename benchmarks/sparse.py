"""Sparse tables, side by side in one run: rows/s of table push and pull against the same bytes
through a dense key, and ps-lite's test_kv_app pattern on classic servers, on the service, and
on C++ ps-lite built from ``--pslite PATH``.

**tables**: an embedded service with one Aggregator process; one worker pushes (and pulls) ``n``
ids per request (10^4 and 10^6; ids drawn from 4n, so some repeat and are summed) of rows of
width 16 and 64 float32, against pushes and pulls of one dense key of ``n x width`` floats.
Variants alternate within each round, the order reversed on every other round; the anchor of
each figure is the dense key measured in the same round (table / dense, medians over rounds).

**kv_app**: ps-lite's tests/test_kv_app.cc, timed: 1 worker x 1 server, each Push is 10,000
keys of one float (keys spread over the key space), at most 10 pushes in flight, ``--repeat``
times; then as many Pulls; then as many serial PushPulls. Variants, alternating:

- ``classic``: ``pslink launch --pslite -s 1 -n 1``, the server running KVServerDefaultHandle;
- ``service``: ``--server-mode service``: no server; each request is one table request per
  shard (``PSLINK_PSLITE_SHARDS``, default DMLC_NUM_SERVER = 1) to one Aggregator;
- ``cpp``: C++ ps-lite: ``benchmarks/cpp/kv_many.cc`` compiled against the ``--pslite PATH``
  checkout's libps.a, built with its own Makefile (:mod:`pslink.bench.pslite_cpp`).

The figures are classic and service against ``cpp``, in keys/s, round by round; without
``--pslite`` they carry no ratio.

    python benchmarks/sparse.py --pslite ~/ps-lite    # both sections, 3 rounds
    python benchmarks/sparse.py --quick [--pslite ~/ps-lite]   # a smoke run (< 60 s)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from pslink.bench import figures, pslite_cpp, pslite_deploy

RESULT = "KV_MANY_RESULT "
CPP_DRIVER = os.path.join(HERE, "cpp", "kv_many.cc")
NOT_RUN = "C++ ps-lite not run: give --pslite PATH (a dmlc/ps-lite checkout)"
TABLE_VARIANTS = ("table push", "dense push", "table pull", "dense pull")


# -- tables against dense keys ------------------------------------------------------------------------


def _timed(fn, reps: int) -> float:
    fn()  # warm: rows made, buffers touched
    started = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - started) / reps


def tables_section(sizes, widths, rounds: int) -> tuple[list[dict], list]:
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
                        variants = {  # TABLE_VARIANTS
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
    rows_out, figs = [], []
    for n in sizes:
        for width in widths:
            med = {name: statistics.median(results[(n, width, name)]) for name in TABLE_VARIANTS}
            row = {"ids": n, "width": width,
                   **{k.replace(" ", "_") + "_rows_per_s": round(v) for k, v in med.items()}}
            for op in ("push", "pull"):
                fig = figures.measured("sparse", f"table {op}, {n} ids x {width} floats", "rows/s", "higher",
                                       results[(n, width, f"table {op}")], f"dense {op} of the same bytes (one key)",
                                       results[(n, width, f"dense {op}")])
                row[f"{op}_table_over_dense"] = round(fig.ratio, 2)
                figs.append(fig)
            rows_out.append(row)
    return rows_out, figs


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


def run_pslink(mode: str, plan: dict, timeout: float = 300.0) -> dict:
    command = [sys.executable, os.path.abspath(__file__), "--program", json.dumps(plan)]
    return _parse(pslite_deploy.run(command, mode, f"pslink {mode}", timeout), f"pslink {mode}")


def run_cpp(binary: str, plan: dict, timeout: float = 300.0) -> dict:
    outputs = pslite_cpp.run(binary, [plan["num"], plan["repeat"], plan["window"]], timeout=timeout)
    return _parse(outputs["worker0"].splitlines(), "C++ ps-lite")


def kv_app_section(plan: dict, rounds: int, binary: str | None, commit: str | None) -> tuple[dict, list]:
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
    figs, ratios = [], {}
    for op in ("push", "pull", "pushpull"):
        for name in ("classic", "service"):
            what = f"test_kv_app {op}, pslink {name} ({plan['num']} keys of 1 float per request)"
            if binary is None:
                figs.append(figures.unanchored("sparse", what, "keys/s", "higher", runs[(name, op)], NOT_RUN))
                continue
            fig = figures.measured("sparse", what, "keys/s", "higher", runs[(name, op)],
                                   f"C++ ps-lite tcp ({(commit or 'unknown')[:12]})", runs[("cpp", op)])
            ratios[f"{name}/cpp {op}"] = round(fig.ratio, 2)
            figs.append(fig)
    out["ratios"] = ratios
    return out, figs


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--program", help=argparse.SUPPRESS)
    parser.add_argument("--sections", default="tables,kv_app")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--sizes", default="10000,1000000", help="ids per table request")
    parser.add_argument("--widths", default="16,64")
    parser.add_argument("--repeat", type=int, default=50, help="kv_app: pushes (and pulls, pushpulls) timed")
    parser.add_argument("--pslite", metavar="PATH", help="a dmlc/ps-lite checkout: build it and run it alongside")
    parser.add_argument("--deps-path", default="/usr", help="prefix of ZeroMQ and protobuf for ps-lite's Makefile")
    parser.add_argument("--quick", action="store_true", help="a smoke run: small sizes, 2 rounds")
    args = parser.parse_args(argv)
    if args.program:
        return program(json.loads(args.program))
    if args.quick:
        args.rounds, args.sizes, args.widths, args.repeat = 2, "1000", "16", 5
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    sections = [x for x in args.sections.split(",") if x]
    for section in sections:
        if section not in ("tables", "kv_app"):
            parser.error(f"unknown section {section!r}; use tables, kv_app")
    binary = commit = None
    if args.pslite and "kv_app" in sections:
        try:
            root = pslite_cpp.checkout(args.pslite)
            commit = pslite_cpp.commit(root)
            print(f"building C++ ps-lite {commit} in {root} (its Makefile, DEPS_PATH={args.deps_path}) ...",
                  file=sys.stderr, flush=True)
            binary = pslite_cpp.build_driver(root, CPP_DRIVER, args.deps_path)
        except pslite_cpp.PsliteError as exc:
            print(f"sparse: {exc}", file=sys.stderr)
            return 2
    figs: list = []
    report = {"benchmark": "sparse", "host": platform.node(), "cpus": os.cpu_count(),
              "command": " ".join([os.path.basename(sys.executable)] + sys.argv)}
    print(f"sparse tables on {platform.node()} ({os.cpu_count()} CPUs, Python {platform.python_version()}), "
          f"{args.rounds} round(s)", file=sys.stderr)
    if "tables" in sections:
        report["tables"], table_figs = tables_section([int(s) for s in args.sizes.split(",")],
                                                      [int(w) for w in args.widths.split(",")], args.rounds)
        figs += table_figs
        for row in report["tables"]:
            print(f"{row['ids']:>8} ids x {row['width']:>3}: push table {row['table_push_rows_per_s']:>10} rows/s, "
                  f"dense {row['dense_push_rows_per_s']:>10} ({row['push_table_over_dense']}x); pull table "
                  f"{row['table_pull_rows_per_s']:>10}, dense {row['dense_pull_rows_per_s']:>10} "
                  f"({row['pull_table_over_dense']}x)")
    if "kv_app" in sections:
        plan = {"num": 1000 if args.quick else 10_000, "repeat": args.repeat, "window": 10}
        report["kv_app"], kv_figs = kv_app_section(plan, args.rounds, binary, commit)
        figs += kv_figs
        report["pslite_commit"] = commit
        for name, ops in report["kv_app"]["variants"].items():
            print(f"kv_app {name:>8}: " + ", ".join(f"{op} {v} keys/s" for op, v in ops.items()))
    for fig in figs:
        figures.emit(fig)
    report["figures"] = [fig.as_json() for fig in figs]
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
