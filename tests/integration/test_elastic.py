"""Elastic membership inside one process: workers leave and join running jobs; SSP; stragglers.

Every wait has a deadline; nothing relies on a sleep for correctness (sleeps below only make a
worker slow on purpose, and the assertions hold for any scheduling).
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

import pslink
from pslink.core.transport import Transports
from pslink.errors import MembershipError
from tests.helpers import run_workers, start_cluster

FAST = {"heartbeat_interval": 0.2}


@pytest.fixture
def cluster():
    transports = Transports()
    service = start_cluster("tcp", aggregators=2, transports=transports, disconnect_grace=0.3, worker_timeout=3.0,
                            sweep_interval=0.05)
    yield service, transports
    service.stop()
    transports.close()


def connect(cluster, job, rank, workers, **options):
    service, transports = cluster
    options.setdefault("timeout", 20.0)
    return pslink.connect(job, rank, workers, master=service.address, transports=transports, **FAST, **options)


def wait_until(predicate, timeout, what):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_a_worker_that_leaves_is_no_longer_waited_for(cluster):
    a, b = connect(cluster, "leave", 0, 2), connect(cluster, "leave", 1, 2)
    try:
        for agent in (a, b):
            agent.init("w", np.zeros(4, np.float32))
        handles = [agent.pushpull("w", np.full(4, agent.rank + 1.0, np.float32)) for agent in (a, b)]
        assert [h.wait().tolist() for h in handles] == [[3.0] * 4] * 2
        before = handles[0].epoch
        rank1_pushed = b.push("w", np.full(4, 10.0, np.float32))  # rank 1's round-2 push is in, then it leaves
        rank1_pushed.wait()
        b.close()
        # round 2 closes with both pushes; round 3 with rank 0's alone
        round2 = a.pushpull("w", np.full(4, 1.0, np.float32))
        np.testing.assert_array_equal(round2.wait(), np.full(4, 11.0))
        round3 = a.pushpull("w", np.full(4, 1.0, np.float32), average=True)
        np.testing.assert_array_equal(round3.wait(), np.full(4, 1.0))  # averaged over the 1 who pushed
        assert round3.epoch > before and a.epoch == round3.epoch
    finally:
        a.close()
        b.close()


def test_a_silent_worker_is_removed_after_the_grace_period_and_its_waits_fail(cluster):
    a, b = connect(cluster, "crash", 0, 2), connect(cluster, "crash", 1, 2)
    try:
        a.init("w", np.zeros(4, np.float32)).wait()
        b.init("w", np.zeros(4, np.float32)).wait()
        waiting = a.pushpull("w", np.ones(4, np.float32))  # waits for rank 1
        b._master.peer.conn.close()  # as if rank 1's process died: pMaster sees its connection close
        b._closed = True  # ... and it never comes back (no heartbeats, no reconnect)
        started = time.monotonic()
        np.testing.assert_array_equal(waiting.wait(timeout=10), np.ones(4))
        assert time.monotonic() - started < 5.0
        np.testing.assert_array_equal(a.pushpull("w", np.ones(4, np.float32)).wait(timeout=10), np.ones(4))
    finally:
        a.close()


def test_a_worker_added_to_a_running_job_comes_in_at_the_next_round(cluster):
    """Optimizer mode: the newcomer pulls the current weights, then every round sums three pushes."""
    options = dict(optimizer={"type": "sgd", "lr": 1.0, "average": False}, max_workers=3)  # steps by the sum
    a, b = connect(cluster, "grow", 0, 2, **options), connect(cluster, "grow", 1, 2, **options)
    c = None
    try:
        for agent in (a, b):
            agent.init("w", np.full(4, 100.0, np.float32))
        for _ in range(3):  # weights 100 - 3 * (1 + 1) = 94
            hs = [agent.pushpull("w", np.ones(4, np.float32)) for agent in (a, b)]
            results = [h.wait() for h in hs]
        np.testing.assert_array_equal(results[0], np.full(4, 94.0))
        c = connect(cluster, "grow", 2, 3, **options)
        assert c.late
        current = c.pull("w").wait()
        np.testing.assert_array_equal(current, np.full(4, 94.0))
        for expected in (91.0, 88.0):  # each round: 94 - (1 + 1 + 1)
            hs = [agent.pushpull("w", np.ones(4, np.float32)) for agent in (a, b, c)]
            for h in hs:
                np.testing.assert_array_equal(h.wait(), np.full(4, expected))
    finally:
        for agent in (a, b, c):
            if agent is not None:
                agent.close()


def test_join_all_between_barriers_puts_a_newcomer_into_the_very_next_round(cluster):
    """Sum mode, as an elastic framework syncs: members stop at a barrier, the newcomer joins
    every key, a second barrier, then everyone's next round has three pushes."""
    workers = {}
    trained = threading.Barrier(3, timeout=20)  # the newcomer comes once the keys are in use
    registered = threading.Event()  # in a framework: the members see the new epoch at a commit

    def member(rank):
        agent = workers[rank] = connect(cluster, "sync", rank, 2, max_workers=3)
        for key in ("a", "b"):
            agent.init(key, np.zeros(3, np.float32)).wait()
        for _ in range(2):
            agent.pushpull_many(["a", "b"], [np.ones(3, np.float32)] * 2).wait()
        trained.wait()
        assert registered.wait(20)
        agent.barrier("sync-1")
        agent.barrier("sync-2")
        outs = agent.pushpull_many(["a", "b"], [np.ones(3, np.float32)] * 2).wait()
        return [o.tolist() for o in outs]

    def newcomer():
        trained.wait()
        agent = workers[2] = connect(cluster, "sync", 2, 3, max_workers=3)
        registered.set()
        agent.barrier("sync-1")
        assert sorted(agent.join_all()) == ["a", "b"]
        agent.barrier("sync-2")
        outs = agent.pushpull_many(["a", "b"], [np.ones(3, np.float32)] * 2).wait()
        return [o.tolist() for o in outs]

    results = run_workers(3, lambda rank: member(rank) if rank < 2 else newcomer())
    try:
        assert all(r == [[3.0] * 3, [3.0] * 3] for r in results)
        assert workers[2].membership()["ranks"] == [0, 1, 2]
    finally:
        for agent in workers.values():
            agent.close()


