"""pMaster's state in Redis: the lease that lets one pMaster lead, the epoch that fences a deposed
one, and a store that goes away while pMaster serves (a real redis-server, on a Unix socket)."""

from __future__ import annotations

import os
import signal
import threading
import time

import msgpack
import pytest

from pslink.core.master.leadership import Lease
from pslink.core.master.records import AggregatorRecord
from pslink.core.master.store_redis import RedisStore, names
from pslink.errors import ConfigError

pytestmark = pytest.mark.integration


def _aggregator(name: str) -> AggregatorRecord:
    return AggregatorRecord(name, f"tcp://10.0.0.1:{len(name)}", pid=1, host="h", host_id="h1")


def _stored_aggregators(store: RedisStore) -> set[str]:
    return {msgpack.unpackb(v)[0] for v in store.client.hgetall(store.keys["aggregators"]).values()}


def test_one_leader_at_a_time_and_a_standby_takes_over_once_the_lease_lapses(redis_url):
    a, b = Lease(redis_url, "tcp://a:1", ttl=0.6), Lease(redis_url, "tcp://b:1", ttl=0.6)
    try:
        assert a.try_acquire() == 1
        assert b.try_acquire() is None  # held
        assert a.renew()
        leader = b.leader()
        assert leader["address"] == "tcp://a:1" and leader["epoch"] == 1 and leader["holds_lease"]
        stop = threading.Event()
        b_epoch: list = []
        waiting = threading.Thread(target=lambda: b_epoch.append(b.wait_to_lead(stop, poll=0.05)))
        waiting.start()
        deadline = time.monotonic() + 5
        while not b.standbys() and time.monotonic() < deadline:
            time.sleep(0.02)  # polling for the standby's announcement, with a deadline
        assert [s["address"] for s in a.standbys()] == ["tcp://b:1"]
        taken = time.monotonic()
        waiting.join(5)  # a no longer renews: b takes the lease when it lapses
        assert b_epoch == [2] and time.monotonic() - taken < 0.6 + 0.5
        assert not a.renew()  # a newer epoch: a is deposed
        assert b.renew() and not b.standbys()
    finally:
        a.close()
        b.close()


def test_a_deposed_leader_writes_nothing_and_learns_it_at_its_first_write(redis_url):
    a, b = Lease(redis_url, "tcp://a:1", ttl=0.3), Lease(redis_url, "tcp://b:1", ttl=0.3)
    fenced = threading.Event()
    old = RedisStore(redis_url, a.try_acquire(), on_fenced=fenced.set)
    old.save_aggregator(_aggregator("agg-0"))
    deadline = time.monotonic() + 5
    while b.try_acquire() is None:  # a cut off: it renews nothing, its lease lapses
        assert time.monotonic() < deadline, "the lease never lapsed"
        time.sleep(0.05)  # polling for the lease to lapse, with a deadline
    new = RedisStore(redis_url, b.epoch)
    new.save_aggregator(_aggregator("agg-1"))
    # a comes back and writes what it decided meanwhile: nothing lands, and it is told
    old.save_aggregator(_aggregator("agg-stale"))
    old.delete_aggregator("agg-1")
    old.delete_job("j")
    assert fenced.wait(5)
    assert old.fenced and old.written == 2 and old.discarded == 1  # (the schema and agg-0 went in before)
    assert _stored_aggregators(new) == {"agg-0", "agg-1"}
    assert not a.renew()
    for lease, store in ((a, old), (b, new)):
        store.close()
        lease.close()


def test_writes_made_while_the_store_is_away_are_kept_and_applied_in_order_when_it_returns(redis_server):
    redis_server.flush()
    lease = Lease(redis_server.url(), "tcp://a:1")
    store = RedisStore(redis_server.url(), lease.try_acquire(), retry_interval=0.1, timeout=0.3)
    store.save_aggregator(_aggregator("agg-0"))
    os.kill(redis_server.proc.pid, signal.SIGSTOP)  # the store stops answering while pMaster serves
    try:
        started = time.monotonic()
        store.save_aggregator(_aggregator("agg-1"))
        store.delete_aggregator("agg-0")
        store.save_aggregator(_aggregator("agg-2"))
        assert time.monotonic() - started < 1.5  # one timeout at most, then kept in memory
        assert not store.reachable and len(store.pending) == 3
    finally:
        os.kill(redis_server.proc.pid, signal.SIGCONT)
    deadline = time.monotonic() + 5
    while store.pending and time.monotonic() < deadline:
        time.sleep(0.05)  # polling for the retry to apply them, with a deadline
    assert store.reachable and _stored_aggregators(store) == {"agg-1", "agg-2"}
    store.close()
    lease.close()


def test_an_unreachable_store_is_a_clear_error_naming_it():
    pytest.importorskip("redis")
    with pytest.raises(ConfigError, match=r"state store redis://127\.0\.0\.1:1/0 is unreachable"):
        Lease("redis://127.0.0.1:1/0", "tcp://a:1")
    with pytest.raises(ConfigError, match=r"redis://u:\*\*\*@127\.0\.0\.1:1/0"):  # no password in the error
        RedisStore("redis://u:secret@127.0.0.1:1/0", 1)


def test_a_state_of_a_newer_schema_is_refused(redis_url):
    lease = Lease(redis_url, "tcp://a:1")
    epoch = lease.try_acquire()
    store = RedisStore(redis_url, epoch)
    store.client.hset(names("pslink")["meta"], "schema", msgpack.packb(["schema", "99"]))
    with pytest.raises(ConfigError, match="schema 99"):
        RedisStore(redis_url, epoch)
    store.close()
    lease.close()


def test_a_store_restarted_empty_gets_the_leaders_state_back_and_no_standby_takes_it_over(redis_url):
    """A Redis restarted without persistence has lost everything: a standby must not take over
    that empty store (it would load no jobs), and the leader writes what it holds back."""
    from pslink.core.master import Master
    from pslink.core.service.client import ControlClient
    from pslink.core.service.standby import Terms

    masters: list = []

    def make_master(store, leadership):
        masters.append(Master("tcp://127.0.0.1:0", store=store, leadership=leadership))
        return masters[-1]

    stop = threading.Event()
    terms = Terms(redis_url, "tcp://127.0.0.1:0", ttl=0.6)
    leading = threading.Thread(target=terms.run, args=(make_master, stop), kwargs={"standby": False})
    leading.start()
    standby = Lease(redis_url, "tcp://b:1", ttl=0.6)
    try:
        deadline = time.monotonic() + 10
        while not (masters and terms.master is not None):
            assert time.monotonic() < deadline, "the leader never led"
            time.sleep(0.02)  # polling for the leader's term to begin, with a deadline
        with ControlClient(masters[0].address, timeout=5) as client:
            client.register_job("kept", 2, {"mode": "sum"})
        jobs = names("pslink")["jobs"]
        assert standby.client.hexists(jobs, "kept")
        standby.client.flushall()  # Redis restarted with nothing
        assert standby.try_acquire(standby=True) is None  # no state to take over
        deadline = time.monotonic() + 10
        while not standby.client.hexists(jobs, "kept"):
            assert time.monotonic() < deadline, "the leader never wrote its state back"
            time.sleep(0.05)  # polling for the write-back, with a deadline
        assert int(standby.client.get(names("pslink")["epoch"])) == 1  # under the leader's own epoch
        assert standby.try_acquire(standby=True) is None and terms.master is masters[0]  # still the leader
    finally:
        stop.set()
        leading.join(10)
        standby.close()
