"""In-process transport: a whole service (pMaster, Aggregators, Agents) inside one process.

Addresses are ``inproc://name``; ``inproc://*`` picks a fresh name. The registry of names lives in
the :class:`InprocTransport` object, not in a module global, so independent clusters can share a
process: give every component of one cluster the same transport object.

A send copies the payloads, as a socket would: the receiver may keep what it received (an
Aggregator keeps a pushed buffer as its accumulator) while the sender reuses its array. The same
limits as on a socket are enforced before the handler sees a message.
"""

from __future__ import annotations

import itertools
import threading
from typing import Sequence

from pslink.core.wire.loop import Reactor
from pslink.core.wire.protocol import DEFAULT_LIMITS, Limits, frame_limit
from pslink.core.transport.base import DISCARD, Connection, Handler, Listener, Transport
from pslink.errors import PeerError, ProtocolError


class InprocConnection(Connection):
    def __init__(self, reactor: Reactor, handler: Handler, limits: Limits, peer: str):
        self.reactor = reactor
        self.handler = handler
        self.limits = limits
        self.peer = peer
        self.other: InprocConnection | None = None
        self._closed = False
        self._lock = threading.Lock()

    @property
    def closed(self) -> bool:
        return self._closed

    def __repr__(self) -> str:
        return f"<InprocConnection {self.peer}{' closed' if self._closed else ''}>"

    def send(self, frames: Sequence) -> None:
        header = bytes(frames[0])
        payloads = [bytearray(memoryview(p).cast("B")) for p in frames[1:]]
        with self._lock:
            if self._closed:
                raise PeerError(f"connection to {self.peer} is closed", peer=self.peer)
            other = self.other
        # Posting keeps the order of messages on this connection (the reactor's queue is FIFO).
        other.reactor.post(other._deliver, header, payloads)

    def _deliver(self, header: bytes, payloads: list) -> None:
        if self._closed:
            return
        sizes = tuple(len(p) for p in payloads)
        limits = self.limits
        if (
            len(sizes) > frame_limit(limits)
            or len(header) > limits.max_header_bytes
            or sum(sizes) > limits.max_message_bytes
        ):
            self._fail(
                ProtocolError(
                    f"bad frame from {self.peer}: {len(sizes)} payloads of {sum(sizes)} bytes and a "
                    f"header of {len(header)} bytes exceed the limits"
                )
            )
            return
        state, buffers = self.handler.on_header(self, header, sizes)
        if buffers is DISCARD:
            filled = []
        elif buffers is None:
            filled = [memoryview(p) for p in payloads]
        else:
            filled = [memoryview(b).cast("B") if not isinstance(b, memoryview) else b for b in buffers]
            if [f.nbytes for f in filled] != list(sizes):
                self._fail(ProtocolError(f"handler gave buffers that do not fit payloads of {list(sizes)}"))
                return
            for dest, src in zip(filled, payloads):
                dest[:] = src
        self.handler.on_message(self, state, filled)

    def _fail(self, exc: BaseException) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            other = self.other
        self.handler.on_close(self, exc)
        other._peer_closed()

    def _peer_closed(self) -> None:
        def notify():
            with self._lock:
                if self._closed:
                    return
                self._closed = True
            self.handler.on_close(self, PeerError(f"{self.peer} closed the connection", peer=self.peer))

        self.reactor.post(notify)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            other = self.other
        if other is not None:
            other._peer_closed()


class InprocListener(Listener):
    def __init__(self, transport: "InprocTransport", name: str, reactor: Reactor, handler: Handler, limits: Limits):
        self.transport = transport
        self.name = name
        self.address = f"inproc://{name}"
        self.reactor = reactor
        self.handler = handler
        self.limits = limits

    def close(self) -> None:
        self.transport._unregister(self.name, self)


class InprocTransport(Transport):
    schemes = ("inproc",)

    def __init__(self):
        self._listeners: dict[str, InprocListener] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count(1)

    def listen(self, address, reactor, handler, limits=DEFAULT_LIMITS) -> InprocListener:
        name = address.split("://", 1)[1] if "://" in address else address
        with self._lock:
            if name in ("*", "", "0") or name.endswith(":0"):
                name = f"{name.rsplit(':', 1)[0] if name.endswith(':0') else 'ep'}-{next(self._ids)}"
            if name in self._listeners:
                raise PeerError(f"cannot listen on inproc://{name}: address already in use")
            listener = InprocListener(self, name, reactor, handler, limits)
            self._listeners[name] = listener
        return listener

    def _unregister(self, name: str, listener: InprocListener) -> None:
        with self._lock:
            if self._listeners.get(name) is listener:
                del self._listeners[name]

    def connect(self, address, reactor, handler, limits=DEFAULT_LIMITS, timeout=10.0) -> InprocConnection:
        name = address.split("://", 1)[1] if "://" in address else address
        with self._lock:
            listener = self._listeners.get(name)
            serial = next(self._ids)
        if listener is None:
            raise PeerError(f"cannot connect to {address}: nothing listens there", peer=address)
        client = InprocConnection(reactor, handler, limits, peer=address)
        server = InprocConnection(
            listener.reactor, listener.handler, listener.limits, peer=f"inproc://client-{serial}"
        )
        client.other, server.other = server, client
        listener.reactor.post(listener.handler.on_accept, server)
        return client
