"""Whole services inside the test process: pMaster, Aggregators and Agents on threads.

The exactness tests run over every transport (in-process, native TCP and ZeroMQ) to show the
seam holds end to end; failure tests use in-process or TCP clusters.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import psutil
import pytest

import pslink
from pslink.core.wire.protocol import Op, encode
from pslink.core.transport import Transports
from pslink.errors import (
    AuthError,
    ConfigError,
    KeyStateError,
    PeerError,
    PslinkTimeoutError,
    ShapeMismatchError,
    UnknownJobError,
)
from tests.helpers import RawClient, run_workers, start_cluster


@pytest.fixture
def transports():
    t = Transports()
    yield t
    t.close()


@pytest.fixture(params=["inproc", "tcp", "zmq"])
def any_cluster(request, transports):
    service = start_cluster(request.param, aggregators=2, transports=transports)
    yield service, transports
    service.stop()


@pytest.fixture
def cluster(transports):
    service = start_cluster("tcp", aggregators=2, transports=transports)
    yield service, transports
    service.stop()


def agent_for(service, transports, job, rank, workers, **options):
    options.setdefault("timeout", 20.0)
    return pslink.connect(job, rank, workers, master=service.address, transports=transports, **options)


def contribution(rank: int, round_: int, n: int, dtype=np.float32) -> np.ndarray:
    """Integer-valued data, so every sum is exact in floating point."""
    rng = np.random.default_rng(1000 * rank + round_)
    return rng.integers(-50, 50, n).astype(dtype)


def test_bsp_sums_are_exact_over_many_rounds_and_partitioned_keys(any_cluster):
    service, transports = any_cluster
    workers, rounds, n = 3, 25, 1000  # 4000 bytes in parts of 1 KiB: 4 parts over 2 Aggregators

    def worker(rank):
        agent = agent_for(service, transports, "exact", rank, workers, partition_bytes=1024, servers=2)
        try:
            agent.init("w", np.zeros(n, np.float32)).wait()
            agent.init("steps", np.zeros(3, np.int64)).wait()
            out, steps = np.empty(n, np.float32), np.empty(3, np.int64)
            for r in range(1, rounds + 1):
                h1 = agent.pushpull("w", contribution(rank, r, n), out=out)
                h2 = agent.pushpull("steps", np.array([1, rank, r], np.int64), out=steps)
                h1.wait()
                h2.wait()
                expected = sum(contribution(k, r, n) for k in range(workers))
                np.testing.assert_array_equal(out, expected)
                np.testing.assert_array_equal(steps, [workers, sum(range(workers)), workers * r])
            assert len({p[3] for p in agent.key_info("w")["parts"]}) == 2  # its 2 servers share the parts
            return agent.pull("w").wait()
        finally:
            agent.close()

    finals = run_workers(workers, worker)
    for final in finals:
        np.testing.assert_array_equal(final, sum(contribution(k, rounds, n) for k in range(workers)))


def test_large_averages_are_exact_wherever_the_division_happens(any_cluster):
    # Over local sockets the sums come back through shared-memory rings and each worker divides
    # its copy on the way out of the ring; elsewhere the Aggregator divides once for everyone.
    # Integer-valued data: every sum is exact, so both must give the very same numbers.
    service, transports = any_cluster
    n, workers, rounds = 1_500_000, 3, 3  # 6 MB: two parts, one on each Aggregator
    done = threading.Barrier(workers, timeout=60)
    tasks = []

    def worker(rank):
        agent = agent_for(service, transports, "large-avg", rank, workers)
        try:
            agent.init("g", np.zeros(n, np.float32)).wait()
            for r in range(1, rounds + 1):
                out = agent.pushpull("g", contribution(rank, r, n), average=True).wait()
                total = sum(contribution(k, r, n) for k in range(workers))
                np.testing.assert_array_equal(out, np.divide(total, workers, dtype=np.float32))
            if done.wait() == 0:  # one worker looks at the tasks before the job ends
                tasks.extend(task for aggregator in service.provider.aggregators.values()
                             for (job, _, _), task in list(aggregator.core.tasks.items()) if job == agent.job)
            done.wait()
        finally:
            agent.close()

    run_workers(workers, worker)
    assert len(tasks) == 2 and all(task.closed == rounds for task in tasks)
    in_rings = transports.backend(service.address).schemes == ("tcp",) and transports.options.uses_rings
    assert all((task.averaged is None) == in_rings for task in tasks)


def test_batched_calls_and_averages(cluster):
    service, transports = cluster
    keys = ["a", "b", 7]

    def worker(rank):
        agent = agent_for(service, transports, "batch", rank, 2)
        try:
            agent.init_many(keys, [np.zeros(5, np.float32), np.zeros((2, 2)), np.zeros(1, np.float16)]).wait()
            grads = [np.full(5, rank + 1.0, np.float32), np.full((2, 2), 10.0 * rank), np.ones(1, np.float16)]
            outs = agent.pushpull_many(keys, grads, average=True).wait()
            assert [o.shape for o in outs] == [(5,), (2, 2), (1,)]
            np.testing.assert_array_equal(outs[0], np.full(5, 1.5))
            np.testing.assert_array_equal(outs[1], np.full((2, 2), 5.0))
            np.testing.assert_array_equal(outs[2], [1.0])
            summed = agent.pull_many(keys).wait()  # the same round's sum, not averaged
            np.testing.assert_array_equal(summed[0], np.full(5, 3.0))
            with pytest.raises(ConfigError, match="average needs a floating dtype"):
                agent.init("i", np.zeros(2, np.int32)).wait()
                agent.pull("i", average=True)
        finally:
            agent.close()

    run_workers(2, worker)


def test_rank0_init_is_the_initial_value_and_early_requests_wait_for_it(cluster):
    service, transports = cluster
    rank1_waiting = threading.Event()
    init = np.arange(12, dtype=np.float64).reshape(3, 4)

    def worker(rank):
        agent = agent_for(service, transports, "init", rank, 2)
        try:
            if rank == 1:
                h_init = agent.init("w", np.ones((3, 4)))  # declares first; its value is not used
                h_pull = agent.pull("w")
                assert not h_init.done() and not h_pull.done()  # queued behind rank 0's init
                rank1_waiting.set()
                h_init.wait()
                return h_pull.wait()
            assert rank1_waiting.wait(20)
            agent.init("w", init).wait()
            return agent.pull("w").wait()
        finally:
            agent.close()

    for pulled in run_workers(2, worker):
        np.testing.assert_array_equal(pulled, init)


def test_optimizer_mode_matches_momentum_sgd_on_the_averaged_gradient(cluster):
    service, transports = cluster
    settings = {"type": "sgd", "lr": 0.1, "momentum": 0.9, "weight_decay": 0.01}
    w0 = np.linspace(-1, 1, 300)
    rounds = 10

    def grad(rank, r):
        return np.sin(np.arange(300) * (rank + 1) + r)

    def worker(rank):
        agent = agent_for(service, transports, "opt", rank, 2, optimizer=settings, partition_bytes=1024)
        try:
            agent.init("w", w0).wait()
            weights = np.empty_like(w0)
            for r in range(rounds):
                agent.pushpull("w", grad(rank, r), out=weights).wait()
            return weights
        finally:
            agent.close()

    results = run_workers(2, worker)
    w, buf = w0.copy(), None
    for r in range(rounds):
        g = (grad(0, r) + grad(1, r)) / 2 + settings["weight_decay"] * w
        buf = g.copy() if buf is None else settings["momentum"] * buf + g
        w = w - settings["lr"] * buf
    for weights in results:
        np.testing.assert_allclose(weights, w, rtol=1e-12, atol=1e-12)


def test_asp_job_workers_never_wait_for_each_other(cluster):
    service, transports = cluster
    fast = agent_for(service, transports, "async", 0, 2, sync="asp")
    slow = agent_for(service, transports, "async", 1, 2, sync="asp")
    try:
        assert fast.sync == "asp"
        fast.init("w", np.zeros(3)).wait()
        for _ in range(5):  # rank 1 has not pushed at all: under BSP this would block
            fast.push("w", np.ones(3)).wait()
        np.testing.assert_array_equal(fast.pull("w").wait(), np.full(3, 5.0))
        np.testing.assert_array_equal(slow.pushpull("w", np.full(3, 10.0)).wait(), np.full(3, 15.0))
    finally:
        fast.close()
        slow.close()


def test_set_optimizer_after_connecting(cluster):
    service, transports = cluster
    agent = agent_for(service, transports, "late-opt", 0, 1)
    try:
        agent.set_optimizer({"type": "adam", "lr": 0.5})
        assert agent.mode == "optimizer"
        agent.init("w", np.zeros(4)).wait()
        out = agent.pushpull("w", np.ones(4), out=np.empty(4)).wait()
        np.testing.assert_allclose(out, -0.5)  # Adam's first step is lr * sign(grad)
    finally:
        agent.close()


def test_a_shape_mismatch_fails_both_workers_within_a_second(cluster):
    service, transports = cluster
    rank0_waiting = threading.Event()

    def worker(rank):
        agent = agent_for(service, transports, "shapes", rank, 2)
        try:
            if rank == 0:
                handle = agent.pushpull("w", np.ones(4, np.float32))
                rank0_waiting.set()
                with pytest.raises(ShapeMismatchError) as info:
                    handle.wait(timeout=1.0)
            else:
                assert rank0_waiting.wait(20)
                with pytest.raises(ShapeMismatchError) as info:
                    agent.pushpull("w", np.ones(5, np.float32)).wait(timeout=1.0)
            return str(info.value)
        finally:
            agent.close()

    for message in run_workers(2, worker):
        assert "key 'w'" in message and "(5,)" in message and "(4,)" in message


def test_a_batched_call_fails_at_its_first_failed_key_not_at_its_timeout(cluster):
    """Key 'a' of rank 0's batch waits on rank 1, who never sends it: rank 1's bad 'w' must still
    fail rank 0's whole batch now, not after its 20 s timeout."""
    service, transports = cluster
    rank0_waiting = threading.Event()

    def worker(rank):
        agent = agent_for(service, transports, "batch-fail", rank, 2)
        try:
            if rank == 0:
                handle = agent.pushpull_many(["a", "w"], [np.ones(3, np.float32), np.ones(4, np.float32)])
                rank0_waiting.set()
                started = time.monotonic()
                with pytest.raises(ShapeMismatchError, match=r"key 'w'"):
                    handle.wait(timeout=10.0)
                assert time.monotonic() - started < 5.0
                assert handle.done() and isinstance(handle.exception(), ShapeMismatchError)
            else:
                assert rank0_waiting.wait(20)
                with pytest.raises(ShapeMismatchError):
                    agent.pushpull("w", np.ones(5, np.float32)).wait(timeout=5.0)
        finally:
            agent.close()

    run_workers(2, worker)


