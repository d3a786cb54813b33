"""An Agent's link to pMaster: control calls, registration, heartbeats with iteration times, and
registering again after pMaster comes back.

The data path never waits for pMaster: while it is away the Agent trains on the mapping it has
and reconnects on every heartbeat until pMaster answers again (with the job's token, so a
restarted pMaster recognizes the worker).
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
import time
from typing import Callable

from pslink.core import hosts
from pslink.core.agent.handle import Handles
from pslink.core.agent.seat import Seat
from pslink.core.transport import Transports
from pslink.core.transport.rpc import RpcEndpoint, RpcPeer
from pslink.core.wire.loop import Reactor
from pslink.core.wire.protocol import Limits, Op
from pslink.errors import MembershipError, PeerError, ProtocolError, PslinkError

log = logging.getLogger("pslink.core.agent")


class MasterLink:
    """Requests to pMaster at ``address`` for the worker in ``seat``. ``take_iterations()`` gives
    the iteration times measured since the last heartbeat and the worker's own work in each; ``on_back(body)`` hears pMaster's
    answer when the worker registered again after losing it; ``closed()`` says the Agent closed."""

    def __init__(self, seat: Seat, address: str, transports: Transports, reactor: Reactor, limits: Limits,
                 handles: Handles, *, connect_timeout: float, timeout: float, heartbeat_interval: float,
                 take_iterations: Callable[[], tuple], on_back: Callable[[dict], None], closed: Callable[[], bool]):
        self.seat = seat
        # This Agent, among its process's: a registration it asks again (its answer lost) is its own.
        self.incarnation = secrets.token_hex(8)
        self.address = address
        self.transports, self.reactor, self.limits, self.handles = transports, reactor, limits, handles
        self.connect_timeout = connect_timeout
        self.timeout = timeout
        self.heartbeat_interval = heartbeat_interval
        self.take_iterations = take_iterations
        self.on_back = on_back
        self.closed = closed
        self.endpoint = RpcEndpoint(reactor, self._refuse, limits, on_close=self._lost)
        self.peer: RpcPeer | None = None
        self._lock = threading.Lock()
        self._reconnecting = False
        self._barriers_passed: dict[str, int] = {}  # barrier name -> the releases this Agent got

    def start_heartbeats(self) -> None:
        self.reactor.call_later(self.heartbeat_interval, self._heartbeat)

    def connected(self) -> RpcPeer:
        """The connection to pMaster, made if there is none (raises PeerError naming the address)."""
        peer = self.peer
        if peer is not None and not peer.conn.closed:
            return peer
        with self._lock:
            if self.peer is None or self.peer.conn.closed:
                try:
                    conn = self.transports.connect(self.address, self.reactor, self.endpoint, self.limits,
                                                   self.connect_timeout)
                except PeerError as exc:
                    raise PeerError(f"pMaster at {self.address} is unreachable (is `pslink service up` "
                                    f"running there?): {exc.message}", peer=self.address) from None
                self.peer = self.endpoint.peer(conn)
                self.peer.info["name"] = f"pMaster at {self.address}"
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
        by the chaos run with control faults) or pMaster is down (restarting), within
        ``timeout`` (the job's by default)."""
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
        return dict(job=seat.job, rank=seat.rank, num_workers=seat.num_workers, pid=os.getpid(),
                    host=hosts.host_name(), host_id=seat.host_id, agent=self.incarnation)

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
                 or isinstance(exc, MembershipError) and exc.details.get("reason") == "connected")
        return self._ask_while(again, time.monotonic() + self.connect_timeout, Op.REGISTER_WORKER,
                               before=self.connected, timeout=self.connect_timeout, **fields)

    @staticmethod
    def _refuse(peer: RpcPeer, req: dict) -> None:
        raise ProtocolError(f"an Agent serves no {req['op'].name} requests")

    def _lost(self, peer: RpcPeer, exc) -> None:
        if peer is self.peer:
            self.peer = None
            if not self.closed():
                log.warning("agent %s: lost pMaster at %s (%s); training continues, reconnecting", self.seat,
                            self.address, exc)

    def _heartbeat(self) -> None:
        if self.closed():
            return
        try:
            peer = self.peer
            if peer is not None and not peer.conn.closed:
                iterations, work = self.take_iterations()
                extra = {"work": [round(w, 6) for w in work]} if work else {}
                peer.notify(Op.HEARTBEAT, **self.seat.fields(), iters=[round(d, 6) for d in iterations], **extra)
            elif not self._reconnecting:
                self._reconnecting = True
                threading.Thread(target=self._reconnect, daemon=True).start()
        finally:
            self.reactor.call_later(self.heartbeat_interval, self._heartbeat)

    def _reconnect(self) -> None:
        """Off the driving thread (connecting may block): register again with the job's token."""
        try:
            peer = self.connected()

            def registered(result, error):
                if error is not None:
                    log.warning("agent %s: re-registering with pMaster failed: %s", self.seat, error)
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
