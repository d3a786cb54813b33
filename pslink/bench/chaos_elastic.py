"""The chaos run's elastic job (:mod:`pslink.bench.chaos`): ``pslink launch --service`` of
:mod:`pslink.bench.chaos_worker` workers, watched through their output."""

from __future__ import annotations

import collections
import os
import random
import subprocess
import sys
import threading
import time

CLI = [sys.executable, "-m", "pslink.cli"]


class ElasticJob:
    """The chaos run's elastic job: ``pslink launch --service`` of :mod:`pslink.bench.chaos_worker`
    workers, watched through their output (pid, steps and sizes, final weights)."""

    def __init__(self, workdir: str, workers: int):
        self.out = os.path.join(workdir, "elastic")
        os.makedirs(self.out, exist_ok=True)
        self.workers = workers
        self.launcher: subprocess.Popen | None = None
        self.pids: dict[int, int] = {}  # rank -> its current process
        self.latest: dict[int, tuple[int, int, int]] = {}  # rank -> (pid, step, size) of its last step line
        self.finals: dict[int, str] = {}
        self.ends: list[float] = []  # when rank 0's steps ended (as read here)
        self.errors: list[str] = []
        self.lines: collections.deque = collections.deque(maxlen=200)  # the last lines, for errors
        self._reader: threading.Thread | None = None

    def start(self, master: str) -> None:
        command = CLI + ["launch", "--service", master, "--job", "chaos-elastic", "--min-np", "1",
                         "--max-np", str(self.workers), "-n", str(self.workers), "--max-restarts", "1000",
                         sys.executable, "-m", "pslink.bench.chaos_worker", self.out]
        self.launcher = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                         stdin=subprocess.DEVNULL)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        log = open(os.path.join(self.out, "launch.log"), "w")  # all of it, kept with the run's workdir
        for line in self.launcher.stdout:
            log.write(line)
            line = line.rstrip("\n")
            self.lines.append(line)
            if not line.startswith("[rank") or "]: " not in line:
                continue
            head, said = line.split("]: ", 1)
            rank, words = int(head[5:]), said.split()
            if words[:1] == ["pid"]:
                self.pids[rank] = int(words[1])
            elif words[:1] == ["step"] and len(words) >= 4:
                self.latest[rank] = (self.pids.get(rank, 0), int(words[1]), int(words[3]))
                if rank == 0:
                    self.ends.append(time.monotonic())
            elif words[:1] == ["final"]:
                self.finals[rank] = said
        log.close()

    def steps(self) -> int:
        return min((step for _, step, _ in self.latest.values()), default=0) if len(self.latest) == self.workers else 0

    def victim(self, rng: random.Random) -> tuple[int, int]:
        rank = rng.choice(sorted(self.pids))
        return rank, self.pids[rank]

    def back(self, rank: int, old_pid: int) -> bool:
        """``rank``'s replacement (a new pid) has stepped in a world of every worker."""
        pid, _, size = self.latest.get(rank, (0, 0, 0))
        return pid != old_pid and pid != 0 and size == self.workers

    def failed(self) -> bool:
        if self.launcher is not None and self.launcher.poll() is not None:
            self.errors.append("the elastic job's launcher exited early:\n" + "\n".join(list(self.lines)[-40:]))
            return True
        return False

    def stop(self) -> None:
        """Every worker stops at the same step, a few past the furthest one now."""
        target = max((step for _, step, _ in self.latest.values()), default=0) + 10
        with open(os.path.join(self.out, "stop.tmp"), "w") as f:
            f.write(str(target))
        os.replace(os.path.join(self.out, "stop.tmp"), os.path.join(self.out, "stop"))

    def wait(self, timeout: float) -> None:
        try:
            code = self.launcher.wait(timeout)
        except subprocess.TimeoutExpired:
            self.errors.append("the elastic job did not end:\n" + "\n".join(list(self.lines)[-40:]))
            return
        if self._reader is not None:
            self._reader.join(10)
        if code != 0:
            self.errors.append(f"the elastic job's launcher exited with {code}:\n" + "\n".join(list(self.lines)[-40:]))

    def result(self) -> dict:
        from pslink.bench.chaos_worker import expected

        finals = [self.finals.get(rank) for rank in range(self.workers)]
        if any(f is None for f in finals) or len(set(finals)) != 1:
            return {"exact": False, "error": "the workers did not end alike", "finals": finals}
        steps, weights = finals[0].split()[1], finals[0].split()[2:]
        want = [f"{v:g}" for v in expected(int(steps))]
        return {"steps": int(steps), "exact": weights == want}

    def close(self) -> None:
        if self.launcher is not None and self.launcher.poll() is None:
            self.launcher.terminate()  # the launcher stops its workers on SIGTERM
            try:
                self.launcher.wait(30)
            except subprocess.TimeoutExpired:
                self.launcher.kill()
