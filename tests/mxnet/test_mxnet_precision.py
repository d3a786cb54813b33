"""multi_precision on the service: float16 keys stepped through a float32 master copy, as MXNet's
updater does, checked against MXNet's own store for several of its optimizers."""

from __future__ import annotations

import numpy as np
import pytest

mx = pytest.importorskip("mxnet", reason="MXNet 1.9.1 is not installed (CI installs it: pip install '.[mxnet]')")

import pslink  # noqa: E402
from pslink.core.transport import Transports  # noqa: E402
from pslink.mxnet import PSLinkKVStore  # noqa: E402
from tests.helpers import run_workers, start_cluster  # noqa: E402

SHAPE, STEPS = (6, 4), 6
OPTIMIZERS = {
    "sgd": {"momentum": 0.9, "wd": 1e-3},
    "adam": {},
    "nag": {"momentum": 0.9},
    "adagrad": {},
    "rmsprop": {},
}


@pytest.fixture(scope="module")
def cluster():
    transports = Transports()
    service = start_cluster("inproc", aggregators=2, transports=transports)
    yield service, transports
    service.stop()
    transports.close()


def make(name: str):
    return mx.optimizer.create(name, learning_rate=0.05, rescale_grad=0.5, multi_precision=True, **OPTIMIZERS[name])


def gradient(rank: int, step: int) -> np.ndarray:
    return np.random.default_rng(10 * rank + step).normal(size=SHAPE).astype(np.float16)


def initial() -> np.ndarray:
    return np.linspace(-1, 1, np.prod(SHAPE)).reshape(SHAPE).astype(np.float16)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_float16_keys_step_through_a_float32_master_copy_as_mxnet_does(cluster, name):
    service, transports = cluster
    kv = mx.kv.create("local")
    kv.init(0, mx.nd.array(initial(), dtype="float16"))
    kv.set_optimizer(make(name))
    for step in range(STEPS):  # the two workers' gradients as two devices' (summed), as dist_sync sums them
        kv.push(0, [mx.nd.array(gradient(r, step), dtype="float16") for r in range(2)])
    expected = mx.nd.zeros(SHAPE, dtype="float16")
    kv.pull(0, out=expected)

    def worker(rank):
        agent = pslink.connect(f"mp-{name}", rank, 2, master=service.address, transports=transports, timeout=20)
        store = PSLinkKVStore(agent=agent)
        store.set_optimizer(make(name))
        store.init(0, mx.nd.array(initial(), dtype="float16"))
        out = mx.nd.zeros(SHAPE, dtype="float16")
        for step in range(STEPS):
            store.push(0, mx.nd.array(gradient(rank, step), dtype="float16"))
            store.pull(0, out=out)
        agent.close()
        return out.asnumpy()

    want = expected.asnumpy()
    for got in run_workers(2, worker):
        # Bit for bit (stepped in float16 alone, 30-50% of the weights would differ in their last bit).
        assert got.dtype == np.float16
        np.testing.assert_array_equal(got, want)
