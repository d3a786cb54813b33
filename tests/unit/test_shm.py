"""Shared-memory rings between processes of one host: the ring's arithmetic, and the frames
that carry payloads through it over a real Unix socket pair (both ends in this process)."""

from __future__ import annotations

import gc
import os
import socket
import struct
import threading
import time

import numpy as np
import pytest

from pslink.core.wire.loop import Reactor
from pslink.core.wire.protocol import Limits
from pslink.core.transport import DISCARD, Lent
from pslink.core.transport.options import transport_options
from pslink.core.transport.options import TransportOptions, rings_supported
from pslink.core.transport.shm import INLINE, ReceiveRing, SendRing
from pslink.core.transport.framing import FRAMING_RING, FRAMING_RING_OPEN, MAGIC, PREFIX
from pslink.core.transport.stream import TcpConnection
from pslink.errors import ConfigError, ProtocolError

def _out(conn):
    """The ring a connection sends through (None: none, or no rings on this connection)."""
    return conn.rings.out if conn.rings is not None else None

needs_rings = pytest.mark.skipif(not rings_supported(), reason="shared-memory rings need Linux on x86-64 (memfd)")


def pair(capacity: int):
    send = SendRing(capacity)
    receive = ReceiveRing(os.dup(send.fd), capacity, "test-peer")
    return send, receive


def take(receive: ReceiveRing, position: int, size: int) -> bytes:
    out = bytearray(size)
    receive.take(position, size, memoryview(out))
    return bytes(out)


@needs_rings
def test_payloads_are_placed_in_order_and_wrap_to_the_start_whole():
    send, receive = pair(1000)
    a, b = bytes(range(200)) * 2, b"b" * 500
    assert send.place(memoryview(a)) == 0
    assert send.place(memoryview(b)) == 400
    assert send.place(memoryview(b"c" * 200)) == INLINE  # 100 bytes left at the end, none taken yet
    assert take(receive, 0, 400) == a
    # 100 bytes before the end are too few: the payload starts at the beginning (position 1000)
    assert send.place(memoryview(b"c" * 200)) == 1000
    assert take(receive, 400, 500) == b
    assert take(receive, 1000, 200) == b"c" * 200
    assert send.place(memoryview(b"d" * 1000)) == 2000  # the whole ring, once all was taken
    assert send.place(memoryview(b"e")) == INLINE
    assert take(receive, 2000, 1000) == b"d" * 1000
    assert send.place(memoryview(b"f" * 1001)) == INLINE  # larger than the ring: on the socket
    send.close()
    receive.close()


@needs_rings
def test_space_is_reused_exactly_when_the_receiver_has_taken_it():
    send, receive = pair(1000)
    assert send.place(memoryview(b"a" * 600)) == 0
    assert take(receive, 0, 600) == b"a" * 600
    assert send.place(memoryview(b"b" * 300)) == 600  # held at [600, 900)
    assert send.place(memoryview(b"c" * 200)) == 1000  # wraps onto [0, 200), taken already
    assert send.place(memoryview(b"d" * 500)) == INLINE  # [200, 700) would overwrite the b's
    assert send.place(memoryview(b"d" * 400)) == 1200  # [200, 600) does not
    assert take(receive, 600, 300) == b"b" * 300
    assert take(receive, 1000, 200) == b"c" * 200
    assert take(receive, 1200, 400) == b"d" * 400
    send.close()
    receive.close()


@needs_rings
def test_a_receiver_refuses_positions_outside_what_was_placed():
    send, receive = pair(1000)
    send.place(memoryview(b"x" * 300))
    take(receive, 0, 300)
    for position, size in [(0, 10), (950, 100), (1950, 100), (300, 1001)]:
        with pytest.raises(ProtocolError, match="ring position"):
            receive.take(position, size, None)
    send.close()
    receive.close()


@needs_rings
def test_a_sender_sees_room_as_place_would_and_waits_for_the_receiver_to_make_it():
    send, receive = pair(1000)
    assert send.fits([400, 500]) and not send.fits([400, 500, 200]) and not send.fits([1001])
    send.place(memoryview(b"a" * 800))
    assert send.fits([200]) and not send.fits([300])  # the end is too short, the start not taken
    assert not send.wait_for_room([300], 0.005)  # nothing taken: gives up after the wait
    assert not send.wait_for_room([1001], 60.0)  # can never fit: no wait at all
    waited = []
    waiter = threading.Thread(target=lambda: waited.append(send.wait_for_room([300], 60.0)))
    waiter.start()
    take(receive, 0, 800)
    waiter.join(60.0)
    assert waited == [True] and send.place(memoryview(b"b" * 300)) == 1000
    send.close()
    receive.close()


