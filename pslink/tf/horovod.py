"""Horovod's ``horovod.tensorflow`` functions over the parameter service.

``import pslink.tf as hvd`` in place of ``import horovod.tensorflow as hvd``; run the script with
``pslink launch -n N python train.py`` (as with ``horovodrun``). ``init()`` joins the job that
the launcher's environment names; everything else works on the Session it made
(:mod:`pslink.core.worker.session`, where what Horovod means is written once for every
framework). This module converts tensors (:mod:`pslink.tf.collectives`), makes the collectives
differentiable (:mod:`pslink.tf.gradients`) and keeps Horovod's TensorFlow signatures, including
its handling of ``tf.IndexedSlices``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import tensorflow as tf

from pslink.core.worker.horovod import HorovodAPI
from pslink.core.worker.process_sets import ProcessSet
from pslink.core.worker.reduction import Adasum, Average, ReduceOp, Sum, reduce_op
from pslink.errors import ConfigError
from pslink.tf import collectives, gradients, graph, variables
from pslink.tf.compression import Compression
from pslink.tf.world import current_session, global_process_set, holder

# Horovod's codes for process_set_included_op (horovod/common/basics.py)
PROCESS_SET_ERROR_INIT = -1
PROCESS_SET_ERROR_UNKNOWN_SET = -3


def init(comm=None, process_sets=None, *, job: str | None = None, rank: int | None = None,
         num_workers: int | None = None, master: str | None = None, **options: Any) -> None:
    """Join the job (job, rank, num_workers and master from ``pslink launch``'s environment, or as
    arguments, as :func:`pslink.connect` names them); with none named anywhere, a job of one
    worker, as Horovod runs without ``horovodrun``. Calling it again while initialized does
    nothing, as in Horovod; after :func:`shutdown` it joins again. ``process_sets``: sets to add
    at once (ProcessSets or rank lists), as Horovod's ``init(process_sets=...)``."""
    holder.start(comm, process_sets, job, rank, num_workers, master, **options)


shutdown = holder.shutdown
is_initialized = holder.is_initialized


def _dense_or_slices(tensor):
    return tensor if isinstance(tensor, tf.IndexedSlices) else tf.convert_to_tensor(tensor)


