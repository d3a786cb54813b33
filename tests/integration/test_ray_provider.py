"""A Ray-provided Aggregator serves a job (a local Ray instance; about 600 MB, so one test)."""

from __future__ import annotations

import shutil
import tempfile

import numpy as np
import pytest

import pslink

ray = pytest.importorskip("ray", reason="Ray not installed (pip install 'pslink[ray]'); CI installs it")

pytestmark = pytest.mark.integration


@pytest.fixture
def ray_dir():
    # Ray's Unix sockets live under its temp dir, and their paths may not exceed 107 bytes.
    path = tempfile.mkdtemp(prefix="pslr", dir="/tmp")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_a_ray_actor_aggregator_serves_a_job_and_is_released(ray_dir, monkeypatch):
    from pslink.core.service import Service

    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")  # no token file in the home directory
    options = {"listen_host": "127.0.0.1",
               "init_options": {"num_cpus": 2, "include_dashboard": False, "_temp_dir": ray_dir}}
    with Service(aggregators=1, provider="ray", provider_options=options,
                 control={"profile_iterations": 1000}) as service:
        (name,) = service.provider.names()
        assert service.master.aggregator_alive(name)
        pid = service.provider.pid(name)
        with pslink.connect("ray-job", 0, 1, master=service.address, servers=2, timeout=60) as agent:
            for r in range(1, 4):
                np.testing.assert_array_equal(agent.pushpull("w", np.full(8, float(r))).wait(), np.full(8, float(r)))
            # the job asked for 2 servers: Ray started a second actor for it
            assert len(service.provider.names()) == 2
            places = {p[3] for p in agent.key_info("w")["parts"]}
            assert places <= set(service.provider.names())
        assert pid != __import__("os").getpid()  # really another process
    assert not ray.is_initialized()  # the provider started Ray, so it stopped it
