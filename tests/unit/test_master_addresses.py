"""Several pMaster addresses (issue 51): parsing a comma list, naming a bad entry, the order
connections are tried in, and the error when none answers."""

from __future__ import annotations

import json
import os
import socket

import pytest

from pslink.core.config import resolve_master
from pslink.core.credential_files import (
    client_file_for,
    credential_for,
    write_client_file,
)
from pslink.core.credentials import OPERATOR
from pslink.core.master_addresses import MasterAddresses
from pslink.core.service.client import ControlClient
from pslink.core.transport import Transports
from pslink.core.transport.rpc import RpcEndpoint
from pslink.core.wire.loop import Reactor
from pslink.core.wire.protocol import DEFAULT_LIMITS
from pslink.errors import ConfigError, PeerError


def unused_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_a_comma_list_is_split_and_spaces_around_entries_dropped():
    addresses = MasterAddresses.parse(" tcp://10.77.0.2:7770 ,tcp://[::1]:7771,  inproc://standby ")
    assert addresses.addresses == ("tcp://10.77.0.2:7770", "tcp://[::1]:7771", "inproc://standby")
    assert str(addresses) == "tcp://10.77.0.2:7770,tcp://[::1]:7771,inproc://standby"
    assert addresses.several and addresses.current == "tcp://10.77.0.2:7770"
    one = MasterAddresses.parse("tcp://127.0.0.1:7770")
    assert not one.several and str(one) == "tcp://127.0.0.1:7770"


@pytest.mark.parametrize("text, named", [
    ("tcp://a:1,,tcp://b:2", "entry 2 is empty"),
    ("tcp://a:1,", "entry 2 is empty"),
    ("tcp://a:1, 10.0.0.3:7770", "'10.0.0.3:7770' has no scheme"),
    ("tcp://a:1,tcp://b", "'tcp://b' is not tcp://host:port"),
    ("tcp://a:1,tcp://b:http", "'tcp://b:http': port 'http' is not a port number"),
    ("tcp://a:1,tcp://b:70000", "'tcp://b:70000': port '70000' is not a port number"),
    ("tcp://a:1,tcp://a:1", "'tcp://a:1' is given twice"),
    ("127.0.0.1:7770", "'127.0.0.1:7770' has no scheme"),
    ("  ", "must name pMaster's address"),
])
def test_a_bad_entry_is_named_with_the_whole_setting(text, named):
    with pytest.raises(ConfigError) as caught:
        MasterAddresses.parse(text, "PSLINK_MASTER")
    assert named in caught.value.message
    assert caught.value.message.startswith("PSLINK_MASTER")
    if text.strip():
        assert repr(text) in caught.value.message  # the whole setting, as given


def test_connect_settings_check_the_list_and_say_where_it_came_from():
    assert resolve_master(None, {"PSLINK_MASTER": "tcp://a:1, tcp://b:2"}) == "tcp://a:1,tcp://b:2"
    assert resolve_master("tcp://c:3", {"PSLINK_MASTER": "tcp://a:1"}) == "tcp://c:3"  # the argument wins
    with pytest.raises(ConfigError, match=r"^PSLINK_MASTER='tcp://a:1,tcp:/b:2': 'tcp:/b:2' has no scheme"):
        resolve_master(None, {"PSLINK_MASTER": "tcp://a:1,tcp:/b:2"})
    with pytest.raises(ConfigError, match=r"^master='tcp://a:1,,': entry 2 is empty"):
        resolve_master("tcp://a:1,,", {})


class Dialer:
    """Answers at the addresses in ``up``, records the order addresses were tried in."""

    def __init__(self, up: set):
        self.up, self.tried = up, []

    def __call__(self, address: str) -> str:
        self.tried.append(address)
        if address not in self.up:
            raise PeerError(f"cannot connect to {address}: Connection refused", peer=address)
        return f"connection to {address}"


