"""What pMaster needs from whatever starts Aggregators."""

from __future__ import annotations

import abc


class Provider(abc.ABC):
    """Starts and stops Aggregators that register with one pMaster."""

    @abc.abstractmethod
    def start(self, count: int) -> list[str]:
        """Start ``count`` Aggregators; return their names (they register under these)."""

    @abc.abstractmethod
    def stop(self, name: str, timeout: float = 5.0) -> None:
        """Stop one Aggregator and make sure it is gone."""

    @abc.abstractmethod
    def names(self) -> list[str]:
        """The Aggregators this provider started and that have not been stopped."""

    def __init__(self):
        self._reserved: set[str] = set()
        self._serial = 0
        # The service's Aggregator credential, given to each Aggregator started (None: an open service).
        self.credential: str | None = None

    def reserve(self, names) -> None:
        """Names already taken by Aggregators this provider did not start (a restarted service's,
        or one an operator joined): it never starts another under them."""
        self._reserved.update(names)

    def next_name(self) -> str:
        """``agg-N`` for the next Aggregator: the lowest N from here on not in use or reserved."""
        taken = set(self.names()) | self._reserved
        while f"agg-{self._serial}" in taken:
            self._serial += 1
        self._serial += 1
        return f"agg-{self._serial - 1}"

    def stop_all(self, timeout: float = 10.0) -> None:
        for name in list(self.names()):
            self.stop(name, timeout)

    def close(self) -> None:
        """Stop everything this provider started (and whatever it runs on, if it started that)."""
        self.stop_all()

    def diagnose(self, name: str) -> str:
        """Whatever helps explain why ``name`` failed (exit status, log tail)."""
        return ""
