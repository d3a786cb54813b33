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

**Several pMaster addresses** (a leader and its standby, :mod:`pslink.core.master_addresses`):
the Aggregator registers with the first that accepts a connection, and after losing it (the
connection closed, or a heartbeat unanswered for ``max(lease, 1)`` seconds: a pMaster whose host
was cut off closes nothing) with the next, round and round; ``orphan_timeout`` counts from losing
the last pMaster it had, whichever address answers next. Connecting happens off the loop: an
address whose host is gone holds a connect for its whole timeout, while data goes on being served.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from pslink.core.master_addresses import MasterAddresses
from pslink.core.transport import Connection, Transports
from pslink.core.transport.rpc import RpcEndpoint, RpcPeer
from pslink.core.wire.loop import Reactor
from pslink.core.wire.protocol import Limits, Op
from pslink.errors import (
    AuthError,
    ConfigError,
    FencedError,
    PeerError,
    PslinkError,
    PslinkTimeoutError,
)

log = logging.getLogger("pslink.core.aggregator.process")

DEFAULT_LEASE = 5.0  # seconds an answered heartbeat lets the Aggregator serve without pMaster
CONNECT_TIMEOUT = 2.0  # seconds a connection to one pMaster address may take


class MasterLink:
    """The Aggregator's side of pMaster at ``address`` (one, or a comma list: whichever answers;
    empty: no pMaster, never started). ``registration()`` gives the fields of a
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
        self.addresses = MasterAddresses.parse(address, "--master") if address else None
        self.address = str(self.addresses) if address else address  # every address given, for messages
        self.connected_to: str | None = None  # the address of the pMaster connected last
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
        self._connecting = False  # a connection is being made, off the loop
        self._closed = False
        self._close_lock = threading.Lock()  # a connection made off the loop either lands or is closed

    def start(self) -> None:
        self.reactor.post(self._connect)
        self.reactor.call_later(self.heartbeat_interval, self._heartbeat)

    def notify(self, op: Op, **fields) -> None:
        """A one-way message to pMaster (dropped while pMaster is away)."""
        if self.peer is not None:
            self.peer.notify(op, **fields)

    def close(self) -> None:
        with self._close_lock:
            self._closed = True
        if self.peer is not None:
            self.peer.conn.close()

    def _connect(self) -> None:
        if self.peer is not None or self.reactor.stopping or self._connecting:
            return
        self._connecting = True
        threading.Thread(target=self._dial, name="aggregator-to-pmaster", daemon=True).start()

    def _dial(self) -> None:
        """Off the loop: a connection to the first pMaster address that accepts, handed to the loop."""
        try:
            conn, address = self.addresses.connect(self.transports, self.reactor, self.endpoint, self.limits,
                                                   CONNECT_TIMEOUT)
        except Exception as exc:  # whatever it was, the loop hears of it: a dial never wedges reconnecting
            if not isinstance(exc, PslinkError):
                log.exception("aggregator %s: connecting to pMaster failed", self.name() or "")
                exc = PeerError(f"connecting to pMaster at {self.address} failed: {exc!r}", peer=self.address)
            with self._close_lock:
                if not self._closed:
                    self.reactor.post(self._dialed, None, None, exc)
            return
        with self._close_lock:
            if self._closed:
                conn.close()
            else:
                self.reactor.post(self._dialed, conn, address, None)

    def _dialed(self, conn: Connection | None, address: str | None, error: PslinkError | None) -> None:
        self._connecting = False
        if isinstance(error, ConfigError):
            # An address no transport serves (an unknown scheme): asking again would fail again.
            self._give_up(f"cannot reach pMaster at {self.address}", error)
            return
        if error is not None:
            self._down(error)
            return
        if self.reactor.stopping or self.peer is not None:
            conn.close()
            return
        peer = self.endpoint.peer(conn)
        peer.info.update(name="pMaster", address=address)
        if self.connected_to is not None and address != self.connected_to:
            log.warning("aggregator %s: pMaster now %s (was %s)", self.name() or "", address, self.connected_to)
        self.connected_to = address
        self.peer = peer
        sent = self.clock()
        peer.call(Op.REGISTER_AGGREGATOR, lambda result, error: self._registered(result, error, sent), timeout=10.0,
                  lease=self.lease, **self.registration())

    def _give_up(self, why: str, error: PslinkError) -> None:
        """Asking again would fail again: say why and stop (status 2)."""
        log.error("aggregator %s: %s: %s", self.name() or "", why, error.message)
        self.refusal = error
        self.registered.set()
        self.stop(2)

    def _registered(self, result: dict | None, error: PslinkError | None, sent: float) -> None:
        if isinstance(error, (ConfigError, AuthError)):
            # pMaster refused what this Aggregator is (an address nobody can dial, a name a live
            # one has, no valid credential): retrying would be refused again. Say why and stop.
            self._give_up(f"pMaster at {self.address} refused it", error)
            return
        if error is not None:
            log.warning("aggregator %s: registration with pMaster failed: %s", self.name(), error)
            if self.peer is not None:
                self.addresses.lost(self.peer.info["address"])  # silent, say: the next address is tried first
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
        if "address" in peer.info:
            self.addresses.lost(peer.info["address"])
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
        peer = self.peer

        def answered(result, error):
            self._renewing = False
            if error is None:
                self.lease_until = max(self.lease_until, sent + self.lease)
            elif isinstance(error, PslinkTimeoutError) and self.addresses.several and peer is self.peer:
                self._leave_silent(peer, error)

        self._renewing = True
        peer.call(Op.AGG_HEARTBEAT, answered, timeout=max(self.lease, 1.0), agg=self.name(), stats=self.stats())

    def _leave_silent(self, peer: RpcPeer, error: PslinkError) -> None:
        """A pMaster that left a heartbeat unanswered, with other addresses to try: close its
        connection as if it had closed it (on the loop), so that the next address is tried. One
        address keeps its connection: there is nowhere else to go, and a partition heals on it."""
        log.warning("aggregator %s: pMaster at %s is silent (%s); trying the next address", self.name(),
                    peer.info.get("address"), error.message)
        peer.conn.close()  # a local close tells no handler
        self.endpoint.on_close(peer.conn, PeerError(f"pMaster at {peer.info.get('address')} went silent: "
                                                    f"{error.message}", peer=peer.info.get("address")))

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
