"""The ``thread`` provider: Aggregators inside this process (in-process clusters, tests)."""

from __future__ import annotations

from pslink.core.aggregator import Aggregator
from pslink.core.service.providers.base import Provider
from pslink.core.transport import Transports


class ThreadProvider(Provider):
    """Each Aggregator runs its loop on a thread of this process; share ``transports`` with
    pMaster and the Agents so that ``inproc://`` addresses resolve."""

    def __init__(self, master: str, transports: Transports, listen: str = "tcp://127.0.0.1:0", **options):
        super().__init__()
        self.master = master
        self.transports = transports
        self.listen = listen
        # Spinning pays only for a thread that has its process to itself; here it would fight
        # every other thread of the process for the GIL.
        options.setdefault("spin", 0.0)
        self.options = options
        self.aggregators: dict[str, Aggregator] = {}

    def start(self, count: int) -> list[str]:
        names = []
        for _ in range(count):
            name = self.next_name()
            listen = self.listen
            if listen.startswith("inproc://"):
                listen = f"inproc://{name}"
            self.aggregators[name] = Aggregator(
                self.master, listen, name=name, transports=self.transports, credential=self.credential, **self.options
            ).start()
            names.append(name)
        return names

    def stop(self, name: str, timeout: float = 5.0) -> None:
        aggregator = self.aggregators.pop(name, None)
        if aggregator is not None:
            aggregator.stop()

    def names(self) -> list[str]:
        return list(self.aggregators)
