"""A synchronous control-plane client for tools (``pslink service status``, ``pslink job create``)."""

from __future__ import annotations

from typing import Self

from pslink.core.credential_files import credential_for
from pslink.core.credentials import OPERATOR
from pslink.core.master_addresses import MasterAddresses
from pslink.core.names import check_job_name
from pslink.core.transport import Transports
from pslink.core.transport.rpc import RpcEndpoint
from pslink.core.wire.loop import Reactor
from pslink.core.wire.protocol import DEFAULT_LIMITS, Op
from pslink.errors import ProtocolError, PslinkTimeoutError


class ControlClient:
    """Request/reply with pMaster on the calling thread; no background thread. ``master``: its
    address, or a comma list of them (a leader and its standby): the first that accepts a
    connection is the one asked. A request whose connection drops is not sent again elsewhere
    (adding or removing an Aggregator twice is not the same as once): the caller hears the error
    and may make a new client. ``credential``: the operator credential to present (default: the
    one :func:`credential_for` finds for ``master``, if any; a service made without credentials
    needs none)."""

    def __init__(self, master: str, timeout: float = 10.0, transports: Transports | None = None,
                 credential: str | None = None, credentials_file: str | None = None):
        self.master = master  # as given: every address, for messages
        self.addresses = MasterAddresses.parse(master)
        self.credential = credential or credential_for(master, OPERATOR, credentials_file)
        self.timeout = timeout
        self.transports = transports or Transports()
        self._own_transports = transports is None
        self.reactor = Reactor("control-client")
        self.endpoint = RpcEndpoint(self.reactor, self._refuse, DEFAULT_LIMITS, control_faults=False)
        try:
            conn, self.address = self.addresses.connect(self.transports, self.reactor, self.endpoint, DEFAULT_LIMITS,
                                                        timeout)
        except BaseException:
            self._release()
            raise
        self.peer = self.endpoint.peer(conn)
        self.peer.info["name"] = f"pMaster at {self.address}"

    @staticmethod
    def _refuse(peer, req):
        raise ProtocolError(f"a control client serves no {req['op'].name} requests")

    def call(self, op: Op, **fields) -> dict:
        """Send a request and return the reply's body (or raise the error pMaster sent)."""
        outcome: dict = {}

        def answered(result, error):
            outcome["result"], outcome["error"] = result, error

        if self.credential and op in (Op.STATUS, Op.REGISTER_JOB, Op.POOL):
            fields["cred"] = self.credential
        self.peer.call(op, answered, timeout=self.timeout, **fields)
        deadline = self.reactor.clock() + self.timeout + 1.0
        with_lock = self.reactor.acquire()
        try:
            while "result" not in outcome:
                remaining = deadline - self.reactor.clock()
                if remaining <= 0:
                    raise PslinkTimeoutError(f"{op.name} to pMaster at {self.address} got no answer")
                self.reactor.run_once(remaining)
        finally:
            if with_lock:
                self.reactor.release()
        if outcome["error"] is not None:
            raise outcome["error"]
        return outcome["result"].get("body", {})

    def status(self) -> dict:
        return self.call(Op.STATUS)

    def register_job(self, job: str, num_workers: int, config: dict | None = None, token: bytes | None = None,
                     quota: dict | None = None) -> dict:
        """Create job ``job`` (the operator's), or re-create one that has no live workers (the
        operator's, or whoever holds its ``token``): the reply carries the new token. ``quota``
        (the operator's): ``{"max_bytes": n, "max_keys": n}``, any subset."""
        check_job_name(job)
        return self.call(Op.REGISTER_JOB, job=job, num_workers=num_workers, config=config or {},
                         **({"tok": token} if token is not None else {}), **({"quota": quota} if quota else {}))

    def add_aggregators(self, count: int = 1) -> dict:
        """Start ``count`` Aggregators through pMaster's provider; answered once they registered:
        ``{"added": [names], "min_aggregators": n}``."""
        return self.call(Op.POOL, action="add", count=count)

    def remove_aggregator(self, name: str) -> dict:
        """Drain the Aggregator ``name`` (its tasks and replicas move elsewhere while jobs run) and
        stop it; answered once it was released: ``{"removed", "moved": [[job, key, part, where]],
        "replicas": [[job, key, part, [new holders]]], "min_aggregators"}``."""
        return self.call(Op.POOL, action="remove", agg=name)

    def stop_service(self) -> dict:
        """Stop the service (pMaster and every process it started), as Ctrl-C in ``pslink service
        up``'s terminal would: ``{"stopping": address}``."""
        return self.call(Op.POOL, action="stop")

    def close(self) -> None:
        self.peer.conn.close()
        self._release()

    def _release(self) -> None:
        self.reactor.drain()
        self.reactor.close()
        if self._own_transports:
            self.transports.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
