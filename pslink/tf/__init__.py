"""pslink for TensorFlow: Horovod's TensorFlow API and a tf.distribute strategy, over the service.

Horovod users change the import (``import pslink.tf as hvd``, ``import pslink.tf.keras as hvd``):
``init``, ``rank``, ``size``, ``allreduce``, ``allgather``, ``broadcast``, ``alltoall``,
``reducescatter``, the grouped ones, ``broadcast_variables``, ``broadcast_object``, ``join``,
``DistributedGradientTape``, ``SyncBatchNormalization``, process sets, ``elastic``, ... with
Horovod's signatures and meaning (the names offered are held to
``pslink.core.worker.horovod.HOROVOD_MODULE_NAMES``). Run the script with
``pslink launch -n N python train.py``.

One line for ``tf.distribute`` users (Keras ``model.fit`` or a custom loop, unchanged)::

    strategy = pslink.tf.ParameterServiceStrategy()
    with strategy.scope():
        model = ...; model.compile(...)
    model.fit(...)

Tested with TensorFlow 2.17 and Keras 3 (see docs/tf.md).
"""

try:
    import tensorflow as _tf  # noqa: F401
except ImportError as _exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "pslink.tf needs TensorFlow: pip install -c constraints.txt 'pslink[tf]' "
        f"(TensorFlow 2.17.1, the version tested) ({_exc})"
    ) from None

# Horovod's build reports, as every adapter offers them
from pslink.core.worker.horovod import (
    ccl_built,
    ddl_built,
    gloo_built,
    gloo_enabled,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    rocm_built,
)
from pslink.core.worker.process_sets import ProcessSet
from pslink.core.worker.reduction import (
    Adasum,
    Average,
    Max,
    Min,
    Product,
    ReduceOp,
    Sum,
)
from pslink.errors import (
    PslinkError as HorovodInternalError,  # a RuntimeError, as Horovod's
)
from pslink.tf import elastic  # hvd.elastic.run, hvd.elastic.TensorFlowKerasState
from pslink.tf.compression import Compression
from pslink.tf.horovod import (
    BroadcastGlobalVariablesHook,
    DistributedOptimizer,
    add_process_set,
    allgather,
    allgather_object,
    allreduce,
    alltoall,
    barrier,
    broadcast,
    broadcast_,
    broadcast_global_variables,
    broadcast_object,
    broadcast_object_fn,
    broadcast_variables,
    cross_rank,
    cross_size,
    cuda_built,
    grouped_allgather,
    grouped_allreduce,
    grouped_reducescatter,
    init,
    is_homogeneous,
    is_initialized,
    join,
    local_rank,
    local_rank_op,
    local_size,
    local_size_op,
    process_set_included_op,
    rank,
    rank_op,
    reducescatter,
    remove_process_set,
    shutdown,
    size,
    size_op,
    start_timeline,
    stop_timeline,
)
from pslink.tf.strategy import ParameterServiceStrategy
from pslink.tf.tape import DistributedGradientTape, PartialDistributedGradientTape
from pslink.tf.world import global_process_set


def __getattr__(name: str):
    # Keras loads only when its layer is asked for: the rest of pslink.tf does not need it.
    if name == "SyncBatchNormalization":
        from pslink.tf.sync_batch_norm import SyncBatchNormalization

        return SyncBatchNormalization
    raise AttributeError(f"module 'pslink.tf' has no attribute {name!r}")


__all__ = [
    # Horovod
    "Adasum",
    "Average",
    "BroadcastGlobalVariablesHook",
    "Compression",
    "DistributedGradientTape",
    "DistributedOptimizer",
    "HorovodInternalError",
    "Max",
    "Min",
    # tf.distribute
    "ParameterServiceStrategy",
    "PartialDistributedGradientTape",
    "ProcessSet",
    "Product",
    "ReduceOp",
    "Sum",
    "SyncBatchNormalization",
    "add_process_set",
    "allgather",
    "allgather_object",
    "allreduce",
    "alltoall",
    "barrier",
    "broadcast",
    "broadcast_",
    "broadcast_global_variables",
    "broadcast_object",
    "broadcast_object_fn",
    "broadcast_variables",
    "ccl_built",
    "cross_rank",
    "cross_size",
    "cuda_built",
    "ddl_built",
    "elastic",
    "global_process_set",
    "gloo_built",
    "gloo_enabled",
    "grouped_allgather",
    "grouped_allreduce",
    "grouped_reducescatter",
    "init",
    "is_homogeneous",
    "is_initialized",
    "join",
    "local_rank",
    "local_rank_op",
    "local_size",
    "local_size_op",
    "mpi_built",
    "mpi_enabled",
    "mpi_threads_supported",
    "nccl_built",
    "process_set_included_op",
    "rank",
    "rank_op",
    "reducescatter",
    "remove_process_set",
    "rocm_built",
    "shutdown",
    "size",
    "size_op",
    "start_timeline",
    "stop_timeline",
]
