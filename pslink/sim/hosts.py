"""Hosts and their NICs in the simulator (issue 29): where Aggregators run, and what the network
does to the jobs they serve.

Aggregators run on hosts of ``cpus`` CPUs each with a NIC of ``bandwidth`` bytes/s each way. The
simulator plays the provider: a new Aggregator goes to the first host with a free CPU and room on
its NIC for what placement already put on it (its tasks' rates, as the control plane computes them),
else to a new host. Placement keeps every NIC within its bandwidth for the rates it knows
(:mod:`pslink.core.master.nics`); this module measures the **real** load: every task's bytes at
its job's own iteration (a job being profiled too, whose rates placement does not know yet), and
a host whose NIC carries more than its bandwidth slows every job it serves by the excess, which
counts against their SLOs like any other slowdown. Pure, no I/O.
"""

from __future__ import annotations

import collections


class HostPool:
    """Hosts, the Aggregators on them and the real load on their NICs."""

    def __init__(self, cpus: int, bandwidth: float):
        if cpus < 1 or not bandwidth > 0:
            raise ValueError(f"hosts need >= 1 CPU and a NIC bandwidth > 0, got {cpus} and {bandwidth}")
        self.cpus = cpus
        self.bandwidth = bandwidth
        self.host_of: dict[str, str] = {}  # Aggregator -> host
        self.on_host: dict[str, set[str]] = collections.defaultdict(set)  # host -> Aggregators
        self.rate: dict[str, float] = {}  # Aggregator -> real bytes/s it receives
        self.load: collections.Counter = collections.Counter()  # host -> real bytes/s
        self.peak_hosts = 0
        self.peak_load = 0.0  # the highest real load of any NIC after an event, as a share of its bandwidth
        self._touched: set[str] = set()  # hosts whose load changed during the event under way
        self._serial = 0

    def place(self, name: str, planned: float, nic_load) -> str:
        """The host a new Aggregator starts on: the first with a free CPU and room on its NIC for
        ``planned`` bytes/s (what placement put on it); ``nic_load(host)`` is placement's own
        count of the host's load."""
        for host in sorted(self.on_host, key=_host_order):
            if len(self.on_host[host]) < self.cpus and nic_load(host) + planned <= self.bandwidth:
                break
        else:
            self._serial += 1
            host = f"host-{self._serial}"
        self.host_of[name] = host
        self.on_host[host].add(name)
        self.load[host] += self.rate.get(name, 0.0)
        self.peak_hosts = max(self.peak_hosts, sum(1 for names in self.on_host.values() if names))
        return host

    def release(self, name: str) -> set[str]:
        """``name`` is gone; returns the Aggregators whose slowdown may have changed."""
        host = self.host_of.pop(name, None)
        if host is None:
            return set()
        self.on_host[host].discard(name)
        if not self.on_host[host]:
            del self.on_host[host]
        return self._set(name, host, 0.0)

    def measured(self, name: str, rate: float) -> set[str]:
        """``name`` now receives ``rate`` bytes/s; returns the Aggregators whose slowdown may have
        changed (those of its host, when its NIC is or was over its bandwidth)."""
        host = self.host_of.get(name)
        if host is None:
            self.rate[name] = rate  # not started: counted once it is placed
            return set()
        return self._set(name, host, rate)

    def _set(self, name: str, host: str, rate: float) -> set[str]:
        before = self.load[host]
        self.load[host] += rate - self.rate.get(name, 0.0)
        if rate:
            self.rate[name] = rate
        else:
            self.rate.pop(name, None)
        after = self.load[host]
        self._touched.add(host)
        if max(before, after) > self.bandwidth * (1 + 1e-9):
            return set(self.on_host.get(host, ())) | {name}
        return set()

    def settle(self) -> None:
        """An event is over: the loads of the hosts it touched count for the peak. (Within an
        event an Aggregator's new tasks may be counted before the old ones of its neighbour
        left: no NIC ever carries that.)"""
        for host in self._touched:
            self.peak_load = max(self.peak_load, self.load.get(host, 0.0) / self.bandwidth)
        self._touched.clear()

    def factor(self, name: str) -> float:
        """How many times longer the jobs on ``name`` take for its NIC (1: it keeps up)."""
        host = self.host_of.get(name)
        if host is None:
            return 1.0
        return max(1.0, self.load[host] / self.bandwidth)


def _host_order(host: str) -> int:
    return int(host.rsplit("-", 1)[1])
