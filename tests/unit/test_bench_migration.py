"""The migration benchmarks' reading of a run: when moves ran (from status samples), which
iterations that was, and each round's stall against its still run."""

from __future__ import annotations

import pytest

from pslink.bench.migration_runs import (
    Episode,
    Sample,
    Window,
    episodes,
    excess_ms,
    iteration_at,
    read_round,
    slowdowns,
    span,
    speed_points,
)


def _samples(rows):
    return [Sample(at, listed, done) for at, listed, done in rows]


def test_an_episode_runs_from_the_first_look_listing_a_move_to_the_first_listing_none():
    found = episodes(_samples([(0.0, 0, 0), (0.1, 2, 0), (0.2, 1, 1), (0.3, 0, 2), (0.4, 0, 2)]))
    assert found == [Episode(0.1, 0.3, 2)]


def test_a_move_begun_and_done_between_two_looks_is_placed_between_them():
    found = episodes(_samples([(0.0, 0, 3), (0.1, 0, 4), (0.2, 0, 4)]))
    assert found == [Episode(0.0, 0.1, 1)]


def test_moves_close_together_are_one_episode_and_far_apart_two():
    rows = [(0.0, 1, 0), (0.1, 0, 1), (0.3, 1, 1), (0.4, 0, 2), (2.0, 1, 2), (2.1, 0, 3)]
    assert episodes(_samples(rows)) == [Episode(0.0, 0.4, 2), Episode(2.0, 2.1, 1)]


def test_span_leaves_out_moves_seen_before_the_moment_asked():
    # A pack's moves end at 0.4; a drain asked at 0.45 moves from 0.5: close enough to merge
    # as one episode, but the drain's span is its own.
    rows = [(0.0, 1, 0), (0.4, 0, 2), (0.5, 3, 2), (0.9, 0, 5)]
    assert span(_samples(rows)) == Episode(0.0, 0.9, 5)
    assert span(_samples(rows), after=0.45) == Episode(0.5, 0.9, 3)
    assert span(_samples(rows), after=1.0) is None


def test_an_episode_still_under_way_ends_at_the_last_look():
    assert episodes(_samples([(0.0, 0, 0), (0.1, 1, 0), (0.2, 1, 0)])) == [Episode(0.1, 0.2, 0)]


def test_iteration_at_is_the_last_iteration_started_by_then():
    starts = [10.0, 10.5, 11.0, 11.5]
    assert iteration_at(starts, 9.0) == 0
    assert iteration_at(starts, 10.5) == 1
    assert iteration_at(starts, 10.9) == 1
    assert iteration_at(starts, 99.0) == 3
    with pytest.raises(ValueError, match="no iteration"):
        iteration_at([], 1.0)


def test_the_window_runs_to_the_iteration_after_the_last_move():
    starts = [float(i) for i in range(10)]
    window = Window.of(starts, Episode(4.2, 6.5, 3), 10)
    assert (window.start, window.end, window.taken) == (4, 8, 3)
    assert Window.of(starts, Episode(4.2, 9.5, 3), 10).end == 10  # not past the run
    with pytest.raises(ValueError, match="iteration 0"):
        Window.of(starts, Episode(0.5, 1.0, 1), 10)


def test_a_round_is_met_within_the_noise_plus_the_margin():
    still = [0.30] * 10
    still[5] = 0.31  # 10 ms of noise in the window
    moved = [0.30] * 10
    moved[5] = 0.314  # 14 ms: within 10 + 5
    window = Window(4, 7, 2)
    r = read_round(moved, still, window, 5.0)
    assert r.stall_ms == pytest.approx(14.0) and r.noise_ms == pytest.approx(10.0) and r.met
    moved[6] = 0.316  # 16 ms: past 10 + 5
    assert not read_round(moved, still, window, 5.0).met
    with pytest.raises(ValueError, match="passes"):
        read_round(moved, still, Window(4, 12, 2), 5.0)


def test_excess_and_slowdowns_are_against_the_median_before():
    durations = [0.2, 0.2, 0.2, 0.3, 0.2, 0.25, 0.2]
    window = Window(4, 7, 2)
    assert excess_ms(durations, window) == pytest.approx(50.0)
    assert slowdowns(durations, window) == pytest.approx([0.0, 0.25, 0.0])


def test_speed_points_put_each_iteration_at_its_end():
    assert speed_points([0.5, 0.25]) == [(0.5, 2.0), (0.75, 4.0)]
