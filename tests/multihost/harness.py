"""Running pslink on several hosts (network namespaces) from a test.

Each test makes its own hosts (``hosts`` fixture): a service, Aggregators and workers run there
as real processes started with ``ip netns exec``; the test itself talks to pMaster from inside a
host (``Cluster.client``). Every wait has a deadline; every process is reaped by ``close()``.
"""

from __future__ import annotations

import contextlib
import os
import queue
import shutil
import subprocess
import sys
import threading
import time

import pytest

from pslink.bench import netns
from pslink.core.service.client import ControlClient
from pslink.errors import PslinkError

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PYTHON = sys.executable
PSLINK = [PYTHON, "-m", "pslink.cli"]
WORKER = os.path.join(ROOT, "tests", "multihost", "mh_worker.py")
PORT = 7770


def make_hosts(names):
    reason = netns.unavailable()
    if reason is not None:
        pytest.skip(f"several hosts cannot be made here: {reason}")
    return netns.VirtualHosts(names).start()


class Output:
    """A process's output, read line by line on a thread (a pipe never fills and blocks it)."""

    def __init__(self, proc: subprocess.Popen):
        self.proc = proc
        self.lines: list[str] = []
        self.times: list[float] = []  # time.monotonic() when each line came
        self._new: queue.Queue = queue.Queue()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        for line in iter(self.proc.stdout.readline, ""):
            self.times.append(time.monotonic())
            self.lines.append(line.rstrip("\n"))
            self._new.put(line)
        self._done.set()
        self._new.put(None)

    def wait_for(self, text: str, timeout: float) -> str:
        """The first line containing ``text`` (already read, or arriving within ``timeout``)."""
        deadline = time.monotonic() + timeout
        while True:
            for line in list(self.lines):
                if text in line:
                    return line
            if self._done.is_set():
                raise AssertionError(f"{text!r} never came; the process ended (status {self.proc.poll()}):\n"
                                     + self.text())
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(f"{text!r} did not come within {timeout} s:\n" + self.text())
            try:
                self._new.get(timeout=remaining)
            except queue.Empty:
                pass

    def finish(self, timeout: float) -> int:
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"process did not end within {timeout} s:\n" + self.text()) from None
        self._thread.join(5)
        return code

    def text(self) -> str:
        return "\n".join(self.lines[-60:])


class Cluster:
    """Hosts plus the pslink processes started on them."""

    def __init__(self, hosts: netns.VirtualHosts, env: dict | None = None):
        self.hosts = hosts
        self.env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
        self.outputs: list[Output] = []
        self.scratch: list[str] = []  # directories removed once every process is gone

    def address(self, host: str) -> str:
        return self.hosts.address(host)

    def master(self, host: str = "M") -> str:
        return f"tcp://{self.address(host)}:{PORT}"

    def start(self, host: str, argv, env: dict | None = None) -> Output:
        proc = self.hosts.popen(host, list(argv), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env=dict(self.env, **(env or {})), cwd=ROOT)
        output = Output(proc)
        self.outputs.append(output)
        return output

    def service(self, host: str = "M", aggregators: int = 2, *extra: str, first_join: bool = True) -> Output:
        """``pslink service up`` on ``host``; returns once pMaster answers with every Aggregator.
        ``first_join``: workers may join without a token from the other hosts (a network the test
        trusts)."""
        output = self.start(host, [*PSLINK, "service", "up", "--host", self.address(host), "--port", str(PORT),
                                   "--aggregators", str(aggregators), *(["--allow-first-join"] if first_join else []),
                                   *extra])
        self.wait_status(lambda s: len([a for a in s["aggregators"] if a["alive"]]) >= aggregators, 60,
                         f"{aggregators} Aggregator(s) of the service on {host}", output=output, via=host)
        return output

    @contextlib.contextmanager
    def client(self, via: str = "A", timeout: float = 10.0):
        """A control client to pMaster, its socket made on host ``via``."""
        with self.hosts.enter(via):
            client = ControlClient(self.master(), timeout=timeout)
        try:
            yield client
        finally:
            client.close()

    def status(self, via: str = "A") -> dict:
        with self.client(via) as client:
            return client.status()

    def wait_status(self, ready, timeout: float, what: str, output: Output | None = None, via: str = "A") -> dict:
        """Poll pMaster's status (from host ``via``) until ``ready(status)``."""
        deadline = time.monotonic() + timeout
        last: object = None
        while time.monotonic() < deadline:
            if output is not None and output.proc.poll() is not None:
                raise AssertionError(f"waiting for {what}: the process ended (status {output.proc.returncode}):\n"
                                     + output.text())
            try:
                status = self.status(via)
                if ready(status):
                    return status
                last = status
            except PslinkError as exc:
                last = exc
            time.sleep(0.2)  # polling for a state to come about, with a deadline
        raise AssertionError(f"waiting for {what}: not within {timeout} s (last: {last})"
                             + (f"\n{output.text()}" if output is not None else ""))

    def worker(self, host: str, job: str, rank: int, workers: int, *args: str, out: str | None = None,
               master: str | None = None) -> Output:
        """mh_worker.py on ``host``, given ``master`` (default: pMaster on host M)."""
        argv = [PYTHON, WORKER, "--job", job, "--rank", str(rank), "--num-workers", str(workers),
                "--master", master or self.master(), *args]
        return self.start(host, argv + (["--out", out] if out else []))

    def close(self) -> None:
        self.hosts.close()
        for output in self.outputs:
            output._thread.join(5)
        for path in self.scratch:
            shutil.rmtree(path, ignore_errors=True)
