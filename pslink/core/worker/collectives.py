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

The torch and TensorFlow adapters turn their tensors into host arrays and call these; each passes
a :data:`PushPull`, one synchronous round of one key that rewords errors for its own users. The
public names every adapter offers are listed here once (:data:`HOROVOD_NAMES`), and a test holds
the adapters to it.
"""

from __future__ import annotations

import atexit
import enum
import hashlib
import pickle
from collections.abc import Callable
from typing import Any

import numpy as np

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


def check_root(root: Any, size: int, what: str) -> None:
    """ConfigError naming ``what`` unless ``root`` is a rank of a job of ``size`` workers."""
    if isinstance(root, bool) or not isinstance(root, int) or not 0 <= root < size:
        raise ConfigError(f"{what}: root_rank must be an int in [0, {size}), got {root!r}")


# -- reduction operators ----------------------------------------------------------------------------


class ReduceOp(enum.Enum):
    AVERAGE = "average"
    SUM = "sum"
    ADASUM = "adasum"
    MIN = "min"
    MAX = "max"
    PRODUCT = "product"


Average = ReduceOp.AVERAGE
Sum = ReduceOp.SUM
Adasum = ReduceOp.ADASUM
Min = ReduceOp.MIN
Max = ReduceOp.MAX
Product = ReduceOp.PRODUCT
# Reduced from every rank's tensor, gathered in rank order (the service sums; it does not take
# minima or products), so every rank computes the same result.
ELEMENTWISE = frozenset({Min, Max, Product})


def reduce_op(op: ReduceOp | None, average: bool | None = None, elementwise: bool = False) -> ReduceOp:
    """Horovod's rules: ``op`` wins, the deprecated ``average`` flag picks Average or Sum.
    ``elementwise``: the adapter reduces Min, Max and Product too."""
    if op is not None and average is not None:
        raise ConfigError("pass op= or the deprecated average=, not both")
    if op is None:
        op = Sum if average is False else Average
    if op is Adasum:
        raise ConfigError("op=Adasum is not supported by pslink; use Average or Sum")
    if not isinstance(op, ReduceOp):
        raise ConfigError(f"op must be pslink's Average, Sum, Min, Max or Product, got {op!r}")
    if op in ELEMENTWISE and not elementwise:
        raise ConfigError(f"op={op.name.title()} is not supported here; use Average or Sum")
    return op


class SessionHolder:
    """The process's one session of a Horovod-style module (``module``, as users import it): its
    ``init()`` sets ``session``; ``shutdown()``, also at exit, closes it."""

    def __init__(self, module: str):
        self.module = module
        self.session: Any = None
        atexit.register(self.shutdown)

    def current(self) -> Any:
        if self.session is None:
            raise ConfigError(f"{self.module} has not been initialized; call {self.module}.init() first")
        return self.session

    def shutdown(self) -> None:
        session, self.session = self.session, None
        if session is not None:
            session.close()


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
    """``obj`` pickled, as a ``uint8`` array."""
    return np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), np.uint8)


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


# -- the Horovod API ---------------------------------------------------------------------------------

# What Horovod's build reports: pslink needs none of MPI, Gloo, NCCL, DDL, CCL or ROCm (CUDA is
# the framework's own question, answered by each adapter). The adapters export these as they are.
# -- join: uneven data (Horovod's join(), the same in every adapter) -----------------------------

def join_vector(slots: int, rank: int, stepper: int | None) -> np.ndarray:
    """A rank's part of a join round: a slot per rank (1 in its own once it joined) and, in the
    last slot, ``stepper + 1`` from every rank still training (which gradient reduction it makes:
    a joined rank learns which to mirror)."""
    vector = np.zeros(slots + 1, np.int64)
    if stepper is None:
        vector[rank] = 1
    else:
        vector[slots] = stepper + 1
    return vector


def join(join_round: Callable[[], np.ndarray], size: int, rank: int, seen: np.ndarray,
         mirror: Callable[[int], None]) -> tuple[int, np.ndarray]:
    """This rank ran out of data: until every rank did, ``mirror(stepper)`` the reduction the
    others make (with zeros), one join round (``join_round()``: this rank's joined vector,
    summed over the ranks) at a time. ``seen``: who had joined at the last round this rank saw.
    Returns the rank that joined last (the highest, if several joined together) and who has."""
    while True:
        before, vector = seen, join_round()
        seen = vector[:size].copy()
        if seen.sum() == size:
            newcomers = [r for r in range(size) if not before[r]]
            return (max(newcomers) if newcomers else rank), seen
        mirror(int(vector[-1]) // (size - int(seen.sum())) - 1)


class NoneCompressor:
    """Horovod's ``Compression.none`` in every adapter: tensors go as they are (each adapter's
    ``Compression.fp16`` casts with its framework's own calls)."""

    @staticmethod
    def compress(tensor):
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor


def mpi_threads_supported() -> bool:
    return False


def mpi_enabled() -> bool:
    return False


def mpi_built() -> bool:
    return False


def gloo_enabled() -> bool:
    return False


def gloo_built() -> bool:
    return False


def nccl_built() -> bool:
    return False


def ddl_built() -> bool:
    return False


