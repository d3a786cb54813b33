"""The migration core (pslink.core.master.migration_core): events in, actions out, no I/O. pMaster and
the simulator drive the very same class."""

from __future__ import annotations

import pytest

from pslink.core.master import Master
from pslink.core.master.actions import Migrate
from pslink.core.master.migration_core import (Begin, CopyFromReplica, Dropped, Finished, HandOver, Migrated, Migrations,
                                           Routed, Settle)
from pslink.core.transport import Transports
from pslink.core.wire.protocol import Op
from pslink.sim.engine import PslinkSimulation, ServiceOptions
from pslink.sim.workload import SimJob

MIB = 1 << 20


def core(sizes: dict | None = None, max_bytes: int = 16 * MIB) -> Migrations:
    return Migrations(lambda task: (sizes or {}).get(task, 4 * MIB), max_bytes)


def kinds(actions) -> list:
    """Actions as plain tuples, to compare across drivers."""
    out = []
    for a in actions:
        if isinstance(a, (Begin, HandOver, Routed)):
            out.append((type(a).__name__, a.move.task, a.move.source, a.move.target))
        elif isinstance(a, Finished):
            out.append(("Finished", a.move.task, a.why))
        elif isinstance(a, Dropped):
            out.append(("Dropped", a.action.task, a.why))
        elif isinstance(a, CopyFromReplica):
            out.append(("CopyFromReplica", a.move.task, a.lost))
        elif isinstance(a, Settle):
            out.append(("Settle",) + tuple(a.names))
    return out


def walk(moves: Migrations, task, now=0.0) -> list:
    """Every step of a move that is under way, in order; the actions of each."""
    move = moves.running[task]
    return (moves.target_ready(task, True, now) + moves.handed_over(task, move.source, True, now)
            + moves.copy_done(task, now) + moves.workers_done(task, now))


def test_a_move_goes_through_its_steps_and_ends_once_copied_and_caught_up():
    moves = core()
    t = ("j", "w", 0)
    assert kinds(moves.request(Migrate(t, "a", "b", "pack"), 1.0)) == [("Begin", t, "a", "b")]
    assert moves.moving("a") and moves.moving("b") and moves.moving_jobs() == {"j"}
    assert kinds(moves.target_ready(t, True, 1.0)) == [("HandOver", t, "a", "b")]
    assert kinds(moves.handed_over(t, "a", True, 1.0)) == [("Routed", t, "a", "b")]
    assert kinds(moves.deadline(t)) == [("HandOver", t, "a", "b")] and moves.deadline(t)[0].force
    assert moves.copy_done(t, 2.0) == [] and moves.copying_bytes() == 0  # copied: room for others
    assert kinds(moves.workers_done(t, 3.0)) == [("Finished", t, "done"), ("Settle", "a", "b")]
    assert moves.idle() and moves.done == 1 and not moves.moving("a")


def test_the_throttle_lets_a_bounded_amount_copy_at_once_and_the_rest_waits_in_order():
    moves = core(max_bytes=10 * MIB)
    tasks = [("j", k, 0) for k in range(5)]
    begun = []
    for t in tasks:
        begun += kinds(moves.request(Migrate(t, "a", "b", "pack"), 0.0))
    assert [b[1] for b in begun] == tasks[:2]  # 2 x 4 MiB fit in 10 MiB; a third would not
    status = moves.status(5.0)
    assert [s["queued"] for s in status] == [False, False, True, True, True]
    assert status[0]["seconds"] == 5.0 and status[2]["bytes"] == 4 * MIB
    begun = []
    for t in tasks[:2]:
        begun += kinds(walk(moves, t))
    assert [b[1] for b in begun if b[0] == "Begin"] == tasks[2:4]  # each copy landed frees room
    big = core({("j", "huge", 0): 64 * MIB}, max_bytes=10 * MIB)
    assert kinds(big.request(Migrate(("j", "huge", 0), "a", "b", "x"), 0.0))[0][0] == "Begin"  # one always goes


def test_a_task_moved_again_waits_for_its_move_or_goes_straight_to_the_new_place():
    moves = core(max_bytes=4 * MIB)
    first, second = ("j", 0, 0), ("j", 1, 0)
    moves.request(Migrate(first, "a", "b", "x"), 0.0)
    assert kinds(moves.request(Migrate(first, "b", "c", "y"), 0.0)) == []  # waits behind the running move
    moves.request(Migrate(second, "a", "b", "x"), 0.0)  # throttled
    assert kinds(moves.request(Migrate(second, "b", "c", "y"), 0.0)) == [("Settle", "b")]  # straight a -> c
    assert moves.throttled[second] == Migrate(second, "a", "c", "y")
    assert kinds(moves.request(Migrate(second, "c", "a", "z"), 0.0)) == [("Dropped", second, "ended"),
                                                                        ("Settle", "a", "c")]  # back where it is
    done = kinds(walk(moves, first))
    assert ("Finished", first, "done") in done and ("Begin", first, "b", "c") in done  # the follow-up begins


