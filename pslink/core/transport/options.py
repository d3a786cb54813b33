"""How a process's connections reach peers on its own host: :class:`TransportOptions`.

The options are given to :class:`~pslink.core.transport.Transports` (and from it to each
listener and connection) by whoever makes it; :func:`transport_options` reads them from the
environment (``PSLINK_LOCAL_SOCKETS``, ``PSLINK_SHM``, ``PSLINK_SHM_RING_MIB``,
``PSLINK_SHM_WAIT_MS``, and TLS's and CURVE's variables) once, when a ``Transports`` is made
without options.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import platform
import sys

from pslink.core.config import env_number, env_value
from pslink.core.transport import curve, tls
from pslink.core.transport.curve import CurveSettings
from pslink.core.transport.tls import TlsSettings
from pslink.errors import ConfigError

log = logging.getLogger(__name__)

ENV_LOCAL_SOCKETS = "PSLINK_LOCAL_SOCKETS"
ENV_ALLOWED_UIDS = "PSLINK_ALLOWED_UIDS"
ENV_SHM = "PSLINK_SHM"
ENV_SHM_RING_MIB = "PSLINK_SHM_RING_MIB"
ENV_SHM_WAIT_MS = "PSLINK_SHM_WAIT_MS"

DEFAULT_RING_BYTES = 16 << 20  # four 4 MiB parts in flight per direction before falling back
MAX_RING_BYTES = 1 << 30  # the largest ring a receiver maps
DEFAULT_RING_WAIT = 0.02  # how long a sender may wait for room before its payload takes the socket
MAX_RING_WAIT = 60.0


def rings_supported() -> bool:
    """Whether this platform can carry payloads through shared-memory rings: a ring's counter is
    read without fences, which x86-64's memory order allows (see shm.py), and made with memfd."""
    return (
        sys.platform.startswith("linux")
        and hasattr(os, "memfd_create")
        and platform.machine().lower() in ("x86_64", "amd64")
    )


def local_sockets_supported() -> bool:
    """Whether listeners can have an abstract Unix socket beside them (Linux only)."""
    return sys.platform.startswith("linux")


@dataclasses.dataclass(frozen=True)
class TransportOptions:
    """``local_sockets``: reach peers of this host (and network namespace) over a Unix socket
    beside each TCP port; ``rings``: send large payloads to them through shared-memory rings;
    ``ring_bytes``: the size of each ring; ``ring_wait``: seconds a payload waits for room in a
    full ring before it takes the socket (0: never waits); ``tls``: TLS settings for TCP
    (:class:`~pslink.core.transport.tls.TlsSettings`); ``allowed_uids``: users besides this
    process's own (and root) whose processes may use the local socket (and so hand over rings);
    everyone else's are refused there and reach the listener over TCP. Where the platform cannot,
    local sockets and rings are off whatever the options say."""

    local_sockets: bool = True
    rings: bool = True
    ring_bytes: int = DEFAULT_RING_BYTES
    ring_wait: float = DEFAULT_RING_WAIT
    allowed_uids: frozenset = frozenset()
    tls: TlsSettings | None = None  # TCP (not same-host sockets) encrypted, both ends authenticated (tls.py)
    curve: CurveSettings | None = None  # zmq+tcp:// encrypted and authenticated by CURVE (curve.py)

    def __post_init__(self):
        if not isinstance(self.ring_bytes, int) or not 1 << 20 <= self.ring_bytes <= MAX_RING_BYTES:
            raise ConfigError(f"ring_bytes must be a whole number of bytes from 1 MiB to {MAX_RING_BYTES >> 20} MiB, "
                              f"got {self.ring_bytes!r}")
        if not isinstance(self.ring_wait, (int, float)) or not 0 <= self.ring_wait <= MAX_RING_WAIT:
            raise ConfigError(f"ring_wait must be from 0 to {MAX_RING_WAIT:g} seconds, got {self.ring_wait!r}")

    def may_share_host(self, uid: int) -> bool:
        """Whether a same-host peer running as ``uid`` may use the local socket and rings."""
        return uid in (0, os.geteuid()) or uid in self.allowed_uids

    @property
    def uses_local_sockets(self) -> bool:
        return self.local_sockets and local_sockets_supported()

    @property
    def uses_rings(self) -> bool:
        """Whether this process makes rings (it takes a peer's ring in any case)."""
        return self.rings and rings_supported()


def transport_options(environ=os.environ) -> TransportOptions:
    """The :class:`TransportOptions` the environment asks for.

    ``PSLINK_LOCAL_SOCKETS=0``: peers on this host talk TCP; ``PSLINK_ALLOWED_UIDS``: other users
    (ids, comma-separated) whose processes may use this host's local sockets and rings;
    ``PSLINK_SHM=0``: no shared-memory rings; ``PSLINK_SHM_RING_MIB``: each ring's size; ``PSLINK_SHM_WAIT_MS``: how long a payload
    waits for ring room. A malformed ring size or wait is logged and turns off what it sets (no
    rings; no waiting), as a setting a running service meets must not stop it."""
    rings = (env_value(ENV_SHM, environ) or "1").strip() != "0"
    ring_bytes, ring_wait = DEFAULT_RING_BYTES, DEFAULT_RING_WAIT
    try:
        mib = env_number(ENV_SHM_RING_MIB, int, "a whole number of MiB", 1, MAX_RING_BYTES >> 20, environ)
        if mib is not None:
            ring_bytes = mib << 20
    except ConfigError as exc:
        log.warning("%s; large payloads stay on the socket (no shared-memory rings)", exc)
        rings = False
    try:
        ms = env_number(ENV_SHM_WAIT_MS, float, "a number of milliseconds", 0, 60_000, environ)
        if ms is not None:
            ring_wait = ms / 1000
    except ConfigError as exc:
        log.warning("%s; large payloads do not wait for ring room", exc)
        ring_wait = 0.0
    allowed = set()
    for part in (env_value(ENV_ALLOWED_UIDS, environ) or "").replace(",", " ").split():
        if part.isdigit():
            allowed.add(int(part))
        else:
            log.warning("%s: %r is not a user id; ignored (only the service's own user shares the host's "
                        "sockets and rings)", ENV_ALLOWED_UIDS, part)
    return TransportOptions(
        local_sockets=(env_value(ENV_LOCAL_SOCKETS, environ) or "1").strip() != "0",
        rings=rings, ring_bytes=ring_bytes, ring_wait=ring_wait, allowed_uids=frozenset(allowed),
        tls=tls.settings_from_env(environ), curve=curve.settings_from_env(environ),
    )
