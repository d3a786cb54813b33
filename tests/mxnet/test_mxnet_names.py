"""The kvstore names: mx.kv.create, gluon.Trainer and Module given 'pslink' as a string.

MXNet makes no store for a name without "dist" in it when there is one device; pslink.mxnet makes
its names resolve anyway. Single-worker jobs in this process.
"""

from __future__ import annotations

import os

import pytest

mx = pytest.importorskip("mxnet", reason="MXNet 1.9.1 is not installed (CI installs it: pip install '.[mxnet]')")

from mxnet import gluon  # noqa: E402
from mxnet.base import MXNetError  # noqa: E402

import pslink.mxnet  # noqa: E402
from pslink.core.service import Service  # noqa: E402


@pytest.fixture(scope="module")
def service():
    with Service(aggregators=1) as s:
        yield s


def test_the_names_reach_registry_and_trainer(service, monkeypatch):
    monkeypatch.setenv("PSLINK_MASTER", service.address)
    monkeypatch.setenv("PSLINK_RANK", "0")
    monkeypatch.setenv("PSLINK_NUM_WORKERS", "1")
    monkeypatch.setenv("PSLINK_TIMEOUT", "20")
    monkeypatch.setenv("PSLINK_JOB", f"names-{os.getpid()}")
    store = mx.kv.create("PSLink")
    assert type(store) is pslink.mxnet.PSLink and store.type == "pslink_dist_sync"
    # One store per worker: a second one for the same rank is refused, naming why.
    with pytest.raises(MXNetError, match=r"job 'names-\d+' needs its token to register rank 0 .*a worker process "
                                         r"uses one pslink kvstore: create it once and pass it to every Trainer"):
        mx.kv.create("pslink")
    store.close()

    monkeypatch.setenv("PSLINK_JOB", f"names-async-{os.getpid()}")
    store = mx.kv.create("pslink_async")
    assert type(store) is pslink.mxnet.PSLink_Async and store.type == "pslink_dist_async"
    store.close()

    # By name, with one device: MXNet would make no store for a name without "dist" in it.
    monkeypatch.setenv("PSLINK_JOB", f"names-trainer-{os.getpid()}")
    net = gluon.nn.Dense(2, in_units=3)
    net.initialize(mx.init.One())
    trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.5}, kvstore="pslink")
    with mx.autograd.record():
        loss = net(mx.nd.ones((1, 3))).sum()
    loss.backward()
    trainer.step(1)
    assert type(trainer._kvstore) is pslink.mxnet.PSLink and trainer._update_on_kvstore is True
    # The service applied SGD: w = 1 - 0.5 * 1 for every weight, b = 1 - 0.5 * 1.
    assert net.weight.data().asnumpy().tolist() == [[0.5] * 3] * 2
    trainer._kvstore.close()
    # Other names are left to MXNet (one device, no "dist": no store).
    local = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.5}, kvstore="local")
    local._init_kvstore()
    assert local._kvstore is None


def test_the_module_api_takes_the_name_too(service, monkeypatch):
    for name, value in dict(PSLINK_MASTER=service.address, PSLINK_RANK="0", PSLINK_NUM_WORKERS="1",
                            PSLINK_TIMEOUT="20", PSLINK_JOB=f"module-{os.getpid()}").items():
        monkeypatch.setenv(name, value)
    data = mx.sym.FullyConnected(mx.sym.var("data"), num_hidden=2, name="fc")
    module = mx.mod.Module(mx.sym.LinearRegressionOutput(data, name="lro"), label_names=["lro_label"])
    batches = mx.io.NDArrayIter(mx.nd.ones((8, 3)), mx.nd.zeros((8, 2)), batch_size=4, label_name="lro_label")
    module.fit(batches, num_epoch=1, kvstore="pslink", optimizer="sgd", optimizer_params={"learning_rate": 0.1},
               initializer=mx.init.One())
    assert type(module._kvstore) is pslink.mxnet.PSLink and module._update_on_kvstore is True
    # Two steps of SGD on the service moved the weights off their initial ones.
    assert module.get_params()[0]["fc_weight"].asnumpy().max() < 1.0
    module._kvstore.close()
