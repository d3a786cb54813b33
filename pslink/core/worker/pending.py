"""Operations in flight: what a Session's collectives return (Horovod's handles).

A collective is a generator of steps: it yields each Agent handle it waits for and is resumed
with that handle's result (an allgather: the shapes round, then the rows; an allreduce: one
push-pull, then its finishing arithmetic). :class:`Pending` runs it:

- ``wait()`` (Horovod's ``synchronize``) drives it to the end on the caller's thread, which
  also drives the Agent's I/O while it waits (the fastest way to an answer);
- ``done()`` (Horovod's ``poll``) says whether the result is at hand, taking any step that is
  ready without blocking;
- when nobody waits, the session's :class:`Progress` thread takes the next step as soon as a
  handle completes, so a rank that polls rarely (or waits on something else) never holds the
  other ranks' rounds up: the next step's requests go out in the background, as Horovod's
  background thread sends them.

A failure of any step, or :meth:`Pending.fail` (the board found that the ranks' calls
disagree), ends the operation with that error on every later ``wait()``.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Generator
from typing import Any

from pslink.errors import PslinkError

log = logging.getLogger("pslink.core.worker")

Steps = Generator[Any, Any, Any]
NUDGE_AFTER = 0.002  # a wait (or poll) on an operation this long calls its nudge (see Pending)
NUDGE_MAX = 0.05  # ... and again, each pause twice the last, up to this


class Pending:
    """One collective in flight. ``steps`` yields Agent handles (see the module); ``what`` names
    it in errors; ``cancel(handle, error)`` fails a handle at once (the Agent's), ``progress``
    takes steps in the background; ``finish(failed)`` runs when the operation ended, ok or not.

    Steps are taken under a lock that nobody blocks on: a thread that finds it taken leaves a
    note (``_again``) and the holder takes the new steps too before it lets go. So a handle's
    callback that fires on the very thread that is taking a step (a handle done already when
    its callback is attached) never deadlocks, and no ready step is left behind."""

    __slots__ = ("what", "_steps", "_handle", "_result", "_error", "_ended", "_failed", "_lock", "_again",
                 "_cancel", "_progress", "_finish", "_inline", "_unattended", "_callbacks", "_callbacks_lock",
                 "_nudge", "_timeout", "_born")

    def __init__(self, what: str, steps: Steps, cancel: Callable, progress: "Progress",
                 finish: Callable[[], None] | None = None, inline: bool = False, unattended: bool = False,
                 nudge: Callable[[], bool] | None = None, timeout: float | None = None):
        """``inline``: the steps after each handle only compute (they send nothing and never
        block), so the thread that completes a handle takes them, without the hop to the
        progress thread (a single push-pull and its arithmetic); they need nobody to read the
        answer before ``wait()`` or ``done()`` does, unless ``unattended``: the operation must
        end with nobody waiting (a torch.distributed future), so its answers are read in the
        background. Steps that send go on in the background always (the other ranks' rounds
        wait for them). ``nudge()``: called while a wait (or a poll) drags on, every NUDGE_AFTER
        seconds and then less often (the session sends its board rows); it returns whether to
        keep calling it. ``timeout``: a wait's default bound (the Agent's)."""
        self.what = what
        self._steps = steps
        self._handle = None
        self._result: Any = None
        self._error: BaseException | None = None
        self._ended = False
        self._failed: PslinkError | None = None  # set by fail(): the next step meets it
        self._lock = threading.Lock()
        self._again = False
        self._cancel = cancel
        self._progress = progress
        self._finish = finish
        self._inline = inline
        self._unattended = unattended
        self._callbacks: list[Callable[["Pending"], None]] | None = []
        self._callbacks_lock = threading.Lock()
        self._nudge = nudge
        self._timeout = timeout
        self._born = time.monotonic() if nudge is not None else 0.0
        with self._lock:
            self._step(None, None)
        self._drain()

    @classmethod
    def finished(cls, what: str, result: Any) -> "Pending":
        """An operation with nothing to wait for (its result at hand)."""
        def steps():
            return result
            yield  # a generator that ends at once

        return cls(what, steps(), None, None)

    # -- what callers use -------------------------------------------------------------------------

    def done(self) -> bool:
        """Whether :meth:`wait` would return (or raise) at once; takes the steps that are ready
        (never blocks)."""
        self._drain()
        if not self._ended and self._nudge is not None and time.monotonic() - self._born > NUDGE_AFTER:
            if not self._nudge():
                self._nudge = None
        return self._ended

    def wait(self, timeout: float | None = None) -> Any:
        """The result (raises the operation's error); ``timeout`` bounds each Agent wait (a
        timeout raises, and the operation stays in flight)."""
        if self._nudge is not None:
            self._wait_nudging(timeout)
        while True:
            self._drain()
            if self._ended:
                break
            handle = self._handle
            if handle is None:
                continue  # another thread is between two steps
            try:
                handle.wait(timeout)
            except PslinkError:
                if not handle.done():
                    raise  # timed out: still in flight
        if self._error is not None:
            raise self._error
        return self._result

    def _wait_nudging(self, timeout: float | None) -> None:
        """Wait in slices while ``nudge()`` wants to be called between them (then :meth:`wait`
        waits the rest); out of time, raise the Agent's timeout error for what it waits on."""
        timeout = self._timeout if timeout is None else timeout
        started = time.monotonic()
        pause = NUDGE_AFTER - (started - self._born)
        while self._nudge is not None:
            self._drain()
            handle = self._handle
            if self._ended or handle is None or not hasattr(handle, "wait_briefly"):
                return  # (a stand-in's handle: waited on plainly)
            left = None if timeout is None else timeout - (time.monotonic() - started)
            if left is not None and left <= 0:
                raise handle.timed_out(timeout)
            if handle.wait_briefly(max(0.0, pause if left is None else min(pause, left))):
                continue
            if not self._nudge():
                self._nudge = None
            pause = min(max(pause, NUDGE_AFTER) * 2, NUDGE_MAX)

    def exception(self) -> BaseException | None:
        return self._error if self._ended else None

    def result(self) -> Any:
        """The result of an operation that ended (raises its error)."""
        if not self._ended:
            raise RuntimeError(f"{self.what} is still in flight")
        if self._error is not None:
            raise self._error
        return self._result

    def add_done_callback(self, fn: Callable[["Pending"], None]) -> None:
        """Call ``fn(pending)`` once it ended (now, if it has): on the thread that ended it."""
        with self._callbacks_lock:
            if self._callbacks is not None:
                self._callbacks.append(fn)
                return
        fn(self)

    def fail(self, error: PslinkError) -> None:
        """End the operation with ``error`` (from any thread): whoever waits wakes and raises it."""
        self._failed = error
        handle = self._handle
        if not self._ended and handle is not None and self._cancel is not None:
            self._cancel(handle, error)  # wakes a waiter, whose step then meets the error
        self._drain()

    def advance(self) -> None:
        """Take the steps that are ready (the progress thread's call)."""
        self._drain()

    # -- taking steps -----------------------------------------------------------------------------

    def _drain(self) -> None:
        """Take every ready step, unless another thread is taking them (it then takes these too)."""
        while True:
            self._again = True
            if not self._lock.acquire(blocking=False):
                return
            try:
                self._again = False
                while not self._ended and self._handle is not None and (self._handle.done() or self._failed):
                    self._resume()
            finally:
                self._lock.release()
            if not self._again:
                return

    def _resume(self) -> None:
        """The current handle is done (or the operation failed): resume the steps with its
        result or error."""
        handle = self._handle
        error = self._failed or handle.exception()
        if error is not None:
            self._step(None, error)
        else:
            self._step(handle.wait(0), None)

    def _step(self, value: Any, error: BaseException | None) -> None:
        try:
            handle = self._steps.throw(error) if error is not None else self._steps.send(value)
        except StopIteration as stop:
            self._end(stop.value, None)
            return
        except PslinkError as exc:  # the service's or the operation's: named for this operation
            self._end(None, reworded(exc, self.what))
            return
        except BaseException as exc:
            self._end(None, exc)
            return
        self._handle = handle
        if self._progress is not None or self._inline:
            handle.add_done_callback(self._ready, drive=self._unattended or not self._inline)

    def _end(self, result: Any, error: BaseException | None) -> None:
        self._result, self._error, self._handle = result, error, None
        # finish() first: a waiter on another thread returns as soon as it sees _ended, and
        # its next call may reuse what finish() releases (the call's name).
        if self._finish is not None:
            self._finish(error is not None)
        self._ended = True
        with self._callbacks_lock:
            callbacks, self._callbacks = self._callbacks, None
        for callback in callbacks or ():
            try:
                callback(self)
            except Exception:  # a caller's callback must not break the operation's end
                log.exception("pslink: a callback of %r failed", self)

    def _ready(self, handle) -> None:
        """A handle completed (on the Agent's driving thread): take the next steps here when
        they only compute, else leave them to the progress thread (or a waiter)."""
        if handle is not self._handle:
            return
        if self._inline:
            self._drain()
        else:
            self._progress.schedule(self)

    def __repr__(self) -> str:
        return f"<Pending {self.what} {'done' if self._ended else 'in flight'}>"


