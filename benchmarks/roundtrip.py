"""Bare 4 KiB round trips between two processes: pyzmq against Python sockets.

Why pslink's default transport is not ZeroMQ (docs/transport.md, table 1): every ZeroMQ message
crosses libzmq's I/O thread on both sides, and on a virtual machine each thread wake-up costs
more than the loopback trip itself. Three variants, ``--trips`` round trips each per round, in
``--rounds`` rounds (each round starting with the next variant): pyzmq DEALER/ROUTER (the anchor),
blocking Python sockets, and Python sockets that poll 50 us before blocking (what pslink's own
transport does). Figures: each socket variant's median round trip against pyzmq's of the same
rounds (lower is better). Prints p10/p50/p90 per variant over all rounds and a JSON line.

    python benchmarks/roundtrip.py [--trips 10000] [--rounds 5]
    python benchmarks/roundtrip.py --quick    # 2,000 trips, 5 rounds: a few seconds
"""

import argparse
import json
import statistics
import sys

import numpy as np

from pslink.bench import figures, raw

SIZE = 4096
ZMQ = "pyzmq DEALER/ROUTER"
VARIANTS = {
    ZMQ: lambda trips: raw.zmq_round_trips(SIZE, trips),
    "sockets, blocking": lambda trips: raw.socket_round_trips(SIZE, trips),
    "sockets, poll 50 us then block": lambda trips: raw.socket_round_trips(SIZE, trips, spin=50e-6),
}


def percentiles(samples: list) -> dict:
    p10, p50, p90 = np.percentile(np.array(samples) * 1e6, [10, 50, 90])
    return {"p10_us": round(float(p10), 1), "p50_us": round(float(p50), 1), "p90_us": round(float(p90), 1)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trips", type=int, default=10_000, help="round trips of each variant per round")
    parser.add_argument("--rounds", type=int, default=5, help="rounds of every variant, alternating")
    parser.add_argument("--quick", action="store_true", help="2,000 trips, 5 rounds (a smoke run)")
    args = parser.parse_args(argv)
    if args.quick:
        args.trips, args.rounds = 2_000, 5
    if args.trips < 10:
        parser.error(f"--trips must be at least 10, got {args.trips}")
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    names = list(VARIANTS)
    samples: dict[str, list[float]] = {name: [] for name in names}
    p50: dict[str, list[float]] = {name: [] for name in names}  # one median per round, in us
    for index in range(args.rounds):
        # Each round starts with the next variant: a fixed order would charge one with the host's drift.
        for name in names[index % len(names):] + names[:index % len(names)]:
            trips = VARIANTS[name](args.trips)
            samples[name].extend(trips)
            p50[name].append(statistics.median(trips) * 1e6)
    results = {name: percentiles(s) for name, s in samples.items()}
    for name, r in results.items():
        print(f"{name:32s} p10 {r['p10_us']:7.1f} us  p50 {r['p50_us']:7.1f} us  p90 {r['p90_us']:7.1f} us")
    figs = [figures.measured("roundtrip", f"4 KiB round trip between two processes, {name} (median)", "us", "lower",
                             p50[name], ZMQ, p50[ZMQ]) for name in names if name != ZMQ]
    for fig in figs:
        figures.emit(fig)
    print(json.dumps({"benchmark": "roundtrip", "bytes": SIZE, "trips": args.trips, "rounds": args.rounds,
                      "results": results, "figures": [fig.as_json() for fig in figs]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
