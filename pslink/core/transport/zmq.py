"""ZeroMQ transport (``zmq+tcp://host:port``, ``zmq+ipc:///path``) through pyzmq.

ps-lite's transport, kept for deployments that want ZeroMQ (and, later, CURVE encryption). A
listener is a ROUTER socket; each peer identity that talks to it becomes one
:class:`~pslink.core.transport.base.Connection`. A client is a DEALER socket. ZeroMQ sockets are not
thread-safe, so one I/O thread per :class:`ZmqTransport` owns all of them: sends are queued to it,
and received messages are posted to the reactor that owns the connection. Payloads are sent and
received without copies (``copy=False``); a handler that names destination buffers gets one copy
into them.

What ZeroMQ does not report: a ROUTER does not learn that one peer went away (its connection
object simply goes quiet; the roles' PING/heartbeat timeouts cover that). A client sees a
disconnect through the socket monitor and is closed, so its pending requests fail at once.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import os
import threading
from typing import Sequence

import zmq
from zmq.utils.monitor import parse_monitor_message

from pslink.core.wire.loop import Reactor
from pslink.core.wire.protocol import DEFAULT_LIMITS, Limits, frame_limit
from pslink.core.transport import curve
from pslink.core.transport.base import DISCARD, Connection, Handler, Listener, Transport
from pslink.core.transport.options import TransportOptions
from pslink.errors import PeerError, ProtocolError

log = logging.getLogger(__name__)

_HANDSHAKE_FAILED = (
    getattr(zmq, "EVENT_HANDSHAKE_FAILED_PROTOCOL", 0)
    | getattr(zmq, "EVENT_HANDSHAKE_FAILED_NO_DETAIL", 0)
)
_AUTH_FAILED = getattr(zmq, "EVENT_HANDSHAKE_FAILED_AUTH", 0)
# A connection counts once its ZMTP handshake (and CURVE's, if on) is done, where libzmq says so.
_READY = getattr(zmq, "EVENT_HANDSHAKE_SUCCEEDED", zmq.EVENT_CONNECTED)


def _zmq_endpoint(address: str) -> str:
    """``zmq+tcp://h:0`` -> ``tcp://h:*`` (ZeroMQ's spelling of an ephemeral port)."""
    endpoint = address.split("+", 1)[1] if address.startswith("zmq+") else address
    if endpoint.startswith("tcp://") and endpoint.endswith(":0"):
        endpoint = endpoint[:-2] + ":*"
    return endpoint


class _ZmqConnectionBase(Connection):
    def __init__(self, transport: "ZmqTransport", reactor: Reactor, handler: Handler, limits: Limits, peer: str):
        self.transport = transport
        self.reactor = reactor
        self.handler = handler
        self.limits = limits
        self.peer = peer
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.peer}{' closed' if self._closed else ''}>"

    def _deliver(self, header, payloads: list) -> None:
        """On the reactor's thread: validate sizes, place payloads, hand the message over."""
        if self._closed:
            return
        views = [memoryview(p) for p in payloads]
        sizes = tuple(v.nbytes for v in views)
        limits = self.limits
        if (
            len(sizes) > frame_limit(limits)
            or len(header) > limits.max_header_bytes
            or sum(sizes) > limits.max_message_bytes
        ):
            self._fail(
                ProtocolError(
                    f"bad message from {self.peer}: {len(sizes)} payloads of {sum(sizes)} bytes and "
                    f"a header of {len(header)} bytes exceed the limits"
                )
            )
            return
        state, buffers = self.handler.on_header(self, bytes(header), sizes)
        if buffers is DISCARD:
            filled = []
        elif buffers is None:
            filled = views
        else:
            filled = [memoryview(b).cast("B") if not isinstance(b, memoryview) else b for b in buffers]
            if [f.nbytes for f in filled] != list(sizes):
                self._fail(ProtocolError(f"handler gave buffers that do not fit payloads of {list(sizes)}"))
                return
            for dest, src in zip(filled, views):
                dest[:] = src.cast("B") if src.format != "B" else src
        self.handler.on_message(self, state, filled)

    def _fail(self, exc: BaseException) -> None:
        if self._closed:
            return
        self._closed = True
        self._forget()
        self.handler.on_close(self, exc)

    def _forget(self) -> None:
        """Drop transport-side resources (I/O thread)."""


class ZmqPeerConnection(_ZmqConnectionBase):
    """One peer identity of a listener's ROUTER socket."""

    def __init__(self, listener: "ZmqListener", identity: bytes):
        super().__init__(
            listener.transport, listener.reactor, listener.handler, listener.limits,
            peer=f"{listener.address} peer {identity.hex()}",
        )
        self.listener = listener
        self.identity = identity

    def send(self, frames: Sequence) -> None:
        if self._closed:
            raise PeerError(f"connection to {self.peer} is closed", peer=self.peer)
        self.transport._submit(self.listener._send, [self.identity, *frames])

    def close(self) -> None:
        self._closed = True
        self._forget()

    def _forget(self) -> None:
        self.transport._submit(self.listener._peers.pop, self.identity, None)


