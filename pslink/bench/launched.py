"""Benchmarks whose workers are processes under ``pslink launch``, each reporting to a file."""

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
