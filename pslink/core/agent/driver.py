"""Who runs a client's I/O: the thread that waits, else a background thread.

On these virtual machines waking a blocked thread costs more than a loopback round trip (see
docs/transport.md), so a thread that waits for a reply reads the sockets itself, spinning
briefly before it blocks. A background thread drives only when no thread waits: for requests
whose completion runs a callback (nobody may ever wait for them), posted work and due timers
(heartbeats, probes), and, once no thread has touched the client for ``idle_poll`` seconds,
for requests in flight that their waiter left (``in_flight``) or, in a process that serves
requests arriving unasked (a ps-lite server, ``serves``), for those.

Both the Agent and the ps-lite node run on this. Everything done on receipt (completions,
callbacks, a ps-lite server's request handle) runs on whichever thread drives, one at a time; a
callback that itself waits would wait on itself: :meth:`Driver.wait` refuses that with a clear
error instead of hanging.
"""

from __future__ import annotations

import threading
import time
from typing import Callable

from pslink.core.wire.loop import Reactor
from pslink.errors import ConfigError, PslinkError, PslinkTimeoutError

MAX_SLEEP = 0.05  # the longest the background thread sleeps without looking at the reactor


class Driver:
    """Drives one reactor; see the module docstring. ``in_flight()``: requests wait for answers
    (the background thread steps in once the client went quiet); ``serves``: always step in
    once quiet (requests may arrive unasked)."""

    def __init__(self, reactor: Reactor, name: str, *, spin: float = 100e-6, idle_poll: float = 0.002,
                 in_flight: Callable[[], bool] = lambda: False, serves: bool = False,
                 clock: Callable[[], float] = time.monotonic):
        self.reactor = reactor
        self.name = name
        self.spin = spin
        self.idle_poll = idle_poll
        self.in_flight = in_flight
        self.serves = serves
        self.clock = clock
        self._lock = threading.Lock()
        self._cv = threading.Condition(self._lock)
        self._waiters = 0
        self._callbacks = 0  # requests whose completion runs a callback: someone must drive for them
        self._activity = clock()  # the last submit or wait by a user thread
        self._closed = False
        self._driver: int | None = None  # thread id of whoever drives now
        self._events = threading.local()
        self._thread = threading.Thread(target=self._background, name=f"pslink-{name}", daemon=True)

    def start(self) -> "Driver":
        self._thread.start()
        return self

    @property
    def on_driver_thread(self) -> bool:
        return self._driver == threading.get_ident()

    def touch(self) -> None:
        """A user thread is busy with the client (submitting requests): keep the background away."""
        self._activity = self.clock()

    def callbacks_pending(self, delta: int) -> None:
        """Requests with callbacks came (+) or went (-): with any pending, the background thread
        drives as soon as no thread waits, since nobody may ever wait for them."""
        with self._lock:
            self._callbacks += delta
            if self._callbacks > 0 and delta > 0:
                self._cv.notify()

    def notify(self) -> None:
        """Something a parked waiter may wait for happened."""
        self.reactor.wake_parked()

    def wait(self, done: Callable[[], bool], timeout: float | None, what: Callable[[], str], *,
             on_timeout: Callable[[float], PslinkError] | None = None,
             parking: Callable[[], threading.Event] | None = None) -> None:
        """Return once ``done()``; after ``timeout`` seconds (None: no limit) raise
        ``on_timeout(timeout)``, by default a PslinkTimeoutError naming ``what()``. Drives the
        reactor meanwhile when nobody else does; otherwise parks on the event ``parking()`` gives
        (set when what it waits for completes), or on one of its own that :meth:`notify` sets."""
        if done():
            return
        if self.on_driver_thread:
            raise ConfigError(
                f"{what()}: cannot wait inside a request handle or callback (it runs on the thread that "
                "does the I/O, so the answer could never arrive); respond or wait later instead"
            )
        deadline = None if timeout is None else self.clock() + timeout
        reactor = self.reactor
        with self._lock:
            self._waiters += 1
        try:
            while not done():
                remaining = None if deadline is None else deadline - self.clock()
                if remaining is not None and remaining <= 0:
                    if on_timeout is not None:
                        raise on_timeout(timeout)
                    raise PslinkTimeoutError(f"{what()}: not done after {timeout:g} s")
                if reactor.try_drive():
                    self._driver = threading.get_ident()
                    try:
                        while not done():
                            if deadline is None:
                                reactor.run_once(None, self.spin)
                                continue
                            remaining = deadline - self.clock()
                            if remaining <= 0:
                                break
                            reactor.run_once(remaining, self.spin)
                    finally:
                        self._driver = None
                        reactor.release()
                else:
                    # Someone else drives (maybe the background thread, blocked in poll).
                    event = parking() if parking is not None else self._own_event()
                    if done():
                        break
                    reactor.wake()  # make it yield
                    reactor.park(event, 0.05 if remaining is None else min(remaining, 0.05))
        finally:
            with self._lock:
                self._waiters -= 1
                self._activity = self.clock()
                # Callbacks have nobody to wait for them: hand over now. Plain requests still in
                # flight need no wake-up here (one per wait cost more than the wait on these VMs;
                # their waiter is usually back within microseconds): the background thread looks
                # again within idle_poll.
                if not self._waiters and self._callbacks > 0:
                    self._cv.notify()

    def _own_event(self) -> threading.Event:
        event = getattr(self._events, "event", None)
        if event is None:
            event = self._events.event = threading.Event()
        event.clear()
        return event

    def _background(self) -> None:
        reactor = self.reactor
        while True:
            with self._lock:
                while True:
                    if self._closed:
                        return
                    if self._waiters:
                        self._cv.wait(self.idle_poll)
                        continue
                    now = self.clock()
                    due = reactor.next_deadline()
                    if self._callbacks > 0 or reactor.has_posted or (due is not None and due <= now):
                        break
                    if self.serves or self.in_flight():
                        # A waiter usually comes within microseconds and drives faster than we
                        # could; step in only once things went quiet.
                        quiet = now - self._activity
                        if quiet >= self.idle_poll:
                            break
                        self._cv.wait(self.idle_poll - quiet)
                        continue
                    # Until the next timer; at most MAX_SLEEP, since a thread that posts work or
                    # sets a timer does not wake this one.
                    self._cv.wait(MAX_SLEEP if due is None else min(MAX_SLEEP, due - now))
            if not reactor.try_drive():
                time.sleep(self.idle_poll)
                continue
            self._driver = threading.get_ident()
            try:
                due = reactor.next_deadline()
                if self._callbacks > 0 or self.serves:
                    slice_ = 0.05
                else:
                    slice_ = self.idle_poll if self.in_flight() else 0.0
                if due is not None:
                    slice_ = min(slice_, max(0.0, due - self.clock()))
                reactor.run_once(slice_, 0.0)
            finally:
                self._driver = None
                reactor.release()

    def close(self, timeout: float = 5.0) -> None:
        """Stop the background thread (the client closes its own sockets)."""
        with self._lock:
            self._closed = True
            self._cv.notify_all()
        self.reactor.wake()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)
