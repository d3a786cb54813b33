"""Horovod's MXNet API (pslink.mxnet.horovod): collectives, DistributedTrainer,
DistributedOptimizer, join and process sets, on ranks that are threads of this process (one core
Session each, the API over it: ``hvd.Horovod(lambda: session)``)."""

from __future__ import annotations

import inspect
import itertools
import re

import numpy as np
import pytest

mx = pytest.importorskip("mxnet", reason="MXNet 1.9.1 is not installed (CI installs it: pip install '.[mxnet]')")

import pslink  # noqa: E402
from pslink.core.worker.session import Session  # noqa: E402
from pslink.errors import ConfigError, MismatchError, PeerError, ShapeMismatchError  # noqa: E402
from pslink.mxnet import horovod as hvd  # noqa: E402
from tests.helpers import on_sessions, run_workers  # noqa: E402

_jobs = itertools.count()


@pytest.fixture(scope="module")
def cluster(inproc_cluster):
    return inproc_cluster


def on_ranks(cluster, size: int, fn, **session_options) -> list:
    """Run ``fn(api)`` for ranks 0..size-1 of a fresh job, each on its own thread with its own
    Session (``api.session`` is it)."""
    service, transports = cluster

    def body(rank, session):
        api = hvd.Horovod(lambda: session)
        api.session = session
        return fn(api)

    return on_sessions(f"mxhvd-{next(_jobs)}", size, service.address, transports, body, **session_options)


# -- collectives -----------------------------------------------------------------------------------


def test_allreduce_broadcast_allgather_and_objects(cluster):
    def body(h):
        r = h.rank() + 1
        source = mx.nd.array([1.0, 2.0]) * r
        mean = h.allreduce(source, name="mean")
        total = h.allreduce(mx.nd.array([3, 7], dtype="int32") * r, op=hvd.Sum)  # unnamed
        ints = h.allreduce(mx.nd.array([3, 7], dtype="int64") * r, name="ints")  # an integer mean truncates
        scaled = h.allreduce(mx.nd.ones((2,)) * r, name="scaled", prescale_factor=2.0, postscale_factor=10.0)
        summed = h.allreduce(mx.nd.array([1.0]) * r, False, "deprecated-average")  # Horovod's positional average
        value = mx.nd.array([-0.0, 1.5]) if h.rank() == 1 else mx.nd.array([5.0, 5.0])
        same = h.broadcast_(value, root_rank=1, name="value")
        copy = h.broadcast(mx.nd.array([float(h.rank())]), 0)
        rows = h.allgather(mx.nd.ones((r, 2)) * h.rank(), name="rows")
        obj = h.broadcast_object({"from": h.rank()} if h.rank() == 0 else None, root_rank=0)
        low = h.allreduce(mx.nd.array([1.5 * r, -r]), name="min", op=hvd.Min)
        product = h.allreduce(mx.nd.array([r + 1, 3], dtype="int64"), op=hvd.Product)
        objects = h.allgather_object(("rank", h.rank()))
        with pytest.raises(ConfigError, match="root_rank must be an int in \\[0, 2\\), got 2"):
            h.broadcast_(mx.nd.ones((1,)), root_rank=2)
        with pytest.raises(ConfigError, match="takes an mx.nd.NDArray, got ndarray"):
            h.allreduce(np.ones(2))
        return (source, mean, total, ints, scaled, summed, value, same is value, copy, rows, obj, low, product,
                objects)

    for rank, out in enumerate(on_ranks(cluster, 2, body)):
        source, mean, total, ints, scaled, summed, value, same, copy, rows, obj, low, product, objects = out
        assert source.asnumpy().tolist() == [rank + 1.0, 2 * (rank + 1.0)]  # allreduce leaves its input alone
        assert mean.asnumpy().tolist() == [1.5, 3.0] and mean.context == mx.cpu()
        assert total.dtype == np.int32 and total.asnumpy().tolist() == [9, 21]
        assert ints.dtype == np.int64 and ints.asnumpy().tolist() == [4, 10]
        assert scaled.asnumpy().tolist() == [30.0, 30.0]  # (2*1 + 2*2) / 2 * 10
        assert summed.asnumpy().tolist() == [3.0]
        got = value.asnumpy()
        assert same and np.signbit(got[0]) and got[1] == 1.5  # in place, the root's bits, -0.0 included
        assert copy.asnumpy().tolist() == [0.0]
        assert rows.asnumpy().tolist() == [[0.0, 0.0], [1.0, 1.0], [1.0, 1.0]]
        assert obj == {"from": 0}
        assert low.asnumpy().tolist() == [1.5, -2.0] and product.asnumpy().tolist() == [6, 9]
        assert objects == [("rank", 0), ("rank", 1)]