class Horovod(HorovodAPI):
    """Horovod's TensorFlow API (``horovod.tensorflow``'s functions) over the Session ``current()``
    gives: the module's functions are the methods of one of these, bound to the session
    ``init()`` made; a test or a library may hold its own over any Session. What holds no tensor
    (the world, process sets, objects, barrier) is :class:`HorovodAPI`'s, as for every adapter."""

    # -- the world (rank, size, process sets: HorovodAPI's), and TensorFlow's -------------------------

    def cuda_built(self) -> bool:
        """Whether this TensorFlow was built with CUDA (as Horovod reports it)."""
        return tf.test.is_built_with_cuda()

    # ops that read the world when they run (Horovod's promise: a graph built in one place may run
    # in another); eagerly they are constants
    def rank_op(self, name: str | None = None) -> tf.Tensor:
        return graph.value_op(self.rank, name)

    def local_rank_op(self, name: str | None = None) -> tf.Tensor:
        return graph.value_op(self.local_rank, name)

    def size_op(self, process_set_id: int = 0, name: str | None = None) -> tf.Tensor:
        """The number of ranks (of the process set with this id)."""
        return graph.value_op(lambda: self._set_of(process_set_id).size(), name)

    def local_size_op(self, name: str | None = None) -> tf.Tensor:
        return graph.value_op(self.local_size, name)

    def process_set_included_op(self, process_set_id: int = 0, name: str | None = None) -> tf.Tensor:
        """1 if this rank is in the process set, 0 if not; Horovod's error codes for a job not
        initialized (-1) or a set not known (-3)."""

        def read() -> int:
            if not holder.is_initialized():
                return PROCESS_SET_ERROR_INIT
            try:
                process_set = self._set_of(process_set_id)
            except ConfigError:
                return PROCESS_SET_ERROR_UNKNOWN_SET
            return 1 if process_set.included() else 0

        return graph.value_op(read, name)

    def _set_of(self, process_set_id: int) -> ProcessSet:
        if process_set_id == 0:
            return global_process_set
        found = self._current().process_sets.added.get(process_set_id)
        if found is None:
            raise ConfigError(f"no process set has id {process_set_id!r} (add_process_set gives the ids)")
        return found

    # -- allreduce --------------------------------------------------------------------------------

    def allreduce(self, tensor, average: bool | None = None, device_dense: str = "", device_sparse: str = "",
                  compression=Compression.none, op: ReduceOp | None = None, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0, name: str | None = None,
                  process_set: ProcessSet = global_process_set, ignore_name_scope: bool = False):
        """``tensor`` reduced over the ranks (Average by default; ``op``: Sum, Min, Max, Product,
        Adasum), ``prescale_factor`` applied before, ``postscale_factor`` after (differentiable).
        A ``tf.IndexedSlices`` is gathered instead (values and indices), as Horovod does."""
        op = reduce_op(op, average)
        session = self._session_of(process_set)
        if isinstance(tensor, tf.IndexedSlices):
            return self._slices(session, [tensor], op, prescale_factor, postscale_factor)[0]
        compressed, ctx = compression.compress(tf.convert_to_tensor(tensor))
        reduced = gradients.allreduce(session, compressed, name, op, prescale_factor, postscale_factor)
        return compression.decompress(reduced, ctx)

    def grouped_allreduce(self, tensors, average: bool | None = None, device_dense: str = "",
                          device_sparse: str = "", compression=Compression.none, op: ReduceOp | None = None,
                          prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                          process_set: ProcessSet = global_process_set, ignore_name_scope: bool = False,
                          name: str | None = None) -> list:
        """:func:`allreduce` of each of ``tensors``, as one group (``name.i`` each); slices among
        them are gathered (differentiable)."""
        if not isinstance(tensors, (list, tuple)):
            raise ConfigError(f"grouped_allreduce takes a list of tensors, got {type(tensors).__name__}")
        if not tensors:
            return tensors
        op = reduce_op(op, average)
        session = self._session_of(process_set)
        values = [_dense_or_slices(t) for t in tensors]
        out: list = [None] * len(values)
        sparse = [i for i, v in enumerate(values) if isinstance(v, tf.IndexedSlices)]
        dense = [i for i in range(len(values)) if i not in sparse]
        if sparse:
            for i, value in zip(sparse, self._slices(session, [values[i] for i in sparse], op, prescale_factor,
                                                     postscale_factor)):
                out[i] = value
        if dense:
            packed = [compression.compress(values[i]) for i in dense]
            reduced = gradients.grouped_allreduce(session, [c for c, _ in packed], name, op, prescale_factor,
                                                  postscale_factor)
            for i, value, (_, ctx) in zip(dense, reduced, packed):
                out[i] = compression.decompress(value, ctx)
        return out

    @staticmethod
    def _slices(session, slices: list, op: ReduceOp, prescale: float, postscale: float) -> list:
        """Horovod's allreduce of ``tf.IndexedSlices``: every rank's values and indices gathered
        (the values divided by the number of ranks for Average)."""
        if op is Adasum:
            raise NotImplementedError("The Adasum reduction does not currently support sparse tensors. As a "
                                      "workaround please pass sparse_as_dense=True to DistributedOptimizer")
        if op not in (Average, Sum):
            raise NotImplementedError("Only Sum and Average ops are supported with tf.IndexedSlices")
        if prescale != 1.0 or postscale != 1.0:
            raise NotImplementedError("Pre/postscale_factor are not supported with tf.IndexedSlices")
        values = gradients.grouped_allgather(session, [s.values for s in slices], None)
        indices = gradients.grouped_allgather(session, [s.indices for s in slices], None)
        if op is Average:
            values = [v / tf.cast(session.size, v.dtype) for v in values]
        return [tf.IndexedSlices(v, i, dense_shape=s.dense_shape) for v, i, s in zip(values, indices, slices)]

    # -- gathers and broadcasts ---------------------------------------------------------------------

    def allgather(self, tensor, name: str | None = None, ignore_name_scope: bool = False,
                  process_set: ProcessSet = global_process_set) -> tf.Tensor:
        """Every rank's ``tensor`` concatenated along the first dimension, in rank order; ranks may
        bring different numbers of rows (differentiable)."""
        return gradients.allgather(self._session_of(process_set), tensor, name)

    def grouped_allgather(self, tensors, name: str | None = None, ignore_name_scope: bool = False,
                          process_set: ProcessSet = global_process_set) -> list:
        """:func:`allgather` of each of ``tensors``, as one group (differentiable)."""
        return gradients.grouped_allgather(self._session_of(process_set), tensors, name)

    def broadcast(self, tensor, root_rank: int, name: str | None = None, ignore_name_scope: bool = False,
                  process_set: ProcessSet = global_process_set) -> tf.Tensor:
        """``root_rank``'s ``tensor`` on every rank (differentiable)."""
        return gradients.broadcast(self._session_of(process_set), tensor, root_rank, name)

    def broadcast_(self, variables_, root_rank: int, name: str | None = None,
                   process_set: ProcessSet = global_process_set) -> list:
        """Horovod's in-place broadcast: ``root_rank``'s values assigned to ``variables_`` (every
        rank passes the same ones, checked first); returns their new values."""
        variables_ = list(variables_)
        assigns = self._assign_from_root(variables_, root_rank, process_set, "broadcast_", name)
        if graph.eager():
            return [tf.convert_to_tensor(v) for v in variables_]
        with tf.control_dependencies(assigns):
            return [tf.identity(v) for v in variables_]

    def broadcast_variables(self, variables_, root_rank: int, process_set: ProcessSet = global_process_set,
                            inplace: bool = False):
        """Assign ``root_rank``'s values to ``variables_`` on every rank (one request; every rank
        passes the same variables, checked first: else a ShapeMismatchError naming the first that
        differs). In a graph, returns the op that does it."""
        assigns = self._assign_from_root(list(variables_), root_rank, process_set, "broadcast_variables")
        if not graph.eager():
            return tf.group(*assigns)
        return None

    def _assign_from_root(self, variables_: list, root_rank: int, process_set, what: str,
                          name: str | None = None) -> list:
        if not variables_:
            return []  # no call at all (Horovod's makes no op either: it needs no init() then)
        session = self._session_of(process_set)
        session.check_root(root_rank, what)
        entries = variables.describe_variables(variables_)
        variables.check_once(session, entries, what, what)
        named = [(f"tf.var/{entry[0]}", tf.identity(v) if not graph.eager() else tf.convert_to_tensor(v))
                 for entry, v in zip(entries, variables_)]
        values = collectives.broadcast_many(session, named, root_rank, what, name or what)
        return [v.assign(value) for v, value in zip(variables_, values)]

    def broadcast_global_variables(self, root_rank: int):
        """TF1: an op that assigns ``root_rank``'s values to every global variable of the graph."""
        if graph.eager():
            raise RuntimeError("hvd.broadcast_global_variables() does not support eager execution. Please use "
                               "`hvd.broadcast_variables(<model/optimizer variables>)` instead.")  # Horovod's words
        return self.broadcast_variables(tf.compat.v1.global_variables(), root_rank)

    def broadcast_object(self, obj: Any = None, root_rank: int = 0, session=None, name: str | None = None,
                         process_set: ProcessSet = global_process_set) -> Any:
        """``root_rank``'s ``obj`` (any picklable object) on every rank (at once, in any mode;
        ``session``, Horovod's TF1 argument, is not needed). Unnamed calls share one name, not
        the object's type as Horovod's: the ranks that receive pass no object of that type."""
        return self._session_of(process_set).broadcast_object(obj, root_rank, name)

    def broadcast_object_fn(self, root_rank: int = 0, session=None, name: str | None = None,
                            process_set: ProcessSet = global_process_set) -> Callable:
        """A function that broadcasts an object from ``root_rank`` (Horovod's, for TF1 sessions)."""
        name = name or "broadcast_object_fn"
        return lambda obj: self.broadcast_object(obj, root_rank, None, name, process_set)

    def allgather_object(self, obj: Any, session=None, name: str | None = None,
                         process_set: ProcessSet = global_process_set) -> list:
        """Every rank's ``obj`` (any picklable object), as a list in rank order."""
        return self._session_of(process_set).allgather_object(obj, name)

    # -- reducescatter, alltoall ------------------------------------------------------------------------

    def reducescatter(self, tensor, device_dense: str = "", compression=Compression.none, op: ReduceOp = Average,
                      name: str | None = None, process_set: ProcessSet = global_process_set,
                      ignore_name_scope: bool = False, prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0) -> tf.Tensor:
        """``tensor`` reduced over the ranks (Average or Sum), this rank's share of its rows (the
        first ``rows % size`` ranks one more), scale factors as allreduce's (differentiable)."""
        compressed, ctx = compression.compress(tf.convert_to_tensor(tensor))
        share = gradients.reducescatter(self._session_of(process_set), compressed, name, reduce_op(op),
                                        prescale_factor, postscale_factor)
        return compression.decompress(share, ctx)

    def grouped_reducescatter(self, tensors, device_dense: str = "", compression=Compression.none,
                              op: ReduceOp = Average, process_set: ProcessSet = global_process_set,
                              prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                              name: str | None = None) -> list:
        """:func:`reducescatter` of each of ``tensors``, as one group (differentiable)."""
        if not isinstance(tensors, (list, tuple)):
            raise ConfigError(f"grouped_reducescatter takes a list of tensors, got {type(tensors).__name__}")
        if not tensors:
            return tensors
        packed = [compression.compress(tf.convert_to_tensor(t)) for t in tensors]
        shares = gradients.grouped_reducescatter(self._session_of(process_set), [c for c, _ in packed], name,
                                                 reduce_op(op), prescale_factor, postscale_factor)
        return [compression.decompress(s, ctx) for s, (_, ctx) in zip(shares, packed)]

    def alltoall(self, tensor, splits=None, name: str | None = None, ignore_name_scope: bool = False,
                 process_set: ProcessSet = global_process_set):
        """Rank i gets ``splits[i]`` rows of every rank's ``tensor`` (equal shares by default), in
        rank order; with ``splits``, also how many rows came from each rank (int32), as Horovod
        returns (differentiable)."""
        received, received_splits = gradients.alltoall(self._session_of(process_set), tensor, splits, name)
        return received if splits is None else (received, received_splits)

    # -- synchronization -----------------------------------------------------------------------------

    def join(self) -> tf.Tensor:
        """This rank is out of data: take part in the others' allreduces and gradient reductions
        with zeros until every rank joined; the rank that joined last (an int32 tensor)."""
        return collectives.join(self._current())

    def barrier(self, process_set: ProcessSet = global_process_set) -> None:
        """Block until every rank (of ``process_set``) has called ``barrier()``."""
        self._session_of(process_set).barrier()

    def start_timeline(self, file_path: str, mark_cycles: bool = False) -> None:
        """Horovod's: record this rank's requests to a Chrome trace at ``file_path`` from now on
        (rank 0 writes ``file_path``, rank R ``file_path.rankR``); ``mark_cycles`` marks iterations."""
        self._current().agent.start_timeline(file_path, mark_cycles)

    def stop_timeline(self) -> None:
        self._current().agent.stop_timeline()

    # -- wrappers ------------------------------------------------------------------------------------

    def DistributedOptimizer(self, optimizer, name: str | None = None, use_locking: bool = False,
                             device_dense: str = "", device_sparse: str = "", compression=Compression.none,
                             sparse_as_dense: bool = False, backward_passes_per_step: int = 1,
                             op: ReduceOp = Average, gradient_predivide_factor: float = 1.0,
                             average_aggregated_gradients: bool = False, num_groups: int = 0, groups=None,
                             process_set: ProcessSet = global_process_set, scale_local_gradients: bool = True):
        """Horovod's ``horovod.tensorflow.DistributedOptimizer`` for a Keras optimizer: the Keras
        wrapper (:func:`pslink.tf.keras.DistributedOptimizer`). TF1's ``tf.compat.v1.train``
        optimizers are refused, naming what to use instead."""
        import keras

        from pslink.tf.optimizer import DistributedOptimizer as keras_distributed

        if not isinstance(optimizer, keras.optimizers.Optimizer):
            raise ConfigError(f"pslink.tf.DistributedOptimizer wraps Keras optimizers, got {type(optimizer).__name__}; "
                              "TF1's tf.compat.v1.train optimizers are not offered: take the gradients with "
                              "pslink.tf.DistributedGradientTape and apply them with the optimizer")
        if op is Adasum:
            raise ConfigError("op == Adasum is not supported yet with Keras")  # Horovod's words
        return keras_distributed(optimizer, name, device_dense, device_sparse, compression, sparse_as_dense,
                                 gradient_predivide_factor, op, backward_passes_per_step,
                                 average_aggregated_gradients, num_groups, groups, process_set, scale_local_gradients)


