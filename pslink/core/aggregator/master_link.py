"""An Aggregator's link to pMaster: it registers (and again after losing pMaster), sends a
heartbeat with its load and figures every ``heartbeat_interval``, and hands pMaster's requests
to the process shell.

While pMaster is away the Aggregator keeps serving the jobs it has and reconnects every
``reconnect_interval``; after ``orphan_timeout`` with no pMaster it exits (status 3), since nobody
would ever manage it again. A registration pMaster refuses (an address nobody can dial) stops it
at once (status 2): a retry would be refused again.

**The lease** (fencing). pMaster fails over an Aggregator it no longer hears from, and an
Aggregator cut off from pMaster (a partition, a frozen process) must not go on serving workers
that still reach it once its parts are served elsewhere. Each heartbeat pMaster answers renews
a lease of ``lease`` seconds counted from when the heartbeat was sent; pMaster fails an
Aggregator over early (an Agent asked where its parts went) only once the last heartbeat it
heard is a lease old. Past its lease, the Aggregator refuses data requests (``FencedError``: the
Agent asks pMaster where the part is) and heartbeats at once to renew it. pMaster itself may be
down: an Agent that cannot reach pMaster either says so (a PING with ``pmd``), and the
Aggregator serves on for another lease: nobody can fail it over then.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

from pslink.core.transport import Transports
from pslink.core.transport.rpc import RpcEndpoint, RpcPeer
from pslink.core.wire.loop import Reactor
from pslink.core.wire.protocol import Limits, Op
from pslink.errors import AuthError, ConfigError, FencedError, PeerError, PslinkError

log = logging.getLogger("pslink.core.aggregator.process")

DEFAULT_LEASE = 5.0  # seconds an answered heartbeat lets the Aggregator serve without pMaster


class MasterLink:
    """The Aggregator's side of pMaster at ``address``. ``registration()`` gives the fields of a
    REGISTER_AGGREGATOR; ``on_request(peer, request)`` serves pMaster's requests; ``stats()``
    gives a heartbeat's figures; ``on_named(name)`` hears the name pMaster gave;
    ``stop(status)`` ends the Aggregator; ``stopping()`` says it is ending (pMaster asked);
    ``on_fenced(parts)`` drops parts pMaster placed elsewhere while this one was away."""

    def __init__(self, address: str, transports: Transports, reactor: Reactor, limits: Limits, *,
                 registration: Callable[[], dict], on_request: Callable[[RpcPeer, dict], None],
                 stats: Callable[[], dict], on_named: Callable[[str], None], stop: Callable[[int], None],
                 stopping: Callable[[], bool], name: Callable[[], str | None], clock: Callable[[], float],
                 on_fenced: Callable[[list], set],
                 heartbeat_interval: float, reconnect_interval: float, orphan_timeout: float | None,
                 lease: float = DEFAULT_LEASE):
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
        self.lease = lease
        self.on_fenced = on_fenced
        self.fenced_parts: set = set()  # dropped at a registration: refused, not unknown
        self.refused = 0  # data requests refused past the lease or for a dropped part
        self.lease_until = float("inf")  # no pMaster answered yet: nothing to be fenced from
        self._renewing = False  # a heartbeat pMaster has not answered yet is out

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
        sent = self.clock()
        peer.call(Op.REGISTER_AGGREGATOR, lambda result, error: self._registered(result, error, sent), timeout=10.0,
                  lease=self.lease, **self.registration())

    def _registered(self, result: dict | None, error: PslinkError | None, sent: float) -> None:
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
        self.fenced_parts |= self.on_fenced(result["body"].get("fenced") or [])
        self.lease_until = sent + self.lease
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
            # The first time at once: a connection the network reset while pMaster lives
            # comes back within pMaster's grace period, before anything is failed over.
            self.reactor.post(self._connect)
            return
        if self.orphan_timeout is not None and now - self._lost_at > self.orphan_timeout:
            # Nobody will ever manage this process again: leave instead of lingering forever.
            log.error("aggregator %s: pMaster gone for %.0f s; exiting", self.name(), self.orphan_timeout)
            self.stop(3)
            return
        self.reactor.call_later(self.reconnect_interval, self._connect)

    def _heartbeat(self) -> None:
        try:
            self.renew()
        finally:
            self.reactor.call_later(self.heartbeat_interval, self._heartbeat)

    def renew(self) -> None:
        """Heartbeat now (with the figures); pMaster's answer renews the lease."""
        # Not before pMaster named it (a joining Aggregator has no name until then).
        if self.peer is None or self._lost_at is not None or self.name() is None or self._renewing:
            return
        sent = self.clock()

        def answered(result, error):
            self._renewing = False
            if error is None:
                self.lease_until = max(self.lease_until, sent + self.lease)

        self._renewing = True
        self.peer.call(Op.AGG_HEARTBEAT, answered, timeout=max(self.lease, 1.0), agg=self.name(), stats=self.stats())

    def fenced(self, now: float, header: dict) -> FencedError | None:
        """Past the lease (or a part dropped at registration): the error a data request gets (and
        a heartbeat goes to renew the lease)."""
        if self.fenced_parts and (header["job"], header["key"], header["part"]) in self.fenced_parts:
            self.refused += 1
            return FencedError(f"aggregator {self.name()} was failed over while away; key {header['key']!r} part "
                               f"{header['part']} is served elsewhere now: ask pMaster", agg=self.name())
        if now <= self.lease_until:
            return None
        self.refused += 1
        self.renew()
        return FencedError(f"aggregator {self.name()} has not heard from pMaster for {now - self.lease_until + self.lease:.1f} s "
                           "(its lease ran out): its parts may be served elsewhere now; ask pMaster", agg=self.name(),
                           lease=True)

    def master_down(self, now: float) -> None:
        """An Agent cannot reach pMaster either: pMaster is down, nobody fails this one over."""
        self.lease_until = max(self.lease_until, now + self.lease)
