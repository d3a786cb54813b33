"""Sparse tables (no I/O): rows of a fixed width keyed by 64-bit ids, held in shards.

A table is one key of a job whose parts are its **shards**: an id lives in shard
``shard_of(id, shards)`` (a hash, so consecutive ids spread evenly, whatever their range), and
each shard is one model aggregation task, placed, migrated, replicated and checkpointed as a
tensor's part is. A row is created on first touch (a push or a pull of its id) from the table's
initializer, which depends only on the id and the seed, so a row starts the same whatever shard
or Aggregator holds it. A shard may be capped: past ``capacity`` rows it evicts the least
recently used ones (``evict="lru"``), or rows untouched for ``ttl`` seconds go (``"ttl"``).

Pushes are summed per id in a fixed order (the ranks' pushes in rank order, each push in its
own order), then applied by the table's row optimizer: ``sum`` (the row accumulates the pushes:
ps-lite's default server handle), ``sgd``, ``adagrad`` or ``adam`` with lazy moments (only the
rows a round touches move; the bias correction counts the shard's steps, as torch's SparseAdam
counts its ``step()`` calls). Everything here is numpy over whole requests: no Python loop runs
per id.
"""

from __future__ import annotations

import math

import numpy as np

from pslink.core.wire.protocol import FLOAT_DTYPES
from pslink.errors import ConfigError, KeyStateError

ID_DTYPE = np.dtype("<u8")
INITS = ("zeros", "uniform", "normal")
OPTIMIZERS = {
    "sum": {},
    "sgd": {"lr": 0.01},
    "adagrad": {"lr": 0.01, "eps": 1e-10, "initial_accumulator_value": 0.0},
    "adam": {"lr": 0.001, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8},
    "job": {},  # the job's own optimizer (pslink.core.optim), applied to the touched rows only
}
_PER_ROW = {"adagrad": ("acc",), "adam": ("m", "v")}  # the row optimizers' state, a row of it per id
EVICTIONS = ("lru", "ttl")
EVICT_SLACK = 0.1  # a full shard evicts this fraction of its capacity more than it needs, so it evicts seldom
MAX_WIDTH = 1 << 20

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer over a uint64 array: a bijection that scatters nearby ids."""
    with np.errstate(over="ignore"):
        z = x + _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * _M1
        z = (z ^ (z >> np.uint64(27))) * _M2
        return z ^ (z >> np.uint64(31))


def as_ids(ids, what: str) -> np.ndarray:
    """Ids as a contiguous uint64 array; negative or non-integer ids are refused by name."""
    array = np.asarray(ids)
    if array.ndim != 1:
        array = array.reshape(-1)
    if array.dtype == ID_DTYPE:
        return np.ascontiguousarray(array)
    if array.dtype.kind == "u":
        return array.astype(ID_DTYPE)
    if array.dtype.kind == "i":
        if array.size and int(array.min()) < 0:
            raise ConfigError(f"{what}: ids must be non-negative, got {int(array.min())}")
        return array.astype(ID_DTYPE)
    if array.size == 0:
        return np.empty(0, ID_DTYPE)
    raise ConfigError(f"{what}: ids must be integers, got dtype {array.dtype}")


def shard_of(ids: np.ndarray, shards: int) -> np.ndarray:
    """The shard of each id (uint16): Fibonacci hashing (the id times 2^64 / golden ratio, its
    top bits, which depend on every bit of the id), spreading consecutive ids and ps-lite's
    evenly strided keys alike."""
    if shards == 1:
        return np.zeros(ids.size, np.uint16)
    with np.errstate(over="ignore"):
        high = (ids * _GOLDEN) >> np.uint64(32)  # the product's top 32 bits...
        return ((high * np.uint64(shards)) >> np.uint64(32)).astype(np.uint16)  # ...scaled to [0, shards)


def split_by_shard(ids: np.ndarray, shards: int) -> tuple[np.ndarray, np.ndarray]:
    """``(order, bounds)``: ``ids[order]`` grouped by shard (stable: each shard's ids keep their
    order), shard ``s`` being ``[bounds[s], bounds[s + 1])`` of it."""
    if shards == 1:
        return np.arange(ids.size), np.array([0, ids.size], np.int64)
    shard = shard_of(ids, shards)
    order = np.argsort(shard, kind="stable")  # a radix sort, for 16-bit keys
    bounds = np.zeros(shards + 1, np.int64)
    np.cumsum(np.bincount(shard, minlength=shards), out=bounds[1:])
    return order, bounds


def initial_rows(ids: np.ndarray, width: int, dtype: np.dtype, init: list, seed: int) -> np.ndarray:
    """The first value of each id's row: a function of (id, column, seed) only."""
    kind = init[0]
    if kind == "zeros" or ids.size == 0:
        return np.zeros((ids.size, width), dtype)
    base = mix64(ids ^ mix64(np.array([seed], ID_DTYPE)))[:, None]
    with np.errstate(over="ignore"):
        streams = width if kind == "uniform" else 2 * width  # Box-Muller takes two uniforms per value
        counters = np.arange(streams, dtype=ID_DTYPE)[None, :] * _GOLDEN
        bits = mix64(base + counters)
    uniform = (bits >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))  # [0, 1)
    if kind == "uniform":
        low, high = init[1], init[2]
        return (low + (high - low) * uniform[:, :width]).astype(dtype)
    mean, std = init[1], init[2]  # Box-Muller from the row's two streams
    radius = np.sqrt(-2.0 * np.log1p(-uniform[:, :width]))
    return (mean + std * radius * np.cos(2 * math.pi * uniform[:, width:])).astype(dtype)


