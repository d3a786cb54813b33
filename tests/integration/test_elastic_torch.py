"""Elastic PyTorch jobs under ``pslink launch --min-np A --max-np B``: real processes on 127.0.0.1.

The workers (tests/torch/elastic_worker.py) train until the test creates OUT/stop, and log what
they see after every reset. The test moves the job through its phases by rewriting the
discovery file, waiting each time (with a deadline) for the workers to report the new world.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import psutil
import pytest

from pslink.core.service import Service

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
WORKER = REPO / "tests" / "torch" / "elastic_worker.py"
HEARTBEAT_TIMEOUT = 2.0
LOSS_THRESHOLD = 1e-3


class ElasticRun:
    """``pslink launch`` of the elastic worker, its output in a file, every process reaped."""

    def __init__(self, out: Path, *launch_args: str):
        self.out = out
        self.log_path = out / "launch.log"
        env = dict(os.environ, PSLINK_TIMEOUT="60",
                   PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p))
        self._log = open(self.log_path, "w")
        if "--service" not in launch_args:
            launch_args += ("--heartbeat-timeout", str(HEARTBEAT_TIMEOUT))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pslink.cli", "launch", *launch_args, sys.executable, str(WORKER), str(out)],
            stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, cwd=str(REPO))

    @property
    def output(self) -> str:
        return self.log_path.read_text()

    def events(self) -> list[dict]:
        found = []
        for path in self.out.glob("events-*.jsonl"):
            for line in path.read_text().splitlines():
                try:
                    found.append(json.loads(line))
                except json.JSONDecodeError:
                    pass  # a line being written
        return sorted(found, key=lambda e: e["time"])

    def wait_for(self, predicate, what: str, timeout: float = 120.0):
        deadline = time.monotonic() + timeout
        while True:
            result = predicate(self.events())
            if result:
                return result
            if self.proc.poll() is not None:
                raise AssertionError(f"pslink launch exited ({self.proc.returncode}) before {what}:\n{self.output}")
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout:g} s waiting for {what}:\n{self.output[-4000:]}")
            time.sleep(0.05)

    def finish(self, timeout: float = 120.0) -> int:
        (self.out / "stop").touch()
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"pslink launch did not end within {timeout:g} s:\n{self.output[-4000:]}") from None

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # the launcher stops its workers on it
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for pid in {e["pid"] for e in self.events()}:  # a worker the launcher could not stop
            try:
                psutil.Process(pid).kill()
            except psutil.Error:
                pass
        self._log.close()


@pytest.fixture
def elastic(tmp_path):
    runs = []

    def start(*args: str) -> ElasticRun:
        run = ElasticRun(tmp_path, *args)
        runs.append(run)
        return run

    yield start
    for run in runs:
        run.close()


def set_workers(out: Path, count: int) -> None:
    tmp = out / "np.tmp"
    tmp.write_text(f"{count}\n")
    os.replace(tmp, out / "np")  # the launcher never reads half a file


def commits_at(size: int, pids: int, at_least: int, after: float = 0.0):
    """A predicate: ``pids`` processes each logged ``at_least`` commits in a world of ``size``."""

    def check(events):
        counts = defaultdict(int)
        for e in events:
            if e["event"] == "commit" and e["size"] == size and e["time"] > after:
                counts[e["pid"]] += 1
        ready = [pid for pid, n in counts.items() if n >= at_least]
        return ready if len(ready) >= pids else None

    return check


def converged(size: int, after: float):
    """A predicate: a commit in a world of ``size`` after ``after`` with the loss below the threshold."""
    return lambda events: any(e["event"] == "commit" and e["size"] == size and e["time"] > after
                              and e["loss"] < LOSS_THRESHOLD for e in events)


def check_resets(events: list[dict]) -> dict[int, dict]:
    """Every generation: as many processes as its size reported, all with the same model,
    optimizer state and counters, and ranks 0..size-1. Returns generation -> its reset."""
    by_generation = defaultdict(list)
    for e in events:
        if e["event"] == "reset":
            by_generation[e["generation"]].append(e)
    worlds = {}
    for generation, resets in sorted(by_generation.items()):
        size = resets[0]["size"]
        assert len({r["pid"] for r in resets}) == size == len(resets), resets
        assert sorted(r["rank"] for r in resets) == list(range(size)), resets
        for field in ("model", "optimizer", "epoch", "batch", "commits", "lr", "momentum_buffers"):
            assert len({r[field] for r in resets}) == 1, f"generation {generation}: {field} differs: {resets}"
        worlds[generation] = resets[0]
    # the counters never go back: each reset starts from a commit at least as late as the last
    batches = [w["batch"] for _, w in sorted(worlds.items())]
    assert batches == sorted(batches), batches
    return worlds


def check_done(events: list[dict], survivors: int) -> list[dict]:
    done = [e for e in events if e["event"] == "done"]
    assert len(done) == survivors, done
    assert len({d["model"] for d in done}) == 1 and len({d["optimizer"] for d in done}) == 1, done
    assert len({tuple(d["weights"]) for d in done}) == 1
    assert all(d["loss"] < LOSS_THRESHOLD for d in done), done
    return done


def test_a_job_that_goes_from_2_to_3_to_2_workers_converges_with_consistent_state(elastic, tmp_path):
    set_workers(tmp_path, 2)
    run = elastic("--min-np", "2", "--max-np", "3", "--discovery", str(tmp_path / "np"),
                  "--discovery-interval", "0.2")
    run.wait_for(commits_at(2, 2, 20), "2 workers training")
    set_workers(tmp_path, 3)
    grown = run.wait_for(commits_at(3, 3, 5), "3 workers training")
    newcomer = [e for e in run.events() if e["event"] == "reset" and e["size"] == 3 and e["service_rank"] == 2]
    assert newcomer and newcomer[0]["pid"] in grown
    assert newcomer[0]["batch"] >= 100 and newcomer[0]["commits"] >= 20  # it got the committed state
    shrunk_at = time.time()
    set_workers(tmp_path, 2)
    run.wait_for(commits_at(2, 2, 5, after=shrunk_at), "2 workers training again")
    run.wait_for(converged(2, shrunk_at), "the loss below the threshold")
    assert run.finish() == 0, run.output

    events = run.events()
    worlds = check_resets(events)
    sizes = [w["size"] for _, w in sorted(worlds.items())]
    assert sizes == [2, 3, 2], sizes
    first_losses = [e["loss"] for e in events if e["event"] == "commit"][:2]
    assert min(first_losses) > 10 * LOSS_THRESHOLD  # it did have something to learn
    done = check_done(events, survivors=2)
    assert {d["service_rank"] for d in done} == {0, 1}
    # Three generations made state-sync keys each; those of the first two were deleted.
    assert all(d["stale_keys"] == [] for d in done), [d["stale_keys"] for d in done]
    output = run.output
    assert "started rank 2" in output and "removing rank 2" in output and "rank 2 (pid" in output


def test_a_killed_worker_is_reported_and_the_others_continue_within_the_heartbeat_timeout(elastic, tmp_path):
    run = elastic("--min-np", "2", "--max-np", "3", "-n", "3", "--max-restarts", "0")
    run.wait_for(commits_at(3, 3, 10), "3 workers training")
    root = next(e for e in run.events() if e["event"] == "reset" and e["service_rank"] == 0)
    killed_at = time.time()
    os.kill(root["pid"], signal.SIGKILL)  # rank 0: the others must pick a new root too
    survivors = run.wait_for(commits_at(2, 2, 1, after=killed_at), "the 2 others training", timeout=60)
    first = min(e["time"] for e in run.events()
                if e["event"] == "commit" and e["size"] == 2 and e["pid"] in survivors)
    # pMaster drops the dead worker after the heartbeat timeout; the rest (a sweep, the reset) is quick
    assert first - killed_at < HEARTBEAT_TIMEOUT + 5.0, first - killed_at
    run.wait_for(commits_at(2, 2, 10, after=killed_at), "the 2 others still training")
    run.wait_for(converged(2, killed_at), "the loss below the threshold")
    assert run.finish() == 0, run.output

    events = run.events()
    sizes = [w["size"] for _, w in sorted(check_resets(events).items())]
    assert sizes == [3, 2], sizes
    check_done(events, survivors=2)
    assert f"rank 0 (pid {root['pid']}) was killed by SIGKILL; 2 worker(s) continue" in run.output


def test_a_dead_worker_is_replaced_under_its_rank_and_gets_the_state(elastic, tmp_path):
    """On a service that keeps a dead worker in the job for a minute, the replacement (same
    rank, started at once) is taken for the dead one until it leaves and registers anew: it must
    do so, or nothing moves for a minute."""
    service = Service(aggregators=2, master_options={"disconnect_grace": 60.0, "worker_timeout": 60.0}).start()
    try:
        run = elastic("--min-np", "1", "--max-np", "2", "-n", "2", "--max-restarts", "1", "--service", service.address)
        run.wait_for(commits_at(2, 2, 10), "2 workers training")
        victim = next(e for e in run.events() if e["event"] == "reset" and e["service_rank"] == 1)
        killed_at = time.time()
        os.kill(victim["pid"], signal.SIGKILL)
        grown = run.wait_for(commits_at(2, 2, 5, after=killed_at), "the replacement training", timeout=45)
        assert victim["pid"] not in grown
        run.wait_for(converged(2, killed_at), "the loss below the threshold")
        assert run.finish() == 0, run.output
    finally:
        service.stop()
    events = run.events()
    worlds = check_resets(events)
    last = worlds[max(worlds)]
    assert last["size"] == 2 and last["batch"] > victim["batch"]
    replacement = [e for e in events if e["event"] == "reset" and e["pid"] not in (victim["pid"],)
                   and e["service_rank"] == 1]
    assert replacement and replacement[0]["batch"] >= victim["batch"]  # it started from the committed state
    check_done(events, survivors=2)
    assert f"rank 1 (pid {victim['pid']}) was killed by SIGKILL" in run.output
    assert "starting a replacement" in run.output


def test_a_job_below_min_np_fails_with_a_clear_message(elastic, tmp_path):
    run = elastic("--min-np", "2", "--max-np", "2", "-n", "2", "--max-restarts", "0")
    run.wait_for(commits_at(2, 2, 3), "2 workers training")
    victim = next(e for e in run.events() if e["event"] == "reset" and e["service_rank"] == 1)
    os.kill(victim["pid"], signal.SIGKILL)
    code = run.proc.wait(60)
    assert code == 128 + signal.SIGKILL, run.output
    assert f"rank 1 (pid {victim['pid']}) was killed by SIGKILL" in run.output
    assert "fewer than --min-np 2: the job fails" in run.output
    for pid in {e["pid"] for e in run.events()}:
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
