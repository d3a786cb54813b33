"""KVWorker: pushes and pulls key-value lists (ps-lite's KVWorker); see :mod:`pslink.pslite.kv`."""

from __future__ import annotations

import logging
from typing import Any, Callable

import numpy as np

from pslink.core.transport import DISCARD
from pslink.errors import ConfigError, ProtocolError, PslinkError, ShapeMismatchError
from pslink.pslite import wire
from pslink.pslite.kv import (
    EMPTY_KEYS,
    EMPTY_LENS,
    KVPairs,
    check_keys,
    check_layout,
    check_lens,
    default_slicer,
    value_dtype,
)
from pslink.pslite.scheduler import Range
from pslink.pslite.simple import Request, SimpleApp
from pslink.pslite.wire import KEY_DTYPE, LEN_DTYPE, Kind

log = logging.getLogger("pslink.pslite")


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
        lens = check_lens(lens, keys.size, "push")
        check_layout(keys, vals, lens, "push")
        return self._submit(True, False, keys, vals, lens, None, None, cmd, callback, priority, "push")

    def zpush(self, keys, vals, lens=None, cmd: int = 0, callback=None, priority: int = 0) -> int:
        """Push without a copy: ``vals`` must stay unchanged until the request is done."""
        keys = check_keys(keys, "zpush")
        vals = self._zero_copy(vals, "zpush", writable=False)
        lens = check_lens(lens, keys.size, "zpush")
        check_layout(keys, vals, lens, "zpush")
        return self._submit(True, False, keys, vals, lens, None, None, cmd, callback, priority, "zpush")

    def pull(self, keys, vals_out, lens_out=None, cmd: int = 0, callback=None, priority: int = 0) -> int:
        """Pull the values of ``keys`` into ``vals_out`` (a list, replaced, or a numpy array of
        exactly the pulled size) and their lengths into ``lens_out`` if given."""
        keys = check_keys(keys, "pull")
        vals_out = self._out(vals_out, "pull", allow_list=True)
        lens_out = self._lens_out(lens_out, keys.size, "pull")
        return self._submit(False, True, keys, _EMPTY_VALS.get(self.dtype), EMPTY_LENS, vals_out, lens_out, cmd,
                            callback, priority, "pull")

    def zpull(self, keys, vals_out, lens_out=None, cmd: int = 0, callback=None, priority: int = 0) -> int:
        """Pull straight into the numpy array ``vals_out`` (of the app's dtype, the pulled size)."""
        keys = check_keys(keys, "zpull")
        vals_out = self._out(vals_out, "zpull", allow_list=False)
        lens_out = self._lens_out(lens_out, keys.size, "zpull")
        return self._submit(False, True, keys, _EMPTY_VALS.get(self.dtype), EMPTY_LENS, vals_out, lens_out, cmd,
                            callback, priority, "zpull")

    def pushpull(self, keys, vals, vals_out, lens_out=None, cmd: int = 0, callback=None, priority: int = 0) -> int:
        """Push ``vals`` (copied) and pull the result into ``vals_out`` (a list, or a numpy array
        of the same size as ``vals``, as ps-lite checks)."""
        keys = check_keys(keys, "pushpull")
        vals = self._copy_values(vals, "pushpull")
        # As ps-lite's PushPull: lengths given in lens_out are the pushed ones, and get the pulled ones.
        lens = check_lens(lens_out, keys.size, "pushpull") if lens_out is not None and len(lens_out) else EMPTY_LENS
        check_layout(keys, vals, lens, "pushpull")
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
        push_lens = check_lens(lens, keys.size, "zpushpull")
        check_layout(keys, vals, push_lens, "zpushpull")
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
                               check_lens(part.lens, part_keys.size, what), part.priority)
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
        slices = request.slices
        # (one slice, one key: most requests; np.array_equal costs more than the rest of this)
        slices = list(slices.values()) if len(slices) == 1 else sorted(slices.values(), key=lambda s: s.start)
        keys, got = request.keys, 0
        for sl in slices:
            answered = sl.keys if sl.keys is not None else EMPTY_KEYS
            asked = keys[sl.start:sl.start + sl.count]
            if answered.size != asked.size or answered.tobytes() != asked.tobytes():
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
            lens = np.concatenate([self._slice_lens(sl) for sl in slices]) if slices else EMPTY_LENS
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
            return EMPTY_LENS
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