def test_ssp_lets_a_fast_worker_run_staleness_rounds_ahead_and_no_further(cluster):
    fast, slow = connect(cluster, "ssp", 0, 2, sync="ssp", staleness=2), connect(cluster, "ssp", 1, 2)
    try:
        for agent in (fast, slow):
            agent.init("w", np.zeros(2, np.float32))
        first = fast.pushpull("w", np.ones(2, np.float32))
        second = fast.pushpull("w", np.ones(2, np.float32))
        # rounds 1 and 2 answer at once (round 0 is within 2 of them), with the latest closed round
        assert first.wait(timeout=5).tolist() == [0.0, 0.0] and second.wait(timeout=5).tolist() == [0.0, 0.0]
        third = fast.pushpull("w", np.ones(2, np.float32))
        time.sleep(0.2)
        assert not third.done()  # round 3 needs round 1 closed: the slow worker holds it
        slow.pushpull("w", np.full(2, 5.0, np.float32)).wait(timeout=5)  # closes round 1: 1 + 5
        assert third.wait(timeout=5).tolist() == [6.0, 6.0] and third.round == 3
    finally:
        fast.close()
        slow.close()


def test_a_straggler_does_not_hold_a_round_past_the_timeout_and_its_late_push_is_dropped(cluster):
    opts = dict(straggler_timeout=0.3)
    a, b, late = (connect(cluster, "straggle", r, 3, **opts) for r in range(3))
    try:
        for agent in (a, b, late):
            agent.init("w", np.zeros(2, np.float32))
        started = time.monotonic()
        hs = [agent.pushpull("w", np.ones(2, np.float32), average=True) for agent in (a, b)]
        outs = [h.wait(timeout=10) for h in hs]
        assert 0.25 < time.monotonic() - started < 5.0
        assert all(o.tolist() == [1.0, 1.0] for o in outs)  # the average over the two who came
        result = late.pushpull("w", np.full(2, 100.0, np.float32)).wait(timeout=10)
        assert result.tolist() == [2.0, 2.0] and late.dropped_pushes == 1  # round 1's sum, without it
        hs = [agent.pushpull("w", np.ones(2, np.float32)) for agent in (a, b, late)]
        assert [h.wait(timeout=10).tolist() for h in hs] == [[3.0, 3.0]] * 3  # in step again
    finally:
        for agent in (a, b, late):
            agent.close()


def test_a_barrier_releases_when_the_member_it_waits_for_leaves(cluster):
    a, b = connect(cluster, "bar", 0, 2), connect(cluster, "bar", 1, 2)
    released = {}

    def enter():
        released["body"] = a.barrier("end")

    thread = threading.Thread(target=enter)
    thread.start()
    try:
        time.sleep(0.1)
        assert thread.is_alive()
        b.close()
        thread.join(10)
        assert released["body"]["ranks"] == [0]
    finally:
        thread.join(10)
        a.close()


