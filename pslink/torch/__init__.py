"""PyTorch adapter: a DDP communication hook and a Horovod-compatible module.

DDP, one line::

    ddp_model.register_comm_hook(pslink.torch.connect(), pslink.torch.comm_hook)

Horovod scripts, the import line::

    import pslink.torch as hvd      # was: import horovod.torch as hvd
    hvd.init()
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)

Run either with ``pslink launch -n N python train.py``. See docs/torch.md; elastic jobs
(``hvd.elastic.run``, ``pslink launch --min-np A --max-np B``): docs/elastic.md.
"""

try:
    import torch  # noqa: F401
except ImportError as exc:  # pragma: no cover - CI installs torch
    raise ImportError(f"pslink.torch needs PyTorch: pip install 'pslink[torch]' ({exc})") from None

from pslink.torch.ddp import HookState, comm_hook, connect  # noqa: E402
from pslink.torch.horovod import (  # noqa: E402
    DistributedOptimizer,
    add_process_set,
    allgather,
    allgather_async,
    allgather_object,
    alltoall,
    alltoall_async,
    allreduce,
    allreduce_,
    allreduce_async,
    allreduce_async_,
    barrier,
    broadcast,
    broadcast_,
    broadcast_async,
    broadcast_async_,
    broadcast_object,
    broadcast_optimizer_state,
    broadcast_parameters,
    ccl_built,
    cross_rank,
    cross_size,
    cuda_built,
    ddl_built,
    gloo_built,
    gloo_enabled,
    grouped_allgather,
    grouped_allgather_async,
    grouped_allreduce,
    grouped_allreduce_,
    grouped_allreduce_async,
    grouped_allreduce_async_,
    grouped_reducescatter,
    grouped_reducescatter_async,
    init,
    is_homogeneous,
    is_initialized,
    join,
    local_rank,
    local_size,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    poll,
    push_pull,
    push_pull_async,
    push_pull_async_inplace,
    push_pull_inplace,
    rank,
    remove_process_set,
    reducescatter,
    reducescatter_async,
    rocm_built,
    shutdown,
    size,
    sparse_allreduce_async,
    start_timeline,
    stop_timeline,
    synchronize,
)
from pslink.torch.sync_batch_norm import SyncBatchNorm  # noqa: E402
from pslink.torch.embedding import Embedding, EmbeddingBag  # noqa: E402  (tables on the service)
from pslink.core.worker.reduction import Adasum, Average, Max, Min, Product, ReduceOp, Sum  # noqa: E402
from pslink.core.worker.session import Session  # noqa: E402
from pslink.torch.collectives import Compression, Work  # noqa: E402
from pslink.core.worker.process_sets import ProcessSet  # noqa: E402
from pslink.torch.world import global_process_set  # noqa: E402
from pslink.errors import PslinkError as HorovodInternalError  # noqa: E402  (a RuntimeError, as Horovod's)
from pslink.torch import elastic  # noqa: E402  (hvd.elastic.run, hvd.elastic.TorchState)
from pslink.torch import backend as _backend  # noqa: E402

_backend.register()  # torch.distributed.init_process_group("pslink")

__all__ = [
    # DDP
    "HookState",
    "comm_hook",
    "connect",
    # elastic
    "elastic",
    # sparse tables on the service
    "Embedding",
    "EmbeddingBag",
    # Horovod / BytePS
    "Adasum",
    "Average",
    "Compression",
    "DistributedOptimizer",
    "HorovodInternalError",
    "Max",
    "Min",
    "ProcessSet",
    "Product",
    "ReduceOp",
    "Session",
    "Sum",
    "Work",
    "add_process_set",
    "allgather",
    "allgather_async",
    "allgather_object",
    "alltoall",
    "alltoall_async",
    "allreduce",
    "allreduce_",
    "allreduce_async",
    "allreduce_async_",
    "barrier",
    "grouped_allgather",
    "grouped_allgather_async",
    "grouped_allreduce",
    "grouped_allreduce_",
    "grouped_allreduce_async",
    "grouped_allreduce_async_",
    "grouped_reducescatter",
    "grouped_reducescatter_async",
    "broadcast",
    "broadcast_",
    "broadcast_async",
    "broadcast_async_",
    "broadcast_object",
    "broadcast_optimizer_state",
    "broadcast_parameters",
    "ccl_built",
    "cross_rank",
    "cross_size",
    "cuda_built",
    "ddl_built",
    "gloo_built",
    "gloo_enabled",
    "init",
    "is_homogeneous",
    "is_initialized",
    "join",
    "local_rank",
    "local_size",
    "mpi_built",
    "mpi_enabled",
    "mpi_threads_supported",
    "nccl_built",
    "poll",
    "push_pull",
    "push_pull_async",
    "push_pull_async_inplace",
    "push_pull_inplace",
    "global_process_set",
    "rank",
    "remove_process_set",
    "reducescatter",
    "reducescatter_async",
    "rocm_built",
    "shutdown",
    "size",
    "sparse_allreduce_async",
    "start_timeline",
    "stop_timeline",
    "SyncBatchNorm",
    "synchronize",
]
