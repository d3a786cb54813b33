"""``pslink launch``: run N worker processes of a training script against a parameter service.

As ``horovodrun`` or ``torchrun`` do: start an embedded service when none is given, set each
worker's environment (``PSLINK_MASTER``, ``PSLINK_JOB``, ``PSLINK_RANK``, ``PSLINK_NUM_WORKERS``,
``PSLINK_LOCAL_RANK``, ``PSLINK_LOCAL_SIZE``, and torchrun's and horovodrun's names for them), prefix every output line with the worker's rank,
and stop everything when a worker fails (its exit status is returned) or on Ctrl-C.

``pslink launch --pslite -s NS -n NW prog args`` runs a ps-lite program as ps-lite's local
launcher (tracker/dmlc_local.py) does: the program once as the scheduler, NS times as a server
and NW times as a worker, with ps-lite's environment (``DMLC_ROLE``, ``DMLC_PS_ROOT_URI``,
``DMLC_PS_ROOT_PORT``, ``DMLC_NUM_SERVER``, ``DMLC_NUM_WORKER``) and output prefixed by role and
rank. With ``server_mode="service"`` no server processes run: the workers are served by the
parameter service (embedded, or the one given).
"""

from __future__ import annotations

import glob
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import IO, Callable, Sequence

from pslink.core import hosts
from pslink.core.observe import timeline
from pslink.core.observe.timeline import ENV_TIMELINE
from pslink.errors import ConfigError

GRACE_SECONDS = 5.0


