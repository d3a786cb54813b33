"""Native framed TCP: pslink's default transport, Python sockets with no extra copies.

The stream each connection carries (framing, zero-copy sends and receives, shared-memory rings
to peers on this host) is :class:`~pslink.core.transport.stream.TcpConnection`; this module
listens, connects, and chooses between TCP and a local Unix socket.
"""

from __future__ import annotations

import errno
import itertools
import logging
import socket
import struct

from pslink.core import hosts
from pslink.core.ratelog import Throttled
from pslink.core.transport.base import Handler, Listener, Transport, split_host_port
from pslink.core.transport.options import TransportOptions
from pslink.core.transport.framing import FRAMING_VERSION, MAGIC, PREFIX
from pslink.core.transport.stream import TcpConnection
from pslink.core.transport.tls import SETTINGS_HINT, Handshakes, TlsSocket, client_handshake
from pslink.core.wire.protocol import encode_error, peek_id
from pslink.core.wire.loop import Reactor
from pslink.core.wire.protocol import DEFAULT_LIMITS, Limits
from pslink.errors import ConfigError, PeerError

log = logging.getLogger(__name__)

# -- same-host peers --------------------------------------------------------------------------------
#
# A listener also listens on an abstract Unix socket named after its address, and a connection to
# an address of this host (loopback, or an address of one of its interfaces) tries that first: the
# same framed stream, without the TCP stack. On these machines that moves bulk data 2.3-2.8x
# faster (4 MiB messages: 4.7-6.1 GB/s against 1.7-2.6 GB/s over loopback TCP), which is most of
# what a worker, its Aggregators and a migration's copies do when they share a host.
#
# Why reaching the socket proves the peer shares the host: abstract Unix names live in the network
# namespace, not on a file system, so a connect succeeds only from the same kernel and namespace
# as the listener (two containers, or two namespaces of one machine, never reach each other's).
# Only such connections carry shared-memory rings. Peers on other hosts, and peers that only
# share the machine but not the namespace, use TCP. TransportOptions(local_sockets=False)
# (PSLINK_LOCAL_SOCKETS=0) turns it off (TCP only). Abstract names vanish with their process:
# nothing is left on disk.
#
# Abstract names have no file permissions: any user of the host (and namespace) reaches them. So
# both ends look at the other's credentials (SO_PEERCRED) and use the socket only with a process
# of the same user, root, or a user the options allow; a listener closes a connection from anyone
# else (who can still dial TCP), and a connecting process that finds a listener of another user
# there dials TCP instead. Rings, which a peer's process maps, never cross between users.

_WILDCARD_NAME = "*"  # a listener bound to every address of the host
ACCEPTS_PER_TURN = 16
_PEERCRED = struct.Struct("3i")  # pid, uid, gid


def peer_uid(sock: socket.socket) -> int:
    """The user id of the process at the other end of a Unix socket."""
    return _PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))[1]


def _canonical(host: str) -> str:
    host = host.strip("[]")
    if hosts.is_wildcard(host):
        return _WILDCARD_NAME
    return "127.0.0.1" if host == "localhost" else host


def local_socket_name(host: str, port: int, options: TransportOptions = TransportOptions()) -> str | None:
    """The abstract Unix socket beside a TCP listener bound to ``host:port``, or None where there
    is none (not Linux, or turned off)."""
    if not options.uses_local_sockets:
        return None
    return f"\0pslink/{_canonical(host)}:{port}"


def local_socket_names(host: str, port: int, options: TransportOptions = TransportOptions()) -> list[str]:
    """The abstract sockets to try, in turn, for a connection to ``host:port``: the listener's
    own (bound to that address), then one bound to every address; none when ``host`` is not an
    address of this host's network namespace."""
    if not options.uses_local_sockets or not hosts.is_local(host):
        return []
    host = _canonical(host)
    if host == _WILDCARD_NAME:  # dialing 0.0.0.0 means this host
        return [f"\0pslink/{_WILDCARD_NAME}:{port}", f"\0pslink/127.0.0.1:{port}"]
    return [f"\0pslink/{host}:{port}", f"\0pslink/{_WILDCARD_NAME}:{port}"]


