"""MXNet's 2-bit gradient compression on the pslink store: bytes each worker pushes per step,
the step time and the accuracy reached, with and without, in one run (alternating).

Runs ``pslink launch -n 2 python examples/mxnet/gluon_train.py`` (an MLP on the digits, momentum
SGD on the service) with ``--compression THRESHOLD`` and without, one run of each per round, the
order reversed every other round; the pushed bytes are what the workers' Agents sent as push
payloads (``Agent.payload_bytes``: the initial values once, then every gradient), divided by the
steps. A round's figure is the mean of the two workers'. Reported as figures
(``pslink.bench.figures``), 2-bit against the same training without compression: push bytes per
step, ms per step (the training loop only) and test accuracy, each with the spread of the rounds'
own ratios. Needs MXNet (``pip install -e '.[mxnet]'``); without it, it says so and measures
nothing. The last line is JSON.

    python benchmarks/compression.py           # 3 rounds, threshold 0.5 (MXNet's default), 5 epochs
    python benchmarks/compression.py --quick   # 2 rounds, 3 epochs
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
EXAMPLE = os.path.join(ROOT, "examples", "mxnet", "gluon_train.py")
sys.path.insert(0, ROOT)

from pslink.bench import figures as fig  # noqa: E402

WITHOUT = "the same training without compression"


def run(threshold: float, epochs: int, hidden: int, workdir: str) -> list[dict]:
    result = os.path.join(workdir, f"r-{threshold}-{{rank}}.json")
    command = [sys.executable, "-m", "pslink.cli", "launch", "-n", "2", sys.executable, EXAMPLE, "--no-progress",
               "--epochs", str(epochs), "--hidden", str(hidden), "--compression", str(threshold), "--result", result]
    done = subprocess.run(command, capture_output=True, text=True, timeout=900, stdin=subprocess.DEVNULL, cwd=ROOT)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    results = []
    for rank in (0, 1):
        with open(result.format(rank=rank)) as f:
            results.append(json.load(f))
    return results


def per_round(rounds: list[list[dict]], figure) -> list[float]:
    """One value per round: the mean of its two workers'."""
    return [statistics.mean(figure(x) for x in results) for results in rounds]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threshold", type=float, default=0.5)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--quick", action="store_true", help="smoke run: 2 rounds of 3 epochs")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.epochs = 2, 3
    if args.rounds < 1 or args.epochs < 1 or args.threshold <= 0:
        parser.error(f"--rounds and --epochs must be at least 1 and --threshold above 0 (got {args.rounds}, "
                     f"{args.epochs}, {args.threshold})")
    if importlib.util.find_spec("mxnet") is None:
        # Not a failure: MXNet is an optional extra, and without it there is nothing to compress.
        print("compression: MXNet is not installed (pip install -c constraints.txt -e '.[mxnet]'): nothing measured")
        print(json.dumps({"benchmark": "compression", "skipped": "mxnet is not installed", "figures": []}))
        return 0
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
    report = {"benchmark": "compression", "quick": args.quick, "threshold": args.threshold, "epochs": args.epochs,
              "hidden": args.hidden, "rounds": args.rounds}
    measures = {"push_bytes_per_step": ("push bytes per step per worker", "B/step", "lower",
                                        lambda x: x["push_bytes_per_step"]),
                "ms_per_step": ("step time", "ms/step", "lower", lambda x: x["seconds"] / x["steps"] * 1e3),
                "test_accuracy": ("test accuracy reached", "fraction correct", "higher", lambda x: x["test_accuracy"])}
    made = []
    for key, (what, unit, better, value) in measures.items():
        on, off = per_round(runs["2bit"], value), per_round(runs["off"], value)
        made.append(fig.measured("compression", f"MXNet 2-bit compression (threshold {args.threshold}), digits MLP "
                                 f"{args.hidden} hidden, 2 workers: {what}", unit, better, on, WITHOUT, off))
        report["off"] = {**report.get("off", {}), key: statistics.median(off)}
        report["2bit"] = {**report.get("2bit", {}), key: statistics.median(on)}
    for name in ("off", "2bit"):
        print(f"{name:>5}: {report[name]['push_bytes_per_step']:.0f} push B/step per worker, "
              f"{report[name]['ms_per_step']:.2f} ms/step, test accuracy {report[name]['test_accuracy']:.3f}")
    for figure in made:
        fig.emit(figure)
    report["bytes_ratio"] = round(made[0].ratio, 4)
    report["figures"] = [f.as_json() for f in made]
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
