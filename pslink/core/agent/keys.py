"""What an Agent keeps per key and per request in flight, and how it reads arrays (no I/O)."""

from __future__ import annotations

import collections
import math
from typing import Any

import numpy as np

from pslink.core.wire.protocol import DTYPES, FLOAT_DTYPES
from pslink.core.transport import Connection
from pslink.errors import ConfigError, ShapeMismatchError

class Seat:
    """This worker's place in its job: who it is, the job's token (pMaster gives it at
    registration) and the members as last heard. One object the Agent's collaborators share."""

    __slots__ = ("job", "rank", "num_workers", "token", "host_id", "members")

    def __init__(self, job: str, rank: int, num_workers: int, token: bytes, host_id: str):
        self.job, self.rank, self.num_workers, self.token, self.host_id = job, rank, num_workers, token, host_id
        self.members: dict = {}  # {"ranks": [...], "epoch": n}, as pMaster last said

    def fields(self) -> dict:
        """The fields every request to pMaster about the job carries."""
        return {"job": self.job, "tok": self.token, "rank": self.rank}

    def update_members(self, membership: dict | None) -> None:
        if membership and "ranks" in membership and membership.get("epoch", -1) >= self.members.get("epoch", -1):
            self.members = {"ranks": list(membership["ranks"]), "epoch": membership["epoch"]}
            self.num_workers = len(self.members["ranks"])

    def __str__(self) -> str:
        return f"{self.job}/{self.rank}"


class PartInfo:
    """A part of a key and where it lives. The place is one (aggregator, address) tuple, replaced
    whole (:meth:`move`): the relocation thread moves parts while the driving and calling threads
    send to them, and a reader that took the name before a move and the address after it would
    connect to the wrong Aggregator (or fail, and report the other one unreachable). Read
    ``where`` once where both are needed."""

    __slots__ = ("index", "start", "stop", "where", "headers")

    def __init__(self, index, start, stop, aggregator, address):
        self.index, self.start, self.stop = index, start, stop
        self.where: tuple[str, str] = (aggregator, address)
        self.headers: dict = {}  # (op, average) -> HeaderTemplate: the part's request headers

    @property
    def aggregator(self) -> str:
        return self.where[0]

    @property
    def address(self) -> str:
        return self.where[1]

    def move(self, aggregator: str, address: str) -> None:
        self.where = (aggregator, address)


class KeyInfo:
    """What the Agent knows of a key: its declaration and where its parts live."""

    __slots__ = ("key", "shape", "dtype", "dtype_name", "numel", "parts", "round", "declared_by")

    def __init__(self, spec: dict):
        self.key = spec["key"]
        self.shape = tuple(spec["shape"])
        self.dtype_name = spec["dtype"]
        self.dtype = DTYPES[self.dtype_name]
        self.numel = math.prod(self.shape)
        self.declared_by = spec.get("declared_by", 0)
        self.parts = [PartInfo(*p) for p in spec["parts"]]
        self.round = 0  # this worker's pushes of the key so far

    def describe(self) -> str:
        return f"shape {self.shape} {self.dtype_name}"


class Link:
    """The connection to one Aggregator and the requests waiting on it."""

    __slots__ = ("name", "address", "conn", "last_heard", "ping_sent", "pending", "error", "outbox", "outbox_bytes",
                 "flush_due", "window", "in_window", "held")

    def __init__(self, name: str, address: str, conn: Connection | None, now: float, error: str | None = None):
        self.name, self.address, self.conn = name, address, conn
        self.error = error  # with no ``conn``: why connecting failed
        self.last_heard = now
        self.ping_sent: float | None = None
        self.pending: set[int] = set()
        # Small requests waiting to travel fused (pslink.core.agent.requests): (id, frames) each.
        self.outbox: list[tuple[int, list]] = []
        self.outbox_bytes = 0
        self.flush_due = False  # a cycle timer will send the outbox
        # Large requests in flight on a network link, at most ``window`` (0: no limit; see
        # pslink.core.agent.requests); the ones past it wait in ``held``, in order.
        self.window = 0
        self.in_window = 0
        self.held: collections.deque = collections.deque()


