"""Lists of keys, a list of values per key (one per device) and lists of outputs, with 2 and 4
workers, against MXNet's own store holding every worker's devices."""

from __future__ import annotations

import numpy as np
import pytest

mx = pytest.importorskip("mxnet", reason="MXNet 1.9.1 is not installed (CI installs it: pip install '.[mxnet]')")

import pslink  # noqa: E402
from pslink.mxnet import PSLinkKVStore  # noqa: E402
from tests.helpers import run_workers  # noqa: E402

KEYS, SHAPES, DEVICES = ["weight", "bias"], [(4, 3), (5,)], 2


@pytest.fixture(scope="module")
def cluster(inproc_cluster):
    return inproc_cluster


def values(rank: int, step: int) -> list[list]:
    """Per key, this worker's per-device values (integers: every sum is exact)."""
    rng = np.random.default_rng(100 * rank + step)
    return [[mx.nd.array(rng.integers(-9, 9, shape)) for _ in range(DEVICES)] for shape in SHAPES]


def initial() -> list:
    return [mx.nd.array(np.arange(np.prod(shape)).reshape(shape)) for shape in SHAPES]


@pytest.mark.parametrize("workers", [2, 4])
def test_lists_of_keys_devices_and_outputs_as_mxnets_store(cluster, workers):
    service, transports = cluster
    kv = mx.kv.create("local")
    kv.init(KEYS, initial())
    reference = []
    for step in range(3):
        # every worker's devices, as one store's devices: the sum MXNet's dist_sync makes
        kv.push(KEYS, [sum((values(r, step)[k] for r in range(workers)), []) for k in range(len(KEYS))])
        outs = [[mx.nd.zeros(shape) for _ in range(DEVICES)] for shape in SHAPES]
        kv.pull(KEYS, out=outs)
        reference.append([[o.asnumpy() for o in per_key] for per_key in outs])

    def worker(rank):
        agent = pslink.connect(f"lists-{workers}", rank, workers, master=service.address, transports=transports,
                               timeout=20)
        store = PSLinkKVStore(agent=agent)
        store.init(KEYS, initial())
        seen = []
        for step in range(3):
            store.push(KEYS, values(rank, step))
            outs = [[mx.nd.zeros(shape) for _ in range(DEVICES)] for shape in SHAPES]
            store.pull(KEYS, out=outs)
            seen.append([[o.asnumpy() for o in per_key] for per_key in outs])
        # pushpull of a list, results into the values' own arrays; broadcast of a new key to 2 outputs
        pushed = values(rank, 9)
        store.pushpull(KEYS, pushed)
        targets = [mx.nd.zeros((2,)), mx.nd.zeros((2,))]
        store.broadcast("new", mx.nd.array([rank + 1.0, 7.0]), out=targets)
        agent.close()
        return seen, [[a.asnumpy() for a in per_key] for per_key in pushed], [t.asnumpy() for t in targets]

    summed = [sum(values(r, 9)[k][d].asnumpy() for r in range(workers) for d in range(DEVICES))
              for k in range(len(KEYS))]
    for seen, pushed, targets in run_workers(workers, worker):
        for got_step, want_step in zip(seen, reference):
            for got_key, want_key in zip(got_step, want_step):
                for got, want in zip(got_key, want_key):
                    np.testing.assert_array_equal(got, want)
        for k in range(len(KEYS)):
            for device in range(DEVICES):
                np.testing.assert_array_equal(pushed[k][device], summed[k])
        for target in targets:  # rank 0's value, in every output
            np.testing.assert_array_equal(target, [1.0, 7.0])
