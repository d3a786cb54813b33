"""Horovod's behaviour, one test body for every framework adapter (so that drift between them
shows as a failure): each body runs on ranks that are threads of this process, each with its own
Session and the adapter's Horovod API over it, and sees tensors only through the framework's
own conversions (``fw.tensor``, ``fw.numpy``)."""

from __future__ import annotations

import importlib.util
import itertools
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import pytest

from pslink.core.worker.session import Session
from pslink.errors import ConfigError, MismatchError, ShapeMismatchError
from tests.helpers import on_sessions

# MXNet must load before TensorFlow in one process (TensorFlow first, then MXNet, segfaults).
if importlib.util.find_spec("mxnet") is not None:
    import mxnet  # noqa: F401


@dataclass
class Framework:
    """One adapter as the bodies see it."""

    name: str
    api: Callable[[Session], Any]  # the adapter's Horovod API over one Session
    tensor: Callable[[np.ndarray], Any]  # a host array as the framework's tensor
    numpy: Callable[[Any], np.ndarray]  # and back
    errors: tuple  # what the adapter raises when the ranks' calls disagree


def _torch() -> Framework:
    import torch

    from pslink.torch.horovod import Horovod

    return Framework("torch", Horovod, lambda a: torch.from_numpy(np.array(a)), lambda t: t.detach().numpy(),
                     (RuntimeError,))


def _mxnet() -> Framework:
    import mxnet as mx

    from pslink.mxnet.horovod import Horovod

    return Framework("mxnet", Horovod, lambda a: mx.nd.array(a, dtype=np.asarray(a).dtype), lambda t: t.asnumpy(),
                     (RuntimeError, mx.base.MXNetError))


def _tf() -> Framework:
    import tensorflow as tf

    from pslink.tf.horovod import Horovod

    return Framework("tf", Horovod, lambda a: tf.constant(a), lambda t: np.asarray(t),
                     (RuntimeError, tf.errors.OpError))


_MODULES = {"torch": "torch", "mxnet": "mxnet", "tf": "tensorflow"}
_MAKERS = {"torch": _torch, "mxnet": _mxnet, "tf": _tf}


@pytest.fixture(params=sorted(_MAKERS), scope="module")
def fw(request) -> Framework:
    module = _MODULES[request.param]
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not installed (CI installs it)")
    return _MAKERS[request.param]()


_jobs = itertools.count()


def on_ranks(cluster, fw: Framework, size: int, body, **session_options) -> list:
    """``body(api, fw)`` on ranks 0..size-1 of a fresh job, each a thread with its own Session."""
    service, transports = cluster
    return on_sessions(f"behaviour-{fw.name}-{next(_jobs)}", size, service.address, transports,
                       lambda rank, session: body(fw.api(lambda: session), fw), timeout=90.0, **session_options)


@pytest.fixture(scope="module")
def cluster(tcp_cluster):
    return tcp_cluster


# -- reductions ---------------------------------------------------------------------------------------


def test_every_reduction_and_horovods_scale_rules(cluster, fw):
    """Average, Sum, Min, Max, Product; an integer average truncates; prescale and postscale in
    float16 (float32 math) and int32 (float64, truncated toward zero), as Horovod's CPU ops."""
    def body(h, fw):
        r = h.rank() + 1
        x = np.array([1.5, -2.0, 4.0], np.float32) * r
        out = {op: fw.numpy(h.allreduce(fw.tensor(x), name=f"op-{op}", op=getattr(h_module(fw), op)))
               for op in ("Average", "Sum", "Min", "Max", "Product")}
        out["int-average"] = fw.numpy(h.allreduce(fw.tensor(np.array([3, -3, 5], np.int32) * r), name="int-average"))
        out["half"] = fw.numpy(h.allreduce(fw.tensor(np.array([1.0, 3.0], np.float16) * r), name="half",
                                           op=h_module(fw).Sum, prescale_factor=1 / 3, postscale_factor=0.7))
        out["int-scaled"] = fw.numpy(h.allreduce(fw.tensor(np.array([7, -7], np.int32) * r), name="int-scaled",
                                                 op=h_module(fw).Sum, prescale_factor=0.5, postscale_factor=3.0))
        return out

    base = np.array([1.5, -2.0, 4.0], np.float32)
    for out in on_ranks(cluster, fw, 2, body):
        np.testing.assert_allclose(out["Average"], base * 1.5)
        np.testing.assert_allclose(out["Sum"], base * 3)
        np.testing.assert_allclose(out["Min"], np.minimum(base, base * 2))
        np.testing.assert_allclose(out["Max"], np.maximum(base, base * 2))
        np.testing.assert_allclose(out["Product"], base * base * 2)
        assert out["int-average"].tolist() == [4, -4, 7]  # 9 / 2, -9 / 2, 15 / 2 truncated
        half = sum((np.array([1.0, 3.0], np.float16) * r).astype(np.float32) * np.float32(1 / 3) for r in (1, 2))
        expected = (np.float16(half[0]), np.float16(half[1]))  # each rank's prescaled half, summed, x 0.7
        assert out["half"].dtype == np.float16
        np.testing.assert_allclose(out["half"].astype(np.float32), np.array(expected, np.float32) * 0.7, rtol=2e-3)
        # 7 * 0.5 -> 3, 14 * 0.5 -> 7: 10, x 3 = 30; the negative side truncates toward zero too
        assert out["int-scaled"].dtype == np.int32 and out["int-scaled"].tolist() == [30, -30]


