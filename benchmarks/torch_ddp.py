"""DDP training step time on CPU, 2 workers: the pslink comm hook and the pslink torch.distributed
backend (``init_process_group("pslink")``, DDP with no hook) against DDP's own gloo all-reduce.

    python benchmarks/torch_ddp.py            # the measured run (about 25 M parameters)
    python benchmarks/torch_ddp.py --quick    # a smoke run: small model, few steps

Every variant runs in this one invocation, alternating round by round (alone, gloo, pslink,
backend, then backward: backend, pslink, gloo, alone, ...; five rounds by default), each as 2
worker processes started by ``pslink launch`` against one embedded service (2 Aggregator
processes). "alone" is the limit: the same training with no communication at all, each worker by
itself, side by side so that the CPUs are shared alike. A step is forward, backward (with the
gradient exchange) and an SGD step of an MLP 1024 -> H -> H -> 1024 -> 10 (H = 4096: 25.2 M
parameters, 101 MB of gradients per step) on a random batch. A round's figure of a variant is its
median step time (per worker, then the mean of the two workers). Reported as figures
(``pslink.bench.figures``): the hook and the backend each against DDP over gloo, and each against
the limit (how far above it), every ratio with its spread over the rounds; and each worker's extra
memory: peak RSS while training minus RSS once its model and optimizer exist. Each round's line
also gives the CPU per step of a worker (every thread: DDP's copies, the Agent's copies in and out
of the rings) and of the two Aggregators (their whole run over its steps, an upper bound): on 2
shared cores the step's time beyond the limit is mostly that CPU. The last line is JSON.

    python benchmarks/torch_ddp.py --bucket-view       # every DDP variant with gradient_as_bucket_view=True
    python benchmarks/torch_ddp.py --variants alone,pslink --repeats 2   # development: no figures
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
    ddp = model if alone else DDP(model, gradient_as_bucket_view=args.bucket_view)
    state = None
    if args.worker == "pslink":
        state = pslink.torch.connect()
        ddp.register_comm_hook(state, pslink.torch.comm_hook)
    peak_rss, times, cpu = base_rss, [], 0.0
    for step in range(args.warmup + args.steps):
        started, cpu_started = time.perf_counter(), time.process_time()
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        optimizer.step()
        elapsed = time.perf_counter() - started
        if step >= args.warmup:
            times.append(elapsed)
            cpu += time.process_time() - cpu_started  # every thread of this worker: the copies in and out too
        peak_rss = max(peak_rss, process.memory_info().rss)
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump({"times": times, "cpu_per_step": cpu / args.steps, "extra_mb": (peak_rss - base_rss) / 2**20,
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


def aggregator_cpu() -> float:
    """CPU seconds the embedded service's Aggregator processes have used so far: a step's CPU
    beyond the workers' own (on 2 cores it is taken from the workers' compute)."""
    import psutil

    total = 0.0
    for child in psutil.Process().children(recursive=True):
        try:
            if "pslink.core.aggregator" in " ".join(child.cmdline()):
                times = child.cpu_times()
                total += times.user + times.system
        except psutil.Error:
            continue
    return total


def run_variant(variant: str, args, service: str, index: int) -> list[dict]:
    from pslink.bench.launched import launch_and_collect

    command = [sys.executable, os.path.abspath(__file__), "--worker", variant,
               "--hidden", str(args.hidden), "--batch-size", str(args.batch_size),
               "--steps", str(args.steps), "--warmup", str(args.warmup)]
    if args.bucket_view:
        command.append("--bucket-view")
    return launch_and_collect(command, variant, service, f"bench-ddp-{variant}-{os.getpid()}-{index}")


def main(argv=None) -> int:
    from pslink.bench.launched import add_step_options, alternating, chosen_variants, settle_step_options

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_step_options(parser, hidden=4096, batch_size=32, repeats=5,
                     warmup_help="steps before measuring (DDP rebuilds its buckets)")
    parser.add_argument("--bucket-view", action="store_true",
                        help="DDP(gradient_as_bucket_view=True) for every DDP variant: no copy of the gradients "
                             "into DDP's buckets and back")
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help="comma-separated variants to run (development: the figures need all four)")
    parser.add_argument("--worker", choices=list(VARIANTS), help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    settle_step_options(parser, args)
    chosen = chosen_variants(parser, args.variants, VARIANTS)

    from pslink.bench import figures as fig
    from pslink.core.service import Service

    runs: dict[str, dict] = {v: {"medians": [], "cpu": [], "extra_mb": [[], []]} for v in VARIANTS}
    params = 0
    with Service(aggregators=2) as service:
        for index, variant in alternating(chosen, args.repeats):
            aggregators_before = aggregator_cpu()
            results = run_variant(variant, args, service.address, index)
            # (the whole run: its warm-up steps and joining the job too, so an upper bound)
            aggregators = (aggregator_cpu() - aggregators_before) / (args.warmup + args.steps)
            params = results[0]["params"]
            median = statistics.mean(statistics.median(r["times"]) for r in results)
            runs[variant]["medians"].append(median)
            workers_cpu = statistics.mean(r["cpu_per_step"] for r in results)
            runs[variant]["cpu"].append((workers_cpu, aggregators))
            for rank, r in enumerate(results):
                runs[variant]["extra_mb"][rank].append(r["extra_mb"])
            print(f"round {index + 1}/{args.repeats} {variant:7}: median step {median * 1e3:8.1f} ms, CPU per "
                  f"step {workers_cpu * 1e3:.0f} ms a worker + {aggregators * 1e3:.0f} ms the Aggregators, extra "
                  "memory " + ", ".join(f"rank {k} {r['extra_mb']:.0f} MB" for k, r in enumerate(results)),
                  flush=True)

    if chosen != VARIANTS:
        for variant in chosen:
            cpu = [statistics.median(c[i] for c in runs[variant]["cpu"]) * 1e3 for i in (0, 1)]
            print(f"{variant:8} {statistics.median(runs[variant]['medians']) * 1e3:9.1f} ms/step, CPU {cpu[0]:.0f} ms a "
                  f"worker + {cpu[1]:.0f} ms Aggregators (development run: no figures without all four variants)")
        return 0
    ms = {v: [m * 1e3 for m in r["medians"]] for v, r in runs.items()}
    step_ms = {v: statistics.median(m) for v, m in ms.items()}
    cpu_ms = {v: tuple(statistics.median(c[i] for c in r["cpu"]) * 1e3 for i in (0, 1)) for v, r in runs.items()}
    extra = {v: [max(per_rank) for per_rank in r["extra_mb"]] for v, r in runs.items()}
    view = ", gradient_as_bucket_view" if args.bucket_view else ""
    hook_what = f"DDP step, pslink comm hook, {params / 1e6:.1f} M parameters, 2 workers{view}"
    backend_what = (f"DDP step, pslink backend (init_process_group('pslink'), no hook), {params / 1e6:.1f} M "
                    f"parameters, 2 workers{view}")
    limit = "the same training alone (no communication: the limit)"
    made = [
        fig.measured("torch_ddp", hook_what, "ms/step", "lower", ms["pslink"], "DDP over gloo", ms["gloo"]),
        fig.measured("torch_ddp", backend_what, "ms/step", "lower", ms["backend"], "DDP over gloo", ms["gloo"]),
        fig.measured("torch_ddp", hook_what, "ms/step", "lower", ms["pslink"], limit, ms["alone"]),
        fig.measured("torch_ddp", backend_what, "ms/step", "lower", ms["backend"], limit, ms["alone"]),
        fig.measured("torch_ddp", backend_what, "ms/step", "lower", ms["backend"], "the pslink comm hook",
                     ms["pslink"]),
    ]
    print(f"\nmodel: {params / 1e6:.1f} M parameters ({params * 4 / 1e6:.0f} MB of float32 gradients), "
          f"batch {args.batch_size} per worker, 2 workers, {args.steps} steps x {args.repeats} rounds per variant")
    print(f"{'variant':8} {'step ms':>9} {'extra MB rank 0':>16} {'extra MB rank 1':>16}")
    for variant in VARIANTS:
        print(f"{variant:8} {step_ms[variant]:9.1f} {extra[variant][0]:16.0f} {extra[variant][1]:16.0f}")
    print("CPU per step (medians over the rounds; a development aid, not a figure): "
          + ", ".join(f"{v} {cpu_ms[v][0]:.0f} ms a worker + {cpu_ms[v][1]:.0f} ms Aggregators" for v in VARIANTS))
    overhead = [p - g for p, g in zip(extra["pslink"], extra["gloo"], strict=True)]
    print("pslink's own memory per worker (hook's extra - gloo's extra): "
          + ", ".join(f"rank {k} {mb:+.0f} MB" for k, mb in enumerate(overhead)))
    for figure in made:
        fig.emit(figure)
    hook, backend, hook_over_limit, _, backend_over_hook = made
    print(f"target: the hook at or below 1.0x gloo: {'met' if hook.ratio <= 1.0 else 'not met'}")
    print(json.dumps({
        "benchmark": "torch_ddp", "quick": args.quick, "params": params, "batch_size": args.batch_size,
        "workers": 2, "steps": args.steps, "repeats": args.repeats,
        "gloo_step_ms": round(step_ms["gloo"], 2), "pslink_step_ms": round(step_ms["pslink"], 2),
        "alone_step_ms": round(step_ms["alone"], 2), "backend_step_ms": round(step_ms["backend"], 2),
        "backend_over_gloo": round(backend.ratio, 4), "backend_over_hook": round(backend_over_hook.ratio, 4),
        "pslink_over_limit": round(hook_over_limit.ratio, 4), "ratio": round(hook.ratio, 4),
        "pair_ratios": [round(p / g, 4) for p, g in zip(ms["pslink"], ms["gloo"])],
        "gloo_extra_mb": [round(m, 1) for m in extra["gloo"]],
        "pslink_extra_mb": [round(m, 1) for m in extra["pslink"]],
        "pslink_minus_gloo_mb": [round(m, 1) for m in overhead],
        "cpu_ms_per_step": {v: {"worker": round(c[0], 1), "aggregators": round(c[1], 1)} for v, c in cpu_ms.items()},
        "figures": [f.as_json() for f in made],
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
