"""Many small tensors per step: 500 gradients of 1-64 KiB (a ResNet-50-like size mix), 2 workers.

A step is forward, backward (with the gradient exchange) and an SGD step of a model whose 500
parameters have sizes drawn log-uniformly from 1 to 64 KiB of float32 (seeded; about 8.2 MiB in
all). Variants, alternating in one run (each as 2 worker processes started by ``pslink launch``
against one embedded service):

- ``alone``: the limit, each worker training by itself with no communication;
- ``gloo``: DDP over gloo (its buckets fuse the 500 gradients into a few all-reduces);
- ``pslink``: pslink's Horovod API (``pslink.torch.DistributedOptimizer``): each gradient is
  push-pulled by name as backward produces it, and the Agent fuses what is bound for one
  Aggregator (``PSLINK_FUSION_BYTES`` / ``PSLINK_FUSION_CYCLE_MS``);
- ``unfused``: the same with fusion off (``PSLINK_FUSION_BYTES=0``), for the change;
- ``horovod``: Horovod's own DistributedOptimizer over gloo (``horovodrun --gloo``), where Horovod
  is installed (``--horovod-path`` or ``$PSLINK_BENCH_HOROVOD``: a ``pip install --target``
  directory).

The variants alternate, one run each per round, the order reversed every other round; a run's
figure is its median step (per worker, then the mean of both). Reported as figures
(``pslink.bench.figures``): pslink against DDP over gloo, against Horovod (or, without Horovod,
pslink's figure alone saying how to add it), against itself with fusion off, and against the
limit, each with the spread of the rounds' own ratios. The last line is JSON::

    python benchmarks/pushpull.py --many-keys           # the measured run
    python benchmarks/pushpull.py --many-keys --quick   # a smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from pslink.bench.launched import HOROVOD_MISSING, add_horovod_path, horovod_available, horovodrun_and_collect

TENSORS = 500
# The figures' script: this runs as ``benchmarks/pushpull.py --many-keys``, and the report names a
# figure by the script that printed it.
SCRIPT = "pushpull"
VARIANTS = ("alone", "gloo", "pslink", "unfused", "horovod")
MIN_BYTES, MAX_BYTES = 1 << 10, 64 << 10


def tensor_sizes(count: int = TENSORS, seed: int = 0) -> list[int]:
    """Element counts (float32) drawn log-uniformly from 1 to 64 KiB."""
    import numpy as np

    rng = np.random.default_rng(seed)
    nbytes = np.exp(rng.uniform(np.log(MIN_BYTES), np.log(MAX_BYTES), count))
    return [max(1, int(b) // 4) for b in nbytes]


def build_model(sizes: list[int]):
    import torch

    class ManyTensors(torch.nn.Module):
        """One parameter per size; the loss touches each, so backward yields 500 gradients."""

        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.weights = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(n) * 0.01) for n in sizes)

        def forward(self, x):
            return sum((w * x[: w.numel()]).sum() for w in self.weights)

    return ManyTensors()


def _horovod():
    try:
        import horovod.torch as hvd  # noqa: F401
    except ImportError:
        return None
    return hvd


def run_horovod(args, index: int) -> list[dict]:
    """Horovod's own DistributedOptimizer over gloo, 2 processes started by ``horovodrun --gloo``."""
    return horovodrun_and_collect([sys.executable, "-m", "pslink.bench.many_keys", "--worker", "horovod",
                                   "--steps", str(args.steps), "--warmup", str(args.warmup)], args.horovod_path)


def worker(args) -> None:
    import torch

    variant = args.worker
    if variant == "horovod":  # started by horovodrun, not pslink launch
        rank, size = int(os.environ["HOROVOD_RANK"]), int(os.environ["HOROVOD_SIZE"])
    else:
        rank, size = int(os.environ["PSLINK_RANK"]), int(os.environ["PSLINK_NUM_WORKERS"])
    torch.set_num_threads(1)
    if variant == "unfused":
        os.environ["PSLINK_FUSION_BYTES"] = "0"
    sizes = tensor_sizes()
    model = build_model(sizes)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(max(sizes), generator=torch.Generator().manual_seed(rank))
    close = None
    if variant == "gloo":
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel as DDP

        dist.init_process_group("gloo", init_method=f"file://{args.out}/store", rank=rank, world_size=size)
        model = DDP(model)
        close = dist.destroy_process_group
    elif variant in ("pslink", "unfused"):
        import pslink.torch as hvd

        hvd.init()
        optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
        close = hvd.shutdown
    elif variant == "horovod":
        hvd = _horovod()
        hvd.init()
        optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
        close = hvd.shutdown
    times = []
    for step in range(args.warmup + args.steps):
        started = time.perf_counter()
        optimizer.zero_grad()
        model(x).backward()
        optimizer.step()
        if step >= args.warmup:
            times.append(time.perf_counter() - started)
    checksum = float(sum(float(p.detach().double().sum()) for p in model.parameters()))
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump({"times": times, "checksum": checksum, "bytes": 4 * sum(sizes)}, f)
    if close is not None:
        close()


