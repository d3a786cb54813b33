"""Which group a worker of a job with delayed global sync (:mod:`pslink.core.worker.groups`) should
train in: dSyncPS's load balancing (``../shared/papers/003``, 3.2.4), done by the workers. A
worker scores each group by the product of its *load* and the *RTT* to the group's service,
and moves when another group's score is ``margin`` (20%) below its own group's: the margin keeps
workers from hopping back and forth on the noise of both measures.

Load here is the group's number of workers, counting the worker who asks (its own group's as it
is, another's with one more): each of a group's BSP rounds waits for all of them, and the
group's Aggregators do work per worker. (dSyncPS uses the servers' load average; on a shared
pool every group's Aggregators are the same processes, so only the member count tells the
groups apart.) The RTT is measured to each group's service, once per distinct address: groups
of one service share it, and RTTs below ``rtt_floor`` count as equal (a LAN's microseconds are
noise, not distance).

:class:`GroupChoice` is the rule, pure; :func:`probe_rtt` measures."""

from __future__ import annotations

import statistics
import time
from typing import Mapping

from pslink.errors import ConfigError

MARGIN = 0.2  # dSyncPS: move when another group's load x RTT is 20% lower
RTT_FLOOR = 0.001  # seconds: below it RTTs are alike


class GroupChoice:
    """The load x RTT rule. ``margin``: how much lower (a fraction) another group's score must
    be to move there; ``rtt_floor``: the smallest RTT counted (seconds)."""

    def __init__(self, margin: float = MARGIN, rtt_floor: float = RTT_FLOOR):
        if not 0.0 <= margin < 1.0:
            raise ConfigError(f"group choice: margin {margin!r} must be a fraction in [0, 1), e.g. 0.2 for 20%")
        if rtt_floor < 0:
            raise ConfigError(f"group choice: rtt_floor {rtt_floor!r} must be >= 0 seconds")
        self.margin, self.rtt_floor = margin, rtt_floor

    def scores(self, current: int, sizes: Mapping[int, int], rtts: Mapping[int, float]) -> dict[int, float]:
        """Each group's load x RTT were this worker in it: ``sizes`` are the groups' workers now
        (this worker counted in ``current``); groups with no workers (no leader) are not scored."""
        scores = {}
        for group, size in sizes.items():
            if size <= 0 or group not in rtts:
                continue
            load = size if group == current else size + 1
            scores[group] = load * max(rtts[group], self.rtt_floor)
        return scores

    def better(self, current: int, sizes: Mapping[int, int], rtts: Mapping[int, float]) -> int | None:
        """The group to move to, or None to stay: the best-scoring other group, if its score is at
        least ``margin`` below the current group's (ties: the lowest index)."""
        scores = self.scores(current, sizes, rtts)
        if current not in scores:
            return None
        others = sorted((score, group) for group, score in scores.items() if group != current)
        if not others:
            return None
        score, group = others[0]
        return group if score < (1.0 - self.margin) * scores[current] else None


def probe_rtt(address: str, count: int = 5, timeout: float = 5.0, transports=None) -> float:
    """The median round trip of ``count`` PINGs to the pMaster at ``address`` (seconds), over
    one connection made for it (its set-up is not counted)."""
    from pslink.core.service.client import ControlClient
    from pslink.core.wire.protocol import Op

    client = ControlClient(address, timeout=timeout, transports=transports)
    try:
        client.call(Op.PING)  # the first one also waits for the connection: not a round trip
        times = []
        for _ in range(count):
            started = time.perf_counter()
            client.call(Op.PING)
            times.append(time.perf_counter() - started)
    finally:
        client.close()
    return statistics.median(times)
