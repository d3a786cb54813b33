"""The shared-memory side of a same-host connection (see ``shm.py``): a mixin of
:class:`~pslink.core.transport.tcp.TcpConnection`, kept apart so the stream's own logic reads on
its own. It uses the connection's socket, write lock and queues, and its rings."""

from __future__ import annotations

import array
import logging
import os
import socket

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
    ring_bytes,
    ring_wait,
)
from pslink.errors import ConfigError, PeerError, ProtocolError

log = logging.getLogger("pslink.core.transport.tcp")

HOLD_POLL = 200e-6  # how often the reactor looks for ring room while it holds a message back


class RingSide:
    """Sending large payloads through this connection's ring, and taking them out of the peer's."""

    # -- sending ------------------------------------------------------------------------------

    def _wait_setting(self) -> float:
        """``PSLINK_SHM_WAIT_MS``; a bad one is said, as a bad ring size is, and nothing waits."""
        try:
            return ring_wait()
        except ConfigError as exc:
            log.warning("connection to %s: %s; large payloads do not wait for ring room", self.peer, exc)
            return 0.0

    def payload_in_place(self, nbytes: int) -> bool:
        return self._rings_allowed and nbytes >= MIN_PAYLOAD

    def _send_with_ring(self, header: bytes, payloads: list) -> None:
        """Send a message whose large payloads go through the ring (those that fit).

        A full ring means the peer is behind; on a host short of cores, behind because it needs
        the CPU this side holds. Sending the payload on the socket instead costs both sides about
        four times the CPU, so a message first waits (up to ``PSLINK_SHM_WAIT_MS``) for room: an
        application thread sleeps for it; the reactor's thread, which serves every connection,
        holds the message back (and what follows it) and looks again on a timer."""
        ring = self._ring_out
        if ring is not None and self._ring_wait and not self._wq and not self._held \
                and not self.reactor.in_callback():
            # Without the write lock: the reactor may need it to flush what the peer reads first.
            ring.wait_for_room(_ring_sizes(payloads), self._ring_wait)
        with self._wlock:
            if self._closed:
                raise PeerError(f"connection to {self.peer} is closed", peer=self.peer)
            if self._held:
                self._held.append((header, payloads))
                return
            ring = self._ring_out if self._ring_out is not None else self._open_ring()
            if ring is not None and self._ring_wait and self.reactor.in_callback() \
                    and not ring.fits(sizes := _ring_sizes(payloads)) and max(sizes) <= ring.capacity:
                self._held.append((header, payloads))
                self._held_until = self.reactor.clock() + self._ring_wait
                self.reactor.call_later(HOLD_POLL, self._release_held)
                return
            self._write(self._ring_parts(ring, header, payloads))

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
        try:
            with self._wlock:
                while self._held and not self._closed:
                    item = self._held[0]
                    if type(item) is list:  # a message without ring payloads, queued behind
                        self._held.popleft()
                        self._write_now(item)
                        continue
                    header, payloads = item
                    ring = self._ring_out
                    if ring is not None and not ring.fits(_ring_sizes(payloads)):
                        now = self.reactor.clock()
                        if self._held_until is None:
                            self._held_until = now + self._ring_wait
                        if now < self._held_until:
                            self.reactor.call_later(HOLD_POLL, self._release_held)
                            return
                    self._held.popleft()
                    self._held_until = None
                    self._write_now(self._ring_parts(ring, header, payloads))
        except PeerError:
            pass  # the connection failed: _write posted its teardown

    def _open_ring(self) -> SendRing | None:
        """(Write lock held.) Make this direction's ring and hand it to the peer, or None: the
        descriptor must go with bytes written now, so not while older output is queued."""
        if self._wq or self._held:
            return None
        try:
            ring = SendRing(ring_bytes())
        except (OSError, ValueError, ConfigError) as exc:  # a bad setting, or no memory for it
            log.warning("connection to %s: no shared-memory ring (%s); large payloads stay on the socket",
                        self.peer, exc)
            self._rings_allowed = False
            return None
        frame = _PREFIX0.pack(MAGIC, FRAMING_RING_OPEN, 0, 8) + ring.announcement()
        try:
            sent = self.sock.sendmsg([frame], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [ring.fd]))])
        except BlockingIOError:
            sent = 0
        except OSError as exc:
            ring.close()
            self.reactor.post(self._fail, PeerError(f"lost connection to {self.peer}: {exc}"))
            raise PeerError(f"lost connection to {self.peer}: {exc}", peer=self.peer) from None
        if sent == 0:  # the socket is full: try again with a later payload
            ring.close()
            return None
        ring.release_fd()  # the peer holds its own copy now
        if sent < len(frame):
            self._queue_rest([frame], sent)
        self._ring_out = ring
        return ring

    # -- receiving (driving thread) -----------------------------------------------------------

    def _keep_fds(self, ancillary: list, flags: int) -> None:
        for level, kind, data in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds = array.array("i")
                fds.frombytes(data[: len(data) - len(data) % fds.itemsize])
                self._fds.extend(fds)
        if flags & socket.MSG_CTRUNC:
            raise ProtocolError(f"bad frame from {self.peer}: it sent more descriptors than a ring needs")

    def _open_peer_ring(self, announcement: bytes) -> None:
        """The peer made its ring: map it (the descriptor came with this frame's bytes)."""
        if not self._fds:
            raise ProtocolError(f"bad frame from {self.peer}: a ring was announced without its descriptor")
        if self._ring_in is not None:
            raise ProtocolError(f"bad frame from {self.peer}: a second ring for one direction")
        fd = self._fds.pop(0)
        try:
            self._ring_in = ReceiveRing(fd, int.from_bytes(announcement, "little"), self.peer)
        except OSError as exc:
            raise ProtocolError(f"bad frame from {self.peer}: its ring cannot be mapped ({exc})") from None
        finally:
            os.close(fd)

    def _take_from_ring(self) -> None:
        """Copy the message's ring payloads into their buffers; the rest come on the stream."""
        ring = self._ring_in
        stream = list(self._sizes)
        for i, position in enumerate(self._positions):
            if position != INLINE:
                if ring is None:
                    raise ProtocolError(f"bad frame from {self.peer}: payloads in a ring it never handed over")
                if self._lent is not None:
                    self._dests[i] = ring.lend(position, stream[i])
                    self._lent.lent[i] = True
                else:
                    ring.take(position, stream[i], None if self._discard else self._dests[i])
                stream[i] = 0
        self._sizes, self._positions = tuple(stream), None



def _ring_sizes(payloads: list) -> list[int]:
    """The sizes of a message's payloads that go through a ring, when there is room."""
    return [len(p) for p in payloads if len(p) >= MIN_PAYLOAD]
