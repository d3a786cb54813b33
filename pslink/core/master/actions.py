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
