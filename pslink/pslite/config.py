"""A ps-lite node's settings, from ps-lite's own environment variables.

A ps-lite deployment's settings carry over unchanged: ``DMLC_ROLE``, ``DMLC_PS_ROOT_URI``,
``DMLC_PS_ROOT_PORT``, ``DMLC_NUM_SERVER``, ``DMLC_NUM_WORKER``, ``DMLC_NODE_HOST``,
``DMLC_INTERFACE``, ``PORT``, ``PS_VERBOSE``, ``PS_HEARTBEAT_INTERVAL``, ``PS_HEARTBEAT_TIMEOUT``,
``PS_RESEND`` and ``PS_RESEND_TIMEOUT`` mean what they mean to ps-lite. pslink adds
``PSLINK_PSLITE_MODE`` (``classic``: the program's own servers; ``service``: the shared
Aggregator pool), ``PSLINK_PSLITE_RANK`` (the rank a node asks for, as ``pslink launch --pslite``
sets it), and in service mode ``PSLINK_MASTER`` and ``PSLINK_JOB``.

A missing or malformed value raises :class:`~pslink.errors.ConfigError` naming the variable.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import socket
from typing import Mapping

from pslink.core.config import DEFAULT_TIMEOUT, ENV_JOB, ENV_MASTER, ENV_TIMEOUT, ENV_TOKEN
from pslink.errors import ConfigError

ROLES = ("worker", "server", "scheduler")
MODES = ("classic", "service")
ENV_MODE = "PSLINK_PSLITE_MODE"
ENV_RANK = "PSLINK_PSLITE_RANK"
ENV_START_TIMEOUT = "PSLINK_PSLITE_START_TIMEOUT"
ENV_TABLE_WIDTH = "PSLINK_PSLITE_TABLE_WIDTH"  # service mode: keys of at most this many values go to a table
ENV_SHARDS = "PSLINK_PSLITE_SHARDS"  # service mode: the tables' shards (default: DMLC_NUM_SERVER, at least 1)
DEFAULT_TABLE_WIDTH = 256
DEFAULT_START_TIMEOUT = 120.0

# Which variables each role cannot start without (ps-lite aborts on any of them missing).
REQUIRED = ("DMLC_ROLE", "DMLC_PS_ROOT_URI", "DMLC_PS_ROOT_PORT", "DMLC_NUM_WORKER", "DMLC_NUM_SERVER")


@dataclasses.dataclass(frozen=True)
class Config:
    """Everything a :class:`~pslink.pslite.node.Node` needs to know about its deployment.

    ``root_port`` 0 is allowed for a scheduler built in-process (it binds any free port, and its
    ``Node.scheduler_address`` tells the others); from the environment it must be a real port.
    Heartbeat settings are in seconds, ``resend_timeout`` in milliseconds, as in ps-lite.
    """

    role: str
    root_uri: str
    root_port: int
    num_workers: int
    num_servers: int
    node_host: str | None = None
    interface: str | None = None
    port: int = 0
    verbose: int = 0
    heartbeat_interval: float = 0.0
    heartbeat_timeout: float = 0.0
    resend: bool = False
    resend_timeout: int = 1000
    rank: int | None = None
    mode: str = "classic"
    master: str | None = None
    job: str | None = None
    token: str | None = None
    timeout: float = DEFAULT_TIMEOUT
    start_timeout: float = DEFAULT_START_TIMEOUT
    table_width: int = DEFAULT_TABLE_WIDTH
    shards: int | None = None

    def __post_init__(self):
        if self.role not in ROLES:
            raise ConfigError(f"DMLC_ROLE={self.role!r} is not a role: use worker, server or scheduler")
        if not isinstance(self.root_uri, str) or not self.root_uri:
            raise ConfigError("DMLC_PS_ROOT_URI must name the scheduler's host")
        _check_int("DMLC_PS_ROOT_PORT", self.root_port, 0, 65535)
        _check_int("DMLC_NUM_WORKER", self.num_workers, 1, 1 << 20)
        _check_int("DMLC_NUM_SERVER", self.num_servers, 0, 1 << 20)
        _check_int("PORT", self.port, 0, 65535)
        if self.mode not in MODES:
            raise ConfigError(f"{ENV_MODE}={self.mode!r} is not a server mode: use classic or service")
        if self.rank is not None:
            count = {"worker": self.num_workers, "server": self.num_servers, "scheduler": 1}[self.role]
            if not isinstance(self.rank, int) or not 0 <= self.rank < count:
                raise ConfigError(f"{ENV_RANK}={self.rank!r} is out of range for {count} {self.role}(s)")
        if self.mode == "service" and self.role == "worker":
            missing = [name for name, value in ((ENV_MASTER, self.master), (ENV_JOB, self.job)) if not value]
            if missing:
                raise ConfigError(
                    f"{ENV_MODE}=service: a worker needs {' and '.join(missing)} (the parameter service's "
                    "pMaster address and the job name; `pslink launch --pslite --server-mode service` sets them)"
                )
        for name, value in (("PS_HEARTBEAT_INTERVAL", self.heartbeat_interval),
                            ("PS_HEARTBEAT_TIMEOUT", self.heartbeat_timeout)):
            if not isinstance(value, (int, float)) or value < 0:
                raise ConfigError(f"{name} must be a non-negative number of seconds, got {value!r}")
        _check_int("PS_RESEND_TIMEOUT", self.resend_timeout, 1, 1 << 31)
        if not self.timeout > 0 or not self.start_timeout > 0:
            raise ConfigError("timeouts must be positive numbers of seconds")

    @property
    def scheduler_address(self) -> str:
        return f"tcp://{_bracket(self.root_uri)}:{self.root_port}"

    @property
    def expected_servers(self) -> int:
        """Server processes that register with the scheduler (none in service mode)."""
        return 0 if self.mode == "service" else self.num_servers

    def listen_address(self) -> str:
        """Where this node binds: the scheduler on the root address, others on their host."""
        if self.role == "scheduler":
            return f"tcp://{_bind_host(self.root_uri)}:{self.root_port}"
        return f"tcp://{_bind_host(self.advertised_host())}:{self.port}"

    def advertised_host(self) -> str:
        """The host other nodes dial: DMLC_NODE_HOST, else DMLC_INTERFACE's address, else the
        local address that routes to the scheduler (127.0.0.1 when the scheduler is local)."""
        if self.role == "scheduler":
            return self.root_uri
        if self.node_host:
            return self.node_host
        if self.interface:
            return interface_address(self.interface)
        return route_to(self.root_uri, self.root_port or 1)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides) -> "Config":
        """Read ps-lite's variables (and pslink's few additions) from ``environ``."""
        env = os.environ if environ is None else environ
        role = _get(env, "DMLC_ROLE")
        missing = [name for name in REQUIRED if _get(env, name) is None]
        if missing:
            who = f"DMLC_ROLE={role}" if role else "a ps-lite node"
            raise ConfigError(
                f"{who} cannot start: {', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not set "
                "(ps-lite's launcher, or `pslink launch --pslite`, sets them)"
            )
        if role not in ROLES:
            raise ConfigError(f"DMLC_ROLE={role!r} is not a role: use worker, server or scheduler")
        verbose = _int(env, "PS_VERBOSE", 0, minimum=0)
        interface = _get(env, "DMLC_INTERFACE")
        if interface is not None:
            interface_address(interface)  # fail now, naming the variable, not at bind time
        values = dict(
            role=role,
            root_uri=_get(env, "DMLC_PS_ROOT_URI"),
            root_port=_int(env, "DMLC_PS_ROOT_PORT", None, minimum=1, maximum=65535),
            num_workers=_int(env, "DMLC_NUM_WORKER", None, minimum=1),
            num_servers=_int(env, "DMLC_NUM_SERVER", None, minimum=0),
            node_host=_get(env, "DMLC_NODE_HOST"),
            interface=interface,
            port=_int(env, "PORT", 0, minimum=0, maximum=65535),
            verbose=min(verbose, 2),
            heartbeat_interval=_float(env, "PS_HEARTBEAT_INTERVAL", 0.0),
            heartbeat_timeout=_float(env, "PS_HEARTBEAT_TIMEOUT", 0.0),
            resend=_int(env, "PS_RESEND", 0, minimum=0, maximum=1) == 1,
            resend_timeout=_int(env, "PS_RESEND_TIMEOUT", 1000, minimum=1),
            rank=_int(env, ENV_RANK, None, minimum=0),
            mode=(_get(env, ENV_MODE) or "classic").lower(),
            master=_get(env, ENV_MASTER),
            job=_get(env, ENV_JOB),
            token=_get(env, ENV_TOKEN),
            timeout=_float(env, ENV_TIMEOUT, DEFAULT_TIMEOUT, positive=True),
            start_timeout=_float(env, ENV_START_TIMEOUT, DEFAULT_START_TIMEOUT, positive=True),
            table_width=_int(env, ENV_TABLE_WIDTH, DEFAULT_TABLE_WIDTH, minimum=0),
            shards=_int(env, ENV_SHARDS, None, minimum=1, maximum=4096),
        )
        values.update(overrides)
        return cls(**values)


def _get(env: Mapping[str, str], name: str) -> str | None:
    value = env.get(name)
    return value.strip() if value is not None and value.strip() != "" else None


def _int(env, name: str, default, minimum: int, maximum: int | None = None):
    raw = _get(env, name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not an integer") from None
    if value < minimum or (maximum is not None and value > maximum):
        bound = f"between {minimum} and {maximum}" if maximum is not None else f">= {minimum}"
        raise ConfigError(f"{name}={raw!r} must be {bound}")
    return value


def _float(env, name: str, default: float, positive: bool = False) -> float:
    raw = _get(env, name)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not a number") from None
    if value < 0 or (positive and value == 0) or value != value:
        raise ConfigError(f"{name}={raw!r} must be a {'positive' if positive else 'non-negative'} number")
    return value


def _check_int(name: str, value, minimum: int, maximum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= maximum:
        raise ConfigError(f"{name} must be an integer between {minimum} and {maximum}, got {value!r}")


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def _bind_host(host: str) -> str:
    """Bind to the host itself when it is an address; to every interface for a host name."""
    try:
        ipaddress.ip_address(host.strip("[]"))
        return _bracket(host)
    except ValueError:
        return "0.0.0.0" if host not in ("localhost",) else "127.0.0.1"


def interface_address(name: str) -> str:
    """The IPv4 address of a network interface (``DMLC_INTERFACE``)."""
    import psutil

    interfaces = psutil.net_if_addrs()
    if name not in interfaces:
        raise ConfigError(
            f"DMLC_INTERFACE={name!r}: no such network interface; this host has {', '.join(sorted(interfaces))}"
        )
    for entry in interfaces[name]:
        if entry.family == socket.AF_INET:
            return entry.address
    raise ConfigError(f"DMLC_INTERFACE={name!r} has no IPv4 address")


def route_to(host: str, port: int) -> str:
    """The local address this host uses to reach ``host`` (no packet is sent)."""
    try:
        target = socket.gethostbyname(host)
    except OSError:
        raise ConfigError(f"DMLC_PS_ROOT_URI={host!r} does not resolve") from None
    if target.startswith("127."):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((target, port))
            return probe.getsockname()[0]
        except OSError:
            return "127.0.0.1"
