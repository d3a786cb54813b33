"""TensorFlow custom-loop training step on CPU, 2 workers: pslink's ParameterServiceStrategy against
TensorFlow's own MultiWorkerMirroredStrategy, and against the limit (no communication at all).

    python benchmarks/tf_strategy.py            # the measured run (8.4 M parameters)
    python benchmarks/tf_strategy.py --quick    # a smoke run: small model, few steps

Every variant runs in this one invocation, alternating round by round (alone, pslink, mwms, then
backward: mwms, pslink, alone, ...; three rounds by default), each as 2 worker processes started by
``pslink launch`` against one embedded service (2 Aggregator processes). "alone" is the limit: the
same training with no communication, each worker by itself, side by side so that the CPUs are
shared alike. "pslink" is the custom loop docs/tf.md documents (a ``tf.function`` step calling
``strategy.run``; Keras' SGD all-reduces the gradients through the strategy). "mwms" is
``tf.distribute.MultiWorkerMirroredStrategy``, each worker with its ``TF_CONFIG`` (2 workers on
127.0.0.1, free ports), its collectives in ring mode over gRPC. Every variant runs with one
intra-op and two inter-op threads per worker (2 workers on 2 cores). A step is forward, backward
(with the gradient exchange) and an SGD step of an MLP 1024 -> H -> H -> 1024 -> 10 (H = 2048:
8.4 M parameters, 33.6 MB of float32 gradients) on a fixed random batch per worker. A round's
figure of a variant is its median step time (per worker, then the mean of the two workers); each
worker's CPU time a step is printed beside it (communication that overlaps compute still takes
CPU from it on 2 cores). The last line is JSON. ``--save-weights DIR`` writes rank 0's final weights of each variant's last
round (``DIR/<variant>.npz``) to compare code versions bit for bit.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time

VARIANTS = ("alone", "pslink", "mwms")
INTRA_THREADS, INTER_THREADS = 1, 2


def free_ports(n: int) -> list[int]:
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def build(tf, keras, hidden: int):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((1024,)), keras.layers.Dense(hidden, activation="relu"),
        keras.layers.Dense(hidden, activation="relu"), keras.layers.Dense(1024, activation="relu"),
        keras.layers.Dense(10),
    ])
    return model, keras.optimizers.SGD(0.01)


def worker(args) -> None:
    """One worker of one variant; writes its figures to ``args.out/rank{r}.json``."""
    rank, size = int(os.environ["PSLINK_RANK"]), int(os.environ["PSLINK_NUM_WORKERS"])
    if args.worker == "mwms":
        os.environ["TF_CONFIG"] = json.dumps({
            "cluster": {"worker": [f"127.0.0.1:{p}" for p in args.ports.split(",")]},
            "task": {"type": "worker", "index": rank}})
    import keras
    import numpy as np
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(INTRA_THREADS)
    tf.config.threading.set_inter_op_parallelism_threads(INTER_THREADS)
    if args.worker == "pslink":
        import pslink.tf

        strategy = pslink.tf.ParameterServiceStrategy()
    elif args.worker == "mwms":
        options = tf.distribute.experimental.CommunicationOptions(
            implementation=tf.distribute.experimental.CommunicationImplementation.RING)
        strategy = tf.distribute.MultiWorkerMirroredStrategy(communication_options=options)
    else:
        strategy = tf.distribute.get_strategy()  # the default: no communication
    generator = np.random.default_rng(rank)
    x = tf.constant(generator.standard_normal((args.batch_size, 1024), dtype=np.float32))
    y = tf.constant(generator.integers(0, 10, args.batch_size), tf.int64)
    with strategy.scope():
        model, optimizer = build(tf, keras, args.hidden)
    loss_of = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")
    global_batch = args.batch_size * size if args.worker != "alone" else args.batch_size

    @tf.function
    def step(x, y):
        def replica_step(x, y):
            with tf.GradientTape() as tape:
                loss = tf.nn.compute_average_loss(loss_of(y, model(x, training=True)),
                                                  global_batch_size=global_batch)
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            return loss
        losses = strategy.run(replica_step, args=(x, y))
        return strategy.reduce(tf.distribute.ReduceOp.SUM, losses, axis=None)

    times, cpu_started = [], 0.0
    for index in range(args.warmup + args.steps):
        if index == args.warmup:
            cpu_started = time.process_time()
        started = time.perf_counter()
        step(x, y).numpy()
        elapsed = time.perf_counter() - started
        if index >= args.warmup:
            times.append(elapsed)
    # This process' CPU time a step (its TensorFlow threads and its Agent's): on 2 shared cores
    # whatever communication costs beyond "alone" slows the step down even when it overlaps.
    cpu_ms = (time.process_time() - cpu_started) * 1e3 / args.steps
    if args.save_weights and rank == 0:
        os.makedirs(args.save_weights, exist_ok=True)
        np.savez(os.path.join(args.save_weights, f"{args.worker}.npz"), *[v.numpy() for v in model.trainable_variables])
    with open(os.path.join(args.out, f"rank{rank}.json.part"), "w") as f:
        json.dump({"times": times, "cpu_ms": cpu_ms, "params": int(sum(np.prod(v.shape) for v in model.trainable_variables))}, f)
    os.replace(os.path.join(args.out, f"rank{rank}.json.part"), os.path.join(args.out, f"rank{rank}.json"))
    sys.stdout.flush()
    if args.worker == "mwms":
        # A worker that leaves while the other still receives its last step's data fails that
        # one ("Socket closed"): leave once every worker wrote its figures (its steps are over).
        deadline = time.monotonic() + 120
        while not all(os.path.exists(os.path.join(args.out, f"rank{r}.json")) for r in range(size)):
            if time.monotonic() > deadline:
                raise SystemExit(f"mwms rank {rank}: the other workers did not finish within 120 s")
            time.sleep(0.05)
        os._exit(0)  # MWMS' gRPC server has no shutdown; the worker would linger


def run_variant(variant: str, args, service: str, index: int) -> list[dict]:
    from pslink.bench.launched import launch_and_collect

    command = [sys.executable, os.path.abspath(__file__), "--worker", variant, "--hidden", str(args.hidden),
               "--batch-size", str(args.batch_size), "--steps", str(args.steps), "--warmup", str(args.warmup),
               "--ports", ",".join(map(str, free_ports(2)))]
    if args.save_weights:
        command.append(f"--save-weights={os.path.abspath(args.save_weights)}")
    return launch_and_collect(command, variant, service, f"bench-tf-{variant}-{os.getpid()}-{index}")


def main(argv=None) -> int:
    from pslink.bench.launched import add_step_options, alternating, chosen_variants, settle_step_options

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_step_options(parser, hidden=2048, batch_size=64, repeats=3,
                     warmup_help="steps before measuring (tracing, first sync)")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="a comma-separated subset (development)")
    parser.add_argument("--save-weights", default="", help="write rank 0's final weights to DIR/<variant>.npz")
    parser.add_argument("--worker", choices=list(VARIANTS), help=argparse.SUPPRESS)
    parser.add_argument("--ports", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    settle_step_options(parser, args)
    variants = chosen_variants(parser, args.variants, VARIANTS)

    from pslink.bench import figures as fig
    from pslink.core.service import Service

    ms: dict[str, list[float]] = {v: [] for v in variants}
    cpu: dict[str, list[float]] = {v: [] for v in variants}
    params = 0
    with Service(aggregators=2) as service:
        for index, variant in alternating(variants, args.repeats):
            results = run_variant(variant, args, service.address, index)
            params = results[0]["params"]
            median = statistics.mean(statistics.median(r["times"]) for r in results)
            ms[variant].append(median * 1e3)
            cpu[variant].append(statistics.mean(r["cpu_ms"] for r in results))
            print(f"round {index + 1}/{args.repeats} {variant:6}: median step {median * 1e3:8.1f} ms, "
                  f"CPU {cpu[variant][-1]:6.1f} ms a step per worker", flush=True)

    step_ms = {v: statistics.median(m) for v, m in ms.items()}
    what = f"TF custom loop step, ParameterServiceStrategy, {params / 1e6:.1f} M parameters, 2 workers"
    made = {}
    if "pslink" in ms and "mwms" in ms:
        made["vs_mwms"] = fig.measured("tf_strategy", what, "ms/step", "lower", ms["pslink"],
                                       "MultiWorkerMirroredStrategy (ring over gRPC)", ms["mwms"])
    if "pslink" in ms and "alone" in ms:
        made["vs_limit"] = fig.measured("tf_strategy", what, "ms/step", "lower", ms["pslink"],
                                        "the same training alone (no communication: the limit)", ms["alone"])
    print(f"\nmodel: {params / 1e6:.1f} M parameters ({params * 4 / 1e6:.1f} MB of float32 gradients), "
          f"batch {args.batch_size} per worker, 2 workers, {args.steps} steps x {args.repeats} rounds per variant")
    cpu_ms = {v: statistics.median(c) for v, c in cpu.items()}
    for variant in variants:
        print(f"{variant:8} {step_ms[variant]:9.1f} ms/step  {cpu_ms[variant]:7.1f} ms CPU a step per worker "
              "(the Aggregators' not counted)")
    for figure in made.values():
        fig.emit(figure)
    if "vs_limit" in made and "vs_mwms" in made:
        met = made["vs_limit"].ratio <= 1.20 and made["vs_mwms"].ratio <= 0.75
        print(f"target: <= 1.20x the limit and <= 0.75x MWMS: {'met' if met else 'not met'}")
    print(json.dumps({
        "benchmark": "tf_strategy", "quick": args.quick, "params": params, "batch_size": args.batch_size,
        "workers": 2, "steps": args.steps, "repeats": args.repeats,
        **{f"{v}_step_ms": round(step_ms[v], 2) for v in variants},
        **{f"{v}_cpu_ms": round(cpu_ms[v], 2) for v in variants},
        **{k: round(f.ratio, 4) for k, f in made.items()},
        "figures": [f.as_json() for f in made.values()],
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
