"""Between TensorFlow tensors and the Session's host arrays: dtypes, zero-copy views, naming.

An eager CPU tensor is handed to the Session as ``np.asarray(tensor)``, a read-only view of its
own buffer (``tensor.numpy()`` copies). Results are received into 64-byte aligned numpy arrays
(:func:`empty`) that TensorFlow takes over through DLPack without a copy (TensorFlow aborts the
process on an unaligned DLPack buffer, so only aligned ones are handed over that way). Inside a
graph, ``tf.numpy_function`` passes its inputs as views and takes aligned outputs as they are.

The service carries the dtypes of :data:`pslink.core.wire.protocol.DTYPES`; others travel as
one of them: ``bool`` as ``uint8``, ``bfloat16`` as its bits (``uint16``) where values are only
moved (broadcast, gathers) and as ``float32`` where they are reduced. The conversion is a
TensorFlow op before and after the trip (:func:`to_wire`, :func:`from_wire`).
"""

from __future__ import annotations

import re

import numpy as np
import tensorflow as tf

from pslink.core.wire.protocol import DTYPES
from pslink.errors import ConfigError

ALIGN = 64  # bytes: TensorFlow's buffers (EIGEN_MAX_ALIGN_BYTES)

_NATIVE = frozenset(tf.as_dtype(name) for name in DTYPES)
_MOVED_AS = {tf.bool: tf.uint8, tf.bfloat16: tf.uint16}
_REDUCED_AS = {tf.bfloat16: tf.float32}
_DLPACK = frozenset(np.dtype(name) for name in DTYPES)


def wire(dtype: tf.DType, what: str, reduced: bool) -> tf.DType:
    """The dtype a tensor of ``dtype`` travels as (``reduced``: its values are summed, not just
    moved); ConfigError naming ``what`` if it cannot travel."""
    dtype = tf.as_dtype(dtype)
    if dtype in _NATIVE:
        return dtype
    carried = (_REDUCED_AS if reduced else _MOVED_AS).get(dtype)
    if carried is None:
        supported = sorted(d.name for d in (_NATIVE | (_REDUCED_AS.keys() if reduced else _MOVED_AS.keys())))
        raise ConfigError(f"{what}: {'reducing' if reduced else 'sending'} {dtype.name} tensors is not supported; "
                          f"supported: {', '.join(supported)}")
    return carried


def to_wire(tensor: tf.Tensor, carried: tf.DType) -> tf.Tensor:
    """``tensor`` as ``carried`` (a view where TensorFlow has one: a bitcast)."""
    if tensor.dtype == carried:
        return tensor
    if tensor.dtype == tf.bfloat16 and carried == tf.uint16:
        return tf.bitcast(tensor, tf.uint16)
    return tf.cast(tensor, carried)


def from_wire(tensor: tf.Tensor, dtype: tf.DType) -> tf.Tensor:
    """The inverse of :func:`to_wire`."""
    if tensor.dtype == dtype:
        return tensor
    if dtype == tf.bfloat16 and tensor.dtype == tf.uint16:
        return tf.bitcast(tensor, tf.bfloat16)
    return tf.cast(tensor, dtype)


def empty(shape, dtype) -> np.ndarray:
    """An uninitialised array whose buffer starts at a multiple of :data:`ALIGN` bytes."""
    dtype = np.dtype(dtype)
    shape = tuple(int(d) for d in shape)
    size = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.empty(size + ALIGN, np.uint8)
    start = -raw.ctypes.data % ALIGN
    return raw[start:start + size].view(dtype).reshape(shape)


def zeros(shape, dtype) -> np.ndarray:
    array = empty(shape, dtype)
    array.fill(0)
    return array


def host(tensor: tf.Tensor) -> np.ndarray:
    """An eager tensor's values as a (read-only) numpy view of its buffer."""
    return np.asarray(tensor)


def to_tensor(array: np.ndarray) -> tf.Tensor:
    """A host array the Session filled, as an eager tensor; no copy for an aligned array."""
    array = np.asarray(array)
    if array.dtype in _DLPACK and array.flags.c_contiguous and array.ctypes.data % ALIGN == 0:
        return tf.experimental.dlpack.from_dlpack(array.__dlpack__())
    return tf.convert_to_tensor(array)


def aligned(array: np.ndarray) -> np.ndarray:
    """``array`` itself if its buffer is aligned and contiguous, else an aligned copy (what a
    graph op returns: TensorFlow takes an aligned array without copying it again)."""
    if array.flags.c_contiguous and array.ctypes.data % ALIGN == 0:
        return array
    copy = empty(array.shape, array.dtype)
    np.copyto(copy, array)
    return copy


def name_of(tensor) -> str:
    """A graph tensor's name made a valid op-name part (Horovod's ``_normalize_name``)."""
    return re.sub(r"[^a-zA-Z0-9_]", "_", tensor.name)
