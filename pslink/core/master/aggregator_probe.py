"""Is an Aggregator's process still serving, though its connection to pMaster closed?

A closed control connection is not a dead Aggregator: the network can reset a connection (or
drop it, as ``PSLINK_FAULTS`` ``ctl_drop`` does) while the process serves on and dials pMaster
again. Failing a live Aggregator over moves its parts onto their replicas for nothing, and
cascading failovers of live Aggregators (each before the last one's replicas were topped up)
lose keys. So before a failover pMaster asks the Aggregator's data port directly, as an Agent
would: a PING answered is a live process; a refused or unanswered one is gone.
"""

from __future__ import annotations

import threading
from typing import Callable

from pslink.core.transport import Transports
from pslink.core.transport.rpc import RpcEndpoint
from pslink.core.wire.loop import Reactor
from pslink.core.wire.protocol import Limits, Op
from pslink.errors import PslinkError


class Prober:
    """``probe(address, timeout, done)``: ``done(None)`` on the reactor once the process at
    ``address`` answered a PING, ``done(why not)`` if it could not be reached or said nothing
    within ``timeout`` seconds."""

    def __init__(self, transports: Transports, reactor: Reactor, limits: Limits):
        self.transports, self.reactor, self.limits = transports, reactor, limits
        self.endpoint = RpcEndpoint(reactor, self._refuse, limits, control_faults=False)

    @staticmethod
    def _refuse(peer, req) -> None:
        peer.conn.close()  # an Aggregator's data port asks pMaster nothing

    def probe(self, address: str, timeout: float, done: Callable[[str | None], None]) -> None:
        def dial() -> None:  # connecting blocks (up to ``timeout``): not on the reactor
            try:
                conn = self.transports.connect(address, self.reactor, self.endpoint, self.limits, timeout=timeout)
            except PslinkError as exc:
                self.reactor.post(done, exc.message)
                return
            self.reactor.post(ping, conn)

        def ping(conn) -> None:
            def answered(result, error) -> None:
                conn.close()  # (a close of its own tells the endpoint nothing: forget the peer here)
                self.endpoint.peers.pop(conn, None)
                done(None if error is None else error.message)

            self.endpoint.peer(conn).call(Op.PING, answered, timeout=timeout)

        threading.Thread(target=dial, name="pmaster-probe", daemon=True).start()
