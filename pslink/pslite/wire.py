"""The messages ps-lite nodes exchange over pslink's transports, and their validation.

A message is a header frame plus payload frames, as everywhere in pslink, but with a header of
its own (pslink's core protocol is untouched): a fixed little-endian struct followed by a tail.

    magic b"PK" | version u8 | kind u8 | flags u8 | dtype u8 | app i32 | customer i32
    | timestamp i32 | sender i32 | cmd i32 | priority i32 | tail length u32 | tail

The fixed part is what every data message needs and costs one ``struct.unpack`` (a KV request
is on the hot path of every push and pull). The tail is the UTF-8 body of a SimpleApp message,
or a msgpack map for control and error messages. KV messages carry up to three payloads, as
ps-lite's do: keys (uint64), values (the app's dtype) and, optionally, lengths (int32).

:func:`decode` checks everything it can before a byte of payload is read: magic, version, kind,
flags, dtype, tail length, payload count and sizes (keys a multiple of 8, values of the item
size, one length per key), and the tail's fields. It raises ProtocolError naming what is wrong.
"""

from __future__ import annotations

import enum
import struct
from typing import Any, Sequence

import msgpack
import numpy as np

from pslink.core.wire.protocol import DTYPES
from pslink.errors import ProtocolError, PslinkError

MAGIC = b"PK"
VERSION = 1
FIXED = struct.Struct("<2sBBBBiiiiiiI")
_I32 = (-(1 << 31), (1 << 31) - 1)

# flags
PUSH = 1
PULL = 2
LENS = 4  # the message carries a lengths payload
FINAL = 8  # a barrier that ends the node (finalize)

DTYPE_CODES: dict[str, int] = {name: code for code, name in enumerate(DTYPES)}
DTYPE_BY_CODE: list[np.dtype] = [DTYPES[name] for name in DTYPES]
KEY_DTYPE = np.dtype("<u8")
LEN_DTYPE = np.dtype("<i4")


class Kind(enum.IntEnum):
    KV_REQUEST = 1
    KV_RESPONSE = 2
    SIMPLE_REQUEST = 3
    SIMPLE_RESPONSE = 4
    ERROR = 5  # a request failed at the receiver: tail {code, msg}
    REGISTER = 10  # node -> scheduler
    NODES = 11  # scheduler -> node: everyone registered; here is the table
    BARRIER = 12  # node -> scheduler
    RELEASE = 13  # scheduler -> node: a barrier is complete
    HEARTBEAT = 14
    LEAVE = 15  # node -> scheduler: finalized without a barrier
    NODE_FAILED = 16  # scheduler -> nodes
    REFUSED = 17  # scheduler -> node: registration refused


_KINDS = {int(k): k for k in Kind}
DATA_KINDS = frozenset({Kind.KV_REQUEST, Kind.KV_RESPONSE})


class Header:
    """A decoded, validated header."""

    __slots__ = ("kind", "flags", "dtype", "app", "customer", "ts", "sender", "cmd", "priority", "tail")

    def __init__(self, kind, flags, dtype, app, customer, ts, sender, cmd, priority, tail):
        self.kind, self.flags, self.dtype = kind, flags, dtype
        self.app, self.customer, self.ts, self.sender = app, customer, ts, sender
        self.cmd, self.priority, self.tail = cmd, priority, tail

    @property
    def push(self) -> bool:
        return bool(self.flags & PUSH)

    @property
    def pull(self) -> bool:
        return bool(self.flags & PULL)

    def __repr__(self) -> str:
        return (f"<{self.kind.name} app={self.app} customer={self.customer} ts={self.ts} "
                f"sender={self.sender} flags={self.flags}>")


def encode(kind: Kind, *, flags: int = 0, dtype: int = 0, app: int = 0, customer: int = 0, ts: int = 0,
           sender: int = 0, cmd: int = 0, priority: int = 0, tail: bytes = b"") -> bytes:
    return FIXED.pack(MAGIC, VERSION, kind, flags, dtype, app, customer, ts, sender, cmd, priority,
                      len(tail)) + tail


