"""pMaster's orders lost with their connection (PSLINK_FAULTS ctl_drop, or a pMaster killed
before it sent them): what pMaster sends again when the Aggregator registers makes up for them.
Driven by hand: an Aggregator's core, as the shell drives it."""

from __future__ import annotations

import numpy as np

from pslink.core.wire.protocol import Op

from tests.unit.test_aggregator_core import close_round, init_replicated, replicated_source, spec


def test_a_part_placed_on_the_holder_of_its_replica_is_promoted_from_the_replica():
    """Found by the chaos run with control faults: the PROMOTE of a failover was lost with the
    replica holder's connection; pMaster re-sent what it places there (an ASSIGN) when the holder
    registered again, and the holder made a new, empty task of it: the workers' rounds found no
    state (and waited, or failed). Now such an ASSIGN promotes the replica it holds."""
    c, replica = replicated_source({"type": "sgd", "lr": 0.1, "momentum": 0.9})
    t = c.task
    ident = (t.job.job, t.key, t.part)
    init_replicated(c, replica, np.arange(6, dtype=np.float32))
    close_round(c, replica, 1, [np.ones(6), np.full(6, 3.0)])
    info = {"job": t.job.job, "token": t.job.token, "membership": t.job.membership.to_wire(), "mode": "optimizer",
            "optimizer": t.job.optimizer.to_wire(), "sync": "bsp"}
    placed = [dict(spec(), replicas=[])]  # the re-sent ASSIGN: the part is served here now
    assert replica.moves.promote_placed(t.job.job, placed) == []
    (task,) = replica.assign(info, placed)
    assert replica.tasks[ident] is task and ident not in replica.replicas and task.closed == 1
    np.testing.assert_array_equal(task.value, t.value)
    for name, value in t.opt_state.items():  # the momentum too
        np.testing.assert_array_equal(task.opt_state[name], value)
    # A move's ASSIGN (incoming) or a replica's is not a promotion.
    assert replica.moves.promote_placed(t.job.job, [dict(spec(), incoming=True), dict(spec(), replica=True)]) == []


def _failing_over(state_dir=None, names=("agg-0", "agg-1", "agg-2")):
    """pMaster with a job's key ``w`` on agg-0 (its replica on agg-1), agg-1 and agg-2 connected
    (recording peers), an Agent waiting to hear where the part went, and agg-0 failed over."""
    from pslink.core.master import Master
    from pslink.core.transport import Transports
    from tests.helpers import RecordingPeer

    master = Master("inproc://pmaster-lost-orders", transports=Transports(), state_dir=state_dir)
    state = master.state
    for name in names:
        master.store.save_aggregator(state.register_aggregator(f"tcp://127.0.0.1:{9400 + int(name[-1])}", name))
        state.aggregator_joined(name)
    record = state.register_worker("j", 0, 1, None, {"servers": 1, "partition_bytes": 1024, "replication": 1})
    spec, _ = state.declare(record, 0, {"key": "w", "shape": [32], "dtype": "float32", "intent": "init"})
    spec.ready = True
    (part,) = spec.parts
    part.aggregator, part.replicas = "agg-0", ["agg-1"]
    master.store.save_job(record)
    master.store.save_key("j", spec)
    peers = {name: RecordingPeer() for name in names[1:]}
    master.links.peers.update(peers)
    agent = RecordingPeer()
    master.failover.relocate(agent, {"id": 7, "job": "j", "tok": record.token, "rank": 0, "parts": [["w", 0, "agg-0"]]})
    master.failover.fail_over("agg-0")
    (promote,) = [i for i, (op, _) in enumerate(peers["agg-1"].calls) if op == Op.PROMOTE]
    return master, peers, agent, promote


def test_a_promote_lost_with_its_connection_is_sent_again_when_the_holder_is_back():
    """Found by the chaos run with control faults: a failover's PROMOTE was lost with the replica
    holder's connection; pMaster logged it and answered the Agents, which went to the holder and
    were told it does not hold the part (the job failed). Now the Agents wait; the PROMOTE goes
    again once the holder registers again, and they are answered when it took it."""
    from pslink.errors import PeerError

    master, peers, agent, promote = _failing_over()
    try:
        peers["agg-1"].callbacks[promote](None, PeerError("the connection was cut"))
        assert agent.replies == [] and "agg-0" in master.failover.failing  # nobody is sent there yet
        master.failover.aggregator_back("agg-1")  # it registered again
        again = [i for i, (op, _) in enumerate(peers["agg-1"].calls) if op == Op.PROMOTE][-1]
        assert again != promote and agent.replies == []
        peers["agg-1"].callbacks[again]({"op": Op.REPLY}, None)
        ((_, _, _, where, _),) = agent.replies[0]["body"]["keys"][0]["parts"]
        assert where == "agg-1" and not master.failover.failing
    finally:
        master.stop()


