"""The native TCP framing: messages split at every byte boundary, and garbage."""

from __future__ import annotations

import queue
import socket

import numpy as np
import pytest

from pslink.core.loop import Reactor
from pslink.core.protocol import Limits
from pslink.core.transport.tcp import TcpConnection, frame_prefix
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
    (b"PL\x01\x63\x00\x00\x00\x00", "99 payloads exceed the limit"),
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
