"""A deliberately slow worker process against fast ones, on a service of Aggregator processes.

With a straggler timeout the fast workers' rounds close without the slow one; with SSP they run
ahead of it by at most the staleness bound and no further. The slow worker is a real process (it
sleeps between steps: that is what makes it slow); the fast ones are threads of the test process
over real sockets. Every wait has a deadline; every process is reaped.
"""

from __future__ import annotations

import multiprocessing as mp
import time

import numpy as np
import pytest

import pslink
from pslink.core.service import Service
from tests.helpers import run_workers

pytestmark = pytest.mark.integration

SLOW_VALUE = 100.0


def slow_worker(master, job, rank, workers, options, period, pushed, stop):
    """Push ``SLOW_VALUE`` every ``period`` s until ``stop``; ``pushed`` counts the pushes issued
    (incremented before each is sent, so a round it closed is always counted)."""
    with pslink.connect(job, rank, workers, master=master, timeout=60, **options) as agent:
        agent.init("w", np.zeros(4, np.float32)).wait()
        while not stop.is_set():
            with pushed.get_lock():
                pushed.value += 1
            agent.pushpull("w", np.full(4, SLOW_VALUE, np.float32)).wait()
            stop.wait(period)


def run_against_a_slow_worker(job, fast_count, options, fast_step, period=5.0, steps=12):
    """``fast_count`` fast workers (ranks 0..) and one slow process (the last rank); each fast
    worker runs ``fast_step(agent, step, pushed)`` ``steps`` times; the slow one steps every ``period`` s. Returns the fast workers' results and the
    slow process's push count at the end."""
    context = mp.get_context("spawn")
    pushed, stop = context.Value("i", 0), context.Event()
    with Service(aggregators=2) as service:
        slow = context.Process(target=slow_worker, args=(service.address, job, fast_count, fast_count + 1, options,
                                                        period, pushed, stop))
        slow.start()
        try:
            def worker(rank):
                with pslink.connect(job, rank, fast_count + 1, master=service.address, timeout=60, **options) as agent:
                    agent.init("w", np.zeros(4, np.float32)).wait()
                    return [fast_step(agent, step, pushed) for step in range(steps)]

            results = run_workers(fast_count, worker, timeout=120)
        finally:
            stop.set()
            slow.join(30)
            if slow.is_alive():
                slow.kill()
                slow.join(10)
    assert slow.exitcode == 0, f"the slow worker failed with exit code {slow.exitcode}"
    return results, pushed.value


def test_a_slow_worker_process_does_not_hold_bsp_rounds_past_the_straggler_timeout():
    timeout = 0.3

    def step(agent, _step, _pushed):
        started = time.monotonic()
        out = agent.pushpull("w", np.ones(4, np.float32), average=True).wait(timeout=30)
        return time.monotonic() - started, float(out[0])

    results, pushed = run_against_a_slow_worker("straggler", 2, {"straggler_timeout": timeout}, step)
    durations = [d for r in results for d, _ in r]
    # The slow worker steps every 5 s; a round waiting for it would take that long. The bound
    # here leaves room for a loaded machine and is still far below it.
    assert max(durations) < 2.5, f"a round waited {max(durations):.2f} s for the slow worker"
    assert min(durations) >= 0.0
    # The average is over those who came: the two fast workers, or all three when the slow one
    # happened to be on time for a round.
    values = {v for r in results for _, v in r}
    assert values <= {1.0, (2 + SLOW_VALUE) / 3}, values
    assert 1.0 in values
    assert pushed < 12  # it really was slower than the rounds the others completed


def test_ssp_fast_worker_runs_ahead_of_a_slow_worker_process_by_the_bound_and_no_further():
    staleness = 3

    def step(agent, _step, pushed):
        handle = agent.pushpull("w", np.ones(4, np.float32))
        handle.wait(timeout=30)
        # round r is answered only once round r - staleness closed, which needs the slow push
        # of that round: counted before it was sent
        return handle.round - pushed.value

    results, _ = run_against_a_slow_worker("ssp", 1, {"sync": "ssp", "staleness": staleness}, step,
                                           period=0.5, steps=8)
    (leads,) = results
    assert max(leads) <= staleness, leads
    assert max(leads) == staleness  # it did run ahead, as far as allowed
