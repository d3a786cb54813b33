"""Who runs a node's I/O: the thread that waits, else a background thread.

The same policy as the Agent's (see pslink/core/agent/agent.py and docs/transport.md): on these
virtual machines waking a blocked thread costs more than a loopback round trip, so a thread that
waits for a reply reads the sockets itself, spinning briefly before it blocks. A background
thread drives only when no thread has waited for ``idle_poll`` seconds: then it serves requests
to servers, SimpleApp handles, callbacks, heartbeats.

Everything a node does on receipt (request handles, callbacks, completions) runs on whichever
thread drives, one at a time. A handle or callback that itself waits would wait on itself:
:meth:`Driver.wait` refuses that with a clear error instead of hanging.
"""

from __future__ import annotations

import threading
import time
from typing import Callable

from pslink.core.wire.loop import Reactor
from pslink.errors import ConfigError, PslinkTimeoutError


class Driver:
    """Drives one reactor for a node; see the module docstring."""

    def __init__(self, reactor: Reactor, name: str, *, spin: float = 100e-6, idle_poll: float = 0.002,
                 clock: Callable[[], float] = time.monotonic):
        self.reactor = reactor
        self.name = name
        self.spin = spin
        self.idle_poll = idle_poll
        self.clock = clock
        self._lock = threading.Lock()
        self._cv = threading.Condition(self._lock)
        self._waiters = 0
        self._callbacks = 0  # requests whose completion runs a callback: someone must drive for them
        self._activity = clock()
        self._closed = False
        self._driver: int | None = None  # thread id of whoever drives now
        self._events = threading.local()
        self._thread = threading.Thread(target=self._background, name=f"pslite-{name}", daemon=True)

    def start(self) -> "Driver":
        self._thread.start()
        return self

    @property
    def on_driver_thread(self) -> bool:
        return self._driver == threading.get_ident()

    def touch(self) -> None:
        """A user thread is busy with the node (submitting requests): keep the background away."""
        self._activity = self.clock()

    def callbacks_pending(self, delta: int) -> None:
        """Requests with callbacks came (+) or went (-): with any pending, the background
        thread drives as soon as no thread waits, since nobody may ever wait for them."""
        with self._lock:
            self._callbacks += delta
            if self._callbacks > 0:
                self._cv.notify()

    def notify(self) -> None:
        """Something a parked waiter may wait for happened."""
        self.reactor.wake_parked()

    def wait(self, done: Callable[[], bool], timeout: float | None, what: Callable[[], str]) -> None:
        """Return once ``done()``; raise PslinkTimeoutError (naming ``what()``) after ``timeout``
        seconds (None: no limit). Drives the reactor meanwhile when nobody else does."""
        if done():
            return
        if self.on_driver_thread:
            raise ConfigError(
                f"{what()}: cannot wait inside a request handle or callback (it runs on the thread that "
                "does the node's I/O, so the answer could never arrive); respond later instead"
            )
        deadline = None if timeout is None else self.clock() + timeout
        reactor = self.reactor
        with self._lock:
            self._waiters += 1
        try:
            while not done():
                remaining = None if deadline is None else deadline - self.clock()
                if remaining is not None and remaining <= 0:
                    raise PslinkTimeoutError(f"{what()}: not done after {timeout:g} s")
                if reactor.try_drive():
                    self._driver = threading.get_ident()
                    try:
                        while not done():
                            if deadline is None:
                                reactor.run_once(None, self.spin)
                            else:
                                remaining = deadline - self.clock()
                                if remaining <= 0:
                                    break
                                reactor.run_once(remaining, self.spin)
                    finally:
                        self._driver = None
                        reactor.release()
                else:
                    event = getattr(self._events, "event", None)
                    if event is None:
                        event = self._events.event = threading.Event()
                    event.clear()
                    if done():
                        break
                    reactor.wake()  # the background thread may be blocked in poll: make it yield
                    reactor.park(event, 0.05 if remaining is None else min(remaining, 0.05))
        finally:
            with self._lock:
                self._waiters -= 1
                self._activity = self.clock()
                if not self._waiters and self._callbacks > 0:
                    self._cv.notify()

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
                    if self._callbacks > 0:
                        break
                    quiet = self.clock() - self._activity
                    if quiet >= self.idle_poll:
                        break
                    self._cv.wait(self.idle_poll - quiet)
            if not reactor.try_drive():
                time.sleep(self.idle_poll)
                continue
            self._driver = threading.get_ident()
            try:
                reactor.run_once(0.05, 0.0)
            finally:
                self._driver = None
                reactor.release()

    def close(self, timeout: float = 5.0) -> None:
        """Stop the background thread (the node's sockets are closed by the node)."""
        with self._lock:
            self._closed = True
            self._cv.notify_all()
        self.reactor.wake()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)
