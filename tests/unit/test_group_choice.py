"""The load x RTT rule that moves workers between groups (pslink.core.worker.group_choice, dSyncPS 3.2.4)."""

from __future__ import annotations

import pytest

from pslink.core.worker.group_choice import GroupChoice
from pslink.errors import ConfigError


def test_a_worker_moves_when_another_group_would_be_20_percent_lighter():
    # Alone with 3 workers against 1: the other group with this worker in it has 2, 2 < 0.8 x 3.
    assert GroupChoice().better(0, {0: 3, 1: 1}, {0: 1.0, 1: 1.0}) == 1


def test_balanced_groups_keep_their_workers_both_ways():
    # 2 and 2: moving would make 3 there (worse); the mover that just came does not go back.
    choice = GroupChoice()
    assert choice.better(0, {0: 2, 1: 2}, {0: 1.0, 1: 1.0}) is None
    assert choice.better(1, {0: 2, 1: 2}, {0: 1.0, 1: 1.0}) is None


def test_within_the_margin_a_worker_stays():
    # 5 workers here, the other with it would have 4: 4 > 0.8 x 5 = 4 is not lower; 0.1 moves it.
    assert GroupChoice().better(0, {0: 5, 1: 3}, {0: 1.0, 1: 1.0}) is None
    assert GroupChoice(margin=0.1).better(0, {0: 5, 1: 3}, {0: 1.0, 1: 1.0}) == 1


def test_the_rtt_weighs_as_much_as_the_load():
    # The same sizes, but the other group's service is 4x farther: staying wins.
    assert GroupChoice().better(0, {0: 3, 1: 1}, {0: 0.010, 1: 0.040}) is None
    # A near, busier group beats a far, idle one: 3 x 10 ms < 0.8 x (1 x 50 ms).
    assert GroupChoice().better(1, {0: 2, 1: 1}, {0: 0.010, 1: 0.050}) == 0


def test_rtts_below_the_floor_count_as_equal():
    # 0.1 ms and 0.3 ms on a LAN are noise: only the sizes decide.
    choice = GroupChoice()
    assert choice.better(0, {0: 2, 1: 2}, {0: 0.0003, 1: 0.0001}) is None
    assert choice.better(0, {0: 2, 1: 2}, {0: 0.030, 1: 0.010}) == 1


def test_the_best_of_several_groups_and_none_without_a_leader():
    # Group 2 has no workers (its leader left): never a target; of 1 and 3, the lighter.
    sizes = {0: 4, 1: 2, 2: 0, 3: 1}
    assert GroupChoice().better(0, sizes, {0: 1.0, 1: 1.0, 2: 1.0, 3: 1.0}) == 3
    assert GroupChoice().scores(0, sizes, {0: 1.0, 1: 1.0, 2: 1.0, 3: 1.0}) == {0: 4.0, 1: 3.0, 3: 2.0}
    assert GroupChoice().better(0, {0: 4}, {0: 1.0}) is None  # nowhere else to go


@pytest.mark.parametrize("options, words", [({"margin": 1.0}, "margin"), ({"margin": -0.1}, "margin"),
                                            ({"rtt_floor": -1}, "rtt_floor")])
def test_bad_settings_are_named(options, words):
    with pytest.raises(ConfigError, match=words):
        GroupChoice(**options)
