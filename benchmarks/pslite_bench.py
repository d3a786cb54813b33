"""ps-lite's benchmark on pslink.pslite, side by side with C++ ps-lite in the same run.

ps-lite's KV benchmark semantics: one server and one worker (and a scheduler), each request one
key whose value is 4 KiB, 256 KiB, 4 MiB or 64 MiB of float32, 4 requests in flight as a sliding
window, an untimed init push per key, a warm-up, then a timed run sized to ``--seconds``;
throughput is value MB/s seen by the worker. Each size and op is a deployment of its own (ps-lite's
benchmark takes one length and one mode per run), started as ``pslink launch --pslite -s 1 -n 1``
starts one (a scheduler, a server and a worker process running this file). pslink variants:

- ``classic``: the server process runs ``KVServerDefaultHandle`` (``store[key] += value``; pulls
  answer from the store), with pslink's defaults on one host (Unix sockets and shared-memory rings);
- ``uds``: classic with ``PSLINK_SHM=0`` (Unix sockets only);
- ``tcp``: classic with ``PSLINK_SHM=0 PSLINK_LOCAL_SOCKETS=0`` (loopback TCP);
- ``service``: no server process; an embedded parameter service with one Aggregator serves the
  worker (an ASP job in sum mode, the same semantics).

The anchor, with ``--pslite PATH`` (a dmlc/ps-lite checkout, any commit): C++ ps-lite built from
it with its own Makefile against the system's ZeroMQ and protobuf, driven by
``benchmarks/cpp/pslite_bench.cc`` (the same semantics), over ``tcp`` (its default) and ``ipc``
(``DMLC_LOCAL=1``). C++ and pslink runs alternate case by case, the order reversed on every other
round; each figure is a pslink variant against the ps-lite transport it matches (tcp/tcp,
uds/ipc, classic/tcp, service/tcp), medians over the rounds. Without ``--pslite`` the figures are
pslink's alone, with no ratio. With ``--pslite`` (unless ``--quick`` or ``--no-kv-app-benchmark``)
ps-lite's own ``tests/test_kv_app_benchmark`` is built by its Makefile and run unchanged,
alternating with its port, ``benchmarks/pslite_kv_app_benchmark.py``, on the classic variants
(figures in ms). The last line printed is JSON::

    python benchmarks/pslite_bench.py --pslite ~/ps-lite   # every size and op, 3 rounds, 1 s per case
    python benchmarks/pslite_bench.py                      # pslink's figures only
    python benchmarks/pslite_bench.py --quick [--pslite ~/ps-lite]   # a smoke run (< 60 s)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import sys
import time
from collections import deque

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # pslink from this checkout, when run as a script

from pslink.bench import figures, pslite_cpp, pslite_deploy

OPS = ("zpush", "zpull", "zpushpull")
# name: (server mode, environment of the deployment)
PSLINK_VARIANTS = {
    "classic": ("classic", {}),
    "uds": ("classic", {"PSLINK_SHM": "0"}),
    "tcp": ("classic", {"PSLINK_SHM": "0", "PSLINK_LOCAL_SOCKETS": "0"}),
    "service": ("service", {}),
}
CPP_VARIANTS = tuple(pslite_cpp.TRANSPORTS)  # tcp, ipc
MATCH = {"tcp": "tcp", "uds": "ipc", "classic": "tcp", "service": "tcp"}  # pslink variant -> ps-lite's
UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
RESULT = "PSLITE_BENCH_RESULT "
CPP_RESULT = "PSLITE_CPP_RESULT "
CPP_DRIVER = os.path.join(HERE, "cpp", "pslite_bench.cc")
NOT_RUN = "C++ ps-lite not run: give --pslite PATH (a dmlc/ps-lite checkout)"
KV_APP_PORT = os.path.join(HERE, "pslite_kv_app_benchmark.py")
KV_APP_VARIANTS = ("classic", "uds", "tcp")  # its own server's handle: service mode answers pulls otherwise
KV_APP_COST = re.compile(r"(Push|Pull) average time cost: ([0-9.]+) ?ms")


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


# -- one case of each side ----------------------------------------------------------------------------


def launch_pslink(variant: str, command: list[str], name: str, timeout: float, echo: bool = False) -> list[str]:
    """Run ``command`` as ``pslink launch --pslite -s 1 -n 1`` runs it, in a pslink variant's
    setting; its output lines."""
    mode, extra = PSLINK_VARIANTS[variant]
    return pslite_deploy.run(command, mode, f"pslink {variant} {name}", timeout, env=extra, echo=echo, hide=RESULT)


def run_pslink(variant: str, size: int, op: str, inflight: int, seconds: float, timeout: float,
               echo: bool = False) -> dict:
    """One deployment of a pslink variant: one size, one op (``{op, size, count, seconds, MBps}``).

    Each case is a deployment of its own: one job through several would be measured against
    itself (the parameter service profiles a job while it runs alone, and its performance guard
    reads a later, slower phase as interference; see docs/benchmarks.md)."""
    plan = {"sizes": [size], "ops": [op], "inflight": inflight, "seconds": seconds}
    command = [sys.executable, os.path.abspath(__file__), "--program", json.dumps(plan)]
    lines = launch_pslink(variant, command, f"{op} {size_label(size)}", timeout, echo)
    found = [line[len(RESULT):] for line in lines if line.startswith(RESULT)]
    if not found:
        raise RuntimeError(f"pslink {variant} {op} {size_label(size)}: no result\n" + "\n".join(lines[-20:]))
    return json.loads(found[-1])[0]


def run_cpp(binary: str, transport: str, size: int, op: str, inflight: int, seconds: float,
            timeout: float) -> dict:
    outputs = pslite_cpp.run(binary, [size, op, inflight, seconds], transport=transport, timeout=timeout)
    return json.loads(pslite_cpp.result(outputs["worker0"], CPP_RESULT))


def schedule(cpp: list[str], pslink: list[str]) -> list[tuple[str, str]]:
    """C++ and pslink variants interleaved (C++ first), the longer list's rest at the end."""
    order = []
    for i in range(max(len(cpp), len(pslink))):
        if i < len(cpp):
            order.append(("ps-lite", cpp[i]))
        if i < len(pslink):
            order.append(("pslink", pslink[i]))
    return order


