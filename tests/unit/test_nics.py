"""Placement on hosts never puts more on a NIC than it carries (issue 29)."""

from __future__ import annotations

import numpy as np
import pytest

from pslink.core.master.control import ControlPlane
from pslink.core.master.nics import Nics
from pslink.core.master.packing import NewAggregator, Placement, TaskDemand


def test_a_task_goes_only_where_its_hosts_nic_has_room():
    nics = Nics(bandwidth=100.0)
    plan = Placement(nics=nics)
    for name, host in (("a1", "A"), ("a2", "A"), ("b1", "B")):
        plan.add_aggregator(name)
        plan.set_host(name, host)
    plan.place(TaskDemand("big", 0, 0, 1.0, 0.1, rate=90.0), candidates=["a1"])
    assert nics.load_of("A") == 90.0
    # a2 has CPU to spare, but its host's NIC carries a1's 90 of 100: the task goes to B
    assert plan.place(TaskDemand("j", 0, 0, 1.0, 0.1, rate=20.0), candidates=["a2", "b1"]) == "b1"
    assert plan.place(TaskDemand("j", 1, 0, 1.0, 0.1, rate=10.0), candidates=["a2"]) == "a2"  # exactly full
    assert isinstance(plan.place(TaskDemand("k", 0, 0, 1.0, 0.1, rate=1.0), candidates=["a1", "a2"]), NewAggregator)
    assert (nics.load_of("A"), nics.load_of("B")) == (100.0, 20.0)
    plan.unassign(("big", 0, 0))
    assert nics.load_of("A") == 10.0
    plan.set_host("b1", "A")  # an Aggregator's load follows it
    assert (nics.load_of("A"), nics.load_of("B")) == (30.0, 0.0)
    plan.remove_aggregator("a2")
    assert nics.load_of("A") == 20.0


@pytest.mark.parametrize("at_once", [False, True])
def test_random_jobs_never_oversubscribe_a_nic(at_once):
    rng = np.random.default_rng(1)
    nics = Nics(bandwidth=1000.0)
    plan = Placement(nics=nics)
    for n in range(40):
        plan.add_aggregator(f"agg-{n}")
        plan.set_host(f"agg-{n}", f"host-{n // 4}")  # 4 Aggregators a host
    opened = 0
    for j in range(60):
        iteration = float(rng.choice([0.1, 0.2, 0.4]))
        tasks = [TaskDemand(f"job-{j}", k, 0, iteration, float(rng.uniform(0.001, 0.02)),
                            rate=float(rng.uniform(10, 300))) for k in range(int(rng.integers(1, 12)))]
        tasks.sort(key=lambda t: -t.cost)
        decisions = plan.place_many(tasks) if at_once else [plan.place(t) for t in tasks]
        opened += sum(isinstance(d, NewAggregator) for d in decisions)
        assert nics.load.max() <= 1000.0 + 1e-6
    assert nics.load.max() > 900  # the NICs, not the CPUs, were what filled up
    assert opened > 0
    # the load each host carries is what its Aggregators' tasks send
    for host, index in nics.index.items():
        placed = sum(t.rate for p in plan.aggregators.values() if p.index < 40 and plan._host[p.index] == index
                     for t in p.tasks.values())
        assert nics.load[index] == pytest.approx(placed)


def test_the_control_plane_gives_each_packed_task_its_bytes_per_second():
    control = ControlPlane(profile_iterations=0, nic_bandwidth=1e6, cost_per_byte=1e-9)
    control.aggregator_added("agg-0")
    control.aggregator_host("agg-0", "host-1", spread=False)
    control.job_arrived("j", workers=4)
    control.jobs["j"].standalone = 0.5
    control.place_part("j", "w", 0, 1000)
    # 4 workers push 1000 bytes every 0.5 s
    assert control.nics.load_of("host-1") == pytest.approx(8000.0)
    assert control.pool.host_of == {}  # spread=False: not a host jobs are spread over


@pytest.mark.parametrize("at_once", [False, True])
def test_an_aggregator_not_yet_on_a_host_takes_no_more_than_a_whole_nic(at_once):
    # A job whose parts send more than one NIC carries needs several hosts, as its static servers
    # would: each new Aggregator gets at most a NIC's worth, whatever CPU it has to spare.
    plan = Placement(nics=Nics(bandwidth=100.0))
    tasks = [TaskDemand("wide", k, 0, 1.0, 0.01, rate=40.0) for k in range(5)]
    decisions = plan.place_many(tasks) if at_once else [plan.place(t) for t in tasks]
    assert all(isinstance(d, NewAggregator) for d in decisions[::2])
    assert sorted(round(p.rate) for p in plan.aggregators.values()) == [40, 80, 80]


def test_a_job_is_profiled_only_on_idle_aggregators_whose_nic_carries_nothing():
    control = ControlPlane(nic_bandwidth=1000.0, cost_per_byte=1e-9)
    for name, host in (("busy-host", "A"), ("quiet", "B"), ("idle-on-busy", "A"), ("lightly-used", "C"),
                       ("idle-on-light", "C")):
        control.aggregator_added(name)
        control.aggregator_host(name, host, spread=False)
    control.job_arrived("big", workers=1, servers=1)
    control.jobs["big"].standalone = 1.0
    control.jobs["big"].phase = "packed"
    control.jobs["big"].temporaries.clear()
    control.pool.reserved.clear()
    plan = control.pool.clusters[control.pool.cluster_of["busy-host"]]
    plan.assign(TaskDemand("big", 0, 0, 1.0, 0.1, rate=600.0), "busy-host")
    plan.assign(TaskDemand("big", 1, 0, 1.0, 0.1, rate=10.0), "lightly-used")
    actions = control.job_arrived("new", workers=1, servers=2)
    # A's NIC is 60% used, C's 1%: what the new job sends is not known, so only B's idle NIC
    # takes it; a new Aggregator is started for its second server
    assert control.jobs["new"].temporaries[0] == "quiet"
    assert not {"idle-on-busy", "idle-on-light"} & set(control.jobs["new"].temporaries) and len(actions) == 1


def test_a_job_is_profiled_on_one_aggregator_per_nic():
    control = ControlPlane(nic_bandwidth=1000.0, cost_per_byte=1e-9)
    for name, host in (("a1", "A"), ("a2", "A"), ("b1", "B")):
        control.aggregator_added(name)
        control.aggregator_host(name, host, spread=False)
    actions = control.job_arrived("new", workers=1, servers=3)
    assert sorted(control.jobs["new"].temporaries[:2]) == ["a1", "b1"] and len(actions) == 1


def test_a_job_keeps_its_nic_whole_until_profiled_then_uses_what_it_sends():
    # Its iteration is not known while it is profiled: nothing may be placed beside it on its NIC.
    # Once measured (not packed yet: its moves would not pay), its NIC holds its real bytes a second.
    control = ControlPlane(nic_bandwidth=1000.0, cost_per_byte=1e-9, profile_iterations=3, clock=lambda: 0.0)
    control.aggregator_added("agg")
    control.aggregator_host("agg", "A", spread=False)
    control.job_arrived("new", workers=2, servers=1)
    control.place_part("new", "w", 0, 100)
    assert control.nics.load_of("A") == pytest.approx(1000.0)
    assert control.pack_due("new") > 0.0  # the clock stays at 0: it is not packed below
    assert control.iterations_reported("new", [0.5, 0.5, 0.5]) == []
    assert control.jobs["new"].phase == "profiling"
    assert control.nics.load_of("A") == pytest.approx(2 * 100 / 0.5)  # 2 workers push 100 bytes every 0.5 s
