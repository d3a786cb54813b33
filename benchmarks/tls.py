"""What TLS costs the data path: pushpull over TCP with and without TLS, alternated in one run.

Each variant is ``benchmarks/pushpull.py`` (1 worker, pushpull; 4 KiB with 1 request in flight
for latency, 4 MiB and 64 MiB with 4 in flight for throughput) in a process of its own with
``PSLINK_LOCAL_SOCKETS=0`` (every peer on TCP: on one host they would otherwise meet on the Unix
socket, which TLS leaves alone), the TLS one with ``PSLINK_TLS_*`` pointing at a CA and a
certificate made here with ``openssl``. The anchor is the same run in clear (plain TCP): the two
alternate ``--rounds`` times, the order reversed on every other round, and each figure is TLS
against clear, round by round (the project's goal at 4 MiB: TLS costs at most 30%). Ends with
one JSON line.

    python benchmarks/tls.py             # 3 rounds, 2 s per case, 4 KiB, 4 MiB and 64 MiB
    python benchmarks/tls.py --quick     # 2 rounds, 0.3 s per case, 4 KiB and 4 MiB
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from pslink.bench import figures

GOAL_COST = 0.30  # the project's goal for TLS at 4 MiB, judged on the ratio measured here


def make_pki(directory: str) -> dict:
    def openssl(*args):
        subprocess.run(["openssl", *args], cwd=directory, check=True, capture_output=True, timeout=60)

    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=bench-ca",
            "-keyout", "ca.key", "-out", "ca.pem")
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=pslink", "-keyout", "peer.key", "-out", "peer.csr")
    openssl("x509", "-req", "-in", "peer.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial", "-days", "2",
            "-out", "peer.pem")
    return {"PSLINK_TLS_CERT": os.path.join(directory, "peer.pem"),
            "PSLINK_TLS_KEY": os.path.join(directory, "peer.key"),
            "PSLINK_TLS_CA": os.path.join(directory, "ca.pem")}


def run(env: dict, sizes: str, inflight: str, seconds: float, timeout: float = 1200) -> dict:
    """One pushpull.py process, one round, no raw anchor of its own (the clear run is the anchor
    here): its cases by (size, in flight)."""
    command = [sys.executable, os.path.join(HERE, "pushpull.py"), "--sizes", sizes, "--workers", "1",
               "--inflight", inflight, "--ops", "pushpull", "--seconds", str(seconds), "--rounds", "1", "--no-raw"]
    try:
        out = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"{' '.join(command)} did not finish in {timeout:.0f} s") from None
    if out.returncode != 0:
        raise RuntimeError(f"pushpull.py exited with status {out.returncode}:\n{out.stderr[-2000:]}")
    result = json.loads(out.stdout.strip().splitlines()[-1])
    return {(c["size"], c["inflight"]): c for c in result["cases"]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", "--repeats", dest="rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--quick", action="store_true", help="2 rounds, 0.3 s per case, no 64 MiB")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.seconds = 2, 0.3
    if args.rounds < 1 or args.seconds <= 0:
        parser.error("--rounds must be at least 1 and --seconds above 0")
    if shutil.which("openssl") is None:
        print("tls: needs the openssl command to make a test CA (apt-get install openssl)", file=sys.stderr)
        return 2
    bulk_sizes = [4 << 20] if args.quick else [4 << 20, 64 << 20]
    labels = {4 << 20: "4M", 64 << 20: "64M"}
    scratch = tempfile.TemporaryDirectory(prefix="pslink-tls-bench-")
    pki = make_pki(scratch.name)
    base = {k: v for k, v in os.environ.items() if not k.startswith("PSLINK_TLS_")}
    base["PSLINK_LOCAL_SOCKETS"] = "0"
    variants = {"clear": base, "tls": dict(base, **pki)}
    measured: dict = {name: {"lat_4K_us": [], **{f"MBps_{labels[s]}": [] for s in bulk_sizes}} for name in variants}
    try:
        for r in range(args.rounds):
            for name in (list(variants) if r % 2 == 0 else list(variants)[::-1]):
                latency = run(variants[name], "4K", "1", args.seconds)[(4096, 1)]["latency_us"]
                bulk = run(variants[name], ",".join(labels[s] for s in bulk_sizes), "4", args.seconds)
                measured[name]["lat_4K_us"].append(latency)
                for s in bulk_sizes:
                    measured[name][f"MBps_{labels[s]}"].append(bulk[(s, 4)]["MBps"])
                print(f"round {r + 1} {name:5}: 4 KiB {latency:.1f} us, " + ", ".join(
                    f"{labels[s]} {measured[name][f'MBps_{labels[s]}'][-1]:.0f} MB/s" for s in bulk_sizes), flush=True)
    finally:
        scratch.cleanup()

    anchor = "the same run over plain TCP"
    figs = [figures.measured("tls", "pushpull 4K over TLS, 1 worker, 1 in flight, latency", "us", "lower",
                             measured["tls"]["lat_4K_us"], anchor, measured["clear"]["lat_4K_us"])]
    for s in bulk_sizes:
        key = f"MBps_{labels[s]}"
        figs.append(figures.measured("tls", f"pushpull {labels[s]} over TLS, 1 worker, 4 in flight", "MB/s",
                                     "higher", measured["tls"][key], anchor, measured["clear"][key]))
    for fig in figs:
        figures.emit(fig)
    cost_4m = 1 - figs[1].ratio
    print(f"TLS costs: 4 KiB latency {figs[0].ratio - 1:+.0%}, 4 MiB throughput {-cost_4m:+.0%} "
          f"(goal: at most -{GOAL_COST:.0%}: {'met' if cost_4m <= GOAL_COST else 'NOT met'})"
          + (f", 64 MiB throughput {figs[2].ratio - 1:+.0%}" if len(figs) > 2 else ""))
    medians = {name: {k: statistics.median(v) for k, v in f.items()} for name, f in measured.items()}
    print(json.dumps({"benchmark": "tls", "rounds": args.rounds, "seconds": args.seconds, "values": measured,
                      "medians": medians, "cost_4M": round(cost_4m, 3), "goal_met": cost_4m <= GOAL_COST,
                      "figures": [f.as_json() for f in figs]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
