"""Host-local reduce (pslink.core.agent.host_reduce) in one process: four workers as two hosts of
two (local ranks as a launcher gives them), against the same job pushed flat. Gradients are
multiples of 2**-10, so every sum is exact and the two paths must agree bit for bit."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

import pslink
from pslink.core.agent.host_reduce import HostFollower, HostLeader
from tests.helpers import run_workers

KEYS = {"big": 5000, **{f"b{i}": 1 + 7 * i for i in range(40)}}  # one key in parts, many small ones (fused)


@pytest.fixture(scope="module")
def cluster(tcp_cluster):
    return tcp_cluster


def pushed_bytes(service, job: str) -> int:
    return sum(agg.core.jobs[job].pushed_bytes for agg in service.provider.aggregators.values()
               if job in agg.core.jobs)


def gradient(rank: int, step: int, key: str, n: int) -> np.ndarray:
    rng = np.random.default_rng([rank, step, len(key), n])
    return (rng.integers(-1024, 1024, n) / 1024).astype(np.float32)


def train(service, transports, job: str, host_reduce: bool, steps: int = 4, mode: str = "sum", before_close=None,
          leaves: tuple[int, int] | None = None, on_start=None, on_end=None, local_size: int = 2, **options):
    """Each worker's weights after ``steps`` (sum mode: pushpull of the average, the worker steps;
    optimizer mode: push, then pull the service's weights). ``leaves``: (rank, step) at which
    that rank leaves the job instead of pushing."""
    met = threading.Barrier(4 if leaves is None else 3)
    connected = threading.Barrier(4)
    optimizer = {"type": "sgd", "lr": 0.5, "momentum": 0.5} if mode == "optimizer" else None

    def worker(rank):
        agent = pslink.connect(job, rank, 4, master=service.address, transports=transports, timeout=30.0,
                               host_reduce=host_reduce, local_rank=rank % local_size, local_size=local_size,
                               partition_bytes=4096, optimizer=optimizer, **options)
        try:
            expected = (HostLeader if rank % local_size == 0 else HostFollower) if host_reduce else type(None)
            assert type(agent._sender.host) is expected
            if on_start is not None:
                on_start(rank, agent)
            if host_reduce:
                _wait_for_the_hosts_followers(agent, rank, local_size)
            connected.wait(30)  # every follower counted before any leader's first push
            weights = {k: np.full(n, 0.25, np.float32) for k, n in KEYS.items()}
            agent.init_many(list(KEYS), list(weights.values())).wait()
            for step in range(steps):
                if leaves == (rank, step):
                    return None
                grads = [gradient(rank, step, k, n) for k, n in KEYS.items()]
                if mode == "optimizer":
                    agent.push_many(list(KEYS), grads).wait()
                    agent.pull_many(list(KEYS), list(weights.values())).wait()
                else:
                    agent.pushpull_many(list(KEYS), grads, grads, average=True).wait()
                    for w, g in zip(weights.values(), grads):
                        w -= np.float32(0.5) * g
            met.wait(30)
            if before_close is not None and rank == 1:
                before_close()
            met.wait(30)
            if on_end is not None:
                on_end(rank, agent)
            return weights
        finally:
            agent.close()

    return run_workers(4, worker)


def _wait_for_the_hosts_followers(agent, rank: int, local_size: int, timeout: float = 30.0) -> None:
    """A leader: until each follower's hello arrived. A follower that connects after its leader's
    first push is sent on alone for the rounds that went without it (right, but a push more);
    the workers a launcher starts together are all in before the first step here."""
    host = agent._sender.host
    if not isinstance(host, HostLeader):
        return
    first = rank - rank % local_size
    expected = {r for r in range(first, first + local_size) if r < 4} - {rank}
    deadline = time.monotonic() + timeout
    while True:
        with host.lock:
            followers = set(host.followers.values())
        if followers == expected:
            return
        assert time.monotonic() < deadline, f"rank {rank}: followers {sorted(followers)} of {sorted(expected)}"
        time.sleep(0.01)


@pytest.mark.parametrize("mode", ["sum", "optimizer"])
def test_host_local_reduce_gives_the_flat_weights_with_half_the_pushes(cluster, mode):
    service, transports = cluster
    pushed = {}
    runs = {}
    for host_reduce in (False, True):
        job = f"hr-{mode}-{host_reduce}"
        runs[host_reduce] = train(service, transports, job, host_reduce, mode=mode,
                                  before_close=lambda: pushed.__setitem__(host_reduce, pushed_bytes(service, job)))
    for flat, local in zip(runs[False], runs[True]):
        for key in KEYS:
            assert np.array_equal(flat[key], local[key]), key
    assert pushed[True] * 2 == pushed[False] > 0  # two hosts push where four workers did


def test_a_leader_lost_after_its_hosts_push_loses_no_round(cluster):
    # At the third step the leaders push their hosts' sums and then lose their followers before
    # answering (as a leader that dies there): the followers send the round themselves, the
    # Aggregators answer it as the repeat it is, and from then on they push on their own.
    service, transports = cluster
    cut = []

    def on_start(rank, agent):
        if rank % 2:
            return
        host = agent._sender.host
        answer = host._answer

        def answer_or_cut(lr, error, result, total):
            if lr.round == 3 and lr.key == "big" and not cut.count(rank):
                cut.append(rank)
                for conn in list(host.followers):
                    conn.close()
                    host.on_close(conn, None)  # what the leader's side sees of a connection lost
                lr.waiting = [w for w in lr.waiting if w[1] is None]
            answer(lr, error, result, total)

        host._answer = answer_or_cut

    flat = train(service, transports, "cut-flat", False, steps=6)
    local = train(service, transports, "cut-local", True, steps=6, on_start=on_start)
    assert sorted(cut) == [0, 2]
    for a, b in zip(flat, local):
        for key in KEYS:
            assert np.array_equal(a[key], b[key]), key


def test_a_leader_that_leaves_before_its_hosts_push_loses_no_round(cluster):
    # Rank 0 leaves at the third step while rank 1's pushes wait at it: rank 1 sends them itself,
    # and the rounds close without rank 0, as on the flat path.
    service, transports = cluster
    flat = train(service, transports, "leave-flat", False, steps=5, leaves=(0, 2))
    local = train(service, transports, "leave-local", True, steps=5, leaves=(0, 2))
    assert flat[0] is None and local[0] is None
    for a, b in zip(flat[1:], local[1:]):
        for key in KEYS:
            assert np.array_equal(a[key], b[key]), key


def _pair_round(agents) -> list[np.ndarray]:
    """One pushpull of ``w`` by each agent, on threads; each result."""
    for agent in agents:
        agent.init("w", np.zeros(4, np.float32)).wait()

    def push(rank):
        return agents[rank].pushpull("w", np.full(4, rank + 1, np.float32), average=False).wait()

    return run_workers(len(agents), push)


def test_a_follower_whose_leader_runs_on_another_host_pushes_to_the_pool_itself(cluster, monkeypatch, caplog):
    service, transports = cluster
    options = dict(master=service.address, transports=transports, timeout=20.0, host_reduce=True, local_size=2)
    leader = pslink.connect("elsewhere", 0, 2, local_rank=0, **options)
    monkeypatch.setattr("pslink.core.agent.agent.hosts.host_id", lambda: "another-kernel/1")
    follower = pslink.connect("elsewhere", 1, 2, local_rank=1, **options)
    try:
        assert follower._sender.host is None and type(leader._sender.host) is HostLeader
        assert "runs on another host" in caplog.text
        assert [r.tolist() for r in _pair_round([leader, follower])] == [[3.0] * 4] * 2
    finally:
        follower.close()
        leader.close()


def test_a_follower_whose_leader_does_not_come_pushes_to_the_pool_itself(cluster, caplog):
    service, transports = cluster
    options = dict(master=service.address, transports=transports, timeout=20.0, host_reduce=True, local_size=2)
    # Rank 1 first: it waits for its leader as long as it may connect, then goes on alone.
    follower = pslink.connect("no-leader", 1, 2, local_rank=1, connect_timeout=0.5, **options)
    leader = pslink.connect("no-leader", 0, 2, local_rank=0, **options)
    try:
        assert follower._sender.host is None and "is not there" in caplog.text
        assert [r.tolist() for r in _pair_round([leader, follower])] == [[3.0] * 4] * 2
    finally:
        follower.close()
        leader.close()


def test_the_next_rank_of_a_host_leads_once_its_leader_left(cluster):
    # Ranks 0, 1, 2 on one host (rank 3 alone on another); rank 0 leaves at the third step.
    # Rank 1 leads the host from its next push on, and rank 2 pushes through it.
    service, transports = cluster
    roles = {}

    def on_end(rank, agent):
        host = agent._sender.host
        roles[rank] = (type(host).__name__, getattr(host, "leader", None))

    flat = train(service, transports, "elect-flat", False, steps=5, leaves=(0, 2), local_size=3)
    local = train(service, transports, "elect-local", True, steps=5, leaves=(0, 2), local_size=3, on_end=on_end)
    assert roles == {1: ("HostLeader", None), 2: ("HostFollower", 1), 3: ("HostLeader", None)}
    for a, b in zip(flat[1:], local[1:]):
        for key in KEYS:
            assert np.array_equal(a[key], b[key]), key
