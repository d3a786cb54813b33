"""A small event loop (reactor) that any thread may drive, one thread at a time.

Why not asyncio: on the virtual machines pslink runs on, waking a sleeping thread costs 50-100 us,
several times a whole loopback round trip. The fastest way to wait for a reply is for the waiting
thread to read the socket itself, spinning briefly before it blocks. So the reactor has no thread
of its own: an Aggregator or pMaster drives it from its main thread, and in an Agent the user
thread that waits drives it (a background thread drives only when nobody waits). Whoever holds the
drive lock runs I/O callbacks, posted callbacks and due timers.

Thread rules: :meth:`post`, :meth:`call_later`, :meth:`wake` and :meth:`stop` are safe from any
thread. Reader/writer registration must happen on the driving thread (use ``post`` otherwise).
"""

from __future__ import annotations

import collections
import heapq
import itertools
import logging
import os
import select
import threading
import time
from typing import Callable

from pslink.core.wire.spin import SpinWindow

EVENT_READ = select.POLLIN
EVENT_WRITE = select.POLLOUT
_FAILED = select.POLLERR | select.POLLHUP  # reported whatever was asked: treat as readable+writable


class _Poller:
    """epoll where the platform has it, else poll(2); one small interface, timeouts in seconds."""

    def __init__(self):
        if hasattr(select, "epoll"):
            self._poll = select.epoll()
            self.poll = self._poll.poll  # seconds; -1 blocks
            self._ms = False
        else:  # pragma: no cover - non-Linux
            self._poll = select.poll()
            self._ms = True
        self.register = self._poll.register
        self.modify = self._poll.modify
        self.unregister = self._poll.unregister

    def wait(self, timeout: float | None) -> list:
        if self._ms:  # pragma: no cover
            return self._poll.poll(None if timeout is None else timeout * 1000)
        return self.poll(-1 if timeout is None else timeout)

    def close(self) -> None:
        if not self._ms:
            self._poll.close()

log = logging.getLogger(__name__)


_COMPACT_AT = 256  # cancelled timers in the heap before it may be compacted


class Timer:
    """A callback scheduled by :meth:`Reactor.call_later`; ``cancel()`` stops it."""

    __slots__ = ("deadline", "seq", "fn", "args", "cancelled", "_reactor")

    def __init__(self, deadline: float, seq: int, fn: Callable, args: tuple, reactor: "Reactor | None" = None):
        self.deadline = deadline
        self.seq = seq
        self.fn = fn
        self.args = args
        self.cancelled = False
        self._reactor = reactor

    def cancel(self) -> None:
        if not self.cancelled:
            self.cancelled = True
            if self._reactor is not None:
                self._reactor._timer_cancelled()

    def __lt__(self, other: "Timer") -> bool:
        return (self.deadline, self.seq) < (other.deadline, other.seq)


