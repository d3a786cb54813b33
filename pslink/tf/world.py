"""The process's Horovod session for ``pslink.tf`` and ``pslink.tf.keras`` (``hvd.init()`` makes
it): one holder that the module's functions, the gradient tapes, the Keras optimizer and
callbacks, the elastic states and ParameterServiceStrategy find it through."""

from __future__ import annotations

from pslink.core.worker.horovod import Holder
from pslink.core.worker.process_sets import ProcessSet
from pslink.core.worker.session import Session

holder = Holder("pslink.tf")


def current_session() -> Session:
    """The session ``pslink.tf.init()`` made (ConfigError before it)."""
    return holder.current()


def session_of(process_set) -> Session:
    """The Session a collective of ``process_set`` runs on (the process's for the global set)."""
    return current_session().process_sets.session_for(process_set)


# Horovod's global process set: every rank of the session init() made.
global_process_set = ProcessSet.of_world(current_session)
