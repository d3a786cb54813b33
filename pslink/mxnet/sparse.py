"""Row-sparse keys of the ``pslink`` kvstore: each is a sparse table on the service
(:mod:`pslink.core.tables`), a row per first-axis index, as MXNet's dist_sync servers keep a
row_sparse weight.

``init`` of a row_sparse array (or of a dense one a Trainer's ``stype='row_sparse'`` Parameter
holds) declares the table and rank 0 sets its rows; ``push`` of row_sparse gradients sends each
device's rows (repeated rows are summed); the service applies the job's optimizer, set with
``set_optimizer``, to the pushed rows only (MXNet's lazy update); ``row_sparse_pull`` reads the
rows of ``row_ids`` into a row_sparse array. Without an optimizer a round's pushed rows replace
the stored ones, as MXNet's servers copy the merged gradient into the store.
"""

from __future__ import annotations

import math

import mxnet as mx
import numpy as np

from pslink.mxnet.errors import KVStoreError

SHARDS = 4  # a row-sparse key's shards: 4 placed tasks, spread over the pool


class RowSparseKey:
    """A row-sparse key as this worker knows it: its shape, dtype and table."""

    __slots__ = ("shape", "dtype", "table")

    def __init__(self, shape: tuple, dtype: np.dtype, table):
        self.shape, self.dtype, self.table = shape, dtype, table


def is_row_sparse(value) -> bool:
    arrays = value if isinstance(value, (list, tuple)) else [value]
    return any(isinstance(a, mx.nd.NDArray) and a.stype == "row_sparse" for a in arrays)


def rows_of(array: mx.nd.NDArray, key, shape: tuple, what: str) -> tuple[np.ndarray, np.ndarray]:
    """(row ids, their rows flattened to the table's width) of a row_sparse or dense array."""
    if array.shape != shape:
        raise KVStoreError(f"pslink kvstore: {what} of row-sparse key {key!r} with shape {array.shape}, but the key "
                           f"has shape {shape}", key=key, shapes=[list(array.shape), list(shape)])
    width = math.prod(shape[1:])
    if array.stype == "row_sparse":
        ids = array.indices.asnumpy().astype(np.int64)
        return ids, array.data.asnumpy().reshape(ids.size, width)
    if array.stype != "default":
        raise KVStoreError(f"pslink kvstore: {what} of key {key!r}: {array.stype} arrays are not supported", key=key)
    return np.arange(shape[0], dtype=np.int64), array.asnumpy().reshape(shape[0], width)


def declare(agent, key, array: mx.nd.NDArray) -> RowSparseKey:
    """Declare ``key``'s table (every worker); rank 0 sets its rows (its initial value)."""
    shape = tuple(array.shape)
    if len(shape) < 2 or not shape[0]:
        raise KVStoreError(f"pslink kvstore: row-sparse key {key!r} needs at least 2 dimensions and a row, got "
                           f"shape {shape}", key=key)
    dtype = np.dtype(array.dtype)
    table = agent.table(key, math.prod(shape[1:]), dtype.name, shards=SHARDS, optimizer="job")
    info = RowSparseKey(shape, dtype, table)
    if agent.rank == 0:
        ids, rows = rows_of(array, key, shape, "init")
        table.assign(ids, rows.astype(dtype, copy=False)).wait()
    return info


def push(info: RowSparseKey, key, arrays: list):
    """Send every device's rows of ``key`` as this worker's push of the round."""
    parts = [rows_of(a, key, info.shape, "push") for a in arrays]
    ids = np.concatenate([p[0] for p in parts]) if len(parts) > 1 else parts[0][0]
    rows = np.concatenate([p[1] for p in parts]) if len(parts) > 1 else parts[0][1]
    return info.table.push(ids, rows.astype(info.dtype, copy=False))


def pull_rows(info: RowSparseKey, key, outs: list, row_ids: list) -> None:
    """Write the rows of each ``row_ids`` entry into the row_sparse (or dense) array beside it."""
    for out, rid in zip(outs, row_ids):
        if not isinstance(rid, mx.nd.NDArray):
            raise KVStoreError(f"pslink kvstore: row_sparse_pull of key {key!r}: row_ids must be NDArrays, got "
                               f"{type(rid).__name__}", key=key)
        if out.shape != info.shape:
            raise KVStoreError(f"pslink kvstore: row_sparse_pull of key {key!r} into shape {out.shape}, but the key "
                               f"has shape {info.shape}", key=key, shapes=[list(out.shape), list(info.shape)])
        ids = np.unique(rid.asnumpy().astype(np.int64))
        if ids.size and (ids[0] < 0 or ids[-1] >= info.shape[0]):
            raise KVStoreError(f"pslink kvstore: row_sparse_pull of key {key!r}: row id {int(ids[-1] if ids[0] >= 0 else ids[0])} "
                               f"is out of range [0, {info.shape[0]})", key=key)
        rows = info.table.pull(ids).wait().reshape((ids.size,) + info.shape[1:])
        pulled = mx.nd.sparse.row_sparse_array((rows, ids), shape=info.shape, dtype=info.dtype)
        # Not recorded: gluon pulls a row_sparse Parameter's rows into its data array (which is in
        # the graph) from inside autograd.record() (Parameter.row_sparse_data), and MXNet's own
        # store writes there through its engine, which autograd never sees.
        with mx.autograd.pause():
            if out.stype == "row_sparse":
                pulled.copyto(out)
            else:
                out[:] = pulled.tostype("default")