def describe_status(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


class _Output:
    """Copies a child's output to ours, one whole line at a time, with a prefix."""

    def __init__(self, sink: IO[str]):
        self.sink = sink
        self.lock = threading.Lock()
        self.threads: list[threading.Thread] = []

    def follow(self, stream, prefix: str) -> None:
        thread = threading.Thread(target=self._copy, args=(stream, prefix), daemon=True)
        thread.start()
        self.threads.append(thread)

    def _copy(self, stream, prefix: str) -> None:
        for raw in iter(stream.readline, b""):
            line = raw.decode(errors="replace").rstrip("\n")
            with self.lock:
                self.sink.write(f"{prefix}{line}\n")
                self.sink.flush()
        stream.close()

    def drain(self, timeout: float = 5.0) -> None:
        for thread in self.threads:
            thread.join(timeout)


class Launch:
    """One launch: the service (own or given), the worker processes, their output."""

    def __init__(
        self,
        command: Sequence[str],
        num_workers: int,
        service: str | None = None,
        aggregators: int = 2,
        job: str | None = None,
        prefix: bool = True,
        output: IO[str] | None = None,
        env: dict | None = None,
        worker_env: Callable[[int], dict] | None = None,
        nnodes: int = 1,
        node_rank: int = 0,
        master_addr: str | None = None,
        master_port: int | None = None,
        timeline: str | None = None,
    ):
        if not command:
            raise ConfigError("pslink launch needs a command to run, e.g. pslink launch -n 2 python train.py")
        if num_workers < 1:
            raise ConfigError(f"-n must be at least 1, got {num_workers}")
        check_nodes(nnodes, node_rank, service, job, master_addr)
        self.command = list(command)
        self.num_workers = num_workers  # on this node
        # torchrun's multi-node form: every node runs num_workers workers; node i's have the
        # global ranks i * num_workers ... (i + 1) * num_workers - 1.
        self.nnodes, self.node_rank = nnodes, node_rank
        self.world_size = nnodes * num_workers
        self.first_rank = node_rank * num_workers
        self.master_addr = master_addr or "127.0.0.1"
        self._master_port = master_port
        self.service_address = service
        self.aggregators = aggregators
        script = next((arg for arg in self.command if arg.endswith(".py")), self.command[0])
        # Unique per launch: a job name must not collide with an earlier run still ending.
        self.job = job or f"{os.path.splitext(os.path.basename(script))[0]}-{os.getpid()}-{int(time.time())}"
        self.prefix = prefix
        self.output = _Output(output or sys.stdout)
        self.env = dict(os.environ if env is None else env)
        self.worker_env = worker_env
        self.procs: list[subprocess.Popen] = []
        self.labels: list[str] = []  # how messages name each process ("rank 1", "server 0")
        self.others = "workers"  # how a failure message names the rest
        self._service = None
        self._scratch: tempfile.TemporaryDirectory | None = None
        # --timeline: each rank writes its own trace here; close() merges them into self.timeline.
        self.timeline = os.path.abspath(timeline) if timeline else None
        self._timelines = tempfile.mkdtemp(prefix="pslink-timeline-") if timeline else None

    def _say(self, message: str) -> None:
        with self.output.lock:
            self.output.sink.write(f"pslink launch: {message}\n")
            self.output.sink.flush()

    def start_service(self) -> str:
        if self.service_address is not None:
            return self.service_address
        from pslink.core.service import Service

        self._scratch = tempfile.TemporaryDirectory(prefix="pslink-launch-")
        self._service = Service(aggregators=self.aggregators, log_dir=os.path.join(self._scratch.name, "logs")).start()
        self.service_address = self._service.address
        return self.service_address

    def environment(self, local_rank: int) -> dict:
        """The environment of this node's worker ``local_rank``."""
        rank = self.first_rank + local_rank
        env = dict(self.env)
        env.update(
            PSLINK_MASTER=self.service_address,
            PSLINK_JOB=self.job,
            PSLINK_RANK=str(rank),
            PSLINK_NUM_WORKERS=str(self.world_size),
            PSLINK_LOCAL_RANK=str(local_rank),
            PSLINK_LOCAL_SIZE=str(self.num_workers),
            # torchrun's names too, so torch.distributed.init_process_group() (gloo, env://) and
            # scripts written for torchrun run unchanged under pslink launch.
            RANK=str(rank),
            WORLD_SIZE=str(self.world_size),
            LOCAL_RANK=str(local_rank),
            LOCAL_WORLD_SIZE=str(self.num_workers),
            GROUP_RANK=str(self.node_rank),
            # horovodrun's names too, for scripts that read them (to shard data before init(),
            # say): the same numbers pslink.torch / .tf / .mxnet.horovod report.
            HOROVOD_RANK=str(rank),
            HOROVOD_SIZE=str(self.world_size),
            HOROVOD_LOCAL_RANK=str(local_rank),
            HOROVOD_LOCAL_SIZE=str(self.num_workers),
            HOROVOD_CROSS_RANK=str(self.node_rank),
            HOROVOD_CROSS_SIZE=str(self.nnodes),
            MASTER_ADDR=self.master_addr,
            MASTER_PORT=str(self._rendezvous_port()),
            PYTHONUNBUFFERED="1",  # lines reach the prefixer as they are printed
        )
        if self.nnodes > 1 and "GLOO_SOCKET_IFNAME" not in env:
            # gloo finds its own address through the host name, which often resolves to loopback
            # (or to another network): the interface that reaches node 0 is the one its peers
            # reach too (torchrun leaves this to the user; a multi-node run hangs without it).
            interface = hosts.interface_toward(self.master_addr)
            if interface is not None:
                env["GLOO_SOCKET_IFNAME"] = interface
        if self._timelines is not None:
            env[ENV_TIMELINE] = os.path.join(self._timelines, f"rank{rank}.json")
        if self.worker_env is not None:
            env.update(self.worker_env(rank))
        return env

    def _merge_timelines(self) -> None:
        paths = sorted(glob.glob(os.path.join(self._timelines, "rank*.json")))
        try:
            if paths:
                events = timeline.merge(paths, self.timeline)
                self._say(f"timeline of {len(paths)} rank(s), {events} events: {self.timeline} (open it in "
                          "https://ui.perfetto.dev or chrome://tracing)")
            else:
                self._say("no timeline was written (no worker used the service?)")
        except (OSError, ValueError) as exc:
            self._say(f"could not merge the timelines in {self._timelines}: {exc}")
            return
        shutil.rmtree(self._timelines, ignore_errors=True)
        self._timelines = None

    def _rendezvous_port(self) -> int:
        """One free port per launch for torch.distributed's env:// rendezvous (MASTER_PORT); on
        several nodes the one given (every node must name the same), torchrun's 29500 by default."""
        if self._master_port is None:
            self._master_port = free_port() if self.nnodes == 1 else DEFAULT_MASTER_PORT
        return self._master_port

    def processes(self) -> list[tuple[str, str, dict]]:
        """What to start: (label for messages, output prefix, environment) per process."""
        specs = []
        for local_rank in range(self.num_workers):
            rank = self.first_rank + local_rank
            specs.append((f"rank {rank}", f"[rank{rank}]: ", self.environment(local_rank)))
        return specs

    def start_workers(self) -> None:
        for label, prefix, env in self.processes():
            proc = subprocess.Popen(
                self.command,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # our Ctrl-C handling stops them, with their children
            )
            self.procs.append(proc)
            self.labels.append(label)
            self.output.follow(proc.stdout, prefix if self.prefix else "")

    def wait(self) -> int:
        """Until every worker succeeded (0) or one failed (its status; the others are stopped).

        One reaper thread per process notes when it exited, so the failure returned is the first
        in time: when one worker fails, its peers often fail a few milliseconds later because of
        it, and the cause is the one to report."""
        exits: queue.Queue = queue.Queue()

        def reap(label: str, proc: subprocess.Popen) -> None:
            exits.put((proc.wait(), label))

        for label, proc in zip(self.labels, self.procs):
            threading.Thread(target=reap, args=(label, proc), daemon=True).start()
        for _ in self.procs:
            while True:
                try:
                    code, label = exits.get(timeout=0.5)  # a timeout keeps Ctrl-C responsive
                    break
                except queue.Empty:
                    continue
            if code != 0:
                self._say(f"{label} {describe_status(code)}; stopping the other {self.others}")
                self.stop_workers()
                return code if code > 0 else 128 - code
        return 0

    def stop_workers(self) -> None:
        alive = [p for p in self.procs if p.poll() is None]
        for proc in alive:
            self._signal(proc, signal.SIGTERM)
        deadline = time.monotonic() + GRACE_SECONDS
        for proc in alive:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self._signal(proc, signal.SIGKILL)
                proc.wait()

    @staticmethod
    def _signal(proc: subprocess.Popen, sig: int) -> None:
        try:
            os.killpg(proc.pid, sig)  # the worker's session: its own children too
        except (ProcessLookupError, PermissionError):
            pass

    def close(self) -> None:
        self.stop_workers()
        self.output.drain()
        if self._timelines is not None:
            self._merge_timelines()
        if self._service is not None:
            self._service.stop()
            self._service = None
        if self._scratch is not None:
            self._scratch.cleanup()
            self._scratch = None

    def run(self) -> int:
        """Start, wait, clean up; Ctrl-C (or SIGTERM) stops everything and returns 130."""
        interrupted = threading.Event()

        def on_signal(signum, frame):
            interrupted.set()
            raise KeyboardInterrupt

        previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)} \
            if threading.current_thread() is threading.main_thread() else {}
        try:
            self.start_service()
            self.start_workers()
            return self.wait()
        except KeyboardInterrupt:
            self._say("interrupted; stopping every process")
            return 130
        finally:
            try:
                self.close()
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)


