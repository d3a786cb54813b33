"""Collectives over push-pull, shared by the framework adapters: numpy arrays in and out.

Horovod's collectives reduce to push-pulls of named keys in ``sum`` mode:

- an **allreduce** sums (or averages) what every rank pushed;
- a **broadcast** has every rank but the root push zeros, so the sum is the root's value (the same
  key can be broadcast any number of times, one round each);
- an **allgather** has each rank fill its own rows of a zeroed buffer (broadcasts and gathers push
  the elements' bits as integers, :func:`bits_of`, so the result is exact, -0.0 included); a first round shares every
  rank's shape, so ranks may bring different numbers of rows and a mismatch is an error on every
  rank at once (not two keys each waiting for the other);
- an **object** is pickled into bytes and travels as a ``uint8`` array, its length first (a key's
  shape is fixed once declared, so the length is part of the data key).

The Session (:mod:`pslink.core.worker.session`) composes these pure pieces into Horovod's
collectives; the torch.distributed backend uses the gathers too.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Callable
from typing import Any

import numpy as np

from pslink.core.wire.protocol import DTYPES
from pslink.errors import ConfigError, ShapeMismatchError

MAX_KEY_LENGTH = 256  # the service's limit on string keys
MAX_GATHER_DIMS = 8

# One synchronous push-pull round: (key, array to push, array to receive into) -> the latter.
PushPull = Callable[[str, np.ndarray, np.ndarray], np.ndarray]


def service_key(*parts: Any) -> str:
    """``parts`` joined by ``/`` as a service key: identical on every rank, at most 256 characters
    (a longer one keeps its start and gets a digest of the whole)."""
    key = "/".join(str(p) for p in parts)
    if len(key) <= MAX_KEY_LENGTH:
        return key
    digest = hashlib.sha1(key.encode()).hexdigest()
    return f"{key[: MAX_KEY_LENGTH - len(digest) - 1]}#{digest}"


def check_root(root: Any, size: int, what: str) -> int:
    """``root`` as an int; ConfigError naming ``what`` unless it is a rank of a world of ``size``."""
    if isinstance(root, (np.integer,)):
        root = int(root)
    if isinstance(root, bool) or not isinstance(root, int) or not 0 <= root < size:
        raise ConfigError(f"{what}: root_rank must be an int in [0, {size}), got {root!r}")
    return root


_DTYPE_NAMES = tuple(DTYPES)


def dtype_code(dtype: np.dtype) -> int:
    """A dtype the service carries as a small number (1-based), for rows every rank shares."""
    return _DTYPE_NAMES.index(np.dtype(dtype).name) + 1


def dtype_of(code: int) -> str:
    return _DTYPE_NAMES[code - 1] if 1 <= code <= len(_DTYPE_NAMES) else "?"


# -- broadcast ----------------------------------------------------------------------------------------


class Zeros:
    """Read-only zero arrays, cut from one buffer per dtype: what non-root ranks push."""

    def __init__(self):
        self._buffers: dict[np.dtype, np.ndarray] = {}

    def like(self, array: np.ndarray) -> np.ndarray:
        buffer = self._buffers.get(array.dtype)
        if buffer is None or buffer.size < array.size:
            buffer = np.zeros(max(array.size, 1024), array.dtype)
            buffer.flags.writeable = False
            self._buffers[array.dtype] = buffer
        return buffer[: array.size].reshape(array.shape)

    def clear(self) -> None:
        self._buffers.clear()


_INT_OF_WIDTH = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}


def bits_of(array: np.ndarray) -> np.ndarray:
    """``array``'s memory as integers of its element's width, flat: a view, so what is received
    into it lands in ``array``. Broadcasts and gathers push these: a sum of one rank's value and
    zeros is then that value bit for bit, where a float sum turns -0.0 into 0.0."""
    if not array.flags.c_contiguous:
        raise ValueError("bits_of needs a contiguous array (a reshaped copy would not receive the result)")
    flat = array.reshape(-1)
    return flat.view(_INT_OF_WIDTH[flat.dtype.itemsize])


def broadcast_pushes(arrays: list[np.ndarray], rank: int, root: int, zeros: Zeros) -> list[np.ndarray]:
    """What this rank pushes to broadcast ``arrays`` (each as :func:`bits_of`, and received into
    the same): the arrays themselves on the root, zeros elsewhere."""
    return list(arrays) if rank == root else [zeros.like(a) for a in arrays]


# -- allgather ----------------------------------------------------------------------------------------


def gather_same_rows(pushpull: PushPull, key: str, row: np.ndarray, rank: int, rows: int) -> np.ndarray:
    """Every rank's ``row`` (all of one shape) stacked, in rank order: ``rows`` slots, this rank
    filling slot ``rank``; slots no rank fills stay zero."""
    stacked = np.zeros((rows,) + row.shape, row.dtype)
    stacked[rank] = row
    pushpull(key, bits_of(stacked), bits_of(stacked))
    return stacked


def scatter_share(rows: int, size: int, rank: int) -> tuple[int, int]:
    """Horovod's reducescatter split of ``rows``: (first row, rows) of ``rank``'s share; the
    first ``rows % size`` ranks get one row more."""
    counts = [rows // size + (1 if r < rows % size else 0) for r in range(size)]
    return sum(counts[:rank]), counts[rank]


def alltoall_splits(name: str, rows: int, size: int, splits) -> list[int]:
    """The rows ``alltoall`` sends each rank: ``splits`` checked, or equal shares if None."""
    if splits is None:
        if rows % size:
            raise ConfigError(f"alltoall {name!r}: {rows} rows do not split evenly over {size} ranks; pass splits")
        return [rows // size] * size
    splits = [int(n) for n in splits]
    if len(splits) != size or any(n < 0 for n in splits) or sum(splits) != rows:
        raise ConfigError(f"alltoall {name!r}: splits {splits} must be {size} counts >= 0 adding up to the "
                          f"tensor's {rows} rows")
    return splits


def alltoall_pieces(table: list[list[int]], rank: int) -> list[tuple[int, int]]:
    """Where ``rank``'s rows lie in every rank's rows gathered in rank order: (first row, rows)
    from each rank in turn (``table[r]``: the rows rank r sends each rank)."""
    pieces, start = [], 0
    for sent in table:
        pieces.append((start + sum(sent[:rank]), sent[rank]))
        start += sum(sent)
    return pieces


def gather_rows(pushpull: PushPull, name: str, host: np.ndarray, rank: int, size: int,
                capacity: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(all ranks' ``host`` concatenated along the first dimension, rows per rank).

    Ranks may bring different numbers of rows; the other dimensions must agree. ``capacity`` (the
    most ranks the job may have, default ``size``) sizes the shapes round, so its key keeps one
    shape when an elastic job changes size; slots past ``size`` stay zero."""
    if host.ndim == 0:
        host = host.reshape(1)
    if host.ndim > MAX_GATHER_DIMS:
        raise ConfigError(f"allgather {name!r}: at most {MAX_GATHER_DIMS} dimensions, got {host.ndim}")
    described_row = np.zeros(1 + MAX_GATHER_DIMS, np.int64)
    described_row[0] = host.ndim
    described_row[1 : 1 + host.ndim] = host.shape
    shapes = gather_same_rows(pushpull, service_key("allgather", name, "shapes"), described_row, rank,
                              capacity or size)
    described = [tuple(int(d) for d in row[1 : 1 + row[0]]) for row in shapes[:size]]
    if any(s[1:] != described[rank][1:] for s in described):
        listing = ", ".join(f"rank {r} has shape {s}" for r, s in enumerate(described))
        raise ShapeMismatchError(f"allgather {name!r}: all dimensions but the first must agree: {listing}",
                                 key=name, shapes=[list(s) for s in described])
    rows = np.array([s[0] for s in described], np.int64)
    start = int(rows[:rank].sum())
    trailing = host.shape[1:]
    buffer = np.zeros((int(rows.sum()),) + trailing, host.dtype)
    buffer[start : start + host.shape[0]] = host
    dims = "x".join(str(d) for d in (int(rows.sum()),) + trailing)
    pushpull(service_key("allgather", name, dims), bits_of(buffer), bits_of(buffer))
    return buffer, rows


