"""A chaos run (issue 23): jobs train on a ``pslink service up --state`` while a random but seeded
schedule kills Aggregators (SIGKILL) and pMaster (SIGKILL, then started again on the same port
and state after a pause), and workers of an elastic job (SIGKILL; ``pslink launch`` starts a
replacement, which joins the job under way); replication 1. Every job's final weights must equal
its run without faults, bit for bit: its gradients are small integers and its learning rate a
power of two, so the service's SGD is exact and the run without faults is a closed form; a round
lost or doubled shows. The elastic job (:mod:`pslink.bench.chaos_worker`, PyTorch's elastic API)
computes each step from a fixed global batch split over the workers present, so its closed form
holds whoever comes and goes. Reported: the seed and the schedule, each job's steps and whether its weights are exact,
the longest pause of any job's steps around each fault kind, and the growth of the resident
memory of every process that lived long enough (30 s of warm-up, then at least a minute).

    python benchmarks/chaos.py                      # 10 minutes, seed 0
    python benchmarks/chaos.py --minutes 1 --seed 3 # a shorter one

Not in this schedule yet (issue 23 asks for it too): network partitions between namespaces.
The last line is JSON.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np
import psutil

from pslink.core.service.client import ControlClient
from pslink.errors import PslinkError

CLI = [sys.executable, "-m", "pslink.cli"]
LR = 0.125  # a power of two: every update below is exact in float32
SIZE = 3000  # floats per key
KEYS = 3
PARTITION = 4096  # bytes: several parts a key, spread over the Aggregators
MEMORY_WARMUP = 30.0  # seconds of a process's life before its memory is a baseline
MEMORY_SPAN = 60.0  # seconds past that baseline a process must live to be reported


def gradient(rank: int, step: int, key: int) -> np.ndarray:
    return np.full(SIZE, float(rank + (step + key) % 5), np.float32)


def expected_weights(workers: int, steps: int) -> list[np.ndarray]:
    """The run without faults: w -= LR * (the ranks' mean gradient), every step, exactly."""
    out = []
    for key in range(KEYS):
        w = np.zeros(SIZE, np.float32)
        for step in range(steps):
            mean = np.float32(sum(rank + (step + key) % 5 for rank in range(workers)) / workers)
            w -= np.float32(LR) * mean
        out.append(w)
    return out


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def status_of(master: str) -> dict | None:
    try:
        with ControlClient(master, timeout=2.0) as client:
            return client.status()
    except PslinkError:
        return None


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.1)


