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

Where network namespaces can be made (root, iproute2), the run has two hosts
(:mod:`pslink.bench.netns`): pMaster, its Aggregators and the workers on M, and Aggregators joined
from B (``pslink aggregator --master``), and the schedule also **partitions** B from M for a few
seconds (its link down: B's processes live on, cut off; pMaster fails their parts over and fences
them; they come back when the link does). ``--no-hosts`` runs on loopback only. And pMaster is
also killed at named points of its control plane (``PSLINK_FAULTS=kill=pmaster@POINT``,
:data:`pslink.core.faults.PMASTER_POINTS`): started again armed, it is driven there (an Aggregator
killed, or drained), dies, and starts again from its state.
The last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import logging
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

from pslink.bench.chaos_elastic import ElasticJob
from pslink.core.faults import PMASTER_POINTS
from pslink.core.service.client import ControlClient
from pslink.errors import PslinkError

log = logging.getLogger("pslink.bench.chaos")

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

    def __init__(self, seed: int, jobs: int, workers: int, aggregators: int, workdir: str, elastic: bool = False,
                 hosts=None, remote: int = 2, points: list[str] | None = None, control_faults: str | None = None):
        self.rng = random.Random(seed)
        # PSLINK_FAULTS ctl_* for the service's processes and host B's Aggregators: every message
        # pMaster sends or gets from an Aggregator, and every answer to a worker, may be lost
        # with its connection, repeated or held (the workers here keep their own clean)
        self.control_faults = control_faults
        self.elastic = ElasticJob(workdir, workers) if elastic else None
        self.seed, self.jobs, self.workers, self.aggregators = seed, jobs, workers, aggregators
        self.hosts = hosts  # a started VirtualHosts of "M" and "B", or None: loopback only
        self.points = list(points or PMASTER_POINTS)  # where pMaster may be killed: in turn
        self.remote: list = [None] * (remote if hosts is not None else 0)  # the Aggregators joined from B
        self._home = None  # this process's own network namespace, while the run is on M's
        self.port = free_port()
        self.master = f"tcp://{hosts.address('M') if hosts is not None else '127.0.0.1'}:{self.port}"
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

    def up(self, faults: str | None = None, floor: int | None = None) -> None:
        """Start pMaster (on its state) and wait for ``floor`` Aggregators (default: the pool's
        size); ``faults``: its PSLINK_FAULTS (e.g. kill=pmaster@failover)."""
        floor = self.aggregators if floor is None else floor
        where = ["--host", self.hosts.address("M")] if self.hosts is not None else []
        faults = ",".join(filter(None, [self.control_faults, faults]))
        env = dict(os.environ, **({"PSLINK_FAULTS": faults} if faults else {}))
        self.service = subprocess.Popen(
            CLI + ["service", "up", "--port", str(self.port), "--aggregators", str(self.aggregators),
                   "--state", self.state, "--log-level", "INFO", *where], stdout=self.log, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, env=env)
        wait_for(lambda: (alive := self.alive_aggregators()) is not None and len(alive) >= floor,
                 90, "the service and its Aggregators")

    def alive_aggregators(self) -> dict | None:
        status = status_of(self.master)
        if status is None:
            return None
        return {a["name"]: a["pid"] for a in status["aggregators"] if a["alive"] and a.get("pid")}

    def join_remote(self) -> None:
        """Start the Aggregators of host B that are not running (first, or after a kill)."""
        for i, proc in enumerate(self.remote):
            if proc is None or proc.poll() is not None:
                env = dict(os.environ, **({"PSLINK_FAULTS": self.control_faults} if self.control_faults else {}))
                self.remote[i] = self.hosts.popen("B", CLI + ["aggregator", "--master", self.master], stdout=self.log,
                                                  stderr=subprocess.STDOUT, env=env)

    def rejoin_if_remote(self, pid: int) -> None:
        """The Aggregator ``pid`` that was killed ran on host B: its supervisor starts it again
        there (the service's own replace those on M)."""
        if any(proc is not None and proc.pid == pid for proc in self.remote):
            self.join_remote()
            wait_for(self.remote_serving, 60, "host B's Aggregator to join again")

    def remote_serving(self) -> bool:
        """Every Aggregator of host B is in the pool (registered, alive)."""
        status = status_of(self.master)
        pids = {a.get("pid") for a in (status or {}).get("aggregators", []) if a["alive"]}
        return all(proc is not None and proc.poll() is None and proc.pid in pids for proc in self.remote)

    def wait_replicated(self, after: str) -> None:
        """Until every part is served by a live Aggregator and has its job's replicas, each of
        which a round (or its primary's catch-up) reached: the service survives another failure.
        Replication 1 survives one failure at a time; a fault before this is a second failure,
        whose loss no replication 1 promises to prevent, so the schedule waits (and reports how
        long it took). Not so within a minute: the run fails, naming what is missing."""
        lacking = ["no status"]

        def replicated() -> bool:
            status = status_of(self.master)
            if status is None:
                return False
            lacking[:] = [f"{j['job']}: {j['parts_short_of_replicas']} part(s) short of replicas, "
                          f"{j['parts_on_lost_aggregators']} on lost Aggregators" for j in status["jobs"]
                          if j["parts_short_of_replicas"] or j["parts_on_lost_aggregators"]]
            lacking.extend(f"{a['name']}: {a['replicas_without_state']} replica(s) no round reached"
                           for a in status["aggregators"] if a["replicas_without_state"])
            return not lacking

        try:
            wait_for(lambda: replicated() or self.errors, 60, f"every part's replicas to have its state after {after}")
        except RuntimeError as exc:
            raise RuntimeError(f"{exc} ({'; '.join(lacking)})") from None

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
        from pslink.core.worker.connect import connect

        try:
            with connect(f"chaos-{job}", rank, self.workers, master=self.master, replication=1,
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
        except BaseException as exc:  # reported, and the run fails (where it came from: in the log)
            self.errors.append(f"job chaos-{job} rank {rank}: {type(exc).__name__}: {exc}")
            log.error("job chaos-%d rank %d failed", job, rank, exc_info=True)

    # -- faults ------------------------------------------------------------------------------------

    def kill_aggregator(self) -> dict:
        alive: dict = {}

        def status_came() -> bool:  # (a status may fail to come once: pMaster busy, or its connection cut)
            alive.update(self.alive_aggregators() or {})
            return bool(alive)

        wait_for(status_came, 30, "pMaster's status")
        name = self.rng.choice(sorted(alive))
        os.kill(alive[name], signal.SIGKILL)
        at = time.monotonic()
        # The pool is back at its floor (a replacement started, the parts failed over).
        wait_for(lambda: (a := self.alive_aggregators()) is not None and name not in a and len(a) >= self.aggregators,
                 90, f"the service to replace {name}")
        self.rejoin_if_remote(alive[name])
        return {"kind": "aggregator", "victim": name, "at": at, "recovered_s": round(time.monotonic() - at, 2)}

    def kill_pmaster_at_point(self) -> dict:
        """Start pMaster again armed to die at a named point of its control plane, make it get
        there (an Aggregator killed: its failover; or drained: its parts migrate), then start it
        plainly once it died. A point not reached (a drained Aggregator that held nothing) ends
        with pMaster killed there and then, as a plain pMaster kill."""
        point = self.points.pop(0)
        self.points.append(point)
        self.service.kill()
        self.service.wait(10)
        self.up(faults=f"kill=pmaster@{point}")
        at = time.monotonic()
        serving = [a for a in (status_of(self.master) or {}).get("aggregators", []) if a["alive"] and a.get("pid")]
        if not serving:
            # No status: pMaster reached the point by itself (a move of its own, just restarted,
            # reached "copy-landed"), or it is between answers: what was armed is spent either way.
            self.service.kill()
            self.service.wait(10)
            self.up()
            return {"kind": "pmaster-point", "victim": f"{point} (reached or not, before a victim was chosen)",
                    "reached": None, "at": at, "recovered_s": round(time.monotonic() - at, 2)}
        alive = {a["name"]: a["pid"] for a in serving}
        victim = max(serving, key=lambda a: a["tasks"])["name"]  # the one with most parts to move
        if point in ("failover", "promoted"):
            os.kill(alive[victim], signal.SIGKILL)
        else:
            try:
                with ControlClient(self.master, timeout=60.0) as client:
                    client.remove_aggregator(victim)  # a drain: its parts migrate
            except PslinkError:
                pass  # pMaster died under the drain: the point was reached
        try:
            self.service.wait(30)
            reached = True
        except subprocess.TimeoutExpired:
            reached = False
            self.service.kill()
            self.service.wait(10)
        drained = point not in ("failover", "promoted")
        self.up(floor=self.aggregators - 1 if drained else None)
        if drained:
            with ControlClient(self.master, timeout=60.0) as client:
                client.add_aggregators(1)  # the operator's drain took one off the pool's floor: one back
        self.rejoin_if_remote(alive[victim])
        return {"kind": "pmaster-point", "victim": f"{point} ({victim}{'' if reached else ', not reached'})",
                "reached": reached, "at": at, "recovered_s": round(time.monotonic() - at, 2)}

    def partition(self) -> dict:
        """Cut host B off for a few seconds; recovered once every job stepped on after the link came
        back and B's Aggregators are in the pool again (fenced, registered anew)."""
        length = round(self.rng.uniform(2.0, 8.0), 2)
        remote = {proc.pid for proc in self.remote if proc is not None}
        status = status_of(self.master) or {}
        on_b = [a for a in status.get("aggregators", []) if a["alive"] and a.get("pid") in remote]
        held, replicas = sum(a["tasks"] for a in on_b), sum(a.get("replicas", 0) for a in on_b)
        self.hosts.cut("B")
        at = time.monotonic()
        try:
            time.sleep(length)  # the partition lasts this long: the schedule's, not a wait for an outcome
        finally:
            self.hosts.heal("B")
        mark = dict(self.steps)
        wait_for(lambda: all(self.steps[k] > mark[k] + 2 for k in mark) or self.errors, 120,
                 "every job to step on after the partition")
        self.join_remote()  # one that gave pMaster up for lost (orphan timeout) exited
        wait_for(self.remote_serving, 60, "host B's Aggregators to come back")
        return {"kind": "partition", "down_s": length, "parts_cut_off": held, "replicas_cut_off": replicas, "at": at,
                "recovered_s": round(time.monotonic() - at, 2)}

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
            worker_share: float = 0.3, partition_share: float = 0.2, point_share: float = 0.0,
            faults: int | None = None) -> dict:
        """Faults every ``gap`` seconds: pMaster with probability ``pmaster_share``, an elastic
        job's worker with ``worker_share`` (with ``elastic``), a partition of host B with
        ``partition_share`` (with hosts), pMaster at a named point with ``point_share``, else
        an Aggregator. For ``seconds``, or (``faults``) that many faults whatever they take: the
        seed then fixes the schedule's kinds and order, not the host's speed (tests)."""
        if self.hosts is not None:  # this process (its workers, the launcher, the service) on host M
            self._home = self.hosts.enter("M")
            self._home.__enter__()
        self.up()
        if self.remote:
            self.join_remote()
            wait_for(self.remote_serving, 60, "host B's Aggregators")
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
        self.wait_replicated("the warm-up")
        while (len(self.schedule) < faults if faults is not None else time.monotonic() - started < seconds) \
                and not self.errors:
            self.sample_memory()
            time.sleep(self.rng.uniform(*gap))
            self.sample_memory()
            draw = self.rng.random()
            if draw < pmaster_share:
                fault = self.kill_pmaster()
            elif self.elastic is not None and draw < pmaster_share + worker_share:
                fault = self.kill_worker()
            elif self.remote and draw < pmaster_share + worker_share + partition_share:
                fault = self.partition()
            elif draw >= 1.0 - point_share:
                fault = self.kill_pmaster_at_point()
            else:
                fault = self.kill_aggregator()
            self.wait_replicated(f"the {fault['kind']} fault")
            fault["replicated_s"] = round(time.monotonic() - fault["at"], 2)
            fault["steps"] = dict(sorted((f"{j}/{r}", s) for (j, r), s in self.steps.items()))
            self.schedule.append(fault)
            cut = f"({fault['parts_cut_off']} parts, {fault['replicas_cut_off']} replicas cut off) " \
                if "parts_cut_off" in fault else ""
            print(f"chaos: {fault['kind']:10} " + (f"{fault.get('victim', '')} " if "victim" in fault else
                  f"down {fault['down_s']} s {cut}") + f"recovered in {fault['recovered_s']} s, replicated in "
                  f"{fault['replicated_s']} s", flush=True)
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
        mended: dict[str, float] = {}  # kind -> the longest until every part was whole again
        for fault in self.schedule:
            mended[fault["kind"]] = max(mended.get(fault["kind"], 0.0), fault["replicated_s"])
        memory = self.memory_growth()
        return {"benchmark": "chaos", "seed": self.seed, "jobs": jobs, "errors": self.errors,
                "schedule": [{k: v for k, v in f.items() if k != "at"} for f in self.schedule],
                "longest_pause_s": {k: round(v, 2) for k, v in pauses.items()}, "longest_mend_s": mended,
                "memory": memory}

    def log_excerpt(self, lines: int = 80) -> str:
        """The service's last warnings and errors (pMaster's and its Aggregators'): why a run failed."""
        if not self.log.closed:
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
        for proc in self.remote:  # host B's
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait(10)
        if self._home is not None:
            self._home.__exit__(None, None, None)
            self._home = None
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


