"""MXNet's 2-bit gradient compression on the pslink store: bytes each worker pushes per step,
the step time and the accuracy reached, with and without, in one run (alternating).

Runs ``pslink launch -n 2 python examples/mxnet/gluon_train.py`` (an MLP on the digits, momentum
SGD on the service) with ``--compression THRESHOLD`` and without, ``--rounds`` times each; the
pushed bytes are what the workers' Agents sent as push payloads (``Agent.payload_bytes``: the
initial values once, then every gradient), divided by the steps.

    python benchmarks/compression.py                 # 3 rounds, threshold 0.5 (MXNet's default)
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
EXAMPLE = os.path.join(os.path.dirname(HERE), "examples", "mxnet", "gluon_train.py")


def run(threshold: float, epochs: int, hidden: int, workdir: str) -> list[dict]:
    result = os.path.join(workdir, f"r-{threshold}-{{rank}}.json")
    command = [sys.executable, "-m", "pslink.cli", "launch", "-n", "2", sys.executable, EXAMPLE, "--no-progress",
               "--epochs", str(epochs), "--hidden", str(hidden), "--compression", str(threshold), "--result", result]
    done = subprocess.run(command, capture_output=True, text=True, timeout=900, stdin=subprocess.DEVNULL)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    return [json.load(open(result.format(rank=r))) for r in (0, 1)]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threshold", type=float, default=0.5)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--hidden", type=int, default=256)
    args = parser.parse_args(argv)
    runs: dict = {"off": [], "2bit": []}
    with tempfile.TemporaryDirectory() as workdir:
        for r in range(args.rounds):
            order = [("off", 0.0), ("2bit", args.threshold)]
            for name, threshold in order if r % 2 == 0 else reversed(order):
                results = run(threshold, args.epochs, args.hidden, workdir)
                runs[name].append(results)
                print(f"  round {r + 1} {name}: " + ", ".join(
                    f"rank {x['rank']} {x['push_bytes_per_step']:.0f} B/step, {x['seconds'] / x['steps'] * 1e3:.2f} "
                    f"ms/step, test accuracy {x['test_accuracy']:.3f}" for x in results), file=sys.stderr)
    report = {"benchmark": "compression", "threshold": args.threshold, "epochs": args.epochs, "hidden": args.hidden}
    for name, rounds in runs.items():
        report[name] = {
            "push_bytes_per_step": statistics.median(x["push_bytes_per_step"] for rs in rounds for x in rs),
            "ms_per_step": statistics.median(x["seconds"] / x["steps"] * 1e3 for rs in rounds for x in rs),
            "test_accuracy": statistics.median(x["test_accuracy"] for rs in rounds for x in rs),
        }
        print(f"{name:>5}: {report[name]['push_bytes_per_step']:.0f} push B/step per worker, "
              f"{report[name]['ms_per_step']:.2f} ms/step, test accuracy {report[name]['test_accuracy']:.3f}")
    report["bytes_ratio"] = round(report["2bit"]["push_bytes_per_step"] / report["off"]["push_bytes_per_step"], 4)
    print(f"2bit / off bytes: {report['bytes_ratio']}")
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
