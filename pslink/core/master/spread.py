"""Spreading a job over the pool's hosts (pure): no single NIC should carry a whole job.

The control plane uses these where the pool spans several hosts; on one host (or with no hosts
known, as in the simulator) they change nothing.
"""

from __future__ import annotations

import collections
import itertools
from typing import Iterable, Mapping

from pslink.core.master.nics import UNKNOWN
from pslink.core.master.packing import Placement, TaskDemand


def across_hosts(names: list[str], host_of: Mapping[str, str]) -> list[str]:
    """``names`` reordered to take one per host in turn (a job's profiling Aggregators then
    span its hosts' NICs); kept as they are on one host."""
    by_host: dict[str, list[str]] = {}
    for name in names:
        by_host.setdefault(host_of.get(name, ""), []).append(name)
    if len(by_host) < 2:
        return names
    columns = list(by_host.values())
    return [n for row in itertools.zip_longest(*columns) for n in row if n is not None]


def one_per_nic(names: list[str], plan: Placement) -> list[str]:
    """``names`` keeping the first on each host's NIC (one whose host is not known yet counts as a
    NIC of its own): a job being profiled sends what no one knows yet, even to itself."""
    first_on_nic: dict = {}
    for name in names:
        nic = plan.nic_of(name)
        first_on_nic.setdefault(name if nic == UNKNOWN else nic, name)
    return list(first_on_nic.values())


def bytes_by_host(parts: Mapping[tuple, int], plans: Iterable[Placement], host_of: Mapping[str, str]) -> collections.Counter:
    """Bytes of the parts (task -> bytes) placed so far on each host."""
    plans = list(plans)
    count: collections.Counter = collections.Counter()
    for ident, nbytes in parts.items():
        for plan in plans:
            name = plan.where.get(ident)
            if name is not None:
                count[host_of.get(name, "")] += nbytes
                break
    return count


def one_host(names, host_of: Mapping[str, str]) -> bool:
    """The Aggregators ``names`` all run on one host (or none is known): nothing to spread over."""
    return len({host_of.get(n, "") for n in names}) < 2


def choose(plan: Placement, demand: TaskDemand, candidates: list[str], host_of: Mapping[str, str],
           on_host: collections.Counter) -> str | None:
    """Where Pseudocode 1 puts ``demand`` when hosts are tried in order of the job's bytes on
    them (``on_host``): the best fit on the first host that has a qualified Aggregator (it is
    assigned there), or None on one host or when no host qualifies (the caller places it as
    without hosts)."""
    if one_host(candidates, host_of):
        return None
    by_host: dict[str, list[str]] = {}
    for name in candidates:
        by_host.setdefault(host_of.get(name, ""), []).append(name)
    for host in sorted(by_host, key=lambda h: (on_host[h], h)):
        target = plan.choose(demand, by_host[host])
        if target is not None:
            plan.assign(demand, target)
            return target
    return None
