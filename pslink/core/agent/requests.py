"""An Agent's requests in flight (one per part: :class:`PartRequest`) and the Aggregator
connections they wait on (:class:`Link`).

A request is sent on the link to the Aggregator its part lives on and stays in the table until
its answer comes, or until it fails. Probes, every ``probe_interval``: a link that owes answers
and has been quiet gets a PING; one that stays silent past ``peer_timeout`` fails its requests;
with faults injected (``resend_timeout``), a request unanswered that long is sent again, with the
same id (the Aggregator applies it once). A request that cannot be sent (its Aggregator is gone,
maybe not noticed yet) is handed to ``on_lost``, the Agent's failover.

Fusion (``fusion_bytes`` > 0): a small data request (below FUSE_BELOW) for an Aggregator that
already owes this Agent FUSE_AFTER answers (a burst, not a sliding window of a few) waits in the
link's outbox, and the outbox travels as one FUSED message (pslink.core.transport.fused) when it
holds ``fusion_bytes`` or MAX_FUSED_ITEMS requests, when an answer comes on that link, when a
thread waits for a handle, or ``fusion_cycle`` seconds after its first request (seen when the
reactor next runs: within the Driver's idle poll, 2 ms, while requests are in flight), whichever
comes first. Fewer requests in flight go at once, so fusion never delays a lone request (the
latency of one request in flight is as it was) nor a short window's. Requests leave in the order
they were made (a large one sends the outbox before it).

The window (``link_window`` > 0): at most that many large requests (FUSE_BELOW bytes or more) are
in flight on a link that crosses the network; the next waits, in order, for an answer. Over a
link between two hosts each direction carries two TCP streams of a job (a worker's pushes, the
other host's Aggregator's sums), and in a deep queue the one with the larger window takes the
larger share: when the sums win, the pushes they depend on come late on both hosts, and the
link idles at the step's end (measured: 5 of 20 DDP steps 20-40 ms slower at 1 Gbit/s). With a
few requests each in flight both streams share the link evenly, as BytePS's scheduling credit
does. Links to Aggregators on this host are not limited.
"""

from __future__ import annotations

import collections
import itertools
import logging
import threading
from typing import Callable

from pslink.core.agent.handle import Handles
from pslink.core.agent.seat import Seat
from pslink.core.faults import Faults
from pslink.core.transport import Connection, Handler, Transports
from pslink.core.wire.loop import Reactor
from pslink.core.transport.fused import FUSE_BELOW, MAX_FUSED_ITEMS, fuse

FUSE_AFTER = 8  # requests of ours in flight on a link before the next small one waits to be fused
from pslink.core.wire.protocol import DATA_OPS, Limits, Op, encode
from pslink.errors import PeerError, PslinkError

log = logging.getLogger("pslink.core.agent")


class Link:
    """The connection to one Aggregator and the requests waiting on it."""

    __slots__ = ("name", "address", "conn", "last_heard", "ping_sent", "pending", "error", "outbox", "outbox_bytes",
                 "flush_due", "window", "in_window", "held")

    def __init__(self, name: str, address: str, conn: Connection | None, now: float, error: str | None = None):
        self.name, self.address, self.conn = name, address, conn
        self.error = error  # with no ``conn``: why connecting failed
        self.last_heard = now
        self.ping_sent: float | None = None
        self.pending: set[int] = set()
        # Small requests waiting to travel fused (pslink.core.agent.requests): (id, frames) each.
        self.outbox: list[tuple[int, list]] = []
        self.outbox_bytes = 0
        self.flush_due = False  # a cycle timer will send the outbox
        # Large requests in flight on a network link, at most ``window`` (0: no limit; see
        # pslink.core.agent.requests); the ones past it wait in ``held``, in order.
        self.window = 0
        self.in_window = 0
        self.held: collections.deque = collections.deque()


class PartRequest:
    """One part of a request in flight, with what it takes to send it again elsewhere (a task
    that migrated answers with its new place)."""

    __slots__ = ("handle", "link", "nbytes", "dest", "array", "average", "op", "info", "part", "round",
                 "payload", "flat_out", "moves", "covers", "frames", "sent", "window_link", "held")

    def __init__(self, handle, link, nbytes, dest, array, average, op, info, part, round_, payload, flat_out, moves,
                 covers=None):
        self.handle, self.link, self.nbytes = handle, link, nbytes
        self.dest, self.array, self.average = dest, array, average
        self.op, self.info, self.part, self.round = op, info, part, round_
        self.payload, self.flat_out, self.moves = payload, flat_out, moves
        self.covers = covers  # the ranks a host's leader pushes for (pslink.core.agent.host_reduce)
        self.frames: list | None = None  # what was sent: sent again as it is (same id) if no answer comes
        self.sent = 0.0
        self.window_link: Link | None = None  # the link whose window this request counts in
        self.held = False  # ... waiting there for room, not sent yet


