"""Cyclic execution at an Aggregator: slots, late rounds that fit, late rounds that wait."""

from __future__ import annotations

import numpy as np

from pslink.core.aggregator.core import AggregatorCore
from pslink.core.aggregator.tasks import CloseLater, Reply, Request, Summer
from pslink.core.aggregator.cycle import CycleBudget
from pslink.core.wire.protocol import Op

A, B = ("j1", "a", 0), ("j2", "b", 0)


def test_each_task_runs_its_slots_per_cycle():
    # Figure 5's packing: cycle 12, J1 runs twice (2 units each), J2 once (3 units)
    budget = CycleBudget(12.0, {A: (2, 2.0), B: (1, 3.0)}, start=0.0)
    assert budget.admit(A, 0.5) == 0.5
    assert budget.admit(B, 1.0) == 1.0
    assert budget.admit(A, 6.5) == 6.5
    # a third run of J1 at t=7: 5 units left in the cycle, nothing owed to J2 any more: it fits
    assert budget.admit(A, 7.0) == 7.0
    # the next cycle starts afresh
    assert budget.admit(A, 12.5) == 12.5 and budget.used[A] == 1


def test_a_late_round_waits_when_it_would_eat_into_slots_owed_to_others():
    budget = CycleBudget(12.0, {A: (2, 2.0), B: (1, 3.0)}, start=0.0)
    budget.admit(A, 0.0)
    budget.admit(A, 1.0)  # J1 used both its slots early
    # at t=8 J2's run (3 units) is still owed; 4 units remain: a third J1 run (2) would leave 2 < 3
    assert budget.admit(A, 8.0) == 12.0
    assert budget.deferred == 1
    # the deferred run counts against the next cycle's budget
    assert budget.admit(B, 9.0) == 9.0
    assert budget.admit(A, 12.0) == 12.0 and budget.used[A] == 2  # the carried run plus this one


def test_unscheduled_tasks_are_not_held_back():
    budget = CycleBudget(1.0, {A: (1, 0.5)}, start=0.0)
    assert all(budget.admit(B, t / 10) == t / 10 for t in range(5))


class Clock:
    now = 0.0

    def __call__(self):
        return self.now


def test_the_aggregator_defers_a_complete_round_to_its_slot():
    clock = Clock()
    core = AggregatorCore("agg", summer=Summer(threads=1), clock=clock)
    info = {"job": "j1", "token": b"t", "membership": {"ranks": [0]}, "mode": "sum"}
    spec = {"key": "a", "part": 0, "shape": [4], "span": [0, 4], "dtype": "float32", "needs_init": False}
    (task,) = core.assign(info, [spec])
    core.set_schedule(1.0, {A: (1, 0.1), B: (1, 0.85)})  # j2's slot (0.85 s) is still owed

    def pushpull(rnd, value):
        buffer = core.receive_buffer(task)
        buffer[:] = value
        return core.handle(task, Request("w", rnd, Op.PUSHPULL, 0, rnd, buffer))

    first = pushpull(1, 1.0)
    assert isinstance(first[0], Reply) and first[0].round == 1  # its slot in this cycle
    clock.now = 0.2
    second = pushpull(2, 2.0)
    (later,) = second
    assert isinstance(later, CloseLater) and later.when == 1.0  # 0.8 left, 0.85 owed to j2
    assert core.close_due(task) != [] and task.closed == 2
    np.testing.assert_array_equal(task.value, np.full(4, 2.0))


def test_a_round_whose_slot_came_while_its_replicas_were_caught_up_closes_once_they_were():
    """Found by the CI chaos test with control faults: a complete round waited for its slot; when
    the slot came, a catch-up of the part's new replica was under way, so it did not close, and
    the slot stayed marked as awaited: no later try closed it, and the job waited 90 s."""
    clock = Clock()
    core = AggregatorCore("agg", summer=Summer(threads=1), clock=clock)
    info = {"job": "j1", "token": b"t", "membership": {"ranks": [0]}, "mode": "sum"}
    spec = {"key": "a", "part": 0, "shape": [4], "span": [0, 4], "dtype": "float32", "needs_init": False}
    (task,) = core.assign(info, [spec])
    core.set_schedule(1.0, {A: (1, 0.1), B: (1, 0.85)})

    def pushpull(rnd, value):
        buffer = core.receive_buffer(task)
        buffer[:] = value
        return core.handle(task, Request("w", rnd, Op.PUSHPULL, 0, rnd, buffer))

    pushpull(1, 1.0)
    clock.now = 0.2
    (later,) = pushpull(2, 2.0)
    assert isinstance(later, CloseLater)
    task.replicating = task.closed  # a new replica's catch-up (of round 1) is on its way
    clock.now = later.when
    assert core.close_due(task) == [] and task.closed == 1  # its slot: it waits for the catch-up
    task.replicating = None  # (as moves.replicated() does, then it tries to close)
    replies = core.moves.close_ready(task)
    assert task.closed == 2 and any(isinstance(r, Reply) and r.round == 2 for r in replies)
