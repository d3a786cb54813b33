"""Live migration inside running jobs (AutoPS Appendix B): nothing lost, nothing applied twice."""

from __future__ import annotations

import threading
import time
from collections import Counter

import numpy as np
import pytest

import pslink
from pslink.core.transport import Transports
from tests.helpers import run_workers, start_cluster


@pytest.fixture
def transports():
    t = Transports()
    yield t
    t.close()


def wait_until(predicate, timeout, what):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def contribution(rank, round_, n):
    rng = np.random.default_rng(100 * rank + round_)
    return rng.integers(-50, 50, n).astype(np.float32)


def followers_caught_up(service, job: str) -> bool:
    """Whether every part of ``job`` that a move's target follows has its seed there and every
    closed round confirmed (parts handed over, or not followed, count as caught up)."""
    for aggregator in service.provider.aggregators.values():
        for ident, task in list(aggregator.core.tasks.items()):
            follower = task.follower
            if ident[0] == job and follower is not None and not follower.failed \
                    and (follower.confirmed is None or follower.confirmed < task.closed):
                return False
    return True


def moving_worker(service, transports, job: str, n: int, part_bytes: int, rounds: int, migrated_at: int | None,
                  settings: dict, workers: int = 2, keep_up: bool = False):
    """A worker (for run_workers) of a 2-worker momentum-SGD job on one key of ``n`` floats: before
    round ``migrated_at`` (None: never) rank 0 moves every part of the job to agg-2. Returns its
    final weights and where the key's parts ended. ``keep_up``: after the move's start rank 0
    begins each round only once the targets have confirmed the rounds closed before (the rounds
    of this job take well under a millisecond, with no compute between them: on a loaded machine
    a target may fall the allowed rounds behind, and the part then moves whole, by design)."""
    both_past = threading.Barrier(workers, timeout=30)
    master = service.master

    def worker(rank):
        agent = pslink.connect(job, rank, workers, master=service.address, transports=transports,
                               partition_bytes=part_bytes, servers=2, optimizer=settings, timeout=30)
        try:
            w = np.full(n, 0.5, np.float32)
            agent.init("w", w).wait()
            for r in range(1, rounds + 1):
                if r == migrated_at:
                    both_past.wait()
                    if rank == 0:
                        master.migrate(master.tasks_of(job), "agg-2", "test")
                if keep_up and rank == 0 and migrated_at is not None and r > migrated_at:
                    wait_until(lambda: followers_caught_up(service, job), 10, f"the targets to confirm round {r - 1}")
                agent.pushpull("w", contribution(rank, r, n) / 100, out=w).wait()
            return w.copy(), agent.key_info("w")["parts"]
        finally:
            agent.close()

    return worker


@pytest.mark.parametrize("kind", ["inproc", "tcp"])
def test_bsp_sums_stay_exact_while_every_task_migrates(kind, transports):
    service = start_cluster(kind, aggregators=3, transports=transports)
    master = service.master
    workers, rounds, n = 2, 40, 3000  # 12 KB in parts of 2 KiB: 6 tasks
    migrated_at = 10
    both_past = threading.Barrier(workers, timeout=30)

    def worker(rank):
        agent = pslink.connect("moving", rank, workers, master=service.address, transports=transports,
                               partition_bytes=2048, servers=2, timeout=30)
        try:
            agent.init("w", np.zeros(n, np.float32)).wait()
            out = np.empty(n, np.float32)
            for r in range(1, rounds + 1):
                if r == migrated_at:
                    both_past.wait()
                    if rank == 0:  # every task of the job moves to the idle Aggregator
                        master.migrate(master.tasks_of("moving"), "agg-2", "test")
                agent.pushpull("w", contribution(rank, r, n), out=out).wait()
                np.testing.assert_array_equal(out, contribution(0, r, n) + contribution(1, r, n))
            return agent.key_info("w")["parts"]
        finally:
            agent.close()

    try:
        parts = run_workers(workers, worker)
        assert {p[3] for p in parts[0]} == {"agg-2"} == {p[3] for p in parts[1]}
        wait_until(lambda: master.migrations_done == 6 and master.mover.core.idle(), 20, "migrations to finish")
    finally:
        service.stop()


