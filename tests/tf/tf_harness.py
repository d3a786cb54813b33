"""Runs TensorFlow workers for the tests in this directory: N processes under pslink launch.

The launch (its embedded service and its workers) lives in the test process, so that every
process it started is stopped when the test ends, also on a timeout or a failure.
"""

from __future__ import annotations

import io
import os
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from pslink.launch import Launch

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
WORKER = HERE / "tf_worker.py"


@dataclass
class Outcome:
    code: int
    output: str
    timed_out: bool
    seconds: float

    def describe(self) -> str:
        state = "timed out" if self.timed_out else f"exit status {self.code}"
        return f"{state} after {self.seconds:.0f} s; output:\n{self.output[-6000:]}"


def launch(command: list[str], workers: int = 2, timeout: float = 240.0, env: dict | None = None) -> Outcome:
    """Run ``command`` as ``workers`` workers of one job (``env``: more of their environment);
    stop them all after ``timeout`` s."""
    output = io.StringIO()
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=os.pathsep.join(
        p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p), **(env or {}))
    run = Launch(command, workers, output=output, env=env)
    timed_out = threading.Event()

    def expire():
        timed_out.set()
        run.stop_workers()

    timer = threading.Timer(timeout, expire)
    started = time.monotonic()
    try:
        run.start_service()
        run.start_workers()
        timer.start()
        code = run.wait()
    finally:
        timer.cancel()
        run.close()
    return Outcome(code, output.getvalue(), timed_out.is_set(), time.monotonic() - started)


def launch_worker(*args: str, workers: int = 2, timeout: float = 240.0) -> Outcome:
    """Run tests/tf/tf_worker.py with ``args`` as ``workers`` workers."""
    pytest.importorskip("sklearn", reason="scikit-learn is not installed (the workers train on its digits)")
    return launch([sys.executable, str(WORKER), *args], workers, timeout)
