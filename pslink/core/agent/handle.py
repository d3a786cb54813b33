"""Handles: what Agent operations return, to wait on or to attach callbacks to; and
:class:`Handles`, which makes, completes and waits on an Agent's handles."""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable

from pslink.core.agent.driver import Driver
from pslink.core.observe.timeline import Timeline
from pslink.errors import PslinkError, PslinkTimeoutError

log = logging.getLogger("pslink.core.agent")


class Handle:
    """The outcome of an Agent request (one key or a batch, all of its parts).

    ``wait(timeout=None)`` returns the result (the ``out`` array of a pull or pushpull, a list
    for batched calls, None for push and init) or raises the request's error. While it waits, the
    calling thread drives the Agent's I/O itself, which is the fastest way to get a reply.
    """

    __slots__ = (
        "_book", "op", "keys", "round", "epoch", "_left", "_error", "_result", "_event", "_callbacks", "_drives",
        "_waiting_on", "_started", "__weakref__",
    )

    def __init__(self, book: "Handles", op: str, keys: list, result: Any, parts: int, round_: int = 0):
        self._book = book
        self.op = op
        self.keys = keys
        self.round = round_
        self.epoch = 0  # the job's membership epoch the answers carried (the same for every worker)
        self._left = parts
        self._error: PslinkError | None = None
        self._result = result
        self._event: threading.Event | None = None  # made only if a thread has to park
        self._callbacks: list[Callable[["Handle"], None]] | None = None
        self._drives = False  # a callback needs the answer read even if nobody waits for it
        self._waiting_on: dict[str, str] = {}  # aggregator name -> address, for error messages
        self._started: float | None = None  # when it was issued, if the timeline records it

    def done(self) -> bool:
        return self._left == 0

    def wait(self, timeout: float | None = None) -> Any:
        """Block until done (at most ``timeout`` s, default: the Agent's timeout)."""
        if self._left:
            self._book.wait(self, timeout)
        if self._error is not None:
            raise self._error
        return self._result

    def wait_briefly(self, seconds: float) -> bool:
        """Whether it is done within ``seconds`` (no error raised either way: a caller that
        does something while a wait drags on, then waits again)."""
        return not self._left or self._book.wait_briefly(self, seconds)

    def timed_out(self, seconds: float) -> PslinkTimeoutError:
        """The error of a wait that gave up after ``seconds`` (naming who it waits for)."""
        return self._book._timed_out(self, seconds)

    def exception(self) -> PslinkError | None:
        return self._error

    def add_done_callback(self, fn: Callable[["Handle"], None], drive: bool = True) -> None:
        """Call ``fn(handle)`` when done: on the thread that drives the Agent's I/O (keep it
        short, never block in it), or right now if already done. ``drive=False``: only when
        some thread reads the answer anyway (one that waits, or a callback's): the Agent's
        background thread does not start reading for it, and a waiting thread does not have to
        take the reading over from it (which costs milliseconds on these VMs)."""
        if self._book.add_callback(self, fn, drive):
            return
        fn(self)

    def __repr__(self) -> str:
        state = "done" if not self._left else f"{self._left} part(s) pending"
        keys = self.keys if len(self.keys) <= 4 else self.keys[:4] + ["..."]
        return f"<Handle {self.op} {keys} {state}{' failed' if self._error else ''}>"

    # -- called by Handles, on the driving thread ---------------------------------------------------

    def _part_done(self, error: PslinkError | None) -> list:
        """One part finished; returns the callbacks to run if the whole handle is now done.

        The first failed part fails the whole handle at once: its other parts may be waiting on
        workers that will never come (a batched call whose other keys another worker rejected),
        and the caller should hear of the failure now, not at its timeout."""
        if self._left <= 0:
            return []  # already failed: later parts change nothing
        if error is not None:
            if self._error is None:
                self._error = error
            self._left = 0
        else:
            self._left -= 1
        if self._left:
            return []
        if self._event is not None:
            self._event.set()
        callbacks, self._callbacks = self._callbacks or [], None
        return callbacks

    def _parking_event(self) -> threading.Event:
        """The event a non-driving waiter sleeps on (set on completion or hand-over)."""
        event = self._event
        if event is None:
            event = self._event = threading.Event()
        event.clear()
        if not self._left:  # completed while we were making the event
            event.set()
        return event

    def _describe_wait(self) -> str:
        peers = ", ".join(f"{name} ({address})" for name, address in sorted(self._waiting_on.items()))
        keys = ", ".join(repr(k) for k in self.keys[:8]) + (" ..." if len(self.keys) > 8 else "")
        round_ = f" (round {self.round})" if self.round else ""
        return f"{self.op} of key {keys}{round_}" + (f" from aggregator {peers}" if peers else "")


class _NotYet(PslinkError):
    """A brief wait ended (Handles.wait_briefly): not an error anyone sees."""


