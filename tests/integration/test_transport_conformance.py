"""One conformance suite, run against every transport backend.

Each backend must deliver whole messages in order, put payloads into the buffers a handler names,
drop discarded payloads without losing step, serve many peers and concurrent senders, enforce the
size limits, and report closed peers.
"""

from __future__ import annotations

import contextlib
import functools
import queue
import socket
import threading

import numpy as np
import pytest

from pslink.bench import netns
from pslink.core.wire.loop import Reactor, ReactorThread
from pslink.core.wire.protocol import Limits
from pslink.core.transport import DISCARD, Transports
from pslink.errors import PeerError, ProtocolError

def _out(conn):
    """The ring a connection sends through (None: none, or no rings on this connection)."""
    return conn.rings.out if conn.rings is not None else None

# "tcp" between peers of one host goes over the local (Unix) socket beside the port, large
# payloads through shared-memory rings where the platform has them; "tcp-no-shm" keeps every
# payload on that socket (PSLINK_SHM=0); "tcp-only" turns local sockets off
# (PSLINK_LOCAL_SOCKETS=0). Across hosts (network namespaces, when they can be made here):
# "tcp-other-host" listens on host A's address and connects from host B, so TCP carries
# everything; "tcp-host-address" connects from host A itself to that (non-loopback) address, so
# the local socket and the rings are used: which path is taken follows the host, not the address.
BACKENDS = ["tcp://127.0.0.1:0", "tcp-no-shm", "tcp-only", "tcp-other-host", "tcp-host-address",
            "zmq+tcp://127.0.0.1:0", "inproc://*"]
BACKEND_IDS = ["tcp", "tcp-no-shm", "tcp-only", "tcp-other-host", "tcp-host-address", "zmq", "inproc"]
WAIT = 10.0


class Recorder:
    """A handler that records what arrives; optionally echoes or places payloads."""

    def __init__(self, echo=False, placer=None):
        self.echo = echo
        self.placer = placer  # fn(header, sizes) -> buffers
        self.messages: queue.Queue = queue.Queue()
        self.accepted: queue.Queue = queue.Queue()
        self.closed: queue.Queue = queue.Queue()

    def on_header(self, conn, header, sizes):
        buffers = self.placer(header, sizes) if self.placer else None
        return (header, buffers), buffers

    def on_message(self, conn, state, payloads):
        header, buffers = state
        data = [bytes(p) for p in payloads]
        self.messages.put((conn, header, data, payloads, buffers))
        if self.echo:
            conn.send([header, *data])

    def on_accept(self, conn):
        self.accepted.put(conn)

    def on_close(self, conn, exc):
        self.closed.put((conn, exc))


class Net(tuple):
    """``(address, transports, reactor factory)``, and the hosts the two sides are made on."""

    server_host = client_host = contextlib.nullcontext


@pytest.fixture(scope="module")
def hosts():
    reason = netns.unavailable()
    if reason is not None:
        pytest.skip(f"no second host to test against: {reason}")
    with netns.VirtualHosts(["A", "B"]) as made:
        yield made


@pytest.fixture(params=BACKENDS, ids=BACKEND_IDS)
def net(request, monkeypatch):
    address = request.param
    server_host = client_host = contextlib.nullcontext
    if address == "tcp-only":
        monkeypatch.setenv("PSLINK_LOCAL_SOCKETS", "0")
        address = "tcp://127.0.0.1:0"
    elif address == "tcp-no-shm":
        monkeypatch.setenv("PSLINK_SHM", "0")
        address = "tcp://127.0.0.1:0"
    elif address in ("tcp-other-host", "tcp-host-address"):
        hosts = request.getfixturevalue("hosts")
        server_host = functools.partial(hosts.enter, "A")
        client_host = functools.partial(hosts.enter, "B" if address == "tcp-other-host" else "A")
        address = f"tcp://{hosts.address('A')}:0"
    transports = Transports()
    threads = []

    def reactor(name):
        r = Reactor(name)
        threads.append(ReactorThread(r).start())
        return r

    made = Net((address, transports, reactor))
    made.server_host, made.client_host = server_host, client_host
    yield made
    for t in threads:
        t.stop()
        t.reactor.close()
    transports.close()


