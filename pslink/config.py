"""Settings that come from the environment (what ``pslink launch`` and ``pslink demo`` set).

Every value can also be passed as an argument; the argument wins. A missing or malformed value
raises :class:`~pslink.errors.ConfigError` naming both the argument and the variable.
"""

from __future__ import annotations

import os

from pslink.errors import ConfigError

ENV_JOB = "PSLINK_JOB"
ENV_RANK = "PSLINK_RANK"
ENV_NUM_WORKERS = "PSLINK_NUM_WORKERS"
ENV_MAX_WORKERS = "PSLINK_MAX_WORKERS"
ENV_MASTER = "PSLINK_MASTER"
ENV_TOKEN = "PSLINK_TOKEN"
ENV_TIMEOUT = "PSLINK_TIMEOUT"
ENV_PARTITION_BYTES = "PSLINK_PARTITION_BYTES"

DEFAULT_MASTER = "tcp://127.0.0.1:7770"
DEFAULT_TIMEOUT = 300.0


def _env(name: str, environ) -> str | None:
    value = environ.get(name)
    return value if value not in (None, "") else None


def resolve_str(value: str | None, argument: str, variable: str, default: str | None = None, environ=os.environ) -> str:
    if value is None:
        value = _env(variable, environ) or default
    if value is None:
        raise ConfigError(f"{argument} is not set: pass {argument}= or set {variable}")
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{argument} must be a non-empty string, got {value!r}")
    return value


def resolve_int(value: int | None, argument: str, variable: str, minimum: int, environ=os.environ) -> int:
    source = f"{argument}="
    if value is None:
        raw = _env(variable, environ)
        if raw is None:
            raise ConfigError(f"{argument} is not set: pass {argument}= or set {variable}")
        source = variable
        try:
            value = int(raw)
        except ValueError:
            raise ConfigError(f"{variable}={raw!r} is not an integer") from None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{source} must be an integer >= {minimum}, got {value!r}")
    return value


def resolve_float(value: float | None, argument: str, variable: str, default: float, environ=os.environ) -> float:
    if value is None:
        raw = _env(variable, environ)
        if raw is None:
            return default
        try:
            value = float(raw)
        except ValueError:
            raise ConfigError(f"{variable}={raw!r} is not a number") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ConfigError(f"{argument} must be a positive number of seconds, got {value!r}")
    return float(value)


def resolve_token(value: bytes | str | None, environ=os.environ) -> bytes | None:
    """A job token as bytes; the environment carries it as hex."""
    if value is None:
        value = _env(ENV_TOKEN, environ)
        if value is None:
            return None
    if isinstance(value, bytes):
        return value
    try:
        return bytes.fromhex(value)
    except ValueError:
        raise ConfigError(f"{ENV_TOKEN} must be the job token in hex, got {value[:12]!r}...") from None