def chaos_hosts():
    """Hosts M and B (started), or None where namespaces cannot be made (said why)."""
    from pslink.bench import netns

    why = netns.unavailable()
    if why is not None:
        print(f"chaos: on loopback only, no partitions: {why}", flush=True)
        return None
    return netns.VirtualHosts(["M", "B"]).start()


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
    parser.add_argument("--partition-share", type=float, default=0.2,
                        help="share of faults that partition host B (with network namespaces)")
    parser.add_argument("--point-share", type=float, default=0.15,
                        help="share of faults that kill pMaster at a named point of its control plane")
    parser.add_argument("--points", default=",".join(PMASTER_POINTS),
                        help=f"the named points, taken in turn (of {', '.join(PMASTER_POINTS)})")
    parser.add_argument("--control-faults", default=None, metavar="SETTINGS",
                        help="PSLINK_FAULTS for the service's processes, e.g. ctl_drop=0.001,ctl_dup=0.01,"
                        "ctl_delay=0.01,delay_ms=50: control messages lost with their connection, repeated, held")
    parser.add_argument("--no-hosts", action="store_true", help="loopback only: no namespaces, no partitions")
    parser.add_argument("--warmup", type=float, default=10.0, help="seconds of training before the first fault")
    args = parser.parse_args(argv)
    workdir = tempfile.mkdtemp(prefix="pslink-chaos-")
    hosts = None if args.no_hosts else chaos_hosts()
    points = [p.strip() for p in args.points.split(",") if p.strip()]
    if not points or set(points) - set(PMASTER_POINTS):
        parser.error(f"--points: each of {', '.join(PMASTER_POINTS)}, got {args.points!r}")
    chaos = Chaos(args.seed, args.jobs, args.workers, args.aggregators, workdir, elastic=args.worker_share > 0,
                  hosts=hosts, points=points, control_faults=args.control_faults)
    try:
        report = chaos.run(args.minutes * 60, args.warmup, tuple(args.gap), args.pmaster_share, args.worker_share,
                           args.partition_share, args.point_share)
    finally:
        chaos.close()
        if hosts is not None:
            hosts.close()
    for job, figures in report["jobs"].items():
        print(f"{job}: {figures}")
    for error in report["errors"]:
        print(f"error: {error}")
    print(f"longest pause per fault kind: {report['longest_pause_s']}")
    print(f"longest until every part was served and had a replica with a round in it, per fault kind: "
          f"{report['longest_mend_s']}")
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