def run_variant(variant: str, args, service: str, index: int) -> list[dict]:
    from pslink.bench.launched import launch_and_collect

    command = [sys.executable, "-m", "pslink.bench.many_keys", "--worker", variant,
               "--steps", str(args.steps), "--warmup", str(args.warmup)]
    return launch_and_collect(command, variant, service, f"bench-many-{variant}-{os.getpid()}-{index}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: 10 steps, 2 rounds, no unfused")
    parser.add_argument("--steps", type=int, default=30, help="measured steps per run")
    parser.add_argument("--warmup", type=int, default=5, help="steps before measuring")
    parser.add_argument("--repeats", type=int, default=5, help="rounds: runs of each variant, alternating")
    parser.add_argument("--variants", help=f"which of {', '.join(VARIANTS)} (default: all; --quick: all but unfused)")
    add_horovod_path(parser)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    if args.quick:
        args.steps, args.warmup, args.repeats = 10, 2, 2
    if args.variants is None:  # the quick run leaves out fusion's own effect: its anchors fit in a minute
        args.variants = ",".join(v for v in VARIANTS if not (args.quick and v == "unfused"))
    if args.repeats < 1 or args.steps < 1:
        parser.error(f"--repeats and --steps must be at least 1 (got {args.repeats}, {args.steps})")
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown or "pslink" not in variants:
        parser.error(f"--variants: {', '.join(unknown) or 'pslink is missing'} (known: {', '.join(VARIANTS)}; "
                     "pslink is the one measured)")
    horovod_missing = ""
    if "horovod" in variants and not horovod_available(args.horovod_path):
        print("horovod: horovod.torch does not import here; its variant is skipped", flush=True)
        variants.remove("horovod")
        horovod_missing = HOROVOD_MISSING

    from pslink.bench import figures as fig
    from pslink.core.service import Service

    medians: dict[str, list[float]] = {v: [] for v in variants}
    nbytes = 0
    with Service(aggregators=2) as service:
        for index in range(args.repeats):
            for variant in variants if index % 2 == 0 else variants[::-1]:
                if variant == "horovod":
                    results = run_horovod(args, index)
                else:
                    results = run_variant(variant, args, service.address, index)
                nbytes = results[0]["bytes"]
                median = statistics.mean(statistics.median(r["times"]) for r in results)
                medians[variant].append(median * 1e3)
                print(f"round {index + 1}/{args.repeats} {variant:8}: median step {median * 1e3:8.2f} ms", flush=True)

    step_ms = {v: statistics.median(m) for v, m in medians.items()}
    print(f"\n{TENSORS} tensors of 1-64 KiB ({nbytes / 2**20:.1f} MiB of float32 gradients), 2 workers, "
          f"{args.steps} steps x {args.repeats} rounds per variant")
    for variant in variants:
        print(f"{variant:8} {step_ms[variant]:9.2f} ms")
    what = f"training step, {TENSORS} tensors of 1-64 KiB, 2 workers, pslink DistributedOptimizer"
    anchors = {"gloo": "DDP over gloo", "horovod": "Horovod's DistributedOptimizer over gloo (horovodrun --gloo)",
               "unfused": "pslink with fusion off (PSLINK_FUSION_BYTES=0)",
               "alone": "the same training alone (no communication: the limit)"}
    made = []
    for variant, anchor in anchors.items():
        if variant in medians:
            made.append(fig.measured(SCRIPT, what, "ms/step", "lower", medians["pslink"],
                                     anchor, medians[variant]))
        elif variant == "horovod" and horovod_missing:
            made.append(fig.unanchored(SCRIPT, what, "ms/step", "lower", medians["pslink"],
                                       missing=horovod_missing))
    for figure in made:
        fig.emit(figure)
    result = {"benchmark": "many_keys", "quick": args.quick, "tensors": TENSORS, "bytes": nbytes,
              "steps": args.steps, "repeats": args.repeats, "step_ms": {v: round(ms, 3) for v, ms in step_ms.items()},
              "figures": [f.as_json() for f in made]}
    for figure in made:
        if figure.anchor == anchors["gloo"]:
            result["pslink_over_gloo"] = round(figure.ratio, 4)
            result["pslink_pairs"] = [round(p / g, 4) for p, g in zip(figure.values, figure.anchor_values)]
            print(f"target pslink / gloo <= 0.8: {'met' if figure.ratio <= 0.8 else 'not met'}")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
