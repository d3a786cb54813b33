"""Who reads an Agent's sockets, and how it notices a silent Aggregator (a mixin of
:class:`pslink.core.agent.Agent`).

Whoever waits drives the I/O: ``Handle.wait`` reads the sockets on the calling thread, spinning
briefly before it blocks, because handing a reply from an I/O thread to a waiting thread costs
more than a whole round trip on a virtual machine. A background thread drives only when nobody
waits: for handles with callbacks, heartbeats and liveness probes. Probes ping an Aggregator that
owes answers and has been quiet, and fail its requests once it stays silent past
``peer_timeout``.
"""

from __future__ import annotations

import logging
import time

from pslink.core.agent.keys import Link
from pslink.core.agent.handle import Handle
from pslink.core.wire.protocol import Op, encode
from pslink.errors import PeerError, PslinkError, PslinkTimeoutError

log = logging.getLogger("pslink.core.agent.agent")


class Driving:
    """Requires of its host: ``_reactor``, ``_lock``, ``_bg_cv``, ``_waiters``, ``_async``,
    ``_activity``, ``_pending``, ``_links``, ``_conn_links``, ``_link_lock``, ``_transmit``,
    ``_fail_requests``, ``_closed``, its timing settings (``clock``, ``timeout``, ``spin``,
    ``idle_poll``, ``resend_timeout``, ``peer_timeout``, ``probe_interval``) and its identity."""

    def _probe(self) -> None:
        """Ping Aggregators that owe us answers and have been quiet; give up on the silent."""
        if self._closed:
            return
        try:
            now = self.clock()
            if self.resend_timeout:
                for rid, request in list(self._pending.items()):
                    conn = request.link.conn
                    if conn is None or conn.closed:
                        continue  # its Aggregator is lost: the relocation under way sends it again
                    if request.frames is not None and now - request.sent > self.resend_timeout:
                        self._transmit(rid, request, request.frames)
            for link in list(self._links.values()):
                if not link.pending:
                    link.ping_sent = None
                elif link.ping_sent is not None:
                    if now - link.ping_sent > self.peer_timeout:
                        self._give_up(link, now - link.last_heard)
                elif now - link.last_heard > min(self.peer_timeout / 2, 1.0):
                    link.ping_sent = now
                    try:
                        link.conn.send([encode(Op.PING, id=0)])
                    except PslinkError:
                        pass
        finally:
            self._reactor.call_later(self.probe_interval, self._probe)

    def _give_up(self, link: Link, silent_for: float) -> None:
        error = PeerError(
            f"aggregator {link.name} at {link.address} did not answer for {silent_for:.1f} s "
            f"(job {self.job!r}, rank {self.rank}); {len(link.pending)} request(s) failed",
            peer=link.address,
        )
        log.error("%s", error)
        self._conn_links.pop(link.conn, None)
        with self._link_lock:
            if self._links.get(link.name) is link:
                del self._links[link.name]
        link.conn.close()
        self._fail_requests(list(link.pending), error)

    def _wait(self, handle: Handle, timeout: float | None) -> None:
        timeout = self.timeout if timeout is None else timeout
        deadline = self.clock() + timeout
        reactor = self._reactor
        with self._lock:
            self._waiters += 1
        try:
            while handle._left:
                if self.clock() >= deadline:
                    raise PslinkTimeoutError(
                        f"{handle._describe_wait()} not done after {timeout:g} s "
                        f"(job {self.job!r}, rank {self.rank})",
                        job=self.job,
                    )
                if reactor.try_drive():
                    try:
                        while handle._left:
                            remaining = deadline - self.clock()
                            if remaining <= 0:
                                break
                            reactor.run_once(remaining, self.spin)
                    finally:
                        reactor.release()
                else:
                    # Someone else drives (maybe the background thread, blocked in poll).
                    event = handle._parking_event()
                    if handle._left:
                        reactor.wake()
                        reactor.park(event, min(deadline - self.clock(), 0.05))
        finally:
            with self._lock:
                self._waiters -= 1
                self._activity = self.clock()
                # Callbacks have nobody to wait for them: hand over now. Plain requests still in
                # flight need no wake-up here (one per wait cost more than the wait on these VMs;
                # their waiter is usually back within microseconds): the background thread looks
                # again within idle_poll, as it does below while a thread waits.
                if not self._waiters and self._async:
                    self._bg_cv.notify()

    def _background(self) -> None:
        """Drive when no thread waits: callbacks, heartbeats, probes, forgotten replies."""
        reactor = self._reactor
        while True:
            with self._lock:
                while True:
                    if self._closed:
                        return
                    if not self._waiters:
                        due = reactor.next_deadline()
                        now = self.clock()
                        if self._async or reactor.has_posted or (due is not None and due <= now):
                            break
                        if self._pending:
                            # Plain handles: their waiter usually comes within microseconds and
                            # drives faster than we could; step in only once things went quiet.
                            quiet = now - self._activity
                            if quiet >= self.idle_poll:
                                break
                            self._bg_cv.wait(self.idle_poll - quiet)
                            continue
                        self._bg_cv.wait(None if due is None else due - now)
                    else:
                        self._bg_cv.wait(self.idle_poll)
            if not reactor.try_drive():
                time.sleep(self.idle_poll)
                continue
            try:
                due = reactor.next_deadline()
                slice_ = 0.05 if self._async else (self.idle_poll if self._pending else 0.0)
                if due is not None:
                    slice_ = min(slice_, max(0.0, due - self.clock()))
                reactor.run_once(slice_, 0.0)
            finally:
                reactor.release()