def test_asp_pushes_and_optimizer_state_survive_a_migration(transports):
    service = start_cluster("tcp", aggregators=2, transports=transports)
    master = service.master
    try:
        with pslink.connect("asp", 0, 1, master=service.address, transports=transports, sync="asp", servers=1) as a:
            a.init("w", np.zeros(4)).wait()
            for _ in range(5):
                a.push("w", np.ones(4)).wait()
            (source,) = {p[3] for p in a.key_info("w")["parts"]}
            target = "agg-1" if source == "agg-0" else "agg-0"
            master.migrate(master.tasks_of("asp"), target)
            for _ in range(5):  # pushes racing the move: each applied exactly once, here or there
                a.push("w", np.ones(4)).wait()
            np.testing.assert_array_equal(a.pull("w").wait(), np.full(4, 10.0))
        settings = {"type": "sgd", "lr": 0.1, "momentum": 0.9}
        with pslink.connect("opt", 0, 1, master=service.address, transports=transports, optimizer=settings,
                            servers=1) as a:
            w0 = np.linspace(-1, 1, 8)
            a.init("w", w0).wait()
            weights = np.empty(8)
            for r in range(6):
                if r == 3:
                    (source,) = {p[3] for p in a.key_info("w")["parts"]}
                    master.migrate(master.tasks_of("opt"), "agg-1" if source == "agg-0" else "agg-0")
                a.pushpull("w", np.full(8, float(r + 1)), out=weights).wait()
            expected, buf = w0.copy(), None
            for r in range(6):
                g = np.full(8, float(r + 1))
                buf = g.copy() if buf is None else 0.9 * buf + g
                expected = expected - 0.1 * buf
            np.testing.assert_allclose(weights, expected, rtol=0, atol=1e-12)  # momentum carried over
    finally:
        service.stop()


def test_throttled_migrations_copy_a_bounded_amount_at_a_time_and_all_complete(transports):
    """Many moves at once: at most max_migration_bytes of task state copies at a time (one task
    always; a job's tasks from one Aggregator to another go in batches of up to that), the rest
    wait queued (and count as in flight), and the result is exact."""
    part_bytes = 2048  # 6000 floats: 12 parts of 2 KiB; momentum doubles the state: 4 KiB a task
    limit = 8192  # two tasks at a time
    n, workers, rounds, migrated_at = 6000, 2, 40, 8
    settings = {"type": "sgd", "lr": 0.01, "momentum": 0.9}

    def train(migrate):
        service = start_cluster("tcp", aggregators=3, transports=transports, max_migration_bytes=limit)
        master = service.master
        peak, seen_queued = [0], [False]
        moves = master.mover.core
        original = moves._start

        def watched(now):
            actions = original(now)
            peak[0] = max(peak[0], moves.copying_bytes())
            # Batches of up to two tasks (4 KiB each): a batch never copies more than the throttle.
            assert all(b.bytes <= limit for b in moves.batches.values())
            if moves.throttled:
                seen_queued[0] = True
                assert all(moves.moving(a.source) for a in moves.throttled.values())
            return actions

        moves._start = watched
        try:
            results = run_workers(workers, moving_worker(service, transports, "throttled", n, part_bytes, rounds,
                                                         migrated_at if migrate else None, settings))
            if migrate:
                wait_until(lambda: master.migrations_done == 12 and master.mover.core.idle(),
                           20, "migrations to finish")
        finally:
            service.stop()
        return results, peak[0], seen_queued[0]

    moved, peak, queued = train(True)
    still, _, _ = train(False)
    assert {p[3] for p in moved[0][1]} == {"agg-2"}
    assert 0 < peak <= limit and queued
    for rank in range(workers):
        assert moved[rank][0].tobytes() == still[rank][0].tobytes()


