"""Optimizer state on the service (optimizer mode): read for a checkpoint, written to resume."""

from __future__ import annotations

import numpy as np
import pytest

import pslink
from pslink.errors import ConfigError, KeyStateError, ShapeMismatchError
from tests.helpers import serving

SETTINGS = {
    "sgd": {"type": "sgd", "lr": 0.05, "momentum": 0.9},
    "adam": {"type": "adam", "lr": 0.01},
}


@pytest.fixture
def cluster():
    yield from serving("tcp")


def gradient(step: int) -> np.ndarray:
    return np.random.default_rng(step).standard_normal(5000).astype(np.float32)


def train(agent, steps: range) -> np.ndarray:
    for step in steps:
        weights = agent.pushpull("w", gradient(step)).wait()
    return weights


@pytest.mark.parametrize("kind", list(SETTINGS))
def test_a_job_resumed_from_weights_and_optimizer_state_continues_bit_identically(cluster, kind):
    service, transports = cluster
    # 5000 float32 in parts of 4 KiB: the key spans several parts on both Aggregators
    options = dict(master=service.address, transports=transports, optimizer=SETTINGS[kind], partition_bytes=4096,
                   timeout=20)
    initial = np.linspace(-1, 1, 5000, dtype=np.float32)
    with pslink.connect(f"straight-{kind}", 0, 1, **options) as straight:
        straight.init("w", initial).wait()
        train(straight, range(3))
        assert len(straight.key_info("w")["parts"]) > 1
        checkpoint_weights = straight.pull("w").wait().copy()
        checkpoint_state = straight.optimizer_state()
        expected = train(straight, range(3, 6))
    state = checkpoint_state["w"]
    names = {"sgd": {"momentum_buffer"}, "adam": {"exp_avg", "exp_avg_sq", "step"}}[kind]
    assert set(state) == names
    assert all(v.shape == (5000,) and v.dtype == np.float32 and np.any(v) for v in state.values() if hasattr(v, "shape"))
    if kind == "adam":
        assert state["step"] == 3
    with pslink.connect(f"resumed-{kind}", 0, 1, **options) as resumed:
        resumed.init("w", checkpoint_weights).wait()
        resumed.set_optimizer_state(checkpoint_state)
        np.testing.assert_array_equal(train(resumed, range(3, 6)), expected)
    # without the state the resumed run differs: the test would notice a state that did nothing
    with pslink.connect(f"fresh-{kind}", 0, 1, **options) as fresh:
        fresh.init("w", checkpoint_weights).wait()
        assert not np.array_equal(train(fresh, range(3, 6)), expected)


def test_a_key_never_stepped_has_an_empty_state_and_an_empty_state_resets(cluster):
    service, transports = cluster
    with pslink.connect("reset", 0, 1, master=service.address, transports=transports, optimizer=SETTINGS["sgd"],
                        timeout=20) as agent:
        agent.init("w", np.zeros(5000, np.float32)).wait()
        assert agent.optimizer_state() == {"w": {}}
        once = train(agent, range(1)).copy()
        agent.set_optimizer_state({"w": {}})
        # with the momentum forgotten, a step with the same gradient moves by the same amount again
        np.testing.assert_allclose(train(agent, range(1)) - once, once, rtol=1e-6)


def test_bad_states_are_refused_naming_the_key(cluster):
    service, transports = cluster
    options = dict(master=service.address, transports=transports, timeout=20)
    with pslink.connect("bad-state", 0, 1, optimizer=SETTINGS["adam"], **options) as agent:
        agent.init("w", np.zeros(5000, np.float32)).wait()
        train(agent, range(1))
        with pytest.raises(ConfigError, match=r"key 'w'.*optimizer 'adam' keeps state.*got arrays \['exp_avg'\]"):
            agent.set_optimizer_state({"w": {"exp_avg": np.zeros(5000, np.float32)}})
        with pytest.raises(ShapeMismatchError, match=r"key 'w': optimizer state 'exp_avg' has shape \(4,\)"):
            agent.set_optimizer_state({"w": {"exp_avg": np.zeros(4, np.float32)}})
        with pytest.raises(ConfigError, match="must be a non-negative int"):
            zeros = np.zeros(5000, np.float32)
            agent.set_optimizer_state({"w": {"exp_avg": zeros, "exp_avg_sq": zeros, "step": -1}})
        assert agent.optimizer_state()["w"]["step"] == 1  # nothing above changed it
    with pslink.connect("sum-state", 0, 1, **options) as agent:
        agent.init("w", np.zeros(8, np.float32)).wait()
        with pytest.raises(KeyStateError, match=r"job 'sum-state' keeps no optimizer state.*sum mode"):
            agent.optimizer_state()