def test_connections_start_at_the_address_that_answered_last_and_move_on_when_it_is_lost():
    addresses = MasterAddresses.parse("tcp://a:1,tcp://b:2,tcp://c:3")
    dial = Dialer({"tcp://a:1", "tcp://b:2", "tcp://c:3"})
    assert addresses.dial(dial) == ("connection to tcp://a:1", "tcp://a:1")
    assert addresses.dial(dial) == ("connection to tcp://a:1", "tcp://a:1")  # it answered: it stays first
    addresses.lost("tcp://a:1")
    assert addresses.current == "tcp://b:2"
    addresses.lost("tcp://a:1")  # said again (another connection to it closing late): no second move
    assert addresses.current == "tcp://b:2"
    dial.up = {"tcp://a:1"}  # b and c are down: round and round, back to a
    dial.tried.clear()
    assert addresses.dial(dial)[1] == "tcp://a:1"
    assert dial.tried == ["tcp://b:2", "tcp://c:3", "tcp://a:1"]
    addresses.lost("tcp://a:1")
    dial.up, dial.tried = {"tcp://c:3"}, []
    assert addresses.dial(dial)[1] == "tcp://c:3" and dial.tried == ["tcp://b:2", "tcp://c:3"]
    addresses.lost("tcp://c:3")  # past the last: the first again
    assert addresses.current == "tcp://a:1"


def test_when_no_address_accepts_the_error_names_each_and_why():
    first, second = unused_port(), unused_port()
    addresses = MasterAddresses.parse(f"tcp://127.0.0.1:{first},tcp://127.0.0.1:{second}")
    reactor, transports = Reactor("test"), Transports()
    try:
        with pytest.raises(PeerError) as caught:
            addresses.connect(transports, reactor, RpcEndpoint(reactor, lambda *a: None), DEFAULT_LIMITS, 2.0)
        message = caught.value.message
        assert message.startswith(f"no pMaster accepts a connection at any of tcp://127.0.0.1:{first}, "
                                  f"tcp://127.0.0.1:{second}: ")
        assert f"cannot connect to tcp://127.0.0.1:{first}: " in message
        assert f"cannot connect to tcp://127.0.0.1:{second}: " in message
        assert addresses.current == f"tcp://127.0.0.1:{first}"  # nothing answered: where it was
        # One address: the transport's own error, as before several were possible.
        with pytest.raises(PeerError, match=rf"^cannot connect to tcp://127.0.0.1:{first}: "):
            MasterAddresses.parse(f"tcp://127.0.0.1:{first}").connect(transports, reactor,
                                                                      RpcEndpoint(reactor, lambda *a: None),
                                                                      DEFAULT_LIMITS, 2.0)
    finally:
        transports.close()
        reactor.close()


def test_a_real_listener_is_found_past_an_address_nobody_listens_on():
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)  # the kernel accepts: a connection is made without anyone answering
    up, down = f"tcp://127.0.0.1:{listener.getsockname()[1]}", f"tcp://127.0.0.1:{unused_port()}"
    addresses = MasterAddresses.parse(f"{down},{up}")
    reactor, transports = Reactor("test"), Transports()
    endpoint = RpcEndpoint(reactor, lambda *a: None)
    try:
        conn, address = addresses.connect(transports, reactor, endpoint, DEFAULT_LIMITS, 2.0)
        assert address == up and addresses.current == up
        conn.close()
    finally:
        listener.close()
        reactor.drain()
        transports.close()
        reactor.close()


def test_the_control_client_names_every_address_it_could_not_reach():
    first, second = unused_port(), unused_port()
    with pytest.raises(PeerError) as caught:
        ControlClient(f"tcp://127.0.0.1:{first}, tcp://127.0.0.1:{second}", timeout=2.0, credential="none")
    assert f"tcp://127.0.0.1:{first}" in caught.value.message and f"tcp://127.0.0.1:{second}" in caught.value.message
    with pytest.raises(ConfigError, match="entry 2 is empty"):
        ControlClient(f"tcp://127.0.0.1:{first},", credential="none")


def test_a_credential_for_a_list_is_the_first_address_that_has_one(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    first, second = unused_port(), unused_port()
    secret = os.urandom(32)
    # `service up` wrote a file for the second pMaster only (this host, that port).
    path = write_client_file(client_file_for(second), f"tcp://127.0.0.1:{second}", secret)
    with open(path) as f:
        written = json.load(f)
    listed = f"tcp://127.0.0.1:{first},tcp://127.0.0.1:{second}"
    assert credential_for(listed, OPERATOR, environ={}) == written[OPERATOR]
    assert credential_for(f"tcp://127.0.0.1:{first}", OPERATOR, environ={}) is None
