"""Server-side optimizers against reference implementations of the documented update rules."""

from __future__ import annotations

import math

import numpy as np
import pytest

from pslink.core.optim import make_optimizer
from pslink.core.optim.rules import SGD, Adam
from pslink.errors import ConfigError


def reference_sgd(w, grads, lr, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False):
    """torch.optim.SGD's algorithm, written out step by step (no in-place tricks)."""
    w = w.astype(np.float64)
    buf = None
    for g in grads:
        g = g + weight_decay * w
        if momentum:
            buf = g.copy() if buf is None else momentum * buf + (1 - dampening) * g
            g = g + momentum * buf if nesterov else buf
        w = w - lr * g
    return w


def reference_adam(w, grads, lr, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0):
    """torch.optim.Adam's algorithm (amsgrad off)."""
    w = w.astype(np.float64)
    m = np.zeros_like(w)
    v = np.zeros_like(w)
    for t, g in enumerate(grads, start=1):
        g = g + weight_decay * w
        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g * g
        m_hat = m / (1 - beta1**t)
        v_hat = v / (1 - beta2**t)
        w = w - lr * m_hat / (np.sqrt(v_hat) + eps)
    return w


def run(optimizer, w0, grads):
    w = w0.copy()
    state: dict = {}
    for g in grads:
        optimizer.step(w, g.copy(), state)
    return w


@pytest.fixture
def problem():
    rng = np.random.default_rng(1)
    w0 = rng.standard_normal(257).astype(np.float64)
    grads = [rng.standard_normal(257) for _ in range(25)]
    return w0, grads


@pytest.mark.parametrize("settings", [
    dict(lr=0.1),
    dict(lr=0.05, momentum=0.9),
    dict(lr=0.05, momentum=0.9, dampening=0.3),
    dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-2),
])
def test_sgd_matches_the_reference(problem, settings):
    w0, grads = problem
    got = run(SGD({"type": "sgd", **settings}), w0, grads)
    np.testing.assert_allclose(got, reference_sgd(w0, grads, **settings), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("settings", [
    dict(lr=1e-3),
    dict(lr=1e-2, beta1=0.8, beta2=0.99, eps=1e-6, weight_decay=1e-3),
])
def test_adam_matches_the_reference(problem, settings):
    w0, grads = problem
    got = run(Adam({"type": "adam", **settings}), w0, grads)
    np.testing.assert_allclose(got, reference_adam(w0, grads, **settings), rtol=1e-10, atol=1e-12)


def test_float32_weights_stay_float32(problem):
    w0, grads = problem
    w = w0.astype(np.float32)
    state: dict = {}
    opt = Adam({"type": "adam", "lr": 1e-2})
    for g in grads:
        opt.step(w, g.astype(np.float32), state)
    assert w.dtype == np.float32 and state["exp_avg"].dtype == np.float32
    np.testing.assert_allclose(w, reference_adam(w0, grads, lr=1e-2), rtol=1e-4, atol=1e-5)


def test_gradient_scale_averages_and_rescales():
    assert make_optimizer({"type": "sgd", "lr": 1}).grad_scale(4) == 0.25
    assert make_optimizer({"type": "sgd", "lr": 1, "average": False}).grad_scale(4) == 1.0
    assert make_optimizer({"type": "sgd", "lr": 1, "rescale_grad": 0.5}).grad_scale(2) == 0.25


@pytest.mark.parametrize("config, match", [
    ({"type": "lars"}, "unknown optimizer type 'lars'"),
    ({"lr": 0.1}, "unknown optimizer type None"),
    ({"type": "sgd"}, "lr is required"),
    ({"type": "sgd", "lr": -1}, "lr=-1 is outside"),
    ({"type": "sgd", "lr": float("nan")}, "lr must be a finite number"),
    ({"type": "sgd", "lr": 0.1, "momentun": 0.9}, "unknown setting\\(s\\) \\['momentun'\\]"),
    ({"type": "sgd", "lr": 0.1, "nesterov": True}, "nesterov needs momentum"),
    ({"type": "adam", "beta1": 1.0}, "beta1=1.0 is outside"),
    ({"type": "adam", "average": "yes"}, "average must be true or false"),
    ("sgd", "described by a dict"),
])
def test_bad_optimizer_configs_are_named(config, match):
    with pytest.raises(ConfigError, match=match):
        make_optimizer(config)


def test_against_torch_optim_when_torch_is_installed(problem):
    torch = pytest.importorskip("torch", reason="torch not installed: the numpy references above still run")
    w0, grads = problem
    for cls, make, settings in [
        (SGD, torch.optim.SGD, dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-2)),
        (Adam, torch.optim.Adam, dict(lr=1e-2, weight_decay=1e-3)),
    ]:
        param = torch.nn.Parameter(torch.tensor(w0))
        opt = make([param], **settings)
        for g in grads:
            param.grad = torch.tensor(g)
            opt.step()
        ours = run(cls({"type": cls.name, **settings}), w0, grads)
        np.testing.assert_allclose(ours, param.detach().numpy(), rtol=1e-10, atol=1e-12)


