"""Agents, Aggregators and the control client given several pMaster addresses follow whichever
answers (issue 51): pMaster A stops (a leader stepping down closes its listener and every
connection) or goes silent (its host cut off: nothing is closed), pMaster B starts at the other
address from the same state, and the job trains on without a restart: every Agent and Aggregator
registers with B, and a key declared after the switch is placed by B. In-process pMasters,
Aggregators on threads, real sockets."""

from __future__ import annotations

import logging
import socket
import threading

import numpy as np
import pytest

import pslink
from pslink.core.master import Master
from pslink.core.service.client import ControlClient
from pslink.core.service.providers import ThreadProvider
from pslink.core.transport import Transports
from tests.helpers import run_workers
from tests.integration.test_processes import wait_until

pytestmark = pytest.mark.integration

AGGREGATORS = ["agg-0", "agg-1"]
KEYS = ["w", "b"]
SIZES = {"w": 3000, "b": 40, "late": 500}


def unused_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def pushed(rank: int, step: int, key: str) -> np.ndarray:
    return np.full(SIZES[key], (rank + 1) * (step + 1), np.float32)


def summed(step: int, key: str) -> np.ndarray:
    return np.full(SIZES[key], 3 * (step + 1), np.float32)  # ranks 0 and 1: 1x and 2x


class FollowingJob:
    """Two workers on threads (``master``: the list), training round after round (each round's
    sum checked) until told how many rounds to end at; then a key declared late, through
    whichever pMaster leads by then."""

    def __init__(self, job: str, master: str, transports: Transports):
        self.job, self.master, self.transports = job, master, transports
        self.steps = [0, 0]
        self.stop_at = [1 << 30]
        self.agents: list = [None, None]
        self.ready = threading.Barrier(2, timeout=60)
        self.late_placed_by: list = []  # the pMasters whose state held the late key while the job ran
        self.leading: Master | None = None

    def worker(self, rank: int):
        with pslink.connect(self.job, rank, 2, master=self.master, transports=self.transports, timeout=60,
                            heartbeat_interval=0.1, partition_bytes=4096) as agent:
            self.agents[rank] = agent
            agent.init_many(KEYS, [np.zeros(SIZES[k], np.float32) for k in KEYS]).wait()
            self.ready.wait()
            step = 0
            while step < self.stop_at[0]:
                outs = agent.pushpull_many(KEYS, [pushed(rank, step, k) for k in KEYS]).wait()
                for key, out in zip(KEYS, outs):
                    np.testing.assert_array_equal(out, summed(step, key), err_msg=f"rank {rank} step {step} {key}")
                step = self.steps[rank] = step + 1
            agent.init("late", np.zeros(SIZES["late"], np.float32)).wait()  # placed by the pMaster now leading
            for late in range(3):
                out = agent.pushpull("late", pushed(rank, late, "late")).wait()
                np.testing.assert_array_equal(out, summed(late, "late"), err_msg=f"rank {rank} late key round {late}")
            if rank == 0 and self.leading is not None:
                self.late_placed_by.append("late" in self.leading.state.jobs[self.job].keys)
            self.ready.wait()  # neither leaves before both are done (the job ends with its last worker)
            return step

    def run(self):
        self.thread = threading.Thread(target=lambda: self.result.extend(run_workers(2, self.worker, timeout=120)))
        self.result: list = []
        self.thread.start()
        return self

    def trained(self, rounds: int):
        return min(self.steps) >= rounds

    def finish(self, more: int) -> list:
        """End at ``more`` rounds past the furthest worker (both end at the same round)."""
        self.stop_at[0] = max(self.steps) + more
        self.thread.join(150)
        assert not self.thread.is_alive(), "the workers did not finish"
        assert self.result == [self.stop_at[0]] * 2, "a worker failed (its error is above)"
        return self.result


def registered_with(master: Master, job: str) -> bool:
    record = master.state.jobs.get(job)
    return (record is not None and len(record.live_workers()) == 2
            and all(master.aggregator_alive(name) for name in AGGREGATORS))


def pmaster_and_aggregators(tmp_path, **aggregator_options):
    """pMaster A (its state in a directory), the address B will have (nobody listens there yet),
    and a provider of Aggregators given both: (transports, state_dir, A, B's address, "A,B",
    provider)."""
    transports = Transports()
    state_dir = str(tmp_path / "state")
    first = Master("tcp://127.0.0.1:0", state_dir=state_dir, transports=transports).start()
    other = f"tcp://127.0.0.1:{unused_port()}"
    both = f"{first.address},{other}"
    provider = ThreadProvider(both, transports, reconnect_interval=0.1, **aggregator_options)
    return transports, state_dir, first, other, both, provider