def test_losing_an_aggregator_abandons_moves_onto_it_and_has_a_replica_copy_moves_off_it():
    moves = core(max_bytes=8 * MIB)
    onto, off, handed, queued = ("j", 0, 0), ("j", 1, 0), ("j", 2, 0), ("j", 3, 0)
    moves.request(Migrate(onto, "a", "x", "m"), 0.0)
    moves.request(Migrate(handed, "x", "b", "m"), 0.0)
    moves.target_ready(handed, True, 0.0)  # x was told it may hand it over: workers may queue at b
    moves.request(Migrate(off, "x", "c", "m"), 0.0)  # throttled (8 MiB in flight)
    moves.request(Migrate(queued, "a", "d", "m"), 0.0)
    stays, actions = moves.aggregator_lost("x", 1.0)
    assert stays == {onto: "a"}  # a may still serve it: the failover offers it the task first
    got = kinds(actions)
    assert ("Dropped", off, "failed") in got and ("Finished", onto, "abandoned") in got
    assert ("CopyFromReplica", handed, "x") in got
    assert ("Begin", queued, "a", "d") in got  # room freed
    moves.resourced(handed, "replica")
    assert moves.running[handed].source == "replica" and not moves.moving("x")
    assert kinds(moves.copy_done(handed, 2.0) + moves.workers_done(handed, 2.0))[0] == ("Finished", handed, "done")


def test_a_job_that_ends_takes_its_moves_with_it():
    moves = core(max_bytes=4 * MIB)
    moves.request(Migrate(("j", 0, 0), "a", "b", "m"), 0.0)
    moves.request(Migrate(("j", 1, 0), "a", "b", "m"), 0.0)
    moves.request(Migrate(("k", 0, 0), "a", "c", "m"), 0.0)
    got = kinds(moves.job_ended("j", 1.0))
    assert ("Dropped", ("j", 1, 0), "ended") in got and ("Finished", ("j", 0, 0), "ended") in got
    assert ("Begin", ("k", 0, 0), "a", "c") in got and moves.moving_jobs() == {"k"}


# -- one core for pMaster and the simulator ----------------------------------------------------------


class _Peer:
    def call(self, op, callback, timeout=None, **fields):
        pass

    def notify(self, op, **fields):
        pass


