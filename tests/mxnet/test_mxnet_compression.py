"""MXNet's 2-bit gradient compression through the pslink store, against MXNet's own store with
the same compression (its 'device' store, one device per worker): the same sums and the same
weights after several rounds, residuals carried over; 2 and 4 workers."""

from __future__ import annotations

import numpy as np
import pytest

mx = pytest.importorskip("mxnet", reason="MXNet 1.9.1 is not installed (CI installs it: pip install '.[mxnet]')")

import pslink  # noqa: E402
from pslink.mxnet import PSLinkKVStore  # noqa: E402
from tests.helpers import run_workers  # noqa: E402

# MXNet's default threshold: +-0.5 and their sums are exact in float32, whatever order the workers'
# pushes are added in (the service adds them as they come, MXNet's store device by device).
SHAPE, ROUNDS, COMPRESSION = (7, 5), 5, {"type": "2bit", "threshold": 0.5}


@pytest.fixture(scope="module")
def cluster(inproc_cluster):
    return inproc_cluster


def gradient(rank: int, step: int) -> np.ndarray:
    return np.random.default_rng(100 * rank + step).normal(scale=0.5, size=SHAPE).astype(np.float32)


def mxnet_reference(workers: int, with_optimizer: bool) -> list[np.ndarray]:
    kv = mx.kv.create("device")
    kv.set_gradient_compression(COMPRESSION)
    kv.init(3, mx.nd.ones(SHAPE))
    if with_optimizer:
        kv.set_optimizer(mx.optimizer.create("sgd", learning_rate=0.1))
    out, seen = mx.nd.zeros(SHAPE), []
    for step in range(ROUNDS):
        kv.push(3, [mx.nd.array(gradient(r, step), ctx=mx.cpu(r)) for r in range(workers)])
        kv.pull(3, out=out)
        seen.append(out.asnumpy())
    return seen


@pytest.mark.parametrize("workers", [2, 4])
@pytest.mark.parametrize("with_optimizer", [False, True])
def test_two_bit_pushes_sum_as_mxnets_own_store_sums_them(cluster, workers, with_optimizer):
    service, transports = cluster

    def worker(rank):
        agent = pslink.connect(f"cmp-{workers}-{with_optimizer}", rank, workers, master=service.address,
                               transports=transports, timeout=20)
        kv = PSLinkKVStore(agent=agent)
        kv.set_gradient_compression(COMPRESSION)
        if with_optimizer:
            kv.set_optimizer(mx.optimizer.create("sgd", learning_rate=0.1))
        kv.init(3, mx.nd.ones(SHAPE))
        out, seen = mx.nd.zeros(SHAPE), []
        for step in range(ROUNDS):
            kv.push(3, mx.nd.array(gradient(rank, step)))
            kv.pull(3, out=out)
            seen.append(out.asnumpy())
        sent = agent.payload_bytes
        agent.close()
        return seen, sent

    expected = mxnet_reference(workers, with_optimizer)
    for seen, sent in run_workers(workers, worker):
        for got, want in zip(seen, expected):
            np.testing.assert_array_equal(got, want)
        # rank 0's init sends 35 float32 (140 B); each push 35 values at 2 bits (9 B): 16x fewer than 140
        assert sent in (ROUNDS * 9, 140 + ROUNDS * 9)


def test_a_bad_compression_setting_is_an_mxnet_error(cluster):
    service, transports = cluster
    agent = pslink.connect("cmp-bad", 0, 1, master=service.address, transports=transports)
    kv = PSLinkKVStore(agent=agent)
    with pytest.raises(mx.base.MXNetError, match="type '1bit' is not supported"):
        kv.set_gradient_compression({"type": "1bit"})
    with pytest.raises(mx.base.MXNetError, match="takes a dict with 'type'"):
        kv.set_gradient_compression({"threshold": 0.5})
    agent.close()
