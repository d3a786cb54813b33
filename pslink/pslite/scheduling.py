"""The scheduler node's side of the control messages: :class:`SchedulerRunner`.

:class:`~pslink.pslite.scheduler.SchedulerState` decides (who registered, which barrier is
released, who missed its heartbeats) without I/O; this runner feeds it the control messages the
scheduler node receives, sends what it decides, and checks heartbeats on the node's reactor.
"""

from __future__ import annotations

import collections
import logging
from typing import Callable

from pslink.core.wire.loop import Reactor
from pslink.errors import PslinkError
from pslink.pslite import wire
from pslink.pslite.scheduler import SCHEDULER, SchedulerState
from pslink.pslite.wire import Kind

log = logging.getLogger("pslink.pslite")

HANDLED = (Kind.REGISTER, Kind.BARRIER, Kind.HEARTBEAT, Kind.LEAVE)


class SchedulerRunner:
    """Runs ``state`` for the scheduler node: ``notify`` wakes the node's waiting threads after
    each decision; heartbeats are checked every so often when both ``heartbeat_interval`` and
    ``heartbeat_timeout`` are set (seconds; ps-lite's PS_HEARTBEAT_INTERVAL and _TIMEOUT)."""

    def __init__(self, state: SchedulerState, reactor: Reactor, clock: Callable[[], float],
                 heartbeat_interval: float, heartbeat_timeout: float, notify: Callable[[], None]):
        self.state = state
        self.reactor = reactor
        self.clock = clock
        self.heartbeat_interval = heartbeat_interval
        self.heartbeat_timeout = heartbeat_timeout
        self.notify = notify
        self.stopped = False
        if heartbeat_timeout > 0 and heartbeat_interval > 0:
            reactor.call_later(self._check_interval(), self._check_heartbeats)

    def on_control(self, conn, header) -> None:
        """A control message of a kind in :data:`HANDLED`, from a node (or from this one)."""
        kind, now = header.kind, self.clock()
        self.state.heard(conn, now)
        if kind == Kind.REGISTER:
            outs = self.state.register(conn, header.tail, now)
        elif kind == Kind.BARRIER:
            outs = self.state.barrier(conn, header.tail["group"], header.customer, bool(header.flags & wire.FINAL))
        elif kind == Kind.LEAVE:
            outs = self.state.leave(conn)
        else:
            outs = []
        self.send(outs)

    def lost(self, conn, reason: str) -> None:
        """A node's connection closed."""
        self.send(self.state.lost(conn, reason))
        self.notify()

    def send(self, outs) -> None:
        """Send the messages the state decided on."""
        for out in outs:
            kind = Kind[out.kind]
            frame = wire.encode_fields(kind, out.fields, sender=SCHEDULER, customer=out.customer, flags=out.flags)
            if out.by_origin:
                conn = out.target
            else:
                member = self.state.members.get(out.target)
                conn = member.origin if member is not None else None
            if conn is None:
                continue
            try:
                conn.send([frame])
            except PslinkError:
                pass  # that node is gone; its on_close says so

    def progress(self, num_workers: int, address: str) -> str:
        """What the start is waiting for, for a timeout's message."""
        counts = collections.Counter(w["role"] for w in self.state.waiting)
        return (f"start of the scheduler at {address}: {counts['worker']} of {num_workers} worker(s) "
                f"and {counts['server']} of {self.state.expected_servers} server(s) registered")

    def _check_interval(self) -> float:
        return max(0.1, min(self.heartbeat_timeout / 4, self.heartbeat_interval or 1.0))

    def _check_heartbeats(self) -> None:
        if self.stopped:
            return
        try:
            if self.state.complete:
                self.send(self.state.expired(self.clock(), self.heartbeat_timeout))
        finally:
            self.reactor.call_later(self._check_interval(), self._check_heartbeats)