# -- figures and the table ----------------------------------------------------------------------------


def make_figures(runs: dict, pslink: list[str], cpp: list[str], sizes, ops, inflight: int, rounds: int,
                 commit: str | None) -> dict:
    """One figure per (op, size, pslink variant): against its matching ps-lite transport when
    ps-lite ran, else unanchored. ``runs[(side, variant, op, size)]`` holds one MB/s (or None for
    a failed case) per round."""
    out = {}
    for op in ops:
        for size in sizes:
            for variant in pslink:
                mine = runs[("pslink", variant, op, size)]
                what = f"{op} {size_label(size)}, pslink {variant} (1 server x 1 worker, {inflight} in flight)"
                if not any(v is not None for v in mine):
                    continue  # failed in every round: said when it happened, no figure
                anchor_variant = MATCH[variant] if MATCH[variant] in cpp else (cpp[0] if cpp else None)
                if commit is None or anchor_variant is None:
                    missing = NOT_RUN if commit is None else "no C++ ps-lite transport chosen (--cpp-variants)"
                    out[(op, size, variant)] = figures.unanchored(
                        "pslite_bench", what, "MB/s", "higher", [v for v in mine if v is not None], missing)
                    continue
                theirs = runs[("ps-lite", anchor_variant, op, size)]
                pairs = [(a, b) for a, b in zip(mine, theirs) if a is not None and b]
                anchor = f"C++ ps-lite {anchor_variant} ({commit[:12]})"
                if not pairs:
                    out[(op, size, variant)] = figures.unanchored(
                        "pslite_bench", what, "MB/s", "higher", [v for v in mine if v is not None],
                        f"{anchor} failed in every round (errors above)")
                    continue
                out[(op, size, variant)] = figures.measured("pslite_bench", what, "MB/s", "higher",
                                                            [a for a, _ in pairs], anchor, [b for _, b in pairs])
    return out


#: pslink's own local paths, each against the one below it, measured in the same rounds: the Unix
#: socket against TCP loopback, and the shared-memory rings (payloads of 64 KiB and up) against the
#: Unix socket alone. What README's "Addresses" paragraph rests on.
LOCAL_PATHS = (("uds", "tcp", "Unix socket", "TCP loopback"), ("classic", "uds", "shared-memory rings", "Unix socket"))


def local_path_figures(runs: dict, pslink: list[str], sizes, ops, inflight: int) -> list:
    out = []
    for variant, base, name, base_name in LOCAL_PATHS:
        if variant not in pslink or base not in pslink:
            continue
        for op in ops:
            for size in sizes:
                pairs = [(a, b) for a, b in zip(runs[("pslink", variant, op, size)], runs[("pslink", base, op, size)])
                         if a is not None and b]
                if pairs:
                    out.append(figures.measured(
                        "pslite_bench", f"{op} {size_label(size)}, pslink over the {name} ({inflight} in flight)",
                        "MB/s", "higher", [a for a, _ in pairs], f"pslink over the {base_name}",
                        [b for _, b in pairs]))
    return out


