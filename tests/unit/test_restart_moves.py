"""A pMaster killed in the middle of a move (issue 23: the drain's named points ``hand-over``
and ``copy-landed``): the source took the MIGRATE and sent the Agents to the target, but the
store still places the parts on the source. Before, the restarted pMaster fenced the parts on
the target at its registration (it dropped the state the workers trained on since) and let a
drain shut the source down with its copy in flight. Now the Aggregators' registrations say
what moved: the source's hand-overs move the parts to their target (the move goes on until its
copy lands), and a target that registers first keeps its part until the source says. Driven by
hand: pMaster's admission with recording peers, the pure migration core, an Aggregator's shell."""

from __future__ import annotations

from pslink.core.aggregator.process import Aggregator
from pslink.core.master import Master
from pslink.core.master.migration_core import Finished, Migrations, Routed
from pslink.core.transport import Transports
from pslink.core.wire.protocol import Op
from tests.helpers import RecordingPeer

TOKEN = b"secret-token-123"


def _restarted_master():
    """A pMaster that has a job's key ``w`` in two parts placed on agg-0 and agg-1 (as a
    restarted one has them from its store), none of its Aggregators registered yet."""
    master = Master("inproc://pmaster-restart-moves", transports=Transports())
    state = master.state
    for name in ("agg-0", "agg-1"):
        state.register_aggregator(f"tcp://127.0.0.1:{9100 + int(name[-1])}", name)
        state.aggregator_joined(name)
    record = state.register_worker("j", 0, 1, None, {"servers": 2, "partition_bytes": 64})
    spec, _ = state.declare(record, 0, {"key": "w", "shape": [32], "dtype": "float32", "intent": "init"})
    spec.ready = True
    source = spec.parts[0].aggregator
    target = "agg-1" if source == "agg-0" else "agg-0"
    return master, spec, source, target


def _register(master, name: str, **report) -> RecordingPeer:
    peer = RecordingPeer()
    master.joining._admit(peer, {"id": 1, "address": f"inproc://{name}-again", "agg": name, "lease": 2.5, **report})
    return peer


def test_a_source_that_handed_a_part_over_before_the_restart_moves_it_to_its_target():
    for landed in (True, False):
        master, spec, source, target = _restarted_master()
        try:
            peer = _register(master, source, tasks=[], moved=[["j", "w", 0, target, landed]])
            assert peer.replies[0]["body"]["fenced"] == []
            assert spec.parts[0].aggregator == target  # lookups go where the Agents were sent
            assert master.state.control.pool.where(("j", "w", 0)) == target  # and the plan agrees (a drain counts it)
            if landed:
                assert master.mover.core.idle() and master.mover.core.done == 1
            else:  # the move goes on: a drain of the source waits for its copy
                assert master.mover.core.moving(source)
                master.mover.progress(peer, {"op": Op.TENSOR_COPY_DONE, "job": "j", "key": "w", "part": 0})
                assert master.mover.core.idle() and master.mover.core.done == 1
            # The target registering afterwards keeps the part: it is placed there.
            assert _register(master, target, tasks=[["j", "w", 0]], arrived=[["j", "w", 0, source]]) \
                .replies[0]["body"]["fenced"] == []
        finally:
            master.stop()


def test_a_target_that_registers_first_keeps_the_part_until_its_source_says():
    master, spec, source, target = _restarted_master()
    try:
        holder = _register(master, target, tasks=[["j", "w", 0], ["j", "w", 1]], arrived=[["j", "w", 0, source]])
        assert holder.replies[0]["body"]["fenced"] == []  # not fenced: the source may have handed it over
        assert master.state.move_claims == {("j", "w", 0): (target, source)}
        _register(master, source, tasks=[], moved=[["j", "w", 0, target, True]])
        assert spec.parts[0].aggregator == target and not master.state.move_claims
        assert not [op for op, _ in holder.calls if op == Op.FENCE]
    finally:
        master.stop()


def test_a_part_whose_source_kept_it_is_fenced_on_the_claimed_target():
    master, spec, source, target = _restarted_master()
    try:
        holder = _register(master, target, tasks=[["j", "w", 0]], arrived=[["j", "w", 0, source]])
        _register(master, source, tasks=[["j", "w", 0]])  # the MIGRATE never reached it
        assert spec.parts[0].aggregator == source and not master.state.move_claims
        assert [fields for op, fields in holder.calls if op == Op.FENCE] == [{"parts": [["j", "w", 0]]}]
    finally:
        master.stop()


def test_a_claimed_part_whose_source_never_comes_back_is_fenced_at_its_failover():
    master, spec, source, target = _restarted_master()
    try:
        holder = _register(master, target, tasks=[["j", "w", 0]], arrived=[["j", "w", 0, source]])
        master.failover.fail_over(source)  # silent since the restart (its replicas hold the answered rounds)
        assert not master.state.move_claims
        fences = [fields for op, fields in holder.calls if op == Op.FENCE]
        assert fences == ([] if spec.parts[0].aggregator == target else [{"parts": [["j", "w", 0]]}])
    finally:
        master.stop()


def test_the_migration_core_resumes_moves_from_their_hand_over():
    core = Migrations(lambda task: 1000)
    actions = core.resume("agg-0", [(("j", "w", 0), "agg-1", True), (("j", "w", 1), "agg-1", False)], now=1.0)
    assert [(type(a), a.move.task[2]) for a in actions if isinstance(a, (Routed, Finished))] == \
        [(Routed, 0), (Finished, 0), (Routed, 1)]  # the landed one is done at once
    assert list(core.running) == [("j", "w", 1)] and core.copying_bytes() == 1000
    assert core.resume("agg-0", [(("j", "w", 1), "agg-1", False)], now=2.0) == []  # already under way
    assert [type(a) for a in core.copy_done(("j", "w", 1), now=3.0) if isinstance(a, Finished)] == [Finished]
    assert core.idle() and core.done == 2 and core.copying_bytes() == 0