class BroadcastGlobalVariablesHook(tf.compat.v1.train.SessionRunHook):
    """TF1: a ``SessionRunHook`` that broadcasts every global variable from ``root_rank`` once the
    session is created (``tf.compat.v1.train.MonitoredTrainingSession(hooks=[...])``)."""

    def __init__(self, root_rank: int, device: str = ""):
        super().__init__()
        self.root_rank = root_rank
        self.bcast_op = None
        self.device = device

    def begin(self) -> None:
        if self.bcast_op is None or self.bcast_op.graph != tf.compat.v1.get_default_graph():
            with tf.device(self.device):
                self.bcast_op = broadcast_global_variables(self.root_rank)

    def after_create_session(self, session, coord) -> None:
        session.run(self.bcast_op)


# The module's functions: the API over the session init() made.
_api = Horovod(current_session)
add_process_set = _api.add_process_set
remove_process_set = _api.remove_process_set
rank = _api.rank
size = _api.size
local_rank = _api.local_rank
local_size = _api.local_size
cross_rank = _api.cross_rank
cross_size = _api.cross_size
is_homogeneous = _api.is_homogeneous
cuda_built = _api.cuda_built
rank_op = _api.rank_op
local_rank_op = _api.local_rank_op
size_op = _api.size_op
local_size_op = _api.local_size_op
process_set_included_op = _api.process_set_included_op
allreduce = _api.allreduce
grouped_allreduce = _api.grouped_allreduce
allgather = _api.allgather
grouped_allgather = _api.grouped_allgather
broadcast = _api.broadcast
broadcast_ = _api.broadcast_
broadcast_variables = _api.broadcast_variables
broadcast_global_variables = _api.broadcast_global_variables
broadcast_object = _api.broadcast_object
broadcast_object_fn = _api.broadcast_object_fn
allgather_object = _api.allgather_object
reducescatter = _api.reducescatter
grouped_reducescatter = _api.grouped_reducescatter
alltoall = _api.alltoall
join = _api.join
barrier = _api.barrier
start_timeline = _api.start_timeline
stop_timeline = _api.stop_timeline
DistributedOptimizer = _api.DistributedOptimizer
