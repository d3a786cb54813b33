"""dSyncPS's schedule of global syncs (pslink.core.worker.groups.SyncSchedule), its join rule, and how
connect() reads groups (sync="local:T")."""

from __future__ import annotations

import re

import pytest

from pslink.core.config import parse_local_sync
from pslink.core.worker.groups import SyncSchedule
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


# -- how connect() reads sync="local:T" ----------------------------------------------------------------


def test_groups_come_from_the_option_or_one_per_launched_host():
    from pslink.core.config import local_sync_settings

    assert local_sync_settings("local:5", 2, None, "j", 3, 4, environ={}) == (5, 2, None)
    assert local_sync_settings("bsp", None, None, "j", 0, 4, environ={}) is None
    assert local_sync_settings(None, None, None, "j", 0, 4, environ={}) is None
    launched = {"PSLINK_JOB": "j", "PSLINK_RANK": "1", "PSLINK_SYNC": "local:3", "PSLINK_LOCAL_SIZE": "2",
                "PSLINK_SYNC_STORE": "/tmp/meet"}
    assert local_sync_settings(None, None, None, "j", 1, 6, environ=launched) == (3, 3, "/tmp/meet")  # a group a host
    assert local_sync_settings(None, None, None, "j", 1, 6, environ=dict(launched, PSLINK_GROUPS="2")) == (3, 2,
                                                                                                       "/tmp/meet")
    # Another job of the process (a process set's, a group's own) is not the launched one.
    assert local_sync_settings(None, None, None, "j.ps1", 1, 6, environ=launched) is None
    # A group by label: from the option, or the launched worker's environment.
    assert local_sync_settings("local:5", None, None, "j", 3, 4, environ={}, label="site-a") == (5, "site-a", None)
    assert local_sync_settings(None, None, None, "j", 1, 6, environ=dict(launched, PSLINK_SYNC_GROUP="b")) == (
        3, "b", "/tmp/meet")


@pytest.mark.parametrize("sync, groups, env, words", [
    ("local:5", None, {}, "groups=N"),  # no launcher to say where the hosts are
    ("local:5", 3, {}, "do not split into 3 groups"),
    ("local:0", 2, {}, "'local:T'"),
    (None, None, {"PSLINK_SYNC": "ssp"}, "PSLINK_SYNC"),
    (None, None, {"PSLINK_SYNC": "local:2", "PSLINK_GROUPS": "x"}, "PSLINK_GROUPS"),
])
def test_group_settings_that_cannot_work_are_named(sync, groups, env, words):
    from pslink.core.config import local_sync_settings

    with pytest.raises(ConfigError, match=re.escape(words)):
        local_sync_settings(sync, groups, None, "j", 0, 4, environ=env)


@pytest.mark.parametrize("groups, label, words", [(2, "a", "not both"), (None, "", "non-empty"),
                                                  (None, "x" * 201, "at most 200 bytes"), (None, 3, "must name")])
def test_group_labels_that_cannot_work_are_named(groups, label, words):
    from pslink.core.config import local_sync_settings

    with pytest.raises(ConfigError, match=re.escape(words)):
        local_sync_settings("local:5", groups, None, "j", 0, 4, environ={}, label=label)


def test_connect_refuses_group_options_without_groups_and_an_optimizer_with_them():
    import pslink

    with pytest.raises(ConfigError, match="go with sync='local:T'"):
        pslink.connect("j", 0, 2, "tcp://127.0.0.1:9", groups=2)
    with pytest.raises(ConfigError, match="go with sync='local:T'"):
        pslink.connect("j", 0, 2, "tcp://127.0.0.1:9", sync_group="a")
    with pytest.raises(ConfigError, match="workers step"):
        pslink.connect("j", 0, 2, "tcp://127.0.0.1:9", sync="local:2", groups=2, mode="optimizer",
                       optimizer={"type": "sgd", "lr": 0.1})
