"""Sparse tables on a running service: sync and async rounds against a single-process reference,
bit for bit, through a migration, an Aggregator lost with replication 1, and eviction."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import pslink
from pslink.core.tables import TableShard, table_options
from pslink.core.transport import Transports
from pslink.errors import ConfigError, KeyStateError, ShapeMismatchError
from tests.helpers import run_workers, start_cluster

WIDTH = 8
OPTIONS = dict(shards=3, init=["normal", 0.0, 0.1], seed=5, optimizer={"name": "adam", "lr": 0.01})


@pytest.fixture
def transports():
    t = Transports()
    yield t
    t.close()


def batch(rank: int, step: int, vocabulary: int = 500, n: int = 200):
    """A worker's ids for a step (with repeats, as a minibatch's features have) and gradients."""
    rng = np.random.default_rng(1000 * rank + step)
    ids = (rng.zipf(1.3, n) % vocabulary).astype(np.int64)
    return ids, rng.normal(size=(n, WIDTH)).astype(np.float32)


def reference(workers: int, steps: int, vocabulary: int = 500) -> np.ndarray:
    """The same training in one process: one shard, each round's pushes in rank order."""
    table = TableShard(table_options({"width": WIDTH, **OPTIONS}, "reference"), np.float32)
    for step in range(steps):
        pushes = [batch(rank, step, vocabulary) for rank in range(workers)]
        table.apply(np.concatenate([p[0] for p in pushes]).astype(np.uint64),
                    np.concatenate([p[1] for p in pushes]), contributors=workers)
    return table.read(np.arange(vocabulary, dtype=np.uint64))


def train(service, transports, job, workers, steps, *, at=None, action=None, **options):
    """Each worker pushes its batch and pulls the next batch's rows every step; ``action(rank)``
    runs between steps ``at - 1`` and ``at`` while every worker waits."""
    barrier = threading.Barrier(workers, timeout=30)

    def worker(rank):
        with pslink.connect(job, rank, workers, master=service.address, transports=transports, timeout=30,
                            **options) as agent:
            table = agent.table("emb", WIDTH, **OPTIONS)
            for step in range(steps):
                if step == at:
                    barrier.wait()
                    if rank == 0:
                        action()
                    barrier.wait()
                ids, grads = batch(rank, step)
                table.pull(ids).wait()  # what the forward pass would read
                table.push(ids, grads).wait()
            return table.pull(np.arange(500)).wait(), [p[3] for p in agent.key_info("emb")["parts"]]

    results = run_workers(workers, worker, timeout=120)
    return [rows for rows, _ in results], results[0][1]  # every rank's rows; where the shards ended


@pytest.mark.parametrize("kind,workers", [("inproc", 2), ("tcp", 3)])
def test_synchronous_rounds_equal_a_single_process_reference_bit_for_bit(kind, workers):
    transports = Transports()
    service = start_cluster(kind, aggregators=2, transports=transports)
    try:
        results, _ = train(service, transports, "sync", workers, 12)
    finally:
        service.stop()
        transports.close()
    expected = reference(workers, 12)
    for rows in results:
        np.testing.assert_array_equal(rows, expected)


def test_a_table_migrated_mid_training_loses_nothing(transports):
    service = start_cluster("tcp", aggregators=3, transports=transports)
    master = service.master
    try:
        def move_every_shard():
            tasks = master.tasks_of("moving")
            assert len(tasks) == 3
            master.migrate(tasks, "agg-2", "test")

        results, places = train(service, transports, "moving", 2, 16, at=6, action=move_every_shard, servers=2)
        assert master.migrations_done == 3 and set(places) == {"agg-2"}
    finally:
        service.stop()
    expected = reference(2, 16)
    for rows in results:
        np.testing.assert_array_equal(rows, expected)


def test_an_aggregator_lost_with_replication_1_loses_no_row(transports):
    service = start_cluster("tcp", aggregators=3, transports=transports, control={"profile_iterations": 0})
    lost = []

    def crash_a_shards_aggregator():
        spec = service.master.state.jobs["replicated"].keys["emb"]
        victim = spec.parts[0].aggregator
        lost.append(victim)
        service.provider.aggregators[victim].stop()  # its sockets close, its state is gone

    try:
        results, places = train(service, transports, "replicated", 2, 14, at=7, action=crash_a_shards_aggregator,
                                replication=1)
        assert service.master.failovers_done == 1 and lost[0] not in places
    finally:
        service.stop()
    expected = reference(2, 14)
    for rows in results:
        np.testing.assert_array_equal(rows, expected)


def test_asynchronous_pushes_are_applied_as_they_come(transports):
    service = start_cluster("tcp", aggregators=2, transports=transports)
    try:
        def worker(rank):
            with pslink.connect("async", rank, 2, master=service.address, transports=transports, sync="asp") as a:
                table = a.table("counts", 2, dtype="int64", shards=4)
                for step in range(20):
                    table.push([rank, 7, 7, 1000 + step], np.ones((4, 2), np.int64)).wait()
                a.barrier("pushed")
                return table.pull([0, 1, 7, 1005, 99]).wait()

        for rows in run_workers(2, worker):
            np.testing.assert_array_equal(rows[:, 0], [20, 20, 80, 2, 0])
    finally:
        service.stop()