def switches(caplog, what: str, to: str) -> list:
    return [r.getMessage() for r in caplog.records if f"pMaster now {to}" in r.getMessage() and what in r.getMessage()]


def test_a_job_follows_pmaster_to_its_other_address_without_a_restart(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="pslink")
    transports, state_dir, first, other, both, provider = pmaster_and_aggregators(tmp_path)
    second = None
    stopped = False
    try:
        assert first.wait_for_aggregators(provider.start(2), 20)
        job = FollowingJob("follow", both, transports).run()
        wait_until(lambda: job.trained(5), 30, "a few rounds through the first pMaster")
        first.stop(shutdown_aggregators=False)  # A steps down: listener and connections closed
        stopped = True
        at_stop = max(job.steps)
        wait_until(lambda: job.trained(at_stop + 5), 30, "rounds with no pMaster at all (the data path needs none)")
        second = Master(other, state_dir=state_dir, transports=transports).start()
        wait_until(lambda: registered_with(second, "follow"), 20, "both Agents and Aggregators to register with B")
        with ControlClient(both, timeout=10) as client:  # A refuses: the client finds B
            assert client.address == other
            status = client.status()
        (listed,) = [j for j in status["jobs"] if j["job"] == "follow"]
        assert listed["workers"] == 2
        assert sorted(a["name"] for a in status["aggregators"] if a["alive"]) == AGGREGATORS
        job.leading = second
        job.finish(more=10)
        assert job.stop_at[0] > at_stop  # rounds ran on through the switch
        for rank in (0, 1):
            assert len(switches(caplog, f"agent follow/{rank}:", other)) == 1, "the switch is said once per Agent"
        for name in AGGREGATORS:
            assert len(switches(caplog, f"aggregator {name}:", other)) == 1
        assert job.late_placed_by == [True]  # declared after the switch: B placed it
    finally:
        if not stopped:
            first.stop()
        if second is not None:
            second.stop(shutdown_aggregators=True)
        provider.stop_all()
        transports.close()


def test_a_silent_pmaster_is_left_for_the_next_address(tmp_path, caplog):
    """pMaster A stops answering and closes nothing (its loop is held here, as a host cut off from
    the network, or a frozen process, would leave it): the Aggregators leave it once a heartbeat
    goes unanswered for their bound (max(lease, 1) s), the Agents once three heartbeats and 5 s
    did (pslink.core.agent.master_link.SILENT_SECONDS), and both go to B."""
    caplog.set_level(logging.INFO, logger="pslink")
    transports, state_dir, first, other, both, provider = pmaster_and_aggregators(tmp_path, lease=1.0,
                                                                                  heartbeat_interval=0.2)
    second = None
    held = threading.Event()
    release = threading.Event()

    def hold():  # A's loop stops here: its sockets stay open, unanswered
        held.set()
        release.wait(60)

    try:
        assert first.wait_for_aggregators(provider.start(2), 20)
        job = FollowingJob("silent", both, transports).run()
        wait_until(lambda: job.trained(5), 30, "a few rounds through the first pMaster")
        first.call_soon(hold)
        assert held.wait(10)
        second = Master(other, state_dir=state_dir, transports=transports).start()
        wait_until(lambda: registered_with(second, "silent"), 30, "both Agents and Aggregators to leave A for B")
        job.leading = second
        job.finish(more=10)
        messages = [r.getMessage() for r in caplog.records]
        left = [m for m in messages if m.startswith("agent silent/") and "lost pMaster" in m]
        # Each Agent saw A go silent: at its heartbeat bound, or sooner, when an Aggregator's lease
        # ran out while A had left its heartbeats unanswered too.
        assert len(left) == 2 and all("answered none of the last" in m or "lease ran out" in m for m in left)
        assert sum(m.startswith("aggregator agg-") and " is silent " in m for m in messages) == 2  # each Aggregator
        assert job.late_placed_by == [True]
    finally:
        if second is not None:
            second.stop(shutdown_aggregators=True)
        release.set()
        first.stop()
        provider.stop_all()
        transports.close()