class TcpListener(Listener):
    _accepted = itertools.count(1)

    def __init__(self, address: str, reactor: Reactor, handler: Handler, limits: Limits,
                 options: TransportOptions = TransportOptions()):
        host, port = split_host_port(address)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            sock.close()
            raise PeerError(f"cannot listen on {address}: {exc.strerror or exc}") from None
        sock.listen(1024)
        sock.setblocking(False)
        self.sock = sock
        self.reactor = reactor
        self.handler = handler
        self.limits = limits
        self.options = options
        bound_host, bound_port = sock.getsockname()[:2]
        self.address = f"tcp://{bound_host}:{bound_port}"
        self.local_sock = self._listen_local(local_socket_name(bound_host, bound_port, options))
        self._closed = False
        self.refused_local = 0  # local connections from users it does not share its host with
        self._refusals = Throttled(log)
        # With TLS, TCP peers are taken once their handshake (on a thread of its own) is done.
        self.handshakes = None if options.tls is None else Handshakes(
            options.tls.context(server=True), reactor, self._accepted_tls, self._refuse_plain)
        reactor.post(self._register)

    def _listen_local(self, name: str | None) -> socket.socket | None:
        if name is None:
            return None
        local = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            local.bind(name)  # taken (another listener on this port of another loopback address): TCP only
            local.listen(1024)
        except OSError as exc:
            log.debug("listener %s: no local socket (%s); same-host peers use TCP", self.address, exc)
            local.close()
            return None
        local.setblocking(False)
        return local

    def _register(self) -> None:
        if not self._closed:
            self.reactor.add_reader(self.sock.fileno(), lambda: self._on_accept(self.sock))
            if self.local_sock is not None:
                self.reactor.add_reader(self.local_sock.fileno(), lambda: self._on_accept(self.local_sock))

    def _on_accept(self, listening: socket.socket) -> None:
        # A few per turn: a flood of connections must not keep the loop from the peers it serves
        # (the listener stays readable, so the reactor comes back for the rest).
        for _ in range(ACCEPTS_PER_TURN):
            try:
                conn_sock, addr = listening.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    log.error("listener %s cannot accept: %s", self.address, exc)
                return
            if listening is self.sock:
                peer = f"tcp://{addr[0]}:{addr[1]}"
                if self.handshakes is not None:
                    self.handshakes.start(conn_sock, peer)
                    continue
            else:  # a same-host peer: no address of its own, so a number tells them apart
                uid = peer_uid(conn_sock)
                if not self.options.may_share_host(uid):
                    conn_sock.close()
                    self.refused_local += 1
                    self._refusals.warning(f"uid {uid}", "local", "listener %s refused a local connection from "
                                           "uid %d, a user it does not share its host with; it may connect over "
                                           "TCP", self.address, uid)
                    continue
                peer = f"local://{self.address[len('tcp://'):]}#{next(self._accepted)}"
            conn = TcpConnection(conn_sock, self.reactor, self.handler, self.limits, peer=peer, on_driver_thread=True,
                                 options=self.options)
            self.handler.on_accept(conn)

    def _accepted_tls(self, sock: TlsSocket, peer: str) -> None:
        if self._closed:
            sock.close()
            return
        conn = TcpConnection(sock, self.reactor, self.handler, self.limits, peer=peer, on_driver_thread=True,
                             options=self.options)
        self.handler.on_accept(conn)

    def _refuse_plain(self, sock: socket.socket, first: bytes) -> None:
        """(A handshake thread.) A pslink peer without TLS: an error for its first request."""
        request = 0
        if len(first) >= PREFIX.size:
            _, _, count, length = PREFIX.unpack_from(first)
            start = PREFIX.size + 8 * count
            request = peek_id(first[start:start + length])
        error = ConfigError(f"{self.address} accepts only TLS connections; {SETTINGS_HINT}")
        frame = encode_error(request, error)
        try:
            sock.sendall(PREFIX.pack(MAGIC, FRAMING_VERSION, 0, len(frame)) + frame)
        except OSError:
            pass
        log.warning("listener %s refused a peer without TLS (%s)", self.address, sock.getpeername()[0]
                    if sock.family != socket.AF_UNIX else "local")

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True

        def teardown():
            for sock in (self.sock, self.local_sock):
                if sock is not None:
                    self.reactor.remove_reader(sock.fileno())
                    sock.close()

        self.reactor.post(teardown)


class TcpTransport(Transport):
    schemes = ("tcp",)

    def __init__(self, options: TransportOptions = TransportOptions()):
        self.options = options
        self._context = None  # the TLS client context, made once

    def listen(self, address, reactor, handler, limits=DEFAULT_LIMITS) -> TcpListener:
        return TcpListener(address, reactor, handler, limits, self.options)

    def connect(self, address, reactor, handler, limits=DEFAULT_LIMITS, timeout=10.0) -> TcpConnection:
        host, port = split_host_port(address)
        for name in local_socket_names(host, port, self.options):
            local = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            local.settimeout(timeout)
            try:
                local.connect(name)
                if self.options.may_share_host(peer_uid(local)):
                    return TcpConnection(local, reactor, handler, limits, peer=address, options=self.options)
                local.close()  # another user's listener: it would refuse us, and we it; TCP
                break
            except OSError:
                local.close()  # no local socket there (TCP only, or bound elsewhere): the next, or TCP
        try:
            sock = socket.create_connection((host, port), timeout=timeout)
            if self.options.tls is not None:
                sock = client_handshake(sock, self._client_context(), address, timeout)
        except OSError as exc:
            raise PeerError(
                f"cannot connect to {address}: {exc.strerror or exc}", peer=address
            ) from None
        return TcpConnection(sock, reactor, handler, limits, peer=address, options=self.options)

    def _client_context(self):
        if self._context is None:
            self._context = self.options.tls.context(server=False)
        return self._context
