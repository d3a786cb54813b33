"""The multi-job benchmark's pieces: the stand-in models, their gradients, and how a phase is read."""

from __future__ import annotations

import time

import numpy as np
import pytest

from pslink.bench.multijob import (
    MODELS,
    SCALE,
    CpuMeter,
    Mlp,
    Model,
    batches,
    common_window,
    durations_within,
    iteration_counts,
)


def _loss(net: Mlp, x, y) -> float:
    return net.loss(x, y)


def test_gradients_match_finite_differences():
    model = Model("tiny", 0, 0, layers=3, width=5, batch=4)
    net = Mlp(model, seed=3)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 5)).astype(np.float32)
    y = rng.standard_normal((4, 5)).astype(np.float32)
    grads = [g.copy() for g in net.gradients(x, y)]
    eps = 1e-2
    for p, g in zip(net.weights, grads):
        for index in [(0,) * p.ndim, tuple(s - 1 for s in p.shape)]:
            saved = p[index]
            p[index] = saved + eps
            up = _loss(net, x, y)
            p[index] = saved - eps
            down = _loss(net, x, y)
            p[index] = saved
            assert (up - down) / (2 * eps) == pytest.approx(float(g[index]), rel=2e-2, abs=2e-3), index


def test_steps_on_the_averaged_gradient_lower_the_loss_and_replicas_stay_identical():
    model = Model("tiny", 0, 0, layers=2, width=16, batch=32)
    a, b = Mlp(model, seed=1), Mlp(model, seed=1)
    (x0, y0), (x1, y1) = batches(model, 0, 0, 1)[0], batches(model, 0, 1, 1)[0]
    first = _loss(a, x0, y0) + _loss(a, x1, y1)
    for _ in range(30):
        g0 = [g.copy() for g in a.gradients(x0, y0)]
        g1 = a.gradients(x1, y1)
        average = [(u + v) * np.float32(0.5) for u, v in zip(g0, g1)]
        a.step(average, lr=1e-2)
        b.step(average, lr=1e-2)
    assert _loss(a, x0, y0) + _loss(a, x1, y1) < first
    assert a.digest() == b.digest()


def test_stand_ins_keep_the_real_models_proportions():
    for model in MODELS.values():
        assert model.parameters == pytest.approx(model.params / SCALE, rel=0.01), model
        assert model.batch >= 8
    flops = {name: m.flops for name, m in MODELS.items()}
    assert flops["alexnet"] < flops["resnet50"] < min(flops["vgg19"], flops["bert"])
    sizes = sorted(MODELS, key=lambda n: MODELS[n].parameters)
    assert sizes == sorted(MODELS, key=lambda n: MODELS[n].params)


def test_each_rank_draws_its_own_batches_and_the_same_ones_every_time():
    model = MODELS["alexnet"]
    (x0, _), = batches(model, 2, 0, 1)
    (x1, _), = batches(model, 2, 1, 1)
    (again, _), = batches(model, 2, 0, 1)
    assert x0.shape == (model.batch, model.width) and x0.dtype == np.float32
    assert not np.array_equal(x0, x1)
    assert np.array_equal(x0, again)


def test_the_window_is_while_every_job_ran():
    spans = {"a": [(0.0, 1.0), (1.0, 2.0), (2.0, 3.0), (3.0, 4.0)], "b": [(0.5, 2.5), (2.5, 3.5)]}
    window = common_window(spans)
    assert window == (0.5, 3.5)
    assert durations_within(spans["a"], window) == [1.0, 1.0]  # the first started too early, the last ended late
    assert durations_within(spans["b"], window) == [2.0, 1.0]
    with pytest.raises(ValueError, match="'c'"):
        common_window({**spans, "c": []})


def test_iteration_counts_fill_a_phase_with_a_floor():
    assert iteration_counts({"fast": 0.1, "slow": 2.0}, 10.0, 6) == {"fast": 100, "slow": 6}
    with pytest.raises(ValueError, match="positive"):
        iteration_counts({"broken": 0.0}, 10.0, 1)
    with pytest.raises(ValueError, match="seconds"):
        iteration_counts({"a": 0.1}, 0.0, 1)


class _FakeMeter(CpuMeter):
    """CPU seconds by pid from ``clock`` (a pid missing there has ended)."""

    def __init__(self, pids, clock: dict):
        super().__init__(pids)
        self.clock = clock

    def _read(self, pid):
        return self.clock.get(pid)


def test_cpu_meter_counts_newcomers_from_zero_and_keeps_what_the_departed_burned():
    pids = [1, 2]
    clock = {1: 10.0, 2: 5.0}
    meter = _FakeMeter(lambda: list(pids), clock)
    meter.start()
    clock.update({1: 11.0, 2: 5.5, 3: 0.25})
    pids.append(3)  # started during the window: all its CPU is the window's
    meter.sample()
    del clock[2]  # ended: what it was last seen at stays counted
    clock[1] = 12.0
    meter.sample()
    assert meter.seconds == pytest.approx(2.0 + 0.5 + 0.25)
    assert meter.most == 3


def test_cpu_meter_reads_a_real_process():
    import os

    meter = CpuMeter(lambda: [os.getpid()])
    meter.start()
    deadline = time.monotonic() + 30
    while meter.seconds < 0.02 and time.monotonic() < deadline:  # CPU burned here, however busy the host
        np.sum(np.ones(200_000))
        meter.sample()
    assert meter.seconds >= 0.02 and meter.most == 1