def test_results_keep_the_inputs_context_and_dtype_and_float16_scales_as_horovods(cluster):
    def body(h):
        r = h.rank() + 1
        on_cpu1 = h.allreduce(mx.nd.ones((2,), ctx=mx.cpu(1)) * r, name="ctx", op=hvd.Sum)
        half = h.allreduce(mx.nd.array([23.078125], dtype="float16"), name="half", op=hvd.Sum,
                           prescale_factor=0.38367755426188344)
        small = h.allreduce(mx.nd.array([7, -7], dtype="int32"), name="small", op=hvd.Sum, postscale_factor=0.4)
        inplace = mx.nd.array([[1.0, 2.0]], dtype="float64") * r
        returned = h.allreduce_(inplace, name="inplace")
        int8 = h.allgather(mx.nd.array([r], dtype="int8"), name="int8")  # a dtype MXNet takes only as a copy
        return on_cpu1, half, small, inplace, returned is inplace, int8

    for on_cpu1, half, small, inplace, same, int8 in on_ranks(cluster, 2, body):
        assert on_cpu1.context == mx.cpu(1) and on_cpu1.asnumpy().tolist() == [3.0, 3.0]
        # float16 scaled in float32 math, rounded once to half (Horovod's CPU rule: 8.85), not with
        # the factor rounded to half first (8.86); the sum of two equal halves is exact
        assert half.dtype == np.float16 and half.asnumpy().tolist() == [2 * float(np.float16(8.85))]
        assert small.asnumpy().tolist() == [5, -5]  # trunc(14 * 0.4), integers scaled in float64 and truncated
        assert same and inplace.asnumpy().tolist() == [[1.5, 3.0]]
        assert int8.dtype == np.int8 and int8.asnumpy().tolist() == [1, 2]


def test_reducescatter_alltoall_and_grouped_collectives_as_horovod_splits(cluster):
    def body(h):
        r = h.rank()
        x = mx.nd.array(np.arange(10, dtype=np.float32).reshape(5, 2) * (r + 1))
        mine = h.reducescatter(x, op=hvd.Sum, name="rs")  # 5 rows over 2 ranks: 3 and 2
        mean = h.reducescatter(x)  # unnamed: matched by position
        even = h.alltoall(mx.nd.arange(4) + 10 * r)  # two elements to each rank; unnamed
        rows = mx.nd.array(np.arange(3 * 2, dtype=np.float32).reshape(3, 2) + 100 * r)
        splits = mx.nd.array([1, 2] if r == 0 else [2, 1], dtype="int32")
        got, counts = h.alltoall(rows, splits=splits, name="uneven")
        with pytest.raises(ConfigError, match=r"splits \[1, 1\] must be 2 counts >= 0 adding up to the tensor's 3 rows"):
            h.alltoall(rows, splits=[1, 1], name="bad")
        with pytest.raises(ValueError, match="splits must be integers, got an NDArray of float32"):
            h.alltoall(rows, splits=mx.nd.array([1, 2]), name="floats")
        with pytest.raises(ValueError, match="at least one dimension"):
            h.grouped_reducescatter([mx.nd.zeros((3, 1)), mx.nd.array(1.0)], op=hvd.Average)
        group = [mx.nd.ones((2,)) * (r + 1), mx.nd.ones((3,), dtype="int32") * (r + 1)]
        reduced = h.grouped_allreduce(group, op=hvd.Sum, name="g")
        h.grouped_allreduce_(group, name="g-inplace")
        gathered = h.grouped_allgather([mx.nd.array([r]), mx.nd.ones((r + 1, 2))])
        shares = h.grouped_reducescatter([x, x * 2], op=hvd.Sum, name="grs", postscale_factor=0.5)
        return (mine.asnumpy(), mean.asnumpy(), even.asnumpy(), got.asnumpy(), counts, [t.asnumpy() for t in reduced],
                [t.asnumpy() for t in group], [t.asnumpy() for t in gathered], [t.asnumpy() for t in shares])

    results = on_ranks(cluster, 2, body)
    total = np.arange(10, dtype=np.float32).reshape(5, 2) * 3
    for r, (mine, mean, even, got, counts, reduced, group, gathered, shares) in enumerate(results):
        share = slice(0, 3) if r == 0 else slice(3, 5)
        np.testing.assert_array_equal(mine, total[share])
        np.testing.assert_array_equal(mean, total[share] / 2)
        np.testing.assert_array_equal(even, [2 * r, 2 * r + 1, 10 + 2 * r, 11 + 2 * r])
        assert counts.dtype == np.int32 and counts.context == mx.cpu()
        sent = [[1, 2], [2, 1]]  # rank 0 sends 1 row to rank 0 and 2 to rank 1; rank 1 sends 2 and 1
        assert counts.asnumpy().tolist() == [sent[0][r], sent[1][r]]
        assert reduced[0].tolist() == [3.0, 3.0] and reduced[1].tolist() == [3, 3, 3]
        assert group[0].tolist() == [1.5, 1.5] and group[1].tolist() == [1, 1, 1]  # int average truncates
        assert gathered[0].tolist() == [0.0, 1.0] and gathered[1].shape == (3, 2)
        np.testing.assert_array_equal(shares[0], total[share] * 0.5)
        np.testing.assert_array_equal(shares[1], total[share])
    rows = [np.arange(6, dtype=np.float32).reshape(3, 2) + 100 * r for r in range(2)]
    np.testing.assert_array_equal(results[0][3], np.concatenate([rows[0][:1], rows[1][:2]]))
    np.testing.assert_array_equal(results[1][3], np.concatenate([rows[0][1:], rows[1][2:]]))


