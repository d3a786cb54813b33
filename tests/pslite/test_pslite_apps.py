"""ps-lite's semantics, whole deployments on threads of this process (TCP on 127.0.0.1).

Python ports of ps-lite's tests (test_simple_app, test_kv_app, test_kv_app_multi_workers) run
in both server modes where they apply: ``classic`` (the program's own KVServer with
KVServerDefaultHandle) and ``service`` (the shared Aggregator pool, no server nodes).
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

from pslink.errors import ConfigError, PeerError, ProtocolError, PslinkError, ShapeMismatchError
from pslink.pslite import (
    K_MAX_KEY,
    SERVER_GROUP,
    WORKER_GROUP,
    KVMeta,
    KVPairs,
    KVServer,
    KVServerDefaultHandle,
    KVWorker,
    SimpleApp,
)
from tests.helpers import start_cluster
from tests.pslite.pslite_deploy import run_nodes

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def service():
    """One parameter service (pMaster and two Aggregators on threads) for every service-mode run."""
    svc = start_cluster("tcp", aggregators=2)
    yield svc
    svc.stop()


def modes(service_fixture_name="service"):
    return pytest.mark.parametrize("mode", ["classic", "service"])


def deploy(mode, service, num_workers, worker, **options):
    return run_nodes(num_workers, worker, mode=mode, service=service if mode == "service" else None, **options)


def spread_keys(num: int, offset: int = 0) -> np.ndarray:
    """Keys over the whole key space (every server gets some), as ps-lite's tests make them."""
    return np.array([K_MAX_KEY // num * i + offset for i in range(num)], dtype=np.uint64)


def known_values(total: int) -> np.ndarray:
    return np.random.default_rng(7).integers(0, 1000, total).astype(np.float32)


# -- test_simple_app -------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["classic", "service"])
def test_simple_app_every_node_answers_every_request(mode, service):
    """ps-lite's test_simple_app: the scheduler sends n requests to every node, itself included."""
    n = 30
    counts = {}

    def counting_app(node):
        app = SimpleApp(0, node=node)
        handled = []

        def handle(req, app_):
            assert (req.head, req.body) == (1, "test")
            handled.append(req.sender)
            app_.response(req, f"ack from {node.role}")

        app.set_request_handle(handle)
        return app, handled

    def scheduler(node, rank):
        app, handled = counting_app(node)
        responses = []
        app.set_response_handle(lambda res, app_: responses.append(res.body))
        node.start()
        for ts in [app.request(1, "test", 7) for _ in range(n)]:
            app.wait(ts)
        node.finalize()
        counts["scheduler"] = len(handled)
        return responses

    def member(node, rank):
        _, handled = counting_app(node)
        node.start()
        node.finalize()
        counts[f"{node.role}{rank}"] = len(handled)
        return set(handled)

    results = deploy(mode, service, 2, member, num_servers=2, server=member, scheduler=scheduler)
    expected = {"scheduler", "worker0", "worker1"} | ({"server0", "server1"} if mode == "classic" else set())
    assert counts == {name: n for name in expected}
    responses = results[("scheduler", 0)]
    assert len(responses) == n * len(expected)
    assert responses.count("ack from scheduler") == n and responses.count("ack from worker") == 2 * n
    assert results[("worker", 1)] == {1}  # every request came from the scheduler (node id 1)


# -- test_kv_app -------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode,servers,workers", [("classic", 1, 1), ("classic", 2, 3), ("service", 1, 3)])
def test_push_repeatedly_then_pull_returns_repeat_x_workers_x_values(mode, servers, workers, service):
    """ps-lite's test_kv_app with shared keys: the pull equals repeat x workers x values."""
    num, repeat = 16, 12
    keys = spread_keys(num)
    vals = known_values(num)

    def worker(node, rank):
        node.start()
        kv = KVWorker(0, 0, node=node)
        timestamps = []
        for i in range(repeat):
            timestamps.append(kv.push(keys, vals))
            if i > 4:
                kv.wait(timestamps[-4])
        for ts in timestamps:
            kv.wait(ts)
        node.barrier(0, WORKER_GROUP)
        rets: list = []
        kv.wait(kv.pull(keys.tolist(), rets))
        out = np.zeros(num, np.float32)
        kv.wait(kv.zpull(keys, out))
        node.finalize()
        return np.asarray(rets, np.float32), out

    results = deploy(mode, service, workers, worker, num_servers=servers)
    for rank in range(workers):
        listed, zero_copy = results[("worker", rank)]
        np.testing.assert_array_equal(listed, vals * repeat * workers)
        np.testing.assert_array_equal(zero_copy, vals * repeat * workers)


@pytest.mark.parametrize("mode", ["classic", "service"])
def test_variable_length_values_with_lens(mode, service):
    num, repeat, workers = 20, 5, 2
    keys = spread_keys(num)
    lens = np.random.default_rng(3).integers(1, 6, num).astype(np.int32)
    vals = known_values(int(lens.sum()))

    def worker(node, rank):
        node.start()
        kv = KVWorker(0, 0, node=node)
        for ts in [kv.push(keys, vals, lens) for _ in range(repeat)]:
            kv.wait(ts)
        node.barrier(0, WORKER_GROUP)
        rets, rlens = [], []
        kv.wait(kv.pull(keys, rets, rlens))
        out, out_lens = np.zeros(vals.size, np.float32), np.zeros(num, np.int32)
        kv.wait(kv.zpull(keys, out, out_lens))
        node.finalize()
        return rets, rlens, out, out_lens

    results = deploy(mode, service, workers, worker, num_servers=2)
    for rank in range(workers):
        rets, rlens, out, out_lens = results[("worker", rank)]
        np.testing.assert_array_equal(np.asarray(rets, np.float32), vals * repeat * workers)
        assert rlens == lens.tolist()
        np.testing.assert_array_equal(out, vals * repeat * workers)
        np.testing.assert_array_equal(out_lens, lens)


@pytest.mark.parametrize("mode", ["classic", "service"])
def test_several_customers_in_one_worker(mode, service):
    """ps-lite's test_kv_app_multi_workers: customers 0 and 1 on two threads of each worker."""
    num, repeat, workers = 50, 6, 2
    vals = known_values(num)

    def customer(node, customer_id, out: dict):
        node.start(customer_id)
        kv = KVWorker(0, customer_id, node=node)
        keys = spread_keys(num, offset=customer_id)
        for ts in [kv.push(keys, vals) for _ in range(repeat)]:
            kv.wait(ts)
        node.barrier(customer_id, WORKER_GROUP)
        rets = np.zeros(num, np.float32)
        kv.wait(kv.zpull(keys, rets))
        out[customer_id] = rets
        node.finalize(customer_id, True)

    def worker(node, rank):
        out: dict = {}
        errors = []

        def run(c):
            try:
                customer(node, c, out)
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=run, args=(c,)) for c in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(40)
        if errors:
            raise errors[0]
        return out

    results = deploy(mode, service, workers, worker, num_servers=1)
    for rank in range(workers):
        out = results[("worker", rank)]
        for c in (0, 1):
            np.testing.assert_array_equal(out[c], vals * repeat * workers)


@pytest.mark.parametrize("mode", ["classic", "service"])
def test_pushpull_and_in_place_zpushpull(mode, service):
    keys = spread_keys(8)

    def worker(node, rank):
        node.start()
        kv = KVWorker(0, 0, node=node)
        first = np.full(16, 1.0, np.float32)  # two values per key
        out: list = []
        kv.wait(kv.pushpull(keys, first, out))
        node.barrier(0, WORKER_GROUP)
        again = np.full(16, 2.0, np.float32)
        kv.wait(kv.zpushpull(keys, again, again))  # the pushed array receives the result
        node.finalize()
        return out, again

    results = deploy(mode, service, 2, worker, num_servers=2)
    for rank in range(2):
        out, again = results[("worker", rank)]
        assert len(out) == 16 and min(out) >= 1.0  # at least this worker's own push
        np.testing.assert_array_equal(again[::2], again[1::2])
        assert again.min() >= 2.0 + 2.0  # both first pushes are in, plus at least this one


# -- errors a program gets, clearly -----------------------------------------------------------------


@pytest.mark.parametrize("mode", ["classic", "service"])
def test_bad_input_is_a_clear_error(mode, service):
    keys = spread_keys(4)

    def worker(node, rank):
        kv = KVWorker(0, 0, node=node)
        with pytest.raises(ConfigError, match="call start"):
            kv.push(keys, np.ones(4, np.float32))
        node.start()
        seen = {}
        with pytest.raises(ConfigError, match=r"ascending order, but keys\[1\]=3 follows keys\[0\]=5") as err:
            kv.push([5, 3], [1.0, 2.0])
        seen["order"] = str(err.value)
        with pytest.raises(ConfigError, match=r"keys\[1\]=5 repeats"):
            kv.push([5, 5], [1.0, 2.0])
        with pytest.raises(ConfigError, match="7 values do not divide among 4 keys"):
            kv.push(keys, np.ones(7, np.float32))
        with pytest.raises(ConfigError, match="lengths sum to 5, but 4 values"):
            kv.push(keys, np.ones(4, np.float32), lens=[1, 1, 1, 2])
        with pytest.raises(ConfigError, match="numpy array of float32"):
            kv.zpush(keys, [1.0, 2.0, 3.0, 4.0])
        with pytest.raises(ConfigError, match="values are float64"):
            kv.zpush(keys, np.ones(4))
        with pytest.raises(ShapeMismatchError, match="lens_out must be .* of 4"):
            kv.pull(keys, [], lens_out=np.zeros(3, np.int32))
        kv.wait(kv.push(keys, np.ones(8, np.float32)))  # two values per key
        wrong = np.zeros(5, np.float32)
        with pytest.raises(ShapeMismatchError, match="holds 5 value.*returned 8") as err:
            kv.wait(kv.zpull(keys, wrong))
        seen["size"] = str(err.value)
        with pytest.raises(ConfigError, match="issued no request with timestamp 999"):
            kv.wait(999)
        node.finalize()
        return seen

    results = deploy(mode, service, 1, worker)
    assert "zpull" in results[("worker", 0)]["size"]


def test_values_of_another_dtype_than_the_server_holds_are_refused():
    def worker(node, rank):
        node.start()
        kv = KVWorker(0, 0, dtype=np.float64, node=node)
        with pytest.raises(ProtocolError, match="sends float64 values to app 0, but this server's KVServer holds"):
            kv.wait(kv.push([1, 2], [1.0, 2.0]))
        node.finalize()

    run_nodes(1, worker)


def test_a_failing_request_handle_reaches_the_worker_with_its_cause():
    def server(node, rank):
        srv = KVServer(0, node=node)

        def handle(meta, pairs, server_):
            raise ValueError(f"no key {int(pairs.keys[0])} here")

        srv.set_request_handle(handle)
        node.start()
        node.finalize()

    def worker(node, rank):
        node.start()
        kv = KVWorker(0, 0, node=node)
        with pytest.raises(PslinkError, match=r"server 0 \(app 0\) failed on a push of 1 key.*ValueError: no key 42"):
            kv.wait(kv.push([42], [1.0]))
        node.finalize()

    run_nodes(1, worker, server=server)


def test_a_node_that_dies_fails_every_other_node_clearly_instead_of_hanging():
    def worker(node, rank):
        node.start()
        if rank == 1:
            node.close()  # as a crash would: no finalize
            return "gone"
        node.finalize()

    results = run_nodes(2, worker, expect_errors=True, timeout=40)
    assert results[("worker", 1)] == "gone"
    for who in (("worker", 0), ("server", 0), ("scheduler", 0)):
        error = results[who]
        assert isinstance(error, PeerError), (who, error)
        assert "worker 1 (node id 11" in str(error) and "before finalize" in str(error)


# -- server semantics -----------------------------------------------------------------------------


def test_the_server_sees_what_ps_lite_puts_in_kvmeta_and_kvpairs():
    seen = []

    def server(node, rank):
        srv = KVServer(3, node=node)

        def handle(meta, pairs, server_):
            seen.append((meta.cmd, meta.push, meta.pull, meta.sender, meta.timestamp, meta.customer_id,
                         pairs.keys.tolist(), pairs.vals.tolist(), pairs.lens.tolist(), pairs.priority))
            answer = KVPairs(pairs.keys, np.full(pairs.keys.size, 9.0, np.float32)) if meta.pull else None
            server_.response(meta, answer)

        srv.set_request_handle(handle)
        node.start()
        node.finalize()

    def worker(node, rank):
        node.start()
        kv = KVWorker(3, 5, node=node)
        kv.wait(kv.push([1, 2], [0.5, 1.5, 2.5], lens=[1, 2], cmd=7, priority=-2))
        out = []
        kv.wait(kv.pull([4], out, cmd=8))
        node.finalize()
        return out

    results = run_nodes(1, worker, server=server)
    assert results[("worker", 0)] == [9.0]
    assert seen == [
        (7, True, False, 9, 0, 5, [1, 2], [0.5, 1.5, 2.5], [1, 2], -2),
        (8, False, True, 9, 1, 5, [4], [], [], 0),
    ]


def test_deferred_responses_make_synchronous_aggregation():
    """A handle that answers every worker's push only once all workers pushed (sync SGD)."""
    workers = 3

    def server(node, rank):
        srv = KVServer(0, node=node)
        waiting: list[KVMeta] = []
        total = {}

        def handle(meta, pairs, server_):
            key = int(pairs.keys[0])
            total[key] = total.get(key, 0) + pairs.vals
            waiting.append(meta)
            if len(waiting) == workers:
                for m in waiting:
                    server_.response(m, KVPairs(pairs.keys, total[key]))
                waiting.clear()
                total.clear()

        srv.set_request_handle(handle)
        node.start()
        node.finalize()

    def worker(node, rank):
        node.start()
        kv = KVWorker(0, 0, node=node)
        results = []
        for step in range(3):
            out = np.zeros(4, np.float32)
            kv.wait(kv.zpushpull([11], np.full(4, rank + step, np.float32), out))
            results.append(out.copy())
        node.finalize()
        return results

    results = run_nodes(workers, worker, server=server)
    for rank in range(workers):
        for step, out in enumerate(results[("worker", rank)]):
            np.testing.assert_array_equal(out, np.full(4, sum(r + step for r in range(workers)), np.float32))


def test_requests_that_arrive_before_the_handle_is_set_are_queued_not_fatal():
    """ps-lite aborts when a request reaches a server before its handle (about 1 start in 40)."""
    pushed = threading.Event()

    def server(node, rank):
        node.start()
        assert pushed.wait(20)  # the worker's requests are on their way, or here already
        srv = KVServer(0, node=node)  # the app itself comes late
        assert pushed.wait(20)
        srv.set_request_handle(KVServerDefaultHandle())  # and its handle later still
        node.finalize()

    def worker(node, rank):
        node.start()
        kv = KVWorker(0, 0, node=node)
        timestamps = [kv.push([7], [float(i)]) for i in range(5)]
        timestamps.append(kv.pull([7], out := []))
        pushed.set()
        for ts in timestamps:
            kv.wait(ts)
        node.finalize()
        return out

    results = run_nodes(1, worker, server=server)
    assert results[("worker", 0)] == [0.0 + 1 + 2 + 3 + 4]  # in order: every push before the pull


def test_a_custom_slicer_decides_which_server_gets_which_keys():
    per_server = {0: [], 1: []}

    def server(node, rank):
        srv = KVServer(0, node=node)
        default = KVServerDefaultHandle()

        def handle(meta, pairs, server_):
            per_server[rank].extend(pairs.keys.tolist())
            default(meta, pairs, server_)

        srv.set_request_handle(handle)
        node.start()
        node.finalize()

    def all_to_last(send, ranges):
        return [(False, KVPairs()) for _ in ranges[:-1]] + [(True, send)]

    def worker(node, rank):
        node.start()
        kv = KVWorker(0, 0, node=node)
        kv.set_slicer(all_to_last)
        keys = spread_keys(6)
        kv.wait(kv.push(keys, np.arange(6, dtype=np.float32)))
        out = np.zeros(6, np.float32)
        kv.wait(kv.zpull(keys, out))
        kv.set_slicer(lambda send, ranges: [(True, send)])  # wrong: one entry for two servers
        with pytest.raises(ConfigError, match="one \\(bool, KVPairs\\) per server \\(2\\)"):
            kv.push(keys, np.zeros(6, np.float32))
        node.finalize()
        return out

    results = run_nodes(1, worker, num_servers=2, server=server)
    np.testing.assert_array_equal(results[("worker", 0)], np.arange(6, dtype=np.float32))
    assert per_server[0] == [] and len(per_server[1]) == 12


def test_the_callback_runs_once_every_slice_answered():
    keys = spread_keys(10)  # half on each of two servers

    def worker(node, rank):
        node.start()
        kv = KVWorker(0, 0, node=node)
        kv.wait(kv.push(keys, np.arange(10, dtype=np.float32)))
        out = np.zeros(10, np.float32)
        at_callback = []
        called = threading.Event()

        def callback():
            at_callback.append(out.copy())
            called.set()

        ts = kv.zpull(keys, out, callback=callback)
        assert called.wait(20), "the callback did not run without anyone waiting"
        kv.wait(ts)
        empty = kv.push([], [], callback=lambda: at_callback.append("empty"))  # no slice: runs at once
        kv.wait(empty)
        node.finalize()
        return at_callback

    results = run_nodes(1, worker, num_servers=2)
    at_callback = results[("worker", 0)]
    np.testing.assert_array_equal(at_callback[0], np.arange(10, dtype=np.float32))
    assert at_callback[1] == "empty"


# -- roles, ranks, barriers, exit callbacks ------------------------------------------------------------


def test_roles_ranks_barriers_and_exit_callbacks():
    exits = []

    def worker(node, rank):
        with pytest.raises(ConfigError, match="known only after start"):
            node.my_rank()
        node.register_exit_callback(lambda: exits.append(rank))
        node.start()
        facts = (node.is_worker, node.is_server, node.is_scheduler, node.my_rank(), node.num_workers,
                 node.num_servers, node.node_ids(WORKER_GROUP), node.node_ids(SERVER_GROUP), node.node_ids(1))
        node.barrier(0, WORKER_GROUP)
        node.barrier(0, 7)
        with pytest.raises(ConfigError, match="cannot join barrier group 2"):
            node.barrier(0, SERVER_GROUP)
        with pytest.raises(ConfigError, match="node 99 does not exist"):
            node.node_ids(99)
        node.finalize()
        return facts

    def server(node, rank):
        node.start()
        node.barrier(0, 7)
        node.finalize()

    def scheduler(node, rank):
        node.start()
        node.barrier(0, 7)
        node.finalize()

    results = run_nodes(3, worker, num_servers=2, server=server, scheduler=scheduler)
    for rank in range(3):
        assert results[("worker", rank)] == (True, False, False, rank, 3, 2, [9, 11, 13], [8, 10], [1])
    assert sorted(exits) == [0, 1, 2]


def test_service_mode_specifics(service):
    def worker(node, rank):
        node.start()
        kv = KVWorker(0, 0, node=node)
        kv.set_slicer(lambda send, ranges: None)  # placement is pMaster's: never called
        kv.wait(kv.push([3, 4], [1.0, 2.0], cmd=5))
        never = []
        kv.wait(kv.pull([8], never))  # small values live in a table: a key never pushed reads zeros
        assert never == [0.0]
        with pytest.raises(PslinkError, match="never initialized or pushed"):
            kv.pull([9], np.empty(300, np.float32))  # more values than a table row: a key of its own
        other = KVWorker(1, 1, node=node)  # another app id is another key space
        other.wait(other.push([3], [10.0]))
        out = []
        kv.wait(kv.pull([3, 4], out))
        mine = []
        other.wait(other.pull([3], mine))
        simple = SimpleApp(2, node=node)
        assert node.node_ids(SERVER_GROUP) == []  # no server processes in service mode
        simple.wait(simple.request(1, "anyone?", SERVER_GROUP), timeout=5)
        node.finalize()
        return out, mine

    results = run_nodes(1, worker, mode="service", service=service)
    assert results[("worker", 0)] == ([1.0, 2.0], [10.0])


def test_service_mode_sends_a_push_of_many_keys_as_one_message_per_shard(service):
    """test_kv_app's pattern: 10,000 keys of one value per push. Each push is one table request per
    shard (``PSLINK_PSLITE_SHARDS``), not one message per key; the sums are the default handle's."""
    aggregators = list(service.provider.aggregators.values())

    def shard_pushes():
        """Pushes the table's shards took (an asynchronous shard counts each as a round); not
        ``Aggregator.requests``, which counts the Agents' liveness pings too."""
        return sum(task.closed for a in aggregators for (_, key, _), task in list(a.core.tasks.items())
                   if str(key).startswith("pslite/"))

    num, repeat = 10_000, 5
    keys = np.arange(num, dtype=np.uint64) * (K_MAX_KEY // num)
    vals = np.random.default_rng(7).integers(0, 1000, num).astype(np.float32)
    counted = {}

    def worker(node, rank):
        node.start()
        kv = KVWorker(0, 0, node=node)
        kv.wait(kv.push(keys, vals))  # the table is declared: count from here
        node_barrier(node)
        if rank == 0:
            counted["before"] = shard_pushes()
        node_barrier(node)
        for _ in range(repeat - 1):
            kv.wait(kv.push(keys, vals))
        node_barrier(node)
        if rank == 0:
            counted["after"] = shard_pushes()
        out = np.empty(num, np.float32)
        kv.wait(kv.zpull(keys, out))
        rets = []
        kv.wait(kv.pull(keys[:3].tolist(), rets))  # into a list: no lengths given
        node.finalize()
        return out, rets

    results = run_nodes(2, worker, mode="service", service=service, shards=3)
    assert counted["after"] - counted["before"] == 2 * (repeat - 1) * 3  # 2 workers x pushes x 3 shards
    for rank in range(2):
        out, rets = results[("worker", rank)]
        np.testing.assert_array_equal(out, vals * repeat * 2)
        assert rets == (vals[:3] * repeat * 2).tolist()


def node_barrier(node):
    node.barrier(0, WORKER_GROUP)


# -- PS_RESEND and heartbeats ------------------------------------------------------------------------


def test_ps_resend_replays_an_answer_lost_with_its_connection_and_applies_the_push_once():
    calls = []
    held: list = []
    holding, cut = threading.Event(), threading.Event()

    def server(node, rank):
        srv = KVServer(0, node=node)
        default = KVServerDefaultHandle()

        def handle(meta, pairs, server_):
            calls.append((meta.sender, meta.timestamp))
            if meta.timestamp == 0 and not held:  # hold the first answer until its connection is cut
                held.append(meta)
                default.store[int(pairs.keys[0])] = np.array(pairs.vals)
                holding.set()
                return
            default(meta, pairs, server_)

        srv.set_request_handle(handle)
        node.start()
        assert cut.wait(20)
        node.post(lambda: srv.response(held[0]))  # goes to a dead connection: lost
        node.finalize()
        return node._resender.duplicates

    def worker(node, rank):
        node.start()
        kv = KVWorker(0, 0, node=node)
        ts = kv.push([5], [2.5])
        assert holding.wait(20)
        node.links.conn_to(8).close()  # fault injection: the link to server 0 breaks under the request
        cut.set()
        kv.wait(ts)  # answered by the resend, over a new connection
        out = []
        kv.wait(kv.pull([5], out))
        node.finalize()
        return out, node._resender.resent

    results = run_nodes(1, worker, server=server, resend=True, resend_timeout=100)
    out, resent = results[("worker", 0)]
    assert out == [2.5]  # the push counted once
    assert resent >= 1 and results[("server", 0)] >= 1
    assert calls.count((9, 0)) == 1


def test_ps_resend_does_not_double_a_request_that_is_only_slow():
    calls = []

    def server(node, rank):
        srv = KVServer(0, node=node)
        default = KVServerDefaultHandle()

        def handle(meta, pairs, server_):
            calls.append(meta.timestamp)
            threading.Timer(0.4, lambda: node.post(default, meta, pairs, server_)).start()  # 8 timeouts late

        srv.set_request_handle(handle)
        node.start()
        node.finalize()
        return node._resender.duplicates

    def worker(node, rank):
        node.start()
        kv = KVWorker(0, 0, node=node)
        kv.wait(kv.push([1, 2], [1.0, 2.0]))
        out = []
        kv.wait(kv.pull([1, 2], out))
        node.finalize()
        return out

    results = run_nodes(1, worker, server=server, resend=True, resend_timeout=50)
    assert results[("worker", 0)] == [1.0, 2.0]
    assert calls == [0, 1] and results[("server", 0)] >= 2


def test_a_node_silent_past_the_heartbeat_timeout_fails_the_others():
    def worker(node, rank):
        node.start()
        if rank == 1:
            node.driver.close()  # nobody drives this node any more: its heartbeats stop
            return "frozen"
        node.finalize()

    results = run_nodes(2, worker, expect_errors=True, timeout=40, heartbeat_interval=0.1, heartbeat_timeout=1.0)
    assert results[("worker", 1)] == "frozen"
    error = results[("worker", 0)]
    assert isinstance(error, PeerError) and "worker 1" in str(error) and "PS_HEARTBEAT_TIMEOUT=1" in str(error)


def test_start_names_an_unreachable_scheduler_and_a_taken_port():
    from pslink.launch import free_port
    from pslink.pslite import Config, Node

    port = free_port()
    lonely = Node(Config(role="worker", root_uri="127.0.0.1", root_port=port, num_workers=1, num_servers=1,
                         start_timeout=0.5))
    try:
        with pytest.raises(PeerError, match=f"cannot reach the scheduler at tcp://127.0.0.1:{port} "
                                            r"\(DMLC_PS_ROOT_URI, DMLC_PS_ROOT_PORT\)"):
            lonely.start()
    finally:
        lonely.close()
    first = Node(Config(role="scheduler", root_uri="127.0.0.1", root_port=port, num_workers=1, num_servers=1))
    try:
        with pytest.raises(PeerError, match=r"scheduler cannot listen \(DMLC_PS_ROOT_URI/DMLC_PS_ROOT_PORT\)"):
            Node(Config(role="scheduler", root_uri="127.0.0.1", root_port=port, num_workers=1, num_servers=1))
        SimpleApp(0, node=first)
        with pytest.raises(ConfigError, match="app 0 customer 0 already exists"):
            SimpleApp(0, node=first)
    finally:
        first.close()


def test_ps_verbose_2_logs_every_message(caplog):
    import logging

    def worker(node, rank):
        node.start()
        kv = KVWorker(0, 0, node=node)
        kv.wait(kv.push([1], [1.0]))
        node.finalize()

    logger = logging.getLogger("pslink.pslite")
    handlers = list(logger.handlers)
    try:
        with caplog.at_level(logging.DEBUG, logger="pslink.pslite"):
            run_nodes(1, worker, verbose=2)
    finally:  # PS_VERBOSE set the process's pslite logger, as in ps-lite: put it back
        logger.setLevel(logging.NOTSET)
        logger.handlers[:] = handlers
    messages = [r.getMessage() for r in caplog.records]
    assert any("-> server 0" in m and "KV_REQUEST" in m for m in messages)
    assert any("<-" in m and "KV_RESPONSE" in m for m in messages)
