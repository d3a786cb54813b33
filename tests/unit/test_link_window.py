"""The window of large requests in flight on a network link (pslink.core.agent.requests):
without I/O, on fake connections."""

from __future__ import annotations

import pytest

from pslink.core.config import DEFAULT_LINK_WINDOW, link_window
from pslink.core.agent.requests import PartRequest, Requests
from pslink.core.agent.seat import Seat
from pslink.core.transport.fused import FUSE_BELOW
from pslink.core.wire.loop import Reactor
from pslink.core.wire.protocol import Limits, Op
from pslink.errors import ConfigError, PeerError

LARGE = FUSE_BELOW


class FakeConn:
    def __init__(self, over_network: bool, fail: bool = False):
        self.over_network = over_network
        self.fail = fail
        self.closed = False
        self.sent: list[int] = []  # the request ids written, in order

    def send(self, frames) -> None:
        if self.fail:
            raise PeerError("connection refused")
        self.sent.append(frames[0])

    def close(self) -> None:
        self.closed = True


class FakeTransports:
    def __init__(self):
        self.conns: dict[str, FakeConn] = {}

    def connect(self, address, reactor, handler, limits, timeout):
        return self.conns[address]


class FakeHandles:
    def __init__(self):
        self.completed: list = []

    def complete(self, handle, error) -> None:
        self.completed.append((handle, error))


@pytest.fixture
def setup():
    reactor = Reactor()
    transports = FakeTransports()
    lost: list = []
    requests = Requests(Seat("job", 0, 1, b"", "host"), transports, reactor, handler=None, limits=Limits(),
                        handles=FakeHandles(), connect_timeout=1.0, peer_timeout=10.0, probe_interval=3600.0,
                        resend_timeout=None, faults=None, clock=lambda: 0.0, link_window=3,
                        on_lost=lambda link, error, rids: lost.append((link.name, rids)))
    yield requests, transports, lost
    reactor.close()


def submit(requests, link, nbytes=LARGE, op=Op.PUSHPULL) -> int:
    request = PartRequest(None, link, nbytes, None, None, False, op, None, None, 1, None, None, 0)
    rid = requests.add(request)
    requests.transmit(rid, request, [rid])  # the "frames" are the id: what the fake connection records
    return rid


def link_to(requests, transports, name, over_network=True):
    transports.conns[f"tcp://{name}"] = FakeConn(over_network)
    return requests.link(name, f"tcp://{name}")


def test_at_most_the_window_of_large_requests_is_in_flight_and_the_rest_go_in_order(setup):
    requests, transports, _ = setup
    link = link_to(requests, transports, "agg-0")
    rids = [submit(requests, link) for _ in range(6)]
    assert link.conn.sent == rids[:3]
    small = submit(requests, link, nbytes=LARGE - 1)  # small requests are not held
    assert link.conn.sent == rids[:3] + [small]
    requests.take(rids[1])  # one answered: the next waiting goes
    assert link.conn.sent == rids[:3] + [small, rids[3]]
    requests.take(small)  # small ones do not count
    assert link.conn.sent == rids[:3] + [small, rids[3]]
    for rid in (rids[0], rids[2]):
        requests.take(rid)
    assert link.conn.sent == rids[:3] + [small] + rids[3:]
    assert link.in_window == 3 and not link.held


def test_links_on_this_host_and_window_zero_are_not_limited(setup):
    requests, transports, _ = setup
    local = link_to(requests, transports, "agg-local", over_network=False)
    rids = [submit(requests, local) for _ in range(8)]
    assert local.conn.sent == rids
    requests.link_window = 0
    unlimited = link_to(requests, transports, "agg-unlimited")
    rids = [submit(requests, unlimited) for _ in range(8)]
    assert unlimited.conn.sent == rids


def test_a_held_request_failed_over_goes_to_its_new_link_once_and_leaves_the_old_window(setup):
    requests, transports, _ = setup
    old = link_to(requests, transports, "agg-0")
    rids = [submit(requests, old) for _ in range(5)]
    new = link_to(requests, transports, "agg-1")
    for rid in (rids[1], rids[4]):  # as failover does: the request's link changes, then it is sent
        request = requests.pending[rid]
        old.pending.discard(rid)
        request.link = new
        new.pending.add(rid)
        requests.transmit(rid, request, request.frames)
    assert new.conn.sent == [rids[1], rids[4]] and new.in_window == 2
    # rids[1] left the old window: the one waiting there went; the moved held one did not
    assert old.conn.sent == rids[:4] and not old.held and old.in_window == 3
    requests.take(rids[0])
    assert old.conn.sent == rids[:4] and old.in_window == 2


def test_a_resent_request_is_sent_again_without_counting_twice_and_a_held_one_waits(setup):
    requests, transports, _ = setup
    link = link_to(requests, transports, "agg-0")
    rids = [submit(requests, link) for _ in range(4)]
    for rid in rids:  # what the probe does for requests unanswered past resend_timeout
        requests.transmit(rid, requests.pending[rid], [rid])
    assert link.conn.sent == rids[:3] + rids[:3]  # the held one is still held, once
    assert link.in_window == 3 and [r for r, _ in link.held] == [rids[3]]


def test_a_held_request_that_fails_is_never_sent_and_a_failed_send_is_reported(setup):
    requests, transports, lost = setup
    link = link_to(requests, transports, "agg-0")
    rids = [submit(requests, link) for _ in range(5)]
    requests.fail([rids[3]], PeerError("gone"))
    requests.take(rids[0])
    assert link.conn.sent == rids[:3] + [rids[4]]
    link.conn.fail = True
    requests.take(rids[1])  # nothing waits: nothing is sent
    more = submit(requests, link)  # the link fails as it is written: failover hears of it
    assert lost == [("agg-0", [more])]


def test_the_window_setting_is_checked_by_name():
    assert link_window({}) == DEFAULT_LINK_WINDOW
    assert link_window({"PSLINK_LINK_WINDOW": "0"}) == 0
    for bad in ("-1", "two", "1.5"):
        with pytest.raises(ConfigError, match="PSLINK_LINK_WINDOW"):
            link_window({"PSLINK_LINK_WINDOW": bad})
