"""Bad input to the pslink kvstore: MXNet errors naming the key and shapes, at once, never a hang.

Single-worker stores live in this process (one job each, on one service); the conflict between
two workers runs in two processes.
"""

from __future__ import annotations

import itertools
import json
import os

import pytest

mx = pytest.importorskip("mxnet", reason="MXNet 1.9.1 is not installed (CI installs it: pip install '.[mxnet]')")

from mxnet.base import MXNetError  # noqa: E402

from pslink.core.service import Service  # noqa: E402
from pslink.mxnet import KVStoreError, PSLink  # noqa: E402
from tests.mxnet.mxnet_procs import HERE, launch  # noqa: E402

SHAPE = (2, 3)
_jobs = itertools.count()


@pytest.fixture(scope="module")
def service():
    with Service(aggregators=1) as s:
        yield s


@pytest.fixture
def new_store(service):
    """Makes single-worker stores, each in a job of its own; closes them after the test."""
    made = []

    def make(cls=PSLink, **options):
        store = cls(job=f"errors-{os.getpid()}-{next(_jobs)}", rank=0, num_workers=1, master=service.address,
                    timeout=20, **options)
        made.append(store)
        return store

    yield make
    for store in made:
        store.close()


@pytest.fixture
def kv(new_store):
    store = new_store()
    store.init(3, mx.nd.ones(SHAPE))
    return store


@pytest.mark.parametrize("call", [
    lambda kv: kv.push(9, mx.nd.ones(SHAPE)),
    lambda kv: kv.pull(9, out=mx.nd.zeros(SHAPE)),
    lambda kv: kv.pushpull(9, mx.nd.ones(SHAPE)),
    lambda kv: kv.push([3, 9], [mx.nd.ones(SHAPE), mx.nd.ones(SHAPE)]),
], ids=["push", "pull", "pushpull", "push-list"])
def test_a_key_never_initialized_is_an_mxnet_error_naming_it(kv, call):
    with pytest.raises(MXNetError, match=r"key 9 has not been initialized; call init\(9, value\)") as info:
        call(kv)
    assert isinstance(info.value, KVStoreError) and info.value.key == 9


@pytest.mark.parametrize("call, shapes", [
    (lambda kv: kv.push(3, mx.nd.ones((4,))), ((4,), SHAPE)),
    (lambda kv: kv.push(3, [mx.nd.ones(SHAPE), mx.nd.ones((3, 2))]), ((3, 2), SHAPE)),  # one device is off
    (lambda kv: kv.pushpull(3, mx.nd.ones((6, 1))), ((6, 1), SHAPE)),
    (lambda kv: kv.pushpull(3, mx.nd.ones(SHAPE), out=mx.nd.zeros((3,))), ((3,), SHAPE)),
    (lambda kv: kv.pull(3, out=mx.nd.zeros((1, 2, 3))), ((1, 2, 3), SHAPE)),
], ids=["push", "push-one-device", "pushpull", "pushpull-out", "pull-out"])
def test_a_shape_other_than_the_init_is_an_mxnet_error_naming_key_and_shapes(kv, call, shapes):
    with pytest.raises(MXNetError) as info:
        call(kv)
    message = str(info.value)
    assert "key 3" in message and str(shapes[0]) in message and f"shape {shapes[1]}" in message, message
    assert info.value.key == 3 and info.value.shapes == [list(s) for s in shapes]
    # The store is still usable afterwards.
    out = mx.nd.zeros(SHAPE)
    kv.pushpull(3, mx.nd.ones(SHAPE) * 5, out=out)
    assert out.asnumpy().tolist() == [[5.0] * 3] * 2


def test_other_misuse_is_named(kv):
    with pytest.raises(MXNetError, match="duplicate init of key 3"):
        kv.init(3, mx.nd.ones(SHAPE))
    with pytest.raises(MXNetError, match="duplicate init of key 3"):
        kv.broadcast(3, mx.nd.ones(SHAPE), out=mx.nd.zeros(SHAPE))
    with pytest.raises(MXNetError, match=r"a key is an int or a str, got 1.5"):
        kv.push(1.5, mx.nd.ones(SHAPE))
    with pytest.raises(MXNetError, match=r"key -1 must be an int in \[0, 2\*\*64\)"):
        kv.init(-1, mx.nd.ones(SHAPE))
    with pytest.raises(MXNetError, match="push of key 3 needs NDArrays, got ndarray"):
        kv.push(3, mx.nd.ones(SHAPE).asnumpy())
    with pytest.raises(MXNetError, match="push of 2 keys needs one value per key, got 1 values"):
        kv.push([3, 4], [mx.nd.ones(SHAPE)])
    with pytest.raises(MXNetError, match="pull needs out="):
        kv.pull(3)
    with pytest.raises(MXNetError, match="row_sparse_pull of key 3, which is not a row-sparse key"):
        kv.row_sparse_pull(3, out=mx.nd.zeros(SHAPE), row_ids=mx.nd.array([0]))
    with pytest.raises(MXNetError, match="csr arrays are not supported"):
        kv.push(3, mx.nd.ones(SHAPE).tostype("csr"))
    with pytest.raises(MXNetError, match="gradient compression type '1bit' is not supported; supported: 2bit"):
        kv.set_gradient_compression({"type": "1bit"})
    with pytest.raises(MXNetError, match="save_optimizer_states needs an optimizer"):
        kv.save_optimizer_states("unused")


def test_optimizers_the_service_cannot_apply_are_refused_by_name(kv, new_store):
    with pytest.raises(MXNetError, match=r"cannot apply optimizer mxnet.optimizer.optimizer.Nadam; it applies "
                                         r"mx.optimizer.SGD .*, Adam, NAG, .* FTML, LAMB \(keys of one part\) and Test"):
        new_store().set_optimizer(mx.optimizer.Nadam())


def test_two_workers_initializing_a_key_with_different_shapes_both_fail(service, tmp_path):
    code, out = launch(HERE / "mxnet_kv_worker.py", [tmp_path, "shape_conflict"], service.address, job="kv-conflict",
                       timeout=90)
    assert code == 0, out
    for rank in (0, 1):
        seen = json.loads((tmp_path / f"shape_conflict-{rank}.json").read_text())
        assert seen["error"] is not None, f"rank {rank} saw no error"
        assert seen["cls"] == "KVStoreError" and seen["key"] == 4, seen
        assert "key 4" in seen["error"] and "(2, 3)" in seen["error"] and "(3, 2)" in seen["error"], seen


def test_init_takes_a_list_holding_one_value_and_refuses_two_as_mxnet_does(kv):
    local = mx.kv.create("local")
    for store in (local, kv):
        store.init("200", [mx.nd.ones(SHAPE) * 3])  # one key, a list holding its value
        out = mx.nd.zeros(SHAPE)
        store.pull("200", out=out)
        assert (out.asnumpy() == 3).all()
        with pytest.raises(MXNetError, match="duplicate init of key"):
            store.init("201", [mx.nd.ones(SHAPE), mx.nd.ones(SHAPE)])
