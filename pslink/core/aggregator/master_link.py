"""An Aggregator's link to pMaster: it registers (and again after losing pMaster), sends a
heartbeat with its load and figures every ``heartbeat_interval``, and hands pMaster's requests
to the process shell.

While pMaster is away the Aggregator keeps serving the jobs it has and reconnects every
``reconnect_interval``; after ``orphan_timeout`` with no pMaster it exits (status 3), since nobody
would ever manage it again. A registration pMaster refuses (an address nobody can dial) stops it
at once (status 2): a retry would be refused again.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

from pslink.core.transport import Transports
from pslink.core.transport.rpc import RpcEndpoint, RpcPeer
from pslink.core.wire.loop import Reactor
from pslink.core.wire.protocol import Limits, Op
from pslink.errors import AuthError, ConfigError, PeerError, PslinkError

log = logging.getLogger("pslink.core.aggregator.process")


class MasterLink:
    """The Aggregator's side of pMaster at ``address``. ``registration()`` gives the fields of a
    REGISTER_AGGREGATOR; ``on_request(peer, request)`` serves pMaster's requests; ``stats()``
    gives a heartbeat's figures; ``on_named(name)`` hears the name pMaster gave;
    ``stop(status)`` ends the Aggregator; ``stopping()`` says it is ending (pMaster asked)."""

    def __init__(self, address: str, transports: Transports, reactor: Reactor, limits: Limits, *,
                 registration: Callable[[], dict], on_request: Callable[[RpcPeer, dict], None],
                 stats: Callable[[], dict], on_named: Callable[[str], None], stop: Callable[[int], None],
                 stopping: Callable[[], bool], name: Callable[[], str | None], clock: Callable[[], float],
                 heartbeat_interval: float, reconnect_interval: float, orphan_timeout: float | None):
        self.address = address
        self.transports, self.reactor, self.limits = transports, reactor, limits
        self.registration, self.stats, self.on_named = registration, stats, on_named
        self.stop, self.stopping, self.name, self.clock = stop, stopping, name, clock
        self.heartbeat_interval = heartbeat_interval
        self.reconnect_interval = reconnect_interval
        self.orphan_timeout = orphan_timeout
        self.endpoint = RpcEndpoint(reactor, on_request, limits, on_close=self._lost)
        self.peer: RpcPeer | None = None
        self._lost_at: float | None = None
        self.registered = threading.Event()  # set once pMaster answered a registration (either way)
        self.refusal: ConfigError | None = None  # pMaster refused this Aggregator (it then stops)
        self.error: PslinkError | None = None  # why pMaster was last unreachable

    def start(self) -> None:
        self.reactor.post(self._connect)
        self.reactor.call_later(self.heartbeat_interval, self._heartbeat)

    def notify(self, op: Op, **fields) -> None:
        """A one-way message to pMaster (dropped while pMaster is away)."""
        if self.peer is not None:
            self.peer.notify(op, **fields)

    def close(self) -> None:
        if self.peer is not None:
            self.peer.conn.close()

    def _connect(self) -> None:
        if self.peer is not None or self.reactor.stopping:
            return
        try:
            conn = self.transports.connect(self.address, self.reactor, self.endpoint, self.limits, timeout=2.0)
        except PeerError as exc:
            self._down(exc)
            return
        peer = self.endpoint.peer(conn)
        peer.info["name"] = "pMaster"
        self.peer = peer
        peer.call(Op.REGISTER_AGGREGATOR, self._registered, timeout=10.0, **self.registration())

    def _registered(self, result: dict | None, error: PslinkError | None) -> None:
        if isinstance(error, (ConfigError, AuthError)):
            # pMaster refused what this Aggregator is (an address nobody can dial, a name a live
            # one has, no valid credential): retrying would be refused again. Say why and stop.
            log.error("aggregator %s: pMaster at %s refused it: %s", self.name() or "", self.address, error.message)
            self.refusal = error
            self.registered.set()
            self.stop(2)
            return
        if error is not None:
            log.warning("aggregator %s: registration with pMaster failed: %s", self.name(), error)
            if self.peer is not None:
                self.peer.conn.close()
                self.peer = None
            self._down(error)
            return
        self.on_named(result["body"]["agg"])
        self._lost_at = None
        self.error = None
        self.registered.set()

    def _lost(self, peer: RpcPeer, exc) -> None:
        if self.stopping():
            return  # shutting down on pMaster's request: its going away is expected
        if peer is self.peer:
            self.peer = None
            self._down(exc)

    def _down(self, exc) -> None:
        self.error = exc
        now = self.clock()
        if self._lost_at is None:
            self._lost_at = now
            log.warning("aggregator %s: pMaster at %s unreachable (%s); retrying", self.name(), self.address, exc)
        if self.orphan_timeout is not None and now - self._lost_at > self.orphan_timeout:
            # Nobody will ever manage this process again: leave instead of lingering forever.
            log.error("aggregator %s: pMaster gone for %.0f s; exiting", self.name(), self.orphan_timeout)
            self.stop(3)
            return
        self.reactor.call_later(self.reconnect_interval, self._connect)

    def _heartbeat(self) -> None:
        try:
            # Not before pMaster named it (a joining Aggregator has no name until then).
            if self.peer is not None and self._lost_at is None and self.name() is not None:
                self.peer.notify(Op.AGG_HEARTBEAT, agg=self.name(), stats=self.stats())
        finally:
            self.reactor.call_later(self.heartbeat_interval, self._heartbeat)
