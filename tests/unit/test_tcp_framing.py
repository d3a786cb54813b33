"""The native TCP framing: messages split at every byte boundary, and garbage."""

from __future__ import annotations

import queue
import socket

import numpy as np
import pytest

from pslink.core.wire.loop import Reactor
from pslink.core.wire.protocol import Limits
from pslink.core.transport.framing import frame_prefix
from pslink.core.transport.stream import TcpConnection
from pslink.errors import PeerError, ProtocolError


class Sink:
    def __init__(self):
        self.messages = []
        self.closed = queue.Queue()

    def on_header(self, conn, header, sizes):
        return header, None

    def on_message(self, conn, state, payloads):
        self.messages.append((state, [bytes(p) for p in payloads]))

    def on_close(self, conn, exc):
        self.closed.put(exc)


def make(limits=Limits()):
    reactor = Reactor()
    ours, theirs = socket.socketpair()
    sink = Sink()
    with reactor._drive_lock:
        conn = TcpConnection(ours, reactor, sink, limits, peer="test-peer", on_driver_thread=True)
    return reactor, conn, theirs, sink


def pump(reactor, rounds=50):
    with reactor._drive_lock:
        for _ in range(rounds):
            reactor.run_once(0)


def encode_message(header: bytes, payloads) -> bytes:
    return frame_prefix(header, payloads) + header + b"".join(bytes(p) for p in payloads)


def test_messages_fed_one_byte_at_a_time_arrive_whole():
    reactor, conn, theirs, sink = make()
    stream = b"".join([
        encode_message(b"first", [b"abc", b""]),
        encode_message(b"second", []),
        encode_message(b"third", [np.arange(10, dtype=np.uint8).tobytes()]),
    ])
    for byte in stream:
        theirs.send(bytes([byte]))
        pump(reactor, 1)
    pump(reactor)
    assert sink.messages == [
        (b"first", [b"abc", b""]),
        (b"second", []),
        (b"third", [bytes(range(10))]),
    ]
    reactor.close()


def test_whole_messages_in_one_read_arrive_whole():
    # Where a message's prefix and header are buffered whole, the parser takes them in one step.
    reactor, conn, theirs, sink = make()
    big = np.arange(50_000, dtype=np.uint8).tobytes()
    messages = [(b"one", [b"abc"]), (b"empty payload", [b""]), (b"none", []), (b"two", [b"ab", b"cd"]),
                (b"big", [big]), (b"after", [b"z"])]
    theirs.sendall(b"".join(encode_message(h, p) for h, p in messages))
    pump(reactor)
    assert sink.messages == messages
    reactor.close()


@pytest.mark.parametrize("garbage, match", [
    (b"PL\x01\x01\x10\x00\x00\x00" + (2000).to_bytes(8, "little") + b"h" * 16, "payload of 2000 bytes exceeds"),
    (b"PL\x01\x01\x00\x02\x00\x00" + (1).to_bytes(8, "little") + b"h" * 512, "header of 512 bytes exceeds"),
    # two payloads (a ps-lite message's keys and values), each under the limit, together over it
    (b"PL\x01\x02\x10\x00\x00\x00" + (600).to_bytes(8, "little") * 2 + b"h" * 16, "payload of 1200 bytes exceeds"),
])
def test_limits_hold_for_whole_messages_in_one_read(garbage, match):
    reactor, conn, theirs, sink = make(Limits(max_header_bytes=256, max_message_bytes=1000))
    theirs.sendall(garbage)
    pump(reactor)
    exc = sink.closed.get(timeout=1)
    assert isinstance(exc, ProtocolError) and match in str(exc)
    reactor.close()


def test_keys_and_values_sent_as_two_payloads_arrive_whole_even_when_one_is_empty():
    # send() packs a message of two payloads (every ps-lite KV message) in a shape of its own.
    reactor, conn, theirs, sink = make()
    peer_reactor = Reactor()
    peer_sink = Sink()
    with peer_reactor._drive_lock:
        peer = TcpConnection(theirs, peer_reactor, peer_sink, Limits(), peer="sender", on_driver_thread=True)
    keys, values = np.arange(3, dtype=np.uint64), np.linspace(0, 1, 1024, dtype=np.float32)
    for frames in ([b"kv", keys, values], [b"no keys", b"", values], [b"no values", keys, np.empty(0, np.float32)],
                   [b"neither", b"", b""]):
        peer.send(frames)
    pump(reactor)
    assert sink.messages == [(b"kv", [keys.tobytes(), values.tobytes()]), (b"no keys", [b"", values.tobytes()]),
                             (b"no values", [keys.tobytes(), b""]), (b"neither", [b"", b""])]
    reactor.close()
    peer_reactor.close()