class PsliteLaunch(Launch):
    """A ps-lite deployment on this machine: a scheduler, servers and workers of one program."""

    SERVER_MODES = ("classic", "service")

    def __init__(self, command: Sequence[str], num_workers: int, num_servers: int = 1,
                 server_mode: str = "classic", host: str = "127.0.0.1", port: int | None = None, **options):
        super().__init__(command, num_workers, **options)
        if num_servers < 0:
            raise ConfigError(f"-s must be at least 0, got {num_servers}")
        if server_mode not in self.SERVER_MODES:
            raise ConfigError(f"--server-mode must be classic or service, got {server_mode!r}")
        if server_mode == "classic" and self.service_address is not None:
            raise ConfigError("--service serves workers only in --server-mode service; classic mode runs the "
                              "program's own servers")
        self.num_servers = num_servers
        self.server_mode = server_mode
        self.host = host
        self.port = port
        self.others = "processes"

    def start_service(self) -> str | None:
        if self.server_mode == "service":
            return super().start_service()
        return None

    def processes(self) -> list[tuple[str, str, dict]]:
        port = self.port or free_port(self.host)
        common = dict(
            DMLC_PS_ROOT_URI=self.host,
            DMLC_PS_ROOT_PORT=str(port),
            DMLC_NUM_SERVER=str(self.num_servers),
            DMLC_NUM_WORKER=str(self.num_workers),
            PSLINK_PSLITE_MODE=self.server_mode,
            PYTHONUNBUFFERED="1",  # lines reach the prefixer as they are printed
        )
        if self.server_mode == "service":
            common.update(PSLINK_MASTER=self.service_address, PSLINK_JOB=self.job)
        roles = [("scheduler", 0)]
        if self.server_mode == "classic":
            roles += [("server", rank) for rank in range(self.num_servers)]
        roles += [("worker", rank) for rank in range(self.num_workers)]
        specs = []
        for role, rank in roles:
            env = dict(self.env)
            env.update(common, DMLC_ROLE=role, PSLINK_PSLITE_RANK=str(rank))
            if self.worker_env is not None and role == "worker":
                env.update(self.worker_env(rank))
            name = "scheduler" if role == "scheduler" else f"{role}{rank}"
            label = "scheduler" if role == "scheduler" else f"{role} {rank}"
            specs.append((label, f"[{name}]: ", env))
        return specs


