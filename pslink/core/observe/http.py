"""pMaster's HTTP endpoint for people and Prometheus: ``/metrics``, ``/status.json``,
``/history.json`` and the live page at ``/``.

Read-only and free of secrets (status carries no tokens), so it needs no credential; it listens
where pMaster does unless told otherwise. It runs on threads of its own and reads pMaster's state
only through ``snapshot()``, which runs on pMaster's loop.
"""

from __future__ import annotations

import http.server
import importlib.resources
import json
import logging
import threading
from typing import Callable

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from pslink.core.observe.metrics import registry_for
from pslink.errors import PslinkError

log = logging.getLogger(__name__)

MAX_CONNECTIONS = 16  # served at once; more are closed at once (a flood costs threads of nobody's)
REQUEST_TIMEOUT = 5.0  # seconds a connection may stay silent while its request is read


class _Server(http.server.ThreadingHTTPServer):
    """A thread per connection, at most MAX_CONNECTIONS of them; ``refused`` counts the rest."""

    daemon_threads = True
    request_queue_size = 128  # the listen backlog: 5 (socketserver's) makes a burst of connects wait for SYN retries

    def __init__(self, address, handler):
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self.refused = 0
        super().__init__(address, handler)

    def process_request(self, request, client_address):
        if not self._slots.acquire(blocking=False):
            self.refused += 1
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def handle_error(self, request, client_address):
        log.debug("http: a request from %s failed", client_address, exc_info=True)


def _page() -> bytes:
    return importlib.resources.files("pslink.core.observe").joinpath("page.html").read_bytes()


class StatusServer:
    """Serves ``snapshot()`` (pMaster's status) and ``history()`` (its recent load) over HTTP on
    ``host:port`` (port 0: any free one; ``address`` says which)."""

    def __init__(self, snapshot: Callable[[], dict], history: Callable[[], dict], host: str = "127.0.0.1",
                 port: int = 0):
        registry = registry_for(snapshot)
        page = _page()

        class Handler(http.server.BaseHTTPRequestHandler):
            server_version = "pslink"
            timeout = REQUEST_TIMEOUT  # a silent client is dropped, not waited for

            def do_GET(self):  # noqa: N802 (http.server's name)
                path = self.path.split("?", 1)[0]
                try:
                    if path == "/metrics":
                        self._send(200, CONTENT_TYPE_LATEST, generate_latest(registry))
                    elif path == "/status.json":
                        self._send(200, "application/json", json.dumps(snapshot()).encode())
                    elif path == "/history.json":
                        self._send(200, "application/json", json.dumps(history()).encode())
                    elif path in ("/", "/index.html"):
                        self._send(200, "text/html; charset=utf-8", page)
                    else:
                        self._send(404, "text/plain", f"no page {path}; try /, /metrics or /status.json\n".encode())
                except PslinkError as exc:
                    self._send(503, "text/plain", f"{exc}\n".encode())

            def _send(self, code: int, kind: str, body: bytes) -> None:
                self.send_response(code)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.send_header("Cache-Control", "no-store")
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, fmt, *args):
                log.debug("http %s: " + fmt, self.client_address[0], *args)

        try:
            self._server = _Server((host, port), Handler)
        except OSError as exc:
            raise PslinkError(f"cannot serve metrics on {host}:{port}: {exc.strerror or exc}") from None
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.2},
                                        name="pslink-http", daemon=True)

    @property
    def refused(self) -> int:
        """Connections closed unserved: MAX_CONNECTIONS were being served."""
        return self._server.refused

    @property
    def address(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{'[' + host + ']' if ':' in host else host}:{port}"

    def start(self) -> "StatusServer":
        self._thread.start()
        return self

    def close(self) -> None:
        if self._thread.is_alive():
            self._server.shutdown()
            self._thread.join(5.0)
        self._server.server_close()
