"""Several pMaster addresses, of which the one that answers leads.

A pMaster may have a standby (``pslink master --standby``) that listens on its own address only
once it took over, and a pMaster that steps down closes its listener and every connection. So
Agents, Aggregators and the control tools may be given every address, as a comma list
(``tcp://10.77.0.2:7770,tcp://10.77.0.3:7770``, in ``master=``, ``--master`` or
``PSLINK_MASTER``), and follow whichever answers: a connection is made to the first address that
accepts one, starting with the address that answered last; after losing that pMaster (its
connection closed, or it went silent) the next connection starts at the address after it, round
and round. One address behaves as it always did.

A leaf of the core, as :mod:`pslink.core.config` is: it imports no transport, not even for its
annotations (the caller's transports, loop and handler are handed in).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, TypeVar

from pslink.errors import ConfigError, PeerError

T = TypeVar("T")

# Schemes whose address is a name or a path, not host:port.
NAMED_SCHEMES = ("inproc", "zmq+ipc")
SCHEME_HINT = "use tcp://host:port, zmq+tcp://host:port or inproc://name"


def _entry_problem(entry: str) -> str | None:
    """Why ``entry`` is not a pMaster address (None when it is one)."""
    scheme, sep, rest = entry.partition("://")
    if not sep or not scheme:
        return f"{entry!r} has no scheme; {SCHEME_HINT}"
    if not rest:
        return f"{entry!r} names no host"
    if scheme in NAMED_SCHEMES:
        return None
    host, colon, port = rest.rpartition(":")
    if not colon or not host.strip("[]"):
        return f"{entry!r} is not {scheme}://host:port"
    if not port.isdigit() or not 0 <= int(port) < 65536:
        return f"{entry!r}: port {port!r} is not a port number"
    return None


class MasterAddresses:
    """The pMaster addresses a client was given, and which of them answered last."""

    def __init__(self, addresses: tuple[str, ...] | list[str]):
        if not addresses:
            raise ConfigError("no pMaster address given")
        self.addresses = tuple(addresses)
        self._current = 0  # the index a connection is tried at first
        self._lock = threading.Lock()  # the Agent connects from its own threads, and loses on the reactor's

    @classmethod
    def parse(cls, text: str, setting: str = "master") -> MasterAddresses:
        """``text``, a comma list of addresses (spaces around each ignored); a ConfigError naming
        the bad entry and the whole ``setting`` when one is empty or not ``scheme://host:port``."""
        if not isinstance(text, str) or not text.strip():
            raise ConfigError(f"{setting} must name pMaster's address (scheme://host:port), got {text!r}")
        entries = [entry.strip() for entry in text.split(",")]
        for position, entry in enumerate(entries, 1):
            problem = f"entry {position} is empty" if not entry else _entry_problem(entry)
            if problem is not None:
                hint = "" if len(entries) == 1 else " (several pMasters: tcp://host1:port,tcp://host2:port)"
                raise ConfigError(f"{setting}={text!r}: {problem}{hint}")
        if len(set(entries)) != len(entries):
            twice = next(entry for entry in entries if entries.count(entry) > 1)
            raise ConfigError(f"{setting}={text!r}: {twice!r} is given twice")
        return cls(entries)

    @property
    def several(self) -> bool:
        return len(self.addresses) > 1

    @property
    def current(self) -> str:
        """The address a connection is tried at first: the one that answered last."""
        with self._lock:
            return self.addresses[self._current]

    def __str__(self) -> str:
        return ",".join(self.addresses)

    def __len__(self) -> int:
        return len(self.addresses)

    def lost(self, address: str) -> None:
        """pMaster at ``address`` went away or silent: the next connection starts at the address
        after it (nothing changes when another one answered since)."""
        with self._lock:
            if self.addresses[self._current] == address:
                self._current = (self._current + 1) % len(self.addresses)

    def connect(self, transports: Any, reactor: Any, handler: Any, limits: Any, timeout: float) -> tuple[Any, str]:
        """A connection to the first address that accepts one (each try bounded by ``timeout``),
        and that address; a PeerError naming every address and why each failed when none does."""
        return self.dial(lambda address: transports.connect(address, reactor, handler, limits, timeout))

    def dial(self, attempt: Callable[[str], T]) -> tuple[T, str]:
        """``attempt(address)`` at each address in turn, from the current one, until one does not
        raise PeerError; its result and the address. A single address's error is raised as it
        is; otherwise one that names each address and its failure."""
        with self._lock:
            start = self._current
        count = len(self.addresses)
        failures: list[tuple[str, PeerError]] = []
        for step in range(count):
            index = (start + step) % count
            address = self.addresses[index]
            try:
                result = attempt(address)
            except PeerError as exc:
                failures.append((address, exc))
                continue
            with self._lock:
                self._current = index
            return result, address
        if count == 1:
            raise failures[0][1]
        reasons = "; ".join(exc.message if address in exc.message else f"{address}: {exc.message}"
                            for address, exc in failures)
        raise PeerError(f"no pMaster accepts a connection at any of {', '.join(self.addresses)}: {reasons}",
                        peer=str(self))
