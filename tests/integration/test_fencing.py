"""Fencing (issue 23): an Aggregator cut off from pMaster stops serving once its lease runs out,
pMaster then fails it over (an Agent asked) without waiting for ``aggregator_timeout``, and
when it comes back it drops what is served elsewhere now. pMaster down is not a partition:
Aggregators serve on. In-process services over real sockets; the cut is made by dropping the
messages between pMaster and one Aggregator (its heartbeats, pMaster's ping)."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import pslink
from pslink.core.service import Service
from pslink.core.transport import Transports
from pslink.core.wire.protocol import Op
from tests.helpers import run_workers
from tests.integration.test_processes import wait_until

pytestmark = pytest.mark.integration

OPTIMIZER = {"type": "sgd", "lr": 0.01, "momentum": 0.9}
KEYS = [0, 1, 2]
LEASE = 0.6


def gradient(rank: int, step: int, key: int) -> np.ndarray:
    return np.full(3000, (rank + 1) * 0.01 * (step + 1) + key, np.float32)


def service_with_leases(transports: Transports) -> Service:
    return Service("tcp://127.0.0.1:0", 3, provider="thread", transports=transports,
                   aggregator_listen="tcp://127.0.0.1:0", control={"profile_iterations": 0},
                   aggregator_options={"lease": LEASE, "heartbeat_interval": 0.1}).start()


def train(job: str, steps: int, fault=None, at: int = 6) -> tuple[list, dict]:
    """Two workers, replication 1; ``fault(service, seen)`` runs before step ``at`` while both
    wait. Returns each rank's final weights and what the fault recorded."""
    transports = Transports()
    service = service_with_leases(transports)
    barrier = threading.Barrier(2, timeout=60)
    seen: dict = {"job": job}

    def worker(rank):
        with pslink.connect(job, rank, 2, master=service.address, transports=transports, partition_bytes=4096,
                            replication=1, timeout=60, optimizer=OPTIMIZER) as agent:
            agent.init_many(KEYS, [np.linspace(-1, 1, 3000, dtype=np.float32) * (k + 1) for k in KEYS]).wait()
            for step in range(steps):
                if fault is not None and step == at:
                    barrier.wait()
                    if rank == 0:
                        fault(service, seen)
                    barrier.wait()
                outs = agent.pushpull_many(KEYS, [gradient(rank, step, k) for k in KEYS]).wait()
            if "end" in seen:  # while the job still runs
                barrier.wait()
                if rank == 0:
                    seen["end"](service, seen)
                barrier.wait()
            return [o.copy() for o in outs]

    try:
        results = run_workers(2, worker, timeout=120)
        seen["failovers"], seen["by_lease"] = service.master.failovers_done, service.master.failover.by_lease
        return results, seen
    finally:
        service.stop()
        transports.close()


def serving_most(service: Service, job: str) -> str:
    counts: dict = {}
    for spec in service.master.state.jobs[job].keys.values():
        for part in spec.parts:
            counts[part.aggregator] = counts.get(part.aggregator, 0) + 1
    return max(counts, key=counts.get)


def cut_off_from_pmaster(service: Service, seen: dict) -> None:
    """From here on pMaster and the busiest Aggregator do not hear each other (its heartbeats
    and pMaster's pings are dropped); workers and other Aggregators still reach it."""
    master = service.master
    victim = seen["victim"] = serving_most(service, seen["job"])
    aggregator = service.provider.aggregators[victim]
    seen["aggregator"], seen["before"] = aggregator, master.failovers_done
    heartbeat = master._handlers[Op.AGG_HEARTBEAT]
    master._handlers[Op.AGG_HEARTBEAT] = (
        lambda peer, req: None if peer.info.get("name") == victim else heartbeat(peer, req))
    link = master.links.peers[victim]  # pMaster's side of its control connection
    call = link.call
    link.call = lambda op, callback, **fields: None if op == Op.PING else call(op, callback, **fields)


def test_an_aggregator_cut_off_from_pmaster_is_fenced_and_failed_over_by_its_lease():
    """Gap (issue 23): an Aggregator cut off from pMaster went on serving the workers that reached
    it; an Agent asking where its parts went waited for ``aggregator_timeout`` (15 s). Now past
    its lease it refuses them, and pMaster fails it over once the lease ran out."""
    clean, _ = train("fence-clean", 14)

    def fault(service, seen):
        cut_off_from_pmaster(service, seen)
        aggregator = seen["aggregator"]
        wait_until(lambda: aggregator.master.lease_until < aggregator.clock(), 10, "its lease to run out")

    got, seen = train("fence-cut", 14, fault)
    assert seen["aggregator"].master.refused > 0  # past its lease it refused the workers' requests
    assert service_failovers(seen) == 1 and seen["by_lease"] == 1  # decided by the lease, not the 15 s timeout
    for rank in (0, 1):
        for key in KEYS:
            np.testing.assert_array_equal(got[rank][key], clean[rank][key])


def service_failovers(seen: dict) -> int:
    return seen["failovers"] - seen["before"]


def test_with_pmaster_down_aggregators_serve_on_past_their_lease():
    clean, _ = train("down-clean", 14)

    def stop_pmaster(service, seen):
        aggregators = seen["aggregators"] = list(service.provider.aggregators.values())
        service.master.stop()
        service.master.stop = lambda *args, **kwargs: None  # stopped here already (the service stops it again)
        wait_until(lambda: all(a.master.lease_until < a.clock() for a in aggregators), 10,
                   "the Aggregators' leases to run out")

    got, seen = train("down", 14, stop_pmaster, at=4)
    # Every request after that came to an Aggregator past its lease: refused once, then served
    # when the worker said it cannot reach pMaster either. Nothing failed, nothing changed.
    assert sum(a.master.refused for a in seen["aggregators"]) > 0
    for rank in (0, 1):
        for key in KEYS:
            np.testing.assert_array_equal(got[rank][key], clean[rank][key])
