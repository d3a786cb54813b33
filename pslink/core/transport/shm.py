"""Shared-memory rings that carry large payloads between processes of one host.

Peers on one host already talk over a Unix socket (see ``tcp.py``). Through a socket a payload
is copied twice by the kernel (into a socket buffer, out of it) with the overheads of a system
call and socket buffers per piece: about 2 ms of CPU per 4 MiB here, sender and receiver
together. Through a ring it is copied twice by the processes themselves (into the ring, out of
it), about 0.5 ms. Only the payload takes this way; headers and their order stay on the socket::

    sender                                   receiver
    copy payload into its ring at ``pos``
    send the frame (sizes, positions)  --->  read the frame, ask the handler where it goes
                                             copy it out of the ring, store ``consumed``
    reuse space up to ``consumed``

Each direction of a connection has a ring of its own, made by its sender the first time a
payload is large enough (:data:`MIN_PAYLOAD`), as an anonymous ``memfd`` handed to the receiver
over the socket (``SCM_RIGHTS``): nothing is named, nothing is left behind by a process that
dies. A payload that does not fit (the receiver is behind) waits a little for room
(:meth:`SendRing.wait_for_room`, ``TransportOptions.ring_wait``), then goes on the socket as before. A
receiver may also read a payload where it lies (:meth:`ReceiveRing.lend`) and free its space once
it is done (:meth:`ReceiveRing.settle`): one copy fewer for what is read only once.

The receiver's ``consumed`` counter is one aligned 8-byte word, written by the receiver after its
copy and read by the sender before it reuses space. That ordering holds without fences on
x86-64 (stores are not made visible ahead of earlier loads), so rings are made only there;
elsewhere payloads stay on the socket. ``TransportOptions(rings=False)`` (``PSLINK_SHM=0``) turns
rings off for what a process sends.
"""

from __future__ import annotations

import ctypes
import fcntl
import mmap
import os
import time

import numpy as np

from pslink.core.transport.options import MAX_RING_BYTES
from pslink.errors import ProtocolError

MIN_PAYLOAD = 64 << 10  # smaller payloads are cheaper on the socket than bookkept in a ring
HEADER_BYTES = 64  # the first cache line holds ``consumed``; the data follows
INLINE = (1 << 64) - 1  # a payload's position when it travels on the socket
# A ring that could shrink under its receiver would kill it: reading a mapped page past the end of
# its file raises SIGBUS, which no handler in Python survives. So a receiver maps only a memfd
# sealed against resizing, whose size covers what its sender declared.
RING_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
MADV_POPULATE_READ, MADV_POPULATE_WRITE = 22, 23  # Linux 5.14 (Python's mmap names neither before 3.13)
ROOM_POLL = 50e-6  # between looks at ``consumed`` while waiting (a sleep: the receiver needs the CPU)


try:
    _LIBC = ctypes.CDLL(None, use_errno=True)
    _LIBC.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
except (OSError, AttributeError):
    _LIBC = None


def _madvise(mapping: mmap.mmap, advice: int) -> bool:
    """madvise(2) on a whole mapping through ctypes, which lets go of the GIL for the call
    (``mmap.madvise`` holds it: faulting a 16 MiB ring in would stop every thread for 9 ms)."""
    if _LIBC is None:
        return False
    anchor = ctypes.c_char.from_buffer(mapping)
    try:
        return _LIBC.madvise(ctypes.addressof(anchor), len(mapping), advice) == 0
    finally:
        del anchor


class _Ring:
    """A mapped ring: ``consumed`` (the receiver's count of bytes it has taken) and the data."""

    def __init__(self, fd: int, capacity: int):
        self.capacity = capacity
        self._map = mmap.mmap(fd, HEADER_BYTES + capacity)
        self._consumed = np.frombuffer(self._map, np.uint64, 1, 0)  # one aligned 8-byte word
        self._data = memoryview(self._map)[HEADER_BYTES:]

    def populate(self, write: bool) -> None:
        """Fault every page of the ring in now (a fresh ring's first pass takes a fault per page:
        about 9 ms per 16 MiB here, spent wherever the first payloads cross). ``write``: the
        sender's side, which makes the pages; the receiver only maps them."""
        if _madvise(self._map, MADV_POPULATE_WRITE if write else MADV_POPULATE_READ):
            return  # (a kernel before 5.14 refuses: touch one byte a page)
        pages = np.frombuffer(self._map, np.uint8)[HEADER_BYTES::mmap.PAGESIZE]
        if write:
            pages[:] = 0
        else:
            int(pages.sum())

    def close(self) -> None:
        self._data.release()
        del self._consumed
        try:
            self._map.close()
        except BufferError:
            pass  # a view is still alive somewhere: the mapping goes with it