MAX_MOVES = 8  # a request that keeps meeting "moved" answers gives up with the last one


def fenced_pause(moves: int) -> float:
    """Seconds before a request told "ask pMaster again" (FencedError) for the ``moves``-th time
    asks: at once the first time (a lease that ran out: pMaster knows the new place), then
    50 ms doubling to 1 s (a failover whose promotion is not done yet), so that the MAX_MOVES
    tries span seconds instead of a burst of round trips."""
    return 0.0 if moves <= 1 else min(0.05 * 2 ** (moves - 2), 1.0)


#: Called with the link a request could not be sent on, why, and the request ids.
LostCallback = Callable[[Link, PslinkError, list], None]


class Requests:
    """The table of requests in flight and the links to Aggregators (connected through
    ``transports`` with ``handler`` receiving on them: the Agent)."""

    def __init__(self, seat: Seat, transports: Transports, reactor: Reactor, handler: Handler, limits: Limits,
                 handles: Handles, *, connect_timeout: float, peer_timeout: float, probe_interval: float,
                 resend_timeout: float | None, faults: Faults | None, clock: Callable[[], float],
                 fusion_bytes: int = 0, fusion_cycle: float = 0.001, link_window: int = 0,
                 on_lost: LostCallback | None = None):
        self.seat = seat
        self.transports, self.reactor, self.handler, self.limits = transports, reactor, handler, limits
        self.handles = handles
        self.connect_timeout = connect_timeout
        self.peer_timeout = peer_timeout
        self.probe_interval = probe_interval
        self.resend_timeout = resend_timeout
        self.faults = faults
        self.clock = clock
        self.pending: dict[int, PartRequest] = {}
        # When the last request in flight was answered, and how long no request was in flight
        # before the current burst began (ms; None before the second burst): the worker's compute
        # between two exchanges, told to the Aggregators with each push (a move's copies go in it).
        self._idle_since: float | None = None
        self.burst_idle_ms: int | None = None
        self.ids = itertools.count(1)
        self.links: dict[str, Link] = {}
        self.by_conn: dict[Connection, Link] = {}
        self._link_lock = threading.Lock()
        self._warming: set[str] = set()  # Aggregators being connected to ahead of use
        self._warmed: dict[str, Connection] = {}  # ... and the connection made ready for each
        self.to_warm: dict[str, str] = {}  # ... once no request is in flight (name -> address)
        self.fusion_bytes, self.fusion_cycle = fusion_bytes, fusion_cycle
        self._fuse_lock = threading.Lock()  # outboxes, and the order requests leave in
        self.link_window = link_window
        self._window_lock = threading.Lock()  # the links' windows and what waits for room in them
        # Without a failover a lost link's requests fail.
        self.on_lost: LostCallback = on_lost or (lambda link, error, rids: self.fail(rids, error))
        self.closed = False
        reactor.call_later(probe_interval, self._probe)

    # -- links ------------------------------------------------------------------------------------

    def link(self, name: str, address: str) -> Link:
        """The connection to Aggregator ``name`` at ``address``, made on first use (raises
        PeerError when it cannot be)."""
        link = self.links.get(name)
        if link is not None and not link.conn.closed:
            return link
        with self._link_lock:
            link = self.links.get(name)
            if link is None or link.conn.closed or link.address != address:
                conn = self.transports.connect(address, self.reactor, self.handler, self.limits, self.connect_timeout)
                link = Link(name, address, conn, self.clock())
                if getattr(conn, "over_network", False):
                    link.window = self.link_window
                self.links[name] = link
                self.by_conn[conn] = link
            return link

    def warm(self, name: str, address: str) -> None:
        """A part is about to move to Aggregator ``name`` (its Aggregator said so in a reply):
        connect once no request is in flight (the worker computes then: :meth:`warm_now`)."""
        link = self.links.get(name)
        if (link is None or self._warmed.get(name) is not link.conn) and name not in self._warming:
            self.to_warm[name] = address  # (a link made for small payloads has no ring yet)

    def warm_now(self) -> None:
        """Connect to the Aggregators :meth:`warm` named, in the background, and have both
        directions' rings made with their pages in place. Made at the first request there
        instead, they cost the job's first round at the new place a page fault per page of each
        ring (about 9 ms per 16 MiB ring, each side, on the machines we measured)."""
        with self._link_lock:
            chosen, self.to_warm = self.to_warm, {}
            chosen = {name: address for name, address in chosen.items() if name not in self._warming}
            if self.closed:
                return
            self._warming.update(chosen)
        for name, address in chosen.items():
            self._connect_ahead(name, address)

    def _connect_ahead(self, name: str, address: str) -> None:
        def connect():
            try:
                conn = self.link(name, address).conn
                conn.warm()
                conn.send([encode(Op.PING, id=0, warm=True)])  # and the Aggregator its ring to this worker
                self._warmed[name] = conn
            except PslinkError as exc:  # the first request there connects (and says what is wrong)
                log.debug("agent: connecting ahead to %s at %s failed: %s", name, address, exc)
            finally:
                with self._link_lock:
                    self._warming.discard(name)

        threading.Thread(target=connect, name=f"pslink-connect-{name}", daemon=True).start()

    def closed_link(self, conn: Connection) -> Link | None:
        """``conn`` closed: forget its link (returned, with the requests still waiting on it)."""
        link = self.by_conn.pop(conn, None)
        if link is not None:
            self._drop_outbox(link)  # its requests are still pending: failover sends them elsewhere
            with self._link_lock:
                if self.links.get(link.name) is link:
                    del self.links[link.name]
        return link

    def close_links(self) -> None:
        with self._link_lock:
            links, self.links = list(self.links.values()), {}
        for link in links:
            link.conn.close()

    # -- requests ---------------------------------------------------------------------------------

    def add(self, request: PartRequest) -> int:
        rid = next(self.ids)
        if not self.pending and self._idle_since is not None:
            self.burst_idle_ms = int((self.clock() - self._idle_since) * 1000)
        self.pending[rid] = request
        request.link.pending.add(rid)
        return rid

    def take(self, rid: int) -> PartRequest | None:
        """The request ``rid`` answered: out of the table (None if it was not in it)."""
        request = self.pending.pop(rid, None)
        if request is not None:
            request.link.pending.discard(rid)
            if not self.pending:
                self._idle_since = self.clock()
            if request.window_link is not None:  # (set and cleared on the reactor's thread once sent)
                self._leave_window(request)
        return request

    def transmit(self, rid: int, request: PartRequest, frames: list) -> None:
        request.frames = frames
        link = request.link
        if request.window_link is not link and request.window_link is not None:
            self._leave_window(request)  # sent elsewhere now (failover): out of the old link's window
        if link.window and request.nbytes >= FUSE_BELOW and request.op in DATA_OPS:
            with self._window_lock:
                if request.held:
                    return  # already waiting for room: it goes in its turn
                if request.window_link is None:  # (else sent again, as it was: it counts already)
                    request.window_link = link
                    if link.in_window >= link.window or link.held:
                        request.held = True
                        link.held.append((rid, request))
                        return
                    link.in_window += 1
        self._send(rid, request, frames)

    def _leave_window(self, request: PartRequest) -> None:
        """``request`` no longer counts in its link's window: the next ones waiting there go."""
        ready = []
        with self._window_lock:
            link = request.window_link
            if link is None:
                return
            if request.held:
                link.held = collections.deque(entry for entry in link.held if entry[1] is not request)
            else:
                link.in_window -= 1
            request.window_link, request.held = None, False
            while link.held and link.in_window < link.window:
                rid, waiting = link.held.popleft()
                waiting.held = False
                link.in_window += 1
                ready.append((rid, waiting))
        for rid, waiting in ready:
            self._send(rid, waiting, waiting.frames)

    def _send(self, rid: int, request: PartRequest, frames: list) -> None:
        request.sent = self.clock()
        link = request.link
        if self.fusion_bytes and link.conn is not None:
            if request.nbytes < FUSE_BELOW and request.op in DATA_OPS and len(frames) <= 2:
                self._fuse(link, rid, frames, request.nbytes)
                return
            with self._fuse_lock:  # what waits in the outbox leaves first
                rids = [r for r, _ in link.outbox]
                lost = self._send_outbox(link)
                if lost is None:
                    rids, lost = [rid], self._write(link, frames)
                else:
                    rids.append(rid)  # the link is gone: this one with them
            if lost is not None:
                self.on_lost(*lost, rids)
            return
        error = self._write(link, frames)
        if error is not None:
            self.on_lost(*error, [rid])

    def _write(self, link: Link, frames: list) -> tuple[Link, PslinkError] | None:
        try:
            if link.conn is None:
                raise PeerError(link.error or "not connected")
            if self.faults is not None:
                self.faults.send(link.conn, frames)
            else:
                link.conn.send(frames)
        except PslinkError as exc:
            # The Aggregator is gone (maybe not noticed yet): ask where the part went.
            return link, PeerError(f"cannot reach aggregator {link.name} at {link.address}: {exc.message}")
        return None

    # -- fusion -----------------------------------------------------------------------------------

    def _fuse(self, link: Link, rid: int, frames: list, nbytes: int) -> None:
        with self._fuse_lock:
            if not link.outbox and len(link.pending) <= FUSE_AFTER:
                # Few of ours in flight there: this one goes at once. The Aggregator works on one
                # while we send the next, and answers each as it is done; holding a sliding
                # window's few requests back to fuse them made the two sides take turns instead
                # (4 KiB pushpulls, 4 in flight: 105 -> 75 MB/s). A burst fuses past the first few.
                lost = self._write(link, frames)
                rids = [rid]
            else:
                link.outbox.append((rid, frames))
                link.outbox_bytes += nbytes
                if link.outbox_bytes < self.fusion_bytes and len(link.outbox) < MAX_FUSED_ITEMS:
                    if not link.flush_due:
                        link.flush_due = True
                        # Not worth a wake-up of the reactor (a system call per fused message):
                        # an Agent with requests in flight drives its reactor every idle_poll
                        # (2 ms) at the latest, and an answer or a wait sends the outbox sooner.
                        self.reactor.call_later(self.fusion_cycle, self._cycle_ends, link, wake=False)
                    return
                rids = [r for r, _ in link.outbox]
                lost = self._send_outbox(link)
        if lost is not None:
            self.on_lost(*lost, rids)

    def _send_outbox(self, link: Link) -> tuple[Link, PslinkError] | None:
        """(Fuse lock held.) Send the link's outbox: one request as it is, more as one FUSED message."""
        batch = link.outbox
        if not batch:
            return None
        link.outbox, link.outbox_bytes = [], 0
        return self._write(link, batch[0][1] if len(batch) == 1 else fuse([frames for _, frames in batch]))

    def flush_link(self, link: Link) -> None:
        """Send what waits in ``link``'s outbox now."""
        with self._fuse_lock:
            rids = [rid for rid, _ in link.outbox]
            lost = self._send_outbox(link)
        if lost is not None:
            self.on_lost(*lost, rids)

    def flush(self) -> None:
        """Send every outbox now (a thread is about to wait for an answer)."""
        for link in list(self.links.values()):
            if link.outbox:
                self.flush_link(link)

    def _cycle_ends(self, link: Link) -> None:
        link.flush_due = False
        if link.outbox:
            self.flush_link(link)

    def _drop_outbox(self, link: Link) -> None:
        with self._fuse_lock:
            link.outbox, link.outbox_bytes = [], 0

    def fail(self, rids: list[int], error: PslinkError) -> None:
        for rid in rids:
            request = self.take(rid)
            if request is not None:
                self.handles.complete(request.handle, error)

    # -- probes -----------------------------------------------------------------------------------

    def _probe(self) -> None:
        """Ping Aggregators that owe answers and have been quiet; give up on the silent."""
        if self.closed:
            return
        try:
            now = self.clock()
            if self.resend_timeout:
                for rid, request in list(self.pending.items()):
                    conn = request.link.conn
                    if conn is None or conn.closed:
                        continue  # its Aggregator is lost: the relocation under way sends it again
                    if request.frames is not None and now - request.sent > self.resend_timeout:
                        self.transmit(rid, request, request.frames)
            for link in list(self.links.values()):
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
            self.reactor.call_later(self.probe_interval, self._probe)

    def _give_up(self, link: Link, silent_for: float) -> None:
        """A silent Aggregator (frozen, or cut off): its requests go where pMaster says (which
        fails it over once its lease ran out, see pslink.core.aggregator.master_link)."""
        error = PeerError(
            f"aggregator {link.name} at {link.address} did not answer for {silent_for:.1f} s "
            f"(job {self.seat.job!r}, rank {self.seat.rank})", peer=link.address,
        )
        log.error("%s; %d request(s) go where pMaster says its parts are", error, len(link.pending))
        self.by_conn.pop(link.conn, None)
        self._drop_outbox(link)
        with self._link_lock:
            if self.links.get(link.name) is link:
                del self.links[link.name]
        link.conn.close()
        self.on_lost(link, error, list(link.pending))

    def put_back(self, rid: int, request: PartRequest) -> None:
        """A request taken for its answer goes again (the answer said: ask pMaster)."""
        self.pending[rid] = request
        request.link.pending.add(rid)
