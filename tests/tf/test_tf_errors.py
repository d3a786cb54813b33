"""Bad input to the TensorFlow adapter: clear errors that name what is wrong, never a hang."""

from __future__ import annotations

import socket

import pytest

pytest.importorskip("tensorflow", reason="TensorFlow is not installed (CI installs it: pip install '.[tf]')")

import tensorflow as tf
import tf_harness

import pslink.tf
from pslink.errors import ConfigError, PeerError
from tests.helpers import start_cluster


@pytest.fixture
def disconnected(monkeypatch):
    """No process-wide connection before or after the test, and no PSLINK_* from outside."""
    pslink.tf.shutdown()
    for name in ("PSLINK_MASTER", "PSLINK_JOB", "PSLINK_RANK", "PSLINK_NUM_WORKERS", "PSLINK_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    yield monkeypatch
    pslink.tf.shutdown()


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens once the socket is closed


def test_strategy_without_a_reachable_service_fails_at_construction(disconnected):
    address = f"tcp://127.0.0.1:{closed_port()}"
    disconnected.setenv("PSLINK_MASTER", address)
    disconnected.setenv("PSLINK_JOB", "nothing-there")
    disconnected.setenv("PSLINK_RANK", "0")
    disconnected.setenv("PSLINK_NUM_WORKERS", "2")
    with pytest.raises(PeerError) as caught:
        pslink.tf.ParameterServiceStrategy()
    message = str(caught.value)
    assert message.startswith("pslink.tf.init: no parameter service reachable")
    assert address in message
    assert "pslink service up" in message and "pslink launch" in message
    assert not pslink.tf.is_initialized()


def test_without_a_job_named_anywhere_the_process_is_a_job_of_one(disconnected):
    # As Horovod without horovodrun: a script runs as size 1, on a service of its own.
    strategy = pslink.tf.ParameterServiceStrategy()
    assert (strategy.rank, strategy.num_workers) == (0, 1)
    assert (pslink.tf.rank(), pslink.tf.size(), pslink.tf.local_rank(), pslink.tf.local_size()) == (0, 1, 0, 1)
    assert float(pslink.tf.allreduce(tf.constant(3.0), op=pslink.tf.Sum)) == 3.0


def test_horovod_calls_before_init_say_so(disconnected):
    with pytest.raises(ConfigError, match=r"pslink.tf has not been initialized; call pslink.tf.init\(\) first"):
        pslink.tf.rank()
    disconnected.setenv("PSLINK_MASTER", f"tcp://127.0.0.1:{closed_port()}")
    disconnected.setenv("PSLINK_JOB", "nothing-there")
    disconnected.setenv("PSLINK_RANK", "1")
    disconnected.setenv("PSLINK_NUM_WORKERS", "2")
    with pytest.raises(PeerError, match="no parameter service reachable"):
        pslink.tf.init()


def test_a_job_that_reduces_on_the_service_is_refused(disconnected):
    service = start_cluster("tcp", aggregators=1)
    try:
        with pytest.raises(ConfigError, match="pslink.tf reduces on the service in mode 'sum'"):
            pslink.tf.ParameterServiceStrategy(job="server-side-sgd", rank=0, num_workers=1, master=service.address,
                                               optimizer={"type": "sgd", "lr": 0.1})
        assert not pslink.tf.is_initialized()
    finally:
        service.stop()


@pytest.mark.integration
@pytest.mark.timeout(300)
@pytest.mark.parametrize("scenario, who, variable, shapes", [
    # rank 1's hidden layer is wider
    ("wider", "ParameterServiceStrategy", "sequential/dense/kernel", ("(64, 32)", "(64, 40)")),
    # rank 1 has one more layer: the first variable that differs is the next layer's kernel
    ("deeper", "ParameterServiceStrategy", "sequential/dense_1/kernel", ("(32, 10)", "(32, 32)")),
    # no strategy: DistributedOptimizer checks the variables when their gradients first meet
    ("wrapper", "DistributedOptimizer(SGD)", "sequential/dense/kernel", ("(64, 32)", "(64, 40)")),
])
def test_workers_whose_models_differ_both_get_an_error_naming_the_variable(tmp_path, scenario, who, variable,
                                                                           shapes):
    # Each worker prints the error it got and exits 0, so the launch waits for both: a worker
    # left waiting would time the launch out.
    outcome = tf_harness.launch_worker(scenario, str(tmp_path), timeout=240)
    assert outcome.code == 0 and not outcome.timed_out, outcome.describe()
    assert "training finished although the models differ" not in outcome.output
    expected = (f"failed with ShapeMismatchError: {who}: the workers' models differ: variable {variable!r} "
                f"is {shapes[0]} float32 on rank 0 but {shapes[1]} float32 on rank 1")
    for rank in (0, 1):
        assert f"[rank{rank}]: {expected}" in outcome.output, outcome.describe()
