"""What the control plane asks pMaster (or the simulator) to do: start an Aggregator, let one go,
move a task."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Allocate:
    """Start an Aggregator in ``cluster``; tell :meth:`ControlPlane.bind` its name once it is up."""

    cluster: str
    placeholder: str
    reason: str


@dataclasses.dataclass(frozen=True)
class Release:
    aggregator: str
    reason: str


@dataclasses.dataclass(frozen=True)
class Migrate:
    task: tuple  # (job, key, part)
    source: str
    target: str
    reason: str


def batches_of_moves(actions: list) -> list[list]:
    """``actions`` in order, the moves side by side in one list (one decision's: pMaster and the
    simulator hand them to the migration core together), every other action a list of its own."""
    out: list[list] = []
    for action in actions:
        if isinstance(action, Migrate) and out and isinstance(out[-1][0], Migrate):
            out[-1].append(action)
        else:
            out.append([action])
    return out
