"""The stall inspector (no I/O): rounds that have waited longer than a threshold, and the ranks
they still wait for.

"Which rank is stuck" is the question Horovod and BytePS users ask most (horovod#100, #534,
#2672; byteps#37, #419). An Aggregator knows the answer for its own tasks: a round that some
ranks pushed and others did not. The process shell scans every ``period`` seconds, logs each
stalled round once, and reports the current ones to pMaster with its heartbeat
(``pslink service status`` lists them, ``/metrics`` counts them).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Iterable

from pslink.core.aggregator.tasks import Task
from pslink.errors import ConfigError

DEFAULT_STALL_SECONDS = 10.0  # as the Agents' peer timeout: longer than any healthy step we measured
ENV_STALL_SECONDS = "PSLINK_STALL_SECONDS"
MAX_REPORTED = 32  # stalled rounds sent to pMaster per heartbeat (the oldest first); the count is exact


def stall_threshold(value: float | None, environ=os.environ) -> float:
    """The threshold: the argument, else $PSLINK_STALL_SECONDS, else the default; 0 turns it off."""
    source = "stall_seconds"
    if value is None:
        raw = environ.get(ENV_STALL_SECONDS)
        if not raw:
            return DEFAULT_STALL_SECONDS
        source = f"{ENV_STALL_SECONDS}={raw!r}"
        try:
            value = float(raw)
        except ValueError:
            raise ConfigError(f"{source} is not a number of seconds") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise ConfigError(f"{source} must be a number of seconds >= 0 (0: no stall inspector), got {value!r}")
    return float(value)


@dataclasses.dataclass(frozen=True, slots=True)
class Stall:
    job: str
    key: object
    part: int
    round: int
    waiting: tuple[int, ...]  # ranks the round still waits for
    pushed: tuple[int, ...]
    since: float  # when its first push arrived

    def to_wire(self, now: float) -> dict:
        return {"job": self.job, "key": self.key, "part": self.part, "round": self.round,
                "waiting": list(self.waiting), "pushed": list(self.pushed), "seconds": round(now - self.since, 1)}

    def describe(self, now: float) -> str:
        part = f" part {self.part}" if self.part else ""
        return (f"job {self.job!r} key {self.key!r}{part} round {self.round} has waited {now - self.since:.1f} s "
                f"for rank(s) {list(self.waiting)} (pushed: {list(self.pushed)})")


def waiting_for(task: Task, round_no: int) -> dict:
    """Who round ``round_no`` of ``task`` has and still waits for (0: the oldest open round)."""
    if round_no <= 0:
        open_rounds = [r for r in task.rounds if r > task.closed]
        round_no = min(open_rounds) if open_rounds else task.closed + 1
    expected = task.members.expected(round_no)
    round_ = task.rounds.get(round_no)
    pushed = round_.contributors if round_ is not None and round_no > task.closed else set()
    waiting = set() if round_no <= task.closed else set(expected) - pushed
    return {"round": round_no, "closed": task.closed, "pushed": sorted(pushed), "waiting": sorted(waiting)}


class StallInspector:
    """Finds rounds open longer than ``threshold`` seconds; each is new once (logged once) and
    counted per job in ``counts``."""

    def __init__(self, threshold: float = DEFAULT_STALL_SECONDS):
        self.threshold = threshold
        self.current: list[Stall] = []
        self.counts: dict[str, int] = {}  # job -> stalled rounds seen (each once)
        self._seen: set[tuple] = set()

    @property
    def period(self) -> float:
        """Seconds between scans: a stall is seen within threshold + period."""
        return min(1.0, self.threshold / 2)

    def scan(self, tasks: Iterable[Task], now: float) -> list[Stall]:
        """The rounds stalled now; returns those stalled for the first time."""
        current, new, seen = [], [], set()
        for task in tasks:
            if task.job.sync == "asp" or task.poisoned is not None or task.moved_to is not None or task.incoming:
                continue
            for r, round_ in task.rounds.items():
                if r <= task.closed or not round_.contributors or now - round_.opened < self.threshold:
                    continue
                waiting = task.members.expected(r) - round_.contributors
                if not waiting:
                    continue  # complete: it waits for its slot in the cycle or for replicas, not for ranks
                stall = Stall(task.job.job, task.key, task.part, r, tuple(sorted(waiting)),
                              tuple(sorted(round_.contributors)), round_.opened)
                ident = (stall.job, stall.key, stall.part, stall.round)
                seen.add(ident)
                current.append(stall)
                if ident not in self._seen:
                    new.append(stall)
                    self.counts[stall.job] = self.counts.get(stall.job, 0) + 1
        self._seen = seen
        current.sort(key=lambda s: s.since)
        self.current = current
        return new

    def report(self, now: float) -> list[dict]:
        return [s.to_wire(now) for s in self.current[:MAX_REPORTED]]