def test_an_aggregator_reports_its_hand_overs_and_arrivals_and_drops_a_fenced_part():
    transports = Transports()
    aggregator = Aggregator(None, "inproc://agg-restart-moves", name="agg-0", transports=transports)
    try:
        info = {"job": "j", "token": TOKEN, "membership": {"ranks": [0], "epoch": 0}, "mode": "sum",
                "optimizer": None, "sync": "bsp"}
        spec = {"key": "w", "part": 0, "shape": [4], "span": [0, 4], "dtype": "float32", "needs_init": False,
                "declared_by": 0}
        leaving, arrived, kept = aggregator.core.assign(
            info, [spec, dict(spec, key="v", incoming=True, **{"from": "agg-7"}), dict(spec, key="u")])
        leaving.migrate_to = ("agg-1", "tcp://127.0.0.1:1")  # a MIGRATE taken; hands over at the round's end
        aggregator.core.moved[("j", "gone", 0)] = ("agg-2", "tcp://127.0.0.1:2")  # a copy that landed
        report = aggregator._registration()
        assert report["tasks"] == [["j", "v", 0], ["j", "u", 0]]
        assert report["moved"] == [["j", "w", 0, "agg-1", False], ["j", "gone", 0, "agg-2", True]]
        assert report["arrived"] == [["j", "v", 0, "agg-7"]]
        # A MIGRATE of a part already handed over: done if to the same target, refused (naming
        # where it went) if to another (before: taken silently, and that target waited forever).
        migrate = aggregator.core.moves.begin_migrations
        assert migrate({"job": "j", "target": ["agg-2", "a"], "parts": [["gone", 0]]}) == ([], [])
        _, failed = migrate({"job": "j", "target": ["agg-3", "a"], "parts": [["gone", 0]]})
        assert len(failed) == 1 and "handed over to agg-2 already" in failed[0][2]
        peer = RecordingPeer()
        aggregator._send_all = lambda outputs: None
        aggregator._on_control(peer, {"op": Op.FENCE, "id": 3, "parts": [["j", "v", 0]]})
        assert ("j", "v", 0) not in aggregator.core.tasks and ("j", "u", 0) in aggregator.core.tasks
        assert ("j", "v", 0) in aggregator.master.fenced_parts and peer.replies == [{}]
    finally:
        aggregator.stop()
        transports.close()


def test_a_part_left_short_of_replicas_gets_them_when_an_aggregator_joins():
    # A move resumed onto the Aggregator that held the part's replica, when no other one had
    # registered yet, leaves the part without one; the next registration tops it up (before:
    # nothing did, and the part's next failover lost the key).
    master = Master("inproc://pmaster-top-up", transports=Transports())
    try:
        state = master.state
        for name in ("agg-0", "agg-1"):
            state.register_aggregator(f"tcp://127.0.0.1:{9200 + int(name[-1])}", name)
            state.aggregator_joined(name)
        record = state.register_worker("j", 0, 1, None, {"servers": 1, "partition_bytes": 1024, "replication": 1})
        spec, _ = state.declare(record, 0, {"key": "w", "shape": [32], "dtype": "float32", "intent": "init"})
        spec.ready = True
        (part,) = spec.parts
        primary, other = part.aggregator, "agg-1" if part.aggregator == "agg-0" else "agg-0"
        part.replicas = []
        state.aggregator_lost(other)  # (as a restarted pMaster has it until it registers)
        _register(master, primary, tasks=[["j", "w", 0]])  # no other Aggregator alive: nothing to pick
        assert part.replicas == []
        holder = _register(master, other, tasks=[])
        assert part.replicas == [other]
        assert [fields["tasks"][0].get("replica") for op, fields in holder.calls if op == Op.ASSIGN] == [True]
    finally:
        master.stop()


def test_malformed_move_reports_are_ignored_not_raised():
    master, spec, source, target = _restarted_master()
    try:
        junk = ["x", 5, ["j", ["w"], 0, target, True], ["j", "w", "0", target], [1, 2], {"a": 1}, ["j", "w", 0],
                ["j", "w", 0, [target], True], ["j", "w", 0, {"t": 1}]]
        peer = _register(master, target, tasks=[["j", ["w"], 0], ["j", "w", 1, ["x"]]], moved=junk, arrived=junk)
        assert peer.replies[0]["body"]["fenced"] == [] and spec.parts[0].aggregator == source
    finally:
        master.stop()


def test_a_part_of_a_key_pmaster_does_not_have_is_dropped_at_registration():
    """A placement pMaster never stored (it restarted before the ASSIGN was answered, or the
    placement failed) is made again, maybe elsewhere: an Aggregator that reports a part of it
    drops it (else a later move or replica onto it finds a stale copy). Keys of jobs pMaster
    does not serve are not its to judge, and the parts it places there stay."""
    master, spec, source, target = _restarted_master()
    try:
        peer = _register(master, source, tasks=[["j", "w", 0], ["j", "gone", 0], ["other-job", "w", 0], ["j", [1], 0]])
        assert peer.replies[0]["body"]["fenced"] == [["j", "gone", 0]]
    finally:
        master.stop()