def test_a_shape_change_after_first_use_also_fails_the_other_worker(cluster):
    service, transports = cluster
    both_declared = threading.Barrier(2, timeout=20)

    def worker(rank):
        agent = agent_for(service, transports, "reshape", rank, 2)
        try:
            agent.pushpull("w", np.ones(4)).wait()
            both_declared.wait()
            if rank == 0:
                with pytest.raises(ShapeMismatchError, match=r"key 'w'.*\(4, 1\).*\(4,\)"):
                    agent.pushpull("w", np.ones(4), out=np.empty((4, 1)))
                with pytest.raises(ShapeMismatchError, match=r"rank 0 uses shape \(6,\)"):
                    agent.pushpull("w", np.ones(6))
            else:
                with pytest.raises(ShapeMismatchError, match=r"\(6,\).*\(4,\)"):
                    agent.pushpull("w", np.ones(4)).wait(timeout=5.0)
        finally:
            agent.close()

    run_workers(2, worker)


def test_a_refused_request_fails_its_round_and_leaves_nothing_in_the_key(cluster):
    # Before, a dtype mismatch poisoned the key for good: a later correct pushpull failed too.
    service, transports = cluster
    agent = agent_for(service, transports, "refused-alone", 0, 1)
    try:
        agent.init("k", np.zeros(4, np.float32)).wait()
        with pytest.raises(ShapeMismatchError, match=r"float64, but rank 0 declared it as shape \(4,\) float32"):
            agent.pushpull("k", np.ones(4, np.float64))
        with pytest.raises(ShapeMismatchError):
            agent.pull("k", out=np.empty(4, np.float64))
        np.testing.assert_array_equal(agent.pushpull("k", np.full(4, 3, np.float32)).wait(), np.full(4, 3))
        np.testing.assert_array_equal(agent.pull("k").wait(), np.full(4, 3))
    finally:
        agent.close()
    # Two workers: rank 1's bad push fails rank 0's round (it would wait for rank 1), then both go on.
    rank0_waiting = threading.Event()
    barrier = threading.Barrier(2, timeout=20)

    def worker(rank):
        agent = agent_for(service, transports, "refused-pair", rank, 2)
        try:
            agent.init("k", np.zeros(4, np.float32)).wait()
            np.testing.assert_array_equal(agent.pushpull("k", np.full(4, rank + 1, np.float32)).wait(), np.full(4, 3))
            if rank == 0:
                handle = agent.pushpull("k", np.ones(4, np.float32))
                rank0_waiting.set()
                with pytest.raises(ShapeMismatchError, match="rank 1 uses shape"):
                    handle.wait(timeout=5.0)
            else:
                assert rank0_waiting.wait(20)
                with pytest.raises(ShapeMismatchError):
                    agent.pushpull("k", np.ones(4, np.float64))
            barrier.wait()
            for step in range(3):
                got = agent.pushpull("k", np.full(4, 10 * step + rank, np.float32)).wait(timeout=5.0)
                np.testing.assert_array_equal(got, np.full(4, 20 * step + 1))
        finally:
            agent.close()

    run_workers(2, worker)