def h_module(fw: Framework):
    """The adapter's module (its ReduceOps: Average, Sum, ...)."""
    import importlib

    return importlib.import_module({"torch": "pslink.torch", "mxnet": "pslink.mxnet.horovod",
                                    "tf": "pslink.tf"}[fw.name])


def test_broadcast_is_bit_exact_from_any_root_and_objects_travel(cluster, fw):
    def body(h, fw):
        mine = np.array([-0.0, 1.5, 2.0 + h.rank()], np.float64)
        from_last = fw.numpy(h.broadcast(fw.tensor(mine), root_rank=2, name="b"))
        obj = h.broadcast_object({"epoch": 7} if h.rank() == 1 else None, root_rank=1)
        every = h.allgather_object(f"host-{h.rank()}")
        return from_last, obj, every

    for from_last, obj, every in on_ranks(cluster, fw, 3, body):
        assert from_last.tobytes() == np.array([-0.0, 1.5, 4.0]).tobytes()  # -0.0 kept
        assert obj == {"epoch": 7} and every == ["host-0", "host-1", "host-2"]


def test_gathers_reducescatter_and_alltoall_split_rows_as_horovod(cluster, fw):
    def body(h, fw):
        r = h.rank()
        gathered = fw.numpy(h.allgather(fw.tensor(np.full((r + 1, 2), r, np.int64)), name="g"))
        share = fw.numpy(h.reducescatter(fw.tensor(np.arange(10, dtype=np.float32).reshape(5, 2) * (r + 1)),
                                         name="rs", op=h_module(fw).Sum))
        splits = [[1, 2, 1], [0, 0, 4], [2, 1, 1]][r]
        received = h.alltoall(fw.tensor(np.arange(8, dtype=np.int32).reshape(4, 2) + 100 * r), splits=splits,
                              name="a2a")
        return gathered, share, [fw.numpy(t) for t in received]

    full = np.arange(10, dtype=np.float32).reshape(5, 2) * 6
    shares = {0: full[0:2], 1: full[2:4], 2: full[4:5]}  # 5 rows over 3 ranks: 2, 2, 1
    sent = [[1, 2, 1], [0, 0, 4], [2, 1, 1]]
    for r, (gathered, share, (received, counts)) in enumerate(on_ranks(cluster, fw, 3, body)):
        assert gathered[:, 0].tolist() == [0, 1, 1, 2, 2, 2]
        np.testing.assert_allclose(share, shares[r])
        assert counts.tolist() == [sent[k][r] for k in range(3)]
        expected = []
        for k in range(3):
            first = sum(sent[k][:r])
            expected += [[2 * i + 100 * k, 2 * i + 1 + 100 * k] for i in range(first, first + sent[k][r])]
        assert received.tolist() == expected


def test_unnamed_calls_are_matched_by_their_order(cluster, fw):
    def body(h, fw):
        return [float(fw.numpy(h.allreduce(fw.tensor(np.array([float(h.rank() + i)])), op=h_module(fw).Sum))[0])
                for i in range(3)]

    for totals in on_ranks(cluster, fw, 2, body):
        assert totals == [1.0, 3.0, 5.0]


# -- the checks Horovod makes at the call ---------------------------------------------------------


