"""Fusion of small requests (pslink.core.transport.fused, pslink.core.agent.requests): an Agent's small
requests for one Aggregator travel as one FUSED message and come back as one, with every key's
result, round and error its own."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest

import pslink
from pslink.core.transport import Transports
from pslink.core.transport.fused import fuse
from pslink.core.wire.protocol import Op, decode, encode
from pslink.errors import AbortedError, AuthError
from tests.helpers import RawClient, run_workers, start_cluster


@pytest.fixture(scope="module")
def cluster(tcp_cluster):
    return tcp_cluster


def fused_count(service) -> int:
    return sum(agg.fused for agg in service.provider.aggregators.values())


def agent_for(service, transports, job, rank, workers, **options):
    return pslink.connect(job, rank, workers, master=service.address, transports=transports, timeout=20.0, **options)


def train(service, transports, job: str, fusion_bytes: int, steps: int = 4) -> list[list[np.ndarray]]:
    """2 workers, 150 keys of 1-600 float32 (some partitioned), each step's pushes all in flight
    before the first wait; returns every worker's results of the last step."""
    sizes = [1 + (37 * i) % 600 for i in range(150)]
    keys = [f"w{i}" for i in range(len(sizes))]

    def worker(rank):
        agent = agent_for(service, transports, job, rank, 2, fusion_bytes=fusion_bytes, partition_bytes=1024)
        try:
            rng = np.random.default_rng(rank)
            agent.init_many(keys, [np.zeros(n, np.float32) for n in sizes]).wait()
            outs = [np.empty(n, np.float32) for n in sizes]
            for step in range(steps):
                grads = [rng.standard_normal(n).astype(np.float32) for n in sizes]
                handles = [agent.pushpull(k, g, o, average=True) for k, g, o in zip(keys, grads, outs)]
                for handle in handles:
                    handle.wait()
            return outs
        finally:
            agent.close()

    return run_workers(2, worker)


def test_fused_and_unfused_results_are_bit_identical(cluster):
    service, transports = cluster
    before = fused_count(service)
    unfused = train(service, transports, "unfused", fusion_bytes=0)
    assert fused_count(service) == before  # fusion off: not one request came fused
    fused = train(service, transports, "fused", fusion_bytes=1 << 20)
    assert fused_count(service) - before > 100  # most of the 2 x 4 x 150 requests came fused
    for rank in range(2):
        for a, b in zip(fused[rank], unfused[rank]):
            assert a.tobytes() == b.tobytes()
    for a, b in zip(fused[0], fused[1]):
        assert a.tobytes() == b.tobytes()


def test_one_keys_error_in_a_fused_message_fails_only_its_handle(cluster):
    service, transports = cluster
    agent = agent_for(service, transports, "one-bad", 0, 1)
    try:
        keys = [f"k{i}" for i in range(40)]
        agent.init_many(keys, [np.full(8, i, np.float32) for i in range(len(keys))]).wait()
        # Abort key k39 for good (as a refused request does): its Aggregator answers it with the error.
        info = agent._keys["k39"]
        agent._tasks.abort_key(info, AbortedError("key 'k39' was aborted by the test"))
        for _ in range(100):  # the ABORT is a message of its own: answered once it has been handled
            try:
                agent.pull("k39").wait()
            except AbortedError:
                break
        else:
            pytest.fail("the abort of key 'k39' never arrived")
        before = fused_count(service)
        # A burst: past the first few in flight on a link, requests travel fused (the last, k39, among them).
        handles = [agent.pushpull(k, np.ones(8, np.float32)) for k in keys]
        with pytest.raises(AbortedError, match="aborted by the test"):
            handles[39].wait()
        for i, handle in enumerate(handles):
            if i != 39:
                np.testing.assert_array_equal(handle.wait(), np.ones(8, np.float32))
        assert fused_count(service) - before >= 10
    finally:
        agent.close()


def items(header: dict) -> list[dict]:
    """A reply's items: those of a FUSED message, or the reply itself."""
    if header["op"] != Op.FUSED:
        return [header]
    return [msgpack.unpackb(raw) for raw in header["items"]]