class Handles:
    """An Agent's handles: made here, completed part by part on the driving thread, waited on
    through the :class:`~pslink.core.agent.driver.Driver` (so a waiting thread drives the I/O).
    ``timeout``: the default wait; ``job`` and ``rank`` name the Agent in errors. Around a wait:
    ``before_wait()`` runs first (the Agent sends what fusion holds: this thread waits for their
    answers), ``waited(seconds)`` learns how long the thread blocked, and ``explain(handle)`` says
    who a timed-out handle still waits for (the Agent asks its Aggregators)."""

    def __init__(self, driver: Driver, timeout: float, job: str, rank: int, timeline: Timeline | None = None, *,
                 before_wait: Callable[[], None] | None = None, waited: Callable[[float], None] | None = None,
                 explain: Callable[[Handle], str] | None = None):
        self.driver = driver
        self.timeout = timeout
        self.job, self.rank = job, rank
        self.timeline = timeline
        self.explain = explain
        self.before_wait = before_wait or (lambda: None)
        self.waited = waited
        self._lock = threading.Lock()

    def new(self, op: str, keys: list, result: Any, parts: int, round_: int = 0, traced: bool = True) -> Handle:
        """``traced``: on the timeline (a host's leader's own sends for its host are not: the
        worker's request they serve is)."""
        handle = Handle(self, op, keys, result, parts, round_)
        timeline = self.timeline
        if traced and timeline is not None and timeline.active:
            handle._started = timeline.now()
        return handle

    def wait(self, handle: Handle, timeout: float | None) -> None:
        self.before_wait()  # requests held for fusion go now: this thread waits for their answers
        timeline = self.timeline
        started = timeline.now() if timeline is not None and timeline.active else None
        waited, clock = self.waited, self.driver.clock
        began = clock()
        try:
            self.driver.wait(lambda: not handle._left, self.timeout if timeout is None else timeout,
                             handle._describe_wait, on_timeout=lambda t: self._timed_out(handle, t),
                             parking=handle._parking_event)
        finally:
            if waited is not None:
                waited(clock() - began)  # the Iterations' clock: their waits and times compare
            if started is not None:
                timeline.span(f"wait {handle.op}", None, started, timeline.now(), {"keys": handle.keys[:8]})

    def wait_briefly(self, handle: Handle, seconds: float) -> bool:
        self.before_wait()
        try:
            self.driver.wait(lambda: not handle._left, seconds, handle._describe_wait,
                             on_timeout=lambda t: _NotYet(""), parking=handle._parking_event)
        except _NotYet:
            return False
        return True

    def _timed_out(self, handle: Handle, seconds: float) -> PslinkTimeoutError:
        why = ""
        if self.explain is not None:
            try:
                why = self.explain(handle)
            except Exception:  # naming the missing ranks is a courtesy: the timeout is the error
                log.debug("agent %s/%d: could not ask who %r waits for", self.job, self.rank, handle, exc_info=True)
        return PslinkTimeoutError(f"{handle._describe_wait()} not done after {seconds:g} s (job {self.job!r}, rank "
                                  f"{self.rank}){why}", job=self.job)

    def complete(self, handle: Handle, error: PslinkError | None) -> None:
        """One part of ``handle`` finished (``error``: how it failed); its callbacks run once
        the whole handle is done."""
        with self._lock:
            callbacks = handle._part_done(error)
            started = handle._started if not handle._left else None
            if started is not None:
                handle._started = None
        if started is not None:
            self._trace(handle, started, error)
        if callbacks and handle._drives:
            self.driver.callbacks_pending(-1)
        for callback in callbacks:
            try:
                callback(handle)
            except Exception:
                log.exception("callback of %r failed", handle)

    def _trace(self, handle: Handle, started: float, error: PslinkError | None) -> None:
        timeline = self.timeline
        if timeline is None:  # stopped while the request was in flight
            return
        end = timeline.now()
        args = {"round": handle.round} if handle.round else {}
        if error is not None:
            args["error"] = type(error).__name__
        for key in handle.keys[:256]:
            timeline.span(handle.op, key, started, end, args)

    def expect_more(self, handle: Handle, parts: int) -> None:
        """``handle`` waits for ``parts`` more answers (a request that was to come whole from one
        place now comes part by part from several: host-local reduce's leader was lost)."""
        with self._lock:
            handle._left += parts

    def add_callback(self, handle: Handle, fn, drive: bool = True) -> bool:
        """Attach ``fn`` (``drive``: someone must read the answer for it, see
        :meth:`Handle.add_done_callback`); False when the handle is already done (the caller
        runs it)."""
        with self._lock:
            if handle.done():
                return False
            if handle._callbacks is None:
                handle._callbacks = []
            handle._callbacks.append(fn)
            starts_driving = drive and not handle._drives
            if starts_driving:
                handle._drives = True
        if starts_driving:
            self.driver.callbacks_pending(+1)
        return True
