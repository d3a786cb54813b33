"""DDP training step time on CPU, 2 workers: the pslink comm hook and the pslink torch.distributed
backend (``init_process_group("pslink")``, DDP with no hook) against DDP's own gloo all-reduce.

    python benchmarks/torch_ddp.py            # the measured run (about 25 M parameters)
    python benchmarks/torch_ddp.py --quick    # a smoke run: small model, few steps

Every variant runs in this one invocation, alternating (alone, gloo, pslink, backend, alone, ...; five runs
of each by default), each as 2 worker processes started by ``pslink launch`` against one
embedded service (2 Aggregator processes). "alone" is the limit: the same training with no
communication at all, each worker by itself, side by side so that the CPUs are shared alike. A
step is forward, backward (with the gradient exchange) and an SGD step of an MLP
1024 -> H -> H -> 1024 -> 10 (H = 4096: 25.2 M parameters, 101 MB of gradients per step) on a
random batch. Reported: the median step time of each variant (per worker, then the mean of the
two workers), the ratio pslink / gloo (the target is <= 1.0) with the ratio of each pslink run to
the gloo run before it, how far both are above the limit, and each worker's extra memory: peak
RSS while training minus RSS once its model and optimizer exist. The last line is JSON.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time


def build_model(hidden: int):
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(1024, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, hidden), torch.nn.ReLU(),
        torch.nn.Linear(hidden, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 10),
    )


def worker(args) -> None:
    """One DDP worker of one variant; writes its figures to ``args.out/rank{r}.json``."""
    import psutil
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import pslink.torch

    rank, size = int(os.environ["PSLINK_RANK"]), int(os.environ["PSLINK_NUM_WORKERS"])
    torch.set_num_threads(1)  # 2 workers on 2 cores, beside the Aggregators
    alone = args.worker == "alone"  # the limit: the same training with no communication at all
    if args.worker == "backend":  # torch.distributed's own API on the service: no hook
        dist.init_process_group("pslink", init_method=f"file://{args.out}/store", rank=rank, world_size=size)
    elif not alone:
        dist.init_process_group("gloo", init_method=f"file://{args.out}/store", rank=rank, world_size=size)
    process = psutil.Process()
    model = build_model(args.hidden)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(args.batch_size, 1024, generator=torch.Generator().manual_seed(rank))
    y = torch.randint(0, 10, (args.batch_size,), generator=torch.Generator().manual_seed(rank))
    gc.collect()
    base_rss = process.memory_info().rss
    ddp = model if alone else DDP(model)
    state = None
    if args.worker == "pslink":
        state = pslink.torch.connect()
        ddp.register_comm_hook(state, pslink.torch.comm_hook)
    peak_rss, times = base_rss, []
    for step in range(args.warmup + args.steps):
        started = time.perf_counter()
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        optimizer.step()
        elapsed = time.perf_counter() - started
        if step >= args.warmup:
            times.append(elapsed)
        peak_rss = max(peak_rss, process.memory_info().rss)
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump({"times": times, "extra_mb": (peak_rss - base_rss) / 2**20,
                   "params": sum(p.numel() for p in model.parameters())}, f)
    del ddp
    gc.collect()
    if not alone:
        dist.destroy_process_group()
    if state is not None:
        state.close()


# "alone": the limit, every worker training by itself with no communication at all, run side by
# side in the same alternation so that the CPUs are shared alike.
VARIANTS = ("alone", "gloo", "pslink", "backend")


def run_variant(variant: str, args, service: str, index: int) -> list[dict]:
    from pslink.bench.launched import launch_and_collect

    command = [sys.executable, os.path.abspath(__file__), "--worker", variant,
               "--hidden", str(args.hidden), "--batch-size", str(args.batch_size),
               "--steps", str(args.steps), "--warmup", str(args.warmup)]
    return launch_and_collect(command, variant, service, f"bench-ddp-{variant}-{os.getpid()}-{index}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: H=512, 5 steps, 1 repeat")
    parser.add_argument("--hidden", type=int, default=4096, help="H, the width of the hidden layers")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--steps", type=int, default=20, help="measured steps per run")
    parser.add_argument("--warmup", type=int, default=3, help="steps before measuring (DDP rebuilds its buckets)")
    parser.add_argument("--repeats", type=int, default=5, help="runs of each variant, alternating")
    parser.add_argument("--worker", choices=list(VARIANTS), help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    if args.quick:
        args.hidden, args.steps, args.warmup, args.repeats = 512, 5, 2, 1

    from pslink.core.service import Service

    figures: dict[str, dict] = {v: {"medians": [], "extra_mb": [[], []]} for v in VARIANTS}
    params = 0
    with Service(aggregators=2) as service:
        for index in range(args.repeats):
            for variant in VARIANTS:
                results = run_variant(variant, args, service.address, index)
                params = results[0]["params"]
                median = statistics.mean(statistics.median(r["times"]) for r in results)
                figures[variant]["medians"].append(median)
                for rank, r in enumerate(results):
                    figures[variant]["extra_mb"][rank].append(r["extra_mb"])
                print(f"run {index + 1}/{args.repeats} {variant:6}: median step {median * 1e3:8.1f} ms, extra memory "
                      + ", ".join(f"rank {k} {r['extra_mb']:.0f} MB" for k, r in enumerate(results)), flush=True)

    step_ms = {v: statistics.median(f["medians"]) * 1e3 for v, f in figures.items()}
    extra = {v: [max(per_rank) for per_rank in f["extra_mb"]] for v, f in figures.items()}
    ratio = step_ms["pslink"] / step_ms["gloo"]
    # Each pslink run against the gloo run just before it: the host's load drifts between runs
    # more than the variants differ, so the pairs show the spread the medians hide.
    pairs = [p / g for p, g in zip(figures["pslink"]["medians"], figures["gloo"]["medians"], strict=True)]
    print(f"\nmodel: {params / 1e6:.1f} M parameters ({params * 4 / 1e6:.0f} MB of float32 gradients), "
          f"batch {args.batch_size} per worker, 2 workers, {args.steps} steps x {args.repeats} runs per variant")
    print(f"{'variant':8} {'step ms':>9} {'extra MB rank 0':>16} {'extra MB rank 1':>16}")
    for variant in VARIANTS:
        print(f"{variant:8} {step_ms[variant]:9.1f} {extra[variant][0]:16.0f} {extra[variant][1]:16.0f}")
    overhead = [p - g for p, g in zip(extra["pslink"], extra["gloo"], strict=True)]
    print("pslink's own memory per worker (pslink extra - gloo extra): "
          + ", ".join(f"rank {k} {mb:+.0f} MB" for k, mb in enumerate(overhead)))
    print("ratio of each run to the gloo run before it: " + ", ".join(f"{r:.3f}" for r in pairs)
          + f" ({sum(r <= 1.0 for r in pairs)} of {len(pairs)} at or below 1.0)")
    print(f"ratio pslink / gloo: {ratio:.3f} (target <= 1.0: {'met' if ratio <= 1.0 else 'not met'})")
    backend_pairs = [b / g for b, g in zip(figures["backend"]["medians"], figures["gloo"]["medians"], strict=True)]
    print(f"ratio backend (init_process_group('pslink'), no hook) / gloo: {step_ms['backend'] / step_ms['gloo']:.3f}, "
          f"/ hook: {step_ms['backend'] / step_ms['pslink']:.3f} (each run / the gloo run before it: "
          + ", ".join(f"{r:.3f}" for r in backend_pairs) + ")")
    print(f"above the limit (each worker alone, no communication): pslink {step_ms['pslink'] / step_ms['alone']:.3f}x, "
          f"gloo {step_ms['gloo'] / step_ms['alone']:.3f}x")
    print(json.dumps({
        "benchmark": "torch_ddp", "quick": args.quick, "params": params, "batch_size": args.batch_size,
        "workers": 2, "steps": args.steps, "repeats": args.repeats,
        "gloo_step_ms": round(step_ms["gloo"], 2), "pslink_step_ms": round(step_ms["pslink"], 2),
        "alone_step_ms": round(step_ms["alone"], 2), "backend_step_ms": round(step_ms["backend"], 2),
        "backend_over_gloo": round(step_ms["backend"] / step_ms["gloo"], 4),
        "backend_over_hook": round(step_ms["backend"] / step_ms["pslink"], 4), "pslink_over_limit": round(step_ms["pslink"] / step_ms["alone"], 4),
        "ratio": round(ratio, 4), "pair_ratios": [round(r, 4) for r in pairs], "gloo_extra_mb": [round(m, 1) for m in extra["gloo"]],
        "pslink_extra_mb": [round(m, 1) for m in extra["pslink"]],
        "pslink_minus_gloo_mb": [round(m, 1) for m in overhead],
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
