"""Sparse tables as a worker sees them: ``agent.table(name, width, ...)`` returns a :class:`Table`.

A request's ids are split by shard (:func:`pslink.core.tables.split_by_shard`) and each shard
gets one message with all of its ids (and, for a push, their rows), so a push of 10,000 ids to
a table of 4 shards is 4 messages. Under BSP every push reaches every shard, with no ids where a
shard has none: each shard's round waits for every worker's push, as a tensor's part does. A
pull names the worker's last push, so it reads the rows with that round applied; an
asynchronous job's pulls read what the rows are now. The shards' answers land side by side in
one array in shard order, and :class:`TableHandle` puts the rows back in the caller's order.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from pslink.core.agent.keys import KeyInfo, as_array, check_key
from pslink.core.tables import as_ids, split_by_shard, table_options
from pslink.core.wire.protocol import Op, encode
from pslink.errors import ShapeMismatchError


class TableHandle:
    """A table request's handle: ``wait()`` returns the pulled rows in the order asked (None for
    a push). Otherwise as :class:`~pslink.core.agent.handle.Handle`."""

    __slots__ = ("handle", "_finish", "_result", "_done")

    def __init__(self, handle, finish: Callable[[], Any] | None):
        self.handle, self._finish, self._result, self._done = handle, finish, None, finish is None

    def wait(self, timeout: float | None = None):
        self.handle.wait(timeout)
        if not self._done:
            self._result, self._done = self._finish(), True
        return self._result

    def done(self) -> bool:
        return self.handle.done()

    def wait_briefly(self, seconds: float) -> bool:
        return self.handle.wait_briefly(seconds)

    def timed_out(self, seconds: float):
        return self.handle.timed_out(seconds)

    @property
    def keys(self) -> list:
        return self.handle.keys

    def exception(self):
        return self.handle.exception()

    def add_done_callback(self, fn: Callable[["TableHandle"], None], drive: bool = True) -> None:
        self.handle.add_done_callback(lambda _h: fn(self), drive)


class Table:
    """One table of the job. ``push(ids, rows)``, ``pull(ids)`` and ``pushpull(ids, rows)``
    return a :class:`TableHandle`; ids are non-negative 64-bit integers, in any order, repeated
    or not (a push sums the rows of an id that repeats)."""

    def __init__(self, agent, name: str, info: KeyInfo, options: dict):
        self.agent, self.name, self.info, self.options = agent, name, info, options
        self.width, self.shards = options["width"], options["shards"]
        self.dtype = info.dtype
        self._every_shard = agent.sync != "asp"  # a synchronous round waits for a push on every shard

    def __repr__(self) -> str:
        return f"<Table {self.name!r} width {self.width} {self.info.dtype_name}, {self.shards} shard(s)>"

    def push(self, ids, rows) -> TableHandle:
        return self._request(Op.TABLE_PUSH, ids, rows, None)

    def pull(self, ids, out=None) -> TableHandle:
        """The rows of ``ids`` (made on first touch) with this worker's last push applied."""
        return self._request(Op.TABLE_PULL, ids, None, out)

    def pushpull(self, ids, rows, out=None) -> TableHandle:
        """Push ``rows`` for ``ids``, then pull the same ids once that round is applied."""
        return self._request(Op.TABLE_PUSHPULL, ids, rows, out)

    def assign(self, ids, rows) -> TableHandle:
        """Set the rows of ``ids`` to ``rows`` (initial values, as one rank sets them), outside
        any round: the workers' next pulls read them once it is done."""
        return self._request(Op.TABLE_INIT, ids, rows, None)

    def _request(self, op: Op, ids, rows, out) -> TableHandle:
        what = f"table {self.name!r} of job {self.agent.job!r}"
        ids = as_ids(ids, what)
        n = ids.size
        if rows is not None:
            rows, dtype = as_array(rows, self.name)
            if dtype != self.info.dtype_name or rows.size != n * self.width:
                raise ShapeMismatchError(f"{what}: {n} id(s) take rows of shape ({n}, {self.width}) "
                                         f"{self.info.dtype_name}, got {rows.shape} {dtype}", key=self.name)
            rows = np.ascontiguousarray(rows.reshape(n, self.width))
        if self.shards == 1:  # nothing to split or reorder
            order, bounds, in_order = None, (0, n), True
        else:
            order, bounds = split_by_shard(ids, self.shards)
            in_order = bool(n == 0 or (order[1:] > order[:-1]).all())
        if not in_order:
            ids = ids[order]
            rows = rows[order] if rows is not None else None
        pulls = op == Op.TABLE_PULL or op == Op.TABLE_PUSHPULL
        if pulls:
            out = self._out(out, n)
            landing = out if in_order else np.empty((n, self.width), self.dtype)
        agent = self.agent
        if agent._tasks.late:  # a worker added to the running job comes into each shard's rounds first
            agent._tasks.join([self.info])
        pushes = op == Op.TABLE_PUSH or op == Op.TABLE_PUSHPULL  # a round's (an init is none)
        with agent._lock:
            if pushes:
                self.info.round += 1
                agent._iterations.pushed([self.name])
            round_ = self.info.round
        targets = [s for s in range(self.shards) if bounds[s + 1] > bounds[s] or (pushes and self._every_shard)]
        handle = agent._handles.new(op.name.lower(), [self.name], None, len(targets), round_)
        for s in targets:
            a, b = int(bounds[s]), int(bounds[s + 1])
            shard_op = op if a < b or op != Op.TABLE_PUSHPULL else Op.TABLE_PUSH  # nothing to pull there
            payload = ids[a:b] if op == Op.TABLE_PULL else (ids[a:b], rows[a:b])
            agent._sender.send_part(handle, shard_op, self.info, self.info.parts[s], round_, payload,
                                    landing[a:b].reshape(-1) if pulls and shard_op != Op.TABLE_PUSH else None, False)
        if not pulls:
            return TableHandle(handle, None)
        if in_order:
            return TableHandle(handle, lambda: out)

        def finish():
            out[order] = landing
            return out

        return TableHandle(handle, finish)

    def _out(self, out, n: int) -> np.ndarray:
        if out is None:
            return np.empty((n, self.width), self.dtype)
        array, dtype = as_array(out, self.name)
        if array.shape != (n, self.width) or dtype != self.info.dtype_name or not array.flags.c_contiguous \
                or not array.flags.writeable:
            raise ShapeMismatchError(f"table {self.name!r}: out must be a writable C-contiguous ({n}, {self.width}) "
                                     f"{self.info.dtype_name} array, got {array.shape} {dtype}", key=self.name)
        return array


