"""An Agent's link to pMaster (a mixin of :class:`pslink.core.agent.Agent`): control calls,
registration, heartbeats with iteration times, and re-registering after pMaster comes back.

The data path never waits for pMaster: while it is away the Agent trains on the mapping it has
and reconnects on every heartbeat until pMaster answers again (with the job's token, so a
restarted pMaster recognizes the worker).
"""

from __future__ import annotations

import logging
import os
import threading

from pslink.core import hosts
from pslink.core.agent.handle import Handle
from pslink.core.wire.protocol import Op
from pslink.core.transport.rpc import RpcPeer
from pslink.errors import PeerError, ProtocolError, PslinkError

log = logging.getLogger("pslink.core.agent.agent")


class MasterLink:
    """Requires of its host: ``transports``, ``_reactor``, ``_endpoint``, ``limits``, ``_master``,
    ``_master_lock``, ``master_address``, ``connect_timeout``, ``timeout``, ``heartbeat_interval``,
    ``_lock``, ``_iterations``, ``_reconnecting``, ``_closed``, ``_complete``,
    ``_update_membership``, ``_late``, ``_joined`` and its identity."""

    def _master_peer(self) -> RpcPeer:
        peer = self._master
        if peer is not None and not peer.conn.closed:
            return peer
        with self._master_lock:
            if self._master is None or self._master.conn.closed:
                try:
                    conn = self.transports.connect(
                        self.master_address, self._reactor, self._endpoint, self.limits, self.connect_timeout
                    )
                except PeerError as exc:
                    raise PeerError(f"pMaster at {self.master_address} is unreachable (is `pslink service up` "
                                    f"running there?): {exc.message}", peer=self.master_address) from None
                self._master = self._endpoint.peer(conn)
                self._master.info["name"] = f"pMaster at {self.master_address}"
            return self._master

    def _master_call(self, op: Op, timeout: float | None = None, **fields) -> dict:
        """A synchronous control request to pMaster (job fields added); returns the reply body."""
        handle = Handle(self, op.name.lower(), [], None, 1)
        timeout = self.timeout if timeout is None else timeout

        def answered(result, error):
            if result is not None:
                handle._result = result.get("body", {})
            self._complete(handle, error)

        if op != Op.REGISTER_WORKER:
            fields = dict(job=self.job, tok=self.token, rank=self.rank, **fields)
        self._master_peer().call(op, answered, timeout=timeout, **fields)
        return handle.wait(timeout + 1.0)

    def _register(self, config: dict, token: bytes | None, rejoin: bool = False) -> dict:
        fields = dict(job=self.job, rank=self.rank, num_workers=self.num_workers, pid=os.getpid(),
                      host=hosts.host_name(), host_id=self.host_id, config=config)
        if token:
            fields["tok"] = token
        if rejoin:
            fields["rejoin"] = True  # out of the job and back in as a newcomer, in one step
        return self._master_call(Op.REGISTER_WORKER, timeout=self.connect_timeout, **fields)

    def _on_master_request(self, peer: RpcPeer, req: dict) -> None:
        raise ProtocolError(f"an Agent serves no {req['op'].name} requests")

    def _on_master_lost(self, peer: RpcPeer, exc) -> None:
        if peer is self._master:
            self._master = None
            if not self._closed:
                log.warning("agent %s/%s: lost pMaster at %s (%s); training continues, reconnecting",
                            self.job, self.rank, self.master_address, exc)

    def _heartbeat(self) -> None:
        if self._closed:
            return
        try:
            peer = self._master
            if peer is not None and not peer.conn.closed:
                with self._lock:
                    iterations, self._iterations = self._iterations, []
                peer.notify(Op.HEARTBEAT, job=self.job, tok=self.token, rank=self.rank,
                            iters=[round(d, 6) for d in iterations])
            elif not self._reconnecting:
                self._reconnecting = True
                threading.Thread(target=self._reconnect_master, daemon=True).start()
        finally:
            self._reactor.call_later(self.heartbeat_interval, self._heartbeat)

    def _reconnect_master(self) -> None:
        """Off the driving thread (connecting may block): re-register with the job's token."""
        try:
            peer = self._master_peer()
            fields = dict(job=self.job, rank=self.rank, num_workers=self.num_workers, pid=os.getpid(),
                          host=hosts.host_name(), host_id=self.host_id, tok=self.token)

            def registered(result, error):
                if error is not None:
                    log.warning("agent %s/%s: re-registering with pMaster failed: %s", self.job, self.rank, error)
                    return
                body = result.get("body") or {}
                self._update_membership(body.get("membership"))
                if body.get("late"):
                    # It had been taken out of the job (silent too long) and came back as a new
                    # member: it joins every key again, at the rounds under way.
                    log.error("agent %s/%s: this worker had been removed from the job; it rejoins at the "
                              "current rounds (its own state may be behind the others')", self.job, self.rank)
                    self._late, self._joined = True, set()
                else:
                    log.info("agent %s/%s: reconnected to pMaster", self.job, self.rank)

            peer.call(Op.REGISTER_WORKER, registered, timeout=self.connect_timeout, **fields)
        except PslinkError:
            pass
        finally:
            self._reconnecting = False
