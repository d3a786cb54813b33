"""KVWorker and KVServer: ps-lite's key-value push and pull, with its semantics.

::

    kv = KVWorker(0, 0)                              # app 0, customer 0, float32 values
    ts = kv.push([1, 3], [1.1, 1.2, 3.1, 3.2])       # two keys, two values each; returns at once
    kv.wait(ts)
    out = np.empty(4, np.float32)
    kv.wait(kv.zpull([1, 3], out))                   # received straight into ``out``

- Keys are uint64, unique and ascending in every request (a clear error otherwise). Values are
  one flat array: ``len(vals) / len(keys)`` per key, or ``lens[i]`` for key i.
- A request is sliced across the servers by key range (server i holds ``[kMaxKey / n * i,
  kMaxKey / n * (i + 1))``; ``set_slicer`` replaces that), each slice goes to its server, and the
  request completes (``wait`` returns, the callback runs) when every slice answered.
- ``push``, ``pull`` and ``pushpull`` copy or convert what they are given (ps-lite copies into
  an SArray); ``zpush``, ``zpull`` and ``zpushpull`` take numpy arrays of the app's dtype and
  neither copy nor convert: the values go out from, and come back into, the caller's arrays,
  which must stay untouched until the request is done.
- A pull into a numpy array must give one of exactly the pulled size (numpy arrays cannot grow);
  a pull into a Python list replaces the list's contents, as ps-lite resizes a vector.

Servers: ``KVServer(app_id)`` with ``set_request_handle(handle)``; the handle gets
``(KVMeta, KVPairs, server)`` for each request slice and answers with ``server.response(meta,
pairs)``, at once or later from any thread (synchronous aggregation defers responses).
``KVServerDefaultHandle`` keeps ``store[key] += value`` and answers pulls from the store.

In service mode (``PSLINK_PSLITE_MODE=service``) the same KVWorker calls are served by the shared
Aggregator pool (pslink.pslite.service); there are no server processes.
"""

from __future__ import annotations

import logging
import sys
from typing import Any, Callable, Sequence

import numpy as np

from pslink.core.wire.protocol import DTYPES
from pslink.core.transport import DISCARD
from pslink.errors import ConfigError, ProtocolError, PslinkError, ShapeMismatchError
from pslink.pslite import wire
from pslink.pslite.node import MAX_QUEUED
from pslink.pslite.scheduler import Range
from pslink.pslite.simple import Request, SimpleApp
from pslink.pslite.wire import KEY_DTYPE, LEN_DTYPE, Kind

log = logging.getLogger("pslink.pslite")

_EMPTY_KEYS = np.empty(0, KEY_DTYPE)
_EMPTY_LENS = np.empty(0, LEN_DTYPE)


def value_dtype(dtype: Any) -> np.dtype:
    """The little-endian numpy dtype of an app's values, if pslink can carry it."""
    try:
        dt = np.dtype(dtype)
    except TypeError:
        raise ConfigError(f"dtype {dtype!r} is not a numpy dtype") from None
    if dt.name not in DTYPES or dt.byteorder == ">":
        raise ConfigError(f"values of dtype {dt} cannot be carried; use one of {', '.join(DTYPES)}")
    return DTYPES[dt.name]


class KVPairs:
    """A list of key-value pairs (ps-lite's KVPairs): ``keys`` (uint64), ``vals`` (flat),
    ``lens`` (int32; empty when every key has ``len(vals) / len(keys)`` values), ``priority``."""

    __slots__ = ("keys", "vals", "lens", "priority")

    def __init__(self, keys=None, vals=None, lens=None, priority: int = 0):
        self.keys = _EMPTY_KEYS if keys is None else keys
        self.vals = np.empty(0, np.float32) if vals is None else vals
        self.lens = _EMPTY_LENS if lens is None else lens
        self.priority = priority

    def __repr__(self) -> str:
        return f"KVPairs(keys={self.keys!r}, vals={self.vals!r}, lens={self.lens!r}, priority={self.priority})"


