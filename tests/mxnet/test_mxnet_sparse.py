"""Row-sparse keys of the pslink kvstore against MXNet's own store: the same rows after the same
pushes (MXNet's lazy updates: only pushed rows move), and gluon's sparse training accepted."""

from __future__ import annotations

import numpy as np
import pytest

mx = pytest.importorskip("mxnet", reason="MXNet 1.9.1 is not installed (CI installs it: pip install '.[mxnet]')")

import pslink  # noqa: E402
from pslink.mxnet import PSLinkKVStore  # noqa: E402
from tests.helpers import run_workers  # noqa: E402

SHAPE = (12, 3)


@pytest.fixture(scope="module")
def cluster(inproc_cluster):
    return inproc_cluster


def gradient(rank: int, step: int) -> mx.nd.NDArray:
    rng = np.random.default_rng(10 * rank + step)
    rows = np.sort(rng.choice(SHAPE[0], 4, replace=False))
    return mx.nd.sparse.row_sparse_array((rng.normal(size=(4, SHAPE[1])).astype(np.float32), rows), shape=SHAPE)


def initial() -> mx.nd.NDArray:
    return mx.nd.array(np.arange(np.prod(SHAPE), dtype=np.float32).reshape(SHAPE) / 10).tostype("row_sparse")


def make_optimizer(name: str):
    return mx.optimizer.create(name, learning_rate=0.1, rescale_grad=0.5, **({"momentum": 0.9} if name == "sgd" else {}))


def mxnet_reference(name: str, steps: int, workers: int) -> np.ndarray:
    """MXNet's own store: the workers' gradients pushed as devices' (summed), lazily applied."""
    kv = mx.kv.create("local")
    kv.init("emb", initial())
    kv.set_optimizer(make_optimizer(name))
    for step in range(steps):
        kv.push("emb", [gradient(r, step) for r in range(workers)])
    out = mx.nd.sparse.zeros("row_sparse", SHAPE)
    kv.row_sparse_pull("emb", out=out, row_ids=mx.nd.arange(SHAPE[0], dtype="int64"))
    return out.asnumpy()


@pytest.mark.parametrize("workers", [2, 4])
@pytest.mark.parametrize("name", ["sgd", "adam"])
def test_row_sparse_keys_are_updated_as_mxnets_store_updates_them(cluster, name, workers):
    service, transports = cluster
    steps = 4

    def worker(rank):
        agent = pslink.connect(f"rsp-{name}-{workers}", rank, workers, master=service.address, transports=transports,
                               timeout=20)
        kv = PSLinkKVStore(agent=agent)
        kv.init("emb", initial())
        kv.set_optimizer(make_optimizer(name))
        for step in range(steps):
            kv.push("emb", gradient(rank, step))
        out = mx.nd.sparse.zeros("row_sparse", SHAPE)
        kv.row_sparse_pull("emb", out=out, row_ids=mx.nd.array([11, 0, 3, 3, 5], dtype="int64"))
        some = (out.indices.asnumpy().tolist(), out.asnumpy())
        every = mx.nd.sparse.zeros("row_sparse", SHAPE)
        kv.row_sparse_pull("emb", out=every, row_ids=mx.nd.arange(SHAPE[0], dtype="int64"))
        with pytest.raises(mx.base.MXNetError, match="ignore_sparse=False"):
            kv.pull("emb", out=mx.nd.zeros(SHAPE), ignore_sparse=False)
        kv.pull("emb", out=mx.nd.zeros(SHAPE))  # ignore_sparse=True: skipped, as MXNet's store does
        agent.close()
        return some, every.asnumpy()

    expected = mxnet_reference(name, steps, workers)
    for (indices, some), every in run_workers(workers, worker):
        # Adam's square roots and divisions round differently in MXNet's kernel than in numpy, and
        # four workers' rows are summed in rank order here, MXNet's devices' in its own.
        rtol = (1e-6 if name == "sgd" else 1e-5) * (1 if workers == 2 else 5)
        np.testing.assert_allclose(every, expected, rtol=rtol, atol=1e-7)
        assert indices == [0, 3, 5, 11]  # the rows asked for, each once, in order; the others read as zeros
        np.testing.assert_array_equal(some[[0, 3, 5, 11]], every[[0, 3, 5, 11]])
        assert not some[[1, 2, 4]].any()


