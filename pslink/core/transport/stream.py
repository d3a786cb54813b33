"""One connection of the native framed TCP transport (``tcp.py``): the message stream.

Each message on the byte stream is::

    b"PL" | framing version (u8) | payload count (u8) | header length (u32 LE)
    payload sizes (u64 LE each) | header bytes | payload bytes, back to back

Why not ZeroMQ here (it is still a backend, ``zmq+tcp://``): libzmq moves every message through
its own I/O thread, and on virtual machines each of those thread wake-ups costs tens of
microseconds; a 4 KiB round trip measured 200-500 us through pyzmq against 40 us for this
transport (see docs/transport.md). Owning the stream also lets a payload be received straight into
its final buffer (the accumulator, or the caller's ``out`` array) with ``recv_into``, and sent
with ``sendmsg`` from the caller's array, so neither side copies a tensor in user space.
"""

from __future__ import annotations

import collections
import fcntl
import logging
import mmap
import socket
import struct
import termios
import threading
from collections.abc import Sequence

from pslink.core.transport.base import DISCARD, Connection, Handler, Lent
from pslink.core.wire.loop import Reactor
from pslink.core.wire.protocol import Limits, frame_limit
from pslink.core.transport.framing import (
    _FD_SPACE,
    _LOCATION,
    _PREFIX0,
    _PREFIX1,
    _PREFIX2,
    _SIZES_OF,
    FRAMING_RING,
    FRAMING_RING_OPEN,
    FRAMING_VERSION,
    MAGIC,
    PREFIX,
    SIZE,
    frame_prefix,
)
from pslink.core.transport.rings import Rings
from pslink.core.transport.options import TransportOptions
from pslink.core.transport.shm import MIN_PAYLOAD
from pslink.core.transport.tls import TlsSocket
from pslink.errors import PeerError, ProtocolError

log = logging.getLogger("pslink.core.transport.tcp")

READ_BUFFER = 256 * 1024  # small messages are parsed out of this buffer, many per recv
# Messages queued for a peer that does not read them: past this many pieces it is dropped (a
# peer that sends requests and never reads the replies would hold them all in our memory).
MAX_QUEUED_PARTS = 1 << 16
READ_BUDGET = 8 << 20  # bytes one readable callback may take before other sockets get a turn
MAX_IOV = 64  # buffers per sendmsg call (well under IOV_MAX)
# A Unix stream queues only its sender's buffer (about 200 KiB by default; TCP grows its own to
# MiBs): a 4 MiB part would take 20 writes and as many wake-ups of the reader.
LOCAL_SEND_BUFFER = 4 << 20
LOWAT_MAX = 256 * 1024  # the most a trickling TCP payload waits for before we read (see _wake_for)

_PREFIX, _SIZES, _HEADER, _PAYLOAD = range(4)


def _read_buffer() -> mmap.mmap:
    """A connection's read buffer: anonymous pages, so a connection holds only the pages it
    read into, and all of them go back to the kernel with it. (A bytearray came from malloc's
    heap, zeroed in full: thousands of short connections left hundreds of MiB behind.)"""
    return mmap.mmap(-1, READ_BUFFER)


