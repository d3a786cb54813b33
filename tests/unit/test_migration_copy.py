"""When a migration's copy leaves its Aggregator, and what the target prepares for it (pure)."""

from __future__ import annotations

import numpy as np
import pytest

from pslink.core.wire.protocol import Op
from pslink.core.aggregator.moves import MAX_COPY_IDLE_WAIT, copy_delay
from pslink.core.aggregator.tasks import CopyOut
from pslink.core.memory import BufferPool

from test_aggregator_core import Cluster, migrate


class Clock:
    def __init__(self, now=100.0):
        self.now = now

    def __call__(self):
        return self.now


def cluster_with_rounds(opened: list[float]) -> tuple[Cluster, Clock]:
    """A 1-worker BSP task whose rounds 1.. opened at the times in ``opened``."""
    c = Cluster(workers=1, needs_init=False)
    clock = c.core.clock = Clock()
    for r, when in enumerate(opened, start=1):
        clock.now = when
        c.send(Op.PUSHPULL, 0, r, np.full(6, 1.0))
    return c, clock


def test_the_round_gap_is_the_time_between_the_last_two_rounds():
    c, _ = cluster_with_rounds([100.0, 100.4, 100.9])
    assert c.task.last_opened == 100.9 and c.task.round_gap == pytest.approx(0.5)


def test_a_copy_at_a_round_end_may_wait_half_an_iteration_for_quiet():
    c, clock = cluster_with_rounds([100.0, 100.4])
    clock.now = 100.8
    c.send(Op.PUSH, 0, 3, np.full(6, 1.0))
    target, outputs = migrate(c)
    assert outputs == []  # BSP: the task moves when round 3 closes; with one worker it has closed
    # round 4 opens and closes: the hand-over comes with it
    clock.now = 101.2
    _, outputs = c.send(Op.PUSHPULL, 0, 4, np.full(6, 1.0))
    (out,) = [o for o in outputs if isinstance(o, CopyOut)]
    assert out.idle_wait == pytest.approx(0.2)  # half of the 0.4 s the worker takes to come round


def test_a_long_iteration_waits_at_most_the_cap_and_a_forced_move_not_at_all():
    c, clock = cluster_with_rounds([100.0, 110.0])
    clock.now = 120.0
    migrate(c)
    _, outputs = c.send(Op.PUSHPULL, 0, 3, np.full(6, 1.0))
    (out,) = [o for o in outputs if isinstance(o, CopyOut)]
    assert out.idle_wait == MAX_COPY_IDLE_WAIT
    forced, _ = cluster_with_rounds([100.0, 100.4])
    _, outputs = migrate(forced, force=True)  # an idle task handed over at once
    (out,) = [o for o in outputs if isinstance(o, CopyOut)]
    assert out.idle_wait == 0.0


def test_a_task_without_a_known_iteration_sends_its_copy_at_once():
    c, clock = cluster_with_rounds([])
    migrate(c)
    _, outputs = c.send(Op.PUSHPULL, 0, 1, np.full(6, 1.0))  # its first round: no gap known yet
    (out,) = [o for o in outputs if isinstance(o, CopyOut)]
    assert out.idle_wait == 0.0


def test_copy_delay_waits_for_quiet_or_the_deadline():
    # idle_wait 0.5: quiet means 0.25 s without a message; due at 8.5 at the latest
    assert copy_delay(8.0, last_message=8.0, deadline=8.5, idle_wait=0.5) == 0.25
    assert copy_delay(8.125, last_message=8.0, deadline=8.5, idle_wait=0.5) == 0.125
    assert copy_delay(8.25, last_message=8.0, deadline=8.5, idle_wait=0.5) == 0.0  # quiet long enough
    assert copy_delay(8.375, last_message=8.25, deadline=8.5, idle_wait=0.5) == 0.125  # due before quiet
    assert copy_delay(8.5, last_message=8.375, deadline=8.5, idle_wait=0.5) == 0.0  # due, busy or not
    assert copy_delay(8.0, last_message=8.0, deadline=8.0, idle_wait=0.0) == 0.0  # no wait asked


def test_an_incoming_task_has_its_buffers_warm_and_uses_them():
    c, _ = cluster_with_rounds([100.0, 100.4])
    target, _ = migrate(c)
    task = next(iter(target.tasks.values()))
    assert len(task.pool._arrays) == 2
    assert all(a.shape == (6,) and not a.any() for a in task.pool._arrays)
    warm = [id(a) for a in task.pool._arrays]
    assert id(task.pool.acquire()) in warm  # the first push needs no new array


def test_warming_a_pool_respects_what_it_keeps():
    pool = BufferPool(np.dtype(np.float32), 10, keep=1)
    pool.warm(3)
    assert len(pool._arrays) == 1
    pool.warm(3)
    assert len(pool._arrays) == 1