def test_calls_that_disagree_fail_on_every_rank_naming_each_ranks_call(cluster, fw):
    def body(h, fw):
        caught = []
        for attempt in (lambda: h.allreduce(fw.tensor(np.zeros(3, np.float32 if h.rank() else np.int32)),
                                            name="typed"),
                        lambda: h.allreduce(fw.tensor(np.zeros(3 + h.rank(), np.float32)), name="shaped"),
                        lambda: h.broadcast(fw.tensor(np.ones(3, np.float32)), root_rank=h.rank(), name="rooted")):
            try:
                fw.numpy(attempt())
                caught.append(None)
            except fw.errors as exc:
                caught.append(str(exc))
        return caught

    for typed, shaped, rooted in on_ranks(cluster, fw, 2, body):
        assert typed and "int32" in typed and "float32" in typed
        assert shaped and "(3,)" in shaped and "(4,)" in shaped
        assert rooted and "root_rank=0" in rooted and "root_rank=1" in rooted


def test_a_name_reused_with_another_shape_is_a_new_operation(cluster, fw):
    def body(h, fw):
        first = fw.numpy(h.allreduce(fw.tensor(np.ones(2, np.float32)), name="again", op=h_module(fw).Sum))
        second = fw.numpy(h.allreduce(fw.tensor(np.ones(5, np.float32)), name="again", op=h_module(fw).Sum))
        return first.tolist(), second.tolist()

    for first, second in on_ranks(cluster, fw, 2, body):
        assert first == [2.0] * 2 and second == [2.0] * 5


# -- join -----------------------------------------------------------------------------------------------


def test_join_takes_part_in_allreduces_and_fails_what_join_cannot_run(cluster, fw):
    def body(h, fw):
        seen = []
        for first in (0, 1):
            if h.rank() == first:
                last = h.join()
            else:
                seen.append(fw.numpy(h.allreduce(fw.tensor(np.full(4, 6.0, np.float32)), name="a")).tolist())
                try:
                    h.allgather(fw.tensor(np.ones((1, 2), np.float32)))
                    seen.append("no error")
                except fw.errors as exc:
                    seen.append("joined" if "joined" in str(exc) else str(exc))
                last = h.join()
            seen.append(last)
        seen.append(fw.numpy(h.allreduce(fw.tensor(np.ones(2, np.float32)), name="after", op=h_module(fw).Sum))
                    .tolist())
        return seen

    rank0, rank1 = on_ranks(cluster, fw, 2, body)
    # the average of 6 and a joined rank's zeros, over both ranks; the gather refused; the last to join
    assert rank0 == [1, [3.0] * 4, "joined", 0, [2.0, 2.0]]
    assert rank1 == [[3.0] * 4, "joined", 1, 0, [2.0, 2.0]]


# -- the world ------------------------------------------------------------------------------------------


def test_local_rank_and_size_are_the_sessions_in_every_adapter(cluster, fw):
    def body(h, fw):
        return h.rank(), h.size(), h.local_rank(), h.local_size(), h.cross_rank(), h.cross_size()

    results = on_ranks(cluster, fw, 2, body, local_rank=0, local_size=1)
    assert results == [(0, 2, 0, 1, 0, 2), (1, 2, 0, 1, 1, 2)]  # one rank a machine, two machines


def test_process_sets_reduce_among_their_ranks_with_world_roots(cluster, fw):
    def body(h, fw):
        pair = h.add_process_set([1, 2])
        x = fw.tensor(np.full(2, float(h.rank() + 1), np.float32))
        out = {"ranks": (pair.rank(), pair.size(), pair.included())}
        if pair.included():
            out["sum"] = fw.numpy(h.allreduce(x, name="x", op=h_module(fw).Sum, process_set=pair)).tolist()
            # a set's root is a rank of the whole job, as in Horovod
            out["from2"] = fw.numpy(h.broadcast(x, root_rank=2, name="b", process_set=pair)).tolist()
        else:
            with pytest.raises(ConfigError, match="is not in ProcessSet"):
                h.allreduce(x, name="x", process_set=pair)
        h.remove_process_set(pair)
        out["world"] = fw.numpy(h.allreduce(x, name="after", op=h_module(fw).Sum)).tolist()
        return out

    results = on_ranks(cluster, fw, 3, body)
    assert [r["ranks"] for r in results] == [(-1, 2, False), (0, 2, True), (1, 2, True)]
    for rank, out in enumerate(results):
        assert out.get("sum") == ([5.0, 5.0] if rank else None)  # 2 + 3
        assert out.get("from2") == ([3.0, 3.0] if rank else None)
        assert out["world"] == [6.0, 6.0]


def test_the_errors_are_the_documented_ones():
    """Disagreements are pslink's MismatchError or ShapeMismatchError: RuntimeErrors, as Horovod's."""
    assert issubclass(MismatchError, RuntimeError) and issubclass(ShapeMismatchError, RuntimeError)
