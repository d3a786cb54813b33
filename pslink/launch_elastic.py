"""``pslink launch --min-np A --max-np B``: an elastic job, whose workers come and go.

As ``horovodrun --min-np A --max-np B`` on one machine. The launcher keeps the number of
running workers at a target: ``-n`` (default A), or what ``--discovery`` says, polled (a file
holding a number, or an executable printing one; lines ``host:slots`` add up their slots, as
Horovod's host discovery scripts print), clipped to [A, B].

- **More wanted**: it starts workers, each under the lowest rank no running worker has (ranks
  stay below B, the job's ``max_workers``); they join the running job (pslink.torch.elastic
  syncs them).
- **Fewer wanted**: it stops the newest workers with SIGTERM (pslink.torch.elastic leaves the
  job at once on it), and SIGKILL after a grace period.
- **A worker dies**: the launcher says which (rank, pid, exit status or signal) and the job goes
  on with the others, whose rounds stop waiting for it once pMaster drops it (at once for a
  clean exit; after the heartbeat timeout for a killed process). Up to ``--max-restarts`` dead
  workers are replaced. If fewer than A workers can remain, every worker is stopped and the
  launch fails, saying so.
- **A worker finishes** (exit status 0): the job is ending; no worker is started or replaced any
  more, and the launch returns 0 once every worker has exited.
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import tempfile
import threading
import time
from typing import Sequence

from pslink.core.config import ENV_ELASTIC
from pslink.errors import ConfigError
from pslink.launch import GRACE_SECONDS, Launch, describe_status

POLL_SECONDS = 0.2  # how often the launcher looks at its workers when none exits


class _Worker:
    __slots__ = ("rank", "proc", "order", "stopping_since")

    def __init__(self, rank: int, proc: subprocess.Popen, order: int):
        self.rank, self.proc, self.order = rank, proc, order
        self.stopping_since: float | None = None  # when the launcher sent it SIGTERM


class ElasticLaunch(Launch):
    """One elastic launch: see the module's notes."""

    def __init__(self, command: Sequence[str], min_np: int, max_np: int, num_workers: int | None = None, *,
                 discovery: str | None = None, discovery_interval: float = 1.0, max_restarts: int = 3,
                 heartbeat_timeout: float | None = None, **options):
        if min_np < 1 or max_np < min_np:
            raise ConfigError(f"--min-np and --max-np need 1 <= min <= max, got {min_np} and {max_np}")
        initial = min_np if num_workers is None else num_workers
        if not min_np <= initial <= max_np:
            raise ConfigError(f"-n {initial} is outside [--min-np {min_np}, --max-np {max_np}]")
        if max_restarts < 0:
            raise ConfigError(f"--max-restarts must be >= 0, got {max_restarts}")
        if heartbeat_timeout is not None and not heartbeat_timeout > 0:
            raise ConfigError(f"--heartbeat-timeout must be > 0 seconds, got {heartbeat_timeout}")
        if discovery is not None and not os.path.exists(discovery):
            raise ConfigError(f"--discovery {discovery!r}: no such file or script")
        super().__init__(command, initial, **options)
        self.min_np, self.max_np = min_np, max_np
        self.discovery = discovery
        self.discovery_interval = discovery_interval
        self.max_restarts = max_restarts
        self.heartbeat_timeout = heartbeat_timeout
        self.wanted = initial
        self.restarts = 0
        self.lost = 0  # dead workers past the restart budget: the job runs with fewer
        self.finished = False
        self.failure: int | None = None
        self.running: dict[int, _Worker] = {}  # rank -> its (latest) process
        self._exits: queue.Queue = queue.Queue()
        self._started = 0
        self._next_discovery = 0.0
        self._discovery_error: str | None = None
        self._token_dir = tempfile.TemporaryDirectory(prefix="pslink-elastic-")
        self._token_file = os.path.join(self._token_dir.name, "token")
        self._departed: set[int] = set()  # ranks whose process exited: pMaster may still count them

    # -- service and environment ---------------------------------------------------------------

    def start_service(self) -> str:
        if self.service_address is not None or self.heartbeat_timeout is None:
            if self.heartbeat_timeout is not None:
                self._say("--heartbeat-timeout applies to the embedded service only; the given service keeps its own")
            return super().start_service()
        from pslink.core.service import Service

        # A dead process's connection closes at once: it is dropped after the timeout. A silent
        # one (hung, its heartbeats lost) after at least 10 s, well above the heartbeat interval.
        master = {"disconnect_grace": self.heartbeat_timeout, "worker_timeout": max(self.heartbeat_timeout, 10.0),
                  "sweep_interval": min(1.0, self.heartbeat_timeout / 4)}
        self._scratch = tempfile.TemporaryDirectory(prefix="pslink-launch-")
        self._service = Service(aggregators=self.aggregators, log_dir=os.path.join(self._scratch.name, "logs"),
                                master_options=master).start()
        self.service_address = self._service.address
        return self.service_address

    def environment(self, rank: int) -> dict:
        env = super().environment(rank)
        # PSLINK_NUM_WORKERS stays the initial count (the job's first worker creates it with it);
        # ranks up to max-np may come in while it runs.
        env.update({"PSLINK_MAX_WORKERS": str(self.max_np), ENV_ELASTIC: "1", "PSLINK_TOKEN_FILE": self._token_file})
        if os.path.exists(self._token_file):
            # A rank that was in the job registers again only with the job's token.
            with open(self._token_file) as f:
                env["PSLINK_TOKEN"] = f.read().strip()
        return env

    # -- workers ---------------------------------------------------------------------------------

    def start_workers(self) -> None:
        for _ in range(self.num_workers):
            self._start_worker()

    def _free_rank(self) -> int | None:
        """The lowest rank no running worker has and pMaster no longer counts as a member. (With
        a service of its own the launcher sees pMaster's membership; with another one it reuses
        a rank at once, and pslink.torch.elastic makes the new worker register anew.)"""
        record = self._service.master.state.jobs.get(self.job) if self._service is not None else None
        if record is not None:
            self._departed &= set(record.membership.ranks)
        else:
            self._departed.clear()
        free = [r for r in range(self.max_np) if r not in self.running and r not in self._departed]
        return free[0] if free else None

    def _start_worker(self) -> bool:
        rank = self._free_rank()
        if rank is None:
            return False  # its rank is still being dropped from the job: next poll
        proc = subprocess.Popen(self.command, env=self.environment(rank), stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
        worker = _Worker(rank, proc, self._started)
        self._started += 1
        self.running[rank] = worker
        self.procs.append(proc)
        self.labels.append(f"rank {rank}")
        self.output.follow(proc.stdout, f"[rank{rank}]: " if self.prefix else "")
        threading.Thread(target=lambda: self._exits.put((worker, proc.wait())), daemon=True).start()
        if self._started > self.num_workers:
            self._say(f"started rank {rank} (pid {proc.pid}); {len(self.running)} worker(s) now")
        return True

    def _stop_worker(self, worker: _Worker) -> None:
        worker.stopping_since = time.monotonic()
        self._signal(worker.proc, signal.SIGTERM)
        self._say(f"removing rank {worker.rank} (pid {worker.proc.pid}); {self._active()} worker(s) remain")

    def _active(self) -> int:
        return sum(1 for w in self.running.values() if w.stopping_since is None)

    # -- the target ------------------------------------------------------------------------------

    def _discover(self) -> None:
        now = time.monotonic()
        if self.discovery is None or now < self._next_discovery:
            return
        self._next_discovery = now + self.discovery_interval
        try:
            count = discover(self.discovery)
        except (OSError, ValueError, subprocess.SubprocessError) as exc:
            message = f"--discovery {self.discovery}: {exc}; keeping {self.wanted} worker(s)"
            if message != self._discovery_error:  # say it once, not every poll
                self._say(message)
                self._discovery_error = message
            return
        self._discovery_error = None
        wanted = max(self.min_np, min(self.max_np, count))
        if wanted != count:
            self._say(f"discovery asks for {count} worker(s); running {wanted} (--min-np {self.min_np}, "
                      f"--max-np {self.max_np})")
        self.wanted = wanted

    def _rescale(self) -> None:
        if self.finished or self.failure is not None:
            return
        self._discover()
        target = self.wanted - self.lost
        while self._active() < target and self._start_worker():
            pass
        active = sorted((w for w in self.running.values() if w.stopping_since is None), key=lambda w: w.order)
        for worker in active[target:][::-1]:  # the newest go first
            self._stop_worker(worker)
        now = time.monotonic()
        for worker in self.running.values():
            if worker.stopping_since is not None and now - worker.stopping_since > GRACE_SECONDS:
                self._signal(worker.proc, signal.SIGKILL)

    def _exited(self, worker: _Worker, code: int) -> None:
        if self.running.get(worker.rank) is worker:
            del self.running[worker.rank]
        self._departed.add(worker.rank)
        label = f"rank {worker.rank} (pid {worker.proc.pid})"
        if worker.stopping_since is not None:
            self._say(f"{label} removed; it {describe_status(code)}")
            return
        if code == 0:
            if not self.finished:
                self._say(f"{label} finished; the job is ending")
            self.finished = True
            return
        left = self._active()
        if self.finished:
            self._say(f"{label} {describe_status(code)} while the job was ending")
            return
        if self.restarts < self.max_restarts:
            self.restarts += 1
            self._say(f"{label} {describe_status(code)}; {left} worker(s) continue, starting a replacement "
                      f"({self.restarts} of --max-restarts {self.max_restarts})")
        else:
            self.lost += 1
            self._say(f"{label} {describe_status(code)}; {left} worker(s) continue (--min-np {self.min_np}, "
                      f"no restarts left)")
        if self.wanted - self.lost < self.min_np:
            self._say(f"only {left} worker(s) left, fewer than --min-np {self.min_np}: the job fails; "
                      "stopping the other workers")
            self.failure = code if code > 0 else 128 - code

    def wait(self) -> int:
        """Until every worker exited after one finished (0), or the job fell below --min-np."""
        while self.running:
            try:
                worker, code = self._exits.get(timeout=POLL_SECONDS)
            except queue.Empty:
                pass
            else:
                self._exited(worker, code)
                if self.failure is not None:
                    self.stop_workers()
                    return self.failure
            self._rescale()
        return 0 if self.finished else (self.failure or 1)


    def close(self) -> None:
        try:
            super().close()
        finally:
            self._token_dir.cleanup()


def discover(source: str) -> int:
    """How many workers ``source`` (a discovery file or an executable) asks for."""
    if os.access(source, os.X_OK) and not os.path.isdir(source):
        done = subprocess.run([os.path.abspath(source)], capture_output=True, text=True, timeout=30)
        if done.returncode != 0:
            raise ValueError(f"exited with status {done.returncode}: {done.stderr.strip()[-200:]}")
        text = done.stdout
    else:
        with open(source) as f:
            text = f.read()
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]
    if len(lines) == 1 and lines[0].isdigit():
        return int(lines[0])
    total = 0
    for line in lines:  # host or host:slots, one per line
        host, _, slots = line.partition(":")
        if slots and not slots.strip().isdigit():
            raise ValueError(f"cannot read {line!r}: expected a number, or lines host[:slots]")
        total += int(slots) if slots else 1
    return total


def launch_elastic(command: Sequence[str], min_np: int, max_np: int, num_workers: int | None = None, **options) -> int:
    """Run ``command`` as an elastic job of ``min_np`` to ``max_np`` workers; its exit status."""
    return ElasticLaunch(command, min_np, max_np, num_workers, **options).run()