def test_pmaster_and_the_simulator_drive_one_migration_core_to_the_same_decisions():
    """The same job and the same event sequence through pMaster's mover and the simulator's
    core: the same class, configured alike, answering with the same actions."""
    sizes = [6 * MIB, 6 * MIB, 3 * MIB, 5 * MIB]
    master = Master("inproc://pmaster-migrations", transports=Transports(), max_migration_bytes=16 * MIB)
    try:
        state = master.state
        for name in ("agg-0", "agg-1"):
            state.register_aggregator(f"tcp://127.0.0.1:{9000 + int(name[-1])}", name)
            state.aggregator_joined(name)
            master.links.peers[name] = _Peer()
        record = state.register_worker("j", 0, 1, None, {"partition_bytes": 8 * MIB})
        for key, nbytes in enumerate(sizes):
            spec, _ = state.declare(record, 0, {"key": key, "shape": [nbytes // 4], "dtype": "float32",
                                                "intent": "init"})
            spec.ready = True
        sim = PslinkSimulation([SimJob("j", 0.0, 100.0, 1, 1, "hand", 1.0, tuple((k, 0, n) for k, n in enumerate(sizes)),
                                       (0.01,) * len(sizes), 1.0)], ServiceOptions(max_migration_bytes=16 * MIB))
        sim.control.job_arrived("j", 1, 1)
        for key, nbytes in enumerate(sizes):
            sim.control.place_part("j", key, 0, nbytes)
        live, simulated = master.mover.core, sim.migrations
        assert type(live) is type(simulated) is Migrations
        assert live.max_bytes == simulated.max_bytes
        events = [("request", Migrate(("j", k, 0), "agg-0", "agg-1", "pack")) for k in range(len(sizes))]
        events += [(step, ("j", 0, 0)) for step in ("target_ready", "handed_over", "copy_done", "workers_done")]
        events += [("aggregator_lost", "agg-1")]
        answers = []
        for moves in (live, simulated):
            got = []
            for name, arg in events:
                if name == "request":
                    got.append(kinds(moves.request(arg, 0.0)))
                elif name == "target_ready":
                    got.append(kinds(moves.target_ready(arg, True, 0.0)))
                elif name == "handed_over":
                    got.append(kinds(moves.handed_over(arg, "agg-0", True, 0.0)))
                elif name == "copy_done":
                    got.append(kinds(moves.copy_done(arg, 0.0)))
                elif name == "workers_done":
                    got.append(kinds(moves.workers_done(arg, 0.0)))
                else:
                    stays, actions = moves.aggregator_lost(arg, 0.0)
                    got.append((sorted(stays.items()), kinds(actions)))
            answers.append(got)
        assert answers[0] == answers[1]
        assert answers[0][:4] == [[("Begin", ("j", k, 0), "agg-0", "agg-1")] for k in range(3)] + [[]]  # 15 + 5 > 16 MiB
    finally:
        master.stop()


@pytest.mark.parametrize("timed", [False, True])
def test_simulated_moves_take_time_and_hold_back_the_guard(timed):
    # Two jobs whose packing moves parts: with timed moves the moves end later, the jobs stall
    # for their copies, and the guard does not judge a job while its tasks move.
    def sim_job(name, submit):
        parts = tuple((k, 0, 8 * MIB) for k in range(6))
        return SimJob(name, float(submit), 400.0, 2, 2, "hand", 1.0, parts, (0.1,) * 6, 1.0)

    options = ServiceOptions(startup=0.0, timed_moves=timed, copy_bandwidth=1e8, max_migration_bytes=16 * MIB)
    sim = PslinkSimulation([sim_job("A", 0), sim_job("B", 5)], options, check=True)
    seen_moving = []
    original = sim._caught_up

    def caught_up(task):
        seen_moving.append(bool(sim.control.moving_jobs()))
        return original(task)

    sim._caught_up = caught_up
    result = sim.run()
    assert result.counters["migrations"] > 0 and all(seen_moving)
    ends = [o.end for o in result.jobs]
    if timed:
        assert all(end > o.submit + o.duration for end, o in zip(ends, result.jobs))  # each copy stalled a round
    else:
        assert ends == [pytest.approx(o.submit + o.duration) for o in result.jobs]


# -- batches: one decision's moves of a job onto one Aggregator are one migration ----------------------


def test_one_decisions_moves_of_a_job_onto_an_aggregator_are_batches_the_throttle_admits_whole():
    moves = core(max_bytes=8 * MIB)
    pack = [Migrate(("j", k, 0), "a", "b", "pack") for k in range(3)] + [Migrate(("j", 3, 0), "c", "b", "pack")]
    pack.append(Migrate(("k", 0, 0), "a", "b", "pack"))  # another job's: a batch of its own
    begun = kinds(moves.request_many(pack, 0.0))
    # 16 MiB onto b (from a and from c): two batches of 8 MiB (the throttle's worth); the rest waits.
    assert begun == [("Begin", ("j", k, 0), "a", "b") for k in range(2)]
    assert {m.batch for m in moves.running.values()} == {1} and moves.batch(1).bytes == 8 * MIB
    assert [list(m) for m in moves.waiting.values()] == [[("j", 2, 0), ("j", 3, 0)], [("k", 0, 0)]]
    actions = []
    for k in range(2):
        actions += walk(moves, ("j", k, 0))
    migrated = [a.batch for a in actions if isinstance(a, Migrated)]
    assert len(migrated) == 1 and (migrated[0].job, migrated[0].source, migrated[0].target, migrated[0].moved) == \
        ("j", "a", "b", 2)
    assert moves.done == 2 and moves.migrated == 1 and moves.batch(1) is None
    # The first batch's copies landed: room for the next, from two sources at once.
    assert [a[1:] for a in kinds(actions) if a[0] == "Begin"] == [(("j", 2, 0), "a", "b"), (("j", 3, 0), "c", "b")]
    big = core({("j", "huge", 0): 64 * MIB}, max_bytes=8 * MIB)  # a task over the throttle goes alone
    assert kinds(big.request_many([Migrate(("j", "huge", 0), "a", "b", "x"), Migrate(("j", 1, 0), "a", "b", "x")],
                                  0.0)) == [("Begin", ("j", "huge", 0), "a", "b")]


def test_a_job_whose_compute_hides_a_bigger_copy_moves_in_bigger_batches():
    """Issue 29: the batch bound is per job (the control plane's batch_bytes: what the copy
    moves while the job computes), at least the throttle's; a pack of a job with long
    iterations is one migration per target, not one per 16 MiB."""
    moves = core(max_bytes=8 * MIB)
    moves.batch_bytes = {"slow": 64 * MIB, "fast": 0}.get
    pack = [Migrate(("slow", k, 0), "a" if k % 2 else "c", "b", "pack") for k in range(6)]
    pack += [Migrate(("fast", k, 0), "a", "b", "pack") for k in range(4)]
    begun = kinds(moves.request_many(pack, 0.0))
    assert [a[1] for a in begun] == [("slow", k, 0) for k in range(6)]  # 24 MiB: one batch, admitted alone
    assert moves.batch(1).bytes == 24 * MIB and moves.batch(1).left == 6
    assert [list(m) for m in moves.waiting.values()] == [[("fast", 0, 0), ("fast", 1, 0)],
                                                         [("fast", 2, 0), ("fast", 3, 0)]]


def test_a_batch_counts_as_a_migration_only_if_some_of_its_moves_were_done():
    moves = core()
    moves.request_many([Migrate(("j", k, 0), "a", "b", "pack") for k in range(2)], 0.0)
    first = moves.target_ready(("j", 0, 0), False, 0.0)  # refused: the plan goes back
    assert [a for a in first if isinstance(a, Migrated)] == []
    rest = walk(moves, ("j", 1, 0))
    (migrated,) = [a.batch for a in rest if isinstance(a, Migrated)]
    assert migrated.moved == 1 and moves.migrated == 1
    moves.request_many([Migrate(("j", k, 0), "b", "c", "guard") for k in range(2)], 0.0)
    for k in range(2):
        assert not [a for a in moves.target_ready(("j", k, 0), False, 0.0) if isinstance(a, Migrated)]
    assert moves.migrated == 1 and moves.idle()


def test_a_waiting_task_moved_again_leaves_its_batch():
    moves = core({("x", 0, 0): 16 * MIB})
    moves.request(Migrate(("x", 0, 0), "a", "b", "m"), 0.0)  # runs, 16 MiB: what follows waits
    moves.request_many([Migrate(("j", k, 0), "a", "b", "pack") for k in range(3)], 0.0)
    assert list(moves.waiting.values()) == [dict.fromkeys(("j", k, 0) for k in range(3))]
    moves.request_many([Migrate(("j", 1, 0), "b", "c", "guard")], 0.0)  # straight a -> c, a batch of its own
    assert [list(m) for m in moves.waiting.values()] == [[("j", 0, 0), ("j", 2, 0)], [("j", 1, 0)]]
    moves.request_many([Migrate(("j", 0, 0), "b", "a", "back"), Migrate(("j", 2, 0), "b", "a", "back")], 0.0)
    assert [list(m) for m in moves.waiting.values()] == [[("j", 1, 0)]]  # back where they were: off
    assert set(moves.batch_of) == set(moves.throttled) == {("j", 1, 0)}


class _RecordingPeer:
    def __init__(self):
        self.calls = []

    def call(self, op, callback, timeout=None, **fields):
        self.calls.append((op, callback, fields))

    def notify(self, op, **fields):
        pass


def test_pmaster_tells_a_batch_in_one_assign_and_one_migrate_and_plans_back_a_part_the_source_refused():
    master = Master("inproc://pmaster-batches", transports=Transports())
    try:
        state = master.state
        peers = {}
        for name in ("agg-0", "agg-1"):
            state.register_aggregator(f"tcp://127.0.0.1:{9000 + int(name[-1])}", name)
            state.aggregator_joined(name)
            peers[name] = master.links.peers[name] = _RecordingPeer()
        record = state.register_worker("j", 0, 1, None, {"servers": 1})
        for key in range(3):
            spec, _ = state.declare(record, 0, {"key": key, "shape": [16], "dtype": "float32", "intent": "init"})
            spec.ready = True
        source = record.keys[0].parts[0].aggregator
        target = next(n for n in peers if n != source)
        tasks = [("j", key, 0) for key in range(3)]
        master.mover.migrate([state.control.move_task(t, target, "test") for t in tasks])
        ((op, assigned, fields),) = peers[target].calls
        assert op == Op.ASSIGN and sorted(t["key"] for t in fields["tasks"]) == [0, 1, 2]
        assigned({"op": Op.REPLY}, None)
        ((op, started, fields),) = peers[source].calls
        assert op == Op.MIGRATE and fields["parts"] == [[0, 0], [1, 0], [2, 0]] and fields["target"][0] == target
        started({"op": Op.REPLY, "body": {"failed": [[1, 0, "still arriving"]]}}, None)
        assert [record.keys[k].parts[0].aggregator for k in range(3)] == [target, source, target]
        assert sorted(master.mover.core.running) == [("j", 0, 0), ("j", 2, 0)]
        assert [state.control.pool.where(t) for t in tasks] == [target, source, target]  # the plan took it back
    finally:
        master.stop()
