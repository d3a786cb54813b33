"""pMaster when the source of a live migration is gone before its copy landed: its decisions,
driven by hand on its own objects (fake Aggregator connections; no processes, no sleeps)."""

from __future__ import annotations

import pytest

from pslink.core.master import Master
from pslink.core.wire.protocol import Op
from pslink.core.transport import Transports
from pslink.errors import PeerError

TASK = ("j", "w", 0)


class FakePeer:
    """An Aggregator's control connection: records what pMaster sends; answers when told."""

    def __init__(self, name):
        self.name = name
        self.info = {"role": "aggregator", "name": name}  # what pMaster's registration records
        self.calls: list[tuple] = []
        self.notes: list[tuple] = []

    def call(self, op, callback, timeout=None, **fields):
        self.calls.append((op, callback, fields))

    def notify(self, op, **fields):
        self.notes.append((op, fields))

    def answer(self, op, error=None):
        """Answer the oldest unanswered ``op`` request."""
        index = next(i for i, c in enumerate(self.calls) if c[0] == op)
        _, callback, fields = self.calls.pop(index)
        callback(None if error else {"op": Op.REPLY}, error)
        return fields


@pytest.fixture
def master():
    master = Master("inproc://pmaster-unit", transports=Transports())
    yield master
    master.stop()


def moving(master, replication=1, *, target_holds_replica=False, migrate=True):
    """Job "j" with key "w" in one part on 4 Aggregators; start moving it. Returns the part,
    the peers and the names (source, replica, target)."""
    state = master.state
    names = [f"agg-{i}" for i in range(4)]
    for i, name in enumerate(names):
        state.register_aggregator(f"tcp://127.0.0.1:{9000 + i}", name)
        state.aggregator_joined(name)
    peers = {n: FakePeer(n) for n in names}
    master.links.peers.update(peers)
    record = state.register_worker("j", 0, 1, None, {"replication": replication, "mode": "optimizer"})
    spec, _ = state.declare(record, 0, {"key": "w", "shape": [4], "dtype": "float32", "intent": "init"})
    spec.ready = True
    (part,) = spec.parts
    source = part.aggregator
    replica = part.replicas[0] if part.replicas else None
    target = replica if target_holds_replica else next(n for n in names if n not in (source, replica))
    if migrate:
        master.mover.migrate([state.control.move_task(TASK, target, "test")])
        peers[target].answer(Op.ASSIGN)  # the target waits for the copy now
    return part, peers, (source, replica, target)


def lose(master, name):
    """``name``'s connection closed and it did not come back: its failover."""
    master.links.peers.pop(name)
    master.state.aggregator_lost(name)
    master.failover.fail_over(name)


def move_of(master):
    return master.mover.core.running.get(TASK)


def test_a_source_dead_after_it_handed_the_part_over_has_a_replica_send_the_copy(master):
    part, peers, (source, replica, target) = moving(master)
    peers[source].answer(Op.MIGRATE)  # it took the MIGRATE: lookups point at the target
    assert part.aggregator == target
    lose(master, source)
    ((op, _, fields),) = peers[replica].calls
    assert op == Op.COPY_REPLICA and fields["target"] == [target, master.state.aggregators[target].address]
    assert move_of(master).source == replica and master.failovers_done == 0  # Agents wait
    peers[replica].answer(Op.COPY_REPLICA)  # the copy landed
    assert master.failovers_done == 1 and move_of(master).copied
    assert part.aggregator == target and part.replicas == [replica]
    master.mover.progress(peers[target], {"op": Op.WORKER_DONE, "job": "j", "key": "w", "part": 0})
    assert move_of(master) is None and master.migrations_done == 1


def test_a_source_dead_before_it_answered_the_migrate_is_taken_as_having_handed_over(master):
    """It may have frozen the part and sent the workers to the target before it died."""
    part, peers, (source, replica, target) = moving(master)
    assert part.aggregator == source  # the MIGRATE is unanswered
    lose(master, source)
    peers[source].answer(Op.MIGRATE, PeerError("gone"))  # the failed call, afterwards: ignored
    assert part.aggregator == target and move_of(master).source == replica
    peers[replica].answer(Op.COPY_REPLICA)
    assert master.failovers_done == 1 and part.aggregator == target


def test_a_failed_copy_from_the_last_replica_fails_the_key_loudly(master):
    part, peers, (source, replica, target) = moving(master)
    peers[source].answer(Op.MIGRATE)
    lose(master, source)
    peers[replica].answer(Op.COPY_REPLICA, PeerError("no"))
    assert move_of(master) is None and master.failovers_done == 1
    message = master.state.jobs["j"].keys["w"].aborted.message
    assert f"aggregator {source} is gone after it handed the part over to {target}" in message
    assert "key 'w' part 0 of job 'j'" in message
    aborts = [f for op, f in peers[target].notes if op == Op.ABORT]
    assert aborts and aborts[0]["msg"] == message  # the target fails what waits for the copy


def test_without_replicas_the_key_fails_at_once(master):
    part, peers, (source, _, target) = moving(master, replication=0)
    peers[source].answer(Op.MIGRATE)
    lose(master, source)
    assert not any(c[0] == Op.COPY_REPLICA for p in peers.values() for c in p.calls)
    message = master.state.jobs["j"].keys["w"].aborted.message
    assert "replication 0" in message and source in message and "part 0" in message
    assert master.failovers_done == 1 and move_of(master) is None


def test_a_target_that_held_the_replica_is_asked_first(master):
    part, peers, (source, replica, target) = moving(master, target_holds_replica=True)
    assert target == replica and target not in part.replicas  # a newcomer took its replica's place
    peers[source].answer(Op.MIGRATE)
    lose(master, source)
    fields = peers[target].answer(Op.COPY_REPLICA)
    assert fields["target"][0] == target
    assert master.failovers_done == 1


def test_a_source_dead_before_the_target_took_the_task_fails_over_as_before(master):
    """The MIGRATE was never sent: the source served the part to the end; its replica takes over."""
    part, peers, (source, replica, target) = moving(master, migrate=False)
    master.mover.migrate([master.state.control.move_task(TASK, target, "test")])  # the ASSIGN is unanswered
    lose(master, source)
    assert move_of(master) is None
    assert part.aggregator == replica
    peers[replica].answer(Op.PROMOTE)
    assert master.failovers_done == 1
    assert not any(c[0] == Op.COPY_REPLICA for p in peers.values() for c in p.calls)


def test_the_replica_sending_the_copy_lost_too_fails_the_key(master):
    """Replication 1 and both the source and the replica gone: nothing holds the state."""
    part, peers, (source, replica, target) = moving(master)
    peers[source].answer(Op.MIGRATE)
    lose(master, source)
    peers[replica].answer(Op.COPY_REPLICA, PeerError("connection closed"))  # as its connection closes
    assert master.state.jobs["j"].keys["w"].aborted is not None
    lose(master, replica)
    assert master.failovers_done == 2 and move_of(master) is None
