"""MXNet's own ``dist_sync`` store, for tests that compare pslink with it in the same run.

``run_dist_sync(script, args, workers)`` starts what MXNet's ``tools/launch.py --launcher local``
starts: a scheduler and a server (``import mxnet`` under ``DMLC_ROLE=scheduler|server`` runs
them: mxnet.kvstore.kvstore_server) and the workers, with the DMLC_* environment on loopback, and
reaps every one of them by pid.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.mxnet.mxnet_procs import REPO


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_dist_sync(script: Path, args, workers: int = 2, timeout: float = 120) -> str:
    """Run ``python script args`` as ``workers`` workers of MXNet's dist_sync with one server;
    returns their output, or fails naming the process that failed (a server that dies leaves
    the workers waiting: it fails the run at once) or the ones still running at the deadline."""
    env = dict(os.environ, DMLC_PS_ROOT_URI="127.0.0.1", DMLC_PS_ROOT_PORT=str(_free_port()),
               DMLC_NUM_SERVER="1", DMLC_NUM_WORKER=str(workers), DMLC_INTERFACE="lo",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    started: list[tuple[str, subprocess.Popen, object]] = []

    def start(role: str, command: list[str]) -> None:
        log = tempfile.TemporaryFile("w+")  # a file, not a pipe: nothing blocks on a full pipe
        proc = subprocess.Popen(command, env=dict(env, DMLC_ROLE=role), stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, text=True, cwd=str(REPO))
        started.append((f"{role} (pid {proc.pid})", proc, log))

    def outputs() -> str:
        text = []
        for name, proc, log in started:
            log.seek(0)
            text.append(f"--- {name}, exit {proc.poll()}\n{log.read()}")
        return "\n".join(text)

    try:
        start("scheduler", [sys.executable, "-c", "import mxnet"])
        start("server", [sys.executable, "-c", "import mxnet"])
        for _ in range(workers):
            start("worker", [sys.executable, str(script), *map(str, args)])
        deadline = time.monotonic() + timeout
        while any(proc.poll() is None for _, proc, _ in started):
            failed = [name for name, proc, _ in started if proc.poll() not in (None, 0)]
            if failed:
                raise AssertionError(f"MXNet's dist_sync: {', '.join(failed)} failed:\n{outputs()}")
            if time.monotonic() > deadline:
                running = [name for name, proc, _ in started if proc.poll() is None]
                raise AssertionError(f"MXNet's dist_sync: {', '.join(running)} still running after {timeout:g} s:\n"
                                     f"{outputs()}")
            try:
                next(proc for _, proc, _ in started if proc.poll() is None).wait(timeout=0.5)
            except subprocess.TimeoutExpired:
                pass  # look at all of them again
        failed = [name for name, proc, _ in started if proc.returncode != 0]
        if failed:
            raise AssertionError(f"MXNet's dist_sync: {', '.join(failed)} failed:\n{outputs()}")
        return outputs()
    finally:
        for _, proc, log in started:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
            log.close()
