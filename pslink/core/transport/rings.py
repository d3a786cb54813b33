"""The shared-memory side of a same-host connection (see ``shm.py``): :class:`Rings`, which a
:class:`~pslink.core.transport.stream.TcpConnection` over a Unix socket owns, kept apart so the
stream's own logic reads on its own. It writes through the connection's stream interface
(:class:`Stream`: ``write_lock``, ``output_queued``, ``write_now``, ``queue_rest``, ``fail``) and
keeps the rings, the descriptors received for them and the messages held back for ring room."""

from __future__ import annotations

import array
import collections
import logging
import os
import socket
import threading
from typing import Protocol

from pslink.core.transport.framing import (
    _LOCATION,
    _PREFIX0,
    FRAMING_RING,
    FRAMING_RING_OPEN,
    MAGIC,
    PREFIX,
    frame_prefix,
)
from pslink.core.transport.shm import (
    INLINE,
    MIN_PAYLOAD,
    ReceiveRing,
    SendRing,
)
from pslink.core.wire.loop import Reactor
from pslink.errors import PeerError, ProtocolError

log = logging.getLogger("pslink.core.transport.tcp")

HOLD_POLL = 200e-6  # how often the reactor looks for ring room while it holds a message back


class Stream(Protocol):
    """What the rings need of the connection that owns them: its socket (to hand a ring's
    descriptor over), its reactor, and its way of writing frames in order. Named here, not
    imported, because the connection (stream.py) owns and imports the rings."""

    sock: socket.socket
    reactor: Reactor
    peer: str

    @property
    def write_lock(self) -> threading.Lock: ...

    @property
    def closed(self) -> bool: ...

    def output_queued(self) -> bool: ...

    def write_now(self, parts: list) -> None: ...

    def queue_rest(self, parts: list, sent: int) -> None: ...

    def fail(self, exc: BaseException) -> None: ...


