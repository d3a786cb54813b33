"""``PS_RESEND=1``: requests that get no answer are sent again, and receivers drop duplicates.

ps-lite's resender guards against lost messages: a request not acknowledged within
``PS_RESEND_TIMEOUT`` milliseconds is sent again and the receiver drops what it has seen. Over
TCP a message is lost only with its connection, so here a request not answered within the
timeout is sent again, over a new connection if the old one broke (and a broken connection no
longer fails the requests on it: they wait for their resend). The receiver remembers the
signature (sender, kind, app, customer, timestamp) of the last requests it got: a duplicate of a
request still being handled is dropped (the answer goes to whichever connection asked last), and
a duplicate of one already answered gets the same answer again, so every push is applied once.

The cost, paid only with ``PS_RESEND=1``: a sender keeps each request's frames until answered
(zero-copy values must stay unchanged until then anyway), and a receiver keeps its last answers,
which pins their arrays (KVServerDefaultHandle then adds into a copy instead of in place).
"""

from __future__ import annotations

import collections
import logging

from pslink.errors import PslinkError

log = logging.getLogger("pslink.pslite")

HISTORY = 4096  # answered requests a receiver remembers


class Resender:
    def __init__(self, node, timeout_ms: int, history: int = HISTORY):
        self.node = node
        self.timeout = timeout_ms / 1000.0
        self.interval = max(0.005, self.timeout / 4)
        self.history = history
        self.unanswered: dict[tuple, list] = {}  # (target, route, ts) -> [frames, last sent]
        self.seen: collections.OrderedDict[tuple, list | None] = collections.OrderedDict()
        self.reply_to: dict[tuple, object] = {}
        self.resent = 0
        self.duplicates = 0
        node.reactor.call_later(self.interval, self._tick)

    # -- the sender's side ----------------------------------------------------------------------

    def sent(self, target: int, key: tuple, frames: list) -> None:
        self.unanswered[(target, *key)] = [frames, self.node.clock()]

    def answered(self, target: int, key: tuple) -> None:
        self.unanswered.pop((target, *key), None)

    def _tick(self) -> None:
        node = self.node
        if node.closed:
            return
        try:
            now = node.clock()
            for ident, entry in list(self.unanswered.items()):
                target, route, ts = ident
                app = node._apps.get(route)
                if app is None or ts not in app._customer.pending:
                    del self.unanswered[ident]  # finished (or failed) some other way
                    continue
                if now - entry[1] < self.timeout:
                    continue
                entry[1] = now
                try:
                    # On the I/O thread: a peer that does not answer must not hold it for long.
                    conn = node.links.conn_to(target, connect_timeout=min(1.0, self.timeout))
                    conn.send(entry[0])
                except PslinkError as exc:
                    log.info("%s: PS_RESEND: node %s is unreachable, trying again later: %s", node, target, exc)
                    continue
                self.resent += 1
                log.info("%s: PS_RESEND: request %d of app %s to node %s unanswered after %.0f ms; sent again",
                         node, ts, route[0], target, self.timeout * 1e3)
        finally:
            node.reactor.call_later(self.interval, self._tick)

    # -- the receiver's side ----------------------------------------------------------------------

    def receive(self, conn, header):
        """The origin to answer this request through, or None if it is a duplicate (then it was
        dealt with here)."""
        signature = (header.sender, int(header.kind), header.app, header.customer, header.ts)
        if signature in self.seen:
            self.duplicates += 1
            answer = self.seen[signature]
            if answer is None:
                self.reply_to[signature] = conn  # still being handled: answer where it asked last
            else:
                try:
                    conn.send(answer)
                except PslinkError:
                    pass
            return None
        self.seen[signature] = None
        while len(self.seen) > self.history:
            old, _ = self.seen.popitem(last=False)
            self.reply_to.pop(old, None)
        return _Replier(self, signature, conn)


class _Replier:
    """The origin a request is answered through with resends on: it keeps the answer."""

    __slots__ = ("resender", "signature", "conn")

    def __init__(self, resender: Resender, signature: tuple, conn):
        self.resender, self.signature, self.conn = resender, signature, conn

    @property
    def peer(self) -> str:
        return self.conn.peer

    @property
    def closed(self) -> bool:
        return False  # a closed connection is not the end: the answer waits for the resend

    def send(self, frames) -> None:
        resender = self.resender
        if self.signature in resender.seen:
            resender.seen[self.signature] = list(frames)
        conn = resender.reply_to.pop(self.signature, self.conn)
        conn.send(frames)