class KVMeta:
    """What a server knows of a request (ps-lite's KVMeta)."""

    __slots__ = ("cmd", "push", "pull", "sender", "timestamp", "customer_id", "app_id", "_origin", "_responded")

    def __init__(self, cmd=0, push=False, pull=False, sender=0, timestamp=0, customer_id=0, app_id=0):
        self.cmd, self.push, self.pull, self.sender = cmd, push, pull, sender
        self.timestamp, self.customer_id, self.app_id = timestamp, customer_id, app_id
        self._origin = None
        self._responded = False

    def __repr__(self) -> str:
        return (f"KVMeta(cmd={self.cmd}, push={self.push}, pull={self.pull}, sender={self.sender}, "
                f"timestamp={self.timestamp}, customer_id={self.customer_id})")


# -- argument checks --------------------------------------------------------------------------------


def check_keys(keys: Any, what: str) -> np.ndarray:
    """Keys as a contiguous uint64 array, unique and ascending, or a ConfigError naming the fault."""
    if type(keys) is np.ndarray and keys.dtype == KEY_DTYPE and keys.ndim == 1 and keys.flags.c_contiguous:
        array = keys
    else:
        try:
            array = np.asarray(keys)
        except Exception as exc:
            raise ConfigError(f"{what}: keys cannot be read as an array ({exc})") from None
        if array.dtype.kind in "fO" and array.size and not isinstance(keys, np.ndarray):
            # Python ints above 2**63 next to small ones make numpy pick float64 or object.
            array = _python_keys(keys, what)
        elif array.dtype.kind not in "iu" and not (array.size == 0 and array.dtype.kind == "f"):
            raise ConfigError(f"{what}: keys must be integers in [0, 2**64), got {array.dtype} values")
        if array.dtype.kind == "i" and array.size and array.min() < 0:
            raise ConfigError(f"{what}: keys must be integers in [0, 2**64); key {int(array.min())} is negative")
        array = np.ascontiguousarray(array.reshape(-1), KEY_DTYPE)
    if array.size > 1:
        bad = array[1:] <= array[:-1]
        if bad.any():
            i = int(bad.argmax()) + 1
            fault = "repeats" if array[i] == array[i - 1] else "follows"
            raise ConfigError(f"{what}: keys must be unique and in ascending order, but keys[{i}]={int(array[i])} "
                              f"{fault} keys[{i - 1}]={int(array[i - 1])}")
    return array


def _python_keys(keys: Any, what: str) -> np.ndarray:
    values = list(keys)
    for i, key in enumerate(values):
        if isinstance(key, bool) or not isinstance(key, (int, np.integer)) or not 0 <= int(key) < 1 << 64:
            raise ConfigError(f"{what}: keys must be integers in [0, 2**64); keys[{i}] is {key!r}")
    return np.array([int(k) for k in values], dtype=KEY_DTYPE)


def _check_lens(lens: Any, nkeys: int, what: str) -> np.ndarray:
    if lens is None:
        return _EMPTY_LENS
    try:
        array = np.asarray(lens)
    except Exception as exc:
        raise ConfigError(f"{what}: lens cannot be read as an array ({exc})") from None
    if array.size == 0:
        return _EMPTY_LENS
    if array.dtype.kind not in "iu":
        raise ConfigError(f"{what}: lens must be integers, got {array.dtype}")
    if array.size != nkeys:
        raise ConfigError(f"{what}: {array.size} lengths for {nkeys} keys; give one length per key")
    if array.min() < 0:
        raise ConfigError(f"{what}: lengths must not be negative (lens[{int(array.argmin())}]={int(array.min())})")
    return np.ascontiguousarray(array.reshape(-1), LEN_DTYPE)


def _check_layout(keys: np.ndarray, vals: np.ndarray, lens: np.ndarray, what: str) -> None:
    n = keys.size
    if lens.size:
        total = int(lens.sum())
        if total != vals.size:
            raise ConfigError(f"{what}: lengths sum to {total}, but {vals.size} values were given")
    elif n == 0:
        if vals.size:
            raise ConfigError(f"{what}: {vals.size} values but no keys")
    elif vals.size % n:
        raise ConfigError(f"{what}: {vals.size} values do not divide among {n} keys; give lens for values of "
                          "different lengths")


