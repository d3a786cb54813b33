"""Gluon training step time on CPU, 2 workers: ``gluon.Trainer(..., kvstore='pslink')`` against
MXNet's own ``dist_sync`` store and against the limit (the same training with no communication).

    python benchmarks/mxnet_gluon.py            # the measured run (8.4 M parameters)
    python benchmarks/mxnet_gluon.py --quick    # a smoke run: small model, few steps
    python benchmarks/mxnet_gluon.py --save-weights DIR   # no timing: each pslink variant's final
                                                          # weights (rank 0) to DIR/<variant>.npz

Every variant runs in this one invocation, alternating round by round (alone, pslink, pslink_opt,
dist_sync, dist_sync_opt, then backward, ...; four rounds by default), each as 2 worker processes. "alone" is
the limit: each worker trains by itself, no store at all, side by side so that the CPUs are
shared alike. "pslink" and "pslink_opt" are started by ``pslink launch`` against one embedded
service with 2 Aggregator processes: "pslink" sums the gradients (``update_on_kvstore=False``:
every worker steps SGD itself), "pslink_opt" has the service step SGD (``update_on_kvstore=True``).
"dist_sync" is MXNet's own store from the same libmxnet, summing as "pslink" does
(``update_on_kvstore=False``), and "dist_sync_opt" the same store with its servers stepping SGD
as "pslink_opt" has the service do (``update_on_kvstore=True``, what gluon.Trainer chooses for a
dist store by default); each with as many servers as pslink has Aggregators (2) and a scheduler,
started with the DMLC_* environment MXNet's ``tools/launch.py --launcher local`` sets.
Every process gets OMP_NUM_THREADS=1 and MXNET_CPU_WORKER_NTHREADS=1 (2 workers on 2 cores).

With ``--compare-copying`` a fifth variant, "pslink_copying", is "pslink" with
``PSLINK_MXNET_ZERO_COPY=0``: each gradient copied out of MXNet and back in, one synchronous
pushpull per parameter (the store's path before issue 53), reported against "pslink".

A step is forward, backward, the Trainer's step (gradient exchange and SGD) and ``waitall`` (MXNet
computes asynchronously: a step is timed once done) of an MLP 1024 -> 2048 -> 2048 -> 1024 -> 10
(8.4 M parameters, 34 MB of float32 gradients a step) on a random batch. A round's figure of a
variant is its median step time (per worker, then the mean of the two workers). Reported as
figures (``pslink.bench.figures``): each pslink variant against dist_sync in the same mode and
against the limit, each with its spread over the rounds. The last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

# 2 workers on 2 cores: one engine thread and one OpenMP thread each, in every variant and in
# dist_sync's servers and scheduler (inherited; MXNet reads them when it is imported).
THREADS = {"OMP_NUM_THREADS": "1", "MXNET_CPU_WORKER_NTHREADS": "1"}

VARIANTS = ("alone", "pslink", "pslink_opt", "dist_sync", "dist_sync_opt")
DIST_SYNC_VARIANTS = ("dist_sync", "dist_sync_opt")
OPTIMIZER_ON_STORE = ("pslink_opt", "dist_sync_opt")  # update_on_kvstore=True: the servers step SGD
PSLINK_VARIANTS = ("pslink", "pslink_opt", "pslink_copying")


def build_model(hidden: int, mx, gluon):
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Dense(hidden, activation="relu", in_units=1024),
            gluon.nn.Dense(hidden, activation="relu", in_units=hidden),
            gluon.nn.Dense(1024, activation="relu", in_units=hidden),
            gluon.nn.Dense(10, in_units=1024))
    mx.random.seed(0)
    net.initialize(mx.init.Xavier(), ctx=mx.cpu())
    return net


def worker(args) -> None:
    """One worker of one variant; writes its figures to ``args.out/rank{r}.json``."""
    os.environ.update(THREADS)
    if args.worker == "pslink_copying":
        os.environ["PSLINK_MXNET_ZERO_COPY"] = "0"
    import mxnet as mx
    import numpy as np
    from mxnet import autograd, gluon

    if args.worker in PSLINK_VARIANTS:
        import pslink.mxnet  # noqa: F401 - registers 'pslink'

    store = None
    if args.worker in PSLINK_VARIANTS:
        store = mx.kv.create("pslink")
    elif args.worker in DIST_SYNC_VARIANTS:
        store = mx.kv.create("dist_sync")
    rank = store.rank if store is not None else int(os.environ["PSLINK_RANK"])
    net = build_model(args.hidden, mx, gluon)
    net.hybridize()
    params = net.collect_params()
    trainer_args = {"learning_rate": 0.01}
    if store is None:
        trainer = gluon.Trainer(params, "sgd", trainer_args, kvstore=None)
    else:
        trainer = gluon.Trainer(params, "sgd", trainer_args, kvstore=store,
                                update_on_kvstore=args.worker in OPTIMIZER_ON_STORE)
    rng = np.random.default_rng(rank)
    x = mx.nd.array(rng.standard_normal((args.batch_size, 1024), dtype=np.float32))
    y = mx.nd.array(rng.integers(0, 10, args.batch_size), dtype="float32")
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    times = []
    for step in range(args.warmup + args.steps):
        started = time.perf_counter()
        with autograd.record():
            loss = loss_fn(net(x), y)
        loss.backward()
        trainer.step(args.batch_size)
        mx.nd.waitall()
        elapsed = time.perf_counter() - started
        if step >= args.warmup:
            times.append(elapsed)
    if args.save_weights and rank == 0:
        np.savez(args.save_weights, **{name: p.data().asnumpy() for name, p in params.items()})
    count = sum(p.data().size for p in params.values())
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump({"times": times, "params": count}, f)
    if args.worker in PSLINK_VARIANTS:
        store.close()


def worker_command(variant: str, args) -> list[str]:
    command = [sys.executable, os.path.abspath(__file__), "--worker", variant, "--hidden", str(args.hidden),
               "--batch-size", str(args.batch_size), "--steps", str(args.steps), "--warmup", str(args.warmup)]
    if args.save_weights:
        command += ["--save-weights", os.path.join(args.save_weights, f"{variant}.npz")]
    return command


def run_dist_sync(command: list[str], workers: int, servers: int, timeout: float) -> list[dict]:
    """MXNet's dist_sync: a scheduler, ``servers`` servers (``import mxnet`` with DMLC_ROLE=server
    serves until the workers finish) and the workers, as MXNet's local launcher starts them."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    base = dict(os.environ, **THREADS, DMLC_PS_ROOT_URI="127.0.0.1", DMLC_PS_ROOT_PORT=str(port),
                DMLC_NUM_SERVER=str(servers), DMLC_NUM_WORKER=str(workers))
    serve = [sys.executable, "-c", "import mxnet"]
    with tempfile.TemporaryDirectory(prefix="pslink-bench-dist-sync-") as out:
        roles = [("scheduler", serve)] + [("server", serve)] * servers + [("worker", [*command, "--out", out])] * workers
        procs, logs = [], []
        try:
            for role, argv in roles:
                log = open(os.path.join(out, f"{role}{len(procs)}.log"), "w+")  # noqa: SIM115 - closed below
                logs.append(log)
                procs.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                              env=dict(base, DMLC_ROLE=role)))
            deadline = time.monotonic() + timeout
            for proc in procs:  # the workers end first; then the servers and the scheduler
                proc.wait(max(1.0, deadline - time.monotonic()))
            failed = [(role, p.returncode) for (role, _), p in zip(roles, procs) if p.returncode != 0]
            if failed:
                raise SystemExit(f"dist_sync: {failed} failed:\n" + _logs(logs))
        except subprocess.TimeoutExpired:
            raise SystemExit(f"dist_sync: not done within {timeout:g} s:\n" + _logs(logs)) from None
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait(30)
            for log in logs:
                log.close()
        results = []
        for rank in range(workers):
            with open(os.path.join(out, f"rank{rank}.json")) as f:
                results.append(json.load(f))
        return results