def test_a_known_key_takes_whatever_its_first_call_took(cluster):
    # Calls on one known key with plain arrays take a shorter path than the rest; both must agree.
    service, transports = cluster
    agent = agent_for(service, transports, "known-key", 0, 1, partition_bytes=64)
    try:
        agent.init("m", np.zeros((4, 6), np.float32)).wait()
        agent.init("i", np.zeros(3, np.int32)).wait()
        for value in [np.ones((4, 6), np.float32),                        # the short path
                      np.arange(24, dtype=np.float32).reshape(6, 4).T,      # not contiguous
                      np.full((4, 6), 2.0, np.float32)]:
            out = np.empty((4, 6), np.float32)
            assert agent.pushpull("m", value, out=out).wait() is out  # one worker: the round's sum is its push
            np.testing.assert_array_equal(out, np.asarray(value, np.float32))
        np.testing.assert_array_equal(agent.pull("m").wait(), np.full((4, 6), 2.0))  # out allocated
        strided = np.empty((4, 12), np.float32)[:, ::2]
        with pytest.raises(ConfigError, match="writable C-contiguous"):
            agent.pull("m", out=strided)
        read_only = np.empty((4, 6), np.float32)
        read_only.flags.writeable = False
        with pytest.raises(ConfigError, match="writable C-contiguous"):
            agent.pull("m", out=read_only)
        with pytest.raises(ShapeMismatchError, match=r"uses shape \(4, 6\) float64, but rank 0 declared it as shape \(4, 6\) float32"):
            agent.pull("m", out=np.empty((4, 6), np.float64))
        with pytest.raises(ConfigError, match="average needs a floating dtype"):
            agent.pull("i", out=np.empty(3, np.int32), average=True)
        assert agent.pushpull("i", np.array([1, 2, 3], np.int32)).wait().tolist() == [1, 2, 3]
    finally:
        agent.close()


