"""A whole parameter service in one object: pMaster plus a pool of Aggregators.

``pslink service up`` runs one in the foreground; ``pslink demo`` and the tests embed one::

    with Service(aggregators=2) as service:
        agent = pslink.connect("job", 0, 1, master=service.address)
"""

from __future__ import annotations

import logging

from pslink.core import hosts
from pslink.core.credentials import AGGREGATOR, ServiceCredentials, derive
from pslink.core.master import Master
from pslink.core.service.providers import LocalProvider, Provider, ThreadProvider
from pslink.core.transport import Transports
from pslink.errors import ServiceError

log = logging.getLogger(__name__)


class Service:
    """pMaster (on a thread of this process) and ``aggregators`` Aggregators.

    ``provider="local"`` runs Aggregators as subprocesses, ``"ray"`` as Ray actors (on any node of
    a Ray cluster; ``provider_options`` go to :class:`~pslink.core.service.providers.ray.RayProvider`),
    ``"thread"`` inside this process (then ``aggregator_listen`` may be ``inproc://*`` for a
    socket-free cluster).
    """

    def __init__(
        self,
        listen: str = "tcp://127.0.0.1:0",
        aggregators: int = 2,
        *,
        provider: str = "local",
        state_dir: str | None = None,
        log_dir: str | None = None,
        transports: Transports | None = None,
        aggregator_listen: str | None = None,
        master_options: dict | None = None,
        aggregator_options: dict | None = None,
        control: dict | None = None,
        provider_options: dict | None = None,
        advertise: str | None = None,
        interface: str | None = None,
        secret: bytes | None = None,
        allow_first_join: bool = False,
        standbys: list[str] | None = None,
    ):
        """``secret``: the service secret (:mod:`pslink.core.credentials`): pMaster then requires
        the credentials it derives, and the Aggregators started here get theirs; None: an open
        service (tests, one user's machine). ``allow_first_join``: workers may create a job by
        joining from any host (else only from pMaster's). ``standbys``: the addresses of the
        pMasters standing by to take over (a state shared in Redis): the Aggregators started here
        follow whichever leads."""
        if aggregators < 1:
            raise ServiceError(f"a service needs at least one Aggregator, got {aggregators}")
        self.count = aggregators
        self.transports = transports or Transports()
        self._own_transports = transports is None
        advertise, interface = hosts.settings(advertise, interface)
        credentials = ServiceCredentials(secret, allow_first_join) if secret is not None else None
        self.master = Master(listen, state_dir=state_dir, transports=self.transports, control=control,
                             advertise=advertise, interface=interface, credentials=credentials, **(master_options or {}))
        self.address = self.master.address
        # What Aggregators and workers are given: this pMaster, then those that may take over.
        self.addresses = ",".join([self.address, *(standbys or [])])
        if provider == "local":
            # Aggregators on pMaster's host bind where pMaster did (every address, or the one it
            # was given) and advertise as it does: reachable from wherever pMaster is.
            bound = self.master.listener.address
            host = hosts.host_of(bound) if bound.startswith(("tcp://", "zmq+tcp://")) else "127.0.0.1"
            self.provider: Provider = LocalProvider(self.addresses, listen_host=host, log_dir=log_dir,
                                                    advertise=advertise, interface=interface,
                                                    **(aggregator_options or {}))
        elif provider == "ray":
            from pslink.core.service.providers.ray import RayProvider

            self.provider = RayProvider(self.addresses, **(provider_options or {}))
        elif provider == "thread":
            default_listen = "inproc://*" if self.address.startswith("inproc://") else "tcp://127.0.0.1:0"
            self.provider = ThreadProvider(self.address, self.transports, aggregator_listen or default_listen,
                                           **(aggregator_options or {}))
        else:
            raise ServiceError(f"unknown provider {provider!r}; use 'local', 'ray' or 'thread'")
        self.provider.credential = derive(secret, AGGREGATOR) if secret is not None else None
        # The pool grows and shrinks with load, never below what was asked for here.
        self.master.use_provider(self.provider, min_aggregators=(control or {}).get("min_aggregators", aggregators))
        self._started = False
        self._stopped = False
        # How long a restarted service waits for the Aggregators it knew before starting others:
        # two of their attempts, each at worst a connect that times out (2 s), the retry pause
        # (0.5 s) and pMaster's dial-back (3 s). 5 s, one attempt's worth, was too short under
        # load (a CI run once found a known Aggregator replaced after a restart).
        self.rejoin_window = 12.0

    def start(self, timeout: float = 30.0) -> "Service":
        """Start pMaster and the Aggregators; return once every Aggregator registered."""
        # The Aggregators the store knows, named before pMaster runs: its first sweep fails over
        # those a dead pMaster had lost already, and their names must stay taken all the same.
        known = {name: record.address for name, record in self.master.state.aggregators.items()}
        self.master.start()
        self._started = True
        try:
            adopted = self._adopt(known, timeout)
            names = self.provider.start(max(0, self.count - len(adopted)))
            self.wait_for(names, timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _adopt(self, known: dict[str, str], timeout: float) -> list[str]:
        """After a restart from ``state_dir``: the Aggregators the store knows (``known``: name ->
        address) keep running (they serve jobs while pMaster is away and reconnect to it), so
        wait for them rather than start as many again; those that do not come back are failed
        over by pMaster. One without an address was lost before the restart: not waited for.
        Returns the ones that came back. A fresh service knows none and returns at once."""
        if not known:
            return []
        self.provider.reserve(known)  # new Aggregators must not take a name an old one has
        running = sorted(name for name, address in known.items() if address)
        self.master.wait_for_aggregators(running, min(timeout, self.rejoin_window))
        return [n for n in running if self.master.aggregator_alive(n)]

    def wait_for(self, names: list[str], timeout: float) -> None:
        if not self.master.wait_for_aggregators(names, timeout):
            missing = [n for n in names if not self.master.aggregator_alive(n)]
            details = "\n".join(self.provider.diagnose(n) for n in missing)
            raise ServiceError(f"aggregator(s) {missing} did not register within {timeout} s\n{details}")

    def add_aggregators(self, count: int, timeout: float = 30.0) -> list[str]:
        names = self.provider.start(count)
        self.wait_for(names, timeout)
        return names

    def stop(self) -> None:
        """Stop everything this service started (idempotent)."""
        if self._stopped:
            return
        self._stopped = True
        if self._started:
            self.master.stop(shutdown_aggregators=True)
        if isinstance(self.provider, LocalProvider):
            self.provider.wait_exit(5.0)
        self.provider.close()
        if self._own_transports:
            self.transports.close()

    def __enter__(self) -> "Service":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