class ZmqClientConnection(_ZmqConnectionBase):
    """A DEALER socket connected to one listener."""

    def __init__(self, transport, reactor, handler, limits, address: str):
        super().__init__(transport, reactor, handler, limits, peer=address)
        self.sock: zmq.Socket | None = None
        self.monitor: zmq.Socket | None = None
        self.connected = threading.Event()  # set once connected, or once that failed (``failure``)
        self.failure: PeerError | None = None

    def _open(self, endpoint: str) -> None:  # I/O thread
        sock = self.transport.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, max(self.limits.max_message_bytes, self.limits.max_header_bytes))
        self.monitor = sock.get_monitor_socket(_READY | zmq.EVENT_DISCONNECTED | _HANDSHAKE_FAILED | _AUTH_FAILED)
        if self.transport.options.curve is not None:
            curve.dial(sock, self.transport.options.curve)
        sock.connect(endpoint)
        self.sock = sock
        self.transport._own(sock, self._on_readable)
        self.transport._own(self.monitor, self._on_monitor)

    def _on_readable(self) -> None:  # I/O thread
        while self.sock is not None:
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self.reactor.post(self._deliver, frames[0].buffer, [f.buffer for f in frames[1:]])

    def _on_monitor(self) -> None:  # I/O thread
        while self.monitor is not None:
            try:
                event = parse_monitor_message(self.monitor.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                return
            if event["event"] == _READY:
                self.connected.set()
            elif event["event"] & (_HANDSHAKE_FAILED | _AUTH_FAILED):
                # A listener with CURVE and a client without (or with another key), or the reverse:
                # libzmq would retry forever; the caller learns why now.
                uses = "with" if self.transport.options.curve is not None else "without"
                error = PeerError(f"the ZeroMQ handshake with {self.peer} failed (this process connects {uses} "
                                  f"CURVE): do both use the service's CURVE key? {curve.CURVE_HINT}", peer=self.peer)
                self.failure = error
                self.connected.set()
                self._teardown()
                self.reactor.post(self._fail, error)
                return
            elif event["event"] == zmq.EVENT_DISCONNECTED:
                self._teardown()
                self.reactor.post(self._fail, PeerError(f"lost connection to {self.peer}", peer=self.peer))
                return

    def _send(self, frames) -> None:  # I/O thread
        if self.sock is not None:
            self.sock.send_multipart(frames, copy=False)

    def _teardown(self) -> None:  # I/O thread
        for sock in (self.sock, self.monitor):
            if sock is not None:
                self.transport._disown(sock)
        if self.sock is not None:
            self.sock.disable_monitor()
            self.sock.close(0)
        if self.monitor is not None:
            self.monitor.close(0)
        self.sock = self.monitor = None

    def send(self, frames: Sequence) -> None:
        if self._closed:
            raise PeerError(f"connection to {self.peer} is closed", peer=self.peer)
        self.transport._submit(self._send, list(frames))

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.transport._submit(self._teardown)

    def _forget(self) -> None:
        self.transport._submit(self._teardown)


class ZmqListener(Listener):
    def __init__(self, transport: "ZmqTransport", address: str, reactor: Reactor, handler: Handler, limits: Limits):
        self.transport = transport
        self.reactor = reactor
        self.handler = handler
        self.limits = limits
        self._peers: dict[bytes, ZmqPeerConnection] = {}
        self.sock: zmq.Socket | None = None
        self.monitor: zmq.Socket | None = None
        self.address = address

    def _open(self, endpoint: str) -> None:  # I/O thread
        sock = self.transport.ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        if self.transport.options.curve is not None:
            curve.serve(sock, self.transport.options.curve)
        sock.setsockopt(zmq.MAXMSGSIZE, max(self.limits.max_message_bytes, self.limits.max_header_bytes))
        try:
            sock.bind(endpoint)
        except zmq.ZMQError as exc:
            sock.close(0)
            raise PeerError(f"cannot listen on {self.address}: {exc}") from None
        self.address = "zmq+" + sock.getsockopt_string(zmq.LAST_ENDPOINT)
        if _HANDSHAKE_FAILED:
            self.monitor = sock.get_monitor_socket(_HANDSHAKE_FAILED)
            self.transport._own(self.monitor, self._on_monitor)
        self.sock = sock
        self.transport._own(sock, self._on_readable)

    def _on_readable(self) -> None:  # I/O thread
        while self.sock is not None:
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            identity = frames[0].bytes
            if len(frames) < 2:
                continue  # an empty message carries nothing to answer
            conn = self._peers.get(identity)
            if conn is None:
                conn = self._peers[identity] = ZmqPeerConnection(self, identity)
                self.reactor.post(self.handler.on_accept, conn)
            self.reactor.post(conn._deliver, frames[1].buffer, [f.buffer for f in frames[2:]])

    def _on_monitor(self) -> None:  # I/O thread
        while self.monitor is not None:
            try:
                parse_monitor_message(self.monitor.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                return
            # A peer that does not speak ZMTP (garbage bytes): report it like a bad frame.
            ghost = ZmqPeerConnection(self, b"?")
            ghost.peer = f"{self.address} (unidentified peer)"
            error = ProtocolError(f"bad handshake on {self.address}: not a ZeroMQ peer")
            self.reactor.post(self.handler.on_close, ghost, error)

    def _send(self, frames) -> None:  # I/O thread
        if self.sock is not None:
            self.sock.send_multipart(frames, copy=False)

    def _close(self) -> None:  # I/O thread
        for sock in (self.sock, self.monitor):
            if sock is not None:
                self.transport._disown(sock)
        if self.sock is not None:
            if self.monitor is not None:
                self.sock.disable_monitor()
            self.sock.close(0)
        if self.monitor is not None:
            self.monitor.close(0)
        self.sock = self.monitor = None
        for conn in self._peers.values():
            conn._closed = True
        self._peers.clear()

    def close(self) -> None:
        self.transport._submit(self._close)


class ZmqTransport(Transport):
    schemes = ("zmq+tcp", "zmq+ipc")
    reports_peer_close = False

    def __init__(self, options: TransportOptions = TransportOptions()):
        self.options = options
        self.ctx = zmq.Context()
        # CURVE: listeners of this process admit only clients holding the service's key (ZAP).
        self._auth = curve.authenticator(self.ctx, options.curve) if options.curve is not None else None
        self._commands: collections.deque = collections.deque()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._owned: dict[zmq.Socket, object] = {}
        self._poller = zmq.Poller()
        self._poller.register(self._wake_r, zmq.POLLIN)
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="pslink-zmq-io", daemon=True)
        self._thread.start()

    # -- I/O thread plumbing ----------------------------------------------------------------------

    def _submit(self, fn, *args) -> None:
        self._commands.append((fn, args, None))
        self._wake()

    def _call(self, fn, *args, timeout: float = 10.0):
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.append((fn, args, future))
        self._wake()
        return future.result(timeout)

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"\0")
        except (BlockingIOError, OSError):
            pass

    def _own(self, sock: zmq.Socket, callback) -> None:
        self._owned[sock] = callback
        self._poller.register(sock, zmq.POLLIN)

    def _disown(self, sock: zmq.Socket) -> None:
        if self._owned.pop(sock, None) is not None:
            self._poller.unregister(sock)

    def _run(self) -> None:
        while not self._closed:
            try:
                events = self._poller.poll(1000)
            except zmq.ZMQError:
                if self._closed:
                    return
                raise
            for target, _ in events:
                if target == self._wake_r:
                    try:
                        while os.read(self._wake_r, 4096):
                            pass
                    except BlockingIOError:
                        pass
                    continue
                callback = self._owned.get(target)
                if callback is not None:
                    try:
                        callback()
                    except Exception:
                        log.exception("zmq transport: handling %r failed", target)
            while self._commands:
                fn, args, future = self._commands.popleft()
                try:
                    result = fn(*args)
                except BaseException as exc:
                    if future is None:
                        log.exception("zmq transport: command %r failed", fn)
                    else:
                        future.set_exception(exc)
                else:
                    if future is not None:
                        future.set_result(result)

    # -- Transport API ------------------------------------------------------------------------------

    def listen(self, address, reactor, handler, limits=DEFAULT_LIMITS) -> ZmqListener:
        listener = ZmqListener(self, address, reactor, handler, limits)
        self._call(listener._open, _zmq_endpoint(address))
        return listener

    def connect(self, address, reactor, handler, limits=DEFAULT_LIMITS, timeout=10.0) -> ZmqClientConnection:
        conn = ZmqClientConnection(self, reactor, handler, limits, address)
        self._call(conn._open, _zmq_endpoint(address))
        # ZeroMQ would retry forever in the background; a caller wants to know now.
        if not conn.connected.wait(timeout):
            self._submit(conn._teardown)
            raise PeerError(f"cannot connect to {address}: no answer within {timeout} s", peer=address)
        if conn.failure is not None:
            raise conn.failure
        return conn

    def close(self) -> None:
        if self._closed:
            return

        def shutdown():
            for sock in list(self._owned):
                self._disown(sock)
                sock.close(0)

        try:
            self._call(shutdown, timeout=5.0)
        except Exception:
            pass
        self._closed = True
        self._wake()
        self._thread.join(5.0)
        if self._auth is not None:
            self._auth.stop()
        self.ctx.term()
        os.close(self._wake_r)
        os.close(self._wake_w)