def test_wrong_credentials_and_unknown_jobs_are_refused(cluster):
    service, transports = cluster
    agent = agent_for(service, transports, "secure", 0, 1)
    raw = None
    try:
        agent.init("w", np.zeros(4, np.float32)).wait()
        part = agent.key_info("w")["parts"][0]
        raw = RawClient(part[4], transports)
        fields = dict(job="secure", rank=0, key="w", part=0, rnd=1, dtype="float32", shape=[4], span=[0, 4])
        raw.send(encode(Op.PUSH, id=1, tok=b"not-the-token", **fields), np.ones(4, np.float32))
        header, _ = raw.reply()
        assert header["op"] == Op.ERROR and header["code"] == AuthError.code
        assert "wrong credential for job 'secure'" in header["msg"]
        raw.send(encode(Op.PULL, id=2, tok=agent.token, **{**fields, "job": "ghost"}))
        header, _ = raw.reply()
        assert header["code"] == UnknownJobError.code and "no job 'ghost'" in header["msg"]
        # the real worker is still served
        np.testing.assert_array_equal(agent.pushpull("w", np.ones(4, np.float32)).wait(), np.ones(4))
        with pytest.raises(pslink.AuthError, match="wrong token for job 'secure'"):
            agent_for(service, transports, "secure", 0, 1, token=b"x" * 16)
        with pytest.raises(pslink.UnknownJobError, match="job 'elsewhere' is not registered"):
            agent_for(service, transports, "elsewhere", 0, 1, token=b"x" * 16)
    finally:
        if raw is not None:
            raw.close()
        agent.close()


