"""What a move costs its job (issue 54, pslink.core.master.move_cost): a pre-copy while the job
trains, then a switch at a round boundary. Pure numbers; then the control plane and the
simulator checked to use this one model."""

from __future__ import annotations

import math

import pytest

from pslink.core.master.control import ControlPlane
from pslink.core.master.move_cost import MoveCost, compute_gap
from pslink.errors import ConfigError
from pslink.sim.engine import PslinkSimulation, ServiceOptions
from pslink.sim.workload import SimJob

MB = 1_000_000
MIB = 1 << 20
GBIT = 1e9 / 8  # bytes a second


def test_on_a_1_gbit_link_a_100_mb_move_costs_the_job_only_the_switch_when_its_last_round_fits_its_compute():
    cost = MoveCost(copy_bandwidth=GBIT, copy_latency=0.002, switch_latency=0.002, copy_cpu_per_byte=0.0)
    # 200 MB of state (weights and momentum): 1.6 s on the link, while the job trains.
    assert cost.seed_seconds(200 * MB) == pytest.approx(0.002 + 1.6)
    # Its last round's sum, 100 MB, takes 0.802 s to forward; a job computing 1 s of its 2 s
    # iterations hides it: the job waits for the switch alone.
    assert cost.switch_stall(100 * MB, gap=1.0, iteration=2.0, state_bytes=200 * MB) == pytest.approx(0.002)
    assert cost.delay(200 * MB, 100 * MB, iteration=2.0, gap=1.0) == pytest.approx(0.002)
    # Stopping the job for the whole copy would have cost it 0.002 + 0.8 s (the model before).
    # The pre-copy lasts the seed and the rounds that closed meanwhile: longer on the slower link.
    slow = cost.precopy_seconds(200 * MB, 100 * MB, 2.0)
    fast = MoveCost(copy_bandwidth=10 * GBIT, copy_cpu_per_byte=0.0).precopy_seconds(200 * MB, 100 * MB, 2.0)
    assert slow == pytest.approx(1.602 + 1.602 * 0.802 / (2.0 - 0.802)) and slow > 8 * fast


def test_a_switch_whose_last_forwarded_round_outlasts_the_compute_costs_the_excess():
    cost = MoveCost(copy_bandwidth=GBIT, copy_latency=0.002, switch_latency=0.002)
    assert cost.switch_stall(100 * MB, gap=0.5, iteration=2.0) == pytest.approx(0.002 + (0.802 - 0.5))
    # A forward the link cannot keep up with (1.2 s a round, 1 s iterations): the target never
    # catches up, so it switches after the seed and the round waits for every round behind.
    behind = cost.rounds_behind(300 * MB, 150 * MB, 1.0)
    assert behind == math.ceil(2.402 / 1.0) == 3
    assert cost.switch_stall(150 * MB, gap=0.5, iteration=1.0, state_bytes=300 * MB) == pytest.approx(
        0.002 + 4 * 1.202 - 0.5)


def test_the_pre_copy_costs_the_copys_cpu_where_it_meets_the_jobs_communication():
    cost = MoveCost(copy_bandwidth=1e9, copy_latency=0.0, switch_latency=0.0, copy_cpu_per_byte=1e-10)
    # 200 MB of state: 0.2 s; 0.1 s a round forwarded, iterations of 0.5 s: 0.05 s to catch up,
    # one round forwarded. 300 MB sent at 0.1 ns a byte, of which the job's communication (60% of
    # its iteration) meets 60%.
    assert cost.precopy_delay(200 * MB, 100 * MB, iteration=0.5, gap=0.2) == pytest.approx(300 * MB * 1e-10 * 0.6)
    # On a ten times slower link the pre-copy lasts ten times longer at a tenth of the slowdown;
    # only the rounds forwarded meanwhile add to what it costs.
    slow = MoveCost(copy_bandwidth=1e8, copy_latency=0.0, switch_latency=0.0, copy_cpu_per_byte=1e-10)
    duration = slow.precopy_seconds(200 * MB, 10 * MB, 0.5)
    assert duration == pytest.approx(2.0 + 2.0 * 0.1 / 0.4)
    assert slow.precopy_delay(200 * MB, 10 * MB, 0.5, 0.2) == pytest.approx((200 + 5 * 10) * MB * 1e-10 * 0.6)


