"""The ``local`` provider: Aggregators as subprocesses on this machine."""

from __future__ import annotations

import os
import subprocess
import sys

from pslink.core import hosts
from pslink.core.credential_files import ENV_AGGREGATOR_CREDENTIAL
from pslink.core.service.providers.base import Provider


class LocalProvider(Provider):
    """Runs ``python -m pslink.core.aggregator.process`` per Aggregator and reaps it on stop.

    ``log_dir`` collects each Aggregator's output in ``<name>.log``; without it the output goes to
    this process's stderr.
    """

    def __init__(self, master: str, listen_host: str = "127.0.0.1", log_dir: str | None = None,
                 orphan_timeout: float = 60.0, log_level: str | None = None, scheme: str | None = None,
                 advertise: str | None = None, interface: str | None = None):
        super().__init__()
        self.master = master
        self.listen_host = listen_host
        # Aggregators speak the transport pMaster was given (tcp or zmq+tcp).
        self.scheme = scheme or (master.split("://", 1)[0] if master.startswith("zmq+tcp://") else "tcp")
        self.log_dir = log_dir
        self.advertise = advertise
        self.interface = interface
        self.orphan_timeout = orphan_timeout
        self.log_level = log_level or os.environ.get("PSLINK_LOG_LEVEL", "WARNING")
        self._procs: dict[str, subprocess.Popen] = {}
        self._ended: dict[str, subprocess.Popen] = {}  # stopped (or reaped after a failure)
        self._logs: dict[str, str] = {}

    def start(self, count: int) -> list[str]:
        names = []
        for _ in range(count):
            name = self.next_name()
            command = [
                sys.executable, "-m", "pslink.core.aggregator",
                "--master", self.master,
                "--listen", f"{self.scheme}://{hosts.bracket(self.listen_host)}:0",
                "--name", name,
                "--orphan-timeout", str(self.orphan_timeout),
                "--log-level", self.log_level,
                *(["--advertise", self.advertise] if self.advertise else []),
                *(["--interface", self.interface] if self.interface else []),
            ]
            output = None
            if self.log_dir is not None:
                os.makedirs(self.log_dir, exist_ok=True)
                path = self._logs[name] = os.path.join(self.log_dir, f"{name}.log")
                output = open(path, "ab")
            try:
                # The credential goes in the environment, which only its user (and root) can read.
                env = dict(os.environ, **({ENV_AGGREGATOR_CREDENTIAL: self.credential} if self.credential else {}))
                self._procs[name] = subprocess.Popen(
                    command, stdin=subprocess.DEVNULL, stdout=output, stderr=subprocess.STDOUT if output else None,
                    env=env,
                )
            finally:
                if output is not None:
                    output.close()
            names.append(name)
        return names

    def stop(self, name: str, timeout: float = 5.0) -> None:
        proc = self._procs.pop(name, None)
        if proc is None:
            return
        self._ended[name] = proc  # diagnose() still tells how it ended
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout)

    def wait_exit(self, timeout: float) -> None:
        """Give Aggregators that were asked to shut down the chance to exit on their own."""
        for proc in self._procs.values():
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass

    def names(self) -> list[str]:
        return list(self._procs)

    def pid(self, name: str) -> int | None:
        proc = self._procs.get(name)
        return proc.pid if proc is not None else None

    def diagnose(self, name: str) -> str:
        proc = self._procs.get(name) or self._ended.get(name)
        status = "not started" if proc is None else (
            "running" if proc.poll() is None else f"exited with status {proc.returncode}"
        )
        tail = ""
        path = self._logs.get(name)
        if path and os.path.exists(path):
            with open(path, "rb") as f:
                tail = f.read()[-2000:].decode(errors="replace")
        return f"{name}: {status}" + (f"\n{tail}" if tail else "")