@needs_rings
def test_a_lent_payload_is_read_where_it_lies_and_freed_when_its_reader_returns():
    send, receive = pair(1000)
    position = send.place(memoryview(b"x" * 600))
    view = receive.lend(position, 600)
    assert bytes(view) == b"x" * 600
    assert send.place(memoryview(b"y" * 600)) == INLINE  # still being read
    receive.settle()
    assert send.place(memoryview(b"y" * 600)) == 1000
    with pytest.raises(ProtocolError, match="ring position"):
        receive.lend(position, 600)  # lent already
    del view
    send.close()
    receive.close()


def test_the_ring_wait_setting_is_checked(caplog):
    assert transport_options({"PSLINK_SHM_WAIT_MS": "2.5"}).ring_wait == 0.0025
    assert transport_options({"PSLINK_SHM_WAIT_MS": "0"}).ring_wait == 0.0
    assert transport_options({}).ring_wait == 0.02
    for bad in ["-1", "soon", "1e9"]:
        caplog.clear()
        assert transport_options({"PSLINK_SHM_WAIT_MS": bad}).ring_wait == 0.0  # said, and nothing waits
        assert "PSLINK_SHM_WAIT_MS" in caplog.text
    with pytest.raises(ConfigError, match="ring_wait must be from 0 to 60 seconds, got -1"):
        TransportOptions(ring_wait=-1)


def test_the_ring_size_setting_is_checked(caplog):
    assert transport_options({"PSLINK_SHM_RING_MIB": "8"}).ring_bytes == 8 << 20
    for bad in ["0", "eight", "4096"]:
        caplog.clear()
        options = transport_options({"PSLINK_SHM_RING_MIB": bad})
        assert not options.rings and "PSLINK_SHM_RING_MIB" in caplog.text  # said, and no rings
    with pytest.raises(ConfigError, match="ring_bytes must be a whole number of bytes"):
        TransportOptions(ring_bytes=1000)


def test_the_environment_turns_rings_and_local_sockets_off():
    assert transport_options({}) == TransportOptions()
    assert transport_options({"PSLINK_SHM": "0", "PSLINK_LOCAL_SOCKETS": "0"}) == TransportOptions(
        local_sockets=False, rings=False)


class Sink:
    def __init__(self, placer=None):
        self.placer = placer
        self.messages = []
        self.closed = []

    def on_header(self, conn, header, sizes):
        return header, (self.placer(header, sizes) if self.placer else None)

    def on_message(self, conn, state, payloads):
        self.messages.append((state, [bytes(p) for p in payloads]))

    def on_close(self, conn, exc):
        self.closed.append(exc)


def connected(receiver=None):
    """Two connections over a Unix socket pair, with the options this environment asks for."""
    reactor = Reactor("shm test")
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    sender_sink, receiver_sink = Sink(), receiver or Sink()
    options = transport_options()
    with reactor._drive_lock:
        sender = TcpConnection(ours, reactor, sender_sink, Limits(), peer="sender", on_driver_thread=True,
                               options=options)
        receiver_conn = TcpConnection(theirs, reactor, receiver_sink, Limits(), peer="receiver", on_driver_thread=True,
                                      options=options)
    return reactor, sender, receiver_conn, receiver_sink


def pump(reactor, rounds=200):
    with reactor._drive_lock:
        for _ in range(rounds):
            reactor.run_once(0)


def pump_until(reactor, done, timeout=30.0):
    deadline = time.monotonic() + timeout
    with reactor._drive_lock:
        while not done():
            assert time.monotonic() < deadline, "timed out"
            reactor.run_once(0)


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@needs_rings
def test_large_payloads_go_through_the_ring_small_ones_on_the_socket():
    reactor, sender, receiver, sink = connected()
    big = np.arange(300_000, dtype=np.uint8)
    sender.send([b"one", big, b"small", b""])
    sender.send([b"two", b"tiny"])
    pump(reactor)
    assert sink.messages == [(b"one", [big.tobytes(), b"small", b""]), (b"two", [b"tiny"])]
    assert _out(sender) is not None and receiver.rings.inp is not None
    assert _out(sender).head == 300_000 and receiver.rings.inp.taken == 300_000
    reactor.close()


@needs_rings
def test_ring_payloads_land_in_named_buffers_or_are_dropped():
    targets = []

    def placer(header, sizes):
        if header == b"drop":
            return DISCARD
        targets.append(np.zeros(sizes[0], np.uint8))
        return [memoryview(targets[-1])]

    reactor, sender, receiver, sink = connected(Sink(placer))
    data = np.random.default_rng(0).integers(0, 255, 200_000, dtype=np.uint8)
    sender.send([b"drop", data])
    sender.send([b"keep", data])
    pump(reactor)
    assert [m[0] for m in sink.messages] == [b"drop", b"keep"]
    np.testing.assert_array_equal(targets[0], data)
    assert receiver.rings.inp.taken == 400_000  # the dropped one's space was freed too
    reactor.close()


