"""pMaster's connections to its Aggregators, by name, and the ways it asks them things."""

from __future__ import annotations

import logging
from typing import Callable

from pslink.core.master.state import MasterState
from pslink.core.transport.rpc import RpcPeer
from pslink.core.wire.protocol import Op
from pslink.errors import PslinkError

log = logging.getLogger("pslink.core.master")


class AggregatorLinks:
    """The Aggregators connected to pMaster (``peers``: name -> connection); requests to them
    time out after ``timeout`` seconds."""

    def __init__(self, state: MasterState, timeout: float):
        self.state = state
        self.timeout = timeout
        self.peers: dict[str, RpcPeer] = {}

    def get(self, name: str) -> RpcPeer | None:
        return self.peers.get(name)

    def address_of(self, name: str) -> str:
        record = self.state.aggregators.get(name)
        return record.address if record is not None else ""

    def call(self, name: str, op: Op, callback, timeout: float | None = None, until_lost: bool = False,
             **fields) -> bool:
        """Ask Aggregator ``name``; False (nothing sent) when it is not connected. ``until_lost``:
        no timeout, the answer or the connection's loss ends the call (for orders whose late
        arrival must not pass for "not carried out": a partition delays a message, TCP still
        delivers it once the link heals)."""
        peer = self.peers.get(name)
        if peer is None:
            return False
        peer.call(op, callback, timeout=None if until_lost else self.timeout if timeout is None else timeout, **fields)
        return True

    def notify(self, name: str, op: Op, **fields) -> None:
        peer = self.peers.get(name)
        if peer is not None:
            peer.notify(op, **fields)

    @staticmethod
    def log_failure(what: str) -> Callable:
        """A callback that logs a failed request (for requests nothing waits on)."""
        def callback(result, error):
            if error is not None:
                log.warning("%s failed: %s", what, error)
        return callback

    def tell(self, name: str, op: Op, what: str, **fields) -> None:
        """Ask ``name`` and only log a failure."""
        self.call(name, op, self.log_failure(what), **fields)

    def fence(self, holder: str, ident: tuple, why: str) -> None:
        """``holder``'s copy of part ``ident`` (from a move that never happened) goes: FENCE."""
        log.warning("pMaster: %s drops %s (%s)", holder, ident, why)
        self.tell(holder, Op.FENCE, f"fencing {ident} on {holder}", parts=[list(ident)])

    def broadcast_each(self, calls: list[tuple[RpcPeer, dict]], op: Op,
                       done: Callable[[PslinkError | None], None]) -> None:
        """One request per peer; ``done(first error or None)`` once every answer is in."""
        if not calls:
            done(None)
            return
        outcome = {"left": len(calls), "error": None}

        def answered(result, error):
            if error is not None and outcome["error"] is None:
                outcome["error"] = error
            outcome["left"] -= 1
            if outcome["left"] == 0:
                done(outcome["error"])

        for peer, fields in calls:
            peer.call(op, answered, timeout=self.timeout, **fields)
