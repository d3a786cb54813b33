"""Where a model aggregation task goes: pure functions, no I/O.

:func:`least_loaded` is the placeholder policy (the Aggregator holding the fewest bytes). The
AutoPS heuristic (Pseudocode 1 with cyclic execution) replaces it behind the same signature, and
the simulator imports the very same function.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence


@dataclasses.dataclass(frozen=True)
class TaskDemand:
    """A task to place: which job and key part, and how many bytes it aggregates per round."""

    job: str
    key: object
    part: int
    nbytes: int


@dataclasses.dataclass(frozen=True)
class AggregatorLoad:
    """An Aggregator as placement sees it."""

    name: str
    bytes: int
    tasks: int


#: A placement policy: the chosen Aggregator's name, or None when none can take the task.
Placement = Callable[[TaskDemand, Sequence[AggregatorLoad]], "str | None"]


def least_loaded(task: TaskDemand, aggregators: Sequence[AggregatorLoad]) -> str | None:
    """The Aggregator with the fewest bytes (then fewest tasks, then name: deterministic)."""
    if not aggregators:
        return None
    return min(aggregators, key=lambda a: (a.bytes, a.tasks, a.name)).name
