"""The network side of placement (issue 29): which host each Aggregator runs on, and how much of
each host's NIC its tasks use. Pure, no I/O.

A task's ``rate`` is the bytes a second its Aggregator receives (and, as much again, sends: a NIC
carries both directions at full speed) while its job runs at its standalone speed: the job's
workers each push the task's bytes once an iteration. Placement keeps every host's load at or
below its NIC's ``bandwidth`` (bytes a second, each direction): a task goes only where its host
has room. An Aggregator whose host is not known yet (one being started) has room: whoever
starts it picks a host with room for what it holds. Without a bandwidth (the default of a live
pMaster, which does not know its NICs) nothing here constrains placement.
"""

from __future__ import annotations

import numpy as np

UNKNOWN = -1


class Nics:
    """Hosts' NICs and the load placement put on them, shared by every cluster's plan."""

    def __init__(self, bandwidth: float | None = None):
        if bandwidth is not None and not bandwidth > 0:
            raise ValueError(f"NIC bandwidth must be > 0 bytes/s, got {bandwidth}")
        self.bandwidth = bandwidth
        self.index: dict[str, int] = {}  # host -> its slot in ``load``
        self.hosts: list[str] = []
        self.load = np.zeros(0)  # bytes/s placed on each host's NIC

    @property
    def limited(self) -> bool:
        return self.bandwidth is not None

    def host_index(self, host: str) -> int:
        index = self.index.get(host)
        if index is None:
            index = self.index[host] = len(self.hosts)
            self.hosts.append(host)
            self.load = np.append(self.load, 0.0)
        return index

    def add(self, host: int, rate: float) -> None:
        if host != UNKNOWN and rate:
            self.load[host] += rate

    def free(self) -> np.ndarray:
        """Room left on each host's NIC (bytes/s); infinite without a bandwidth."""
        if self.bandwidth is None:
            return np.full(len(self.hosts), np.inf)
        return self.bandwidth - self.load

    def load_of(self, host: str) -> float:
        index = self.index.get(host)
        return float(self.load[index]) if index is not None else 0.0
