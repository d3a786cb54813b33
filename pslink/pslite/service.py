"""Service mode: a KVWorker's requests served by the shared Aggregator pool, not by servers.

A ps-lite program whose servers run ``KVServerDefaultHandle`` (``store[key] += value``; a pull
returns the store) needs no server processes of its own: the parameter service does exactly
that for an ASP job in sum mode (each push is added at once, pulls never wait). With
``PSLINK_PSLITE_MODE=service`` every worker node connects one :class:`~pslink.core.agent.Agent`
(job ``PSLINK_JOB``, rank = the worker's rank) and its KVWorkers send through it; the worker code
does not change. Each ps-lite key is one pslink key (app 0 keeps the integer; app ``a`` uses
the string ``"a/key"``), so many small keys mean many small messages: group values into few
keys, as deep-learning programs do anyway.

Differences from a server running the default handle: there is nothing to slice (pMaster places
keys, so ``set_slicer`` has no effect), ``cmd`` and ``priority`` are not used, and a key's length
is fixed by its first push (a later push of another length is a ShapeMismatchError). A pull of a
key no worker pushed yet is an error naming the key (the default handle would answer one zero).
"""

from __future__ import annotations

import functools
import logging
import threading
from typing import Callable

import numpy as np

from pslink.errors import PslinkError, ShapeMismatchError
from pslink.pslite.wire import LEN_DTYPE

log = logging.getLogger("pslink.pslite")

PRUNE_EVERY = 256


class _ServiceRequest:
    __slots__ = ("ts", "handle", "post", "callback", "op", "count", "finished", "error")

    def __init__(self, ts, handle, post, callback, op, count):
        self.ts, self.handle, self.post, self.callback, self.op, self.count = ts, handle, post, callback, op, count
        self.finished = handle is None
        self.error: PslinkError | None = None

    @property
    def what(self) -> str:
        return f"{self.op} of {self.count} key(s) (service mode)"


class ServiceBackend:
    """Carries one KVWorker's requests to the Agent; timestamps stay the KVWorker's."""

    def __init__(self, worker):
        self.worker = worker
        self.agent = worker.node.agent
        self.pending: dict[int, _ServiceRequest] = {}
        self._submits = 0
        self._lock = threading.Lock()  # a callback (driving thread) and a wait may finish a request at once
        app = worker.app_id
        self._key: Callable[[int], object] = (lambda key: key) if app == 0 else (lambda key: f"{app}/{key}")

    def submit(self, push, pull, keys, vals, lens, vals_out, lens_out, callback, what) -> int:
        n = keys.size
        ts = self.worker._customer.new_ts()
        post = outs = None
        if n == 1 and (not pull or (type(vals_out) is np.ndarray and lens_out is None)):
            # One key, its values in one array and received in place: a request's common case
            # (every value of a push is the key's, whatever ``lens`` says), without the slicing.
            pkeys, arrays = [self._key(int(keys[0]))], [vals] if push else None
            if pull:
                outs = [vals_out]
        else:
            pkeys = [self._key(k) for k in keys.tolist()]
            arrays = _split(vals, lens, n) if push else None
            if pull:
                if isinstance(vals_out, np.ndarray) and lens_out is None and n and vals_out.size % n == 0:
                    k = vals_out.size // n
                    outs = [vals_out[i * k:(i + 1) * k] for i in range(n)]  # received in place
                else:
                    post = functools.partial(_assemble, vals_out, lens_out, what, self.worker.dtype)
        handle = None
        if n:
            if push and pull:
                handle = self.agent.pushpull_many(pkeys, arrays, outs)
            elif push:
                handle = self.agent.push_many(pkeys, arrays)
            else:
                handle = self.agent.pull_many(pkeys, outs)
        request = _ServiceRequest(ts, handle, post, callback, what, n)
        self.pending[ts] = request
        if handle is None:
            if post is not None:
                post([])
            if callback is not None:
                callback()
        elif callback is not None:
            # Only with a callback: a handle with one makes the Agent's background thread drive.
            handle.add_done_callback(lambda _h: self._finish(request))
        self._submits += 1
        if self._submits % PRUNE_EVERY == 0:
            self._prune()
        return ts

    def wait(self, ts: int, timeout: float) -> bool:
        """Wait for request ``ts`` if it is one of ours (True), else return False at once."""
        request = self.pending.get(ts)
        if request is None:
            return False
        try:
            if request.handle is not None:
                request.handle.wait(timeout)
        except PslinkError:
            self.pending.pop(ts, None)
            raise
        self._finish(request)
        self.pending.pop(ts, None)
        if request.error is not None:
            raise request.error
        return True

    def _finish(self, request: _ServiceRequest) -> None:
        with self._lock:
            if request.finished:
                return
            error = request.handle.exception()
            if error is None and request.post is not None:
                try:
                    request.post(request.handle._result)
                except PslinkError as exc:
                    error = exc
            request.error = error
            request.finished = True
        if request.callback is None:
            return
        if error is not None:
            log.error("%s failed (its callback will not run): %s", request.what, error)
            return
        try:
            request.callback()
        except Exception:
            log.exception("callback of %s failed", request.what)

    def _prune(self) -> None:
        """Forget requests nobody will wait for that need nothing more done."""
        for ts, request in list(self.pending.items()):
            handle = request.handle
            if (handle is None or handle.done()) and (request.finished or request.post is None) and (
                    handle is None or handle.exception() is None) and request.error is None:
                self.pending.pop(ts, None)

    def fail_all(self, error: PslinkError) -> None:
        """The deployment failed: the Agent's requests fail on their own (it watches its peers)."""


def _split(vals: np.ndarray, lens: np.ndarray, n: int) -> list[np.ndarray]:
    if lens.size:
        ends = np.cumsum(lens).tolist()
        starts = [0] + ends[:-1]
        return [vals[a:b] for a, b in zip(starts, ends)]
    k = vals.size // n if n else 0
    return [vals[i * k:(i + 1) * k] for i in range(n)]


def _assemble(vals_out, lens_out, what: str, dtype, results) -> None:
    results = results if isinstance(results, list) else [results]
    parts = [np.asarray(r).reshape(-1) for r in results]
    total = sum(p.size for p in parts)
    joined = np.concatenate(parts) if parts else np.empty(0, dtype)
    if isinstance(vals_out, np.ndarray):
        if vals_out.size != total:
            raise ShapeMismatchError(f"{what}: the pull buffer holds {vals_out.size} value(s), but the service "
                                     f"returned {total} for {len(parts)} key(s)")
        vals_out[:] = joined
    else:
        vals_out[:] = joined.tolist()
    if lens_out is not None:
        lens = np.array([p.size for p in parts], LEN_DTYPE)
        if isinstance(lens_out, np.ndarray):
            lens_out[:] = lens
        else:
            lens_out[:] = lens.tolist()