@needs_rings
def test_with_rings_turned_off_everything_stays_on_the_socket(monkeypatch):
    monkeypatch.setenv("PSLINK_SHM", "0")
    reactor, sender, receiver, sink = connected()
    sender.send([b"big", np.ones(500_000, np.uint8)])
    pump(reactor)
    assert sink.messages == [(b"big", [b"\x01" * 500_000])]
    assert _out(sender) is None and receiver.rings.inp is None
    reactor.close()


@needs_rings
def test_a_bad_ring_wait_is_said_and_nothing_waits(monkeypatch, caplog):
    monkeypatch.setenv("PSLINK_SHM_WAIT_MS", "soon")
    reactor, sender, receiver, sink = connected()
    assert sender.rings.wait == 0.0
    assert "PSLINK_SHM_WAIT_MS='soon' must be a number of milliseconds" in caplog.text
    sender.send([b"big", np.ones(500_000, np.uint8)])
    pump(reactor)
    assert sink.messages == [(b"big", [b"\x01" * 500_000])]  # the connection still works
    reactor.close()


@needs_rings
def test_a_bad_ring_size_keeps_payloads_on_the_socket_and_says_why(monkeypatch, caplog):
    monkeypatch.setenv("PSLINK_SHM_RING_MIB", "lots")
    reactor, sender, receiver, sink = connected()
    sender.send([b"big", np.ones(500_000, np.uint8)])
    pump(reactor)
    assert sink.messages == [(b"big", [b"\x01" * 500_000])] and _out(sender) is None
    assert "PSLINK_SHM_RING_MIB='lots' must be a whole number of MiB" in caplog.text
    reactor.close()


@needs_rings
def test_rings_and_their_descriptors_go_with_the_connection():
    # Earlier tests' connections, left to the garbage collector, hold rings and sockets: collect
    # them first, or a collection during the loop closes them and the count comes out lower.
    gc.collect()
    before = open_fds()
    for _ in range(3):
        reactor, sender, receiver, sink = connected()
        sender.send([b"big", np.ones(100_000, np.uint8)])
        receiver.send([b"back", np.ones(100_000, np.uint8)])
        pump(reactor)
        assert len(sink.messages) == 1 and _out(receiver) is not None
        sender.close()
        receiver.close()
        pump(reactor, 5)
        reactor.close()
    assert open_fds() == before


@pytest.mark.parametrize("frame, match", [
    # a ring frame whose payload lies in a ring never handed over
    (PREFIX.pack(MAGIC, FRAMING_RING, 1, 1) + struct.pack("<QQ", 100, 0) + b"h", "never handed over"),
    # a ring announced without its descriptor
    (PREFIX.pack(MAGIC, FRAMING_RING_OPEN, 0, 8) + (1 << 20).to_bytes(8, "little"), "without its descriptor"),
    (PREFIX.pack(MAGIC, FRAMING_RING_OPEN, 1, 8) + b"\0" * 16, "ring frame with 1 payloads"),
])
def test_bad_ring_frames_close_the_connection_with_a_protocol_error(frame, match):
    reactor, sender, receiver, sink = connected()
    sender.sock.sendall(frame)
    pump(reactor)
    assert len(sink.closed) == 1 and isinstance(sink.closed[0], ProtocolError)
    assert match in str(sink.closed[0])
    reactor.close()


def test_ring_frames_are_refused_on_tcp():
    reactor = Reactor("tcp test")
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    client = socket.create_connection(listener.getsockname())
    server, _ = listener.accept()
    sink = Sink()
    with reactor._drive_lock:
        TcpConnection(server, reactor, sink, Limits(), peer="tcp peer", on_driver_thread=True)
    client.sendall(PREFIX.pack(MAGIC, FRAMING_RING, 1, 1) + struct.pack("<QQ", 100, 0) + b"h")
    pump(reactor)
    assert len(sink.closed) == 1 and "framing version 2" in str(sink.closed[0])
    for sock in (client, listener):
        sock.close()
    reactor.close()


class LendingSink(Sink):
    """Takes ring payloads where they lie; notes what was lent and whether its space was
    still held while it read."""

    def __init__(self):
        super().__init__()
        self.lent = []

    def on_header(self, conn, header, sizes):
        buffers = Lent([memoryview(bytearray(size)) for size in sizes])
        return (header, buffers), buffers

    def on_message(self, conn, state, payloads):
        header, buffers = state
        ring = conn.rings.inp
        held = ring is not None and int(ring._consumed[0]) < ring.taken
        self.lent.append((list(buffers.lent), held))
        self.messages.append((header, [bytes(p) for p in payloads]))


