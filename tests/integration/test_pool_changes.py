"""Operators adding and removing Aggregators while a job trains: the removed one drains by live
migration, its replicas are made elsewhere, and the job's weights are those of a run without
any pool change. Real sockets on 127.0.0.1; every wait has a deadline; every process is reaped.
"""

from __future__ import annotations

import re
import subprocess
import threading
import time

import numpy as np
import psutil
import pytest

import pslink
from pslink.core.service.client import ControlClient
from pslink.core.transport import Transports
from pslink.errors import ServiceError
from tests.helpers import run_workers, start_cluster
from tests.integration.test_processes import CLI, service_up, status_of, wait_until  # noqa: F401 - a fixture

pytestmark = pytest.mark.integration

OPTIMIZER = {"type": "sgd", "lr": 0.01, "momentum": 0.9}
KEYS = [0, 1, 2]


def gradient(rank: int, step: int, key: int) -> np.ndarray:
    return np.random.default_rng(1000 * step + 10 * key + rank).standard_normal(3000).astype(np.float32)


def train(address, job, steps=None, *, change=None, after_change=None, transports=None, replication=0,
          ends=None, **options):
    """Two workers (threads), three keys of three parts each (4 KiB partitions), momentum SGD on the
    service; returns (each rank's final weights, the number of steps).

    Without ``change``: ``steps`` steps. With it: after 5 steps ``change()`` runs on another thread
    while both train on (a drain needs their rounds: its migrations finish when the workers have
    moved over); once it is done, rank 0 picks a step a few ahead where both stop, so a run
    without the change can do as many. ``after_change()`` runs (rank 0, both waiting) before the
    step halfway there. ``ends`` collects rank 0's step end times."""
    done, failed, plan = threading.Event(), [], {}
    barrier = threading.Barrier(2, timeout=60)
    started = threading.Event()

    def run_change():
        try:
            assert started.wait(60), "rank 0 never reached the step of the pool change"
            change()
        except BaseException as exc:  # reported by the workers
            failed.append(exc)
        finally:
            done.set()

    def worker(rank):
        extra = {"transports": transports} if transports is not None else {}
        with pslink.connect(job, rank, 2, master=address, optimizer=OPTIMIZER, partition_bytes=4096,
                            replication=replication, timeout=60, **extra, **options) as agent:
            agent.init_many(KEYS, [np.linspace(-1, 1, 3000, dtype=np.float32) * (k + 1) for k in KEYS]).wait()
            step = 0
            while step != (steps if change is None else plan.get("stop")):
                if change is not None and rank == 0:
                    if step == 5:
                        started.set()
                    if done.is_set() and "stop" not in plan:
                        assert not failed, f"the pool change failed: {failed[0]!r}"
                        # BSP keeps rank 1 within a step of rank 0: it learns these in time.
                        plan["after"], plan["stop"] = step + 4, step + 8
                    assert step < 5000, "the pool change did not finish within 5000 steps"
                if after_change is not None and step == plan.get("after"):
                    barrier.wait()
                    if rank == 0:
                        after_change()
                    barrier.wait()
                outs = agent.pushpull_many(KEYS, [gradient(rank, step, k) for k in KEYS]).wait()
                if rank == 0 and ends is not None:
                    ends.append(time.monotonic())
                step += 1
            return [o.copy() for o in outs], step

    thread = threading.Thread(target=run_change, daemon=True) if change else None
    if thread:
        thread.start()
    try:
        results = run_workers(2, worker, timeout=300)
    finally:
        if thread:
            thread.join(10)
    assert results[0][1] == results[1][1]
    return [r[0] for r in results], results[0][1]


def clean_run(steps):
    """The same training on a service whose pool never changes."""
    transports = Transports()
    service = start_cluster("tcp", aggregators=2, transports=transports, control={"profile_iterations": 0})
    try:
        return train(service.address, "clean", steps, transports=transports)[0]
    finally:
        service.stop()
        transports.close()


def serving(master, job: str) -> str:
    """An Aggregator serving parts of the job (pMaster's own record, not heartbeat statistics)."""
    (record,) = [j for j in status_of(master)["jobs"] if j["job"] == job]
    return record["aggregators"][0]


def assert_same(got, expected):
    for rank in (0, 1):
        for key in KEYS:
            np.testing.assert_array_equal(got[rank][key], expected[rank][key])


