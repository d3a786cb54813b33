"""Helpers for the MXNet adapter's tests: run scripts as workers of a job with `pslink launch`."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
EXAMPLE = REPO / "examples" / "mxnet" / "gluon_train.py"

# Every wait of a worker's Agent ends within this (a hang becomes an error, not a stuck test).
WORKER_TIMEOUT_S = "30"


def worker_env() -> dict:
    env = dict(os.environ)
    env["PSLINK_TIMEOUT"] = WORKER_TIMEOUT_S
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


def _finish(proc: subprocess.Popen, timeout: float, what: str) -> str:
    try:
        out, _ = proc.communicate(timeout=timeout)
        return out
    except subprocess.TimeoutExpired:
        # `pslink launch` stops its workers on SIGTERM; kill it only if it does not.
        proc.send_signal(signal.SIGTERM)
        try:
            out, _ = proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
        raise AssertionError(f"{what} did not finish within {timeout:g} s; output:\n{out}") from None


def launch(script, args, service: str, job: str, workers: int = 2, timeout: float = 100,
           launcher: tuple[str, ...] = ()) -> tuple[int, str]:
    """Run ``python script args`` as ``workers`` workers of ``job`` on ``service`` (more
    ``launcher`` options to `pslink launch`); (status, output)."""
    command = [sys.executable, "-m", "pslink.cli", "launch", "-n", str(workers), "--service", service,
               "--job", job, *launcher, sys.executable, str(script), *map(str, args)]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            stdin=subprocess.DEVNULL, env=worker_env(), cwd=str(REPO))
    out = _finish(proc, timeout, f"pslink launch of {Path(script).name} {' '.join(map(str, args))}")
    return proc.returncode, out


def run_alone(script, args, timeout: float = 100) -> tuple[int, str]:
    """Run ``python script args`` as one plain process (no service)."""
    proc = subprocess.Popen([sys.executable, str(script), *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, stdin=subprocess.DEVNULL, env=worker_env(),
                            cwd=str(REPO))
    out = _finish(proc, timeout, f"{Path(script).name} {' '.join(map(str, args))}")
    return proc.returncode, out
