"""set_optimizer after init, as MXNet's dist_sync takes it: bit for bit against MXNet's own store.

MXNet's nightly ``dist_sync_kvstore.py`` inits keys, then sets an optimizer on the servers; its
servers sum until then (a pull returns the round's sum) and from then on step the stored value as
the weights. Here 2 workers train ``mxnet_switch_worker.train`` (dense float32, float16 with
multi_precision, a row-sparse key; 3 summed rounds, then the optimizer) on pslink, where after
the switch every part of the job migrates to another Aggregator and then the busiest Aggregator
is lost (replication 1). With the nightly test's own optimizer every pull of every round is the
same bits as on MXNet's own dist_sync (a scheduler, a server and 2 worker processes, in the same
test); with SGD with momentum (whose fused kernel MXNet rounds otherwise than numpy), the same
bits as pslink undisturbed, and MXNet's within float32 rounding.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

mx = pytest.importorskip("mxnet", reason="MXNet 1.9.1 is not installed (CI installs it: pip install '.[mxnet]')")

import pslink  # noqa: E402
from pslink.core.transport import Transports  # noqa: E402
from pslink.mxnet import PSLinkKVStore  # noqa: E402
from tests.helpers import run_workers, start_cluster  # noqa: E402
from tests.mxnet import mxnet_switch_worker as training  # noqa: E402
from tests.mxnet.mxnet_native import run_dist_sync  # noqa: E402

pytestmark = pytest.mark.integration

MIGRATE_AT, LOSE_AT = 2, 5  # steps after the switch


def wait_until(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def busiest(service, job: str) -> str:
    counts: dict[str, int] = {}
    for spec in service.master.state.jobs[job].keys.values():
        for part in spec.parts:
            counts[part.aggregator] = counts.get(part.aggregator, 0) + 1
    return max(counts, key=counts.get)


def train_on_pslink(job: str, optimizer: str, disturb: bool) -> tuple[list[dict], dict]:
    transports = Transports()
    service = start_cluster("tcp", aggregators=3, transports=transports, control={"profile_iterations": 0})
    master = service.master
    both = threading.Barrier(2, timeout=60)
    seen: dict = {}

    def between(rank: int, step: int) -> None:
        if not disturb or step not in (MIGRATE_AT, LOSE_AT):
            return
        both.wait()
        if rank == 0 and step == MIGRATE_AT:
            # Every part goes to the Aggregator that serves the fewest: the copies carry the
            # momentum, the float32 master copies and the switch round with the weights.
            tasks = master.tasks_of(job)
            target = min(service.provider.aggregators, key=lambda n: sum(
                1 for _, key, part in tasks
                for p in master.state.jobs[job].keys[key].parts if p.part == part and p.aggregator == n))
            moving = [t for t in tasks if any(p.part == t[2] and p.aggregator != target
                                              for p in master.state.jobs[job].keys[t[1]].parts)]
            seen["moving"], seen["done"] = len(moving), master.migrations_done
            master.migrate(moving, target, "test")  # each moves when its current round closes
        elif rank == 0:
            # The moves of MIGRATE_AT ended (the rounds since closed on the targets).
            wait_until(lambda: master.migrations_done >= seen["done"] + seen["moving"] and master.mover.core.idle(),
                       30, "the migrations")
            seen["migrated"] = master.migrations_done - seen["done"]
            victim = busiest(service, job)
            service.provider.aggregators[victim].stop()  # as if it crashed: its state is gone
            seen["lost"] = victim
        both.wait()

    def worker(rank: int) -> dict:
        agent = pslink.connect(job, rank, 2, master=service.address, transports=transports, partition_bytes=1024,
                               replication=1, timeout=30)
        store = PSLinkKVStore(agent=agent)
        try:
            return training.train(store, rank, optimizer, lambda step: between(rank, step))
        finally:
            store.close()
            agent.close()

    try:
        results = run_workers(2, worker, timeout=150)
        if disturb:
            wait_until(lambda: master.failovers_done >= 1, 20, "the failover")
        return results, seen
    finally:
        service.stop()
        transports.close()


def native_dist_sync(tmp_path, optimizer: str) -> list[dict]:
    run_dist_sync(training.__file__, ["dist_sync", tmp_path, optimizer], workers=2)
    return [dict(np.load(tmp_path / f"{rank}.npz")) for rank in (0, 1)]


def assert_same(ours: list[dict], theirs: list[dict], exact: bool = True) -> None:
    for rank in (0, 1):
        assert sorted(ours[rank]) == sorted(theirs[rank])
        for name, want in theirs[rank].items():
            got = ours[rank][name]
            assert got.dtype == want.dtype, name
            if exact:
                np.testing.assert_array_equal(got, want, err_msg=f"rank {rank}, {name}")
            else:  # the float16 weights: one float16 step of rounding (MXNet's SGD kernel, numpy's)
                np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64),
                                           rtol=1e-5 if got.dtype == np.float32 else 2e-3, atol=1e-6,
                                           err_msg=f"rank {rank}, {name}")


def test_set_after_init_trains_as_mxnets_dist_sync_bit_for_bit_through_a_migration_and_a_failover(tmp_path):
    native = native_dist_sync(tmp_path, "test")
    ours, seen = train_on_pslink("switch-test", "test", disturb=True)
    assert seen["migrated"] > 0 and seen["lost"]
    assert_same(ours, native)
    # The switch happened where MXNet's did: the last round before it is a sum, the next a step.
    shape, dtype = training.DENSE["w32"]
    last = training.SUM_ROUNDS - 1
    np.testing.assert_array_equal(ours[0][f"sum{last}-w32"], sum(training.gradient(r, last, shape, dtype)
                                                                   for r in (0, 1)))
    step = sum(training.gradient(r, 0, shape, dtype) for r in (0, 1))
    np.testing.assert_array_equal(ours[0]["step0-w32"], ours[0][f"sum{last}-w32"] + step * np.float32(0.5))


def test_set_after_init_with_momentum_survives_a_migration_and_a_failover_bit_for_bit(tmp_path):
    undisturbed, _ = train_on_pslink("switch-sgd-calm", "sgd", disturb=False)
    ours, seen = train_on_pslink("switch-sgd", "sgd", disturb=True)
    assert seen["migrated"] > 0 and seen["lost"]
    assert_same(ours, undisturbed)
    assert_same(ours, native_dist_sync(tmp_path, "sgd"), exact=False)
