"""Horovod's process sets for ``pslink.tf`` (:mod:`pslink.core.worker.process_sets`, as ``pslink.torch``
and ``pslink.mxnet.horovod`` have them): a set is a job of its own on the service, with an
:class:`~pslink.tf.exchange.Exchange` of its own; ``process_set=`` on a collective runs it there.

::

    evens = hvd.add_process_set([0, 2])          # every worker adds every set, in the same order
    if evens.included():
        total = hvd.allreduce(x, op=hvd.Sum, process_set=evens)
"""

from __future__ import annotations

from pslink.core.worker import process_sets
from pslink.tf import context
from pslink.tf.exchange import Exchange


class _World:
    """An Exchange as :mod:`pslink.core.worker.process_sets` sees a session."""

    def __init__(self, exchange: Exchange):
        self.exchange, self.agent = exchange, exchange.agent
        self.rank, self.size = exchange.rank, exchange.num_workers

    def broadcast_object(self, obj, root: int, name: str):
        return self.exchange.broadcast_object(obj, root, f"tf/{name}", what=f"add_process_set ({name})")

    def close(self) -> None:
        self.agent.close()


class ProcessSet(process_sets.ProcessSet):
    __doc__ = process_sets.ProcessSet.__doc__

    @staticmethod
    def current():
        return _World(context.exchange())


global_process_set = ProcessSet()


def _sets(exchange: Exchange) -> process_sets.ProcessSets:
    if exchange.process_sets is None:  # this worker's added sets live with its Exchange
        exchange.process_sets = process_sets.ProcessSets(ProcessSet, lambda agent: _World(Exchange(agent)))
    return exchange.process_sets


def add_process_set(process_set) -> ProcessSet:
    """Add a set of workers (a ProcessSet or a list of ranks); every worker adds every set, in the
    same order. Its collectives (``process_set=``) count only its workers."""
    exchange = context.exchange()
    return _sets(exchange).add(_World(exchange), process_set)


def remove_process_set(process_set: ProcessSet) -> bool:
    return _sets(context.exchange()).remove(process_set)


def exchange_of(process_set) -> Exchange:
    """The Exchange a collective of ``process_set`` runs on (the process's for None or the global set)."""
    exchange = context.exchange()
    if process_set is None:  # the common case: nothing to look up
        return exchange
    return _sets(exchange).session_for(_World(exchange), process_set).exchange