class PartRequest:
    """One part of a request in flight, with what it takes to send it again elsewhere (a task
    that migrated answers with its new place)."""

    __slots__ = ("handle", "link", "nbytes", "dest", "array", "average", "op", "info", "part", "round",
                 "payload", "flat_out", "moves", "covers", "frames", "sent", "window_link", "held")

    def __init__(self, handle, link, nbytes, dest, array, average, op, info, part, round_, payload, flat_out, moves,
                 covers=None):
        self.handle, self.link, self.nbytes = handle, link, nbytes
        self.dest, self.array, self.average = dest, array, average
        self.op, self.info, self.part, self.round = op, info, part, round_
        self.payload, self.flat_out, self.moves = payload, flat_out, moves
        self.covers = covers  # the ranks a host's leader pushes for (pslink.core.agent.host_reduce)
        self.frames: list | None = None  # what was sent: sent again as it is (same id) if no answer comes
        self.sent = 0.0
        self.window_link: Link | None = None  # the link whose window this request counts in
        self.held = False  # ... waiting there for room, not sent yet


MAX_MOVES = 8  # a request that keeps meeting "moved" answers gives up with the last one


def fenced_pause(moves: int) -> float:
    """Seconds before a request told "ask pMaster again" (FencedError) for the ``moves``-th time
    asks: at once the first time (a lease that ran out: pMaster knows the new place), then
    50 ms doubling to 1 s (a failover whose promotion is not done yet), so that the MAX_MOVES
    tries span seconds instead of a burst of round trips."""
    return 0.0 if moves <= 1 else min(0.05 * 2 ** (moves - 2), 1.0)


# dtype -> wire name; a dict lookup, because ``dtype.name`` costs microseconds per call
WIRE_NAMES = {dtype: name for name, dtype in DTYPES.items()}
WIRE_NAMES.update({np.dtype(name): name for name in DTYPES})


def as_array(value: Any, key: Any) -> tuple[np.ndarray, str]:
    """numpy view of an array, a buffer-protocol object or a CPU tensor (no copy when possible),
    and its wire dtype name."""
    array = value if type(value) is np.ndarray else None
    if array is None:
        try:
            array = np.asarray(value)
        except Exception as exc:
            raise ConfigError(f"key {key!r}: cannot read {type(value).__name__} as an array ({exc})") from None
    name = WIRE_NAMES.get(array.dtype)
    if name is None:
        if array.dtype.byteorder == ">" and array.dtype.newbyteorder("<") in WIRE_NAMES:
            array = array.astype(array.dtype.newbyteorder("<"))
            return array, WIRE_NAMES[array.dtype]
        raise ConfigError(
            f"key {key!r}: dtype {array.dtype} is not supported; supported: {', '.join(DTYPES)}"
        )
    return array, name


def check_key(key: Any) -> Any:
    kind = type(key)
    if kind is str:
        if 0 < len(key) <= 256:
            return key
    elif kind is int:
        if 0 <= key < 1 << 64:
            return key
    elif isinstance(key, np.integer):
        return check_key(int(key))
    raise ConfigError(f"key {key!r} must be an int in [0, 2**64) or a string of 1..256 characters")


def out_array(info: KeyInfo, out, average: bool) -> np.ndarray:
    """Where a pull of ``info``'s key lands: ``out`` checked, or a new array."""
    if average and info.dtype_name not in FLOAT_DTYPES:
        raise ConfigError(f"key {info.key!r}: average needs a floating dtype, the key is {info.dtype_name}")
    if out is None:
        return np.empty(info.shape, info.dtype)
    array, name = as_array(out, info.key)
    if array.shape != info.shape or name != info.dtype_name:
        raise ShapeMismatchError(
            f"key {info.key!r}: out has shape {array.shape} {name}, but the key has {info.describe()}",
            key=info.key,
        )
    if not array.flags.c_contiguous or not array.flags.writeable:
        raise ConfigError(f"key {info.key!r}: out must be a writable C-contiguous array")
    return array
