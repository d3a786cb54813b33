"""pMaster's door: which requests need which credential (:mod:`pslink.core.credentials`).

- REGISTER_AGGREGATOR: the Aggregator credential (or the operator's);
- POOL (add, remove): the operator credential;
- REGISTER_JOB: the operator credential, or (re-creating a job that exists) the job's token, which
  the state checks;
- STATUS: nothing from pMaster's own host; the operator credential from elsewhere;
- a worker's first registration without a token (trust on first use): from pMaster's own host
  only, unless the service allows first joins from anywhere;
- every other request of a job: its token (the state checks it); the Aggregators' reports
  (TENSOR_COPY_DONE, WORKER_DONE, AGG_HEARTBEAT): a connection that registered as that Aggregator.

Without credentials (an open service) every request passes, as the operator's. Refusals are
counted, and logged at most once per interval (a flood writes a few lines, not one each).
"""

from __future__ import annotations

import logging
import time

from pslink.core.credentials import AGGREGATOR, OPERATOR, ServiceCredentials
from pslink.core.hosts import is_loopback
from pslink.core.ratelog import Throttled
from pslink.core.transport.rpc import RpcPeer
from pslink.core.wire.protocol import Op

log = logging.getLogger("pslink.core.master")


def from_this_host(peer: RpcPeer) -> bool:
    """Whether the peer's connection comes from pMaster's host: a local socket (whose user the
    transport checked) or a loopback address."""
    address = peer.conn.peer
    if address.startswith(("local://", "inproc://")):
        return True
    if address.startswith(("tcp://", "zmq+tcp://")):
        host = address.split("://", 1)[1].rsplit(":", 1)[0].strip("[]")
        return is_loopback(host)
    return False


class Gate:
    def __init__(self, credentials: ServiceCredentials | None, clock=time.monotonic):
        self.credentials = credentials
        self.refused = 0
        self._log = Throttled(log, clock=clock)

    @property
    def open(self) -> bool:
        return self.credentials is None

    def check(self, peer: RpcPeer, req: dict) -> None:
        """Raise :class:`~pslink.errors.AuthError` if ``req`` needs a credential it lacks."""
        if self.credentials is None:
            return
        op = req["op"]
        try:
            if op == Op.REGISTER_AGGREGATOR:
                self.credentials.require(req.get("cred"), AGGREGATOR, f"registering an aggregator from {peer.conn.peer}")
            elif op == Op.POOL:
                self.credentials.require(req.get("cred"), OPERATOR, f"POOL {req.get('action')} from {peer.conn.peer}")
            elif op == Op.REGISTER_JOB and req.get("tok") is None:
                self.credentials.require(req.get("cred"), OPERATOR, f"creating job {req.get('job')!r}")
            elif op == Op.STATUS and not from_this_host(peer):
                self.credentials.require(req.get("cred"), OPERATOR, f"the status, asked from {peer.conn.peer}")
        except Exception as exc:
            self.count_refusal(peer, exc)
            raise

    def is_operator(self, req: dict) -> bool:
        return self.credentials is None or self.credentials.grants(req.get("cred"), OPERATOR)

    def first_join(self, peer: RpcPeer) -> bool:
        """Whether this peer may join a job without its token (once per rank)."""
        return self.credentials is None or self.credentials.allow_first_join or from_this_host(peer)

    def count_refusal(self, peer: RpcPeer, exc: BaseException) -> None:
        self.refused += 1
        self._log.warning(peer.conn.peer, "refused", "pMaster refused a request from %s: %s", peer.conn.peer, exc)
