"""Groups with delayed global sync (pslink.core.worker.groups, dSyncPS): 2 groups of 2 workers on
threads, each group its own job on the pool, the groups' leaders a global job."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import pslink
from pslink.core.worker.groups import GroupSync
from tests.helpers import DelayRelay, run_workers


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


def grouped_sgd_reference(steps: int, every: int, founders: dict, moves: list) -> dict[int, np.ndarray]:
    """The weights each group's workers should end with: plain SGD (lr 1/2) averaged within each
    group every step and over the groups every ``every`` steps, ``moves`` being (worker, left
    after step, target, in from the step after ``entered``)."""
    members = {group: list(ranks) for group, ranks in founders.items()}
    weights = {group: np.full(50, 0.5, np.float32) for group in members}
    for step in range(1, steps + 1):
        for group, ranks in members.items():
            total = np.zeros(50, np.float32)
            for rank in ranks:
                total += exact_gradient(rank, step)
            weights[group] -= np.float32(0.5) * (total / np.float32(len(ranks)))
        if step % every == 0:
            mean = sum(weights.values()) / np.float32(len(weights))
            weights = {group: mean.copy() for group in weights}
        for worker, left, target, entered in moves:
            if step == left:
                members[[g for g, ranks in members.items() if worker in ranks][0]].remove(worker)
            if step == entered:
                members[target].append(worker)
    return weights


def test_a_founding_group_that_announces_itself_late_is_not_taken_for_a_new_one(cluster, tmp_path):
    # Group 1's leader comes to the store only after group 0's leader first listed its members:
    # the first sync waits for it (a founder), and from then on it is no newcomer, so group 0's
    # syncs stay on the common schedule (they went a step ahead, as for a group that joins, and
    # the groups averaged different steps: found by the suite on a loaded machine).
    service, transports = cluster
    job, steps, every = "late-bonjour", 6, 2
    listed = threading.Event()

    def worker(group):
        agent = connect(service, transports, f"{job}.g{group}", 0, 1)
        if group == 1:
            assert listed.wait(30), "group 0's leader never listed the groups"
        groups = GroupSync(agent, job, group, 2, every, store=str(tmp_path))
        if group == 0:
            listed.set()
        try:
            w = np.full(50, 0.5, np.float32)
            agent.init("w", w).wait()
            while groups.steps < steps:
                g = exact_gradient(group, groups.steps + 1)
                agent.pushpull("w", g, g, average=True).wait()
                w -= np.float32(0.5) * g
                groups.step({"w": w})
            return groups.moves, w
        finally:
            groups.close()
            agent.close()

    results = run_workers(2, worker)
    assert [moves for moves, _ in results] == [[], []]
    expected = grouped_sgd_reference(steps, every, {0: [0], 1: [1]}, [])
    for group, (_, w) in enumerate(results):
        np.testing.assert_array_equal(w, expected[group], err_msg=f"group {group}")


@pytest.mark.parametrize("meeting", ["pool", "store"])
def test_a_worker_moves_to_the_lighter_group_and_loses_no_round(cluster, meeting, tmp_path):
    # Groups of 3 and 1 workers, one service (equal RTTs): at the first sync (step 2) group 0's
    # highest rank finds group 1 with it 2 workers against 3 (more than 20% lighter) and moves:
    # it leaves group 0, comes into group 1 at whatever step group 1 is at, with its weights.
    # Then 2 and 2: nobody moves again. Every worker ends with the weights of plain SGD
    # with those memberships, step for step (no round of either group lost or doubled).
    from pslink.core.worker.group_choice import GroupChoice

    service, transports = cluster
    job, steps, every = f"moving-{meeting}", 12, 2
    founders = {0: [0, 1, 2], 1: [3]}
    store = str(tmp_path) if meeting == "store" else None
    histories: dict[int, list] = {}

    def agent_of(group: int, world_rank: int):
        size = len(founders[group])
        own = founders[group].index(world_rank) if world_rank in founders[group] else size + world_rank
        return connect(service, transports, f"{job}.g{group}", own, size, max_workers=size + 4)

    def worker(world_rank):
        group = 0 if world_rank < 3 else 1
        groups = GroupSync(agent_of(group, world_rank), job, group, 2, every, store=store, choice=GroupChoice(),
                           connect=lambda target: agent_of(target, world_rank))
        history = histories[world_rank] = []
        try:
            w = np.full(50, 0.5, np.float32)
            groups.agent.init("w", w).wait()
            while groups.steps < steps:
                g = exact_gradient(world_rank, groups.steps + 1)
                groups.agent.pushpull("w", g, g, average=True).wait()
                w -= np.float32(0.5) * g
                groups.step({"w": w})
                history.append((groups.group, groups.steps, w.copy()))
            return groups.moves, groups.group, w
        finally:
            groups.close()
            groups.agent.close()

    results = run_workers(4, worker)
    moved = [(rank, moves) for rank, (moves, _, _) in enumerate(results) if any(m[0] == "moved" for m in moves)]
    assert [(rank, [m[:2] for m in moves]) for rank, moves in moved] == [(2, [("moved", 1)])], moved
    assert [group for _, group, _ in results] == [0, 0, 1, 1]
    left = moved[0][1][0][2]
    assert left == 2
    entered = next(step for group, step, _ in histories[2] if group == 1)  # (group 1's step when it came in)
    assert entered >= left
    # From its first step in group 1 on, the mover's weights are group 1's leader's, step by step.
    leader = {step: w for _, step, w in histories[3]}
    for group, step, w in histories[2]:
        if group == 1:
            np.testing.assert_array_equal(w, leader[step])
    expected = grouped_sgd_reference(steps, every, founders, [(2, left, 1, entered)])
    for rank, (_, group, w) in enumerate(results):
        np.testing.assert_array_equal(w, expected[group], err_msg=f"worker {rank} (group {group})")


def test_the_rtt_to_a_service_is_measured_through_its_link(cluster):
    from pslink.core.worker.group_choice import probe_rtt

    service, transports = cluster
    relay = DelayRelay(service.address, 0.030)
    try:
        near, far = probe_rtt(service.address), probe_rtt(relay.address)
    finally:
        relay.close()
    assert near < 0.020 <= 0.030 <= far < 1.0, (near, far)


@pytest.mark.parametrize("far_group, mover", [(1, None), (0, 1)])
def test_a_far_group_weighs_as_its_rtt_says(cluster, far_group, mover):
    # Group `far_group`'s service is reached through a link with a 30 ms round trip, the other's
    # directly (under the 1 ms floor). Groups of 3 (group 0) and 1, group 1 far: moving would
    # lighten the load 3 -> 2 but cost 30x the RTT: nobody moves. Groups of 2 and 2, group 0
    # far: its highest rank moves to the near group though it then has 3 workers.
    from pslink.core.worker.group_choice import GroupChoice

    service, transports = cluster
    job = f"far-{far_group}"
    founders = {0: [0, 1, 2], 1: [3]} if far_group == 1 else {0: [0, 1], 1: [2, 3]}
    relay = DelayRelay(service.address, 0.030)
    sites = {far_group: relay.address, 1 - far_group: service.address}

    def agent_of(group: int, world_rank: int):
        size = len(founders[group])
        own = founders[group].index(world_rank) if world_rank in founders[group] else size + world_rank
        return connect(service, transports, f"{job}.g{group}", own, size, max_workers=size + 4)

    def worker(world_rank):
        group = next(g for g, ranks in founders.items() if world_rank in ranks)
        groups = GroupSync(agent_of(group, world_rank), job, group, 2, 2, choice=GroupChoice(), sites=sites,
                           connect=lambda target: agent_of(target, world_rank))
        try:
            w = np.full(4, 0.5, np.float32)
            groups.agent.init("w", w).wait()
            while groups.steps < 6:
                g = np.full(4, 0.25, np.float32)
                groups.agent.pushpull("w", g, g, average=True).wait()
                w -= g
                groups.step({"w": w})
            return [m[:2] for m in groups.moves if m[0] == "moved"], groups.sizes, w
        finally:
            groups.close()
            groups.agent.close()

    try:
        results = run_workers(4, worker)
    finally:
        relay.close()
    moved = {rank: moves for rank, (moves, _, _) in enumerate(results) if moves}
    assert moved == ({} if mover is None else {mover: [("moved", 1)]})
    assert results[0][1] == ({0: 3, 1: 1} if mover is None else {0: 1, 1: 3})  # as the last sync told
    for _, _, w in results:
        np.testing.assert_array_equal(w, np.full(4, -1.0, np.float32))


def test_groups_by_label_take_any_ranks_and_sizes(cluster):
    # Labels "b", "a", "b", "a": group 0 is "b" (rank 0's), ranks 0 and 2; group 1 "a". With
    # T = 1 the groups of equal size give the flat job's weights. Then 3 "x" and 1 "y": the
    # group sizes follow the labels.
    service, transports = cluster
    flat = sgd(service, transports, "flat-labels", 6, None)

    def worker(index, job, labels, steps):
        agent = connect(service, transports, job, index, 4, sync="local:1", sync_group=labels[index])
        try:
            w = np.full(50, 0.5, np.float32)
            agent.init("w", w).wait()
            for step in range(steps):
                g = exact_gradient(index, step)
                agent.pushpull("w", g, g, average=True).wait()
                w -= np.float32(0.5) * g
                agent.end_step({"w": w})
            return (agent.group, agent.rank, agent.num_workers, agent.world_rank), w
        finally:
            agent.close()

    results = run_workers(4, lambda i: worker(i, "labelled", "baba", 6))
    assert [seat for seat, _ in results] == [(0, 0, 2, 0), (1, 0, 2, 1), (0, 1, 2, 2), (1, 1, 2, 3)]
    for a, (_, b) in zip(flat, results):
        np.testing.assert_array_equal(a, b)
    results = run_workers(4, lambda i: worker(i, "uneven-labels", "xxxy", 2))
    assert [seat for seat, _ in results] == [(0, 0, 3, 0), (0, 1, 3, 1), (0, 2, 3, 2), (1, 0, 1, 3)]
    for _, w in results[1:]:
        np.testing.assert_array_equal(w, results[0][1])