def sum_duplicates(ids: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Unique ids (sorted) and their rows summed, each id's rows added left to right in the order
    they came (float addition is not associative: the order is part of the result, so a sum is
    the same bit for bit wherever it is made)."""
    if ids.size < 2 or (ids[1:] > ids[:-1]).all():
        return ids, rows  # sorted and unique already: ps-lite's keys are
    unique, inverse, counts = np.unique(ids, return_inverse=True, return_counts=True)
    order = np.argsort(inverse, kind="stable")  # grouped by id, each group in arrival order
    if unique.size == ids.size:
        return unique, rows[order]
    starts = np.zeros(unique.size, np.int64)
    np.cumsum(counts[:-1], out=starts[1:])
    summed = rows[order[starts]]
    # The k-th rows of every id that has one, added as a whole: one pass per multiplicity, over
    # the ids that have that many (most-repeated first, so each pass takes a prefix).
    by_count = np.argsort(-counts, kind="stable")
    descending = counts[by_count]
    for k in range(1, int(descending[0])):
        groups = by_count[: np.searchsorted(-descending, -k, side="left")]
        summed[groups] += rows[order[starts[groups] + k]]
    return unique, summed


def table_options(options: dict, what: str) -> dict:
    """A table's settings, checked and completed; a ConfigError names what is wrong."""
    if not isinstance(options, dict):
        raise ConfigError(f"{what}: table options must be a map")
    known = {"width", "shards", "init", "seed", "optimizer", "capacity", "evict", "ttl"}
    unknown = sorted(set(options) - known)
    if unknown:
        raise ConfigError(f"{what}: unknown table option(s) {unknown}; known: {sorted(known)}")
    width, shards = options.get("width"), options.get("shards", 1)
    if not isinstance(width, int) or isinstance(width, bool) or not 0 < width <= MAX_WIDTH:
        raise ConfigError(f"{what}: width {width!r} must be an int in 1..{MAX_WIDTH}")
    if not isinstance(shards, int) or isinstance(shards, bool) or not 0 < shards <= 4096:
        raise ConfigError(f"{what}: shards {shards!r} must be an int in 1..4096")
    init = options.get("init", ["zeros"])
    init = [init] if isinstance(init, str) else list(init)
    if not init or init[0] not in INITS:
        raise ConfigError(f"{what}: init {init!r} must be one of {INITS} (uniform: [low, high]; normal: [mean, std])")
    if init[0] != "zeros":
        if len(init) == 1:
            init += [-0.05, 0.05] if init[0] == "uniform" else [0.0, 0.01]
        if len(init) != 3 or not all(isinstance(v, (int, float)) and math.isfinite(v) for v in init[1:]):
            raise ConfigError(f"{what}: init {init!r}: {init[0]} takes two finite numbers")
        init = [init[0], float(init[1]), float(init[2])]
    seed = options.get("seed", 0)
    if not isinstance(seed, int) or not 0 <= seed < 1 << 64:
        raise ConfigError(f"{what}: seed {seed!r} must be an int in [0, 2**64)")
    optimizer = options.get("optimizer", "sum")
    optimizer = {"name": optimizer} if isinstance(optimizer, str) else dict(optimizer or {})
    name = optimizer.pop("name", None)
    if name not in OPTIMIZERS:
        raise ConfigError(f"{what}: row optimizer {name!r} is not one of {sorted(OPTIMIZERS)}")
    extra = sorted(set(optimizer) - set(OPTIMIZERS[name]))
    if extra:
        raise ConfigError(f"{what}: row optimizer {name!r} takes {sorted(OPTIMIZERS[name])}, not {extra}")
    settings = {**OPTIMIZERS[name], **optimizer}
    if not all(isinstance(v, (int, float)) and math.isfinite(v) and v >= 0 for v in settings.values()):
        raise ConfigError(f"{what}: row optimizer {name!r} settings {settings} must be non-negative numbers")
    capacity, evict, ttl = options.get("capacity"), options.get("evict", "lru"), options.get("ttl")
    if capacity is not None and (not isinstance(capacity, int) or capacity <= 0):
        raise ConfigError(f"{what}: capacity {capacity!r} must be a positive int (rows per shard) or None")
    if evict not in EVICTIONS:
        raise ConfigError(f"{what}: evict {evict!r} must be one of {EVICTIONS}")
    if evict == "ttl" and (not isinstance(ttl, (int, float)) or ttl <= 0):
        raise ConfigError(f"{what}: evict='ttl' needs ttl, a positive number of seconds")
    return {"width": width, "shards": shards, "init": init, "seed": seed, "optimizer": {"name": name, **settings},
            "capacity": capacity, "evict": evict, "ttl": ttl}


class TableShard:
    """The rows of one shard: an index from id to slot (sorted ids, searched as a whole request
    at a time), the rows by slot, each slot's last touch, and the row optimizer's state by slot."""

    def __init__(self, options: dict, dtype: np.dtype, clock=lambda: 0.0):
        self.width = options["width"]
        self.dtype = np.dtype(dtype)
        if self.dtype.name not in FLOAT_DTYPES and options["optimizer"]["name"] != "sum":
            raise ConfigError(f"a {self.dtype.name} table can only sum its pushes (optimizer 'sum')")
        self.init, self.seed = options["init"], options["seed"]
        self.optimizer = options["optimizer"]
        self.capacity, self.evict, self.ttl = options["capacity"], options["evict"], options["ttl"]
        self.clock = clock
        self.keys = np.empty(0, ID_DTYPE)  # sorted ids
        self.where = np.empty(0, np.int64)  # the slot of each sorted id
        self.ids = np.empty(0, ID_DTYPE)  # the id in each slot (live slots: [0, size))
        self.rows = np.empty((0, self.width), self.dtype)
        self.touched = np.empty(0, np.float64)  # LRU: the request count at the last touch; TTL: the time
        # the row optimizer's state by slot (the job's optimizer makes its own on its first step)
        self.per_row = {name: np.empty((0, self.width), self.dtype) for name in _PER_ROW.get(self.optimizer["name"], ())}
        self.scalars: dict = {}  # the job's optimizer's scalars (its step count)
        self.size = 0
        self._last: tuple | None = None  # (ids, slots) of the last request found whole: reused if they come again
        self.requests = 0
        self.steps = 0  # rounds applied (Adam's bias correction)
        self.evicted = 0

    @property
    def nbytes(self) -> int:
        per_row = self.width * self.dtype.itemsize * (1 + len(self.per_row))
        return self.size * (per_row + 8 + 8 + 8)

    # -- finding and making rows -------------------------------------------------------------------

    def slots(self, ids: np.ndarray) -> np.ndarray | slice:
        """The slot of each id (a slice when they are one run of slots), making the rows not held
        yet (evicting first if the shard is full)."""
        self.requests += 1
        stamp = self.clock() if self.evict == "ttl" else float(self.requests)
        if self.evict == "ttl" and self.size:
            self._evict(self.touched[: self.size] < stamp - self.ttl)
        last = self._last
        if last is not None and last[0].size == ids.size and np.array_equal(last[0], ids):
            self.touched[last[1]] = stamp  # the same ids as last time (ps-lite's are): their slots
            return last[1]
        found, slots = self._find(ids)
        if found.all():
            self.touched[slots] = stamp
            return slots
        new = np.unique(ids[~found])
        if self.capacity is not None and self.size + new.size > self.capacity:
            held = np.unique(slots[found])
            if held.size + new.size > self.capacity:
                raise ConfigError(f"a request touches {held.size + new.size} rows of a shard capped at "
                                  f"{self.capacity} rows; raise the table's capacity or its shards")
            self._evict_oldest(self.size + new.size - self.capacity, keep=held)
            found, slots = self._find(ids)  # the survivors were compacted: their slots changed
        self.touched[slots[found]] = stamp
        made = self._make(new, stamp)
        slots[~found] = made[np.searchsorted(new, ids[~found])]
        return slots

    def _find(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        if not self.keys.size:
            return np.zeros(ids.size, bool), np.zeros(ids.size, np.int64)
        pos = np.minimum(np.searchsorted(self.keys, ids), self.keys.size - 1)
        found = self.keys[pos] == ids
        slots = self.where[pos]
        if found.all():  # kept for the next request of the same ids; a run of slots as a slice
            run = ids.size and slots[-1] - slots[0] == ids.size - 1 and bool((np.diff(slots) == 1).all())
            self._last = (ids.copy(), slice(int(slots[0]), int(slots[-1]) + 1) if run else slots.copy())
        return found, slots

    def _make(self, new: np.ndarray, stamp: float) -> np.ndarray:
        start, stop = self.size, self.size + new.size
        if stop > self.rows.shape[0]:
            grow = max(stop, 2 * self.rows.shape[0], 64)
            self.rows = _grown(self.rows, grow)
            self.ids = _grown(self.ids, grow)
            self.touched = _grown(self.touched, grow)
            for name, array in self.per_row.items():
                self.per_row[name] = _grown(array, grow)
        self.rows[start:stop] = initial_rows(new, self.width, self.dtype, self.init, self.seed)
        self.ids[start:stop] = new
        self.touched[start:stop] = stamp
        for name, array in self.per_row.items():
            array[start:stop] = self.optimizer.get("initial_accumulator_value", 0.0) if name == "acc" else 0
        made = np.arange(start, stop, dtype=np.int64)
        self._last = None
        at = np.searchsorted(self.keys, new)
        self.keys = np.insert(self.keys, at, new)
        self.where = np.insert(self.where, at, made)
        self.size = stop
        return made

    def _evict_oldest(self, count: int, keep: np.ndarray) -> None:
        """Evict at least ``count`` rows, the least recently used first, never those in ``keep``."""
        age = self.touched[: self.size].copy()
        age[keep] = np.inf  # rows the request in hand uses stay
        count = min(count + int(EVICT_SLACK * self.capacity), self.size - keep.size)
        victims = np.zeros(self.size, bool)
        if count > 0:
            victims[np.argpartition(age, count - 1)[:count]] = True
        self._evict(victims)

    def _evict(self, victims: np.ndarray) -> None:
        """Drop the slots marked in ``victims`` and compact the rest (their order kept)."""
        gone = int(victims.sum())
        if not gone:
            return
        keep = ~victims
        n = self.size - gone
        self.rows[:n] = self.rows[: self.size][keep]
        self.ids[:n] = self.ids[: self.size][keep]
        self.touched[:n] = self.touched[: self.size][keep]
        for array in self.per_row.values():
            array[:n] = array[: self.size][keep]
        self.size = n
        self.evicted += gone
        self._reindex()

    def _reindex(self) -> None:
        self._last = None
        order = np.argsort(self.ids[: self.size], kind="stable")
        self.keys = self.ids[: self.size][order]
        self.where = order.astype(np.int64)

    # -- requests ------------------------------------------------------------------------------------

    def read(self, ids: np.ndarray) -> np.ndarray:
        """The rows of ``ids`` in their order (a copy: the next update may not reach a reply)."""
        slots = self.slots(ids)  # first: it may grow self.rows
        rows = self.rows[slots]
        return rows.copy() if type(slots) is slice else rows

    def assign(self, ids: np.ndarray, rows: np.ndarray) -> None:
        """Set rows (an id that repeats takes its last row), outside any round."""
        slots = self.slots(ids)  # first: it may grow self.rows
        self.rows[slots] = rows

    def apply(self, ids: np.ndarray, rows: np.ndarray, contributors: int = 1, job_optimizer=None) -> None:
        """One round's pushes (ids may repeat: summed in order), applied by the row optimizer;
        the optimizers other than ``sum`` step with the mean over the round's ``contributors``
        (the job's optimizer scales as it says: ``job_optimizer.grad_scale``)."""
        self.steps += 1
        opt = self.optimizer
        name = opt["name"]
        if ids.size == 0 and name != "job":  # the job's optimizer counts every round (its step count)
            return
        unique, grads = sum_duplicates(ids, rows)
        slots = self.slots(unique)
        if name == "job":
            self._job_step(job_optimizer, slots, grads, contributors)
            return
        if name == "sum":
            self.rows[slots] += grads
            return
        if contributors > 1:
            grads /= np.asarray(contributors, grads.dtype)
        lr = np.asarray(opt["lr"], self.dtype)
        if name == "sgd":
            self.rows[slots] -= lr * grads
        elif name == "adagrad":
            acc = self.per_row["acc"][slots] + grads * grads
            self.per_row["acc"][slots] = acc
            self.rows[slots] -= lr * grads / (np.sqrt(acc) + np.asarray(opt["eps"], self.dtype))
        else:
            b1, b2 = np.asarray(opt["beta1"], self.dtype), np.asarray(opt["beta2"], self.dtype)
            m = b1 * self.per_row["m"][slots] + (1 - b1) * grads
            v = b2 * self.per_row["v"][slots] + (1 - b2) * grads * grads
            self.per_row["m"][slots], self.per_row["v"][slots] = m, v
            corr1, corr2 = 1 - opt["beta1"] ** self.steps, 1 - opt["beta2"] ** self.steps
            step = np.asarray(opt["lr"] * math.sqrt(corr2) / corr1, self.dtype)
            self.rows[slots] -= step * m / (np.sqrt(v) + np.asarray(opt["eps"] * math.sqrt(corr2), self.dtype))

    def _job_step(self, optimizer, slots: np.ndarray, grads: np.ndarray, contributors: int) -> None:
        """The job's optimizer (SGD, Adam, MXNet's, ...) on the touched rows alone: MXNet's lazy
        update of a row-sparse weight. Their state is gathered, stepped and put back; a row's
        state starts at zero, and the scalars (a step count) are the shard's, one per round."""
        if optimizer is None:  # MXNet's servers without an updater copy the merged rows into the store
            self.rows[slots] = grads
            return
        scale = optimizer.grad_scale(contributors)
        if scale != 1.0:
            grads *= np.asarray(scale, grads.dtype)
        n = grads.shape[0]
        weights = self.rows[slots].reshape(-1)
        state = {**self.scalars, **{name: array[slots].reshape(-1) for name, array in self.per_row.items()}}
        optimizer.step(weights, grads.reshape(-1), state)
        self.rows[slots] = weights.reshape(n, self.width)
        for name, value in state.items():
            if not isinstance(value, np.ndarray):
                self.scalars[name] = value
                continue
            if value.size != weights.size:
                raise KeyStateError(f"the job's optimizer keeps {name!r} of {value.size} values for {weights.size} "
                                    "weights; a table's rows can only keep state of their own size")
            if name not in self.per_row:
                self.per_row[name] = np.zeros((self.rows.shape[0], self.width), value.dtype)
            self.per_row[name][slots] = value.reshape(n, self.width)

    # -- state crossing Aggregators ----------------------------------------------------------------------

    def export(self) -> tuple[dict, list[tuple[str, np.ndarray]]]:
        """Live rows and their state, in slot order (copies: the shard goes on)."""
        n = self.size
        arrays = [("ids", self.ids[:n].copy()), ("rows", self.rows[:n].copy()), ("touched", self.touched[:n].copy())]
        arrays += [(f"row:{name}", array[:n].copy()) for name, array in sorted(self.per_row.items())]
        return {"requests": self.requests, "steps": self.steps, "evicted": self.evicted, "scalars": self.scalars}, arrays

    def load(self, scalars: dict, named: dict[str, np.ndarray]) -> None:
        ids = named["ids"]
        n = ids.size
        self.ids = ids.astype(ID_DTYPE)
        self.rows = np.ascontiguousarray(named["rows"], self.dtype).reshape(n, self.width)
        self.touched = named["touched"].astype(np.float64)
        self.per_row = {name[4:]: np.ascontiguousarray(array).reshape(n, self.width)
                        for name, array in named.items() if name.startswith("row:")}
        self.size = n
        self.requests, self.steps, self.evicted = scalars["requests"], scalars["steps"], scalars["evicted"]
        self.scalars = dict(scalars.get("scalars") or {})
        self._reindex()


def _grown(array: np.ndarray, rows: int) -> np.ndarray:
    grown = np.empty((rows,) + array.shape[1:], array.dtype)
    grown[: array.shape[0]] = array
    return grown
