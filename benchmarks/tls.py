"""What TLS costs the data path: pushpull over TCP with and without TLS, alternated in one run.

Each variant is ``benchmarks/pushpull.py`` (1 worker, pushpull; 4 KiB with 1 request in flight
for latency, 4 MiB and 64 MiB with 4 in flight for throughput) in a process of its own with
``PSLINK_LOCAL_SOCKETS=0`` (every peer on TCP: on one host they would otherwise meet on the Unix
socket, which TLS leaves alone), the TLS one with ``PSLINK_TLS_*`` pointing at a CA and a
certificate made here with ``openssl``. Variants alternate ``--repeats`` times; the report is
the median of each and the ratio TLS / clear (target at 4 MiB: TLS costs at most 30%). Ends with
one JSON line.

    python benchmarks/tls.py             # 3 alternations, 2 s per case
    python benchmarks/tls.py --quick     # 1 alternation, 0.5 s per case
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
TARGET_COST = 0.30


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


def run(env: dict, sizes: str, inflight: str, seconds: float) -> dict:
    out = subprocess.run([sys.executable, os.path.join(HERE, "pushpull.py"), "--sizes", sizes, "--workers", "1",
                          "--inflight", inflight, "--ops", "pushpull", "--seconds", str(seconds)],
                         env=env, capture_output=True, text=True, timeout=1200)
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-2000:])
    result = json.loads(out.stdout.strip().splitlines()[-1])
    return {(c["size"], c["inflight"]): c for c in result["cases"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.repeats, args.seconds = 1, 0.5
    pki = make_pki(tempfile.mkdtemp(prefix="pslink-tls-bench-"))
    base = {k: v for k, v in os.environ.items() if not k.startswith("PSLINK_TLS_")}
    base["PSLINK_LOCAL_SOCKETS"] = "0"
    variants = {"clear": base, "tls": dict(base, **pki)}
    figures: dict = {name: {"lat_4K_us": [], "MBps_4M": [], "MBps_64M": []} for name in variants}
    for index in range(args.repeats):
        for name, env in variants.items():
            latency = run(env, "4K", "1", args.seconds)[(4096, 1)]["latency_us"]
            bulk = run(env, "4M,64M", "4", args.seconds)
            figures[name]["lat_4K_us"].append(latency)
            figures[name]["MBps_4M"].append(bulk[(4 << 20, 4)]["MBps"])
            figures[name]["MBps_64M"].append(bulk[(64 << 20, 4)]["MBps"])
            print(f"run {index + 1} {name:5}: 4 KiB {latency:.1f} us, 4 MiB {figures[name]['MBps_4M'][-1]:.0f} MB/s, "
                  f"64 MiB {figures[name]['MBps_64M'][-1]:.0f} MB/s", flush=True)
    medians = {name: {k: statistics.median(v) for k, v in f.items()} for name, f in figures.items()}
    cost = {
        "lat_4K": medians["tls"]["lat_4K_us"] / medians["clear"]["lat_4K_us"] - 1,
        "MBps_4M": 1 - medians["tls"]["MBps_4M"] / medians["clear"]["MBps_4M"],
        "MBps_64M": 1 - medians["tls"]["MBps_64M"] / medians["clear"]["MBps_64M"],
    }
    print(f"TLS costs: 4 KiB latency +{cost['lat_4K']:.0%}, 4 MiB throughput -{cost['MBps_4M']:.0%} "
          f"(target <= {TARGET_COST:.0%}: {'met' if cost['MBps_4M'] <= TARGET_COST else 'NOT met'}), "
          f"64 MiB throughput -{cost['MBps_64M']:.0%}")
    print(json.dumps({"benchmark": "tls", "repeats": args.repeats, "seconds": args.seconds, "figures": figures,
                      "medians": medians, "cost": {k: round(v, 3) for k, v in cost.items()}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
