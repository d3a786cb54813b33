"""ps-lite's key-value push and pull, with its semantics: the pairs, their checks and the slicer here;
KVWorker in :mod:`pslink.pslite.kv_worker`, KVServer in :mod:`pslink.pslite.kv_server`.

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
from typing import Any, Sequence

import numpy as np

from pslink.core.wire.protocol import DTYPES
from pslink.errors import ConfigError
from pslink.pslite.scheduler import Range
from pslink.pslite.wire import KEY_DTYPE, LEN_DTYPE

log = logging.getLogger("pslink.pslite")

EMPTY_KEYS = np.empty(0, KEY_DTYPE)
EMPTY_LENS = np.empty(0, LEN_DTYPE)


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
        self.keys = EMPTY_KEYS if keys is None else keys
        self.vals = np.empty(0, np.float32) if vals is None else vals
        self.lens = EMPTY_LENS if lens is None else lens
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


def check_lens(lens: Any, nkeys: int, what: str) -> np.ndarray:
    if lens is None:
        return EMPTY_LENS
    try:
        array = np.asarray(lens)
    except Exception as exc:
        raise ConfigError(f"{what}: lens cannot be read as an array ({exc})") from None
    if array.size == 0:
        return EMPTY_LENS
    if array.dtype.kind not in "iu":
        raise ConfigError(f"{what}: lens must be integers, got {array.dtype}")
    if array.size != nkeys:
        raise ConfigError(f"{what}: {array.size} lengths for {nkeys} keys; give one length per key")
    if array.min() < 0:
        raise ConfigError(f"{what}: lengths must not be negative (lens[{int(array.argmin())}]={int(array.min())})")
    return np.ascontiguousarray(array.reshape(-1), LEN_DTYPE)


def check_layout(keys: np.ndarray, vals: np.ndarray, lens: np.ndarray, what: str) -> None:
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
            part = KVPairs(keys[a:b], send.vals[a * k:b * k], EMPTY_LENS, send.priority)
        sliced.append((True, part))
    return sliced

__all__ = ["KVMeta", "KVPairs", "Range", "check_keys", "default_slicer", "value_dtype"]