DEFAULT_MASTER_PORT = 29500  # torchrun's


def check_nodes(nnodes: int, node_rank: int, service: str | None, job: str | None, master_addr: str | None) -> None:
    """The multi-node form's settings: every node must name the same service, job and
    rendezvous, so none of them may be left to a per-node default."""
    if nnodes < 1:
        raise ConfigError(f"--nnodes must be at least 1, got {nnodes}")
    if not 0 <= node_rank < nnodes:
        raise ConfigError(f"--node-rank must be between 0 and {nnodes - 1} (--nnodes {nnodes}), got {node_rank}")
    if nnodes == 1:
        return
    missing = [f"{flag} ({why})" for flag, value, why in (
        ("--service ADDR", service, "the pMaster every node's workers join; `pslink service up` runs one"),
        ("--job NAME", job, "the same job name on every node"),
        ("--master-addr HOST", master_addr, "node 0's address, where torch.distributed's rendezvous "
                                            "(MASTER_ADDR) listens, as torchrun's --master-addr"),
    ) if not value]
    if missing:
        raise ConfigError(f"a launch on {nnodes} nodes needs " + "; ".join(missing))


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now (for the scheduler; ps-lite's tracker does the same)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


def launch(command: Sequence[str], num_workers: int, **options) -> int:
    """Run ``command`` as ``num_workers`` workers of one job; returns the exit status."""
    return Launch(command, num_workers, **options).run()


def launch_pslite(command: Sequence[str], num_workers: int, num_servers: int = 1, **options) -> int:
    """Run a ps-lite program: a scheduler, ``num_servers`` servers (classic mode) and
    ``num_workers`` workers; returns the first failing exit status, or 0."""
    return PsliteLaunch(command, num_workers, num_servers, **options).run()