def test_a_float16_part_with_its_float32_master_copy_migrates_whole(transports):
    """multi_precision keeps a float32 master copy (and float32 momentum) beside a float16 part:
    a copy of frames of two dtypes and sizes, which must land whole (the run equals one that
    never moved)."""
    optimizer = {"type": "sgd", "lr": 0.05, "momentum": 0.9, "multi_precision": True}

    def train(job, move_at):
        service = start_cluster("tcp", aggregators=2, transports=transports)
        master = service.master
        try:
            with pslink.connect(job, 0, 1, master=service.address, transports=transports, optimizer=optimizer,
                                servers=1) as agent:
                agent.init("w", np.linspace(-1, 1, 1000).astype(np.float16)).wait()
                out = np.empty(1000, np.float16)
                for step in range(12):
                    if step == move_at:
                        (source,) = {p[3] for p in agent.key_info("w")["parts"]}
                        master.migrate(master.tasks_of(job), "agg-1" if source == "agg-0" else "agg-0", "test")
                    grad = np.random.default_rng(step).normal(size=1000).astype(np.float16)
                    agent.pushpull("w", grad, out=out).wait()
                moved = {p[3] for p in agent.key_info("w")["parts"]} != {source} if move_at is not None else None
            return out.copy(), moved
        finally:
            service.stop()

    expected, _ = train("still", None)
    got, moved = train("moved", 5)
    assert moved
    np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("relocated", [False, True])
def test_a_moved_reply_from_an_aggregator_the_part_has_left_is_stale(inproc_cluster, relocated):
    """A reply saying "moved to X" redirects the part only while the part is still placed on the
    Aggregator that answered: once it was relocated elsewhere (failover, a newer redirect), the
    old Aggregator's redirect would send it back to a stale place."""
    from pslink.core.agent.requests import Link, PartRequest
    from pslink.core.wire.protocol import Op

    service, transports = inproc_cluster
    with pslink.connect(f"stale-{relocated}", 0, 1, master=service.address, transports=transports) as agent:
        agent.init("w", np.zeros(4, np.float32)).wait()
        info = agent._keys["w"]
        part = info.parts[0]
        answered_by = part.aggregator
        handle = agent._handles.new("pull", ["w"], None, 1)
        link = Link(answered_by, part.address, None, 0.0)
        request = PartRequest(handle, link, 0, None, None, False, Op.PULL, info, part, 0, None, None, 0)
        rid = agent._requests.add(request)
        if relocated:  # relocated while the request was out: where pMaster says it is now
            part.move("agg-elsewhere", "inproc://agg-elsewhere")
        agent.on_message(None, ({"op": Op.REPLY, "id": rid, "rnd": 0, "n": 1,
                                 "moved": ["agg-target", "inproc://agg-target"]}, None, None), [])
        handle.wait(5)
        expected = ("agg-elsewhere", "inproc://agg-elsewhere") if relocated else ("agg-target", "inproc://agg-target")
        assert part.where == expected


def test_a_migrate_order_that_reaches_its_source_late_still_moves_the_parts_pmaster_routes(transports):
    """A partition delays pMaster's MIGRATE beyond its request timeout; TCP delivers it once the
    link heals and the source hands the parts over. pMaster must not have given the move up
    meanwhile (before: "failed to start", the plan went back, the source's table and pMaster's
    disagreed, and a pMaster restart then fenced the parts at the target the workers used)."""
    service = start_cluster("tcp", aggregators=2, transports=transports, assign_timeout=0.2)
    master = service.master
    held = threading.Event()
    workers, n = 2, 3000
    after_move = []  # rounds trained since pMaster counted the moves done

    def next_round():  # (both workers at the barrier) train on until 3 rounds after the moves
        if master.migrations_done == 3:
            after_move.append(1)
    step = threading.Barrier(workers, action=next_round, timeout=30)
    try:
        for agg in service.provider.aggregators.values():
            def late(peer, req, agg=agg, migrate=agg._migrate):
                held.set()  # answered 1 s later: five times pMaster's request timeout
                agg.reactor.call_later(1.0, migrate, peer, req)
            agg._migrate = late

        def worker(rank):
            with pslink.connect("late-order", rank, workers, master=service.address, transports=transports,
                                partition_bytes=4096, servers=1, timeout=30) as agent:
                agent.init("w", np.zeros(n, np.float32)).wait()
                out = np.empty(n, np.float32)
                r = 0
                while len(after_move) < 3:
                    r += 1
                    assert r < 2000, "the moves never finished"
                    step.wait()
                    if r == 5 and rank == 0:
                        (source,) = {p[3] for p in agent.key_info("w")["parts"]}
                        master.migrate(master.tasks_of("late-order"), "agg-1" if source == "agg-0" else "agg-0")
                    agent.pushpull("w", contribution(rank, r, n), out=out).wait()
                    np.testing.assert_array_equal(out, contribution(0, r, n) + contribution(1, r, n))
                step.wait()  # (the job still there: pMaster's table is read before anyone leaves)
                placed = {part.aggregator for part in master.state.jobs["late-order"].keys["w"].parts}
                return {p[3] for p in agent.key_info("w")["parts"]}, placed

        (served, placed), (served_1, _) = run_workers(workers, worker)
        assert held.is_set() and master.mover.core.idle()
        assert len(served) == 1 and served == served_1 == placed  # pMaster routes where the parts are
    finally:
        service.stop()


