"""Many small tensors per step: 500 gradients of 1-64 KiB (a ResNet-50-like size mix), 2 workers.

A step is forward, backward (with the gradient exchange) and an SGD step of a model whose 500
parameters have sizes drawn log-uniformly from 1 to 64 KiB of float32 (seeded; about 7.5 MiB in
all). Variants, alternating in one run (each as 2 worker processes started by ``pslink launch``
against one embedded service):

- ``alone``: the limit, each worker training by itself with no communication;
- ``gloo``: DDP over gloo (its buckets fuse the 500 gradients into a few all-reduces);
- ``pslink``: pslink's Horovod API (``pslink.torch.DistributedOptimizer``): each gradient is
  push-pulled by name as backward produces it, and the Agent fuses what is bound for one
  Aggregator (``PSLINK_FUSION_BYTES`` / ``PSLINK_FUSION_CYCLE_MS``);
- ``unfused``: the same with fusion off (``PSLINK_FUSION_BYTES=0``), for the change;
- ``horovod``: Horovod's own DistributedOptimizer over gloo (``horovodrun --gloo``), where Horovod
  is installed (``--horovod-path``: a ``pip install --target`` directory).

Reported: each variant's median step (per worker, then the mean of both), pslink / gloo (the
target is <= 0.8), each pslink run's ratio to the gloo run before it, and how far each is above
the limit. The last line is JSON::

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

from pslink.bench.launched import add_horovod_path, horovod_available, horovodrun_and_collect

TENSORS = 500
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
    parser.add_argument("--quick", action="store_true", help="smoke run: 5 steps, 1 repeat")
    parser.add_argument("--steps", type=int, default=30, help="measured steps per run")
    parser.add_argument("--warmup", type=int, default=5, help="steps before measuring")
    parser.add_argument("--repeats", type=int, default=5, help="runs of each variant, alternating")
    parser.add_argument("--variants", default="alone,gloo,pslink,unfused,horovod")
    add_horovod_path(parser)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    if args.quick:
        args.steps, args.warmup, args.repeats = 5, 2, 1
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    if "horovod" in variants and not horovod_available(args.horovod_path):
        print("horovod: not installed here (horovod.torch does not import; see --horovod-path); its variant is "
              "skipped", flush=True)
        variants.remove("horovod")

    from pslink.core.service import Service

    medians: dict[str, list[float]] = {v: [] for v in variants}
    nbytes = 0
    with Service(aggregators=2) as service:
        for index in range(args.repeats):
            for variant in variants:
                if variant == "horovod":
                    results = run_horovod(args, index)
                else:
                    results = run_variant(variant, args, service.address, index)
                nbytes = results[0]["bytes"]
                median = statistics.mean(statistics.median(r["times"]) for r in results)
                medians[variant].append(median)
                print(f"run {index + 1}/{args.repeats} {variant:8}: median step {median * 1e3:8.2f} ms", flush=True)

    step_ms = {v: statistics.median(m) * 1e3 for v, m in medians.items()}
    print(f"\n{TENSORS} tensors of 1-64 KiB ({nbytes / 2**20:.1f} MiB of float32 gradients), 2 workers, "
          f"{args.steps} steps x {args.repeats} runs per variant")
    for variant in variants:
        print(f"{variant:8} {step_ms[variant]:9.2f} ms")
    figures = {"benchmark": "many_keys", "quick": args.quick, "tensors": TENSORS, "bytes": nbytes,
               "steps": args.steps, "repeats": args.repeats,
               "step_ms": {v: round(ms, 3) for v, ms in step_ms.items()}}
    if "gloo" in step_ms:
        for variant in ("pslink", "unfused", "horovod"):
            if variant in step_ms:
                pairs = [p / g for p, g in zip(medians[variant], medians["gloo"])]
                figures[f"{variant}_over_gloo"] = round(step_ms[variant] / step_ms["gloo"], 4)
                figures[f"{variant}_pairs"] = [round(r, 4) for r in pairs]
                print(f"{variant} / gloo: {step_ms[variant] / step_ms['gloo']:.3f} (each run / the gloo run before "
                      "it: " + ", ".join(f"{r:.3f}" for r in pairs) + ")")
        if "pslink" in step_ms:
            ratio = step_ms["pslink"] / step_ms["gloo"]
            print(f"target pslink / gloo <= 0.8: {'met' if ratio <= 0.8 else 'not met'}")
    if "alone" in step_ms:
        for variant in step_ms:
            if variant != "alone":
                print(f"{variant} above the limit (each worker alone): {step_ms[variant] / step_ms['alone']:.3f}x")
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