def encode_fields(kind: Kind, fields: dict, **fixed) -> bytes:
    """A control or error message: the fields travel as a msgpack map in the tail."""
    return encode(kind, tail=msgpack.packb(fields, use_bin_type=True), **fixed)


def encode_error(exc: BaseException, **fixed) -> bytes:
    if isinstance(exc, PslinkError):
        code, message = exc.code, exc.message
    else:
        code, message = "service", f"{type(exc).__name__}: {exc}"
    return encode_fields(Kind.ERROR, {"code": code, "msg": message}, **fixed)


def check_i32(name: str, value: Any) -> int:
    """ps-lite's ints (app ids, customer ids, commands, heads) are 32-bit on the wire."""
    if type(value) is int and _I32[0] <= value <= _I32[1]:
        return value  # the common case, in one test: this runs twice for every KV request
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise ProtocolError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    value = int(value)
    if not _I32[0] <= value <= _I32[1]:
        raise ProtocolError(f"{name}={value} does not fit in 32 bits")
    return value


def decode(raw: bytes, sizes: Sequence[int]) -> Header:
    """Parse and validate a header given the sizes of the payloads that follow it."""
    if len(raw) < FIXED.size:
        raise ProtocolError(f"pslite header of {len(raw)} bytes is shorter than {FIXED.size}")
    magic, version, kind_code, flags, dtype_code, app, customer, ts, sender, cmd, priority, tail_len = \
        FIXED.unpack_from(raw)
    if magic != MAGIC:
        raise ProtocolError(f"not a pslite message (magic {magic!r}; a pslink core peer on a ps-lite port?)")
    if version != VERSION:
        raise ProtocolError(f"pslite message version {version}; this node speaks {VERSION}")
    kind = _KINDS.get(kind_code)
    if kind is None:
        raise ProtocolError(f"unknown pslite message kind {kind_code}")
    if FIXED.size + tail_len != len(raw):
        raise ProtocolError(f"{kind.name}: tail of {tail_len} bytes, but {len(raw) - FIXED.size} follow")
    if dtype_code >= len(DTYPE_BY_CODE):
        raise ProtocolError(f"{kind.name}: unknown dtype code {dtype_code}")
    if flags & ~(PUSH | PULL | LENS | FINAL):
        raise ProtocolError(f"{kind.name}: unknown flags {flags:#x}")
    tail: Any = None
    if kind in DATA_KINDS:
        _check_kv_sizes(kind, flags, DTYPE_BY_CODE[dtype_code], sizes)
        if tail_len:
            raise ProtocolError(f"{kind.name} carries a tail of {tail_len} bytes; it has none")
    else:
        if sizes:
            raise ProtocolError(f"{kind.name} carries {len(sizes)} payloads; it has none")
        body = raw[FIXED.size:]
        if kind in (Kind.SIMPLE_REQUEST, Kind.SIMPLE_RESPONSE):
            try:
                tail = body.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise ProtocolError(f"{kind.name}: body is not UTF-8 ({exc})") from None
        else:
            tail = _unpack(kind, body)
            _check_fields(kind, tail)
    return Header(kind, flags, DTYPE_BY_CODE[dtype_code], app, customer, ts, sender, cmd, priority, tail)