def test_a_key_whose_assign_was_lost_with_its_connection_is_placed_again(inproc_cluster, monkeypatch):
    """pMaster's connection to an Aggregator broke under the ASSIGN that places a new key (found
    with PSLINK_FAULTS ctl_drop): the key is placed again, not failed to the worker (before: a
    ServiceError 'placing key failed', and the job ended)."""
    from pslink.core.wire.protocol import Op
    from pslink.errors import PeerError

    service, transports = inproc_cluster
    links, cut = service.master.links, []
    broadcast = links.broadcast_each

    def lossy(calls, op, done):
        if op == Op.ASSIGN and len(cut) < 2:  # the first two placements: lost with the connection
            cut.append(op)
            done(PeerError("the connection was cut"))
            return
        broadcast(calls, op, done)

    monkeypatch.setattr(links, "broadcast_each", lossy)
    with pslink.connect("placed-again", 0, 1, master=service.address, transports=transports, timeout=30) as agent:
        agent.init("w", np.ones(4, np.float32)).wait()
        out = np.empty(4, np.float32)
        agent.pushpull("w", np.full(4, 2.0, np.float32), out=out).wait()
    assert len(cut) == 2 and out.tolist() == [2.0] * 4


def test_a_placement_whose_assign_failed_leaves_nothing_on_the_aggregators_that_got_it(inproc_cluster, monkeypatch):
    """Found by the chaos run with control faults: an ASSIGN lost with one Aggregator's
    connection failed the placement, which pMaster forgot and made again (maybe elsewhere), but
    the other Aggregators kept what it gave them (the part, its replica); a later move onto one
    of them then found a stale copy there ("expects no copy") and never ended. Now whoever got
    a failed placement drops it. Here every placement of the key fails that way."""
    from pslink.core.wire.protocol import Op
    from pslink.errors import PeerError, ServiceError
    from tests.integration.test_processes import wait_until

    service, transports = inproc_cluster
    links, cut = service.master.links, []
    broadcast = links.broadcast_each

    def half_lost(calls, op, done):
        if op != Op.ASSIGN:
            broadcast(calls, op, done)
            return
        cut.append(op)  # the first Aggregator's connection breaks; the others get their ASSIGN
        broadcast(calls[1:], op, lambda error: done(PeerError("the connection was cut")))

    def holdings(job):
        held = {}
        for name, aggregator in service.provider.aggregators.items():
            core = aggregator.core
            held[name] = sorted(i for table in (core.tasks, core.replicas) for i in table if i[0] == job)
        return held

    monkeypatch.setattr(links, "broadcast_each", half_lost)
    with pslink.connect("half-placed", 0, 1, master=service.address, transports=transports, timeout=30,
                        replication=1, partition_bytes=64) as agent:
        with pytest.raises(ServiceError, match="placing key 'w' failed"):
            agent.init("w", np.ones(64, np.float32)).wait()
        assert len(cut) == 5  # placed five times, each failed
        # (the drops went out before the last lookup's answer; the Aggregators carry them out on their threads)
        wait_until(lambda: not any(holdings("half-placed").values()), 10, "the Aggregators to drop the placements")


