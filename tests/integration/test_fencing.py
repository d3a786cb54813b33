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
from pslink.errors import PeerError
from tests.helpers import run_workers
from tests.integration.test_processes import wait_until

pytestmark = pytest.mark.integration

OPTIMIZER = {"type": "sgd", "lr": 0.01, "momentum": 0.9}
KEYS = [0, 1, 2]
LEASE = 0.6


def gradient(rank: int, step: int, key: int) -> np.ndarray:
    return np.full(3000, (rank + 1) * 0.01 * (step + 1) + key, np.float32)


def service_with_leases(transports: Transports, lease: float = LEASE) -> Service:
    return Service("tcp://127.0.0.1:0", 3, provider="thread", transports=transports,
                   aggregator_listen="tcp://127.0.0.1:0", control={"profile_iterations": 0},
                   aggregator_options={"lease": lease, "heartbeat_interval": 0.1}).start()


def train(job: str, steps: int, fault=None, at: int = 6, lease: float = LEASE) -> tuple[list, dict]:
    """Two workers, replication 1; ``fault(service, seen)`` runs before step ``at`` while both
    wait. Returns each rank's final weights and what the fault recorded."""
    transports = Transports()
    service = service_with_leases(transports, lease)
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


def test_an_aggregator_whose_control_connection_breaks_is_not_failed_over_while_it_serves():
    """Found by control-plane faults (issue 23): a control connection the network cut was taken
    for the Aggregator's death once ``aggregator_grace`` (0.5 s) passed, whenever the live
    Aggregator took longer than that to register again (it retried after 0.5 s; a lost SYN
    alone costs TCP 1 s): its parts went to their replicas for nothing, and cascading
    failovers of live Aggregators lost keys. Now pMaster asks the Aggregator's data port first:
    it answers, so pMaster waits for it until its lease runs out. Its way back is held here for
    3x the grace period."""
    clean, _ = train("cut-clean", 14, lease=5.0)
    held = 1.5

    def fault(service, seen):
        master = service.master
        victim = seen["victim"] = serving_most(service, seen["job"])
        link = service.provider.aggregators[victim].master  # the Aggregator's side of its control connection
        seen["before"], old = master.failovers_done, master.links.peers[victim]
        connect = link._connect

        def slowly():  # a slow way back, once
            link._connect = connect
            link.reactor.call_later(held, connect)

        link._connect = slowly
        broken = threading.Event()

        def cut():
            peer = link.peer
            peer.conn.close()  # pMaster sees the connection close ...
            link._lost(peer, PeerError("connection reset (test)"))  # ... and so does the Aggregator
            broken.set()

        link.reactor.post(cut)
        assert broken.wait(10)
        wait_until(lambda: master.links.peers.get(victim) not in (None, old), 20, f"{victim} to register again")
        seen["away"] = master.failover.alive_but_away

    got, seen = train("cut", 14, fault, lease=5.0)
    assert seen["away"] == 1  # it answered pMaster's probe while away ...
    assert service_failovers(seen) == 0  # ... and came back within its lease: nothing moved
    for rank in (0, 1):
        for key in KEYS:
            np.testing.assert_array_equal(got[rank][key], clean[rank][key])


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


def test_after_a_pmaster_restart_an_agent_asking_for_a_known_aggregator_is_answered_once_it_registers(tmp_path):
    """Found by the chaos run: after a pMaster restart, an Agent asking where an Aggregator's
    parts went (its lease ran out while pMaster was down) waited ``aggregator_grace`` +
    ``aggregator_timeout`` whenever that Aggregator, known from the store, had not registered
    again yet, though it came back within a second; a second pMaster kill in that window failed
    the job. Now the answer goes out as soon as the Aggregator registers."""
    from pslink.core.master import Master
    from pslink.core.service.providers import ThreadProvider

    transports = Transports()
    state_dir = str(tmp_path / "state")
    silent = 120.0  # what the answer waited for before (plus the grace)
    master = Master("tcp://127.0.0.1:0", state_dir=state_dir, transports=transports, aggregator_timeout=silent).start()
    address = master.address
    # Aggregators that come back a while after pMaster does: the Agent asks before they do.
    provider = ThreadProvider(address, transports, reconnect_interval=3.0)
    agent = None
    try:
        assert master.wait_for_aggregators(provider.start(2), 20)
        agent = pslink.connect("back", 0, 1, master=address, transports=transports, heartbeat_interval=0.1,
                               timeout=silent / 2)
        agent.init("w", np.zeros(8, np.float32)).wait()
        (holder,) = {p[3] for p in agent.key_info("w")["parts"]}
        master.stop()  # the Aggregators stay, and retry every 3 s
        master = Master(address, state_dir=state_dir, transports=transports, aggregator_timeout=silent).start()
        worker = master.state.jobs["back"].workers
        wait_until(lambda: worker[0].connected and not worker[0].restored, 20, "the Agent to register again")
        body = agent._master.call(Op.RELOCATE, parts=[["w", 0, holder]])  # waits for its answer
        assert master.aggregator_alive(holder)  # answered once it was back (or at once, if it was)
        ((_, _, _, where, _),) = body["keys"][0]["parts"]
        assert where == holder  # it serves the part still: the Agent goes back to it
        np.testing.assert_array_equal(agent.pushpull("w", np.ones(8, np.float32)).wait(), np.ones(8))
    finally:
        if agent is not None:
            agent.close()
        master.stop(shutdown_aggregators=True)
        provider.stop_all()
        transports.close()


