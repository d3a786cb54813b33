"""torch futures and works completed by pslink's answers: shared by the DDP hook
(:mod:`pslink.torch.ddp`) and the torch.distributed backend (:mod:`pslink.torch.backend`).

A future is completed once (:class:`FutureOnce`): by its answer, or failed at its deadline
(:class:`Deadlines`), since DDP and torch code wait on futures without a timeout. A backend
collective is a :class:`Work` over such a future.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time

import torch
import torch.distributed as dist

from pslink.errors import PslinkTimeoutError


class PslinkBackendError(RuntimeError):
    """A collective of the pslink backend failed (PyTorch code catches RuntimeError)."""


class FutureOnce:
    """A future completed once: by its answer or by its deadline (a DDP bucket's, a collective's)."""

    __slots__ = ("future", "timeout_message", "_lock", "_done")

    def __init__(self, future: torch.futures.Future, timeout_message: str):
        self.future = future
        self.timeout_message = timeout_message
        self._lock = threading.Lock()
        self._done = False

    def _claim(self) -> bool:
        with self._lock:
            if self._done:
                return False
            self._done = True
            return True

    def succeed(self, tensor: torch.Tensor) -> bool:
        """Complete with ``tensor``; False if it was completed before (its deadline passed)."""
        if self._claim():
            self.future.set_result(tensor)
            return True
        return False

    def fail(self, error: BaseException) -> None:
        if self._claim():
            self.future.set_exception(error)

    def expire(self) -> None:
        self.fail(PslinkTimeoutError(self.timeout_message))

    @property
    def done(self) -> bool:
        return self._done


class Deadlines:
    """Fails futures whose answer did not come in time. Nobody waits on a bucket's handle (DDP
    waits on the future, without a timeout), so without this a dead peer would hang training."""

    def __init__(self):
        self._heap: list = []
        self._order = itertools.count()
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False

    def add(self, deadline: float, pending: FutureOnce) -> None:
        with self._cv:
            if self._closed:
                return
            while self._heap and self._heap[0][2].done:  # answers come about in order: prune here
                heapq.heappop(self._heap)
            heapq.heappush(self._heap, (deadline, next(self._order), pending))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="pslink-ddp-deadlines", daemon=True)
                self._thread.start()
            elif self._heap[0][2] is pending:
                self._cv.notify()

    def _run(self) -> None:
        # This thread holds no future while it waits, and close() joins it: a daemon thread
        # that drops the last reference to a torch future (its tensors) while the interpreter
        # goes down is stopped inside torch's deallocation, and the process aborts ("terminate
        # called without an active exception").
        with self._cv:
            while not self._closed:
                while self._heap and self._heap[0][2].done:
                    heapq.heappop(self._heap)
                if not self._heap:
                    self._cv.wait()
                    continue
                left = self._heap[0][0] - time.monotonic()
                if left > 0:
                    self._cv.wait(left)
                    continue
                heapq.heappop(self._heap)[2].expire()

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._heap.clear()
            self._cv.notify()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5)


class Collective(FutureOnce):
    """A backend collective's future: failed at its deadline with a RuntimeError, as torch code
    expects."""

    __slots__ = ()

    def expire(self) -> None:
        self.fail(PslinkBackendError(self.timeout_message))


class Work(dist._Work):
    """A collective in flight. ``wait()`` raises the collective's error (a Work made by
    ``_create_work_from_future`` returns True whatever its future holds); it never blocks past
    the group's timeout, after which the work fails."""

    def __init__(self, future: torch.futures.Future):
        super().__init__()
        self._future = future

    def wait(self, timeout=None) -> bool:
        self._future.wait()  # raises what the future was failed with
        return True

    def get_future(self) -> torch.futures.Future:
        return self._future

    def is_completed(self) -> bool:
        return self._future.done()

    def is_success(self) -> bool:
        if not self._future.done():
            return False
        try:
            self._future.value()
        except Exception:
            return False
        return True


class Received(Work):
    """A receive in flight: ``source_rank()`` names the rank whose message it took (torch's
    ``recv(src=None)`` returns it) once it completed."""

    def __init__(self, future: torch.futures.Future, source: int | None = None):
        super().__init__(future)
        self.source = source

    def source_rank(self) -> int:
        if self.source is None or not self._future.done():
            raise PslinkBackendError("source_rank(): the receive has not completed yet (wait() for it first)")
        return self.source

    _source_rank = source_rank


def single(items: list, what: str):
    if len(items) != 1:
        raise PslinkBackendError(f"{what}: the pslink backend takes one tensor per rank (one device), got {len(items)}")
    return items[0]


def then_finish(work: Work, finish) -> Work:
    return Work(work.get_future().then(lambda f: finish(f.value())))


def all_of(works: list, result) -> Work:
    futures = torch.futures.collect_all([w.get_future() for w in works])
    return Work(futures.then(lambda f: [v.value() for v in f.value()] and result))
