"""The Horovod API against Horovod itself: ``hvd.allreduce`` of 4 KiB, 4 MiB and 64 MiB and a
``DistributedOptimizer`` training step, pslink (``import pslink.torch as hvd``, 2 workers under
``pslink launch`` against one embedded service of 2 Aggregators) against Horovod 0.28.1 over gloo
(``horovodrun --gloo``, 2 processes), the same worker code, alternating in one run.

Each run starts both ranks once and measures, in turn: every size's allreduce (the median of
its calls after a warm-up, each call waited for), then the median training step (forward,
backward with the averaging, SGD) of an MLP of 8.4 M parameters (33.6 MB of gradients in
6 tensors). Reported: per figure, the median over runs of each variant, pslink / Horovod (the
target is <= 1.0 from 4 MiB up), and each pslink run's ratio to the Horovod run before it. The
last line is JSON::

    PSLINK_BENCH_HOROVOD=/tmp/hvdlib python benchmarks/horovod_api.py          # the measured run
    PSLINK_BENCH_HOROVOD=/tmp/hvdlib python benchmarks/horovod_api.py --quick  # a smoke run

Horovod is not a dependency: it is built from its sdist as ENVIRONMENT.md says (``pip install
--target DIR``) and found through ``--horovod-path`` / ``$PSLINK_BENCH_HOROVOD``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from pslink.bench.launched import add_horovod_path, horovod_available, horovodrun_and_collect, launch_and_collect

SIZES = {"4K": 4 << 10, "4M": 4 << 20, "64M": 64 << 20}
CALLS = {"4K": 300, "4M": 40, "64M": 8}  # measured calls per size (the quick run takes a fifth)
WARMUP_CALLS = 3


def build_model():
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(1024, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 2048),
                               torch.nn.ReLU(), torch.nn.Linear(2048, 1024))


def worker(args) -> None:
    import torch

    if args.worker == "horovod":
        import horovod.torch as hvd
    else:
        import pslink.torch as hvd
    torch.set_num_threads(1)
    hvd.init()
    rank = hvd.rank()
    scale = 5 if args.quick else 1
    figures: dict[str, float] = {}
    for label, nbytes in SIZES.items():
        tensor = torch.full((nbytes // 4,), float(rank + 1))
        times = []
        for call in range(WARMUP_CALLS + max(2, CALLS[label] // scale)):
            started = time.perf_counter()
            result = hvd.allreduce(tensor, name=f"allreduce.{label}")
            if call >= WARMUP_CALLS:
                times.append(time.perf_counter() - started)
        if not torch.all(result == 1.5):  # the average of 1 and 2
            raise SystemExit(f"{args.worker}: allreduce of {label} gave {result[:4]}, not 1.5")
        figures[f"allreduce_{label}"] = statistics.median(times)
    model = build_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    x = torch.randn(64, 1024, generator=torch.Generator().manual_seed(rank))
    times = []
    for step in range(5 + max(3, args.steps // scale)):
        started = time.perf_counter()
        optimizer.zero_grad()
        model(x).square().mean().backward()
        optimizer.step()
        if step >= 5:
            times.append(time.perf_counter() - started)
    figures["step"] = statistics.median(times)
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(figures, f)
    hvd.shutdown()


def _command(variant: str, args) -> list[str]:
    command = [sys.executable, "-m", "pslink.bench.horovod_api", "--worker", variant, "--steps", str(args.steps)]
    return command + (["--quick"] if args.quick else [])


def run_horovod(args) -> list[dict]:
    return horovodrun_and_collect(_command("horovod", args), args.horovod_path)


def run_pslink(args, service: str, index: int) -> list[dict]:
    return launch_and_collect(_command("pslink", args), "pslink", service, f"bench-hvd-api-{os.getpid()}-{index}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: fewer calls and steps, 1 repeat")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each variant, alternating")
    parser.add_argument("--steps", type=int, default=20, help="measured training steps per run")
    add_horovod_path(parser)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    if args.quick:
        args.repeats = 1
    if not horovod_available(args.horovod_path):
        print("horovod: not installed here (horovod.torch does not import; see --horovod-path): nothing to "
              "compare against", flush=True)
        return 1
    from pslink.core.service import Service

    runs: dict[str, list[dict]] = {"horovod": [], "pslink": []}
    with Service(aggregators=2) as service:
        for index in range(args.repeats):
            for variant in ("horovod", "pslink"):
                results = run_horovod(args) if variant == "horovod" else run_pslink(args, service.address, index)
                # The slower rank's figure: a collective is done when both have it.
                figures = {k: max(r[k] for r in results) for k in results[0]}
                runs[variant].append(figures)
                print(f"run {index + 1}/{args.repeats} {variant:8}: " + ", ".join(
                    f"{k} {v * 1e3:.2f} ms" for k, v in figures.items()), flush=True)
    names = list(runs["pslink"][0])
    summary = {}
    print(f"\n2 workers, {args.repeats} runs per variant, alternating (medians; ratio = pslink / Horovod)")
    for name in names:
        hvd_ms = statistics.median(r[name] for r in runs["horovod"]) * 1e3
        ps_ms = statistics.median(r[name] for r in runs["pslink"]) * 1e3
        pairs = [p[name] / h[name] for p, h in zip(runs["pslink"], runs["horovod"])]
        summary[name] = {"horovod_ms": round(hvd_ms, 3), "pslink_ms": round(ps_ms, 3), "ratio": round(ps_ms / hvd_ms, 4),
                         "pairs": [round(x, 4) for x in pairs]}
        print(f"{name:15} horovod {hvd_ms:9.2f} ms  pslink {ps_ms:9.2f} ms  ratio {ps_ms / hvd_ms:.3f} "
              f"(pairs: {', '.join(f'{x:.3f}' for x in pairs)})")
    met = all(summary[n]["ratio"] <= 1.0 for n in ("allreduce_4M", "allreduce_64M", "step"))
    print(f"target pslink <= 1.0x Horovod from 4 MiB up (and the step): {'met' if met else 'not met'}")
    print(json.dumps({"benchmark": "horovod_api", "quick": args.quick, "repeats": args.repeats, "figures": summary}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
