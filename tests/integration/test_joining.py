"""Aggregators joining pMaster: addresses peers can dial, or a refusal that names the fix.

(Across real hosts, network namespaces: tests/multihost.)
"""

from __future__ import annotations

import socket

import pytest

from pslink.core.aggregator import Aggregator
from pslink.core.master import Master
from pslink.core.wire.protocol import Op, encode
from pslink.core.transport import Transports
from pslink.errors import ConfigError
from tests.helpers import RawClient

pytestmark = pytest.mark.integration


@pytest.fixture
def master():
    transports = Transports()
    made = Master("tcp://127.0.0.1:0", transports=transports, dial_back_timeout=2.0).start()
    yield made, transports
    made.stop()
    transports.close()


def _register(master_address, transports, **fields):
    raw = RawClient(master_address, transports)
    try:
        raw.send(encode(Op.REGISTER_AGGREGATOR, id=1, pid=4242, host="node9", **fields))
        header, _ = raw.reply(timeout=10)
        return header
    finally:
        raw.close()


def test_loopback_advertised_from_another_host_is_refused_naming_the_fix(master):
    pmaster, transports = master
    header = _register(pmaster.address, transports, address="tcp://127.0.0.1:5555", host_id="another-host/1")
    assert header["op"] == Op.ERROR and header["code"] == ConfigError.code
    for part in ("tcp://127.0.0.1:5555", "a loopback address", "another host", "--advertise", "PSLINK_ADVERTISE",
                 "--interface", "node9"):
        assert part in header["msg"]
    assert pmaster.state.aggregators == {}
    # a wildcard is nobody's address either
    header = _register(pmaster.address, transports, address="tcp://0.0.0.0:5555", host_id=pmaster.host_id)
    assert header["code"] == ConfigError.code and "wildcard" in header["msg"]


def test_an_address_pmaster_cannot_dial_back_is_refused(master):
    pmaster, transports = master
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        dead = probe.getsockname()[1]
    header = _register(pmaster.address, transports, address=f"tcp://127.0.0.1:{dead}", host_id=pmaster.host_id)
    assert header["code"] == ConfigError.code
    assert f"pMaster cannot reach tcp://127.0.0.1:{dead}, the address it advertises" in header["msg"]
    assert pmaster.state.aggregators == {}


def test_a_refused_aggregator_stops_instead_of_retrying(master):
    pmaster, transports = master
    # 127.0.0.2 is loopback too, but the Aggregator listens on 127.0.0.1 only: nobody reaches it there
    aggregator = Aggregator(pmaster.address, "tcp://127.0.0.1:0", advertise="127.0.0.2", transports=transports).start()
    try:
        assert aggregator.registered.wait(10)
        assert isinstance(aggregator.registration_error, ConfigError)
        assert "cannot reach tcp://127.0.0.2:" in aggregator.registration_error.message
        assert aggregator.exit_code == 2
    finally:
        aggregator.stop()
    good = Aggregator(pmaster.address, "tcp://127.0.0.1:0", transports=transports, keep=True).start()
    try:
        assert good.registered.wait(10) and good.registration_error is None
        assert pmaster.wait_for_aggregators([good.name], 10)
        record = pmaster.state.aggregators[good.name]
        assert record.host_id == pmaster.host_id and good.name in pmaster.state.control.pool.pinned
    finally:
        good.stop()