def test_each_item_is_checked_on_its_own_and_a_message_holds_one_job():
    transports = Transports()
    service = start_cluster("tcp", aggregators=1, transports=transports)  # both jobs' keys on it
    first = agent_for(service, transports, "owner", 0, 1)
    second = agent_for(service, transports, "other", 0, 1)
    raw = None
    try:
        first.init("w", np.zeros(4, np.float32)).wait()
        part = first.key_info("w")["parts"][0]
        name = "v"
        second.init(name, np.zeros(4, np.float32)).wait()
        raw = RawClient(part[4], transports)
        fields = dict(rank=0, key="w", part=0, dtype="float32", shape=[4], span=[0, 4])
        good = [encode(Op.PUSHPULL, id=1, job="owner", tok=first.token, rnd=1, **fields), np.ones(4, np.float32)]
        forged = [encode(Op.PUSHPULL, id=2, job="owner", tok=b"not-the-token", rnd=2, **fields), np.ones(4, np.float32)]
        garbage = [b"\x81\xa1v\x07"]  # a map with a protocol version nobody speaks
        mixed = [encode(Op.PULL, id=4, job="other", tok=second.token, rnd=0, **{**fields, "key": name})]
        messages = [good, forged, garbage, mixed]
        raw.send(*fuse(messages))
        replies: dict[int, dict] = {}
        while len(replies) < len(messages) - 1:  # the garbage has no id to answer
            header, payloads = raw.reply()
            for item in items(header):
                replies[item["id"]] = item
        assert replies[1]["op"] == Op.REPLY and replies[1]["rnd"] == 1
        assert replies[2]["op"] == Op.ERROR and replies[2]["code"] == AuthError.code
        assert replies[4]["op"] == Op.ERROR and "one job per message" in replies[4]["msg"]
        # A FUSED message may carry data requests only.
        raw.send(*fuse([[encode(Op.PING, id=9)], [encode(Op.PULL, id=10, job="owner", tok=first.token, rnd=1,
                                                        **fields)]]))
        seen: dict[int, dict] = {}
        while len(seen) < 2:
            header, payloads = raw.reply()
            for item in items(header):
                seen[item["id"]] = item
        assert seen[9]["op"] == Op.ERROR and "cannot travel in a FUSED message" in seen[9]["msg"]
        assert seen[10]["op"] == Op.REPLY
        # The workers are still served (the raw client's round 1 was the worker's too).
        assert first.pushpull("w", np.ones(4, np.float32)).wait().shape == (4,)
        np.testing.assert_array_equal(second.pushpull(name, np.ones(4, np.float32)).wait(), np.ones(4, np.float32))
    finally:
        if raw is not None:
            raw.close()
        first.close()
        second.close()
        service.stop()
        transports.close()


def test_an_agents_fused_messages_hold_its_own_job_only(cluster):
    service, transports = cluster
    seen: list[set] = []
    for agg in service.provider.aggregators.values():
        original = agg._fused_header

        def recording(conn, header, sizes, original=original):
            seen.append({decode(raw, ())["job"] if not s else decode(raw, s)["job"] for raw, s in
                         zip(header["items"], _sizes(header, sizes))})
            return original(conn, header, sizes)

        agg._fused_header = recording
    try:
        keys = [f"k{i}" for i in range(60)]

        def worker(index):
            agent = agent_for(service, transports, f"tenant-{index}", 0, 1)
            try:
                agent.init_many(keys, [np.zeros(16, np.float32)] * len(keys)).wait()
                for _ in range(3):
                    for handle in [agent.pushpull(k, np.ones(16, np.float32)) for k in keys]:
                        handle.wait()
            finally:
                agent.close()

        run_workers(2, worker)
    finally:
        for agg in service.provider.aggregators.values():
            agg.__dict__.pop("_fused_header", None)
    assert seen and all(len(jobs) == 1 for jobs in seen)
    assert {job for jobs in seen for job in jobs} == {"tenant-0", "tenant-1"}


def _sizes(header: dict, sizes: tuple) -> list[tuple]:
    out, position = [], 0
    for count in header["np"]:
        out.append(tuple(sizes[position: position + count]))
        position += count
    return out