def reworded(error: PslinkError, what: str) -> PslinkError:
    """``error`` of the same class, its message led by ``what`` (unless it is already)."""
    if error.message.startswith(what):
        return error
    return type(error)(f"{what}: {error.message}", **error.details)


class PendingGroup:
    """Operations started together (Horovod's ``grouped_*``): ``wait()`` gives their results, a
    list in the order given."""

    __slots__ = ("items", "what")

    def __init__(self, items: list, what: str = "group"):
        self.items = items
        self.what = what

    def done(self) -> bool:
        return all(item.done() for item in self.items)

    def wait(self, timeout: float | None = None) -> list:
        return [item.wait(timeout) for item in self.items]

    def __repr__(self) -> str:
        return f"<PendingGroup of {len(self.items)}>"


class Progress:
    """A thread that takes ready steps of operations nobody waits for (started on first use)."""

    def __init__(self, name: str):
        self._name = name
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._closed = False

    def schedule(self, pending: Pending) -> None:
        if self._closed:
            return
        if self._thread is None:
            with self._lock:
                if self._thread is None:
                    thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                    thread.start()
                    # Named only once started: close() on another thread joins what it sees (a
                    # CI run once saw a thread not yet started there: "cannot join thread").
                    self._thread = thread
        self._queue.put(pending)

    def _run(self) -> None:
        while True:
            pending = self._queue.get()
            if pending is None:
                return
            try:
                pending.advance()
            except Exception:  # a step's error belongs to its operation; this is a bug's last net
                log.exception("pslink: taking a step of %r failed", pending)

    def close(self) -> None:
        self._closed = True
        thread = self._thread
        if thread is not None:
            self._queue.put(None)
            if thread is not threading.current_thread():
                thread.join(timeout=5)