def test_an_agent_that_loses_an_aggregator_while_pmaster_is_down_asks_again_once_pmaster_is_back(tmp_path, caplog):
    """Found by the chaos run: an Agent lost an Aggregator, asked pMaster where its parts went, and
    pMaster was down (killed, restarting): the requests failed with the lost connection's error,
    and the job with them. Now the Agent asks again until pMaster is back (within its timeout);
    the restarted pMaster fails the Aggregator over and the round completes on its replica."""
    import logging

    from pslink.core.master import Master
    from pslink.core.service.providers import ThreadProvider

    caplog.set_level(logging.INFO, logger="pslink.core.agent.agent")
    transports = Transports()
    state_dir = str(tmp_path / "state")
    # A known Aggregator that does not come back is failed over this long after the restart.
    master = Master("tcp://127.0.0.1:0", state_dir=state_dir, transports=transports, aggregator_timeout=2.0).start()
    address = master.address
    provider = ThreadProvider(address, transports, reconnect_interval=0.2)
    agents = []
    try:
        assert master.wait_for_aggregators(provider.start(2), 20)
        agents = [pslink.connect("asks", rank, 2, master=address, transports=transports, replication=1, timeout=60,
                                 heartbeat_interval=0.1, optimizer={"type": "sgd", "lr": 0.5}) for rank in (0, 1)]
        for handle in [agent.init("w", np.ones(8, np.float32)) for agent in agents]:
            handle.wait()
        first = agents[0].pushpull("w", np.full(8, 1.0, np.float32))  # round 1 waits for rank 1 ...
        (holder,) = {p[3] for p in agents[0].key_info("w")["parts"]}
        master.stop()
        provider.stop(holder)  # ... and the part's Aggregator dies while pMaster is down
        wait_until(lambda: any("pMaster is unreachable" in r.message or "could not say" in r.message
                               for r in caplog.records), 20, "rank 0 to ask pMaster where the part went")
        master = Master(address, state_dir=state_dir, transports=transports, aggregator_timeout=2.0).start()
        second = agents[1].pushpull("w", np.full(8, 3.0, np.float32))
        # SGD on the mean gradient, 2: 1 - 0.5 * 2 = 0, served by the promoted replica
        np.testing.assert_array_equal(first.wait(), np.zeros(8, np.float32))
        np.testing.assert_array_equal(second.wait(), np.zeros(8, np.float32))
    finally:
        for agent in agents:
            agent.close()
        master.stop(shutdown_aggregators=True)
        provider.stop_all()
        transports.close()


def test_an_agent_sent_to_a_replica_holder_asks_pmaster_again_instead_of_failing():
    # A restarted pMaster or a lost PROMOTE can send an Agent to an Aggregator that holds only
    # the part's replica (its promotion on the way). Before: "does not hold part", and the job
    # failed. Now the holder answers "ask pMaster again": the Agent relocates and goes on.
    transports = Transports()
    service = service_with_leases(transports, lease=30.0)
    try:
        with pslink.connect("to-replica", 0, 1, master=service.address, transports=transports, replication=1,
                            timeout=30) as agent:
            agent.init("k", np.zeros(100, np.float32)).wait()
            g = np.arange(100, dtype=np.float32)
            np.testing.assert_array_equal(agent.pushpull("k", g).wait(), g)
            placed = service.master.state.jobs["to-replica"].keys["k"].parts[0]
            primary, holder = placed.aggregator, placed.replicas[0]
            part = agent._keys["k"].parts[0]
            assert part.aggregator == primary
            part.move(holder, service.master.state.aggregators[holder].address)  # where an early answer sends it
            np.testing.assert_array_equal(agent.pushpull("k", g + 1).wait(), g + 1)
            assert part.aggregator == primary
        assert service.master.failovers_done == 0
    finally:
        service.stop()
        transports.close()