# -- objects -------------------------------------------------------------------------------------------


def object_bytes(obj: Any) -> np.ndarray:
    """``obj`` pickled, as a ``uint8`` array. (Objects are pickled between the ranks of one job,
    as Horovod's broadcast_object does; the service only sums their bytes.)"""
    return np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), np.uint8)


def object_from(data: np.ndarray) -> Any:
    return pickle.loads(data.tobytes())


def broadcast_object(pushpull: PushPull, name: str, obj: Any, rank: int, root: int) -> Any:
    """``root``'s ``obj`` on every rank (pickled on the root, unpickled on the others)."""
    if rank == root:
        payload = object_bytes(obj)
        length = np.array([payload.size], np.int64)
    else:
        payload, length = None, np.zeros(1, np.int64)
    pushpull(service_key("object", name, "length"), length, length)
    size = int(length[0])
    data = payload if payload is not None else np.zeros(size, np.uint8)
    out = np.empty(size, np.uint8)
    pushpull(service_key("object", name, size), data, out)
    return obj if rank == root else pickle.loads(out.tobytes())


def allgather_object(pushpull: PushPull, name: str, obj: Any, rank: int, size: int,
                     capacity: int | None = None) -> list:
    """Every rank's ``obj``, as a list in rank order."""
    gathered, rows = gather_rows(pushpull, f"{name}/object", object_bytes(obj), rank, size, capacity)
    bounds = np.concatenate([[0], np.cumsum(rows)])
    return [pickle.loads(gathered[bounds[r] : bounds[r + 1]].tobytes()) for r in range(size)]
