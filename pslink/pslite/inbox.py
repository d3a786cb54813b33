"""Requests that reach a ps-lite node for its apps: :class:`Inbox`.

A request is received into buffers the inbox picks (pooled for large values), then handed to
the app it names. It is held while the node does not know its node table yet (a peer that got
the table first may ask before we got ours) and queued while its app does not exist yet (ps-lite
aborts there after 5 s; we wait, up to :data:`MAX_QUEUED` requests an app). Bad requests are
answered with an error naming what was wrong.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import numpy as np

from pslink.core.memory import BufferPool
from pslink.core.ratelog import Throttled
from pslink.errors import ConfigError, ProtocolError, PslinkError
from pslink.pslite import wire
from pslink.pslite.wire import Kind

log = logging.getLogger("pslink.pslite")

MAX_QUEUED = 1 << 16  # requests one app id may hold before it exists
POOL_MIN_BYTES = 64 << 10  # below this, a fresh np.empty is cheaper than a pool lookup


class Inbox:
    """Requests for the apps in ``apps`` (route key -> app, the node's own dict), routed by
    ``route_key(app id, customer id)``; ``sender_id()`` is this node's id for the answers,
    ``describe()`` names the node in errors."""

    def __init__(self, apps: dict[tuple[int, int], Any], route_key: Callable[[int, int], tuple[int, int]],
                 sender_id: Callable[[], int], describe: Callable[[], str]):
        self.apps = apps
        self.route_key = route_key
        self.sender_id = sender_id
        self.describe = describe
        self.ready = False  # the node has its node table
        self.bad_messages = 0
        self._bad_log = Throttled(log)  # one line per peer host per interval, not one per message
        self._early: list = []  # requests that came before the node table
        self._queued: dict[tuple[int, int], list] = {}  # requests for apps that do not exist yet
        self._pools: dict[tuple, BufferPool] = {}

    def buffers(self, header, sizes) -> list:
        """Arrays to receive a KV request's keys, values and lengths into."""
        if not sizes:
            return []
        arrays = [np.empty(sizes[0] // 8, wire.KEY_DTYPE)]
        nvals = sizes[1] // header.dtype.itemsize
        if sizes[1] >= POOL_MIN_BYTES:
            pool = self._pools.get((header.dtype, nvals))
            if pool is None:
                pool = self._pools[(header.dtype, nvals)] = BufferPool(header.dtype, nvals)
            arrays.append(pool.acquire())
        else:
            arrays.append(np.empty(nvals, header.dtype))
        if len(sizes) == 3:
            arrays.append(np.empty(sizes[2] // 4, wire.LEN_DTYPE))
        return arrays

    def deliver(self, conn, header, arrays) -> None:
        """Hand a request to its app, or hold it until it can be."""
        if not self.ready:
            self._early.append((conn, header, arrays))
            return
        key = self.route_key(header.app, header.customer)
        app = self.apps.get(key)
        if app is None:
            queue = self._queued.setdefault(key, [])
            if len(queue) >= MAX_QUEUED:
                self.reply_error(conn, header, ConfigError(
                    f"the {self.describe()} has no app {header.app} (customer {header.customer}) after "
                    f"{MAX_QUEUED} requests for it were queued; is it ever created?"))
                return
            queue.append((conn, header, arrays))
            return
        if header.kind == Kind.KV_REQUEST:
            app._on_kv_request(conn, header, arrays)
        else:
            app._on_simple_request(conn, header)

    def table_known(self) -> None:
        """The node has its node table: deliver what came before it."""
        self.ready = True
        early, self._early = self._early, []
        self.replay(early)

    def take_queued(self, key: tuple[int, int]) -> list | None:
        """The requests queued for the app now added under ``key`` (to :meth:`replay`)."""
        return self._queued.pop(key, None)

    def replay(self, queued: list) -> None:
        for conn, header, arrays in queued:
            self.deliver(conn, header, arrays)

    def reply_error(self, conn, header, exc: BaseException) -> None:
        frame = wire.encode_error(exc, app=header.app, customer=header.customer, ts=header.ts, sender=self.sender_id())
        try:
            conn.send([frame])
        except PslinkError:
            pass  # the requester is gone

    def bad_message(self, conn, error: ProtocolError, raw: bytes) -> None:
        """A message that could not be read: counted, logged, and answered if it was a request."""
        self.bad_messages += 1
        self._bad_log.warning(conn.peer, "bad", "%s: bad message from %s: %s", self.describe(), conn.peer, error)
        try:
            fixed = wire.FIXED.unpack_from(raw)
        except Exception:
            return
        if fixed[0] == wire.MAGIC and fixed[2] in (Kind.KV_REQUEST, Kind.SIMPLE_REQUEST):
            frame = wire.encode_error(error, app=fixed[5], customer=fixed[6], ts=fixed[7], sender=self.sender_id())
            try:
                conn.send([frame])
            except PslinkError:
                pass
