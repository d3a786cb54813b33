"""CURVE on the ZeroMQ transport: a job gives the same weights with it as without, a job's token
never crosses the link in clear text, and a peer without the service's key (or with another) is
refused at connect with an error naming the setting."""

from __future__ import annotations

import numpy as np
import pytest

import pslink
from pslink.core.service.client import ControlClient
from pslink.core.transport import Transports, TransportOptions
from pslink.core.transport.curve import CurveSettings, make_key_file
from pslink.errors import ConfigError, PeerError
from tests.helpers import start_cluster
from tests.integration.test_pool_changes import assert_same, train
from tests.integration.test_tls import Recorder

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    directory = tmp_path_factory.mktemp("curve")
    return make_key_file(str(directory / "service.key")), make_key_file(str(directory / "other.key"))


def zmq_transports(key=None) -> Transports:
    return Transports(TransportOptions(curve=CurveSettings(key) if key else None))


def test_a_two_worker_job_over_curve_gives_the_weights_it_gives_without(keys):
    ours, _ = keys
    results = []
    for key in (None, ours):
        transports = zmq_transports(key)
        service = start_cluster("zmq", aggregators=2, transports=transports, control={"profile_iterations": 0})
        try:
            results.append(train(service.address, f"curve-{bool(key)}", 12, transports=transports)[0])
        finally:
            service.stop()
            transports.close()
    assert_same(results[1], results[0])


@pytest.mark.parametrize("encrypted", [False, True])
def test_with_curve_a_jobs_token_never_crosses_the_link_in_clear_text(keys, encrypted):
    ours, _ = keys
    transports = zmq_transports(ours if encrypted else None)
    service = start_cluster("zmq", aggregators=1, transports=transports)
    recorder = Recorder(service.address.replace("zmq+tcp://", "tcp://"))
    through = recorder.address.replace("tcp://", "zmq+tcp://")
    try:
        with ControlClient(through, transports=transports) as client:
            token = client.register_job("curve-secret", 1)["token"]
        with pslink.connect("curve-secret", 0, 1, master=through, transports=transports, token=token,
                            timeout=20) as agent:
            np.testing.assert_array_equal(agent.pushpull("w", np.ones(8, np.float32)).wait(), np.ones(8))
        assert len(recorder.seen) > 500
        assert (token in recorder.seen) is not encrypted  # the control: without CURVE it is there to read
    finally:
        recorder.close()
        service.stop()
        transports.close()


def test_peers_without_the_key_or_with_another_are_refused_naming_the_setting(keys):
    ours, theirs = keys
    transports = zmq_transports(ours)
    service = start_cluster("zmq", aggregators=1, transports=transports)
    try:
        for key, uses in ((None, "without"), (theirs, "with")):
            other = zmq_transports(key)
            try:
                with pytest.raises(PeerError, match=f"connects {uses} CURVE.*PSLINK_CURVE_KEY"):
                    with ControlClient(service.address, transports=other, timeout=5) as client:
                        client.status()
            finally:
                other.close()
        with ControlClient(service.address, transports=transports) as client:
            assert client.status()["aggregators"]
    finally:
        service.stop()
        transports.close()


def test_a_bad_key_file_is_a_clear_error(tmp_path):
    from pslink.core.transport.options import transport_options

    (tmp_path / "short.key").write_text("abc")
    with pytest.raises(ConfigError, match="does not hold a Z85 secret key"):
        transport_options({"PSLINK_CURVE_KEY": str(tmp_path / "short.key")})
    with pytest.raises(ConfigError, match="cannot be read"):
        transport_options({"PSLINK_CURVE_KEY": str(tmp_path / "missing.key")})