class Rings:
    """Large payloads of one connection through its ring, and the peer's out of the peer's.
    ``allowed``: this side may make a ring (Linux on x86-64, not turned off); it takes the
    peer's ring in any case. ``ring_bytes``: the size of the ring it makes; ``wait``: how long a
    payload waits for room (``TransportOptions.ring_wait``)."""

    def __init__(self, conn: Stream, allowed: bool, ring_bytes: int, wait: float):
        self.conn = conn
        self.allowed = allowed
        self.ring_bytes = ring_bytes
        self.wait = wait
        self.out: SendRing | None = None
        self.inp: ReceiveRing | None = None
        self.fds: list[int] = []  # descriptors received, for the ring frames that follow them
        self.held: collections.deque = collections.deque()  # messages waiting for ring room
        self.held_until: float | None = None  # when the first of them stops waiting

    # -- sending ------------------------------------------------------------------------------

    def payload_in_place(self, nbytes: int) -> bool:
        return self.allowed and nbytes >= MIN_PAYLOAD

    def send(self, header: bytes, payloads: list) -> None:
        """Send a message whose large payloads go through the ring (those that fit).

        A full ring means the peer is behind; on a host short of cores, behind because it needs
        the CPU this side holds. Sending the payload on the socket instead costs both sides about
        four times the CPU, so a message first waits (up to ``ring_wait``) for room: an
        application thread sleeps for it; the reactor's thread, which serves every connection,
        holds the message back (and what follows it) and looks again on a timer."""
        conn, reactor = self.conn, self.conn.reactor
        ring = self.out
        if ring is not None and self.wait and not conn.output_queued() and not self.held \
                and not reactor.in_callback():
            # Without the write lock: the reactor may need it to flush what the peer reads first.
            ring.wait_for_room(_ring_sizes(payloads), self.wait)
        with conn.write_lock:
            if conn.closed:
                raise PeerError(f"connection to {conn.peer} is closed", peer=conn.peer)
            if self.held:
                self.held.append((header, payloads))
                return
            ring = self.out if self.out is not None else self._open()
            if ring is not None and self.wait and reactor.in_callback() \
                    and not ring.fits(sizes := _ring_sizes(payloads)) and max(sizes) <= ring.capacity:
                self.held.append((header, payloads))
                self.held_until = reactor.clock() + self.wait
                reactor.call_later(HOLD_POLL, self._release_held)
                return
            conn.write_now(self._ring_parts(ring, header, payloads))

    def _ring_parts(self, ring: SendRing | None, header: bytes, payloads: list) -> list:
        """(Write lock held.) Place what fits in the ring; the frame and what goes on the socket."""
        positions = [ring.place(p) if ring is not None and len(p) >= MIN_PAYLOAD else INLINE for p in payloads]
        if all(pos == INLINE for pos in positions):  # no ring, or no room in it: all on the socket
            return [frame_prefix(header, payloads) + header, *(p for p in payloads if len(p))]
        prefix = PREFIX.pack(MAGIC, FRAMING_RING, len(payloads), len(header)) + b"".join(
            _LOCATION.pack(len(p), pos) for p, pos in zip(payloads, positions))
        return [prefix + header, *(p for p, pos in zip(payloads, positions) if pos == INLINE and len(p))]

    def _release_held(self) -> None:
        """(Reactor.) Send the messages held back for ring room, in order, as room comes; past
        the wait, a payload that still does not fit goes on the socket."""
        conn = self.conn
        try:
            with conn.write_lock:
                while self.held and not conn.closed:
                    item = self.held[0]
                    if type(item) is list:  # a message without ring payloads, queued behind
                        self.held.popleft()
                        conn.write_now(item)
                        continue
                    header, payloads = item
                    ring = self.out
                    if ring is not None and not ring.fits(_ring_sizes(payloads)):
                        now = conn.reactor.clock()
                        if self.held_until is None:
                            self.held_until = now + self.wait
                        if now < self.held_until:
                            conn.reactor.call_later(HOLD_POLL, self._release_held)
                            return
                    self.held.popleft()
                    self.held_until = None
                    conn.write_now(self._ring_parts(ring, header, payloads))
        except PeerError:
            pass  # the connection failed: write_now posted its teardown

    def _open(self) -> SendRing | None:
        """(Write lock held.) Make this direction's ring and hand it to the peer, or None: the
        descriptor must go with bytes written now, so not while older output is queued."""
        conn = self.conn
        if conn.output_queued() or self.held:
            return None
        try:
            ring = SendRing(self.ring_bytes)
        except (OSError, ValueError) as exc:  # no memory for it
            log.warning("connection to %s: no shared-memory ring (%s); large payloads stay on the socket",
                        conn.peer, exc)
            self.allowed = False
            return None
        frame = _PREFIX0.pack(MAGIC, FRAMING_RING_OPEN, 0, 8) + ring.announcement()
        try:
            sent = conn.sock.sendmsg([frame], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [ring.fd]))])
        except BlockingIOError:
            sent = 0
        except OSError as exc:
            ring.close()
            conn.reactor.post(conn.fail, PeerError(f"lost connection to {conn.peer}: {exc}"))
            raise PeerError(f"lost connection to {conn.peer}: {exc}", peer=conn.peer) from None
        if sent == 0:  # the socket is full: try again with a later payload
            ring.close()
            return None
        ring.release_fd()  # the peer holds its own copy now
        if sent < len(frame):
            conn.queue_rest([frame], sent)
        self.out = ring
        return ring

    # -- receiving (driving thread) -----------------------------------------------------------

    def keep_fds(self, ancillary: list, flags: int) -> None:
        for level, kind, data in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds = array.array("i")
                fds.frombytes(data[: len(data) - len(data) % fds.itemsize])
                self.fds.extend(fds)
        if flags & socket.MSG_CTRUNC:
            raise ProtocolError(f"bad frame from {self.conn.peer}: it sent more descriptors than a ring needs")

    def warm(self) -> None:
        """Make this direction's ring now, its pages in place, instead of at the first large
        payload (a worker about to send a part to an Aggregator it never used: see
        :meth:`pslink.core.agent.requests.Requests.warm`)."""
        if not self.allowed:
            return
        with self.conn.write_lock:
            ring = self.out if self.out is not None else self._open()
        if ring is not None:
            ring.populate(write=True)

    def open_peer(self, announcement: bytes) -> None:
        """The peer made its ring: map it (the descriptor came with this frame's bytes)."""
        peer = self.conn.peer
        if not self.fds:
            raise ProtocolError(f"bad frame from {peer}: a ring was announced without its descriptor")
        if self.inp is not None:
            raise ProtocolError(f"bad frame from {peer}: a second ring for one direction")
        fd = self.fds.pop(0)
        try:
            self.inp = ReceiveRing(fd, int.from_bytes(announcement, "little"), peer)
            self.inp.populate(write=False)  # mapped once, not page by page under the first payloads
        except OSError as exc:
            raise ProtocolError(f"bad frame from {peer}: its ring cannot be mapped ({exc})") from None
        finally:
            os.close(fd)

    def take(self, sizes: tuple, positions: tuple, dests: list, lent, discard: bool) -> tuple:
        """Copy a message's ring payloads into ``dests`` (or lend them in place, marking ``lent``);
        returns the sizes still to read from the stream (0 for those the ring held)."""
        ring = self.inp
        stream = list(sizes)
        for i, position in enumerate(positions):
            if position != INLINE:
                if ring is None:
                    raise ProtocolError(f"bad frame from {self.conn.peer}: payloads in a ring it never handed over")
                if lent is not None:
                    dests[i] = ring.lend(position, stream[i])
                    lent.lent[i] = True
                else:
                    ring.take(position, stream[i], None if discard else dests[i])
                stream[i] = 0
        return tuple(stream)

    def settle(self) -> None:
        """The handler is done with what it read in place."""
        if self.inp is not None:
            self.inp.settle()

    def close(self) -> None:
        """(The connection is closed.) Unmap both rings, close descriptors never used."""
        with self.conn.write_lock:
            out, self.out = self.out, None
        for ring in (out, self.inp):
            if ring is not None:
                ring.close()
        self.inp = None
        fds, self.fds = self.fds, []
        for fd in fds:
            os.close(fd)



def _ring_sizes(payloads: list) -> list[int]:
    """The sizes of a message's payloads that go through a ring, when there is room."""
    return [len(p) for p in payloads if len(p) >= MIN_PAYLOAD]
