"""Faults on the control plane (PSLINK_FAULTS ctl_drop, ctl_dup, ctl_delay), as TCP can have
them: lost with the connection, repeated, or held with every later message behind them."""

from __future__ import annotations

import pytest

from pslink.core.faults import Faults
from pslink.errors import ConfigError, PeerError


class _Conn:
    peer = "tcp://peer:1"

    def __init__(self):
        self.sent, self.closed, self.timers, self.posted = [], False, [], []
        self.reactor = self
        self.handler = type("Handler", (), {"on_close": lambda conn, exc: None})()

    def post(self, fn, *args):
        self.posted.append((fn, args))

    def send(self, frames):
        if self.closed:
            raise PeerError("closed")
        self.sent.append(frames[0])

    def close(self):
        self.closed = True

    def call_later(self, delay, fn, *args):
        self.timers.append((delay, fn, args))


def test_the_settings_are_read_and_checked():
    faults = Faults.parse("ctl_drop=0.01,ctl_dup=0.02,ctl_delay=0.03,delay_ms=20,seed=3")
    assert (faults.ctl_drop, faults.ctl_dup, faults.ctl_delay, faults.on_control) == (0.01, 0.02, 0.03, True)
    assert not Faults.parse("drop=0.1").on_control  # data-path faults leave the control plane alone
    with pytest.raises(ConfigError, match="ctl_drop"):
        Faults.parse("ctl_drop=2")
    with pytest.raises(ConfigError, match="ctl_drop \\+ ctl_dup \\+ ctl_delay"):
        Faults.parse("ctl_drop=0.6,ctl_dup=0.6")


def test_a_repeated_control_message_arrives_twice():
    conn = _Conn()
    Faults(ctl_dup=1.0).send_control(conn, [b"assign"])
    assert conn.sent == [b"assign", b"assign"]


def test_a_lost_control_message_is_lost_with_its_connection():
    conn = _Conn()
    faults = Faults(ctl_drop=1.0)
    with pytest.raises(PeerError, match="ctl_drop"):
        faults.send_control(conn, [b"migrate"])
    assert conn.closed and conn.sent == [] and faults.dropped == 1
    # Both ends see the reset: the other by its socket, this one is told (its own close says nothing).
    ((on_close, (closed, error)),) = conn.posted
    assert on_close == conn.handler.on_close and closed is conn and "ctl_drop" in str(error)


def test_a_delayed_control_message_holds_the_later_ones_behind_it_in_order():
    conn = _Conn()
    faults = Faults(ctl_delay=1.0, delay_ms=30)
    faults.send_control(conn, [b"first"])
    faults.ctl_delay = 0.0  # the later ones are not delayed themselves: they wait behind the first
    faults.send_control(conn, [b"second"])
    faults.send_control(conn, [b"third"])
    assert conn.sent == [] and [t[0] for t in conn.timers] == [0.03]
    _, release, args = conn.timers[0]
    release(*args)
    assert conn.sent == [b"first", b"second", b"third"]
    faults.send_control(conn, [b"fourth"])  # nothing held any more: straight out
    assert conn.sent[-1] == b"fourth"
