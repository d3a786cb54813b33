"""The Horovod API against Horovod itself: ``hvd.allreduce`` of 4 KiB, 4 MiB and 64 MiB and a
``DistributedOptimizer`` training step, pslink (``import pslink.torch as hvd``, 2 workers under
``pslink launch`` against one embedded service of 2 Aggregators) against Horovod 0.28.1 over gloo
(``horovodrun --gloo``, 2 processes), the same worker code, alternating in one run.

Each run starts both ranks once and measures, in turn: every size's allreduce (the median of
its calls after a warm-up, each call waited for), then the median training step (forward,
backward with the averaging, SGD) of an MLP of 8.4 M parameters (33.6 MB of gradients in
6 tensors); a run's figure is its slower rank's (a collective is done when both have it). The
variants alternate, one run each per round, the order reversed every other round. Reported as
figures (``pslink.bench.figures``): each allreduce size and the step, pslink against Horovod, with
the spread of the rounds' own ratios. Without Horovod, pslink's figures alone, each saying how to
add Horovod. The last line is JSON::

    PSLINK_BENCH_HOROVOD=/tmp/hvdlib python benchmarks/horovod_api.py          # the measured run
    PSLINK_BENCH_HOROVOD=/tmp/hvdlib python benchmarks/horovod_api.py --quick  # a smoke run

Horovod is not a dependency: it is built from its sdist as ENVIRONMENT.md says (``pip install
--target DIR``) and found through ``--horovod-path`` / ``$PSLINK_BENCH_HOROVOD``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time

from pslink.bench.launched import (
    HOROVOD_MISSING,
    add_horovod_path,
    horovod_available,
    horovodrun_and_collect,
    launch_and_collect,
)

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
        times, faults = [], []
        for call in range(WARMUP_CALLS + max(2, CALLS[label] // scale)):
            faulted = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            started = time.perf_counter()
            result = hvd.allreduce(tensor, name=f"allreduce.{label}")
            if call >= WARMUP_CALLS:
                times.append(time.perf_counter() - started)
                faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faulted)
        if not torch.all(result == 1.5):  # the average of 1 and 2
            raise SystemExit(f"{args.worker}: allreduce of {label} gave {result[:4]}, not 1.5")
        figures[f"allreduce_{label}"] = statistics.median(times)
        # Pages faulted in per call (a fresh result's memory, touched first by the copy of the
        # answer into it): a development aid, printed with each run, not a figure.
        figures[f"faults_{label}"] = statistics.median(faults)
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


WHAT = {"allreduce_4K": "hvd.allreduce 4 KiB", "allreduce_4M": "hvd.allreduce 4 MiB",
        "allreduce_64M": "hvd.allreduce 64 MiB",
        "step": "DistributedOptimizer step, MLP 8.4 M parameters"}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: fewer calls and steps, 2 rounds")
    parser.add_argument("--repeats", type=int, default=3, help="rounds: runs of each variant, alternating")
    parser.add_argument("--steps", type=int, default=20, help="measured training steps per run")
    add_horovod_path(parser)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    if args.quick:
        args.repeats = 2
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, not {args.repeats}")
    from pslink.bench import figures as fig
    from pslink.core.service import Service

    variants = ["horovod", "pslink"]
    if not horovod_available(args.horovod_path):
        where = f" (not importable from {args.horovod_path})" if args.horovod_path else ""
        print(f"horovod: horovod.torch does not import here{where}: pslink's figures alone", flush=True)
        variants.remove("horovod")
    runs: dict[str, list[dict]] = {v: [] for v in variants}
    with Service(aggregators=2) as service:
        for index in range(args.repeats):
            for variant in variants if index % 2 == 0 else variants[::-1]:
                results = run_horovod(args) if variant == "horovod" else run_pslink(args, service.address, index)
                # The slower rank's figure: a collective is done when both have it.
                slower = {k: max(r[k] for r in results) for k in results[0]}
                runs[variant].append(slower)
                print(f"round {index + 1}/{args.repeats} {variant:8}: " + ", ".join(
                    f"{k} {v:.0f} pages faulted a call" if k.startswith("faults") else f"{k} {v * 1e3:.2f} ms"
                    for k, v in slower.items()), flush=True)
    print(f"\n2 workers, {args.repeats} rounds" + (", the variants alternating" if len(runs) > 1 else "")
          + " (medians over the rounds)")
    made, summary = [], {}
    for name, what in WHAT.items():
        ms = [r[name] * 1e3 for r in runs["pslink"]]
        unit = "ms/step" if name == "step" else "ms"
        if "horovod" in runs:
            figure = fig.measured("horovod_api", f"{what}, 2 workers", unit, "lower", ms,
                                  "Horovod over gloo (horovodrun --gloo)", [r[name] * 1e3 for r in runs["horovod"]])
        else:
            figure = fig.unanchored("horovod_api", f"{what}, 2 workers", unit, "lower", ms, missing=HOROVOD_MISSING)
        made.append(figure)
        summary[name] = {"horovod_ms": figure.anchor_value, "pslink_ms": figure.value, "ratio": figure.ratio}
        fig.emit(figure)
    print(json.dumps({"benchmark": "horovod_api", "quick": args.quick, "repeats": args.repeats,
                      "horovod": "horovod" in runs, "summary": summary, "figures": [f.as_json() for f in made]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
