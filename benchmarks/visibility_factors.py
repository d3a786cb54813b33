"""One factor of benchmarks/visibility.py at a time: 4 KiB pushpull latency against two services
that differ only in it, alternating (each round starting with the other).

    python benchmarks/visibility_factors.py same      # two identical services: the noise
    python benchmarks/visibility_factors.py stall     # stall inspector off (a) vs on at 10 s (b)
    python benchmarks/visibility_factors.py metrics   # no HTTP (a) vs /metrics scraped every second (b)

PSLINK_FACTOR_ROUNDS sets the rounds (default 10). Prints the medians, b / a and each round's ratio.
"""

from __future__ import annotations

import os
import statistics
import sys
import threading

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main() -> int:
    from visibility import latency, scraper

    from pslink.core.service import Service

    mode = sys.argv[1] if len(sys.argv) > 1 else "same"
    if mode not in ("same", "stall", "metrics"):
        raise SystemExit(f"unknown factor {mode!r}: same, stall or metrics")
    rounds = int(os.environ.get("PSLINK_FACTOR_ROUNDS", "10"))
    os.environ["PSLINK_STALL_SECONDS"] = "0"
    a = Service(aggregators=1).start()
    stop = threading.Event()
    if mode == "stall":
        os.environ["PSLINK_STALL_SECONDS"] = "10"
        b = Service(aggregators=1).start()
    elif mode == "same":
        b = Service(aggregators=1).start()
    else:
        b = Service(aggregators=1, master_options={"metrics_port": 0}).start()
        threading.Thread(target=scraper, args=(b.master.observing.http_address, stop, []), daemon=True).start()
    ra, rb = [], []
    try:
        for i in range(rounds):
            pairs = (("a", a, ra), ("b", b, rb))
            for name, service, into in pairs if i % 2 == 0 else pairs[::-1]:
                into.append(latency(service.address, f"{mode}-{name}{i}", 1.5))
    finally:
        stop.set()
        a.stop()
        b.stop()
    print(f"{mode}: a {statistics.median(ra) * 1e6:.1f} us, b {statistics.median(rb) * 1e6:.1f} us, b / a "
          f"{statistics.median(rb) / statistics.median(ra):.3f}; rounds {[round(y / x, 2) for x, y in zip(ra, rb)]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