def test_calls_that_disagree_fail_on_every_rank_as_horovods_errors(cluster):
    """The checks Horovod makes at the call are the Session's: an error that is a RuntimeError
    (what Horovod's MXNet tests catch) on every rank, naming each rank's call, after which the
    ranks go on."""
    def body(h):
        r = h.rank()
        errors = []
        for call in (lambda: h.allreduce(mx.nd.ones((3,), dtype="int32" if r == 0 else "float32"), name="dtype"),
                     lambda: h.broadcast(mx.nd.ones((4,)), root_rank=r, name="root"),
                     lambda: h.allgather(mx.nd.ones((2, 3 + r)), name="trailing")):
            with pytest.raises(RuntimeError) as caught:
                call()
            errors.append(caught.value)
        after = h.allreduce(mx.nd.ones((1,)), name="after", op=hvd.Sum)
        return errors, after.asnumpy().tolist()

    for errors, after in on_ranks(cluster, 2, body):
        # the board's verdict, or the service's when the second rank's push meets the first's key first
        assert isinstance(errors[0], (MismatchError, ShapeMismatchError))
        assert "int32" in str(errors[0]) and "float32" in str(errors[0])
        assert isinstance(errors[1], (MismatchError, ShapeMismatchError)) and "root_rank=0" in str(errors[1])
        # (the board's words, "rank 0: allgather float32 (3,); rank 1: ... (4,)", or the gather's own,
        # "rank 0 has float32 (2, 3), rank 1 has float32 (2, 4)", whichever comes first)
        assert isinstance(errors[2], (MismatchError, ShapeMismatchError))
        assert re.search(r"rank 0.*\b3\b.*rank 1.*\b4\b", str(errors[2]))
        assert after == [2.0]


def test_local_rank_and_size_come_from_the_session_not_the_global_rank(cluster):
    def body(h):
        h.allreduce(mx.nd.ones((1,)), name="meet")  # every rank registered (none leaves before another joins)
        return h.rank(), h.size(), h.local_rank(), h.local_size(), h.cross_rank(), h.cross_size()

    # Two hosts of one rank each, as the launcher's environment would say: local rank 0 of 1.
    assert on_ranks(cluster, 2, body, local_rank=0, local_size=1) == [(0, 2, 0, 1, 0, 2), (1, 2, 0, 1, 1, 2)]
    # The launcher said nothing: one host.
    assert on_ranks(cluster, 2, body) == [(0, 2, 0, 2, 0, 1), (1, 2, 1, 2, 0, 1)]