def default_slicer(send: KVPairs, ranges: Sequence[Range]) -> list[tuple[bool, KVPairs]]:
    """ps-lite's DefaultSlicer: cut a sorted request into the servers' key ranges."""
    keys, n = send.keys, send.keys.size
    if n and int(keys[-1]) >= ranges[-1].end:
        raise ConfigError(f"key {int(keys[-1])} is beyond the last server's key range [{ranges[-1].begin}, "
                          f"{ranges[-1].end}); ps-lite keys must be below kMaxKey / servers * servers")
    if len(ranges) == 1:
        return [(n > 0, send)]
    bounds = np.array([r.begin for r in ranges] + [ranges[-1].end], dtype=KEY_DTYPE)
    pos = np.searchsorted(keys, bounds).tolist()
    if send.lens.size:
        offsets = np.concatenate(([0], np.cumsum(send.lens))).tolist()
    else:
        k = send.vals.size // n if n else 0
        offsets = None
    sliced = []
    for i in range(len(ranges)):
        a, b = pos[i], pos[i + 1]
        if a == b:
            sliced.append((False, KVPairs(priority=send.priority)))
            continue
        if offsets is not None:
            part = KVPairs(keys[a:b], send.vals[offsets[a]:offsets[b]], send.lens[a:b], send.priority)
        else:
            part = KVPairs(keys[a:b], send.vals[a * k:b * k], _EMPTY_LENS, send.priority)
        sliced.append((True, part))
    return sliced


# -- server -------------------------------------------------------------------------------------------


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
                payloads.append(_check_lens(pairs.lens, keys.size, "response"))
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
        lens = arrays[2] if len(arrays) == 3 else _EMPTY_LENS
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
            lens = np.array([vals.size], LEN_DTYPE) if pairs.lens.size else _EMPTY_LENS
            server.response(meta, KVPairs(keys, vals, lens))
            return
        zero = np.zeros(1, server.dtype)
        values = [self.store.get(key, zero) for key in keys.tolist()]
        vals = np.concatenate(values) if n else np.empty(0, server.dtype)
        sizes = {v.size for v in values}
        lens = np.array([v.size for v in values], LEN_DTYPE) if (pairs.lens.size or len(sizes) > 1) else _EMPTY_LENS
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


# -- worker -------------------------------------------------------------------------------------------


class _Slice:
    __slots__ = ("target", "start", "count", "keys", "vals", "lens", "in_place", "error")

    def __init__(self, target: int, start: int, count: int):
        self.target, self.start, self.count = target, start, count
        self.keys = self.vals = self.lens = None
        self.in_place = False
        self.error: PslinkError | None = None


class _KVRequest(Request):
    __slots__ = ("keys", "pull", "vals_out", "lens_out", "k", "slices", "worker")

    def __init__(self, ts, callback, what, worker, keys, pull, vals_out, lens_out):
        super().__init__(ts, 0, callback, what)
        self.worker = worker  # for the description, made only when an error or a timeout needs it
        self.keys, self.pull, self.vals_out, self.lens_out = keys, pull, vals_out, lens_out
        self.k = None
        if pull and isinstance(vals_out, np.ndarray) and keys.size and vals_out.size % keys.size == 0:
            self.k = vals_out.size // keys.size  # slices of k values per key land in place
        self.slices: dict[int, _Slice] = {}

    def describe(self) -> str:
        worker = self.worker
        return (f"{self.what} of {self.keys.size} key(s) by app {worker.app_id} customer {worker.customer_id} "
                f"(timestamp {self.ts})")