def test_a_refused_connect_leaves_no_socket_or_thread_behind(cluster):
    service, _ = cluster
    owner = pslink.connect("owned", 0, 1, master=service.address, timeout=10.0)  # own transports: real TCP
    try:
        process = psutil.Process()
        before = (process.num_fds(), threading.active_count())
        for _ in range(5):
            with pytest.raises(pslink.AuthError):
                pslink.connect("owned", 0, 1, master=service.address, token=b"y" * 16, timeout=10.0)
        # pMaster runs in this process too: its end of the last refused connection closes when it
        # reads the EOF, on its own thread, so give it a moment (bounded) before comparing.
        deadline = time.monotonic() + 5.0
        while (process.num_fds(), threading.active_count()) != before and time.monotonic() < deadline:
            time.sleep(0.01)
        assert (process.num_fds(), threading.active_count()) == before
    finally:
        owner.close()


def test_an_unresponsive_aggregator_is_named_and_nothing_hangs(transports):
    # Without failover (an Agent's opt-out) the silence is the error; with it, see test_fencing.
    service = start_cluster("tcp", aggregators=1, transports=transports)
    agent = agent_for(service, transports, "stuck", 0, 1, peer_timeout=1.0, probe_interval=0.1, failover=False)
    try:
        agent.init("w", np.zeros(4)).wait()
        address = agent.key_info("w")["parts"][0][4]
        service.provider.aggregators["agg-0"].freeze()
        handle = agent.pushpull("w", np.ones(4))
        with pytest.raises(PslinkTimeoutError, match=rf"pushpull of key 'w' \(round 1\) from aggregator agg-0 \({address}\)"):
            handle.wait(timeout=0.3)
        with pytest.raises(PeerError, match=rf"aggregator agg-0 at {address} did not answer for"):
            handle.wait(timeout=10.0)
    finally:
        agent.close()
        service.stop()


def test_garbage_on_an_aggregator_socket_is_counted_and_others_are_served(cluster):
    import socket as socket_module

    service, transports = cluster
    agent = agent_for(service, transports, "garbage", 0, 1)
    try:
        agent.init("w", np.zeros(4)).wait()
        name, address = agent.key_info("w")["parts"][0][3:5]
        aggregator = service.provider.aggregators[name]
        host, port = address[len("tcp://"):].rsplit(":", 1)
        with socket_module.create_connection((host, int(port)), timeout=5) as garbage:
            garbage.sendall(b"\x00\xffthis is not pslink\r\n" * 10)
            assert garbage.recv(100) == b""  # the Aggregator hung up on it
        for _ in range(20):
            agent.pushpull("w", np.ones(4)).wait()
        assert aggregator.errors == 1
    finally:
        agent.close()


def test_callbacks_complete_with_nobody_waiting(cluster):
    service, transports = cluster
    agent = agent_for(service, transports, "callbacks", 0, 1)
    try:
        agent.init_many(range(8), [np.zeros(1000) for _ in range(8)]).wait()
        done = threading.Semaphore(0)
        results = {}
        for key in range(8):
            handle = agent.pushpull(key, np.full(1000, float(key)))
            handle.add_done_callback(lambda h, key=key: (results.__setitem__(key, h.wait()), done.release()))
        for _ in range(8):
            assert done.acquire(timeout=10)  # the background thread drove these
        assert {k: float(v[0]) for k, v in results.items()} == {k: float(k) for k in range(8)}
    finally:
        agent.close()


def test_requests_left_in_flight_by_a_wait_complete_with_nobody_waiting(cluster):
    # A wait that ends does not wake the background thread (one wake-up per wait cost more than the
    # wait); the background must still take over the requests still in flight on its own.
    service, transports = cluster
    agent = agent_for(service, transports, "left-in-flight", 0, 1)
    try:
        agent.init_many(range(8), [np.zeros(50_000, np.float32) for _ in range(8)]).wait()
        handles = [agent.pushpull(key, np.full(50_000, key, np.float32)) for key in range(8)]
        handles[0].wait()
        deadline = time.monotonic() + 10
        while not all(h.done() for h in handles) and time.monotonic() < deadline:
            time.sleep(0.001)
        assert all(h.done() for h in handles), "requests nobody waits for were left unfinished"
        assert [float(h.wait()[0]) for h in handles] == [float(k) for k in range(8)]
    finally:
        agent.close()


