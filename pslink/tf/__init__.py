"""pslink for TensorFlow: a tf.distribute strategy and Horovod's TensorFlow API, over the service.

One line for ``tf.distribute`` users (Keras ``model.fit`` or a custom loop, unchanged)::

    strategy = pslink.tf.ParameterServiceStrategy()
    with strategy.scope():
        model = ...; model.compile(...)
    model.fit(...)

Horovod users change the import (``import pslink.tf as hvd``): ``init``, ``rank``, ``size``,
``allreduce``, ``allgather``, ``broadcast``, ``broadcast_variables``, ``broadcast_object``,
``allgather_object``, ``barrier``, ``DistributedGradientTape``, ``SyncBatchNormalization``, ... and in
``pslink.tf.keras``:
``DistributedOptimizer`` and the callbacks ``BroadcastGlobalVariablesCallback`` and
``MetricAverageCallback`` (the names offered are checked against
``pslink.core.worker.collectives.HOROVOD_NAMES``). Run the script with ``pslink launch -n N python train.py``.
Tested with TensorFlow 2.17 and Keras 3 (see docs/tf.md).
"""

try:
    import tensorflow as _tf  # noqa: F401
except ImportError as _exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "pslink.tf needs TensorFlow: pip install -c constraints.txt 'pslink[tf]' "
        f"(TensorFlow 2.17.1, the version tested) ({_exc})"
    ) from None

from pslink.core.worker.collectives import (
    Adasum,
    Average,
    Max,
    Min,
    Product,
    Sum,
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
from pslink.tf.context import (
    cross_rank,
    cross_size,
    cuda_built,
    init,
    is_initialized,
    local_rank,
    local_size,
    rank,
    shutdown,
    size,
)
from pslink.tf.functions import (
    BroadcastGlobalVariablesHook,
    broadcast_,
    broadcast_global_variables,
    broadcast_object_fn,
    is_homogeneous,
    local_rank_op,
    local_size_op,
    process_set_included_op,
    rank_op,
    size_op,
    start_timeline,
    stop_timeline,
)
from pslink.tf.ops import (
    Compression,
    DistributedGradientTape,
    DistributedOptimizer,
    PartialDistributedGradientTape,
    allgather,
    allgather_object,
    allreduce,
    barrier,
    broadcast,
    broadcast_object,
    broadcast_variables,
    grouped_allreduce,
    join,
)
from pslink.tf.rows import alltoall, grouped_allgather, grouped_reducescatter, reducescatter
from pslink.tf.strategy import ParameterServiceStrategy
from pslink.tf import elastic
from pslink.tf.process_sets import ProcessSet, add_process_set, global_process_set, remove_process_set
from pslink.errors import PslinkError as HorovodInternalError  # a RuntimeError, as Horovod's


def __getattr__(name: str):
    # Keras loads only when its layer is asked for: the rest of pslink.tf does not need it.
    if name == "SyncBatchNormalization":
        from pslink.tf.sync_batch_norm import SyncBatchNormalization

        return SyncBatchNormalization
    raise AttributeError(f"module 'pslink.tf' has no attribute {name!r}")


__all__ = [
    "elastic",
    "BroadcastGlobalVariablesHook",
    "PartialDistributedGradientTape",
    "SyncBatchNormalization",
    "broadcast_",
    "broadcast_global_variables",
    "broadcast_object_fn",
    "is_homogeneous",
    "local_rank_op",
    "local_size_op",
    "process_set_included_op",
    "rank_op",
    "size_op",
    "start_timeline",
    "stop_timeline",
    "Adasum",
    "Average",
    "DistributedGradientTape",
    "DistributedOptimizer",
    "HorovodInternalError",
    "Max",
    "Min",
    "ParameterServiceStrategy",
    "Product",
    "Sum",
    "allgather",
    "allgather_object",
    "allreduce",
    "barrier",
    "broadcast",
    "broadcast_object",
    "broadcast_variables",
    "grouped_allreduce",
    "join",
    "ProcessSet",
    "add_process_set",
    "global_process_set",
    "remove_process_set",
    "grouped_allgather",
    "grouped_reducescatter",
    "reducescatter",
    "alltoall",
    "Compression",
    "ccl_built",
    "cross_rank",
    "cross_size",
    "cuda_built",
    "ddl_built",
    "gloo_built",
    "gloo_enabled",
    "init",
    "is_initialized",
    "local_rank",
    "local_size",
    "mpi_built",
    "mpi_enabled",
    "mpi_threads_supported",
    "nccl_built",
    "rank",
    "rocm_built",
    "shutdown",
    "size",
]