# -- broadcast_parameters ----------------------------------------------------------------------------


def test_broadcast_parameters_gives_every_rank_the_roots(cluster):
    def body(h):
        net = mx.gluon.nn.Dense(2, in_units=3, bias_initializer=mx.init.Constant(float(h.rank() + 1)))
        net.initialize(mx.init.Constant(float(h.rank() + 1)))
        h.broadcast_parameters(net.collect_params(), root_rank=1, prefix="net")
        arrays = {"a": mx.nd.ones((2,)) * h.rank(), 3: mx.nd.ones((1,), dtype="int64") * h.rank()}
        h.broadcast_parameters(arrays, root_rank=0)
        with pytest.raises(ConfigError, match="takes a ParameterDict or a dict of NDArrays, got list"):
            h.broadcast_parameters([mx.nd.ones((1,))])
        return [p.data().asnumpy() for p in net.collect_params().values()], arrays["a"].asnumpy(), arrays[3].asnumpy()

    for params, array, ints in on_ranks(cluster, 2, body):
        assert all((p == 2.0).all() for p in params)
        assert array.tolist() == [0.0, 0.0] and ints.tolist() == [0]


def test_deferred_initialization_parameters_are_broadcast_once_initialized(cluster):
    """Horovod's way: a parameter whose shape is known only at the first forward pass is
    broadcast right after MXNet initializes it there."""
    def body(h):
        mx.random.seed(h.rank())
        layer = mx.gluon.nn.Conv2D(4, 2)  # in_channels unknown: deferred
        layer.initialize()
        h.broadcast_parameters(layer.collect_params(), root_rank=0)
        layer(mx.nd.ones((1, 3, 5, 5)))
        return [p.data().asnumpy() for _, p in sorted(layer.collect_params().items())]

    first, second = on_ranks(cluster, 2, body)
    assert first[0].shape == (4,) and first[1].shape == (4, 3, 2, 2)
    for a, b in zip(first, second, strict=True):
        np.testing.assert_array_equal(a, b)
    assert np.abs(first[1]).sum() > 0  # the root's random initialization, not zeros


# -- DistributedTrainer ------------------------------------------------------------------------------


def net_and_data(rank: int):
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


def reference_on_the_combined_batch(steps: int = 4) -> list:
    reference, x0, y0 = net_and_data(0)
    _, x1, y1 = net_and_data(1)
    trainer = mx.gluon.Trainer(reference.collect_params(), "sgd", {"learning_rate": 0.5, "momentum": 0.9},
                               kvstore=None)
    return train_steps(reference, trainer, mx.nd.concat(x0, x1, dim=0), mx.nd.concat(y0, y1, dim=0), steps, 16)


