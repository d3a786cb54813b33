"""Failures with real processes: lost and repeated messages, killed Aggregators, workers and pMaster.

Aggregators run as processes started by the service (the ``local`` provider); workers run on
threads of the test process over real sockets unless a test needs them killed. Every wait has a
deadline; every process is reaped.
"""

from __future__ import annotations

import numpy as np
import pytest

import pslink
from pslink.core.faults import Faults
from pslink.core.service import Service
from pslink.errors import ConfigError
from tests.helpers import run_workers

pytestmark = pytest.mark.integration

OPTIMIZER = {"type": "sgd", "lr": 0.01, "momentum": 0.9}


def gradient(rank: int, step: int, key: int) -> np.ndarray:
    return np.random.default_rng(1000 * step + 10 * key + rank).standard_normal(3000).astype(np.float32)


def train(service: Service, job: str, steps: int, faults: Faults | None = None) -> list[np.ndarray]:
    """Two workers, three keys of three parts each (4 KiB partitions), momentum SGD on the service."""

    def worker(rank):
        options = dict(faults=faults, resend_timeout=0.2, probe_interval=0.05) if faults else {}
        with pslink.connect(job, rank, 2, master=service.address, optimizer=OPTIMIZER, partition_bytes=4096,
                            timeout=60, **options) as agent:
            keys = [0, 1, 2]
            agent.init_many(keys, [np.linspace(-1, 1, 3000, dtype=np.float32) * (k + 1) for k in keys]).wait()
            for step in range(steps):
                outs = agent.pushpull_many(keys, [gradient(rank, step, k) for k in keys]).wait()
            return [o.copy() for o in outs]

    return run_workers(2, worker, timeout=120)


def test_one_percent_of_messages_lost_and_one_percent_repeated_change_nothing(monkeypatch):
    with Service(aggregators=2) as clean_service:
        clean = train(clean_service, "clean", 60)
    # The Aggregator processes read PSLINK_FAULTS from the environment they inherit.
    monkeypatch.setenv("PSLINK_FAULTS", "drop=0.01,dup=0.01,delay=0.01,delay_ms=30,seed=3")
    with Service(aggregators=2) as faulty_service:
        faults = Faults(drop=0.01, dup=0.01, delay=0.01, delay_ms=30, seed=5)
        faulty = train(faulty_service, "faulty", 60, faults)
    assert faults.dropped > 0 and faults.duplicated > 0 and faults.delayed > 0  # it did inject
    for rank in (0, 1):
        for key in range(3):
            np.testing.assert_array_equal(faulty[rank][key], clean[rank][key])


def test_fault_settings_are_checked():
    assert Faults.parse("drop=0.5, seed=2").drop == 0.5
    with pytest.raises(ConfigError, match="cannot read 'lose=0.1'"):
        Faults.parse("lose=0.1")
    with pytest.raises(ConfigError, match="drop is a probability"):
        Faults.parse("drop=2")
    with pytest.raises(ConfigError, match="dup must be a number"):
        Faults.parse("dup=often")
