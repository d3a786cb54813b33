"""KVServer: serves KVWorkers' requests of one app id (ps-lite's KVServer); see :mod:`pslink.pslite.kv`."""

from __future__ import annotations

import logging
import sys
from typing import Any, Callable

import numpy as np

from pslink.errors import ConfigError, ProtocolError, PslinkError, ShapeMismatchError
from pslink.pslite import wire
from pslink.pslite.inbox import MAX_QUEUED
from pslink.pslite.kv import EMPTY_LENS, KVMeta, KVPairs, check_keys, check_lens, value_dtype
from pslink.pslite.simple import SimpleApp
from pslink.pslite.wire import KEY_DTYPE, LEN_DTYPE, Kind

log = logging.getLogger("pslink.pslite")


class KVServer(SimpleApp):
    """Serves KVWorkers' requests of one app id with a request handle (ps-lite's KVServer)."""

    def __init__(self, app_id: int = 0, dtype: Any = np.float32, node=None):
        self.dtype = value_dtype(dtype)
        self._code = wire.DTYPE_CODES[self.dtype.name]
        self._handle: Callable | None = None
        self._waiting: list[tuple[KVMeta, KVPairs]] = []
        super().__init__(app_id, app_id, node)

    def set_request_handle(self, handle: Callable[[KVMeta, KVPairs, "KVServer"], None]) -> None:
        """``handle(meta, pairs, server)`` for every request; requests that arrived before it was
        set run now, in order (ps-lite aborts on them)."""
        if not callable(handle):
            raise ConfigError(f"request handle {handle!r} is not callable")
        self._handle = handle
        if self._waiting:
            self.node.post(self._drain_waiting)

    def response(self, meta: KVMeta, pairs: KVPairs | None = None) -> None:
        """Answer request ``meta`` with ``pairs`` (keys, values, optional lengths) or nothing.
        Any thread, any time; the arrays are sent without a copy, so leave them alone until the
        next request for the same keys (KVServerDefaultHandle copies before it would overwrite)."""
        if not isinstance(meta, KVMeta) or meta._origin is None:
            raise ConfigError("response() needs the KVMeta a request handle received")
        if meta._responded:
            raise ConfigError(f"request {meta.timestamp} from node {meta.sender} (customer {meta.customer_id}) "
                              "was already answered")
        meta._responded = True
        flags = (wire.PUSH if meta.push else 0) | (wire.PULL if meta.pull else 0)
        payloads: list = []
        if pairs is not None and len(pairs.keys):
            keys, vals = pairs.keys, pairs.vals
            # The worker checks the keys against what it asked for; here they only need to travel.
            if type(keys) is not np.ndarray or keys.dtype != KEY_DTYPE or not keys.flags.c_contiguous:
                keys = check_keys(keys, "response")
            if type(vals) is not np.ndarray or vals.dtype != self.dtype or not vals.flags.c_contiguous:
                try:
                    vals = np.ascontiguousarray(vals, dtype=self.dtype)
                except (TypeError, ValueError) as exc:
                    raise ConfigError(f"response: values cannot be read as {self.dtype.name} ({exc})") from None
            payloads = [keys, vals.reshape(-1)]
            if len(pairs.lens):
                payloads.append(check_lens(pairs.lens, keys.size, "response"))
                flags |= wire.LENS
        header = wire.encode(Kind.KV_RESPONSE, flags=flags, dtype=self._code, app=meta.app_id,
                             customer=meta.customer_id, ts=meta.timestamp, sender=self.node.id, cmd=meta.cmd)
        try:
            meta._origin.send([header, *payloads])
        except PslinkError as exc:
            log.warning("%r: the answer to node %s's request %d is lost: %s", self, meta.sender, meta.timestamp, exc)

    # -- on the driving thread ------------------------------------------------------------------

    def _on_kv_request(self, conn, header, arrays) -> None:
        meta = KVMeta(header.cmd, header.push, header.pull, header.sender, header.ts, header.customer, header.app)
        meta._origin = conn
        if header.dtype != self.dtype:
            self._fail_request(meta, header, ProtocolError(
                f"worker node {header.sender} sends {header.dtype.name} values to app {self.app_id}, but this "
                f"server's KVServer holds {self.dtype.name}"))
            return
        lens = arrays[2] if len(arrays) == 3 else EMPTY_LENS
        if lens.size and header.push and (lens.min() < 0 or int(lens.sum()) != arrays[1].size):
            self._fail_request(meta, header, ProtocolError(
                f"worker node {header.sender}: lengths sum to {int(lens.sum())} for {arrays[1].size} values"))
            return
        pairs = KVPairs(arrays[0], arrays[1], lens, header.priority)
        if self._handle is None or self._waiting:
            if len(self._waiting) >= MAX_QUEUED:
                self._fail_request(meta, header, ConfigError(
                    f"KVServer app {self.app_id} has no request handle after {MAX_QUEUED} requests queued; "
                    "call set_request_handle"))
                return
            self._waiting.append((meta, pairs))  # ps-lite aborts here; we wait for the handle
            return
        self._run(meta, pairs)

    def _drain_waiting(self) -> None:
        while self._waiting:
            meta, pairs = self._waiting.pop(0)
            self._run(meta, pairs)

    def _run(self, meta: KVMeta, pairs: KVPairs) -> None:
        try:
            self._handle(meta, pairs, self)
        except Exception as exc:
            log.exception("%r: request handle failed on %r", self, meta)
            if not meta._responded:
                meta._responded = True
                what = "push" if meta.push and not meta.pull else "pull" if meta.pull and not meta.push else "pushpull"
                error = exc if isinstance(exc, PslinkError) else PslinkError(
                    f"server {self.node.rank} (app {self.app_id}) failed on a {what} of {len(pairs.keys)} key(s) from "
                    f"node {meta.sender}: {type(exc).__name__}: {exc}")
                self._send_error(meta, error)

    def _fail_request(self, meta: KVMeta, header, error: PslinkError) -> None:
        log.warning("%r: %s", self, error)
        meta._responded = True
        self._send_error(meta, error)

    def _send_error(self, meta: KVMeta, error: PslinkError) -> None:
        frame = wire.encode_error(error, app=meta.app_id, customer=meta.customer_id, ts=meta.timestamp,
                                  sender=self.node.id)
        try:
            meta._origin.send([frame])
        except PslinkError:
            pass


