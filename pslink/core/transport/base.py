"""The transport seam: message connections with a header frame and raw payload frames.

A transport moves messages ``[header, payload...]`` between a listener and its clients. Roles
(Agent, Aggregator, pMaster) see only these classes, so the same role code runs over the native
TCP backend, ZeroMQ or the in-process backend, and one conformance suite checks all of them.

Receiving is two-step so that payloads can land where they belong without a copy: when a message's
header has arrived, the transport asks the handler where its payloads go
(:meth:`Handler.on_header` returns destination buffers, ``None`` to let the transport allocate, or
:data:`DISCARD` to drop them), then it calls :meth:`Handler.on_message` with the filled buffers.
All handler callbacks run on the thread that drives the connection's reactor.

A handler that only reads a payload once (adds it into a sum, say) may return its buffers as a
:class:`Lent` list: a payload that sits in shared memory is then handed over where it lies,
valid until ``on_message`` returns, instead of being copied into the buffer first.
"""

from __future__ import annotations

import abc
from typing import Any, Protocol, Sequence

from pslink.core.wire.loop import Reactor
from pslink.core.wire.protocol import DEFAULT_LIMITS, Limits
from pslink.errors import ConfigError

#: Returned by :meth:`Handler.on_header` as the buffers to make the transport drop the payloads.
DISCARD = object()


class Lent(list):
    """Destination buffers, as :meth:`Handler.on_header` returns them, that also say: a payload
    the transport can show in place (in a shared-memory ring) may be handed to ``on_message``
    there instead of being copied into its buffer. ``lent[i]`` is True where that happened; the
    handler reads such a payload before ``on_message`` returns and keeps no reference to it."""

    __slots__ = ("lent",)

    def __init__(self, buffers):
        super().__init__(buffers)
        self.lent = [False] * len(self)


class Handler(Protocol):
    """What a role implements to receive messages. Callbacks must not block."""

    def on_header(self, conn: "Connection", header: bytes, sizes: tuple[int, ...]) -> tuple[Any, Any]:
        """Return ``(state, buffers)``: ``buffers`` is a list of writable byte memoryviews with
        exactly ``sizes``, or ``None`` (transport allocates), or :data:`DISCARD`. ``state`` is
        handed back to :meth:`on_message`."""

    def on_message(self, conn: "Connection", state: Any, payloads: list) -> None:
        """A whole message arrived; ``payloads`` are the filled buffers (empty when discarded)."""

    def on_accept(self, conn: "Connection") -> None:
        """A listener accepted a new connection (listener side only)."""

    def on_close(self, conn: "Connection", exc: BaseException | None) -> None:
        """The peer closed the connection or it failed (``exc`` says why). Not called for a
        local :meth:`Connection.close`."""


class Connection(abc.ABC):
    """One message stream to a peer. ``send`` is safe from any thread and never blocks for long:
    what the socket does not take at once is queued and written by the reactor's driver."""

    peer: str  # a readable name of the remote end, for error messages
    reactor: Reactor

    @abc.abstractmethod
    def send(self, frames: Sequence) -> None:
        """Send ``[header, payload...]``. Payload buffers must stay unchanged until the peer
        answered (zero-copy). Raises PeerError if the connection is closed."""

    @abc.abstractmethod
    def close(self) -> None:
        """Close; queued output may be dropped."""

    def sending(self) -> bool:
        """Whether bytes sent here have not all reached the peer yet (queued in this process, or
        in the socket's send queue: not yet acknowledged by the peer over TCP, not yet read by it
        over a Unix socket): a large reply still crossing a slow link."""
        return False

    def warm(self) -> None:
        """Make ready now what the first large payloads would (a shared-memory ring and its
        pages), where the transport has such a thing."""

    def payload_in_place(self, nbytes: int) -> bool:
        """Whether a payload of ``nbytes`` sent here usually reaches the peer where a
        :class:`Lent` receiver reads it in place (a shared-memory ring): the peer can then
        transform it on the one copy it makes anyway (divide a sum, say)."""
        return False

    @property
    @abc.abstractmethod
    def closed(self) -> bool: ...


class Listener(abc.ABC):
    address: str  # the bound address, with the real port when port 0 was asked for

    @abc.abstractmethod
    def close(self) -> None: ...


class Transport(abc.ABC):
    """A family of addresses (``scheme://...``) and how to listen on and connect to them."""

    schemes: tuple[str, ...] = ()
    #: Whether a listener's handler hears (``on_close``) that a client went away.
    reports_peer_close: bool = True

    @abc.abstractmethod
    def listen(
        self, address: str, reactor: Reactor, handler: Handler, limits: Limits = DEFAULT_LIMITS
    ) -> Listener: ...

    @abc.abstractmethod
    def connect(
        self,
        address: str,
        reactor: Reactor,
        handler: Handler,
        limits: Limits = DEFAULT_LIMITS,
        timeout: float = 10.0,
    ) -> Connection: ...

    def close(self) -> None:
        """Release what the transport holds (threads, contexts)."""


def scheme_of(address: str) -> str:
    if not isinstance(address, str) or "://" not in address:
        raise ConfigError(
            f"address {address!r} has no scheme; use tcp://host:port, zmq+tcp://host:port "
            "or inproc://name"
        )
    return address.split("://", 1)[0]


def split_host_port(address: str) -> tuple[str, int]:
    """``tcp://host:port`` -> ``(host, port)`` with a clear error for anything else."""
    rest = address.split("://", 1)[1] if "://" in address else address
    host, sep, port = rest.rpartition(":")
    if not sep or not host:
        raise ConfigError(f"address {address!r} must look like tcp://host:port")
    try:
        port_number = int(port)
    except ValueError:
        raise ConfigError(f"address {address!r}: port {port!r} is not a number") from None
    if not 0 <= port_number < 65536:
        raise ConfigError(f"address {address!r}: port {port_number} is out of range")
    return host.strip("[]"), port_number