@needs_rings
def test_a_lending_receiver_reads_ring_payloads_in_place_and_frees_them_after(monkeypatch):
    monkeypatch.setenv("PSLINK_SHM_RING_MIB", "1")
    reactor, sender, receiver, sink = connected(LendingSink())
    sent = []
    for i in range(8):  # 2.4 MB through a 1 MiB ring: its space is freed after each message
        sent.append((b"m%d" % i, [np.full(300_000, i, np.uint8).tobytes(), b"small"]))
        sender.send([sent[-1][0], np.frombuffer(sent[-1][1][0], np.uint8), b"small"])
        pump_until(reactor, lambda: len(sink.messages) == len(sent))
        assert int(receiver.rings.inp._consumed[0]) == receiver.rings.inp.taken
    assert sink.messages == sent
    assert sink.lent == [([True, False], True)] * 8  # the large one in place, held while read
    reactor.close()


def _send_from_the_reactor(reactor, sender, count):
    """Post sends that run on the reactor's own thread, as an Aggregator's replies do."""
    payloads = [np.full(300_000, i, np.uint8) for i in range(count)]

    def send_all():
        for i, payload in enumerate(payloads):
            sender.send([b"%d" % i, payload])
            sender.send([b"small%d" % i, b"s"])

    reactor.post(send_all)
    expected = []
    for i, payload in enumerate(payloads):
        expected += [(b"%d" % i, [payload.tobytes()]), (b"small%d" % i, [b"s"])]
    return expected


@needs_rings
def test_the_reactor_holds_messages_back_for_ring_room_in_order(monkeypatch):
    monkeypatch.setenv("PSLINK_SHM_RING_MIB", "1")
    reactor, sender, receiver, sink = connected()
    expected = _send_from_the_reactor(reactor, sender, 6)
    pump_until(reactor, lambda: len(sink.messages) == len(expected))
    assert sink.messages == expected
    assert not sender.rings.held
    # all six went through the ring (three at a time): none fell back to the socket
    assert receiver.rings.inp.taken >= 6 * 300_000
    reactor.close()


@needs_rings
def test_held_messages_take_the_socket_once_the_wait_is_over(monkeypatch):
    monkeypatch.setenv("PSLINK_SHM_RING_MIB", "1")
    monkeypatch.setenv("PSLINK_SHM_WAIT_MS", "1")
    reactor, sender, receiver, sink = connected()
    with reactor._drive_lock:
        reactor.remove_reader(receiver.fd)  # a receiver that takes nothing for now
    expected = _send_from_the_reactor(reactor, sender, 6)
    pump_until(reactor, lambda: sender.rings.held_until is not None)
    pump_until(reactor, lambda: not sender.rings.held)  # the wait ran out: the rest went on the socket
    with reactor._drive_lock:
        reactor.add_reader(receiver.fd, receiver._read_burst)
    pump_until(reactor, lambda: len(sink.messages) == len(expected))
    assert sink.messages == expected
    assert receiver.rings.inp.taken < 6 * 300_000  # some came on the socket, still in order
    reactor.close()


def _first_send_faults(warm: bool) -> int:
    """Minor page faults this process takes sending one 8 MiB payload as a connection's first
    (after ``warm()`` or not), received into a buffer whose pages are in place already."""
    import resource

    landing = np.zeros(8 << 20, np.uint8)
    landing[::4096] = 1  # (its pages faulted here, not below)
    received = []

    class Landing(Sink):
        def on_header(self, conn, header, sizes):
            return header, [memoryview(landing)]

        def on_message(self, conn, state, payloads):
            received.append(state)

    reactor, sender, receiver, _ = connected(Landing())
    payload = np.full(8 << 20, 7, np.uint8)
    if warm:
        sender.warm()
        pump(reactor)
        assert _out(sender) is not None and receiver.rings.inp is not None  # made before any payload
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    sender.send([b"first", payload])
    pump_until(reactor, lambda: received)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    assert (landing == 7).all() and _out(sender).head == payload.size  # it went through the ring
    reactor.close()
    return faults


@needs_rings
def test_a_warmed_connection_has_its_ring_made_and_its_pages_in_place_before_the_first_payload():
    pages = (8 << 20) // 4096
    cold = _first_send_faults(warm=False)
    warm = _first_send_faults(warm=True)
    assert cold >= pages  # a fresh ring faults in page by page under the first payload (at both ends)
    assert warm < pages // 8  # warmed: both ends' pages were in place already


def test_a_connection_says_whether_what_it_sent_is_still_on_its_way():
    """What an Aggregator's copies wait for on a slow link: its replies still crossing."""
    reactor, sender, receiver, sink = connected()
    assert not sender.sending()
    sender.send([b"reply", b"x" * 1000])  # on the socket: the receiver has not read it yet
    assert sender.sending()
    pump_until(reactor, lambda: sink.messages)
    assert not sender.sending()
    reactor.close()
