"""One worker of the multi-host tests: a deterministic training loop on a few keys.

Every worker pushes gradients made from the weights it pulled, its rank and the round, so two runs
of one job (or a run and its twin) end with bit-identical weights exactly when no update was lost
or applied twice. Prints ``round N`` after each round (a test may act at a given round) and writes
the final weights to ``--out`` (``.npy``).
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

import pslink
from pslink.errors import PslinkError


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--job", required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--num-workers", type=int, required=True)
    parser.add_argument("--master", required=True)
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument("--keys", type=int, default=6)
    parser.add_argument("--values", type=int, default=16384, help="float32 values per key")
    parser.add_argument("--pause", type=float, default=0.0, help="seconds of 'compute' per round")
    parser.add_argument("--optimizer", action="store_true", help="the service keeps the weights (momentum SGD)")
    parser.add_argument("--replication", type=int, default=0)
    parser.add_argument("--servers", type=int, default=None)
    parser.add_argument("--exact", action="store_true",
                        help="gradients of multiples of 2**-10: every sum exact, in any order")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    options = {"replication": args.replication}
    if args.servers is not None:
        options["servers"] = args.servers
    if args.optimizer:
        options["optimizer"] = {"type": "sgd", "lr": 0.05, "momentum": 0.9}
    keys = [f"w{k}" for k in range(args.keys)]
    weights = [np.random.default_rng(k).standard_normal(args.values).astype(np.float32) for k in range(args.keys)]
    try:
        with pslink.connect(args.job, args.rank, args.num_workers, args.master, **options) as agent:
            agent.init_many(keys, weights).wait()
            for round_no in range(args.rounds):
                grads = [np.sin(w * (1 + args.rank) + round_no).astype(np.float32) for w in weights]
                if args.exact:
                    grads = [np.round(g * 1024) / np.float32(1024) for g in grads]
                if args.optimizer:  # pushpull answers the new weights
                    agent.pushpull_many(keys, grads, outs=weights).wait()
                else:  # pushpull answers the average gradient; the worker steps
                    agent.pushpull_many(keys, grads, outs=grads, average=True).wait()
                    for w, g in zip(weights, grads):
                        w -= np.float32(0.05) * g
                print(f"round {round_no}", flush=True)
                if args.pause:
                    time.sleep(args.pause)
    except PslinkError as exc:
        print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        return 1
    if args.out:
        np.save(args.out, np.concatenate(weights))
    return 0


if __name__ == "__main__":
    sys.exit(main())