def test_adding_and_removing_aggregators_in_process_changes_nothing_in_the_weights():
    transports = Transports()
    service = start_cluster("tcp", aggregators=2, transports=transports, control={"profile_iterations": 0})
    master = service.master
    seen: dict = {}

    def change():
        with ControlClient(service.address, timeout=60, transports=transports) as client:
            (added,) = client.add_aggregators(1)["added"]
            assert master.aggregator_alive(added)
            victim = serving(service.address, "pool")
            seen.update(added=added, victim=victim, steps_before=len(ends))
            seen["removed"] = client.remove_aggregator(victim)
            seen["steps_after"] = len(ends)

    ends: list = []
    try:
        got, steps = train(service.address, "pool", change=change, transports=transports, ends=ends)
        assert_same(got, clean_run(steps))
        victim, removed = seen["victim"], seen["removed"]
        assert removed["removed"] == victim and len(removed["moved"]) == 9  # all its parts (packed on one)
        assert all(where != victim for *_, where in removed["moved"])
        assert seen["steps_after"] > seen["steps_before"], "training stopped while the Aggregator drained"
        names = [a["name"] for a in status_of(service.address)["aggregators"]]
        assert victim not in names and seen["added"] in names
        assert victim not in service.provider.names()  # stopped, not only forgotten
        assert master.state.control.pool.min_aggregators == 2
        with ControlClient(service.address, timeout=10, transports=transports) as client:
            with pytest.raises(ServiceError, match=rf"aggregator '{victim}' is not registered"):
                client.remove_aggregator(victim)
            last = [n for n in names if n != seen["added"]][0]
            client.remove_aggregator(seen["added"])
            # The last one goes too: the provider starts another in its place first.
            assert client.remove_aggregator(last)["removed"] == last
            remaining = [a["name"] for a in client.status()["aggregators"]]
            assert last not in remaining and len(remaining) == 1, remaining
    finally:
        service.stop()
        transports.close()


def test_a_removed_replica_holder_is_replaced_and_the_new_replica_survives_a_crash():
    transports = Transports()
    service = start_cluster("tcp", aggregators=3, transports=transports, control={"profile_iterations": 0})
    master = service.master
    seen: dict = {}

    def parts():
        record = master.state.jobs["replicated"]
        return [p for spec in record.keys.values() for p in spec.parts]

    def remove_a_replica_holder():
        holders = sorted({r for p in parts() for r in p.replicas} - {p.aggregator for p in parts()})
        seen["holder"] = holders[0]
        with ControlClient(service.address, timeout=60, transports=transports) as client:
            seen["removed"] = client.remove_aggregator(holders[0])
        seen["replicas"] = [list(p.replicas) for p in parts()]
        seen["names"] = [a["name"] for a in status_of(service.address)["aggregators"]]

    def crash_the_primary():
        (primary,) = {p.aggregator for p in parts()}
        service.provider.aggregators[primary].stop()  # as if it crashed: sockets close, state gone

    try:
        got, steps = train(service.address, "replicated", transports=transports, replication=1,
                           change=remove_a_replica_holder, after_change=crash_the_primary)
        holder = seen["holder"]
        assert seen["removed"]["moved"] == [] and seen["removed"]["replicas"]
        assert master.failovers_done == 1
        assert_same(got, clean_run(steps))  # the new replicas held every round the crash needed
        # every part kept its one replica, on an Aggregator still in the pool
        assert all(len(r) == 1 and r[0] != holder and r[0] in seen["names"] for r in seen["replicas"])
        assert holder not in seen["names"] and holder not in service.provider.names()
    finally:
        service.stop()
        transports.close()


def test_cli_add_and_remove_on_a_service_of_processes(service_up, tmp_path):  # noqa: F811 - the fixture
    master, _ = service_up
    seen: dict = {}

    def cli(*args):
        done = subprocess.run(CLI + ["service", *args, "-m", master], capture_output=True, text=True, timeout=150)
        assert done.returncode == 0, done.stdout + done.stderr
        return done.stdout

    def packed():
        status = status_of(master)
        jobs = [j for j in status["jobs"] if j["job"] == "procs"]
        return jobs and jobs[0]["control"].get("phase") == "packed" and not status["migrations"]

    def change():
        wait_until(packed, 60, "the job to be profiled and packed")  # its own moves are over
        seen["add"] = cli("add", "-n", "1")
        seen["names after add"] = [a["name"] for a in status_of(master)["aggregators"]]
        victim = seen["victim"] = serving(master, "procs")
        seen["pid"] = [a["pid"] for a in status_of(master)["aggregators"] if a["name"] == victim][0]
        seen["remove"] = cli("remove", victim)
        status = status_of(master)  # (once the job ended, scaling may shrink the pool to its minimum)
        seen["serving"] = [j["aggregators"] for j in status["jobs"] if j["job"] == "procs"][0]
        seen["names"] = [a["name"] for a in status["aggregators"]]

    got, steps = train(master, "procs", change=change, heartbeat_interval=0.2)
    assert_same(got, clean_run(steps))
    victim = seen["victim"]
    added = re.search(r"added (agg-\d+) at tcp://", seen["add"]).group(1)
    # (the control plane's guard may have moved some of its tasks off it already)
    assert f"removed {victim}" in seen["remove"] and victim not in seen["serving"]
    wait_until(lambda: not psutil.pid_exists(seen["pid"]) or psutil.Process(seen["pid"]).status() == "zombie", 20,
               f"{victim}'s process to exit")
    decisions = [line for line in (tmp_path / "service.log").read_text(errors="replace").splitlines()
                 if "starting aggregator" in line or "releasing aggregator" in line]
    assert added in seen["names after add"] and victim not in seen["names"] and seen["names"], (seen, decisions)
    # (The added one need not stay to the end: the performance guard may revert the job onto a
    # new Aggregator of its own and release the one it emptied. The CLI's own processes slow this
    # job's millisecond iterations: pMaster's log showed "revert job procs: 24% slower than
    # alone" in a passing run, and CI saw the pool end as agg-1 and agg-3.)
    bad = subprocess.run(CLI + ["service", "remove", "agg-9", "-m", master], capture_output=True, text=True,
                         timeout=60)
    assert bad.returncode == 1 and "aggregator 'agg-9' is not registered" in bad.stderr


