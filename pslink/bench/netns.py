"""Several hosts on one machine, for tests and benchmarks: one network namespace per host.

Each host is a network namespace with one interface (``eth0``, address ``10.77.0.N/16``) whose
veth peer sits on a bridge in a namespace of its own, so nothing is added to the machine's own
network: traffic goes only between these namespaces (and each one's loopback). ``shape`` puts a
token bucket (``tc ... tbf``) on both directions of a host's link, as a NIC of that speed.

    with VirtualHosts(["M", "A", "B"]) as hosts:
        hosts.shape("A", "1gbit")
        proc = hosts.popen("M", ["pslink", "service", "up", "--host", hosts.address("M")])
        ...
        hosts.kill("B")          # every process of host B at once

Processes run in a host with ``ip netns exec`` (its pid is the program's own: ``ip`` execs it);
``enter(host)`` moves the calling thread into a host, for sockets made in-process (a socket stays
in the namespace it was made in, whatever thread uses it). Everything is removed on ``close()``,
and namespaces a crashed run left behind are removed by the next one. Needs root and iproute2;
:func:`unavailable` says why they cannot be made, for a visible skip.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import shutil
import signal
import subprocess
import time
from typing import Sequence

SUBNET = "10.77"
NETNS_DIR = "/var/run/netns"
_PREFIX = "plk"  # namespaces are named plk<pid>-<host>: a later run knows whose they were
_CLONE_NEWNET = 0x40000000


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and result.returncode != 0:
        raise OSError(f"ip {' '.join(args)} failed: {result.stderr.strip() or result.returncode}")
    return result


def unavailable() -> str | None:
    """Why hosts cannot be made here (None when they can)."""
    if os.geteuid() != 0:
        return "network namespaces need root (CI runs as root)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` (iproute2) is not installed"
    name = f"{_PREFIX}{os.getpid()}-probe"
    try:
        _ip("netns", "add", name)
    except OSError as exc:
        return f"cannot make a network namespace: {exc}"
    _ip("netns", "del", name, check=False)
    return None


def remove_stale() -> None:
    """Remove the namespaces of runs whose process is gone (a killed test run leaves them)."""
    try:
        names = os.listdir(NETNS_DIR)
    except OSError:
        return
    for name in names:
        match = re.fullmatch(rf"{_PREFIX}(\d+)-.+", name)
        if match and not os.path.exists(f"/proc/{match.group(1)}"):
            _kill_all(name)
            _ip("netns", "del", name, check=False)


def _pids(namespace: str) -> list[int]:
    result = _ip("netns", "pids", namespace, check=False)
    return [int(p) for p in result.stdout.split()] if result.returncode == 0 else []


def _kill_all(namespace: str, sig: int = signal.SIGKILL) -> list[int]:
    pids = _pids(namespace)
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
    return pids


def _setns(fd: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, _CLONE_NEWNET) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"setns: {os.strerror(errno)}")


def burst_for(rate: str) -> str:
    """A token bucket of 10 ms at ``rate`` (at least 64 KiB): a 10 Gbit/s link needs MBs of burst,
    or the bucket, not the rate, limits it."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kmg]?)bit", rate.lower())
    if not match:
        raise ValueError(f"rate {rate!r} must look like 1gbit, 500mbit or 10gbit")
    bits = float(match.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[match.group(2)]
    return f"{max(64 * 1024, int(bits / 8 / 100))}b"


class VirtualHosts:
    """Hosts named ``names`` (addresses 10.77.0.1, .2, ... in that order), on one bridge."""

    def __init__(self, names: Sequence[str]):
        if not names or len(set(names)) != len(names):
            raise ValueError(f"host names must be distinct and at least one, got {list(names)}")
        self.names = list(names)
        self.tag = f"{_PREFIX}{os.getpid()}-{int(time.monotonic() * 1000) % 100000}"
        self.bridge = f"{self.tag}-bridge"
        self.procs: list[subprocess.Popen] = []
        self._made: list[str] = []
        self.rates: dict[str, str] = {}

    # -- making and removing -----------------------------------------------------------------------

    def start(self) -> "VirtualHosts":
        remove_stale()
        try:
            self._add(self.bridge)
            _ip("-n", self.bridge, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.bridge, "link", "set", "br0", "up")
            for index, name in enumerate(self.names, start=1):
                namespace = self.namespace(name)
                self._add(namespace)
                port = f"p{index}"
                _ip("link", "add", "name", "eth0", "netns", namespace, "type", "veth", "peer", "name", port,
                    "netns", self.bridge)
                _ip("-n", self.bridge, "link", "set", port, "master", "br0")
                _ip("-n", self.bridge, "link", "set", port, "up")
                _ip("-n", namespace, "addr", "add", f"{self.address(name)}/16", "dev", "eth0")
                _ip("-n", namespace, "link", "set", "eth0", "up")
                _ip("-n", namespace, "link", "set", "lo", "up")
        except BaseException:
            self.close()
            raise
        return self

    def _add(self, namespace: str) -> None:
        _ip("netns", "add", namespace)
        self._made.append(namespace)

    def close(self) -> None:
        """Stop every process of every host and remove the namespaces (idempotent)."""
        for namespace in self._made:
            _kill_all(namespace)
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                pass
        for namespace in reversed(self._made):
            _ip("netns", "del", namespace, check=False)
        self._made = []

    def __enter__(self) -> "VirtualHosts":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    # -- naming ----------------------------------------------------------------------------------

    def namespace(self, name: str) -> str:
        if name not in self.names:
            raise KeyError(f"no host {name!r}; hosts are {self.names}")
        return f"{self.tag}-{name}"

    def address(self, name: str) -> str:
        index = self.names.index(name) + 1
        return f"{SUBNET}.{index // 256}.{index % 256}"

    # -- links -----------------------------------------------------------------------------------

    def shape(self, name: str, rate: str, latency: str = "50ms") -> None:
        """Limit host ``name``'s link to ``rate`` (e.g. ``1gbit``) in both directions."""
        burst = burst_for(rate)
        port = f"p{self.names.index(name) + 1}"
        for namespace, device in ((self.namespace(name), "eth0"), (self.bridge, port)):
            _ip("netns", "exec", namespace, "tc", "qdisc", "replace", "dev", device, "root", "tbf", "rate", rate,
                "burst", burst, "latency", latency)
        self.rates[name] = rate

    def cut(self, name: str) -> None:
        """Partition host ``name`` from every other (its port on the bridge down): its processes
        live on, and packets to and from it are lost until :meth:`heal`."""
        _ip("-n", self.bridge, "link", "set", f"p{self.names.index(name) + 1}", "down")

    def heal(self, name: str) -> None:
        _ip("-n", self.bridge, "link", "set", f"p{self.names.index(name) + 1}", "up")

    # -- processes -------------------------------------------------------------------------------

    def command(self, name: str, argv: Sequence[str]) -> list[str]:
        return ["ip", "netns", "exec", self.namespace(name), *argv]

    def popen(self, name: str, argv: Sequence[str], **options) -> subprocess.Popen:
        """Start ``argv`` on host ``name`` (stopped by ``close()`` if still running)."""
        options.setdefault("stdin", subprocess.DEVNULL)
        proc = subprocess.Popen(self.command(name, argv), **options)
        self.procs.append(proc)
        return proc

    def run(self, name: str, argv: Sequence[str], timeout: float, **options) -> subprocess.CompletedProcess:
        options.setdefault("stdin", subprocess.DEVNULL)
        return subprocess.run(self.command(name, argv), timeout=timeout, **options)

    def pids(self, name: str) -> list[int]:
        return _pids(self.namespace(name))

    def kill(self, name: str, sig: int = signal.SIGKILL) -> list[int]:
        """Signal every process of host ``name`` at once (a host failing); returns their pids.
        Those this object started are reaped."""
        pids = _kill_all(self.namespace(name), sig)
        for proc in self.procs:
            if proc.pid in pids:
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    pass
        return pids

    @contextlib.contextmanager
    def enter(self, name: str):
        """Run the body with the calling thread in host ``name``'s network namespace: sockets
        made meanwhile belong to that host."""
        original = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
        target = os.open(os.path.join(NETNS_DIR, self.namespace(name)), os.O_RDONLY)
        try:
            _setns(target)
            try:
                yield
            finally:
                _setns(original)
        finally:
            os.close(target)
            os.close(original)


# -- running a benchmark's processes on the hosts --------------------------------------------------


def start_on(hosts: VirtualHosts, host: str, argv: Sequence[str], cwd: str | None = None,
             env: dict | None = None, **options) -> subprocess.Popen:
    """``argv`` on ``host``, its output (stderr too) on a pipe, unbuffered."""
    return hosts.popen(host, list(argv), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=cwd,
                       env=dict(os.environ, PYTHONUNBUFFERED="1", **(env or {})), **options)


def finish(proc: subprocess.Popen, timeout: float, what: str) -> str:
    """``proc``'s whole output once it ended well; SystemExit naming ``what`` if not."""
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        raise SystemExit(f"{what} did not finish within {timeout} s:\n{out[-3000:]}")
    if proc.returncode != 0:
        raise SystemExit(f"{what} failed (status {proc.returncode}):\n{out[-3000:]}")
    return out


def wait_service(hosts: VirtualHosts, via: str, master: str, aggregators: int, proc: subprocess.Popen,
                 timeout: float = 60) -> None:
    """Return once the service at ``master`` (seen from host ``via``) has ``aggregators`` alive."""
    from pslink.core.service.client import ControlClient
    from pslink.errors import PslinkError

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the service on {via} ended:\n{proc.communicate()[0][-3000:]}")
        try:
            with hosts.enter(via):
                client = ControlClient(master, timeout=5)
            with client:
                if len([a for a in client.status()["aggregators"] if a["alive"]]) >= aggregators:
                    return
        except PslinkError:
            pass
        time.sleep(0.2)  # polling for the service to come up, with a deadline
    raise SystemExit(f"the service at {master} did not get {aggregators} Aggregator(s) within {timeout} s")
