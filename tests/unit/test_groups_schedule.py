"""dSyncPS's schedule of global syncs (pslink.core.groups.SyncSchedule) and its join rule."""

from __future__ import annotations

import pytest

from pslink.core.groups import SyncSchedule, parse_local_sync
from pslink.errors import ConfigError


def run(schedule: SyncSchedule, steps: int, joins: dict[int, None] | None = None) -> tuple[list[int], list]:
    synced, moves = [], []
    for step in range(1, steps + 1):
        if joins and step in joins:
            moves.append(schedule.joined(step))
        if schedule.due(step):
            schedule.synced(step)
            synced.append(step)
    return synced, moves


def test_groups_sync_every_t_local_steps():
    assert run(SyncSchedule(5), 16)[0] == [5, 10, 15]
    assert run(SyncSchedule(1), 3)[0] == [1, 2, 3]


def test_a_join_due_at_a_sync_defers_it_to_include_the_newcomer():
    synced, moves = run(SyncSchedule(5), 16, {10: None})
    assert moves == [("defer", 2)] and synced == [5, 10, 15]


def test_a_join_mid_period_advances_the_coming_sync_and_restarts_the_period():
    synced, moves = run(SyncSchedule(5), 16, {7: None})
    assert moves == [("advance", 2)] and synced == [5, 7, 12]


def test_a_join_right_after_a_sync_advances_the_next_one():
    synced, moves = run(SyncSchedule(5), 12, {6: None})
    assert moves == [("advance", 2)] and synced == [5, 6, 11]


def test_local_sync_settings_are_checked():
    assert parse_local_sync("local:5") == 5
    for bad in ("local:0", "local", "bsp", "local:x"):
        with pytest.raises(ConfigError, match="'local:T'"):
            parse_local_sync(bad)
    with pytest.raises(ConfigError, match="at least 1"):
        SyncSchedule(0)
