"""Integrals, samples and ratios of step functions."""

from __future__ import annotations

import numpy as np
import pytest

from pslink.sim.engine import Timeline
from pslink.sim.metrics import binned_mean, integral, ratio_samples, sample


def test_step_functions_integrate_and_sample_as_steps():
    times, values = np.array([0.0, 10.0, 30.0]), np.array([2.0, 5.0, 0.0])
    assert integral(times, values) == 2 * 10 + 5 * 20
    assert list(sample(times, values, np.array([-1.0, 0.0, 9.9, 10.0, 29.0, 31.0]))) == [0, 2, 2, 5, 5, 0]
    starts, means = binned_mean(times, values, 20.0)
    assert list(starts) == [0.0, 20.0] and list(means) == [(20 + 50) / 20, 50 / 20]  # 0 after the end


def test_the_ratio_is_sampled_every_interval_where_jobs_request_cpus():
    timeline = Timeline()
    for t, allocated, requested in ((0, 1, 4), (120, 6, 4), (180, 0, 0), (300, 2, 2), (360, 0, 0)):
        timeline.record(t, allocated, requested, 0.0)
    ratios = ratio_samples(timeline, 60.0)
    # samples at 0, 60 (1/4), 120 (6/4), 180 and 240 idle (left out), 300 (2/2)
    assert list(ratios) == [0.25, 0.25, 1.5, 1.0]
    assert np.mean(ratios > 1) == pytest.approx(0.25)


def test_a_timeline_keeps_one_point_per_instant_and_drops_repeats():
    timeline = Timeline()
    timeline.record(0, 1, 1, 0.5)
    timeline.record(0, 2, 2, 0.5)  # same instant: the later state holds
    timeline.record(5, 2, 2, 0.5)  # nothing changed
    timeline.record(9, 0, 0, 0.0)
    assert timeline.times == [0, 9] and timeline.allocated == [2, 0]
