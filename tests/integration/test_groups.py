"""Groups with delayed global sync (pslink.core.groups, dSyncPS): 2 groups of 2 workers on
threads, each group its own job on the pool, the groups' leaders a global job."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import pslink
from pslink.core.groups import GroupSync
from tests.helpers import run_workers


@pytest.fixture(scope="module")
def cluster(tcp_cluster):
    return tcp_cluster


def connect(service, transports, job, rank, workers, **options):
    return pslink.connect(job, rank, workers, master=service.address, transports=transports, timeout=30.0,
                          **options)


def exact_gradient(worker: int, step: int) -> np.ndarray:
    rng = np.random.default_rng([worker, step])
    return (rng.integers(-64, 64, 50) / 64).astype(np.float32)


def sgd(service, transports, job: str, steps: int, every: int | None, store: str | None = None) -> list[np.ndarray]:
    """4 workers of plain SGD (lr 1/2), flat or as 2 groups of 2 syncing every ``every`` steps
    (through the pool, or ``store``)."""

    def worker(index):
        group, rank = divmod(index, 2) if every else (0, index)
        agent = connect(service, transports, f"{job}.g{group}" if every else job, rank, 2 if every else 4)
        groups = GroupSync(agent, job, group, 2, every, store=store) if every else None
        try:
            w = np.full(50, 0.5, np.float32)
            agent.init("w", w).wait()
            for step in range(steps):
                g = exact_gradient(index, step)
                agent.pushpull("w", g, g, average=True).wait()
                w -= np.float32(0.5) * g
                if groups is not None:
                    groups.step({"w": w})
            return w
        finally:
            if groups is not None:
                groups.close()
            agent.close()

    return run_workers(4, worker)


@pytest.mark.parametrize("meeting", ["pool", "store"])
def test_groups_that_sync_every_step_train_as_one_flat_bsp_job(cluster, meeting, tmp_path):
    service, transports = cluster
    store = str(tmp_path / "store") if meeting == "store" else None
    flat = sgd(service, transports, f"flat-sgd-{meeting}", 6, None)
    grouped = sgd(service, transports, f"grouped-sgd-{meeting}", 6, 1, store=store)
    for a, b in zip(flat, grouped):
        np.testing.assert_array_equal(a, b)


def test_groups_syncing_every_five_steps_reach_the_flat_accuracy_on_digits(cluster):
    pytest.importorskip("sklearn", reason="the digits data set ships with scikit-learn (CI installs it)")
    from pslink.demo.digits import train

    service, transports = cluster

    def flat(rank):
        with connect(service, transports, "digits-flat", rank, 4) as agent:
            return train(agent, epochs=6, progress=False)

    def grouped(index):
        group, rank = divmod(index, 2)
        with connect(service, transports, f"digits-local.g{group}", rank, 2) as agent:
            groups = GroupSync(agent, "digits-local", group, 2, every=5)
            try:
                result = train(agent, epochs=6, progress=False, groups=groups, shard=(index, 4))
            finally:
                groups.close()
            return result, groups.syncs

    flat_accuracy = run_workers(4, flat, timeout=240)[0]["accuracy"]
    results = run_workers(4, grouped, timeout=240)
    assert all(syncs == results[0][1] > 0 for _, syncs in results), [(r["accuracy"], s) for r, s in results]
    for result, _ in results:
        assert result["accuracy"] >= flat_accuracy - 0.01, (result["accuracy"], flat_accuracy)


@pytest.mark.parametrize("meeting", ["pool", "store"])
def test_a_group_that_joins_mid_period_syncs_at_once_and_the_others_advance_to_it(cluster, meeting, tmp_path):
    # Group 0 syncs every 5 steps; after its 7th step group 1 comes. Group 0's leader sees it
    # at the end of step 8: the 2nd sync, due at step 10, is advanced to step 8; group 1's first
    # step syncs with it (it starts from group 0's weights); the period counts from there.
    service, transports = cluster
    came = threading.Event()
    at_seven = threading.Barrier(4)  # group 0 after its 7th step, group 1 before it starts
    syncs: dict[int, list[int]] = {}
    moves = {}

    def worker(index):
        group, rank = divmod(index, 2)
        if group == 1:
            at_seven.wait(30)
        agent = connect(service, transports, f"joining-{meeting}.g{group}", rank, 2)
        groups = GroupSync(agent, f"joining-{meeting}", group, 1, every=5, max_groups=2,
                           store=str(tmp_path) if meeting == "store" else None)
        try:
            if group == 1 and rank == 0:
                came.set()
            w = np.full(8, float(group), np.float32)
            agent.init("w", w).wait()
            steps = 13 if group == 0 else 6
            for step in range(1, steps + 1):
                g = np.full(8, 1.0, np.float32)
                agent.pushpull("w", g, g, average=True).wait()
                w -= np.float32(0.25) * g
                if groups.step({"w": w}):
                    syncs.setdefault(index, []).append(step)
                if group == 0 and step == 7:
                    at_seven.wait(30)
                    assert came.wait(30)
            moves[index] = groups.moves
            return w
        finally:
            groups.close()
            agent.close()

    weights = run_workers(4, worker)
    assert syncs[0] == syncs[1] == [5, 8, 13] and syncs[2] == syncs[3] == [1, 6]
    assert moves[0] == [("advance", 2, 8)]
    for w in weights[1:]:
        np.testing.assert_array_equal(w, weights[0])


@pytest.mark.parametrize("meeting", ["pool", "store"])
def test_a_group_that_leaves_does_not_stop_the_others(cluster, meeting, tmp_path):
    # Both groups sync at step 5; group 1 then stops. Group 0 goes on to step 15, its syncs at
    # 10 and 15 with itself alone: its weights are its own.
    service, transports = cluster
    syncs: dict[int, list[int]] = {}

    def worker(index):
        group, rank = divmod(index, 2)
        agent = connect(service, transports, f"leaving-{meeting}.g{group}", rank, 2)
        groups = GroupSync(agent, f"leaving-{meeting}", group, 2, every=5,
                           store=str(tmp_path) if meeting == "store" else None)
        try:
            w = np.zeros(4, np.float32)
            agent.init("w", w).wait()
            for step in range(1, (15 if group == 0 else 5) + 1):
                g = np.full(4, float(group + 1), np.float32)
                agent.pushpull("w", g, g, average=True).wait()
                w -= g
                if groups.step({"w": w}):
                    syncs.setdefault(index, []).append(step)
            return w
        finally:
            groups.close()
            agent.close()

    weights = run_workers(4, worker)
    assert syncs[0] == [5, 10, 15] and syncs[2] == [5]
    np.testing.assert_array_equal(weights[2], np.full(4, -7.5, np.float32))  # (-5 + -10) / 2
    np.testing.assert_array_equal(weights[0], np.full(4, -17.5, np.float32))  # then 10 steps alone
