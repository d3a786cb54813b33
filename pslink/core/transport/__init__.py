"""Transports, chosen by address scheme: ``tcp://`` (native, default), ``zmq+tcp://``, ``inproc://``."""

from __future__ import annotations

import threading

from pslink.core.wire.loop import Reactor
from pslink.core.wire.protocol import DEFAULT_LIMITS, Limits
from pslink.core.transport.base import (
    DISCARD,
    Connection,
    Handler,
    Lent,
    Listener,
    Transport,
    scheme_of,
    split_host_port,
)
from pslink.core.transport.options import TransportOptions, transport_options
from pslink.errors import ConfigError

__all__ = [
    "DISCARD",
    "Connection",
    "Handler",
    "Lent",
    "Listener",
    "Transport",
    "TransportOptions",
    "Transports",
    "scheme_of",
    "split_host_port",
]


class Transports(Transport):
    """Dispatches by scheme to one backend object each, created on first use.

    Components that must reach each other over ``inproc://`` have to share one ``Transports``
    (the in-process name registry lives in it); over sockets any instance will do. ``options``
    (local sockets, shared-memory rings) go to the TCP backend; without them they are read from
    the environment, once (:func:`~pslink.core.transport.options.transport_options`).
    """

    def __init__(self, options: TransportOptions | None = None):
        if options is None:
            options = transport_options()  # the edge that reads the environment
        self.options = options
        self._backends: dict[str, Transport] = {}
        self._lock = threading.Lock()

    def backend(self, address: str) -> Transport:
        scheme = scheme_of(address)
        with self._lock:
            backend = self._backends.get(scheme)
            if backend is None:
                backend = self._backends[scheme] = _create(scheme, self._backends, self.options)
            return backend

    def listen(self, address: str, reactor: Reactor, handler: Handler, limits: Limits = DEFAULT_LIMITS) -> Listener:
        return self.backend(address).listen(address, reactor, handler, limits)

    def connect(self, address: str, reactor: Reactor, handler: Handler, limits: Limits = DEFAULT_LIMITS, timeout: float = 10.0) -> Connection:
        return self.backend(address).connect(address, reactor, handler, limits, timeout)

    def close(self) -> None:
        with self._lock:
            backends, self._backends = list(set(self._backends.values())), {}
        for backend in backends:
            backend.close()


def _create(scheme: str, existing: dict[str, Transport], options: TransportOptions) -> Transport:
    if scheme == "tcp":
        from pslink.core.transport.tcp import TcpTransport

        return TcpTransport(options)
    if scheme == "inproc":
        from pslink.core.transport.inproc import InprocTransport

        return InprocTransport()
    if scheme in ("zmq+tcp", "zmq+ipc"):
        # One ZeroMQ context and I/O thread serve both zmq schemes.
        for other in ("zmq+tcp", "zmq+ipc"):
            if other in existing:
                return existing[other]
        from pslink.core.transport.zmq import ZmqTransport

        return ZmqTransport(options)
    raise ConfigError(
        f"unknown transport scheme {scheme!r}; use tcp://host:port, zmq+tcp://host:port or inproc://name"
    )
