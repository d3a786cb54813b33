"""What an Agent keeps per key (its declaration, its parts and where they live), and how it reads
arrays (no I/O)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from pslink.core.wire.protocol import DTYPES, FLOAT_DTYPES
from pslink.errors import ConfigError, ShapeMismatchError


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