def test_a_promote_lost_with_a_holder_that_is_then_failed_over_ends_the_wait():
    from pslink.errors import PeerError

    master, peers, agent, promote = _failing_over()
    try:
        peers["agg-1"].callbacks[promote](None, PeerError("the connection was cut"))
        del master.links.peers["agg-1"]
        master.failover.fail_over("agg-1")  # never came back: its parts (and the promoted one) go elsewhere
        assert "agg-0" not in master.failover.failing and agent.replies  # the Agent hears where it went now
    finally:
        master.stop()


def test_a_pmaster_killed_in_a_failover_resumes_from_where_the_parts_go(tmp_path):
    """Found by the chaos run with control faults (a pMaster killed at the named point
    ``promoted``): the failover forgot the lost Aggregator in the store at once but stored a
    key's new place only once its PROMOTE was answered. The restarted pMaster found the other
    parts on an Aggregator it no longer knew and answered the Agents with no address for them
    ("address '' has no scheme"). Now the failover's placement is stored first; the holders
    promote their replicas when the restarted pMaster re-sends what it places on them."""
    from pslink.core.master import Master
    from pslink.core.transport import Transports

    master, peers, agent, promote = _failing_over(str(tmp_path), names=("agg-0", "agg-1"))  # (no replica to top up)
    master.stop()  # killed before any PROMOTE was answered
    restarted = Master("inproc://pmaster-lost-orders-2", transports=Transports(), state_dir=str(tmp_path))
    try:
        (part,) = restarted.state.jobs["j"].keys["w"].parts
        assert part.aggregator == "agg-1" and "agg-0" not in restarted.state.aggregators
        assert restarted.state.tasks_on("agg-1") and not restarted.state.tasks_on("agg-0")  # re-sent at registration
    finally:
        restarted.stop()


def test_a_drain_whose_moves_fail_keeps_the_aggregator_and_its_parts():
    """Found by the chaos run with partitions: a scale-down drained an Aggregator that had just
    died (its connection closed, the liveness probe not answered yet). Its moves were refused
    (not connected), yet the release that followed them forgot it with the parts still placed
    on it: no failover came, and the Agents were told no address for them ("address '' has no
    scheme"). Now the parts keep it in the pool (and in the plan), and its failover places them."""
    from pslink.core.master import Master
    from pslink.core.master.actions import Migrate, Release
    from pslink.core.transport import Transports
    from tests.helpers import RecordingPeer

    master = Master("inproc://pmaster-drain-failed", transports=Transports())
    try:
        state, control = master.state, master.state.control
        for name in ("agg-0", "agg-1"):
            master.store.save_aggregator(state.register_aggregator(f"tcp://127.0.0.1:{9400 + int(name[-1])}", name))
            state.aggregator_joined(name)
        record = state.register_worker("j", 0, 1, None, {"servers": 1, "partition_bytes": 1024, "replication": 0})
        spec, _ = state.declare(record, 0, {"key": "w", "shape": [32], "dtype": "float32", "intent": "init"})
        spec.ready = True
        ident = ("j", "w", 0)
        assert spec.parts[0].aggregator == "agg-0"
        master.links.peers["agg-1"] = RecordingPeer()  # agg-0's connection is closed
        # What Scaling._drain decides: the part to agg-1, agg-0 out of the plan, then released.
        move = control.move_task(ident, "agg-1", "drain agg-0: idle")
        control.pool.clusters[control.pool.cluster_of.pop("agg-0")].remove_aggregator("agg-0")
        state.outbox += [move, Release("agg-0", "drained: idle")]
        master._carry_out()
        assert isinstance(move, Migrate) and spec.parts[0].aggregator == "agg-0"
        assert "agg-0" in state.aggregators and control.pool.where(ident) == "agg-0"  # kept, the plan put back
        agent = RecordingPeer()
        master.failover.relocate(agent, {"id": 7, "job": "j", "tok": record.token, "rank": 0,
                                         "parts": [["w", 0, "agg-0"]]})
        master.failover.fail_over("agg-0")  # its failover places the part (no replica: restarted elsewhere)
        assert spec.parts[0].aggregator == "agg-1" and "agg-0" not in state.aggregators
        peer = master.links.peers["agg-1"]
        for callback in list(peer.callbacks):  # agg-1 took what it was given
            callback({"op": Op.REPLY}, None)
        for key in agent.replies[0]["body"]["keys"]:
            for _, _, _, where, address in key["parts"]:
                assert where == "agg-1" and address == "tcp://127.0.0.1:9401"
    finally:
        master.stop()


