"""Who a job's rounds wait for, and how that changes while the job runs.

Two levels, both answered here and nowhere else:

- :class:`Membership` is the job's: the ranks pMaster counts as members now, numbered by an
  epoch that grows with every change. A worker that leaves (cleanly, or silent past the
  heartbeat timeout) is removed at once; a worker that registers while the job runs is added.
- :class:`TaskMembers` is one task's: for every member, the first round of *this task* it
  contributes to. Members at the time a task is created contribute from round 1. A member added
  later contributes from the round it *joined* the task at (the Agent's JOIN: the first round
  no worker has started, so the rounds already under way close without it). A removed member's
  pushes already in a round stay in it; the open rounds stop waiting for it.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Membership:
    ranks: frozenset[int]
    epoch: int = 0

    @classmethod
    def fixed(cls, num_workers: int) -> "Membership":
        if num_workers < 1:
            raise ValueError(f"a job needs at least one worker, got {num_workers}")
        return cls(frozenset(range(num_workers)))

    def without(self, rank: int) -> "Membership":
        return Membership(self.ranks - {rank}, self.epoch + 1)

    def with_rank(self, rank: int) -> "Membership":
        return Membership(self.ranks | {rank}, self.epoch + 1)

    @property
    def leader(self) -> int | None:
        """The rank that plays rank 0 (whose init value wins): the lowest member."""
        return min(self.ranks) if self.ranks else None

    def __contains__(self, rank: int) -> bool:
        return rank in self.ranks

    def __len__(self) -> int:
        return len(self.ranks)

    def to_wire(self) -> dict:
        return {"ranks": sorted(self.ranks), "epoch": self.epoch}

    @classmethod
    def from_wire(cls, data: dict) -> "Membership":
        return cls(frozenset(int(r) for r in data["ranks"]), int(data.get("epoch", 0)))


class TaskMembers:
    """The ranks one task's rounds wait for: rank -> first round it contributes to."""

    __slots__ = ("first", "_all", "_latest_start")

    def __init__(self, ranks, first_round: int = 1):
        self.first: dict[int, int] = {int(r): first_round for r in ranks}
        self._refresh()

    def _refresh(self) -> None:
        self._all = frozenset(self.first)
        self._latest_start = max(self.first.values(), default=0)

    def expected(self, round_: int) -> frozenset[int]:
        """The ranks whose pushes close round ``round_``."""
        if round_ >= self._latest_start:
            return self._all  # the usual case: every member is in
        return frozenset(r for r, first in self.first.items() if first <= round_)

    def __contains__(self, rank: int) -> bool:
        return rank in self.first

    def join(self, rank: int, first_round: int) -> None:
        self.first[rank] = first_round
        self._refresh()

    def keep_only(self, ranks) -> list[int]:
        """Drop every rank not in ``ranks`` (they left the job); returns those dropped."""
        gone = [r for r in self.first if r not in ranks]
        for rank in gone:
            del self.first[rank]
        if gone:
            self._refresh()
        return gone

    def to_wire(self) -> list:
        return sorted([r, f] for r, f in self.first.items())

    @classmethod
    def from_wire(cls, pairs) -> "TaskMembers":
        members = cls(())
        members.first = {int(r): int(f) for r, f in pairs}
        members._refresh()
        return members
