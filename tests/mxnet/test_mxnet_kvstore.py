"""The kvstore API used directly by 2 worker processes: dist_sync results as MXNet documents them.

MXNet's KVStore tutorial (https://mxnet.apache.org/versions/1.9.1/api/python/docs/tutorials/
packages/kvstore/kvstore.html) and dist_sync: init sets the value; a pull before any push returns
it; push adds the worker's value (summed over its devices) into a round, and a pull returns the
sum over all workers; with an optimizer set (update_on_kvstore), the server applies it to the
summed gradient and pulls return the weights. dist_async applies every push by itself, at once.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

mx = pytest.importorskip("mxnet", reason="MXNet 1.9.1 is not installed (CI installs it: pip install '.[mxnet]')")

import pslink.mxnet  # noqa: E402
from pslink.core.service import Service  # noqa: E402
from tests.mxnet.mxnet_procs import HERE, launch  # noqa: E402

pytestmark = pytest.mark.integration

WORKER = HERE / "mxnet_kv_worker.py"
SHAPE = (2, 3)


@pytest.fixture(scope="module")
def service():
    with Service(aggregators=2) as s:
        yield s


def run_scenario(service, tmp_path, scenario) -> list[dict]:
    code, out = launch(WORKER, [tmp_path, scenario], service.address, job=f"kv-{scenario}")
    assert code == 0, out
    return [json.loads((tmp_path / f"{scenario}-{rank}.json").read_text()) for rank in (0, 1)]


def full(value, shape=SHAPE) -> list:
    return np.full(shape, value, np.float32).tolist()


def test_init_push_pull_pushpull_broadcast_across_two_workers(service, tmp_path):
    records = run_scenario(service, tmp_path, "dist_sync")
    for rank, seen in enumerate(records):
        assert seen["class"] == "PSLink" and seen["rank"] == rank and seen["num_workers"] == 2
        assert "dist" in seen["type"] and "_sync" in seen["type"] and "async" not in seen["type"]
        assert seen["capable"] is True
        assert seen["unknown_capability"] == "Unknown capability: sparse"
        assert seen["init"] == full(2)                      # the initial value
        assert seen["push_8"] == full(16)                   # 8 from each of 2 workers
        assert seen["push_4_devices"] == [full(8)] * 2      # 4 devices x 1, from each of 2 workers
        assert seen["str_keys"] == [full(3, (4,)), full(30, (2, 2))]  # (1 + 2) and (10 + 20)
        assert seen["pushpull_in_place"] == full(3)         # rank 0 pushed 1, rank 1 pushed 2
        assert seen["pushpull_out"] == full(20)
        assert seen["broadcast"] == [full(10)] * 2          # rank 0's value on every device
        assert seen["int32"] == [3, 3, 3]


def test_pulls_inside_autograd_record_as_mxnets_nightly_sparse_step(service, tmp_path):
    """MXNet's nightly gluon_sparse_step_cpu: each worker pulls a row_sparse Parameter's rows
    inside autograd.record() and pushes (rank + 1) x ones; SGD with lr 1 on the store leaves
    1 - (1 + 2) = -2. Writing into the recorded array was refused by MXNet before."""
    records = run_scenario(service, tmp_path, "record")
    for seen in records:
        assert seen["sparse_step"] == np.full((2, 10), -2.0, np.float32).tolist()
        assert seen["dense_pull"] == full(5)
        assert seen["dense_grad"] == full(3)  # the graph after the pull is as MXNet's own store leaves it


def mxnet_sgd_reference(steps: int, lrs: list[float]) -> list:
    """What MXNet's own SGD does to the weights with the workers' summed gradients."""
    from tests.mxnet.mxnet_kv_worker import gradient

    opt = mx.optimizer.SGD(learning_rate=lrs[0], momentum=0.9, wd=0.01, rescale_grad=0.5, clip_gradient=1.0)
    updater = mx.optimizer.get_updater(opt)
    w = mx.nd.array(np.arange(6, dtype=np.float32).reshape(SHAPE) / 10)
    history = []
    for step in range(steps):
        opt.set_learning_rate(lrs[step])
        updater(0, mx.nd.array(gradient(step, 0) + gradient(step, 1)), w)
        history.append(w.asnumpy().copy())
    return history


def test_set_optimizer_updates_on_the_service_as_mxnet_sgd_does(service, tmp_path):
    records = run_scenario(service, tmp_path, "optimizer")
    expected = mxnet_sgd_reference(5, [0.1, 0.1, 0.05, 0.05, 0.05])
    for seen in records:
        assert seen["type"] == "pslink_dist_sync"
        for step, weights in enumerate(seen["weights"]):
            np.testing.assert_allclose(weights, expected[step], rtol=1e-5, atol=1e-6, err_msg=f"step {step}")
        # save_optimizer_states, then load_optimizer_states after another optimizer was set: the
        # saved learning rate is back on the service and the momentum kept going.
        assert seen["loaded_lr"] == 0.05
        np.testing.assert_allclose(seen["after_load"], expected[4], rtol=1e-5, atol=1e-6)
    # The learning rate change mattered (the check above can tell it apart).
    unchanged = mxnet_sgd_reference(4, [0.1] * 4)
    assert not np.allclose(unchanged[3], expected[3], atol=1e-4)
    # The saved file is MXNet's updater format: MXNet's own updater loads it.
    updater = mx.optimizer.get_updater(mx.optimizer.SGD())
    updater.set_states((tmp_path / "states-0").read_bytes())
    assert type(updater.optimizer).__name__ == "SGD" and updater.optimizer.lr == 0.05
    assert updater.optimizer.momentum == 0.9 and updater.optimizer.num_update == 4
    # ... with the momentum the service had after 4 steps, which is MXNet's own after the same steps
    from tests.mxnet.mxnet_kv_worker import gradient

    reference = mx.optimizer.get_updater(mx.optimizer.SGD(learning_rate=0.1, momentum=0.9, wd=0.01, rescale_grad=0.5,
                                                          clip_gradient=1.0))
    w = mx.nd.array(np.arange(6, dtype=np.float32).reshape(SHAPE) / 10)
    for step, lr in enumerate([0.1, 0.1, 0.05, 0.05]):
        reference.optimizer.set_learning_rate(lr)
        reference(0, mx.nd.array(gradient(step, 0) + gradient(step, 1)), w)
    np.testing.assert_allclose(updater.states[0].asnumpy(), reference.states[0].asnumpy(), rtol=1e-5, atol=1e-6)
    assert np.any(updater.states[0].asnumpy())


def test_async_store_applies_every_push_at_once(service, tmp_path):
    records = run_scenario(service, tmp_path, "async")
    for seen in records:
        assert "dist" in seen["type"] and "_async" in seen["type"]
        # 10 pushes of ones, each stepping SGD(lr 0.1) by itself: 0 - 10 x 0.1.
        np.testing.assert_allclose(seen["after_all_pushes"], full(-1.0), rtol=1e-6)


def mxnet_optimizers():
    """MXNet optimizers with the settings where MXNet's rules differ from PyTorch's."""
    return {
        "sgd-clip-wd": lambda: mx.optimizer.SGD(learning_rate=0.2, wd=0.05, rescale_grad=0.25, clip_gradient=0.3),
        "sgd-momentum-scheduler": lambda: mx.optimizer.SGD(
            momentum=0.8, wd=0.01, clip_gradient=1.0,
            lr_scheduler=mx.lr_scheduler.FactorScheduler(step=2, factor=0.5, base_lr=0.1)),
        "adam-large-epsilon": lambda: mx.optimizer.Adam(learning_rate=0.05, epsilon=0.1, wd=0.02, clip_gradient=0.5),
        # MXNet's other optimizers (pslink.core.optim.mxnet_rules), each with clipping and weight decay
        "nag": lambda: mx.optimizer.NAG(momentum=0.9, learning_rate=0.1, wd=0.05, rescale_grad=0.5, clip_gradient=0.8),
        "nag-no-momentum": lambda: mx.optimizer.NAG(learning_rate=0.1, wd=0.01),
        "adagrad": lambda: mx.optimizer.AdaGrad(learning_rate=0.1, wd=0.01, clip_gradient=2.0, rescale_grad=0.5),
        "adadelta": lambda: mx.optimizer.AdaDelta(rho=0.8, epsilon=1e-4, wd=0.01, clip_gradient=2.0),
        "rmsprop": lambda: mx.optimizer.RMSProp(learning_rate=0.01, gamma1=0.8, wd=0.02, clip_gradient=2.0,
                                                clip_weights=1.5),
        "rmsprop-centered": lambda: mx.optimizer.RMSProp(learning_rate=0.01, gamma1=0.8, gamma2=0.7, centered=True,
                                                         wd=0.02, clip_gradient=2.0),
        "signum": lambda: mx.optimizer.Signum(learning_rate=0.01, momentum=0.9, wd=0.01, wd_lh=0.02, clip_gradient=2.0),
        # (MXNet's own signsgd_update refuses wd_lh: without momentum it is left out)
        "signum-no-momentum": lambda: mx.optimizer.Signum(learning_rate=0.01, momentum=0.0, wd=0.01),
        "ftrl": lambda: mx.optimizer.Ftrl(learning_rate=0.1, lamda1=0.05, beta=0.5, wd=0.01, clip_gradient=2.0),
        "adamax": lambda: mx.optimizer.Adamax(learning_rate=0.01, beta1=0.8, beta2=0.9, wd=0.02, clip_gradient=2.0),
        "ftml": lambda: mx.optimizer.FTML(learning_rate=0.01, beta1=0.6, beta2=0.99, wd=0.02, clip_gradient=2.0),
        "lamb": lambda: mx.optimizer.LAMB(learning_rate=0.01, wd=0.02, clip_gradient=2.0, rescale_grad=0.5),
        "lamb-bounded-no-correction": lambda: mx.optimizer.LAMB(learning_rate=0.01, lower_bound=0.5, upper_bound=2.0,
                                                                bias_correction=False, wd=0.01),
        "test": lambda: mx.optimizer.Test(rescale_grad=0.5),
    }


@pytest.mark.parametrize("name", list(mxnet_optimizers()))
def test_the_service_steps_as_mxnets_own_optimizer(service, name, tmp_path):
    make = mxnet_optimizers()[name]
    rng = np.random.default_rng(7)
    w0 = rng.standard_normal(SHAPE).astype(np.float32)
    grads = [rng.standard_normal(SHAPE).astype(np.float32) * 3 for _ in range(6)]

    reference = make()
    updater = mx.optimizer.get_updater(reference)
    w_ref = mx.nd.array(w0)
    kv = pslink.mxnet.PSLink(job=f"rules-{name}", rank=0, num_workers=1, master=service.address, timeout=20)
    try:
        kv.set_optimizer(make())
        kv.init("w", mx.nd.array(w0))
        w = mx.nd.zeros(SHAPE)
        for step, g in enumerate(grads):
            updater("w", mx.nd.array(g), w_ref)
            kv.pushpull("w", mx.nd.array(g), out=w)
            np.testing.assert_allclose(w.asnumpy(), w_ref.asnumpy(), rtol=1e-5, atol=1e-6, err_msg=f"step {step}")
        # The state the service kept, written as MXNet's updater writes it, is MXNet's state.
        path = tmp_path / "states"
        kv.save_optimizer_states(str(path))
        loaded = mx.optimizer.get_updater(make())
        loaded.set_states(path.read_bytes())
        theirs, ours = updater.states.get("w"), loaded.states.get("w")
        if name == "test":
            return  # MXNet's test optimizer keeps a copy of the weights, the service nothing
        theirs = [] if theirs is None else list(theirs) if isinstance(theirs, (tuple, list)) else [theirs]
        ours = [] if ours is None else list(ours) if isinstance(ours, (tuple, list)) else [ours]
        assert len(ours) == len(theirs)
        for a, b in zip(ours, theirs):
            np.testing.assert_allclose(a.asnumpy(), b.asnumpy(), rtol=1e-5, atol=1e-6)
    finally:
        kv.close()


def test_a_state_file_from_a_local_run_loads_its_optimizer_and_its_momentum(service, tmp_path):
    local = mx.optimizer.get_updater(mx.optimizer.SGD(learning_rate=0.3, momentum=0.5))
    w = mx.nd.ones(SHAPE)
    local(0, mx.nd.ones(SHAPE), w)  # creates momentum state for key 0: -0.3
    path = tmp_path / "local-states"
    path.write_bytes(local.get_states(dump_optimizer=True))

    kv = pslink.mxnet.PSLink(job="load-local", rank=0, num_workers=1, master=service.address, timeout=20)
    try:
        kv.set_optimizer(mx.optimizer.SGD(learning_rate=1.0))
        kv.init(0, mx.nd.zeros(SHAPE))
        kv.load_optimizer_states(str(path))
        out = mx.nd.zeros(SHAPE)
        kv.pushpull(0, mx.nd.ones(SHAPE), out=out)
        # The file's SGD(lr 0.3, momentum 0.5) stepped from the file's momentum, as MXNet's own
        # updater continues: momentum 0.5 * -0.3 - 0.3 * 1 = -0.45 added to the weights (0).
        expected = mx.nd.zeros(SHAPE)
        local(0, mx.nd.ones(SHAPE), expected)
        np.testing.assert_allclose(out.asnumpy(), np.full(SHAPE, -0.45), rtol=1e-6)
        np.testing.assert_allclose(out.asnumpy(), expected.asnumpy(), rtol=1e-6)
        # an uninitialized key in the file is refused, naming it
        other = tmp_path / "other-states"
        local(7, mx.nd.ones(SHAPE), mx.nd.ones(SHAPE))
        other.write_bytes(local.get_states(dump_optimizer=True))
        with pytest.raises(mx.base.MXNetError, match=r"key\(s\) \[7\] that this store has not initialized"):
            kv.load_optimizer_states(str(other))
    finally:
        kv.close()


@pytest.mark.parametrize("kind", ["sgd", "adagrad"])
def test_keys_with_their_own_learning_rate_and_weight_decay_step_as_mxnet(service, kind):
    """lr_mult and wd_mult (the Module API sets wd_mult 0 for biases) reach the service per key."""
    def make():
        opt = (mx.optimizer.SGD(learning_rate=0.1, momentum=0.9, wd=0.05) if kind == "sgd"
               else mx.optimizer.AdaGrad(learning_rate=0.1, wd=0.05))
        opt.set_lr_mult({"e": 2.5})
        opt.set_wd_mult({"b": 0.0, "e": 3.0})
        return opt

    rng = np.random.default_rng(3)
    keys = ["w", "b", "e"]
    w0 = {k: rng.standard_normal(SHAPE).astype(np.float32) for k in keys}
    updater = mx.optimizer.get_updater(make())
    reference = {k: mx.nd.array(w0[k]) for k in keys}
    kv = pslink.mxnet.PSLink(job=f"mults-{kind}", rank=0, num_workers=1, master=service.address, timeout=20)
    try:
        kv.set_optimizer(make())
        kv.init(keys, [mx.nd.array(w0[k]) for k in keys])
        outs = [mx.nd.zeros(SHAPE) for _ in keys]
        for step in range(4):
            grads = [mx.nd.array(rng.standard_normal(SHAPE).astype(np.float32)) for _ in keys]
            for k, g in zip(keys, grads):
                updater(k, g, reference[k])
            kv.pushpull(keys, grads, out=outs)
            for k, out in zip(keys, outs):
                np.testing.assert_allclose(out.asnumpy(), reference[k].asnumpy(), rtol=1e-5, atol=1e-6,
                                           err_msg=f"key {k} step {step}")
    finally:
        kv.close()
