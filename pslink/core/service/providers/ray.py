"""The ``ray`` provider: each Aggregator is a Ray actor that reserves its CPU, on any node.

pMaster asks Ray to start and stop them; Ray places them on the cluster's nodes by their CPU
reservation, so the Aggregator pool spans machines without pslink knowing the machines. Each actor
runs one Aggregator, listening on its node's address and registering with pMaster like any other.

    Service(provider="ray", provider_options={"address": "auto"})   # an existing Ray cluster
"""

from __future__ import annotations

import logging
import os

from pslink.core.service.providers.base import Provider
from pslink.errors import ConfigError

log = logging.getLogger(__name__)


def _ray():
    try:
        import ray
    except ImportError:
        raise ConfigError("the ray provider needs Ray: pip install 'pslink[ray]'") from None
    return ray


class _AggregatorActor:
    """Runs inside the actor's process: one Aggregator on a thread of it, listening on the
    node's address (the one Ray's nodes reach each other at) unless ``listen_host`` is given."""

    def __init__(self, master: str, name: str, listen_host: str | None, orphan_timeout: float,
                 credential: str | None = None):
        from pslink.core.aggregator import Aggregator
        from pslink.core.memory import keep_freed_memory

        keep_freed_memory()  # the actor's process is the Aggregator's own
        if listen_host is None:
            import ray

            listen_host = ray.util.get_node_ip_address()
        self.aggregator = Aggregator(master, f"tcp://{listen_host}:0", name=name, orphan_timeout=orphan_timeout,
                                     credential=credential)
        self.aggregator.start()

    def address(self) -> str:
        return self.aggregator.address

    def pid(self) -> int:
        return os.getpid()

    def stop(self) -> bool:
        self.aggregator.stop()
        return True


class RayProvider(Provider):
    """Aggregators as Ray actors of ``cpus`` CPUs each.

    ``address``: the Ray cluster to join (``"auto"``, ``"ray://..."``); None starts or reuses a
    local Ray instance with ``init_options``. ``listen_host``: the address Aggregators bind and
    advertise (None: each actor's node address).
    """

    def __init__(self, master: str, address: str | None = None, cpus: float = 1.0, listen_host: str | None = None,
                 orphan_timeout: float = 60.0, init_options: dict | None = None, namespace: str = "pslink"):
        super().__init__()
        ray = _ray()
        self.master = master
        self.cpus = cpus
        self.listen_host = listen_host
        self.orphan_timeout = orphan_timeout
        self._started_ray = False
        if not ray.is_initialized():
            ray.init(address=address, namespace=namespace, log_to_driver=False, **(init_options or {}))
            self._started_ray = True
        self._actor_class = ray.remote(_AggregatorActor)
        self._actors: dict = {}

    def start(self, count: int) -> list[str]:
        names = []
        for _ in range(count):
            name = self.next_name()
            # The CPU reservation is the point: Ray schedules the Aggregator where a CPU is free
            # and keeps other work off it. SPREAD puts them on every node in turn (where the
            # CPUs allow): the pool spans the cluster's NICs, and a node lost takes few of them.
            self._actors[name] = self._actor_class.options(
                num_cpus=self.cpus, name=f"pslink-{name}-{os.getpid()}", scheduling_strategy="SPREAD",
            ).remote(self.master, name, self.listen_host, self.orphan_timeout, self.credential)
            names.append(name)
        return names

    def stop(self, name: str, timeout: float = 5.0) -> None:
        ray = _ray()
        actor = self._actors.pop(name, None)
        if actor is None:
            return
        try:
            ray.get(actor.stop.remote(), timeout=timeout)
        except Exception as exc:  # the actor died already, or hangs: kill it regardless
            log.warning("ray provider: %s did not stop cleanly (%s)", name, exc)
        ray.kill(actor, no_restart=True)

    def names(self) -> list[str]:
        return list(self._actors)

    def pid(self, name: str) -> int | None:
        actor = self._actors.get(name)
        return None if actor is None else _ray().get(actor.pid.remote(), timeout=10)

    def diagnose(self, name: str) -> str:
        actor = self._actors.get(name)
        if actor is None:
            return f"{name}: not started"
        try:
            return f"{name}: actor alive, address {_ray().get(actor.address.remote(), timeout=5)}"
        except Exception as exc:
            return f"{name}: actor not answering ({exc})"

    def close(self) -> None:
        """Stop every actor, and Ray itself if this provider started it."""
        self.stop_all()
        if self._started_ray:
            _ray().shutdown()
            self._started_ray = False

