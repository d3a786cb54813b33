"""An Agent's iterations (pslink.core.agent.iterations): durations, and the worker's own work in
each once the Agent measures waits. A hand-driven clock: no processes, no sleeps."""

from __future__ import annotations

import threading

from pslink.core.agent.iterations import Iterations


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_own_work_is_each_iterations_duration_less_its_waits():
    clock = Clock()
    iterations = Iterations(clock, None, threading.Lock())
    for step in range(3):  # iterations of 0.1 s; the second and third wait 0.03 s and 0.05 s
        clock.now = step * 0.1
        iterations.pushed(["a", "b"])
        iterations.waited((0.0, 0.03, 0.05)[step])
    clock.now = 0.3
    iterations.pushed(["a"])
    durations, work = iterations.take()
    assert [round(d, 6) for d in durations] == [0.1, 0.1, 0.1]
    assert [round(w, 6) for w in work] == [0.1, 0.07, 0.05]
    assert iterations.take() == ([], [])  # taken


def test_no_work_is_reported_while_no_wait_was_measured():
    """A job that waits outside the Agent (DDP's hook: torch waits on its futures) reports
    durations only: pMaster judges them whole."""
    clock = Clock()
    iterations = Iterations(clock, None, threading.Lock())
    for step in range(3):
        clock.now = step * 0.1
        iterations.pushed(["a"])
        iterations.waited(0.0)  # handles that were done already
    durations, work = iterations.take()
    assert len(durations) == 2 and work == []


def test_waits_overlapping_on_several_threads_never_make_work_negative():
    clock = Clock()
    iterations = Iterations(clock, None, threading.Lock())
    iterations.pushed(["a"])
    iterations.waited(0.08)
    iterations.waited(0.08)  # two threads waited at once
    clock.now = 0.1
    iterations.pushed(["a"])
    assert iterations.take()[1] == [0.0]
