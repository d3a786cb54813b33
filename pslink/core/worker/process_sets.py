"""Horovod's process sets: collectives among some of the ranks, for every adapter.

A process set is a job of its own on the service (as each ``torch.distributed`` group is): its
ranks, renumbered from 0 in the order of their global ranks, register ``<job>.ps<id>`` (its
first rank creates it; the others learn its token from the first through the world), so its
keys, rounds and board count only its members. As in Horovod, every rank calls
``add_process_set`` for every set, in the same order (that order numbers the sets); a rank
outside a set gets the set's object but cannot use it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from pslink.core.worker.connect import connect
from pslink.errors import ConfigError


class ProcessSet:
    """Some ranks of the job (Horovod's ``ProcessSet``); ``ranks=None``: all of them. An
    adapter's ``global_process_set`` is :meth:`of_world` of its current session."""

    def __init__(self, ranks: Iterable[int] | None = None):
        self.ranks = None if ranks is None else sorted({_rank(r) for r in ranks})
        if self.ranks is not None and not self.ranks:
            raise ConfigError("a process set needs at least one rank")
        self.process_set_id: int | None = 0 if ranks is None else None
        self.session: Any = None  # this rank's Session of the set's job, while it is added and includes this rank
        self._world: Any = None  # the Session the set was added from
        self._current: Callable[[], Any] | None = None  # the adapter's current session (the global set)

    @classmethod
    def of_world(cls, current: Callable[[], Any]) -> "ProcessSet":
        """Every rank of whatever session ``current()`` gives (an adapter's global process set)."""
        process_set = cls()
        process_set._current = current
        return process_set

    def _session_world(self):
        if self._world is not None:
            return self._world
        if self._current is not None:
            return self._current()
        raise ConfigError(f"{self!r} is not added: call add_process_set first")

    def included(self) -> bool:
        return self.ranks is None or self._session_world().rank in self.ranks

    def size(self) -> int:
        return self._session_world().size if self.ranks is None else len(self.ranks)

    def rank(self) -> int:
        """This rank's number in the set (-1 outside it)."""
        world = self._session_world()
        if self.ranks is None:
            return world.rank
        return self.ranks.index(world.rank) if world.rank in self.ranks else -1

    def __repr__(self) -> str:
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks if self.ranks else 'all'})"


class ProcessSets:
    """The process sets added from one Session (``world``); a set's Session is of the world's
    class, over the set's own job."""

    def __init__(self, world):
        self.world = world
        self.added: dict[int, ProcessSet] = {}
        self.next_id = 1

    def add(self, process_set) -> ProcessSet:
        world = self.world
        if not isinstance(process_set, ProcessSet):
            process_set = ProcessSet(process_set)
        if process_set.process_set_id is not None:
            raise ConfigError(f"{process_set!r} is added already")
        if process_set.ranks[-1] >= world.size:
            raise ConfigError(f"process set ranks {process_set.ranks} name ranks beyond the job's {world.size}")
        same = [s for s in self.added.values() if s.ranks == process_set.ranks]
        if same:
            raise ConfigError(f"a process set of ranks {process_set.ranks} exists already ({same[0]!r})")
        set_id, self.next_id = self.next_id, self.next_id + 1
        # The set's first rank creates its job (a job is created by a worker that joins it
        # without a token); the job's token reaches the other members through the world.
        agent, leader = world.agent, process_set.ranks[0]
        job, members = f"{agent.job}.ps{set_id}", len(process_set.ranks)
        options = dict(mode="sum", timeout=agent.timeout, transports=agent.transports)
        sub = None
        if world.rank == leader:
            sub = connect(job, 0, members, agent.master_address, **options)
        token = world.broadcast_object(sub.token if sub is not None else None, leader, f"{job}.token")
        if world.rank in process_set.ranks and sub is None:
            sub = connect(job, process_set.ranks.index(world.rank), members, agent.master_address, token=token,
                          **options)
        process_set.process_set_id = set_id
        process_set._world = world
        if sub is not None:
            process_set.session = type(world)(sub, set_ranks=process_set.ranks)
        self.added[set_id] = process_set
        return process_set

    def remove(self, process_set: ProcessSet) -> bool:
        if process_set.ranks is None or process_set.process_set_id not in self.added:
            return False
        del self.added[process_set.process_set_id]
        if process_set.session is not None:
            process_set.session.close()
            process_set.session = None
        process_set.process_set_id = None
        process_set._world = None
        return True

    def session_for(self, process_set):
        """The Session a collective of ``process_set`` runs on (the world's for None or a global set)."""
        if process_set is None or isinstance(process_set, ProcessSet) and process_set.ranks is None:
            return self.world
        if not isinstance(process_set, ProcessSet):
            raise ConfigError(f"process_set must be a ProcessSet, got {process_set!r}")
        if self.added.get(process_set.process_set_id) is not process_set:
            raise ConfigError(f"{process_set!r} is not added (add_process_set) or was removed")
        if process_set.session is None:
            raise ConfigError(f"rank {self.world.rank} is not in {process_set!r}; only its ranks call its collectives")
        return process_set.session

    def close(self) -> None:
        for process_set in list(self.added.values()):
            self.remove(process_set)


def _rank(value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"a process set's ranks are ints >= 0, got {value!r}")
    return value
