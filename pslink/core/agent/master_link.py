"""An Agent's link to pMaster: control calls, registration, heartbeats with iteration times, and
registering again after pMaster comes back.

The data path never waits for pMaster: while it is away the Agent trains on the mapping it has
and reconnects on every heartbeat until pMaster answers again (with the job's token, so a
restarted pMaster recognizes the worker).

Given several pMaster addresses (a leader and its standby, :mod:`pslink.core.master_addresses`),
the Agent connects to the first that accepts, and after losing it to the next one. A pMaster
cut off from the network closes nothing, so with several addresses each heartbeat asks for an
answer: a pMaster that answered none of the last few (:attr:`MasterLink.silence`) is left for
the next address.
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
import time
from collections.abc import Callable

from pslink.core import hosts
from pslink.core.agent.handle import Handles
from pslink.core.agent.seat import Seat
from pslink.core.master_addresses import MasterAddresses
from pslink.core.transport import Transports
from pslink.core.transport.rpc import RpcEndpoint, RpcPeer
from pslink.core.wire.loop import Reactor
from pslink.core.wire.protocol import Limits, Op
from pslink.errors import (
    MembershipError,
    PeerError,
    ProtocolError,
    PslinkError,
    PslinkTimeoutError,
)

log = logging.getLogger("pslink.core.agent")

# A pMaster is left as silent once this many heartbeats in a row went unanswered, and at least
# SILENT_SECONDS passed since its last answer. pMaster answers a heartbeat on its loop, between
# other work: under load (a burst of registrations, a big placement, a slow store) an answer can
# take a second or two, and a live pMaster dropped for that would be a pointless switch. The
# count keeps a stall of the Agent's own loop (one late heartbeat) from looking like silence.
SILENT_HEARTBEATS = 3
SILENT_SECONDS = 5.0


class MasterLink:
    """Requests to pMaster at ``address`` (one, or a comma list: whichever answers) for the worker
    in ``seat``. ``take_iterations()`` gives the iteration times measured since the last heartbeat
    and the worker's own work in each; ``on_back(body)`` hears pMaster's answer when the worker
    registered again after losing it; ``closed()`` says the Agent closed."""

    def __init__(self, seat: Seat, address: str, transports: Transports, reactor: Reactor, limits: Limits,
                 handles: Handles, *, connect_timeout: float, timeout: float, heartbeat_interval: float,
                 take_iterations: Callable[[], tuple], on_back: Callable[[dict], None], closed: Callable[[], bool]):
        self.seat = seat
        # This Agent, among its process's: a registration it asks again (its answer lost) is its own.
        self.incarnation = secrets.token_hex(8)
        self.addresses = MasterAddresses.parse(address)
        self.address = str(self.addresses)  # every address given, for messages
        self.transports, self.reactor, self.limits, self.handles = transports, reactor, limits, handles
        self.connect_timeout = connect_timeout
        self.timeout = timeout
        self.heartbeat_interval = heartbeat_interval
        # How long a pMaster may leave heartbeats unanswered before the next address is tried
        # (only with several: one address has nowhere else to go, and its connection stays).
        self.silence = max(SILENT_HEARTBEATS * heartbeat_interval, SILENT_SECONDS)
        self.take_iterations = take_iterations
        self.on_back = on_back
        self.closed = closed
        self.endpoint = RpcEndpoint(reactor, self._refuse, limits, on_close=self._lost)
        self.peer: RpcPeer | None = None
        self._lock = threading.Lock()
        self._reconnecting = False
        self._barriers_passed: dict[str, int] = {}  # barrier name -> the releases this Agent got
        self.connected_to: str | None = None  # the address of the pMaster connected last
        self._heard_at = 0.0  # when pMaster last answered a heartbeat (or was connected to)
        self._unanswered = 0  # heartbeats sent since its last answer

    def start_heartbeats(self) -> None:
        self.reactor.call_later(self.heartbeat_interval, self._heartbeat)

    def connected(self) -> RpcPeer:
        """The connection to pMaster, made if there is none: to the first of its addresses that
        accepts one (raises PeerError naming the addresses)."""
        peer = self.peer
        if peer is not None and not peer.conn.closed:
            return peer
        with self._lock:
            if self.peer is None or self.peer.conn.closed:
                try:
                    conn, address = self.addresses.connect(self.transports, self.reactor, self.endpoint, self.limits,
                                                           self.connect_timeout)
                except PeerError as exc:
                    if self.addresses.several:  # the message names each address and why
                        raise PeerError(f"pMaster is unreachable (is `pslink service up` running at one of its "
                                        f"addresses?): {exc.message}", peer=self.address) from None
                    raise PeerError(f"pMaster at {self.address} is unreachable (is `pslink service up` "
                                    f"running there?): {exc.message}", peer=self.address) from None
                peer = self.endpoint.peer(conn)
                peer.info.update(name=f"pMaster at {address}", address=address)
                self._heard_at, self._unanswered = time.monotonic(), 0
                if self.connected_to is not None and address != self.connected_to:
                    log.warning("agent %s: pMaster now %s (was %s)", self.seat, address, self.connected_to)
                self.connected_to = address
                self.peer = peer
            return self.peer

    def call(self, op: Op, timeout: float | None = None, **fields) -> dict:
        """A synchronous control request to pMaster (the job's fields added); returns the body."""
        handle = self.handles.new(op.name.lower(), [], None, 1)
        timeout = self.timeout if timeout is None else timeout

        def answered(result, error):
            if result is not None:
                handle._result = result.get("body", {})
            self.handles.complete(handle, error)

        if op != Op.REGISTER_WORKER:
            fields = dict(self.seat.fields(), **fields)
        self.connected().call(op, answered, timeout=timeout, **fields)
        return handle.wait(timeout + 1.0)

    def call_again_if_cut(self, op: Op, timeout: float | None = None, **fields) -> dict:
        """A request pMaster may see twice to no harm (LOOKUP: a key declared again is the same
        key; JOB_KEYS, a read; BARRIER, which says how often this worker passed it), asked again
        on a new connection when the connection is lost under it (its answer too, maybe: found
        by the chaos run with control faults) or pMaster is down (restarting, or another of its
        addresses taking over), within ``timeout`` (the job's by default)."""
        timeout = self.timeout if timeout is None else timeout
        return self._ask_while(lambda exc: isinstance(exc, PeerError), time.monotonic() + timeout, op,
                               timeout=timeout, **fields)

    def barrier(self, name: str, timeout: float | None) -> dict:
        """BARRIER ``name``, saying how often this Agent passed it: asked again after a cut, its
        release lost with the connection is the answer (not a new entry at a barrier the others
        have left)."""
        passed = self._barriers_passed.get(name, 0)
        body = self.call_again_if_cut(Op.BARRIER, timeout=timeout, name=name, n=passed)
        self._barriers_passed[name] = passed + 1
        return body

    def _ask_while(self, again: Callable[[PslinkError], bool], deadline: float, op: Op,
                   before: Callable[[], object] = lambda: None, **fields) -> dict:
        """``op``, asked again (50 ms apart, doubling to 1 s) while it fails with an error that
        ``again`` accepts, until ``deadline``; ``before`` each try (an error there ends it)."""
        pause = 0.05
        while True:
            before()
            try:
                return self.call(op, **fields)
            except PslinkError as exc:
                if not again(exc) or time.monotonic() + pause > deadline:
                    raise
                log.info("agent %s: %s: %s; asking again in %.2f s", self.seat, op.name, exc.message, pause)
                time.sleep(pause)  # a backoff between attempts, not what correctness rests on
                pause = min(2 * pause, 1.0)

    def _identity(self) -> dict:
        seat = self.seat
        return {"job": seat.job, "rank": seat.rank, "num_workers": seat.num_workers, "pid": os.getpid(),
                "host": hosts.host_name(), "host_id": seat.host_id, "agent": self.incarnation}

    def register(self, config: dict, token: bytes | None, rejoin: bool = False) -> dict:
        """Register the worker. A rank pMaster still sees connected is asked for again, for up
        to ``connect_timeout``: a replacement for a worker that just died may come before
        pMaster noticed the old connection close (then the old one is gone within a heartbeat or
        two); a rank truly in use is refused after that, with pMaster's reason."""
        fields = dict(self._identity(), config=config)
        if token:
            fields["tok"] = token
        if rejoin:
            fields["rejoin"] = True  # out of the job and back in as a newcomer, in one step
        # A connection lost under the request (its answer too, maybe) is asked again on a new
        # one: pMaster lets the same Agent register again until it used the token. pMaster
        # unreachable is said at once (``before``), not asked again.
        again = (lambda exc: isinstance(exc, PeerError)
                 or isinstance(exc, MembershipError) and exc.details.get("reason") == "connected"
                 or self._left_silent(exc))
        # With several addresses, a silent one (its registration unanswered) costs a try each.
        deadline = time.monotonic() + self.connect_timeout * len(self.addresses)
        return self._ask_while(again, deadline, Op.REGISTER_WORKER, before=self.connected,
                               timeout=self.connect_timeout, **fields)

    def _left_silent(self, exc: PslinkError) -> bool:
        """With several addresses, a request pMaster left unanswered: leave that pMaster for the
        next address (True: ask again there). One address keeps its connection, as ever."""
        peer = self.peer
        if not self.addresses.several or not isinstance(exc, PslinkTimeoutError) or peer is None:
            return False
        self._drop(peer, f"{exc.message}: trying the next pMaster address")
        return True

    def _drop(self, peer: RpcPeer, why: str) -> None:
        """Close the connection to a silent pMaster, as if it had closed it (any thread): its
        pending requests fail with PeerError (asked again where they may be) and the next
        connection starts at the next address."""
        self.addresses.lost(peer.info.get("address", ""))
        peer.conn.close()  # a local close tells no handler: on_close is called here
        self.reactor.post(self.endpoint.on_close, peer.conn, PeerError(why, peer=peer.info.get("address")))

    @staticmethod
    def _refuse(peer: RpcPeer, req: dict) -> None:
        raise ProtocolError(f"an Agent serves no {req['op'].name} requests")

    def _lost(self, peer: RpcPeer, exc) -> None:
        self.addresses.lost(peer.info.get("address", ""))
        if peer is self.peer:
            self.peer = None
            if not self.closed():
                log.warning("agent %s: lost pMaster at %s (%s); training continues, reconnecting", self.seat,
                            peer.info.get("address", self.address), exc)

    def _heartbeat(self) -> None:
        if self.closed():
            return
        try:
            peer = self.peer
            if peer is not None and not peer.conn.closed:
                if self._silent():
                    self._drop(peer, f"pMaster at {peer.info['address']} answered none of the last {self._unanswered} "
                               f"heartbeats ({time.monotonic() - self._heard_at:.1f} s); trying the next address")
                    return
                iterations, work = self.take_iterations()
                extra = {"work": [round(w, 6) for w in work]} if work else {}
                fields = dict(self.seat.fields(), iters=[round(d, 6) for d in iterations], **extra)
                if self.addresses.several:
                    self._unanswered += 1
                    peer.call(Op.HEARTBEAT, lambda result, error: self._answered(peer, error), timeout=self.silence,
                              **fields)
                else:
                    peer.notify(Op.HEARTBEAT, **fields)
            elif not self._reconnecting:
                self._reconnecting = True
                threading.Thread(target=self._reconnect, daemon=True).start()
        finally:
            self.reactor.call_later(self.heartbeat_interval, self._heartbeat)

    def lease_ran_out(self, aggregator: str) -> None:
        """``aggregator`` has not heard from pMaster for its lease. With several addresses, a
        pMaster that left this Agent's heartbeats unanswered too is silent (its host cut off):
        leave it now, not at the heartbeat bound, so the data path tells the Aggregator that
        pMaster is down (it serves on) instead of asking the silent one where the parts went."""
        peer = self.peer
        if (peer is None or peer.conn.closed or not self.addresses.several or not self._unanswered
                or time.monotonic() - self._heard_at < 1.5 * self.heartbeat_interval):
            return
        self._drop(peer, f"pMaster at {peer.info['address']} answered no heartbeat for "
                   f"{time.monotonic() - self._heard_at:.1f} s and aggregator {aggregator}'s lease ran out; "
                   "trying the next address")

    def _silent(self) -> bool:
        return (self.addresses.several and self._unanswered >= SILENT_HEARTBEATS
                and time.monotonic() - self._heard_at >= self.silence)

    def _answered(self, peer: RpcPeer, error: PslinkError | None) -> None:
        # Any answer, an error too, says pMaster is there; a lost connection is _lost's.
        if peer is self.peer and not isinstance(error, (PslinkTimeoutError, PeerError)):
            self._heard_at, self._unanswered = time.monotonic(), 0

    def _reconnect(self) -> None:
        """Off the driving thread (connecting may block): register again with the job's token."""
        try:
            peer = self.connected()

            def registered(result, error):
                if error is not None:
                    log.warning("agent %s: re-registering with pMaster failed: %s", self.seat, error)
                    self._left_silent(error)  # the next heartbeat tries the next address
                    return
                self.on_back(result.get("body") or {})

            peer.call(Op.REGISTER_WORKER, registered, timeout=self.connect_timeout,
                      **self._identity(), tok=self.seat.token)
        except PslinkError:
            pass
        finally:
            self._reconnecting = False

    def close(self) -> None:
        if self.peer is not None:
            self.peer.conn.close()