def handing_over():
    """An Aggregator's core that handed its part over at round 1's end, its copy not sent yet:
    (the cluster, the part, the move's target, the copy)."""
    from pslink.core.aggregator.tasks import CopyOut
    from tests.unit.test_aggregator_core import Cluster, migrate

    c = Cluster(workers=1, needs_init=False)
    target, _ = migrate(c)
    _, outputs = c.send(Op.PUSHPULL, 0, 1, np.full(6, 1.0))
    (out,) = [o for o in outputs if isinstance(o, CopyOut)]
    return c, (c.task.job.job, c.task.key, c.task.part), target, out

def test_a_source_given_a_replica_of_the_part_it_handed_over_no_longer_reports_the_hand_over():
    """Found by the CI chaos test killing pMaster at named points: an Aggregator that had handed a
    part over long before, and held its replica since, reported that old hand-over at every
    registration (its forwarding address stayed). A pMaster restarted in a failover that placed
    the part on this very holder took the report for a move it had not stored, sent the part to
    the old target, which held only a replica with no round in it, and promoted that: the job
    failed (``its replica ... had not received any of its rounds``). A replica placed here
    means pMaster stored the hand-over's end: the forwarding address goes."""
    from tests.unit.test_aggregator_core import copy, jobinfo

    c, ident, target, out = handing_over()
    copy(out, target)
    c.core.moves.copy_done(ident)
    assert ident in c.core.moved and ident not in c.core.tasks  # reported as handed over (landed)
    c.core.assign(jobinfo(workers=1), [dict(spec(), replica=True)])  # later: this holds its replica
    assert ident in c.core.replicas and ident not in c.core.moved


def test_a_replica_given_to_an_aggregator_waiting_for_the_parts_copy_takes_the_waiting_task_s_place():
    """Found by the chaos run with control faults: agg-3 waited for the copy of a part from a
    source that died before it handed the part over; the failover promoted the part's replica
    elsewhere and gave agg-3 the new replica. agg-3 ignored it (it "served" the part: the
    waiting task), so the new primary's rounds never reached a replica ("still does not know
    it holds it", for good). Now the ASSIGN ends the given-up move first."""
    from pslink.core.aggregator import failures

    c, replica = replicated_source({"type": "sgd", "lr": 0.1})
    t = c.task
    ident = (t.job.job, t.key, t.part)
    info = {"job": t.job.job, "token": t.job.token, "membership": t.job.membership.to_wire(), "mode": "optimizer",
            "optimizer": t.job.optimizer.to_wire(), "sync": "bsp"}
    target = replica  # (any core: one that waits for the part's copy)
    target.replicas.pop(ident)
    target.assign(info, [dict(spec(), incoming=True, **{"from": "agg-1"})])
    assert target.tasks[ident].incoming
    given = [dict(spec(), replica=True)]
    assert failures.end_moves_given_up(target.tasks, t.job.job, [dict(spec(), replica=True, drop=True)], "agg-3") == []
    assert ident in target.tasks  # a dropped replica, or any other ASSIGN, leaves the move alone
    assert failures.end_moves_given_up(target.tasks, t.job.job, given, "agg-3") == []  # nothing waited on it
    target.assign(info, given)
    assert ident not in target.tasks and ident in target.replicas
    init_replicated(c, target, np.arange(6, dtype=np.float32))  # the primary's next round reaches it
    assert target.replicas[ident]["closed"] == 0