def test_a_batch_carries_what_its_last_forwarded_round_lands_within_the_compute():
    cost = MoveCost(copy_bandwidth=1e9, copy_latency=0.002, switch_latency=0.002)
    bound = cost.batch_bytes(0.025)
    assert bound == 23 * MB  # (25 ms of compute - 2 ms a message) at 1 GB/s
    assert cost.switch_stall(bound, gap=0.025) == pytest.approx(0.002)
    assert cost.switch_stall(bound + MB, gap=0.025) == pytest.approx(0.002 + 0.001)
    assert cost.batch_bytes(0.001) == 0  # no compute to hide anything: the throttle's bound
    assert compute_gap(0.05) == 0.025 and compute_gap(0.05, work=0.04) == 0.04 and compute_gap(None) == 0.0


def test_untimed_copies_cost_the_job_the_switch_alone():
    cost = MoveCost(copy_bandwidth=0.0, switch_latency=0.003)
    assert cost.delay(1e12, 1e12, iteration=0.1, gap=0.0) == 0.003 and cost.batch_bytes(10.0) == 0
    assert MoveCost(copy_bandwidth=0.0, switch_latency=0.0).delay(1e12, 1e12, 0.1, 0.0) == 0.0


@pytest.mark.parametrize("setting, value", [
    ("copy_bandwidth", -1.0), ("copy_latency", float("nan")), ("switch_latency", float("inf")),
    ("copy_cpu_per_byte", "5e-10"), ("copy_bandwidth", True),
])
def test_bad_settings_are_refused_naming_them(setting, value):
    with pytest.raises(ConfigError, match=f"^{setting} must be a finite number >= 0, got"):
        MoveCost(**{setting: value})
    if setting != "copy_cpu_per_byte":  # the control plane's cost_per_byte; the simulator's cost model
        with pytest.raises(ConfigError, match=f"^{setting} must be"):
            ControlPlane(**{setting: value})
        with pytest.raises(ConfigError, match=f"^{setting} must be"):
            ServiceOptions(**{setting: value})


def test_the_simulator_delays_a_packed_job_by_the_control_planes_own_model():
    """One job of 6 parts of 8 MiB, profiled on 2 Aggregators, packed onto one: 3 parts move as
    one migration (24 MiB, under its batch bound of (0.5 s - 2 ms) x 100 MB/s). The job ends
    late by exactly what the control plane's model says that migration costs it: its real state
    (weights and momentum), its iteration (1 s), half of it compute."""
    parts = tuple((k, 0, 8 * MIB) for k in range(6))
    job = SimJob("A", 0.0, 400.0, 2, 2, "hand", 1.0, parts, (0.1,) * 6, 1.0)
    sim = PslinkSimulation([job], ServiceOptions(startup=0.0, copy_bandwidth=1e8), check=True)
    result = sim.run()
    assert (result.counters["migrations"], result.counters["parts moved"]) == (1, 3)
    cost = sim.control.move_cost
    assert cost.batch_bytes(0.5) == 49_800_000 > 24 * MIB
    expected = cost.delay(2 * 24 * MIB, 24 * MIB, iteration=1.0, gap=0.5)
    (outcome,) = result.jobs
    assert outcome.end == pytest.approx(400.0 + expected)
    # The copy's CPU (0.019 s, half of it where the job communicates) and a 2 ms switch: far less
    # than stopping the job's round for the 24 MiB copy (0.254 s).
    assert expected == pytest.approx(72 * MIB * 5e-10 * 0.5 + 0.002)
    assert expected < (0.002 + 24 * MIB / 1e8) / 10