def declare(agent, name: str, width: int, dtype: str, options: dict) -> Table:
    """Declare table ``name`` with pMaster (every worker declares it alike) and return it."""
    name = check_key(name)  # an int or a string, as any key
    options = table_options({"width": width, **options}, f"table {name!r}")
    info = agent._keys.get(name)
    if info is None:
        item = {"key": name, "intent": "push", "shape": [options["shards"], options["width"]], "dtype": dtype,
                "table": options}
        body = agent._master.call(Op.LOOKUP, items=[item])
        info = agent._keys.setdefault(name, KeyInfo(body["keys"][0]))
    if info.shape != (options["shards"], options["width"]) or info.dtype_name != dtype:
        raise ShapeMismatchError(f"{name!r} of job {agent.job!r} is {info.describe()}, not a table of "
                                 f"{options['shards']} shard(s) of width {options['width']} {dtype}", key=name)
    return Table(agent, name, info, options)


def table_frames(seat, op: Op, info: KeyInfo, part, rid: int, round_: int, payload) -> list:
    """The frames of one shard's request: the header, the ids and (a push) the rows."""
    ids = payload if op == Op.TABLE_PULL else payload[0]
    header = encode(op, id=rid, job=seat.job, tok=seat.token, rank=seat.rank, key=info.key, part=part.index,
                    rnd=round_, dtype=info.dtype_name, shape=list(info.shape), span=[part.start, part.stop],
                    n=int(ids.size))
    # Flat: a buffer of shape (0, width) cannot be viewed as bytes.
    return [header, ids] if op == Op.TABLE_PULL else [header, ids, payload[1].reshape(-1)]
