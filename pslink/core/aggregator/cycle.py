"""Cyclic execution at an Aggregator (AutoPS 3.3.1), pure and clock-driven.

pMaster gives each Aggregator its cycle ``C`` and, per task, how many times it runs in a cycle
(``floor(C / D_j)`` for its job) and what one run costs (``e_t``). Those are the task's slots: a
round that closes within its task's budget for the current cycle runs at once. A round beyond the
budget (its job runs faster than it was profiled, or came late) runs at once only if the rest of
the cycle still has room after reserving every slot still owed to the other tasks; otherwise it
waits for the next cycle, so that it never eats into the time the co-located jobs were promised.
"""

from __future__ import annotations

import math


class CycleBudget:
    """Per-cycle run budgets of the tasks on one Aggregator."""

    def __init__(self, cycle: float, budgets: dict[tuple, tuple[int, float]], start: float):
        if not cycle > 0:
            raise ValueError(f"a cycle must be positive, got {cycle}")
        self.cycle = cycle
        self.budgets = dict(budgets)  # task -> (runs per cycle, seconds per run)
        self.start = start
        self.index = 0  # the cycle `used` counts for
        self.used: dict[tuple, int] = {}
        self.ahead: dict[tuple, int] = {}  # runs already deferred into the next cycle
        self.deferred = 0  # rounds that had to wait for a later cycle (for status)

    def _roll(self, now: float) -> None:
        index = max(self.index, int(math.floor((now - self.start) / self.cycle)))
        if index != self.index:
            carried = self.ahead if index == self.index + 1 else {}
            self.index, self.used, self.ahead = index, dict(carried), {}

    def admit(self, task: tuple, now: float) -> float:
        """When ``task``'s next round may run: ``now``, or the start of a later cycle."""
        budget = self.budgets.get(task)
        if budget is None:
            return now  # not scheduled here (yet): nothing to protect it from
        self._roll(now)
        runs, cost = budget
        used = self.used.get(task, 0)
        if used < runs:
            self.used[task] = used + 1
            return now
        cycle_end = self.start + (self.index + 1) * self.cycle
        owed = sum(max(0, r - self.used.get(t, 0)) * c for t, (r, c) in self.budgets.items() if t != task)
        if cycle_end - now - owed >= cost:
            self.used[task] = used + 1  # an extra run that fits: take it
            return now
        self.deferred += 1
        self.ahead[task] = self.ahead.get(task, 0) + 1
        return cycle_end

    def describe(self) -> dict:
        return {"cycle": self.cycle, "tasks": len(self.budgets), "deferred": self.deferred,
                "work": sum(r * c for r, c in self.budgets.values())}