def test_a_capped_table_evicts_and_the_service_counts_it(transports):
    service = start_cluster("tcp", aggregators=1, transports=transports)
    try:
        with pslink.connect("capped", 0, 1, master=service.address, transports=transports) as a:
            table = a.table("emb", 4, shards=2, capacity=100)
            for start in range(0, 2000, 50):
                table.pull(np.arange(start, start + 50)).wait()
            (aggregator,) = service.provider.aggregators.values()
            stats = aggregator.core.stats()["capped"]
            assert stats["table_rows"] <= 2 * 100
            assert stats["evicted_rows"] == 2000 - stats["table_rows"]
    finally:
        service.stop()


def test_bad_table_requests_get_errors_that_name_what_is_wrong(transports):
    service = start_cluster("inproc", aggregators=1, transports=transports)
    try:
        agents = [pslink.connect("bad", r, 2, master=service.address, transports=transports, timeout=10)
                  for r in range(2)]
        table = agents[0].table("emb", 4, shards=2)
        with pytest.raises(ShapeMismatchError, match=r"take rows of shape \(2, 4\) float32, got \(2, 3\)"):
            table.push([1, 2], np.zeros((2, 3), np.float32))
        with pytest.raises(ConfigError, match="ids must be non-negative, got -3"):
            table.pull([1, -3])
        with pytest.raises(ConfigError, match="rank 1 declares it as .* but rank 0 declared it"):
            agents[1].table("emb", 4, shards=2, optimizer="sgd")
        with pytest.raises(KeyStateError, match="is a table; PULL does not apply"):
            agents[0].pull("emb").wait()
        agents[0].init("dense", np.zeros(4, np.float32)).wait()
        with pytest.raises(ShapeMismatchError, match="'dense' of job 'bad' is shape"):
            agents[0].table("dense", 4)
        for agent in agents:
            agent.close()
    finally:
        service.stop()


def test_a_killed_aggregator_without_replicas_restarts_its_shard_from_the_checkpoint(tmp_path):
    """kill -9 of the Aggregator holding shard 0, no replica: its shards restart from their last
    checkpoint, the workers are told how many rounds were lost, and every row equals a replay that
    skips exactly those rounds on those shards."""
    import os
    import signal

    from pslink.core.service import Service
    from pslink.core.tables import shard_of

    steps, every, kill_at = 30, 5, 17
    reached = threading.Event()
    lost_shards: list = []
    with Service(aggregators=3, control={"profile_iterations": 0}) as service:

        def killer():
            assert reached.wait(60), "rank 0 never reached the step to kill at"
            parts = service.master.state.jobs["ckpt"].keys["emb"].parts
            victim = parts[0].aggregator
            lost_shards.extend(p.part for p in parts if p.aggregator == victim)
            os.kill(service.provider.pid(victim), signal.SIGKILL)

        def worker(rank):
            with pslink.connect("ckpt", rank, 2, master=service.address, timeout=30,
                                checkpoint=str(tmp_path / "ckpt"), checkpoint_every=every) as agent:
                table = agent.table("emb", WIDTH, **OPTIONS)
                for step in range(steps):
                    if rank == 0 and step == kill_at:
                        reached.set()
                    ids, grads = batch(rank, step)
                    # One request per round: resent whole where the shard went, so a round is lost
                    # or applied whole (a push acknowledged by the dead Aggregator before a separate
                    # pull would close its round without that push, as for a straggler).
                    table.pushpull(ids, grads).wait()
                return table.pull(np.arange(500)).wait(), dict(agent.rounds_lost_by_part)

        thread = threading.Thread(target=killer, daemon=True)
        thread.start()
        results = run_workers(2, worker, timeout=120)
        thread.join(10)
        assert service.master.failovers_done == 1
    (rows0, lost0), (rows1, lost1) = results
    assert lost0 == lost1 and {shard for _, shard in lost0} == set(lost_shards), \
        f"the workers were told of lost rounds on shards {sorted(lost0)}, not on {lost_shards}"
    for lost, restored in lost0.values():
        assert restored % every == 0 and restored + lost <= steps
    np.testing.assert_array_equal(rows0, rows1)
    # The replay, shard by shard: round r is step r - 1; a lost shard never applied steps
    # restored .. restored + lost - 1 (each shard from its own checkpoint's round).
    shards = [TableShard(table_options({"width": WIDTH, **OPTIONS}, "replay"), np.float32) for _ in range(3)]
    for step in range(steps):
        pushes = [batch(rank, step) for rank in range(2)]
        ids = np.concatenate([p[0] for p in pushes]).astype(np.uint64)
        grads = np.concatenate([p[1] for p in pushes])
        where = shard_of(ids, 3)
        for s, shard in enumerate(shards):
            lost, restored = lost0.get(("emb", s), (0, 0))
            if restored <= step < restored + lost:
                continue
            shard.apply(ids[where == s], grads[where == s], contributors=2)
    every_id = np.arange(500, dtype=np.uint64)
    where = shard_of(every_id, 3)
    expected = np.empty((500, WIDTH), np.float32)
    for s, shard in enumerate(shards):
        expected[where == s] = shard.read(every_id[where == s])
    np.testing.assert_array_equal(rows0, expected)
