"""Logging of bad input that a flood cannot turn into a flood of log lines (and a full disk).

:class:`Throttled` writes at most one line per peer host and kind of trouble per interval, and
says how many it held back since its last line; callers count every event themselves (status
shows the counts)."""

from __future__ import annotations

import logging
import time

INTERVAL = 10.0
MAX_KEYS = 1024  # distinct (host, kind) remembered; past it the memory starts over


def peer_host(peer: str) -> str:
    """``tcp://1.2.3.4:5678`` -> ``tcp://1.2.3.4``; ``local://127.0.0.1:7770#12`` -> ``local://127.0.0.1:7770``:
    one attacker reconnecting is one peer."""
    return peer.split("#", 1)[0] if peer.startswith("local://") else peer.rsplit(":", 1)[0]


class Throttled:
    def __init__(self, logger: logging.Logger, interval: float = INTERVAL, clock=time.monotonic):
        self.logger, self.interval, self.clock = logger, interval, clock
        self._last: dict[tuple[str, str], list] = {}  # (host, kind) -> [time of the last line, held back]

    def warning(self, peer: str, kind: str, message: str, *args) -> bool:
        """Log ``message % args`` unless a line about ``kind`` from ``peer``'s host was written
        within the interval; returns whether it was written."""
        key = (peer_host(peer), kind)
        now = self.clock()
        entry = self._last.get(key)
        if entry is not None and now - entry[0] < self.interval:
            entry[1] += 1
            return False
        if entry is None and len(self._last) >= MAX_KEYS:
            self._last.clear()
        held = entry[1] if entry is not None else 0
        suffix = f" ({held} more like it from {key[0]} not logged)" if held else ""
        self.logger.warning(message + suffix, *args)
        self._last[key] = [now, 0]
        return True
