"""Horovod's process sets: collectives among some of the ranks, for every adapter that offers
Horovod's API (``pslink.torch``, ``pslink.mxnet.horovod``: each subclasses :class:`ProcessSet`
to find its current session, and makes :class:`ProcessSets` with its own Session class).

A process set is a job of its own on the service (as each ``torch.distributed`` group is: see
:mod:`pslink.torch.backend`): its ranks, renumbered from 0 in the order of their global ranks,
register ``<job>.ps<id>`` (its first rank creates it; the others learn its token from the first
through the job), so its keys and rounds count only its members.
As in Horovod, every rank calls ``add_process_set`` for every set, in the same order (that
order numbers the sets); a rank outside a set gets the set's object but cannot use it.
"""

from __future__ import annotations

from typing import Callable, Iterable

from pslink.core.worker.connect import connect
from pslink.errors import ConfigError


class ProcessSet:
    """Some ranks of the job (Horovod's ``ProcessSet``); ``ranks=None``: all of them (each
    adapter's ``global_process_set``). ``current()`` gives the adapter's session (subclasses)."""

    @staticmethod
    def current():
        raise ConfigError("this process set belongs to no adapter; use the adapter's ProcessSet")

    def __init__(self, ranks: Iterable[int] | None = None):
        self.ranks = None if ranks is None else sorted({_rank(r) for r in ranks})
        if self.ranks is not None and not self.ranks:
            raise ConfigError("a process set needs at least one rank")
        self.process_set_id: int | None = 0 if ranks is None else None
        self.session = None  # this rank's Session of the set's job, while it is added and includes this rank
        self._global = None  # the Session the set was added from

    def _world(self):
        return self._global or self.current()

    def included(self) -> bool:
        return self.ranks is None or self._world().rank in self.ranks

    def size(self) -> int:
        return self._world().size if self.ranks is None else len(self.ranks)

    def rank(self) -> int:
        """This rank's number in the set (-1 outside it)."""
        world = self._world()
        if self.ranks is None:
            return world.rank
        return self.ranks.index(world.rank) if world.rank in self.ranks else -1

    def __repr__(self) -> str:
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks if self.ranks else 'all'})"


class ProcessSets:
    """A Session's added process sets: ``kind`` is the adapter's ProcessSet class (a list of ranks
    given to ``add`` becomes one), ``make_session(agent)`` the adapter's Session over a set's job."""

    def __init__(self, kind: type[ProcessSet], make_session: Callable):
        self.kind, self.make_session = kind, make_session
        self.added: dict[int, ProcessSet] = {}
        self.next_id = 1

    def add(self, world, process_set) -> ProcessSet:
        if not isinstance(process_set, ProcessSet):
            process_set = self.kind(process_set)
        if process_set.process_set_id is not None:
            raise ConfigError(f"{process_set!r} is added already")
        if process_set.ranks[-1] >= world.size:
            raise ConfigError(f"process set ranks {process_set.ranks} name ranks beyond the job's {world.size}")
        same = [s for s in self.added.values() if s.ranks == process_set.ranks]
        if same:
            raise ConfigError(f"a process set of ranks {process_set.ranks} exists already ({same[0]!r})")
        process_set.process_set_id, self.next_id = self.next_id, self.next_id + 1
        process_set._global = world
        # The set's first rank creates its job (a job is created by a worker that joins it
        # without a token); the job's token reaches the other members through the world.
        agent, leader = world.agent, process_set.ranks[0]
        job, members = f"{agent.job}.ps{process_set.process_set_id}", len(process_set.ranks)
        options = dict(mode="sum", timeout=agent.timeout, transports=agent.transports)
        sub = None
        if world.rank == leader:
            sub = connect(job, 0, members, agent.master_address, **options)
        token = world.broadcast_object(sub.token if sub is not None else None, leader, f"{job}.token")
        if world.rank in process_set.ranks and sub is None:
            sub = connect(job, process_set.ranks.index(world.rank), members, agent.master_address,
                                 token=token, **options)
        if sub is not None:
            process_set.session = self.make_session(sub)
        self.added[process_set.process_set_id] = process_set
        return process_set

    def remove(self, process_set: ProcessSet) -> bool:
        if process_set.ranks is None or process_set.process_set_id not in self.added:
            return False
        del self.added[process_set.process_set_id]
        if process_set.session is not None:
            process_set.session.close()
            process_set.session = None
        process_set.process_set_id = None
        return True

    def session_for(self, world, process_set):
        """The Session a collective of ``process_set`` runs on (the world's for the global set)."""
        if process_set is None or isinstance(process_set, ProcessSet) and process_set.ranks is None:
            return world
        if not isinstance(process_set, self.kind):
            raise ConfigError(f"process_set must be a ProcessSet, got {process_set!r}")
        if process_set.process_set_id not in self.added or self.added[process_set.process_set_id] is not process_set:
            raise ConfigError(f"{process_set!r} is not added (add_process_set) or was removed")
        if process_set.session is None:
            raise ConfigError(f"rank {world.rank} is not in {process_set!r}; only its ranks call its collectives")
        return process_set.session

    def close(self) -> None:
        for process_set in list(self.added.values()):
            self.remove(process_set)


def _rank(value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"a process set's ranks are ints >= 0, got {value!r}")
    return value