class Reactor:
    """Selector + posted callbacks + timers, driven by whichever thread holds the drive lock."""

    def __init__(self, name: str = "reactor", clock: Callable[[], float] = time.monotonic):
        self.name = name
        self.clock = clock
        self._poller = _Poller()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._poller.register(self._wake_r, EVENT_READ)
        self._masks: dict[int, int] = {}
        self._last_activity = 0.0  # perf_counter() of the last I/O event: spinning counts from it
        self.spin_window = SpinWindow()  # learns from the gaps only in run_forever (servers)
        self._idle_since = 0.0  # perf_counter() when the last burst of I/O was handled (0: not learning)
        self._readers: dict[int, Callable[[], None]] = {}
        self._writers: dict[int, Callable[[], None]] = {}
        self._posted: collections.deque = collections.deque()
        self._timers: list[Timer] = []
        self._cancelled_timers = 0  # about how many of them are cancelled
        self._timer_lock = threading.Lock()
        self._seq = itertools.count()
        self._drive_lock = threading.Lock()
        self._running: int | None = None  # the thread inside run_once (callbacks run there)
        self._sleeping = False
        self._stopping = False
        self._closed = False
        # Threads waiting for the current driver to finish their work or hand over the lock.
        self._parked: set[threading.Event] = set()
        self._parked_lock = threading.Lock()

    # -- any thread ---------------------------------------------------------------------------

    def post(self, fn: Callable, *args) -> None:
        """Run ``fn(*args)`` on the driving thread soon."""
        self._posted.append((fn, args))
        if self._sleeping:
            self.wake()

    def call_later(self, delay: float, fn: Callable, *args, wake: bool = True) -> Timer:
        """Run ``fn(*args)`` on the driving thread after ``delay`` s. ``wake=False``: a deadline
        that may pass a little late, for a thread that must not pay a wake-up (a system call)
        for it: it is seen when the reactor next wakes for anything else."""
        timer = Timer(self.clock() + max(0.0, delay), next(self._seq), fn, args, self)
        with self._timer_lock:
            heapq.heappush(self._timers, timer)
            if self._cancelled_timers > _COMPACT_AT and 2 * self._cancelled_timers > len(self._timers):
                self._compact_timers()
        if wake and self._sleeping:
            self.wake()  # the new deadline may come before the current sleep ends
        return timer

    def _timer_cancelled(self) -> None:
        self._cancelled_timers += 1  # a hint for compaction (racy increments only delay it)

    def _compact_timers(self) -> None:
        """Drop cancelled timers (under ``_timer_lock``). A cancelled timer leaves the heap only
        when it reaches the top, at its deadline: an RPC's timeout timer, cancelled by the reply
        at once, would otherwise stay for the whole timeout, and an Aggregator replicating a
        thousand rounds a second held tens of thousands of them (megabytes, and a deeper heap).
        (``cancel`` leaves the callback in place: another thread may be about to run it.)"""
        self._timers = [t for t in self._timers if not t.cancelled]
        heapq.heapify(self._timers)
        self._cancelled_timers = 0

    def wake(self) -> None:
        """Interrupt a driver blocked in select."""
        try:
            os.write(self._wake_w, b"\0")
        except (BlockingIOError, OSError):
            pass  # the pipe is full (a wake is pending anyway) or closed

    def stop(self) -> None:
        """Make :meth:`run_forever` return after the current iteration."""
        self._stopping = True
        self.wake()

    @property
    def stopping(self) -> bool:
        return self._stopping

    # -- driving ------------------------------------------------------------------------------

    def in_callback(self) -> bool:
        """Whether the calling thread is the one running this reactor's callbacks now: it must
        not block for a peer, as every connection of the reactor would wait with it."""
        return self._running == threading.get_ident()

    def try_drive(self) -> bool:
        return self._drive_lock.acquire(blocking=False)

    def acquire(self, timeout: float = -1) -> bool:
        return self._drive_lock.acquire(timeout=timeout)

    def release(self) -> None:
        """Give up driving and nudge one parked thread so it can take over."""
        self._drive_lock.release()
        with self._parked_lock:
            if self._parked:
                next(iter(self._parked)).set()

    def park(self, event: threading.Event, timeout: float) -> None:
        """Wait (not driving) until ``event`` is set by the driver, a hand-over, or timeout.
        Returns at once if nobody drives by the time the event is parked: the driver that was
        there released without seeing it (it nudges only events parked before its release), and
        nobody else would read the sockets for the caller until the timeout."""
        with self._parked_lock:
            self._parked.add(event)
        try:
            # Checked after parking: a release from now on finds the event and sets it.
            if self._drive_lock.locked():
                event.wait(timeout)
        finally:
            with self._parked_lock:
                self._parked.discard(event)

    def wake_parked(self) -> None:
        with self._parked_lock:
            for event in self._parked:
                event.set()

    def drain(self, timeout: float = 5.0) -> bool:
        """Run what is posted (connection teardowns, say) on this thread, once nobody else
        drives. For shutting down; False if the drive lock could not be had in time."""
        if not self._drive_lock.acquire(timeout=timeout):
            return False
        try:
            self.run_once(0)
        finally:
            self.release()
        return True

    def run_forever(self, spin: float = 0.0) -> None:
        """Drive until :meth:`stop`; for the thread that owns this reactor (a server's loop).

        A server does not wait for one reply, as a client does: it serves whatever comes, so its
        spin adapts to the gaps it sees (:class:`~pslink.core.wire.spin.SpinWindow`), up to ``spin``.
        """
        window = self.spin_window
        with self._drive_lock:
            self._idle_since = time.perf_counter() if spin > 0 else 0.0
            while not self._stopping:
                self.run_once(None, window.window(spin) if spin > 0 else 0.0)

    def run_once(self, timeout: float | None, spin: float = 0.0) -> None:
        """One iteration: wait for I/O, then run callbacks. The caller must hold the drive lock.

        Before blocking, poll without blocking for up to ``spin`` seconds from the later of the
        last I/O event and now: requests come in bursts, and waking a blocked thread costs more
        on a virtual machine than a whole loopback round trip.
        """
        self._running = threading.get_ident()
        try:
            self._run_once(timeout, spin)
        finally:
            self._running = None

    def _run_once(self, timeout: float | None, spin: float) -> None:
        # Work found before polling (a posted delivery may complete what the caller waits for)
        # means this iteration must not block: the caller re-checks its condition first.
        ran = self._run_posted()
        poll = self._poller.poll if not self._poller._ms else self._poller.wait
        events = poll(0)
        idle = not ran and not events and not self._posted
        if idle and spin > 0:
            now = time.perf_counter()
            end = max(now, self._last_activity) + spin
            while now < end:
                events = poll(0)
                if events or self._posted:
                    idle = False
                    break
                now = time.perf_counter()
        if idle:
            wait = self._sleep_time(timeout)
            if wait is None or wait > 0:
                self._sleeping = True
                try:
                    if not self._posted and not self._stopping:
                        events = self._poller.wait(wait)
                finally:
                    self._sleeping = False
        if events:
            now = self._last_activity = time.perf_counter()
            if self._idle_since:
                self.spin_window.record(now - self._idle_since)
            wake_fd = self._wake_r
            for fd, mask in events:
                if fd == wake_fd:
                    self._drain_wake()
                    continue
                if mask & (EVENT_WRITE | _FAILED):
                    callback = self._writers.get(fd)
                    if callback is not None:
                        self._guard(callback)
                if mask & (EVENT_READ | _FAILED):
                    callback = self._readers.get(fd)
                    if callback is not None:
                        self._guard(callback)
            if self._idle_since:
                self._idle_since = time.perf_counter()
        if self._posted:
            self._run_posted()
        if self._timers:
            self._run_timers()

    def next_deadline(self) -> float | None:
        """When the earliest live timer is due (reactor clock), or None."""
        with self._timer_lock:
            while self._timers and self._timers[0].cancelled:
                heapq.heappop(self._timers)
                self._cancelled_timers = max(0, self._cancelled_timers - 1)
            return self._timers[0].deadline if self._timers else None

    @property
    def has_posted(self) -> bool:
        return bool(self._posted)

    def _sleep_time(self, timeout: float | None) -> float | None:
        next_deadline = self.next_deadline()
        if next_deadline is not None:
            until_timer = max(0.0, next_deadline - self.clock())
            timeout = until_timer if timeout is None else min(timeout, until_timer)
        return timeout

    def _drain_wake(self) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except (BlockingIOError, OSError):
            pass

    def _run_posted(self) -> int:
        posted = self._posted
        count = 0
        while posted:
            fn, args = posted.popleft()
            self._guard(fn, *args)
            count += 1
        return count

    def _run_timers(self) -> None:
        if not self._timers:
            return
        now = self.clock()
        due = []
        with self._timer_lock:
            while self._timers and (self._timers[0].deadline <= now or self._timers[0].cancelled):
                timer = heapq.heappop(self._timers)
                if not timer.cancelled:
                    due.append(timer)
                else:
                    self._cancelled_timers = max(0, self._cancelled_timers - 1)
        for timer in due:
            self._guard(timer.fn, *timer.args)

    def _guard(self, fn: Callable, *args) -> None:
        # A failing callback must not take the loop (and every other peer) down with it.
        try:
            fn(*args)
        except Exception:
            log.exception("%s: callback %r failed", self.name, fn)

    # -- registration (driving thread only) ---------------------------------------------------

    def add_reader(self, fd: int, callback: Callable[[], None]) -> None:
        self._readers[fd] = callback
        self._update(fd)

    def remove_reader(self, fd: int) -> None:
        if self._readers.pop(fd, None) is not None:
            self._update(fd)

    def add_writer(self, fd: int, callback: Callable[[], None]) -> None:
        self._writers[fd] = callback
        self._update(fd)

    def remove_writer(self, fd: int) -> None:
        if self._writers.pop(fd, None) is not None:
            self._update(fd)

    def _update(self, fd: int) -> None:
        mask = (EVENT_READ if fd in self._readers else 0) | (EVENT_WRITE if fd in self._writers else 0)
        registered = self._masks.get(fd)
        if mask == 0:
            if registered is not None:
                del self._masks[fd]
                try:
                    self._poller.unregister(fd)
                except (OSError, ValueError):
                    pass  # closed already: the kernel dropped it from the poll set
            return
        if registered == mask:
            return
        try:
            if registered is None:
                self._poller.register(fd, mask)
            else:
                self._poller.modify(fd, mask)
        except FileExistsError:
            self._poller.modify(fd, mask)
        except FileNotFoundError:
            # The number was closed and reused by a new file since we registered it.
            self._poller.register(fd, mask)
        self._masks[fd] = mask

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._poller.close()
        os.close(self._wake_r)
        os.close(self._wake_w)


class ReactorThread:
    """Runs a reactor's loop on a background thread (for Aggregators and pMasters in-process)."""

    def __init__(self, reactor: Reactor, spin: float = 0.0):
        self.reactor = reactor
        self._spin = spin
        self._thread = threading.Thread(target=self._run, name=reactor.name, daemon=True)
        self.error: BaseException | None = None

    def _run(self) -> None:
        try:
            self.reactor.run_forever(self._spin)
        except BaseException as exc:  # surfaced through join()
            self.error = exc
            log.exception("%s: loop died", self.reactor.name)

    def start(self) -> "ReactorThread":
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self.reactor.stop()
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise RuntimeError(f"{self.reactor.name}: loop did not stop within {timeout} s")

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()