class TcpConnection(Connection):
    """A framed message stream over one TCP socket (or a Unix one, to a peer on this host: then
    large payloads may cross through shared-memory rings, its :class:`Rings`)."""

    def __init__(
        self,
        sock: socket.socket,
        reactor: Reactor,
        handler: Handler,
        limits: Limits,
        peer: str,
        on_driver_thread: bool = False,
        options: TransportOptions = TransportOptions(),
    ):
        sock.setblocking(False)
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        elif sock.family == socket.AF_UNIX:
            # A Unix stream queues only its sender's buffer (about 200 KiB by default; TCP grows its
            # own to MiBs): a 4 MiB part would take 20 writes and as many wake-ups of the reader.
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, LOCAL_SEND_BUFFER)
            except OSError:
                pass  # the system's cap (net.core.wmem_max) applies
        self.sock = sock
        self._tls = isinstance(sock, TlsSocket)  # OpenSSL may hold decrypted bytes the poll cannot see
        self.over_network = sock.family in (socket.AF_INET, socket.AF_INET6)  # not a same-host Unix socket
        # SO_RCVLOWAT counts ciphertext under TLS, and OpenSSL reads whole records: plain TCP only.
        self._tcp = self.over_network and not self._tls
        self._lowat = 1  # SO_RCVLOWAT now (TCP: raised while a large payload trickles in)
        self.fd = sock.fileno()
        self.reactor = reactor
        self.handler = handler
        self.limits = limits
        self.peer = peer
        self._closed = False
        # read side (driving thread only)
        self._rbuf = _read_buffer()
        self._rmv = memoryview(self._rbuf)
        self._rpos = 0
        self._rlen = 0
        self._stage = _PREFIX
        self._nframes = 0
        self._hlen = 0
        self._sizes: tuple[int, ...] = ()
        self._big_header: bytearray | None = None
        self._state = None
        self._dests: list = []
        self._discard = False
        self._pi = 0  # payload index being filled
        self._dpos = 0  # bytes of it filled so far
        self._scratch: memoryview | None = None
        # write side (any thread, under the lock)
        self._wlock = threading.Lock()
        self._wq: collections.deque = collections.deque()
        self._writer_on = False
        # Same-host peers: large payloads go through shared-memory rings (shm.py). A Unix stream
        # is read with recvmsg, which takes a ring's descriptor; rings are made only where the
        # options allow them, but taken from any peer that makes one.
        local = sock.family == socket.AF_UNIX
        self._fds_expected = local
        allowed = local and options.uses_rings
        self.rings = Rings(self, allowed, options.ring_bytes, options.ring_wait if allowed else 0.0) if local else None
        self._framing = FRAMING_VERSION  # of the frame being read
        self._positions: tuple[int, ...] | None = None  # its payloads' ring positions, if any
        self._lent: Lent | None = None  # the handler reads this message's ring payloads in place
        if on_driver_thread:
            self.reactor.add_reader(self.fd, self._read_burst)
        else:
            self.reactor.post(self._register)

    def _register(self) -> None:
        if not self._closed:
            self.reactor.add_reader(self.fd, self._read_burst)

    @property
    def closed(self) -> bool:
        return self._closed

    def __repr__(self) -> str:
        return f"<TcpConnection {self.peer}{' closed' if self._closed else ''}>"

    # -- sending ------------------------------------------------------------------------------

    def send(self, frames: Sequence) -> None:
        header = frames[0]
        count = len(frames)
        if count == 1:
            parts = [_PREFIX0.pack(MAGIC, FRAMING_VERSION, 0, len(header)) + header]
        elif count == 2:  # a tensor message: the common case, without the general case's lists
            payload = frames[1]
            if type(payload) is not bytes:
                payload = memoryview(payload).cast("B")
            size = len(payload)
            if size >= MIN_PAYLOAD and self.rings is not None and self.rings.allowed:
                self.rings.send(header, [payload])
                return
            head = _PREFIX1.pack(MAGIC, FRAMING_VERSION, 1, len(header), size) + header
            parts = [head, payload] if size else [head]
        elif count == 3:  # keys and values, as every ps-lite KV message: the same, for two
            keys, values = frames[1], frames[2]
            if type(keys) is not bytes:
                keys = memoryview(keys).cast("B")
            if type(values) is not bytes:
                values = memoryview(values).cast("B")
            key_bytes, value_bytes = len(keys), len(values)
            if (self.rings is not None and self.rings.allowed
                    and (key_bytes >= MIN_PAYLOAD or value_bytes >= MIN_PAYLOAD)):
                self.rings.send(header, [keys, values])
                return
            head = _PREFIX2.pack(MAGIC, FRAMING_VERSION, 2, len(header), key_bytes, value_bytes) + header
            if key_bytes and value_bytes:
                parts = [head, keys, values]
            else:  # an empty part in the write queue would make sendmsg return 0 forever
                parts = [head, *(p for p in (keys, values) if len(p))]
        else:
            payloads = [p if type(p) is bytes else memoryview(p).cast("B") for p in frames[1:]]
            if self.rings is not None and self.rings.allowed and any(len(p) >= MIN_PAYLOAD for p in payloads):
                self.rings.send(header, payloads)
                return
            head = frame_prefix(header, payloads) + header
            # Empty payloads occupy no bytes on the stream (their size is in the prefix); an empty
            # part in the write queue would make sendmsg return 0 forever.
            parts = [head, *(p for p in payloads if len(p))]
        with self._wlock:
            if self._closed:
                raise PeerError(f"connection to {self.peer} is closed", peer=self.peer)
            # Sent at once, not held to share a sendmsg with the replies to other requests read
            # in the same burst: the peer handles this one while we handle the next (4 KiB
            # requests with 4 in flight went 1.5-2x faster than with replies coalesced).
            if self.rings is not None and self.rings.held:  # messages wait for ring room: this one after them
                self.rings.held.append(parts)
                return
            self.write_now(parts)

    # -- the stream, as Rings write through it ------------------------------------------------

    @property
    def write_lock(self) -> threading.Lock:
        return self._wlock

    def output_queued(self) -> bool:
        """(Write lock held.) Bytes wait to be written."""
        return bool(self._wq)

    def payload_in_place(self, nbytes: int) -> bool:
        return self.rings is not None and self.rings.payload_in_place(nbytes)

    def warm(self) -> None:
        if self.rings is not None:
            self.rings.warm()

    def sending(self) -> bool:
        if self._wq:
            return True
        try:
            return struct.unpack("i", fcntl.ioctl(self.sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0"))[0] > 0
        except OSError:
            return False

    def write_now(self, parts: list) -> None:
        """(Write lock held.) Write what the socket takes, queue the rest."""
        if self._wq:
            if len(self._wq) > MAX_QUEUED_PARTS:
                error = PeerError(f"{self.peer} does not read what it is sent ({len(self._wq)} messages queued); "
                                  "dropped", peer=self.peer)
                self.reactor.post(self.fail, error)
                raise error
            self._wq.extend(parts)
            return
        try:
            sent = self.sock.sendmsg(parts if len(parts) <= MAX_IOV else parts[:MAX_IOV])
        except BlockingIOError:
            sent = 0
        except OSError as exc:
            self.reactor.post(self.fail, PeerError(f"lost connection to {self.peer}: {exc}"))
            raise PeerError(f"lost connection to {self.peer}: {exc}", peer=self.peer) from None
        if sent == sum(map(len, parts)):
            return
        self.queue_rest(parts, sent)

    def queue_rest(self, parts: list, sent: int) -> None:
        """Queue what a write did not take, for the reactor's driver to write (write lock held)."""
        for part in parts:
            length = len(part)
            if sent >= length:
                sent -= length
                continue
            self._wq.append(memoryview(part)[sent:] if sent else part)
            sent = 0
        if not self._writer_on:
            self._writer_on = True
            self.reactor.post(self._start_writer)

    def _start_writer(self) -> None:
        if not self._closed:
            self.reactor.add_writer(self.fd, self._on_writable)

    def _on_writable(self) -> None:
        with self._wlock:
            while self._wq:
                batch = [self._wq[i] for i in range(min(MAX_IOV, len(self._wq)))]
                try:
                    sent = self.sock.sendmsg(batch)
                except BlockingIOError:
                    return
                except OSError as exc:
                    error = PeerError(f"lost connection to {self.peer}: {exc}", peer=self.peer)
                    break
                while sent:
                    head = self._wq[0]
                    if sent >= len(head):
                        sent -= len(head)
                        self._wq.popleft()
                    else:
                        self._wq[0] = memoryview(head)[sent:]
                        sent = 0
            else:
                self._writer_on = False
                self.reactor.remove_writer(self.fd)
                return
        self.fail(error)

    # -- receiving (driving thread) -------------------------------------------------------------

    def _read_burst(self) -> None:
        """Read what the socket has, within limits that give the reactor's other connections their
        turn: one read into the buffer (up to READ_BUFFER bytes of messages, all handled), and
        payloads straight into place up to READ_BUDGET bytes. A peer that sends again as soon as
        it is answered would otherwise keep the reader here forever (pMaster's MIGRATE to a
        busy Aggregator went unanswered)."""
        budget = READ_BUDGET
        sock = self.sock
        buffered = False
        try:
            while budget > 0 and not self._closed:
                if self._stage == _PAYLOAD and self._rpos == self._rlen:
                    # Nothing buffered: read the payload straight into its destination.
                    remaining = self._sizes[self._pi] - self._dpos
                    if self._discard:
                        target = self._scratch_view()[: min(remaining, READ_BUFFER)]
                    else:
                        target = self._dests[self._pi][self._dpos :]
                    try:
                        n = sock.recv_into(target, min(remaining, len(target)))
                    except BlockingIOError:
                        self._wake_for(remaining)
                        raise
                    if n == 0:
                        raise PeerError(f"{self.peer} closed the connection mid-message")
                    budget -= n
                    self._dpos += n
                    if self._dpos == self._sizes[self._pi]:
                        self._next_payload()
                    continue
                if buffered:
                    break  # the reactor calls again if there is more
                if self._rpos and self._rpos == self._rlen:
                    self._rpos = self._rlen = 0
                elif self._rlen == len(self._rbuf):
                    self._compact()
                    if self._rlen == len(self._rbuf):
                        raise ProtocolError(f"bad frame from {self.peer}: framing overflows the read buffer")
                if self._fds_expected:
                    n, ancillary, flags, _ = sock.recvmsg_into([self._rmv[self._rlen :]], _FD_SPACE)
                    if ancillary or flags & socket.MSG_CTRUNC:
                        self.rings.keep_fds(ancillary, flags)
                else:
                    n = sock.recv_into(self._rmv[self._rlen :])
                if n == 0:
                    if self._stage != _PREFIX or self._rlen > self._rpos:
                        raise PeerError(f"{self.peer} closed the connection mid-message")
                    raise PeerError(f"{self.peer} closed the connection")
                budget -= n
                self._rlen += n
                buffered = True
                self._parse()
        except BlockingIOError:
            pass
        except (PeerError, ProtocolError) as exc:
            self.fail(exc)
        except OSError as exc:
            self.fail(PeerError(f"lost connection to {self.peer}: {exc}", peer=self.peer))
        except Exception as exc:  # a handler bug: the stream position is unknown, so drop it
            log.exception("handler failed on a message from %s", self.peer)
            self.fail(PeerError(f"internal error on the connection to {self.peer}: {exc!r}"))
        if self._tls and not self._closed and sock.pending():
            self.reactor.post(self._read_burst)  # decrypted bytes wait in OpenSSL, not on the socket

    def _scratch_view(self) -> memoryview:
        if self._scratch is None:
            self._scratch = memoryview(_read_buffer())
        return self._scratch

    def _compact(self) -> None:
        remaining = self._rlen - self._rpos
        if self._rpos:
            self._rmv[:remaining] = self._rmv[self._rpos : self._rlen]
        self._rpos, self._rlen = 0, remaining

    def _parse(self) -> None:
        """Consume what is buffered; leaves the stage waiting for more bytes."""
        rmv = self._rmv
        while not self._closed:
            avail = self._rlen - self._rpos
            stage = self._stage
            if stage == _PREFIX:
                if avail < PREFIX.size:
                    break
                magic, version, nframes, hlen = PREFIX.unpack_from(self._rbuf, self._rpos)
                if (0 < nframes <= 2 and version == FRAMING_VERSION and magic == MAGIC
                        and avail >= PREFIX.size + 8 * nframes + hlen and hlen <= self.limits.max_header_bytes):
                    # A whole message's prefix and header are here, with one payload (a tensor) or
                    # two (a ps-lite KV message's keys and values): the common case of a small
                    # request or reply, past all three stages at once.
                    sizes = _SIZES_OF[nframes].unpack_from(self._rbuf, self._rpos + PREFIX.size)
                    if sum(sizes) <= self.limits.max_message_bytes:
                        start = self._rpos + PREFIX.size + 8 * nframes
                        self._rpos = start + hlen
                        self._sizes = sizes
                        self._begin_payloads(bytes(rmv[start : start + hlen]))
                        continue
                if magic != MAGIC:
                    raise ProtocolError(
                        f"bad frame from {self.peer}: expected magic {MAGIC!r}, got "
                        f"{bytes(rmv[self._rpos : self._rpos + 2])!r} (not a pslink peer?)"
                    )
                if version != FRAMING_VERSION and not (self._fds_expected and version in (FRAMING_RING, FRAMING_RING_OPEN)):
                    raise ProtocolError(
                        f"bad frame from {self.peer}: framing version {version}, expected "
                        f"{FRAMING_VERSION}"
                    )
                if version == FRAMING_RING_OPEN and (nframes or hlen != 8):
                    raise ProtocolError(f"bad frame from {self.peer}: a ring frame with {nframes} payloads "
                                        f"and a header of {hlen} bytes")
                self._framing = version
                if nframes > frame_limit(self.limits):
                    raise ProtocolError(
                        f"bad frame from {self.peer}: {nframes} payloads exceed the limit of "
                        f"{frame_limit(self.limits)}"
                    )
                if hlen > self.limits.max_header_bytes:
                    raise ProtocolError(
                        f"bad frame from {self.peer}: header of {hlen} bytes exceeds the limit of "
                        f"{self.limits.max_header_bytes}"
                    )
                self._rpos += PREFIX.size
                self._nframes, self._hlen = nframes, hlen
                self._stage = _SIZES
            elif stage == _SIZES:
                ring = self._framing == FRAMING_RING
                need = (_LOCATION.size if ring else SIZE.size) * self._nframes
                if avail < need:
                    break
                if ring:
                    located = struct.unpack_from(f"<{2 * self._nframes}Q", self._rbuf, self._rpos)
                    sizes, self._positions = located[0::2], located[1::2]
                else:
                    sizes = struct.unpack_from(f"<{self._nframes}Q", self._rbuf, self._rpos)
                if sum(sizes) > self.limits.max_message_bytes:
                    raise ProtocolError(
                        f"bad frame from {self.peer}: payload of {sum(sizes)} bytes exceeds the "
                        f"limit of {self.limits.max_message_bytes}"
                    )
                self._rpos += need
                self._sizes = sizes
                self._stage = _HEADER
                if self._hlen > READ_BUFFER // 2:
                    self._big_header = bytearray()
            elif stage == _HEADER:
                if self._big_header is not None:
                    take = min(avail, self._hlen - len(self._big_header))
                    self._big_header += rmv[self._rpos : self._rpos + take]
                    self._rpos += take
                    if len(self._big_header) < self._hlen:
                        self._compact()
                        break
                    header, self._big_header = bytes(self._big_header), None
                else:
                    if avail < self._hlen:
                        if self._rpos + self._hlen > len(self._rbuf):
                            self._compact()
                        break
                    header = bytes(rmv[self._rpos : self._rpos + self._hlen])
                    self._rpos += self._hlen
                if self._framing == FRAMING_RING_OPEN:
                    self._framing = FRAMING_VERSION
                    self._stage = _PREFIX
                    self.rings.open_peer(header)
                    continue
                self._begin_payloads(header)
            else:  # _PAYLOAD: take what is buffered, the rest is read directly
                if avail == 0:
                    break
                remaining = self._sizes[self._pi] - self._dpos
                take = min(avail, remaining)
                if not self._discard:
                    self._dests[self._pi][self._dpos : self._dpos + take] = rmv[
                        self._rpos : self._rpos + take
                    ]
                self._rpos += take
                self._dpos += take
                if self._dpos == self._sizes[self._pi]:
                    self._next_payload()
        if self._rpos == self._rlen:
            self._rpos = self._rlen = 0

    def _begin_payloads(self, header: bytes) -> None:
        sizes = self._sizes
        state, buffers = self.handler.on_header(self, header, sizes)
        self._state = state
        self._discard = buffers is DISCARD
        self._lent = buffers if type(buffers) is Lent and self._positions is not None else None
        if self._discard:
            self._dests = []
        elif buffers is None:
            self._dests = [memoryview(bytearray(s)) for s in sizes]
        elif len(buffers) == 1 and len(sizes) == 1 and type(buffers[0]) is memoryview and buffers[0].nbytes == sizes[0]:
            self._dests = buffers  # one buffer of the right size, as a reply to a pull gives
        else:
            self._dests = [memoryview(b).cast("B") if not isinstance(b, memoryview) else b for b in buffers]
            if [d.nbytes for d in self._dests] != list(sizes):
                raise ProtocolError(
                    f"handler gave buffers of {[d.nbytes for d in self._dests]} bytes for payloads "
                    f"of {list(sizes)}"
                )
        if self._positions is not None:
            if self._lent is not None and self._dests is buffers:
                self._dests = list(buffers)  # ring views replace entries: not in the handler's list
            self._framing = FRAMING_VERSION
            self._sizes = self.rings.take(self._sizes, self._positions, self._dests, self._lent, self._discard)
            self._positions = None
        self._pi = -1
        self._next_payload()

    def _wake_for(self, remaining: int) -> None:
        """A TCP payload arrives slower than it is read (a link slower than this host): be woken
        only once a good piece of it is here (SO_RCVLOWAT), not for every few KiB. Over a 1 Gbit/s
        link a part took hundreds of readable callbacks, each one Python's cost in CPU that the
        workers beside this process needed. The kernel still wakes us if its window closes first."""
        if not self._tcp:
            return
        wanted = min(remaining, LOWAT_MAX)
        if wanted != self._lowat:
            self._lowat = wanted
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, wanted)

    def _next_payload(self) -> None:
        self._pi += 1
        self._dpos = 0
        # Zero-length payloads need no bytes: skip them.
        while self._pi < len(self._sizes) and self._sizes[self._pi] == 0:
            self._pi += 1
        if self._pi < len(self._sizes):
            self._stage = _PAYLOAD
            return
        if self._lowat != 1:  # the next message's header must wake us at once
            self._lowat = 1
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, 1)
        state, dests, lent = self._state, self._dests, self._lent
        self._state, self._dests, self._lent = None, [], None
        self._stage = _PREFIX
        try:
            self.handler.on_message(self, state, dests)
        except Exception:
            # The message was consumed whole, so the stream is still in step: keep serving.
            log.exception("handler failed on a message from %s", self.peer)
        finally:
            if lent is not None:
                self.rings.settle()  # the handler is done with what lay in the ring

    # -- closing --------------------------------------------------------------------------------

    def _teardown(self) -> None:
        self.reactor.remove_reader(self.fd)
        self.reactor.remove_writer(self.fd)
        try:
            self.sock.close()
        except OSError:
            pass
        if self.rings is not None:
            self.rings.close()

    def fail(self, exc: BaseException) -> None:
        """The connection broke (``exc`` says how): close it and tell the handler."""
        with self._wlock:
            if self._closed:
                return
            self._closed = True
            self._wq.clear()
            if self.rings is not None:
                self.rings.held.clear()
        self._teardown()
        self.handler.on_close(self, exc)

    def close(self) -> None:
        with self._wlock:
            if self._closed:
                return
            self._closed = True
            self._wq.clear()
            if self.rings is not None:
                self.rings.held.clear()
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.reactor.post(self._teardown)
