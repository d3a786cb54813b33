"""An end of a live migration dies (SIGKILL) while task state is being copied.

A replicated job (replication 1) trains in BSP with two workers on a service of Aggregator
processes; its tasks (all on agg-0, their replicas on agg-1 and agg-2) move to an Aggregator added
for them, all at once or throttled (a few tasks' state in flight at a time). Either the new
Aggregator kills itself (``PSLINK_FAULTS kill=NAME@N``) while the copies are in flight, or the
source does, as it is about to send its first copy (``kill=agg-0@copy``): it handed the part
over, and the workers were told to go to the target. The job must fail over and train on, within
bounded pauses, to the weights of a run without the migration: bit for bit, as replication 1
promises. Every wait has a deadline; every process is reaped (the service stops them).
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

import pslink
from pslink.core.service import Service
from pslink.errors import KeyStateError
from tests.helpers import run_workers
from tests.integration.test_processes import wait_until

pytestmark = pytest.mark.integration

OPTIMIZER = {"type": "sgd", "lr": 0.01, "momentum": 0.9}
KEYS = [0, 1, 2]  # 3000 floats each, in 4 KiB partitions: 3 parts a key, 9 tasks
TASK_BYTES = 2 * 4096  # what moving one part copies: its weights and momentum
STEPS, MIGRATE_AT = 40, 10


# Parts a move's target follows before the hand-over (MIN_FOLLOW_BYTES and up): one part of
# 256 KiB a key (512 KiB of state with momentum), 3 tasks.
FOLLOWED = {"floats": 1 << 16, "partition_bytes": 1 << 18}


def gradient(rank: int, step: int, key: int, floats: int = 3000) -> np.ndarray:
    return np.random.default_rng(1000 * step + 10 * key + rank).standard_normal(floats).astype(np.float32)


def train(job: str, *, max_migration_bytes: int | None = None, migrate: bool = False, log_dir=None,
          watch: tuple[str, ...] = (), floats: int = 3000, partition_bytes: int = 4096):
    """Two workers (threads of this process, real sockets) on 3 Aggregator processes, momentum SGD
    on the service, replication 1. With ``migrate``: before step ``MIGRATE_AT`` a fourth
    Aggregator is added and every task of the job is moved to it, while both train on. Returns
    each rank's final weights, rank 0's step end times, pMaster's counts (failovers, copies asked
    of a replica, the Aggregators the moves left) and how the added Aggregator and those in
    ``watch`` ended."""
    options = {"max_migration_bytes": max_migration_bytes} if max_migration_bytes else None
    with Service(aggregators=1, control={"profile_iterations": 0}, master_options=options,
                 log_dir=str(log_dir) if log_dir else None) as service:
        # agg-0 registers first: best fit places every part there (the others take replicas).
        service.add_aggregators(2)
        master = service.master
        barrier = threading.Barrier(2, timeout=60)
        added: list[str] = []
        sources: set[str] = set()

        def worker(rank):
            ends = []
            with pslink.connect(job, rank, 2, master=service.address, optimizer=OPTIMIZER,
                                partition_bytes=partition_bytes, replication=1, timeout=30) as agent:
                agent.init_many(KEYS, [np.linspace(-1, 1, floats, dtype=np.float32) * (k + 1) for k in KEYS]).wait()
                for step in range(STEPS):
                    if migrate and step == MIGRATE_AT:
                        barrier.wait()
                        if rank == 0:
                            record = master.state.jobs[job]  # settled: both ranks wait at the barrier
                            sources.update(p.aggregator for spec in record.keys.values() for p in spec.parts)
                            added.extend(service.add_aggregators(1))
                            master.migrate(master.tasks_of(job), added[0], "test")
                        barrier.wait()
                    outs = agent.pushpull_many(KEYS, [gradient(rank, step, k, floats) for k in KEYS]).wait()
                    ends.append(time.monotonic())
                return [o.copy() for o in outs], ends

        results = run_workers(2, worker, timeout=180)
        if migrate:
            # A failover (or an abandoned move) may settle after the last step: wait for it, bounded.
            wait_until(lambda: master.failovers_done and master.mover.core.idle(),
                       30, "pMaster's failover of the migration target")
        status = {n: service.provider.diagnose(n).splitlines()[0] for n in [*watch, *added]}
        counts = {"failovers": master.failovers_done, "copies_resourced": master.failover.copies_resourced,
                  "sources": sources}
        return [r[0] for r in results], results[0][1], counts, status


def assert_trained_as_without_the_move(got, ends, expected, what: str) -> None:
    """Every rank's weights are those of the training without the migration, bit for bit, and the
    training went on (a bound that only catches a stall: the workers' own timeout is 30 s)."""
    for rank in (0, 1):
        for key in KEYS:
            np.testing.assert_array_equal(got[rank][key], expected[rank][key])
    pause = max(b - a for a, b in zip(ends, ends[1:]))
    assert pause < 10.0, f"training stopped for {pause:.1f} s after {what}"


@pytest.fixture(scope="module")
def expected():
    """The weights of the same training without a migration or a kill."""
    return train("clean")[0]


@pytest.mark.parametrize("throttle", [None, TASK_BYTES * 2], ids=["all-at-once", "throttled"])
@pytest.mark.parametrize("kill_at", [1, 3])
def test_the_migration_target_killed_mid_copy_changes_nothing(monkeypatch, tmp_path, expected, throttle, kill_at):
    """Throttled, two tasks' state copies at a time: the first moves may have landed (their parts
    fail over to a replica), those in flight stay on their source (which may still be serving
    them), the queued ones never leave it."""
    # Only the Aggregator added for the migration (the fourth: agg-3) dies, as it sends its
    # kill_at-th data-path message: 1 is its answer to the first TENSOR_COPY (installed, not acknowledged).
    monkeypatch.setenv("PSLINK_FAULTS", f"kill=agg-3@{kill_at}")
    got, ends, counts, status = train("moved", max_migration_bytes=throttle, migrate=True,
                                      log_dir=tmp_path / "logs")
    assert status == {"agg-3": "agg-3: exited with status -9"}, status
    assert counts["failovers"] == 1
    assert_trained_as_without_the_move(got, ends, expected, "the migration target was killed")


@pytest.fixture(scope="module")
def expected_followed():
    """The weights of the training of parts large enough to be followed, without a migration."""
    return train("clean", **FOLLOWED)[0]


@pytest.mark.parametrize("kill_at", [1, 4])
def test_the_migration_target_killed_while_it_follows_changes_nothing(monkeypatch, tmp_path, expected_followed,
                                                                       kill_at):
    """Parts large enough to be followed: the target dies as it confirms a seed (1: the first),
    or later (4: a seed or round after). A part not handed over yet stays with its source, which
    stops following when pMaster calls the move off; one handed over fails over to its replica.
    The weights are those of a job never moved, bit for bit."""
    monkeypatch.setenv("PSLINK_FAULTS", f"kill=agg-3@{kill_at}")
    got, ends, counts, status = train("moved", migrate=True, log_dir=tmp_path / "logs", **FOLLOWED)
    assert status == {"agg-3": "agg-3: exited with status -9"}, status
    assert counts["failovers"] == 1
    assert_trained_as_without_the_move(got, ends, expected_followed, "the migration target was killed")


def test_the_migration_source_killed_at_its_hand_over_to_a_follower_changes_nothing(monkeypatch, tmp_path,
                                                                                      expected_followed):
    """The target followed the parts (seed, rounds); agg-0 dies as it sends the hand-over (the
    workers were told to go to agg-3). The replica's state (every round agg-0 acknowledged)
    replaces what the target followed, which may hold a round agg-0 closed and never answered:
    the weights are those of a job never moved, bit for bit."""
    monkeypatch.setenv("PSLINK_FAULTS", "kill=agg-0@copy")
    got, ends, counts, status = train("moved", migrate=True, log_dir=tmp_path / "logs", watch=("agg-0",),
                                      **FOLLOWED)
    assert status == {"agg-0": "agg-0: exited with status -9", "agg-3": "agg-3: running"}, status
    assert counts["failovers"] == 1 and counts["copies_resourced"] >= 1
    assert_trained_as_without_the_move(got, ends, expected_followed, "the migration source was killed")


@pytest.mark.parametrize("throttle", [None, TASK_BYTES * 2], ids=["all-at-once", "throttled"])
def test_the_migration_source_killed_after_handing_a_part_over_changes_nothing(monkeypatch, tmp_path, expected,
                                                                                throttle):
    """agg-0 took the MIGRATE of its parts, and the first round to close froze a part for its
    copy and told the workers to go to agg-3; agg-0 dies before a byte of the copy leaves. The
    workers' requests wait at agg-3 for a copy that will never come from agg-0: pMaster has the
    part's replica (every round agg-0 acknowledged) sent to agg-3 as the copy, and the move goes
    on. Throttled, the moves still queued never leave agg-0: those parts fail over to their
    replicas."""
    monkeypatch.setenv("PSLINK_FAULTS", "kill=agg-0@copy")
    got, ends, counts, status = train("moved", max_migration_bytes=throttle, migrate=True,
                                      log_dir=tmp_path / "logs", watch=("agg-0",))
    assert counts["sources"] == {"agg-0"}
    assert status == {"agg-0": "agg-0: exited with status -9", "agg-3": "agg-3: running"}, status
    assert counts["failovers"] == 1
    assert counts["copies_resourced"] >= 1  # the case under test happened: a replica sent a copy
    assert_trained_as_without_the_move(got, ends, expected, "the migration source was killed")


def test_without_a_replica_the_migration_source_killed_after_handing_a_part_over_fails_the_job_loudly(
        monkeypatch, tmp_path):
    """As above with replication 0: no Aggregator has the state the copy carried. Every worker
    gets an error naming the job, the key, the part and the lost Aggregator, promptly (their
    own timeout, 30 s, would mean a hang)."""
    monkeypatch.setenv("PSLINK_FAULTS", "kill=agg-0@copy")
    with Service(aggregators=1, control={"profile_iterations": 0}, log_dir=str(tmp_path / "logs")) as service:
        master = service.master
        barrier = threading.Barrier(2, timeout=60)

        def worker(rank):
            with pslink.connect("lost", rank, 2, master=service.address, optimizer=OPTIMIZER, partition_bytes=4096,
                                replication=0, timeout=30) as agent:
                agent.init_many(KEYS, [np.zeros(3000, dtype=np.float32) for _ in KEYS]).wait()
                for step in range(STEPS):
                    if step == MIGRATE_AT:
                        barrier.wait()
                        if rank == 0:
                            (target,) = service.add_aggregators(1)
                            master.migrate(master.tasks_of("lost"), target, "test")
                        barrier.wait()
                    started = time.monotonic()
                    try:
                        agent.pushpull_many(KEYS, [gradient(rank, step, k) for k in KEYS]).wait()
                    except KeyStateError as exc:
                        return exc, time.monotonic() - started
            return None, 0.0

        results = run_workers(2, worker, timeout=120)
        status = service.provider.diagnose("agg-0").splitlines()[0]
    assert status == "agg-0: exited with status -9", status
    for error, waited in results:
        assert error is not None, "training went on without the state the lost Aggregator held"
        message = str(error)
        assert "job 'lost'" in message and "aggregator agg-0 is gone" in message, message
        assert "replication" in message and "part" in message, message
        assert waited < 10.0, f"the error came after {waited:.1f} s"