def test_a_replica_given_to_the_source_of_a_hand_over_whose_copy_is_unacknowledged_is_kept():
    """The source of a move holds the task (handed over, its copy not acknowledged yet) when the
    move's end reaches pMaster another way and pMaster makes it the part's replica: the replica
    was ignored (the task was taken for one served here) and no round ever reached it. It is
    kept beside the leaving task now, and the rounds reach it once the task is gone."""
    from tests.unit.test_aggregator_core import copy, jobinfo

    c, ident, target, out = handing_over()
    assert c.core.tasks[ident].moved_to is not None  # handed over, the copy on its way
    c.core.assign(jobinfo(workers=1), [dict(spec(), replica=True)])
    assert ident in c.core.replicas
    copy(out, target)
    c.core.moves.copy_done(ident)
    assert ident not in c.core.tasks and ident in c.core.replicas
    c.core.moves.replica_update({"job": ident[0], "key": ident[1], "part": ident[2]}, {"closed": 1}, [])
    assert c.core.moves.replicas_with_state() == [list(ident)]


def test_a_replica_no_round_reaches_gets_its_orders_again():
    """Found in CI under lost control messages with nothing killed: agg-0 held two replicas no
    round reached for 60 s. pMaster only logged an order that failed, and nothing sent it again.
    Now a counted replica whose holder's heartbeats report no round in it for a while (its
    primary connected) gets its orders again, at pMaster's sweep: the holder's, then the primary's."""
    from pslink.core.master import replica_hosts as replicas_module

    master, peers, agent, promote = _failing_over()
    try:
        peers["agg-1"].callbacks[promote]({"op": Op.REPLY}, None)  # agg-1 serves w now; agg-2 holds its replica
        part = master.state.jobs["j"].keys["w"].parts[0]
        assert part.aggregator == "agg-1" and part.replicas == ["agg-2"]
        now = [master.state.clock()]
        master.state.clock = lambda: now[0]
        ident = ("j", "w", 0)
        peers["agg-2"].info.update(role="aggregator", name="agg-2")

        def heartbeat(reached):  # then pMaster's sweep
            master._aggregator_heartbeat(peers["agg-2"], {"id": 0, "stats": {"replicas_with_state": reached}})
            master.replicas.unreached()

        def assigns(name):
            return [fields for op, fields in peers[name].calls if op == Op.ASSIGN]

        before = len(assigns("agg-2")), len(assigns("agg-1"))
        heartbeat([])
        now[0] += replicas_module.UNREACHED_PATIENCE - 0.1
        heartbeat([])
        assert (len(assigns("agg-2")), len(assigns("agg-1"))) == before  # not yet
        now[0] += 0.2
        heartbeat([])
        (told,) = assigns("agg-2")[before[0]:]
        assert told["tasks"][0]["replica"] and told["tasks"][0]["key"] == "w"
        peers["agg-2"].callbacks[-1]({"op": Op.REPLY}, None)  # the holder took it: now the primary
        (listed,) = assigns("agg-1")[before[1]:]
        assert [r[0] for r in listed["tasks"][0]["replicas"]] == ["agg-2"]
        heartbeat([list(ident)])  # a round reached it: no more orders
        now[0] += 10 * replicas_module.UNREACHED_PATIENCE
        heartbeat([list(ident)])
        assert len(assigns("agg-2")) == before[0] + 1
    finally:
        master.stop()


def test_a_move_target_back_before_the_move_was_routed_keeps_the_part_it_waits_for():
    """Found by the chaos run with control faults: a move's target, told of the move (its
    ASSIGN answered), lost its connection and registered again before pMaster heard that the
    source handed the part over. pMaster still placed the part on the source, took the target's
    waiting task for a stale one and had it dropped: the copy found no task ("expects no
    copy"), the source gave it up, and the workers it had sent to the target found nothing
    (the job failed). A running move's target keeps its task now."""
    from pslink.core.master.actions import Migrate

    master, peers, agent, promote = _failing_over(names=("agg-0", "agg-1", "agg-2", "agg-3"))
    try:
        peers["agg-1"].callbacks[promote]({"op": Op.REPLY}, None)  # agg-1 serves w now
        peers["agg-3"] = master.links.peers["agg-3"] = type(peers["agg-1"])()
        ident = ("j", "w", 0)
        master.mover.migrate([Migrate(ident, "agg-1", "agg-3", "test")])
        assert master.mover.core.incoming().get(ident) == "agg-3"
        assert master.state.jobs["j"].keys["w"].parts[0].aggregator == "agg-1"  # not routed yet
        assert master.joining._fenced("agg-3", {"tasks": [list(ident)]}) == []
        assert master.joining._fenced("agg-2", {"tasks": [list(ident)]}) == [list(ident)]  # not its move
    finally:
        master.stop()
