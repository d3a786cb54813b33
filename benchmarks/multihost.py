"""pslink across hosts: network namespaces on one machine, links shaped like NICs (``tc ... tbf``).

    sudo python benchmarks/multihost.py                  # 10 Gbit/s and 1 Gbit/s links
    sudo python benchmarks/multihost.py --quick          # a smoke run: 1 Gbit/s links, 4 MiB only

For each link rate, hosts A and B (each link shaped to the rate in both directions) and, in
one run, alternating the variants ``--repeats`` times (one run of each per round, the order
reversed every other round):

- **raw TCP**: one Python socket stream A -> B for ``--seconds`` (no pslink code): what the link
  carries;
- **pushpull**: one worker on A, pMaster and its one Aggregator on B; value MB/s seen by the
  worker for 4 MiB and 64 MiB pushpulls, 4 in flight (as ps-lite's benchmark runs; ``--inflight``,
  and ``--unfused`` for the same with fusion off). A pushpull sends its value and receives the
  sum, so a full-duplex link could carry it at the raw rate (the goal: at least 0.8x raw TCP at
  4 MiB);
- **DDP**: 2 workers, rank 0 on A and rank 1 on B, training the MLP of ``benchmarks/torch_ddp.py``;
  "gloo" is DDP's own all-reduce, "pslink" the comm hook with an Aggregator on each worker host
  (pMaster on A with its own Aggregator, one joined from B with ``pslink aggregator``, as BytePS
  co-locates servers with workers), and "alone" the limit: each worker training by itself, no
  communication (the goal: the hook at most 1.0x gloo on the same links). The job's parts are
  1 MiB (``--partition``; the default is 4 MiB): a part's sum crosses back only once the part
  crossed, so the last part of a step costs two crossings, and smaller parts shorten that tail.

Reported as figures (``pslink.bench.figures``), per link rate: each pushpull size against raw TCP
over the same link, fused against unfused (with ``--unfused``), and the DDP hook against gloo and
against the limit, each with the spread of the rounds' own ratios. The last line is JSON. Needs
root (namespaces); without it, it says why and exits. Nothing is added to the machine's own
network: the hosts sit on a bridge of their own.
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
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

from pslink.bench import figures as fig  # noqa: E402
from pslink.bench import netns  # noqa: E402
from pslink.bench.pushpull import parse_size, size_label  # noqa: E402

PYTHON = sys.executable
PSLINK = [PYTHON, "-m", "pslink.cli"]
RAW_PORT, MASTER_PORT = 9700, 7770


# -- roles run inside a host ------------------------------------------------------------------------


def role_raw_receive(args) -> None:
    import socket

    from pslink.bench import raw

    with socket.socket() as server:
        server.bind((args.bind, RAW_PORT))
        server.listen(1)
        print("listening", flush=True)
        print(json.dumps({"MBps": raw.stream_receive(server)}), flush=True)


def role_raw_send(args) -> None:
    from pslink.bench import raw

    raw.stream_send(args.to, RAW_PORT, args.seconds)


def role_pushpull(args) -> None:
    import numpy as np

    import pslink
    from pslink.bench.pushpull import run_ops

    size, inflight = parse_size(args.size), args.inflight
    with pslink.connect(args.job, 0, 1, master=args.master, timeout=300.0) as agent:
        keys = [f"v{i}" for i in range(inflight)]
        arrays = [np.random.default_rng(i).standard_normal(size // 4).astype(np.float32) for i in range(inflight)]
        outs = [np.empty_like(a) for a in arrays]
        agent.init_many(keys, arrays).wait()
        warm = run_ops(agent, "pushpull", keys, arrays, outs, inflight, 2 * inflight)
        count = max(2 * inflight, int(args.seconds / (warm / (2 * inflight))))
        elapsed = run_ops(agent, "pushpull", keys, arrays, outs, inflight, count)
    print(json.dumps({"MBps": count * size / elapsed / 1e6, "ops": count}), flush=True)


# -- the orchestra ----------------------------------------------------------------------------------


def _start(hosts, host, argv, env=None):
    return netns.start_on(hosts, host, argv, cwd=ROOT, env=env)


def _last_json(out: str) -> dict:
    return json.loads([line for line in out.splitlines() if line.startswith("{")][-1])


def measure_raw(hosts, seconds: float) -> float:
    receiver = _start(hosts, "B", [PYTHON, __file__, "--role", "raw-recv", "--bind", hosts.address("B")])
    line = receiver.stdout.readline()
    if "listening" not in line:
        raise SystemExit(f"the raw receiver did not start: {line}{receiver.communicate()[0]}")
    sender = _start(hosts, "A", [PYTHON, __file__, "--role", "raw-send", "--to", hosts.address("B"),
                                 "--seconds", str(seconds)])
    netns.finish(sender, seconds + 60, "the raw sender")
    return _last_json(netns.finish(receiver, 60, "the raw receiver"))["MBps"]


def measure_pushpull(hosts, master: str, size: str, seconds: float, index: int, fused: bool = True,
                     inflight: int = 4) -> float:
    worker = _start(hosts, "A", [PYTHON, __file__, "--role", "pushpull", "--master", master, "--size", size,
                                 "--seconds", str(seconds), "--job", f"pushpull-{size}-{index}-{int(fused)}",
                                 "--inflight", str(inflight)],
                    env=None if fused else {"PSLINK_FUSION_BYTES": "0"})
    return _last_json(netns.finish(worker, seconds * 20 + 120, f"the {size} pushpull worker"))["MBps"]


def measure_ddp(hosts, master: str, variant: str, args, index: int) -> float:
    """Median step time (ms, mean of the two workers) of one DDP run of ``variant``."""
    with tempfile.TemporaryDirectory(prefix=f"pslink-mh-{variant}-") as out:
        os.chmod(out, 0o777)
        procs = []
        for rank, host in enumerate("AB"):
            env = {"PSLINK_RANK": str(rank), "PSLINK_NUM_WORKERS": "2", "PSLINK_MASTER": master,
                   "PSLINK_JOB": f"ddp-{variant}-{index}", "GLOO_SOCKET_IFNAME": "eth0",
                   "PSLINK_PARTITION_BYTES": str(parse_size(args.partition))}
            procs.append(_start(hosts, host, [PYTHON, os.path.join(HERE, "torch_ddp.py"), "--worker", variant,
                                              "--out", out, "--hidden", str(args.hidden), "--batch-size",
                                              str(args.batch_size), "--steps", str(args.steps), "--warmup", "3"],
                                env=env))
        for rank, proc in enumerate(procs):
            netns.finish(proc, 900, f"DDP {variant} rank {rank}")
        times = []
        for rank in range(2):
            with open(os.path.join(out, f"rank{rank}.json")) as f:
                times.append(statistics.median(json.load(f)["times"]))
        return statistics.mean(times) * 1e3


def run_rate(rate: str, args) -> dict:
    figures: dict = {"rate": rate, "raw_MBps": [], "pushpull_MBps": {s: [] for s in args.sizes},
                     "unfused_pushpull_MBps": {s: [] for s in args.sizes} if args.unfused else {},
                     "ddp_ms": {v: [] for v in DDP_VARIANTS}}
    # One round: raw TCP, then each size's pushpull (and the same unfused), each once
    cases = [("raw", None)] + [(kind, size) for size in args.sizes
                               for kind in (("pushpull", "unfused") if args.unfused else ("pushpull",))]
    with netns.VirtualHosts(["A", "B"]) as hosts:
        for host in ("A", "B"):
            hosts.shape(host, rate)
        # pushpull: pMaster and its Aggregator on B, the worker on A
        master_b = f"tcp://{hosts.address('B')}:{MASTER_PORT}"
        service = _start(hosts, "B", [*PSLINK, "service", "up", "--host", hosts.address("B"), "--port",
                                      str(MASTER_PORT), "--aggregators", "1", "--allow-first-join"])
        netns.wait_service(hosts, "B", master_b, 1, service)
        for index in range(args.repeats):
            for kind, size in cases if index % 2 == 0 else cases[::-1]:
                if kind == "raw":
                    figures["raw_MBps"].append(measure_raw(hosts, args.seconds))
                else:
                    fused = kind == "pushpull"
                    key = "pushpull_MBps" if fused else "unfused_pushpull_MBps"
                    figures[key][size].append(measure_pushpull(hosts, master_b, size, args.seconds, index,
                                                               fused=fused, inflight=args.inflight))
            print(f"  {rate} round {index + 1}: raw {figures['raw_MBps'][-1]:.0f} MB/s, pushpull "
                  + ", ".join(f"{s} {figures['pushpull_MBps'][s][-1]:.0f} MB/s" for s in args.sizes)
                  + "".join(f", unfused {s} {figures['unfused_pushpull_MBps'][s][-1]:.0f} MB/s"
                            for s in figures["unfused_pushpull_MBps"]), flush=True)
        service.terminate()
        netns.finish(service, 30, "the pushpull service")
        if args.no_ddp:
            return figures
        # DDP: pMaster and one Aggregator on A, one Aggregator joined from B
        master_a = f"tcp://{hosts.address('A')}:{MASTER_PORT}"
        service = _start(hosts, "A", [*PSLINK, "service", "up", "--host", hosts.address("A"), "--port",
                                      str(MASTER_PORT), "--aggregators", "1", "--allow-first-join"])
        netns.wait_service(hosts, "A", master_a, 1, service)
        joined = _start(hosts, "B", [*PSLINK, "aggregator", "--master", master_a])
        netns.wait_service(hosts, "A", master_a, 2, service)
        for index in range(args.repeats):
            for variant in DDP_VARIANTS if index % 2 == 0 else DDP_VARIANTS[::-1]:
                figures["ddp_ms"][variant].append(measure_ddp(hosts, master_a, variant, args, index))
            print(f"  {rate} round {index + 1}: DDP step " + ", ".join(
                f"{v} {figures['ddp_ms'][v][-1]:.1f} ms" for v in DDP_VARIANTS), flush=True)
        joined.terminate()
        service.terminate()
        for proc, host in ((joined, "B"), (service, "A")):
            try:
                proc.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                hosts.kill(host)  # and its Aggregators, which hold the output pipe
                proc.communicate(timeout=20)
    return figures


DDP_VARIANTS = ("alone", "gloo", "pslink")


def rate_figures(figures: dict, args) -> dict:
    """The figures of one link rate's runs, by the name of the ratio the JSON gives."""
    rate = figures["rate"]
    raw = f"raw TCP over the same {rate} link (one Python socket stream, no pslink)"
    made = {}
    for size in args.sizes:
        what = f"pushpull {size}, {args.inflight} in flight, 1 worker, {rate} link"
        made[f"pushpull_{size}_vs_raw"] = fig.measured("multihost", what, "MB/s", "higher",
                                                       figures["pushpull_MBps"][size], raw, figures["raw_MBps"])
        if size in figures["unfused_pushpull_MBps"]:
            made[f"fused_over_unfused_{size}"] = fig.measured(
                "multihost", what, "MB/s", "higher", figures["pushpull_MBps"][size],
                "pslink with fusion off (PSLINK_FUSION_BYTES=0)", figures["unfused_pushpull_MBps"][size])
    if figures["ddp_ms"]["pslink"]:
        what = f"DDP step, pslink comm hook, 2 workers on 2 hosts, {rate} link, H={args.hidden}"
        hook = figures["ddp_ms"]["pslink"]
        made["ddp_vs_gloo"] = fig.measured("multihost", what, "ms/step", "lower", hook,
                                           "DDP over gloo on the same link", figures["ddp_ms"]["gloo"])
        made["ddp_over_limit"] = fig.measured("multihost", what, "ms/step", "lower", hook,
                                              "each worker training alone (no communication: the limit)",
                                              figures["ddp_ms"]["alone"])
    return made


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rates", help="link rates, comma separated, in tc's units (default: 10gbit,1gbit; "
                        "--quick: 1gbit)")
    parser.add_argument("--sizes", help="pushpull value sizes (default: 4M,64M; --quick: 4M)")
    parser.add_argument("--seconds", type=float, default=3.0, help="timed duration of each raw and pushpull case")
    parser.add_argument("--hidden", type=int, default=2048, help="DDP model width (2048: 6.4 M parameters, 26 MB)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--steps", type=int, default=10, help="measured DDP steps per run")
    parser.add_argument("--repeats", type=int, default=3, help="rounds: runs of each variant, alternating")
    parser.add_argument("--partition", default="1M", help="the DDP job's partition size (PSLINK_PARTITION_BYTES)")
    parser.add_argument("--no-ddp", action="store_true", help="raw TCP and pushpull only")
    parser.add_argument("--unfused", action="store_true", help="also each pushpull size with fusion off")
    parser.add_argument("--inflight", type=int, default=4, help="pushpulls in flight (one key each)")
    parser.add_argument("--quick", action="store_true", help="smoke run: 1 Gbit/s only, 4 MiB only, 1 s cases, H=512, "
                        "3 steps, 2 rounds")
    parser.add_argument("--role", help=argparse.SUPPRESS)
    parser.add_argument("--bind", help=argparse.SUPPRESS)
    parser.add_argument("--to", help=argparse.SUPPRESS)
    parser.add_argument("--master", help=argparse.SUPPRESS)
    parser.add_argument("--size", help=argparse.SUPPRESS)
    parser.add_argument("--job", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.role:
        {"raw-recv": role_raw_receive, "raw-send": role_raw_send, "pushpull": role_pushpull}[args.role](args)
        return 0
    if args.quick:
        args.seconds, args.hidden, args.steps, args.repeats = 1.0, 512, 3, 2
    if args.rates is None:
        args.rates = "1gbit" if args.quick else "10gbit,1gbit"
    if args.sizes is None:
        args.sizes = "4M" if args.quick else "4M,64M"
    if args.repeats < 1 or args.steps < 1 or args.seconds <= 0:
        parser.error(f"--repeats and --steps must be at least 1 and --seconds above 0 (got {args.repeats}, "
                     f"{args.steps}, {args.seconds})")
    args.sizes = [size_label(parse_size(s)) for s in args.sizes.split(",")]
    reason = netns.unavailable()
    if reason is not None:
        print(f"benchmarks/multihost.py: skipped: {reason}")
        return 0
    if not args.no_ddp:
        try:
            import torch  # noqa: F401
        except ImportError:
            print("torch is not installed: DDP is left out (pip install -c constraints.txt -e '.[torch]')")
            args.no_ddp = True
    results = []
    for rate in args.rates.split(","):
        print(f"link {rate} (tc tbf, both directions of each host's link):", flush=True)
        results.append(run_rate(rate, args))
    summary, made = [], []
    print(f"\n{'link':>7} {'raw TCP MB/s':>13} " + " ".join(f"{'pushpull ' + s:>13}" for s in args.sizes)
          + ("" if args.no_ddp else f" {'alone ms':>9} {'gloo ms':>8} {'pslink ms':>9}"))
    for figures in results:
        raw_mbps = statistics.median(figures["raw_MBps"])
        row = {"rate": figures["rate"], "raw_MBps": round(raw_mbps, 1), "runs": figures}
        line = f"{figures['rate']:>7} {raw_mbps:13.0f} "
        for size in args.sizes:
            row[f"pushpull_{size}_MBps"] = round(statistics.median(figures["pushpull_MBps"][size]), 1)
            line += f"{row[f'pushpull_{size}_MBps']:13.0f} "
        for size, runs in figures["unfused_pushpull_MBps"].items():
            row[f"unfused_pushpull_{size}_MBps"] = round(statistics.median(runs), 1)
        if not args.no_ddp:
            step = {v: statistics.median(figures["ddp_ms"][v]) for v in DDP_VARIANTS}
            row.update({f"ddp_{v}_ms": round(ms, 2) for v, ms in step.items()})
            line += f"{step['alone']:9.1f} {step['gloo']:8.1f} {step['pslink']:9.1f}"
        print(line)
        ours = rate_figures(figures, args)
        row.update({key: round(figure.ratio, 3) for key, figure in ours.items()})  # each ratio from its figure
        made += ours.values()
        summary.append(row)
    for figure in made:
        fig.emit(figure)
    for row in summary:
        if "pushpull_4M_vs_raw" in row:
            verdict = "met" if row["pushpull_4M_vs_raw"] >= 0.8 else "not met"
            print(f"target {row['rate']}: pushpull 4 MiB >= 0.8x raw TCP: {row['pushpull_4M_vs_raw']:.2f} ({verdict})")
        if "ddp_vs_gloo" in row:
            verdict = "met" if row["ddp_vs_gloo"] <= 1.0 else "not met"
            print(f"target {row['rate']}: DDP hook <= 1.0x gloo: {row['ddp_vs_gloo']:.3f} ({verdict})")
    print(json.dumps({"benchmark": "multihost", "quick": args.quick, "repeats": args.repeats,
                      "seconds": args.seconds, "hidden": args.hidden, "steps": args.steps,
                      "partition": parse_size(args.partition), "links": summary,
                      "figures": [f.as_json() for f in made]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
