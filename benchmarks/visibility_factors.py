"""One factor of benchmarks/visibility.py at a time: 4 KiB pushpull latency against two services
that differ only in it, alternating (each round starting with the other).

    python benchmarks/visibility_factors.py same      # two identical services: the noise
    python benchmarks/visibility_factors.py stall     # stall inspector off (a) vs on at 10 s (b)
    python benchmarks/visibility_factors.py metrics   # no HTTP (a) vs /metrics scraped every second (b)
    python benchmarks/visibility_factors.py stall --quick   # 4 rounds of 1 s: under a minute

``--rounds`` (default: PSLINK_FACTOR_ROUNDS, else 10) sets the rounds. The figure: b's latency
against a's (the anchor), paired round by round (lower is better).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

FACTORS = {"same": ("a second, identical service", "one service"),
           "stall": ("stall inspector on at 10 s", "stall inspector off"),
           "metrics": ("/metrics scraped every second", "no HTTP endpoint")}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("factor", nargs="?", default="same", help=f"one of {', '.join(FACTORS)}")
    parser.add_argument("--rounds", type=int, default=None, help="alternating rounds (default 10)")
    parser.add_argument("--seconds", type=float, default=1.5, help="seconds of each latency run")
    parser.add_argument("--quick", action="store_true", help="4 rounds of 1 s (a smoke run)")
    args = parser.parse_args(argv)
    if args.factor not in FACTORS:
        parser.error(f"unknown factor {args.factor!r}: one of {', '.join(FACTORS)}")
    if args.rounds is None:
        try:
            args.rounds = int(os.environ.get("PSLINK_FACTOR_ROUNDS", "10"))
        except ValueError:
            parser.error(f"PSLINK_FACTOR_ROUNDS must be a whole number, got {os.environ['PSLINK_FACTOR_ROUNDS']!r}")
    if args.quick:
        args.rounds, args.seconds = 4, 1.0
    if args.rounds < 1 or args.seconds <= 0:
        parser.error(f"--rounds must be at least 1 and --seconds above 0 (got {args.rounds}, {args.seconds})")

    from visibility import latency, scraper

    from pslink.bench import figures
    from pslink.core.service import Service

    mode = args.factor
    os.environ["PSLINK_STALL_SECONDS"] = "0"
    a = Service(aggregators=1).start()
    stop = threading.Event()
    try:
        if mode == "stall":
            os.environ["PSLINK_STALL_SECONDS"] = "10"
            b = Service(aggregators=1).start()
        elif mode == "same":
            b = Service(aggregators=1).start()
        else:
            b = Service(aggregators=1, master_options={"metrics_port": 0}).start()
            threading.Thread(target=scraper, args=(b.master.observing.http_address, stop, []), daemon=True).start()
    except BaseException:
        a.stop()
        raise
    ra, rb = [], []
    try:
        for i in range(args.rounds):
            pairs = (("a", a, ra), ("b", b, rb))
            for name, service, into in pairs if i % 2 == 0 else pairs[::-1]:
                into.append(latency(service.address, f"{mode}-{name}{i}", args.seconds) * 1e6)
    finally:
        stop.set()
        a.stop()
        b.stop()
    changed, anchor = FACTORS[mode]
    fig = figures.measured("visibility_factors", f"4 KiB pushpull latency, 1 worker, {changed} (b)", "us", "lower",
                           rb, f"{anchor} (a)", ra)
    figures.emit(fig)
    print(json.dumps({"benchmark": "visibility_factors", "factor": mode, "rounds": args.rounds,
                      "seconds": args.seconds, "figures": [fig.as_json()]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