# -- optional settings that reproduce MXNet's update rules (pslink.mxnet sends them) -------------


def reference_mxnet_sgd(w, grads, lrs, momentum=0.0, weight_decay=0.0, clip=None):
    """MXNet's sgd_mom_update: mom = momentum * mom + lr * (clip(g) + wd * w); w -= mom."""
    w = w.astype(np.float64)
    mom = np.zeros_like(w)
    for g, lr in zip(grads, lrs):
        if clip is not None:
            g = np.clip(g, -clip, clip)
        mom = momentum * mom + lr * (g + weight_decay * w)
        w = w - mom
    return w


def reference_mxnet_adam(w, grads, lr, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, clip=None):
    """MXNet's Adam: g = clip(g + wd * w); w -= lr * sqrt(1 - b2^t) / (1 - b1^t) * m / (sqrt(v) + eps)."""
    w = w.astype(np.float64)
    m = np.zeros_like(w)
    v = np.zeros_like(w)
    for t, g in enumerate(grads, start=1):
        g = g + weight_decay * w
        if clip is not None:
            g = np.clip(g, -clip, clip)
        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g * g
        w = w - lr * math.sqrt(1 - beta2**t) / (1 - beta1**t) * m / (np.sqrt(v) + eps)
    return w


def test_lr_in_momentum_matches_mxnet_rule_also_when_lr_changes(problem):
    w0, grads = problem
    lrs = [0.05] * 10 + [0.01] * 15
    opt = SGD({"type": "sgd", "lr": 0.05, "momentum": 0.9, "weight_decay": 1e-2, "lr_in_momentum": True})
    w, state = w0.copy(), {}
    for g, lr in zip(grads, lrs):
        opt.lr = lr  # what a new config with the same type does: state kept, lr changed
        opt.step(w, g.copy(), state)
    np.testing.assert_allclose(w, reference_mxnet_sgd(w0, grads, lrs, 0.9, 1e-2), rtol=1e-12, atol=1e-12)
    # With a constant lr both rules give the same weights.
    same = run(SGD({"type": "sgd", "lr": 0.05, "momentum": 0.9, "lr_in_momentum": True}), w0, grads)
    np.testing.assert_allclose(same, reference_sgd(w0, grads, lr=0.05, momentum=0.9), rtol=1e-10, atol=1e-12)
    # ...and different ones once it changes.
    torch_rule = SGD({"type": "sgd", "lr": 0.05, "momentum": 0.9, "weight_decay": 1e-2})
    w_torch, state = w0.copy(), {}
    for g, lr in zip(grads, lrs):
        torch_rule.lr = lr
        torch_rule.step(w_torch, g.copy(), state)
    assert not np.allclose(w, w_torch, atol=1e-3)


def test_sgd_clips_the_gradient_before_weight_decay(problem):
    w0, grads = problem
    grads = [3 * g for g in grads]
    opt = SGD({"type": "sgd", "lr": 0.05, "momentum": 0.9, "weight_decay": 0.1, "clip_gradient": 1.0,
               "lr_in_momentum": True})
    expected = reference_mxnet_sgd(w0, grads, [0.05] * len(grads), 0.9, 0.1, clip=1.0)
    np.testing.assert_allclose(run(opt, w0, grads), expected, rtol=1e-12, atol=1e-12)
    unclipped = run(SGD({"type": "sgd", "lr": 0.05, "momentum": 0.9, "weight_decay": 0.1}), w0, grads)
    assert not np.allclose(unclipped, expected, atol=1e-3)


