"""Bare 4 KiB round trips between two processes: pyzmq against Python sockets.

Why pslink's default transport is not ZeroMQ (docs/transport.md, table 1): every ZeroMQ message
crosses libzmq's I/O thread on both sides, and on a virtual machine each thread wake-up costs
more than the loopback trip itself. Prints p10/p50/p90 per variant and a JSON line.

    python benchmarks/roundtrip.py [--trips 10000]
"""

import argparse
import json
import sys

import numpy as np

from pslink.bench import raw

SIZE = 4096


def percentiles(samples: list) -> dict:
    p10, p50, p90 = np.percentile(np.array(samples) * 1e6, [10, 50, 90])
    return {"p10_us": round(float(p10), 1), "p50_us": round(float(p50), 1), "p90_us": round(float(p90), 1)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trips", type=int, default=10_000)
    args = parser.parse_args(argv)
    results = {
        "pyzmq DEALER/ROUTER": percentiles(raw.zmq_round_trips(SIZE, args.trips)),
        "sockets, blocking": percentiles(raw.socket_round_trips(SIZE, args.trips)),
        "sockets, poll 50 us then block": percentiles(raw.socket_round_trips(SIZE, args.trips, spin=50e-6)),
    }
    for name, r in results.items():
        print(f"{name:32s} p10 {r['p10_us']:7.1f} us  p50 {r['p50_us']:7.1f} us  p90 {r['p90_us']:7.1f} us")
    print(json.dumps({"benchmark": "roundtrip", "bytes": SIZE, "trips": args.trips, "results": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
