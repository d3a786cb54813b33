"""The process's Horovod session for ``pslink.torch`` (``hvd.init()`` makes it): one holder
that the module's functions, the DistributedOptimizer, SyncBatchNorm, the elastic states and the
service's embedding tables find it through."""

from __future__ import annotations

from pslink.core.worker.horovod import Holder
from pslink.core.worker.process_sets import ProcessSet
from pslink.core.worker.session import Session

holder = Holder("pslink.torch")


def current_session() -> Session:
    """The session ``pslink.torch.init()`` made (ConfigError before it)."""
    return holder.current()


# Horovod's global process set: every rank of the session init() made.
global_process_set = ProcessSet.of_world(current_session)

