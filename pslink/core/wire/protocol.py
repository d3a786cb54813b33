"""The pslink wire protocol: one msgpack header frame plus raw tensor payload frames.

A message is ``[header, payload_0, payload_1, ...]``. The header is a msgpack map with the protocol
version ``v`` and the operation ``op``; payloads are the raw little-endian bytes of C-contiguous
arrays, never pickled. Transports carry the frames (``pslink.core.transport``); this module only
says what a valid header is. Every message is validated here before any role looks at it: version,
op, field types, the dtype whitelist, shape and span bounds, payload count, ``span x itemsize ==
payload bytes`` and the configured size limits. A peer never sees a traceback from deep inside:
it gets a :class:`~pslink.errors.ProtocolError` naming the field.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from typing import Any, Callable, Mapping, Sequence

import msgpack
import numpy as np

from pslink.errors import ProtocolError, PslinkError

PROTOCOL_VERSION = 1


class Op(enum.IntEnum):
    """Operations. Data-path ops go Agent -> Aggregator; control ops go to or from pMaster."""

    # data path (Agent -> Aggregator)
    INIT = 1
    PUSH = 2
    PULL = 3
    PUSHPULL = 4
    PING = 5
    ABORT = 6
    TENSOR_COPY = 7  # Aggregator -> Aggregator: a migrating task's state
    STATE_GET = 8  # a part's optimizer state (momentum, moments), for checkpoints
    STATE_SET = 9  # replace a part's optimizer state (resuming from a checkpoint)
    JOIN = 13  # a worker added to a running job: where it comes in (rnd 0 asks; rnd R joins)
    REPLICATE = 14  # Aggregator -> Aggregator: a closed round's state for a replica
    WAITING = 15  # who a part's open round has and still waits for (a timed-out worker asks, to name them)
    # a table's shard (pslink.core.tables): ``n`` ids in a frame, and for a push their rows in another
    TABLE_PUSH = 16
    TABLE_PULL = 17
    TABLE_PUSHPULL = 18
    TABLE_INIT = 19  # set rows to the values sent (rank 0's initial rows), outside any round
    # replies (to any request)
    REPLY = 10
    ERROR = 11
    PONG = 12
    # control (Agent / CLI -> pMaster)
    REGISTER_JOB = 20
    REGISTER_WORKER = 21
    LOOKUP = 22
    SET_OPTIMIZER = 23
    HEARTBEAT = 24
    BARRIER = 25
    LEAVE = 26
    STATUS = 27
    JOB_KEYS = 28  # every key of a job, for a worker that joins it while it runs
    RELOCATE = 29  # an Agent lost an Aggregator: where do these parts live now?
    # control (Aggregator <-> pMaster)
    REGISTER_AGGREGATOR = 30
    ASSIGN = 31
    JOB_INFO = 32
    DROP_JOB = 33
    SHUTDOWN = 34
    AGG_HEARTBEAT = 35
    MIGRATE = 36  # pMaster -> source Aggregator (the paper's MIGRATE_INIT)
    TENSOR_COPY_DONE = 37  # source Aggregator -> pMaster
    WORKER_DONE = 38  # target Aggregator -> pMaster: every worker now talks to it
    SCHEDULE = 39  # pMaster -> Aggregator: its cycle and per-task budgets
    PROMOTE = 40  # pMaster -> Aggregator: serve a part from the replica you hold
    COPY_REPLICA = 42  # pMaster -> a replica's holder: a move's source died; send the copy yourself
    # control (CLI -> pMaster)
    POOL = 41  # CLI -> pMaster: add or remove Aggregators
    DELETE_KEYS = 43  # Agent -> pMaster: forget these keys of the job (their tasks and replicas go)
    DROP_KEYS = 44  # pMaster -> Aggregator: drop the tasks and replicas of these keys of a job
    # data path, both ways: small requests bound for one Aggregator (or their replies) in one
    # message; ``items`` are their headers as each would travel alone, ``np`` how many of the
    # payload frames that follow belong to each (pslink.core.transport.fused)
    FUSED = 45
    # Agent -> pMaster: where a host's leader takes its followers' pushes (host-local reduce,
    # pslink.core.agent.host_reduce); the leader says (``address``), a follower asks
    HOST_LEADER = 46
    FENCE = 47  # pMaster -> Aggregator: drop these parts and refuse them (they are served elsewhere)


DATA_OPS = frozenset({Op.INIT, Op.PUSH, Op.PULL, Op.PUSHPULL})
TABLE_OPS = frozenset({Op.TABLE_PUSH, Op.TABLE_PULL, Op.TABLE_PUSHPULL, Op.TABLE_INIT})
STATE_OPS = frozenset({Op.STATE_GET, Op.STATE_SET, Op.JOIN, Op.WAITING})  # about a task, not its rounds
MAX_STATE_ARRAYS = 8  # per part; a frame each, every one of the part's size (momentum, moments)
MAX_FUSED_FRAMES = 128  # payload frames of one FUSED message (its items' payloads, one each at most)

# The dtypes a tensor may have on the wire. Always little-endian.
DTYPES: dict[str, np.dtype] = {
    name: np.dtype(name).newbyteorder("<")
    for name in ("int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64", "float16", "float32",
                 "float64")
}
FLOAT_DTYPES = frozenset({"float16", "float32", "float64"})

MAX_NDIM = 32
MAX_KEY_STR = 256
MAX_NAME = 128


@dataclasses.dataclass(frozen=True)
class Limits:
    """Size limits every receiver enforces before it allocates or reads anything."""

    max_header_bytes: int = 1 << 20
    max_message_bytes: int = 1 << 30
    max_frames: int = 8

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"Limits.{field.name} must be a positive int, got {value!r}")


DEFAULT_LIMITS = Limits()


def frame_limit(limits: Limits) -> int:
    """The most payload frames a transport lets a message carry: a FUSED one may carry more than
    ``max_frames`` (its items' payloads); :func:`decode` holds every other op to ``max_frames``."""
    return max(limits.max_frames, MAX_FUSED_FRAMES)


def dtype_of(name: str) -> np.dtype:
    """The numpy dtype for a wire dtype name; a name outside the whitelist is a ProtocolError."""
    try:
        return DTYPES[name]
    except (KeyError, TypeError):
        raise ProtocolError(
            f"dtype {name!r} is not supported; supported: {', '.join(DTYPES)}"
        ) from None


def wire_dtype(dtype: Any) -> str:
    """The wire name of a numpy dtype, or ProtocolError if it cannot travel."""
    dt = np.dtype(dtype)
    name = dt.name
    if name not in DTYPES or dt.byteorder == ">":
        raise ProtocolError(
            f"dtype {dt.str} is not supported on the wire; supported: {', '.join(DTYPES)} "
            "(little-endian)"
        )
    return name


# ---------------------------------------------------------------------------------------------
# field validators: each returns normally or raises ProtocolError naming the field


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _uint(name: str, v) -> None:
    if not _is_int(v) or v < 0 or v >= 1 << 63:
        raise ProtocolError(f"field {name!r} must be a non-negative int, got {v!r}")


def _small_str(name: str, v) -> None:
    if not isinstance(v, str) or not v or len(v) > MAX_NAME:
        raise ProtocolError(f"field {name!r} must be a string of 1..{MAX_NAME} characters")


def _token(name: str, v) -> None:
    if not isinstance(v, bytes) or len(v) > 256:
        raise ProtocolError(f"field {name!r} must be bytes of at most 256")


def _key(name: str, v) -> None:
    if _is_int(v):
        if 0 <= v < 1 << 64:
            return
    elif isinstance(v, str) and 0 < len(v) <= MAX_KEY_STR:
        return
    raise ProtocolError(
        f"field {name!r} must be an int in [0, 2**64) or a string of 1..{MAX_KEY_STR} characters, "
        f"got {v!r}"
    )


def _dtype(name: str, v) -> None:
    if v not in DTYPES:
        raise ProtocolError(f"dtype {v!r} is not supported; supported: {', '.join(DTYPES)}")


def _shape(name: str, v) -> None:
    if not isinstance(v, list) or len(v) > MAX_NDIM or not all(
        _is_int(d) and 0 <= d < 1 << 62 for d in v
    ):
        raise ProtocolError(
            f"field {name!r} must be a list of at most {MAX_NDIM} non-negative ints, got {v!r}"
        )


def _span(name: str, v) -> None:
    if (
        not isinstance(v, list)
        or len(v) != 2
        or not all(_is_int(x) and 0 <= x < 1 << 62 for x in v)
        or v[0] > v[1]
    ):
        raise ProtocolError(f"field {name!r} must be [start, stop] with 0 <= start <= stop, got {v!r}")


def _map(name: str, v) -> None:
    if not isinstance(v, dict):
        raise ProtocolError(f"field {name!r} must be a map")


def _list(name: str, v) -> None:
    if not isinstance(v, list):
        raise ProtocolError(f"field {name!r} must be a list")


def _text(name: str, v) -> None:
    if not isinstance(v, str):
        raise ProtocolError(f"field {name!r} must be a string")


def _number(name: str, v) -> None:
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
        raise ProtocolError(f"field {name!r} must be a finite number, got {v!r}")


def _bool(name: str, v) -> None:
    if not isinstance(v, bool):
        raise ProtocolError(f"field {name!r} must be a bool")


Validator = Callable[[str, Any], None]

_DATA_REQUIRED: dict[str, Validator] = {
    "id": _uint,
    "job": _small_str,
    "tok": _token,
    "rank": _uint,
    "key": _key,
    "part": _uint,
    "rnd": _uint,
    "dtype": _dtype,
    "shape": _shape,
    "span": _span,
}


@dataclasses.dataclass(frozen=True)
class Schema:
    required: Mapping[str, Validator]
    optional: Mapping[str, Validator] = dataclasses.field(default_factory=dict)
    payloads: tuple[int, ...] = (0,)  # allowed payload counts


SCHEMAS: dict[Op, Schema] = {
    Op.INIT: Schema(_DATA_REQUIRED, payloads=(0, 1)),
    Op.PUSH: Schema(_DATA_REQUIRED, payloads=(1,)),
    Op.PULL: Schema(_DATA_REQUIRED, {"avg": _bool}),  # avg: answer the round's average
    Op.PUSHPULL: Schema(_DATA_REQUIRED, {"avg": _bool}, payloads=(1,)),
    Op.TABLE_PUSH: Schema({**_DATA_REQUIRED, "n": _uint}, payloads=(2,)),
    Op.TABLE_PULL: Schema({**_DATA_REQUIRED, "n": _uint}, payloads=(1,)),
    Op.TABLE_PUSHPULL: Schema({**_DATA_REQUIRED, "n": _uint}, payloads=(2,)),
    Op.TABLE_INIT: Schema({**_DATA_REQUIRED, "n": _uint}, payloads=(2,)),
    # pmd: the Agent cannot reach pMaster (see FencedError); job, tok, rank: a follower's hello to
    # its host's leader (host-local reduce)
    # warm: the sender is about to use this connection for large payloads: make its rings now
    Op.PING: Schema({"id": _uint}, {"pmd": _bool, "job": _small_str, "tok": _token, "rank": _uint, "warm": _bool}),
    Op.PONG: Schema({"id": _uint}),
    Op.ABORT: Schema(
        {"id": _uint, "job": _small_str, "tok": _token, "rank": _uint, "key": _key, "msg": _text},
        {"part": _uint, "code": _small_str, "details": _map, "rnd": _uint},  # rnd: fail rounds up to it only
    ),
    Op.REPLY: Schema(
        {"id": _uint},
        {"rnd": _uint, "n": _uint, "body": _map, "moved": _list, "ep": _uint, "dropped": _bool,
         "lost": _list, "avg": _bool,  # avg: the payload is the average already
         "next": _list},  # the part is about to move there (connect ahead)
        payloads=tuple(range(0, MAX_STATE_ARRAYS + 1)),  # one tensor; a STATE_GET's arrays
    ),
    Op.TENSOR_COPY: Schema(
        {**_DATA_REQUIRED, "state": _map},
        {"from_replica": _bool},  # sent by a replica for a source that died (COPY_REPLICA)
        payloads=tuple(range(0, 9)),
    ),
    Op.REPLICATE: Schema(
        {**_DATA_REQUIRED, "state": _map},
        payloads=tuple(range(0, 9)),
    ),
    Op.STATE_GET: Schema(_DATA_REQUIRED),
    Op.JOIN: Schema(_DATA_REQUIRED),
    Op.WAITING: Schema(_DATA_REQUIRED),
    Op.STATE_SET: Schema(
        {**_DATA_REQUIRED, "names": _list},
        {"scalars": _map},
        payloads=tuple(range(0, MAX_STATE_ARRAYS + 1)),
    ),
    Op.ERROR: Schema({"id": _uint, "code": _small_str, "msg": _text}, {"details": _map}),
    Op.REGISTER_JOB: Schema({"id": _uint, "job": _small_str, "num_workers": _uint},
                            {"config": _map, "cred": _small_str, "tok": _token, "quota": _map}),
    Op.REGISTER_WORKER: Schema({"id": _uint, "job": _small_str, "rank": _uint, "num_workers": _uint},
                               {"tok": _token, "config": _map, "pid": _uint, "host": _text, "host_id": _small_str,
                                "rejoin": _bool, "agent": _small_str}),  # agent: the Agent's incarnation
    Op.LOOKUP: Schema({"id": _uint, "job": _small_str, "tok": _token, "rank": _uint, "items": _list}),
    Op.SET_OPTIMIZER: Schema(
        {"id": _uint, "job": _small_str, "tok": _token, "rank": _uint, "optimizer": _map}
    ),
    Op.HEARTBEAT: Schema({"id": _uint, "job": _small_str, "tok": _token, "rank": _uint},
                         {"iters": _list, "work": _list}),
    Op.HOST_LEADER: Schema({"id": _uint, "job": _small_str, "tok": _token, "rank": _uint, "leader": _uint},
                           {"address": _text, "host_id": _small_str}),
    Op.BARRIER: Schema(
        {"id": _uint, "job": _small_str, "tok": _token, "rank": _uint, "name": _small_str}, {"n": _uint}
    ),
    Op.LEAVE: Schema({"id": _uint, "job": _small_str, "tok": _token, "rank": _uint}),
    Op.STATUS: Schema({"id": _uint}, {"cred": _small_str}),
    Op.JOB_KEYS: Schema({"id": _uint, "job": _small_str, "tok": _token, "rank": _uint}, {"keys": _bool}),
    Op.RELOCATE: Schema({"id": _uint, "job": _small_str, "tok": _token, "rank": _uint, "parts": _list}),
    Op.REGISTER_AGGREGATOR: Schema(
        {"id": _uint, "address": _text},
        {"agg": _small_str, "pid": _uint, "host": _text, "host_id": _small_str, "keep": _bool, "tasks": _list,
         "cred": _small_str, "lease": _number, "moved": _list, "arrived": _list}),
    Op.ASSIGN: Schema({"id": _uint, "jobinfo": _map, "tasks": _list}),
    Op.JOB_INFO: Schema({"id": _uint, "jobinfo": _map}),
    Op.DROP_JOB: Schema({"id": _uint, "job": _small_str}),
    Op.DELETE_KEYS: Schema({"id": _uint, "job": _small_str, "tok": _token, "rank": _uint, "keys": _list}),
    Op.DROP_KEYS: Schema({"id": _uint, "job": _small_str, "keys": _list}),
    Op.FENCE: Schema({"id": _uint, "parts": _list}),
    Op.SHUTDOWN: Schema({"id": _uint}),
    Op.AGG_HEARTBEAT: Schema({"id": _uint, "agg": _small_str, "stats": _map}),
    Op.MIGRATE: Schema(  # one part (key, part), or a batch of one job's (parts: [[key, part], ...])
        {"id": _uint, "job": _small_str, "target": _list},
        {"key": _key, "part": _uint, "parts": _list, "force": _bool},
    ),
    Op.TENSOR_COPY_DONE: Schema({"id": _uint, "agg": _small_str, "job": _small_str, "key": _key, "part": _uint}),
    Op.WORKER_DONE: Schema({"id": _uint, "agg": _small_str, "job": _small_str, "key": _key, "part": _uint}),
    Op.SCHEDULE: Schema({"id": _uint, "cycle": _number, "tasks": _list}),
    Op.PROMOTE: Schema({"id": _uint, "job": _small_str, "key": _key, "part": _uint, "replicas": _list}),
    Op.COPY_REPLICA: Schema({"id": _uint, "job": _small_str, "key": _key, "part": _uint, "target": _list}),
    # action "add" (with count) or "remove" (with agg); pMaster checks which needs what
    Op.POOL: Schema({"id": _uint, "action": _small_str}, {"count": _uint, "agg": _small_str, "cred": _small_str}),
    Op.FUSED: Schema({"items": _list, "np": _list}, payloads=tuple(range(0, MAX_FUSED_FRAMES + 1))),
}


_OPS = {int(op): op for op in Op}
_DATA_FIELDS = tuple(_DATA_REQUIRED)


def _check_data(header: dict, op: Op) -> None:
    """The data-path schema, checked inline: this runs once per tensor message."""
    try:
        rid, job, tok, rank, key, part, rnd, dtype, shape, span = (header[f] for f in _DATA_FIELDS)
    except KeyError:
        missing = next(f for f in _DATA_FIELDS if f not in header)
        raise ProtocolError(f"{op.name} header lacks field {missing!r}") from None
    if (
        type(rid) is not int or rid < 0
        or type(rank) is not int or rank < 0
        or type(part) is not int or part < 0
        or type(rnd) is not int or rnd < 0
        or type(job) is not str or not 0 < len(job) <= MAX_NAME
        or type(tok) is not bytes or len(tok) > 256
        or dtype not in DTYPES
        or type(shape) is not list or len(shape) > MAX_NDIM
        or type(span) is not list or len(span) != 2
    ):
        # Something is off: let the per-field validators name it.
        for name, check in _DATA_REQUIRED.items():
            check(name, header[name])
    _key("key", key)
    for d in shape:
        if type(d) is not int or not 0 <= d < 1 << 62:
            _shape("shape", shape)
    start, stop = span
    if type(start) is not int or type(stop) is not int or not 0 <= start <= stop < 1 << 62:
        _span("span", span)


_REPLY = Op.REPLY  # a module global: an enum member's lookup on its class is slow
_PLAIN_REPLY_FIELDS = frozenset(("v", "op", "id", "rnd", "n", "ep"))
_U63 = 1 << 63


def _plain_reply(header: dict) -> bool:
    """True if a REPLY holds only non-negative ints in the fields every data reply has; anything
    else (a body, a move, a bad value) goes through the schema, which names what is wrong."""
    if not header.keys() <= _PLAIN_REPLY_FIELDS:
        return False
    rid, rnd, n, ep = header.get("id"), header.get("rnd", 0), header.get("n", 0), header.get("ep", 0)
    return (type(rid) is int and type(rnd) is int and type(n) is int and type(ep) is int
            and 0 <= rid < _U63 and 0 <= rnd < _U63 and 0 <= n < _U63 and 0 <= ep < _U63)


def _unpack(raw) -> Any:
    return msgpack.unpackb(
        raw,
        raw=False,
        strict_map_key=True,
        use_list=True,
        # No field needs more: this stops a hostile header from allocating its way to an OOM.
        max_str_len=1 << 20,
        max_bin_len=1 << 16,
        max_array_len=1 << 20,
        max_map_len=1 << 16,
        max_ext_len=0,
    )


def decode(raw, payload_sizes: Sequence[int] = (), limits: Limits = DEFAULT_LIMITS) -> dict:
    """Parse and validate one header frame given the sizes of the payload frames that follow.

    Raises ProtocolError naming the first thing that is wrong. The payloads themselves are not
    needed: a receiver validates before it reads (or allocates for) them.
    """
    if len(raw) > limits.max_header_bytes:
        raise ProtocolError(
            f"header of {len(raw)} bytes exceeds the limit of {limits.max_header_bytes}"
        )
    if len(payload_sizes) > frame_limit(limits):
        raise ProtocolError(
            f"message has {len(payload_sizes)} payload frames; the limit is {limits.max_frames}"
        )
    if sum(payload_sizes) > limits.max_message_bytes:
        raise ProtocolError(
            f"payload of {sum(payload_sizes)} bytes exceeds the limit of {limits.max_message_bytes}"
        )
    try:
        header = _unpack(raw)
    except Exception as exc:  # msgpack raises several unrelated types for bad input
        raise ProtocolError(f"header is not valid msgpack ({type(exc).__name__}: {exc})") from None
    if type(header) is not dict:
        raise ProtocolError(f"header must be a msgpack map, got {type(header).__name__}")
    version = header.get("v")
    if version != PROTOCOL_VERSION:
        raise ProtocolError(
            f"protocol version {version!r} is not supported; this peer speaks {PROTOCOL_VERSION}"
        )
    op_code = header.get("op")
    op = _OPS.get(op_code) if type(op_code) is int else None
    if op is None:
        raise ProtocolError(f"unknown op {op_code!r}")
    header["op"] = op
    if len(payload_sizes) > limits.max_frames and op is not Op.FUSED:
        raise ProtocolError(f"{op.name} has {len(payload_sizes)} payload frames; the limit is {limits.max_frames}")
    if op is _REPLY and len(payload_sizes) <= 1 and _plain_reply(header):
        return header  # the answer to every push and pull: checked inline, as data headers are
    schema = SCHEMAS[op]
    if op in DATA_OPS or op in TABLE_OPS:
        _check_data(header, op)
        if op in TABLE_OPS:
            _uint("n", header.get("n"))
    else:
        for name, check in schema.required.items():
            if name not in header:
                raise ProtocolError(f"{op.name} header lacks field {name!r}")
            check(name, header[name])
        for name, check in schema.optional.items():
            if name in header:
                check(name, header[name])
    if len(payload_sizes) not in schema.payloads:
        raise ProtocolError(
            f"{op.name} carries {len(payload_sizes)} payload frames; allowed: {schema.payloads}"
        )
    if op in DATA_OPS:
        _check_tensor(header, payload_sizes)
        if "cov" in header:
            _check_covers(header, op)
    elif op in TABLE_OPS:
        _check_table(header, payload_sizes)
    elif (op == Op.TENSOR_COPY or op == Op.REPLICATE) and "layout" in header["state"]:
        pass  # a table's state: frames of their own sizes, checked against the layout where it lands
    elif op == Op.TENSOR_COPY or op == Op.STATE_SET or op == Op.REPLICATE:
        _check_tensor(header, payload_sizes[:1])
        if any(size != payload_sizes[0] for size in payload_sizes):
            raise ProtocolError(f"{op.name} of key {header['key']!r}: frames of unequal sizes {list(payload_sizes)}")
        if op == Op.STATE_SET:
            names = header["names"]
            if len(names) != len(payload_sizes) or not all(type(n) is str and 0 < len(n) <= MAX_NAME for n in names):
                raise ProtocolError(f"STATE_SET of key {header['key']!r}: names {names!r} must be "
                                    f"{len(payload_sizes)} short strings, one per frame")
    return header


MAX_COVERED = 1 << 16  # ranks one push may stand for (a host's workers: pslink.core.agent.host_reduce)


def _check_covers(header: dict, op: Op) -> None:
    """``cov``: the ranks a push stands for (a host's leader pushes its host's sum for them)."""
    cov = header["cov"]
    if (op is not Op.PUSH and op is not Op.PUSHPULL) or type(cov) is not list or not 0 < len(cov) <= MAX_COVERED \
            or any(type(r) is not int or r < 0 for r in cov) or len(set(cov)) != len(cov):
        raise ProtocolError(f"{op.name} of key {header['key']!r}: field 'cov' must be a list of distinct ranks, "
                            f"on a push or pushpull only; got {cov!r}")


def _check_tensor(header: dict, payload_sizes: Sequence[int]) -> None:
    start, stop = header["span"]
    numel = math.prod(header["shape"]) if stop else 0
    if stop and stop > numel:
        raise ProtocolError(
            f"key {header['key']!r}: span {header['span']} exceeds the {numel} elements of shape "
            f"{tuple(header['shape'])}"
        )
    if payload_sizes:
        expected = (stop - start) * DTYPES[header["dtype"]].itemsize
        threshold = header.get("cmp")
        if threshold is not None:  # 2-bit compressed (pslink.core.compression): 4 values a byte
            if header["op"] not in (Op.PUSH, Op.PUSHPULL) or header["dtype"] not in FLOAT_DTYPES or \
                    type(threshold) not in (int, float) or not 0 < threshold < math.inf:
                raise ProtocolError(f"key {header['key']!r}: compression threshold {threshold!r} must be a positive "
                                    f"number, on a push of a floating dtype (got {header['op'].name} of "
                                    f"{header['dtype']})")
            expected = (stop - start + 3) // 4
        if payload_sizes[0] != expected:
            raise ProtocolError(
                f"key {header['key']!r}: payload of {payload_sizes[0]} bytes, but span {header['span']} "
                f"of {header['dtype']} needs {expected}"
            )


def _check_table(header: dict, payload_sizes: Sequence[int]) -> None:
    shape, n = header["shape"], header["n"]
    if len(shape) != 2 or not shape[0] or not shape[1]:
        raise ProtocolError(f"table {header['key']!r}: shape {shape} must be [shards, width]")
    expected = [n * 8] + ([n * shape[1] * DTYPES[header["dtype"]].itemsize] if len(payload_sizes) == 2 else [])
    if list(payload_sizes) != expected:
        raise ProtocolError(f"table {header['key']!r}: {n} id(s) of width {shape[1]} {header['dtype']} take frames of "
                            f"{expected} bytes, not {list(payload_sizes)}")


def encode(op: Op, **fields) -> bytes:
    """Build a header frame. Field order is the call's order, so the bytes are deterministic."""
    header = {"v": PROTOCOL_VERSION, "op": int(op)}
    header.update(fields)
    return msgpack.packb(header, use_bin_type=True)


def peek_id(raw: bytes) -> int:
    """Best effort: the request id of a header that failed validation, so the error finds its
    request (and its caller does not wait out a timeout). 0 when even that cannot be read."""
    try:
        header = msgpack.unpackb(raw, raw=False, max_str_len=1 << 16, max_bin_len=1 << 16,
                                 max_array_len=1 << 10, max_map_len=64)
        value = header.get("id") if isinstance(header, dict) else None
        return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0
    except Exception:
        return 0


class HeaderTemplate:
    """A data header whose fields are the same for every request but ``id`` and ``rnd``
    (the Agent sends one per part and op): the fixed pairs are packed once, and :meth:`make`
    appends the two that change, a fraction of the cost of packing the whole map each time. The
    order of a msgpack map's pairs means nothing to a reader, so the result decodes to exactly
    what ``encode(op, id=..., rnd=..., **fixed)`` does (with ``idl=...`` when given: how long,
    in ms, the worker had no request in flight before the burst this one is part of)."""

    __slots__ = ("_head", "_head_idle")

    def __init__(self, op: Op, **fixed):
        fields = {"v": PROTOCOL_VERSION, "op": int(op), **fixed}
        if "id" in fields or "rnd" in fields:
            raise ValueError("a header template's id and rnd are given per request")
        pairs = b"".join(msgpack.packb(k) + msgpack.packb(v, use_bin_type=True) for k, v in fields.items())
        self._head = _map_head(len(fields) + 2) + pairs + _ID_KEY
        self._head_idle = _map_head(len(fields) + 3) + pairs + _IDLE_KEY

    def make(self, request_id: int, round_: int, idle_ms: int | None = None) -> bytes:
        if idle_ms is None:
            return self._head + _packb(request_id) + _RND_KEY + _packb(round_)
        return self._head_idle + _packb(idle_ms) + _ID_KEY + _packb(request_id) + _RND_KEY + _packb(round_)


def _map_head(count: int) -> bytes:
    return bytes([0x80 | count]) if count < 16 else b"\xde" + count.to_bytes(2, "big")


_ID_KEY, _RND_KEY, _IDLE_KEY = msgpack.packb("id"), msgpack.packb("rnd"), msgpack.packb("idl")
_packb = msgpack.packb


def encode_error(request_id: int, exc: BaseException) -> bytes:
    """An ERROR reply for a request. A non-pslink exception is reported as an internal error."""
    if isinstance(exc, PslinkError):
        code, message = exc.code, exc.message
        details = {k: v for k, v in exc.details.items() if _plain(v)}
    else:
        code, message, details = "service", f"internal error: {type(exc).__name__}: {exc}", {}
    return encode(Op.ERROR, id=request_id, code=code, msg=message, details=details)


def _plain(value) -> bool:
    """True for values msgpack carries without custom types (error details must be plain)."""
    if value is None or isinstance(value, (bool, int, float, str, bytes)):
        return True
    if isinstance(value, (list, tuple)):
        return all(_plain(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _plain(v) for k, v in value.items())
    return False
