"""pMaster's side of seeing the service: its status (for ``pslink service status``, ``/metrics``
and the live page), the HTTP endpoint that serves them (``metrics_port``), and stopping the
service on an operator's request (``pslink service stop``)."""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Callable

from pslink.core.master.watch import History, Watch, status_of
from pslink.core.transport.rpc import RpcPeer
from pslink.errors import PslinkTimeoutError, ServiceError

log = logging.getLogger("pslink.core.master")
SNAPSHOT_AGE = 0.25  # seconds a status served over HTTP may be old


class Observing:
    """``master``: the :class:`~pslink.core.master.master.Master` it reports on. ``on_stop``: what
    stops the whole service (``pslink service up`` passes its own stop); None refuses the request."""

    def __init__(self, master, *, metrics_port: int | None, metrics_host: str, on_stop: Callable[[], None] | None,
                 leadership: Callable[[], dict] | None = None):
        self.master = master
        self.leadership = leadership
        self.watch = Watch()
        self.history = History()
        self.on_stop = on_stop
        self._snapshot_lock = threading.Lock()
        self._last_snapshot: tuple[float, dict | None] = (0.0, None)
        self.http = None
        if metrics_port is not None:
            from pslink.core.observe.http import StatusServer  # prometheus-client: only with metrics on

            self.http = StatusServer(self.snapshot, self.history.to_wire, metrics_host, metrics_port).start()
            log.info("pMaster: metrics at %s/metrics, status page at %s/", self.http.address, self.http.address)

    @property
    def http_address(self) -> str | None:
        return self.http.address if self.http is not None else None

    def status(self) -> dict:
        """On pMaster's loop: the whole status."""
        m = self.master
        body = status_of(m.state)
        body["migrations"] = m.mover.core.status(m.state.clock())  # running, then queued
        body["migrations_done"] = m.mover.core.done
        body["master"] = {"address": m.address, "state": m.store.path, "pid": os.getpid(),
                          "refused": m.gate.refused + m.mover.refused, "bad_messages": m.endpoint.bad_messages,
                          "credentials": not m.gate.open, "http": self.http_address}
        if self.leadership is not None:
            body["leadership"] = dict(self.leadership(), pending_writes=m.store.pending_writes,
                                      written=m.store.written)
        return self.watch.add_to(body, m.state.aggregators, migrations=m.mover.core.done, failovers=m.failover.done)

    def snapshot(self, timeout: float = 5.0) -> dict:
        """From any thread: the status, taken on pMaster's loop, at most once per SNAPSHOT_AGE
        (however often the page and scrapers ask, pMaster's loop computes it a few times a second)."""
        with self._snapshot_lock:
            taken, status = self._last_snapshot
            if status is not None and time.monotonic() - taken < SNAPSHOT_AGE:
                return status
            status = self._take_snapshot(timeout)
            self._last_snapshot = (time.monotonic(), status)
            return status

    def _take_snapshot(self, timeout: float) -> dict:
        box: list = []
        done = threading.Event()

        def take():
            try:
                box.append(self.status())
            finally:
                done.set()

        self.master.call_soon(take)
        if not done.wait(timeout) or not box:
            raise PslinkTimeoutError(f"pMaster did not give its status within {timeout:g} s (is it stopping?)")
        return box[0]

    def tick(self) -> None:
        """On pMaster's loop, every sweep."""
        state = self.master.state
        self.history.sample(state.clock(), time.time(), state.aggregators, state.jobs)

    def heartbeat(self, record, rank: int, iterations) -> None:
        if iterations and rank == min(record.membership.ranks):
            self.watch.iterations_reported(record.job, iterations)

    def stop_requested(self, peer: RpcPeer, req: dict) -> None:
        """POOL stop (the operator credential was checked at the gate): answer, then stop."""
        if self.on_stop is None:
            raise ServiceError("this pMaster was not started by `pslink service up`; stop it where it runs")
        log.warning("pMaster: stop requested from %s", peer.conn.peer)
        peer.reply(req, body={"stopping": self.master.address})
        # A moment after the reply is on its way (the stop tears this loop down), from a thread of
        # its own (it joins this loop's thread).
        self.master.reactor.call_later(0.1, lambda: threading.Thread(target=self.on_stop, name="pslink-stop",
                                                                     daemon=True).start())

    def close(self) -> None:
        if self.http is not None:
            self.http.close()