class SendRing(_Ring):
    """The sender's side: places payloads and knows what the receiver has taken."""

    def __init__(self, capacity: int):
        self.fd = os.memfd_create("pslink-ring", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self.fd, HEADER_BYTES + capacity)
            # The receiver maps it only if it can never shrink (see ReceiveRing).
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, RING_SEALS | fcntl.F_SEAL_SEAL)
            super().__init__(self.fd, capacity)
        except BaseException:
            os.close(self.fd)
            raise
        self.head = 0  # bytes placed so far (positions only grow; the offset is pos % capacity)

    def announcement(self) -> bytes:
        """What the frame that hands the descriptor over carries: the capacity."""
        return self.capacity.to_bytes(8, "little")

    def release_fd(self) -> None:
        """Once the descriptor was sent (or could not be), this side needs only the mapping."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def _start(self, head: int, size: int, consumed: int) -> int | None:
        """Where a payload of ``size`` placed after ``head`` would start, or None: no room."""
        capacity = self.capacity
        if size > capacity:
            return None
        offset = head % capacity
        start = head if offset + size <= capacity else head + capacity - offset  # never split
        # The receiver holds [consumed, head); the space skipped above never held anything.
        if consumed < head and start + size - consumed > capacity:
            return None
        return start

    def fits(self, sizes) -> bool:
        """Whether payloads of these sizes (those of one message that go through the ring)
        would all be placed now, as :meth:`place` would place them one after another."""
        head = self.head
        consumed = int(self._consumed[0])
        for size in sizes:
            start = self._start(head, size, consumed)
            if start is None:
                return False
            head = start + size
        return True

    def wait_for_room(self, sizes, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the receiver to take enough that ``sizes`` fit.

        A full ring means the receiver is behind; on a host short of cores it is behind because
        it needs the CPU this sender holds. Sending the payload on the socket instead costs both
        sides about four times the CPU, so a thread that may block yields until there is room."""
        if self.fits(sizes):
            return True
        if any(size > self.capacity for size in sizes) or timeout <= 0:
            return False
        deadline = time.monotonic() + timeout
        while True:
            time.sleep(ROOM_POLL)
            if self.fits(sizes):
                return True
            if time.monotonic() >= deadline:
                return False

    def place(self, payload: memoryview) -> int:
        """Copy ``payload`` into the ring and return its position, or :data:`INLINE` if there is
        no room (the receiver has not taken enough yet): then it goes on the socket."""
        size = len(payload)
        start = self._start(self.head, size, int(self._consumed[0]))
        if start is None:
            return INLINE
        offset = start % self.capacity
        self._data[offset : offset + size] = payload
        self.head = start + size
        return start

    def close(self) -> None:
        self.release_fd()
        super().close()


class ReceiveRing(_Ring):
    """The receiver's side: takes payloads in the order their frames arrive."""

    def __init__(self, fd: int, capacity: int, peer: str):
        if not 0 < capacity <= MAX_RING_BYTES:
            raise ProtocolError(f"bad frame from {peer}: a ring of {capacity} bytes (at most {MAX_RING_BYTES})")
        try:
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        except OSError:
            seals = 0  # not a memfd (or one made without sealing)
        if seals & RING_SEALS != RING_SEALS:
            raise ProtocolError(f"bad frame from {peer}: its ring is not sealed against resizing (F_SEAL_SHRINK, "
                                "F_SEAL_GROW); refused")
        if os.fstat(fd).st_size < HEADER_BYTES + capacity:
            raise ProtocolError(f"bad frame from {peer}: its ring is smaller than the {capacity} bytes announced")
        super().__init__(fd, capacity)
        self.peer = peer
        self.taken = 0  # this side's count of bytes taken: written to ``consumed`` after each copy

    def take(self, position: int, size: int, dest) -> None:
        """Copy the payload at ``position`` into ``dest`` (None: drop it) and free its space."""
        view = self.lend(position, size)
        if dest is not None:
            dest[:] = view
        self.settle()

    def lend(self, position: int, size: int) -> memoryview:
        """The payload at ``position`` where it lies; its space is freed by :meth:`settle`."""
        capacity = self.capacity
        offset = position % capacity
        # Frames come in the order their payloads were placed, so everything placed before this
        # one was taken already: positions only grow, and a payload never runs past the end.
        if position < self.taken or offset + size > capacity:
            raise ProtocolError(f"bad frame from {self.peer}: a payload of {size} bytes at ring position {position} "
                                f"(taken up to {self.taken} of a {capacity}-byte ring)")
        self.taken = position + size
        return self._data[offset : offset + size]

    def settle(self) -> None:
        """Free the space of what was lent: its reader is done with it."""
        self._consumed[0] = self.taken