def _listen(net, handler, limits=Limits()):
    address, transports, reactor = net
    with net.server_host():
        return transports.listen(address, reactor("server"), handler, limits)


def _connect(net, listener, handler, limits=Limits()):
    _, transports, reactor = net
    with net.client_host():
        return transports.connect(listener.address, reactor("client"), handler, limits, timeout=5.0)


def _payloads(rng, count, size):
    return [rng.integers(0, 256, size, dtype=np.uint8) for _ in range(count)]


def test_echo_keeps_order_and_content(net):
    server = Recorder(echo=True)
    listener = _listen(net, server)
    client = Recorder()
    conn = _connect(net, listener, client)
    rng = np.random.default_rng(0)
    sent = []
    for i, (count, size) in enumerate([(0, 0), (1, 1), (1, 4096), (3, 1000), (2, 0), (1, 5 << 20), (1, 17)] * 3):
        payloads = _payloads(rng, count, size)
        header = f"msg-{i}".encode()
        conn.send([header, *payloads])
        sent.append((header, [p.tobytes() for p in payloads]))
    for header, payloads in sent:
        _, got_header, got, _, _ = client.messages.get(timeout=WAIT)
        assert got_header == header
        assert got == payloads


def test_many_large_messages_from_two_threads_arrive_whole_and_in_order(net):
    # Far more than a shared-memory ring holds, from two threads, echoed back: the rings wrap
    # and fill, and what does not fit goes on the socket, in order.
    server = Recorder(echo=True)
    listener = _listen(net, server)
    client = Recorder()
    conn = _connect(net, listener, client)
    sizes = [300_000, 70_000, 5 << 20, 1 << 20, 65_536, 3 << 20]
    messages = {t: [np.full(size, (t * 31 + i) % 251, np.uint8) for i, size in enumerate(sizes * 6)] for t in range(2)}

    def sender(t):
        for i, payload in enumerate(messages[t]):
            conn.send([f"{t}:{i}".encode(), payload, b"small"])

    workers = [threading.Thread(target=sender, args=(t,)) for t in range(2)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(WAIT)
    seen = {0: [], 1: []}
    for _ in range(2 * len(sizes) * 6):
        _, header, got, _, _ = client.messages.get(timeout=WAIT)
        t, i = map(int, header.decode().split(":"))
        assert got == [messages[t][i].tobytes(), b"small"]
        seen[t].append(i)
    assert seen == {t: list(range(len(sizes) * 6)) for t in range(2)}


@pytest.mark.parametrize("net, same_host", [("tcp://127.0.0.1:0", True), ("tcp-host-address", True),
                                             ("tcp-only", False), ("tcp-other-host", False)],
                         indirect=["net"], ids=["loopback", "host-address", "tcp-only", "other-host"])
def test_the_path_follows_the_host_not_the_address(net, same_host):
    # A peer in the listener's own network namespace meets it on the local socket, also when it
    # dials the host's network address, and its large payloads cross a shared-memory ring; a
    # peer on another host takes TCP, and no ring, whatever the address looks like.
    from pslink.core.transport.options import rings_supported

    server = Recorder(echo=True)
    listener = _listen(net, server)
    client = Recorder()
    conn = _connect(net, listener, client)
    payload = np.arange(1 << 18, dtype=np.uint8)
    conn.send([b"big", payload])
    _, header, got, _, _ = client.messages.get(timeout=WAIT)
    assert header == b"big" and got == [payload.tobytes()]
    accepted = server.accepted.get(timeout=WAIT)
    if same_host:
        assert conn.sock.family == socket.AF_UNIX and accepted.peer.startswith("local://")
        assert (_out(conn) is not None) == rings_supported()
    else:
        assert conn.sock.family in (socket.AF_INET, socket.AF_INET6) and accepted.peer.startswith("tcp://")
        assert _out(conn) is None and _out(accepted) is None


def test_payloads_land_in_named_buffers(net):
    targets = []

    def placer(header, sizes):
        bufs = [np.zeros(s, np.uint8) for s in sizes]
        targets.append(bufs)
        return [memoryview(b) for b in bufs]

    server = Recorder(placer=placer)
    listener = _listen(net, server)
    conn = _connect(net, listener, Recorder())
    data = np.arange(300_000, dtype=np.float32)
    conn.send([b"h", data, b"tail"])
    _, header, got, payloads, buffers = server.messages.get(timeout=WAIT)
    assert header == b"h"
    array = targets[0][0].view(np.float32)
    np.testing.assert_array_equal(array, data)
    assert bytes(targets[0][1]) == b"tail"
    # on_message got the very buffers the handler named, not copies of them
    assert all(p.obj is b.obj for p, b in zip(payloads, buffers))


def test_discarded_payloads_keep_the_stream_in_step(net):
    server = Recorder(placer=lambda header, sizes: DISCARD if header == b"drop" else None)
    listener = _listen(net, server)
    conn = _connect(net, listener, Recorder())
    conn.send([b"drop", np.ones(2_000_000, np.uint8)])
    conn.send([b"keep", b"abc"])
    _, header, got, _, _ = server.messages.get(timeout=WAIT)
    assert header == b"drop" and got == []
    _, header, got, _, _ = server.messages.get(timeout=WAIT)
    assert header == b"keep" and got == [b"abc"]


def test_many_clients_get_their_own_replies(net):
    server = Recorder(echo=True)
    listener = _listen(net, server)
    clients = [Recorder() for _ in range(6)]
    conns = [_connect(net, listener, c) for c in clients]
    for round_ in range(20):
        for i, conn in enumerate(conns):
            conn.send([f"{i}:{round_}".encode(), np.full(1000 + i, i, np.uint8)])
    for i, client in enumerate(clients):
        for round_ in range(20):
            _, header, got, _, _ = client.messages.get(timeout=WAIT)
            assert header == f"{i}:{round_}".encode()
            assert got == [bytes([i]) * (1000 + i)]


def test_concurrent_senders_never_interleave_messages(net):
    server = Recorder()
    listener = _listen(net, server)
    conn = _connect(net, listener, Recorder())
    per_thread, threads = 50, 4

    def sender(t):
        for i in range(per_thread):
            conn.send([f"{t}:{i}".encode(), np.full(70_000, t, np.uint8)])

    workers = [threading.Thread(target=sender, args=(t,)) for t in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(WAIT)
    seen = {t: [] for t in range(threads)}
    for _ in range(per_thread * threads):
        _, header, got, _, _ = server.messages.get(timeout=WAIT)
        t, i = map(int, header.decode().split(":"))
        assert got == [bytes([t]) * 70_000]
        seen[t].append(i)
    # each thread's messages arrive in the order that thread sent them
    assert all(seen[t] == list(range(per_thread)) for t in range(threads))


def test_client_close_is_reported_to_the_server(net):
    address, transports, _ = net
    server = Recorder()
    listener = _listen(net, server)
    conn = _connect(net, listener, Recorder())
    conn.send([b"hello"])
    server.messages.get(timeout=WAIT)
    conn.close()
    with pytest.raises(PeerError):
        conn.send([b"after close"])
    if transports.backend(address).reports_peer_close:
        closed_conn, exc = server.closed.get(timeout=WAIT)
        assert isinstance(exc, PeerError)
    else:  # ZeroMQ: a ROUTER never hears of it; the roles' heartbeats cover that case
        assert address.startswith("zmq")


def test_server_going_away_is_reported_to_the_client(net):
    server = Recorder()
    listener = _listen(net, server)
    client = Recorder()
    conn = _connect(net, listener, client)
    conn.send([b"hello"])
    server_conn, *_ = server.messages.get(timeout=WAIT)
    if net[0].startswith("zmq"):
        listener.close()  # closes the ROUTER socket: the DEALER sees a disconnect
    else:
        server_conn.close()
    _, exc = client.closed.get(timeout=WAIT)
    assert isinstance(exc, PeerError)
    assert conn.closed


def test_connecting_to_nothing_fails_fast(net):
    address, transports, reactor = net
    nowhere = {"tcp": "tcp://127.0.0.1:1", "zmq+tcp": "zmq+tcp://127.0.0.1:1", "inproc": "inproc://nobody"}
    target = nowhere[address.split("://")[0]]
    with pytest.raises(PeerError, match="cannot connect"):
        transports.connect(target, reactor("client"), Recorder(), timeout=0.5)


def test_oversized_message_is_refused(net):
    limits = Limits(max_message_bytes=1 << 16, max_header_bytes=1 << 12)
    server = Recorder()
    listener = _listen(net, server, limits)
    client = Recorder()
    conn = _connect(net, listener, client)
    conn.send([b"small", b"x" * 100])
    assert server.messages.get(timeout=WAIT)[1] == b"small"
    conn.send([b"big", np.zeros(1 << 17, np.uint8)])
    # the sender learns that the receiver dropped the connection; nothing big was delivered
    _, exc = client.closed.get(timeout=WAIT)
    assert isinstance(exc, PeerError)
    assert server.messages.empty()
    if not net[0].startswith("zmq"):  # libzmq drops such peers itself, without telling
        _, server_exc = server.closed.get(timeout=WAIT)
        assert isinstance(server_exc, ProtocolError)
        assert "exceed" in str(server_exc)


def test_same_host_tcp_peers_meet_on_the_local_socket_unless_turned_off():
    import socket

    from pslink.core.transport.options import TransportOptions
    from pslink.core.transport.tcp import TcpTransport, local_socket_names

    transport, reactor = TcpTransport(), Reactor("local")
    thread = ReactorThread(reactor).start()
    try:
        server = Recorder(echo=True)
        listener = transport.listen("tcp://127.0.0.1:0", reactor, server)
        conn = transport.connect(listener.address, reactor, Recorder(), timeout=5.0)
        assert conn.sock.family == socket.AF_UNIX and conn.peer == listener.address
        accepted = server.accepted.get(timeout=WAIT)
        assert accepted.peer.startswith(f"local://{listener.address[len('tcp://'):]}#")
        tcp_only = TcpTransport(TransportOptions(local_sockets=False))
        assert tcp_only.connect(listener.address, reactor, Recorder(), timeout=5.0).sock.family == socket.AF_INET
        assert local_socket_names("127.0.0.1", 7000, TransportOptions(local_sockets=False)) == []
        # Another host's address is never tried on a local socket; this host's are, the wildcard
        # listener's after the address's own; a loopback port without one falls back to TCP.
        assert local_socket_names("10.1.2.3", 7000) == []
        assert local_socket_names("127.0.0.1", 7000) == ["\0pslink/127.0.0.1:7000", "\0pslink/*:7000"]
        assert local_socket_names("localhost", 7000) == local_socket_names("127.0.0.1", 7000)
        plain = socket.socket()
        plain.bind(("127.0.0.1", 0))
        plain.listen()
        try:
            fallback = transport.connect(f"tcp://127.0.0.1:{plain.getsockname()[1]}", reactor, Recorder(), timeout=5.0)
            assert fallback.sock.family == socket.AF_INET
        finally:
            plain.close()
        listener.close()
    finally:
        thread.stop()
        reactor.close()