def print_table(runs: dict, figs: dict, order, sizes, ops, cpp_ran: bool) -> None:
    columns = [f"{side} {variant}" for side, variant in order]
    pslink = [variant for side, variant in order if side == "pslink"]
    head = ["op", "size"] + [c + " MB/s" for c in columns]
    if cpp_ran:
        head += [f"{v}/{figs_anchor(figs, v)}" for v in pslink]
    rows = []
    for op in ops:
        for size in sizes:
            row = [op, size_label(size)]
            for side, variant in order:
                got = [v for v in runs[(side, variant, op, size)] if v is not None]
                row.append(f"{statistics.median(got):.1f}" if got else "failed")
            if cpp_ran:
                for variant in pslink:
                    fig = figs.get((op, size, variant))
                    row.append(f"{fig.ratio:.2f}" if fig is not None and fig.ratio is not None else "-")
            rows.append(row)
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]

    def fmt(r):
        return " | ".join(s.rjust(widths[i]) if i > 1 else s.ljust(widths[i]) for i, s in enumerate(r))

    print(fmt(head))
    print("-|-".join("-" * w for w in widths))
    for r in rows:
        print(fmt(r))
    rounds = max((len([v for v in vs if v is not None]) for vs in runs.values()), default=0)
    print(f"medians of up to {rounds} rounds" + ("; ratio columns: pslink variant / the ps-lite transport it "
                                                   "matches (figures below: spread over the rounds)" if cpp_ran else ""))


def figs_anchor(figs: dict, variant: str) -> str:
    for (_, _, v), fig in figs.items():
        if v == variant and fig.anchor:
            return fig.anchor.split()[2]  # "C++ ps-lite tcp (...)" -> "tcp"
    return MATCH[variant]


# -- ps-lite's own tests/test_kv_app_benchmark, unchanged, beside its port -----------------------------


def _kv_app_costs(text: str, what: str) -> dict:
    costs = {op.lower(): float(ms) for op, ms in KV_APP_COST.findall(text)}
    if set(costs) != {"push", "pull"}:
        raise RuntimeError(f"{what}: no 'Push/Pull average time cost' lines in its output:\n{text[-1500:]}")
    return costs


def kv_app_benchmark(root: str, deps_path: str, pslink: list[str], cpp: list[str], rounds: int, timeout: float,
                     commit: str, echo: bool) -> tuple[dict, list]:
    """ps-lite's tests/test_kv_app_benchmark (10M keys of one float, one push and one pull, timed),
    built by its Makefile and run unchanged, alternating with benchmarks/pslite_kv_app_benchmark.py
    (its port) on pslink's classic variants; figures in ms, against the matching transport."""
    binary = pslite_cpp.build_test(root, "test_kv_app_benchmark", deps_path)
    variants = [v for v in pslink if v in KV_APP_VARIANTS]
    order = schedule(cpp, variants)
    runs: dict = {(side, v, op): [] for side, v in order for op in ("push", "pull")}
    print(f"ps-lite's tests/test_kv_app_benchmark ({binary}) beside its port ({KV_APP_PORT}); order: "
          + ", ".join(f"{s_} {v}" for s_, v in order), flush=True)
    for r in range(rounds):
        line = []
        for side, variant in (order if r % 2 == 0 else order[::-1]):
            try:
                if side == "ps-lite":
                    outputs = pslite_cpp.run(binary, [], transport=variant, timeout=timeout)
                    costs = _kv_app_costs(outputs["worker0"], f"C++ ps-lite {variant}")
                else:
                    lines = launch_pslink(variant, [sys.executable, KV_APP_PORT], "test_kv_app_benchmark", timeout,
                                          echo)
                    costs = _kv_app_costs("\n".join(lines), f"pslink {variant}")
            except RuntimeError as exc:
                print(f"  round {r + 1}: test_kv_app_benchmark {side} {variant} failed: {exc}", file=sys.stderr)
                costs = {"push": None, "pull": None}
            for op in ("push", "pull"):
                runs[(side, variant, op)].append(costs[op])
            line.append(f"{side} {variant} push {costs['push']} ms pull {costs['pull']} ms")
        print(f"  round {r + 1} test_kv_app_benchmark: " + ", ".join(line), file=sys.stderr, flush=True)
    figs, medians = [], {}
    for (side, variant, op), values in runs.items():
        got = [v for v in values if v is not None]
        medians[f"{side} {variant} {op}_ms"] = round(statistics.median(got), 1) if got else None
    for op in ("push", "pull"):
        for variant in variants:
            anchor_variant = MATCH[variant] if MATCH[variant] in cpp else cpp[0]
            pairs = [(a, b) for a, b in zip(runs[("pslink", variant, op)], runs[("ps-lite", anchor_variant, op)])
                     if a is not None and b]
            what = f"test_kv_app_benchmark {op} (10M keys x 1 float, once), pslink {variant}"
            anchor = f"C++ ps-lite {anchor_variant}, its test unchanged ({commit[:12]})"
            if pairs:
                figs.append(figures.measured("pslite_bench", what, "ms", "lower", [a for a, _ in pairs], anchor,
                                             [b for _, b in pairs]))
            elif any(v is not None for v in runs[("pslink", variant, op)]):
                figs.append(figures.unanchored("pslite_bench", what, "ms", "lower",
                                               [v for v in runs[("pslink", variant, op)] if v is not None],
                                               f"{anchor} failed in every round (errors above)"))
    return medians, figs


