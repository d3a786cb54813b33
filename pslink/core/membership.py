"""Who a job's rounds wait for.

This is the one place that answers "which workers must contribute to round r": the Aggregator's
round logic asks :meth:`Membership.expected` and nothing else. Membership is fixed at registration
for now; elastic jobs will change it between rounds through a new epoch.
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

    def expected(self, round_: int) -> frozenset[int]:
        """The ranks whose pushes close round ``round_``."""
        return self.ranks

    def __contains__(self, rank: int) -> bool:
        return rank in self.ranks

    def __len__(self) -> int:
        return len(self.ranks)

    def to_wire(self) -> dict:
        return {"ranks": sorted(self.ranks), "epoch": self.epoch}

    @classmethod
    def from_wire(cls, data: dict) -> "Membership":
        return cls(frozenset(int(r) for r in data["ranks"]), int(data.get("epoch", 0)))
