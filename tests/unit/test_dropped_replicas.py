"""A primary that cannot reach one of its replicas goes on without it (a round must not wait on
a partitioned holder), and says so to pMaster with every heartbeat until pMaster names the
part's replicas again. Before, pMaster never heard: it kept counting the replica, and a
failover of the primary would promote it without the rounds it missed (issue 23). Driven by
hand: an Aggregator's core, and pMaster's heartbeat handling with recording peers."""

from __future__ import annotations

from pslink.core.aggregator.core import AggregatorCore
from pslink.core.master import Master
from pslink.core.transport import Transports
from pslink.core.wire.protocol import Op
from tests.helpers import RecordingPeer

TOKEN = b"secret-token-123"


def test_an_aggregator_reports_the_replicas_it_went_on_without_until_pmaster_names_them_again():
    core = AggregatorCore("agg-0")
    info = {"job": "j", "token": TOKEN, "membership": {"ranks": [0], "epoch": 0}, "mode": "sum", "optimizer": None,
            "sync": "bsp"}
    spec = {"key": "w", "part": 0, "shape": [4], "span": [0, 4], "dtype": "float32", "needs_init": False,
            "declared_by": 0, "replicas": [["agg-1", "tcp://127.0.0.1:1"], ["agg-2", "tcp://127.0.0.1:2"]]}
    (task,) = core.assign(info, [spec])
    task.replicating = 3
    core.moves.replicated(("j", "w", 0), 3, lost=["agg-2"])
    assert task.replicas == [("agg-1", "tcp://127.0.0.1:1")]  # the next rounds do not wait for it
    assert core.moves.dropped_report() == [["j", "w", 0, "agg-2"]]
    assert core.moves.dropped_report() == [["j", "w", 0, "agg-2"]]  # said again until pMaster answers
    core.assign(info, [dict(spec, replicas=[["agg-1", "tcp://127.0.0.1:1"], ["agg-3", "tcp://127.0.0.1:3"]])])
    assert core.moves.dropped_report() == []
    assert task.catch_up  # the new replica gets the state at once


def test_pmaster_stops_counting_a_replica_its_primary_went_on_without_and_places_another():
    master = Master("inproc://pmaster-dropped-replicas", transports=Transports())
    try:
        state = master.state
        for name in ("agg-0", "agg-1", "agg-2"):
            state.register_aggregator(f"tcp://127.0.0.1:{9300 + int(name[-1])}", name)
            state.aggregator_joined(name)
        record = state.register_worker("j", 0, 1, None, {"servers": 1, "partition_bytes": 1024, "replication": 1})
        spec, _ = state.declare(record, 0, {"key": "w", "shape": [32], "dtype": "float32", "intent": "init"})
        spec.ready = True
        (part,) = spec.parts
        (unreachable,) = part.replicas
        peers = {name: RecordingPeer() for name in ("agg-0", "agg-1", "agg-2")}
        master.links.peers.update(peers)
        primary = part.aggregator
        master.replicas.dropped(primary, [["j", "w", 0, unreachable], ["j", "w", 0, "agg-9"], "junk", 7,
                                          [["j"], "w", 0, "x"], ["j", ["w"], 0, "x"], ["j", "w", 0, ["x"]]])
        (other,) = {"agg-0", "agg-1", "agg-2"} - {primary, unreachable}
        assert part.replicas == [other]  # another holds it (the unreachable one is not picked again)
        drops = [f["tasks"][0] for op, f in peers[unreachable].calls if op == Op.ASSIGN]
        assert drops and drops[0]["replica"] and drops[0]["drop"]  # its stale copy goes
        assert [f["tasks"][0].get("replica") for op, f in peers[other].calls if op == Op.ASSIGN] == [True]
        master.replicas.dropped(primary, [["j", "w", 0, unreachable]])  # said again: nothing more to do
        assert part.replicas == [other]
    finally:
        master.stop()


def test_a_part_never_gets_the_target_of_its_own_move_as_a_replica():
    """Found by the chaos run with control faults: the holder of a moving part's replica died,
    and the failover gave the replica's place to the move's target, which served the part once
    the copy landed: its only "replica" was itself, and when it died the key was lost. The
    same for a replica placed while the part moves (a primary's dropped replica, a top-up)."""
    from pslink.core.master.records import JobRecord, KeySpec, PartSpec
    from pslink.core.master.failover_plan import plan_failover

    def moving_job():
        record = JobRecord(job="j", token=b"t", num_workers=1, mode="optimizer", replication=1)
        record.keys["w"] = KeySpec("w", (4,), "float32", 0, True, [PartSpec(0, (0, 4), "agg-0", ["agg-1"])])
        return record

    # agg-3 is the least loaded, so the only pick but for the move onto it
    for incoming, replica in (({}, "agg-3"), ({("j", "w", 0): "agg-3"}, "agg-2")):
        record = moving_job()
        record.keys["x"] = KeySpec("x", (4,), "float32", 0, True, [PartSpec(0, (0, 4), "agg-2", [])])
        plan_failover({"j": record}, "agg-1", ["agg-0", "agg-2", "agg-3"], incoming=incoming)
        assert record.keys["w"].parts[0].replicas == [replica]

    master = Master("inproc://pmaster-no-replica-on-the-target", transports=Transports())
    try:
        state = master.state
        for name in ("agg-0", "agg-1", "agg-2"):
            state.register_aggregator(f"tcp://127.0.0.1:{9300 + int(name[-1])}", name)
            state.aggregator_joined(name)
        record = state.register_worker("j", 0, 1, None, {"servers": 1, "partition_bytes": 1024, "replication": 1})
        spec, _ = state.declare(record, 0, {"key": "w", "shape": [32], "dtype": "float32", "intent": "init"})
        spec.ready = True
        (part,) = spec.parts
        master.links.peers.update({name: RecordingPeer() for name in ("agg-0", "agg-1", "agg-2")})
        (target,) = {"agg-0", "agg-1", "agg-2"} - {part.aggregator, *part.replicas}
        master.replicas.incoming = lambda: {("j", "w", 0): target}
        dropped = part.replicas[0]
        master.replicas.dropped(part.aggregator, [["j", "w", 0, dropped]])
        assert part.replicas == []  # none but the target was left: none now, one once the move landed
    finally:
        master.stop()
