"""Service mode: a KVWorker's requests served by the shared Aggregator pool, not by servers.

A ps-lite program whose servers run ``KVServerDefaultHandle`` (``store[key] += value``; a pull
returns the store) needs no server processes of its own: the parameter service does exactly
that for an ASP job in sum mode (each push is added at once, pulls never wait). With
``PSLINK_PSLITE_MODE=service`` every worker node connects one :class:`~pslink.core.agent.Agent`
(job ``PSLINK_JOB``, rank = the worker's rank) and its KVWorkers send through it; the worker code
does not change.

Small values go to sparse tables (:mod:`pslink.core.tables`): a request whose keys each carry
the same number of values ``w``, at most ``PSLINK_PSLITE_TABLE_WIDTH`` (default 256), is one
table request of app ``a``'s table ``pslite/a/w`` (its rows: the keys' values), so a push of
10,000 keys is one message per shard, as C++ ps-lite sends one per server; the tables have
``PSLINK_PSLITE_SHARDS`` shards (default: ``DMLC_NUM_SERVER``, at least 1). A key never pushed
pulls as zeros, as from the default handle's store. A key with more values is one pslink key of
its own (app 0 keeps the integer; app ``a`` uses the string ``"a/key"``), split into parts when
large; a pull of such a key before any push is an error naming it.

Differences from a server running the default handle: there is nothing to slice (pMaster places
keys and shards, so ``set_slicer`` has no effect), ``cmd`` and ``priority`` are not used, and a
key's length is fixed by its first push (a later push of another length is a ShapeMismatchError
for a key of its own; a small key pushed with another length lands in another table).
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
        config = worker.node.config
        self._table_width = config.table_width
        self._shards = config.shards or max(1, config.num_servers)
        self._tables: dict[int, object] = {}
        self._dense_keys: set[int] = set()  # keys pushed as pslink keys of their own (more values than a table row)

    def _table(self, width: int):
        table = self._tables.get(width)
        if table is None:
            table = self._tables[width] = self.agent.table(
                f"pslite/{self.worker.app_id}/{width}", width, self.worker.dtype.name, shards=self._shards)
        return table

    def submit(self, push, pull, keys, vals, lens, vals_out, lens_out, callback, what) -> int:
        n = keys.size
        ts = self.worker._customer.new_ts()
        post = outs = None
        width = _width(vals, lens, n, push, vals_out)
        if width is None and not push and not lens.size and not self._dense_keys.intersection(keys.tolist()):
            # A pull into a list says nothing of its keys' lengths: keys this worker pushed as keys
            # of their own stay so; others are in the one table this worker used, else one value
            # per key (all the default handle serves).
            width = next(iter(self._tables)) if len(self._tables) == 1 else 1
        if n and width is not None and width <= self._table_width:
            handle, post = self._table_request(push, pull, keys, vals, width, vals_out, lens_out, what)
            return self._track(ts, handle, post, callback, what, n)
        if push:
            self._dense_keys.update(keys.tolist())
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
        return self._track(ts, handle, post, callback, what, n)

    def _table_request(self, push, pull, keys, vals, width, vals_out, lens_out, what):
        """One table request for keys of ``width`` values each: (its handle, what completes it)."""
        table, n = self._table(width), keys.size
        rows = vals.reshape(n, width) if push else None
        post = out = None
        if pull:
            if type(vals_out) is np.ndarray and lens_out is None and vals_out.size == n * width \
                    and vals_out.flags.c_contiguous:
                out = vals_out.reshape(n, width)  # received in place
            else:
                post = functools.partial(_assemble, vals_out, lens_out, what, self.worker.dtype)
        if push and pull:
            handle = table.pushpull(keys, rows, out)
        elif push:
            handle = table.push(keys, rows)
        else:
            handle = table.pull(keys, out)
        return handle, post

    def _track(self, ts, handle, post, callback, what, n) -> int:
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
                    request.post(request.handle.wait(0))  # done: returns its result at once
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


def _width(vals, lens, n: int, push: bool, vals_out) -> int | None:
    """The values per key of a request whose keys all have as many; None when they differ or
    are not known (a pull with no lengths and no output array to size them by)."""
    if not n:
        return None
    if lens.size:
        first = int(lens[0])
        return first if (lens == first).all() else None
    size = vals.size if push else (vals_out.size if type(vals_out) is np.ndarray else None)
    if size is None or size % n:
        return None
    return size // n


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