def test_a_removed_rank_is_told_so_and_a_rank_beyond_max_workers_is_refused(cluster):
    a, b = connect(cluster, "told", 0, 2), connect(cluster, "told", 1, 2)
    try:
        a.init("w", np.zeros(2, np.float32)).wait()
        b.init("w", np.zeros(2, np.float32)).wait()
        b._master.peer.conn.close()
        b._closed = True
        wait_until(lambda: a.membership()["ranks"] == [0], 10, "rank 1's removal")
        b._closed = False
        with pytest.raises(MembershipError, match="rank 1 is not a member"):
            b.pushpull("w", np.ones(2, np.float32)).wait(timeout=10)
        with pytest.raises(MembershipError, match="job 'told' has 2 workers; rank 2 says 3"):
            connect(cluster, "told", 2, 3)
    finally:
        a.close()


def test_a_rank_registered_anew_is_out_of_the_job_and_back_in_in_one_step():
    """What pslink.torch.elastic does when a new process took over the rank of a worker that
    died (pMaster still counts the dead one), or after a failed collective: the rank registers
    again with ``rejoin``. The round waiting for the old incarnation closes, and no barrier ever
    sees the job without the rank: one entered right after waits for the newcomer. (A LEAVE and
    a registration as two requests left a moment in which the others could settle a world
    without it, then wait in that world's fresh keys for it while it waited for them in the
    settle barrier: the flake of test_elastic_torch's replacement test.) The old Agent's
    connection closing afterwards does not take the new one out."""
    transports = Transports()
    # Silent workers stay for 30 s: the newcomer sends no heartbeat that could mask a removal.
    service = start_cluster("tcp", aggregators=2, transports=transports, disconnect_grace=0.3, worker_timeout=30.0,
                            sweep_interval=0.05)
    master = service.master
    options = dict(master=service.address, transports=transports, timeout=20.0)
    a = pslink.connect("rejoin", 0, 2, heartbeat_interval=0.2, **options)
    b = pslink.connect("rejoin", 1, 2, heartbeat_interval=0.2, **options)
    fresh = None
    try:
        for agent in (a, b):
            agent.init("w", np.zeros(4, np.float32))
        assert [h.wait(timeout=10).tolist() for h in [x.pushpull("w", np.ones(4, np.float32)) for x in (a, b)]] \
            == [[2.0] * 4] * 2
        waiting = a.pushpull("w", np.ones(4, np.float32))  # rank 1 (b) never pushes again: as if it died
        epoch = a.membership()["epoch"]
        fresh = pslink.connect("rejoin", 1, 2, token=b.token, rejoin=True, heartbeat_interval=3600.0, **options)
        assert fresh.late
        np.testing.assert_array_equal(waiting.wait(timeout=10), np.ones(4))  # closed without the old rank 1
        assert a.membership() == {"ranks": [0, 1], "epoch": epoch + 2}  # out (epoch + 1) and in, one request

        released = {}
        thread = threading.Thread(target=lambda: released.setdefault("a", a.barrier("settle", timeout=20)))
        thread.start()
        b.close(leave=False)  # the old Agent goes; its connection closing must not concern the new one

        def old_connection_closed():
            try:
                return not any(p.info.get("role") == "replaced" for p in list(master.endpoint.peers.values()))
            except RuntimeError:  # the dict changed under us: look again
                return False

        wait_until(old_connection_closed, 10, "pMaster to see the old connection close")
        time.sleep(0.5)  # past disconnect_grace, many sweeps
        assert thread.is_alive()  # the barrier waits for the newcomer: never released with rank 0 alone
        assert a.membership()["ranks"] == [0, 1]
        assert master.state.jobs["rejoin"].workers[1].connected
        assert fresh.barrier("settle", timeout=20)["ranks"] == [0, 1]
        thread.join(10)
        assert released["a"]["ranks"] == [0, 1]
        assert fresh.join_all(timeout=10) == ["w"]  # between barriers, as an elastic framework does
        hs = [x.pushpull("w", np.ones(4, np.float32)) for x in (a, fresh)]
        assert [h.wait(timeout=10).tolist() for h in hs] == [[2.0] * 4] * 2
    finally:
        for agent in (a, b, fresh):
            if agent is not None:
                agent.close()
        service.stop()
        transports.close()


