"""The process's Horovod session for ``pslink.mxnet.horovod`` (``hvd.init()`` makes it): one
holder that the module's functions, the DistributedTrainer and the DistributedOptimizer find it
through."""

from __future__ import annotations

from pslink.core.worker.horovod import Holder
from pslink.core.worker.process_sets import ProcessSet
from pslink.core.worker.session import Session
from pslink.errors import ConfigError

holder = Holder("pslink.mxnet.horovod")


def current_session() -> Session:
    """The session ``pslink.mxnet.horovod.init()`` made (ConfigError before it)."""
    return holder.current()


# Horovod's global process set: every rank of the session init() made.
global_process_set = ProcessSet.of_world(current_session)


def member_session(world: Session, process_set) -> Session | None:
    """The Session ``process_set``'s collectives run on from ``world`` (the world itself for
    the global set), or None where this rank is outside the set: Horovod's DistributedTrainer
    and DistributedOptimizer then step on their own gradients, unreduced."""
    ranks = getattr(process_set, "ranks", None)
    if ranks is not None and world.rank not in ranks:
        if world.process_sets.added.get(process_set.process_set_id) is not process_set:
            raise ConfigError(f"{process_set!r} is not added (add_process_set) or was removed")
        return None
    return world.process_sets.session_for(process_set)
