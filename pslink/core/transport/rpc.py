"""Request/reply over a transport connection, for the control plane (headers only).

pMaster, Aggregators and Agents all talk control messages the same way: every request carries an
``id``; the answer is a REPLY or ERROR with that id; either side may send requests. An
:class:`RpcEndpoint` is the transport handler; it keeps one :class:`RpcPeer` per connection.
"""

from __future__ import annotations

import itertools
import logging
from typing import Any, Callable

from pslink.core import faults
from pslink.core.wire.loop import Reactor
from pslink.core.ratelog import Throttled
from pslink.core.wire.protocol import DEFAULT_LIMITS, Limits, Op, decode, encode, encode_error, peek_id
from pslink.core.transport import DISCARD, Connection
from pslink.errors import PeerError, ProtocolError, PslinkError, PslinkTimeoutError, error_from_code

log = logging.getLogger(__name__)

#: callback(result_header_or_None, error_or_None)
Callback = Callable[[dict | None, PslinkError | None], None]


class RpcPeer:
    """The control conversation with one peer."""

    def __init__(self, conn: Connection, reactor: Reactor, on_request: Callable[["RpcPeer", dict], None],
                 faults=None):
        self.conn = conn
        self.faults = faults  # PSLINK_FAULTS ctl_*: pslink.core.faults.Faults.send_control
        self.reactor = reactor
        self.on_request = on_request
        self.info: dict[str, Any] = {}  # what the owner knows of this peer (role, name, ...)
        self._ids = itertools.count(1)
        self._pending: dict[int, tuple[Callback, Any]] = {}

    @property
    def name(self) -> str:
        return self.info.get("name") or self.conn.peer

    def call(self, op: Op, callback: Callback, timeout: float | None = None, payloads=(), **fields) -> int:
        """Send a request; ``callback`` runs on the reactor thread with the reply or an error."""
        request_id = next(self._ids)
        timer = None
        if timeout is not None:
            timer = self.reactor.call_later(timeout, self._expire, request_id, op, timeout)
        self._pending[request_id] = (callback, timer)
        try:
            self._out([encode(op, id=request_id, **fields), *payloads])
        except PslinkError as exc:
            self._finish(request_id, None, exc)
        return request_id

    def reply(self, request: dict, **fields) -> None:
        self._send([encode(Op.REPLY, id=request["id"], **fields)])

    def error(self, request: dict, exc: BaseException) -> None:
        self._send([encode_error(request.get("id", 0), exc)])

    def notify(self, op: Op, **fields) -> None:
        """A one-way message (no reply expected), such as a heartbeat."""
        self._send([encode(op, id=0, **fields)])

    def _send(self, frames) -> None:
        try:
            self._out(frames)
        except PslinkError:
            pass  # the peer is gone; its on_close will clean up

    def _out(self, frames) -> None:
        if self.faults is None:
            self.conn.send(frames)
        else:
            self.faults.send_control(self.conn, frames)

    def dispatch(self, header: dict) -> None:
        op = header["op"]
        if op == Op.REPLY or op == Op.PONG:  # (a data port answers a PING with a PONG)
            self._finish(header["id"], header, None)
        elif op == Op.ERROR:
            self._finish(header["id"], None, error_from_code(header["code"], header["msg"], header.get("details")))
        else:
            try:
                self.on_request(self, header)
            except PslinkError as exc:
                self.error(header, exc)
            except Exception as exc:
                log.exception("control request %s from %s failed", op.name, self.name)
                self.error(header, exc)

    def _finish(self, request_id: int, header: dict | None, error: PslinkError | None) -> None:
        entry = self._pending.pop(request_id, None)
        if entry is None:
            return  # late answer to a request that timed out
        callback, timer = entry
        if timer is not None:
            timer.cancel()
        callback(header, error)

    def _expire(self, request_id: int, op: Op, timeout: float) -> None:
        self._finish(
            request_id, None,
            PslinkTimeoutError(f"{op.name} to {self.name} got no answer within {timeout} s", peer=self.name),
        )

    def fail_pending(self, error: PslinkError) -> None:
        for request_id in list(self._pending):
            self._finish(request_id, None, error)


class RpcEndpoint:
    """Transport handler for control connections: decodes and validates headers, routes them."""

    def __init__(
        self,
        reactor: Reactor,
        on_request: Callable[[RpcPeer, dict], None],
        limits: Limits = DEFAULT_LIMITS,
        on_accept: Callable[[RpcPeer], None] | None = None,
        on_close: Callable[[RpcPeer, BaseException | None], None] | None = None,
        control_faults: bool = True,
    ):
        """``control_faults``: the process's PSLINK_FAULTS ctl_* act on these connections (the
        control plane's to and from pMaster; not an operator's client, nor Aggregator to
        Aggregator)."""
        self.reactor = reactor
        self.faults = faults.control() if control_faults else None
        self.on_request = on_request
        self.limits = limits
        self._on_accept = on_accept
        self._on_close = on_close
        self.peers: dict[Connection, RpcPeer] = {}
        self.bad_messages = 0
        self._bad_log = Throttled(log)  # bad input: one line per peer host and kind per interval

    def peer(self, conn: Connection) -> RpcPeer:
        peer = self.peers.get(conn)
        if peer is None:
            peer = self.peers[conn] = RpcPeer(conn, self.reactor, self.on_request, self.faults)
        return peer

    # transport Handler
    def on_header(self, conn, header, sizes):
        try:
            decoded = decode(header, sizes, self.limits)
        except ProtocolError as exc:
            exc.request_id = peek_id(header)
            return exc, DISCARD
        return decoded, (DISCARD if sizes else None)

    def on_message(self, conn, state, payloads):
        peer = self.peer(conn)
        if isinstance(state, ProtocolError):
            self.bad_messages += 1
            self._bad_log.warning(peer.conn.peer, "bad", "bad control message from %s: %s", peer.name, state)
            peer.error({"id": getattr(state, "request_id", 0)}, state)
            return
        peer.dispatch(state)

    def on_accept(self, conn):
        peer = self.peer(conn)
        if self._on_accept is not None:
            self._on_accept(peer)

    def on_close(self, conn, exc):
        if isinstance(exc, ProtocolError):  # a stream it could not read: dropped, counted
            self.bad_messages += 1
            self._bad_log.warning(conn.peer, "dropped", "dropped %s: %s", conn.peer, exc)
        peer = self.peers.pop(conn, None)
        if peer is None:
            return
        peer.fail_pending(exc if isinstance(exc, PslinkError) else PeerError(f"{peer.name} went away"))
        if self._on_close is not None:
            self._on_close(peer, exc)