def test_a_pmaster_without_a_provider_says_it_cannot_add():
    from pslink.core.master import Master

    transports = Transports()
    master = Master("tcp://127.0.0.1:0", transports=transports).start()
    try:
        with ControlClient(master.address, timeout=10, transports=transports) as client:
            with pytest.raises(ServiceError, match="this pMaster has no provider to start Aggregators with"):
                client.add_aggregators(1)
            with pytest.raises(ServiceError, match=r"aggregator 'agg-0' is not registered with this pMaster "
                                                   r"\(it has: none\)"):
                client.remove_aggregator("agg-0")
    finally:
        master.stop()
        transports.close()


def stored_removals(tmp_path) -> list:
    from pslink.core.master.store import SqliteStore

    store = SqliteStore(str(tmp_path / "state" / "pmaster.sqlite"))
    try:
        return store.load_removing()
    finally:
        store.close()


def test_a_removal_pmaster_stopped_during_goes_on_after_its_restart(tmp_path):
    """Gap (issue 23): a pMaster restart mid-drain forgot the drain: the Aggregator stayed in the
    pool. Now the removal is stored; a pMaster started from the store drains it once it registers
    again. The store here is as a pMaster that stopped mid-drain left it (the removal recorded,
    the Aggregator still holding its parts), so the moment of the stop is not left to chance."""
    from pslink.core.master import Master
    from pslink.core.master.store import SqliteStore
    from pslink.core.service.providers import ThreadProvider

    transports = Transports()
    state_dir = str(tmp_path / "state")
    master = Master("tcp://127.0.0.1:0", state_dir=state_dir, transports=transports).start()
    address = master.address
    provider = ThreadProvider(address, transports, reconnect_interval=0.05)
    agent = None
    try:
        assert master.wait_for_aggregators(provider.start(2), 20)
        agent = pslink.connect("drained", 0, 1, master=address, transports=transports, heartbeat_interval=0.1,
                               timeout=30.0)
        agent.init("w", np.zeros(64, np.float32)).wait()
        for _ in range(3):
            agent.pushpull("w", np.ones(64, np.float32)).wait()
        victim = agent.key_info("w")["parts"][0][3]
        master.stop()  # Aggregators and the Agent stay; the store is left as it was
        store = SqliteStore(str(tmp_path / "state" / "pmaster.sqlite"))
        store.save_removing([victim])  # ... as the removal's first step stored it
        store.close()
        master = Master(address, state_dir=state_dir, transports=transports).start()
        deadline, rounds = time.monotonic() + 60, 3
        while victim in master.state.aggregators:  # drained and released once it registered again
            assert time.monotonic() < deadline, f"{victim} was not drained after the restart"
            # Training goes on meanwhile (a part moves between two rounds), every round's sum right.
            np.testing.assert_array_equal(agent.pushpull("w", np.ones(64, np.float32)).wait(), np.ones(64))
            rounds += 1
        # pMaster forgets the removal in its store right after the release (on its own thread).
        while stored_removals(tmp_path):
            assert time.monotonic() < deadline, f"the store still holds {victim}'s removal"
            time.sleep(0.01)
        spec = master.state.jobs["drained"].keys["w"]
        assert all(p.aggregator != victim for p in spec.parts)
        np.testing.assert_array_equal(agent.pushpull("w", np.ones(64, np.float32)).wait(), np.ones(64))
        assert agent.key_info("w")["round"] == rounds + 1
    finally:
        if agent is not None:
            agent.close()
        master.stop(shutdown_aggregators=True)
        provider.stop_all()
        transports.close()