def test_an_agent_sent_to_a_replica_holder_while_pmaster_is_down_waits_for_pmaster(tmp_path, caplog):
    """Found by the chaos run with control faults: pMaster was killed mid-failover, and an Agent
    sent to the replica it had picked (not promoted yet) could not reach pMaster. It told the
    holder "pMaster is down" and sent the request there again, as for an Aggregator past its
    lease; a replica cannot serve either way, so the request used its tries up in milliseconds
    and the job failed. Now it waits for pMaster to say where the part is."""
    import logging

    from pslink.core.master import Master
    from pslink.core.service.providers import ThreadProvider

    caplog.set_level(logging.INFO, logger="pslink.core.agent.agent")
    transports = Transports()
    state_dir = str(tmp_path / "state")
    master = Master("tcp://127.0.0.1:0", state_dir=state_dir, transports=transports, aggregator_timeout=60.0).start()
    address = master.address
    provider = ThreadProvider(address, transports, reconnect_interval=0.2)
    agent = None
    try:
        assert master.wait_for_aggregators(provider.start(2), 20)
        agent = pslink.connect("down-replica", 0, 1, master=address, transports=transports, replication=1,
                               timeout=30, heartbeat_interval=0.1)
        agent.init("k", np.zeros(100, np.float32)).wait()
        g = np.arange(100, dtype=np.float32)
        np.testing.assert_array_equal(agent.pushpull("k", g).wait(), g)
        placed = master.state.jobs["down-replica"].keys["k"].parts[0]
        primary, holder = placed.aggregator, placed.replicas[0]
        holder_address = master.state.aggregators[holder].address
        master.stop()
        wait_until(lambda: agent._master.peer is None, 10, "the Agent to see pMaster go")
        part = agent._keys["k"].parts[0]
        part.move(holder, holder_address)  # where an answer of a pMaster killed mid-failover sends it
        handle = agent.pushpull("k", g + 1)
        wait_until(lambda: handle.done() or any("pMaster is unreachable" in r.message for r in caplog.records), 20,
                   "the Agent to ask pMaster where the part is")
        assert not handle.done(), f"it failed instead of waiting for pMaster: {handle.exception()}"
        master = Master(address, state_dir=state_dir, transports=transports, aggregator_timeout=60.0).start()
        np.testing.assert_array_equal(handle.wait(20), g + 1)
        assert part.aggregator == primary
    finally:
        if agent is not None:
            agent.close()
        master.stop(shutdown_aggregators=True)
        provider.stop_all()
        transports.close()


def test_a_worker_whose_registration_answer_was_lost_registers_again_and_trains():
    """Found by the chaos run with control faults: pMaster registered a worker, and its answer
    (with the job's token) was lost with the connection; the worker failed at once with a
    PeerError, and had it asked again without the token it would have been refused. Now the
    Agent asks again on a new connection, and pMaster lets the same Agent register again
    until it has used the token; another may not."""
    from tests.helpers import FirstAnswerLost

    with Service(aggregators=1) as service:
        relay = FirstAnswerLost(service.address)
        try:
            with pslink.connect("answer-lost", 0, 1, master=relay.address, timeout=30) as agent:
                assert relay.cut == 1  # the first registration's answer never came
                agent.init("w", np.ones(4, np.float32)).wait(10)
                np.testing.assert_array_equal(agent.pushpull("w", np.full(4, 2.0, np.float32)).wait(10), np.full(4, 2.0))
                record = service.master.state.jobs["answer-lost"]
                wait_until(lambda: record.workers[0].token_used, 10, "the worker's first request with its token")
                with pytest.raises(pslink.errors.AuthError, match="needs its token to register rank 0"):
                    record.check_credential(None, 0, agent=record.workers[0].agent)
        finally:
            relay.close()


def test_a_key_lookup_whose_answer_was_lost_is_asked_again(caplog):
    """Found by the chaos run with control faults: the answer to a worker's LOOKUP (where its
    keys live) was lost with the connection, and init_many failed with a PeerError. A key
    declared again is the same key, so the Agent asks again on a new connection."""
    from tests.helpers import FirstAnswerLost

    with Service(aggregators=1) as service:
        relay = FirstAnswerLost(service.address, answer=2)  # the registration's comes through
        try:
            with caplog.at_level("INFO", logger="pslink.core.agent"), \
                    pslink.connect("lookup-lost", 0, 1, master=relay.address, timeout=30) as agent:
                agent.init_many(["a", "b"], [np.ones(4, np.float32)] * 2).wait(10)
                assert relay.cut == 1
                assert any("LOOKUP" in r.getMessage() and "asking again" in r.getMessage() for r in caplog.records)
                got = agent.pushpull_many(["a", "b"], [np.full(4, 2.0, np.float32)] * 2).wait(10)
                for value in got:
                    np.testing.assert_array_equal(value, np.full(4, 2.0))
        finally:
            relay.close()
