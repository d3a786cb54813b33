"""Hosts and NICs in the simulator (issue 29): the provider's choice of host, what an oversubscribed
NIC does to jobs, and placement keeping every NIC within its bandwidth."""

from __future__ import annotations

import dataclasses

import pytest

from pslink.sim.engine import PslinkSimulation, ServiceOptions
from pslink.sim.hosts import HostPool
from pslink.sim.workload import SimJob

EXACT = ServiceOptions(startup=0.0, timed_moves=False, headroom=0.0, placement_share=1.0)


def job(name, submit, costs, duration, workers=1, nbytes=1000, iteration=1.0):
    parts = tuple((key, 0, nbytes) for key in range(len(costs)))
    return SimJob(name, float(submit), float(duration), workers, 1, "hand", iteration, parts, tuple(costs))


def test_the_provider_starts_aggregators_on_the_first_host_with_a_cpu_and_nic_room():
    pool = HostPool(cpus=2, bandwidth=100.0)
    loads = {"host-1": 0.0}
    assert pool.place("a", 30.0, lambda h: loads.get(h, 0.0)) == "host-1"
    assert pool.place("b", 30.0, lambda h: loads.get(h, 0.0)) == "host-1"
    assert pool.place("c", 0.0, lambda h: loads.get(h, 0.0)) == "host-2"  # host-1's CPUs are taken
    loads["host-2"] = 80.0
    assert pool.place("d", 30.0, lambda h: loads.get(h, 0.0)) == "host-3"  # host-2's NIC has 20 left
    assert pool.peak_hosts == 3
    assert pool.measured("a", 60.0) == set() and pool.factor("a") == 1.0
    assert pool.measured("b", 60.0) == {"a", "b"}  # 120 of 100: both slowed
    assert pool.peak_load == 0.0  # counted once the event is over
    pool.settle()
    assert pool.factor("a") == pytest.approx(1.2) and pool.peak_load == pytest.approx(1.2)
    assert pool.release("b") == {"a", "b"} and pool.factor("a") == 1.0
    assert pool.place("e", 0.0, lambda h: 0.0) == "host-1"  # b's CPU is free again


def test_a_job_whose_bytes_its_neighbours_nic_cannot_carry_is_not_packed_there():
    # A and B would share one Aggregator by CPU (0.3 + 0.3 of a 1 s cycle), but each pushes
    # 1000 bytes a second and a host's NIC carries 1500: B stays on its own host.
    nic = 1500 * 8 / 1e9
    a, b = job("A", 0, [0.3], 1000), job("B", 5, [0.3], 1000)
    tight = PslinkSimulation([a, b], dataclasses.replace(EXACT, host_cpus=1, nic_gbit=nic), check=True).run()
    assert {o.name: o.relocations for o in tight.jobs} == {"A": 0, "B": 0}
    assert all(o.slowdown == 0 for o in tight.jobs)
    assert tight.counters["NIC peak load"] <= 1.0 and tight.counters["hosts at peak"] == 2
    roomy = PslinkSimulation([a, b], dataclasses.replace(EXACT, host_cpus=1, nic_gbit=1.0), check=True).run()
    assert {o.name: o.relocations for o in roomy.jobs} == {"A": 0, "B": 1}  # B packed onto A's Aggregator


def test_jobs_being_profiled_never_share_a_nic():
    # Two jobs arrive at once on a pool of hosts with two CPUs each. Placement cannot know what a
    # job being profiled sends (here 20,000 bytes a second each: together more than a NIC of
    # 30,000 carries), so each is given a NIC of its own: neither is slowed.
    nic = 30_000 * 8 / 1e9
    a, b = (job(name, 0, [0.01], 1000, iteration=0.05) for name in "AB")
    options = dataclasses.replace(EXACT, host_cpus=2, nic_gbit=nic, profile_iterations=100_000)  # never packed
    result = PslinkSimulation([a, b], options, check=True).run()
    assert result.counters["hosts at peak"] == 2
    assert result.counters["NIC peak load"] == pytest.approx(20_000 / 30_000)
    assert all(o.slowdown == 0 for o in result.jobs)


def test_a_nic_carrying_more_than_its_bandwidth_slows_the_jobs_on_it():
    # A job alone sends 20,000 bytes a second through a NIC of 15,000: it takes 4/3 as long.
    nic = 15_000 * 8 / 1e9
    options = dataclasses.replace(EXACT, host_cpus=2, nic_gbit=nic, profile_iterations=100_000)
    result = PslinkSimulation([job("A", 0, [0.01], 1000, iteration=0.05)], options, check=True).run()
    assert result.counters["NIC peak load"] == pytest.approx(20_000 / 15_000)
    assert round(result.jobs[0].slowdown, 6) == round(1 / 3, 6)