class Chaos:
    """The service, the jobs' workers (threads of this process) and the schedule."""

    def __init__(self, seed: int, jobs: int, workers: int, aggregators: int, workdir: str, elastic: bool = False):
        self.rng = random.Random(seed)
        self.elastic = ElasticJob(workdir, workers) if elastic else None
        self.seed, self.jobs, self.workers, self.aggregators = seed, jobs, workers, aggregators
        self.port = free_port()
        self.master = f"tcp://127.0.0.1:{self.port}"
        self.state = os.path.join(workdir, "state")
        self.log = open(os.path.join(workdir, "service.log"), "ab")  # pMaster's (INFO: what it did and why)
        self.service: subprocess.Popen | None = None
        self.stop_at: list[int] = []
        self.steps = {(j, r): 0 for j in range(jobs) for r in range(workers)}
        self.ends: dict[int, list[float]] = {j: [] for j in range(jobs)}  # rank 0's step end times
        self.results: dict[tuple[int, int], tuple[list, int]] = {}  # (job, rank) -> weights, steps
        self.errors: list[str] = []
        self.schedule: list[dict] = []
        self.memory: dict[int, list] = {}  # pid -> [what, [(time, resident bytes), ...]]

    # -- the service -------------------------------------------------------------------------------

    def up(self) -> None:
        self.service = subprocess.Popen(
            CLI + ["service", "up", "--port", str(self.port), "--aggregators", str(self.aggregators),
                   "--state", self.state, "--log-level", "INFO"], stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        wait_for(lambda: self.alive_aggregators() is not None and len(self.alive_aggregators()) >= self.aggregators,
                 90, "the service and its Aggregators")

    def alive_aggregators(self) -> dict | None:
        status = status_of(self.master)
        if status is None:
            return None
        return {a["name"]: a["pid"] for a in status["aggregators"] if a["alive"] and a.get("pid")}

    def processes(self) -> dict[int, tuple[str, int]]:
        """The long-lived processes now: pMaster and the Aggregators (pid -> (what, bytes of
        tensors it holds: an Aggregator's parts, replicas included, as it reports them))."""
        out = {self.service.pid: ("pMaster", 0)} if self.service is not None and self.service.poll() is None else {}
        status = status_of(self.master)
        for agg in (status or {}).get("aggregators", []):
            if agg["alive"] and agg.get("pid"):
                out[agg["pid"]] = (agg["name"], int(agg.get("bytes", 0)))
        return out

    # -- the jobs ----------------------------------------------------------------------------------

    def worker(self, job: int, rank: int) -> None:
        import pslink

        try:
            with pslink.connect(f"chaos-{job}", rank, self.workers, master=self.master, replication=1,
                                optimizer={"type": "sgd", "lr": LR}, partition_bytes=PARTITION, timeout=90,
                                heartbeat_interval=0.2) as agent:
                agent.init_many(list(range(KEYS)), [np.zeros(SIZE, np.float32) for _ in range(KEYS)]).wait()
                step, outs = 0, []
                while not (self.stop_at and step >= self.stop_at[0]):
                    outs = agent.pushpull_many(list(range(KEYS)), [gradient(rank, step, k) for k in range(KEYS)]).wait()
                    step += 1
                    self.steps[(job, rank)] = step
                    if rank == 0:
                        self.ends[job].append(time.monotonic())
                self.results[(job, rank)] = ([o.copy() for o in outs], step)
        except BaseException as exc:  # reported, and the run fails
            self.errors.append(f"job chaos-{job} rank {rank}: {type(exc).__name__}: {exc}")

    # -- faults ------------------------------------------------------------------------------------

    def kill_aggregator(self) -> dict:
        alive = self.alive_aggregators() or {}
        name = self.rng.choice(sorted(alive))
        os.kill(alive[name], signal.SIGKILL)
        at = time.monotonic()
        # The pool is back at its floor (a replacement started, the parts failed over).
        wait_for(lambda: (a := self.alive_aggregators()) is not None and name not in a and len(a) >= self.aggregators,
                 90, f"the service to replace {name}")
        return {"kind": "aggregator", "victim": name, "at": at, "recovered_s": round(time.monotonic() - at, 2)}

    def kill_worker(self) -> dict:
        """SIGKILL a worker of the elastic job; recovered once its replacement trains with the others."""
        rank, pid = self.elastic.victim(self.rng)
        os.kill(pid, signal.SIGKILL)
        at = time.monotonic()
        wait_for(lambda: self.elastic.back(rank, pid) or self.elastic.failed(), 120,
                 f"the elastic job to replace rank {rank}")
        return {"kind": "worker", "victim": f"rank {rank}", "at": at, "recovered_s": round(time.monotonic() - at, 2)}

    def kill_pmaster(self) -> dict:
        down = round(self.rng.uniform(1.0, 4.0), 2)
        self.service.kill()
        self.service.wait(10)
        at = time.monotonic()
        time.sleep(down)  # pMaster stays down this long: the schedule's, not a wait for an outcome
        self.up()
        return {"kind": "pmaster", "down_s": down, "at": at, "recovered_s": round(time.monotonic() - at, 2)}

    # -- the run -----------------------------------------------------------------------------------

    def run(self, seconds: float, warmup: float, gap: tuple[float, float], pmaster_share: float,
            worker_share: float = 0.3) -> dict:
        """Faults every ``gap`` seconds: pMaster with probability ``pmaster_share``, an elastic
        job's worker with ``worker_share`` (with ``elastic``), else an Aggregator."""
        self.up()
        threads = [threading.Thread(target=self.worker, args=(j, r), daemon=True)
                   for j in range(self.jobs) for r in range(self.workers)]
        for thread in threads:
            thread.start()
        if self.elastic is not None:
            self.elastic.start(self.master)
            self.ends["elastic"] = self.elastic.ends
        started = time.monotonic()
        wait_for(lambda: all(s >= 5 for s in self.steps.values()) and (self.elastic is None or self.elastic.steps() >= 5)
                 or self.errors, 120, "every job's first steps")
        time.sleep(warmup)  # the warm-up: memory and rates settle before the measured part
        while time.monotonic() - started < seconds and not self.errors:
            self.sample_memory()
            time.sleep(self.rng.uniform(*gap))
            self.sample_memory()
            draw = self.rng.random()
            if draw < pmaster_share:
                fault = self.kill_pmaster()
            elif self.elastic is not None and draw < pmaster_share + worker_share:
                fault = self.kill_worker()
            else:
                fault = self.kill_aggregator()
            fault["steps"] = dict(sorted((f"{j}/{r}", s) for (j, r), s in self.steps.items()))
            self.schedule.append(fault)
            print(f"chaos: {fault['kind']:10} " + (f"{fault.get('victim', '')} " if "victim" in fault else
                  f"down {fault['down_s']} s ") + f"recovered in {fault['recovered_s']} s", flush=True)
        self.sample_memory()
        self.stop_at.append(max(self.steps.values()) + 10)
        if self.elastic is not None:
            self.elastic.stop()
        for thread in threads:
            thread.join(180)
        if self.elastic is not None:
            self.elastic.wait(180)
        return self.report()

    def sample_memory(self) -> None:
        """Each long-lived process's resident memory now (pid -> [what, [(time, bytes), ...]])."""
        now = time.monotonic()
        for pid, (what, held) in self.processes().items():
            try:
                rss = psutil.Process(pid).memory_info().rss
            except psutil.Error:
                continue
            self.memory.setdefault(pid, [what, []])[1].append((now, rss, held))

    def memory_growth(self) -> dict:
        """Growth from a process's first sample past ``MEMORY_WARMUP`` of its life (as seen here)
        to its last, for the processes seen that long after it: of its resident memory, and of
        what it holds beyond its tensors (an Aggregator that took over the parts of one killed
        grows by their bytes: that is not a leak)."""
        out = {}
        for pid, (what, samples) in self.memory.items():
            warm = [sample for sample in samples if sample[0] >= samples[0][0] + MEMORY_WARMUP]
            if warm and samples[-1][0] - warm[0][0] >= MEMORY_SPAN:
                (t0, before, held0), (t1, after, held1) = warm[0], samples[-1]
                out[f"{what} (pid {pid})"] = {
                    "before_mb": round(before / 2**20, 1), "after_mb": round(after / 2**20, 1),
                    "held_before_mb": round(held0 / 2**20, 2), "held_after_mb": round(held1 / 2**20, 2),
                    "seconds": round(t1 - t0), "growth": round(after / before - 1, 4),
                    "growth_beyond_held": round((after - held1) / (before - held0) - 1, 4)}
        return out

    def report(self) -> dict:
        jobs = {}
        for job in range(self.jobs):
            got = [self.results.get((job, rank)) for rank in range(self.workers)]
            if any(g is None for g in got):
                jobs[f"chaos-{job}"] = {"exact": False, "error": "a worker did not finish"}
                continue
            steps = {g[1] for g in got}
            expected = expected_weights(self.workers, got[0][1])
            exact = len(steps) == 1 and all(np.array_equal(w, e) for g in got for w, e in zip(g[0], expected))
            jobs[f"chaos-{job}"] = {"steps": got[0][1], "exact": bool(exact)}
        if self.elastic is not None:
            jobs["chaos-elastic"] = self.elastic.result()
            self.errors.extend(self.elastic.errors)
        pauses: dict[str, float] = {}
        for fault in self.schedule:
            later = [f["at"] for f in self.schedule if f["at"] > fault["at"]]
            until = min(later) if later else float("inf")
            for ends in self.ends.values():
                gaps = [b - a for a, b in zip(ends, ends[1:]) if b >= fault["at"] and a < until]
                if gaps:
                    pauses[fault["kind"]] = max(pauses.get(fault["kind"], 0.0), max(gaps))
        memory = self.memory_growth()
        return {"benchmark": "chaos", "seed": self.seed, "jobs": jobs, "errors": self.errors,
                "schedule": [{k: v for k, v in f.items() if k != "at"} for f in self.schedule],
                "longest_pause_s": {k: round(v, 2) for k, v in pauses.items()}, "memory": memory}

    def log_excerpt(self, lines: int = 80) -> str:
        """The service's last warnings and errors (pMaster's and its Aggregators'): why a run failed."""
        self.log.flush()
        with open(self.log.name, "rb") as log:
            said = [line for line in log.read().decode(errors="replace").splitlines() if " WARNING " in line
                    or " ERROR " in line or " pslink.core.master INFO " in line]
        return "\n".join(said[-lines:])

    def close(self) -> None:
        self.stop_at.append(0)
        if self.elastic is not None:
            self.elastic.close()
        if self.service is not None and self.service.poll() is None:
            self.service.send_signal(signal.SIGINT)
            try:
                self.service.wait(30)
            except subprocess.TimeoutExpired:
                self.service.kill()
                self.service.wait(10)
        # Aggregators orphaned by a killed pMaster exit by themselves (orphan_timeout); not left behind here.
        for proc in psutil.process_iter(["cmdline"]):
            cmdline = " ".join(proc.info["cmdline"] or [])
            if "pslink.core.aggregator" in cmdline and self.master in cmdline:
                try:
                    proc.kill()
                    proc.wait(10)
                except psutil.Error:
                    pass
        self.log.close()


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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--jobs", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--aggregators", type=int, default=3)
    parser.add_argument("--gap", type=float, nargs=2, default=(10.0, 20.0), metavar=("MIN", "MAX"),
                        help="seconds between faults (uniform)")
    parser.add_argument("--pmaster-share", type=float, default=0.3, help="share of faults that kill pMaster")
    parser.add_argument("--worker-share", type=float, default=0.3,
                        help="share of faults that kill a worker of the elastic job (0: no elastic job)")
    parser.add_argument("--warmup", type=float, default=10.0, help="seconds of training before the first fault")
    args = parser.parse_args(argv)
    workdir = tempfile.mkdtemp(prefix="pslink-chaos-")
    chaos = Chaos(args.seed, args.jobs, args.workers, args.aggregators, workdir, elastic=args.worker_share > 0)
    try:
        report = chaos.run(args.minutes * 60, args.warmup, tuple(args.gap), args.pmaster_share, args.worker_share)
    finally:
        chaos.close()
    for job, figures in report["jobs"].items():
        print(f"{job}: {figures}")
    for error in report["errors"]:
        print(f"error: {error}")
    print(f"longest pause per fault kind: {report['longest_pause_s']}")
    for process, figures in report["memory"].items():
        print(f"{process}: {figures['before_mb']} MB -> {figures['after_mb']} MB ({figures['growth']:+.1%}; tensors "
              f"held {figures['held_before_mb']} -> {figures['held_after_mb']} MB, the rest "
              f"{figures['growth_beyond_held']:+.1%})")
    print(json.dumps(report))
    ok = not report["errors"] and all(j.get("exact") for j in report["jobs"].values())
    if ok:
        shutil.rmtree(workdir, ignore_errors=True)
    else:
        print(f"the service's log and state are kept in {workdir}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
