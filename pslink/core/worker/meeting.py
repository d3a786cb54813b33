"""Where the groups of a job with delayed global sync (:mod:`pslink.core.worker.groups`) average their
weights: through the pool (:class:`PoolMeeting`: a job of the groups' leaders) or through shared
storage (:class:`StoreMeeting`: a directory or any fsspec URL, as dSyncPS syncs through a
distributed store). Both answer the same three questions: which groups are there, did this one
come while others were under way, and what is the average of the groups' weights at a sync."""

from __future__ import annotations

import io
import logging
import time
import urllib.parse

import numpy as np

from pslink.errors import ConfigError

log = logging.getLogger("pslink.core.worker.groups")
POLL = 0.01  # how often a store is looked at while a sync waits for the other groups' files
_SIZES = "__dsync/sizes"  # the groups' workers, one slot per group (moving between groups: group_choice)


class PoolMeeting:
    """The groups' leaders as the members of a job ``<job>.global`` (ranks: group indices,
    elastic up to ``max_groups``; the first ``groups`` start it); a sync is an averaging pushpull
    of the weights' keys, a BSP round of that job."""

    def __init__(self, agent, job: str, group: int, groups: int, max_groups: int, master: str | None,
                 timeout: float | None):
        from pslink.core.agent.agent import Agent  # the core's own: no adapter in between

        self.timeout, self.group, self.max_groups = timeout, group, max_groups
        self.world = Agent(f"{job}.global", group, groups, master or agent.master_address, max_workers=max_groups,
                           timeout=agent.timeout, transports=agent.transports)
        self.late = self.world.late
        self._declared = False
        if self.late:
            # Others are under way (dSyncPS's Bonjour): come into the weights' keys now, so that
            # their next sync waits for this group.
            self.world.join_all(timeout)

    def members(self) -> list[int]:
        return self.world.membership()["ranks"]

    def average(self, names: list[str], arrays: list[np.ndarray], size: int) -> dict[int, int]:
        """The groups' average into ``arrays``; ``size``: this group's workers. Returns every
        group's (a sum of one-hot vectors, in flight with the average: no round trip more)."""
        sizes = np.zeros(self.max_groups, np.float32)
        if not self._declared:
            self.world.init_many(names + [_SIZES], arrays + [sizes]).wait(self.timeout)
            self._declared = True
        sizes[self.group] = size
        averaged = self.world.pushpull_many(names, arrays, arrays, average=True)
        self.world.pushpull(_SIZES, sizes, sizes).wait(self.timeout)
        averaged.wait(self.timeout)
        return {group: int(n) for group, n in enumerate(sizes) if n > 0}

    def close(self) -> None:
        self.world.close()


class StoreMeeting:
    """The groups meet in ``url`` (a directory or an fsspec URL)::

        <url>/<job>/members/g<group>          one per group there (its Bonjour; gone when it leaves)
        <url>/<job>/sync-<i>/g<group>.npz     its weights at the i-th sync

    At a sync a leader writes its file, waits until every group listed in ``members`` (and each of
    the first ``groups``) wrote its own (one that leaves meanwhile is not waited for; one silent
    past ``timeout`` is left out, with a warning) and averages them in group order. A group that comes while others are
    under way takes the next sync's number from what it finds. Each leader removes its own file of
    two syncs back (every group has read it: they all wrote the sync after it)."""

    def __init__(self, url: str, job: str, group: int, groups: int, timeout: float | None):
        try:
            import fsspec
        except ImportError:
            raise ConfigError(f"store {url!r} needs fsspec (pip install fsspec)") from None
        try:
            self.fs, root = fsspec.core.url_to_fs(url)
        except (ValueError, ImportError) as exc:
            raise ConfigError(f"store {url!r}: fsspec cannot use it ({exc})") from None
        self.group, self.founders = group, range(groups)  # the groups that start the job: always waited for
        self.timeout = timeout if timeout is not None else 300.0
        self.base = "/".join([root.rstrip("/"), urllib.parse.quote(job, safe="")])
        self.fs.makedirs(f"{self.base}/members", exist_ok=True)
        done = self._syncs()
        # Late: others are under way without this group. A founding group is awaited at the first
        # sync, whose folder may exist already (a founder quicker to its first sync waits for it
        # there: found by the suite on a loaded machine); it is late only once a later one exists.
        self.late = bool(set(done) - {1}) if group in self.founders else bool(done)
        self.index = max(done) if self.late else 0  # the syncs this group has done, as the job numbers them
        self.written: list[str] = []  # this group's files of the last syncs
        self.seen: set[int] = set()  # groups ever listed as members
        self.fs.pipe(f"{self.base}/members/g{group}", str(time.time()).encode())

    def _syncs(self) -> list[int]:
        names = [p.rstrip("/").rsplit("/", 1)[-1] for p in self.fs.ls(self.base, detail=False)]
        return [int(n[5:]) for n in names if n.startswith("sync-") and n[5:].isdigit()]

    def members(self) -> list[int]:
        names = [p.rstrip("/").rsplit("/", 1)[-1] for p in self.fs.ls(f"{self.base}/members", detail=False)]
        return sorted(int(n[1:]) for n in names if n.startswith("g") and n[1:].isdigit())

    def average(self, names: list[str], arrays: list[np.ndarray], size: int) -> dict[int, int]:
        """As :meth:`PoolMeeting.average`: each file carries its group's size too."""
        self.index += 1
        folder = f"{self.base}/sync-{self.index:08d}"
        buffer = io.BytesIO()
        np.savez(buffer, size=np.int64(size), **{f"a{i}": a for i, a in enumerate(arrays)})
        self.fs.makedirs(folder, exist_ok=True)
        self.fs.pipe(f"{folder}/g{self.group}.tmp", buffer.getvalue())
        self.fs.mv(f"{folder}/g{self.group}.tmp", f"{folder}/g{self.group}.npz")  # whole or not at all
        found = self._wait(folder)
        total = [np.zeros_like(a) for a in arrays]
        sizes = {}
        for group in sorted(found):  # in group order: the same sum on every group
            with np.load(io.BytesIO(self.fs.cat(f"{folder}/g{group}.npz")), allow_pickle=False) as data:
                for i, t in enumerate(total):
                    t += data[f"a{i}"]
                sizes[group] = int(data["size"])
        for array, t in zip(arrays, total):
            np.divide(t, len(found), out=array, casting="unsafe")
        self.written.append(f"{folder}/g{self.group}.npz")
        if len(self.written) > 2:
            self.fs.rm(self.written.pop(0))
        return sizes

    def _wait(self, folder: str) -> set[int]:
        deadline = time.monotonic() + self.timeout
        while True:
            names = [p.rstrip("/").rsplit("/", 1)[-1] for p in self.fs.ls(folder, detail=False)]
            found = {int(n[1:-4]) for n in names if n.startswith("g") and n.endswith(".npz") and n[1:-4].isdigit()}
            members = set(self.members())
            self.seen |= members
            waiting = (members | (set(self.founders) - self.seen)) - found  # a founder that left is not awaited
            if not waiting:
                return found
            if time.monotonic() > deadline:
                log.warning("group %d: sync %d goes on without group(s) %s (nothing from them in %g s)", self.group,
                            self.index, sorted(waiting), self.timeout)
                return found
            time.sleep(POLL)  # a store has no way to wait for a file: looked at again, until the deadline

    def close(self) -> None:
        try:
            self.fs.rm(f"{self.base}/members/g{self.group}")
        except FileNotFoundError:
            pass