@pytest.mark.parametrize("options", [{}, {"gradient_predivide_factor": 4.0, "num_groups": 2}])
def test_distributed_trainer_equals_one_process_on_the_combined_batch(cluster, options):
    def body(h):
        net, x, y = net_and_data(h.rank())
        trainer = h.DistributedTrainer(net.collect_params(), "sgd", {"learning_rate": 0.5, "momentum": 0.9},
                                       **options)
        assert isinstance(trainer, hvd.DistributedTrainer) and isinstance(trainer, mx.gluon.Trainer)
        return train_steps(net, trainer, x, y, 4, 8)

    expected = reference_on_the_combined_batch()
    for weights in on_ranks(cluster, 2, body):
        for got, want in zip(weights, expected, strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_two_trainers_with_their_prefixes_step_apart(cluster):
    def body(h):
        nets = [mx.gluon.nn.Dense(2, in_units=3, use_bias=False), mx.gluon.nn.Dense(5, in_units=3, use_bias=False)]
        trainers = []
        for i, net in enumerate(nets):
            net.initialize(mx.init.Constant(1.0))
            trainers.append(h.DistributedTrainer(net.collect_params(), "sgd", {"learning_rate": 1.0},
                                                 prefix=f"net{i}"))
        with mx.autograd.record():
            loss = sum(net(mx.nd.ones((1, 3)) * (h.rank() + 1)).sum() for net in nets)
        loss.backward()
        for trainer in trainers:
            trainer.step(1)
        return [net.weight.data().asnumpy() for net in nets]

    for first, second in on_ranks(cluster, 2, body):
        assert (first == 1.0 - 1.5).all() and (second == 1.0 - 1.5).all()  # the average input, 1.5


def test_distributed_trainer_with_fp16_compression_sends_float16_and_steps_in_float32(cluster):
    sent = []

    class Counting(hvd.Compression.fp16):
        @staticmethod
        def compress(tensor):
            out = hvd.Compression.fp16.compress(tensor)
            sent.append(out[0].dtype)
            return out

    def body(h):
        net = mx.gluon.nn.Dense(1, in_units=2, use_bias=False)
        net.initialize(mx.init.Constant(1.0))
        trainer = h.DistributedTrainer(net.collect_params(), "sgd", {"learning_rate": 0.5}, compression=Counting)
        with mx.autograd.record():
            loss = net(mx.nd.array([[1.0, 2.0]]) * (h.rank() + 1)).sum()  # gradient (rank + 1) * [1, 2]
        loss.backward()
        trainer.step(1)
        weight = net.weight.data()
        return weight.dtype, weight.asnumpy().tolist()

    for dtype, weight in on_ranks(cluster, 2, body):
        # the average gradient, 1.5 x [1, 2], is exact in float16: w = 1 - 0.5 * [1.5, 3]
        assert dtype == np.float32 and weight == [[0.25, -0.5]]
    assert sent == [np.float16, np.float16]


def test_distributed_trainer_refuses_what_it_cannot_use(cluster):
    def body(h):
        net = mx.gluon.nn.Dense(1, in_units=2)
        net.initialize()
        params = net.collect_params()
        with pytest.raises(ConfigError, match="Compression.none or hvd.Compression.fp16"):
            h.DistributedTrainer(params, "sgd", compression="fp32")
        with pytest.raises(ConfigError, match="gradient_predivide_factor must be > 0"):
            h.DistributedTrainer(params, "sgd", gradient_predivide_factor=0)
        with pytest.raises(ConfigError, match="num_groups must be an int >= 0"):
            h.DistributedTrainer(params, "sgd", num_groups=-1)
        with pytest.warns(UserWarning, match="does not take DistributedOptimizer"):
            trainer = h.DistributedTrainer(params, h.DistributedOptimizer(mx.optimizer.SGD()))
        return type(trainer._optimizer).__name__

    assert on_ranks(cluster, 1, body) == ["SGD"]


def test_join_lets_a_rank_out_of_data_mirror_the_others_trainer_steps_with_zeros(cluster):
    def body(h):
        net = mx.gluon.nn.Dense(1, in_units=2, use_bias=False)
        net.initialize(mx.init.Constant(1.0))
        trainer = h.DistributedTrainer(net.collect_params(), "sgd", {"learning_rate": 0.5})
        for _ in range(3 if h.rank() == 0 else 1):  # rank 1 has one batch, rank 0 three
            with mx.autograd.record():
                loss = net(mx.nd.array([[1.0, 2.0]]) * (h.rank() + 1)).sum()  # gradient (rank + 1) * [1, 2]
            loss.backward()
            trainer.step(1)
        last = h.join()
        after = h.allreduce(mx.nd.ones((1,)), name="after-join", op=hvd.Sum)  # every rank active again
        return last, after.asnumpy().tolist(), net.weight.data().asnumpy().tolist()

    (last0, after0, weight0), (last1, after1, weight1) = on_ranks(cluster, 2, body)
    assert last0 == last1 == 0  # rank 0 joined last
    assert after0 == after1 == [2.0]
    # step 1: the average of both, 1.5 x [1, 2]; steps 2 and 3: rank 0's and rank 1's zeros, 0.5 x [1, 2]
    assert weight0 == [[1 - 0.5 * 1.5 - 2 * 0.5 * 0.5, 1 - 0.5 * 3.0 - 2 * 0.5 * 1.0]]
    assert weight1 == [[1 - 0.5 * 1.5, 1 - 0.5 * 3.0]]  # not stepped while joined


# -- DistributedOptimizer -----------------------------------------------------------------------------


def test_distributed_optimizer_averages_each_gradient_before_its_update(cluster):
    def body(h):
        optimizer = h.DistributedOptimizer(mx.optimizer.SGD(learning_rate=0.1), gradient_predivide_factor=2.0)
        weight = mx.nd.ones((3,))
        grad = mx.nd.array([1.0, 2.0, 3.0]) * (h.rank() + 1)
        optimizer.update(0, weight, grad, optimizer.create_state_multi_precision(0, weight))
        grouped = h.DistributedOptimizer(mx.optimizer.SGD(learning_rate=1.0), num_groups=1)
        weights = [mx.nd.zeros((2,)), mx.nd.zeros((1,))]
        grads = [mx.nd.ones((2,)) * (h.rank() + 1), mx.nd.ones((1,)) * 4 * h.rank()]
        grouped.update([0, 1], weights, grads, [None, None])
        assert optimizer.create_state(0, weight) is None  # the wrapped SGD's (no momentum: no state)
        return weight.asnumpy(), [w.asnumpy().tolist() for w in weights]

    for weight, weights in on_ranks(cluster, 2, body):
        # the average gradient is 1.5 x [1, 2, 3]; SGD: w - 0.1 * g
        np.testing.assert_allclose(weight, 1.0 - 0.1 * 1.5 * np.array([1.0, 2.0, 3.0]), rtol=1e-6)
        assert weights == [[-1.5, -1.5], [-2.0]]


def test_join_mirrors_the_distributed_optimizers_allreduces(cluster):
    """A rank in join() takes part in the others' DistributedOptimizer updates with zeros: their
    allreduces are on the Session's board, which a joined rank mirrors."""
    def body(h):
        optimizer = h.DistributedOptimizer(mx.optimizer.SGD(learning_rate=1.0))
        weight = mx.nd.zeros((2,))
        for _ in range(3 if h.rank() == 0 else 1):
            optimizer.update(0, weight, mx.nd.ones((2,)) * (h.rank() + 1), None)
        return h.join(), weight.asnumpy().tolist()

    (last0, weight0), (last1, weight1) = on_ranks(cluster, 2, body)
    assert last0 == last1 == 0
    assert weight0 == [-1.5 - 0.5 - 0.5] * 2  # then rank 0's gradient with rank 1's zeros, averaged over 2
    assert weight1 == [-1.5, -1.5]


# -- process sets -------------------------------------------------------------------------------------


def test_process_sets_reduce_among_their_ranks(cluster):
    """Horovod's process sets: every rank adds every set in the same order; a set's collectives
    count its ranks only; a rank outside a set may not use it; a removed set is gone."""
    def body(h):
        evens = h.add_process_set([2, 0])  # ranks 0 and 2, numbered 0 and 1 inside
        pair = h.add_process_set(hvd.ProcessSet([1, 2]))
        with pytest.raises(ConfigError, match="exists already"):
            h.add_process_set([0, 2])
        out = {"ids": (evens.process_set_id, pair.process_set_id), "sizes": (evens.size(), pair.size()),
               "ranks": (evens.rank(), pair.rank())}
        x = mx.nd.full((2,), float(h.rank() + 1))
        for label, ps in (("evens", evens), ("pair", pair)):
            if ps.included():
                out[label] = h.allreduce(x, name="x", op=hvd.Sum, process_set=ps).asnumpy().tolist()
            else:
                with pytest.raises(ConfigError, match=f"rank {h.rank()} is not in ProcessSet"):
                    h.allreduce(x, name="x", process_set=ps)
        if pair.included():  # a set's root_rank is a rank of the job (Horovod's rule), one of the set's
            out["from2"] = h.broadcast(x, root_rank=2, name="b", process_set=pair).asnumpy().tolist()
            out["object"] = h.broadcast_object(f"rank {h.rank()}", root_rank=2, process_set=pair)
            with pytest.raises(ConfigError, match=r"root_rank must be a rank of the process set \[1, 2\], got 0"):
                h.broadcast_(x, root_rank=0, process_set=pair)
        assert h.remove_process_set(evens) and not h.remove_process_set(evens)
        with pytest.raises(ConfigError, match="is not added"):
            h.allgather(x, process_set=evens)
        out["world_sum"] = h.allreduce(x, name="after", op=hvd.Sum).asnumpy().tolist()
        return out

    results = on_ranks(cluster, 3, body)
    for rank, out in enumerate(results):
        assert out["ids"] == (1, 2) and out["sizes"] == (2, 2)
        assert out["ranks"] == {0: (0, -1), 1: (-1, 0), 2: (1, 1)}[rank]
        assert out.get("evens") == ([4.0, 4.0] if rank in (0, 2) else None)  # 1 + 3
        assert out.get("pair") == ([5.0, 5.0] if rank in (1, 2) else None)  # 2 + 3
        assert out.get("from2") == ([3.0, 3.0] if rank in (1, 2) else None)
        assert out.get("object") == ("rank 2" if rank in (1, 2) else None)
        assert out["world_sum"] == [6.0, 6.0]


def test_trainer_and_optimizer_of_a_process_set_average_over_its_ranks_only(cluster):
    """As in Horovod: the ranks of the set average among themselves; a rank outside it steps
    on its own gradient (scaled by the set's size)."""
    def body(h):
        pair = h.add_process_set([0, 1])
        net = mx.gluon.nn.Dense(1, in_units=1, use_bias=False)
        net.initialize(mx.init.Constant(0.0))
        trainer = h.DistributedTrainer(net.collect_params(), "sgd", {"learning_rate": 1.0}, process_set=pair)
        gradient = [1.0, 2.0, 5.0][h.rank()]
        with mx.autograd.record():
            loss = net(mx.nd.ones((1, 1)) * gradient).sum()
        loss.backward()
        trainer.step(1)
        optimizer = h.DistributedOptimizer(mx.optimizer.SGD(learning_rate=1.0), process_set=pair)
        weight = mx.nd.zeros((1,))
        optimizer.update(0, weight, mx.nd.ones((1,)) * gradient, None)
        return net.weight.data().asnumpy().item(), weight.asnumpy().item()

    # ranks 0 and 1: the pair's average, 1.5; rank 2 alone: its 5 scaled by 1 / the set's size
    assert on_ranks(cluster, 3, body) == [(-1.5, -1.5), (-1.5, -1.5), (-2.5, -2.5)]


# -- the module API -----------------------------------------------------------------------------------


def test_the_module_functions_take_horovods_arguments_in_horovods_order():
    expected = {
        "allreduce": ["tensor", "average", "name", "priority", "prescale_factor", "postscale_factor", "process_set",
                      "op"],
        "grouped_allreduce_": ["tensors", "average", "name", "priority", "prescale_factor", "postscale_factor",
                               "process_set", "op"],
        "allgather": ["tensor", "name", "priority", "process_set"],
        "broadcast_": ["tensor", "root_rank", "name", "priority", "process_set"],
        "alltoall": ["tensor", "splits", "name", "priority", "process_set"],
        "reducescatter": ["tensor", "op", "name", "priority", "process_set", "prescale_factor", "postscale_factor"],
        "broadcast_parameters": ["params", "root_rank", "prefix", "process_set"],
    }
    for name, params in expected.items():
        assert list(inspect.signature(getattr(hvd, name)).parameters) == params, name
    assert list(inspect.signature(hvd.DistributedTrainer).parameters)[:8] == [
        "params", "optimizer", "optimizer_params", "compression", "gradient_predivide_factor", "prefix", "num_groups",
        "process_set"]
    assert list(inspect.signature(hvd.DistributedOptimizer).parameters)[:4] == [
        "optimizer", "gradient_predivide_factor", "num_groups", "process_set"]
    for name in ("grouped_allgather", "grouped_reducescatter", "broadcast_object", "allgather_object", "barrier"):
        assert "process_set" in inspect.signature(getattr(hvd, name)).parameters, name
    assert hvd.global_process_set.ranks is None and isinstance(hvd.global_process_set, hvd.ProcessSet)


def test_the_module_api_needs_init_and_says_how(monkeypatch):
    for variable in ("PSLINK_JOB", "PSLINK_RANK", "PSLINK_NUM_WORKERS"):
        monkeypatch.delenv(variable, raising=False)
    assert not hvd.is_initialized()
    with pytest.raises(ConfigError, match="pslink.mxnet.horovod has not been initialized"):
        hvd.rank()
    with pytest.raises(ConfigError, match="has not been initialized"):
        hvd.DistributedTrainer(mx.gluon.nn.Dense(1, in_units=1).collect_params(), "sgd")
    with pytest.raises(ConfigError, match="MPI communicators are not supported"):
        hvd.init(comm=[0, 1])
    with pytest.raises(PeerError, match="no parameter service reachable"):
        hvd.init(job="nobody", rank=0, num_workers=1, master="tcp://127.0.0.1:9", connect_timeout=2.0)
    assert not hvd.is_initialized()


def test_the_module_api_on_one_rank_and_init_again_after_shutdown(cluster, monkeypatch):
    service, transports = cluster
    monkeypatch.setenv("PSLINK_LOCAL_RANK", "0")
    monkeypatch.setenv("PSLINK_LOCAL_SIZE", "1")
    job = f"module-{next(_jobs)}"
    for _ in range(2):  # init again after shutdown joins the job again
        hvd.init(job=job, rank=0, num_workers=1, master=service.address, transports=transports)
        try:
            assert hvd.is_initialized()
            assert (hvd.rank(), hvd.size(), hvd.local_rank(), hvd.local_size(), hvd.cross_size()) == (0, 1, 0, 1, 1)
            t = mx.nd.array([1.0, 2.0])
            assert hvd.allreduce(t, name="sum", op=hvd.Sum).asnumpy().tolist() == [1.0, 2.0]
            assert hvd.broadcast(t, root_rank=0, name="b").asnumpy().tolist() == [1.0, 2.0]
            assert hvd.broadcast_object([1, "a"]) == [1, "a"]
            assert hvd.join() == 0
            with pytest.raises(ConfigError, match="root_rank"):
                hvd.broadcast_(t, root_rank=1)
            net = mx.gluon.nn.Dense(1, in_units=1, use_bias=False)
            net.initialize(mx.init.Constant(1.0))
            trainer = hvd.DistributedTrainer(net.collect_params(), "sgd", {"learning_rate": 0.5})  # init()'s session
            with mx.autograd.record():
                loss = net(mx.nd.array([[2.0]])).sum()
            loss.backward()
            trainer.step(1)
            assert net.weight.data().asnumpy().tolist() == [[0.0]]
        finally:
            hvd.shutdown()
        assert not hvd.is_initialized()


def test_distributed_trainers_as_two_groups_syncing_every_step_equal_the_flat_job(cluster):
    """4 ranks as 2 groups of 2 (sync="local:1"): each group averages over its 2 ranks, and the
    groups' weights are averaged after every step (momentum SGD is linear in the gradients):
    the flat 4-rank job's weights; with sync="local:3" the groups part between syncs."""
    service, transports = cluster

    def run(job, steps, **options):
        def body(rank):
            agent = pslink.connect(job, rank, 4, master=service.address, transports=transports, timeout=30.0,
                                   mode="sum", **options)
            session = Session(agent)
            try:
                net, x, y = net_and_data(rank)
                trainer = hvd.Horovod(lambda: session).DistributedTrainer(
                    net.collect_params(), "sgd", {"learning_rate": 0.5, "momentum": 0.9})
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


def test_the_module_exports_horovods_names_but_its_listed_gaps():
    """Held to the list every adapter shares (pslink.core.worker.horovod): Horovod's names, this
    module's own (horovod.mxnet's), and no gap that is in fact offered."""
    from pslink.core.worker.horovod import HOROVOD_GAPS, HOROVOD_MODULE_NAMES, HOROVOD_NAMES

    public = set(hvd.__all__)
    gaps = set(HOROVOD_GAPS["pslink.mxnet.horovod"])
    assert not (HOROVOD_NAMES | HOROVOD_MODULE_NAMES["pslink.mxnet.horovod"]) - public - gaps
    assert not gaps & public and not any(hasattr(hvd, name) for name in gaps)
    assert all(hasattr(hvd, name) for name in hvd.__all__)
    assert hvd.HorovodInternalError is pslink.PslinkError and issubclass(hvd.HorovodInternalError, RuntimeError)
    assert not any(getattr(hvd, name)() for name in ("mpi_built", "gloo_built", "nccl_built", "rocm_built"))