def test_a_worker_added_to_a_running_job_comes_into_a_tables_shards_at_the_next_round(cluster):
    """A table (rows summed as pushed): the newcomer joins each shard, reads the current rows,
    and every round from then on sums three pushes."""
    a, b = connect(cluster, "grow-table", 0, 2, max_workers=3), connect(cluster, "grow-table", 1, 2, max_workers=3)
    c = None
    try:
        tables = [agent.table("emb", 2, shards=3) for agent in (a, b)]
        ids = np.arange(6)
        for _ in range(3):
            for h in [t.pushpull(ids, np.ones((6, 2), np.float32)) for t in tables]:
                h.wait()
        c = connect(cluster, "grow-table", 2, 3, max_workers=3)
        assert c.late
        tables.append(c.table("emb", 2, shards=3))
        np.testing.assert_array_equal(tables[2].pull(ids).wait(), np.full((6, 2), 6.0))
        for expected in (9.0, 12.0):
            for h in [t.pushpull(ids, np.ones((6, 2), np.float32)) for t in tables]:
                np.testing.assert_array_equal(h.wait(), np.full((6, 2), expected))
    finally:
        for agent in (a, b, c):
            if agent is not None:
                agent.close()


def test_a_replacement_that_registers_before_the_dead_workers_connection_closed_gets_in(cluster, monkeypatch):
    """A new process for rank 1 registers while pMaster still sees the old one connected: it is
    told "already connected" and asks again until pMaster has seen the old connection close."""
    from pslink.core.agent import master_link

    a, b = connect(cluster, "replace", 0, 2), connect(cluster, "replace", 1, 2)
    refused = threading.Event()
    real_sleep = time.sleep

    def pause(seconds):  # the replacement's backoff after a refusal: say so, then wait as it would
        refused.set()
        real_sleep(seconds)

    results: dict = {}

    def replacement():
        try:
            results["agent"] = connect(cluster, "replace", 1, 2, token=a.token)  # as launch passes it
        except BaseException as exc:  # reported below
            results["error"] = exc

    monkeypatch.setattr(master_link.os, "getpid", lambda: 4242)  # another process than b's
    monkeypatch.setattr(master_link.time, "sleep", pause)
    thread = threading.Thread(target=replacement)
    thread.start()
    try:
        assert refused.wait(10), f"the replacement was never refused: {results}"
        b._master.peer.conn.close()  # the old worker's process dies: its connection closes
        b._closed = True
        thread.join(15)
        assert "error" not in results, results.get("error")
        c = results["agent"]
        assert a.membership()["ranks"] == [0, 1]
        c.close()
    finally:
        thread.join(15)
        a.close()


def test_a_rank_truly_in_use_is_still_refused_after_the_retries(cluster, monkeypatch):
    from pslink.core.agent import master_link

    a = connect(cluster, "taken", 0, 1, connect_timeout=0.5)
    try:
        monkeypatch.setattr(master_link.os, "getpid", lambda: 4343)
        with pytest.raises(MembershipError, match="rank 0 of job 'taken' is already connected"):
            connect(cluster, "taken", 0, 1, connect_timeout=0.5, token=a.token)
    finally:
        a.close()


def test_a_barrier_whose_release_was_lost_with_the_connection_is_answered_when_asked_again(cluster):
    """Found by the chaos run with control faults (an elastic join): a barrier's release was lost
    with its connection. Asked again as a new entry, the worker would wait at a barrier the
    others had left, and they for it. A BARRIER now says how often its worker passed that
    barrier: asked again, the lost release is the answer; the next barrier is a new one."""
    from tests.helpers import FirstAnswerLost

    service, transports = cluster
    relay = FirstAnswerLost(service.address, answer=2)  # the registration's answer comes through
    a = connect(cluster, "barrier-lost", 0, 2)
    b = pslink.connect("barrier-lost", 1, 2, master=relay.address, transports=transports, timeout=20.0, **FAST)
    try:
        released = {}
        thread = threading.Thread(target=lambda: released.setdefault("a", a.barrier("sync", timeout=20)))
        thread.start()
        assert b.barrier("sync", timeout=20)["ranks"] == [0, 1]
        assert relay.cut == 1  # its release was lost: answered when asked again
        thread.join(20)
        assert released["a"]["ranks"] == [0, 1]
        # the next pass is a barrier of its own: it waits for both again
        second = threading.Thread(target=lambda: released.setdefault("a2", a.barrier("sync", timeout=20)))
        second.start()
        assert b.barrier("sync", timeout=20)["ranks"] == [0, 1]
        second.join(20)
        assert released["a2"]["ranks"] == [0, 1]
    finally:
        for agent in (a, b):
            agent.close()
        relay.close()
