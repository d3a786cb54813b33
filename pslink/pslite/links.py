"""A ps-lite node's connections to the other nodes: :class:`Links` (and :class:`LocalConn`, a
node's connection to itself).

Peers are connected on first use, one connection each; the node answers requests on the
connection they came from. The requests sent on each link are remembered until answered, so that
a lost connection fails exactly those (or, with PS_RESEND, leaves them to the resender).
"""

from __future__ import annotations

import collections
import logging
import threading
from typing import Any, Callable

import numpy as np

from pslink.core.transport import Transports
from pslink.core.wire.loop import Reactor
from pslink.core.wire.protocol import Limits
from pslink.errors import ClosedError, ConfigError, PeerError, PslinkError
from pslink.pslite import wire
from pslink.pslite.scheduler import SCHEDULER

log = logging.getLogger("pslink.pslite")


class LocalConn:
    """A node's connection to itself (the scheduler's own control messages, SimpleApp requests
    a node sends its own group): ``deliver(raw header, payloads)`` is posted to the node's
    reactor, payloads copied."""

    peer = "this node"
    closed = False

    def __init__(self, reactor: Reactor, deliver: Callable[[bytes, list], None]):
        self.reactor = reactor
        self.deliver = deliver

    def send(self, frames) -> None:
        payloads = [np.frombuffer(bytes(memoryview(p).cast("B")), np.uint8) for p in frames[1:]]
        self.reactor.post(self.deliver, bytes(frames[0]), payloads)

    def close(self) -> None:
        pass


class Links:
    """Connections from one node (``handler`` gets what arrives on them) to the others.

    ``node_id()``, ``nodes()`` (id -> NodeInfo) and ``scheduler_conn()`` are the node's current
    id, node table and connection to the scheduler; ``apps`` its apps by route key (told when
    their requests fail); ``closed()`` whether it was finalized; ``resending``: PS_RESEND is on."""

    def __init__(self, transports: Transports, reactor: Reactor, handler, limits: Limits, *, local: LocalConn,
                 connect_timeout: float, node_id: Callable[[], int | None], nodes: Callable[[], dict],
                 scheduler_conn: Callable[[], Any], apps: dict, closed: Callable[[], bool], describe: Callable[[], str],
                 resending: bool, trace: bool):
        self.transports = transports
        self.reactor = reactor
        self.handler = handler
        self.limits = limits
        self.local = local
        self.connect_timeout = connect_timeout
        self.node_id = node_id
        self.nodes = nodes
        self.scheduler_conn = scheduler_conn
        self.apps = apps
        self.closed = closed
        self.describe = describe
        self.resending = resending
        self.trace = trace
        self._lock = threading.Lock()
        self._links: dict[int, Any] = {}
        self._outstanding: dict[int, set] = collections.defaultdict(set)

    def describe_id(self, node: int) -> str:
        info = self.nodes().get(node)
        return info.describe() if info is not None else f"node {node}"

    def conn_to(self, target: int, connect_timeout: float | None = None):
        """The connection to node ``target``, made now if there is none (or it was lost)."""
        if target == self.node_id():
            return self.local
        scheduler = self.scheduler_conn()
        if target == SCHEDULER and scheduler is not None:
            return scheduler
        conn = self._links.get(target)
        if conn is not None and not conn.closed:
            return conn
        with self._lock:
            conn = self._links.get(target)
            if conn is None or conn.closed:
                if self.closed():
                    raise ClosedError(f"the {self.describe()} was finalized")
                info = self.nodes().get(target)
                if info is None:
                    raise ConfigError(f"node {target} does not exist")
                timeout = self.connect_timeout if connect_timeout is None else connect_timeout
                conn = self.transports.connect(info.address, self.reactor, self.handler, self.limits, timeout=timeout)
                self._links[target] = conn
            return conn

    def send_request(self, target: int, frames: list, app, key: tuple, ts: int) -> None:
        """Send ``app``'s request ``(route key, ts)`` to node ``target``; the app hears of its
        answer or of the link failing."""
        self._outstanding[target].add((key, ts))
        if self.trace:
            log.debug("%s -> %s: %r", self.describe(), self.describe_id(target),
                      wire.decode(frames[0], tuple(memoryview(p).nbytes for p in frames[1:])))
        try:
            self.conn_to(target).send(frames)
        except PslinkError as exc:
            self._outstanding[target].discard((key, ts))
            # Completion runs on the driving thread, as every other answer does.
            self.reactor.post(app._target_failed, ts, target,
                              PeerError(f"cannot send to {self.describe_id(target)}: {exc.message}"))

    def answered(self, sender: int, key: tuple, ts: int) -> None:
        outstanding = self._outstanding.get(sender)
        if outstanding is not None:
            outstanding.discard((key, ts))

    def lost(self, conn, reason: str) -> None:
        """``conn`` closed: forget it and fail what was outstanding on it."""
        if conn is self.scheduler_conn():
            self.fail_outstanding(SCHEDULER, reason)
            return
        for target, link in list(self._links.items()):
            if link is conn:
                with self._lock:
                    if self._links.get(target) is conn:
                        del self._links[target]
                self.fail_outstanding(target, reason)

    def fail_outstanding(self, target: int, reason: str) -> None:
        if self.resending and target != SCHEDULER:
            return  # PS_RESEND: they are sent again over a new connection
        keys = self._outstanding.pop(target, set())
        if not keys:
            return
        error = PeerError(f"lost the connection to {self.describe_id(target)}: {reason}")
        for route, ts in keys:
            app = self.apps.get(route)
            if app is not None:
                app._target_failed(ts, target, error)

    def close(self) -> None:
        with self._lock:
            links, self._links = list(self._links.values()), {}
        for conn in links:
            conn.close()