# -- the driver ---------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pslite", metavar="PATH", help="a dmlc/ps-lite checkout: build it and run it alongside")
    parser.add_argument("--sizes", default="4K,256K,4M,64M", help="value sizes in bytes (comma separated)")
    parser.add_argument("--ops", default=",".join(OPS))
    parser.add_argument("--variants", "--modes", dest="variants", default=",".join(PSLINK_VARIANTS),
                        help=f"pslink variants to run ({', '.join(PSLINK_VARIANTS)})")
    parser.add_argument("--cpp-variants", default=",".join(CPP_VARIANTS),
                        help="C++ ps-lite transports to run with --pslite (tcp, ipc)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds (every case once each)")
    parser.add_argument("--inflight", type=int, default=4, help="requests in flight")
    parser.add_argument("--seconds", type=float, default=1.0, help="timed duration of each case")
    parser.add_argument("--case-timeout", type=float, default=180.0, help="seconds before a case is stopped")
    parser.add_argument("--deps-path", default="/usr", help="prefix of ZeroMQ and protobuf for ps-lite's Makefile")
    parser.add_argument("--quick", action="store_true",
                        help="a smoke run: 4K and 256K zpushpull, 0.2 s per case, 2 rounds")
    parser.add_argument("--kv-app-benchmark", action=argparse.BooleanOptionalAction, default=None,
                        help="also run ps-lite's tests/test_kv_app_benchmark beside its port (default: with "
                             "--pslite, unless --quick)")
    parser.add_argument("--echo", action="store_true", help="show the deployments' own output")
    parser.add_argument("--program", help=argparse.SUPPRESS)  # set when this file runs as a node
    args = parser.parse_args(argv)
    if args.program is not None:
        return program(json.loads(args.program))
    if args.quick:
        args.sizes, args.ops, args.seconds, args.rounds = "4K,256K", "zpushpull", 0.2, 2
    sizes = [parse_size(s) for s in args.sizes.split(",") if s]
    ops = [op for op in args.ops.split(",") if op]
    pslink = [v for v in args.variants.split(",") if v]
    cpp = [v for v in args.cpp_variants.split(",") if v] if args.pslite else []
    for op in ops:
        if op not in OPS:
            parser.error(f"unknown op {op!r}; use {', '.join(OPS)}")
    for v in pslink:
        if v not in PSLINK_VARIANTS:
            parser.error(f"unknown pslink variant {v!r}; use {', '.join(PSLINK_VARIANTS)}")
    for v in cpp:
        if v not in CPP_VARIANTS:
            parser.error(f"unknown C++ ps-lite variant {v!r}; use {', '.join(CPP_VARIANTS)}")
    if args.rounds < 1 or args.inflight < 1 or args.seconds <= 0:
        parser.error("--rounds and --inflight must be at least 1, --seconds above 0")

    if args.kv_app_benchmark is None:
        args.kv_app_benchmark = bool(args.pslite) and not args.quick
    if args.kv_app_benchmark and not args.pslite:
        parser.error("--kv-app-benchmark runs ps-lite's own test: give --pslite PATH")
    commit = binary = root = None
    if args.pslite:
        try:
            root = pslite_cpp.checkout(args.pslite)
            commit = pslite_cpp.commit(root)
            print(f"building C++ ps-lite {commit} in {root} (its Makefile, DEPS_PATH={args.deps_path}) ...",
                  flush=True)
            binary = pslite_cpp.build_driver(root, CPP_DRIVER, args.deps_path)
        except pslite_cpp.PsliteError as exc:
            print(f"pslite_bench: {exc}", file=sys.stderr)
            return 2
    order = schedule(cpp, pslink)
    print(f"pslink pslite bench on {platform.node()} ({os.cpu_count()} CPUs, Python {platform.python_version()}): "
          f"1 server x 1 worker, {args.inflight} in flight, {args.seconds:g} s per case, {args.rounds} round(s); "
          + (f"C++ ps-lite {commit} ({binary})" if commit else "C++ ps-lite not run (no --pslite)")
          + f"; order per case: {', '.join(f'{s} {v}' for s, v in order)} (reversed on every other round)",
          flush=True)

    runs: dict = {(side, variant, op, size): [] for side, variant in order for op in ops for size in sizes}
    latency: dict = {key: [] for key in runs}
    failures = 0
    started = time.monotonic()
    for r in range(args.rounds):
        sequence = order if r % 2 == 0 else order[::-1]
        for size in sizes:
            for op in ops:
                line = []
                for side, variant in sequence:
                    try:
                        if side == "ps-lite":
                            got = run_cpp(binary, variant, size, op, args.inflight, args.seconds, args.case_timeout)
                        else:
                            got = run_pslink(variant, size, op, args.inflight, args.seconds, args.case_timeout,
                                             args.echo)
                        mbps, lat = got["MBps"], got["seconds"] / got["count"] * 1e6
                    except (RuntimeError, ValueError, KeyError) as exc:  # PsliteError is a RuntimeError
                        print(f"  round {r + 1}: {side} {variant} {op} {size_label(size)} failed: {exc}",
                              file=sys.stderr, flush=True)
                        failures += 1
                        mbps = lat = None
                    runs[(side, variant, op, size)].append(mbps)
                    latency[(side, variant, op, size)].append(lat)
                    line.append(f"{side} {variant} {'failed' if mbps is None else f'{mbps:.1f}'}")
                print(f"  round {r + 1} {op} {size_label(size)}: " + ", ".join(line), file=sys.stderr, flush=True)
    elapsed = time.monotonic() - started

    figs = make_figures(runs, pslink, cpp, sizes, ops, args.inflight, args.rounds, commit)
    print_table(runs, figs, order, sizes, ops, commit is not None)
    for fig in figs.values():
        figures.emit(fig)
    local_figs = local_path_figures(runs, pslink, sizes, ops, args.inflight)
    for fig in local_figs:
        figures.emit(fig)
    kv_app, kv_app_figs = None, []
    if args.kv_app_benchmark and cpp and any(v in KV_APP_VARIANTS for v in pslink):
        try:
            kv_app, kv_app_figs = kv_app_benchmark(root, args.deps_path, pslink, cpp, args.rounds, args.case_timeout,
                                                   commit, args.echo)
        except pslite_cpp.PsliteError as exc:
            print(f"ps-lite's test_kv_app_benchmark not run: {exc}", file=sys.stderr)
        for fig in kv_app_figs:
            figures.emit(fig)
    elif args.pslite:
        print("ps-lite's test_kv_app_benchmark not run (" + ("--quick" if args.quick else "--no-kv-app-benchmark, "
              "or no classic variant or C++ transport chosen") + ")")

    def med(xs):
        xs = [x for x in xs if x is not None]
        return round(statistics.median(xs), 1) if xs else None

    cases, cpp_cases = [], []
    for (side, variant, op, size), values in runs.items():
        row = {"variant": variant, "op": op, "size": size, "MBps": med(values),
               "latency_us": med(latency[(side, variant, op, size)]),
               "rounds": len([v for v in values if v is not None])}
        if side == "pslink":
            row["mode"] = PSLINK_VARIANTS[variant][0]
            fig = figs.get((op, size, variant))
            if fig is not None and fig.ratio is not None:
                row["vs_pslite"] = round(fig.ratio, 2)
            cases.append(row)
        else:
            cpp_cases.append(row)
    print(f"{len(runs) * args.rounds} cases in {elapsed:.0f} s, {failures} failed", file=sys.stderr)
    print(json.dumps({
        "benchmark": "pslite", "host": platform.node(), "cpus": os.cpu_count(), "servers": 1, "workers": 1,
        "inflight": args.inflight, "seconds_per_case": args.seconds, "rounds": args.rounds,
        "modes": sorted({PSLINK_VARIANTS[v][0] for v in pslink}), "variants": pslink,
        "pslite_commit": commit, "pslite_variants": cpp, "failed_cases": failures,
        "cases": cases, "pslite_cases": cpp_cases, "kv_app_benchmark_ms": kv_app,
        "figures": [f.as_json() for f in [*figs.values(), *local_figs, *kv_app_figs]],
    }))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