class KVServerDefaultHandle:
    """ps-lite's default handle: ``store[key] += value`` on push; pulls answer from the store.

    ps-lite's keeps one value per key; this one keeps each key's values as an array (of the
    length its first push had), so one value per key is the ps-lite case. A key never pushed
    pulls as one zero, as ps-lite's default-constructed value does.
    """

    def __init__(self):
        self.store: dict[int, np.ndarray] = {}

    def __call__(self, meta: KVMeta, pairs: KVPairs, server: KVServer) -> None:
        keys = pairs.keys
        n = keys.size
        if meta.push and n:
            vals, lens = pairs.vals, pairs.lens
            if n == 1:
                self._add(int(keys[0]), vals, meta)
            elif lens.size:
                ends = np.cumsum(lens).tolist()
                start = 0
                for key, end in zip(keys.tolist(), ends):
                    self._add(key, vals[start:end], meta)
                    start = end
            else:
                k = vals.size // n
                for i, key in enumerate(keys.tolist()):
                    self._add(key, vals[i * k:(i + 1) * k], meta)
        if not meta.pull:
            server.response(meta)
            return
        if n == 1:
            vals = self.store.get(int(keys[0]))
            if vals is None:
                vals = np.zeros(1, server.dtype)
            lens = np.array([vals.size], LEN_DTYPE) if pairs.lens.size else EMPTY_LENS
            server.response(meta, KVPairs(keys, vals, lens))
            return
        zero = np.zeros(1, server.dtype)
        values = [self.store.get(key, zero) for key in keys.tolist()]
        vals = np.concatenate(values) if n else np.empty(0, server.dtype)
        sizes = {v.size for v in values}
        lens = np.array([v.size for v in values], LEN_DTYPE) if (pairs.lens.size or len(sizes) > 1) else EMPTY_LENS
        server.response(meta, KVPairs(keys, vals, lens))

    def _add(self, key: int, value: np.ndarray, meta: KVMeta) -> None:
        current = self.store.get(key)
        if current is None:
            self.store[key] = np.array(value)  # the received buffer is pooled: keep a copy
            return
        if current.size != value.size:
            raise ShapeMismatchError(f"key {key}: the store holds {current.size} value(s), but node {meta.sender} "
                                     f"pushed {value.size}", key=key)
        # References: the store, ``current`` and getrefcount's argument. More means a reply still
        # queued on a socket reads this array: add into a new one instead of under its feet.
        if sys.getrefcount(current) > 3:
            self.store[key] = current + value
        else:
            np.add(current, value, out=current)