class Echo(Sink):
    """Answers every message; notes, for each, whether the answers so far had reached the peer."""

    def __init__(self, peer: socket.socket):
        super().__init__()
        self.peer = peer
        self.answered_before: list[int] = []
        self.received = b""

    def on_message(self, conn, state, payloads):
        try:
            while True:
                self.received += self.peer.recv(65536)
        except BlockingIOError:
            pass
        self.answered_before.append(self.received.count(b"answer"))
        conn.send([b"answer"])


def test_an_answer_goes_out_before_the_next_message_of_the_same_read_is_handled():
    # The peer works on an answer while this side handles its next request, so answers are not
    # held back to share one sendmsg at the end of a read.
    reactor = Reactor()
    ours, theirs = socket.socketpair()
    theirs.setblocking(False)
    echo = Echo(theirs)
    with reactor._drive_lock:
        TcpConnection(ours, reactor, echo, Limits(), peer="test-peer", on_driver_thread=True)
    theirs.sendall(b"".join(encode_message(b"request", [b"x" * 8]) for _ in range(4)))
    pump(reactor)
    assert echo.answered_before == [0, 1, 2, 3]
    reactor.close()


class Resender(Sink):
    """A peer that sends again as soon as it hears back: each message handled brings another."""

    def __init__(self, peer: socket.socket, limit: int):
        super().__init__()
        self.peer, self.limit = peer, limit

    def on_message(self, conn, state, payloads):
        super().on_message(conn, state, payloads)
        if len(self.messages) < self.limit:
            self.peer.sendall(encode_message(b"again", [b"x"]))


def test_a_peer_that_keeps_sending_does_not_starve_the_other_connections():
    reactor = Reactor()
    busy_ours, busy_theirs = socket.socketpair()
    quiet_ours, quiet_theirs = socket.socketpair()
    busy, quiet = Resender(busy_theirs, limit=10_000), Sink()
    with reactor._drive_lock:
        TcpConnection(busy_ours, reactor, busy, Limits(), peer="busy", on_driver_thread=True)
        TcpConnection(quiet_ours, reactor, quiet, Limits(), peer="quiet", on_driver_thread=True)
    busy_theirs.sendall(encode_message(b"first", [b"x"]))
    quiet_theirs.sendall(encode_message(b"waiting", []))
    with reactor._drive_lock:
        for _ in range(3):
            reactor.run_once(0)
    assert quiet.messages == [(b"waiting", [])]
    assert 1 <= len(busy.messages) <= 3  # one read of the busy socket per turn
    reactor.close()


def test_a_large_header_spanning_reads_is_reassembled():
    reactor, conn, theirs, sink = make()
    header = bytes(range(256)) * 1000  # 256 KB: larger than the read buffer's half
    data = encode_message(header, [b"x" * 10])
    theirs.setblocking(False)
    sent = 0
    while sent < len(data):
        try:
            sent += theirs.send(data[sent:sent + 65536])
        except BlockingIOError:
            pass
        pump(reactor, 1)
    pump(reactor)
    assert sink.messages == [(header, [b"x" * 10])]
    reactor.close()


@pytest.mark.parametrize("garbage, match", [
    (b"GET / HTTP/1.1\r\n\r\n", "expected magic b'PL'"),
    (b"PL\x07\x00\x00\x00\x00\x00", "framing version 7"),
    (b"PL\x01\xc8\x00\x00\x00\x00", "200 payloads exceed the limit"),  # 128 at most (a FUSED message's)
    (b"PL\x01\x00\xff\xff\xff\x7f", "header of 2147483647 bytes exceeds"),
])
def test_garbage_closes_the_connection_with_a_protocol_error(garbage, match):
    reactor, conn, theirs, sink = make()
    theirs.sendall(garbage)
    pump(reactor)
    exc = sink.closed.get(timeout=1)
    assert isinstance(exc, ProtocolError) and match in str(exc)
    assert conn.closed
    reactor.close()


def test_a_peer_closing_mid_message_is_reported():
    reactor, conn, theirs, sink = make()
    theirs.sendall(encode_message(b"h", [b"x" * 100])[:-10])
    theirs.close()
    pump(reactor)
    exc = sink.closed.get(timeout=1)
    assert isinstance(exc, PeerError) and "mid-message" in str(exc)
    reactor.close()
