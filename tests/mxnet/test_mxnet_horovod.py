"""Horovod's MXNet API (pslink.mxnet.horovod): collectives, DistributedTrainer and
DistributedOptimizer, on ranks that are threads of this process (one Session each)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

mx = pytest.importorskip("mxnet", reason="MXNet 1.9.1 is not installed (CI installs it: pip install '.[mxnet]')")

import pslink  # noqa: E402
from pslink.errors import ConfigError, ShapeMismatchError  # noqa: E402
from pslink.mxnet import horovod as hvd  # noqa: E402
from tests.helpers import run_workers  # noqa: E402

_jobs = itertools.count()


@pytest.fixture(scope="module")
def cluster(inproc_cluster):
    return inproc_cluster


def on_ranks(cluster, size: int, fn) -> list:
    service, transports = cluster
    job = f"mxhvd-{next(_jobs)}"

    def body(rank):
        session = hvd.Session(pslink.connect(job, rank, size, master=service.address, transports=transports,
                                             timeout=30.0, mode="sum"))
        try:
            return fn(session)
        finally:
            session.close()

    return run_workers(size, body)


def test_allreduce_broadcast_allgather_and_objects(cluster):
    def body(s):
        r = s.rank + 1
        mean = s.allreduce(mx.nd.array([1.0, 2.0]) * r, name="mean")
        total = s.allreduce(mx.nd.array([3, 7], dtype="int32") * r, op=hvd.Sum)  # unnamed
        ints = s.allreduce(mx.nd.array([3, 7], dtype="int64") * r, name="ints")  # an integer mean truncates
        scaled = s.allreduce(mx.nd.ones((2,)) * r, name="scaled", prescale_factor=2.0, postscale_factor=10.0)
        value = mx.nd.array([-0.0, 1.5]) if s.rank == 1 else mx.nd.array([5.0, 5.0])
        s.broadcast_(value, root_rank=1, name="value")
        rows = s.allgather(mx.nd.ones((r, 2)) * s.rank, name="rows")
        obj = s.broadcast_object({"from": s.rank} if s.rank == 0 else None, root_rank=0)
        low = s.allreduce(mx.nd.array([1.5 * r, -r]), name="min", op=hvd.Min)
        product = s.allreduce(mx.nd.array([r + 1, 3], dtype="int64"), op=hvd.Product)
        objects = s.allgather_object(("rank", s.rank))
        with pytest.raises(ConfigError, match="root_rank must be an int in \\[0, 2\\), got 2"):
            s.broadcast_(mx.nd.ones((1,)), root_rank=2)
        return mean, total, ints, scaled, value, rows, obj, low, product, objects

    for mean, total, ints, scaled, value, rows, obj, low, product, objects in on_ranks(cluster, 2, body):
        assert low.asnumpy().tolist() == [1.5, -2.0] and product.asnumpy().tolist() == [6, 9]
        assert objects == [("rank", 0), ("rank", 1)]
        assert mean.asnumpy().tolist() == [1.5, 3.0]
        assert total.dtype == np.int32 and total.asnumpy().tolist() == [9, 21]
        assert ints.asnumpy().tolist() == [4, 10]
        assert scaled.asnumpy().tolist() == [30.0, 30.0]  # (2*1 + 2*2) / 2 * 10
        got = value.asnumpy()
        assert np.signbit(got[0]) and got[1] == 1.5  # the root's bits, -0.0 included
        assert rows.asnumpy().tolist() == [[0.0, 0.0], [1.0, 1.0], [1.0, 1.0]]
        assert obj == {"from": 0}


def test_reducescatter_alltoall_and_grouped_collectives_as_horovod_splits(cluster):
    def body(s):
        r = s.rank
        x = mx.nd.array(np.arange(10, dtype=np.float32).reshape(5, 2) * (r + 1))
        mine = s.reducescatter(x, op=hvd.Sum, name="rs")  # 5 rows over 2 ranks: 3 and 2
        mean = s.reducescatter(x)  # unnamed: matched by position
        even = s.alltoall(mx.nd.arange(4) + 10 * r)  # two elements to each rank; unnamed
        rows = mx.nd.array(np.arange(3 * 2, dtype=np.float32).reshape(3, 2) + 100 * r)
        splits = [1, 2] if r == 0 else [2, 1]
        got, counts = s.alltoall(rows, splits=splits, name="uneven")
        with pytest.raises(ConfigError, match=r"splits \[1, 1\] must be 2 counts >= 0 adding up to the tensor's 3 rows"):
            s.alltoall(rows, splits=[1, 1], name="bad")
        return mine.asnumpy(), mean.asnumpy(), even.asnumpy(), got.asnumpy(), counts.asnumpy()

    results = on_ranks(cluster, 2, body)
    total = np.arange(10, dtype=np.float32).reshape(5, 2) * 3
    for r, (mine, mean, even, got, counts) in enumerate(results):
        share = slice(0, 3) if r == 0 else slice(3, 5)
        np.testing.assert_array_equal(mine, total[share])
        np.testing.assert_array_equal(mean, total[share] / 2)
        np.testing.assert_array_equal(even, [2 * r, 2 * r + 1, 10 + 2 * r, 11 + 2 * r])
        sent = [[1, 2], [2, 1]]
        np.testing.assert_array_equal(counts, [sent[0][r], sent[1][r]])
    rows = [np.arange(6, dtype=np.float32).reshape(3, 2) + 100 * r for r in range(2)]
    np.testing.assert_array_equal(results[0][3], np.concatenate([rows[0][:1], rows[1][:2]]))
    np.testing.assert_array_equal(results[1][3], np.concatenate([rows[0][1:], rows[1][2:]]))


def test_shapes_that_differ_fail_on_every_rank(cluster):
    def body(s):
        with pytest.raises(ShapeMismatchError):
            s.allreduce(mx.nd.ones((3 + s.rank,)), name="loss")
        return True

    assert on_ranks(cluster, 2, body) == [True, True]


def net_and_data(rank: int, seed: int = 0):
    net = mx.gluon.nn.Dense(3, in_units=4)
    net.initialize(mx.init.Constant(0.1))
    rng = np.random.default_rng(10 + rank)
    x = mx.nd.array(rng.standard_normal((8, 4)))
    y = mx.nd.array(rng.integers(0, 3, 8))
    return net, x, y


def train_steps(net, trainer, x, y, steps: int, batch: int) -> list:
    loss_fn = mx.gluon.loss.SoftmaxCrossEntropyLoss()
    for _ in range(steps):
        with mx.autograd.record():
            loss = loss_fn(net(x), y)
        loss.backward()
        trainer.step(batch)
    return [p.data().asnumpy() for p in net.collect_params().values()]


def test_distributed_trainer_equals_one_process_on_the_combined_batch(cluster):
    def body(s):
        net, x, y = net_and_data(s.rank)
        trainer = hvd.DistributedTrainer(net.collect_params(), "sgd", {"learning_rate": 0.5, "momentum": 0.9},
                                         session=s)
        return train_steps(net, trainer, x, y, 4, 8)

    results = on_ranks(cluster, 2, body)
    reference, x0, y0 = net_and_data(0)
    _, x1, y1 = net_and_data(1)
    trainer = mx.gluon.Trainer(reference.collect_params(), "sgd", {"learning_rate": 0.5, "momentum": 0.9},
                               kvstore=None)
    expected = train_steps(reference, trainer, mx.nd.concat(x0, x1, dim=0), mx.nd.concat(y0, y1, dim=0), 4, 16)
    for weights in results:
        for got, want in zip(weights, expected, strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_distributed_trainer_with_fp16_compression_sends_float16_and_steps_in_float32(cluster):
    sent = []

    class Counting(hvd.Compression.fp16):
        @staticmethod
        def compress(tensor):
            out = hvd.Compression.fp16.compress(tensor)
            sent.append(out[0].dtype)
            return out

    def body(s):
        net = mx.gluon.nn.Dense(1, in_units=2, use_bias=False)
        net.initialize(mx.init.Constant(1.0))
        trainer = hvd.DistributedTrainer(net.collect_params(), "sgd", {"learning_rate": 0.5}, session=s,
                                         compression=Counting)
        with mx.autograd.record():
            loss = net(mx.nd.array([[1.0, 2.0]]) * (s.rank + 1)).sum()  # gradient (rank + 1) * [1, 2]
        loss.backward()
        trainer.step(1)
        weight = net.weight.data()
        return weight.dtype, weight.asnumpy().tolist()

    for dtype, weight in on_ranks(cluster, 2, body):
        # the average gradient, 1.5 x [1, 2], is exact in float16: w = 1 - 0.5 * [1.5, 3]
        assert dtype == np.float32 and weight == [[0.25, -0.5]]
    assert sent == [np.float16, np.float16]
    with pytest.raises(ConfigError, match="Compression.none or hvd.Compression.fp16"):
        hvd.DistributedTrainer(mx.gluon.nn.Dense(1, in_units=2).collect_params(), "sgd", compression="fp32",
                               session=object())


def test_join_lets_a_rank_out_of_data_mirror_the_others_steps_with_zeros(cluster):
    def body(s):
        net = mx.gluon.nn.Dense(1, in_units=2, use_bias=False)
        net.initialize(mx.init.Constant(1.0))
        trainer = hvd.DistributedTrainer(net.collect_params(), "sgd", {"learning_rate": 0.5}, session=s)
        for _ in range(3 if s.rank == 0 else 1):  # rank 1 has one batch, rank 0 three
            with mx.autograd.record():
                loss = net(mx.nd.array([[1.0, 2.0]]) * (s.rank + 1)).sum()  # gradient (rank + 1) * [1, 2]
            loss.backward()
            trainer.step(1)
        last = s.join()
        return last, net.weight.data().asnumpy().tolist()

    (last0, weight0), (last1, weight1) = on_ranks(cluster, 2, body)
    assert last0 == last1 == 0  # rank 0 joined last
    # step 1: the average of both, 1.5 x [1, 2]; steps 2 and 3: rank 0's and rank 1's zeros, 0.5 x [1, 2]
    assert weight0 == [[1 - 0.5 * 1.5 - 2 * 0.5 * 0.5, 1 - 0.5 * 3.0 - 2 * 0.5 * 1.0]]
    assert weight1 == [[1 - 0.5 * 1.5, 1 - 0.5 * 3.0]]  # not stepped while joined


def test_process_sets_reduce_among_their_ranks(cluster):
    """Horovod's process sets (pslink.core.worker.process_sets, as pslink.torch's): every rank adds every
    set in the same order; a set's collectives count its ranks only; a rank outside a set may not
    use it; a removed set is gone; the job itself is untouched."""
    def body(s):
        sets = s.process_sets
        evens = sets.add(s, [2, 0])  # ranks 0 and 2, numbered 0 and 1 inside
        pair = sets.add(s, hvd.ProcessSet([1, 2]))
        with pytest.raises(ConfigError, match="exists already"):
            sets.add(s, [0, 2])
        out = {"ids": (evens.process_set_id, pair.process_set_id), "sizes": (evens.size(), pair.size()),
               "ranks": (evens.rank(), pair.rank())}
        x = mx.nd.full((2,), float(s.rank + 1))
        for label, ps in (("evens", evens), ("pair", pair)):
            if ps.included():
                out[label] = sets.session_for(s, ps).allreduce(x, name="x", op=hvd.Sum).asnumpy().tolist()
            else:
                with pytest.raises(ConfigError, match=f"rank {s.rank} is not in ProcessSet"):
                    sets.session_for(s, ps)
        assert sets.remove(evens) and not sets.remove(evens)
        with pytest.raises(ConfigError, match="is not added"):
            sets.session_for(s, evens)
        out["world_sum"] = s.allreduce(x, name="after", op=hvd.Sum).asnumpy().tolist()
        return out

    results = on_ranks(cluster, 3, body)
    for rank, out in enumerate(results):
        assert out["ids"] == (1, 2) and out["sizes"] == (2, 2)
        assert out["ranks"] == {0: (0, -1), 1: (-1, 0), 2: (1, 1)}[rank]
        assert out.get("evens") == ([4.0, 4.0] if rank in (0, 2) else None)  # 1 + 3
        assert out.get("pair") == ([5.0, 5.0] if rank in (1, 2) else None)  # 2 + 3
        assert out["world_sum"] == [6.0, 6.0]


def test_the_module_functions_take_a_process_set():
    import inspect

    for name in ("allreduce", "allreduce_", "grouped_allreduce", "allgather", "grouped_allgather", "reducescatter",
                 "alltoall", "broadcast", "broadcast_", "broadcast_object", "allgather_object", "barrier"):
        assert "process_set" in inspect.signature(getattr(hvd, name)).parameters, name
    assert hvd.global_process_set.ranks is None and isinstance(hvd.global_process_set, hvd.ProcessSet)


def test_distributed_optimizer_averages_each_gradient_before_its_update(cluster):
    def body(s):
        optimizer = hvd.DistributedOptimizer(mx.optimizer.SGD(learning_rate=0.1), session=s)
        weight = mx.nd.ones((3,))
        grad = mx.nd.array([1.0, 2.0, 3.0]) * (s.rank + 1)
        optimizer.update(0, weight, grad, optimizer.create_state_multi_precision(0, weight))
        return weight.asnumpy()

    for weight in on_ranks(cluster, 2, body):
        # the average gradient is 1.5 x [1, 2, 3]; SGD: w - 0.1 * g
        np.testing.assert_allclose(weight, 1.0 - 0.1 * 1.5 * np.array([1.0, 2.0, 3.0]), rtol=1e-6)


def test_broadcast_parameters_gives_every_rank_the_roots(cluster):
    def body(s):
        net = mx.gluon.nn.Dense(2, in_units=3, bias_initializer=mx.init.Constant(float(s.rank + 1)))
        net.initialize(mx.init.Constant(float(s.rank + 1)))
        s.broadcast_parameters(net.collect_params(), root_rank=1)
        arrays = {"a": mx.nd.ones((2,)) * s.rank}
        s.broadcast_parameters(arrays, root_rank=0)
        return [p.data().asnumpy() for p in net.collect_params().values()], arrays["a"].asnumpy()

    for params, array in on_ranks(cluster, 2, body):
        assert all((p == 2.0).all() for p in params)
        assert array.tolist() == [0.0, 0.0]


def test_the_module_api_names_horovods_functions():
    for name in ("init", "shutdown", "rank", "size", "local_rank", "allreduce", "allreduce_", "allgather",
                 "broadcast", "broadcast_", "broadcast_parameters", "broadcast_object", "DistributedTrainer",
                 "DistributedOptimizer", "Average", "Sum", "HorovodInternalError", "mpi_built", "nccl_built"):
        assert hasattr(hvd, name), name
    with pytest.raises(ConfigError, match="has not been initialized"):
        hvd.rank()


def test_distributed_trainers_as_two_groups_syncing_every_step_equal_the_flat_job(cluster):
    """4 ranks as 2 groups of 2 (sync="local:1"): each group averages over its 2 ranks, and the
    groups' weights are averaged after every step (momentum SGD is linear in the gradients):
    the flat 4-rank job's weights; with sync="local:3" the groups part between syncs."""
    service, transports = cluster

    def run(job, steps, **options):
        def body(rank):
            agent = pslink.connect(job, rank, 4, master=service.address, transports=transports, timeout=30.0,
                                   mode="sum", **options)
            session = hvd.Session(agent)
            try:
                net, x, y = net_and_data(rank)
                trainer = hvd.DistributedTrainer(net.collect_params(), "sgd", {"learning_rate": 0.5, "momentum": 0.9},
                                                 session=session)
                return train_steps(net, trainer, x, y, steps, 8)
            finally:
                session.close()

        return run_workers(4, body)

    flat = run("mxhvd-flat4", 3)
    every_step = run("mxhvd-groups1", 3, sync="local:1", groups=2)
    for got, want in zip(every_step, flat, strict=True):
        for a, b in zip(got, want, strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    apart = run("mxhvd-groups3", 2, sync="local:3", groups=2)  # no sync yet after 2 steps
    assert all(np.array_equal(a, b) for a, b in zip(apart[0], apart[1]))  # one group, one model
    assert not all(np.array_equal(a, b) for a, b in zip(apart[0], apart[2]))