def _logs(logs) -> str:
    text = ""
    for log in logs:
        log.seek(0)
        text += f"--- {os.path.basename(log.name)}\n{log.read()[-3000:]}"
    return text


def run_variant(variant: str, args, service: str, index: int) -> list[dict]:
    from pslink.bench.launched import launch_and_collect

    command = worker_command(variant, args)
    if variant in DIST_SYNC_VARIANTS:
        return run_dist_sync(command, 2, args.servers, timeout=300)
    return launch_and_collect(command, variant, service, f"bench-mxnet-{variant}-{os.getpid()}-{index}")


def main(argv=None) -> int:
    from pslink.bench.launched import add_step_options, alternating, settle_step_options

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_step_options(parser, hidden=2048, batch_size=32, repeats=4)
    parser.add_argument("--servers", type=int, default=2, help="dist_sync's servers (pslink has 2 Aggregators)")
    parser.add_argument("--save-weights", metavar="DIR",
                        help="no timing: run the pslink variants once and save rank 0's final weights to "
                             "DIR/<variant>.npz (to compare two versions of the store bit for bit)")
    parser.add_argument("--compare-copying", action="store_true",
                        help="also run 'pslink_copying': pslink with PSLINK_MXNET_ZERO_COPY=0 (the copying path)")
    parser.add_argument("--worker", choices=[*VARIANTS, "pslink_copying"], help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    settle_step_options(parser, args)
    if args.servers < 1:
        parser.error(f"--servers must be at least 1 (got {args.servers})")
    os.environ.update(THREADS)

    from pslink.bench import figures as fig
    from pslink.core.service import Service

    if args.save_weights:
        os.makedirs(args.save_weights, exist_ok=True)
        with Service(aggregators=2) as service:
            for variant in PSLINK_VARIANTS[:2]:
                run_variant(variant, args, service.address, 0)
        print(json.dumps({"benchmark": "mxnet_gluon", "saved": [os.path.join(args.save_weights, f"{v}.npz")
                                                                  for v in PSLINK_VARIANTS[:2]]}))
        return 0

    variants = (*VARIANTS, "pslink_copying") if args.compare_copying else VARIANTS
    medians: dict[str, list[float]] = {v: [] for v in variants}
    params = 0
    with Service(aggregators=2) as service:
        for index, variant in alternating(variants, args.repeats):
            results = run_variant(variant, args, service.address, index)
            params = results[0]["params"]
            median = statistics.mean(statistics.median(r["times"]) for r in results)
            medians[variant].append(median * 1e3)
            print(f"round {index + 1}/{args.repeats} {variant:14}: median step {median * 1e3:8.1f} ms",
                  flush=True)

    step_ms = {v: statistics.median(m) for v, m in medians.items()}
    what = f"gluon.Trainer step, kvstore='pslink' (summing), {params / 1e6:.1f} M parameters, 2 workers"
    what_opt = (f"gluon.Trainer step, kvstore='pslink' (the service steps SGD), {params / 1e6:.1f} M parameters, "
                "2 workers")
    limit = "the same training alone (no communication: the limit)"
    dist_sync = f"MXNet's dist_sync ({args.servers} servers, summing)"
    dist_sync_opt = f"MXNet's dist_sync ({args.servers} servers stepping SGD, update_on_kvstore)"
    made = [
        fig.measured("mxnet_gluon", what, "ms/step", "lower", medians["pslink"], dist_sync, medians["dist_sync"]),
        fig.measured("mxnet_gluon", what, "ms/step", "lower", medians["pslink"], limit, medians["alone"]),
        fig.measured("mxnet_gluon", what_opt, "ms/step", "lower", medians["pslink_opt"], dist_sync_opt,
                     medians["dist_sync_opt"]),
        fig.measured("mxnet_gluon", what_opt, "ms/step", "lower", medians["pslink_opt"], limit, medians["alone"]),
    ]
    if args.compare_copying:
        made.append(fig.measured("mxnet_gluon", what, "ms/step", "lower", medians["pslink"],
                                 "the same store copying (PSLINK_MXNET_ZERO_COPY=0)", medians["pslink_copying"]))
    print(f"\nmodel: {params / 1e6:.1f} M parameters ({params * 4 / 1e6:.0f} MB of float32 gradients), batch "
          f"{args.batch_size} per worker, 2 workers, {args.steps} steps x {args.repeats} rounds per variant")
    for variant in variants:
        print(f"{variant:14} {step_ms[variant]:9.1f} ms/step")
    for figure in made:
        fig.emit(figure)
    over_dist_sync, over_limit, opt_over_dist_sync, opt_over_limit = made[:4]
    print(f"target: pslink <= 1.20x the limit: {'met' if over_limit.ratio <= 1.20 else 'not met'}; "
          f"<= 0.75x dist_sync: {'met' if over_dist_sync.ratio <= 0.75 else 'not met'}")
    print(json.dumps({
        "benchmark": "mxnet_gluon", "quick": args.quick, "params": params, "batch_size": args.batch_size,
        "workers": 2, "servers": args.servers, "steps": args.steps, "repeats": args.repeats,
        **{f"{v}_step_ms": round(step_ms[v], 2) for v in variants},
        "pslink_over_dist_sync": round(over_dist_sync.ratio, 4), "pslink_over_limit": round(over_limit.ratio, 4),
        "pslink_opt_over_dist_sync": round(opt_over_dist_sync.ratio, 4),
        "pslink_opt_over_limit": round(opt_over_limit.ratio, 4),
        "figures": [f.as_json() for f in made],
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