class KVWorker(SimpleApp):
    """Pushes and pulls key-value lists to and from the servers (ps-lite's KVWorker)."""

    def __init__(self, app_id: int = 0, customer_id: int = 0, dtype: Any = np.float32, node=None):
        self.dtype = value_dtype(dtype)
        self._code = wire.DTYPE_CODES[self.dtype.name]
        self._slicer: Callable | None = None
        self._service_backend = None
        super().__init__(app_id, customer_id, node)

    def set_slicer(self, slicer: Callable[[KVPairs, list[Range]], list[tuple[bool, KVPairs]]]) -> None:
        """``slicer(send, ranges)`` returns one ``(send_it, KVPairs)`` per server (ps-lite's
        Slicer). In service mode there is nothing to slice: pMaster places the keys."""
        if not callable(slicer):
            raise ConfigError(f"slicer {slicer!r} is not callable")
        self._slicer = slicer

    # -- the ps-lite API -------------------------------------------------------------------------

    def push(self, keys, vals, lens=None, cmd: int = 0, callback=None, priority: int = 0) -> int:
        """Push ``vals`` for ``keys`` (copied first); returns the timestamp."""
        keys = check_keys(keys, "push")
        vals = self._copy_values(vals, "push")
        lens = _check_lens(lens, keys.size, "push")
        _check_layout(keys, vals, lens, "push")
        return self._submit(True, False, keys, vals, lens, None, None, cmd, callback, priority, "push")

    def zpush(self, keys, vals, lens=None, cmd: int = 0, callback=None, priority: int = 0) -> int:
        """Push without a copy: ``vals`` must stay unchanged until the request is done."""
        keys = check_keys(keys, "zpush")
        vals = self._zero_copy(vals, "zpush", writable=False)
        lens = _check_lens(lens, keys.size, "zpush")
        _check_layout(keys, vals, lens, "zpush")
        return self._submit(True, False, keys, vals, lens, None, None, cmd, callback, priority, "zpush")

    def pull(self, keys, vals_out, lens_out=None, cmd: int = 0, callback=None, priority: int = 0) -> int:
        """Pull the values of ``keys`` into ``vals_out`` (a list, replaced, or a numpy array of
        exactly the pulled size) and their lengths into ``lens_out`` if given."""
        keys = check_keys(keys, "pull")
        vals_out = self._out(vals_out, "pull", allow_list=True)
        lens_out = self._lens_out(lens_out, keys.size, "pull")
        return self._submit(False, True, keys, _EMPTY_VALS.get(self.dtype), _EMPTY_LENS, vals_out, lens_out, cmd,
                            callback, priority, "pull")

    def zpull(self, keys, vals_out, lens_out=None, cmd: int = 0, callback=None, priority: int = 0) -> int:
        """Pull straight into the numpy array ``vals_out`` (of the app's dtype, the pulled size)."""
        keys = check_keys(keys, "zpull")
        vals_out = self._out(vals_out, "zpull", allow_list=False)
        lens_out = self._lens_out(lens_out, keys.size, "zpull")
        return self._submit(False, True, keys, _EMPTY_VALS.get(self.dtype), _EMPTY_LENS, vals_out, lens_out, cmd,
                            callback, priority, "zpull")

    def pushpull(self, keys, vals, vals_out, lens_out=None, cmd: int = 0, callback=None, priority: int = 0) -> int:
        """Push ``vals`` (copied) and pull the result into ``vals_out`` (a list, or a numpy array
        of the same size as ``vals``, as ps-lite checks)."""
        keys = check_keys(keys, "pushpull")
        vals = self._copy_values(vals, "pushpull")
        # As ps-lite's PushPull: lengths given in lens_out are the pushed ones, and get the pulled ones.
        lens = _check_lens(lens_out, keys.size, "pushpull") if lens_out is not None and len(lens_out) else _EMPTY_LENS
        _check_layout(keys, vals, lens, "pushpull")
        vals_out = self._out(vals_out, "pushpull", allow_list=True)
        if isinstance(vals_out, np.ndarray) and vals_out.size != vals.size:
            raise ShapeMismatchError(f"pushpull: vals_out holds {vals_out.size} values, but {vals.size} are pushed")
        lens_out = self._lens_out(lens_out, keys.size, "pushpull")
        return self._submit(True, True, keys, vals, lens, vals_out, lens_out, cmd, callback, priority, "pushpull")

    def zpushpull(self, keys, vals, vals_out, lens=None, cmd: int = 0, callback=None, priority: int = 0) -> int:
        """Push ``vals`` and pull into ``vals_out`` without copies (``vals_out`` may be ``vals``).
        ``lens``, if given, are the pushed lengths and receive the pulled ones (ps-lite's ZPushPull)."""
        keys = check_keys(keys, "zpushpull")
        vals = self._zero_copy(vals, "zpushpull", writable=False)
        push_lens = _check_lens(lens, keys.size, "zpushpull")
        _check_layout(keys, vals, push_lens, "zpushpull")
        vals_out = self._out(vals_out, "zpushpull", allow_list=False)
        lens_out = self._lens_out(lens, keys.size, "zpushpull")
        return self._submit(True, True, keys, vals, push_lens, vals_out, lens_out, cmd, callback, priority,
                            "zpushpull")

    def wait(self, timestamp: int, timeout: float | None = None) -> None:
        """Block until request ``timestamp`` is done (its pulled values are in place); raises its
        error if it failed. ``timeout`` defaults to the node's (PSLINK_TIMEOUT, 300 s)."""
        timeout = self.node.config.timeout if timeout is None else timeout
        if self._service_backend is not None and self._service_backend.wait(timestamp, timeout):
            return
        self._customer.wait(timestamp, timeout)

    # -- submitting -------------------------------------------------------------------------------

    def _submit(self, push, pull, keys, vals, lens, vals_out, lens_out, cmd, callback, priority, what) -> int:
        node = self.node
        node.require_ready(what)
        node.driver.touch()
        cmd = wire.check_i32("cmd", cmd)
        priority = wire.check_i32("priority", priority)
        if callback is not None and not callable(callback):
            raise ConfigError(f"{what}: callback {callback!r} is not callable")
        if node.mode == "service":
            if self._service_backend is None:
                from pslink.pslite.service import ServiceBackend

                self._service_backend = ServiceBackend(self)
            return self._service_backend.submit(push, pull, keys, vals, lens, vals_out, lens_out, callback, what)
        ranges = node.server_key_ranges()
        if not ranges:
            raise ConfigError(f"{what}: there are no servers to send to (DMLC_NUM_SERVER=0)")
        n = keys.size
        if self._slicer is None and len(ranges) == 1:  # the common case, without the slicer's work
            if n and int(keys[-1]) >= ranges[0].end:
                raise ConfigError(f"{what}: key {int(keys[-1])} is beyond the server's key range [0, {ranges[0].end})")
            parts = [(0, 0, keys, vals, lens)] if n else []
        else:
            parts = self._slice(KVPairs(keys, vals, lens, priority), ranges, what)
        ts = self._customer.new_ts()
        request = _KVRequest(ts, callback, what, self, keys, pull, vals_out, lens_out)
        flags = (wire.PUSH if push else 0) | (wire.PULL if pull else 0)
        sends = []
        for rank, start, part_keys, part_vals, part_lens in parts:
            target = node.server_id(rank)
            request.slices[target] = _Slice(target, start, part_keys.size)
            request.targets.add(target)
            if part_lens.size:
                header = wire.encode(Kind.KV_REQUEST, flags=flags | wire.LENS, dtype=self._code, app=self.app_id,
                                     customer=self.customer_id, ts=ts, sender=node.id, cmd=cmd, priority=priority)
                sends.append((target, [header, part_keys, part_vals, part_lens]))
            else:
                header = wire.encode(Kind.KV_REQUEST, flags=flags, dtype=self._code, app=self.app_id,
                                     customer=self.customer_id, ts=ts, sender=node.id, cmd=cmd, priority=priority)
                sends.append((target, [header, part_keys, part_vals]))
        request.left = len(sends)
        self._customer.add(request)
        if not sends:  # nothing for any server: done now (ps-lite runs the callback here too)
            self._finish(request)
            return ts
        for target, frames in sends:
            node.send_request(target, frames, self, ts)
        return ts

    def _slice(self, send: KVPairs, ranges: list[Range], what: str) -> list[tuple]:
        """The request's slices to send: (server rank, index of the first key, keys, vals, lens)."""
        keys = send.keys
        if self._slicer is None:
            try:
                sliced = default_slicer(send, ranges)
            except ConfigError as exc:
                raise ConfigError(f"{what}: {exc.message}") from None
        else:
            sliced = self._slicer(send, list(ranges))
            if not isinstance(sliced, (list, tuple)) or len(sliced) != len(ranges):
                size = len(sliced) if hasattr(sliced, "__len__") else "?"
                raise ConfigError(f"{what}: the slicer must return one (bool, KVPairs) per server ({len(ranges)}), "
                                  f"got {type(sliced).__name__} of {size}")
        parts = []
        for rank, entry in enumerate(sliced):
            if not (isinstance(entry, (list, tuple)) and len(entry) == 2 and isinstance(entry[1], KVPairs)):
                raise ConfigError(f"{what}: the slicer's entry for server {rank} must be (bool, KVPairs), "
                                  f"got {entry!r}")
            if not entry[0]:
                continue
            part = entry[1]
            if self._slicer is not None:
                part_keys = check_keys(part.keys, f"{what} (slice for server {rank})")
                part = KVPairs(part_keys, np.ascontiguousarray(part.vals, self.dtype).reshape(-1),
                               _check_lens(part.lens, part_keys.size, what), part.priority)
                if part_keys.size and not np.isin(part_keys, keys).all():
                    raise ConfigError(f"{what}: the slicer gave server {rank} keys that are not in the request")
            start = int(np.searchsorted(keys, part.keys[0])) if part.keys.size else 0
            parts.append((rank, start, part.keys, part.vals, part.lens))
        return parts

    # -- receiving (on the driving thread) ----------------------------------------------------------

    def _response_buffers(self, header, sizes):
        request = self._customer.pending.get(header.ts)
        if type(request) is not _KVRequest or not request.pull:
            return DISCARD
        sl = request.slices.get(header.sender)
        if sl is None or sl.keys is not None:
            return DISCARD
        if header.dtype != self.dtype:
            sl.error = ProtocolError(f"{request.describe()}: server node {header.sender} answered with "
                                     f"{header.dtype.name} values; this KVWorker uses {self.dtype.name}")
            return DISCARD
        nkeys = sizes[0] // 8
        nvals = sizes[1] // self.dtype.itemsize
        sl.keys = np.empty(nkeys, KEY_DTYPE)
        k = request.k
        if k is not None and nkeys == sl.count and nvals == sl.count * k:
            sl.vals = request.vals_out[sl.start * k:(sl.start + sl.count) * k]
            sl.in_place = True
        else:
            sl.vals = np.empty(nvals, self.dtype)
        if len(sizes) == 3:
            sl.lens = np.empty(nkeys, LEN_DTYPE)
            return [memoryview(sl.keys).cast("B"), memoryview(sl.vals).cast("B"), memoryview(sl.lens).cast("B")]
        return [memoryview(sl.keys).cast("B"), memoryview(sl.vals).cast("B")]

    def _on_kv_response(self, header) -> None:
        request = self._customer.pending.get(header.ts)
        if request is None:
            return
        sl = request.slices.get(header.sender) if type(request) is _KVRequest else None
        done = self._customer.answered(header.ts, header.sender, sl.error if sl is not None else None)
        if done is not None:
            self._finish(done)

    def _finish(self, request: Request) -> None:
        if type(request) is _KVRequest and request.pull and request.error is None:
            try:
                self._assemble(request)
            except PslinkError as exc:
                request.error = exc
        self._customer.finish(request)

    def _assemble(self, request: _KVRequest) -> None:
        """Check what the servers answered against what was asked, and put it in place."""
        slices = sorted(request.slices.values(), key=lambda s: s.start)
        keys, got = request.keys, 0
        for sl in slices:
            answered = sl.keys if sl.keys is not None else _EMPTY_KEYS
            asked = keys[sl.start:sl.start + sl.count]
            if answered.size != asked.size or not np.array_equal(answered, asked):
                raise ProtocolError(f"{request.describe()}: server node {sl.target} answered {answered.size} key(s) "
                                    f"for the {asked.size} it was asked for, or other keys")
            got += answered.size
        if got != keys.size:
            raise ProtocolError(f"{request.describe()}: the servers answered {got} of {keys.size} keys (a lost slice?)")
        vals_out, lens_out = request.vals_out, request.lens_out
        in_place = all(sl.in_place for sl in slices)
        if in_place and lens_out is None:
            return
        parts = [sl.vals if sl.vals is not None else np.empty(0, self.dtype) for sl in slices]
        total = sum(p.size for p in parts)
        if isinstance(vals_out, np.ndarray):
            if vals_out.size != total:
                raise ShapeMismatchError(
                    f"{request.describe()}: the pull buffer holds {vals_out.size} value(s), but the servers returned "
                    f"{total} for {keys.size} key(s); pass an array of {total} (or a list, which is resized)")
            if not in_place:
                vals_out[:] = np.concatenate(parts) if len(parts) > 1 else parts[0]
        else:
            vals_out[:] = (np.concatenate(parts) if parts else np.empty(0, self.dtype)).tolist()
        if lens_out is not None:
            lens = np.concatenate([self._slice_lens(sl) for sl in slices]) if slices else _EMPTY_LENS
            if isinstance(lens_out, np.ndarray):
                lens_out[:] = lens
            else:
                lens_out[:] = lens.tolist()

    @staticmethod
    def _slice_lens(sl: _Slice) -> np.ndarray:
        if sl.lens is not None:
            return sl.lens
        count, values = sl.count, (sl.vals.size if sl.vals is not None else 0)
        if count == 0:
            return _EMPTY_LENS
        if values % count:
            raise ProtocolError(f"server node {sl.target} returned {values} values for {count} keys without lengths")
        return np.full(count, values // count, LEN_DTYPE)

    def _fail_all(self, error: PslinkError) -> None:
        super()._fail_all(error)
        if self._service_backend is not None:
            self._service_backend.fail_all(error)

    # -- argument helpers ----------------------------------------------------------------------------

    def _copy_values(self, vals, what: str) -> np.ndarray:
        try:
            return np.array(vals, dtype=self.dtype, copy=True).reshape(-1)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"{what}: values cannot be read as {self.dtype.name} ({exc})") from None

    def _zero_copy(self, vals, what: str, writable: bool) -> np.ndarray:
        if (type(vals) is np.ndarray and vals.ndim == 1 and vals.dtype == self.dtype and vals.flags.c_contiguous
                and (not writable or vals.flags.writeable)):
            return vals  # what every zero-copy call gives: checked in one go
        if not isinstance(vals, np.ndarray):
            raise ConfigError(f"{what} sends without a copy, so values must be a numpy array of {self.dtype.name}; got "
                              f"{type(vals).__name__} (the copying form converts)")
        if vals.dtype != self.dtype:
            raise ConfigError(f"{what}: values are {vals.dtype}, but this KVWorker uses {self.dtype.name} (the copying "
                              "form converts)")
        if not vals.flags.c_contiguous or (writable and not vals.flags.writeable):
            raise ConfigError(f"{what}: values must be a {'writable ' if writable else ''}C-contiguous array")
        return vals.reshape(-1)

    def _out(self, vals_out, what: str, allow_list: bool):
        if isinstance(vals_out, list) and allow_list:
            return vals_out
        if isinstance(vals_out, np.ndarray):
            return self._zero_copy(vals_out, what + " output", writable=True)
        allowed = "a list or a numpy array" if allow_list else f"a numpy array of {self.dtype.name}"
        raise ConfigError(f"{what}: vals_out must be {allowed} to receive the values, got {type(vals_out).__name__}")

    def _lens_out(self, lens_out, nkeys: int, what: str):
        if lens_out is None or isinstance(lens_out, list):
            return lens_out
        if isinstance(lens_out, np.ndarray):
            if lens_out.dtype.kind not in "iu" or not lens_out.flags.writeable or lens_out.size != nkeys:
                raise ShapeMismatchError(f"{what}: lens_out must be a writable integer array of {nkeys} (one per key), "
                                         f"got {lens_out.dtype} of {lens_out.size}")
            return lens_out.reshape(-1)
        raise ConfigError(f"{what}: lens_out must be a list or a numpy integer array, got {type(lens_out).__name__}")


class _EmptyValues(dict):
    """One empty array per dtype, the values of every pull request."""

    def get(self, dtype):  # type: ignore[override]
        array = super().get(dtype)
        if array is None:
            array = self[dtype] = np.empty(0, dtype)
        return array


_EMPTY_VALS = _EmptyValues()

__all__ = ["KVMeta", "KVPairs", "KVServer", "KVServerDefaultHandle", "KVWorker", "Range", "default_slicer",
           "check_keys", "value_dtype"]