def _check_kv_sizes(kind: Kind, flags: int, dtype: np.dtype, sizes: Sequence[int]) -> None:
    count = len(sizes)
    if count not in (0, 2, 3) or (count == 3) != bool(flags & LENS):
        raise ProtocolError(f"{kind.name}: {count} payloads with flags {flags:#x}; expected keys and values, "
                            "plus lengths when the LENS flag is set")
    if kind == Kind.KV_REQUEST and not flags & (PUSH | PULL):
        raise ProtocolError("KV_REQUEST is neither a push nor a pull")
    if not count:
        if kind == Kind.KV_REQUEST:
            raise ProtocolError("KV_REQUEST carries no keys")
        return
    keys_bytes, vals_bytes = sizes[0], sizes[1]
    if keys_bytes % KEY_DTYPE.itemsize:
        raise ProtocolError(f"{kind.name}: keys payload of {keys_bytes} bytes is not a whole number of uint64")
    if vals_bytes % dtype.itemsize:
        raise ProtocolError(f"{kind.name}: values payload of {vals_bytes} bytes is not a whole number of "
                            f"{dtype.name}")
    nkeys = keys_bytes // KEY_DTYPE.itemsize
    if count == 3 and sizes[2] != nkeys * LEN_DTYPE.itemsize:
        raise ProtocolError(f"{kind.name}: {sizes[2]} bytes of lengths for {nkeys} keys; expected "
                            f"{nkeys * LEN_DTYPE.itemsize}")
    if kind == Kind.KV_REQUEST and flags & PUSH and count == 2 and nkeys and (vals_bytes // dtype.itemsize) % nkeys:
        raise ProtocolError(f"KV_REQUEST: {vals_bytes // dtype.itemsize} values do not divide among "
                            f"{nkeys} keys and no lengths were given")


def _unpack(kind: Kind, body: bytes) -> dict:
    try:
        fields = msgpack.unpackb(body, raw=False, strict_map_key=True, max_str_len=1 << 20,
                                 max_bin_len=1 << 16, max_array_len=1 << 20, max_map_len=1 << 10,
                                 max_ext_len=0)
    except Exception as exc:  # msgpack raises several unrelated types for bad input
        raise ProtocolError(f"{kind.name}: tail is not valid msgpack ({type(exc).__name__}: {exc})") from None
    if not isinstance(fields, dict):
        raise ProtocolError(f"{kind.name}: tail must be a map")
    return fields


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _str(kind, fields, name, optional=False):
    value = fields.get(name)
    if value is None and optional:
        return
    if not isinstance(value, str) or len(value) > 4096:
        raise ProtocolError(f"{kind.name}: field {name!r} must be a string, got {value!r}")


def _int_field(kind, fields, name, minimum=-(1 << 62), maximum=1 << 62):
    value = fields.get(name)
    if not _is_int(value) or not minimum <= value <= maximum:
        raise ProtocolError(f"{kind.name}: field {name!r} must be an int in [{minimum}, {maximum}], got {value!r}")


def _check_fields(kind: Kind, fields: dict) -> None:
    if kind == Kind.ERROR:
        _str(kind, fields, "code")
        _str(kind, fields, "msg")
    elif kind == Kind.REGISTER:
        if fields.get("role") not in ("worker", "server"):
            raise ProtocolError(f"REGISTER: role {fields.get('role')!r} must be worker or server")
        for name in ("addr", "host", "mode"):
            _str(kind, fields, name)
        if "host_id" in fields:
            _str(kind, fields, "host_id")
        _int_field(kind, fields, "pid", 0)
        _int_field(kind, fields, "rank", -1)
        _int_field(kind, fields, "nw", 1)
        _int_field(kind, fields, "ns", 0)
    elif kind == Kind.NODES:
        _int_field(kind, fields, "id", 1)
        table = fields.get("nodes")
        if not isinstance(table, list) or not table:
            raise ProtocolError("NODES: field 'nodes' must be a non-empty list")
        for row in table:
            if (not isinstance(row, list) or len(row) != 5 or not _is_int(row[0]) or row[1] not in
                    ("worker", "server", "scheduler") or not _is_int(row[2]) or not isinstance(row[3], str)
                    or not _is_int(row[4])):
                raise ProtocolError(f"NODES: row {row!r} must be [id, role, rank, address, pid]")
    elif kind in (Kind.BARRIER, Kind.RELEASE):
        _int_field(kind, fields, "group", 1, 7)
    elif kind == Kind.NODE_FAILED:
        _int_field(kind, fields, "id", 1)
        _str(kind, fields, "msg")
    elif kind == Kind.REFUSED:
        _str(kind, fields, "msg")
