"""SimpleApp: ps-lite's (int head, string body) request/response between nodes, and the request
tracking (ps-lite's Customer) that KVWorker shares.

::

    app = SimpleApp(0)                          # on every node
    app.set_request_handle(lambda req, app: app.response(req, "ok"))
    node.start()
    ts = app.request(1, "hello", WORKER_GROUP)  # to every worker; returns at once
    app.wait(ts)                                # every worker answered

Handles run on the thread that drives the node's I/O: keep them short and never wait in them
(answer later with ``response`` from any thread instead).
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections import OrderedDict
from typing import Any, Callable

from pslink.core.transport import DISCARD
from pslink.errors import ClosedError, ConfigError, ProtocolError, PslinkError
from pslink.pslite import wire
from pslink.pslite.wire import Kind

log = logging.getLogger("pslink.pslite")

MAX_FAILED_KEPT = 4096  # failed requests remembered for a later wait()


class SimpleData:
    """A received request or response: ``head``, ``body``, ``sender`` (node id), ``timestamp``."""

    __slots__ = ("head", "body", "sender", "timestamp", "app_id", "customer_id", "_origin", "_responded")

    def __init__(self, head: int, body: str, sender: int, timestamp: int, app_id: int = 0, customer_id: int = 0):
        self.head, self.body, self.sender, self.timestamp = head, body, sender, timestamp
        self.app_id, self.customer_id = app_id, customer_id
        self._origin = None
        self._responded = False

    def __repr__(self) -> str:
        return f"SimpleData(head={self.head}, body={self.body!r}, sender={self.sender}, timestamp={self.timestamp})"


class Request:
    """One request of a customer (a timestamp): how many answers it still waits for."""

    __slots__ = ("ts", "left", "error", "done", "callback", "targets", "what")

    def __init__(self, ts: int, left: int, callback: Callable[[], None] | None, what: str):
        self.ts, self.left, self.callback, self.what = ts, left, callback, what
        self.error: PslinkError | None = None
        self.done = False
        self.targets: set[int] = set()

    def describe(self) -> str:
        return f"{self.what} (timestamp {self.ts})"


class Customer:
    """Timestamps and completion of one (app, customer)'s requests, as ps-lite's Customer."""

    def __init__(self, app):
        self.app = app
        self._ids = itertools.count()
        self._next = 0
        self._lock = threading.Lock()
        self.pending: dict[int, Request] = {}
        self.failed: OrderedDict[int, PslinkError] = OrderedDict()

    def new_ts(self) -> int:
        with self._lock:
            ts = next(self._ids)
            self._next = ts + 1
            return ts

    def add(self, request: Request) -> None:
        self.pending[request.ts] = request
        if request.callback is not None:
            self.app.node.driver.callbacks_pending(1)

    def finish(self, request: Request) -> None:
        """All answers are in (or it failed): run the callback, mark it done, wake waiters."""
        if request.done:
            return
        if request.error is None and request.callback is not None:
            try:
                request.callback()
            except Exception:
                log.exception("callback of request %d of app %s failed", request.ts, self.app.app_id)
        elif request.error is not None:
            if request.callback is not None:
                log.error("%s failed (its callback will not run): %s", request.describe(), request.error)
            self.failed[request.ts] = request.error
            while len(self.failed) > MAX_FAILED_KEPT:
                self.failed.popitem(last=False)
        request.done = True
        self.pending.pop(request.ts, None)
        if request.callback is not None:
            self.app.node.driver.callbacks_pending(-1)
        self.app.node.complete()

    def wait(self, ts: int, timeout: float | None) -> None:
        if isinstance(ts, bool) or not isinstance(ts, int):
            raise ConfigError(f"wait: timestamp {ts!r} must be an int returned by a request")
        request = self.pending.get(ts)
        if request is not None:
            self.app.node.wait(lambda: request.done, timeout, request.describe)
        error = self.failed.pop(ts, None)
        if error is not None:
            raise error
        if not 0 <= ts < self._next:
            raise ConfigError(f"wait: app {self.app.app_id} customer {self.app.customer_id} issued no request "
                              f"with timestamp {ts} (the last was {self._next - 1})")

    def answered(self, ts: int, sender: int, error: PslinkError | None = None) -> Request | None:
        """One target answered (or failed); returns the request if that completed it."""
        request = self.pending.get(ts)
        if request is None or sender not in request.targets:
            return None
        request.targets.discard(sender)
        if error is not None and request.error is None:
            request.error = error
        request.left -= 1
        return request if request.left == 0 else None

    def fail_all(self, error: PslinkError) -> None:
        for request in list(self.pending.values()):
            if not request.done:
                request.error = request.error or error
                self.finish(request)


def default_request_handle(request: SimpleData, app: "SimpleApp") -> None:
    app.response(request)


def default_response_handle(response: SimpleData, app: "SimpleApp") -> None:
    pass


class SimpleApp:
    """Requests with an int head and a string body to a node or a group of nodes (ps-lite's
    SimpleApp). ``node`` defaults to the process's default node (built from DMLC_* variables)."""

    def __init__(self, app_id: int = 0, customer_id: int | None = None, node=None):
        if node is None:
            from pslink.pslite.api import default_node

            node = default_node()
        self.node = node
        self.app_id = wire.check_i32("app_id", app_id)
        self.customer_id = self.app_id if customer_id is None else wire.check_i32("customer_id", customer_id)
        self._request_handle: Callable[[SimpleData, Any], None] = default_request_handle
        self._response_handle: Callable[[SimpleData, Any], None] = default_response_handle
        self._customer = Customer(self)
        node.add_app(self)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} app {self.app_id} customer {self.customer_id} on {self.node!r}>"

    def close(self) -> None:
        """Stop receiving (ps-lite's destructor); pending requests fail."""
        self.node.remove_app(self)
        self.node.post(self._fail_all, ClosedError(f"{self!r} was closed"))

    def set_request_handle(self, handle: Callable[[SimpleData, Any], None]) -> None:
        if not callable(handle):
            raise ConfigError(f"request handle {handle!r} is not callable")
        self._request_handle = handle

    def set_response_handle(self, handle: Callable[[SimpleData, Any], None]) -> None:
        if not callable(handle):
            raise ConfigError(f"response handle {handle!r} is not callable")
        self._response_handle = handle

    def request(self, head: int, body: str = "", recv_id: int = 0) -> int:
        """Send (head, body) to node or group ``recv_id``; returns the timestamp to wait on."""
        head = wire.check_i32("head", head)
        if not isinstance(body, str):
            raise ConfigError(f"request body must be a str, got {type(body).__name__}")
        node = self.node
        node.require_ready("SimpleApp.request")
        targets = node.node_ids(recv_id)
        ts = self._customer.new_ts()
        request = Request(ts, len(targets), None, f"SimpleApp {self.app_id} request {head} to {recv_id}")
        request.targets.update(targets)
        self._customer.add(request)
        if not targets:  # an empty group (no servers in service mode): nothing to wait for
            self._customer.finish(request)
            return ts
        frame = wire.encode(Kind.SIMPLE_REQUEST, app=self.app_id, customer=self.customer_id, ts=ts,
                            sender=node.id, cmd=head, tail=body.encode("utf-8"))
        for target in targets:
            node.send_request(target, [frame], self, ts)
        return ts

    def wait(self, timestamp: int, timeout: float | None = None) -> None:
        """Block until every answer to request ``timestamp`` arrived (at most ``timeout`` s,
        default the node's PSLINK_TIMEOUT); raises the request's error if it failed."""
        self._customer.wait(timestamp, self.node.config.timeout if timeout is None else timeout)

    def response(self, request: SimpleData, body: str = "") -> None:
        """Answer a received request (from any thread, at any time)."""
        if not isinstance(request, SimpleData) or request._origin is None:
            raise ConfigError("response() needs the SimpleData a request handle received")
        if not isinstance(body, str):
            raise ConfigError(f"response body must be a str, got {type(body).__name__}")
        if request._responded:
            raise ConfigError(f"request {request.timestamp} from node {request.sender} was already answered")
        request._responded = True
        frame = wire.encode(Kind.SIMPLE_RESPONSE, app=request.app_id, customer=request.customer_id,
                            ts=request.timestamp, sender=self.node.id, cmd=request.head, tail=body.encode("utf-8"))
        try:
            request._origin.send([frame])
        except PslinkError as exc:
            log.warning("%r: the answer to node %s's request %d is lost: %s", self, request.sender,
                        request.timestamp, exc)

    # -- called by the node on its driving thread -------------------------------------------------

    def _on_simple_request(self, conn, header) -> None:
        data = SimpleData(header.cmd, header.tail, header.sender, header.ts, header.app, header.customer)
        data._origin = conn
        try:
            self._request_handle(data, self)
        except Exception as exc:
            log.exception("%r: request handle failed on %r", self, data)
            if not data._responded:
                data._responded = True
                self.node.reply_error(conn, header, exc)

    def _on_kv_request(self, conn, header, arrays) -> None:
        self.node.reply_error(conn, header, ConfigError(
            f"app {self.app_id} on the {self.node.describe()} is a {type(self).__name__}, not a KVServer"))

    def _response_buffers(self, header, sizes):
        return DISCARD  # a KV answer for an app that made no KV request

    def _on_kv_response(self, header) -> None:
        done = self._customer.answered(header.ts, header.sender, ProtocolError(
            f"node {header.sender} answered a SimpleApp request of app {self.app_id} with KV pairs"))
        if done is not None:
            self._finish(done)

    def _on_simple_response(self, header) -> None:
        request = self._customer.pending.get(header.ts)
        if request is None or header.sender not in request.targets:
            return
        data = SimpleData(header.cmd, header.tail, header.sender, header.ts, header.app, header.customer)
        try:
            self._response_handle(data, self)
        except Exception:
            log.exception("%r: response handle failed on %r", self, data)
        done = self._customer.answered(header.ts, header.sender)
        if done is not None:
            self._customer.finish(done)

    def _on_error(self, header, error: PslinkError) -> None:
        done = self._customer.answered(header.ts, header.sender, error)
        if done is not None:
            self._finish(done)

    def _target_failed(self, ts: int, target: int, error: PslinkError) -> None:
        done = self._customer.answered(ts, target, error)
        if done is not None:
            self._finish(done)

    def _finish(self, request: Request) -> None:
        self._customer.finish(request)

    def _fail_all(self, error: PslinkError) -> None:
        self._customer.fail_all(error)
