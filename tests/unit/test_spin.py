"""The reactor's spin window (pslink/core/spin.py): spin through a burst's gaps, not between bursts."""

from __future__ import annotations

import pytest

from pslink.core.wire.spin import SpinWindow

SPIN = 2e-3


def learnt(gaps, **options) -> SpinWindow:
    window = SpinWindow(**options)
    for gap in gaps:
        window.record(gap)
    return window


def test_until_enough_gaps_are_seen_the_configured_spin_is_used():
    window = learnt([5e-3] * 7)  # fewer than half of the 16-gap history
    assert window.window(SPIN) == SPIN


def test_request_reply_gaps_keep_a_window_of_a_few_gaps():
    # One small request in flight: the next one comes about a round trip (100 us) after the reply.
    window = learnt([100e-6] * 16)
    assert window.window(SPIN) == pytest.approx(400e-6)
    assert window.window(SPIN) > 100e-6  # the next request is still caught while spinning


def test_gaps_between_gradient_buckets_stop_the_spinning():
    # Milliseconds between bursts: spinning 2 ms after each would burn a core for nothing.
    window = learnt([8e-3, 15e-3, 30e-3] * 6)
    assert window.window(SPIN) == window.floor


def test_a_burst_of_back_to_back_messages_spins_the_floor_at_least():
    window = learnt([1e-6] * 16)
    assert window.window(SPIN) == window.floor


def test_the_window_never_exceeds_the_configured_spin_and_zero_means_never_spin():
    window = learnt([1e-3] * 16)  # 4 x 1 ms would be 4 ms
    assert window.window(SPIN) == SPIN
    assert window.window(0.0) == 0.0
    assert window.window(100e-6) == pytest.approx(20e-6)  # gaps outlast a 100 us spin: the floor


def test_the_window_follows_a_change_of_pattern():
    window = learnt([20e-3] * 16)
    assert window.window(SPIN) == window.floor
    for _ in range(16):
        window.record(50e-6)
    assert window.window(SPIN) == pytest.approx(200e-6)