def test_gluon_trains_a_row_sparse_weight_and_a_sparse_gradient_on_the_store(cluster):
    service, transports = cluster

    def worker(rank):
        agent = pslink.connect("rsp-gluon", rank, 2, master=service.address, transports=transports, timeout=20)
        kv = PSLinkKVStore(agent=agent)
        mx.random.seed(0)
        sparse_weight = mx.gluon.contrib.nn.SparseEmbedding(20, 4)
        sparse_grad = mx.gluon.nn.Embedding(20, 4, sparse_grad=True)
        for block in (sparse_weight, sparse_grad):
            block.initialize(mx.init.Constant(1.0))
        params = sparse_weight.collect_params()
        params.update(sparse_grad.collect_params())
        trainer = mx.gluon.Trainer(params, "sgd", {"learning_rate": 0.5}, kvstore=kv)
        ids = mx.nd.array([[1, 2], [2, 5]]) if rank == 0 else mx.nd.array([[5, 7], [7, 7]])
        for _ in range(2):
            weight = sparse_weight.weight.row_sparse_data(ids)
            with mx.autograd.record():
                loss = mx.nd.Embedding(ids, weight, 20, 4, sparse_grad=True).sum() + sparse_grad(ids).sum()
            loss.backward()
            trainer.step(1)
        rows = sparse_weight.weight.row_sparse_data(mx.nd.arange(20)).asnumpy()
        dense = sparse_grad.weight.data().asnumpy()
        agent.close()
        return rows, dense

    for rows, dense in run_workers(2, worker):
        # Each step: a row's gradient is how often the batch holds it, summed over both workers.
        counts = np.bincount([1, 2, 2, 5, 5, 7, 7, 7], minlength=20)
        np.testing.assert_allclose(rows[:, 0], 1.0 - 2 * 0.5 * counts, rtol=1e-6)
        np.testing.assert_allclose(dense[:, 0], 1.0 - 2 * 0.5 * counts, rtol=1e-6)


def test_one_call_may_hold_dense_and_row_sparse_keys_as_with_mxnets_store(cluster):
    """init and push of a list mixing a dense key and a row-sparse one (a list of one value for
    the row-sparse key, as MXNet accepts): each key goes its own way, as in MXNet's local store."""
    service, transports = cluster
    dense, rows = mx.nd.ones((3, 2)), initial()

    def run(kv):
        kv.set_optimizer(mx.optimizer.create("sgd", learning_rate=0.1))  # before init (the service's rule)
        kv.init(["d", "r"], [dense, [rows]])
        for step in range(2):
            kv.push(["d", "r"], [mx.nd.full((3, 2), step + 1.0), gradient(0, step)])
        d, r = mx.nd.zeros((3, 2)), mx.nd.sparse.zeros("row_sparse", SHAPE)
        kv.pull("d", out=d)
        kv.row_sparse_pull("r", out=r, row_ids=mx.nd.arange(SHAPE[0], dtype="int64"))
        return d.asnumpy(), r.asnumpy()

    expected = run(mx.kv.create("local"))
    agent = pslink.connect("mixed", 0, 1, master=service.address, transports=transports, timeout=20)
    try:
        got = run(PSLinkKVStore(agent=agent))
    finally:
        agent.close()
    np.testing.assert_allclose(got[0], expected[0], rtol=1e-6)
    np.testing.assert_allclose(got[1], expected[1], rtol=1e-6)


def test_a_pull_into_row_sparse_arrays_is_ignored_as_with_mxnets_store(cluster):
    """MXNet's stores skip a pull's row_sparse outputs (ignore_sparse=True, the default; dense
    outputs of the same call are written) and, with ignore_sparse=False, write the value into
    them (the local store; its dist stores refuse). MXNet's unit test test_invalid_pull checks
    the first."""
    service, transports = cluster

    def run(kv):
        kv.init("d", mx.nd.full((3, 2), 5.0))
        kept = mx.nd.full((3, 2), 2.0).tostype("row_sparse")
        dense = mx.nd.zeros((3, 2))
        kv.pull("d", out=kept)
        kv.pull("d", out=[kept, dense])
        ignored = (kept.asnumpy().copy(), dense.asnumpy().copy())
        written = mx.nd.sparse.zeros("row_sparse", (3, 2))
        kv.pull("d", out=written, ignore_sparse=False)
        return ignored, written.asnumpy()

    expected = run(mx.kv.create("local"))
    agent = pslink.connect("rsp-outs", 0, 1, master=service.address, transports=transports, timeout=20)
    try:
        with pytest.warns(UserWarning, match=r"pull of key 'd' into 1 row_sparse array\(s\) ignored"):
            (kept, dense), written = run(PSLinkKVStore(agent=agent))
    finally:
        agent.close()
    np.testing.assert_array_equal(kept, np.full((3, 2), 2.0))  # untouched
    np.testing.assert_array_equal(dense, np.full((3, 2), 5.0))
    np.testing.assert_array_equal(written, np.full((3, 2), 5.0))
    np.testing.assert_array_equal(kept, expected[0][0])
    np.testing.assert_array_equal(dense, expected[0][1])
    np.testing.assert_array_equal(written, expected[1])
