"""Benchmarks whose workers are processes under ``pslink launch``, each reporting to a file: the
launch itself, the options and alternating rounds of the training-step benchmarks that run such
workers, and Horovod's own launcher for their baseline."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tempfile

from pslink.launch import launch


def launch_and_collect(command: list[str], what: str, service: str, job: str, workers: int = 2) -> list[dict]:
    """Run ``command`` + ``--out DIR`` as ``workers`` processes of ``job`` on ``service``; each
    writes ``DIR/rank<r>.json``. Returns those, in rank order (``what`` names them if they fail)."""
    with tempfile.TemporaryDirectory(prefix="pslink-bench-") as out:
        log = io.StringIO()
        code = launch([*command, "--out", out], workers, service=service, job=job, output=log)
        if code != 0:
            raise SystemExit(f"the {what} workers failed (status {code}):\n{log.getvalue()}")
        return _collected(out, workers)


# -- the training-step benchmarks (torch_ddp, mxnet_gluon, tf_strategy) ---------------------------


def add_step_options(parser, *, hidden: int, batch_size: int, repeats: int,
                     warmup_help: str = "steps before measuring") -> None:
    """The options every training-step benchmark takes: the model's width, the batch, the
    measured and warm-up steps of a run, the rounds, and ``--quick`` (:func:`quick_form`)."""
    parser.add_argument("--quick", action="store_true", help="smoke run: H=512, 10 steps, 2 rounds")
    parser.add_argument("--hidden", type=int, default=hidden, help="H, the width of the hidden layers")
    parser.add_argument("--batch-size", type=int, default=batch_size, help="samples a step, per worker")
    parser.add_argument("--steps", type=int, default=20, help="measured steps per run")
    parser.add_argument("--warmup", type=int, default=3, help=warmup_help)
    parser.add_argument("--repeats", type=int, default=repeats, help="rounds: runs of each variant, alternating")


def settle_step_options(parser, args) -> None:
    """``--quick``'s form (a small model, H=512, 10 steps after 2 of warm-up, 2 rounds), then the
    counts checked: a bad one is the parser's error, naming it."""
    if args.quick:
        args.hidden, args.steps, args.warmup, args.repeats = 512, 10, 2, 2
    if args.repeats < 1 or args.steps < 1:
        parser.error(f"--repeats and --steps must be at least 1 (got {args.repeats}, {args.steps})")


def chosen_variants(parser, given: str, variants) -> tuple:
    """The variants a development run's ``--variants`` names (comma-separated), in the
    benchmark's own order; an unknown name is the parser's error."""
    names = given.split(",")
    chosen = tuple(v for v in variants if v in names)
    unknown = sorted(set(names) - set(variants))
    if unknown or not chosen:
        parser.error(f"--variants takes some of {', '.join(variants)}; got {given!r}")
    return chosen


def alternating(variants, repeats: int):
    """``(round, variant)``: every variant once a round, the order reversed every other round,
    so that a variant's place in the round (a warmer page cache, a service that just served
    another job) favours none of them."""
    variants = tuple(variants)
    for index in range(repeats):
        for variant in variants if index % 2 == 0 else variants[::-1]:
            yield index, variant


# -- Horovod itself, as a baseline: built from its sdist into a directory (ENVIRONMENT.md) ---------


#: What a figure says in place of a ratio when Horovod is not there to measure.
HOROVOD_MISSING = ("Horovod not run: set PSLINK_BENCH_HOROVOD=DIR, a directory Horovod 0.28.1 was installed into "
                   "with pip install --target DIR (ENVIRONMENT.md says how to build it)")


def add_horovod_path(parser) -> None:
    parser.add_argument("--horovod-path", default=os.environ.get("PSLINK_BENCH_HOROVOD"),
                        help="a directory Horovod was installed into (pip install --target), if not in this "
                             "environment (default: $PSLINK_BENCH_HOROVOD)")


def _with_horovod(path: str | None) -> dict:
    return dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [path, os.environ.get("PYTHONPATH")])))


def horovod_available(path: str | None) -> bool:
    """Horovod imports (from ``path`` too, a ``pip install --target`` directory, if given)."""
    probe = subprocess.run([sys.executable, "-c", "import horovod.torch"], env=_with_horovod(path),
                           capture_output=True, timeout=120)
    return probe.returncode == 0


def horovodrun_and_collect(command: list[str], horovod_path: str | None, workers: int = 2,
                           timeout: float = 900) -> list[dict]:
    """Run ``command`` + ``--out DIR`` as ``workers`` processes under ``horovodrun --gloo``; each
    writes ``DIR/rank<r>.json``. Returns those, in rank order."""
    with tempfile.TemporaryDirectory(prefix="pslink-bench-horovod-") as out:
        launcher = [sys.executable, "-m", "horovod.runner.launch", "-np", str(workers), "-H", f"localhost:{workers}",
                    "--gloo"]
        done = subprocess.run([*launcher, *command, "--out", out], env=_with_horovod(horovod_path),
                              capture_output=True, text=True, timeout=timeout)
        if done.returncode != 0:
            raise SystemExit(f"the horovod workers failed (status {done.returncode}):\n{done.stdout}\n{done.stderr}")
        return _collected(out, workers)


def _collected(out: str, workers: int) -> list[dict]:
    results = []
    for rank in range(workers):
        with open(os.path.join(out, f"rank{rank}.json")) as f:
            results.append(json.load(f))
    return results
