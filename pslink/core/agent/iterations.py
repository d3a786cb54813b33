"""An Agent's sense of iterations: their durations, for pMaster's profiler (sent with heartbeats),
and the step count a timeline's window is made of."""

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

    def pushed(self, keys: list) -> None:
        if self._reference_key is None:
            self._reference_key = keys[0]
        if self._reference_key in keys:
            now = self.clock()
            if self._reference_time is not None:
                self._durations.append(now - self._reference_time)
                del self._durations[:-KEEP]
            self._reference_time = now
        if self.timeline is not None:
            self.timeline.pushed(keys)

    def take(self) -> list[float]:
        """The durations measured since the last call."""
        with self._lock:
            durations, self._durations = self._durations, []
        return durations