def test_adam_with_mxnet_epsilon_and_clipping(problem):
    w0, grads = problem
    settings = dict(lr=1e-2, beta1=0.8, beta2=0.99, eps=0.1, weight_decay=1e-2)
    opt = Adam({"type": "adam", **settings, "eps_after_bias_correction": False, "clip_gradient": 0.5})
    expected = reference_mxnet_adam(w0, grads, **settings, clip=0.5)
    np.testing.assert_allclose(run(opt, w0, grads), expected, rtol=1e-10, atol=1e-12)
    # The default keeps PyTorch's rule, which a large eps tells apart.
    torch_rule = run(Adam({"type": "adam", **settings}), w0, grads)
    np.testing.assert_allclose(torch_rule, reference_adam(w0, grads, **settings), rtol=1e-10, atol=1e-12)
    assert not np.allclose(torch_rule, reference_mxnet_adam(w0, grads, **settings), atol=1e-4)


@pytest.mark.parametrize("config, match", [
    ({"type": "sgd", "lr": 0.1, "clip_gradient": 0}, "clip_gradient must be > 0"),
    ({"type": "sgd", "lr": 0.1, "clip_gradient": -1.0}, "clip_gradient=-1.0 is outside"),
    ({"type": "sgd", "lr": 0.1, "lr_in_momentum": 1}, "lr_in_momentum must be true or false"),
    ({"type": "adam", "eps_after_bias_correction": "no"}, "eps_after_bias_correction must be true or false"),
    ({"type": "adam", "lr_in_momentum": True}, "unknown setting\\(s\\) \\['lr_in_momentum'\\]"),
])
def test_bad_mxnet_rule_settings_are_named(config, match):
    with pytest.raises(ConfigError, match=match):
        make_optimizer(config)


def previous_sgd_step(weights, grad, state, lr, momentum=0.0, dampening=0.0):
    """The step as it was written with temporaries (before it reused the gradient's array)."""
    if momentum:
        buf = state.get("momentum_buffer")
        if buf is None:
            buf = state["momentum_buffer"] = grad.copy()
        else:
            buf *= momentum
            buf += (1.0 - dampening) * grad
        grad = buf
    weights -= lr * grad


@pytest.mark.parametrize("settings", [dict(lr=0.1), dict(lr=0.05, momentum=0.9),
                                      dict(lr=0.05, momentum=0.9, dampening=0.3)])
def test_sgd_in_place_is_bit_identical_to_the_step_with_temporaries(settings):
    rng = np.random.default_rng(7)
    grads = [rng.standard_normal(1000).astype(np.float32) for _ in range(6)]
    ours, theirs = np.ones(1000, np.float32), np.ones(1000, np.float32)
    ours_state, theirs_state = {}, {}
    sgd = SGD({"type": "sgd", **settings})
    for g in grads:
        sgd.step(ours, g.copy(), ours_state)
        previous_sgd_step(theirs, g.copy(), theirs_state, **settings)
    np.testing.assert_array_equal(ours, theirs)


def test_sgd_with_momentum_steps_without_a_temporary_array():
    import tracemalloc

    n = 1 << 18
    sgd = SGD({"type": "sgd", "lr": 0.1, "momentum": 0.9, "dampening": 0.1})
    weights, state = np.ones(n, np.float32), {}
    sgd.step(weights, np.ones(n, np.float32), state)  # the first step makes the momentum buffer
    grad = np.ones(n, np.float32)
    tracemalloc.start()
    try:
        sgd.step(weights, grad, state)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < grad.nbytes // 4, f"the step allocated {peak} bytes (an array is {grad.nbytes})"


def test_a_key_with_its_own_factors_steps_with_its_own_learning_rate_and_weight_decay():
    sgd = make_optimizer({"type": "sgd", "lr": 0.1, "weight_decay": 0.01, "per_key": [["b", 1.0, 0.0], [7, 2.0, 3.0]]})
    assert sgd.for_key("w") is sgd
    assert (sgd.for_key("b").lr, sgd.for_key("b").weight_decay) == (0.1, 0.0)
    assert (sgd.for_key(7).lr, sgd.for_key(7).weight_decay) == pytest.approx((0.2, 0.03))
    assert sgd.for_key(7) is sgd.for_key(7)  # made once
    nag = make_optimizer({"type": "nag", "lr": 0.1, "wd": 0.01, "per_key": [["b", 1.0, 0.0]]})
    assert nag.for_key("b").wd == 0.0 and nag.for_key("b").lr == 0.1
    for bad in ([["b", 1.0]], [[None, 1.0, 1.0]], [["b", -1.0, 1.0]], "b"):
        with pytest.raises(ConfigError, match="per_key|lr_mult"):
            make_optimizer({"type": "sgd", "lr": 0.1, "per_key": bad})