@pytest.mark.parametrize("kind", ["tcp", "inproc"])
def test_a_followed_move_hands_over_without_the_state_and_the_weights_stay_bit_for_bit(kind, transports):
    """Parts large enough to follow (512 KiB): the target gets a seed and each round's sum while
    the job trains, the hand-over carries none of the state, and the weights (momentum SGD) are
    those of a job never moved, bit for bit."""
    from pslink.core.aggregator.moves import MIN_FOLLOW_BYTES

    part_bytes = 2 * MIN_FOLLOW_BYTES
    n, workers, rounds, migrated_at = 4 * part_bytes // 4, 2, 24, 6  # 4 parts
    settings = {"type": "sgd", "lr": 0.01, "momentum": 0.9}

    def train(migrate):
        service = start_cluster(kind, aggregators=3, transports=transports)
        master = service.master
        try:
            results = run_workers(workers, moving_worker(service, transports, "followed", n, part_bytes, rounds,
                                                         migrated_at if migrate else None, settings, keep_up=True))
            if migrate:
                wait_until(lambda: master.migrations_done >= 1 and master.mover.core.idle(), 20, "migrations to finish")
            handed = sum((a.copies.handed_over for a in service.provider.aggregators.values()), Counter())
        finally:
            service.stop()
        return results, handed

    moved, handed = train(True)
    still, _ = train(False)
    assert {p[3] for p in moved[0][1]} == {"agg-2"}
    assert handed == {"follower": 4}  # every part handed over without its state
    for rank in range(workers):
        assert moved[rank][0].tobytes() == still[rank][0].tobytes()


def test_a_worker_told_of_a_move_connects_ahead_with_both_rings_ready(transports):
    """What a reply naming a part's next place (``next``, or ``moved``) makes an Agent do once no
    request is in flight: connect to that Aggregator and have both directions' shared-memory
    rings made before any payload (the Aggregator makes its own on the worker's ``warm`` PING)."""
    service = start_cluster("tcp", aggregators=2, transports=transports)
    agent = pslink.connect("ahead", 0, 1, master=service.address, transports=transports, timeout=30)
    try:
        agent.init("w", np.zeros(1 << 18, np.float32)).wait()
        placed = agent.key_info("w")["parts"][0][3]
        other = next(n for n in service.provider.aggregators if n != placed)
        requests = agent._requests
        requests.warm(other, service.provider.aggregators[other].address)
        assert other in requests.to_warm and other not in requests.links  # nothing yet: a round may be under way
        requests.warm_now()
        wait_until(lambda: other in requests._warmed, 10, "the connection made ahead")
        conn = requests.links[other].conn
        if conn.rings is None or not conn.rings.allowed:
            pytest.skip("this machine's connections have no shared-memory rings (PSLINK_SHM=0, or not Linux)")
        assert conn.rings.out is not None  # this side's ring, made before any payload
        wait_until(lambda: conn.rings.inp is not None, 10, "the Aggregator's ring back")
        requests.warm(other, service.provider.aggregators[other].address)
        assert other not in requests.to_warm  # made ready once
    finally:
        agent.close()
        service.stop()


def test_the_workers_compute_between_exchanges_reaches_the_aggregator_with_their_pushes(inproc_cluster):
    """Where a move's copies go: each push tells how long its worker had no request in flight
    before the exchange (its compute), and a part keeps the shortest of its last round's, from
    which it reckons when the job's whole exchange ends (not only its own part of it)."""
    service, transports = inproc_cluster
    computed = 0.05  # the gap this test makes between two exchanges (a lower bound is checked)
    with pslink.connect("computing", 0, 1, master=service.address, transports=transports, timeout=30) as agent:
        agent.init("w", np.zeros(8, np.float32)).wait()
        out = np.empty(8, np.float32)
        agent.pushpull("w", np.ones(8, np.float32), out=out).wait()
        time.sleep(computed)  # the worker computes
        agent.pushpull("w", np.ones(8, np.float32), out=out).wait()
        tasks = [task for aggregator in service.provider.aggregators.values()
                 for ident, task in list(aggregator.core.tasks.items()) if ident[0] == "computing"]
    assert len(tasks) == 1 and tasks[0].closed == 2
    assert computed <= tasks[0].compute_gap < 10.0
    # (and the round opened when its first push's header was heard: the pace is counted from it)
    assert tasks[0].heard_round == 2 and tasks[0].last_opened == tasks[0].heard_at
