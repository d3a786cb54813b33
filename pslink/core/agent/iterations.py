"""An Agent's sense of iterations: their durations and the worker's own work in them, for
pMaster's profiler and guard (sent with heartbeats), and the step count a timeline's window is
made of."""

from __future__ import annotations

import threading
from typing import Any

from pslink.core.observe.timeline import Timeline

KEEP = 1000  # durations kept between heartbeats (pMaster missed a few: the latest count)


class Iterations:
    """``pushed(keys)`` on every push, under ``lock`` (the Agent's, held there already). The first
    key this worker pushes is pushed once per iteration, so the time between its pushes is the
    iteration's duration."""

    def __init__(self, clock, timeline: Timeline | None, lock: threading.Lock):
        self.clock = clock
        self.timeline = timeline
        self._lock = lock
        self._reference_key: Any = None
        self._reference_time: float | None = None
        self._durations: list[float] = []
        # The worker's own work in an iteration: its duration less the time its threads blocked
        # in wait() (the communication it did not hide). Reported only once a wait was measured:
        # a job that waits elsewhere (DDP's hook: torch waits on its futures) reports none, and
        # pMaster then judges its iterations whole, as before.
        self._work: list[float] = []
        self._waited = 0.0
        self._waits_seen = False
        self._wait_lock = threading.Lock()

    def pushed(self, keys: list) -> None:
        if self._reference_key is None:
            self._reference_key = keys[0]
        if self._reference_key in keys:
            now = self.clock()
            with self._wait_lock:
                waited, self._waited = self._waited, 0.0
            if self._reference_time is not None:
                duration = now - self._reference_time
                self._durations.append(duration)
                self._work.append(max(0.0, duration - waited))
                del self._durations[:-KEEP], self._work[:-KEEP]
            self._reference_time = now
        if self.timeline is not None:
            self.timeline.pushed(keys)

    def waited(self, seconds: float) -> None:
        """A thread of the worker blocked ``seconds`` in ``wait()``."""
        with self._wait_lock:
            self._waited += seconds
            self._waits_seen = self._waits_seen or seconds > 0

    def take(self) -> tuple[list[float], list[float]]:
        """The durations measured since the last call, and the own work in each (an empty list
        while no wait has been measured)."""
        with self._lock:
            durations, self._durations = self._durations, []
            work, self._work = self._work, []
        return durations, work if self._waits_seen else []