def test_many_requests_in_flight_from_many_threads(cluster):
    service, transports = cluster
    agent = agent_for(service, transports, "threads", 0, 1, partition_bytes=4096)
    try:
        agent.init_many(range(16), [np.zeros(3000, np.float32) for _ in range(16)]).wait()

        def hammer(thread):
            for r in range(20):
                keys = [k for k in range(16) if k % 4 == thread]
                handles = [agent.pushpull(k, np.full(3000, k, np.float32)) for k in keys]
                for k, h in zip(keys, handles):
                    np.testing.assert_array_equal(h.wait(), np.full(3000, k, np.float32))

        run_workers(4, hammer)
    finally:
        agent.close()


def test_barrier_and_a_job_name_reused_after_the_job_ended(cluster):
    service, transports = cluster

    def run(value):
        # Rank 1 reaches the barrier only after rank 0 is in it, so a barrier that let rank 0
        # through alone would show one arrival where two must be.
        arrived, zero_in, sums, passed = [], threading.Event(), {}, {}
        lock = threading.Lock()

        def worker(rank):
            agent = agent_for(service, transports, "again", rank, 2)
            try:
                sums[rank] = agent.pushpull("w", np.full(2, value)).wait().copy()
                if rank == 1:
                    assert zero_in.wait(30), "rank 0 never reached the barrier"
                with lock:
                    arrived.append(rank)
                if rank == 0:
                    zero_in.set()
                agent.barrier("end")
                with lock:
                    passed[rank] = sorted(arrived)
            finally:
                agent.close()

        run_workers(2, worker)
        assert passed == {0: [0, 1], 1: [0, 1]}
        return sums

    first = run(1.0)
    assert [first[r].tolist() for r in (0, 1)] == [[2.0, 2.0]] * 2
    # Every worker left: the name is free for a new run, which starts from nothing (no sum of the
    # last run's values, no key state carried over).
    second = run(3.0)
    assert [second[r].tolist() for r in (0, 1)] == [[6.0, 6.0]] * 2


def test_requests_on_a_closed_agent_and_bad_arguments(cluster):
    service, transports = cluster
    agent = agent_for(service, transports, "misuse", 0, 1)
    with pytest.raises(ConfigError, match="keys of one call must be distinct"):
        agent.push_many(["a", "a"], [np.zeros(1), np.zeros(1)])
    with pytest.raises(ConfigError, match="must be an int in"):
        agent.push(-3, np.zeros(1))
    with pytest.raises(ConfigError, match="dtype complex128 is not supported"):
        agent.push("c", np.zeros(2, complex))
    with pytest.raises(KeyStateError, match="never initialized"):
        agent.pull("nothing-here")
    agent.close()
    with pytest.raises(pslink.ClosedError):
        agent.push("a", np.zeros(1))


def test_pmaster_restart_resumes_from_sqlite_while_training_continues(tmp_path, transports):
    from pslink.core.master import Master
    from pslink.core.service.providers import ThreadProvider

    state_dir = str(tmp_path / "state")
    master = Master("tcp://127.0.0.1:0", state_dir=state_dir, transports=transports).start()
    address = master.address
    provider = ThreadProvider(address, transports, reconnect_interval=0.05)
    assert master.wait_for_aggregators(provider.start(2), 20)
    agent = pslink.connect("durable", 0, 1, master=address, transports=transports, heartbeat_interval=0.1)
    try:
        agent.init("w", np.zeros(8)).wait()
        agent.pushpull("w", np.ones(8)).wait()
        master.stop()  # pMaster goes away; Aggregators and the Agent stay
        for _ in range(5):  # the data path does not need pMaster
            agent.pushpull("w", np.ones(8)).wait()
        master = Master(address, state_dir=state_dir, transports=transports).start()
        assert master.state.jobs["durable"].token == agent.token
        assert master.wait_for_aggregators(["agg-0", "agg-1"], 20)
        deadline = time.monotonic() + 20
        while not master.state.jobs["durable"].live_workers():  # the Agent re-registers by itself
            assert time.monotonic() < deadline, "the Agent did not re-register"
            time.sleep(0.02)
        agent.init("v", np.ones(3)).wait()  # placing a new key needs pMaster: it is back
        np.testing.assert_array_equal(agent.pushpull("w", np.ones(8)).wait(), np.ones(8))
        assert agent.key_info("w")["round"] == 7
    finally:
        agent.close()
        master.stop(shutdown_aggregators=True)
        provider.stop_all()
