"""Deleting keys (``Agent.delete``): their parts and replicas go from every Aggregator and from
pMaster's state, what waits on them fails, the other keys go on, and the memory returns."""

from __future__ import annotations

import numpy as np
import psutil
import pytest

import pslink
from pslink.core.service import Service
from pslink.errors import ClosedError


def held(service, job):
    """(keys with a task, keys with a replica) over the service's Aggregators."""
    tasks, replicas = set(), set()
    for aggregator in service.provider.aggregators.values():
        tasks |= {k for (j, k, _) in list(aggregator.core.tasks) if j == job}
        replicas |= {k for (j, k, _) in list(aggregator.core.replicas) if j == job}
    return tasks, replicas


def test_deleted_keys_leave_every_aggregator_and_the_others_go_on(inproc_cluster):
    service, transports = inproc_cluster
    with pslink.connect("del", 0, 2, master=service.address, transports=transports, replication=1) as a, \
            pslink.connect("del", 1, 2, master=service.address, transports=transports, replication=1) as b:
        for agent in (a, b):
            agent.init_many(["w", "bias", "keep"], [np.ones(8, np.float32)] * 3)
        table = a.table("emb", 4, shards=2)
        b.table("emb", 4, shards=2)
        assert held(service, "del") == ({"w", "bias", "keep", "emb"},) * 2
        waiting = a.pushpull("w", np.ones(8, np.float32))  # b never pushes: the round waits
        assert a.delete(["w", "emb", "never-declared"]) == ["w", "emb"]
        with pytest.raises(ClosedError, match="key 'w' of job 'del'.* was deleted"):
            waiting.wait(10)
        assert held(service, "del") == ({"bias", "keep"},) * 2
        assert sorted(service.master.state.jobs["del"].keys) == ["bias", "keep"]
        assert b.delete(["w", "emb"]) == []  # every worker may delete: nothing left to delete
        # The other keys go on; a deleted key declared again starts afresh.
        handles = [agent.pushpull("keep", np.full(8, 2.0, np.float32)) for agent in (a, b)]
        np.testing.assert_array_equal(handles[0].wait(), np.full(8, 4.0))
        for agent in (a, b):
            agent.init("w", np.full(8, 7.0, np.float32))
        np.testing.assert_array_equal(a.pull("w").wait(), np.full(8, 7.0))
        assert table.name == "emb"


def aggregator_rss(service) -> int:
    (name,) = service.provider.names()
    return psutil.Process(service.provider.pid(name)).memory_info().rss


def test_the_memory_of_deleted_keys_returns_to_the_system():
    """128 MiB of 4 MiB parts (below malloc's mmap threshold, so kept in the heap for reuse):
    deleted, the Aggregator's resident memory falls by most of it."""
    with Service(aggregators=1) as service:
        with pslink.connect("rss", 0, 1, master=service.address) as agent:
            before = aggregator_rss(service)
            agent.init("big", np.ones(32 << 20, np.float32)).wait()
            for _ in range(2):
                agent.pushpull("big", np.ones(32 << 20, np.float32)).wait()
            loaded = aggregator_rss(service)
            assert loaded - before > 100 << 20, f"the key did not take its memory: {before} -> {loaded}"
            agent.delete(["big"])
            after = aggregator_rss(service)
            assert loaded - after > 100 << 20, (f"RSS {before >> 20} MiB before, {loaded >> 20} with the key, "
                                                f"{after >> 20} after deleting it")
