"""How long a reactor polls before it blocks: learned from the gaps between its bursts of I/O.

Spinning (polling without blocking) saves the 50-100 us that waking a blocked thread costs on
these virtual machines, which matters when the next message comes within a round trip: a small
request answered and the next one arriving. It is pure waste when the next message is
milliseconds away, as between the gradient buckets of a training step: an Aggregator that spins
2 ms after every burst burns a core that the workers beside it need (measured: about 5% of a
DDP step on 2 vCPUs). So the window follows the gaps seen lately: a few times their median,
never more than the configured spin, and almost nothing while the gaps mostly outlast it.
"""

from __future__ import annotations

import collections


class SpinWindow:
    """Learns a reactor's spin window from the gaps between its bursts of I/O (pure: no clock)."""

    def __init__(self, history: int = 16, factor: float = 4.0, floor: float = 20e-6):
        self.factor = factor  # spin this many typical gaps: most of a burst's gaps end within it
        self.floor = floor  # the least window: a poll or two, to catch what is already on its way
        self._gaps: collections.deque = collections.deque(maxlen=history)
        self._since_update = 0
        self._typical: float | None = None  # median of the recent gaps; None while still learning

    def record(self, gap: float) -> None:
        """The reactor was idle ``gap`` seconds before its last I/O event."""
        self._gaps.append(gap)
        self._since_update += 1
        # A median of a few gaps every few events: cheap enough for every small request.
        if self._since_update >= self._gaps.maxlen // 4 and len(self._gaps) >= self._gaps.maxlen // 2:
            ordered = sorted(self._gaps)
            self._typical = ordered[len(ordered) // 2]
            self._since_update = 0

    def window(self, spin: float) -> float:
        """How long to spin now, given the configured most ``spin`` (seconds)."""
        typical = self._typical
        if spin <= 0 or typical is None:
            return spin  # nothing learnt yet: as configured
        if typical >= spin:
            return min(spin, self.floor)  # the gaps mostly outlast any spin: block almost at once
        return min(spin, max(self.floor, self.factor * typical))