def ccl_built() -> bool:
    return False


def rocm_built() -> bool:
    return False


NOT_BUILT = ("mpi_threads_supported", "mpi_enabled", "mpi_built", "gloo_enabled", "gloo_built",
             "nccl_built", "ddl_built", "ccl_built", "rocm_built")


def cross_rank(rank: int, local_size: int) -> int:
    """The index of this rank's machine, as Horovod numbers them (``local_size`` ranks per machine)."""
    return rank // max(local_size, 1)


def cross_size(size: int, local_size: int) -> int:
    """The number of machines, as Horovod counts them."""
    return max(size // max(local_size, 1), 1)


def is_homogeneous(size: int, local_size: int) -> bool:
    """Whether every machine runs ``local_size`` of the ``size`` ranks (as cross_rank and
    cross_size assume; ``pslink launch --nnodes`` starts the same number on each)."""
    return local_size >= 1 and size % local_size == 0


# The names of Horovod's API (horovod.torch, horovod.tensorflow and horovod.mxnet share them) that
# every pslink adapter offering Horovod's API must export, with Horovod's meaning.
HOROVOD_NAMES = frozenset({
    "init", "shutdown", "is_initialized",
    "rank", "size", "local_rank", "local_size", "cross_rank", "cross_size",
    *NOT_BUILT, "cuda_built",
    "Average", "Sum", "Adasum", "Min", "Max", "Product", "HorovodInternalError",
    "allreduce", "allgather", "broadcast", "broadcast_object", "allgather_object",
    "barrier", "join",
    "allgather_async", "grouped_allreduce", "grouped_allreduce_async", "grouped_allgather",
    "reducescatter", "alltoall", "add_process_set", "remove_process_set", "ProcessSet", "global_process_set",
    "Compression", "DistributedOptimizer",
})

# The public names of Horovod 0.28.1's modules (their __init__.py, read from its sdist; helpers a
# module imports for itself, such as check_extension, split_list or vars_to_refs, left out):
# each adapter offers every one of its module's, but the gaps listed below.
HOROVOD_MODULE_NAMES: dict[str, frozenset] = {
    "pslink.torch": frozenset({
        "HorovodInternalError", "SyncBatchNorm", "allgather_async", "allreduce_", "allreduce_async",
        "allreduce_async_", "alltoall_async", "barrier", "broadcast_", "broadcast_async", "broadcast_async_",
        "broadcast_optimizer_state", "broadcast_parameters", "elastic", "grouped_allgather_async",
        "grouped_allreduce_", "grouped_allreduce_async", "grouped_allreduce_async_", "grouped_reducescatter",
        "grouped_reducescatter_async", "poll", "reducescatter_async", "sparse_allreduce_async", "start_timeline",
        "stop_timeline", "synchronize"}),
    "pslink.tf": frozenset({
        "BroadcastGlobalVariablesHook", "DistributedGradientTape", "PartialDistributedGradientTape",
        "SyncBatchNormalization", "broadcast_", "broadcast_global_variables", "broadcast_object_fn",
        "broadcast_variables", "elastic", "grouped_reducescatter", "is_homogeneous", "local_rank_op",
        "local_size_op", "process_set_included_op", "rank_op", "size_op", "start_timeline", "stop_timeline"}),
    "pslink.tf.keras": frozenset({
        "broadcast_global_variables", "callbacks", "elastic", "load_model", "reducescatter", "start_timeline",
        "stop_timeline"}),
    "pslink.tf.keras.callbacks": frozenset({
        "BestModelCheckpoint", "BroadcastGlobalVariablesCallback", "LearningRateScheduleCallback",
        "LearningRateWarmupCallback", "MetricAverageCallback"}),
    "pslink.mxnet.horovod": frozenset({
        "DistributedTrainer", "allreduce_", "broadcast_", "broadcast_parameters", "grouped_allreduce_",
        "grouped_reducescatter", "start_timeline", "stop_timeline"}),
}
# (each set above holds the names beyond HOROVOD_NAMES, which every module but the callbacks' has)

# Names of HOROVOD_NAMES an adapter does not offer yet, and why (the test also checks that each
# listed name is really missing, so that this stays true as names are added).
HOROVOD_GAPS: dict[str, dict[str, str]] = {
    "pslink.torch": {},
    "pslink.tf": {
        # Horovod's TensorFlow API has none either: its ops run asynchronously in the graph.
        **{name: "asynchronous collectives with handles are torch's only (Horovod's TensorFlow API has none)"
           for name in ("allgather_async", "grouped_allreduce_async")},
    },
    "pslink.mxnet.horovod": {
        # Horovod's MXNet API has no handles either (its collectives return when done).
        **{name: "asynchronous collectives of NDArrays are not written (Horovod's MXNet API has none)"
           for name in ("allgather_async", "grouped_allreduce_async")},
    },
    "pslink.tf.keras": {
        # Horovod's TensorFlow API has none either: its ops run asynchronously in the graph.
        **{name: "asynchronous collectives with handles are torch's only (Horovod's TensorFlow API has none)"
           for name in ("allgather_async", "grouped_allreduce_async")},
    },
    "pslink.tf.keras.callbacks": {},
}
