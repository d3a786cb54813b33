"""The window of large requests in flight on a network link (pslink.core.agent.requests), on a
real cluster over TCP: requests held back for room change no result."""

from __future__ import annotations

import numpy as np
import pytest

import pslink
from pslink.core.transport import Transports
from pslink.core.transport.options import TransportOptions
from tests.helpers import run_workers


@pytest.fixture(scope="module")
def cluster(tcp_cluster):
    return tcp_cluster


def train(service, job: str, steps: int = 3):
    """2 workers over TCP (no Unix sockets, as between hosts), 6 keys of 200 000 float32 in parts of 128 KiB (42 parts over 2 Aggregators),
    every step's pushpulls in flight before the first wait; returns each worker's last results
    and the windows of its links."""
    sizes = [200_000 + 1_000 * i for i in range(6)]
    keys = [f"w{i}" for i in range(len(sizes))]

    def worker(rank):
        transports = Transports(TransportOptions(local_sockets=False))
        agent = pslink.connect(job, rank, 2, master=service.address, transports=transports, timeout=20.0,
                               partition_bytes=128 << 10)
        try:
            rng = np.random.default_rng(rank)
            agent.init_many(keys, [np.zeros(n, np.float32) for n in sizes]).wait()
            outs = [np.empty(n, np.float32) for n in sizes]
            for _ in range(steps):
                grads = [rng.standard_normal(n).astype(np.float32) for n in sizes]
                for handle in [agent.pushpull(k, g, o, average=True) for k, g, o in zip(keys, grads, outs)]:
                    handle.wait()
            windows = sorted(link.window for link in agent._requests.links.values())
            return outs, windows
        finally:
            agent.close()
            transports.close()

    return run_workers(2, worker)


def test_large_requests_held_for_room_on_tcp_links_give_bit_identical_results(cluster, monkeypatch):
    service, _ = cluster
    monkeypatch.setenv("PSLINK_LINK_WINDOW", "0")
    unlimited = train(service, "unlimited")
    monkeypatch.setenv("PSLINK_LINK_WINDOW", "2")
    windowed = train(service, "windowed")
    assert [w for _, w in unlimited] == [[0, 0], [0, 0]]
    assert [w for _, w in windowed] == [[2, 2], [2, 2]]  # both links of both workers were limited
    for rank in range(2):
        for a, b in zip(windowed[rank][0], unlimited[rank][0]):
            assert a.tobytes() == b.tobytes()
    for a, b in zip(windowed[0][0], windowed[1][0]):
        assert a.tobytes() == b.tobytes()
